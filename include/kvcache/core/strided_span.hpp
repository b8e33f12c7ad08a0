// A view of n elements a fixed stride apart, like std::span but strided
// (std::mdspan's layout_stride is C++23). WriteGate stores a sequence's
// kv-heads side by side, token slot by token slot, so that a decode step's
// writes for all heads of a sequence share a cache line; one head's
// positions are then every H-th element.
#pragma once

#include <compare>
#include <concepts>
#include <cstddef>
#include <iterator>
#include <type_traits>

#include "kvcache/config.hpp"

KVCACHE_BEGIN_NAMESPACE

/// n elements of T, `stride` elements apart; iterators are random access.
template <class T>
class StridedSpan {
 public:
  /// A random-access iterator over the view.
  class iterator {
   public:
    using iterator_category = std::random_access_iterator_tag;  ///< Random access.
    using value_type = std::remove_cv_t<T>;                      ///< The element type.
    using difference_type = std::ptrdiff_t;                      ///< Distance in elements of the view.
    using pointer = T*;                                          ///< Pointer to an element.
    using reference = T&;                                        ///< Reference to an element.
    iterator() = default;                                        ///< A singular iterator.
    iterator(T* p, std::ptrdiff_t stride) noexcept : p_(p), stride_(stride) {}  ///< At p.
    reference operator*() const noexcept { return *p_; }                        ///< The element.
    pointer operator->() const noexcept { return p_; }                          ///< The element.
    reference operator[](difference_type k) const noexcept { return p_[k * stride_]; }  ///< k further on.
    iterator& operator++() noexcept { p_ += stride_; return *this; }            ///< The next element.
    iterator operator++(int) noexcept { auto t = *this; ++*this; return t; }   ///< The next element.
    iterator& operator--() noexcept { p_ -= stride_; return *this; }            ///< The previous element.
    iterator operator--(int) noexcept { auto t = *this; --*this; return t; }   ///< The previous element.
    iterator& operator+=(difference_type k) noexcept { p_ += k * stride_; return *this; }  ///< k further on.
    iterator& operator-=(difference_type k) noexcept { p_ -= k * stride_; return *this; }  ///< k back.
    friend iterator operator+(iterator i, difference_type k) noexcept { return i += k; }  ///< k further on.
    friend iterator operator+(difference_type k, iterator i) noexcept { return i += k; }  ///< k further on.
    friend iterator operator-(iterator i, difference_type k) noexcept { return i -= k; }  ///< k back.
    /// Elements between two iterators of one view.
    friend difference_type operator-(const iterator& a, const iterator& b) noexcept { return (a.p_ - b.p_) / a.stride_; }
    friend bool operator==(const iterator& a, const iterator& b) noexcept { return a.p_ == b.p_; }  ///< Same element.
    friend auto operator<=>(const iterator& a, const iterator& b) noexcept { return a.p_ <=> b.p_; }  ///< Order in the view.

   private:
    T* p_ = nullptr;
    std::ptrdiff_t stride_ = 1;
  };

  StridedSpan() = default;  ///< Empty.
  /// n elements from `data` on, `stride` elements apart (stride >= 1).
  StridedSpan(T* data, std::size_t n, std::ptrdiff_t stride) noexcept : data_(data), size_(n), stride_(stride) {}
  std::size_t size() const noexcept { return size_; }  ///< Elements in the view.
  bool empty() const noexcept { return size_ == 0; }   ///< No elements.
  std::ptrdiff_t stride() const noexcept { return stride_; }  ///< Elements of the store between two of the view.
  /// Element i (any integer type, as the row slots callers index with).
  template <std::integral I>
  T& operator[](I i) const noexcept {
    return data_[static_cast<std::ptrdiff_t>(i) * stride_];
  }
  T& front() const noexcept { return data_[0]; }                                            ///< The first element.
  T& back() const noexcept { return (*this)[size_ - 1]; }                                   ///< The last element.
  iterator begin() const noexcept { return {data_, stride_}; }                              ///< The first element.
  iterator end() const noexcept { return {data_ + std::ptrdiff_t(size_) * stride_, stride_}; }  ///< Past the last.
  /// The first n elements.
  StridedSpan first(std::size_t n) const noexcept { return {data_, n, stride_}; }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
  std::ptrdiff_t stride_ = 1;
};

KVCACHE_END_NAMESPACE
