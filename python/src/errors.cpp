#include "errors.hpp"

namespace nb = nanobind;

namespace kvpy {
namespace {
// Python classes by Errc value, set once by kvcache/_errors.py at import.
std::array<PyObject*, 32> classes{};
}  // namespace

void register_errors(nb::module_& m) {
  m.def("_set_error_classes", [](nb::list by_code) {
    for (std::size_t i = 0; i < by_code.size() && i < classes.size(); ++i) {
      nb::object c = by_code[i];
      Py_XINCREF(c.ptr());
      classes[i] = c.ptr();
    }
  });
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const StatusError& e) {
      const auto code = static_cast<std::size_t>(e.status.code());
      PyObject* cls = code < classes.size() && classes[code] ? classes[code] : PyExc_RuntimeError;
      PyErr_SetString(cls, e.what());
    } catch (const kvcache::ConfigError& e) {
      const auto code = static_cast<std::size_t>(e.status().code());
      PyObject* cls = code < classes.size() && classes[code] ? classes[code] : PyExc_ValueError;
      PyErr_SetString(cls, e.what());
    }
  });
}

}  // namespace kvpy
