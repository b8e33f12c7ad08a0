"""kvcache.torch_ops: the per-step kernels as torch.library custom ops.

torch.library.opcheck holds each op to its declared schema (what it mutates,
its fake kernel, its registration); a compiled decode step (scatter, gather,
attention over the gathered rows) runs with fullgraph=True, so a graph break
fails it, and equals the eager step. Needs torch >= 2.4: CI's torch is
Debian's 1.13, where these tests are skipped.
"""
import pytest

import kvcache as kv

torch = pytest.importorskip("torch")
if not hasattr(torch.library, "custom_op"):
    pytest.skip(f"torch {torch.__version__} has no torch.library.custom_op (needs >= 2.4)", allow_module_level=True)
import kvcache.torch_ops as ops  # noqa: E402

L, H, D, B, N = 2, 2, 8, 4, 16


def pool_and_memory():
    g = kv.Geometry(num_layers=L, num_kv_heads=H, head_dim=D, block_size=B, dtype=kv.DType.f32)
    memory = torch.zeros(g.pool_bytes(N), dtype=torch.uint8)
    return ops.Pool.of(kv.PoolView(g, memory, N)), memory


def test_every_op_passes_opcheck():
    pool, memory = pool_and_memory()
    spec = list(pool.spec)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    k, v = torch.randn(3, H, D), torch.randn(3, H, D)
    head = kv.Geometry(num_layers=1, num_kv_heads=1, head_dim=D, block_size=B, dtype=kv.DType.f32)
    head_memory = torch.zeros(head.pool_bytes(N), dtype=torch.uint8)
    head_spec = list(ops.Pool.of(kv.PoolView(head, head_memory, N)).spec)
    cases = [
        (torch.ops.kvcache.scatter.default, (memory, k, v, i32(4, 5, 9), spec, N, 0, 1.0, 1.0)),
        (torch.ops.kvcache.gather.default, (memory, spec, N, 1, i32(0, 2), i32(1, 2), i32(0, 6), torch.zeros(6, H, D),
                                            torch.zeros(6, H, D), 1.0, 1.0)),
        (torch.ops.kvcache.block_copy.default, (memory, spec, N, i32(1, 3).view(1, 2))),
        (torch.ops.kvcache.compaction.default, (memory, spec, N, i32(9, 6).view(1, 2), 0, L, 0, 0)),
        (torch.ops.kvcache.ring_write.default, (head_memory, head_spec, N, torch.randn(2, 1, D), torch.randn(2, 1, D),
                                                i32(4, 5), i32(-1, 8), 0)),
        (torch.ops.kvcache.page_bounds_update.default, (memory, spec, N, 0, i32(4, 5, 9), torch.zeros(N * H * 2 * D))),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_ops_write_what_the_plain_kernels_write():
    pool, memory = pool_and_memory()
    g = kv.Geometry(num_layers=L, num_kv_heads=H, head_dim=D, block_size=B, dtype=kv.DType.f32)
    ref_memory = torch.zeros(g.pool_bytes(N), dtype=torch.uint8)
    ref_pool = kv.PoolView(g, ref_memory, N)
    k, v = torch.randn(5, H, D), torch.randn(5, H, D)
    slots = torch.tensor([4, 5, 6, 7, 8], dtype=torch.int32)
    ops.scatter(pool, k, v, slots)
    kv.scatter(ref_pool, k, v, slots)
    moves = torch.tensor([[8, 2]], dtype=torch.int32)
    ops.compaction(pool, moves)
    kv.compaction(ref_pool, moves)
    ops.block_copy(pool, torch.tensor([[1, 3]], dtype=torch.int32))
    kv.block_copy(ref_pool, ref_pool, torch.tensor([[1, 3]], dtype=torch.int32))
    assert torch.equal(memory, ref_memory)


def test_a_compiled_decode_step_keeps_the_ops_in_its_graph():
    pool, memory = pool_and_memory()
    indptr = torch.tensor([0, 2], dtype=torch.int32)
    indices = torch.tensor([1, 2], dtype=torch.int32)
    prefill = torch.randn(7, H, D)
    ops.scatter(pool, prefill, -prefill, torch.arange(4, 11, dtype=torch.int32))

    def step(q, k, v, slot, length):
        ops.scatter(pool, k, v, slot)
        k_out, v_out = torch.zeros(8, H, D), torch.zeros(8, H, D)
        out_indptr = torch.stack([torch.zeros((), dtype=torch.int32), length])
        ops.gather(pool, 0, indptr, indices, out_indptr, k_out, v_out)
        s = torch.einsum("hd,thd->ht", q, k_out)
        mask = torch.arange(8) < length
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
        return torch.einsum("ht,thd->hd", p, v_out)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")  # a graph break raises
    q, k, v = torch.randn(H, D), torch.randn(1, H, D), torch.randn(1, H, D)
    eager = step(q, k, v, torch.tensor([11], dtype=torch.int32), torch.tensor(8, dtype=torch.int32))
    memory.zero_()
    ops.scatter(pool, prefill, -prefill, torch.arange(4, 11, dtype=torch.int32))
    got = compiled(q, k, v, torch.tensor([11], dtype=torch.int32), torch.tensor(8, dtype=torch.int32))
    assert torch.allclose(eager, got)
