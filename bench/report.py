#!/usr/bin/env python3
"""Turns Google Benchmark JSON (run with repetitions) into a markdown table of
medians. Host rows that write `out_bytes` are compared with BM_memcpy of the
same byte count from the same run: ratio = time / memcpy time."""
import json
import sys


def fmt_time(ns):
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.2f} µs"
    return f"{ns:.1f} ns"


def medians(path):
    with open(path) as f:
        data = json.load(f)
    rows = {}
    for b in data["benchmarks"]:
        if b.get("aggregate_name") != "median":
            continue
        scale = {"ns": 1, "us": 1e3, "ms": 1e6, "s": 1e9}[b.get("time_unit", "ns")]
        rows[b["run_name"]] = dict(b, ns=b["real_time"] * scale)
    reps = {b.get("repetitions") for b in data["benchmarks"]}
    return dict(data["context"], repetitions=max(r for r in reps if r) if any(reps) else "?"), rows


def main():
    context, rows = medians(sys.argv[1])
    memcpy = {int(r["out_bytes"]): r for name, r in rows.items() if name.startswith("BM_memcpy/")}
    big = max(memcpy) if memcpy else None
    print(f"Machine: {context.get('num_cpus')} CPUs at {context.get('mhz_per_cpu')} MHz, "
          f"median of {context.get('repetitions', '?')} repetitions.")
    if big:
        print(f"Reference: memcpy of {big >> 20} MiB = {memcpy[big]['bytes_per_second'] / 1e9:.1f} GB/s "
              "(bytes copied per second), same run.\n")
    print("| benchmark | median | reference (same run) | ratio |")
    print("| --- | ---: | --- | ---: |")
    for name, r in rows.items():
        if name.startswith("BM_memcpy/"):
            continue
        ref, ratio = "—", "—"
        out = int(r.get("out_bytes", 0))
        if out in memcpy:
            ref = f"memcpy {out:,} B: {fmt_time(memcpy[out]['ns'])}"
            ratio = f"{r['ns'] / memcpy[out]['ns']:.1f}× memcpy"
        print(f"| {name.removeprefix('BM_')} | {fmt_time(r['ns'])} | {ref} | {ratio} |")


if __name__ == "__main__":
    main()
