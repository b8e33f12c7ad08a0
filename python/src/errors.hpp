// kvcache's Status as a Python exception: one class per error code, all under
// kvcache.Error (python/kvcache/_errors.py defines them and hands them here).
#pragma once

#include <kvcache/status.hpp>
#include <nanobind/nanobind.h>

#include <array>
#include <exception>
#include <string>
#include <utility>

namespace kvpy {

// Thrown by check(); translated to the Python class of its code.
struct StatusError : std::exception {
  kvcache::Status status;
  std::string text;
  explicit StatusError(kvcache::Status s) : status(std::move(s)), text(status.message()) {}
  const char* what() const noexcept override { return text.c_str(); }
};

inline void check(const kvcache::Status& s) {
  if (!s.ok()) throw StatusError(s);
}
template <class T>
T check(kvcache::Result<T> r) {
  if (!r.ok()) throw StatusError(r.status());
  return std::move(*r);
}

// A bad argument found on the Python side (a shape, a dtype, a length):
// the same invalid_argument class, the value named.
inline void require(bool ok, const char* name, std::int64_t value, std::int64_t limit) {
  if (!ok) throw StatusError(kvcache::Status{kvcache::Errc::invalid_argument, name, value, limit});
}

// An array of the wrong kind: the same invalid_argument class, naming the array and what it must be.
[[noreturn]] inline void bad_array(const char* name, const char* want) {
  StatusError e(kvcache::Status{kvcache::Errc::invalid_argument, name, 0, 0});
  e.text = std::string("invalid_argument: ") + name + " must be a C-contiguous " + want + " array on the CPU";
  throw e;
}

void register_errors(nanobind::module_& m);

}  // namespace kvpy
