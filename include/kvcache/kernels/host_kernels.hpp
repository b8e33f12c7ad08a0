// Every host kernel entry point (kernels/host/cpu.hpp), for the one translation unit
// that defines them when the program builds with
// KVCACHE_SEPARATE_HOST_KERNELS:
//   #define KVCACHE_HOST_KERNELS_IMPLEMENTATION
//   #include <kvcache/kernels/host_kernels.hpp>
// Without that macro this header is only the kernels' headers, inline.
#pragma once

#include "kvcache/kernels/host/fast_path.hpp"
#include "kvcache/kernels/seal.hpp"

// A kvcache header included before the macro was defined has declared the
// entry points already, and this translation unit would define none.
#if defined(KVCACHE_HOST_KERNELS_IMPLEMENTATION) && KVCACHE_HOST_KERNEL_DECLARED
#error "KVCACHE_HOST_KERNELS_IMPLEMENTATION must be defined before this translation unit's first kvcache include"
#endif
