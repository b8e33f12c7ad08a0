"""Scale-out from Python, without NIXL: layout handshakes (their msgpack read
by Python's msgpack in array form), transfer plans executed by memmove
between two numpy pools, import / commit / abort, the sender's transfer
holds, vLLM's KV-event batches decoded field by field, and a live ZMQ
publisher (the C++ example kvcache_event_publisher) read by a pyzmq SUB,
sequence numbers and replay checked. test_nixl.py moves the same blocks
with NIXL between two processes."""
import ctypes
import os
import subprocess

import numpy as np
import pytest

import kvcache as kv

msgpack = pytest.importorskip("msgpack")

B = 4


def geometry(heads=2, layout=kv.Layout.NHD, planes=kv.KvPlanes.interleaved, block_size=B):
    return kv.Geometry(num_layers=2, num_kv_heads=heads, head_dim=8, block_size=block_size, dtype=kv.DType.f16,
                       layout=layout, planes=planes)


class Pool:
    """A cache with a numpy pool behind it."""

    def __init__(self, g, blocks=16, events=0, fill=None):
        self.cache = kv.Cache(g, num_blocks=blocks, max_sequences=4, event_capacity=events)
        self.mem = np.zeros(g.pool_bytes(blocks), dtype=np.uint8) if fill is None else \
            np.random.default_rng(fill).integers(0, 256, g.pool_bytes(blocks), dtype=np.uint8)
        self.blocks = blocks
        self.block_bytes = g.block_bytes

    def handshake(self, name="n", **kw):
        return kv.LayoutHandshake.describe(self.cache.geometry, self.blocks, self.mem.ctypes.data, engine_id=name, **kw)

    def block(self, b):
        return self.mem[b * self.block_bytes:(b + 1) * self.block_bytes]


def run(plan):
    for local, remote, nbytes in plan:
        ctypes.memmove(int(local), int(remote), int(nbytes))


def test_handshake_on_the_wire_and_mismatches_named():
    p = Pool(geometry())
    h = p.handshake("prefill-0", tp_rank=0, tp_size=1, hash_seed=7)
    data = h.to_msgpack()
    fields = msgpack.unpackb(data)
    assert len(fields) == 14 and fields[0] == "kvcache.layout" and fields[1] == 2 and fields[2] == "prefill-0"
    assert fields[8] == 7 and fields[9] == 16  # hash seed, blocks
    # full, 2 layers, block 4, 2 heads, dims 8/8, f16, NHD, no window or chunk; K and V unscaled
    assert fields[10] == [[0, 2, B, 2, 8, 8, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]]
    assert fields[11] == [[p.mem.ctypes.data, p.mem.nbytes, 0, 0]]
    assert len(fields[12]) == 2 and fields[13] == h.compat_hash
    back = kv.LayoutHandshake.from_msgpack(data)
    assert back == h and back.registrations == [(p.mem.ctypes.data, p.mem.nbytes, 0, "device")]
    with pytest.raises(kv.InvalidArgument):
        kv.LayoutHandshake.from_msgpack(data[:-3])

    other = Pool(geometry(block_size=8))
    with pytest.raises(kv.LayoutMismatch, match=r"layout_mismatch: block_size=8 \(limit 4\)"):
        kv.check_compatible(h, other.handshake(hash_seed=7))
    with pytest.raises(kv.LayoutMismatch, match="block_size"):
        kv.TransferPlanner(h, other.handshake(hash_seed=7))
    with pytest.raises(kv.LayoutMismatch, match=r"hash_seed=0x0 \(limit 0x7\)"):
        kv.check_compatible(h, p.handshake())


def test_a_quantized_pools_format_travels_and_must_match():
    def quantized(group):
        return kv.Geometry(num_layers=2, num_kv_heads=2, head_dim=32, block_size=B, dtype=kv.DType.int4,
                           format=kv.KvFormat(kv.SideFormat(kv.Scales.group, group, minimum=True),
                                              kv.SideFormat(kv.Scales.group, 32)))
    a, b = Pool(quantized(32)), Pool(quantized(16))
    h = a.handshake(hash_seed=7)
    fields = msgpack.unpackb(h.to_msgpack())
    assert fields[10][0][6] == 6 and fields[10][0][10:] == [3, 32, 1, 3, 32, 0]  # int4; K group 32 + min, V group 32
    assert h.groups[0]["format"] == kv.KvFormat(kv.SideFormat(kv.Scales.group, 32, True), kv.SideFormat(kv.Scales.group, 32))
    assert kv.LayoutHandshake.from_msgpack(h.to_msgpack()) == h
    with pytest.raises(kv.LayoutMismatch, match=r"layout_mismatch: format.k.group=16 \(limit 32\)"):
        kv.check_compatible(h, b.handshake(hash_seed=7))
    # A plan moves whole planes: a block arrives with its codes and its group scales.
    remote = Pool(quantized(32), fill=3)
    plan = kv.TransferPlanner(h, remote.handshake(hash_seed=7)).plan(np.array([2, 5], dtype=np.int32),
                                                                      np.array([9, 1], dtype=np.int32))
    assert int(plan[:, 2].sum()) == 2 * a.block_bytes
    run(plan)
    assert (a.block(9) == remote.block(2)).all() and (a.block(1) == remote.block(5)).all()


def test_plans_move_the_bytes_between_two_pools():
    remote = Pool(geometry(planes=kv.KvPlanes.separate), fill=1)
    local = Pool(geometry())
    planner = kv.TransferPlanner(local.handshake(), remote.handshake())
    assert planner.num_plane_regions == 4
    rb, lb = np.array([3, 4, 5], dtype=np.int32), np.array([7, 8, 9], dtype=np.int32)
    plan = planner.plan(rb, lb)
    assert plan.dtype == np.uint64 and plan.shape[1] == 3 and int(plan[:, 2].sum()) == 3 * local.block_bytes
    run(plan)
    g = geometry()
    # Every (layer, K|V) plane of each block: interleaved locally, separate on the peer.
    plane = g.block_bytes // 4
    for i in range(3):
        for layer in range(2):
            for kv_ in range(2):
                mine = local.block(int(lb[i]))[(2 * layer + kv_) * plane:(2 * layer + kv_ + 1) * plane]
                at = ((2 * layer + kv_) * 16 + int(rb[i])) * plane
                assert (mine == remote.mem[at:at + plane]).all()
    lids, rids = planner.plan_ids(rb, lb)
    ldl, rdl = planner.dlist(True), planner.dlist(False)
    assert ldl.shape == (4 * 16, 2) and len(lids) == 12
    assert sorted(int(ldl[i, 0]) for i in lids) == sorted(int(a) for p_ in [planner.plan(rb, lb, coalesce=False)] for a in p_[:, 0])
    with pytest.raises(kv.InvalidArgument, match="remote block"):
        planner.plan(np.array([99], dtype=np.int32), np.array([1], dtype=np.int32))


def test_import_commit_and_abort():
    prefill, decode = Pool(geometry(), fill=2), Pool(geometry(), events=16)
    prompt = np.arange(1, 15, dtype=np.int32)  # 3 full blocks and 2 tokens
    a = prefill.cache.admit(prompt)
    remote_blocks = prefill.cache.export_block_table([a.seq], 4)[0]
    imp, cached, skip, blocks = decode.cache.import_prompt(prompt)
    assert (cached, skip, len(blocks)) == (0, 0, 4) and decode.cache.imports == 1
    assert decode.cache.match_prefix(prompt) == []  # pending: invisible
    planner = kv.TransferPlanner(decode.handshake(), prefill.handshake())
    run(planner.plan(remote_blocks, blocks, skip=skip))
    seq, published = decode.cache.commit_import(imp, prompt)
    assert published == 3 and decode.cache.imports == 0 and decode.cache.tokens_held(seq) == 14
    for r, l in zip(remote_blocks, blocks):
        assert (prefill.block(int(r)) == decode.block(int(l))).all()
    assert len(decode.cache.match_prefix(prompt)) == 3
    with pytest.raises(kv.UnknownJob):
        decode.cache.commit_import(imp, prompt)
    decode.cache.check_invariants()

    # A second prompt sharing two blocks: only the suffix is received; then the transfer fails.
    p2 = np.concatenate([prompt[:8], np.arange(100, 110, dtype=np.int32)])
    imp2, cached2, skip2, blocks2 = decode.cache.import_prompt(p2)
    assert (cached2, skip2, len(blocks2)) == (8, 2, 3)
    skip_g, blocks_g = decode.cache.import_blocks(imp2)  # HybridCache's call: group 0, the only one
    assert skip_g == skip2 and (blocks_g == blocks2).all()
    with pytest.raises(kv.InvalidArgument, match="group"):
        decode.cache.import_blocks(imp2, 1)
    free = decode.cache.free_blocks
    seq2, cached_after, recompute = decode.cache.abort_import(imp2)
    assert (cached_after, recompute) == (8, 10) and decode.cache.free_blocks == free + 3
    assert decode.cache.tokens_held(seq2) == 8
    decode.cache.check_invariants()


def test_hybrid_import_reads_what_each_groups_next_query_reads():
    lg = kv.LayerGroups([kv.LayerGroup("full", [0], num_kv_heads=2, head_dim=8),
                         kv.LayerGroup("sliding_window", [1], num_kv_heads=2, head_dim=4, window=12),
                         kv.LayerGroup("chunked_local", [2], num_kv_heads=2, head_dim=4, chunk=16)], block_size=4)
    assert [lg.block_size(g) for g in range(3)] == [4, 8, 8]
    blocks, page = 48, lg.page_bytes
    nodes = []
    for fill in (5, None):
        cache = kv.HybridCache(lg, num_blocks=blocks, max_sequences=4, max_tokens=64)
        mem = np.zeros(page * blocks, dtype=np.uint8) if fill is None else \
            np.random.default_rng(fill).integers(0, 256, page * blocks, dtype=np.uint8)
        nodes.append((cache, mem, kv.LayoutHandshake.describe(lg, blocks, mem.ctypes.data, engine_id="h")))
    (pc, pmem, ph), (dc, dmem, dh) = nodes
    prompt = np.arange(1, 46, dtype=np.int32)
    seq = pc.admit(prompt).seq
    pc.computed(seq, 45)
    rows = [pc.export_block_table(g, [seq], 16)[0][:-(-45 // lg.block_size(g))] for g in range(3)]
    holds = kv.TransferHolds()
    hold = holds.hold(pc, pc.live_blocks(seq), consumers=1, deadline=10)
    pc.free(seq)  # the hold keeps every group's blocks until the reader is done

    imp, cached, n = dc.import_prompt(prompt)
    assert (cached, n, dc.imports) == (0, 12 + 2 + 2, 1)
    with pytest.raises(kv.InvalidArgument, match="group"):
        dc.import_blocks(imp, 3)
    planner = kv.TransferPlanner(dh, ph)
    received = []
    for g in range(3):
        skip, local = dc.import_blocks(imp, g)
        assert skip == (0, 4, 4)[g]  # a query at 45 reads 34 .. 44 (window 12), 32 .. 44 (chunk 16)
        assert skip + len(local) == len(rows[g])
        run(planner.plan(rows[g], local, group=g, skip=skip))
        received += [(int(r), int(l)) for r, l in zip(rows[g][skip:], local)]
    with pytest.raises(kv.InvalidArgument, match="prompt"):
        dc.commit_import(imp, prompt[::-1].copy())  # another prompt of the same length: refused
    seq2, published = dc.commit_import(imp, prompt)
    assert published == 11 + 1 + 1 and dc.imports == 0 and dc.computed_tokens(seq2) == 45
    for r, l in received:
        assert (pmem[r * page:(r + 1) * page] == dmem[l * page:(l + 1) * page]).all()
    dc.check_invariants()
    assert holds.consumed(pc, hold, 0) is True
    assert pc.free_blocks == blocks - 1

    # The transfer of a second copy fails: everything received goes back.
    imp, cached, n = dc.import_prompt(prompt)
    free = dc.free_blocks
    seq3, cached, recompute = dc.abort_import(imp)
    assert (cached, recompute) == (0, 45) and dc.free_blocks == free + n
    dc.check_invariants()
    # The old call without the prompt still commits, with a DeprecationWarning.
    dc.free(seq3)
    imp, _, _ = dc.import_prompt(prompt + 100)
    with pytest.warns(DeprecationWarning, match="commit_import"):
        seq4, _ = dc.commit_import(imp)
    assert dc.computed_tokens(seq4) == 45
    dc.check_invariants()


def test_transfer_holds_wait_for_readers_or_the_deadline():
    p = Pool(geometry())
    holds = kv.TransferHolds()
    prompt = np.arange(1, 17, dtype=np.int32)
    a = p.cache.admit(prompt)
    blocks = p.cache.export_block_table([a.seq], 4)[0]
    h = holds.hold(p.cache, blocks, consumers=2, deadline=100)
    p.cache.free(a.seq)
    assert p.cache.free_blocks == 11 and holds.size == 1
    assert holds.consumed(p.cache, h, 0) is False
    with pytest.raises(kv.InvalidArgument, match="already read"):
        holds.consumed(p.cache, h, 0)
    assert holds.consumed(p.cache, h, 1) is True and p.cache.free_blocks == 15
    b = p.cache.admit(prompt)
    g = holds.hold(p.cache, p.cache.export_block_table([b.seq], 4)[0], consumers=1, deadline=50)
    p.cache.free(b.seq)
    assert holds.expire(p.cache, 49) == [] and holds.expire(p.cache, 50) == [g]
    assert p.cache.free_blocks == 15 and p.cache.holds == 0
    with pytest.raises(kv.UnknownJob):
        holds.consumed(p.cache, g, 0)
    with pytest.raises(kv.InvalidArgument, match="consumers"):
        holds.hold(p.cache, blocks, consumers=0, deadline=1)


def test_kv_events_in_vllm_array_form():
    p = Pool(geometry(), events=64)
    prompt = np.arange(1, 14, dtype=np.int32)  # 3 full blocks
    a = p.cache.admit(prompt)
    p.cache.publish(a.seq, prompt)
    p.cache.free(a.seq)
    b = p.cache.admit(np.arange(500, 560, dtype=np.int32))  # 15 blocks: the pool recycles the 3 cached ones
    p.cache.free(b.seq)
    p.cache.reset_prefix_cache()
    data = p.cache.drain_kv_events(ts=12.5, dp_rank=3, group=0)
    ts, events, dp_rank = msgpack.unpackb(data)
    assert (ts, dp_rank) == (12.5, 3)
    stored = events[0]
    assert stored[0] == "BlockStored" and len(stored) == 10
    tag, hashes, parent, token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx = stored
    assert len(hashes) == 3 and all(isinstance(x, int) and 0 <= x < 2**64 for x in hashes)
    assert parent is None and token_ids == list(range(1, 13)) and block_size == B
    assert (lora_id, medium, lora_name, extra_keys, group_idx) == (None, "GPU", None, None, 0)
    assert [e[0] for e in events[1:]] == ["BlockRemoved", "AllBlocksCleared"]  # the three removals merged
    # Freed tail first, so recycled tail first: the chain's head stays cached longest.
    assert events[1] == ["BlockRemoved", hashes[::-1], "GPU", 0] and events[2] == ["AllBlocksCleared"]
    assert p.cache.drain_kv_events(ts=13.0) is None  # nothing left

    replay = kv.EventReplay(2)
    for i in range(3):
        assert replay.push(bytes([i])) == i
    assert replay.oldest == 1 and replay.replay(0) == [(1, b"\x01"), (2, b"\x02")]
    assert kv.sequence_frame(-1) == b"\xff" * 8 and kv.sequence_frame(258) == bytes(6) + b"\x01\x02"


def test_a_live_publisher_read_by_a_pyzmq_subscriber():
    zmq = pytest.importorskip("zmq")
    binary = os.environ.get("KVCACHE_EVENT_PUBLISHER")
    if not binary:
        pytest.skip("KVCACHE_EVENT_PUBLISHER not set (scripts/python sets it)")
    steps = 30
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    port = sub.bind_to_random_port("tcp://127.0.0.1")  # find two free ports, then hand them to the publisher
    sub.unbind(f"tcp://127.0.0.1:{port}")
    probe = ctx.socket(zmq.ROUTER)
    rport = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close(linger=0)
    proc = subprocess.Popen([binary, "--pub", f"tcp://127.0.0.1:{port}", "--replay", f"tcp://127.0.0.1:{rport}",
                             "--steps", str(steps), "--interval-ms", "30", "--linger-ms", "5000", "--topic", "kv"],
                            stdout=subprocess.PIPE, text=True)
    try:
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.RCVTIMEO = 10000
        seen = []
        while not seen or seen[-1] < steps - 1:
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv"
            seen.append(int.from_bytes(seq, "big", signed=True))
            ts, events, dp = msgpack.unpackb(payload)
            assert dp == 0 and events and all(e[0] in ("BlockStored", "BlockRemoved") for e in events)
        assert seen == list(range(seen[0], steps))  # in order, no gap after joining
        # Replay from 0: what a late subscriber missed, then the end marker.
        dealer = ctx.socket(zmq.DEALER)
        dealer.RCVTIMEO = 10000
        dealer.connect(f"tcp://127.0.0.1:{rport}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while True:
            empty, seq, payload = dealer.recv_multipart()
            s = int.from_bytes(seq, "big", signed=True)
            if s == -1:
                assert payload == b""
                break
            replayed.append(s)
            msgpack.unpackb(payload)
        assert replayed == list(range(steps))
        dealer.close(linger=0)
    finally:
        sub.close(linger=0)
        proc.terminate()
        proc.wait(timeout=10)
        ctx.term()
