// The generated translation units (one per public header, or one for them
// all: KVCACHE_HEADERS_ALONE=OFF) are compiled into this binary; it only
// reports how many headers were checked.
#include <cstdio>
#include <cstdlib>
#include <cstring>

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 0;
  const bool together = argc > 2 && std::strcmp(argv[2], "together") == 0;
  std::printf(together ? "%d public headers compiled in one unit\n" : "%d public headers compiled on their own\n", n);
  return n > 0 ? 0 : 1;
}
