"""Memory tiers from Python: kv.Tiers (lookups, store and load plans,
completions and failures, resets), kv.WritePolicy over a cache's pool, the
device-side holds a transfer keeps, the layer-by-layer block copy into a
host tier and back, and typed errors that change nothing."""
import numpy as np
import pytest

import kvcache as kv

B = 4  # tokens per block


def geometry():
    return kv.Geometry(num_layers=2, num_kv_heads=2, head_dim=8, block_size=B, dtype=kv.DType.f32)


def cache(blocks=9):
    return kv.Cache(geometry(), num_blocks=blocks, max_sequences=4, event_capacity=64, publish_on_reserve=True)


def test_a_turn_comes_back_from_host_memory():
    c = cache()
    tiers = kv.Tiers(host_blocks=16, block_size=B)
    prompt = np.arange(1, 18, dtype=np.int32)  # 17 tokens: 4 full blocks
    a = c.admit(prompt)
    chain = c.hash_chain(prompt)
    assert chain.shape == (4, 2) and chain.dtype == np.uint64
    blocks = c.export_block_table([a.seq], 5)[0][:4]
    assert [c.pool.hash(int(b)) for b in blocks] == [tuple(int(x) for x in h) for h in chain]

    store = tiers.plan_store("device", "host", chain, blocks)
    assert (store.from_tier, store.to_tier, store.skipped) == ("device", "host", 0)
    assert store.moves.shape == (4, 3) and list(store.moves[:, 0]) == list(blocks) and list(store.moves[:, 2]) == [0, 1, 2, 3]
    hold = c.hold(blocks)  # the request ends while the copy runs
    c.free(a.seq)
    assert c.holds == 1 and c.free_blocks == 4
    c.check_invariants()
    assert tiers.complete(store.id) == 4
    c.release_hold(hold)
    assert c.holds == 0 and c.free_blocks == 8
    with pytest.raises(kv.UnknownJob, match="hold"):
        c.release_hold(hold)
    with pytest.raises(kv.UnknownJob):
        tiers.complete(store.id)
    assert tiers.counts("host")["published"] == 4

    # The device recycles them; the next turn finds them in host memory.
    filler = c.admit(np.arange(100, 132, dtype=np.int32))
    assert filler.cached_tokens == 0
    assert tiers.lookup(chain, 0, len(prompt)) == (0, 4, 0, ["host"] * 4)
    c.free(filler.seq)
    nxt = c.admit(prompt, reserve=len(prompt))
    dst = c.export_block_table([nxt.seq], 5)[0][:4]
    load = tiers.plan_load("host", "device", chain, dst)
    assert list(load.moves[:, 1]) == list(dst)
    assert tiers.complete(load.id, failed=[2]) == 2  # block 2 failed: recompute from there
    assert tiers.lookup(chain, 0, len(prompt)) == (0, 2, 0, ["host"] * 2)  # a block that failed a read is dropped
    tiers.check_invariants()


def test_write_policies_choose_what_goes_to_host():
    c = cache()
    prompt = np.arange(1, 14, dtype=np.int32)
    a = c.admit(prompt)
    events = c.drain_events()
    through = kv.WritePolicy("write_through")
    blocks, hashes, parents, groups = through.on_stored(events)
    assert len(blocks) == 3 and hashes.shape == (3, 2) and list(groups) == [-1] * 3  # a single-group cache's
    assert tuple(int(x) for x in parents[1]) == tuple(int(x) for x in hashes[0])
    tiers = kv.Tiers(host_blocks=8, block_size=B, event_capacity=8)
    job = tiers.plan_store("device", "host", hashes, blocks, parents=parents)
    assert tiers.complete(job.id) == 3
    ev = tiers.drain_events("host")
    assert [e["medium"] for e in ev] == ["cpu"] * 3 and ev[-1]["hash"] == tuple(int(x) for x in hashes[0])

    reused = kv.WritePolicy("write_through_reused", min_uses=2)
    hit = c.match_prefix(prompt)
    assert len(reused.on_use(c.pool, hit)[0]) == 0
    assert len(reused.on_use(c.pool, hit)[0]) == 3
    assert reused.uses(tuple(int(x) for x in hashes[0])) == 2

    back = kv.WritePolicy("write_back")
    c.free(a.seq)
    assert len(back.before_allocate(c.pool, 4)[0]) == 0  # 4 plain free blocks go first
    recycled, _, _, _ = back.before_allocate(c.pool, 8)
    assert list(recycled) == c.pool.next_recycled(8) and len(recycled) == 3  # the 3 full blocks, tail first
    with pytest.raises(kv.InvalidArgument, match="mode"):
        kv.WritePolicy("sometimes")
    with pytest.raises(kv.InvalidArgument, match="counters"):
        kv.WritePolicy("write_through_reused", counters=1000)


def test_write_back_on_a_hybrid_cache_names_each_block_in_its_group():
    groups = kv.LayerGroups([kv.LayerGroup("full", [0], num_kv_heads=2, head_dim=8),
                             kv.LayerGroup("sliding_window", [1], num_kv_heads=2, head_dim=8, window=8)], block_size=4)
    h = kv.HybridCache(groups, num_blocks=20, max_sequences=2, max_tokens=32)
    gt = kv.GroupTiers(h, host_blocks=32, event_capacity=64)
    prompt = np.arange(1, 25, dtype=np.int32)
    seq = h.admit(prompt).seq
    h.computed(seq, 24)
    h.free(seq)
    back = kv.WritePolicy("write_back")
    blocks, hashes, parents, block_groups = back.before_allocate(h.pool, h.pool.num_free)  # every cached block, before another prompt takes them
    assert list(block_groups) == [h.pool.group(int(b)) for b in blocks] and sorted(set(block_groups.tolist())) == [0, 1]
    with pytest.raises(kv.InvalidArgument, match="groups"):
        gt.tiers.plan_store("device", "host", hashes, blocks, parents, block_groups[:1])
    job = gt.tiers.plan_store("device", "host", hashes, blocks, parents, block_groups)
    assert gt.tiers.complete(job.id) == len(blocks)
    stored = [e for e in gt.tiers.drain_events("host") if e["kind"] == "stored"]
    assert sorted({e["group"] for e in stored}) == [0, 1] and all(e["block_size"] == 4 for e in stored)
    other = h.admit(np.arange(100, 124, dtype=np.int32)).seq  # recycles the prompt's blocks
    h.free(other)
    device, tokens, host, disk = gt.lookup(np.append(prompt, 7).astype(np.int32))
    assert tokens == 24 and host > 0 and disk == 0  # the prompt comes back from host memory, every group


def test_bad_calls_are_typed_errors_that_change_nothing():
    c = cache()
    tiers = kv.Tiers(host_blocks=2, block_size=B)
    chain = np.array([[1, 0], [2, 0], [3, 0]], dtype=np.uint64)
    with pytest.raises(kv.OutOfBlocks, match="n_blocks=3"):
        tiers.plan_store("device", "host", chain, np.array([1, 2, 3], dtype=np.int32))
    with pytest.raises(kv.InvalidArgument, match="route"):
        tiers.plan_store("host", "device", chain, np.array([1, 2, 3], dtype=np.int32))
    with pytest.raises(kv.InvalidArgument, match="src"):
        tiers.plan_store("device", "host", chain, np.array([1], dtype=np.int32))
    with pytest.raises(kv.InvalidArgument, match="tier"):
        tiers.plan_load("tape", "host", chain)
    with pytest.raises(kv.InvalidArgument, match="disk_blocks"):
        kv.Tiers(disk_blocks=-1)
    with pytest.raises(kv.InvalidArgument, match="device_blocks"):
        tiers.lookup(chain, 4, 13)
    assert tiers.jobs_in_flight == 0 and tiers.counts("host") == {"capacity": 2, "free": 2, "ready": 0, "filling": 0, "published": 0}
    with pytest.raises(kv.InvalidArgument, match="block"):
        c.hold(np.array([0], dtype=np.int32))
    with pytest.raises(kv.NotAllocated, match="block"):
        c.hold(np.array([3], dtype=np.int32))
    assert c.holds == 0 and c.free_blocks == 8
    job = tiers.plan_store("device", "host", chain[:2], np.array([1, 2], dtype=np.int32))
    tiers.reset()  # the engine dropped its copies: nothing was stored
    with pytest.raises(kv.UnknownJob):
        tiers.complete(job.id)
    assert tiers.counts("host")["free"] == 2 and tiers.epoch == 1
    tiers.check_invariants()


def test_a_disk_load_completes_only_through_the_librarys_verification():
    """Issue 62: complete() published a disk load whatever its bytes; a disk
    tier without a host tier crashed."""
    with pytest.raises(kv.InvalidArgument, match="a disk tier needs a host tier"):
        kv.Tiers(host_blocks=0, disk_blocks=4)
    tiers = kv.Tiers(host_blocks=2, disk_blocks=4, block_size=B)
    layout = kv.DiskLayout(block_bytes=32, num_blocks=4, digest=kv.layout_digest(geometry()), align=64)
    assert (layout.slot_bytes, layout.tail_bytes) == (128, 96)
    chain = np.array([[11, 1], [12, 1]], dtype=np.uint64)
    host = np.zeros((2, 32), dtype=np.uint8)
    disk = np.zeros((4, layout.slot_bytes), dtype=np.uint8)  # the file, slot by slot
    store = tiers.plan_store("device", "host", chain, np.array([1, 2], dtype=np.int32))
    for src, dst, i in store.moves:
        host[dst] = 40 + i  # the engine's copy: block i's bytes
    tiers.complete(store.id)
    behind = tiers.plan_store("host", "disk", chain, store.moves[:, 1])
    for src, dst, i in behind.moves:  # the engine writes each host block and its sealed tail (pwritev)
        disk[dst, :32] = host[src]
        disk[dst, 32:] = layout.seal_tail(host[src], int(dst), tuple(int(x) for x in chain[i]))
    tiers.complete(behind.id)
    other = tiers.plan_store("device", "host", np.array([[31, 3], [32, 3]], dtype=np.uint64), np.array([3, 4], dtype=np.int32))
    tiers.complete(other.id)  # host memory now holds only the other request's blocks
    assert tiers.lookup(chain, 0, 3 * B) == (0, 0, 2, ["disk", "disk"])

    stage = tiers.plan_load("disk", "host", chain)
    disk[stage.moves[1, 0], 5] ^= 1  # a byte of block 1 flips on disk
    landed = np.stack([disk[src, :32] for src, dst, i in stage.moves])  # the blocks as read into host memory
    tails = np.stack([disk[src, 32:] for src, dst, i in stage.moves])
    with pytest.raises(kv.InvalidArgument, match="complete_disk_load"):
        tiers.complete(stage.id)
    with pytest.raises(kv.InvalidArgument, match="blocks"):
        tiers.complete_disk_load(stage, layout, landed[:, :8], tails)
    assert tiers.complete_disk_load(stage, layout, landed, tails) == 1  # block 1 failed verification: a miss
    assert tiers.lookup(chain, 0, 3 * B) == (0, 1, 0, ["host"])
    with pytest.raises(kv.InvalidArgument, match="checksum=0x"):
        layout.verify(disk[stage.moves[1, 0], :32], disk[stage.moves[1, 0], 32:], int(stage.moves[1, 0]), (12, 1))
    tiers.check_invariants()


def test_a_restarted_disk_tier_names_each_blocks_group_from_its_trailer():
    layout = kv.DiskLayout(block_bytes=32, num_blocks=4, digest=kv.layout_digest(geometry()), align=64)
    disk = np.zeros((4, layout.slot_bytes), dtype=np.uint8)
    chain = [(21, 2), (22, 2), (23, 2)]
    for slot, (h, group) in enumerate(zip(chain, [0, 1, -1])):  # the engine seals each block with its group
        disk[slot, :32] = slot
        disk[slot, 32:] = layout.seal_tail(disk[slot, :32], slot, h, group)
    with pytest.raises(kv.InvalidArgument, match="group=-2"):
        layout.seal_tail(disk[0, :32], 0, chain[0], -2)
    # A restart: each intact trailer (the slot's tail, or its last 64 bytes) names the hash and the group.
    found = [layout.sealed(disk[s, 32:], s) for s in range(3)]
    assert found == [((21, 2), 0), ((22, 2), 1), ((23, 2), -1)]
    assert layout.sealed(disk[1, -64:], 1) == found[1]
    with pytest.raises(kv.InvalidArgument, match="trailer"):
        layout.sealed(disk[3, 32:], 3)  # never written
    tiers = kv.Tiers(host_blocks=2, disk_blocks=4, block_size=B, event_capacity=8)
    slots = np.arange(3, dtype=np.int32)
    hashes = np.array([h for h, _ in found], dtype=np.uint64)
    with pytest.raises(kv.InvalidArgument, match="groups"):
        tiers.restore_disk(slots, hashes, np.array([0, 1], dtype=np.int32))
    tiers.restore_disk(slots, hashes, np.array([g for _, g in found], dtype=np.int32))
    assert [tiers.group("disk", s) for s in range(3)] == [0, 1, -1]
    assert [e["group"] for e in tiers.drain_events("disk")] == [0, 1, -1]
    with pytest.raises(kv.InvalidArgument, match="slot"):
        tiers.group("disk", 4)
    with pytest.raises(kv.InvalidArgument, match="tier"):
        tiers.group("device", 0)
    tiers.check_invariants()


def test_a_hybrid_cache_holds_blocks_too():
    groups = kv.LayerGroups([kv.LayerGroup("full", [0], num_kv_heads=2, head_dim=8),
                             kv.LayerGroup("sliding_window", [1], num_kv_heads=2, head_dim=8, window=8)], block_size=4)
    h = kv.HybridCache(groups, num_blocks=13, max_sequences=2, max_tokens=32)
    seq = h.admit(np.arange(1, 17, dtype=np.int32)).seq
    blocks = [int(b) for g in range(2) for b in h.export_block_table(g, [seq], 8)[0] if b != 0]
    hold = h.hold(blocks)
    h.free(seq)
    assert h.holds == 1 and h.free_blocks == 12 - len(blocks)
    h.check_invariants()
    h.release_hold(hold)
    assert h.free_blocks == 12 and h.pool.num_used == 0


def test_layer_by_layer_copy_into_a_host_tier_and_back():
    g = geometry()
    dev_mem = np.random.default_rng(3).standard_normal(g.pool_bytes(8) // 4).astype(np.float32)
    host_mem = np.zeros(g.pool_bytes(8) // 4, dtype=np.float32)
    dev, host = kv.PoolView(g, dev_mem, 8), kv.PoolView(g, host_mem, 8)
    kv.block_copy(dev, host, np.array([[3, 0], [5, 1]], dtype=np.int32))
    back_mem = np.zeros_like(dev_mem)
    back = kv.PoolView(g, back_mem, 8)
    for layer in range(2):  # onboard layer by layer: attention of layer 0 could start after the first launch
        kv.block_copy(host, back, np.array([[0, 6], [1, 7]], dtype=np.int32), first_layer=layer, layers=1)
    block = g.pool_bytes(8) // 4 // 8
    np.testing.assert_array_equal(back_mem[6 * block:7 * block], dev_mem[3 * block:4 * block])
    np.testing.assert_array_equal(back_mem[7 * block:8 * block], dev_mem[5 * block:6 * block])
