"""The Python snippets of the README and the docs pages run as written (each
```python block behind a ``<!-- snippet: python_NAME -->`` line)."""
import contextlib
import io
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
BLOCKS = [block for page in PAGES
          for block in re.findall(r"<!-- snippet: (python_\w+) -->\n```python\n(.*?)```", page.read_text(), re.S)]


def test_there_are_python_snippets():
    assert [name for name, _ in BLOCKS] == ["python_fidelity_pretrained", "python_hybrid", "python_pretrained",
                                            "python_quickstart", "python_composed", "python_quant", "python_scale_out",
                                            "python_tiers"]


def printed(name, where):
    """What snippet `name` (of page `where`) prints, run as written."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(dict(BLOCKS)[name], f"{where}:{name}", "exec"), {})
    return out.getvalue()


def test_pretrained_serves_smollm2(monkeypatch):
    """Run from the repository's root, as the page says; skipped without the model."""
    pytest.importorskip("torch")
    sys.path.insert(0, str(ROOT / "examples" / "python"))
    import pretrained
    try:
        pretrained.gguf_path("smollm2")
    except pretrained.NotInstalled as e:
        pytest.skip(str(e))
    monkeypatch.chdir(ROOT)
    out = printed("python_pretrained", "docs/pretrained-models.md")
    assert out == " Paris.\n\n\n"


def test_fidelity_pretrained_retrieves_through_three_rows(monkeypatch):
    """Skipped without the model or the filler's package (scripts/python installs both)."""
    pytest.importorskip("torch")
    sys.path.insert(0, str(ROOT / "examples" / "python"))
    import eval_prompts
    import pretrained
    try:
        pretrained.gguf_path("smollm2")
        eval_prompts.kjv_lines()
    except (pretrained.NotInstalled, eval_prompts.MissingCorpus) as e:
        pytest.skip(str(e))
    monkeypatch.chdir(ROOT)
    out = printed("python_fidelity_pretrained", "docs/fidelity-pretrained.md")
    assert out == "full 1 ' 28547.'\ntova:0.25 1 ' 28547.'\nsink_window:0.25 0 ' 1'\n"


def test_quickstart_runs_and_prints_the_error():
    out = printed("python_quickstart", "docs/python.md")
    assert out == "invalid_argument: n_tokens=-1 (limit 0)\n"


def test_composed_runs_and_prints_a_head_row():
    out = printed("python_composed", "docs/python.md")
    held, pages = out.split(" ", 1)
    assert int(held) >= 32 and pages.strip() == "[3, 3]"  # the ring's 32 tokens and admitted ones; 2 ring pages + 1


def test_hybrid_runs_and_prints_what_each_group_holds():
    out = printed("python_hybrid", "docs/hybrid.md")
    # 128 tokens in the full layers; the window's next query (at 64) reads 1 on: blocks 0 .. 7, 8 held;
    # none freed yet (the first reserve after computed 64 frees below first_read(64) = 1, i.e. nothing whole);
    # the second chunk took 4 blocks in each group
    assert out == "128 8 (8, 0) 8\n"


def test_tiers_runs_and_prints_the_host_hits():
    out = printed("python_tiers", "docs/tiers.md")
    assert out == "(0, 4, 0, ['host', 'host', 'host', 'host'])\n"


def test_scale_out_runs_and_prints_the_imported_sequence():
    out = printed("python_scale_out", "docs/scale-out.md")
    assert out == "14 3 3\n"


def test_quant_runs_and_prints_the_bytes_per_token():
    out = printed("python_quant", "docs/quantization.md")
    assert out == "272 True\n"  # 2 planes x 2 heads x (64 codes + 2 groups x 2 bytes)
