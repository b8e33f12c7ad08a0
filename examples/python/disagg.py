#!/usr/bin/env python3
"""Disaggregated serving with the example engine, in PyTorch: a prefill
process and a decode process on one machine, NIXL moving the KV over UCX on
127.0.0.1 (kvcache.nixl.NixlLink). The decode process sends each prompt to
the prefill process, which computes it, returns its first token and block
ids, and holds the blocks (kv.TransferHolds) until the decode process's
NIXL notification says it has read them. The decode process imports the
prompt (its own prefix cache serves what it can; only the rest is read),
reads, commits and decodes. The tokens are those of one process serving
alone (the reference, computed first).

Failures, as a deployment sees them: --die-at K kills the prefill process
after it answered request K and before the read (the decode process aborts
the import and computes the prompt itself, from then on for every request);
--skip-read K never reads request K (the decode process computes it; the
prefill process's hold expires after --ttl-ms and its blocks return).

  python3 examples/python/disagg.py [--requests 6] [--first 128] [--user 32] [--new 16] [--die-at -1] [--skip-read -1]

It prints each request's source of KV and whether its tokens match, and with
--json writes them (python/tests/test_disagg_engine.py runs every variant).
"""
import argparse
import json
import multiprocessing as mp
import os
import pathlib
import sys
import time

os.environ.setdefault("UCX_TLS", "tcp,self")
os.environ.setdefault("UCX_MODULES", "^ib")  # the nixl wheel's bundled libnl crashes at exit without it

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import engine as eng  # noqa: E402
import model as mdl  # noqa: E402
import kvcache as kv  # noqa: E402


class _Row:
    def __init__(self, seq):
        self.seqs = [seq]


class Node:
    """One engine's cache, pool and forward pass (tiered.py's engine without tiers)."""

    def __init__(self, model, blocks=96, block_size=16, chunk=64, max_sequences=4):
        c = model.c
        self.m, self.fwd, self.B, self.chunk = model, eng.Forward(model), block_size, chunk
        self.heads, self.head_dim = c["kv_heads"], c["dim"] // c["q_heads"]
        self.cfg = eng.EngineConfig(block_size=block_size)
        self.geometry = kv.Geometry(num_layers=c["layers"], num_kv_heads=c["kv_heads"], head_dim=c["dim"] // c["q_heads"],
                                    block_size=block_size, dtype=kv.DType.f32)
        self.blocks = blocks
        self.memory = torch.zeros(self.geometry.pool_bytes(blocks), dtype=torch.uint8)
        self.pool = kv.PoolView(self.geometry, self.memory, blocks)
        self.cache = kv.Cache(self.geometry, num_blocks=blocks, max_sequences=max_sequences,
                              max_blocks_per_sequence=c["context"] // block_size + 1, publish_on_reserve=True)
        self.positions = torch.full((1, blocks * block_size), -1, dtype=torch.long)
        self.indptr, self.last = np.zeros(2, dtype=np.int32), np.zeros(1, dtype=np.int32)

    def group_of(self, layer, head):  # engine.PagedKv's position table: one group
        return 0

    def handshake(self, name):
        return kv.LayoutHandshake.describe(self.geometry, self.blocks, self.memory.data_ptr(), engine_id=name, memory="host")

    def blocks_of(self, seq, n_tokens):
        return self.cache.export_block_table([seq], -(-n_tokens // self.B))[0]

    def _forward(self, seq, tokens, slots, at):
        return self.fwd.run(eng.PagedKv(self, _Row(seq), np.asarray(slots, dtype=np.int32)[None], at), tokens, at, True)[0]

    def compute(self, seq, prompt, at, slots=None):
        """Computes prompt[at:] on seq (which holds prompt[:at]) in chunks; returns the first token."""
        arr = np.asarray(prompt, dtype=np.int32)
        logits = None
        while at < len(prompt):
            n = min(self.chunk, len(prompt) - at)
            slot, _, _ = self.cache.reserve(seq, arr[at:at + n])
            logits = self._forward(seq, prompt[at:at + n], slot, at)
            at += n
        return int(torch.argmax(logits))

    def prefill(self, prompt):
        """A new sequence holding the prompt's KV; returns (seq, first token)."""
        a = self.cache.admit(np.asarray(prompt, dtype=np.int32), reserve=0)
        return a.seq, self.compute(a.seq, prompt, a.cached_tokens)

    def received(self, blocks, first_block):
        """Imported blocks hold their tokens' KV now: the forward pass reads their positions."""
        for i, b in enumerate(blocks):
            base = int(b) * self.B
            self.positions[0, base:base + self.B] = torch.arange((first_block + i) * self.B, (first_block + i + 1) * self.B)

    def decode(self, seq, first, n_prompt, max_new):
        out = [first]
        for pos in range(n_prompt, n_prompt + max_new - 1):
            slot, _, _ = self.cache.reserve(seq, np.array([out[-1]], dtype=np.int32))
            out.append(int(torch.argmax(self._forward(seq, [out[-1]], slot, pos))))
        return out


def requests(n, first=128, user=32):
    """Prompts that share prefixes: pairs of requests continue one text."""
    text = list((mdl.MODEL_DIR / "heldout.bin").read_bytes())
    out = []
    for i in range(n):
        at = (i // 2) * 5003
        out.append(text[at:at + first + (i % 2) * user])
    return out


def reference(model, prompts, max_new):
    """One process serving alone: prefill and decode on one node."""
    node, out = Node(model), []
    for p in prompts:
        seq, first = node.prefill(p)
        out.append(node.decode(seq, first, len(p), max_new))
        node.cache.free(seq)
    return out


def prefill_process(conn, ttl_ms):
    """The prefill node: answers ("prefill", prompt) with (first token, blocks, hold id), releases holds on
    "read:<hold>" notifications or at their deadline, dies on ("die",), reports on ("stop",)."""
    from kvcache.nixl import NixlLink

    torch.set_num_threads(1)
    node = Node(mdl.load())
    link = NixlLink(node.handshake("prefill-0"))
    holds, stats = kv.TransferHolds(), {"read": 0, "expired": 0}
    conn.send(link.metadata())
    while True:
        for msgs in link.notifications().values():
            for m in msgs:
                if m.startswith(b"read:") and holds.consumed(node.cache, int(m[5:]), 0):
                    stats["read"] += 1
        stats["expired"] += len(holds.expire(node.cache, int(time.monotonic() * 1000)))
        if not conn.poll(0.002):
            continue
        msg = conn.recv()
        if msg[0] == "prefill":
            seq, first = node.prefill(msg[1])
            blocks = node.blocks_of(seq, len(msg[1]))
            hold = holds.hold(node.cache, blocks, consumers=1, deadline=int(time.monotonic() * 1000) + ttl_ms)
            node.cache.free(seq)  # done here; the hold keeps the blocks until they are read
            conn.send((first, [int(b) for b in blocks], hold))
        elif msg[0] == "die":
            os._exit(3)
        elif msg[0] == "stop":
            while holds.size:  # the last holds: read, or expire
                for msgs in link.notifications().values():
                    for m in msgs:
                        if m.startswith(b"read:") and holds.consumed(node.cache, int(m[5:]), 0):
                            stats["read"] += 1
                stats["expired"] += len(holds.expire(node.cache, int(time.monotonic() * 1000)))
                time.sleep(0.002)
            node.cache.check_invariants()
            stats["free_blocks"], stats["usable_blocks"] = node.cache.free_blocks, node.blocks - 1
            conn.send(stats)
            conn.recv()
            link.close()
            return


def disaggregated(model, prompts, max_new, die_at=-1, skip_read=-1, ttl_ms=300, timeout=20.0):
    """The decode node: returns (tokens per request, how each got its KV, the prefill node's report)."""
    from kvcache.nixl import NixlLink

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=prefill_process, args=(child, ttl_ms))
    proc.start()
    node = Node(model)
    link = NixlLink(node.handshake("decode-0"))
    out, how, report, alive = [], [], None, True
    try:
        if not conn.poll(120):
            raise RuntimeError("the prefill process did not start")
        peer = link.add_peer(conn.recv())
        for i, p in enumerate(prompts):
            arr = np.asarray(p, dtype=np.int32)
            if not alive:  # no prefill node: compute here
                seq, first = node.prefill(p)
                out.append(node.decode(seq, first, len(p), max_new))
                how.append("local")
                node.cache.free(seq)
                continue
            conn.send(("prefill", p))
            first, remote, hold = conn.recv()
            if i == die_at:
                conn.send(("die",))
                proc.join(30)
                alive = False
            imp, cached, skip, blocks = node.cache.import_prompt(arr)
            landed = False
            if i != skip_read:
                try:
                    h = link.read(peer, remote, blocks, skip=skip, notify=b"read:%d" % hold)
                    landed = link.wait(h, timeout if alive else 2.0)
                except Exception:  # NIXL may refuse a read from a dead peer
                    landed = False
            if landed:
                seq, _ = node.cache.commit_import(imp, arr)
                node.received(blocks, skip)
                how.append("read" if skip == 0 else f"read {len(blocks)} of {skip + len(blocks)} blocks")
            else:  # the transfer failed: compute what did not arrive
                seq, cached, _ = node.cache.abort_import(imp)
                first = node.compute(seq, p, cached)
                how.append("recomputed")
            out.append(node.decode(seq, first, len(p), max_new))
            node.cache.free(seq)
            node.cache.check_invariants()
        if alive:
            conn.send(("stop",))
            report = conn.recv()
            conn.send("bye")
            proc.join(30)
    finally:
        if proc.is_alive():
            proc.terminate()
        link.close()
    return out, how, report


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in [("requests", 6), ("first", 128), ("user", 32), ("new", 16), ("die-at", -1), ("skip-read", -1),
                          ("ttl-ms", 300)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--json")
    a = p.parse_args()
    torch.set_num_threads(1)
    model = mdl.load()
    prompts = requests(a.requests, a.first, a.user)
    ref = reference(model, prompts, a.new)
    out, how, report = disaggregated(model, prompts, a.new, a.die_at, a.skip_read, a.ttl_ms)
    for i, (o, h) in enumerate(zip(out, how)):
        print(f"request {i}: prompt {len(prompts[i]):4} tokens, KV {h:24} tokens {'match' if o == ref[i] else 'DIFFER'}")
    print("prefill node:", report)
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(dict(reference=ref, tokens=out, how=how, prefill=report)))
    return 0 if out == ref else 1


if __name__ == "__main__":
    sys.exit(main())
