// kvcache: forwarding header. old.hpp moved to core/y.hpp.
#pragma once
#include "kvcache/core/y.hpp"
