"""The composed caches from Python: Write-Gated KV admission (head-paged) and
Quest selection, alone and with eviction, each against a plain reference:
every head's ring and admitted tokens, the K/V read back through the
head-folded exports, the deferred path (allot, ring_admit, reconcile) against
the synchronous write, and Quest's choice against the bound formula."""
import numpy as np
import pytest

import kvcache as kv

L, H, D, B, W, TAU = 2, 2, 4, 4, 8, 0.5


def head_geometry():
    return kv.Geometry(num_layers=1, num_kv_heads=1, head_dim=D, block_size=B, dtype=kv.DType.f32)


def gated(eviction=None, selection=None, at_cap="refuse", num_blocks=256, global_cap=0):
    g = head_geometry()
    cache = kv.Cache(g, num_blocks=num_blocks, max_sequences=4, max_blocks_per_sequence=16,
                     admission=kv.WriteGate(num_layers=L, num_kv_heads=H, local_window=W, tau=TAU,
                                            global_cap=global_cap, at_cap=at_cap),
                     eviction=eviction, selection=selection)
    memory = np.zeros(g.pool_bytes(num_blocks), dtype=np.uint8)
    return cache, kv.PoolView(g, memory, num_blocks), memory


def kv_rows(layer, first, n):
    """K/V of positions first.. of a layer, [n, H, D]: K encodes (layer, position, head), V its negative."""
    pos = np.arange(first, first + n, dtype=np.float32)[:, None, None]
    head = np.arange(H, dtype=np.float32)[None, :, None]
    k = (1000 * layer + pos + head / 10 + np.zeros((1, 1, D), dtype=np.float32)).astype(np.float32)
    return np.ascontiguousarray(k), np.ascontiguousarray(-k)


class Reference:
    """Per (layer, head): the ring (last W positions) and the admitted older positions, in order."""

    def __init__(self):
        self.gates = {(l, h): [] for l in range(L) for h in range(H)}

    def write(self, layer, gates):
        for h in range(H):
            self.gates[layer, h] += list(gates[:, h])

    def held(self, layer, head):
        g = self.gates[layer, head]
        n = len(g)
        ring = list(range(max(0, n - W), n))
        glob = [p for p in range(max(0, n - W)) if g[p] >= TAU]
        return ring, glob


def write_layer(cache, pool, seq, layer, first, gates):
    info, slots, moves, _, copies = cache.write(seq, layer, gates)
    kv.block_copy(pool, pool, copies[:info.copies])
    kv.compaction(pool, moves[:info.moves])
    k, v = kv_rows(layer, first, len(gates))
    kv.scatter(pool, k.reshape(-1, 1, D), v.reshape(-1, 1, D), slots)  # -1: dropped
    return info


def check_heads(cache, pool, seq, ref):
    """positions() against the reference, and every row's K/V read back through export_heads_csr + gather."""
    seqs = np.array([seq], dtype=np.uint64)
    for layer in range(L):
        indptr, indices, last, _ = cache.export_heads_csr(seqs, layer)
        lengths = cache.export_heads_lengths(seqs, layer)
        for h in range(H):
            ring, glob = ref.held(layer, h)
            pos = cache.positions(seq, layer, h)
            assert sorted(pos[:len(ring)]) == ring and pos[len(ring):] == glob, (layer, h)
            assert lengths[h] == len(pos) == cache.tokens_held(seq, layer, h)
            rows = int(lengths[h])
            k_out = np.zeros((rows, 1, D), dtype=np.float32)
            v_out = np.zeros_like(k_out)
            kv.gather(pool, 0, indptr[h:h + 2] - indptr[h], indices[indptr[h]:indptr[h + 1]],
                      np.array([0, rows], dtype=np.int32), k_out, v_out)
            want = np.array([1000 * layer + p + h / 10 for p in pos], dtype=np.float32)
            np.testing.assert_array_equal(k_out[:, 0, 0], want)
            np.testing.assert_array_equal(v_out[:, 0, 0], -want)
    cache.check_invariants()


def test_write_places_every_token_by_its_gate():
    rng = np.random.default_rng(1)
    cache, pool, _ = gated()
    seq = cache.add_sequence()
    ref, at = Reference(), 0
    for n in [3, 12, 1, 1, 5, 9, 1, 2, 16, 1]:  # chunks longer than the ring send early tokens straight to global
        for layer in range(L):
            gates = rng.random((n, H), dtype=np.float32)
            write_layer(cache, pool, seq, layer, at, gates)
            ref.write(layer, gates)
        at += n
        check_heads(cache, pool, seq, ref)
    assert cache.tokens_held(seq) == sum(cache.tokens_held(seq, l, h) for l in range(L) for h in range(H))
    ring, glob, _ = cache.head_state(seq, 0, 0)
    assert ring == W and glob == len(ref.held(0, 0)[1])
    cache.free(seq)
    assert cache.free_blocks == 255


def test_write_batch_equals_write_per_sequence():
    rng = np.random.default_rng(2)
    a, pool_a, _ = gated()
    b, pool_b, _ = gated()
    seqs_a = [a.add_sequence() for _ in range(3)]
    seqs_b = np.array([b.add_sequence() for _ in range(3)], dtype=np.uint64)
    for step in range(20):
        for layer in range(L):
            gates = rng.random((3, H), dtype=np.float32)
            for i, s in enumerate(seqs_a):
                write_layer(a, pool_a, s, layer, step, gates[i:i + 1])
            info, slots, moves, promote, copies = b.write_batch(seqs_b, layer, gates, promote=True)
            assert info.copies == 0 and promote.shape == (3 * H,)
            k, v = kv_rows(layer, step, 1)
            k3, v3 = np.repeat(k, 3, axis=0), np.repeat(v, 3, axis=0)
            kv.ring_write(pool_b, k3.reshape(-1, 1, D), v3.reshape(-1, 1, D), slots, promote)  # moves + tokens, one call
    for i in range(3):
        for layer in range(L):
            for h in range(H):
                assert a.positions(seqs_a[i], layer, h) == b.positions(int(seqs_b[i]), layer, h)
    ia, xa, _, _ = a.export_heads_csr(np.array(seqs_a, dtype=np.uint64), -1)
    ib, xb, _, _ = b.export_heads_csr(seqs_b, -1)
    assert np.diff(ia).tolist() == np.diff(ib).tolist()


def test_deferred_write_matches_the_synchronous_one():
    """allot (no gates) -> ring_admit on the rows with the device state -> reconcile with the gates."""
    rng = np.random.default_rng(3)
    sync, pool_s, _ = gated(at_cap="drop")
    lazy, pool_l, _ = gated(at_cap="drop")
    s1, s2 = sync.add_sequence(), lazy.add_sequence()
    ref = Reference()
    global_len = np.zeros((L, H), dtype=np.int32)
    bits = np.zeros((L, H, W), dtype=np.uint8)
    pending = []
    at = 0
    for n in [5, 1, 1, 12, 1, 3, 1]:
        for layer in range(L):
            gates = rng.random((n, H), dtype=np.float32)
            write_layer(sync, pool_s, s1, layer, at, gates)
            ref.write(layer, gates)
            info, start, length, copies = lazy.allot(s2, layer, n)
            assert info.copies == 0
            rows = lazy.export_heads_block_table(np.array([s2], dtype=np.uint64), layer, 16)
            k, v = kv_rows(layer, at, n)
            params = lazy.ring_admit_params()  # W, the effective cap (the config says 0: the row) and tau
            assert (params.window, params.global_limit, params.tau) == (W, 16 * B - W, pytest.approx(TAU))
            kv.ring_admit(pool_l, k, v, gates, params, start, length, global_len[layer], bits[layer], rows)
            pending.append((layer, gates))
            assert lazy.pending_writes(s2, layer) >= 1
        at += n
        if len(pending) >= 4:  # the host catches up two chunks late
            for layer, gates in pending:
                lazy.reconcile(s2, layer, gates)
            pending.clear()
    for layer, gates in pending:
        lazy.reconcile(s2, layer, gates)
    check_heads(sync, pool_s, s1, ref)
    check_heads(lazy, pool_l, s2, ref)
    for layer in range(L):
        for h in range(H):
            assert global_len[layer, h] == lazy.head_state(s2, layer, h)[1]


def test_bad_gates_and_combinations_are_typed_errors_that_change_nothing():
    cache, pool, _ = gated()
    seq = cache.add_sequence()
    write_layer(cache, pool, seq, 0, 0, np.full((3, H), 0.9, dtype=np.float32))
    before = [cache.positions(seq, 0, h) for h in range(H)], cache.free_blocks
    bad = np.full((2, H), 0.9, dtype=np.float32)
    bad[1, 1] = np.nan
    with pytest.raises(kv.InvalidArgument, match="gates_at"):
        cache.write(seq, 0, bad)
    with pytest.raises(kv.InvalidArgument, match="layer"):
        cache.write(seq, L, bad[:1])
    with pytest.raises(kv.BufferTooSmall, match=r"slots=1 \(limit 2\)"):
        cache.write(seq, 0, bad[:1], slots=np.zeros(1, dtype=np.int32))
    assert ([cache.positions(seq, 0, h) for h in range(H)], cache.free_blocks) == before
    with pytest.raises(kv.InvalidArgument, match="does not compose with WriteGate"):
        gated(eviction=kv.SlidingWindow(16))
    with pytest.raises(kv.InvalidArgument, match="does not compose with WriteGate"):
        gated(eviction=kv.BlockScores(start=4, recent=4, max=12))
    with pytest.raises(kv.InvalidArgument, match="at_cap"):
        kv.WriteGate(num_layers=1, num_kv_heads=1, at_cap="sometimes")
    with pytest.raises(kv.InvalidArgument, match="local_window"):
        gated_geometry_window = kv.WriteGate(num_layers=1, num_kv_heads=1, local_window=6)
        kv.Cache(head_geometry(), num_blocks=16, max_sequences=1, admission=gated_geometry_window)
    with pytest.raises(kv.InvalidArgument, match="bounds"):
        kv.Cache(head_geometry(), num_blocks=16, bounds=np.zeros(4, dtype=np.float32))


def test_h2o_evicts_each_head_rows_global_region():
    rng = np.random.default_rng(4)
    cache, pool, _ = gated(eviction=kv.H2O(heavy=4, recent=0))
    seq = cache.add_sequence()
    at = 0
    for n in [16, 4, 4, 4]:
        for layer in range(L):
            gates = np.full((n, H), 0.9, dtype=np.float32)  # everything admitted: the region grows
            write_layer(cache, pool, seq, layer, at, gates)
            lengths = cache.export_heads_lengths(np.array([seq], dtype=np.uint64), layer)
            cache.observe(seq, layer, rng.random(int(lengths.sum()), dtype=np.float32))
        at += n
        result, moves = cache.evict(seq)
        kv.compaction(pool, moves[:result.moves])
        for layer in range(L):
            for h in range(H):
                ring, glob, _ = cache.head_state(seq, layer, h)
                assert ring == min(at, W) and glob <= 4
    cache.check_invariants()
    # Each head row's K/V still matches its positions after the compactions.
    seqs = np.array([seq], dtype=np.uint64)
    indptr, indices, _, _ = cache.export_heads_csr(seqs, 1)
    pos = cache.positions(seq, 1, 1)
    k_out = np.zeros((len(pos), 1, D), dtype=np.float32)
    kv.gather(pool, 0, indptr[1:3] - indptr[1], indices[indptr[1]:indptr[2]], np.array([0, len(pos)], dtype=np.int32),
              k_out, np.zeros_like(k_out))
    np.testing.assert_array_equal(k_out[:, 0, 0], np.array([1000 + p + 1 / 10 for p in pos], dtype=np.float32))
    with pytest.raises(kv.InvalidArgument, match="scores"):
        cache.observe(seq, 0, np.zeros(3, dtype=np.float32))


def quest_bound(bounds, q, block, h):
    kmax, kmin = bounds[block, h, 0].astype(np.float64), bounds[block, h, 1].astype(np.float64)
    return max(np.maximum(qq * kmax, qq * kmin).sum() for qq in q.astype(np.float64))


def test_quest_cache_selects_the_best_bounded_pages():
    rng = np.random.default_rng(5)
    layers, heads, group, budget_pages = 3, 2, 2, 3
    g = kv.Geometry(num_layers=layers, num_kv_heads=heads, head_dim=D, block_size=B, dtype=kv.DType.f32)
    quest = kv.Quest(token_budget=budget_pages * B, dense_layers=1, query_group=group)
    cache = kv.Cache(g, num_blocks=64, max_sequences=4, eviction=kv.H2O(heavy=12, recent=4, groups=heads),
                     selection=quest)
    memory = np.zeros(g.pool_bytes(64), dtype=np.uint8)
    pool = kv.PoolView(g, memory, 64)
    seqs = np.array([cache.add_sequence() for _ in range(2)], dtype=np.uint64)
    for s, n in zip(seqs, [22, 13]):
        slots, _, _ = cache.reserve(int(s), n)
        for layer in range(layers):
            k = rng.standard_normal((n, heads, D), dtype=np.float32)
            kv.scatter(pool, k, k, slots, first_layer=layer)
            view = cache.page_bounds(layer)
            assert view.shape == (64, heads, 2, D) and view.base is not None
            kv.page_bounds_update(pool, layer, slots, view)  # writes the cache's own store
    queries = rng.standard_normal((2, heads, group, D), dtype=np.float32)
    for layer in range(layers):
        indptr, indices, n = cache.select(seqs, layer, queries)
        bounds = cache.page_bounds(layer)
        for r, s in enumerate(seqs):
            _, pages, _, _ = cache.export_csr(np.array([s], dtype=np.uint64))
            for h in range(heads):
                got = indices[indptr[r * heads + h]:indptr[r * heads + h + 1]].tolist()
                if layer < 1 or len(pages) <= budget_pages:  # a dense layer, or a row within the budget
                    assert got == pages.tolist()
                    continue
                middle = sorted(range(1, len(pages) - 1),
                                key=lambda i: (-quest_bound(bounds, queries[r, h], pages[i], h), i))[:budget_pages - 2]
                assert got == [int(pages[i]) for i in sorted([0, len(pages) - 1] + middle)]
        assert n == indptr[-1]
    # An eviction's compaction leaves its pages stale; listing them marks them current.
    seq = int(seqs[0])
    cache.observe(seq, rng.random((heads, 22), dtype=np.float32), "head_attention_sums")
    result, moves, group_moves = cache.evict(seq)
    assert result.moves > 0
    pages, fill, listed = cache.stale_pages(seqs)
    assert listed > 0 and all(0 < f <= B for f in fill[:listed])
    assert cache.stale_pages(seqs)[2] == 0
    with pytest.raises(kv.InvalidArgument, match="queries"):
        cache.select(seqs, 1, queries[:1])
    with pytest.raises(kv.InvalidArgument, match="layer"):
        cache.page_bounds(layers)


def test_quest_bounds_store_is_the_callers_array():
    g = kv.Geometry(num_layers=2, num_kv_heads=2, head_dim=D, block_size=B, dtype=kv.DType.f32)
    store = np.zeros(kv.Quest.bounds_floats(g, 16), dtype=np.float32)
    cache = kv.Cache(g, num_blocks=16, selection=kv.Quest(token_budget=8), bounds=store)
    cache.page_bounds(1)[3, 1, 0, 2] = 7.0
    assert store.reshape(2, 16, 2, 2, D)[1, 3, 1, 0, 2] == 7.0
    with pytest.raises(kv.BufferTooSmall, match="bounds"):
        kv.Cache(g, num_blocks=16, selection=kv.Quest(token_budget=8), bounds=store[:10])


def test_gated_quest_reads_the_ring_and_a_budget_of_global_pages():
    rng = np.random.default_rng(6)
    cache, pool, _ = gated(selection=kv.Quest(token_budget=2 * B, dense_layers=0, query_group=2),
                           eviction=kv.H2O(heavy=64, recent=0))
    seq = cache.add_sequence()
    bounds = cache.page_bounds(0)
    for at in range(40):
        for layer in range(L):
            info = write_layer(cache, pool, seq, layer, at, np.full((1, H), 0.9, dtype=np.float32))
            assert info.copies == 0
    _, _, listed = cache.stale_pages(np.array([seq], dtype=np.uint64))
    # Every page's bounds from scratch (the test's shortcut: page_bounds over all the rows' pages).
    indptr, indices, last, _ = cache.export_heads_csr(np.array([seq], dtype=np.uint64), -1)
    fill = np.full(len(indices), B, dtype=np.int32)
    kv.page_bounds(pool, 0, indices.copy(), fill, bounds)
    queries = rng.standard_normal((1, H, 2, D), dtype=np.float32)
    sel_indptr, sel, n = cache.select(np.array([seq], dtype=np.uint64), 1, queries)
    for h in range(H):
        row = cache.export_heads_csr(np.array([seq], dtype=np.uint64), 1)[1]
        chosen = np.diff(sel_indptr)[h]
        assert W // B + 1 <= chosen <= W // B + 2  # the ring's pages, plus a budget of 2 global pages (forced first/last)
    assert n == sel_indptr[-1] and listed >= 0
