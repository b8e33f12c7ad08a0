// The generated translation units (one per public header) are compiled into
// this binary; it only reports how many headers were checked.
#include <cstdio>
#include <cstdlib>

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 0;
  std::printf("%d public headers compiled on their own\n", n);
  return n > 0 ? 0 : 1;
}
