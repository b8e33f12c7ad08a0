#pragma once
#include "kvcache/kernels/host/simd.hpp"
