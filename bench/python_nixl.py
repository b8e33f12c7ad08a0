"""A NIXL transfer over loopback against memcpy of the same bytes, same run.

Two NIXL agents in one process (kvcache.nixl.NixlLink, UCX; on a machine
without RDMA over TCP on 127.0.0.1): a decode-side pool reads 32 blocks of a
Llama-8B-like layout (32 layers, 8 kv-heads of 128, fp16, blocks of 16
tokens: 2 MiB a block, 64 MiB in all) from a prefill-side pool with separate
planes into an interleaved one. Three ways: one prepared READ over the
planner's descriptor ids (2,048 descriptors of 32 KiB), one READ of the
coalesced plan (2,048 as well here: separate planes into interleaved meet
nowhere), and for the coalescing's sake interleaved into interleaved (one
descriptor). The reference is numpy's copy of the same 64 MiB. Medians of 7.

    UCX_TLS=tcp,self UCX_MODULES=^ib python3 bench/python_nixl.py
    UCX_TLS=shm,self python3 bench/python_nixl.py --shm   (shared memory: UCX needs
                                                           ucx_error_handling_mode=none)
"""
import os
import statistics
import sys
import time

os.environ.setdefault("UCX_TLS", "tcp,self")
os.environ.setdefault("UCX_MODULES", "^ib")

import numpy as np  # noqa: E402

import kvcache as kv  # noqa: E402
from kvcache.nixl import NixlLink  # noqa: E402

BLOCKS, REPS = 32, 7


def geometry(planes):
    return kv.Geometry(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=kv.DType.f16, planes=planes)


def median_s(f):
    times = []
    for _ in range(REPS):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    n = BLOCKS + 1
    src_g, dst_g = geometry(kv.KvPlanes.separate), geometry(kv.KvPlanes.interleaved)
    src = np.ones(src_g.pool_bytes(n), dtype=np.uint8)
    src_i = np.ones(dst_g.pool_bytes(n), dtype=np.uint8)
    dst = np.zeros(dst_g.pool_bytes(n), dtype=np.uint8)
    nbytes = BLOCKS * dst_g.block_bytes
    ids = np.arange(1, n, dtype=np.int32)
    params = {"ucx_error_handling_mode": "none"} if "--shm" in sys.argv else None
    reader = NixlLink(kv.LayoutHandshake.describe(dst_g, n, dst.ctypes.data, engine_id="decode", memory="host"),
                      backend_params=params)
    sep = NixlLink(kv.LayoutHandshake.describe(src_g, n, src.ctypes.data, engine_id="prefill-separate", memory="host"),
                   backend_params=params)
    inter = NixlLink(kv.LayoutHandshake.describe(dst_g, n, src_i.ctypes.data, engine_id="prefill-interleaved",
                                                 memory="host"), backend_params=params)
    p_sep, p_inter = reader.add_peer(sep.metadata()), reader.add_peer(inter.metadata())

    def read(peer, coalesce):
        def run():
            assert reader.wait(reader.read(peer, ids, ids, coalesce=coalesce), 60)
        return run

    rows = []
    memcpy = median_s(lambda: np.copyto(dst[:nbytes], src[:nbytes]))
    for name, peer, coalesce in [("prepared READ, separate -> interleaved", p_sep, False),
                                 ("coalesced READ, separate -> interleaved", p_sep, True),
                                 ("coalesced READ, interleaved -> interleaved", p_inter, True)]:
        read(peer, coalesce)()  # warm: connection, registration caches
        planner = kv.TransferPlanner(reader.handshake, reader.peer(peer))
        descs = len(planner.plan(ids, ids, coalesce=coalesce))
        rows.append((name, descs, median_s(read(peer, coalesce))))
    print(f"UCX_TLS={os.environ['UCX_TLS']}: {BLOCKS} blocks, {nbytes / 2**20:.0f} MiB; numpy copy of the same bytes: {memcpy * 1e3:.2f} ms "
          f"({nbytes / memcpy / 1e9:.1f} GB/s), same run, medians of {REPS}\n")
    print("| transfer | descriptors | median | GB/s | vs memcpy |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, descs, s in rows:
        print(f"| {name} | {descs:,} | {s * 1e3:.2f} ms | {nbytes / s / 1e9:.2f} | {memcpy / s:.2f} |")
    for link in (reader, sep, inter):
        link.close()


if __name__ == "__main__":
    main()
