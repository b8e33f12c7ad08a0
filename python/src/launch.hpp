// Runs a kernel where its tensors live: the host launcher for CPU tensors;
// for CUDA tensors (a build with the toolkit), the shape check first (a
// typed error naming the value), then the CUDA launcher (cuda/launchers.cu)
// on the caller's stream, asynchronously: nothing waits and nothing is
// allocated on the way.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "tensors.hpp"

#ifdef KVCACHE_PYTHON_CUDA
#include <cuda_runtime_api.h>

#include "launchers.hpp"
#define KVPY_CUDA(fn) (&kvgpu::fn)
#else
#define KVPY_CUDA(fn) nullptr
#endif

namespace kvpy {

#ifdef KVCACHE_PYTHON_CUDA
// A CUDA launch's stream: an int (a cudaStream_t handle), an object with
// .cuda_stream (torch.cuda.Stream), or None: torch's current stream on the
// device when torch is loaded (what torch's own kernels use), else the legacy
// default stream.
inline cudaStream_t stream_of(nb::handle stream, Device d) {
  if (stream.is_none()) {
    PyObject* torch = PyDict_GetItemString(PyImport_GetModuleDict(), "torch");  // borrowed; no import per launch
    if (!torch) return nullptr;
    stream = nb::handle(torch).attr("cuda").attr("current_stream")(d.id);
  }
  if (nb::hasattr(stream, "cuda_stream")) stream = stream.attr("cuda_stream");
  std::uintptr_t handle = 0;
  if (!nb::try_cast(stream, handle)) bad("stream", "None, an int (cudaStream_t) or a torch.cuda.Stream");
  return reinterpret_cast<cudaStream_t>(handle);
}

// The device of a launch is current while it is queued, then restored.
class DeviceGuard {
 public:
  explicit DeviceGuard(std::int32_t id) {
    if (cudaGetDevice(&prev_) == cudaSuccess && prev_ != id) set_ = cudaSetDevice(id) == cudaSuccess;
  }
  ~DeviceGuard() {
    if (set_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
  bool set_ = false;
};
#endif

// host: the _host launcher; cuda: KVPY_CUDA(name); shape: the check both launchers start with.
template <class P, class Host, class Cuda>
void launch(const char* kernel, Device d, [[maybe_unused]] nb::handle stream, const P& p, Host host,
            [[maybe_unused]] Cuda cuda, [[maybe_unused]] kv::Status (*shape)(const P&) noexcept) {
  if (!d.cuda()) {
    if (!stream.is_none()) bad("stream", "None for CPU tensors");
    check(host(p));
    return;
  }
  if constexpr (!std::is_null_pointer_v<Cuda>) {
#ifdef KVCACHE_PYTHON_CUDA
    check(shape(p));
    const cudaStream_t s = stream_of(stream, d);
    DeviceGuard guard(d.id);
    if (const cudaError_t e = cuda(p, s); e != cudaSuccess)
      throw std::runtime_error(std::string("kvcache.") + kernel + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
#endif
  } else {
    bad(kernel, "given CPU tensors (this build of kvcache has the host kernels only)");
  }
}

}  // namespace kvpy
