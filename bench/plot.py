#!/usr/bin/env python3
"""Plots the kernel bandwidth ratios (kernel GB/s over the same-run reference
GB/s: memcpy on the host, device-to-device copy on the GPU) of the given
Google Benchmark JSON files into one PNG. Needs Debian's python3-matplotlib."""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def ratios(path):
    with open(path) as f:
        data = json.load(f)
    med = {b["run_name"]: b for b in data["benchmarks"] if b.get("aggregate_name") == "median"}
    refs = {int(b["ref_id"]): b for n, b in med.items() if n.startswith(("BM_memcpy/", "BM_d2d_copy/"))}
    out = []
    for name, b in med.items():
        if b.get("bandwidth") and not name.startswith(("BM_memcpy/", "BM_d2d_copy/")) and int(b["ref_id"]) in refs:
            label = name.removeprefix("BM_").replace("/manual_time", "")
            out.append((label, b["bytes_per_second"] / refs[int(b["ref_id"])]["bytes_per_second"]))
    return data["context"].get("gpu", "host CPU"), out


def main():
    out_png, inputs = sys.argv[1], sys.argv[2:]
    fig, axes = plt.subplots(1, len(inputs), figsize=(6 * len(inputs), 4), squeeze=False)
    for ax, path in zip(axes[0], inputs):
        where, rows = ratios(path)
        ax.barh([r[0] for r in rows], [r[1] for r in rows], color="tab:blue")
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.axvline(0.9 if "gpu" in path or "cuda" in path else 0.7, color="tab:red", linestyle="--", linewidth=0.8,
                   label="target")
        ax.set_xlabel("bandwidth / reference (same run)")
        ax.set_title(where, fontsize=10)
        ax.invert_yaxis()
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)


if __name__ == "__main__":
    main()
