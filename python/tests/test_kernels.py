"""The host kernels on arrays (numpy here; torch CPU tensors take the same
DLPack path) against plain numpy references: what the kernel wrote, and
that a bad call wrote nothing."""
import numpy as np
import pytest

import kvcache as kv

L, H, D, B, N = 2, 2, 8, 4, 12


def pool(dtype=kv.DType.f32, planes=kv.KvPlanes.interleaved):
    g = kv.Geometry(num_layers=L, num_kv_heads=H, head_dim=D, block_size=B, dtype=dtype, planes=planes)
    mem = np.zeros(g.pool_bytes(N), dtype=np.uint8)
    return g, mem, kv.PoolView(g, mem, N)


def gather_all(pv, layer, pages, n, dtype=np.float32):
    """Every token of one sequence whose pages are `pages`, through the gather kernel."""
    k = np.zeros((n, H, D), dtype=dtype)
    v = np.zeros_like(k)
    kv.gather(pv, layer, np.array([0, len(pages)], dtype=np.int32), np.array(pages, dtype=np.int32),
              np.array([0, n], dtype=np.int32), k, v)
    return k, v


@pytest.mark.parametrize("planes", [kv.KvPlanes.interleaved, kv.KvPlanes.separate])
def test_scatter_then_gather_returns_the_rows(planes):
    g, mem, pv = pool(planes=planes)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((L, 6, H, D), dtype=np.float32)
    v = rng.standard_normal((L, 6, H, D), dtype=np.float32)
    slots = np.array([8, 9, 10, 11, 20, 21], dtype=np.int32)  # blocks 2 and 5
    kv.scatter(pv, k, v, slots)  # every layer in one call
    for layer in range(L):
        gk, gv = gather_all(pv, layer, [2, 5], 6)
        np.testing.assert_array_equal(gk, k[layer])
        np.testing.assert_array_equal(gv, v[layer])


def test_scatter_reads_a_strided_slice_of_fused_qkv_and_converts_to_f16():
    g, mem, pv = pool(dtype=kv.DType.f16)
    hq = 4
    rng = np.random.default_rng(1)
    qkv = rng.standard_normal((5, (hq + 2 * H) * D), dtype=np.float32)
    k = qkv[:, hq * D:(hq + H) * D].reshape(5, H, D)  # a view: token stride (hq + 2H) * D
    v = qkv[:, (hq + H) * D:].reshape(5, H, D)
    assert not k.flags.c_contiguous
    kv.scatter(pv, k, v, np.array([4, 5, 6, 7, 8], dtype=np.int32), first_layer=1)
    gk, gv = gather_all(pv, 1, [1, 2], 5)
    np.testing.assert_array_equal(gk, k.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(gv, v.astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("dtype,minimum,steps", [(kv.DType.int8, False, 127), (kv.DType.int4, True, 15),
                                                 (kv.DType.int2, True, 3)])
def test_a_quantized_pool_is_written_quantized_and_read_back_dequantized(dtype, minimum, steps):
    d, group = 64, 32
    assert kv.code_max(dtype, minimum) == steps  # what a group's scale maps its range to
    side = kv.SideFormat(kv.Scales.group, group, minimum=minimum)
    g = kv.Geometry(num_layers=1, num_kv_heads=H, head_dim=d, block_size=B, dtype=dtype, format=kv.KvFormat(side, side))
    assert g.format == kv.KvFormat(side, side) and g.row_bytes == d * {kv.DType.int8: 8, kv.DType.int4: 4, kv.DType.int2: 2}[dtype] // 8
    mem = np.zeros(g.pool_bytes(N), dtype=np.uint8)
    pv = kv.PoolView(g, mem, N)
    rng = np.random.default_rng(5)
    k = rng.standard_normal((6, H, d), dtype=np.float32)
    k[..., 3] *= 20  # an outlier channel
    v = rng.standard_normal((6, H, d), dtype=np.float32)
    kv.scatter(pv, k, v, np.array([8, 9, 10, 11, 20, 21], dtype=np.int32))
    gk = np.zeros((6, H, d), dtype=np.float32)
    gv = np.zeros_like(gk)
    kv.gather(pv, 0, np.array([0, 2], dtype=np.int32), np.array([2, 5], dtype=np.int32),
              np.array([0, 6], dtype=np.int32), gk, gv)
    for want, got in ((k, gk), (v, gv)):
        groups = want.reshape(6, H, d // group, group)
        span = groups.max(-1) - groups.min(-1) if minimum else np.abs(groups).max(-1)
        step = span / steps  # one code step per group
        err = np.abs(got - want).reshape(groups.shape).max(-1)
        # Half a step, plus what rounding the scale and minimum to f16 moves the top code (under 0.07 of a step).
        assert (err <= step * 0.6).all() and (err > 0).any()
    with pytest.raises(kv.InvalidArgument, match=r"format.k.scales \(an integer code needs scales\)"):
        kv.Geometry(num_layers=1, num_kv_heads=H, head_dim=d, dtype=kv.DType.int8)


def test_channel_keys_are_sealed_a_block_at_a_time_and_read_back_per_channel():
    """KIVI's keys: 2-bit codes with a scale and minimum per (block, head, channel)."""
    d, b = 32, 16
    k_side, v_side = kv.SideFormat(kv.Scales.channel, minimum=True), kv.SideFormat(kv.Scales.group, 32, minimum=True)
    g = kv.Geometry(num_layers=1, num_kv_heads=H, head_dim=d, block_size=b, dtype=kv.DType.int2,
                    format=kv.KvFormat(k_side, v_side))
    assert repr(g.format.k) == "SideFormat(Scales.channel, 0, minimum=True)"
    mem = np.zeros(g.pool_bytes(4), dtype=np.uint8)
    pv = kv.PoolView(g, mem, 4)
    rng = np.random.default_rng(7)
    k = rng.standard_normal((2 * b, H, d), dtype=np.float32)
    k[..., 5] *= 40  # an outlier channel: only its own range widens
    v = rng.standard_normal((2 * b, H, d), dtype=np.float32)
    kv.seal_blocks(pv, k, v, np.array([3, 1], dtype=np.int32))
    gk, gv = np.zeros_like(k), np.zeros_like(v)
    kv.gather(pv, 0, np.array([0, 2], dtype=np.int32), np.array([3, 1], dtype=np.int32),
              np.array([0, 2 * b], dtype=np.int32), gk, gv)
    blocks = k.reshape(2, b, H, d)
    step = (blocks.max(1) - blocks.min(1)) / 3  # a code step per (block, head, channel)
    err = np.abs(gk - k).reshape(blocks.shape).max(1)
    assert (err <= step * 0.6).all()
    with pytest.raises(kv.InvalidArgument, match=r"cache.format \(a channel-scaled side is written by seal_blocks\)"):
        kv.scatter(pv, k[:1], v[:1], np.array([4], dtype=np.int32))
    before = mem.copy()
    with pytest.raises(kv.InvalidArgument, match=r"k.tokens \(len\(blocks\) x block_size\)"):
        kv.seal_blocks(pv, k[:b + 1], v[:b + 1], np.array([2], dtype=np.int32))
    with pytest.raises(kv.InvalidArgument, match=r"blocks \(outside the pool\)=4"):
        kv.seal_blocks(pv, k[:b], v[:b], np.array([4], dtype=np.int32))
    np.testing.assert_array_equal(mem, before)


def test_engine_held_scales_per_layer_and_head():
    head, tensor = kv.SideFormat(kv.Scales.head), kv.SideFormat(kv.Scales.tensor)
    g = kv.Geometry(num_layers=L, num_kv_heads=H, head_dim=D, block_size=B, dtype=kv.DType.int8,
                    format=kv.KvFormat(head, tensor))
    pv = kv.PoolView(g, np.zeros(g.pool_bytes(N), dtype=np.uint8), N)
    rng = np.random.default_rng(3)
    k = rng.standard_normal((L, 4, H, D), dtype=np.float32) * np.array([1, 8], dtype=np.float32)[None, None, :, None]
    v = rng.standard_normal((L, 4, H, D), dtype=np.float32)
    k_scales = (np.abs(k).max(axis=(1, 3)) / 127).astype(np.float32)  # [layers, heads]: each head's own range
    v_scales = (np.abs(v).max(axis=(1, 2, 3)) / 127).astype(np.float32)  # [layers]
    kv.scatter(pv, k, v, np.array([4, 5, 6, 7], dtype=np.int32), k_scales=k_scales, v_scales=v_scales)
    gk, gv = np.zeros((4, H, D), dtype=np.float32), np.zeros((4, H, D), dtype=np.float32)
    kv.gather(pv, 1, np.array([0, 1], dtype=np.int32), np.array([1], dtype=np.int32), np.array([0, 4], dtype=np.int32),
              gk, gv, k_scales=k_scales, v_scales=v_scales)
    assert (np.abs(gk - k[1]) <= k_scales[1][None, :, None] * 0.5001).all()
    assert (np.abs(gv - v[1]) <= v_scales[1] * 0.5001).all()
    with pytest.raises(kv.InvalidArgument, match="k_scales_at=1"):
        kv.scatter(pv, k, v, np.array([4, 5, 6, 7], dtype=np.int32), k_scales=np.array([1, 0, 1, 1], dtype=np.float32))
    plain = pool()[2]
    with pytest.raises(kv.InvalidArgument, match=r"k_scales \(format.k holds no engine-held scales\)"):
        kv.scatter(plain, k, v, np.array([4, 5, 6, 7], dtype=np.int32), k_scales=k_scales.reshape(-1))


def test_bad_calls_are_typed_errors_that_write_nothing():
    g, mem, pv = pool()
    k = np.ones((2, H, D), dtype=np.float32)
    before = mem.copy()
    cases = [
        (lambda: kv.scatter(pv, k, k, np.array([4, N * B], dtype=np.int32)), kv.InvalidArgument, "slot \\(past the pool\\)=%d" % (N * B)),
        (lambda: kv.scatter(pv, k, k, np.array([4, 5], dtype=np.int64)), kv.InvalidArgument, "slots must be int32"),
        (lambda: kv.scatter(pv, np.ones((2, H + 1, D), dtype=np.float32), k, np.array([4, 5], dtype=np.int32)),
         kv.InvalidArgument, "k=3"),
        (lambda: kv.scatter(pv, k, k.astype(np.float16), np.array([4, 5], dtype=np.int32)), kv.InvalidArgument, "v must be"),
        (lambda: kv.scatter(pv, k.astype(np.int32), k, np.array([4, 5], dtype=np.int32)), kv.InvalidArgument, "float32"),
        (lambda: kv.compaction(pv, np.array([[4, N * B]], dtype=np.int32)), kv.InvalidArgument, "moves=0"),
        (lambda: kv.block_copy(pv, pv, np.array([[1, N]], dtype=np.int32)), kv.InvalidArgument, "pairs.dst=0"),
        (lambda: kv.block_copy(pv, pv, np.array([[1, 2]], dtype=np.int32), first_layer=L), kv.InvalidArgument, "first_layer=%d" % L),
        (lambda: kv.block_copy(pv, pv, np.array([[1, 2]], dtype=np.int32), layers=L + 1), kv.InvalidArgument, "layers=%d" % (L + 1)),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()
        np.testing.assert_array_equal(mem, before)
    with pytest.raises(kv.InvalidArgument, match="memory.nbytes"):
        kv.PoolView(g, np.zeros(10, dtype=np.uint8), N)


def test_a_tensor_where_no_kernel_runs_is_named_and_conversions_still_apply():
    torch = pytest.importorskip("torch")
    g, mem, pv = pool()
    k = np.ones((2, H, D), dtype=np.float32)
    slots = np.array([4, 5], dtype=np.int32)
    meta = torch.empty((2, H, D), device="meta")
    with pytest.raises(kv.InvalidArgument, match="k must be a CPU or CUDA tensor, not one on 'meta'"):
        kv.scatter(pv, meta, k, slots)
    with pytest.raises(kv.InvalidArgument, match="v must be a CPU or CUDA tensor, not one on 'meta'"):
        kv.scatter(pv, k, v=meta, slots=slots)
    with pytest.raises(TypeError):  # not a tensor at all: nanobind's own message
        kv.scatter(pv, "k", k, slots)
    with pytest.raises(kv.InvalidArgument, match="memory must be a CPU or CUDA tensor, not one on 'meta'"):
        kv.PoolView(g, torch.empty(g.pool_bytes(N), dtype=torch.uint8, device="meta"), N)
    kv.scatter(pv, k, -k, slots, k_scale=1)  # an int where a float is taken: converted as before
    got, _ = gather_all(pv, 0, [1], 2)
    np.testing.assert_array_equal(got, k)


def test_compaction_moves_the_rows_of_a_head_range():
    g, mem, pv = pool()
    k = np.arange(8 * H * D, dtype=np.float32).reshape(8, H, D)
    kv.scatter(pv, k, -k, np.arange(4, 12, dtype=np.int32))  # layer 0, blocks 1-2
    kv.compaction(pv, np.array([[11, 4], [10, 5]], dtype=np.int32), num_layers=1, first_head=1, num_heads=1)
    gk, gv = gather_all(pv, 0, [1, 2], 8)
    want = k.copy()
    want[0, 1], want[1, 1] = k[7, 1], k[6, 1]  # head 1 only
    np.testing.assert_array_equal(gk, want)
    np.testing.assert_array_equal(gv, -want)


def test_block_copy_copies_every_layer():
    g, mem, pv = pool()
    for layer in range(L):
        kv.scatter(pv, np.full((B, H, D), layer + 1, dtype=np.float32), np.full((B, H, D), -1, dtype=np.float32),
                   np.arange(4, 8, dtype=np.int32), first_layer=layer)
    kv.block_copy(pv, pv, np.array([[1, 7]], dtype=np.int32))
    for layer in range(L):
        a, _ = gather_all(pv, layer, [1], B)
        b, _ = gather_all(pv, layer, [7], B)
        np.testing.assert_array_equal(a, b)


def test_block_copy_layer_by_layer():
    g, mem, pv = pool()
    for layer in range(L):
        kv.scatter(pv, np.full((B, H, D), layer + 1, dtype=np.float32), np.full((B, H, D), -1, dtype=np.float32),
                   np.arange(4, 8, dtype=np.int32), first_layer=layer)
    for layer in range(L):  # an onboard that lets attention of each layer start once its blocks arrived
        kv.block_copy(pv, pv, np.array([[1, 6]], dtype=np.int32), first_layer=layer, layers=1)
        for seen in range(L):
            a, _ = gather_all(pv, seen, [1], B)
            b, _ = gather_all(pv, seen, [6], B)
            assert np.array_equal(a, b) == (seen <= layer)


def test_rope_rotates_keys_by_their_delta():
    g, mem, pv = pool()
    rng = np.random.default_rng(2)
    k = rng.standard_normal((B, H, D), dtype=np.float32)
    kv.scatter(pv, k, k, np.arange(12, 16, dtype=np.int32))  # block 3, layer 0
    max_delta, theta = 8, 10000.0
    cos = np.zeros((max_delta + 1) * D // 2, dtype=np.float32)
    sin = np.zeros_like(cos)
    kv.make_rope_table(theta, D, max_delta, cos, sin)
    kv.rope(pv, np.array([3], dtype=np.int32), np.array([-5], dtype=np.int32), cos, sin, max_delta, num_layers=1)
    gk, _ = gather_all(pv, 0, [3], B)
    angle = -5 * theta ** (-2.0 * np.arange(D // 2) / D)  # NeoX pairs (i, i + D/2)
    x, y = k[..., : D // 2].astype(np.float64), k[..., D // 2:].astype(np.float64)
    want = np.concatenate([x * np.cos(angle) - y * np.sin(angle), y * np.cos(angle) + x * np.sin(angle)], axis=-1)
    np.testing.assert_allclose(gk, want, rtol=1e-5, atol=1e-5)


def test_scores_sum_attention_over_heads_and_queries():
    rng = np.random.default_rng(3)
    attn = rng.random((2, 3, 4, 10), dtype=np.float32)
    lengths = np.array([10, 6], dtype=np.int32)
    out = np.full((2, 10), -1, dtype=np.float32)
    kv.scores(attn, lengths, out)
    want = attn.astype(np.float64).sum(axis=(1, 2))
    np.testing.assert_allclose(out[0], want[0], rtol=1e-6)
    np.testing.assert_allclose(out[1, :6], want[1, :6], rtol=1e-6)
