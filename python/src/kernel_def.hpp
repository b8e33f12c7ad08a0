// How a kernel is bound: twice, and with a fallback. The typed binding is
// `name` (the fast path: one overload, no wrapper) and `_name`; a catch-all
// overload of `name` runs only when the typed one refused the arguments. It
// retries `_name`, so implicit conversions still apply, and when that refuses
// them too it names a tensor that lives where no kernel runs (torch's meta
// device, say) as an InvalidArgument, instead of nanobind's signature dump.
#pragma once

#include <nanobind/nanobind.h>

#include <deque>
#include <string>
#include <utility>

#include "errors.hpp"

namespace kvpy {

namespace nb = nanobind;

// The name of parameter i in a typed binding's signature ("scatter(pool: ..., k: ...) -> None").
inline std::string param_name(const nb::handle& fn, std::size_t i) {
  const std::string doc = nb::cast<std::string>(nb::str(fn.attr("__doc__")));
  const std::size_t open = doc.find('('), close = doc.find(')');
  if (open == std::string::npos || close == std::string::npos) return "argument " + std::to_string(i);
  std::size_t at = open + 1;
  for (std::size_t k = 0; k < i; ++k) {
    at = doc.find(", ", at);
    if (at == std::string::npos || at > close) return "argument " + std::to_string(i);
    at += 2;
  }
  return doc.substr(at, doc.find(':', at) - at);
}

// A tensor whose device no kernel runs on: an InvalidArgument naming it.
inline void check_device(const nb::handle& value, const std::string& name) {
  if (!nb::hasattr(value, "device")) return;
  const nb::object device = value.attr("device");
  if (!nb::hasattr(device, "type")) return;  // numpy 2's .device is the string "cpu"
  const std::string type = nb::cast<std::string>(nb::str(device.attr("type")));
  if (type == "cpu" || type == "cuda") return;
  StatusError e(kvcache::Status{kvcache::Errc::invalid_argument, "tensor", 0, 0});
  e.text = "invalid_argument: " + name + " must be a CPU or CUDA tensor, not one on '" + type + "'";
  throw e;
}

template <class F, class... Extra>
void def_kernel(nb::module_& m, const char* name, F&& f, const Extra&... extra) {
  static std::deque<std::string> names;  // the bound names outlive the module's functions
  const std::string& typed = names.emplace_back(std::string("_") + name);
  m.def(typed.c_str(), f, extra...);
  m.def(name, std::forward<F>(f), extra...);
  const char* module_name = nb::cast<const char*>(m.attr("__name__"));
  m.def(name, [module_name = std::string(module_name), typed](nb::args args, nb::kwargs kwargs) -> nb::object {
    const nb::object fn = nb::module_::import_(module_name.c_str()).attr(typed.c_str());
    try {
      return fn(*args, **kwargs);
    } catch (nb::python_error& e) {
      if (!e.matches(PyExc_TypeError)) throw;
      for (std::size_t i = 0; i < args.size(); ++i) check_device(args[i], param_name(fn, i));
      for (auto [key, value] : kwargs) check_device(value, nb::cast<std::string>(nb::str(key)));
      throw;
    }
  });
}

}  // namespace kvpy
