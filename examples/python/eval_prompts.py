"""The prompts and the text of the pretrained-model evaluation (eval_pretrained.py).

Retrieval prompts are raw completions (no chat template), as NVIDIA's kvpress
and the passkey papers run them: filler from the King James Bible (Debian's
`bible-kjv`, verse references dropped), whole lines from a random place, a
needle between two lines at a given depth, and a question at the end.

- passkey: "The pass key is 48213. Remember it. 48213 is the pass key."; the
  question "What is the pass key? The pass key is"; correct when the answer's
  first digits are the key.
- passkey_grass: the passkey in the passkey test's own filler, one line
  repeated (the KJV defeats SmolLM2 at 4,096 tokens).
- two_keys: two doors, each with its own five-digit key, one needle at the
  depth asked and the other elsewhere; the question names one door. A wrong
  door's key is as wrong as no key, so it ranks what a policy keeps more
  finely than one needle.

Perplexity runs on Python's own documentation: the Language Reference topics
that ship in every CPython (`pydoc_data/topics.py`), technical English the
models have read about as often as any web text, and not a license, which
they have by heart.
"""
import random
import re
import shutil
import subprocess

KJV_RANGE = "Ge1:1-Re22:21"  # the whole Bible, one verse a line
# The passkey test's own opening (Mohtashami and Jaggi, 2023), as long-context evaluations run it.
PREAMBLE = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
            "I will quiz you about the important information there.\n\n")
DOORS = ("red", "blue", "green", "white", "black", "yellow")


class MissingCorpus(RuntimeError):
    """The filler's package is not installed."""


def kjv_lines():
    """The King James Bible from Debian's bible-kjv, one verse a line, references dropped."""
    if shutil.which("bible") is None:
        raise MissingCorpus("the filler is Debian's bible-kjv: apt-get install bible-kjv (scripts/eval installs it)")
    text = subprocess.run(["bible", "-f", KJV_RANGE], check=True, capture_output=True, text=True).stdout
    return [re.sub(r"^\S+?\d+:\d+ ", "", line) for line in text.split("\n") if line.strip()]


class Filler:
    """Whole lines of filler in the model's tokens."""

    def __init__(self, tok, lines=None):
        self.lines = [tok.encode(line + "\n", bos=False) for line in (lines if lines is not None else kjv_lines())]

    def take(self, rng, n):
        """n tokens of whole lines from a random place (the last one cut), and where each line starts."""
        out, starts, at = [], [], rng.randrange(len(self.lines))
        while len(out) < n:
            starts.append(len(out))
            out += self.lines[at % len(self.lines)]
            at += 1
        return out[:n], [s for s in starts if s <= n]


def _line_start(starts, at):
    """The line start nearest `at`: needles go between lines."""
    return min(starts, key=lambda s: abs(s - at))


def _assemble(tok, filler, rng, length, needles, question):
    """A prompt of exactly `length` tokens: needles [(depth, tokens)] in the filler, then the question."""
    head = ([tok.bos] if tok.bos is not None else []) + (tok.encode(PREAMBLE, bos=False) if PREAMBLE else [])
    room = length - len(head) - sum(len(t) for _, t in needles) - len(question)
    body, starts = filler.take(rng, room)
    cuts = sorted((_line_start(starts, int(room * d)), i) for i, (d, _) in enumerate(needles))
    out, at = list(head), 0
    for cut, i in cuts:
        out += body[at:cut] + needles[i][1]
        at = cut
    return out + body[at:] + question


def passkey(tok, filler, rng, length, depth):
    """(prompt of `length` tokens, answer): the needle at `depth` of the filler."""
    key = str(rng.randrange(10000, 100000))
    needle = tok.encode(f"The pass key is {key}. Remember it. {key} is the pass key.\n", bos=False)
    question = tok.encode("\nWhat is the pass key? The pass key is", bos=False)
    return _assemble(tok, filler, rng, length, [(depth, needle)], question), key


def two_keys(tok, filler, rng, length, depth):
    """(prompt, answer): the asked door's key at `depth`, another door's at least a fifth of the filler away."""
    asked, other = rng.sample(DOORS, 2)
    keys = rng.sample(range(10000, 100000), 2)
    elsewhere = rng.choice([d for d in (0.1, 0.3, 0.5, 0.7, 0.9) if abs(d - depth) >= 0.2])

    def needle(door, key):
        return tok.encode(f"The pass key of the {door} door is {key}. Remember it.\n", bos=False)

    question = tok.encode(f"\nWhat is the pass key of the {asked} door? The pass key of the {asked} door is",
                          bos=False)
    needles = [(depth, needle(asked, keys[0])), (elsewhere, needle(other, keys[1]))]
    return _assemble(tok, filler, rng, length, needles, question), str(keys[0])


# The passkey test's own filler (Mohtashami and Jaggi), one line again and again: at 4,096 tokens SmolLM2
# finds the key in it, where the KJV's 4,096 tokens defeat it even with the full cache.
GRASS = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


def grass_lines():
    return [GRASS]


# Each task: (prompt maker, filler lines).
TASKS = {"passkey": (passkey, kjv_lines), "two_keys": (two_keys, kjv_lines), "passkey_grass": (passkey, grass_lines)}


def answer_tokens(tok, answer):
    """Tokens to decode for an answer: its own (after a space) and one more, which shows where its digits end."""
    return len(tok.encode(" " + answer, bos=False)) + 1


def verdict(output, answer):
    """Whether the output's first digits are the answer: True, False, or None
    while the digits so far could still become it (decoding may stop at a verdict)."""
    text = output.lstrip()
    lead = len(text) - len(text.lstrip("0123456789"))
    if not answer.startswith(text[:lead]):
        return False
    return text[:lead] == answer if lead < len(text) else None


def answered(output, answer):
    """The output, all decoded, opens with exactly the answer's digits."""
    got = verdict(output, answer)
    if got is None:
        text = output.lstrip()
        return text == answer
    return got


def topics_text():
    """Python's Language Reference topics (pydoc_data), in a fixed order."""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k].strip() for k in sorted(topics))


def text_windows(tok, length, count):
    """`count` windows of `length` tokens of topics_text(), one after another."""
    ids = tok.encode(topics_text(), bos=False)
    if len(ids) < length * count:
        raise ValueError(f"windows: {count} of {length} tokens need {length * count}, the text has {len(ids)}")
    return [ids[i * length:(i + 1) * length] for i in range(count)]


def sample_rng(task, length, depth, i):
    """The same prompt for every row (and every rerun)."""
    return random.Random(f"{task} {length} {depth} {i}")
