#pragma once
#include "kvcache/eviction/policy.hpp"
