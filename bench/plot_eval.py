#!/usr/bin/env python3
"""Plots the fidelity evaluation (scripts/eval): each task's quality against
the KV budget, one line per policy, the full cache dashed, 95 % intervals as
bands. usage: plot_eval.py eval.csv eval.png"""
import csv
import sys

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

rows = list(csv.DictReader(open(sys.argv[1])))
panels = [("passkey", "passkey accuracy (all depths)"), ("recall", "key->value recall accuracy"),
          ("repeat_loss", "repeated-passage loss (nats/byte)"), ("agreement", "greedy agreement with full cache"),
          ("perplexity", "held-out perplexity"), ("peak_kv", "peak KV per request (tokens)")]
fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
budgets = sorted({int(r["budget"]) for r in rows if int(r["budget"]) > 0})
for ax, (metric, title) in zip(axes.flat, panels):
    ax.set_prop_cycle(color=plt.cm.tab20.colors)  # 16 policies: the default cycle repeats after 10
    for r in rows:
        if r["metric"] == metric and int(r["budget"]) == 0:
            ax.axhline(float(r["value"]), color="black", ls="--", lw=1, label="full cache")
    for policy in dict.fromkeys(r["policy"] for r in rows if int(r["budget"]) > 0):
        pts = sorted((int(r["budget"]), float(r["value"]), float(r["lo"]), float(r["hi"]))
                     for r in rows if r["policy"] == policy and r["metric"] == metric and int(r["budget"]) > 0)
        if not pts:
            continue
        # Decode-only rows are one budget: a point of their own shape.
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="x" if "decode only" in policy else "o",
                        label=policy)
        ax.fill_between([p[0] for p in pts], [p[2] for p in pts], [p[3] for p in pts], color=line.get_color(), alpha=0.1)
    # Write-Gated KV has no budget: a point per gate set at the peak KV it held.
    peak = {r["policy"]: float(r["value"]) for r in rows if r["metric"] == "peak_kv"}
    stars = ["black", "crimson", "darkorange"]
    for i, policy in enumerate(dict.fromkeys(r["policy"] for r in rows if int(r["budget"]) < 0)):
        for r in rows:
            if r["policy"] == policy and r["metric"] == metric:
                v, lo, hi = float(r["value"]), float(r["lo"]), float(r["hi"])
                ax.errorbar([peak[policy]], [v], yerr=[[v - lo], [hi - v]], marker="*", markersize=10, ls="none",
                            color=stars[i % len(stars)], label=policy)
    ax.set(title=title, xlabel="budget or peak KV (tokens per request)", xscale="log")
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.grid(alpha=0.3)
axes.flat[0].legend(fontsize=7)
fig.suptitle("kvcache example engine: eviction policies and Write-Gated KV (stars) on long-range tasks (1,024-byte contexts)")
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=100)
