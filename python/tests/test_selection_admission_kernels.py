"""Quest's and Write-Gated KV's kernels from Python against numpy references:
page key bounds (recomputed and kept incrementally), the pages a decode query
reads, the gate MLP, and the ring write that promotes the token it replaces."""
import math

import numpy as np
import pytest

import kvcache as kv

L, H, D, B, N = 2, 2, 8, 4, 12


def pool():
    g = kv.Geometry(num_layers=L, num_kv_heads=H, head_dim=D, block_size=B, dtype=kv.DType.f32)
    mem = np.zeros(g.pool_bytes(N), dtype=np.uint8)
    return mem, kv.PoolView(g, mem, N)


def test_page_bounds_recomputed_and_kept_incrementally_agree_with_numpy():
    mem, pv = pool()
    rng = np.random.default_rng(4)
    k = rng.standard_normal((6, H, D), dtype=np.float32)
    slots = np.array([12, 13, 14, 15, 20, 21], dtype=np.int32)  # page 3 full, page 5 holds 2
    kv.scatter(pv, k, k, slots)
    bounds = np.zeros((N, H, 2, D), dtype=np.float32)
    kv.page_bounds(pv, 0, np.array([3, 5], dtype=np.int32), np.array([4, 2], dtype=np.int32), bounds)
    for page, rows in [(3, k[:4]), (5, k[4:])]:
        np.testing.assert_array_equal(bounds[page, :, 0], rows.max(axis=0))
        np.testing.assert_array_equal(bounds[page, :, 1], rows.min(axis=0))
    assert not bounds[[0, 1, 2, 4, 6]].any()  # pages not listed are untouched
    kept = np.zeros_like(bounds)
    kv.page_bounds_update(pv, 0, slots, kept)  # after the appending scatter
    np.testing.assert_array_equal(kept, bounds)
    with pytest.raises(kv.InvalidArgument, match="bounds=10"):
        kv.page_bounds(pv, 0, np.array([3], dtype=np.int32), np.array([4], dtype=np.int32), np.zeros(10, dtype=np.float32))


def test_page_select_reads_the_forced_and_the_best_bounded_pages():
    rng = np.random.default_rng(5)
    blocks, group, budget = 10, 2, 4
    bounds = rng.standard_normal((blocks, H, 2, D), dtype=np.float32)
    bounds[:, :, 1] = np.minimum(bounds[:, :, 0], bounds[:, :, 1])  # max >= min
    queries = rng.standard_normal((1, H, group, D), dtype=np.float32)
    pages = np.array([9, 1, 2, 3, 4, 5, 6, 7], dtype=np.int32)  # logical order
    indptr = np.array([0, 8], dtype=np.int32)
    out_indptr, out_indices = kv.page_select(bounds, queries, indptr, pages, budget)
    assert out_indptr.tolist() == [0, 4, 8]
    for h in range(H):
        def bound(block):
            q = queries[0, h].astype(np.float64)
            kmax, kmin = bounds[block, h, 0], bounds[block, h, 1]
            return max(np.maximum(qq * kmax, qq * kmin).sum() for qq in q)
        middle = sorted(range(1, 7), key=lambda i: (-bound(pages[i]), i))[:budget - 2]
        want = [pages[i] for i in sorted([0, 7] + middle)]
        assert out_indices[out_indptr[h]:out_indptr[h + 1]].tolist() == want
    with pytest.raises(kv.InvalidArgument, match="budget"):
        kv.page_select(bounds, queries, indptr, pages, 1)  # below first_pages + last_pages
    assert kv.page_select_scratch_bytes(8, H) > 0


def test_write_gate_is_the_paper_mlp():
    rng = np.random.default_rng(6)
    hidden, tokens, eps, floor = 16, 5, 1e-6, 1e-3
    f = lambda *s: (0.3 * rng.standard_normal(s)).astype(np.float32)  # noqa: E731
    norm_pre, norm_post, w1, b1, w2, b2 = f(D), f(D), f(H, 2 * D, hidden), f(H, hidden), f(H, hidden), f(H)
    weights = kv.WriteGateWeights(norm_pre, norm_post, w1, b1, w2, b2, norm_eps=eps, min_gate=floor)
    k_pre, k_post = f(tokens, H, D), f(tokens, H, D)
    gates = np.zeros((tokens, H), dtype=np.float32)
    kv.write_gate(weights, k_pre, k_post, gates)

    def rms(x, w):
        x = x.astype(np.float64)
        return x / np.sqrt((x * x).mean() + eps) * w
    erf = np.vectorize(math.erf)
    for t in range(tokens):
        for h in range(H):
            x = np.concatenate([rms(k_pre[t, h], norm_pre), rms(k_post[t, h], norm_post)])
            a = x @ w1[h] + b1[h]
            z = (0.5 * a * (1 + erf(a / math.sqrt(2)))) @ w2[h] + b2[h]
            assert gates[t, h] == pytest.approx(max(1 / (1 + math.exp(-z)), floor), abs=2e-6)
    with pytest.raises(kv.InvalidArgument, match="k_pre.shape"):
        kv.write_gate(weights, f(tokens, H + 1, D), f(tokens, H + 1, D), gates)


def test_ring_write_promotes_the_token_it_replaces():
    mem, pv = pool()
    old = np.full((1, H, D), 1.0, dtype=np.float32)
    new = np.full((1, H, D), 2.0, dtype=np.float32)
    kv.scatter(pv, old, -old, np.array([4], dtype=np.int32))
    kv.ring_write(pv, new, -new, np.array([4], dtype=np.int32), np.array([9], dtype=np.int32))
    k = np.zeros((B, H, D), dtype=np.float32)
    v = np.zeros_like(k)
    kv.gather(pv, 0, np.array([0, 2], dtype=np.int32), np.array([1, 2], dtype=np.int32), np.array([0, 4], dtype=np.int32), k, v)
    # slot 4 is block 1's first row; slot 9 is block 2's second row (rows 4..7 of the gather: only 4 asked)
    assert (k[0] == 2.0).all() and (v[0] == -2.0).all()
    k2 = np.zeros((B, H, D), dtype=np.float32)
    kv.gather(pv, 0, np.array([0, 1], dtype=np.int32), np.array([2], dtype=np.int32), np.array([0, 4], dtype=np.int32), k2, np.zeros_like(k2))
    assert (k2[1] == 1.0).all()  # the replaced token, promoted first
