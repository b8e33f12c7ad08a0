"""The README's Python snippets run as written (each ```python block behind a
``<!-- snippet: python_NAME -->`` line)."""
import contextlib
import io
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"<!-- snippet: (python_\w+) -->\n```python\n(.*?)```", README.read_text(), re.S)


def test_there_are_python_snippets():
    assert [name for name, _ in BLOCKS] == ["python_quickstart", "python_composed"]


def test_quickstart_runs_and_prints_the_error():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(dict(BLOCKS)["python_quickstart"], "README.md:python_quickstart", "exec"), {})
    assert out.getvalue() == "invalid_argument: n_tokens=-1 (limit 0)\n"


def test_composed_runs_and_prints_a_head_row():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(dict(BLOCKS)["python_composed"], "README.md:python_composed", "exec"), {})
    held, pages = out.getvalue().split(" ", 1)
    assert int(held) >= 32 and pages.strip() == "[3, 3]"  # the ring's 32 tokens and admitted ones; 2 ring pages + 1
