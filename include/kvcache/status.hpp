// Typed errors. Hot paths return Status / Result<T> by value; a failed call
// names the argument that was wrong, its value and the limit it broke.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "kvcache/config.hpp"

KVCACHE_BEGIN_NAMESPACE

enum class Errc : std::uint8_t {
  ok = 0,
  invalid_argument,    // a value outside its documented domain (negative count, null block, ...)
  unknown_sequence,    // handle never issued, already freed, or from an older generation
  out_of_blocks,       // the pool has fewer free blocks than the call needs
  capacity_exceeded,   // a fixed capacity (sequences, blocks per sequence) would be exceeded
  buffer_too_small,    // a caller-provided output buffer cannot hold the result
  truncate_too_many,   // truncating more tokens than the sequence holds
  prefix_too_long,     // a token prefix longer than the sequence, or the sequence longer than its tokens
  geometry_overflow,   // sizes of a cache geometry overflow 64-bit arithmetic
  not_allocated,       // retain / release / hash of a block that is not in use
  already_hashed,      // a block's hash is write-once
  duplicate_sequence,  // the same sequence twice in one batch
  blocks_in_use,       // an operation that needs every block free
  invariant_violated,  // check() found corrupted state (a bug, never bad input)
};

constexpr const char* to_string(Errc e) noexcept {
  switch (e) {
    case Errc::ok: return "ok";
    case Errc::invalid_argument: return "invalid_argument";
    case Errc::unknown_sequence: return "unknown_sequence";
    case Errc::out_of_blocks: return "out_of_blocks";
    case Errc::capacity_exceeded: return "capacity_exceeded";
    case Errc::buffer_too_small: return "buffer_too_small";
    case Errc::truncate_too_many: return "truncate_too_many";
    case Errc::prefix_too_long: return "prefix_too_long";
    case Errc::geometry_overflow: return "geometry_overflow";
    case Errc::not_allocated: return "not_allocated";
    case Errc::already_hashed: return "already_hashed";
    case Errc::duplicate_sequence: return "duplicate_sequence";
    case Errc::blocks_in_use: return "blocks_in_use";
    case Errc::invariant_violated: return "invariant_violated";
  }
  return "unknown_errc";
}

// `what` is a string literal naming the offending argument; `value` is what the
// caller passed and `limit` the bound it broke (meaning depends on the code).
class [[nodiscard]] Status {
 public:
  constexpr Status() noexcept = default;
  constexpr Status(Errc code, const char* what, std::int64_t value = 0, std::int64_t limit = 0) noexcept
      : code_(code), what_(what), value_(value), limit_(limit) {}

  constexpr bool ok() const noexcept { return code_ == Errc::ok; }
  constexpr explicit operator bool() const noexcept { return ok(); }
  constexpr Errc code() const noexcept { return code_; }
  constexpr const char* what() const noexcept { return what_; }
  constexpr std::int64_t value() const noexcept { return value_; }
  constexpr std::int64_t limit() const noexcept { return limit_; }

  // Cold path only: builds e.g. "out_of_blocks: n_blocks=9 (limit 4)".
  std::string message() const {
    if (ok()) return "ok";
    return std::string(to_string(code_)) + ": " + what_ + "=" + std::to_string(value_) + " (limit " +
           std::to_string(limit_) + ")";
  }

  friend constexpr bool operator==(const Status&, const Status&) = default;

 private:
  Errc code_ = Errc::ok;
  const char* what_ = "";
  std::int64_t value_ = 0;
  std::int64_t limit_ = 0;
};

// A value or the Status that explains why there is none.
template <class T>
class [[nodiscard]] Result {
 public:
  constexpr Result(T value) noexcept : value_(std::move(value)) {}  // NOLINT: implicit by design
  constexpr Result(Status status) noexcept : status_(status) {}     // NOLINT: implicit by design

  constexpr bool ok() const noexcept { return status_.ok(); }
  constexpr explicit operator bool() const noexcept { return ok(); }
  constexpr const Status& status() const noexcept { return status_; }
  constexpr const T& value() const& noexcept { return value_; }
  constexpr T& value() & noexcept { return value_; }
  constexpr const T& operator*() const noexcept { return value_; }
  constexpr const T* operator->() const noexcept { return &value_; }

 private:
  Status status_{};
  T value_{};
};

KVCACHE_END_NAMESPACE
