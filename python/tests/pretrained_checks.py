"""What the pretrained models' tests share (test_pretrained.py,
test_one_engine.py): the models' fixtures live in conftest.py; here the
held-out text in a model's tokens, the check against the dense reference,
and, for a quantized format, the replay of the engine's own chunks."""
import pathlib
import sys

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples" / "python"))
import engine as eng  # noqa: E402
import model as mdl  # noqa: E402

import kvcache as kv  # noqa: E402

# float32 throughout; torch sums a chunk's products in another order than the
# one-pass reference (BLAS blocking): seen up to 1.3e-4 on logits up to ~50.
LOGIT_TOLERANCE = 1e-3


def text_tokens(tok, start, count):
    """`count` tokens of the KJV held-out text (the tiny model's, shipped) from byte `start`."""
    text = (mdl.MODEL_DIR / "heldout.bin").read_bytes().decode("latin-1")
    return tok.encode(text[start:start + 8 * count], bos=False)[:count]


def check_dense(m, r, round_trip=None):
    """r's logits, at every position the engine computed them, against the reference's."""
    seq = r.prompt + r.output
    ref = mdl.reference_logits(m, seq[:-1], round_trip)
    assert r.chunk_logits, "keep_logits: no logits kept"
    for first, logits in r.chunk_logits:
        want = ref[first:first + logits.shape[0]]
        diff = (logits - want).abs().max().item()
        assert diff <= LOGIT_TOLERANCE, f"request {r.id}: positions {first}..: logits differ by {diff}"
    got = torch.tensor(r.output)
    greedy = ref[len(r.prompt) - 1:].argmax(-1)
    assert torch.equal(greedy, got), f"request {r.id}: greedy tokens differ at {(greedy != got).nonzero()[0].item()}"


def round_trip_through(e):
    """K/V through e's format: written to a pool of e's format (every model
    layer, one stream) at slots 0..n-1 and read back (with e's held scales)."""
    dtype, fmt, _, _ = eng.KV_FORMATS[e.cfg.kv_format]
    geometry = kv.Geometry(num_layers=e.c["layers"], num_kv_heads=e.heads, head_dim=e.head_dim,
                           block_size=e.cfg.block_size, dtype=dtype, format=fmt)

    def run(layer, k, v):
        n = k.shape[0]
        blocks = -(-n // e.cfg.block_size)
        memory = torch.zeros(geometry.pool_bytes(blocks), dtype=torch.uint8)
        pool = kv.PoolView(geometry, memory, blocks)
        scales = eng.held_scales(e, layer, 1)
        kv.scatter(pool, k.contiguous(), v.contiguous(), np.arange(n, dtype=np.int32), first_layer=layer, **scales)
        k2, v2 = torch.empty_like(k), torch.empty_like(v)
        kv.gather(pool, layer, np.array([0, blocks], dtype=np.int32), np.arange(blocks, dtype=np.int32),
                  np.array([0, n], dtype=np.int32), k2, v2, **scales)
        return k2, v2
    return run


def chunks_of(r, below=None):
    """(first position, tokens) of each chunk r's last admission ran (those starting below `below`)."""
    seq = r.prompt + r.output
    return [(first, seq[first:first + lg.shape[0]]) for first, lg in r.chunk_logits
            if below is None or first < below]


def check_replay(m, r, steps, round_trip):
    """r's logits equal, bit for bit, a replay of the same chunks on plain tensors."""
    want = mdl.replay_logits(m, steps, round_trip)[-len(r.chunk_logits):]
    for (first, got), ref in zip(r.chunk_logits, want):
        assert torch.equal(got, ref), f"request {r.id}: positions {first}..: {(got - ref).abs().max().item()} off"
