"""A small continuous-batching engine in PyTorch over kvcache: the Python twin
of examples/engine/engine.hpp, step for step, so the two can be compared
token for token (python/tests/test_example_engine.py).

Requests are admitted by the cache's accounting (the whole life's blocks
under the policy, or, `optimistic`, the prefill's, as vLLM does); every step
runs one prefill chunk or one decoded token per running request, highest
priority first; when the pool runs out, the lowest-priority running request
is preempted (its blocks freed, its prompt and output so far re-prefilled
later). Eviction runs after every chunk on the attention the forward pass
just computed. Greedy decoding: runs are reproducible.

Each request's chunk is its own forward call, as in the C++ engine: a
request's eviction frees blocks before the next request reserves, so the
schedule (and who is preempted) is the same in both engines.
"""
import dataclasses

import numpy as np
import torch

import kvcache as kv
from channel_kv import ChannelResidual
from group_io import Handoff, HostTier, PeerHold, layout_of
from kv_formats import KV_FORMATS, calibrate_kv_scales, calibration_window, heldout_window  # noqa: F401 (the engine's names)
from kv_stores import HybridKv, PagedKv, held_scales  # noqa: F401
from model import Forward, Trace

TOKEN_POLICIES = (kv.H2O, kv.Tova, kv.SnapKV, kv.AverageAttention)


POLICY_NAMES = ["keep_all", "sliding_window", "sink_window", "block_scores", "block_scores_summed", "h2o",
                "h2o_summed", "tova", "tova_summed", "snapkv", "snapkv_summed", "average_attention",
                "average_attention_summed"]


@dataclasses.dataclass
class EngineConfig:
    max_kv_tokens: int = 4096  # the pool: max_kv_tokens / block_size blocks
    block_size: int = 16
    chunk: int = 64            # prefill chunk
    max_batch: int = 8         # running requests at most
    evict_in_prefill: bool = True
    observe_prefill: bool = False  # evict_in_prefill off: every chunk's attention still scores (H2O's and the
    #                                averaging policies' whole-prompt sums; SnapKV keeps its window alone)
    optimistic: bool = False   # admit when the prefill fits now; preempt when decoding runs out
    grouping: str = "heads"    # token policies' groups: all, heads, layers or layer_heads
    observe_window: int = 0    # SnapKV: the prompt's last queries that score it
    layer_streams: bool = False  # one stream per (request, layer): block policies choose per layer
    window: int = 0            # > 0: a hybrid cache, the model's window layers (the tiny model: its odd layers) a
    #                            sliding window of this many tokens (keep_all; any kv_format that scales no
    #                            channel, prefix_caching through HybridCache.admit)
    prefix_caching: bool = False  # admit through the prefix cache: a prompt's cached blocks are not computed again
    kv_format: str = "f32"     # how the pool stores K/V: a name in KV_FORMATS
    kv_scales: tuple = None    # a calibrated format's (k, v) scales, [layers * kv_heads] each; None: calibrate
    keep_logits: bool = False  # every position's logits, each chunk's in Request.chunk_logits (for the dense checks)
    quest_budget: int = 0      # > 0: Quest selection, each decoded query reads about this many tokens per kv-head
    #                            (its pages with the best bound; the first two layers dense, as its paper runs it)
    layer_groups: bool = False  # the layers in kv.HybridCache groups with window 0 too: a model without window
    #                             layers in one full group (what window > 0 does, and everything it takes)
    host_blocks: int = 0       # > 0 (layer groups, prefix_caching): a host tier of this many pages (kv.GroupTiers)

    def __post_init__(self):  # a format that groups over blocks sets the block size (kv_formats.hpp's with_kv_format)
        if self.kv_format in KV_FORMATS and KV_FORMATS[self.kv_format][3]:
            self.block_size = KV_FORMATS[self.kv_format][3]


@dataclasses.dataclass
class Request:
    id: int
    prompt: list
    max_new: int
    priority: int = 0  # a larger priority is preempted last
    output: list = dataclasses.field(default_factory=list)
    logits: list = dataclasses.field(default_factory=list)  # each output token's logits [vocab]
    chunk_logits: list = dataclasses.field(default_factory=list)  # keep_logits: (first position, logits [n, vocab])
    fed: int = 0       # tokens of prompt + output in the cache
    running: bool = False
    done: bool = False
    seqs: list = dataclasses.field(default_factory=list)
    peak_kv: int = 0
    admitted: object = None  # a hybrid's admit(): the first chunk's slots [groups, n], not yet written
    hand_off: bool = False   # layer groups: when done, keep the prompt's pages for a peer (handoff)
    handoff: object = None   # hand_off's group_io.Handoff (None when the policy evicted: no longer the prompt's K/V)
    remote: object = None    # a group_io.Handoff of this prompt from a peer: imported, not computed (if it lands)


@dataclasses.dataclass
class Stats:
    steps: int = 0
    tokens_generated: int = 0
    preemptions: int = 0
    reprefilled: int = 0
    kv_high_water: int = 0
    max_batch: int = 0


def policy_by_name(name, budget, c, cfg):
    """The named policy holding about `budget` tokens per request, and `cfg`
    adjusted for it (examples/engine/policies.hpp, the same table; B is the
    block size, the block policies' unit)."""
    B = cfg.block_size
    cfg = dataclasses.replace(cfg)
    layer_heads = c["layers"] * c["kv_heads"]
    if name == "keep_all":
        return kv.KeepAll(), cfg
    if name == "sliding_window":
        return kv.SlidingWindow(budget), cfg
    if name == "sink_window":
        return kv.SinkWindow(sinks=4, window=budget - 2 * B), cfg
    if name in ("block_scores", "block_scores_summed"):
        recent = max(B, min(4 * B, (budget - 3 * B) // B * B))
        cfg.layer_streams = name == "block_scores" and cfg.window == 0  # a hybrid's global group is one stream
        return kv.BlockScores(start=B, recent=recent, max=budget - B), cfg
    if name in ("h2o", "h2o_summed"):  # half heavy hitters, half recent
        summed = name == "h2o_summed"
        cfg.grouping = "heads" if summed else "layer_heads"
        return kv.H2O(heavy=budget // 2, recent=budget - budget // 2,
                      groups=c["kv_heads"] if summed else layer_heads), cfg
    if name in ("tova", "tova_summed"):
        summed = name == "tova_summed"
        cfg.grouping = "all" if summed else "layers"
        return kv.Tova(budget=budget, groups=1 if summed else c["layers"]), cfg
    if name in ("snapkv", "snapkv_summed"):  # one shot after the prompt
        per_head = name == "snapkv"
        cfg.evict_in_prefill = False
        cfg.grouping = "layer_heads" if per_head else "heads"
        cfg.observe_window = 32 if per_head else 0
        return kv.SnapKV(capacity=budget - 32, window=32, kernel=7,
                         groups=layer_heads if per_head else c["kv_heads"]), cfg
    if name in ("average_attention", "average_attention_summed"):
        summed = name == "average_attention_summed"
        cfg.grouping = "all" if summed else "layer_heads"
        return kv.AverageAttention(budget=budget, step=32, groups=1 if summed else layer_heads), cfg
    raise ValueError(f"unknown policy '{name}' (one of: {', '.join(POLICY_NAMES)})")


class Engine:
    def __init__(self, model, cfg, policy):
        c = model.c
        self.m, self.c, self.cfg, self.fwd = model, c, cfg, Forward(model)
        self.heads, self.head_dim = c["kv_heads"], c.get("head_dim", c["dim"] // c["q_heads"])
        self.token_policy = isinstance(policy, TOKEN_POLICIES)
        self.observes = self.token_policy or isinstance(policy, kv.BlockScores)
        if self.token_policy and cfg.layer_streams:
            raise ValueError("layer_streams: token policies choose per layer through their groups")
        self.streams = c["layers"] if cfg.layer_streams else 1
        self.stats = Stats()
        # Prompt tokens the prefix cache served (prefix_caching; not in Stats: the C++ twin has none).
        self.prefix_hit_tokens = 0
        self.hybrid = cfg.window > 0 or cfg.layer_groups
        self.host = None  # layer groups: the host tier (group_io.HostTier)
        if cfg.host_blocks and not (self.hybrid and cfg.prefix_caching and cfg.host_blocks > 0):
            raise ValueError(f"host_blocks {cfg.host_blocks}: a host tier holds published pages of layer groups "
                             f"(window > 0 or layer_groups, with prefix_caching)")
        self.scales = None  # a calibrated format's (k, v): float32 arrays [layers, kv_heads]
        self.residual = None  # a channel-scaled pool's open blocks (KIVI)
        if cfg.prefix_caching and (self.token_policy or cfg.layer_streams):
            raise ValueError("prefix_caching: one stream per request under keep_all or a block policy "
                             "(a token policy's compaction rewrites the rows a hit would share)")
        if cfg.kv_format not in KV_FORMATS:
            raise ValueError(f"unknown KV format '{cfg.kv_format}' (one of: {', '.join(KV_FORMATS)})")
        dtype, fmt, calibrated, _ = KV_FORMATS[cfg.kv_format]
        if calibrated:
            given = cfg.kv_scales or calibrate_kv_scales(model, calibration_window(model), dtype)
            self.scales = tuple(np.asarray(s, dtype=np.float32) for s in given)
            cells = c["layers"] * self.heads
            for side, s in zip("kv", self.scales):
                if s.size != cells:
                    raise ValueError(f"kv_scales.{side}: {s.size} scales, the format needs {cells} (layers x kv_heads)")
                bad = np.flatnonzero(~(np.isfinite(s) & (s > 0)))
                if bad.size:
                    raise ValueError(f"kv_scales.{side}[{bad[0]}] = {s.flat[bad[0]]}: not positive and finite")
            self.scales = tuple(s.reshape(c["layers"], self.heads) for s in self.scales)
        elif cfg.kv_scales is not None:
            raise ValueError(f"kv_scales: given, but {cfg.kv_format} holds no engine-held scales")
        if self.hybrid:
            self._init_hybrid(policy, dtype, fmt)
            return
        self.geometry = kv.Geometry(num_layers=1 if cfg.layer_streams else c["layers"], num_kv_heads=self.heads,
                                    head_dim=self.head_dim, block_size=cfg.block_size, dtype=dtype, format=fmt)
        self.blocks = (cfg.max_kv_tokens // cfg.block_size + 1) * self.streams
        self.memory = torch.zeros(self.geometry.pool_bytes(self.blocks), dtype=torch.uint8)
        self.pool = kv.PoolView(self.geometry, self.memory, self.blocks)
        self.max_blocks_per_stream = c["context"] // cfg.block_size + 2
        self.quest = None
        if cfg.quest_budget:
            # Bounds fold the keys as the pool holds them (page_bounds_update dequantizes a quantized pool's),
            # so a quantized format ranks its pages by the keys attention reads. A per-channel format keeps its
            # open block's keys outside the pool (ChannelResidual): their bounds would miss them.
            channel = kv.Scales.channel in (fmt.k.scales, fmt.v.scales)
            if channel or cfg.layer_streams:
                raise ValueError(f"quest_budget {cfg.quest_budget}: Quest bounds the keys the pool holds, for one "
                                 f"stream per request (kv_format {cfg.kv_format}, layer_streams {cfg.layer_streams})")
            self.quest = kv.Quest(token_budget=cfg.quest_budget, query_group=c["q_heads"] // c["kv_heads"])
        self.cache = kv.Cache(self.geometry, num_blocks=self.blocks, max_sequences=cfg.max_batch * self.streams,
                              max_blocks_per_sequence=self.max_blocks_per_stream, eviction=policy,
                              publish_on_reserve=cfg.prefix_caching, selection=self.quest)
        self.groups = policy.groups if self.token_policy else 1
        self.grouping = "all" if self.groups == 1 else cfg.grouping
        L, H = c["layers"], self.heads
        self.layout = {"all": (0, 0), "heads": (0, 1), "layers": (1, 0), "layer_heads": (H, 1)}[self.grouping]
        self.positions = torch.full((self.groups, self.blocks * cfg.block_size), -1, dtype=torch.long)
        self.indptr, self.last = np.zeros(2, dtype=np.int32), np.zeros(1, dtype=np.int32)
        self.last_query = isinstance(policy, kv.Tova)
        if fmt.k.scales == kv.Scales.channel or fmt.v.scales == kv.Scales.channel:
            self.residual = ChannelResidual(self.pool, self.geometry.num_layers, cfg.block_size, self.heads, self.head_dim)

    def _init_hybrid(self, policy, dtype, fmt):
        """The layers in groups of one pool (hybrid_backend.hpp): the full-attention
        layers in one group, the window layers in groups of as many layers (as
        vLLM's hybrid manager groups them, so every group's page is the same
        size). The window layers are the model's own (Gemma 3's), or, for a
        model with none, the odd layers."""
        c, cfg, L = self.c, self.cfg, self.c["layers"]
        if (not isinstance(policy, (kv.KeepAll, kv.SinkWindow, kv.BlockScores)) or cfg.optimistic or cfg.layer_streams
                or not cfg.evict_in_prefill):
            raise ValueError("window: keep_all or a block policy on the global layers (sink_window, block_scores), "
                             "admitted by its lifetime, every chunk marked computed")
        if kv.Scales.channel in (fmt.k.scales, fmt.v.scales):
            raise ValueError(f"window: {cfg.kv_format} scales per channel, which a layer group does not store")
        own = [self.m.window(layer) for layer in range(L)]
        if any(own):
            if set(own) - {0} != {cfg.window}:
                raise ValueError(f"window {cfg.window}: the model's window layers attend to {max(own)} tokens")
            full, windowed = [i for i in range(L) if own[i] == 0], [i for i in range(L) if own[i] > 0]
        elif cfg.window == 0:  # layer_groups alone: every layer in one full group
            full, windowed = list(range(L)), []
        else:
            full, windowed = list(range(0, L, 2)), list(range(1, L, 2))
        size = len(full)
        shape = dict(num_kv_heads=self.heads, head_dim=self.head_dim, dtype=dtype, format=fmt)
        groups = [kv.LayerGroup("full", full, **shape)]
        groups += [kv.LayerGroup("sliding_window", windowed[i:i + size], window=cfg.window, **shape)
                   for i in range(0, len(windowed), size)]
        self.groups = kv.LayerGroups(groups, block_size=cfg.block_size)
        self.group_window = [0] + [cfg.window] * (len(groups) - 1)
        self.group_layers = [len(g.layers) for g in groups]
        # A calibrated format's scales by the group's own layers (the kernels index them by pool layer).
        self.group_scales = [{} if self.scales is None else
                             {"k_scales": np.ascontiguousarray(self.scales[0][g.layers]).reshape(-1),
                              "v_scales": np.ascontiguousarray(self.scales[1][g.layers]).reshape(-1)} for g in groups]
        # The bytes of max_kv_tokens tokens of every layer, and the null block.
        self.blocks = len(groups) * (cfg.max_kv_tokens // cfg.block_size) + 1
        self.memory = torch.zeros(self.blocks * self.groups.page_bytes, dtype=torch.uint8)
        self.views = [kv.PoolView.of_group(self.groups, g, self.memory, self.blocks) for g in range(len(groups))]
        # Quest on the global layers (the full-attention group); the window groups keep their window. Its
        # dense_layers count global layers: those among the model's first two read every page, as Quest's do.
        self.quest = None
        if cfg.quest_budget:
            self.quest = kv.Quest(token_budget=cfg.quest_budget, dense_layers=sum(1 for layer in full if layer < 2),
                                  query_group=c["q_heads"] // c["kv_heads"])
        # A block policy on the global layers (the full group): its blocks leave as holes after every chunk and
        # decoded token; the window groups keep their window. Block scores read the full layers' attention sums.
        self.full_layers = full
        self.hybrid_evicts = not isinstance(policy, kv.KeepAll)
        self.cache = kv.HybridCache(self.groups, num_blocks=self.blocks, max_sequences=cfg.max_batch,
                                    max_tokens=c["context"] + 256, prefill_chunk=cfg.chunk,
                                    prefix_caching=cfg.prefix_caching, selection=self.quest,
                                    eviction=policy if self.hybrid_evicts else None)
        self.token_policy = self.last_query = False
        self.observes = isinstance(policy, kv.BlockScores)
        self.layout = layout_of(self.groups, [g.layers for g in groups], self.group_window, cfg.kv_format)
        if cfg.host_blocks:
            self.host = HostTier(self.cache, self.groups.page_bytes, cfg.host_blocks)

    def kv_bytes(self, tokens):
        """(bytes one request of `tokens` tokens holds at its peak in this
        engine's layout, bytes it would hold with every layer keeping every
        token). A hybrid's window groups hold their window and a chunk."""
        B = self.cfg.block_size
        blocks = -(-tokens // B)
        if self.hybrid:
            page = self.groups.page_bytes
            return self.groups.blocks_needed(tokens, self.cfg.chunk) * page, len(self.group_layers) * blocks * page
        per_block = self.geometry.pool_bytes(self.blocks) // self.blocks
        return blocks * per_block * self.streams, blocks * per_block * self.streams

    def group_of(self, layer, head):
        return layer * self.layout[0] + head * self.layout[1]

    # Bookkeeping.
    def held(self, r):  # one stream per layer: their mean, rounded up (a hybrid: its layers')
        if self.hybrid:
            held = sum(self.cache.tokens_held(r.seqs[0], g) * n for g, n in enumerate(self.group_layers))
            return -(-held // self.c["layers"])
        return (sum(self.cache.tokens_held(s) for s in r.seqs) + self.streams - 1) // self.streams

    def blocks_needed(self, tokens, new_tokens, chunk):
        if self.hybrid:  # the configured chunk: the bound the pool is sized with
            return self.cache.blocks_needed(tokens, new_tokens)
        return self.cache.blocks_needed(tokens, new_tokens, chunk) * self.streams

    def _blocks(self, seq):
        return self.cache.export_csr(np.array([seq], dtype=np.uint64), self.indptr, None, self.last)[1].copy()

    def _tokens_of(self, r):
        return len(r.prompt) + len(r.output)

    def _add_streams(self, r):
        r.seqs = [self.cache.add_sequence() for _ in range(self.streams)]

    def _free_streams(self, r):
        for s in r.seqs:
            if self.residual:
                for b in self._blocks(s).tolist():
                    self.residual.drop(b)
            self.cache.free(s)
        r.seqs, r.admitted = [], None

    def _reserve(self, r, n):
        """n slots in each of r's streams, [streams, n]; all or nothing (raises kv.OutOfBlocks)."""
        if self.hybrid:  # [groups, n]; with their ids, computed() publishes the full blocks
            if r.admitted is not None:  # admit() reserved the first chunk
                slots, r.admitted = r.admitted, None
                return slots
            seq = r.prompt + r.output
            return self.cache.reserve(r.seqs[0], np.asarray(seq[r.fed:r.fed + n], dtype=np.int32)
                                      if self.cfg.prefix_caching else n)[0]
        if self.cfg.prefix_caching:  # the tokens' ids go with their slots: full blocks publish themselves
            seq = r.prompt + r.output
            slots, _, copy = self.cache.reserve(r.seqs[0], np.asarray(seq[r.fed:r.fed + n], dtype=np.int32))
            copies = copy[0] >= 0
            slots = slots[None]
        elif len(r.seqs) == 1:
            slots, _, copy = self.cache.reserve(r.seqs[0], n)
            copies = copy[0] >= 0
            slots = slots[None]
        else:
            slots, _, copies = self.cache.reserve_batch(np.array(r.seqs, dtype=np.uint64),
                                                        np.full(len(r.seqs), n, dtype=np.int32))
            slots = slots.reshape(len(r.seqs), n)
        if copies:
            raise RuntimeError("unexpected copy-on-write: nothing is shared here")
        return slots

    def _chunk_before(self, left, n):  # never past the prompt's end; the last chunk holds the observation window
        w = self.cfg.observe_window
        n = min(n, left)
        if w > 0 and 0 < left - n < w and left > w:
            n = left - w
        return n

    # Scheduling.
    def run(self, reqs):
        while not all(r.done for r in reqs):
            self.step(reqs)

    def step(self, reqs):
        self._admit(reqs)
        running = sorted((r for r in reqs if r.running), key=lambda r: -r.priority)
        for r in running:
            if r.running:  # not preempted earlier in this step
                self._advance(r, reqs)
        live = [r for r in reqs if r.running]
        st = self.stats
        st.max_batch = max(st.max_batch, len(live))
        st.kv_high_water = max(st.kv_high_water, sum(self.held(r) for r in live))
        st.steps += 1

    def _admit(self, reqs):
        chunk = self.cfg.chunk if self.cfg.evict_in_prefill else 0
        for r in sorted((r for r in reqs if not r.running and not r.done), key=lambda r: -r.priority):
            remaining = r.max_new - len(r.output)
            try:
                need = self.blocks_needed(self._tokens_of(r), 0 if self.cfg.optimistic else remaining, chunk)
            except kv.Error:
                break
            c = self.cache
            if (r.remote is not None or r.hand_off) and not self.hybrid:
                raise ValueError(f"request {r.id}: a hand-off or a remote prompt moves layer groups' pages "
                                 "(window > 0 or layer_groups)")
            if self.hybrid and (self.cfg.prefix_caching or r.remote is not None):
                if c.free_sequences < 1:
                    break
                try:  # each checks the lifetime need, hit blocks counted
                    self._admit_layer_groups(r, remaining)
                except kv.OutOfBlocks:
                    break
                continue
            if self.cfg.prefix_caching:  # the ledger counts the hit: what the prompt's cached blocks save
                tokens = np.asarray(r.prompt + r.output, dtype=np.int32)
                plan = dict(max_new=0 if self.cfg.optimistic else remaining, prefill_chunk=chunk)
                if c.free_sequences < 1 or not c.can_admit_prompt(tokens, **plan):
                    break
                a = c.admit(tokens, reserve=0, **plan)
                r.seqs, r.running, r.fed = [a.seq], True, a.cached_tokens
                self.prefix_hit_tokens += a.cached_tokens
                continue
            if c.free_sequences < self.streams or need > c.free_blocks - c.promised_blocks:
                break
            self._add_streams(r)
            for s in r.seqs:  # each stream's share of the need
                c.promise(s, need if self.hybrid else min(need // self.streams, self.max_blocks_per_stream))
            r.running, r.fed = True, 0

    def _advance(self, r, reqs):
        total = self._tokens_of(r)
        n = self._chunk_before(total - r.fed, min(self.cfg.chunk, total - r.fed))
        if r.admitted is not None:  # the chunk admit() reserved
            n = r.admitted.shape[1]
        while True:
            try:
                slots = self._reserve(r, n)
                break
            except kv.OutOfBlocks:
                if not self._preempt_lowest(reqs, r):
                    return  # r itself was preempted
        seq = r.prompt + r.output
        # A hybrid feeds only block scores (its global layers' sums, each layer's rows as it holds them).
        trace = (Trace(ragged=True) if self.observes else None) if self.hybrid else Trace(ragged=self.streams > 1)
        store = HybridKv(self, r, slots) if self.hybrid else PagedKv(self, r, slots, r.fed)
        logits = self.fwd.run(store, seq[r.fed:r.fed + n], r.fed, not self.cfg.keep_logits, trace,
                              self.cfg.observe_window)
        if self.cfg.keep_logits:
            r.chunk_logits.append((r.fed, logits))
            logits = logits[-1:]
        r.fed += n
        r.peak_kv = max(r.peak_kv, self.held(r))
        prefill_done = r.fed >= total
        if self.cfg.evict_in_prefill or prefill_done:
            self._feed_and_evict(r, trace)
        elif self.cfg.observe_prefill and not self.cfg.observe_window:
            self._feed_and_evict(r, trace, evict=False)
        if prefill_done:
            r.logits.append(logits[0])
            r.output.append(int(torch.argmax(logits[0])))
            self.stats.tokens_generated += 1
            if len(r.output) >= r.max_new:
                self._finish(r)

    def _admit_layer_groups(self, r, remaining):
        """r's sequence on layer groups: imported from its peer (r.remote), else
        the device's prefix hit, or host memory's longer one; kv.OutOfBlocks
        when it does not fit (nothing changed)."""
        c, tokens = self.cache, np.asarray(r.prompt + r.output, dtype=np.int32)
        if r.remote is not None:
            return self._import(r, remaining)
        if self.host is not None:
            onboarded = self.host.admit(c, self.memory, tokens, remaining)
            if onboarded is not None:
                seq, r.fed, device_tokens = onboarded
                r.seqs, r.running = [seq], True
                self.prefix_hit_tokens += device_tokens
                self._bound_received(seq)
                return
        a = c.admit(tokens, max_new=remaining)
        r.seqs, r.running, r.fed = [a.seq], True, a.cached_tokens
        r.admitted = np.ascontiguousarray(a.slots[:, :a.reserved])
        self.prefix_hit_tokens += a.cached_tokens

    def _import(self, r, remaining):
        """The prompt a peer prefilled (r.remote): the device's own prefix hit
        shared, the rest of every group's pages read from the peer's pool, and
        the peer's first token; what cannot be read is computed here."""
        h, c = r.remote, self.cache
        if h.layout != self.layout:
            raise ValueError(f"request {r.id}: remote layout {h.layout} is not this engine's {self.layout}")
        if r.output or list(h.prompt) != list(r.prompt):
            raise ValueError(f"request {r.id}: remote holds another prompt ({len(h.prompt)} tokens) "
                             f"than the request's ({len(r.prompt)} tokens, {len(r.output)} generated)")
        if (h.scales is None) != (self.scales is None) or (
                h.scales is not None and not all(np.array_equal(a, b) for a, b in zip(h.scales, self.scales))):
            raise ValueError(f"request {r.id}: remote codes are scaled by other kv_scales than this engine's")
        prompt = np.asarray(r.prompt, dtype=np.int32)
        imp, cached, _ = c.import_prompt(prompt, max_new=remaining)
        if h.read_into(c, imp, self.memory):
            seq, _ = c.commit_import(imp, prompt)
            r.fed = len(prompt)
            r.output.append(h.first)
            r.logits.append(h.logits)
            self.stats.tokens_generated += 1
        else:  # the peer let a page go: compute what did not arrive
            seq, cached, _ = c.abort_import(imp)
            r.fed = cached
        h.hold.release()
        r.remote = None
        r.seqs, r.running = [seq], True
        self.prefix_hit_tokens += cached
        self._bound_received(seq)
        if len(r.output) >= r.max_new:
            self._finish(r)

    def _bound_received(self, seq):
        """Quest: the global layers' pages an import or an onboard wrote get their key bounds."""
        if not self.quest:
            return
        pages, fill, listed = self.cache.stale_pages(np.array([seq], dtype=np.uint64))
        for layer in self.full_layers if listed else []:
            g, index = self.groups.layer_slot(layer)
            kv.page_bounds(self.views[g], index, pages[:listed], fill[:listed], self.cache.page_bounds(layer))

    def _finish(self, r):
        """r is done: its pages handed off (r.hand_off), offloaded to host memory (a host tier), then freed."""
        if r.hand_off:
            r.handoff = self._hand_off(r)
        if self.host is not None:
            self.host.finish(self.cache, self.memory, r.seqs[0], (r.prompt + r.output)[:-1])
            r.seqs, r.admitted = [], None
        else:
            self._free_streams(r)
        r.running, r.done = False, True

    def _hand_off(self, r):
        """r's prompt for a peer: its rows and a hold on its pages (released by the peer's
        import); None when the policy evicted (its K/V past the eviction read another context)."""
        c, seq = self.cache, r.seqs[0]
        if self.hybrid_evicts and c.evicted(seq):
            return None
        return Handoff(prompt=list(r.prompt), first=r.output[0], logits=r.logits[0],
                       rows=[c.blocks(seq, g).copy() for g in range(self.groups.num_groups)], memory=self.memory,
                       layout=self.layout, scales=self.scales, hold=PeerHold(c, c.live_blocks(seq)))

    def _preempt_lowest(self, reqs, keep):
        """Frees the lowest-priority running request (perhaps `keep`: then False)."""
        running = [r for r in reqs if r.running]
        if not running:
            raise RuntimeError("out of blocks with nothing to preempt")
        victim = min(running, key=lambda r: (r.priority, -r.id))
        if victim is keep and len(running) == 1:
            raise RuntimeError(f"request {keep.id} does not fit the pool on its own")
        self.stats.preemptions += 1
        self.stats.reprefilled += victim.fed
        self._free_streams(victim)
        victim.running, victim.fed = False, 0
        return victim is not keep

    # Eviction.
    def _feed_and_evict(self, r, trace, evict=True):
        c, cache = self.c, self.cache
        if self.hybrid:  # the chunk is computed: a later reserve may free what left the window
            seq = r.seqs[0]
            cache.computed(seq, cache.tokens(seq))
            if self.hybrid_evicts and evict:  # then the global group's policy: its blocks leave as holes
                if self.observes:
                    cache.observe(seq, 0, sum(trace.layer_sums[layer] for layer in self.full_layers).contiguous().numpy())
                cache.evict(seq)
            return
        if self.streams > 1:  # one stream per layer, scored by that layer's attention
            for layer, seq in enumerate(r.seqs):
                cache.observe(seq, trace.layer_sums[layer].contiguous(), "attention_sums")
                if evict:
                    cache.evict(seq)
            return
        seq = r.seqs[0]
        if self.observes:
            if self.last_query:
                if self.grouping == "layers":
                    cache.observe(seq, trace.layer_last_query.reshape(c["layers"] * c["q_heads"], -1),
                                  "last_query_attention")
                else:
                    cache.observe(seq, trace.last_query, "last_query_attention")
            elif self.grouping == "layer_heads":
                cache.observe(seq, trace.layer_head_sums.reshape(c["layers"] * self.heads, -1), "head_attention_sums")
            elif self.grouping == "heads":
                cache.observe(seq, trace.head_sums, "head_attention_sums")
            else:
                cache.observe(seq, trace.head_sums.sum(0), "attention_sums")
        if not evict:
            return
        before, held = (self._blocks(seq), cache.tokens_held(seq)) if self.residual else (None, 0)
        self.channel_moves = []
        out = cache.evict(seq)
        if self.token_policy and out[0].moves > 0:
            self._compact(out[1], out[2])
        if self.residual and self.token_policy and (out[0].moves > 0 or cache.tokens_held(seq) != held):
            self.residual.compact(before, held, self._blocks(seq), cache.tokens_held(seq), self.channel_moves)
        if self.quest:  # the pages a compaction rewrote get their bounds again
            pages, fill, listed = cache.stale_pages(np.array(r.seqs, dtype=np.uint64))
            for layer in range(self.geometry.num_layers):
                if listed:
                    kv.page_bounds(self.pool, layer, pages[:listed], fill[:listed], cache.page_bounds(layer))

    def _compact(self, moves, group_moves):
        """Moves each group's surviving rows (its layers, its kv-heads) and their positions."""
        L, H = self.c["layers"], self.heads
        by_layer = self.grouping in ("layers", "layer_heads")
        by_head = self.grouping in ("heads", "layer_heads")
        per_layer = H if self.grouping == "layer_heads" else 1
        self.channel_moves = []
        for g in range(self.groups):
            lo, hi = int(group_moves[g]), int(group_moves[g + 1])
            if lo == hi:
                continue
            first_layer, layers = (g // per_layer, 1) if by_layer else (0, L)
            head, heads = (g % H, 1) if by_head else (0, 0)
            if self.residual:  # codes depend on their block's tokens: the residual's compaction moves them
                self.channel_moves.append((moves[lo:hi], first_layer, layers, head, heads))
            else:
                kv.compaction(self.pool, moves[lo:hi], first_layer=first_layer, num_layers=layers,
                              first_head=head, num_heads=heads)
            pos = self.positions[g]
            for src, dst in moves[lo:hi].tolist():  # in order: a move may read an earlier one's destination
                pos[dst] = pos[src]
