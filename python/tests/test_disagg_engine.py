"""The example engine disaggregated (examples/python/disagg.py): a prefill
process and a decode process, NIXL over UCX on 127.0.0.1. The decode process
generates the tokens one process generates alone: when it reads every
prompt, when its own prefix cache already holds part of one (only the rest
is read), when the prefill process dies mid-transfer (it aborts and
computes), and when it never reads one (the prefill process's hold expires
and every block comes back). Skipped without the nixl wheel."""
import os
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")
os.environ.setdefault("UCX_TLS", "tcp,self")
os.environ.setdefault("UCX_MODULES", "^ib")
try:
    from kvcache.nixl import _nixl

    _nixl()
except ImportError:
    pytest.skip("the nixl wheel is not installed", allow_module_level=True)

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "python"))
import disagg  # noqa: E402
import model as mdl  # noqa: E402

NEW = 8


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(1)
    model = mdl.load()
    prompts = disagg.requests(4, first=96, user=32)
    return model, prompts, disagg.reference(model, prompts, NEW)


def test_the_decode_process_reads_every_prompt_and_generates_the_same_tokens(setup):
    model, prompts, ref = setup
    out, how, report = disagg.disaggregated(model, prompts, NEW)
    assert out == ref
    assert how[0] == "read" and how[2] == "read"
    # Requests 1 and 3 continue 0 and 2: the decode process holds their first 6 blocks and reads only the rest.
    assert how[1] == "read 2 of 8 blocks" and how[3] == "read 2 of 8 blocks"
    assert report["read"] == 4 and report["expired"] == 0
    assert report["free_blocks"] == report["usable_blocks"]  # every hold released


def test_the_prefill_process_dies_mid_transfer(setup):
    model, prompts, ref = setup
    out, how, report = disagg.disaggregated(model, prompts, NEW, die_at=1)
    assert out == ref
    assert how == ["read", "recomputed", "local", "local"]
    assert report is None


def test_a_prompt_never_read_lets_the_hold_expire(setup):
    model, prompts, ref = setup
    out, how, report = disagg.disaggregated(model, prompts, NEW, skip_read=2, ttl_ms=200)
    assert out == ref
    assert how[2] == "recomputed"
    assert report["read"] == 3 and report["expired"] == 1
    assert report["free_blocks"] == report["usable_blocks"]


def test_a_hybrid_layout_reads_each_groups_pages(setup):
    """The odd layers a window of 32 (two groups): each group's pages are read
    (the window group's last window only), and the tokens are one process's."""
    model, prompts, _ = setup
    ref = disagg.reference(model, prompts, NEW, window=32)
    out, how, report = disagg.disaggregated(model, prompts, NEW, window=32)
    assert out == ref
    # Requests 1 and 3 continue 0 and 2: each group reads its 2 blocks past the 6 its own cache holds.
    assert how == ["read", "read 4 of 16 blocks", "read", "read 4 of 16 blocks"]
    assert report["read"] == 4 and report["free_blocks"] == report["usable_blocks"]
