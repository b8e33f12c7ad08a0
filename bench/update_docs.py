#!/usr/bin/env python3
"""Replaces each <!-- NAME --> ... <!-- /NAME --> block of the docs pages (and
the README) with bench/results/NAME.md, so the pages show the latest measured
tables."""
import pathlib
import re

root = pathlib.Path(__file__).resolve().parent.parent
results = sorted((root / "bench" / "results").glob("*.md"))
for page in [root / "README.md"] + sorted((root / "docs").glob("*.md")):
    text = page.read_text()
    for md in results:
        name = md.stem
        block = re.compile(rf"(<!-- {name} -->\n).*?(<!-- /{name} -->)", re.S)
        text = block.sub(lambda m: m.group(1) + md.read_text() + m.group(2), text)
    page.write_text(text)
