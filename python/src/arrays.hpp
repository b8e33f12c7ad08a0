// The binding's arrays. A caller's array is borrowed for one call without a
// copy: a numpy array through numpy's C API (a few field reads: the decode
// step's fast path), else through the buffer protocol, else through DLPack
// (torch CPU tensors, via nanobind).
// Outputs must be C-contiguous CPU arrays of the exact dtype, written in
// place; an output the caller did not pass is a new numpy array.
#pragma once

#include <Python.h>
#include <nanobind/nanobind.h>
// numpy's C API: one function table for the module, imported once by
// module.cpp (KVCACHE_NUMPY_IMPORT); every other translation unit refers to it.
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL kvcache_numpy_api
#ifndef KVCACHE_NUMPY_IMPORT
#define NO_IMPORT_ARRAY
#endif
#include <numpy/arrayobject.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>
#include <span>
#include <type_traits>
#include <utility>

#include "errors.hpp"

namespace kvpy {

namespace nb = nanobind;

template <class T, std::size_t N = 1>
using Numpy = nb::ndarray<nb::numpy, T, nb::ndim<N>>;

template <class T>
constexpr const char* dtype_name() {
  if constexpr (std::is_same_v<T, std::int32_t>) return "int32";
  else if constexpr (std::is_same_v<T, std::uint64_t>) return "uint64";
  else if constexpr (std::is_same_v<T, std::uint8_t>) return "uint8";
  else return "float32";
}

// A buffer-protocol format string names T: native order, one item.
template <class T>
bool numpy_type_is(int t) {
  if constexpr (std::is_same_v<T, std::int32_t>) return t == NPY_INT32;
  else if constexpr (std::is_same_v<T, std::uint64_t>) return t == NPY_UINT64 || t == NPY_INT64;
  else if constexpr (std::is_same_v<T, std::uint8_t>) return t == NPY_UINT8 || t == NPY_INT8;  // bytes, read as they are
  else return t == NPY_FLOAT32;
}

template <class T>
bool format_is(const char* f) {
  if (!f) return false;
  if (*f == '@' || *f == '=' || *f == '<') ++f;
  if (f[0] == 0 || f[1] != 0) return false;
  const char c = f[0];
  if constexpr (std::is_same_v<T, std::int32_t>) return c == 'i' || (c == 'l' && sizeof(long) == 4);
  else if constexpr (std::is_same_v<T, std::uint64_t>)  // handles: int64 arrays of them are read as they are
    return c == 'Q' || c == 'q' || ((c == 'L' || c == 'l') && sizeof(long) == 8);
  else if constexpr (std::is_same_v<T, std::uint8_t>) return c == 'B' || c == 'b' || c == 'c';  // bytes, bytearray, memoryview
  else return c == 'f';
}

// A C-contiguous CPU array of T borrowed for the duration of one call.
template <class T>
class Array {
 public:
  static constexpr std::size_t kMaxDims = 4;  // queries are [seqs][kv_heads][group][head_dim]
  Array() = default;
  Array(const Array&) = delete;
  Array& operator=(const Array&) = delete;
  ~Array() {
    if (has_view_) PyBuffer_Release(&view_);
  }
  // Borrows h; false when it is not such an array. An input (writable =
  // false) that is another dtype is converted by a copy (nanobind's).
  bool borrow(nb::handle h, bool writable) {
    if (PyArray_Check(h.ptr())) {
      auto* a = reinterpret_cast<PyArrayObject*>(h.ptr());
      if (numpy_type_is<T>(PyArray_TYPE(a)) && PyArray_IS_C_CONTIGUOUS(a) && PyArray_NDIM(a) <= kMaxDims &&
          (!writable || PyArray_ISWRITEABLE(a))) {
        data_ = static_cast<T*>(PyArray_DATA(a));
        size_ = std::size_t(PyArray_SIZE(a));
        ndim_ = std::size_t(PyArray_NDIM(a));
        for (std::size_t i = 0; i < ndim_; ++i) shape_[i] = std::size_t(PyArray_DIM(a, int(i)));
        return true;
      }
      if (writable) return false;  // an output of the wrong kind: never a converted copy
    }
    const int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_CheckBuffer(h.ptr())) {
      if (PyObject_GetBuffer(h.ptr(), &view_, flags) == 0) {
        has_view_ = true;
        if (view_.itemsize != Py_ssize_t(sizeof(T)) || !format_is<T>(view_.format) || view_.ndim > kMaxDims) {
          PyBuffer_Release(&view_);
          has_view_ = false;
        } else {
          data_ = static_cast<T*>(view_.buf);
          size_ = std::size_t(view_.len) / sizeof(T);
          ndim_ = std::size_t(view_.ndim);
          for (std::size_t i = 0; i < ndim_; ++i) shape_[i] = std::size_t(view_.shape[i]);
          if (ndim_ == 0) shape_[0] = 1;
          return true;
        }
      } else {
        PyErr_Clear();
      }
    }
    if (writable) {
      nb::ndarray<T, nb::c_contig, nb::device::cpu> a;
      if (!nb::try_cast(h, a, false) || a.ndim() > kMaxDims) return false;
      keep_ = nb::cast(a), data_ = a.data(), size_ = a.size(), ndim_ = a.ndim();
      for (std::size_t i = 0; i < ndim_; ++i) shape_[i] = a.shape(i);
      return true;
    }
    if constexpr (std::is_same_v<T, std::uint64_t>) {  // handles in an int64 tensor (torch has no uint64)
      nb::ndarray<const std::int64_t, nb::c_contig, nb::device::cpu> i;
      if (nb::try_cast(h, i, false) && i.ndim() <= kMaxDims) {
        keep_ = nb::cast(i), data_ = reinterpret_cast<T*>(const_cast<std::int64_t*>(i.data())), size_ = i.size();
        ndim_ = i.ndim();
        for (std::size_t d = 0; d < ndim_; ++d) shape_[d] = i.shape(d);
        return true;
      }
    }
    if constexpr (std::is_integral_v<T>) return convert_integers(h);
    nb::ndarray<const T, nb::c_contig, nb::device::cpu> a;
    if (!nb::try_cast(h, a, true) || a.ndim() > kMaxDims) return false;
    keep_ = nb::cast(a), data_ = const_cast<T*>(a.data()), size_ = a.size(), ndim_ = a.ndim();
    for (std::size_t i = 0; i < ndim_; ++i) shape_[i] = a.shape(i);
    return true;
  }
  // An input that needed a conversion held a value T cannot: its index (else -1).
  std::int64_t out_of_range() const { return bad_index_; }
  T* data() const { return data_; }
  std::size_t size() const { return size_; }
  std::size_t ndim() const { return ndim_; }
  std::size_t shape(std::size_t i) const { return shape_[i]; }
  std::span<T> span() const { return {data_, size_}; }

 private:
  // The one rule for integer inputs that are not already T: any integer
  // array-like (a numpy array of another integer type, a CPU tensor, a list,
  // a tuple) is converted by value, and a value that does not fit T is an
  // error naming its index (out_of_range), never a silent wrap. Floats are refused.
  bool convert_integers(nb::handle h) {
    // Through int64 first: numpy casts every other signed integer type to it
    // safely, where int32 -> uint64 is not a safe cast and was refused (an
    // int32 array of handles, while a list of the same ints converted).
    // uint64 itself, past int64, through uint64.
    if (convert_through<std::int64_t>(h, NPY_INT64)) return true;
    if constexpr (!std::is_signed_v<T>) return bad_index_ < 0 && convert_through<std::uint64_t>(h, NPY_UINT64);
    return false;
  }
  template <class Wide>
  bool convert_through(nb::handle h, int npy) {
    PyObject* arr = PyArray_FROMANY(h.ptr(), npy, 0, int(kMaxDims), NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED);
    if (!arr) {
      PyErr_Clear();
      return false;
    }
    nb::object keep = nb::steal(arr);
    auto* a = reinterpret_cast<PyArrayObject*>(arr);
    const auto* in = static_cast<const Wide*>(PyArray_DATA(a));
    const std::size_t n = std::size_t(PyArray_SIZE(a));
    owned_.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      if (std::cmp_less(in[i], std::numeric_limits<T>::min()) || std::cmp_greater(in[i], std::numeric_limits<T>::max())) {
        bad_index_ = std::int64_t(i);
        return false;
      }
      owned_[i] = T(in[i]);
    }
    data_ = owned_.data(), size_ = n, ndim_ = std::size_t(PyArray_NDIM(a));
    for (std::size_t i = 0; i < ndim_; ++i) shape_[i] = std::size_t(PyArray_DIM(a, int(i)));
    return true;
  }

  std::vector<T> owned_;        // a converted input's values
  std::int64_t bad_index_ = -1;
  Py_buffer view_{};
  bool has_view_ = false;
  nb::object keep_;  // the DLPack path's array (or its converted copy)
  T* data_ = nullptr;
  std::size_t size_ = 0, ndim_ = 0, shape_[kMaxDims] = {};
};

// A new zeroed numpy array of n (x cols) elements that owns its buffer.
template <class T, std::size_t N = 1>
Numpy<T, N> new_array(std::size_t n, std::size_t cols = 1) {
  T* p = new T[n * cols]();
  nb::capsule owner(p, [](void* q) noexcept { delete[] static_cast<T*>(q); });
  if constexpr (N == 1) return Numpy<T, 1>(p, {n}, owner);
  else return Numpy<T, 2>(p, {n, cols}, owner);
}

// An input array (read only).
template <class T>
void in_arg(Array<T>& a, nb::handle given, const char* name) {
  if (a.borrow(given, false)) return;
  if (a.out_of_range() >= 0) {  // a value that does not fit the library's type, named by its index
    StatusError e(kvcache::Status{kvcache::Errc::invalid_argument, name, a.out_of_range(), 0});
    e.text = std::string("invalid_argument: ") + name + "[" + std::to_string(a.out_of_range()) + "] does not fit " +
             dtype_name<T>();
    throw e;
  }
  bad_array(name, dtype_name<T>());
}

// An output: the caller's array (the same object comes back), or a new one
// of n elements (n x cols with cols > 1) when None was given. The wrong kind
// of array is an invalid_argument naming it, before anything changes.
template <class T>
nb::object out_arg(Array<T>& a, nb::handle given, std::size_t n, const char* name, std::size_t cols = 1) {
  nb::object obj = !given.is_none() ? nb::borrow(given)
                   : cols == 1      ? nb::cast(new_array<T>(n))
                                    : nb::cast(new_array<T, 2>(n, cols));
  if (!a.borrow(obj, true)) bad_array(name, cols == 1 ? dtype_name<T>() : "[n, k] int32");
  if (cols > 1) require(a.ndim() == 2 && a.shape(1) == cols, name, std::int64_t(a.ndim() == 2 ? a.shape(1) : 0), std::int64_t(cols));
  // The size is the library's to check: a caller's array too small is its
  // buffer_too_small naming the buffer and the size the call needs.
  return obj;
}

// The first n rows of an output (a view of the same array): what a call
// actually wrote, so a caller never reads a buffer's unwritten tail.
inline nb::object rows(const nb::object& out, std::int64_t n) {
  return out[nb::slice(nb::int_(0), nb::int_(std::max<std::int64_t>(n, 0)), nb::none())];
}

}  // namespace kvpy
