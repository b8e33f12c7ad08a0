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
    """Runs a model one chunk of one request at a time against a K/V store. The
    model gives embed_tokens(ids), blocks[i].qkv(x, positions) (roped q, k, v),
    blocks[i].finish(x, attention output), window(layer) (0: full attention)
    and logits(x): train.Model (the tiny model, SmolLM2) and pretrained.Gemma3."""

    def __init__(self, model):
        self.m = model
        c = model.c
        self.c = c
        self.hd = c.get("head_dim", c["dim"] // c["q_heads"])
        self.rep = c["q_heads"] // c["kv_heads"]
        self.scale = torch.tensor(1.0 / float(self.hd) ** 0.5, dtype=torch.float32)

    @torch.no_grad()
    def run(self, store, tokens, first_pos, last_only, trace=None, observe_last=0):
        """Logits [n or 1, vocab] of `tokens` at positions first_pos..; the store
        already has room for the chunk (its slots)."""
        c = self.c
        n = len(tokens)
        pos = torch.arange(first_pos, first_pos + n)
        x = self.m.embed_tokens(torch.as_tensor(tokens, dtype=torch.long))
        observed = max(0, n - observe_last) if observe_last > 0 else 0
        if trace is not None:
            trace.layer_sums = [None] * c["layers"]
        for layer, blk in enumerate(self.m.blocks):
            q, k, v = blk.qkv(x, pos)
            store.write(layer, k.contiguous(), v.contiguous())
            keys, values, key_pos = store.read(layer)  # [kv_heads, held, hd] x2, [kv_heads, held]
            if hasattr(store, "select"):  # a selecting store hides what this chunk's queries do not read
                key_pos = store.select(layer, q, key_pos)
            # The model's sliding-window layers, or a hybrid engine's window over the tiny model's odd layers.
            window = self.m.window(layer) or (store.window(layer) if hasattr(store, "window") else 0)
            a = self._attention(q, keys, values, key_pos, pos, layer, trace, observed, window)
            x = blk.finish(x, a.reshape(n, -1))
        if last_only:
            x = x[-1:]
        return self.m.logits(x)

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


@torch.no_grad()
def reference_logits(model, tokens, round_trip=None):
    """The dense reference: the whole sequence in one pass with no cache at all
    (K and V used as computed, causal by index, the model's windows), logits
    [len(tokens), vocab]. The engines' outputs are checked against it.
    round_trip(layer, k, v) -> (k, v), when given, passes each layer's K and V
    through a KV format first."""
    n = len(tokens)
    c = model.c
    hd = c.get("head_dim", c["dim"] // c["q_heads"])
    rep = c["q_heads"] // c["kv_heads"]
    pos = torch.arange(n)
    x = model.embed_tokens(torch.as_tensor(tokens, dtype=torch.long))
    back = pos[:, None] - pos[None, :]  # query i, key j: i - j
    for layer, blk in enumerate(model.blocks):
        q, k, v = blk.qkv(x, pos)
        if round_trip is not None:
            k, v = round_trip(layer, k, v)
        w = model.window(layer)
        hidden = (back < 0) | ((back >= w) if w > 0 else torch.zeros_like(back, dtype=torch.bool))
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # q-head j reads kv-head j // rep
        s = torch.einsum("qhd,khd->hqk", q, k) / float(hd) ** 0.5
        a = torch.einsum("hqk,khd->qhd", torch.softmax(s.masked_fill(hidden, float("-inf")), dim=-1), v)
        x = blk.finish(x, a.reshape(n, -1))
    return model.logits(x)


class DenseKv:
    """What a cache would hold, with no cache: each layer's K and V rows in plain
    tensors, in position order (round_trip(layer, k, v), when given, stores
    them through a KV format). A store for Forward.run, as engine.PagedKv is."""

    def __init__(self, layers, round_trip=None):
        self.k, self.v = [None] * layers, [None] * layers
        self.round_trip = round_trip

    def write(self, layer, k, v):  # [n, kv_heads, head_dim]
        if self.round_trip is not None:
            k, v = self.round_trip(layer, k, v)
        self.k[layer] = k if self.k[layer] is None else torch.cat([self.k[layer], k])
        self.v[layer] = v if self.v[layer] is None else torch.cat([self.v[layer], v])

    def read(self, layer):
        n, heads = self.k[layer].shape[:2]
        return self.k[layer].transpose(0, 1), self.v[layer].transpose(0, 1), torch.arange(n).expand(heads, n)

    def truncate(self, n):  # keep the first n positions
        self.k = [t[:n] for t in self.k]
        self.v = [t[:n] for t in self.v]


@torch.no_grad()
def replay_logits(model, steps, round_trip=None):
    """The engine's computation replayed on a DenseKv: steps are (first
    position, tokens) chunks in the order they ran, or ("truncate", n). The
    same chunk shapes give the same float sums, so a quantized format's codes
    are the engine's own and the logits must be equal, bit for bit, wherever
    the cache served the right K/V. Returns each chunk's logits [n, vocab]."""
    store, fwd, out = DenseKv(model.c["layers"], round_trip), Forward(model), []
    for first, tokens in steps:
        if first == "truncate":
            store.truncate(tokens)
            continue
        out.append(fwd.run(store, tokens, first, False))
    return out
