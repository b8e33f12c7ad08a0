#pragma once
#include "kvcache/kernels/detail/body.hpp"
