"""One engine (examples/python/engine.py), written once against kvcache's
calls, serving a single-group model (SmolLM2: every layer in one full group,
EngineConfig(layer_groups=True)) and a hybrid one (Gemma 3: its global
layers in a full group, its window layers in window groups) on
kv.HybridCache, with everything at once:

- a disaggregated import: a prefill engine computes the prompt and hands its
  pages off (Request(hand_off=True)); the decode engine imports them
  (Request(remote=...)) and decodes from the peer's first token;
- a host tier under a device pool too small to keep a conversation: a
  later turn's prompt comes back from host memory (kv.GroupTiers);
- a KV format (f32, and fp8 with per-(layer, kv-head) scales);
- a block policy on the global layers (sinks and a window wider than the
  context: it runs after every chunk and lets nothing go).

Checked: every logit the decode engine computed equals, bit for bit, a plain
engine's that computes every prompt itself on a pool large enough to keep it
(the import's and the host tier's pages hold the same bytes, and a policy
that lets nothing go changes nothing). Against the real-models issue's
references: in f32, every logit within LOGIT_TOLERANCE of the dense one and
every greedy token its argmax; in fp8, the next turn's logits equal, bit
for bit, a replay on plain tensors through the same format of the chunks
that computed what it was served (the peer's prompt chunks, the decode
engine's steps) and of its own.

The models' wheels are installed by scripts/python; without them these
tests are skipped, never passed.
"""
import pathlib
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples" / "python"))
import engine as eng  # noqa: E402
from pretrained_checks import check_dense, check_replay, chunks_of, round_trip_through, text_tokens  # noqa: E402

import kvcache as kv  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW = 8


def serve(e, reqs):
    for r in reqs:
        e.run([r])
        e.cache.check_invariants()
    return reqs


def one_engine(m, tok, window, kv_format):
    """The three requests (a conversation's first turn, another prompt, the
    conversation's second turn) through the prefill and decode engines, and
    through a plain engine; returns (decode engine, its requests, the
    prefill engine's request, the plain engine's requests)."""
    if kv_format != "f32":
        m.calibration_tokens = text_tokens(tok, 20000, 256)  # the format's scales, shared by all three engines
    base = eng.EngineConfig(max_kv_tokens=1024, chunk=32, window=window, layer_groups=True, prefix_caching=True,
                            kv_format=kv_format, keep_logits=True)
    policy, base = eng.policy_by_name("sink_window", 2048, m.c, base)  # wider than every request: lets nothing go
    prefill = eng.Engine(m, base, policy)
    scales = None if prefill.scales is None else tuple(s.reshape(-1) for s in prefill.scales)
    a_prompt = text_tokens(tok, 3000, 150)
    b_prompt, more = text_tokens(tok, 9000, 200), text_tokens(tok, 15000, 30)

    sent = eng.Request(id=0, prompt=a_prompt, max_new=1, hand_off=True)
    serve(prefill, [sent])
    assert sent.handoff is not None and prefill.cache.free_blocks < prefill.blocks - 1  # held for the peer

    small = eng.EngineConfig(**{**vars(base), "max_kv_tokens": 256, "host_blocks": 64 * len(prefill.group_layers),
                                "kv_scales": scales})
    decode = eng.Engine(m, small, policy)
    a = eng.Request(id=0, prompt=a_prompt, max_new=NEW, remote=sent.handoff)
    serve(decode, [a])
    assert prefill.cache.free_blocks == prefill.blocks - 1  # the import released the peer's hold
    assert a.chunk_logits[0][0] == len(a_prompt) and a.logits[0] is sent.logits[0]  # nothing of the prompt computed
    b = eng.Request(id=1, prompt=b_prompt, max_new=NEW)
    c = eng.Request(id=2, prompt=a_prompt + a.output + more, max_new=NEW)
    serve(decode, [b, c])
    host = decode.host
    assert host.offloaded > 0 and host.onboarded > 0 and host.hit_tokens > 0  # b pushed a's pages out; c read them back
    assert c.chunk_logits[0][0] == (len(a_prompt) + NEW - 1) // 16 * 16  # a's written blocks, from either tier

    plain = eng.Engine(m, eng.EngineConfig(**{**vars(base), "kv_scales": scales}), kv.KeepAll())
    ref = [eng.Request(id=r.id, prompt=r.prompt, max_new=NEW) for r in (a, b, c)]
    serve(plain, ref)
    assert plain.prefix_hit_tokens == c.chunk_logits[0][0]
    return decode, [a, b, c], sent, ref


def check_against_references(m, decode, reqs, sent):
    """f32: the dense reference; a quantized format: the replay of the chunks."""
    a, b, c = reqs
    if decode.cfg.kv_format == "f32":
        sent.output = list(a.output)  # a's prompt logits are the peer's
        for r in (sent, b, c):
            check_dense(m, r)
        return
    served = (len(a.prompt) + NEW - 1) // 16 * 16  # c's hit: a's written blocks
    steps = chunks_of(sent) + chunks_of(a) + [("truncate", served)] + chunks_of(c)
    check_replay(m, c, steps, round_trip_through(decode))


def check_same(decode_reqs, sent, ref):
    a = decode_reqs[0]
    assert torch.equal(sent.logits[0], ref[0].logits[0])  # the peer's first token's logits
    for r, want in zip(decode_reqs, ref):
        assert r.output == want.output, f"request {r.id}"
        got = dict(r.chunk_logits)
        for first, logits in want.chunk_logits:
            if first in got:  # the positions both engines computed (a's prompt: the peer's)
                assert torch.equal(got[first], logits), f"request {r.id}: positions {first}.."
    assert len(a.chunk_logits) == NEW - 1


@pytest.mark.parametrize("kv_format", ["f32", "fp8_e4m3_head"])
def test_one_engine_on_a_single_group_model(smollm2, kv_format):
    m, tok = smollm2
    decode, reqs, sent, ref = one_engine(m, tok, 0, kv_format)
    assert decode.group_layers == [m.c["layers"]]
    check_same(reqs, sent, ref)
    check_against_references(m, decode, reqs, sent)


@pytest.mark.xdist_group("gemma3")
@pytest.mark.parametrize("kv_format", ["f32", "fp8_e4m3_head"])
def test_one_engine_on_a_hybrid_model(gemma3, kv_format):
    m, tok = gemma3
    decode, reqs, sent, ref = one_engine(m, tok, 512, kv_format)
    assert decode.group_layers == [3, 3, 3, 3, 3, 3] and decode.group_window == [0] + [512] * 5
    check_same(reqs, sent, ref)
    check_against_references(m, decode, reqs, sent)


def test_a_remote_prompt_is_checked_before_anything_moves(smollm2):
    """A hand-off another engine cannot read is a ValueError naming why, and
    the decode engine's pool is untouched; a peer that let a page go leaves
    the prompt to be computed here."""
    m, tok = smollm2
    cfg = eng.EngineConfig(max_kv_tokens=256, chunk=32, layer_groups=True, keep_logits=True)
    prefill = eng.Engine(m, cfg, kv.KeepAll())
    prompt = text_tokens(tok, 3000, 40)
    sent = eng.Request(id=0, prompt=prompt, max_new=1, hand_off=True)
    prefill.run([sent])
    h = sent.handoff
    for other, match in [(dict(cfg=eng.EngineConfig(**{**vars(cfg), "block_size": 32}), prompt=prompt), "layout"),
                         (dict(cfg=cfg, prompt=prompt[:-1]), "another prompt")]:
        e = eng.Engine(m, other["cfg"], kv.KeepAll())
        with pytest.raises(ValueError, match=match):
            e.run([eng.Request(id=1, prompt=other["prompt"], max_new=4, remote=h)])
        assert e.cache.free_blocks == e.blocks - 1 and e.cache.free_sequences == cfg.max_batch
    plain = eng.Engine(m, cfg, kv.KeepAll())
    with pytest.raises(ValueError, match="layer groups"):
        eng.Engine(m, eng.EngineConfig(max_kv_tokens=256), kv.KeepAll()).run(
            [eng.Request(id=1, prompt=prompt, max_new=4, remote=h)])
    with pytest.raises(ValueError, match="host_blocks 8"):
        eng.Engine(m, eng.EngineConfig(max_kv_tokens=256, layer_groups=True, host_blocks=8), kv.KeepAll())
    # The peer gave up on the hand-off (its hold released: the pages may be recycled): computed here, the same tokens.
    h.hold.release()
    late = eng.Request(id=1, prompt=prompt, max_new=4, remote=h)
    e = eng.Engine(m, cfg, kv.KeepAll())
    e.run([late])
    want = eng.Request(id=1, prompt=prompt, max_new=4)
    plain.run([want])
    assert late.output == want.output and late.chunk_logits[0][0] == 0
    assert e.cache.free_blocks == e.blocks - 1


def test_an_evicting_engine_moves_only_its_prompts_own_kv():
    """The tiny model (its odd layers a window of 32) with sinks and a window
    of 64 tokens on its global layers, which evicts inside the prompt: a
    sequence that evicted hands nothing off, and offloads only the blocks it
    published before its first eviction (K/V computed after it read a
    context that is not the prompt's). So a later turn served from host
    memory gets exactly what a device hit on an engine that never offloaded
    gives: the same prefix, the same logits, bit for bit."""
    import model as mdl
    import serve as srv
    torch.set_num_threads(2)
    m, text = mdl.load(), srv.heldout()

    def engine(tokens, host):
        cfg = eng.EngineConfig(max_kv_tokens=tokens, chunk=32, window=32, prefix_caching=True, host_blocks=host,
                               keep_logits=True)
        policy, cfg = eng.policy_by_name("sink_window", 64, m.c, cfg)
        return eng.Engine(m, cfg, policy)

    tiered, roomy = engine(256, 64), engine(1024, 0)
    a = eng.Request(id=0, prompt=text[:160], max_new=8, hand_off=True)
    serve(tiered, [a])
    assert a.handoff is None  # it evicted in its prefill
    # The policy holds 4 sinks and a window of 32: it first evicts after the second chunk of 32, so the tokens
    # computed before, 64, are the prompt's own K/V; a's blocks past them are never offloaded.
    assert tiered.cache.groups == 2
    c_prompt = a.prompt + a.output + text[7000:7040]
    pushing = [eng.Request(id=1 + i, prompt=text[3000 + 997 * i:3200 + 997 * i], max_new=8) for i in range(4)]
    c = eng.Request(id=9, prompt=c_prompt, max_new=8)
    serve(tiered, pushing)  # the device pool forgets a's blocks
    assert tiered.cache.match(np.asarray(c_prompt, dtype=np.int32)) == 0
    serve(tiered, [c])
    # The full group's 4 blocks and the window group's 2 that a hit at 64 reads: from host memory alone.
    assert tiered.host.onboarded == 4 + 2 and c.chunk_logits[0][0] == tiered.host.hit_tokens == 64
    same = [eng.Request(id=0, prompt=a.prompt, max_new=8), eng.Request(id=9, prompt=c_prompt, max_new=8)]
    serve(roomy, same)
    assert same[0].output == a.output and roomy.prefix_hit_tokens == c.chunk_logits[0][0]
    assert same[1].output == c.output
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(c.chunk_logits, same[1].chunk_logits))


@pytest.mark.parametrize("window,kv_format,seed", [(0, "f32", 1), (32, "f32", 2), (0, "int8_g32", 3), (32, "int8_g32", 4)])
def test_randomized_turns_hand_offs_and_host_hits_serve_what_a_plain_engine_does(window, kv_format, seed):
    """The tiny model on layer groups (one full group, or its odd layers a
    window of 32; f32 or int8), sinks and a window wider than any request on
    its global layers: 16 requests, each a new prompt or the next turn of an
    earlier one, a random half of them prefilled by a peer and imported, on
    a device pool too small to keep them (a host tier under it). Every
    request's tokens are a plain engine's (a pool that keeps everything, no
    peer, no host tier), its logits within 1e-4 (the two engines' hits end
    at other blocks, so their chunks differ), the caches' invariants hold
    after each request, the peer's holds are all released and every page
    comes back."""
    import random

    import model as mdl
    import serve as srv
    torch.set_num_threads(2)
    rng = random.Random(seed)
    m, text = mdl.load(), srv.heldout()

    def cfg(tokens, host=0):
        c = eng.EngineConfig(max_kv_tokens=tokens, chunk=32, window=window, layer_groups=True, prefix_caching=True,
                             kv_format=kv_format, host_blocks=host)
        return eng.policy_by_name("sink_window", 4096, m.c, c)

    prefill, plain, decode = (eng.Engine(m, *reversed(cfg(t, h))) for t, h in ((512, 0), (4096, 0), (256, 96)))
    turns = []  # (prompt, output) of each request served
    for i in range(16):
        if len(turns) > 1 and rng.random() < 0.5:  # an earlier conversation's next turn (not the last one's)
            prompt, output = rng.choice(turns[:-1])
            prompt = prompt + output + text[rng.randrange(20000):][:rng.randrange(8, 40)]
        else:
            prompt = text[rng.randrange(20000):][:rng.randrange(40, 150)]
        prompt = prompt[:300]
        new = rng.randrange(1, 10)
        remote = None
        if rng.random() < 0.5:
            sent = eng.Request(id=i, prompt=prompt, max_new=1, hand_off=True)
            serve(prefill, [sent])
            remote = sent.handoff
        r = eng.Request(id=i, prompt=prompt, max_new=new, remote=remote)
        want = eng.Request(id=i, prompt=prompt, max_new=new)
        serve(decode, [r])
        serve(plain, [want])
        assert r.output == want.output, f"request {i}"
        assert max((a - b).abs().max().item() for a, b in zip(r.logits, want.logits)) <= 1e-4
        if remote is not None:
            assert not remote.hold.held
        turns.append((prompt, r.output))
        decode.host.tiers.tiers.check_invariants()
    assert decode.host.onboarded > 0 and decode.host.offloaded > 0
    for e in (prefill, decode, plain):
        assert e.cache.free_blocks == e.blocks - 1 and e.cache.promised_blocks == 0


def test_an_onboard_that_cannot_be_planned_leaves_no_import_behind(monkeypatch):
    """Host memory's hit found, but its onboard refused (kv.OutOfBlocks from
    plan_onboard): the import is aborted, the request computes what the
    device did not hold, and it generates what a plain engine does; no
    import stays pending and every page comes back."""
    import model as mdl
    import serve as srv
    torch.set_num_threads(2)
    m, text = mdl.load(), srv.heldout()

    def engine(tokens, host):
        return eng.Engine(m, eng.EngineConfig(max_kv_tokens=tokens, chunk=32, layer_groups=True, prefix_caching=True,
                                              host_blocks=host), kv.KeepAll())

    tiered, plain = engine(256, 64), engine(1024, 0)
    a = eng.Request(id=0, prompt=text[:150], max_new=4)
    serve(tiered, [a, eng.Request(id=1, prompt=text[4000:4200], max_new=4)])  # a's pages to host memory, then pushed out
    refused = []

    class Refusing:  # the tiers, but every onboard refused
        def __init__(self, tiers):
            self.inner = tiers

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def plan_onboard(self, import_id):
            refused.append(import_id)
            raise kv.OutOfBlocks("host blocks")
    monkeypatch.setattr(tiered.host, "tiers", Refusing(tiered.host.tiers))
    c = eng.Request(id=2, prompt=a.prompt + a.output + text[9000:9020], max_new=4)
    for _ in range(100):  # a pending import left behind would keep c from ever being admitted
        tiered.step([c])
        if c.done:
            break
    assert c.done
    tiered.cache.check_invariants()
    assert refused and tiered.host.onboarded == 0 and tiered.cache.imports == 0
    want = eng.Request(id=2, prompt=c.prompt, max_new=4)
    plain.run([want])
    assert c.output == want.output
    assert tiered.cache.free_blocks == tiered.blocks - 1 and tiered.cache.promised_blocks == 0
