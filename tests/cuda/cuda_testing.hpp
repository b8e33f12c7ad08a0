// What the CUDA tests share: device buffers, a host pool with its device
// twin, and a fresh random generator. Included by the tests of
// test_kernels_cuda only (one binary, one main).
#pragma once

#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <memory>
#include <numeric>
#include <random>

#include "../kernel_testing.hpp"

namespace kvtest {

// REQUIREs a CUDA call succeeded, naming its error.
#define CUDA_OK(expr)                                           \
  do {                                                          \
    const cudaError_t err_ = (expr);                            \
    INFO(#expr << ": " << cudaGetErrorString(err_));            \
    REQUIRE(err_ == cudaSuccess);                               \
  } while (0)


// A device copy of a host buffer; download() brings it back.
struct Dev {
  void* p = nullptr;
  std::size_t n = 0;
  template <class T>
  explicit Dev(const std::vector<T>& host) : n(host.size() * sizeof(T)) {
    REQUIRE(cudaMalloc(&p, n ? n : 1) == cudaSuccess);
    if (n) REQUIRE(cudaMemcpy(p, host.data(), n, cudaMemcpyHostToDevice) == cudaSuccess);
  }
  Dev(const Dev&) = delete;
  ~Dev() { cudaFree(p); }
  template <class T>
  T* as() const { return static_cast<T*>(p); }
  template <class T>
  std::vector<T> download() const {
    std::vector<T> out(n / sizeof(T));
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    REQUIRE(cudaMemcpy(out.data(), p, n, cudaMemcpyDeviceToHost) == cudaSuccess);
    return out;
  }
};

inline std::mt19937_64 fresh_rng() { return std::mt19937_64(Catch::rngSeed() ^ std::random_device{}()); }

// A host pool with random finite content of its dtype, and its device twin.
struct Twin {
  Pool host;
  std::unique_ptr<Dev> dev;
  kv::PoolView dview;
  Twin(std::mt19937_64& rng, const kv::GeometrySpec& g, std::int64_t blocks) : host(g, blocks) {
    host.bytes = random_elems(rng, g.dtype, std::int64_t(host.bytes.size()) / kv::dtype_bytes(g.dtype));
    host.view.base = host.bytes.data();
    dev = std::make_unique<Dev>(host.bytes);
    dview = host.view;
    dview.base = dev->p;
  }
  void require_same() { REQUIRE(dev->download<std::byte>() == host.bytes); }
};

inline std::vector<std::int32_t> shuffled(std::mt19937_64& rng, std::int64_t n) {
  std::vector<std::int32_t> v(static_cast<std::size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  std::shuffle(v.begin(), v.end(), rng);
  return v;
}

}  // namespace kvtest
