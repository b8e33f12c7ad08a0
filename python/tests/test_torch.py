"""torch CPU tensors through the same calls: outputs written in place
(DLPack, no copy), kernels on tensors. Skipped where torch is not installed."""
import numpy as np
import pytest

import kvcache as kv

torch = pytest.importorskip("torch")


def test_cache_writes_into_torch_tensors_in_place():
    g = kv.Geometry(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4)
    c = kv.Cache(g, num_blocks=8, max_sequences=2)
    s = c.add_sequence()
    slots = torch.full((6,), -7, dtype=torch.int32)
    out, _, _ = c.reserve(s, 6, slots)
    assert out is slots and slots.tolist() == [4, 5, 6, 7, 8, 9]
    seqs = torch.tensor([s], dtype=torch.int64)  # int64 handles are read as they are
    table = torch.zeros((1, 4), dtype=torch.int32)
    assert c.export_block_table(seqs, 4, table) is table and table.tolist() == [[1, 2, 0, 0]]
    with pytest.raises(kv.InvalidArgument, match="out must be a C-contiguous int32"):
        c.export_lengths(seqs, torch.zeros(1, dtype=torch.int64))


def test_scatter_and_gather_on_torch_tensors():
    g = kv.Geometry(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4, dtype=kv.DType.bf16)
    mem = torch.zeros(g.pool_bytes(8), dtype=torch.uint8)
    pv = kv.PoolView(g, mem, 8)
    k = torch.randn(5, 2, 8, dtype=torch.bfloat16)
    v = torch.randn(5, 2, 8, dtype=torch.bfloat16)
    kv.scatter(pv, k, v, torch.arange(4, 9, dtype=torch.int32))
    gk, gv = torch.zeros_like(k), torch.zeros_like(v)
    kv.gather(pv, 0, torch.tensor([0, 2], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32),
              torch.tensor([0, 5], dtype=torch.int32), gk, gv)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    assert mem.count_nonzero() > 0  # the pool is the tensor's own memory
