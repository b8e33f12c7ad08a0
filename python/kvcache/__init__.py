"""kvcache: the KV-cache manager of transformer inference engines, from Python.

The same headers as the C++ library, compiled once per supported combination
of admission (all, or Write-Gated KV), selection (all, or Quest) and eviction.
Sequence handles are ints; slot mappings, block tables, CSR pages and
compaction moves are written into the int32 arrays you pass (numpy or torch
CPU tensors, no copy), or returned as new numpy arrays when you pass none.
Errors raise kvcache.Error subclasses whose message names the bad value;
a failed call changes nothing. Kernels take CPU tensors, or CUDA tensors and
a stream in a build with the CUDA launchers (has_cuda); kvcache.torch_ops
registers the per-step kernels as torch.library custom ops.
"""

from . import _kvcache
from ._errors import (
    BY_CODE as _BY_CODE,
    AlreadyHashed,
    BlocksInUse,
    BufferTooSmall,
    CapacityExceeded,
    DuplicateSequence,
    Error,
    GeometryOverflow,
    InvalidArgument,
    InvariantViolated,
    LayoutMismatch,
    TransferFailed,
    NotAllocated,
    OutOfBlocks,
    PrefixTooLong,
    TruncateTooMany,
    UnknownJob,
    UnknownSequence,
)
from ._kvcache import (
    Admitted,
    AverageAttention,
    BlockPool,
    BlockScores,
    DiskLayout,
    DType,
    EventReplay,
    EvictionResult,
    GateWriteInfo,
    Geometry,
    H2O,
    KeepAll,
    KvFormat,
    KvPlanes,
    LayerGroup,
    LayerGroups,
    Layout,
    LayoutHandshake,
    Quest,
    Scales,
    SideFormat,
    SinkWindow,
    SlidingWindow,
    SnapKV,
    TierJob,
    Tiers,
    Tova,
    TransferHolds,
    TransferPlanner,
    WriteGate,
    WriteGateWeights,
    WritePolicy,
    block_copy,
    check_compatible,
    code_max,
    compaction,
    gather,
    has_cuda,
    layout_digest,
    make_rope_table,
    page_bounds,
    page_bounds_update,
    page_select,
    page_select_scratch_bytes,
    ring_admit,
    ring_write,
    rope,
    scatter,
    seal_blocks,
    scores,
    sequence_frame,
    write_gate,
)

_kvcache._set_error_classes(_BY_CODE)


class PoolView(_kvcache.PoolView):
    """A pool over the engine's memory: ``PoolView(geometry, memory, num_blocks)``,
    ``memory`` any C-contiguous CPU or CUDA tensor of at least
    ``geometry.pool_bytes(num_blocks)`` bytes (kept alive by the view)."""

    __slots__ = ()

    def __init__(self, geometry, memory, num_blocks):
        try:
            super().__init__(geometry, memory, num_blocks)
        except TypeError:  # a tensor where no kernel runs (torch's meta): named, not a signature dump
            device = getattr(getattr(memory, "device", None), "type", None)
            if isinstance(device, str) and device not in ("cpu", "cuda"):
                raise InvalidArgument(
                    f"invalid_argument: memory must be a CPU or CUDA tensor, not one on '{device}'") from None
            raise

    @staticmethod
    def of_group(groups, group, memory, num_blocks, planes="kv"):
        """Group ``group``'s view of a hybrid pool (``groups.page_bytes`` x
        ``num_blocks`` bytes of ``memory``) for the kernels. ``planes``:
        ``"kv"`` (K and V of one head dim), ``"k"`` (MLA's latent, or K where V
        differs), ``"v"``; a one-plane view reads and writes only a kernel's K
        side (pass the V rows as ``k``)."""
        return _kvcache._group_view(groups, group, memory, num_blocks, planes)
__version__ = _kvcache.__version__

_EVICTIONS = {KeepAll: "KeepAll", SlidingWindow: "SlidingWindow", SinkWindow: "SinkWindow",
              BlockScores: "BlockScores", H2O: "H2O", Tova: "Tova", SnapKV: "SnapKV",
              AverageAttention: "AverageAttention"}
# What Write-Gated KV composes with, and why the rest does not (the C++ static_asserts' reasons).
_GATED_REJECTS = {
    SlidingWindow: "the ring already is the local window, and dropping a head row's front would drop the ring",
    SinkWindow: "block policies re-rotate kept blocks by their shift in the row; a global region holds scattered "
                "admitted positions",
    BlockScores: "block policies re-rotate kept blocks by their shift in the row; a global region holds scattered "
                 "admitted positions",
}


def _bad(name, value, why):
    return InvalidArgument(f"invalid_argument: {name}={value} ({why})")


def Cache(geometry, num_blocks, max_sequences=256, max_blocks_per_sequence=None, eviction=None,
          event_capacity=0, publish_on_reserve=False, admission=None, selection=None, bounds=None):
    """A cache over ``num_blocks`` blocks (block 0 is the null block): admission,
    selection and eviction composed, as ``kvcache::Cache<BlockPool, PageTable,
    Admission, Selection, Eviction>``.

    ``eviction``: a policy object (default ``KeepAll()``). ``admission``:
    ``None`` (every token is written) or ``WriteGate(...)``: head-paged, one
    row per (sequence, layer, kv-head) over single-head blocks (``geometry``
    has one layer and one kv-head), with ``write``/``write_batch`` in place of
    ``reserve``. ``selection``: ``None`` or ``Quest(...)``; its bounds store is
    ``bounds`` (a C-contiguous float32 CPU array of
    ``Quest.bounds_floats(geometry, num_blocks)`` floats) or a new numpy
    array, kept alive by the cache and seen through ``page_bounds(layer)``.
    ``max_blocks_per_sequence`` (one row: a sequence, or one head under
    WriteGate) defaults to ``num_blocks - 1``. The object is the compiled
    cache of that combination: every method is one call into C++.
    """
    eviction = KeepAll() if eviction is None else eviction
    ev = _EVICTIONS.get(type(eviction))
    if ev is None:
        raise _bad("eviction", type(eviction).__name__, "one of " + ", ".join(t.__name__ for t in _EVICTIONS))
    if admission is not None and not isinstance(admission, WriteGate):
        raise _bad("admission", type(admission).__name__, "None or WriteGate")
    if selection is not None and not isinstance(selection, Quest):
        raise _bad("selection", type(selection).__name__, "None or Quest")
    if admission is not None and type(eviction) in _GATED_REJECTS:
        raise _bad("eviction", ev, "does not compose with WriteGate: " + _GATED_REJECTS[type(eviction)])
    if bounds is not None and selection is None:
        raise _bad("bounds", "given", "only a Quest cache has a bounds store")
    if max_blocks_per_sequence is None:
        max_blocks_per_sequence = max(num_blocks - 1, 1)
    name = "Cache_" + ("WriteGate_" if admission is not None else "") + ("Quest_" if selection is not None else "") + ev
    cls = getattr(_kvcache, name)
    extra = ()
    if selection is not None:
        if bounds is None:
            import numpy
            bounds = numpy.zeros(Quest.bounds_floats(geometry, num_blocks), dtype=numpy.float32)
        extra = (selection, bounds)
    if admission is not None:
        return cls(geometry, num_blocks, max_sequences, max_blocks_per_sequence, admission, eviction, *extra)
    return cls(geometry, num_blocks, max_sequences, max_blocks_per_sequence, event_capacity, publish_on_reserve,
               eviction, *extra)


def HybridCache(groups, num_blocks, max_sequences, max_tokens, prefill_chunk=0, prefix_caching=True, event_capacity=0,
                selection=None, bounds=None, eviction=None):
    """Layer groups over one pool (``kvcache::HybridCache<FastBlockHasher,
    Selection>``): each group's rows follow its kind (full, sliding window,
    chunked, MLA, cross). ``selection``: ``None`` or ``Quest(...)``, which acts
    on the global layers (the full and MLA groups'; the window and chunked
    groups keep their own retention); its bounds store is ``bounds`` (a
    C-contiguous float32 CPU array of ``Quest.bounds_floats(
    groups.global_geometry(), num_blocks)`` floats) or a new numpy array,
    kept alive by the cache and seen through ``page_bounds(layer)`` for a
    global layer. ``eviction``: ``None`` or a block policy, ``SinkWindow(...)``
    or ``BlockScores(...)``, which acts on the global layers too (a copy bound
    to each group's block size; ``evict(seq)``, and ``observe(seq, group,
    scores)`` for block scores), alone or beside Quest (which then ranks the
    pages the policy kept). The object is the compiled cache of that
    combination.
    """
    if selection is not None and not isinstance(selection, Quest):
        raise _bad("selection", type(selection).__name__, "None or Quest")
    if bounds is not None and selection is None:
        raise _bad("bounds", "given", "only a Quest cache has a bounds store")
    if eviction is not None and not isinstance(eviction, KeepAll):
        if type(eviction) not in (SinkWindow, BlockScores):
            raise _bad("eviction", type(eviction).__name__,
                       "None, KeepAll, SinkWindow or BlockScores: a hybrid's global rows drop whole blocks; token and "
                       "window policies compact or shift a row of consecutive positions")
        if selection is None:
            cls = getattr(_kvcache, "HybridCache_" + _EVICTIONS[type(eviction)])
            return cls(groups, num_blocks, max_sequences, max_tokens, prefill_chunk, prefix_caching, event_capacity, eviction)
        if bounds is None:
            import numpy
            bounds = numpy.zeros(Quest.bounds_floats(groups.global_geometry(), num_blocks), dtype=numpy.float32)
        cls = getattr(_kvcache, "HybridCache_Quest_" + _EVICTIONS[type(eviction)])
        return cls(groups, num_blocks, max_sequences, max_tokens, prefill_chunk, prefix_caching, event_capacity, selection,
                   bounds, eviction)
    if selection is None:
        return _kvcache.HybridCache(groups, num_blocks, max_sequences, max_tokens, prefill_chunk, prefix_caching,
                                    event_capacity)
    if bounds is None:
        import numpy
        bounds = numpy.zeros(Quest.bounds_floats(groups.global_geometry(), num_blocks), dtype=numpy.float32)
    return _kvcache.HybridCache_Quest(groups, num_blocks, max_sequences, max_tokens, prefill_chunk, prefix_caching,
                                      event_capacity, selection, bounds)


def GroupTiers(cache, host_blocks=0, disk_blocks=0, max_jobs=1024, event_capacity=0):
    """A hybrid cache's groups in host and disk tiers
    (``kvcache::GroupTiers<HybridCache<...>>``): lookups keyed by (hash,
    group), offloads of what a continuation can hit, onboarding through an
    import. ``cache`` is any compiled hybrid cache (with
    ``selection=Quest(...)`` an onboarded page of a global layer is listed
    by ``stale_pages`` until its bounds are computed; with an eviction
    policy, a sequence that evicted offloads only what it published before);
    the object is the compiled tiers of that cache, which it keeps alive."""
    for cls in ("Quest_SinkWindow", "Quest_BlockScores", "Quest", "SinkWindow", "BlockScores"):
        if isinstance(cache, getattr(_kvcache, "HybridCache_" + cls)):
            return getattr(_kvcache, "GroupTiers_" + cls)(cache, host_blocks, disk_blocks, max_jobs, event_capacity)
    if isinstance(cache, _kvcache.HybridCache):
        return _kvcache.GroupTiers(cache, host_blocks, disk_blocks, max_jobs, event_capacity)
    raise _bad("cache", type(cache).__name__, "a HybridCache")


__all__ = [
    "Admitted", "AlreadyHashed", "AverageAttention", "BlockPool", "BlockScores", "BlocksInUse", "BufferTooSmall", "Cache",
    "CapacityExceeded", "DiskLayout", "DType", "DuplicateSequence", "Error", "EventReplay", "EvictionResult", "GateWriteInfo", "Geometry",
    "GeometryOverflow", "GroupTiers", "H2O", "HybridCache", "InvalidArgument", "InvariantViolated", "KeepAll", "KvFormat", "KvPlanes",
    "LayerGroup", "LayerGroups", "Layout", "LayoutHandshake", "LayoutMismatch", "TransferFailed",
    "NotAllocated", "OutOfBlocks", "PoolView", "PrefixTooLong", "Quest", "Scales", "SideFormat", "SinkWindow", "SlidingWindow", "SnapKV", "TierJob", "Tiers", "Tova",
    "TransferHolds", "TransferPlanner",
    "TruncateTooMany", "UnknownJob", "UnknownSequence", "block_copy", "check_compatible", "code_max", "compaction", "gather", "has_cuda", "layout_digest", "make_rope_table", "rope",
    "scatter", "scores", "seal_blocks", "WriteGate", "WriteGateWeights", "WritePolicy", "page_bounds", "page_bounds_update", "page_select",
    "page_select_scratch_bytes", "ring_admit", "ring_write", "sequence_frame", "write_gate",
]
