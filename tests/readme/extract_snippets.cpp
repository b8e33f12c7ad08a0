// Writes every ```cpp block of the README and the docs pages to
// OUT_DIR/NAME.inc, NAME taken from the `<!-- snippet: NAME -->` line right
// before the block, so the tests that include them compile and run exactly
// what the pages show.
//   extract_snippets OUT_DIR PAGE.md... -- NAME...
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

// One page: its ```cpp blocks to out_dir, their names into found.
int scan(std::istream& in, const std::string& page, const std::string& out_dir, const std::string& marker,
         const std::string& marker_end, std::set<std::string>& found) {
  std::string line, pending, body;  // pending: the marker's name, until its block opens
  std::string python_pending;       // a python_NAME marker: python/tests/test_readme.py runs its block
  bool in_block = false, in_python = false;
  for (int n = 1; std::getline(in, line); ++n) {
    const std::string where = page + ":" + std::to_string(n) + ": ";
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
        if (!write(out_dir + "/" + pending + ".inc", body)) return fail(where + "cannot write " + pending);
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
  if (in_block || !pending.empty()) return fail(page + " ends inside snippet '" + pending + "'");
  return 0;
}
}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> pages;
  int k = 1;
  if (argc < 3) return fail("usage: extract_snippets OUT_DIR PAGE.md... -- NAME...");
  const std::string out_dir = argv[k++];
  for (; k < argc && std::string(argv[k]) != "--"; ++k) pages.emplace_back(argv[k]);
  if (k == argc) return fail("usage: extract_snippets OUT_DIR PAGE.md... -- NAME...");
  const std::set<std::string> expected(argv + k + 1, argv + argc);
  const std::string marker = "<!-- snippet: ", marker_end = " -->";

  std::set<std::string> found;
  for (const std::string& page : pages) {
    std::ifstream in(page);
    if (!in) return fail("cannot read " + page);
    if (int rc = scan(in, page, out_dir, marker, marker_end, found)) return rc;
  }
  for (const auto& name : found)
    if (!expected.count(name)) return fail("snippet '" + name + "' has no test (add it to tests/readme)");
  for (const auto& name : expected)
    if (!found.count(name)) return fail("a test expects snippet '" + name + "', which no page has");
  return 0;
}
