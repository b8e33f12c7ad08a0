// The host kernels' entry points, defined once for every test program that
// links kvcache_test_kernels (tests/CMakeLists.txt), which builds them with
// KVCACHE_SEPARATE_HOST_KERNELS. The translation unit is docs/install.md's
// snippet itself, so the page's two lines are what every test links.
#include "snippets/host_kernels_unit.inc"
