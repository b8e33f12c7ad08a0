// Compiled with KVCACHE_SEPARATE_HOST_KERNELS by test_host_kernels_late_define:
// the implementation macro defined after another kvcache header comes too
// late (that header declared the entry points already), and host_kernels.hpp
// must stop the build instead of leaving every entry point undefined.
#include <kvcache/kernels/seal.hpp>
#define KVCACHE_HOST_KERNELS_IMPLEMENTATION
#include <kvcache/kernels/host_kernels.hpp>
