"""kvcache.Error and one subclass per error code (kvcache::Errc).

Every failed call raises the class of its code with the library's message,
which names the bad value and the limit it broke
(``out_of_blocks: n_blocks=9 (limit 4)``); nothing changed.
"""


class Error(Exception):
    """A kvcache call failed; ``code`` is the error code's name."""

    code = "error"


class InvalidArgument(Error, ValueError):
    """A value outside its documented domain (negative count, bad scores, a wrong array)."""

    code = "invalid_argument"


class UnknownSequence(Error, LookupError):
    """A handle never issued, already freed, or from an older generation."""

    code = "unknown_sequence"


class OutOfBlocks(Error):
    """The pool has fewer free blocks than the call needs: preempt or wait."""

    code = "out_of_blocks"


class CapacityExceeded(Error):
    """A fixed capacity (sequences, blocks per sequence, bookkeeping) would be exceeded."""

    code = "capacity_exceeded"


class BufferTooSmall(Error, ValueError):
    """An output array cannot hold the result."""

    code = "buffer_too_small"


class TruncateTooMany(Error, ValueError):
    """Rolling back more tokens than the sequence can give back."""

    code = "truncate_too_many"


class PrefixTooLong(Error, ValueError):
    """Tokens longer than the sequence holds."""

    code = "prefix_too_long"


class GeometryOverflow(Error, OverflowError):
    """Sizes of a geometry overflow 64-bit arithmetic."""

    code = "geometry_overflow"


class NotAllocated(Error):
    """A block that is not in use."""

    code = "not_allocated"


class AlreadyHashed(Error):
    """A block's hash is write-once."""

    code = "already_hashed"


class DuplicateSequence(Error, ValueError):
    """The same sequence twice in one batch."""

    code = "duplicate_sequence"


class BlocksInUse(Error):
    """An operation that needs every block free."""

    code = "blocks_in_use"


class InvariantViolated(Error, RuntimeError):
    """check_invariants() found corrupted state: a library bug, never bad input."""

    code = "invariant_violated"


class UnknownJob(Error, LookupError):
    """A transfer job never planned, already completed, or from before a reset."""

    code = "unknown_job"


class LayoutMismatch(Error, ValueError):
    """A remote KV layout (a peer's handshake) that cannot be copied into this one: names the field."""

    code = "layout_mismatch"


class TransferFailed(Error, RuntimeError):
    """A transport (NIXL) refused or failed a call: names the call, its status as the value."""

    code = "transfer_failed"


# In kvcache::Errc order (index = the code's value; 0 is ok).
BY_CODE = [
    Error,
    InvalidArgument,
    UnknownSequence,
    OutOfBlocks,
    CapacityExceeded,
    BufferTooSmall,
    TruncateTooMany,
    PrefixTooLong,
    GeometryOverflow,
    NotAllocated,
    AlreadyHashed,
    DuplicateSequence,
    BlocksInUse,
    InvariantViolated,
    UnknownJob,
    LayoutMismatch,
    TransferFailed,
]
