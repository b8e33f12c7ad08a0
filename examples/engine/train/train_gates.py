#!/usr/bin/env python3
"""Trains Write-Gated KV gates for the shipped tiny model; CI never runs this.

Write-Gated KV (arXiv 2512.17452) decides, per (layer, kv-head, token),
whether a key leaves the local window for the long-lived global region. The
gate is a 2-layer MLP per kv-head over [RMSNorm(pre-RoPE key);
RMSNorm(post-RoPE key)]: hidden 4 x head_dim, exact GELU, sigmoid, clamped
to at least 1e-3, exactly what the library's `write_gate` kernel computes.

The recipe (the paper's): the model stays frozen; a student copy adds
log g(key) to the attention logits of every non-local key (query position
>= key position + W_local), so a gate near 0 hides the key from every query
past the window, as dropping it would. The loss is the mean squared error
between the student's and the dense model's final hidden states (after the
final RMSNorm, what the output layer reads) plus lambda times the expected
footprint, mean over keys of offset + (1 - offset) * (1 - (g - 1)^2) with
offset = min(W_local / (n - s), 1): the fraction of the n - s later queries
that read the key from the local window anyway, where it costs nothing to
drop. One set of gates per lambda.

Data: the model's own training mixture (tasks.py: text, passkey, recall,
repeated passage, evenly) at the full context, so the gates see what the
evaluation asks for. Writes ../model/gates-<lambda>.bin per lambda (format:
write_gates) and prints, on held-out samples, each head's admitted fraction
(g >= tau among keys that leave the window), the hidden-state error and the
passkey / recall scores with the gates applied hard (g < tau: key hidden).

Reproducible: fixed seeds, a budget in steps. The defaults are the shipped
run (about 35 minutes for three lambdas on 2 CPU cores):
  /usr/bin/python3 examples/engine/train/train_gates.py
"""
import argparse
import math
import pathlib
import random
import struct
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import tasks
import train

GATE_MAGIC = b"KVCG"
GATE_VERSION = 1


class Gates(nn.Module):
    """One layer's gates: shared RMSNorm weights, one MLP per kv-head (the
    shapes and layout of the library's WriteGateWeights)."""

    def __init__(self, kv_heads, head_dim, hidden, eps=1e-6, min_gate=1e-3):
        super().__init__()
        self.norm_pre = nn.Parameter(torch.ones(head_dim))
        self.norm_post = nn.Parameter(torch.ones(head_dim))
        self.w1 = nn.Parameter(torch.randn(kv_heads, 2 * head_dim, hidden) / math.sqrt(2 * head_dim))
        self.b1 = nn.Parameter(torch.zeros(kv_heads, hidden))
        self.w2 = nn.Parameter(torch.randn(kv_heads, hidden) / math.sqrt(hidden))
        self.b2 = nn.Parameter(torch.zeros(kv_heads))
        self.eps, self.min_gate = eps, min_gate

    def forward(self, k_pre, k_post):  # [B, H, T, D] each -> g [B, H, T]
        def norm(x, w):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

        x = torch.cat([norm(k_pre, self.norm_pre), norm(k_post, self.norm_post)], dim=-1)
        h = F.gelu(torch.einsum("bhti,hij->bhtj", x, self.w1) + self.b1[None, :, None, :])
        z = (h * self.w2[None, :, None, :]).sum(-1) + self.b2[None, :, None]
        return torch.sigmoid(z).clamp(min=self.min_gate)


def hidden_states(model, idx, gates=None, window=0, tau=None):
    """The final normed hidden states. With gates: each layer adds log g to
    non-local keys' logits (soft), or hides keys with g < tau (hard, tau
    given). Returns (hidden, [g per layer])."""
    x = model.embed(idx)
    T = idx.shape[1]
    pos = torch.arange(T)
    causal = pos[None, :] > pos[:, None]
    nonlocal_ = pos[:, None] >= pos[None, :] + window  # [q, k]
    gs = []
    for li, b in enumerate(model.blocks):
        B = x.shape[0]
        h = b.attn_norm(x)
        q = b.wq(h).view(B, T, b.hq, b.hd).transpose(1, 2)
        k_pre = b.wk(h).view(B, T, b.hkv, b.hd).transpose(1, 2)
        v = b.wv(h).view(B, T, b.hkv, b.hd).transpose(1, 2)
        cos, sin = model.cos[:T], model.sin[:T]
        q, k = train.apply_rope(q, cos, sin), train.apply_rope(k_pre, cos, sin)
        rep = b.hq // b.hkv
        s = (q @ k.repeat_interleave(rep, dim=1).transpose(-1, -2)) / math.sqrt(b.hd)
        if gates is not None:
            g = gates[li](k_pre, k)  # [B, Hkv, T]
            gs.append(g)
            gq = g.repeat_interleave(rep, dim=1)[:, :, None, :]  # per key, broadcast over queries
            if tau is None:
                s = s + torch.where(nonlocal_, torch.log(gq), torch.zeros((), dtype=s.dtype))
            else:
                s = s.masked_fill(nonlocal_ & (gq < tau), float("-inf"))
        s = s.masked_fill(causal, float("-inf"))
        a = torch.softmax(s, dim=-1) @ v.repeat_interleave(rep, dim=1)
        x = x + b.wo(a.transpose(1, 2).reshape(B, T, -1))
        h = b.mlp_norm(x)
        x = x + b.w_down(F.silu(b.w_gate(h)) * b.w_up(h))
    return model.norm(x), gs


def footprint(gs, window):
    """The paper's expected-footprint regulariser, mean over keys."""
    T = gs[0].shape[-1]
    s = torch.arange(T, dtype=torch.float32)
    offset = torch.clamp(window / (T - s), max=1.0)
    return torch.stack([(offset + (1 - offset) * (1 - (g - 1) ** 2)).mean() for g in gs]).mean()


def write_gates(gates, path, window, tau, lam):
    """Little-endian. Header: magic 'KVCG', u32 version, u32 layers, kv_heads,
    head_dim, hidden, window, f32 tau, f32 lambda, f32 norm_eps, f32 min_gate.
    Then per layer, float32: norm_pre [head_dim], norm_post [head_dim],
    w1 [kv_heads][2 * head_dim][hidden], b1 [kv_heads][hidden],
    w2 [kv_heads][hidden], b2 [kv_heads] (WriteGateWeights' layout)."""
    g0 = gates[0]
    kv, two_d, hid = g0.w1.shape
    head = GATE_MAGIC + struct.pack("<6I4f", GATE_VERSION, len(gates), kv, two_d // 2, hid, window, tau, lam,
                                    g0.eps, g0.min_gate)
    body = b"".join(t.detach().float().contiguous().numpy().astype("<f4").tobytes()
                    for g in gates for t in (g.norm_pre, g.norm_post, g.w1, g.b1, g.w2, g.b2))
    path.write_bytes(head + body)


@torch.no_grad()
def report(model, gates, filler, window, tau, n, length):
    """Admitted fraction per (layer, head), hidden error and task scores with hard gates."""
    rng = random.Random(11)
    admitted = torch.zeros(len(gates), gates[0].w1.shape[0])
    leaving = 0
    mse = 0.0
    for _ in range(n):
        s = torch.tensor(list(filler.exact(rng, length)), dtype=torch.long)[None]
        ref, _ = hidden_states(model, s)
        out, gs = hidden_states(model, s, gates, window, tau)
        mse += F.mse_loss(out, ref).item() / n
        for li, g in enumerate(gs):
            admitted[li] += (g[0, :, :length - window] >= tau).float().sum(-1)
        leaving += length - window
    frac = admitted / leaving

    def exact(sample):
        s, a, b = sample
        x = torch.tensor(list(s), dtype=torch.long)[None]
        h, _ = hidden_states(model, x[:, :-1], gates, window, tau)
        pred = model.out(h)[0].argmax(-1)
        return bool((pred[a - 1:b - 1] == x[0, a:b]).all())

    passkey = sum(exact(tasks.passkey(rng, filler, length)) for _ in range(n)) / n
    recall = sum(exact(tasks.recall(rng, filler, length)) for _ in range(n)) / n
    return frac, mse, passkey, recall


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lambdas", default="0.003,0.01,0.03", help="one gate set per value")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--window", type=int, default=64, help="W_local, tokens (a multiple of the block size)")
    ap.add_argument("--tau", type=float, default=0.1, help="admission threshold (the paper's)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-samples", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", type=pathlib.Path,
                    default=pathlib.Path(__file__).resolve().parent.parent / "model" / "kjv-tiny.bin")
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).resolve().parent.parent / "model")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model = train.Model(train.CONFIG)
    train.read_weights(model, args.model)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    c = train.CONFIG
    head_dim = c["dim"] // c["q_heads"]
    heldout = (args.model.parent / "heldout.bin").read_bytes()
    import subprocess
    text = subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], capture_output=True, check=True).stdout
    filler = tasks.Filler(text[:int(len(text) * 0.95)])  # train.py's split
    held = tasks.Filler(heldout)
    print(f"gates: {c['layers']} layers x {c['kv_heads']} kv-heads, head_dim {head_dim}, hidden {4 * head_dim}; "
          f"W_local {args.window}, tau {args.tau}; {args.steps} steps of {args.batch} x {args.seq}, lr {args.lr}")
    for lam in (float(x) for x in args.lambdas.split(",")):
        torch.manual_seed(args.seed)
        rng = random.Random(args.seed)
        gates = nn.ModuleList(Gates(c["kv_heads"], head_dim, 4 * head_dim) for _ in range(c["layers"]))
        opt = torch.optim.Adam(gates.parameters(), lr=args.lr)
        start = time.time()
        for step in range(args.steps):
            x = torch.stack([torch.tensor(list(tasks.sample(rng, filler, args.seq)[0]), dtype=torch.long)
                             for _ in range(args.batch)])
            with torch.no_grad():
                ref, _ = hidden_states(model, x)
            out, gs = hidden_states(model, x, gates, args.window)
            mse = F.mse_loss(out, ref)
            reg = footprint(gs, args.window)
            loss = mse + lam * reg
            for grp in opt.param_groups:
                grp["lr"] = args.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step % 25 == 0 or step == args.steps - 1:
                adm = torch.stack([(g[:, :, :args.seq - args.window] >= args.tau).float().mean() for g in gs]).mean()
                print(f"lambda {lam:g} step {step:4d} {time.time() - start:5.0f}s  mse {mse.item():.4f}  "
                      f"footprint {reg.item():.3f}  admitted {adm.item():.3f}", flush=True)
        frac, mse, pk, rc = report(model, gates, held, args.window, args.tau, args.eval_samples, c["context"])
        print(f"lambda {lam:g}: held out, {args.eval_samples} samples at {c['context']} tokens: admitted "
              f"{frac.mean().item():.3f} (per layer x head " +
              " ".join(f"{v:.2f}" for v in frac.flatten().tolist()) +
              f"), hidden mse {mse:.4f}, passkey {pk:.2f}, recall {rc:.2f}; {time.time() - start:.0f}s", flush=True)
        name = f"gates-{lam:g}.bin"
        write_gates(gates, args.out / name, args.window, args.tau, lam)
        print(f"wrote {args.out.name}/{name}")


if __name__ == "__main__":
    main()
