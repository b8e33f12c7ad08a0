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
    # Registration order, whatever order the runs were interleaved in.
    order = lambda b: (b.get("family_index", 0), b.get("per_family_instance_index", 0))
    for b in sorted(data["benchmarks"], key=order):
        if b.get("aggregate_name") != "median":
            continue
        scale = {"ns": 1, "us": 1e3, "ms": 1e6, "s": 1e9}[b.get("time_unit", "ns")]
        rows[b["run_name"]] = dict(b, ns=b["real_time"] * scale)
    reps = {b.get("repetitions") for b in data["benchmarks"]}
    return dict(data["context"], repetitions=max(r for r in reps if r) if any(reps) else "?"), rows


def main():
    context, rows = medians(sys.argv[1])
    # Reference rows, and how they are named: memcpy on the host; on a GPU a
    # device-to-device copy, and one pinned host <-> device copy for transfers.
    kinds = {"BM_memcpy/": "memcpy", "BM_d2d_copy/": "D2D copy", "BM_h2d_copy/": "H2D copy", "BM_d2h_copy/": "D2H copy"}
    ref_prefix = next((p for p in ("BM_memcpy/", "BM_d2d_copy/") if any(n.startswith(p) for n in rows)), "BM_memcpy/")
    ref_name = kinds[ref_prefix]
    # References are matched by ref_id when the suite sets one, else by bytes.
    key = lambda r: int(r["ref_id"]) if "ref_id" in r else int(r.get("out_bytes", -1))
    memcpy = {key(r): r for name, r in rows.items() if name.startswith(ref_prefix)}
    big = max(memcpy, key=lambda k: memcpy[k]["out_bytes"]) if memcpy else None
    named = {key(r): kinds[p] for name, r in rows.items() for p in kinds if name.startswith(p)}
    for name, r in rows.items():
        if any(name.startswith(p) for p in kinds if p != ref_prefix):
            memcpy.setdefault(key(r), r)
    if context.get("gpu"):
        print(f"GPU: {context['gpu']}.")
    print(f"Machine: {context.get('num_cpus')} CPUs at {context.get('mhz_per_cpu')} MHz, "
          f"median of {context.get('repetitions', '?')} repetitions.")
    if big:
        size = int(memcpy[big]["out_bytes"])
        size = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        print(f"Reference: {ref_name} of {size} = {memcpy[big]['bytes_per_second'] / 1e9:.1f} GB/s "
              "(bytes copied per second), same run.\n")
    print("| benchmark | median | reference (same run) | ratio |")
    print("| --- | ---: | --- | ---: |")
    for name, r in rows.items():
        if any(name.startswith(p) for p in kinds):
            continue
        ref, ratio = "—", "—"
        out = int(r.get("out_bytes", 0))
        if key(r) in memcpy:
            m = memcpy[key(r)]
            what = named.get(key(r), ref_name)
            if r.get("bandwidth"):  # a copy kernel: compare bandwidths
                ref = f"{what} {out:,} B: {m['bytes_per_second'] / 1e9:.1f} GB/s"
                ratio = f"{r['bytes_per_second'] / m['bytes_per_second']:.2f}"
                name = f"{name} ({r['bytes_per_second'] / 1e9:.1f} GB/s)"
            else:
                ref = f"{what} {out:,} B: {fmt_time(m['ns'])}"
                ratio = f"{r['ns'] / m['ns']:.1f}× {what}"
        if r.get("label"):
            name = f"{name} [{r['label']}]"
        print(f"| {name.removeprefix('BM_')} | {fmt_time(r['ns'])} | {ref} | {ratio} |")


if __name__ == "__main__":
    main()
