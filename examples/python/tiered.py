#!/usr/bin/env python3
"""The example engine with memory tiers, in PyTorch: the Python twin of
examples/engine/tiered.hpp, call for call. Multi-turn conversations are
served one turn at a time over a device pool too small for them all, with a
host tier under it (kv.Tiers). A turn's prompt blocks come from the device
prefix cache, else from host memory (onboarded with kv.block_copy into the
blocks the admission reserved), and only the rest is computed. Blocks go to
host memory by the write policy (kv.WritePolicy): write-back, write-through
or write-through by reuse. Without a host tier it recomputes: the baseline.

  python3 examples/python/tiered.py [--conversations 8] [--turns 4] [--device 64] [--host 512] [--window 64]
                                    [--json FILE]

Then the same conversations on a hybrid model (HybridTieredEngine: the odd
layers a sliding window of --window tokens; kv.GroupTiers moves each group's
pages), with and without a host tier, as kvcache_multiturn's second table.

With --json it writes each mode's generated tokens and statistics, the
format kvcache_multiturn --json writes (python/tests/test_example_engine.py
compares the two).
"""
import argparse
import dataclasses
import json
import pathlib
import sys
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import engine as eng  # noqa: E402
import model as mdl  # noqa: E402
import kvcache as kv  # noqa: E402

MODES = [("recompute", 0, "write_back"), ("write_back", 1, "write_back"), ("write_through", 1, "write_through"),
         ("write_through_reused", 1, "write_through_reused")]


@dataclasses.dataclass
class Stats:
    turns: int = 0
    generated: int = 0
    prompt_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    computed_tokens: int = 0
    blocks_offloaded: int = 0
    blocks_onboarded: int = 0
    seconds: float = 0.0
    ttft_s: float = 0.0

    def add_turn(self, turn, max_new, seconds):
        """One served turn: its prompt's sources (turn: prompt, device_hit, host_hit, computed, ttft_s)."""
        self.turns += 1
        self.generated += max_new
        self.prompt_tokens += turn["prompt"]
        self.device_hit_tokens += turn["device_hit"]
        self.host_hit_tokens += turn["host_hit"]
        self.computed_tokens += turn["computed"]
        self.ttft_s += turn["ttft_s"]
        self.seconds += seconds

    def line(self, name, unit):
        """main()'s row for a mode; `unit`: what it moves (blocks, or a hybrid pool's pages)."""
        return (f"{name:22} TTFT {1e3 * self.ttft_s / self.turns:8.2f} ms  {self.generated / self.seconds:6.0f} tokens/s  "
                f"device {self.device_hit_tokens:6}  host {self.host_hit_tokens:6}  computed {self.computed_tokens:6}  "
                f"offloaded {self.blocks_offloaded:5} {unit:6}  onboarded {self.blocks_onboarded:5} {unit}")


class _Row:
    """What engine.PagedKv reads of a request: its one stream."""

    def __init__(self, seq):
        self.seqs = [seq]


class TieredEngine:
    def __init__(self, model, device_blocks=64, host_blocks=0, block_size=16, chunk=64, write="write_back"):
        c = model.c
        self.m, self.c, self.fwd = model, c, eng.Forward(model)
        self.heads, self.head_dim = c["kv_heads"], c["dim"] // c["q_heads"]
        self.B, self.chunk, self.write, self.tiered = block_size, chunk, write, host_blocks > 0
        self.cfg = eng.EngineConfig(block_size=block_size)
        self.geometry = kv.Geometry(num_layers=c["layers"], num_kv_heads=self.heads, head_dim=self.head_dim,
                                    block_size=block_size, dtype=kv.DType.f32)
        self.blocks = device_blocks + 1
        self.memory = torch.zeros(self.geometry.pool_bytes(self.blocks), dtype=torch.uint8)
        self.pool = kv.PoolView(self.geometry, self.memory, self.blocks)
        events = 4 * device_blocks if self.tiered and write == "write_through" else 0
        self.cache = kv.Cache(self.geometry, num_blocks=self.blocks, max_sequences=1,
                              max_blocks_per_sequence=c["context"] // block_size + 1, event_capacity=events,
                              publish_on_reserve=True)
        if self.tiered:
            self.host_memory = torch.zeros(self.geometry.pool_bytes(host_blocks), dtype=torch.uint8)
            self.host = kv.PoolView(self.geometry, self.host_memory, host_blocks)
            self.tiers = kv.Tiers(host_blocks=host_blocks, block_size=block_size)
            self.policy = kv.WritePolicy(write)
        self.positions = torch.full((1, self.blocks * block_size), -1, dtype=torch.long)
        self.indptr, self.last = np.zeros(2, dtype=np.int32), np.zeros(1, dtype=np.int32)
        self.stats = Stats()

    def group_of(self, layer, head):  # engine.PagedKv's position table: one group
        return 0

    def _blocks_for(self, tokens):
        return -(-tokens // self.B)

    def _forward(self, seq, tokens, slots, at):
        store = eng.PagedKv(self, _Row(seq), np.asarray(slots, dtype=np.int32)[None], at)
        return self.fwd.run(store, tokens, at, True)[0]

    def serve(self, prompt, max_new):
        """One turn: the prompt (the conversation so far), then max_new greedy tokens; returns them and the turn's stats."""
        t0 = time.perf_counter()
        B, n_prompt, c = self.B, len(prompt), self.cache
        prompt_arr = np.asarray(prompt, dtype=np.int32)
        hit = c.match_prefix(prompt_arr)  # the device's match (a peek), then host memory after it
        cached = len(hit) * B
        chain = c.hash_chain(prompt_arr) if self.tiered else None
        host_blocks = self.tiers.lookup(chain, len(hit), n_prompt)[1] if self.tiered else 0
        # Reserve the host hits' blocks (the onboard's targets) or the first chunk: a reserved slot is read.
        first = host_blocks * B if host_blocks else min(self.chunk, n_prompt - cached)
        self._offload_before_admit(hit, cached + first)
        slots = np.full(n_prompt, -1, dtype=np.int32)
        a = c.admit(prompt_arr, slots=slots[cached:], reserve=first)
        assert a.cached_tokens == cached, "the device hit changed between match and admit"
        seq, reserved = a.seq, cached + a.reserved
        host_hit = self._onboard(seq, chain, host_blocks, cached)
        turn = dict(prompt=n_prompt, device_hit=cached, host_hit=host_hit, computed=n_prompt - cached - host_hit)
        at = cached + host_hit
        while at < n_prompt:
            n = min(self.chunk, n_prompt - at)
            if at + n > reserved:
                self._offload_before(self._blocks_for(at + n) - self._blocks_for(reserved))
                c.reserve(seq, prompt_arr[reserved:at + n], slots[reserved:at + n])
                reserved = at + n
            logits = self._forward(seq, prompt[at:at + n], slots[at:at + n], at)
            at += n
        out = [int(torch.argmax(logits))]
        turn["ttft_s"] = time.perf_counter() - t0
        self._store(self._written())  # write-through: the prompt's blocks are written now
        if self.tiered and self.write == "write_through_reused":  # every full block this prompt used
            blocks = c.export_block_table([seq], n_prompt // B + 1)[0][:n_prompt // B]
            self._store(self.policy.on_use(c.pool, blocks))
        for pos in range(n_prompt, n_prompt + max_new - 1):
            self._offload_before(1 if pos % B == 0 else 0)
            slot, _, _ = c.reserve(seq, np.array([out[-1]], dtype=np.int32))
            logits = self._forward(seq, [out[-1]], slot, pos)
            out.append(int(torch.argmax(logits)))
        self._finish(seq)
        self.stats.add_turn(turn, max_new, time.perf_counter() - t0)
        c.check_invariants()
        if self.tiered:
            self.tiers.check_invariants()
        return out, turn

    def _onboard(self, seq, chain, n, cached):
        if n == 0:
            return 0
        first = cached // self.B
        blocks = self.cache.export_block_table([seq], first + n)[0][first:first + n]
        job = self.tiers.plan_load("host", "device", chain[first:first + n], blocks)
        kv.block_copy(self.host, self.pool, np.ascontiguousarray(job.moves[:, :2]))
        landed = self.tiers.complete(job.id)
        self.stats.blocks_onboarded += landed
        for b in range(landed):  # the landed blocks hold their tokens: the forward pass reads their positions
            base = int(blocks[b]) * self.B
            self.positions[0, base:base + self.B] = torch.arange((first + b) * self.B, (first + b + 1) * self.B)
        return landed * self.B

    def _offload_before_admit(self, hit, end):
        if not self.tiered or self.write != "write_back":
            return
        pool = self.cache.pool
        taken = sum(pool.ref_count(int(b)) == 0 for b in hit)
        blocks, hashes, parents, groups = self.policy.before_allocate(pool, self._blocks_for(end) - len(hit) + taken)
        keep = ~np.isin(blocks, hit)
        self._store((blocks[keep], hashes[keep], parents[keep], groups[keep]))

    def _offload_before(self, allocations):
        if self.tiered and self.write == "write_back" and allocations:
            self._store(self.policy.before_allocate(self.cache.pool, allocations))

    def _written(self):
        if not self.tiered or self.write != "write_through":
            return None
        return self.policy.on_stored(self.cache.drain_events(1024))

    def _plan(self, offloads):
        if offloads is None or len(offloads[0]) == 0:
            return None
        blocks, hashes, parents, groups = offloads
        try:
            return self.tiers.plan_store("device", "host", hashes, blocks, parents=parents, groups=groups)
        except kv.OutOfBlocks:  # host memory cannot take them all: a store is all or nothing
            return None

    def _run(self, job):
        kv.block_copy(self.pool, self.host, np.ascontiguousarray(job.moves[:, :2]))
        self.tiers.complete(job.id)
        self.stats.blocks_offloaded += len(job.moves)

    def _store(self, offloads):
        job = self._plan(offloads)
        if job is not None:
            self._run(job)

    def _finish(self, seq):
        """The request ends while its last blocks' store runs: held until the copy completes."""
        job = self._plan(self._written())
        hold = self.cache.hold(np.ascontiguousarray(job.moves[:, 0])) if job is not None else None
        self.cache.free(seq)
        if job is not None:
            self._run(job)
            self.cache.release_hold(hold)


class HybridTieredEngine:
    """tiered_hybrid.hpp's engine, call for call: the model's even layers full
    attention, its odd layers a sliding window of `window` tokens, both groups
    in one device pool of pages (kv.HybridCache) and one host tier of pages
    under it (kv.GroupTiers). A prompt the device forgot is imported from host
    memory: each group's pending pages are copied in (the full group's whole
    prefix, the window group's last window) and the import commits. A
    finished turn offloads what its continuation can hit, its pages held
    until the copy completes. Without a host tier it recomputes."""

    def __init__(self, model, device_blocks=64, host_blocks=0, block_size=16, chunk=64, window=64):
        c = model.c
        self.m, self.c, self.fwd = model, c, eng.Forward(model)
        self.heads, self.head_dim = c["kv_heads"], c["dim"] // c["q_heads"]
        self.chunk, self.tiered = chunk, host_blocks > 0
        L = c["layers"]
        shape = dict(num_kv_heads=self.heads, head_dim=self.head_dim, dtype=kv.DType.f32)
        self.groups = kv.LayerGroups([kv.LayerGroup("full", list(range(0, L, 2)), **shape),
                                      kv.LayerGroup("sliding_window", list(range(1, L, 2)), window=window, **shape)],
                                     block_size=block_size)
        # What engine.HybridKv reads of its engine: each group's window, views and held scales (f32: none).
        self.group_window, self.group_scales, self.quest = [0, window], [{}, {}], None
        self.page = self.groups.page_bytes
        pages = 2 * device_blocks + 1  # device_blocks counts blocks of every layer: a page holds half of them
        self.device = torch.zeros(pages * self.page, dtype=torch.uint8)
        self.views = [kv.PoolView.of_group(self.groups, g, self.device, pages) for g in range(2)]
        self.cache = kv.HybridCache(self.groups, num_blocks=pages, max_sequences=1, max_tokens=c["context"],
                                    prefill_chunk=chunk)
        if self.tiered:
            self.host = torch.zeros(2 * host_blocks * self.page, dtype=torch.uint8)
            self.tiers = kv.GroupTiers(self.cache, host_blocks=2 * host_blocks)
        self.stats = Stats()

    def _copy(self, dst, src, moves):  # whole pages, (src, dst) of each move
        p = self.page
        for a, b in moves[:, :2].tolist():
            dst[b * p:(b + 1) * p] = src[a * p:(a + 1) * p]

    def _forward(self, seq, tokens, at, n, slots):
        """Tokens [at, at + n) through the model, each group's K/V into its slots [2, n]; then computed."""
        store = eng.HybridKv(self, _Row(seq), np.ascontiguousarray(slots, dtype=np.int32))
        logits = self.fwd.run(store, tokens[at:at + n], at, True)[0]
        self.cache.computed(seq, at + n)
        return logits

    def serve(self, prompt, max_new):
        """One turn: the prompt (the conversation so far), then max_new greedy tokens; returns them and the turn's stats."""
        t0 = time.perf_counter()
        n_prompt, c = len(prompt), self.cache
        prompt_arr = np.asarray(prompt, dtype=np.int32)
        tokens = list(prompt)
        if self.tiered:
            device_tokens, hit_tokens, _, _ = self.tiers.lookup(prompt_arr)
        else:
            device_tokens = hit_tokens = c.match(prompt_arr)
        turn = dict(prompt=n_prompt, device_hit=device_tokens, host_hit=0)
        if hit_tokens > device_tokens:  # host memory holds more: import it, onboard every group's pending pages
            import_id, turn["device_hit"], _ = c.import_prompt(prompt_arr[:hit_tokens])
            job = self.tiers.plan_onboard(import_id)
            self._copy(self.device, self.host, job.moves)
            seq, committed, have = self.tiers.complete_onboard(job.id)
            self.stats.blocks_onboarded += len(job.moves)
            if committed:
                turn["host_hit"] = have - turn["device_hit"]
        else:  # admission shares the device hit and reserves the first chunk
            a = c.admit(prompt_arr)
            seq, have = a.seq, a.cached_tokens
            turn["device_hit"] = have
            logits = self._forward(seq, tokens, have, a.reserved, a.slots[:, :a.reserved])
            have += a.reserved
        turn["computed"] = n_prompt - turn["device_hit"] - turn["host_hit"]
        while have < n_prompt:  # the prefill of what no tier held
            n = min(self.chunk, n_prompt - have)
            logits = self._forward(seq, tokens, have, n, c.reserve(seq, prompt_arr[have:have + n])[0])
            have += n
        out = [int(torch.argmax(logits))]
        turn["ttft_s"] = time.perf_counter() - t0
        for pos in range(n_prompt, n_prompt + max_new - 1):
            tokens.append(out[-1])
            logits = self._forward(seq, tokens, pos, 1, c.reserve(seq, np.array([out[-1]], dtype=np.int32))[0])
            out.append(int(torch.argmax(logits)))
        self._finish(seq, tokens)  # the prompt and every generated token but the last, whose K/V is not written
        self.stats.add_turn(turn, max_new, time.perf_counter() - t0)
        c.check_invariants()
        if self.tiered:
            self.tiers.tiers.check_invariants()
        return out, turn

    def _finish(self, seq, tokens):
        """What the continuation can hit goes to host memory; the pages stay held until the copy completes."""
        if not self.tiered:
            self.cache.free(seq)
            return
        try:
            job = self.tiers.plan_offload(seq, np.asarray(tokens, dtype=np.int32))
        except kv.OutOfBlocks:  # host memory cannot take them all: a store is all or nothing
            job = None
        hold = self.cache.hold(np.ascontiguousarray(job.moves[:, 0]) if job is not None else np.zeros(0, np.int32))
        self.cache.free(seq)
        if job is not None:
            self._copy(self.host, self.device, job.moves)
            self.tiers.tiers.complete(job.id)
            self.stats.blocks_offloaded += len(job.moves)
        self.cache.release_hold(hold)


def serve_multiturn(model, conversations=8, turns=4, first=192, user=48, max_new=32, **engine_args):
    """tiered.hpp's serve_multiturn: turns round the conversations; returns (outputs, turn stats, engine stats)."""
    return serve_multiturn_on(TieredEngine(model, **engine_args), conversations, turns, first, user, max_new)


def serve_multiturn_on(e, conversations=8, turns=4, first=192, user=48, max_new=32):
    """tiered.hpp's serve_multiturn_on: the turns on engine e (a TieredEngine or a HybridTieredEngine)."""
    text = list((mdl.MODEL_DIR / "heldout.bin").read_bytes())

    def cut(at, n):
        at %= len(text) - n
        return text[at:at + n]

    history = [[] for _ in range(conversations)]
    outputs, stats = [], []
    for t in range(turns):
        for c in range(conversations):
            history[c] += cut(c * 4001, first) if t == 0 else cut(c * 7919 + t * 613, user)
            out, turn = e.serve(history[c], max_new)
            history[c] += out
            outputs.append(out)
            stats.append(turn)
    return outputs, stats, e.stats


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in [("conversations", 8), ("turns", 4), ("first", 192), ("user", 48), ("new", 32), ("device", 64),
                          ("host", 512), ("block", 16), ("chunk", 64)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--json")
    a = p.parse_args()
    torch.set_num_threads(2)
    model = mdl.load()
    report = {}
    for name, tiered, write in MODES:
        outputs, _, st = serve_multiturn(model, a.conversations, a.turns, a.first, a.user, a.new, device_blocks=a.device,
                                         host_blocks=a.host if tiered else 0, block_size=a.block, chunk=a.chunk,
                                         write=write)
        report[name] = dict(outputs=outputs, stats=dataclasses.asdict(st))
        print(st.line(name, "blocks"))
    # The hybrid model: its own recompute is the reference (a window changes what the model generates).
    for name, host in [("hybrid_recompute", 0), ("hybrid_host", a.host)]:
        e = HybridTieredEngine(model, device_blocks=a.device, host_blocks=host, block_size=a.block, chunk=a.chunk,
                               window=a.window)
        outputs, _, st = serve_multiturn_on(e, a.conversations, a.turns, a.first, a.user, a.new)
        report[name] = dict(outputs=outputs, stats=dataclasses.asdict(st))
        print(st.line(name, "pages"))
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
