"""The bindings' behaviour: slots and tables as the C++ cache hands them
out, arrays written in place, typed errors that change nothing, and a
randomized sequence of operations with the invariants checked after each."""
import random

import numpy as np
import pytest

import kvcache as kv


def geometry(block_size=4):
    return kv.Geometry(num_layers=2, num_kv_heads=2, head_dim=8, block_size=block_size, dtype=kv.DType.f32)


def test_geometry_validates_and_sizes_the_pool():
    g = geometry()
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.block_size) == (2, 2, 8, 4)
    assert g.block_bytes == 2 * 2 * 2 * 8 * 4 * 4  # layers x K,V x heads x dim x tokens x f32
    assert g.pool_bytes(10) == 10 * g.block_bytes
    with pytest.raises(kv.InvalidArgument, match="num_layers=0"):
        kv.Geometry(num_layers=0, num_kv_heads=1, head_dim=8)
    with pytest.raises(kv.InvalidArgument, match="num_blocks=0"):
        g.pool_bytes(0)
    mla = kv.Geometry(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype=kv.DType.f32, v_head_dim=0)
    assert mla.kv_planes == 1 and g.kv_planes == 2
    assert mla.block_bytes == 2 * 1 * 8 * 4 * 4  # K alone: MLA's latent
    with pytest.raises(kv.InvalidArgument, match="v_head_dim"):
        kv.Geometry(num_layers=1, num_kv_heads=1, head_dim=8, v_head_dim=4)


def test_reserve_hands_out_slots_block_by_block():
    c = kv.Cache(geometry(), num_blocks=8, max_sequences=2)
    s = c.add_sequence()
    slots, new_blocks, copy = c.reserve(s, 6)
    assert slots.dtype == np.int32 and list(slots) == [4, 5, 6, 7, 8, 9]  # blocks 1 and 2 (0 is the null block)
    assert new_blocks == 2 and copy == (-1, -1)
    assert c.tokens_held(s) == 6 and c.blocks_held(s) == 2 and c.free_blocks == 5
    c.truncate(s, 3)
    assert c.tokens_held(s) == 3 and c.blocks_held(s) == 1
    c.free(s)
    assert c.free_blocks == 7
    with pytest.raises(kv.UnknownSequence):
        c.tokens_held(s)  # the handle died; a new one never aliases it
    s2 = c.add_sequence()
    assert s2 != s
    with pytest.raises(kv.InvalidArgument, match=r"n=1099511627776 \(limit 2147483647\)"):
        c.reserve(s2, 2**40)  # a count past int32 is named as a count, not taken for ids
    with pytest.raises(kv.InvalidArgument, match=r"n=-9223372036854775808 \(limit -2147483648\)"):
        c.reserve(s2, -2**90)


def test_caller_arrays_are_written_in_place_and_returned():
    c = kv.Cache(geometry(), num_blocks=16, max_sequences=4)
    seqs = np.array([c.add_sequence() for _ in range(3)], dtype=np.uint64)
    slots = np.full(8, 99, dtype=np.int32)
    copies = np.full((3, 2), 99, dtype=np.int32)
    out_slots, out_copies, n_copies = c.reserve_batch(seqs, np.array([2, 1, 3], dtype=np.int32), slots, copies)
    assert out_slots is slots and out_copies is copies and n_copies == 0
    assert list(slots[:6]) == [4, 5, 8, 12, 13, 14] and list(slots[6:]) == [-1, -1]  # padded with -1
    table = np.zeros((3, 4), dtype=np.int32)
    assert c.export_block_table(seqs, 4, table) is table
    assert table.tolist() == [[1, 0, 0, 0], [2, 0, 0, 0], [3, 0, 0, 0]]
    lengths = np.zeros(3, dtype=np.int32)
    assert c.export_lengths(seqs, lengths) is lengths and lengths.tolist() == [2, 1, 3]
    indptr, indices, last, nnz = c.export_csr(seqs)
    assert indptr.tolist() == [0, 1, 2, 3] and indices.tolist() == [1, 2, 3] and last.tolist() == [2, 1, 3] and nnz == 3


def test_wrong_arrays_are_typed_errors_that_change_nothing():
    c = kv.Cache(geometry(), num_blocks=8, max_sequences=2)
    s = c.add_sequence()
    seqs = np.array([s], dtype=np.uint64)
    for bad, error, match in [(np.zeros(4, dtype=np.int64), kv.InvalidArgument, "slots must be a C-contiguous int32"),
                              (np.zeros(8, dtype=np.int32)[::2], kv.InvalidArgument, "slots must be a C-contiguous int32"),
                              (np.zeros(1, dtype=np.int32), kv.BufferTooSmall, r"slots=1 \(limit 3\)")]:
        with pytest.raises(error, match=match):
            c.reserve_batch(seqs, np.array([3], dtype=np.int32), bad)
        assert c.tokens_held(s) == 0 and c.free_blocks == 7


def test_one_conversion_rule_for_integer_inputs():
    c = kv.Cache(geometry(), num_blocks=16, max_sequences=4)
    s, t = c.add_sequence(), c.add_sequence()
    slots, _, _ = c.reserve_batch([s, t], (2, 1))  # lists and tuples convert like arrays
    assert slots[:3].tolist() == [4, 5, 8]
    slots, _, _ = c.reserve_batch(np.array([s, t], dtype=np.int64), np.array([1, 1], dtype=np.int64))
    assert slots[:2].tolist() == [6, 9]
    # Handles in an int32 array convert by value, as a list of them does (issue 62: they were refused).
    slots, _, _ = c.reserve_batch(np.array([s, t], dtype=np.int32), np.array([1, 1], dtype=np.int32))
    assert slots[:2].tolist() == [7, 10]
    assert c.export_block_table(np.array([s], dtype=np.int16), 2)[0].tolist()[:1] == [1]
    before = (c.tokens_held(s), c.free_blocks)
    with pytest.raises(kv.InvalidArgument, match=r"seqs\[0\] does not fit"):
        c.reserve_batch(np.array([-1, t], dtype=np.int32), np.array([1, 1], dtype=np.int32))
    with pytest.raises(kv.InvalidArgument, match=r"counts\[1\] does not fit int32"):
        c.reserve_batch([s, t], np.array([1, 2**40], dtype=np.int64))
    with pytest.raises(kv.InvalidArgument, match="counts must be"):
        c.reserve_batch([s, t], np.array([1.0, 2.0]))
    assert (c.tokens_held(s), c.free_blocks) == before


def test_out_of_blocks_is_all_or_nothing():
    c = kv.Cache(geometry(), num_blocks=4, max_sequences=2)  # 3 usable blocks
    a, b = c.add_sequence(), c.add_sequence()
    c.reserve(a, 8)
    slots = np.full(8, 7, dtype=np.int32)
    with pytest.raises(kv.OutOfBlocks, match="out_of_blocks"):
        c.reserve_batch(np.array([a, b], dtype=np.uint64), np.array([1, 4], dtype=np.int32), slots)
    assert (slots == -1).all()  # a scatter launched anyway writes nothing
    assert c.tokens_held(a) == 8 and c.tokens_held(b) == 0 and c.free_blocks == 1
    c.check_invariants()


def test_fork_shares_blocks_and_the_first_write_copies():
    c = kv.Cache(geometry(), num_blocks=8, max_sequences=2)
    s = c.add_sequence()
    c.reserve(s, 6)
    t = c.fork(s)
    assert c.free_blocks == 5  # nothing new
    slots, copies, n = c.reserve_batch(np.array([t], dtype=np.uint64), np.array([1], dtype=np.int32))
    assert n == 1 and copies[0, 0] == 2 and slots[0] // 4 == copies[0, 1]  # copy the shared tail, then write


def test_prefix_hits_publish_and_events():
    c = kv.Cache(geometry(), num_blocks=32, max_sequences=4, event_capacity=64, publish_on_reserve=True)
    prompt = np.arange(1, 14, dtype=np.int32)  # 13 tokens: three full blocks
    a = c.admit(prompt)
    assert a.cached_tokens == 0 and a.reserved == 13 and len(a.slots) == 13
    b = c.admit(prompt, salt=0)
    assert b.cached_tokens == 12 and b.reserved == 1
    other = c.admit(prompt, salt=7)  # another tenant shares nothing
    assert other.cached_tokens == 0
    assert len(c.match_prefix(prompt)) == 3
    stats = c.prefix_stats()
    assert stats["hit_tokens"] == 12 and stats["queries"] == 3
    events = c.drain_events()
    stored = [e for e in events if e["kind"] == "stored"]
    assert len(stored) == 6 and stored[0]["token_ids"] == [1, 2, 3, 4] and stored[0]["first"]
    with pytest.raises(kv.InvalidArgument):
        c.admit(np.zeros(0, dtype=np.int32))


def test_sliding_window_keeps_the_window():
    c = kv.Cache(geometry(), num_blocks=16, max_sequences=2, eviction=kv.SlidingWindow(6))
    s = c.add_sequence()
    c.reserve(s, 13)
    (r,) = c.evict(s)
    assert r.tokens == 7 and c.tokens_held(s) == 6 and c.front(s) == 3
    with pytest.raises(kv.InvalidArgument, match="pending_queries"):
        c.evict(s, pending_queries=-1)


def test_h2o_observes_scores_and_writes_moves():
    c = kv.Cache(geometry(), num_blocks=16, max_sequences=2, eviction=kv.H2O(heavy=2, recent=2, groups=2))
    s = c.add_sequence()
    c.reserve(s, 8)
    scores = np.array([[5, 0, 0, 4, 0, 0, 0, 0], [0, 6, 3, 0, 0, 0, 0, 0]], dtype=np.float32)
    c.observe(s, scores, "head_attention_sums")
    r, moves, group_moves = c.evict(s)
    assert r.tokens == 4 and c.tokens_held(s) == 4
    assert sorted(c.positions(s, 0)) == [0, 3, 6, 7] and sorted(c.positions(s, 1)) == [1, 2, 6, 7]
    assert group_moves[-1] == r.moves and moves.shape == (r.moves, 2)  # exactly the moves written
    assert c.eviction.groups == 2 and c.front(s) == 0  # front: a window's dead slots, 0 here
    with pytest.raises(kv.UnknownSequence):
        c.front(s + 1)
    with pytest.raises(kv.InvalidArgument, match="scores_at"):
        c.observe(s, np.array([[np.nan, 0, 0, 0]] * 2, dtype=np.float32), "head_attention_sums")
    with pytest.raises(kv.InvalidArgument, match="scores.kind"):
        c.observe(s, np.zeros((2, 4), dtype=np.float32), "no_such_kind")


def test_block_scores_evicts_whole_blocks():
    c = kv.Cache(geometry(), num_blocks=16, max_sequences=2,
                 eviction=kv.BlockScores(start=4, recent=4, max=12))
    s = c.add_sequence()
    c.reserve(s, 20)
    c.observe(s, np.linspace(1, 2, 20, dtype=np.float32))
    r, blocks, rotations = c.evict(s)
    assert r.evicted == 2 and c.tokens_held(s) == 12
    assert blocks.shape == (2,) and rotations.shape == (r.rotations, 3)  # exactly the rows written
    buffer = np.full(16, -7, dtype=np.int32)  # a caller's buffer: the rows returned are a view of it
    c.reserve(s, 8)
    c.observe(s, np.linspace(1, 2, 20, dtype=np.float32))
    r, blocks, _ = c.evict(s, buffer)
    assert r.evicted == 2 and blocks.shape == (2,) and np.shares_memory(blocks, buffer) and buffer[2] == -7


def test_every_policy_has_a_cache():
    for policy in [kv.KeepAll(), kv.SlidingWindow(8), kv.SinkWindow(sinks=4, window=8),
                   kv.BlockScores(start=4, recent=4, max=12), kv.H2O(heavy=4, recent=4),
                   kv.Tova(budget=8), kv.SnapKV(capacity=8, window=4, kernel=3), kv.AverageAttention(budget=8, step=2)]:
        c = kv.Cache(geometry(), num_blocks=16, max_sequences=2, eviction=policy)
        s = c.add_sequence()
        c.reserve(s, 5)
        c.check_invariants()
    with pytest.raises(kv.InvalidArgument, match="eviction=int"):
        kv.Cache(geometry(), num_blocks=16, eviction=3)
    # Block policies count in the geometry's block size (never given twice): sizes that are not
    # multiples of it are refused when the cache is built.
    with pytest.raises(kv.InvalidArgument, match=r"start \(a multiple of the block size\)=6 \(limit 4\)"):
        kv.Cache(geometry(), num_blocks=16, eviction=kv.BlockScores(start=6, recent=4, max=16))


def test_random_operations_keep_the_invariants():
    rng = random.Random(1234)
    c = kv.Cache(geometry(), num_blocks=24, max_sequences=6, max_blocks_per_sequence=8)
    held = {}  # the reference: tokens per live sequence
    for _ in range(3000):
        op = rng.randrange(6)
        before = (dict(held), c.free_blocks)
        try:
            if op == 0:
                held[c.add_sequence()] = 0
            elif op == 1 and held:
                s = rng.choice(list(held))
                n = rng.randrange(-1, 9)
                c.reserve(s, n)
                held[s] += n
            elif op == 2 and held:
                s = rng.choice(list(held))
                t = c.fork(s)
                held[t] = held[s]
            elif op == 3 and held:
                s = rng.choice(list(held))
                n = rng.randrange(0, held[s] + 3)
                c.truncate(s, n)
                held[s] -= n
            elif op == 4 and held:
                s = rng.choice(list(held))
                c.free(s)
                del held[s]
            elif op == 5 and held:
                seqs = rng.sample(list(held), rng.randrange(1, len(held) + 1))
                counts = [rng.randrange(0, 3) for _ in seqs]
                c.reserve_batch(np.array(seqs, dtype=np.uint64), np.array(counts, dtype=np.int32))
                for s, n in zip(seqs, counts):
                    held[s] += n
        except kv.Error:
            assert (held, c.free_blocks) == before  # a failed call changes nothing
        c.check_invariants()
        for s, n in held.items():
            assert c.tokens_held(s) == n
