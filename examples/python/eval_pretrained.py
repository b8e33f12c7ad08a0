#!/usr/bin/env python3
"""The fidelity study on a pretrained model through kvcache (pretrained.py):
each sample one request through the PyTorch engine, every row a way of
holding its KV (scripts/eval --model runs it; the tiny model stays the
default there).

Tasks (eval_prompts.py): passkey, passkey_grass and two_keys, retrieval at a
length and a depth, and ppl, perplexity and greedy agreement with the full cache over
windows of Python's Language Reference.

Rows: `full`; `dense`, the dense reference (no cache at all: one pass over
the whole sequence a token); `NAME:FRACTION`, an eviction policy holding that fraction of
the prompt (engine.policy_by_name); `quest:FRACTION`, Quest selection, each
decoded query reading that fraction of the prompt; `format=NAME`, a KV
format; `layer_groups`, a hybrid model's window layers in sliding-window
groups; parts joined by commas (`tova:0.25,format=int8`).

Protocols. Retrieval compresses the prompt once, after the last chunk (the
question inside it), from the attention of the whole prompt (H2O, average
attention, block scores: every query's; TOVA: the last query's; SnapKV: its
32-query window's), as kvpress and the policies' papers run a prompt; add
`stream` to a row to evict after every chunk of 64 instead, the engine's
bounded-memory default. Perplexity always streams (a policy that compresses
once, SnapKV, or that selects for decoding, Quest, changes nothing there and
has no ppl row).

Every eviction row of a retrieval sample shares one prefill: no row evicts
before the prompt's last chunk, so the chunks before it hold the same K/V and
the same attention under every policy (f32). The first row computes them and
the others replay them through the engine's own writes and observations
(SharedPrefill, checked against a computed row in test_pretrained).

Results go to a CSV, one line a sample and row; a rerun skips what is there:

  python3 examples/python/eval_pretrained.py --model smollm2 --task passkey --lengths 1024 2048 \\
      --samples 3 --rows full tova:0.25 snapkv:0.25 --out build/eval/smollm2.csv
"""
import argparse
import contextlib
import csv
import math
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import engine as eng  # noqa: E402
import eval_prompts as prompts  # noqa: E402
import model as mdl  # noqa: E402
import pretrained  # noqa: E402
from model import Forward, Trace  # noqa: E402

DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
FIELDS = ["row", "task", "length", "depth", "sample", "correct", "nll", "agree", "tokens", "prompt_tokens",
          "peak_kv", "output", "seconds"]
CHUNK = 64
_SCALES = {}  # (model, format) -> the calibrated format's (k, v) scales
POLICIES = ("sliding_window", "sink_window", "h2o", "tova", "snapkv", "average_attention", "block_scores")
FRACTIONS = (0.125, 0.25, 0.5)
FORMATS = ("f16", "fp8_e4m3_head", "int8_g32", "int4_g32_min", "fp4_g16", "int2_kivi")
EVICTION = ["full"] + [f"{p}:{f}" for p in POLICIES for f in FRACTIONS] + [f"quest:{f}" for f in FRACTIONS]
BEST = "tova:0.25"  # the best policy at a quarter of the prompt on passkey (measured first): the combined rows'
COMBINED = [f"{BEST},format={f}" for f in ("int8_g32", "int4_g32_min", "int2_kivi")]
# Gemma 3: its layers whole, in groups, and Quest or a block eviction policy on the global (full) group.
GEMMA3 = ["full", "layer_groups", "layer_groups,quest:0.25", "layer_groups,quest:0.125",
          "layer_groups,sink_window:0.25", "layer_groups,sink_window:0.5",
          "layer_groups,block_scores:0.25", "layer_groups,block_scores:0.5"]
# The studies scripts/eval --model runs, part by part (task, lengths, samples, rows); each part's CSV resumes.
STUDIES = {
    "smollm2": [
        ("passkey", [1024, 2048], 3, EVICTION),
        ("two_keys", [1024, 2048], 3, EVICTION),
        ("passkey", [4096], 1, EVICTION),
        ("ppl", [2048], 1, EVICTION + [f"format={f}" for f in FORMATS] + COMBINED),
        ("passkey", [1024], 2, [f"format={f}" for f in FORMATS] + COMBINED),
        ("passkey", [1024], 1, ["dense"]),  # the full rows' ceiling, from the reference itself
        ("passkey_grass", [4096], 2, EVICTION),
    ],
    "gemma3": [
        ("passkey", [256, 1024], 2, GEMMA3),
        ("passkey", [4096], 1, GEMMA3),
    ],
}


def parse_row(text):
    """The row's parts: (policy, fraction, quest, format, layer_groups, stream)."""
    name, frac, quest, fmt, groups, stream = "keep_all", 1.0, False, "f32", False, False
    for part in text.split(","):
        if part.startswith("format="):
            fmt = part.split("=", 1)[1]
        elif part == "layer_groups":
            groups = True
        elif part == "stream":
            stream = True
        elif part != "full":
            name, f = part.split(":")
            frac = float(f)
            if not 0 < frac <= 1:
                raise ValueError(f"row '{text}': fraction {f} not in (0, 1]")
            if name == "quest":
                name, quest = "keep_all", True
    return name, frac, quest, fmt, groups, stream


def make_engine(m, row, n, task, keep_logits=False):
    """The engine for one request of `n` tokens under `row`, and whether its prefill may be shared."""
    name, frac, quest, fmt, groups, stream = parse_row(row)
    window = max(m.window(layer) for layer in range(m.c["layers"])) if groups else 0
    cfg = eng.EngineConfig(max_kv_tokens=n + 64, chunk=CHUNK, max_batch=1, kv_format=fmt, window=window,
                           keep_logits=keep_logits)
    if eng.KV_FORMATS[fmt][2]:  # a calibrated format: one calibration a model (a forward pass over its window)
        key = (id(m), fmt)
        if key not in _SCALES:
            _SCALES[key] = eng.calibrate_kv_scales(m, eng.calibration_window(m), eng.KV_FORMATS[fmt][0])
        cfg.kv_scales = _SCALES[key]
    budget = max(96, int(n * frac))
    policy, cfg = eng.policy_by_name(name, budget, m.c, cfg)
    if quest:
        cfg.quest_budget = budget
    once = task != "ppl" and not stream and not groups
    if once:
        cfg.evict_in_prefill, cfg.observe_prefill = False, True
    return eng.Engine(m, cfg, policy), once and fmt == "f32"


class SharedPrefill:
    """The engine's forward for the rows of one prompt: the first run
    computes each chunk before the prompt's last and records its K/V and
    attention; later runs write and observe the recorded ones through the
    engine's own store (a chunk of another size is computed)."""

    def __init__(self, model, prompt_len):
        self.fwd = Forward(model)
        self.end = prompt_len
        self.chunks = {}  # (first position, tokens) -> (K, V per layer, trace)
        self.replayed = 0

    def run(self, store, tokens, first_pos, last_only, trace=None, observe_last=0):
        n = len(tokens)
        if first_pos + n >= self.end:  # the last chunk: every row computes it (and evicts after it)
            return self.fwd.run(store, tokens, first_pos, last_only, trace, observe_last)
        held = store.e.cache.tokens_held(store.r.seqs[0])
        if held != first_pos + n:
            raise RuntimeError(f"shared prefill: the row holds {held} tokens, not {first_pos + n} (it evicted)")
        got = self.chunks.get((first_pos, n))
        if got is None:
            rec = _Recorder(store)
            t = Trace()
            out = self.fwd.run(rec, tokens, first_pos, last_only, t, 0)
            self.chunks[(first_pos, n)] = got = (rec.k, rec.v, t)
            if trace is None:
                return out
        else:
            for layer, (k, v) in enumerate(zip(got[0], got[1])):
                store.write(layer, k, v)
            self.replayed += 1
        if trace is not None:
            t = got[2]
            trace.layer_sums = t.layer_sums
            if not trace.ragged:
                trace.head_sums, trace.last_query = t.head_sums, t.last_query
                trace.layer_head_sums, trace.layer_last_query = t.layer_head_sums, t.layer_last_query
        return torch.zeros(1, 1)  # a chunk before the last: the engine reads no logits


class _Recorder:
    """The store, with each layer's written K/V kept."""

    def __init__(self, store):
        self.store, self.k, self.v = store, [], []

    def write(self, layer, k, v):
        self.k.append(k.clone())
        self.v.append(v.clone())
        self.store.write(layer, k, v)

    def __getattr__(self, name):
        return getattr(self.store, name)


@torch.no_grad()
def dense_answer(m, tok, prompt, answer):
    """The dense reference's greedy answer: every token from one pass over
    the whole sequence with no cache at all (model.reference_logits)."""
    out = []
    while len(out) < prompts.answer_tokens(tok, answer):
        out.append(int(torch.argmax(mdl.reference_logits(m, prompt + out)[-1])))
        if prompts.verdict(tok.decode(out), answer) is not None:
            break
    text = tok.decode(out)
    return dict(correct=int(prompts.answered(text, answer)), peak_kv=0, output=text)


def run_retrieval(m, tok, row, prompt, answer, shared):
    if row == "dense":
        return dense_answer(m, tok, prompt, answer)
    e, shareable = make_engine(m, row, len(prompt), "retrieval")
    if shareable and shared is not None:
        e.fwd = shared
    r = eng.Request(id=0, prompt=prompt, max_new=prompts.answer_tokens(tok, answer))
    while not r.done and (not r.output or prompts.verdict(tok.decode(r.output), answer) is None):
        e.step([r])  # until the answer is decided
    out = tok.decode(r.output)
    return dict(correct=int(prompts.answered(out, answer)), peak_kv=r.peak_kv, output=out)


def run_ppl(m, row, text, full_argmax):
    """Mean negative log-likelihood over the window, and agreement with the full cache's greedy token."""
    e, _ = make_engine(m, row, len(text), "ppl", keep_logits=True)
    r = eng.Request(id=0, prompt=text, max_new=1)
    e.run([r])
    logits = torch.cat([lg for _, lg in r.chunk_logits])[:len(text) - 1]
    target = torch.as_tensor(text[1:], dtype=torch.long)
    nll = torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
    greedy = logits.argmax(-1)
    agree = int((greedy == full_argmax).sum()) if full_argmax is not None else len(target)
    return dict(nll=f"{nll:.4f}", agree=agree, tokens=len(target), peak_kv=r.peak_kv), greedy


def wilson(k, n, z=1.96):
    if n == 0:
        return 0.0, 1.0
    p = k / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, mid - half), min(1.0, mid + half)


def _cell(got):
    if not got:
        return "-"
    lo, hi = wilson(sum(got), len(got))
    return f"{sum(got)}/{len(got)} [{lo:.2f}, {hi:.2f}]"


def table(path, task):
    """The task's table from the CSV: retrieval by length, all lengths and by depth; ppl by row."""
    rows, lengths, seen = {}, set(), set()
    with open(path) as f:
        for s in csv.DictReader(f):
            key = (s["row"], s["task"], s["length"], s["depth"], s["sample"])
            if s["task"] == task and key not in seen:  # two runs of one part may both finish a sample
                seen.add(key)
                rows.setdefault(s["row"], []).append(s)
                lengths.add(int(s["length"]))
    lengths = sorted(lengths)
    if task == "ppl":
        full = rows.get("full")
        base = sum(float(s["nll"]) for s in full) / sum(int(s["tokens"]) for s in full) if full else None
        print(f"| row | perplexity ({', '.join(map(str, lengths))} tokens) | ratio to full | greedy agreement |")
        print("| --- | ---: | ---: | ---: |")
        for row, samples in rows.items():
            nll = sum(float(s["nll"]) for s in samples) / sum(int(s["tokens"]) for s in samples)
            agree = sum(int(s["agree"]) for s in samples) / sum(int(s["tokens"]) for s in samples)
            ratio = f"{math.exp(nll - base):.3f}" if base is not None else "-"
            print(f"| {row} | {math.exp(nll):.2f} | {ratio} | {agree:.1%} |")
        return
    depths = "/".join(f"{d:.0%}" for d in DEPTHS)
    print(f"| row | {' | '.join(f'{task} at {n}' for n in lengths)} | all | by depth {depths} | "
          f"peak KV at {lengths[-1]} (tokens a layer) |")
    print("| --- |" + " ---: |" * (len(lengths) + 1) + " --- | ---: |")
    for row, samples in rows.items():
        cells = [_cell([int(s["correct"]) for s in samples if int(s["length"]) == n]) for n in lengths]
        cells.append(_cell([int(s["correct"]) for s in samples]))
        depth = [[int(s["correct"]) for s in samples if float(s["depth"]) == d] for d in DEPTHS]
        peak = [int(s["peak_kv"]) for s in samples if int(s["length"]) == lengths[-1]]
        peak = f"{sum(peak) / len(peak):.0f}" if peak else "-"
        print(f"| {row} | {' | '.join(cells)} | {' / '.join(f'{sum(d)}/{len(d)}' for d in depth)} | {peak} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", choices=list(pretrained.MODELS))
    ap.add_argument("--task", default="passkey", choices=[*prompts.TASKS, "ppl"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--samples", type=int, default=3, help="per length and depth (ppl: windows per length)")
    ap.add_argument("--rows", nargs="+", default=["full"])
    ap.add_argument("--out", type=pathlib.Path, help="the CSV (resumed)")
    ap.add_argument("--study", choices=list(STUDIES), help="run the model's whole study into --out-dir")
    ap.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path("build/eval/pretrained"))
    ap.add_argument("--part", type=int, nargs="+", help="with --study: only these parts (0, 1, ...: two at once "
                    "share 2 cores best with OPENBLAS_NUM_THREADS=1 each)")
    ap.add_argument("--table", action="store_true", help="print the CSV's table and run nothing")
    ap.add_argument("--reverse", action="store_true", help="the depths from the deepest (a second process on the "
                    "same part meets the first in the middle)")
    a = ap.parse_args()
    if a.study:
        return study(a.study, a.out_dir, a.part)
    if a.out is None:
        ap.error("--out (or --study)")
    if a.table:
        return table(a.out, a.task)
    run_part(a)


def study(model, out_dir, parts=None):
    """Every part of the model's study, into out_dir/MODEL_TASK.csv (resumed),
    then each task's table into out_dir/MODEL_TASK.md."""
    for k, (task, lengths, samples, rows) in enumerate(STUDIES[model]):
        if parts is not None and k not in parts:
            continue
        run_part(argparse.Namespace(model=model, task=task, lengths=lengths, samples=samples, rows=rows,
                                    out=out_dir / f"{model}_{task}.csv"))
    for task in dict.fromkeys(t for t, *_ in STUDIES[model]):
        with open(out_dir / f"{model}_{task}.md", "w") as f, contextlib.redirect_stdout(f):
            table(out_dir / f"{model}_{task}.csv", task)


def run_part(a):
    torch.set_num_threads(1)  # OpenBLAS threads the products
    m, tok = pretrained.load(a.model)
    def finished():  # read again before each sample: another process may run the same part
        if not a.out.exists():
            return set()
        with open(a.out) as f:
            return {(s["row"], s["task"], s["length"], s["depth"], s["sample"]) for s in csv.DictReader(f)}

    done = finished()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    new = not a.out.exists()
    with open(a.out, "a", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        if new:
            w.writeheader()

        def emit(row, length, depth, i, prompt_tokens, t0, got):
            got.update(row=row, task=a.task, length=length, depth=depth, sample=i, prompt_tokens=prompt_tokens,
                       seconds=f"{time.perf_counter() - t0:.1f}")
            w.writerow(got)
            f.flush()
            shown = got.get("output", f"nll {got.get('nll')} agree {got.get('agree')}/{got.get('tokens')}")
            print(f"{row} {a.task} {length} {depth} #{i}: {got.get('correct', '')} {shown!r} ({got['seconds']} s)",
                  flush=True)

        if a.task == "ppl":
            skipped = [r for r in a.rows if "snapkv" in r or "quest" in r]
            if skipped:
                print(f"no ppl row for {', '.join(skipped)}: they change nothing while a text streams", flush=True)
            a.rows = [r for r in a.rows if r not in skipped]
            for length in a.lengths:
                for i, text in enumerate(prompts.text_windows(tok, length, a.samples)):
                    todo = [row for row in a.rows if (row, "ppl", str(length), "", str(i)) not in done]
                    if not todo:
                        continue
                    full = None
                    for row in ["full"] + [r for r in todo if r != "full"]:
                        t0 = time.perf_counter()
                        got, greedy = run_ppl(m, row, text, full)
                        if row == "full":
                            full = greedy
                        if row in todo:
                            emit(row, length, "", i, len(text), t0, got)
            return table(a.out, "ppl")
        make, lines = prompts.TASKS[a.task]
        filler = prompts.Filler(tok, lines())
        for length in a.lengths:
            for depth in (DEPTHS[::-1] if getattr(a, "reverse", False) else DEPTHS):
                for i in range(a.samples):
                    done = finished()
                    todo = [row for row in a.rows if (row, a.task, str(length), str(depth), str(i)) not in done]
                    if not todo:
                        continue
                    prompt, answer = make(tok, filler, prompts.sample_rng(a.task, length, depth, i), length, depth)
                    shared = SharedPrefill(m, len(prompt))
                    for row in todo:
                        t0 = time.perf_counter()
                        got = run_retrieval(m, tok, row, prompt, answer, shared)
                        emit(row, length, depth, i, len(prompt), t0, got)
    table(a.out, a.task)


if __name__ == "__main__":
    main()
