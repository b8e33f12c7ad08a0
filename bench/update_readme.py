#!/usr/bin/env python3
"""Replaces each <!-- NAME --> ... <!-- /NAME --> block of README.md with
bench/results/NAME.md, so the README shows the latest measured tables."""
import pathlib
import re

root = pathlib.Path(__file__).resolve().parent.parent
readme = root / "README.md"
text = readme.read_text()
for md in sorted((root / "bench" / "results").glob("*.md")):
    name = md.stem
    block = re.compile(rf"(<!-- {name} -->\n).*?(<!-- /{name} -->)", re.S)
    text = block.sub(lambda m: m.group(1) + md.read_text() + m.group(2), text)
readme.write_text(text)
