"""What moves a layer-group engine's pages into and out of its device pool
(engine.py on kv.HybridCache): a host tier under the pool (kv.GroupTiers,
EngineConfig(host_blocks=N)), and prompts a peer engine prefilled, imported
as a disaggregated decode node imports them (Request(remote=Handoff)).

Pages are copied whole (a page holds one block of every layer of its group,
in the group's format). A Handoff reads the peer's pool in this process, as
NIXL would read it over the wire (disagg.py's NixlHandoff does, between two
processes).
"""
import dataclasses

import numpy as np
import torch

import kvcache as kv


def copy_pages(dst, src, page, moves):
    """Whole pages of `page` bytes, src[a] -> dst[b] for each (a, b) of moves[:, :2]."""
    for a, b in np.asarray(moves)[:, :2].tolist():
        dst[b * page:(b + 1) * page] = src[a * page:(a + 1) * page]


def layout_of(groups, layers, windows, kv_format):
    """What a peer's pages must match to be read as ours: each group's kind,
    model layers, window and block size, the page's bytes and the format's name."""
    specs = tuple((groups.kind(g), tuple(layers[g]), windows[g], groups.block_size(g)) for g in range(groups.num_groups))
    return specs, groups.page_bytes, kv_format


class PeerHold:
    """A prefill engine's hold on the pages it handed off (cache.hold): they
    stay out of the free list until release(), by the import that read them
    or by whoever gives up on it; a hand-off is read only while held."""

    def __init__(self, cache, blocks):
        self.cache, self.id = cache, cache.hold(blocks)

    @property
    def held(self):
        return self.id is not None

    def release(self):
        if self.id is not None:
            self.cache.release_hold(self.id)
            self.id = None


@dataclasses.dataclass
class Handoff:
    """A prompt a prefill engine computed and holds for a decode engine
    (Engine.run on a Request(hand_off=True)): its first generated token and
    that token's logits, each group's row of the prompt (kv.HybridCache.blocks:
    block j holds positions [j * block size, ...), 0 where the group let it
    go), the pool those rows index and its layout, and the prefill engine's
    hold on those pages (a PeerHold)."""
    prompt: list
    first: int
    logits: torch.Tensor
    rows: list
    memory: torch.Tensor
    layout: tuple
    scales: tuple  # the prefill engine's calibrated (k, v) scales, or None: its codes mean nothing under others
    hold: PeerHold

    def read_into(self, cache, import_id, memory):
        """Copies every group's pages of import `import_id` (cache.import_blocks) from
        the peer's pool into `memory`; False, copying nothing, when the peer no
        longer holds them (its hold released: the pages may hold another prompt's
        K/V now) or let one go."""
        if not self.hold.held:
            return False
        page, moves = self.layout[1], []
        for g, row in enumerate(self.rows):
            skip, local = cache.import_blocks(import_id, g)
            remote = row[skip:skip + len(local)]
            if len(remote) < len(local) or np.any(remote == 0):
                return False
            moves += list(zip(remote.tolist(), np.asarray(local).tolist()))
        copy_pages(memory, self.memory, page, np.array(moves, dtype=np.int64).reshape(-1, 2))
        return True


class HostTier:
    """A host tier of `blocks` pages under a hybrid cache's device pool: a
    prompt the device forgot comes back through an import of what host memory
    holds (each group's pages that the next query reads); a finished request's
    pages go to host memory (what its continuation can hit), held on the
    device until the copy completes (write-back at the end of a request)."""

    def __init__(self, cache, page_bytes, blocks):
        self.tiers = kv.GroupTiers(cache, host_blocks=blocks)
        self.memory = torch.zeros(blocks * page_bytes, dtype=torch.uint8)
        self.page = page_bytes
        self.onboarded = self.offloaded = 0  # pages
        self.hit_tokens = 0  # prompt tokens served from host memory

    def admit(self, cache, device, prompt, max_new):
        """(seq, tokens it holds, tokens the device served) when host memory
        holds more of `prompt` than the device's prefix cache, else None. The
        import promises the request's lifetime (`max_new` tokens past the
        prompt); kv.OutOfBlocks when it does not fit, nothing changed. An
        onboard that cannot be planned aborts the import: the sequence holds
        the device's hit, and the rest is computed."""
        arr = np.asarray(prompt, dtype=np.int32)
        device_tokens, tokens, _, _ = self.tiers.lookup(arr)
        if tokens <= device_tokens:
            return None
        import_id, _, _ = cache.import_prompt(arr[:tokens], max_new=len(arr) - tokens + max_new)
        try:
            job = self.tiers.plan_onboard(import_id)
        except kv.Error:
            seq, held, _ = cache.abort_import(import_id)
            return seq, held, device_tokens
        copy_pages(device, self.memory, self.page, job.moves)
        seq, committed, held = self.tiers.complete_onboard(job.id)
        self.onboarded += len(job.moves)
        if committed:
            self.hit_tokens += held - device_tokens
        return seq, held, device_tokens

    def finish(self, cache, device, seq, tokens):
        """Frees seq after offloading what a continuation of `tokens` (its
        written tokens) can hit; all or nothing: host memory too full stores none."""
        try:
            job = self.tiers.plan_offload(seq, np.asarray(tokens, dtype=np.int32))
        except kv.OutOfBlocks:
            job = None
        moves = np.ascontiguousarray(job.moves[:, 0]) if job is not None else np.zeros(0, np.int32)
        hold = cache.hold(moves)
        cache.free(seq)
        if job is not None:
            copy_pages(self.memory, device, self.page, job.moves)
            self.tiers.tiers.complete(job.id)
            self.offloaded += len(job.moves)
        cache.release_hold(hold)
