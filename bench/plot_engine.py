#!/usr/bin/env python3
"""Plots the example engine's results: quality against budget per policy, and
KV memory over time (full cache against sliding windows).
usage: plot_engine.py RESULTS_DIR   (reads quality.csv and memory.csv there)"""
import csv
import pathlib
import sys

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

d = pathlib.Path(sys.argv[1])
rows = list(csv.DictReader(open(d / "quality.csv")))
fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
for r in rows:  # the full cache (budget 0) is the reference line
    if r["policy"] == "keep_all":
        a1.axhline(1.0, color="grey", ls="--", lw=1)
        a2.axhline(float(r["perplexity"]), color="grey", ls="--", lw=1, label="full cache")
rows = [r for r in rows if r["policy"] != "keep_all"]
for policy in dict.fromkeys(r["policy"] for r in rows):
    pts = [(int(r["budget"]), float(r["agreement"]), float(r["perplexity"])) for r in rows if r["policy"] == policy]
    a1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
    a2.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=policy)
a1.set(xlabel="budget (tokens per request)", ylabel="greedy token agreement with the full cache", xscale="log")
a2.set(xlabel="budget (tokens per request)", ylabel="held-out perplexity (policy active)", xscale="log")
for a in (a1, a2):
    a.set_xticks([128, 256, 512], ["128", "256", "512"])
    a.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    a.grid(alpha=0.3)
a2.legend(fontsize=8)
fig.suptitle("kvcache example engine: quality against KV budget (tiny KJV model)")
fig.tight_layout()
fig.savefig(d / "engine_quality.png", dpi=110)

mem = list(csv.DictReader(open(d / "memory.csv")))
fig, ax = plt.subplots(figsize=(7, 3.5))
for cache in dict.fromkeys(r["cache"] for r in mem):
    pts = [(int(r["step"]), int(r["kv_tokens"])) for r in mem if r["cache"] == cache]
    ax.plot([p[0] for p in pts], [p[1] for p in pts], label=cache)
ax.set(xlabel="engine step", ylabel="KV tokens held (all requests)", title="KV memory over time, 6 requests")
ax.grid(alpha=0.3)
ax.legend()
fig.tight_layout()
fig.savefig(d / "engine_memory.png", dpi=110)
print(f"plots: {d / 'engine_quality.png'}, {d / 'engine_memory.png'}")
