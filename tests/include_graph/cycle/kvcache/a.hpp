#pragma once
#include "kvcache/b.hpp"
