"""Hybrid models from Python: layer groups over one pool (kv.LayerGroups,
kv.HybridCache), each kind's retention and prefix hits, the exports per
group, typed errors that change nothing, and the kernels on a group's view
of the pool (asymmetric K/V, MLA's latent) against the page layout."""
import numpy as np
import pytest

import kvcache as kv


def gemma3():
    full = [l for l in range(62) if l % 6 == 5]
    local = [l for l in range(62) if l % 6 != 5]
    return kv.LayerGroups([kv.LayerGroup("full", full, num_kv_heads=16, head_dim=128),
                           kv.LayerGroup("sliding_window", local, num_kv_heads=16, head_dim=128, window=1024)],
                          block_size=16, block_multiple=16)


def small(window=8):
    return kv.LayerGroups([kv.LayerGroup("full", [0], num_kv_heads=2, head_dim=8),
                           kv.LayerGroup("sliding_window", [1], num_kv_heads=2, head_dim=8, window=window)],
                          block_size=4)


def test_layer_groups_share_one_page_size():
    g = gemma3()
    assert (g.num_groups, g.num_layers) == (2, 62)
    assert g.page_bytes == 52 * 16 * 2 * 16 * 128 * 2
    assert (g.block_size(0), g.block_size(1)) == (80, 16)
    assert g.padding(0) == g.page_bytes - 80 * g.token_bytes(0)
    assert g.layer_slot(11) == (0, 1) and g.layer_slot(6) == (1, 5) and g.layer_slot(62) == (-1, -1)
    assert g.hit_alignment == 80
    # Gemma 3 at 32K tokens, decoding: about a fifth of the all-full KV.
    dense = kv.LayerGroups([kv.LayerGroup("full", list(range(62)), num_kv_heads=16, head_dim=128)], block_size=16)
    share = g.blocks_needed(32768, 1) * g.page_bytes / (dense.blocks_needed(32768, 1) * dense.page_bytes)
    assert 0.18 < share < 0.21
    with pytest.raises(kv.InvalidArgument, match=r"layers \(listed twice\)=0"):
        kv.LayerGroups([kv.LayerGroup("full", [0]), kv.LayerGroup("full", [0, 1])])
    with pytest.raises(kv.InvalidArgument, match="window=0"):
        kv.LayerGroups([kv.LayerGroup("sliding_window", [0])])
    with pytest.raises(kv.InvalidArgument, match="kind"):
        kv.LayerGroup("linear", [0])


def test_a_window_hit_needs_only_the_blocks_its_next_query_reads():
    c = kv.HybridCache(small(), num_blocks=64, max_sequences=4, max_tokens=64)
    prompt = np.arange(100, 133, dtype=np.int32)
    a = c.admit(prompt)
    seq, cached, reserved, slots = a.seq, a.cached_tokens, a.reserved, a.slots
    assert (cached, reserved) == (0, 33) and slots.shape == (2, 33)
    c.computed(seq, 33)
    c.free(seq)
    assert c.match(prompt) == 32
    a = c.admit(prompt)
    seq, cached, reserved, slots = a.seq, a.cached_tokens, a.reserved, a.slots
    assert (cached, reserved) == (32, 1)
    assert c.blocks_held(seq, 1) == 3 and c.blocks_held(seq, 0) == 9  # the window: blocks 6, 7 and the new one
    table = c.export_block_table(1, [seq], 9)
    assert list(table[0, :6]) == [0] * 6 and all(table[0, 6:] > 0)
    indptr, indices, first_pos, nnz = c.export_group_csr(1, [seq])
    assert nnz == 3 and list(first_pos) == [24] and list(indices) == list(table[0, 6:])
    assert list(c.slot_mapping(1, seq, 32, 33)) == [int(slots[1, 0])]
    c.check_invariants()


def test_one_vocabulary_with_cache():
    """admit, reserve, advance and computed take and return on a hybrid cache what they do on Cache,
    and admit's max_new promise, match and tokens mean the same."""
    c = kv.HybridCache(small(), num_blocks=64, max_sequences=4, max_tokens=64)
    prompt = np.arange(100, 113, dtype=np.int32)
    h = c.admit(prompt, max_new=8)
    seq = h.seq
    assert isinstance(h, kv.Admitted) and c.tokens(seq) == h.cached_tokens + h.reserved == 13
    assert h.new_blocks == c.blocks_held(seq, 0) + c.blocks_held(seq, 1) == 8 and h.slots.shape == (2, 13)
    assert h.promised == c.blocks_needed(13, 8) and c.promised_blocks == h.promised - h.new_blocks  # the need not yet held
    c.computed(seq, 13)
    slots, new_blocks, copy = c.reserve(seq, np.array([7, 8, 9], dtype=np.int32))  # 16 tokens: 4 blocks in each group
    assert slots.shape == (2, 3) and new_blocks == 0 and copy == (-1, -1)
    out = np.full((2, 1), -5, dtype=np.int32)
    slots, new_blocks, copy = c.advance(seq, np.array([10], dtype=np.int32), out)  # into the caller's array
    assert slots is out and out.min() > 0 and (new_blocks, copy) == (2, (-1, -1)) and c.computed_tokens(seq) == 16
    c.computed(seq, 17)
    with pytest.raises(kv.InvalidArgument, match="tokens"):
        c.computed(seq, 18)
    with pytest.warns(DeprecationWarning, match="export_group_csr"):
        old = c.export_csr(0, [seq])
    assert [list(a) for a in old[:3]] == [list(a) for a in c.export_group_csr(0, [seq])[:3]]
    g = kv.Geometry(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype=kv.DType.f32)
    tp = kv.Cache(g, num_blocks=32, max_sequences=2, max_blocks_per_sequence=8, publish_on_reserve=True)
    a = tp.admit(prompt)
    assert isinstance(a, kv.Admitted) and (a.cached_tokens, a.reserved, a.new_blocks, a.slots.shape) == (0, 13, 4, (13,))
    assert tp.tokens(a.seq) == 13 and tp.match(prompt) == 12  # three whole blocks published on reserve
    slots, new_blocks, copy = tp.reserve(a.seq, np.array([7, 8, 9], dtype=np.int32))
    assert slots.shape == (3,) and new_blocks == 0 and copy == (-1, -1)
    slots, new_blocks, copy = tp.advance(a.seq, np.array([10], dtype=np.int32))  # publish on reserve: nothing to compute
    assert slots.shape == (1,) and (new_blocks, copy) == (1, (-1, -1)) and tp.tokens(a.seq) == 17
    tp.computed(a.seq, 17)
    with pytest.raises(kv.InvalidArgument, match="tokens"):
        tp.computed(a.seq, 18)
    # The same bad call gets the same words on both: a count past int32, a
    # promise past what one sequence's rows can hold (every group's, on the hybrid).
    for cache, s, most in ((c, seq, 2 * 16), (tp, a.seq, 8)):
        with pytest.raises(kv.InvalidArgument, match=r"n=2147483648 \(limit 2147483647\)"):
            cache.reserve(s, 2 ** 31)
        with pytest.raises(kv.InvalidArgument, match=r"blocks=%d \(limit %d\)" % (most + 1, most)):
            cache.promise(s, most + 1)
        cache.promise(s, most)
        assert cache.promised_blocks == most - cache.blocks_held(s)
        cache.check_invariants()
    c.free(seq)
    assert c.promised_blocks == 0
    c.check_invariants()


def test_prefix_stats_and_reset_prefix_cache_as_on_cache():
    c = kv.HybridCache(small(), num_blocks=64, max_sequences=4, max_tokens=64)
    prompt = np.arange(100, 117, dtype=np.int32)  # 17 tokens: 4 whole blocks in each group
    a = c.admit(prompt)
    c.computed(a.seq, 17)
    c.free(a.seq)
    b = c.admit(prompt)  # a hit of 16: the full group's 4 blocks, the window's last 2
    st = c.prefix_stats()
    assert (st["queries"], st["query_tokens"], st["hit_tokens"], st["hashes"]) == (2, 34, 16, 8)
    assert st["used_hashed"] == 6 and st["free_cached"] == 2  # the window's blocks 0 and 1 stay cached, free
    with pytest.raises(kv.BlocksInUse, match="num_used"):
        c.reset_prefix_cache()
    assert c.prefix_stats() == st  # refused: nothing changed
    c.free(b.seq)
    c.reset_prefix_cache()
    assert c.match(prompt) == 0 and c.prefix_stats()["hashes"] == 0 and c.prefix_stats()["free_cached"] == 0
    c.check_invariants()


def test_advance_batch_is_advance_of_each_entry_in_order():
    a = kv.HybridCache(small(), num_blocks=64, max_sequences=4, max_tokens=64)
    b = kv.HybridCache(small(), num_blocks=64, max_sequences=4, max_tokens=64)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 1000, 5 + 3 * k, dtype=np.int32) for k in range(3)]
    sa = [a.admit(p).seq for p in prompts]
    sb = np.array([b.admit(p).seq for p in prompts], dtype=np.uint64)
    for step in range(12):
        counts = rng.integers(0, 3, 3, dtype=np.int32)
        ids = rng.integers(0, 1000, int(counts.sum()), dtype=np.int32)
        want, at = [], 0
        for k in range(3):
            want.append(a.advance(sa[k], ids[at:at + counts[k]])[0])
            at += counts[k]
        slots, copies, n_copies = b.advance_batch(sb, counts, ids=ids)
        assert slots.shape == (2, at) and n_copies == 0
        assert (slots == np.concatenate(want, axis=1)).all()
        assert [a.usage(g) for g in (0, 1)] == [b.usage(g) for g in (0, 1)]
    out = np.full((2, 4), 9, dtype=np.int32)
    with pytest.raises(kv.DuplicateSequence, match="seqs_at=1"):
        b.advance_batch(np.array([sb[0], sb[0]], dtype=np.uint64), np.array([1, 1], dtype=np.int32), out,
                        ids=np.array([1, 2], dtype=np.int32))
    assert (out == -1).all()  # refused: every slot -1, nothing changed
    assert [a.usage(g) for g in (0, 1)] == [b.usage(g) for g in (0, 1)]
    b.check_invariants()
    g = kv.Geometry(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype=kv.DType.f32)
    tp = kv.Cache(g, num_blocks=32, max_sequences=2, max_blocks_per_sequence=8, publish_on_reserve=True)
    t = tp.admit(prompts[0]).seq
    slots, _, n_copies = tp.advance_batch(np.array([t], dtype=np.uint64), np.array([2], dtype=np.int32),
                                          ids=np.array([3, 4], dtype=np.int32))
    assert slots.shape == (2,) and n_copies == 0 and tp.tokens(t) == 7


def test_block_events_name_their_group_and_reach_the_wire():
    c = kv.HybridCache(small(), num_blocks=64, max_sequences=4, max_tokens=64, event_capacity=32)
    prompt = np.arange(100, 110, dtype=np.int32)
    seq = c.admit(prompt).seq
    c.computed(seq, 10)
    events = c.drain_events()
    assert [(e["kind"], e["group"], e["block_size"]) for e in events] == [("stored", 0, 4)] * 2 + [("stored", 1, 4)] * 2
    assert events[0]["token_ids"] == list(range(100, 104)) and events[3]["token_ids"] == list(range(104, 108))
    assert events[0]["hash"] != events[2]["hash"]  # one chain, keyed by group
    c.free(seq)
    seq = c.admit(prompt + 1).seq
    c.computed(seq, 10)
    wire = c.drain_kv_events(ts=1.0)
    assert wire is not None and b"BlockStored" in wire
    with pytest.raises(kv.InvalidArgument, match="event_capacity=-1"):
        kv.HybridCache(small(), num_blocks=64, max_sequences=4, max_tokens=64, event_capacity=-1)


def test_the_window_frees_on_computed_tokens_only():
    c = kv.HybridCache(small(), num_blocks=64, max_sequences=4, max_tokens=64, prefill_chunk=24)
    t = np.arange(40, dtype=np.int32)
    seq = c.admit(t[:16]).seq
    c.reserve(seq, t[16:24])  # the next chunk before the first is computed (24 in flight): nothing freed
    assert c.blocks_held(seq, 1) == 6
    c.computed(seq, 16)
    c.reserve(seq, t[24:28])
    assert c.blocks_held(seq, 1) == 5 and c.tokens_held(seq, 1) == 20
    assert c.usage(1) == (5, 2) and c.usage(0) == (7, 0)  # blocks 0, 1 were published: free but cached


def test_advance_is_computed_then_reserve_in_one_call():
    a = kv.HybridCache(small(), num_blocks=64, max_sequences=4, max_tokens=64)
    b = kv.HybridCache(small(), num_blocks=64, max_sequences=4, max_tokens=64)
    t = np.arange(40, dtype=np.int32)
    sa = a.admit(t[:10]).seq
    sb = b.admit(t[:10]).seq
    for p in range(10, 30):
        b.computed(sb, p)
        assert (a.advance(sa, t[p:p + 1])[0] == b.reserve(sb, t[p:p + 1])[0]).all()
        assert a.computed_tokens(sa) == p and a.blocks_held(sa, 1) == b.blocks_held(sb, 1)
    assert a.usage(0) == b.usage(0) and a.usage(1) == b.usage(1)
    a.check_invariants()


def test_one_full_group_is_a_geometry_for_cache():
    g = kv.LayerGroups([kv.LayerGroup("full", [0, 1, 2, 3], num_kv_heads=2, head_dim=16)], block_size=8)
    geo = g.as_geometry()
    assert geo.block_bytes == g.page_bytes and geo.num_layers == 4 and geo.kv_planes == 2
    with pytest.raises(kv.InvalidArgument, match=r"groups \(only one runs on Cache<>\)=2"):
        small().as_geometry()


def test_errors_name_the_value_and_change_nothing():
    c = kv.HybridCache(small(), num_blocks=16, max_sequences=2, max_tokens=64)
    t = np.arange(12, dtype=np.int32)
    seq = c.admit(t, reserve=8).seq
    free = c.free_blocks
    with pytest.raises(kv.InvalidArgument, match=r"n_tokens \(prefix caching is on: pass the token ids\)=4"):
        c.reserve(seq, 4)
    with pytest.raises(kv.TruncateTooMany, match="n_tokens=9"):
        c.truncate(seq, 9)
    with pytest.raises(kv.InvalidArgument, match="group=2"):
        c.tokens_held(seq, 2)
    with pytest.raises(kv.InvalidArgument, match=r"tokens \(computed\)=9"):
        c.computed(seq, 9)
    with pytest.raises(kv.OutOfBlocks):
        c.admit(np.arange(1000, 1060, dtype=np.int32))
    assert c.free_blocks == free and c.tokens(seq) == 8
    c.free(seq)
    with pytest.raises(kv.UnknownSequence):
        c.tokens(seq)
    with pytest.raises(kv.InvalidArgument, match="num_blocks=1"):
        kv.HybridCache(small(), num_blocks=1, max_sequences=1, max_tokens=8)


def test_a_block_policy_on_the_global_layers_leaves_holes():
    """eviction=SinkWindow on the full group: its blocks between the sinks and
    the window leave as holes (0 in blocks()), the CSR lists the live ones, the
    window group keeps its own; a sequence that evicted publishes no more."""
    c = kv.HybridCache(small(), num_blocks=64, max_sequences=2, max_tokens=128, eviction=kv.SinkWindow(sinks=4, window=8))
    prompt = np.arange(40, dtype=np.int32)
    seq = c.admit(prompt[:32]).seq
    c.computed(seq, 32)
    res, blocks = c.evict(seq)
    assert res.evicted == 5 and res.rotations == 0 and blocks.tolist() == [1, 2, 3, 4, 5]
    assert c.evicted(seq) and c.tokens_held(seq, 0) == 12 and c.tokens_held(seq, 1) == 32
    row = c.blocks(seq, 0)
    assert row[1:6].tolist() == [0] * 5 and (row[[0, 6, 7]] != 0).all()
    indptr, indices, first_pos, _ = c.export_group_csr(0, np.array([seq], dtype=np.uint64))
    assert indices.tolist() == row[[0, 6, 7]].tolist() and first_pos.tolist() == [20]
    c.reserve(seq, prompt[32:40])
    c.computed(seq, 40)
    assert c.match(prompt) == 32  # what it computed after the eviction is never served
    assert c.computed_before_eviction(seq) == 32 and c.computed_tokens(seq) == 40


def test_host_tiers_over_an_evicting_hybrid_keep_only_what_it_published():
    """kv.GroupTiers over a hybrid with sinks and a window on its full group:
    the blocks a sequence computed after it evicted are never offloaded, so
    a later lookup serves the 32 tokens computed before, not the 48."""
    c = kv.HybridCache(small(), num_blocks=64, max_sequences=2, max_tokens=128, eviction=kv.SinkWindow(sinks=4, window=8))
    tiers = kv.GroupTiers(c, host_blocks=64)
    prompt = np.arange(300, 348, dtype=np.int32)
    seq = c.admit(prompt[:32]).seq
    c.computed(seq, 32)
    assert c.evict(seq)[0].evicted == 5
    c.reserve(seq, prompt[32:48])
    c.computed(seq, 48)
    job = tiers.plan_offload(seq, prompt)
    # Named up to 32 in every group: the full group's 8 published blocks (the 5 it let go still cached), and
    # the window group's 2 that a hit at 32 reads (positions 24..31, let go by its row, still cached).
    assert len(job.moves) == 8 + 2
    tiers.tiers.complete(job.id)
    c.free(seq)
    device_tokens, tokens, _, _ = tiers.lookup(prompt)
    assert tokens == 32


def test_a_hybrid_eviction_refuses_what_it_cannot_serve():
    scored = kv.HybridCache(small(), num_blocks=64, max_sequences=2, max_tokens=64,
                            eviction=kv.BlockScores(start=4, recent=8, max=16))
    seq = scored.admit(np.arange(32, dtype=np.int32)).seq
    scored.computed(seq, 32)
    with pytest.raises(kv.InvalidArgument, match="window, chunked or cross group"):
        scored.observe(seq, 1, np.ones(32, dtype=np.float32))
    with pytest.raises(kv.InvalidArgument, match="scores.size=31"):
        scored.observe(seq, 0, np.ones(31, dtype=np.float32))
    assert scored.evict(seq)[0].evicted == 4 and scored.tokens_held(seq, 0) == 16  # the errors changed nothing
    with pytest.raises(kv.InvalidArgument, match="eviction=H2O"):
        kv.HybridCache(small(), num_blocks=64, max_sequences=2, max_tokens=64, eviction=kv.H2O(heavy=4, recent=4, groups=1))


def test_quest_beside_a_block_policy_ranks_only_the_live_pages():
    c = kv.HybridCache(small(), num_blocks=64, max_sequences=2, max_tokens=64, eviction=kv.SinkWindow(sinks=4, window=8),
                       selection=kv.Quest(token_budget=16, dense_layers=0))
    seq = c.admit(np.arange(32, dtype=np.int32)).seq
    c.computed(seq, 32)
    bounds = c.page_bounds(0)
    for b in range(1, 64):
        bounds[b] = -b  # the null page's zero bounds would outrank every live page
    assert c.evict(seq)[0].evicted == 5
    indptr, picked, n = c.select(np.array([seq], dtype=np.uint64), 0, np.ones((1, 2, 1, 8), dtype=np.float32))
    live = c.blocks(seq, 0)[[0, 6, 7]]
    assert sorted(picked[indptr[0]:indptr[1]].tolist()) == sorted(live.tolist())
    assert type(kv.GroupTiers(c, host_blocks=8)).__name__ == "GroupTiers_Quest_SinkWindow"


def test_the_admission_bound_sizes_the_pool_and_the_ledger_keeps_it():
    g = small()
    blocks = g.pool_blocks(2, 64, 8)
    c = kv.HybridCache(g, num_blocks=blocks, max_sequences=2, max_tokens=64, prefill_chunk=8)
    assert c.max_concurrency(64) == 2 and c.can_admit(64, 0)
    seq = c.admit(np.arange(8, dtype=np.int32)).seq
    c.promise(seq, c.blocks_needed(64, 0))
    assert c.promised_blocks == c.blocks_needed(64, 0) - c.blocks_held(seq)
    assert c.can_admit(64, 0)
    seq2 = c.admit(np.arange(50, 58, dtype=np.int32)).seq
    c.promise(seq2, c.blocks_needed(64, 0))
    assert not c.can_admit(1, 0)


def test_kernels_on_group_views_asymmetric_kv_and_mla():
    g = kv.LayerGroups([kv.LayerGroup("full", [0, 1], num_kv_heads=2, head_dim=8, v_head_dim=4, dtype=kv.DType.f32),
                        kv.LayerGroup("mla", [2, 3, 4], num_kv_heads=1, head_dim=12, dtype=kv.DType.f32)],
                       block_size=4, max_padding_permille=500)
    pages = 6
    memory = np.zeros(pages * g.page_bytes // 4, dtype=np.float32)
    k_view = kv.PoolView.of_group(g, 0, memory, pages, "k")
    v_view = kv.PoolView.of_group(g, 0, memory, pages, "v")
    latent = kv.PoolView.of_group(g, 1, memory, pages, "k")
    assert k_view.kv_planes == 1 and k_view.geometry is None
    with pytest.raises(kv.InvalidArgument, match="K and V differ"):
        kv.PoolView.of_group(g, 0, memory, pages)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((2, 3, 2, 8), dtype=np.float32)  # [layers, tokens, heads, dim]
    v = rng.standard_normal((2, 3, 2, 4), dtype=np.float32)
    c = rng.standard_normal((3, 3, 1, 12), dtype=np.float32)
    slots0 = np.array([4, 5, 7], dtype=np.int32)  # group 0: page 1
    slots1 = np.array([10, 11, 12], dtype=np.int32)  # group 1: pages 2, 3 (block size 5)
    kv.scatter(k_view, k, k, slots0)
    kv.scatter(v_view, v, v, slots0)
    kv.scatter(latent, c, c, slots1)
    # The page layout by hand: [layers][K plane][V plane], NHD, f32.
    page = g.page_bytes // 4
    kp, vp = 4 * 2 * 8, 4 * 2 * 4  # group 0's planes (block size 4)
    for layer in range(2):
        base = 1 * page + layer * (kp + vp)
        for t, slot in enumerate(slots0):
            row = slot % 4
            assert np.array_equal(memory[base + row * 16: base + row * 16 + 16].reshape(2, 8), k[layer, t])
            assert np.array_equal(memory[base + kp + row * 8: base + kp + row * 8 + 8].reshape(2, 4), v[layer, t])
    for layer in range(3):
        for t, slot in enumerate(slots1):
            at = (slot // 5) * page + layer * 5 * 12 + (slot % 5) * 12
            assert np.array_equal(memory[at: at + 12], c[layer, t, 0])


def test_quantized_layer_groups_take_a_format_and_round_trip_through_their_views():
    g32 = kv.SideFormat(kv.Scales.group, 32, False)
    g16m = kv.SideFormat(kv.Scales.group, 16, True)
    g = kv.LayerGroups([kv.LayerGroup("full", [0, 1], num_kv_heads=2, head_dim=64, dtype=kv.DType.int8,
                                      format=kv.KvFormat(g32, g32)),
                        kv.LayerGroup("sliding_window", [2], num_kv_heads=2, head_dim=64, window=32, dtype=kv.DType.int4,
                                      format=kv.KvFormat(g16m, g16m))],
                       block_size=16, max_padding_permille=600)
    assert g.token_bytes(0) == 2 * 2 * 2 * (64 + 4)          # layers x K,V x heads x (codes + 2 f16 scales)
    assert g.token_bytes(1) == 2 * 2 * (32 + 16)             # 4 groups x (scale + minimum)
    # Planes: codes, then the entries from a 16-byte boundary.
    assert g.plane_bytes(0) == (16 * 2 * 64 + 16 * 2 * 4,) * 2
    assert g.page_bytes == 2 * 2 * g.plane_bytes(0)[0]
    with pytest.raises(kv.InvalidArgument, match=r"group=2"):
        g.plane_bytes(2)
    pages = 4
    memory = np.zeros(pages * g.page_bytes, dtype=np.uint8)
    rng = np.random.default_rng(1)
    for grp, step in ((0, 127.0), (1, 15.0)):
        view = kv.PoolView.of_group(g, grp, memory, pages)
        layers = 2 if grp == 0 else 1
        k = rng.standard_normal((layers, 3, 2, 64), dtype=np.float32)
        slots = np.array([g.block_size(grp) + 1, 2 * g.block_size(grp), 2 * g.block_size(grp) + 3], dtype=np.int32)
        kv.scatter(view, k, k, slots)
        # Layer 0 read back through gather: one sequence over pages 1 and 2.
        b = g.block_size(grp)
        out_k = np.zeros((2 * b, 2, 64), dtype=np.float32)
        out_v = np.zeros_like(out_k)
        kv.gather(view, 0, np.array([0, 2], dtype=np.int32), np.array([1, 2], dtype=np.int32),
                  np.array([0, 2 * b], dtype=np.int32), out_k, out_v)
        for t, r in enumerate([1, b, b + 3]):  # the slots' rows in the sequence
            x = k[0, t].reshape(-1, 32 if grp == 0 else 16)
            width = (np.abs(x).max(axis=1) if grp == 0 else x.max(axis=1) - x.min(axis=1)) / step
            assert np.all(np.abs(out_k[r].reshape(x.shape) - x).max(axis=1) <= 0.51 * width + 1e-6)
            assert np.array_equal(out_k[r], out_v[r])  # the same rows went to V
    with pytest.raises(kv.InvalidArgument, match=r"format.k.scales \(an integer code needs scales\)"):
        kv.LayerGroups([kv.LayerGroup("full", [0], head_dim=64, dtype=kv.DType.int8)])
    with pytest.raises(kv.InvalidArgument, match=r"format.v.scales \(the group stores no V\)"):
        kv.LayerGroups([kv.LayerGroup("mla", [0], head_dim=64, dtype=kv.DType.int8, format=kv.KvFormat(g32, g32))])


def test_group_tiers_bring_every_group_back_through_an_import():
    c = kv.HybridCache(small(), num_blocks=40, max_sequences=2, max_tokens=64)
    tiers = kv.GroupTiers(c, host_blocks=32, event_capacity=64)
    prompt = np.arange(100, 141, dtype=np.int32)  # 41 tokens: a hit of 40 (10 full blocks, the window's last 2)
    seq = c.admit(prompt).seq
    c.computed(seq, 41)
    with pytest.raises(kv.InvalidArgument, match="not this sequence's"):
        tiers.plan_offload(seq, prompt + 1)
    job = tiers.plan_offload(seq, prompt)
    assert job.from_tier == "device" and job.to_tier == "host" and len(job.moves) == 10 + 2
    hold = c.hold(job.moves[:, 0])  # the engine copies job.moves (src, dst) here
    c.free(seq)
    tiers.tiers.complete(job.id)
    c.release_hold(hold)
    assert {(e["group"], e["block_size"]) for e in tiers.tiers.drain_events("host")} == {(0, 4), (1, 4)}
    for k in range(3):  # other requests: the device pool recycles the prompt's pages
        other = c.admit(np.arange(5000 + 100 * k, 5060 + 100 * k, dtype=np.int32)).seq
        c.computed(other, 60)
        c.free(other)
    nxt = np.concatenate([prompt, np.array([7], dtype=np.int32)])
    device_tokens, tokens, host, disk = tiers.lookup(nxt)
    assert tokens == 40 and device_tokens < tokens and disk == 0
    imp, cached, blocks = c.import_prompt(nxt[:tokens])
    assert cached == device_tokens and blocks == host  # the import receives what host memory holds for it
    load = tiers.plan_onboard(imp)
    assert len(load.moves) == blocks
    seq, committed, held = tiers.complete_onboard(load.id)
    assert committed and held == 40 and c.tokens(seq) == 40
    with pytest.raises(kv.UnknownJob):
        tiers.complete_onboard(load.id)
    c.free(seq)
    c.check_invariants()
    tiers.tiers.check_invariants()
    with pytest.raises(kv.InvalidArgument, match="prefix_caching"):
        kv.GroupTiers(kv.HybridCache(small(), num_blocks=8, max_sequences=1, max_tokens=16, prefix_caching=False), host_blocks=4)


def test_group_tiers_on_a_quest_cache_list_the_onboarded_pages_stale():
    """kv.GroupTiers over a Quest hybrid: the full group's pages an onboard
    brings in hold K that no page_bounds_update saw, so stale_pages lists
    each of them until page_bounds runs, and their bounds then equal the
    ones the prompt's own pages had before they were offloaded."""
    lg = small()
    c = kv.HybridCache(lg, num_blocks=40, max_sequences=2, max_tokens=64, selection=kv.Quest(token_budget=8, dense_layers=0))
    tiers = kv.GroupTiers(c, host_blocks=32)
    assert type(tiers).__name__ == "GroupTiers_Quest"
    P = lg.page_bytes
    device, host = np.zeros(40 * P, dtype=np.uint8), np.zeros(32 * P, dtype=np.uint8)
    view = kv.PoolView.of_group(lg, 0, device, 40)

    def copy(dst, src, moves):
        for a, b in moves[:, :2].tolist():
            dst[b * P:(b + 1) * P] = src[a * P:(a + 1) * P]

    prompt = np.arange(100, 133, dtype=np.int32)  # 33 tokens: a hit of 32, 8 pages of the full group
    a = c.admit(prompt)
    seq, n, slots = a.seq, a.reserved, a.slots
    k = np.random.default_rng(3).standard_normal((n, 2, 8), dtype=np.float32)
    kv.scatter(view, k, k, slots[0], first_layer=0)
    kv.page_bounds_update(view, 0, slots[0], c.page_bounds(0))
    c.computed(seq, 33)
    before = c.page_bounds(0)[c.export_block_table(0, [seq], 9)[0][:8]].copy()  # the 8 full pages
    job = tiers.plan_offload(seq, prompt)
    copy(host, device, job.moves)
    hold = c.hold(job.moves[:, 0])
    c.free(seq)
    tiers.tiers.complete(job.id)
    c.release_hold(hold)
    for j in range(3):  # other requests: the device pool recycles the prompt's pages
        other = c.admit(np.arange(5000 + 100 * j, 5060 + 100 * j, dtype=np.int32)).seq
        c.computed(other, 60)
        c.free(other)
    device_tokens, tokens, _, _ = tiers.lookup(prompt)
    assert tokens == 32 and device_tokens < tokens
    imp, _, _ = c.import_prompt(prompt[:tokens])
    load = tiers.plan_onboard(imp)
    copy(device, host, load.moves)
    s2, committed, held = tiers.complete_onboard(load.id)
    assert committed and held == 32
    row = c.export_block_table(0, [s2], 8)[0]
    pages, fill, listed = c.stale_pages(np.array([s2], dtype=np.uint64))
    first = device_tokens // 4  # the device's own hit pages kept their bounds
    assert list(pages[:listed]) == list(row[first:]) and list(fill[:listed]) == [4] * listed
    kv.page_bounds(view, 0, pages[:listed], fill[:listed], c.page_bounds(0))
    assert np.array_equal(c.page_bounds(0)[row], before)
    assert c.stale_pages(np.array([s2], dtype=np.uint64))[2] == 0
    with pytest.raises(kv.InvalidArgument, match="a HybridCache"):
        kv.GroupTiers(kv.Tiers(host_blocks=4), host_blocks=4)
    c.free(s2)
    c.check_invariants()
    tiers.tiers.check_invariants()


def test_quest_on_the_global_layers_selects_within_the_budget_and_lists_received_pages():
    """kv.HybridCache(..., selection=kv.Quest(...)): the full group's layer
    has a bounds slice, a decoded query reads its budget of pages (first,
    best-bounded, last), a window layer is refused, and an import's
    received pages are listed stale until bounded."""
    lg = small(window=8)
    assert lg.global_geometry().num_layers == 1
    c = kv.HybridCache(lg, num_blocks=40, max_sequences=2, max_tokens=64, selection=kv.Quest(token_budget=12, dense_layers=0))
    view = kv.PoolView.of_group(lg, 0, np.zeros(40 * lg.page_bytes, dtype=np.uint8), 40)
    assert c.page_bounds(0).shape == (40, 2, 2, 8)
    with pytest.raises(kv.InvalidArgument, match="layer"):
        c.page_bounds(1)  # a window layer has no bounds
    prompt = np.arange(1, 33, dtype=np.int32)
    a = c.admit(prompt)
    seq, cached, n, slots = a.seq, a.cached_tokens, a.reserved, a.slots
    rng = np.random.default_rng(0)
    k = rng.standard_normal((n, 2, 8), dtype=np.float32)
    kv.scatter(view, k, k, slots[0], first_layer=0)
    kv.page_bounds_update(view, 0, slots[0], c.page_bounds(0))
    c.computed(seq, 32)
    pages, fill, listed = c.stale_pages(np.array([seq], dtype=np.uint64))
    assert listed == 0
    q = rng.standard_normal((1, 2, 1, 8), dtype=np.float32)
    indptr, indices, total = c.select(np.array([seq], dtype=np.uint64), 0, q)
    row = c.export_block_table(0, [seq], 8)[0]
    assert total == 6 and list(indptr) == [0, 3, 6]  # 12 tokens: 3 pages of 4 a kv-head
    for h in range(2):
        picked = list(indices[indptr[h]:indptr[h + 1]])
        assert picked[0] == row[0] and picked[-1] == row[7] and picked == sorted(picked, key=list(row).index)
    with pytest.raises(kv.InvalidArgument, match="layer"):
        c.select(np.array([seq], dtype=np.uint64), 1, q)
    # A peer's prompt lands: its pages hold K no page_bounds_update saw.
    imp, cached, _ = c.import_prompt(np.arange(100, 120, dtype=np.int32))
    s2, _ = c.commit_import(imp, np.arange(100, 120, dtype=np.int32))
    pages, fill, listed = c.stale_pages(np.array([s2], dtype=np.uint64))
    assert listed == 5 and list(pages[:listed]) == list(c.export_block_table(0, [s2], 5)[0]) and list(fill[:listed]) == [4] * 5
    with pytest.raises(kv.InvalidArgument, match="selection"):
        kv.HybridCache(lg, num_blocks=40, max_sequences=2, max_tokens=64, selection=kv.KeepAll())
    with pytest.raises(kv.InvalidArgument, match="bounds"):
        kv.HybridCache(lg, num_blocks=40, max_sequences=2, max_tokens=64, bounds=np.zeros(4, dtype=np.float32))
    window_only = kv.LayerGroups([kv.LayerGroup("sliding_window", [0], num_kv_heads=2, head_dim=8, window=8)], block_size=4)
    with pytest.raises(kv.InvalidArgument, match="no full or MLA group"):
        window_only.global_geometry()
