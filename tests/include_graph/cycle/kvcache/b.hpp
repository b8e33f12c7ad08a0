#pragma once
#include "kvcache/a.hpp"
