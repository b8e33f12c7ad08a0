"""The decode step's bookkeeping from Python against the same step in C++.

BM_decode_step_256 (bench/bench_core.cpp) in Python: 256 sequences of 509
prompt tokens, then per step one token each through reserve_batch and the
batch's CSR through export_csr, into preallocated arrays. The reference is
measured in the same run: bench_core's BM_decode_step_256 (Release build),
and one call's overhead (a read-only property, one crossing into C++).
Medians of 7 repetitions of 512 steps.

    python3 bench/python_decode.py [path/to/bench_core]   (default build/bench/bench/bench_core)
"""
import json
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import kvcache as kv

SEQS, CONTEXT, STEPS, REPS = 256, 512, 512, 7


def python_step_us():
    per_seq = (CONTEXT + STEPS) // 16 + 1
    g = kv.Geometry(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=kv.DType.f16)
    c = kv.Cache(g, num_blocks=SEQS * per_seq + 1, max_sequences=SEQS, max_blocks_per_sequence=per_seq)
    slots = np.zeros(CONTEXT, dtype=np.int32)
    seqs = np.zeros(SEQS, dtype=np.uint64)
    for k in range(SEQS):
        seqs[k] = c.admit(np.arange(k * 1000, k * 1000 + CONTEXT - 3, dtype=np.int32), slots).seq
    ones = np.ones(SEQS, dtype=np.int32)
    step_slots = np.zeros(SEQS, dtype=np.int32)
    copies = np.zeros((SEQS, 2), dtype=np.int32)
    indptr = np.zeros(SEQS + 1, dtype=np.int32)
    indices = np.zeros(SEQS * per_seq, dtype=np.int32)
    last = np.zeros(SEQS, dtype=np.int32)
    reserve_batch, export_csr = c.reserve_batch, c.export_csr
    t0 = time.perf_counter_ns()
    for _ in range(STEPS):
        reserve_batch(seqs, ones, step_slots, copies)
        export_csr(seqs, indptr, indices, last)
    return (time.perf_counter_ns() - t0) / STEPS / 1000.0, c


def call_us(c, n=200_000):
    t0 = time.perf_counter_ns()
    for _ in range(n):
        c.free_blocks
    return (time.perf_counter_ns() - t0) / n / 1000.0


def cpp_step_us(bench_core):
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([bench_core, "--benchmark_filter=^BM_decode_step_256/", f"--benchmark_repetitions={REPS}",
                        "--benchmark_report_aggregates_only=true", f"--benchmark_out={out.name}",
                        "--benchmark_out_format=json"], check=True, stdout=subprocess.DEVNULL)
        runs = json.load(open(out.name))["benchmarks"]
    return next(b["real_time"] for b in runs if b.get("aggregate_name") == "median")


def main():
    bench_core = sys.argv[1] if len(sys.argv) > 1 else "build/bench/bench/bench_core"
    steps, calls = [], []
    for _ in range(REPS):
        us, c = python_step_us()
        steps.append(us)
        calls.append(call_us(c))
    py, call = statistics.median(steps), statistics.median(calls)
    cpp = cpp_step_us(bench_core)
    print("| decode step, 256 sequences (reserve_batch + export_csr) | median µs |")
    print("| --- | ---: |")
    print(f"| C++ (bench_core BM_decode_step_256, same run) | {cpp:.2f} |")
    print(f"| Python, two calls into the bindings | {py:.2f} |")
    print(f"| one call's overhead (a property read) | {call:.3f} |")
    print(f"\nPython / C++: {py / cpp:.2f}x; (Python - one call) / C++: {(py - call) / cpp:.2f}x "
          f"(the target: at most 2x plus one call)")


if __name__ == "__main__":
    main()
