#!/usr/bin/env python3
"""Trains the example engine's tiny model once; CI and the demo never run this.

A llama-style byte-level decoder (RMSNorm, RoPE, grouped-query attention,
SwiGLU) on the King James Bible from Debian's `bible-kjv` package, split into
train and held-out parts. Writes, next to this script's `../model/`:

  kjv-tiny.bin       the weights (format: see write_weights), float32
  kjv-tiny.sha256    their checksum
  heldout.bin        the held-out text's token ids (bytes: token id = byte)
  reference.bin      logits of the trained model on a fixed prompt, for the
                     C++ forward-pass test (float32 [T][vocab])

The mixture (tasks.py) adds, to the plain text, passkey retrieval, key->value
recall and repeated passages, whose answers lie far back in the context;
answer bytes weigh `--answer-weight` times a plain byte in the loss. The
mixture is scheduled (`--mix`): passkeys alone first (the retrieval circuit
forms in a few hundred steps when nothing else competes for it; in an even
mixture from the start it did not form within 8,000 steps), then passkey and
recall, then everything. Sequences are 256 bytes, then 512, then the full
1,024 (`--stages`). At the end the script scores the tasks on held-out
filler (greedy exact match = every answer byte is the argmax with the true
prefix) at 256 and 1,024 bytes and prints them to the log. `--init`
continues from a shipped model instead of a fresh one.

Reproducible: fixed seeds, single-process data order, a budget in steps.
The defaults are the shipped run: about 55 minutes on 2 CPU cores with
Debian's interpreter and `libopenblas0-pthread`:
  /usr/bin/python3 examples/engine/train/train.py
"""
import argparse
import hashlib
import math
import pathlib
import struct
import subprocess
import time

import random

import torch
import torch.nn as nn
import torch.nn.functional as F

import tasks

CONFIG = dict(vocab=256, dim=128, layers=4, q_heads=4, kv_heads=2, hidden=352, context=1024, rope_theta=10000.0,
              norm_eps=1e-5)
MAGIC = b"KVCM"
VERSION = 1


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim, context, theta):
    # NeoX pairing: dimension i rotates with i + head_dim / 2.
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ang = torch.arange(context, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cos(ang).float(), torch.sin(ang).float()


def apply_rope(x, cos, sin):  # x [B, H, T, D]
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, hq, hkv = c["dim"], c["q_heads"], c["kv_heads"]
        self.hd = d // hq
        self.hq, self.hkv = hq, hkv
        self.attn_norm = RMSNorm(d, c["norm_eps"])
        self.wq = nn.Linear(d, hq * self.hd, bias=False)
        self.wk = nn.Linear(d, hkv * self.hd, bias=False)
        self.wv = nn.Linear(d, hkv * self.hd, bias=False)
        self.wo = nn.Linear(hq * self.hd, d, bias=False)
        self.mlp_norm = RMSNorm(d, c["norm_eps"])
        self.w_gate = nn.Linear(d, c["hidden"], bias=False)
        self.w_up = nn.Linear(d, c["hidden"], bias=False)
        self.w_down = nn.Linear(c["hidden"], d, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(B, T, self.hq, self.hd).transpose(1, 2)
        k = self.wk(h).view(B, T, self.hkv, self.hd).transpose(1, 2)
        v = self.wv(h).view(B, T, self.hkv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos[:T], sin[:T]), apply_rope(k, cos[:T], sin[:T])
        rep = self.hq // self.hkv  # q-head j reads kv-head j // rep
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True) if hasattr(F, "scaled_dot_product_attention") \
            else self._attention(q, k, v)
        x = x + self.wo(a.transpose(1, 2).reshape(B, T, -1))
        h = self.mlp_norm(x)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))

    # One request's tokens at a time, [n, dim] (model.Forward's interface, shared with pretrained.py's Gemma 3).
    def qkv(self, x, pos):
        n = x.shape[0]
        h = self.attn_norm(x)
        cos, sin = self.cos[pos][:, None, :], self.sin[pos][:, None, :]
        q = apply_rope(self.wq(h).view(n, self.hq, self.hd), cos, sin)
        k = apply_rope(self.wk(h).view(n, self.hkv, self.hd), cos, sin)
        return q, k, self.wv(h).view(n, self.hkv, self.hd)

    def finish(self, x, a):  # a: the attention's output, [n, q_heads * head_dim]
        x = x + self.wo(a)
        h = self.mlp_norm(x)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))

    @staticmethod
    def _attention(q, k, v):
        T = q.shape[2]
        s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        return torch.softmax(s, dim=-1) @ v


class Model(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c["vocab"], c["dim"])
        self.blocks = nn.ModuleList(Block(c) for _ in range(c["layers"]))
        self.norm = RMSNorm(c["dim"], c["norm_eps"])
        self.out = nn.Linear(c["dim"], c["vocab"], bias=False)
        cos, sin = rope_tables(c["dim"] // c["q_heads"], c["context"], c["rope_theta"])
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for b in self.blocks:  # the per-token interface's tables (shared, not copied)
            b.cos, b.sin = cos, sin
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def embed_tokens(self, idx):
        return self.embed(idx)

    def window(self, layer):  # every layer attends to the whole context
        return 0

    def logits(self, x):
        return self.out(self.norm(x))

    def forward(self, idx):
        x = self.embed(idx)
        for b in self.blocks:
            x = b(x, self.cos, self.sin)
        return self.out(self.norm(x))


def write_weights(model, path):
    """Little-endian. Header: magic 'KVCM', u32 version, then u32 vocab, dim,
    layers, q_heads, kv_heads, hidden, context, f32 rope_theta, f32 norm_eps.
    Then float32 tensors, row-major as PyTorch stores them ([out][in] for
    linear layers): embed [vocab][dim]; per layer: attn_norm [dim], wq, wk, wv,
    wo, mlp_norm [dim], w_gate, w_up, w_down; final norm [dim]; out [vocab][dim]."""
    c = model.c
    head = MAGIC + struct.pack("<8I2f", VERSION, c["vocab"], c["dim"], c["layers"], c["q_heads"], c["kv_heads"],
                               c["hidden"], c["context"], c["rope_theta"], c["norm_eps"])
    tensors = [model.embed.weight]
    for b in model.blocks:
        tensors += [b.attn_norm.weight, b.wq.weight, b.wk.weight, b.wv.weight, b.wo.weight, b.mlp_norm.weight,
                    b.w_gate.weight, b.w_up.weight, b.w_down.weight]
    tensors += [model.norm.weight, model.out.weight]
    body = b"".join(t.detach().float().contiguous().numpy().astype("<f4").tobytes() for t in tensors)
    path.write_bytes(head + body)
    return hashlib.sha256(head + body).hexdigest()


def read_weights(model, path):
    """Loads weights written by write_weights into a model of the same shape."""
    blob = path.read_bytes()
    head = struct.unpack("<8I2f", blob[4:44])
    if blob[:4] != MAGIC or head[0] != VERSION:
        raise ValueError(f"{path.name}: not a version {VERSION} model")
    c = model.c
    if tuple(head[1:8]) != (c["vocab"], c["dim"], c["layers"], c["q_heads"], c["kv_heads"], c["hidden"], c["context"]):
        raise ValueError(f"{path.name}: shape {head[1:8]} differs from CONFIG")
    tensors = [model.embed.weight]
    for b in model.blocks:
        tensors += [b.attn_norm.weight, b.wq.weight, b.wk.weight, b.wv.weight, b.wo.weight, b.mlp_norm.weight,
                    b.w_gate.weight, b.w_up.weight, b.w_down.weight]
    tensors += [model.norm.weight, model.out.weight]
    at = 44
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(torch.frombuffer(bytearray(blob[at:at + 4 * n]), dtype=torch.float32).view_as(t))
            at += 4 * n
    if at != len(blob):
        raise ValueError(f"{path.name}: {len(blob) - at} bytes left over")


def batch_of(rng, filler, seq, batch, answer_weight, mix):
    """Inputs, targets and per-target loss weights for one step of the mixture."""
    xs, ys, ws = [], [], []
    for _ in range(batch):
        s, spans = tasks.sample(rng, filler, seq + 1, mix)
        t = torch.tensor(list(s), dtype=torch.long)
        w = torch.ones(seq)
        for a, b in spans:  # target i predicts byte i + 1
            w[a - 1:b - 1] = answer_weight
        xs.append(t[:-1])
        ys.append(t[1:])
        ws.append(w)
    return torch.stack(xs), torch.stack(ys), torch.stack(ws)


@torch.no_grad()
def task_scores(model, filler, n, length):
    """Greedy exact-match accuracy per task (and per passkey depth), and the
    repeated passages' continuation loss, on held-out filler."""
    rng = random.Random(7)
    out = {}

    def exact(s, a, b):
        x = torch.tensor(list(s), dtype=torch.long)[None]
        pred = model(x[:, :-1])[0].argmax(-1)
        return bool((pred[a - 1:b - 1] == x[0, a:b]).all())

    for depth in (0.1, 0.3, 0.5, 0.7, 0.9):
        out[f"passkey@{depth}"] = sum(exact(*tasks.passkey(rng, filler, length, depth=depth)) for _ in range(n)) / n
    out["recall"] = sum(exact(*tasks.recall(rng, filler, length)) for _ in range(n)) / n
    nll, count = 0.0, 0
    for _ in range(n):
        s, a, b = tasks.repeat(rng, filler, length)
        x = torch.tensor(list(s), dtype=torch.long)[None]
        logits = model(x[:, :-1])[0]
        nll += F.cross_entropy(logits[a - 1:b - 1], x[0, a:b], reduction="sum").item()
        count += b - a
    out["repeat_loss"] = nll / count
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3600, help="optimizer steps (the budget; not wall time, so a "
                    "run is the same on any machine)")
    ap.add_argument("--seq", type=int, default=256, help="first stage's sequence length")
    ap.add_argument("--batch", type=int, default=16, help="first stage's batch; later stages keep seq x batch")
    ap.add_argument("--stages", default="0.8,0.92", help="step fractions at which seq doubles, then becomes the context")
    ap.add_argument("--init", type=pathlib.Path, help="continue from these weights (write_weights format)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--answer-weight", type=float, default=8.0)
    ap.add_argument("--mix", default="0:0,1,0,0;0.3:0,1,1,0;0.5:1,1,1,1",
                    help="FRACTION:WEIGHTS;... weights of " + ",".join(tasks.KINDS) +
                    " from a fraction of the steps on")
    ap.add_argument("--shape", default="", help="CONFIG overrides, e.g. dim=192,layers=6")
    ap.add_argument("--eval-samples", type=int, default=40)
    ap.add_argument("--text", type=pathlib.Path, help="the KJV text (default: the output of Debian's `bible`)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).resolve().parent.parent / "model")
    args = ap.parse_args()
    for kv in filter(None, args.shape.split(",")):
        k, v = kv.split("=")
        CONFIG[k] = type(CONFIG[k])(v)
    mixes = [(float(f), [float(x) for x in w.split(",")]) for f, w in (m.split(":") for m in args.mix.split(";"))]
    stages = [float(x) for x in args.stages.split(",")]
    torch.manual_seed(1233 + args.seed)
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    out = args.out
    out.mkdir(exist_ok=True)

    text = args.text.read_bytes() if args.text else \
        subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], capture_output=True, check=True).stdout
    data = torch.tensor(list(text), dtype=torch.long)
    split = int(len(data) * 0.95)  # the last 5% (the end of the New Testament) is held out
    train, heldout = data[:split], data[split:]
    print(f"text: {len(data)} bytes; train {len(train)}, held out {len(heldout)}")
    print("config: " + ", ".join(f"{k}={v}" for k, v in CONFIG.items()))
    print(f"steps {args.steps}, seq {args.seq} x batch {args.batch}, stages {args.stages}, lr {args.lr}, "
          f"answer weight {args.answer_weight}, mix {args.mix} ({'/'.join(tasks.KINDS)})")

    model = Model(CONFIG)
    print(f"parameters: {sum(p.numel() for p in model.parameters()):,}")
    if args.init:
        read_weights(model, args.init)
        print(f"continuing from {args.init.name}")
    model.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    filler = tasks.Filler(bytes(train.tolist()))
    rng = random.Random(args.seed)
    start = time.time()
    for step in range(args.steps):
        # A curriculum of lengths: short sequences are cheap steps in which the
        # retrieval circuits form; the later, longer ones stretch them over the
        # full context (and teach RoPE its far positions).
        frac = step / args.steps
        seq = args.seq if frac < stages[0] else 2 * args.seq if frac < stages[1] else CONFIG["context"]
        seq = min(seq, CONFIG["context"])
        batch = max(1, args.batch * args.seq // seq)
        mix = [w for f, w in mixes if f <= frac][-1]
        x, y, w = (t.to(dev) for t in batch_of(rng, filler, seq, batch, args.answer_weight, mix))
        for g in opt.param_groups:  # warmup, then cosine decay to a tenth
            g["lr"] = args.lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        per = F.cross_entropy(model(x).view(-1, CONFIG["vocab"]), y.view(-1), reduction="none")
        loss = (per * w.view(-1)).sum() / w.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0:
            ans = w.view(-1) > 1
            print(f"step {step:5d}  {time.time() - start:6.0f}s  seq {seq}  loss {loss.item():.3f}  answer loss "
                  f"{per[ans].mean().item() if ans.any() else float('nan'):.3f}", flush=True)
    print(f"trained {args.steps} steps in {time.time() - start:.0f}s")

    model.eval().cpu()
    with torch.no_grad():
        n, nll = 0, 0.0
        for i in range(0, min(len(heldout), 64 * 1024) - 1, CONFIG["context"]):
            chunk = heldout[i:i + CONFIG["context"] + 1]
            logits = model(chunk[None, :-1])
            nll += F.cross_entropy(logits[0], chunk[1:], reduction="sum").item()
            n += len(chunk) - 1
        print(f"held-out: {nll / n / math.log(2):.3f} bits/byte, perplexity {math.exp(nll / n):.3f} over {n} bytes")
        held_filler = tasks.Filler(bytes(heldout.tolist()))
        for length in sorted({args.seq, CONFIG["context"]}):
            scores = task_scores(model, held_filler, args.eval_samples, length)
            print(f"tasks at {length} bytes, {args.eval_samples} samples each: " +
                  ", ".join(f"{k} {v:.3f}" for k, v in scores.items()))
        prompt = heldout[:64]
        ref = model(prompt[None])[0].float().numpy().astype("<f4")
    digest = write_weights(model, out / "kjv-tiny.bin")
    (out / "kjv-tiny.sha256").write_text(f"{digest}  kjv-tiny.bin\n")
    (out / "heldout.bin").write_bytes(bytes(heldout[:64 * 1024].tolist()))
    (out / "reference.bin").write_bytes(struct.pack("<2I", ref.shape[0], ref.shape[1]) + ref.tobytes())
    print(f"wrote {out.name}/: weights sha256 {digest}")  # no absolute path: logs are shipped


if __name__ == "__main__":
    main()
