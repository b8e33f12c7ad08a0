#!/usr/bin/env python3
"""Disaggregated serving with the example engine, in PyTorch: a prefill
process and a decode process on one machine, NIXL moving the KV over UCX on
127.0.0.1 (kvcache.nixl.NixlLink). Both run engine.py's one engine on layer
groups (EngineConfig(layer_groups=True); --window W: the odd layers a
window of W tokens). The decode process sends each prompt to the prefill
process, which computes it (Request(hand_off=True)), returns its first
token and every group's row, and holds the pages (kv.TransferHolds) until
the decode process's NIXL notification says it has read them. The decode
process imports the prompt (Request(remote=...): its own prefix cache
serves what it can; only the rest of every group is read), commits and
decodes. The tokens are those of one process serving alone (the
reference, computed first).

Failures, as a deployment sees them: --die-at K kills the prefill process
after it answered request K and before the read (the decode process aborts
the import and computes the prompt itself, from then on for every request);
--skip-read K never reads request K (the decode process computes it; the
prefill process's hold expires after --ttl-ms and its blocks return).

  python3 examples/python/disagg.py [--requests 6] [--first 128] [--user 32] [--new 16] [--die-at -1] [--skip-read -1]
                                    [--window 0]

It prints each request's source of KV and whether its tokens match, and with
--json writes them (python/tests/test_disagg_engine.py runs every variant).
"""
import argparse
import dataclasses
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
from group_io import Handoff  # noqa: E402
import kvcache as kv  # noqa: E402


def config(window=0):
    """Both processes' engine: the layers on kv.HybridCache (one full group of
    96 pages, or the odd layers a window of `window` tokens), prefix caching."""
    return eng.EngineConfig(max_kv_tokens=95 * 16, chunk=64, max_batch=4, window=window, layer_groups=True,
                            prefix_caching=True)


def node(model, window=0):
    return eng.Engine(model, config(window), kv.KeepAll())


def handshake(e, name):
    """The pool's layout for NIXL: every group's pages, registered once."""
    return kv.LayoutHandshake.describe(e.groups, e.blocks, e.memory.data_ptr(), engine_id=name, memory="host")


class RemoteHold:
    """The prefill process's hold on a hand-off (kv.TransferHolds there): released
    by the read's notification, or at its deadline; nothing to do here."""

    def __init__(self, hold_id):
        self.id, self.held = hold_id, True

    def release(self):
        self.held = False


@dataclasses.dataclass
class NixlHandoff(Handoff):
    """A hand-off whose pages are read over NIXL: every group's, one read after
    another; the last one's notification tells the prefill process it may
    release its hold (an import always receives the last group's last block:
    a hit never covers a whole prompt)."""
    link: object = None
    peer: str = ""
    timeout: float = 20.0
    skip_read: bool = False  # never read: the prefill process's hold expires
    landed: bool = False
    blocks: tuple = (0, 0)   # (read, the prompt's blocks over every group)

    def read_into(self, cache, import_id, memory):
        if self.skip_read:
            return False
        notify, read, total = b"read:%d" % self.hold.id, 0, 0
        try:
            for g, row in enumerate(self.rows):
                skip, local = cache.import_blocks(import_id, g)
                last = g == len(self.rows) - 1
                h = self.link.read(self.peer, row, local, group=g, skip=skip, notify=notify if last else b"")
                if not self.link.wait(h, self.timeout):
                    return False
                read, total = read + len(local), total + skip + len(local)
        except Exception:  # NIXL may refuse a read from a dead peer
            return False
        self.landed, self.blocks = True, (read, total)
        return True


def requests(n, first=128, user=32):
    """Prompts that share prefixes: pairs of requests continue one text."""
    text = list((mdl.MODEL_DIR / "heldout.bin").read_bytes())
    out = []
    for i in range(n):
        at = (i // 2) * 5003
        out.append(text[at:at + first + (i % 2) * user])
    return out


def serve_alone(e, prompt, max_new, remote=None):
    r = eng.Request(id=0, prompt=list(prompt), max_new=max_new, remote=remote)
    e.run([r])
    e.cache.check_invariants()
    return r.output


def reference(model, prompts, max_new, window=0):
    """One process serving alone: prefill and decode on one engine."""
    e = node(model, window)
    return [serve_alone(e, p, max_new) for p in prompts]


def prefill_process(conn, ttl_ms, window):
    """The prefill node: answers ("prefill", prompt) with its hand-off (first token, logits, rows, layout, hold
    id), releases holds on "read:<hold>" notifications or at their deadline, dies on ("die",), reports on ("stop",)."""
    from kvcache.nixl import NixlLink

    torch.set_num_threads(1)
    e = node(mdl.load(), window)
    link = NixlLink(handshake(e, "prefill-0"))
    holds, stats = kv.TransferHolds(), {"read": 0, "expired": 0}
    conn.send(link.metadata())

    def settle():
        for msgs in link.notifications().values():
            for m in msgs:
                if m.startswith(b"read:") and holds.consumed(e.cache, int(m[5:]), 0):
                    stats["read"] += 1
        stats["expired"] += len(holds.expire(e.cache, int(time.monotonic() * 1000)))

    while True:
        settle()
        if not conn.poll(0.002):
            continue
        msg = conn.recv()
        if msg[0] == "prefill":
            r = eng.Request(id=0, prompt=list(msg[1]), max_new=1, hand_off=True)
            e.run([r])
            h = r.handoff  # held by the engine: the transfer's hold (with its deadline) takes over
            pages = np.concatenate([row[row != 0] for row in h.rows])
            hold = holds.hold(e.cache, pages, consumers=1, deadline=int(time.monotonic() * 1000) + ttl_ms)
            h.hold.release()
            conn.send((h.first, h.logits, [row.tolist() for row in h.rows], h.layout, hold))
        elif msg[0] == "die":
            os._exit(3)
        elif msg[0] == "stop":
            while holds.size:  # the last holds: read, or expire
                settle()
                time.sleep(0.002)
            e.cache.check_invariants()
            stats["free_blocks"], stats["usable_blocks"] = e.cache.free_blocks, e.blocks - 1
            conn.send(stats)
            conn.recv()
            link.close()
            return


def disaggregated(model, prompts, max_new, die_at=-1, skip_read=-1, ttl_ms=300, timeout=20.0, window=0):
    """The decode node: returns (tokens per request, how each got its KV, the prefill node's report)."""
    from kvcache.nixl import NixlLink

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=prefill_process, args=(child, ttl_ms, window))
    proc.start()
    e = node(model, window)
    link = NixlLink(handshake(e, "decode-0"))
    out, how, report, alive = [], [], None, True
    try:
        if not conn.poll(120):
            raise RuntimeError("the prefill process did not start")
        peer = link.add_peer(conn.recv())
        for i, p in enumerate(prompts):
            if not alive:  # no prefill node: compute here
                out.append(serve_alone(e, p, max_new))
                how.append("local")
                continue
            conn.send(("prefill", p))
            first, logits, rows, layout, hold = conn.recv()
            if i == die_at:
                conn.send(("die",))
                proc.join(30)
                alive = False
            h = NixlHandoff(prompt=list(p), first=first, logits=logits, rows=[np.asarray(r, dtype=np.int32) for r in rows],
                            memory=None, layout=layout, scales=None, hold=RemoteHold(hold), link=link, peer=peer,
                            timeout=timeout if alive else 2.0, skip_read=i == skip_read)
            hit = e.prefix_hit_tokens
            out.append(serve_alone(e, p, max_new, remote=h))
            read, total = h.blocks
            how.append(("read" if e.prefix_hit_tokens == hit else f"read {read} of {total} blocks") if h.landed
                       else "recomputed")
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
                          ("ttl-ms", 300), ("window", 0)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--json")
    a = p.parse_args()
    torch.set_num_threads(1)
    model = mdl.load()
    prompts = requests(a.requests, a.first, a.user)
    ref = reference(model, prompts, a.new, a.window)
    out, how, report = disaggregated(model, prompts, a.new, a.die_at, a.skip_read, a.ttl_ms, window=a.window)
    for i, (o, h) in enumerate(zip(out, how)):
        print(f"request {i}: prompt {len(prompts[i]):4} tokens, KV {h:24} tokens {'match' if o == ref[i] else 'DIFFER'}")
    print("prefill node:", report)
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(dict(reference=ref, tokens=out, how=how, prefill=report)))
    return 0 if out == ref else 1


if __name__ == "__main__":
    sys.exit(main())
