"""The kernels' CUDA path.

Without a GPU (CI): tensors that say they live on a CUDA device (DLPack
capsules made here with ctypes; their memory is never touched) go through
the CUDA dispatch up to the launch: devices are checked per tensor, shapes
before the launch (typed errors naming the value), the stream argument is
read, and the launch itself reports the missing device. A build without the
toolkit rejects them by name.

With a GPU and a CUDA build of torch: every kernel on CUDA tensors equals the
same call on CPU tensors, on a side stream, and a scatter + gather step runs
under CUDA graph capture. Skipped without one (never passed).
"""
import ctypes

import numpy as np
import pytest

import kvcache as kv

D, H, B = 8, 2, 4


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_CODES = {np.dtype(np.int32): (0, 32), np.dtype(np.uint8): (1, 8), np.dtype(np.float32): (2, 32)}


class FakeCuda:
    """A tensor that says it lives on cuda:`device` (its bytes are host memory nobody reads)."""

    def __init__(self, shape, dtype=np.float32, device=0):
        self.host = np.zeros(shape, dtype=dtype)
        self.shape, self.device = (ctypes.c_int64 * len(shape))(*shape), device
        code, bits = _CODES[np.dtype(dtype)]
        self.managed = _DLManagedTensor(_DLTensor(self.host.ctypes.data, _DLDevice(2, device), len(shape),
                                                  _DLDataType(code, bits, 1), self.shape, None, 0), None, None)

    def __dlpack__(self, stream=None, **kwargs):
        return _new_capsule(ctypes.addressof(self.managed), b"dltensor", None)

    def __dlpack_device__(self):
        return (2, self.device)


def geometry():
    return kv.Geometry(num_layers=2, num_kv_heads=H, head_dim=D, block_size=B, dtype=kv.DType.f32)


def cuda_pool(num_blocks=8):
    g = geometry()
    memory = FakeCuda((g.pool_bytes(num_blocks),), np.uint8)
    return kv.PoolView(g, memory, num_blocks), memory


@pytest.mark.skipif(kv.has_cuda, reason="this build has the CUDA launchers")
def test_a_host_only_build_names_a_cuda_tensor():
    with pytest.raises(kv.InvalidArgument, match="memory must be a CPU tensor .*host kernels only"):
        cuda_pool()


@pytest.mark.skipif(not kv.has_cuda, reason="a build without the CUDA toolkit")
def test_cuda_dispatch_checks_devices_and_shapes_before_the_launch():
    pool, _ = cuda_pool()
    assert pool.is_cuda
    k, v, slots = FakeCuda((3, H, D)), FakeCuda((3, H, D)), FakeCuda((3,), np.int32)
    # Mixed devices: the tensor on the wrong side is named.
    with pytest.raises(kv.InvalidArgument, match="slots must be on the launch's CUDA device"):
        kv.scatter(pool, k, v, np.zeros(3, dtype=np.int32), stream=0)
    with pytest.raises(kv.InvalidArgument, match="k must be on the launch's CUDA device"):
        kv.scatter(pool, np.zeros((3, H, D), dtype=np.float32), v, slots, stream=0)
    with pytest.raises(kv.InvalidArgument, match="k must be on the launch's CUDA device"):
        kv.scatter(pool, FakeCuda((3, H, D), device=1), v, slots, stream=0)  # another device
    cpu_pool = kv.PoolView(geometry(), np.zeros(geometry().pool_bytes(8), dtype=np.uint8), 8)
    with pytest.raises(kv.InvalidArgument, match="k must be a CPU tensor, as the pool is"):
        kv.scatter(cpu_pool, k, v, slots)
    with pytest.raises(kv.InvalidArgument, match="dst must be on the device of src"):
        kv.block_copy(pool, cpu_pool, np.zeros((0, 2), dtype=np.int32))
    # Shapes are checked before anything is queued: a typed error naming the value.
    with pytest.raises(kv.InvalidArgument, match="first_layer"):
        kv.scatter(pool, k, v, slots, first_layer=5, stream=0)
    with pytest.raises(kv.InvalidArgument, match="k must be contiguous in head_dim"):
        kv.scatter(pool, _transposed(), v, slots, stream=0)
    # The stream: an int, an object with .cuda_stream, or None; never for CPU tensors.
    with pytest.raises(kv.InvalidArgument, match="stream"):
        kv.scatter(pool, k, v, slots, stream="side")
    with pytest.raises(kv.InvalidArgument, match="stream must be None for CPU tensors"):
        kv.scatter(cpu_pool, np.zeros((3, H, D), np.float32), np.zeros((3, H, D), np.float32),
                   np.zeros(3, np.int32), stream=0)

    class Stream:
        cuda_stream = 0
    # A valid launch reaches the CUDA launcher; without a GPU it reports the device error.
    for stream in (0, Stream()):
        with pytest.raises(RuntimeError, match="kvcache.scatter: cuda"):
            kv.scatter(pool, k, v, slots, stream=stream)


def _transposed():
    t = FakeCuda((3, H, D))
    t.managed.dl_tensor.strides = (ctypes.c_int64 * 3)(H * D, 1, H)  # head_dim strided: not a row
    t.strides = t.managed.dl_tensor.strides
    return t


@pytest.mark.skipif(not kv.has_cuda, reason="a build without the CUDA toolkit")
def test_every_pool_kernel_dispatches_to_cuda():
    """Every other kernel reaches its CUDA launcher too (the launch fails here: no GPU)."""
    pool, _ = cuda_pool()
    i32 = lambda *s: FakeCuda(s, np.int32)  # noqa: E731
    calls = {
        "gather": lambda: kv.gather(pool, 0, i32(2), i32(1), i32(2), FakeCuda((4, H, D)), FakeCuda((4, H, D)), stream=0),
        "block_copy": lambda: kv.block_copy(pool, pool, i32(1, 2), stream=0),
        "compaction": lambda: kv.compaction(pool, i32(1, 2), stream=0),
        "rope": lambda: kv.rope(pool, i32(1), i32(1), FakeCuda((2 * D // 2,)), FakeCuda((2 * D // 2,)), 1, stream=0),
        "page_bounds": lambda: kv.page_bounds(pool, 0, i32(1), i32(1), FakeCuda((8 * H * 2 * D,)), stream=0),
        "page_bounds_update": lambda: kv.page_bounds_update(pool, 0, i32(1), FakeCuda((8 * H * 2 * D,)), stream=0),
        "ring_write": lambda: kv.ring_write(pool, FakeCuda((1, H, D)), FakeCuda((1, H, D)), i32(1), stream=0),
        "scores": lambda: kv.scores(FakeCuda((1, 1, 1, 4)), i32(1), FakeCuda((4,)), stream=0),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=f"kvcache.{name}: cuda"):
            call()
    head = kv.Geometry(num_layers=1, num_kv_heads=1, head_dim=D, block_size=B, dtype=kv.DType.f32)
    head_pool = kv.PoolView(head, FakeCuda((head.pool_bytes(16),), np.uint8), 16)
    gate = kv.Cache(head, num_blocks=16, max_sequences=1, max_blocks_per_sequence=4,
                    admission=kv.WriteGate(num_layers=1, num_kv_heads=H, local_window=B, tau=0.5))
    with pytest.raises(RuntimeError, match="kvcache.ring_admit: cuda"):
        kv.ring_admit(head_pool, FakeCuda((1, H, D)), FakeCuda((1, H, D)), FakeCuda((1, H)), gate.ring_admit_params(),
                      i32(H), i32(H), i32(H), FakeCuda((H, B), np.uint8), i32(H, 4), stream=0)
    hidden = 4
    weights = kv.WriteGateWeights(FakeCuda((D,)), FakeCuda((D,)), FakeCuda((H, 2 * D, hidden)), FakeCuda((H, hidden)),
                                  FakeCuda((H, hidden)), FakeCuda((H,)))
    with pytest.raises(kv.InvalidArgument, match="k_pre must be on the launch's CUDA device"):
        kv.write_gate(weights, np.zeros((1, H, D), np.float32), np.zeros((1, H, D), np.float32), FakeCuda((1, H)))
    with pytest.raises(RuntimeError, match="kvcache.write_gate: cuda"):
        kv.write_gate(weights, FakeCuda((1, H, D)), FakeCuda((1, H, D)), FakeCuda((1, H)), stream=0)
    with pytest.raises(kv.InvalidArgument, match="bounds must be a CPU tensor: page_select runs on the host"):
        kv.page_select(FakeCuda((8, H, 2, D)), FakeCuda((1, H, 1, D)), i32(2), i32(1), 2)


try:
    import torch
except ImportError:
    torch = None
gpu = pytest.mark.skipif(torch is None or not (kv.has_cuda and torch.cuda.is_available()),
                         reason="no GPU (or no CUDA build of torch)")


def _pools(num_blocks=16):
    g = geometry()
    cpu = torch.zeros(g.pool_bytes(num_blocks), dtype=torch.uint8)
    dev = cpu.cuda()
    return kv.PoolView(g, cpu, num_blocks), kv.PoolView(g, dev, num_blocks), cpu, dev


@gpu
def test_cuda_kernels_match_the_host_kernels():
    gen = torch.Generator().manual_seed(0)
    pc, pd, mc, md = _pools()
    k = torch.randn(6, H, D, generator=gen)
    v = torch.randn(6, H, D, generator=gen)
    slots = torch.tensor([4, 5, 6, 9, 10, 15], dtype=torch.int32)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # None: torch's current stream, here the side stream
        kv.scatter(pd, k.cuda(), v.cuda(), slots.cuda())
        kv.compaction(pd, torch.tensor([[15, 7]], dtype=torch.int32).cuda())
        kv.block_copy(pd, pd, torch.tensor([[1, 3]], dtype=torch.int32).cuda())
    kv.scatter(pc, k, v, slots)
    kv.compaction(pc, torch.tensor([[15, 7]], dtype=torch.int32))
    kv.block_copy(pc, pc, torch.tensor([[1, 3]], dtype=torch.int32))
    side.synchronize()
    assert torch.equal(md.cpu(), mc)
    indptr, indices = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([1, 2, 3], dtype=torch.int32)
    out_indptr = torch.tensor([0, 10], dtype=torch.int32)
    kc, vc = torch.zeros(10, H, D), torch.zeros(10, H, D)
    kd, vd = kc.cuda(), vc.cuda()
    kv.gather(pc, 1, indptr, indices, out_indptr, kc, vc)
    kv.gather(pd, 1, indptr.cuda(), indices.cuda(), out_indptr.cuda(), kd, vd,
              stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert torch.equal(kd.cpu(), kc) and torch.equal(vd.cpu(), vc)


@gpu
def test_a_decode_step_replays_under_cuda_graph_capture():
    _, pd, _, md = _pools()
    k, v = torch.zeros(1, H, D, device="cuda"), torch.zeros(1, H, D, device="cuda")
    slot = torch.zeros(1, dtype=torch.int32, device="cuda")
    indptr = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    indices = torch.tensor([1], dtype=torch.int32, device="cuda")
    out_indptr = torch.tensor([0, B], dtype=torch.int32, device="cuda")
    ko, vo = torch.zeros(B, H, D, device="cuda"), torch.zeros(B, H, D, device="cuda")
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        with torch.cuda.graph(graph, stream=s):  # no allocation, no sync inside: capturable
            kv.scatter(pd, k, v, slot)
            kv.gather(pd, 0, indptr, indices, out_indptr, ko, vo)
    for step in range(B):
        k.fill_(step + 1.0), v.fill_(-step - 1.0), slot.fill_(B + step)
        graph.replay()
    torch.cuda.synchronize()
    assert ko[:, 0, 0].tolist() == [1.0, 2.0, 3.0, 4.0] and vo[:, 0, 0].tolist() == [-1.0, -2.0, -3.0, -4.0]
