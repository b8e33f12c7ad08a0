"""The per-step kernels as torch.library custom ops, for torch.compile.

``import kvcache.torch_ops`` registers ``torch.ops.kvcache.scatter``,
``gather``, ``block_copy``, ``compaction``, ``ring_write`` and
``page_bounds_update``: each mutates the tensors it writes (declared to
torch, so the compiler orders them) and returns nothing, so a compiled
decode step keeps them in its graph instead of breaking around an opaque
call. The wrappers here take the pool as ``ops.Pool`` (plain values the
compiler can trace: the memory tensor, the geometry as ints, the block
count), made once from a ``kv.PoolView`` outside the compiled code::

    import kvcache.torch_ops as ops
    pool = ops.Pool.of(kv.PoolView(geometry, memory, num_blocks))
    ops.scatter(pool, k, v, slots)      # torch.ops.kvcache.scatter under the hood

They run the same launchers: host for CPU tensors, CUDA on torch's current
stream for CUDA tensors (so they are captured into CUDA graphs too). Needs
torch >= 2.4 (``torch.library.custom_op``).
"""
from typing import NamedTuple, Optional

import torch

from . import PoolView, _kvcache

if not hasattr(torch.library, "custom_op"):
    raise ImportError(f"kvcache.torch_ops needs torch >= 2.4 (torch.library.custom_op); this is torch {torch.__version__}")

class Pool(NamedTuple):
    """A kv.PoolView as the ops take it: plain values, so torch.compile traces the calls."""

    memory: torch.Tensor
    spec: tuple  # the geometry: layers, kv-heads, head_dim, block size, dtype, layout, planes
    num_blocks: int

    @staticmethod
    def of(view):
        g = view.geometry
        spec = (g.num_layers, g.num_kv_heads, g.head_dim, g.block_size, g.dtype.value, g.layout.value, g.planes.value)
        return Pool(view.memory, spec, view.num_blocks)


def _pool(memory, spec, num_blocks):
    """The pool back from an op's arguments (a view: a few checks, no copy)."""
    L, H, D, B, dtype, layout, planes = spec
    geometry = _kvcache.Geometry(L, H, D, B, _kvcache.DType(dtype), _kvcache.Layout(layout), _kvcache.KvPlanes(planes))
    return PoolView(geometry, memory, num_blocks)


@torch.library.custom_op("kvcache::scatter", mutates_args=("memory",))
def _scatter(memory: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, spec: list[int],
             num_blocks: int, first_layer: int, k_scale: float, v_scale: float) -> None:
    _kvcache.scatter(_pool(memory, spec, num_blocks), k, v, slots, first_layer, k_scale, v_scale)


@torch.library.custom_op("kvcache::gather", mutates_args=("k_out", "v_out"))
def _gather(memory: torch.Tensor, spec: list[int], num_blocks: int, layer: int, indptr: torch.Tensor,
            indices: torch.Tensor, out_indptr: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor,
            k_scale: float, v_scale: float) -> None:
    _kvcache.gather(_pool(memory, spec, num_blocks), layer, indptr, indices, out_indptr, k_out, v_out, k_scale, v_scale)


@torch.library.custom_op("kvcache::block_copy", mutates_args=("memory",))
def _block_copy(memory: torch.Tensor, spec: list[int], num_blocks: int, pairs: torch.Tensor) -> None:
    pool = _pool(memory, spec, num_blocks)
    _kvcache.block_copy(pool, pool, pairs)


@torch.library.custom_op("kvcache::compaction", mutates_args=("memory",))
def _compaction(memory: torch.Tensor, spec: list[int], num_blocks: int, moves: torch.Tensor, first_layer: int,
                num_layers: int, first_head: int, num_heads: int) -> None:
    _kvcache.compaction(_pool(memory, spec, num_blocks), moves, first_layer, num_layers, first_head, num_heads)


@torch.library.custom_op("kvcache::ring_write", mutates_args=("memory",))
def _ring_write(memory: torch.Tensor, spec: list[int], num_blocks: int, k: torch.Tensor, v: torch.Tensor,
                ring_slots: torch.Tensor, promote_slots: Optional[torch.Tensor], first_layer: int) -> None:
    _kvcache.ring_write(_pool(memory, spec, num_blocks), k, v, ring_slots, promote_slots, first_layer)


@torch.library.custom_op("kvcache::page_bounds_update", mutates_args=("bounds",))
def _page_bounds_update(memory: torch.Tensor, spec: list[int], num_blocks: int, layer: int, slots: torch.Tensor,
                        bounds: torch.Tensor) -> None:
    _kvcache.page_bounds_update(_pool(memory, spec, num_blocks), layer, slots, bounds)


# Shapes do not change (every op writes in place), so the fake kernels only say "nothing returned".
for _op in (_scatter, _gather, _block_copy, _compaction, _ring_write, _page_bounds_update):
    _op.register_fake(lambda *args, **kwargs: None)


def scatter(pool, k, v, slots, first_layer=0, k_scale=1.0, v_scale=1.0):
    torch.ops.kvcache.scatter(pool.memory, k, v, slots, list(pool.spec), pool.num_blocks, first_layer, k_scale, v_scale)


def gather(pool, layer, indptr, indices, out_indptr, k_out, v_out, k_scale=1.0, v_scale=1.0):
    torch.ops.kvcache.gather(pool.memory, list(pool.spec), pool.num_blocks, layer, indptr, indices, out_indptr, k_out, v_out,
                             k_scale, v_scale)


def block_copy(pool, pairs):
    """Copies within one pool (src and dst are the same memory, as a copy-on-write is)."""
    torch.ops.kvcache.block_copy(pool.memory, list(pool.spec), pool.num_blocks, pairs)


def compaction(pool, moves, first_layer=0, num_layers=-1, first_head=0, num_heads=0):
    torch.ops.kvcache.compaction(pool.memory, list(pool.spec), pool.num_blocks, moves, first_layer, num_layers, first_head,
                                 num_heads)


def ring_write(pool, k, v, ring_slots, promote_slots=None, first_layer=0):
    torch.ops.kvcache.ring_write(pool.memory, list(pool.spec), pool.num_blocks, k, v, ring_slots, promote_slots, first_layer)


def page_bounds_update(pool, layer, slots, bounds):
    torch.ops.kvcache.page_bounds_update(pool.memory, list(pool.spec), pool.num_blocks, layer, slots, bounds)


__all__ = ["Pool", "scatter", "gather", "block_copy", "compaction", "ring_write", "page_bounds_update"]
