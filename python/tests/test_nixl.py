"""Disaggregated prefill and decode over NIXL, two processes on 127.0.0.1
(UCX over TCP): the decode node meets the prefill node (agent metadata and
layout handshake), imports the prompt, reads its blocks with one prepared
NIXL READ, commits, and finds the prefill's bytes; with a prefix it already
holds it reads only the suffix; when the prefill node dies mid-transfer it
aborts and recomputes, leaking nothing; when it never reads, the prefill
node's hold expires and its blocks return. Skipped without the nixl wheel
(scripts/python installs nixl-cu12)."""
import multiprocessing as mp
import os

os.environ.setdefault("UCX_TLS", "tcp,self")
os.environ.setdefault("UCX_MODULES", "^ib")  # the wheel's bundled libnl crashes at exit without it

import numpy as np  # noqa: E402
import pytest  # noqa: E402

try:
    from kvcache.nixl import _nixl

    _nixl()
except ImportError:
    pytest.skip("the nixl wheel is not installed", allow_module_level=True)

import kvcache as kv  # noqa: E402
from kvcache.nixl import NixlLink  # noqa: E402

import nixl_nodes  # noqa: E402

PROMPT = list(range(1, 15))  # 3 full blocks and 2 tokens: 4 blocks


class Decode:
    def __init__(self, events=16):
        self.cache = kv.Cache(nixl_nodes.geometry(), num_blocks=nixl_nodes.BLOCKS, max_sequences=4, event_capacity=events)
        self.mem = np.zeros(nixl_nodes.geometry().pool_bytes(nixl_nodes.BLOCKS), dtype=np.uint8)
        self.link = NixlLink(kv.LayoutHandshake.describe(nixl_nodes.geometry(), nixl_nodes.BLOCKS, self.mem.ctypes.data,
                                                         engine_id="decode-0", memory="host"))
        self.bb = nixl_nodes.geometry().block_bytes

    def block(self, mem, b):
        return mem[b * self.bb:(b + 1) * self.bb]


def start(mode, ttl=10.0):
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=nixl_nodes.prefill_node, args=(there, PROMPT, mode, ttl))
    proc.start()
    assert here.poll(60), "the prefill node did not start"
    return proc, here


def finish(proc, conn):
    conn.send("bye")
    proc.join(30)
    assert proc.exitcode == 0


def test_the_decode_node_reads_the_prefill_and_commits():
    proc, conn = start("serve")
    d = Decode()
    try:
        md, remote_blocks, hold = conn.recv()
        peer = d.link.add_peer(md)
        assert d.link.peer(peer).engine_id == "prefill-0"
        imp, cached, skip, blocks = d.cache.import_prompt(np.array(PROMPT, dtype=np.int32))
        assert (cached, skip, len(blocks)) == (0, 0, 4)
        h = d.link.read(peer, remote_blocks, blocks, skip=skip, notify=f"read:{hold}".encode())
        assert d.link.wait(h, 20)
        seq, published = d.cache.commit_import(imp, np.array(PROMPT, dtype=np.int32))
        assert published == 3 and d.cache.tokens_held(seq) == 14
        theirs = nixl_nodes.pool_bytes(11)
        for r, l in zip(remote_blocks, blocks):
            assert (d.block(d.mem, int(l)) == d.block(theirs, r)).all()
        report = conn.recv()
        assert report["released_by"] == "reader"
        assert report["free"] == report["held_free"] + 4  # the prefill's blocks came back
        d.cache.check_invariants()
    finally:
        finish(proc, conn)
        d.link.close()


def test_a_prefix_the_decode_node_holds_is_not_read():
    proc, conn = start("serve")
    d = Decode()
    try:
        mine = d.cache.admit(np.array(PROMPT[:9], dtype=np.int32))  # 2 full blocks, computed here
        d.cache.publish(mine.seq, np.array(PROMPT[:9], dtype=np.int32))
        own = d.cache.export_block_table([mine.seq], 3)[0][:2]
        d.mem[:] = 7
        d.cache.free(mine.seq)
        md, remote_blocks, hold = conn.recv()
        peer = d.link.add_peer(md)
        imp, cached, skip, blocks = d.cache.import_prompt(np.array(PROMPT, dtype=np.int32))
        assert (cached, skip, len(blocks)) == (8, 2, 2)
        assert d.link.wait(d.link.read(peer, remote_blocks, blocks, skip=skip, coalesce=True, notify=f"read:{hold}".encode()), 20)
        seq, _ = d.cache.commit_import(imp, np.array(PROMPT, dtype=np.int32))
        row = d.cache.export_block_table([seq], 4)[0]
        assert list(row[:2]) == list(own)  # shared, untouched
        assert (d.block(d.mem, int(own[0])) == 7).all()
        theirs = nixl_nodes.pool_bytes(11)
        for r, l in zip(remote_blocks[2:], blocks):
            assert (d.block(d.mem, int(l)) == d.block(theirs, r)).all()
        assert conn.recv()["released_by"] == "reader"
    finally:
        finish(proc, conn)
        d.link.close()


def test_the_prefill_node_dies_mid_transfer_and_the_decode_node_recomputes():
    proc, conn = start("die")
    d = Decode()
    try:
        md, remote_blocks, hold = conn.recv()
        peer = d.link.add_peer(md)
        free = d.cache.free_blocks
        imp, cached, skip, blocks = d.cache.import_prompt(np.array(PROMPT, dtype=np.int32))
        conn.send("go")
        proc.join(30)
        assert proc.exitcode == 3
        try:
            h = d.link.read(peer, remote_blocks, blocks, skip=skip)
            landed = d.link.wait(h, 5)
        except Exception:  # NIXL may refuse to start a read to a dead peer
            landed = False
        assert not landed
        seq, cached_after, recompute = d.cache.abort_import(imp)
        assert (cached_after, recompute) == (0, 14) and d.cache.imports == 0
        assert d.cache.free_blocks == free and d.cache.match_prefix(np.array(PROMPT, dtype=np.int32)) == []
        d.cache.free(seq)
        d.cache.check_invariants()
    finally:
        d.link.close()


def test_a_reader_that_never_comes_lets_the_hold_expire():
    proc, conn = start("serve", ttl=0.5)
    try:
        conn.recv()  # the handshake; this decode node never reads
        report = conn.recv()
        assert report["released_by"] == "deadline"
        assert report["free"] == report["held_free"] + 4
    finally:
        finish(proc, conn)
