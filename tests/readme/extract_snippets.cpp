// Writes every ```cpp block of the README to OUT_DIR/NAME.inc, NAME taken from
// the `<!-- snippet: NAME -->` line right before the block, so the tests that
// include them compile and run exactly what the README shows.
//   extract_snippets README.md OUT_DIR NAME...
// Fails (exit 1, naming the line) on a ```cpp block without a marker, a
// marker without a block, a repeated name, or a set of names unlike the
// expected one (every snippet is tested, every test finds its snippet).
// `<!-- snippet: python_NAME -->` markers and their ```python blocks belong to
// python/tests/test_readme.py; a ```python block without one fails here too.
#include <fstream>
#include <iostream>
#include <set>
#include <utility>
#include <string>
#include <vector>

namespace {
int fail(const std::string& why) {
  std::cerr << "extract_snippets: " << why << '\n';
  return 1;
}

bool write(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  return bool(out);
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) return fail("usage: extract_snippets README.md OUT_DIR NAME...");
  std::ifstream in(argv[1]);
  if (!in) return fail(std::string("cannot read ") + argv[1]);
  const std::set<std::string> expected(argv + 3, argv + argc);
  const std::string marker = "<!-- snippet: ", marker_end = " -->";

  std::set<std::string> found;
  std::string line, pending, body;  // pending: the marker's name, until its block opens
  std::string python_pending;       // a python_NAME marker: python/tests/test_readme.py runs its block
  bool in_block = false, in_python = false;
  for (int n = 1; std::getline(in, line); ++n) {
    const std::string where = std::string(argv[1]) + ":" + std::to_string(n) + ": ";
    if (in_python) {
      if (line.rfind("```", 0) == 0) in_python = false;
    } else if (!python_pending.empty()) {
      if (line != "```python") return fail(where + "marker '" + python_pending + "' must be followed directly by its ```python block");
      in_python = true;
      python_pending.clear();
    } else if (line == "```python") {
      return fail(where + "```python block without a `<!-- snippet: python_NAME -->` line before it");
    } else if (in_block) {
      if (line.rfind("```", 0) == 0) {
        if (!write(std::string(argv[2]) + "/" + pending + ".inc", body)) return fail(where + "cannot write " + pending);
        in_block = false;
        pending.clear();
      } else {
        body += line + '\n';
      }
    } else if (line.rfind(marker, 0) == 0) {
      if (!pending.empty()) return fail(where + "marker '" + pending + "' has no ```cpp block after it");
      if (line.size() < marker.size() + marker_end.size() || line.substr(line.size() - marker_end.size()) != marker_end)
        return fail(where + "malformed snippet marker");
      pending = line.substr(marker.size(), line.size() - marker.size() - marker_end.size());
      if (pending.rfind("python_", 0) == 0) {  // the Python tests' snippet, not a C++ one
        python_pending = std::move(pending);
        pending.clear();
        continue;
      }
      if (!found.insert(pending).second) return fail(where + "snippet '" + pending + "' appears twice");
    } else if (line == "```cpp") {
      if (pending.empty()) return fail(where + "```cpp block without a `<!-- snippet: NAME -->` line before it");
      in_block = true;
      body.clear();
    } else if (!pending.empty()) {
      return fail(where + "marker '" + pending + "' must be followed directly by its ```cpp block");
    }
  }
  if (in_block || !pending.empty()) return fail("README ends inside snippet '" + pending + "'");
  for (const auto& name : found)
    if (!expected.count(name)) return fail("snippet '" + name + "' has no test (add it to tests/readme)");
  for (const auto& name : expected)
    if (!found.count(name)) return fail("a test expects snippet '" + name + "', which the README no longer has");
  return 0;
}
