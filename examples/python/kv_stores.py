"""What the example engine's forward pass reads and writes for one request:
PagedKv over a token-paged pool (kv.Cache), HybridKv over a hybrid pool's
groups (kv.HybridCache), and the engine-held scales both pass the kernels."""
import numpy as np
import torch

import kvcache as kv


def held_scales(e, layer, streams):
    """scatter's and gather's k_scales / v_scales for model layer `layer` of
    engine e (the kernels index them by pool layer: with one stream per layer
    the pool has one, so that layer's row alone); none when e holds none
    (other formats, and the engines built on PagedKv that store f32)."""
    scales = getattr(e, "scales", None)
    if scales is None:
        return {}
    k, v = scales
    return {"k_scales": k if streams == 1 else k[layer:layer + 1], "v_scales": v if streams == 1 else v[layer:layer + 1]}


class PagedKv:
    """One request's view of the pool for one forward call: write() scatters
    the chunk's K/V to its slots, read() gathers what the request holds back
    through the exported CSR page table, with each row's token position."""

    def __init__(self, eng, r, slots, first_pos):
        self.e, self.r, self.slots, self.first = eng, r, slots, first_pos
        self.mapped = self.gathered = -1

    def _stream(self, layer):
        return 0 if len(self.r.seqs) == 1 else layer

    def _pool_layer(self, layer):
        return layer if len(self.r.seqs) == 1 else 0

    def write(self, layer, k, v):
        e, s = self.e, self._stream(layer)
        slots = self.slots[s]
        if getattr(e, "residual", None):  # a KIVI pool (engines that share this store have none)
            e.residual.write(self._pool_layer(layer), slots, k, v)
        else:
            kv.scatter(e.pool, k, v, slots, first_layer=self._pool_layer(layer), **held_scales(e, layer, len(self.r.seqs)))
        if getattr(e, "quest", None):  # the written pages' key bounds, which Quest ranks them by
            kv.page_bounds_update(e.pool, layer, slots, e.cache.page_bounds(layer))
        if layer == 0 or len(self.r.seqs) > 1:  # one position table per group (all groups see the same write)
            e.positions[:, torch.from_numpy(slots).long()] = torch.arange(self.first, self.first + len(slots))
            self.mapped = -1
        self.gathered = -1

    def _map(self, s):
        e, seq = self.e, self.r.seqs[s]
        _, self.indices, _, _ = e.cache.export_csr(np.array([seq], dtype=np.uint64), e.indptr, None, e.last)
        B = e.cfg.block_size
        self.front = e.cache.front(seq)  # a sliding window's dead front slots
        self.held = e.cache.tokens_held(seq)
        j = torch.arange(self.front, self.front + self.held)
        pool_slot = torch.from_numpy(self.indices).long()[j // B] * B + j % B
        self.pos = e.positions[:, pool_slot]  # [groups, held]
        self.mapped = s

    def read(self, layer):
        e = self.e
        if self.mapped != self._stream(layer):
            self._map(self._stream(layer))
        if self.gathered != layer:
            rows = self.front + self.held
            self.k = torch.empty(rows, e.heads, e.head_dim)
            self.v = torch.empty_like(self.k)
            kv.gather(e.pool, self._pool_layer(layer), e.indptr, self.indices, np.array([0, rows], dtype=np.int32),
                      self.k, self.v, **held_scales(e, layer, len(self.r.seqs)))
            if getattr(e, "residual", None):
                e.residual.overlay(self._pool_layer(layer), self.indices, rows, self.k, self.v)
            self.gathered = layer
        keys = self.k[self.front:].transpose(0, 1)  # [kv_heads, held, head_dim], past the dead front
        values = self.v[self.front:].transpose(0, 1)
        groups = [e.group_of(layer, h) for h in range(e.heads)]
        return keys, values, self.pos[groups]

    def select(self, layer, q, key_pos):
        """Quest: a decoded query's kv-heads read only the pages the cache
        selects for it; the others' rows are masked as if in the future.
        Prefill chunks read everything (Quest selects for decoding)."""
        e = self.e
        if not getattr(e, "quest", None) or q.shape[0] != 1:
            return key_pos
        rep = q.shape[1] // e.heads
        queries = q.reshape(1, e.heads, rep, e.head_dim).contiguous().numpy()
        indptr, picked, _ = e.cache.select(np.array(self.r.seqs, dtype=np.uint64), layer, queries)
        B = e.cfg.block_size
        row_block = torch.from_numpy(self.indices).long()[torch.arange(self.front, self.front + self.held) // B]
        hidden = key_pos.clone()
        for h in range(e.heads):
            keep = torch.from_numpy(picked[indptr[h]:indptr[h + 1]]).long()
            hidden[h, ~torch.isin(row_block, keep)] = torch.iinfo(torch.long).max
        return hidden


class HybridKv:
    """One request's view of a hybrid pool (hybrid_backend.hpp's HybridKv): each
    layer is written through its group's view at the group's slots and read
    back through the group's CSR over its live blocks; a window group's layers
    mask keys W or more behind the query. With Quest, a decoded query of a
    global (full-attention) layer reads only the pages the cache selects."""

    def __init__(self, eng, r, slots):
        self.e, self.seq, self.slots = eng, r.seqs[0], slots
        self.rows_block = None  # the last read's blocks, one per row (what select masks by)

    def window(self, layer):
        return self.e.group_window[self.e.groups.layer_slot(layer)[0]]

    def write(self, layer, k, v):
        e = self.e
        g, index = e.groups.layer_slot(layer)
        kv.scatter(e.views[g], k, v, self.slots[g], first_layer=index, **e.group_scales[g])
        if e.quest and e.group_window[g] == 0:  # a global layer's written pages: their key bounds, which Quest ranks
            kv.page_bounds_update(e.views[g], index, self.slots[g], e.cache.page_bounds(layer))

    def select(self, layer, q, key_pos):
        """Quest on a global layer's decoded query: each kv-head reads only the
        pages the cache selects; the rest of its rows are masked as if in the
        future. Window layers and prefill chunks read what they hold."""
        e = self.e
        if not e.quest or q.shape[0] != 1 or self.window(layer) > 0:
            return key_pos
        rep = q.shape[1] // e.heads
        queries = q.reshape(1, e.heads, rep, e.head_dim).contiguous().numpy()
        indptr, picked, _ = e.cache.select(np.array([self.seq], dtype=np.uint64), layer, queries)
        hidden = key_pos.clone()
        for h in range(e.heads):
            keep = torch.from_numpy(picked[indptr[h]:indptr[h + 1]]).long()
            hidden[h, ~torch.isin(self.rows_block, keep)] = torch.iinfo(torch.long).max
        return hidden

    def read(self, layer):
        e = self.e
        g, index = e.groups.layer_slot(layer)
        seqs = np.array([self.seq], dtype=np.uint64)
        indptr, indices, first_pos, _ = e.cache.export_group_csr(g, seqs)
        rows = e.cache.tokens(self.seq) - int(first_pos[0])
        k = torch.empty(rows, e.heads, e.head_dim)
        v = torch.empty_like(k)
        kv.gather(e.views[g], index, indptr, indices, np.array([0, rows], dtype=np.int32), k, v, **e.group_scales[g])
        B = e.groups.block_size(g)  # row j is position first_pos + j, slot j of the CSR's pages
        self.rows_block = torch.from_numpy(indices).long()[torch.arange(rows) // B]
        pos = torch.arange(int(first_pos[0]), int(first_pos[0]) + rows).expand(e.heads, rows)
        return k.transpose(0, 1), v.transpose(0, 1), pos
