#pragma once
#include "kvcache/old.hpp"
