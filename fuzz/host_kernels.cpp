// The host kernels' entry points, defined once for the five targets
// (fuzz/CMakeLists.txt: KVCACHE_SEPARATE_HOST_KERNELS), compiled with their
// instrumentation, so the fuzzer sees the vector loops' branches too.
#define KVCACHE_HOST_KERNELS_IMPLEMENTATION
#include <kvcache/kernels/host_kernels.hpp>
