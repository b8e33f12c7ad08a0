"""Long-range tasks mixed into the example model's training text, and the
formats the engine's evaluation (examples/engine/tasks.hpp) reproduces.

Every sample is bytes of KJV filler (whole verse lines) with a fact placed
far before the end, where the model must use it:

  passkey  "The pass key is 48213. Remember it. 48213 is the pass key.\\n" at a
           chosen depth; at the end "What is the pass key? The pass key is "
           and the answer "48213.\\n" (5-8 digits).
  recall   3-6 lines "Boaz's number is 4821.\\n" spread through the filler; at
           the end "What is Boaz's number? Boaz's number is " and the answer
           "4821.\\n" for one of them.
  repeat   a 128-byte passage, 300-900 bytes of filler, then the passage again:
           the answer is its last 96 bytes, continued from its first 32.

Each generator returns (bytes, answer_start, answer_end): the answer span is
what the evaluation scores (exact greedy match, or continuation loss).
"""
import random

NAMES = ["Aaron", "Abigail", "Boaz", "Caleb", "Deborah", "Eli", "Esther", "Gideon", "Hannah", "Isaac", "Jael",
         "Jonah", "Leah", "Micah", "Miriam", "Naomi", "Obed", "Phinehas", "Rahab", "Ruth", "Samson", "Tamar",
         "Uriah", "Zillah"]


def needle(key):
    return f"The pass key is {key}. Remember it. {key} is the pass key.\n".encode()


def passkey_question():
    return b"What is the pass key? The pass key is "


def pair_line(name, value):
    return f"{name}'s number is {value}.\n".encode()


def recall_question(name):
    return f"What is {name}'s number? {name}'s number is ".encode()


class Filler:
    """Whole lines of text, from random places of a byte string."""

    def __init__(self, text):
        self.text = text
        self.starts = [0] + [i + 1 for i, c in enumerate(text) if c == 10 and i + 1 < len(text)]

    def take(self, rng, n):
        """About n bytes (at most n) of whole lines; may be shorter than n."""
        out = bytearray()
        while len(out) < n:
            s = self.starts[rng.randrange(len(self.starts))]
            end = self.text.find(b"\n", s)
            line = self.text[s:end + 1] if end >= 0 else self.text[s:] + b"\n"
            if len(out) + len(line) > n:
                if not out:  # one line longer than n: cut it at n - 1 and end the line
                    out += line[:n - 1] + b"\n"
                break
            out += line
        return bytes(out)

    def exact(self, rng, n):
        """Exactly n bytes of lines (the last line cut and ended)."""
        out = self.take(rng, n)
        while len(out) < n:
            more = self.take(rng, n - len(out))
            if not more:
                break
            out += more
        if len(out) < n:
            out += b" " * (n - len(out))
        return out


def passkey(rng, filler, length, depth=None, digits=None):
    """Key at `depth` (fraction of the filler before it), answer at the end."""
    digits = digits or rng.randint(5, 8)
    key = str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))
    nd, q, ans = needle(key), passkey_question(), f"{key}.\n".encode()
    room = length - len(nd) - len(q) - len(ans)
    depth = rng.random() if depth is None else depth
    before = filler.exact(rng, int(room * depth))
    after = filler.exact(rng, room - len(before))
    body = before + nd + after + q
    return body + ans, len(body), len(body) + len(ans)


def recall(rng, filler, length, pairs=None):
    pairs = pairs or rng.randint(3, 6)
    names = rng.sample(NAMES, pairs)
    values = [str(rng.randint(1000, 9999)) for _ in names]
    asked = rng.randrange(pairs)
    lines = [pair_line(n, v) for n, v in zip(names, values)]
    q, ans = recall_question(names[asked]), f"{values[asked]}.\n".encode()
    room = length - sum(len(x) for x in lines) - len(q) - len(ans)
    # The pairs sit in the first three quarters, so the asked one is far back.
    cuts = sorted(rng.randrange(0, room * 3 // 4 + 1) for _ in lines)
    parts, at = [], 0
    for cut, line in zip(cuts, lines):
        parts += [filler.exact(rng, cut - at), line]
        at = cut
    parts.append(filler.exact(rng, room - at))
    body = b"".join(parts) + q
    return body + ans, len(body), len(body) + len(ans)


def repeat(rng, filler, length, gap=None, passage=128, prefix=32):
    """A passage, `gap` bytes of filler, the passage again; the answer is its
    part after `prefix`. The sample ends with the second copy. Contexts
    shorter than 512 bytes (the training curriculum's first stage) get a
    quarter-length passage and a shorter gap."""
    passage = min(passage, length // 4)
    prefix = min(prefix, passage // 4)
    room = length - 2 * passage
    p = filler.exact(rng, passage)
    gap = gap or rng.randint(min(300, room // 2), min(900, room))
    lead = filler.exact(rng, room - gap)
    body = lead + p + filler.exact(rng, gap) + p[:prefix]
    return body + p[prefix:], len(body), len(body) + passage - prefix


KINDS = ("text", "passkey", "recall", "repeat")


def sample(rng, filler, length, mix=(1, 1, 1, 1)):
    """One training sequence of `length` bytes from the mixture: `mix` weighs
    the KINDS. Returns (bytes, answer spans)."""
    kind = KINDS[rng.choices(range(len(KINDS)), weights=mix)[0]]
    if kind == "text":
        return filler.exact(rng, length), []
    if kind == "passkey":
        s, a, b = passkey(rng, filler, length)
    elif kind == "recall":
        s, a, b = recall(rng, filler, length)
    else:
        s, a, b = repeat(rng, filler, length)
    return s, [(a, b)]
