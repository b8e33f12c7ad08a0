"""kvcache: the KV-cache manager of transformer inference engines, from Python.

The same headers as the C++ library, compiled once per eviction policy.
Sequence handles are ints; slot mappings, block tables, CSR pages and
compaction moves are written into the int32 arrays you pass (numpy or torch
CPU tensors, no copy), or returned as new numpy arrays when you pass none.
Errors raise kvcache.Error subclasses whose message names the bad value;
a failed call changes nothing.
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
    NotAllocated,
    OutOfBlocks,
    PrefixTooLong,
    TruncateTooMany,
    UnknownSequence,
)
from ._kvcache import (
    AverageAttention,
    BlockScores,
    DType,
    EvictionResult,
    Geometry,
    H2O,
    KeepAll,
    KvPlanes,
    Layout,
    PoolView,
    SinkWindow,
    SlidingWindow,
    SnapKV,
    Tova,
    WriteGateWeights,
    block_copy,
    compaction,
    gather,
    make_rope_table,
    page_bounds,
    page_bounds_update,
    page_select,
    page_select_scratch_bytes,
    ring_write,
    rope,
    scatter,
    scores,
    write_gate,
)

_kvcache._set_error_classes(_BY_CODE)
__version__ = _kvcache.__version__

_CACHES = {
    KeepAll: _kvcache.Cache_KeepAll,
    SlidingWindow: _kvcache.Cache_SlidingWindow,
    SinkWindow: _kvcache.Cache_SinkWindow,
    BlockScores: _kvcache.Cache_BlockScores,
    H2O: _kvcache.Cache_H2O,
    Tova: _kvcache.Cache_Tova,
    SnapKV: _kvcache.Cache_SnapKV,
    AverageAttention: _kvcache.Cache_AverageAttention,
}


def Cache(geometry, num_blocks, max_sequences=256, max_blocks_per_sequence=None, eviction=None,
          event_capacity=0, publish_on_reserve=False):
    """A cache over ``num_blocks`` blocks (block 0 is the null block) under an eviction policy.

    ``max_blocks_per_sequence`` defaults to ``num_blocks - 1``. The object is
    the compiled ``kvcache::Cache`` of the policy's type: every method is one
    call into C++.
    """
    eviction = KeepAll() if eviction is None else eviction
    try:
        cls = _CACHES[type(eviction)]
    except KeyError:
        raise InvalidArgument(f"invalid_argument: eviction={type(eviction).__name__} "
                              f"(one of {', '.join(t.__name__ for t in _CACHES)})") from None
    if max_blocks_per_sequence is None:
        max_blocks_per_sequence = max(num_blocks - 1, 1)
    return cls(geometry, num_blocks, max_sequences, max_blocks_per_sequence, event_capacity,
               publish_on_reserve, eviction)


__all__ = [
    "AlreadyHashed", "AverageAttention", "BlockScores", "BlocksInUse", "BufferTooSmall", "Cache",
    "CapacityExceeded", "DType", "DuplicateSequence", "Error", "EvictionResult", "Geometry",
    "GeometryOverflow", "H2O", "InvalidArgument", "InvariantViolated", "KeepAll", "KvPlanes", "Layout",
    "NotAllocated", "OutOfBlocks", "PoolView", "PrefixTooLong", "SinkWindow", "SlidingWindow", "SnapKV", "Tova",
    "TruncateTooMany", "UnknownSequence", "block_copy", "compaction", "gather", "make_rope_table", "rope",
    "scatter", "scores", "WriteGateWeights", "page_bounds", "page_bounds_update", "page_select",
    "page_select_scratch_bytes", "ring_write", "write_gate",
]
