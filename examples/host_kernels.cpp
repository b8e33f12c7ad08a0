// The host kernels' entry points, defined once for every example program:
// they link kvcache_example_kernels (examples/CMakeLists.txt), which builds
// them with KVCACHE_SEPARATE_HOST_KERNELS, as docs/install.md describes.
#define KVCACHE_HOST_KERNELS_IMPLEMENTATION
#include <kvcache/kernels/host_kernels.hpp>
