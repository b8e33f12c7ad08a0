"""The prefill node of test_nixl.py, run in its own process: a cache over a
numpy pool whose blocks hold known bytes, a NIXL agent with the pool
registered, and a transfer hold on the prompt's blocks until the decode
node's notification names it or its deadline passes."""
import os
import time

import numpy as np

import kvcache as kv
from kvcache.nixl import NixlLink

B = 4
BLOCKS = 32


def geometry():
    return kv.Geometry(num_layers=2, num_kv_heads=2, head_dim=8, block_size=B, dtype=kv.DType.f16)


def pool_bytes(seed):
    """What a node's pool holds: the prefill's "computed" KV, the same in both processes."""
    g = geometry()
    return np.random.default_rng(seed).integers(0, 256, g.pool_bytes(BLOCKS), dtype=np.uint8)


def prefill_node(conn, prompt, mode, ttl):
    """mode: "serve" (hold until read or ttl), "die" (exit right after the handshake)."""
    cache = kv.Cache(geometry(), num_blocks=BLOCKS, max_sequences=4)
    mem = pool_bytes(11)
    link = NixlLink(kv.LayoutHandshake.describe(geometry(), BLOCKS, mem.ctypes.data, engine_id="prefill-0", memory="host"))
    a = cache.admit(np.asarray(prompt, dtype=np.int32))
    blocks = cache.export_block_table([a.seq], 8)[0][:cache.blocks_held(a.seq)]
    holds = kv.TransferHolds()
    hold = holds.hold(cache, blocks, consumers=1, deadline=int(time.monotonic() * 1000) + int(ttl * 1000))
    cache.free(a.seq)  # the request is done here; the hold keeps the blocks
    held_free = cache.free_blocks
    conn.send((link.metadata(), [int(b) for b in blocks], hold))
    if mode == "die":
        conn.recv()  # the decode node has met us and is about to read
        os._exit(3)
    report = {"held_free": held_free, "released_by": None}
    end = time.monotonic() + ttl + 5
    while report["released_by"] is None and time.monotonic() < end:
        for msgs in link.notifications().values():
            for m in msgs:
                if m.startswith(b"read:") and holds.consumed(cache, int(m[5:]), 0):
                    report["released_by"] = "reader"
        if report["released_by"] is None and holds.expire(cache, int(time.monotonic() * 1000)):
            report["released_by"] = "deadline"
        time.sleep(0.005)
    cache.check_invariants()
    report["free"] = cache.free_blocks
    conn.send(report)
    conn.recv()  # keep the agent (and its memory) alive until the decode node is done
    link.close()
