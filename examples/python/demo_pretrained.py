#!/usr/bin/env python3
"""SmolLM2-135M served through kvcache (scripts/demo's last table): one
passkey prompt, held four ways, side by side: the full cache, the best
eviction policy of the fidelity study at a quarter of the prompt, a quantized
KV format, and the two together. Each row prints the KV bytes the request
holds while it decodes, prefill and decode tokens/s on this machine, and the
passkey it answers (docs/pretrained-models.md has the study behind it).

  build/python-venv/bin/python examples/python/demo_pretrained.py [--length 1024] [--depth 0.5]
"""
import argparse
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import engine as eng  # noqa: E402
import eval_pretrained as ev  # noqa: E402
import eval_prompts as prompts  # noqa: E402
import pretrained  # noqa: E402

FORMAT = "int8_g32"  # within 0.2 % of the full cache's perplexity on the study's text
ROWS = ["full", ev.BEST, f"format={FORMAT}", f"{ev.BEST},format={FORMAT}"]


def serve(m, tok, row, prompt, answer, new_tokens):
    """(KV bytes held while decoding, prefill tokens/s, decode tokens/s, output, correct)."""
    e, _ = ev.make_engine(m, row, len(prompt), "retrieval")
    r = eng.Request(id=0, prompt=prompt, max_new=max(new_tokens, prompts.answer_tokens(tok, answer)))
    t0 = time.perf_counter()
    while not r.output:
        e.step([r])
    t1 = time.perf_counter()
    held = e.held(r)
    while not r.done:
        e.step([r])
    t2 = time.perf_counter()
    out = tok.decode(r.output)
    return e.kv_bytes(held)[0], len(prompt) / (t1 - t0), (len(r.output) - 1) / (t2 - t1), out, \
        prompts.answered(out.split("\n")[0], answer)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--depth", type=float, default=0.5)
    ap.add_argument("--new-tokens", type=int, default=16)
    a = ap.parse_args()
    torch.set_num_threads(1)  # OpenBLAS threads the products
    try:
        m, tok = pretrained.load("smollm2")
        filler = prompts.Filler(tok)
    except (pretrained.NotInstalled, prompts.MissingCorpus) as e:
        sys.exit(f"demo_pretrained: {e}")
    prompt, answer = prompts.passkey(tok, filler, prompts.sample_rng("passkey", a.length, a.depth, 0), a.length,
                                     a.depth)
    print(f"SmolLM2-135M-Instruct through kvcache: a {len(prompt)}-token passkey prompt (the key {answer} at "
          f"{a.depth:.0%} of it), greedy; the policy evicts once, after the prompt. One prompt: "
          f"docs/fidelity-pretrained.md has the rates over 30")
    print(f"| {'row':<36} | {'KV held decoding':>16} | {'prefill tok/s':>13} | {'decode tok/s':>12} | answer")
    print(f"| {'-' * 36} | {'-' * 15}: | {'-' * 12}: | {'-' * 11}: | ---")
    for row in ROWS:
        kv_bytes, prefill, decode, out, ok = serve(m, tok, row, prompt, answer, a.new_tokens)
        first = out.split("\n")[0].strip()
        print(f"| {row:<36} | {kv_bytes / 2**20:12.2f} MiB | {prefill:13.0f} | {decode:12.1f} | "
              f"{'right' if ok else 'wrong'}: {first[:40]!r}", flush=True)


if __name__ == "__main__":
    main()
