"""The shipped tiny model (examples/engine/model/kjv-tiny.bin) in PyTorch, its
K/V in a kvcache pool.

The modules and the weight loader are train.py's own (the model is defined
once); this file runs them one chunk of one request at a time against a K/V
store (engine.PagedKv or engine.HybridKv), the way examples/engine/forward.hpp does in C++:
the chunk's K/V are scattered into the pool, each layer reads back what the
request holds, and attention masks by token position, not by row order, so
it stays right after a token policy compacts the rows.
"""
import pathlib
import sys

import torch

ENGINE_DIR = pathlib.Path(__file__).resolve().parent.parent / "engine"
sys.path.insert(0, str(ENGINE_DIR / "train"))
import train  # noqa: E402  (train.py: Model, read_weights, CONFIG)

MODEL_DIR = ENGINE_DIR / "model"


def load(path=MODEL_DIR / "kjv-tiny.bin"):
    """train.Model with the shipped weights, in eval mode, on the CPU."""
    model = train.Model(dict(train.CONFIG))
    train.read_weights(model, pathlib.Path(path))
    return model.eval()


class Trace:
    """The attention a chunk's queries paid to the held tokens, in the shapes
    the eviction policies read (forward.hpp's AttentionTrace):
    head_sums [kv_heads, held], last_query [q_heads, held] (mean over layers),
    layer_head_sums [layers, kv_heads, held], layer_last_query [layers, q_heads, held],
    layer_sums: per layer [held in that layer] (filled alone when `ragged`)."""

    def __init__(self, ragged=False):
        self.ragged = ragged
        self.head_sums = self.last_query = self.layer_head_sums = self.layer_last_query = None
        self.layer_sums = []


class Forward:
    def __init__(self, model):
        self.m = model
        c = model.c
        self.c = c
        self.hd = c["dim"] // c["q_heads"]
        self.rep = c["q_heads"] // c["kv_heads"]
        self.scale = torch.tensor(1.0 / float(self.hd) ** 0.5, dtype=torch.float32)
        self.cos, self.sin = model.cos, model.sin  # [context, head_dim / 2], angles taken in float64

    def _rope(self, x, pos):  # x [n, heads, head_dim]; NeoX pairing (i with i + head_dim / 2)
        cos, sin = self.cos[pos][:, None, :], self.sin[pos][:, None, :]
        return train.apply_rope(x, cos, sin)

    @torch.no_grad()
    def run(self, store, tokens, first_pos, last_only, trace=None, observe_last=0):
        """Logits [n or 1, vocab] of `tokens` at positions first_pos..; the store
        already has room for the chunk (its slots)."""
        c, hd = self.c, self.hd
        n = len(tokens)
        pos = torch.arange(first_pos, first_pos + n)
        x = self.m.embed(torch.as_tensor(tokens, dtype=torch.long))
        observed = max(0, n - observe_last) if observe_last > 0 else 0
        if trace is not None:
            trace.layer_sums = [None] * c["layers"]
        for layer, blk in enumerate(self.m.blocks):
            h = blk.attn_norm(x)
            q = self._rope(blk.wq(h).view(n, c["q_heads"], hd), pos)
            k = self._rope(blk.wk(h).view(n, c["kv_heads"], hd), pos)
            v = blk.wv(h).view(n, c["kv_heads"], hd)
            store.write(layer, k.contiguous(), v.contiguous())
            keys, values, key_pos = store.read(layer)  # [kv_heads, held, hd] x2, [kv_heads, held]
            window = store.window(layer) if hasattr(store, "window") else 0  # a hybrid's window layers
            a = self._attention(q, keys, values, key_pos, pos, layer, trace, observed, window)
            x = x + blk.wo(a.reshape(n, -1))
            h = blk.mlp_norm(x)
            x = x + blk.w_down(torch.nn.functional.silu(blk.w_gate(h)) * blk.w_up(h))
        if last_only:
            x = x[-1:]
        return self.m.out(self.m.norm(x))

    def _attention(self, q, keys, values, key_pos, pos, layer, trace, observed, window=0):
        c, rep = self.c, self.rep
        n, H = q.shape[0], c["kv_heads"]
        held = keys.shape[1]
        qg = q.view(n, H, rep, self.hd).permute(1, 2, 0, 3)  # [kv_heads, rep, n, hd]: q-head j reads kv-head j // rep
        s = (qg @ keys.transpose(1, 2)[:, None]) * self.scale  # [kv_heads, rep, n, held]
        future = key_pos[:, None, None, :] > pos[None, None, :, None]  # causal by position
        if window > 0:  # a sliding-window layer: keys W or more behind the query are not read
            future = future | (pos[None, None, :, None] - key_pos[:, None, None, :] >= window)
        p = torch.softmax(s.masked_fill(future, float("-inf")), dim=-1)
        out = p @ values[:, None]  # [kv_heads, rep, n, hd]
        if trace is not None:
            obs = p[:, :, observed:, :]
            per_head = obs.sum(dim=(1, 2))  # [kv_heads, held]
            trace.layer_sums[layer] = per_head.sum(0)
            if not trace.ragged:
                last = p[:, :, -1, :].reshape(c["q_heads"], held)
                if trace.head_sums is None:
                    L = c["layers"]
                    trace.head_sums = torch.zeros(H, held)
                    trace.last_query = torch.zeros(c["q_heads"], held)
                    trace.layer_head_sums = torch.zeros(L, H, held)
                    trace.layer_last_query = torch.zeros(L, c["q_heads"], held)
                trace.head_sums += per_head
                trace.layer_head_sums[layer] = per_head
                trace.last_query += last / c["layers"]
                trace.layer_last_query[layer] = last
        return out.permute(2, 0, 1, 3)  # [n, kv_heads, rep, hd] = [n, q_heads, hd]
