#!/usr/bin/env python3
"""Retrieval on a pretrained model through kvcache (pretrained.py), one request
a sample through the PyTorch engine: the first part of the fidelity study on
real models (issue 63; scripts/eval keeps the tiny model as its default).

Passkey retrieval, as NVIDIA's kvpress and the papers run it: a raw completion
prompt (no chat template) of KJV filler (the held-out text the tiny model
ships, whole lines from random places), "The pass key is 48213. Remember it.
48213 is the pass key." at a depth of 10, 30, 50, 70 or 90 % of the filler,
and at the end "What is the pass key? The pass key is". Greedy; correct when
the output's first digits are the key. The prompt's length counts the
model's tokens. A policy's budget is a fraction of the prompt; every policy
evicts as the engine runs it (after each prefill chunk of 64; SnapKV once
after the prompt, its 32-query observation window holding the question, as
its paper runs it).

Results go to a CSV, one line a sample, and a rerun skips what is there, so
a long study can run in parts:

  python3 examples/python/eval_pretrained.py --model smollm2 --lengths 1024 2048 --samples 4 \\
      --rows full h2o:0.25 tova:0.25 snapkv:0.25 --out build/eval/smollm2.csv
"""
import argparse
import csv
import math
import pathlib
import random
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import engine as eng  # noqa: E402
import model as mdl  # noqa: E402
import pretrained  # noqa: E402

import kvcache as kv  # noqa: E402

DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
FIELDS = ["row", "task", "length", "depth", "sample", "correct", "prompt_tokens", "peak_kv", "output", "seconds"]


class Filler:
    """Whole lines of the held-out KJV text, in the model's tokens."""

    def __init__(self, tok):
        text = (mdl.MODEL_DIR / "heldout.bin").read_bytes().decode("latin-1")
        self.lines = [tok.encode(line + "\n", bos=False) for line in text.split("\n") if line.strip()]

    def take(self, rng, n):
        """Exactly n tokens: whole lines from a random place (the last one cut)."""
        out, at = [], rng.randrange(len(self.lines))
        while len(out) < n:
            out += self.lines[at % len(self.lines)]
            at += 1
        return out[:n]


# The passkey test's own opening (Mohtashami and Jaggi, 2023), as long-context evaluations run it.
PREAMBLE = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
            "I will quiz you about the important information there.\n\n")


def passkey(tok, filler, rng, length, depth):
    """(prompt tokens, answer) of `length` tokens with the needle at `depth` of the filler."""
    key = str(rng.randrange(10000, 100000))
    needle = tok.encode(f"The pass key is {key}. Remember it. {key} is the pass key.\n", bos=False)
    question = tok.encode("\nWhat is the pass key? The pass key is", bos=False)
    head = ([tok.bos] if tok.bos is not None else []) + tok.encode(PREAMBLE, bos=False)
    room = length - len(head) - len(needle) - len(question)
    before = int(room * depth)
    body = filler.take(rng, room)
    return head + body[:before] + needle + body[before:] + question, key


def parse_row(text):
    """'full'; 'NAME:FRACTION' (a policy at a fraction of the prompt); 'format=NAME'; 'layer_groups' (a
    hybrid model's window layers in sliding-window groups); 'once' (the policy evicts once, after the
    whole prompt, from the last chunk's attention: kvpress's protocol; by default it evicts after every
    chunk, and the prompt never holds more than the budget and a chunk); or parts of these joined by commas."""
    name, frac, fmt, groups, once = "keep_all", 1.0, "f32", False, False
    for part in text.split(","):
        if part.startswith("format="):
            fmt = part.split("=", 1)[1]
        elif part == "layer_groups":
            groups = True
        elif part == "once":
            once = True
        elif part != "full":
            name, f = part.split(":")
            frac = float(f)
    return name, frac, fmt, groups, once


def run_sample(m, tok, row, prompt, answer, chunk=64):
    name, frac, fmt, groups, once = parse_row(row)
    n = len(prompt)
    window = max(m.window(layer) for layer in range(m.c["layers"])) if groups else 0
    cfg = eng.EngineConfig(max_kv_tokens=n + 64, chunk=chunk, max_batch=1, kv_format=fmt, window=window)
    budget = max(96, int(n * frac))
    policy, cfg = eng.policy_by_name(name, budget, m.c, cfg)
    if once:
        cfg.evict_in_prefill = False
    e = eng.Engine(m, cfg, policy)
    r = eng.Request(id=0, prompt=prompt, max_new=len(tok.encode(" " + answer, bos=False)) + 1)
    e.run([r])
    out = tok.decode(r.output)
    digits = "".join(ch for ch in out.strip().split(".")[0] if ch.isdigit())
    return digits == answer, r.peak_kv, out


def wilson(k, n, z=1.96):
    if n == 0:
        return 0.0, 1.0
    p = k / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, mid - half), min(1.0, mid + half)


def table(path, lengths):
    rows = {}
    with open(path) as f:
        for s in csv.DictReader(f):
            rows.setdefault(s["row"], []).append(s)
    depths = "/".join(f"{d:.0%}" for d in DEPTHS)
    print(f"| row | {' | '.join(f'passkey at {n}' for n in lengths)} | by depth {depths}, all lengths |")
    print("| --- |" + " ---: |" * len(lengths) + " --- |")
    for row, samples in rows.items():
        cells = []
        for n in lengths:
            got = [int(s["correct"]) for s in samples if int(s["length"]) == n]
            lo, hi = wilson(sum(got), len(got))
            cells.append(f"{sum(got)}/{len(got)} [{lo:.2f}, {hi:.2f}]")
        depth = [[int(s["correct"]) for s in samples if float(s["depth"]) == d] for d in DEPTHS]
        print(f"| {row} | {' | '.join(cells)} | {' / '.join(f'{sum(d)}/{len(d)}' for d in depth)} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", choices=list(pretrained.MODELS))
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--samples", type=int, default=4, help="per length and depth")
    ap.add_argument("--rows", nargs="+", default=["full"])
    ap.add_argument("--out", type=pathlib.Path, required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)  # OpenBLAS threads the products
    m, tok = pretrained.load(a.model)
    filler = Filler(tok)
    done = set()
    if a.out.exists():
        with open(a.out) as f:
            done = {(s["row"], s["task"], s["length"], s["depth"], s["sample"]) for s in csv.DictReader(f)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    new = not a.out.exists()
    with open(a.out, "a", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        if new:
            w.writeheader()
        for length in a.lengths:
            for depth in DEPTHS:
                for i in range(a.samples):
                    rng = random.Random(f"passkey {length} {depth} {i}")  # the same prompt for every row
                    prompt, key = passkey(tok, filler, rng, length, depth)
                    for row in a.rows:
                        if (row, "passkey", str(length), str(depth), str(i)) in done:
                            continue
                        t0 = time.perf_counter()
                        ok, peak, out = run_sample(m, tok, row, prompt, key)
                        w.writerow(dict(row=row, task="passkey", length=length, depth=depth, sample=i, correct=int(ok),
                                        prompt_tokens=len(prompt), peak_kv=peak, output=out,
                                        seconds=f"{time.perf_counter() - t0:.1f}"))
                        f.flush()
                        print(f"{row} passkey {length} depth {depth} #{i}: {'ok' if ok else 'MISS'} {out!r} "
                              f"({time.perf_counter() - t0:.1f} s)", flush=True)
    table(a.out, a.lengths)


if __name__ == "__main__":
    main()
