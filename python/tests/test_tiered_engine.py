"""The PyTorch tiered engine (examples/python/tiered.py) against the C++ one
(kvcache_multiturn): multi-turn conversations over a device pool too small
for them, with a host tier. Every write policy generates recompute's tokens
(the onboarded blocks hold what recompute writes), and both engines make the
same choices: the same tokens, hits per tier, blocks offloaded and onboarded.
The same holds on a hybrid model (a full and a sliding-window layer group in
one pool, kv.GroupTiers under it) against its own recompute.

kvcache_multiturn comes from the host build (scripts/python builds it and sets
KVCACHE_MULTITURN); without one the comparison is skipped, never passed.
"""
import json
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "python"))
import model as mdl  # noqa: E402
import tiered  # noqa: E402
from engine_binaries import binary  # noqa: E402

WORKLOAD = dict(conversations=3, turns=3, first=64, user=16, new=8, device=14, host=64, chunk=64)
WINDOW = 32  # the hybrid model's odd layers: prompts of 64 to 112 tokens leave it


def serve_workload(engines):
    """WORKLOAD's conversations on each named engine: {name: {outputs, turns, stats}}."""
    torch.set_num_threads(2)
    w, out = WORKLOAD, {}
    for name, e in engines:
        outputs, turns, st = tiered.serve_multiturn_on(e, w["conversations"], w["turns"], w["first"], w["user"], w["new"])
        out[name] = dict(outputs=outputs, turns=turns, stats=st)
    return out


@pytest.fixture(scope="module")
def runs():
    model, w = mdl.load(), WORKLOAD
    return serve_workload((name, tiered.TieredEngine(model, device_blocks=w["device"], chunk=w["chunk"], write=write,
                                                     host_blocks=w["host"] if with_host else 0))
                          for name, with_host, write in tiered.MODES)


def test_every_write_policy_serves_recomputes_tokens_from_host_memory(runs):
    base = runs["recompute"]
    assert base["stats"].host_hit_tokens == 0
    for name in ("write_back", "write_through", "write_through_reused"):
        r, st = runs[name], runs[name]["stats"]
        assert r["outputs"] == base["outputs"], name
        assert st.host_hit_tokens > 0 and st.host_hit_tokens == 16 * st.blocks_onboarded
        assert st.device_hit_tokens + st.host_hit_tokens + st.computed_tokens == st.prompt_tokens
        assert st.computed_tokens < base["stats"].computed_tokens
        assert all(t["host_hit"] == 0 for t in r["turns"][:WORKLOAD["conversations"]])  # first turns find nothing


@pytest.fixture(scope="module")
def hybrid_runs():
    model, w = mdl.load(), WORKLOAD
    return serve_workload((name, tiered.HybridTieredEngine(model, device_blocks=w["device"], host_blocks=host,
                                                           chunk=w["chunk"], window=WINDOW))
                          for name, host in [("hybrid_recompute", 0), ("hybrid_host", w["host"])])


def test_a_hybrid_model_serves_its_recomputes_tokens_from_host_memory(hybrid_runs):
    base, r = hybrid_runs["hybrid_recompute"], hybrid_runs["hybrid_host"]
    st = r["stats"]
    assert base["stats"].host_hit_tokens == 0 and base["stats"].blocks_offloaded == 0
    assert r["outputs"] == base["outputs"]  # every onboarded page of both groups holds what recompute writes
    assert st.host_hit_tokens > 0 and st.blocks_onboarded > 0 and st.blocks_offloaded > 0
    assert st.device_hit_tokens + st.host_hit_tokens + st.computed_tokens == st.prompt_tokens
    assert st.computed_tokens < base["stats"].computed_tokens
    assert all(t["host_hit"] == 0 for t in r["turns"][:WORKLOAD["conversations"]])  # first turns find nothing


def test_the_cpp_engine_makes_the_same_choices(runs, hybrid_runs, tmp_path):
    out = tmp_path / "multiturn.json"
    args = [binary("KVCACHE_MULTITURN", "kvcache_multiturn"), "--json", str(out), "--window", str(WINDOW)]
    for k, v in WORKLOAD.items():
        args += [f"--{k}", str(v)]
    subprocess.run(args, check=True, capture_output=True)
    cpp = json.loads(out.read_text())
    assert set(cpp) == {name for name, _, _ in tiered.MODES} | set(hybrid_runs)
    for name, r in {**runs, **hybrid_runs}.items():
        assert cpp[name]["outputs"] == r["outputs"], name
        for key, value in cpp[name]["stats"].items():
            assert getattr(r["stats"], key) == value, (name, key)
