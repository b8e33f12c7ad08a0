"""KIVI's residual for the example engine (examples/engine/channel_kv.hpp's
twin): a channel-scaled pool's open blocks kept in full precision."""
import numpy as np
import torch

import kvcache as kv


class ChannelResidual:
    """KIVI's residual (examples/engine/channel_kv.hpp, step for step): a
    channel-scaled pool's open blocks in full precision. A layer's full blocks
    are sealed (kv.seal_blocks) when that layer next writes, so the step that
    fills a block still reads it exact; reads take unsealed blocks' rows from
    here; a token policy's compaction seals again the blocks a move wrote into."""

    def __init__(self, pool, layers, block, heads, head_dim):
        self.pool, self.L, self.B, self.H = pool, layers, block, heads
        self.shape = (layers, block, heads, head_dim)
        self.open = {}  # block -> [k, v, sealed per layer, layers unsealed]
        self.pending = [[] for _ in range(layers)]  # [layer]: full, not sealed

    def _open(self, b):
        if b not in self.open:
            self.open[b] = [torch.zeros(self.shape), torch.zeros(self.shape), [False] * self.L, self.L]
        return self.open[b]

    def _seal(self, b, k, v, first_layer):
        kv.seal_blocks(self.pool, k, v, np.array([b], dtype=np.int32), first_layer=first_layer)

    def write(self, layer, slots, k, v):
        for b in self.pending[layer]:  # filled by an earlier step: sealed in this layer now
            o = self.open[b]
            self._seal(b, o[0][layer], o[1][layer], layer)
            o[2][layer], o[3] = True, o[3] - 1
            if o[3] == 0:
                del self.open[b]
        self.pending[layer] = []
        for i, slot in enumerate(np.asarray(slots).tolist()):
            b, at = divmod(slot, self.B)
            o = self._open(b)
            o[0][layer, at], o[1][layer, at] = k[i], v[i]
            if at == self.B - 1:
                self.pending[layer].append(b)

    def overlay(self, layer, blocks, rows, k, v):
        for j, b in enumerate(np.asarray(blocks).tolist()):
            o = self.open.get(b)
            n = min(self.B, rows - j * self.B)
            if o is None or o[2][layer] or n <= 0:
                continue
            k[j * self.B:j * self.B + n], v[j * self.B:j * self.B + n] = o[0][layer, :n], o[1][layer, :n]

    def drop(self, b):
        self.open.pop(b, None)
        self.pending = [[x for x in p if x != b] for p in self.pending]

    def compact(self, before, rows_before, after, rows_after, moves):
        """moves: (moves [n, 2] as (src, dst) slots, first_layer, layers, first_head, heads (0: all)) per group."""
        L, B = self.L, self.B
        k = torch.empty((L, rows_before) + self.shape[2:])
        v = torch.empty_like(k)
        for layer in range(L):
            kv.gather(self.pool, layer, np.array([0, len(before)], dtype=np.int32), np.asarray(before, dtype=np.int32),
                      np.array([0, rows_before], dtype=np.int32), k[layer], v[layer])
            self.overlay(layer, before, rows_before, k[layer], v[layer])
        logical = {b: j for j, b in enumerate(np.asarray(before).tolist())}
        dirty = [False] * len(after)
        for mv, first_layer, layers, head, heads in moves:
            heads = heads or self.H
            for src, dst in np.asarray(mv).tolist():
                s, d = logical[src // B] * B + src % B, logical[dst // B] * B + dst % B
                dirty[d // B] = True
                for x in (k, v):
                    x[first_layer:first_layer + layers, d, head:head + heads] = x[first_layer:first_layer + layers, s, head:head + heads]
        after = np.asarray(after).tolist()
        was_open = [b in self.open for b in after]
        for b in np.asarray(before).tolist():
            self.drop(b)
        for j, b in enumerate(after):
            first = j * B
            if first + B <= rows_after:
                if dirty[j] or was_open[j]:
                    self._seal(b, k[:, first:first + B], v[:, first:first + B], 0)
                continue
            o = self._open(b)  # the new last block, partial: back to the residual
            n = min(B, rows_before - first)
            o[0][:, :n], o[1][:, :n] = k[:, first:first + n], v[:, first:first + n]
