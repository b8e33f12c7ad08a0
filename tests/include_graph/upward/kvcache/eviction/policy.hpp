#pragma once
#include "kvcache/cache.hpp"  // a policy reaching up to the coordinator
#include "kvcache/selection/pages.hpp"  // and sideways into another policy folder
