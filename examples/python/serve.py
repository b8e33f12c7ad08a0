#!/usr/bin/env python3
"""Serves the held-out text's requests with a named eviction policy through
the PyTorch engine: the Python twin of kvcache_serve (examples/engine/serve.cpp),
with the same flags and the same JSON.

  python3 examples/python/serve.py --policy sliding_window --budget 128 --requests 4 --prompt 160 --new 32

--model smollm2 or gemma3 serves a pretrained model instead (pretrained.py;
scripts/models installs them): the same held-out text, in its tokens.

  python3 examples/python/serve.py --model gemma3 --window 512 --prompt 600 --new 32
"""
import argparse
import json
import pathlib
import sys
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import engine as eng  # noqa: E402
import model as mdl  # noqa: E402


def heldout(tok=None):
    """The held-out KJV text's tokens: its bytes for the tiny model, else tok's."""
    data = (mdl.MODEL_DIR / "heldout.bin").read_bytes()
    return list(data) if tok is None else tok.encode(data.decode("latin-1"), bos=False)


def workload(text, n, prompt, max_new):
    """Requests cut from the held-out text at fixed places, prompts of 4 lengths (serving.hpp's workload)."""
    reqs = []
    for i in range(n):
        length = prompt - 32 * (i % 4)
        at = i * 4001 % (len(text) - length)
        reqs.append(eng.Request(id=i, priority=i % 3, prompt=text[at:at + length], max_new=max_new))
    return reqs


def serve(model, name, budget, cfg, reqs):
    policy, cfg = eng.policy_by_name(name, budget, model.c, cfg)
    e = eng.Engine(model, cfg, policy)
    e.run(reqs)
    return e, reqs


def to_json(e, name, budget, reqs):
    k, v = e.scales if e.scales is not None else ([], [])
    return {"policy": name, "budget": budget, "kv_format": e.cfg.kv_format,
            "kv_scales": {"k": np.asarray(k).flatten().tolist(), "v": np.asarray(v).flatten().tolist()},
            "stats": vars(e.stats),
            "requests": [{"id": r.id, "priority": r.priority, "max_new": r.max_new, "peak_kv": r.peak_kv,
                          "prompt": r.prompt, "output": r.output,
                          "logits": torch.stack(r.logits).flatten().tolist()} for r in reqs]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="keep_all", choices=eng.POLICY_NAMES)
    ap.add_argument("--model", default="tiny", choices=["tiny", "smollm2", "gemma3"],
                    help="the shipped tiny model, or a pretrained one (pretrained.py)")
    for flag, default in (("budget", 256), ("requests", 4), ("prompt", 512), ("new", 128), ("pool", 8192),
                          ("chunk", 64), ("batch", 8), ("block", None)):
        ap.add_argument(f"--{flag}", type=int, default=default)
    ap.add_argument("--optimistic", action="store_true")
    ap.add_argument("--window", type=int, default=0, help="the hybrid engine: odd layers a window of this many tokens")
    ap.add_argument("--kv-format", default="f32", choices=list(eng.KV_FORMATS),
                    help="how the pool stores K/V (a calibrated format's scales: the held-out text's last window)")
    ap.add_argument("--json", type=pathlib.Path)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = ap.parse_args()
    own_block = eng.KV_FORMATS[a.kv_format][3]  # int2_kivi groups keys over blocks of 32 (as kvcache_serve)
    if own_block and a.block not in (None, own_block):
        ap.error(f"--block {a.block}: {a.kv_format} groups keys over blocks of {own_block}")
    a.block = a.block or own_block or 16
    if min(a.budget, a.requests, a.prompt, a.new, a.pool, a.chunk, a.batch, a.block) <= 0:
        ap.error("every count must be positive")
    if a.prompt - 32 * min(3, a.requests - 1) <= 0:
        ap.error(f"--prompt {a.prompt}: prompts are cut 32 shorter in turn")
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.window < 0 or (a.window and a.policy not in ("keep_all", "sink_window", "block_scores")):
        ap.error("--window: a positive token count, with keep_all, sink_window or block_scores (on the full layers)")
    if a.window and a.kv_format != "f32":
        ap.error("--window: the hybrid engine stores f32")
    cfg = eng.EngineConfig(max_kv_tokens=a.pool, block_size=a.block, chunk=a.chunk, max_batch=a.batch,
                           optimistic=a.optimistic, window=a.window, kv_format=a.kv_format)
    if a.model == "tiny":
        model, tok = mdl.load(), None
    else:
        import pretrained
        model, tok = pretrained.load(a.model)
    t0 = time.perf_counter()
    e, reqs = serve(model, a.policy, a.budget, cfg, workload(heldout(tok), a.requests, a.prompt, a.new))
    s = e.stats
    print(f"{a.policy} at {a.budget}, KV {a.kv_format}: {s.steps} steps, {s.tokens_generated} tokens generated, {s.preemptions} "
          f"preemptions, {s.reprefilled} re-prefilled, high-water {s.kv_high_water} tokens "
          f"({s.tokens_generated / (time.perf_counter() - t0):.0f} tokens/s)")
    text = (lambda ids: bytes(ids).decode("latin-1")) if tok is None else tok.decode
    for r in reqs:
        print(f"request {r.id}: ...{text(r.prompt[-40 if tok is None else -12:])!r}\n  -> {text(r.output)!r}")
    if tok is not None:  # the layout's bytes against every layer holding every token (a hybrid's saving)
        for n in (4096, 32768):
            held, full = e.kv_bytes(n)
            print(f"KV bytes of one {n}-token request: {held / 2**20:.1f} MiB, every layer full "
                  f"{full / 2**20:.1f} MiB ({full / held:.2f}x)")
    if a.json:
        a.json.write_text(json.dumps(to_json(e, a.policy, a.budget, reqs)))


if __name__ == "__main__":
    main()
