"""What the example engine's decoded queries read under Quest: the test
helper both engine test files use."""
import torch


def count_reads(monkeypatch, store):
    """Patches store.select (PagedKv or HybridKv) to record each decoded query's
    (layer, keys each kv-head reads, keys held); returns the list it fills."""
    reads = []
    select = store.select

    def counting(self, layer, q, key_pos):
        out = select(self, layer, q, key_pos)
        if q.shape[0] == 1:
            reads.append((layer, (out < torch.iinfo(torch.long).max).sum(1).tolist(), key_pos.shape[1]))
        return out

    monkeypatch.setattr(store, "select", counting)
    return reads
