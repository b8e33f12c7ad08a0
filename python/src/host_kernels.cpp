// The host kernels' entry points, defined once for the module: it builds
// with KVCACHE_SEPARATE_HOST_KERNELS (python/CMakeLists.txt), so the other
// translation units do not each compile every format's vector loops.
#define KVCACHE_HOST_KERNELS_IMPLEMENTATION
#include "kvcache/kernels/host_kernels.hpp"
