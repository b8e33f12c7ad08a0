// Typed errors. Hot paths return Status / Result<T> by value; a failed call
// names the argument that was wrong, its value and the limit it broke.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include "kvcache/config.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Error codes; Status::message() spells them with the argument, value and limit.
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
  unknown_job,         // a transfer job never planned, already completed, or from before a reset
  layout_mismatch,     // a remote KV layout that cannot be copied into this one (the field that differs)
  transfer_failed,     // a transport (NIXL) refused or failed a call: the call, and its status as the value
};

/// The code's name, as in messages.
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
    case Errc::unknown_job: return "unknown_job";
    case Errc::layout_mismatch: return "layout_mismatch";
    case Errc::transfer_failed: return "transfer_failed";
  }
  return "unknown_errc";
}

/// `what` is a string literal naming the offending argument; `value` is what the
/// caller passed and `limit` the bound it broke (meaning depends on the code).
class [[nodiscard]] Status {
 public:
  constexpr Status() noexcept = default;
  /// An error: code, the argument it names, its value and the limit it broke.
  constexpr Status(Errc code, const char* what, std::int64_t value = 0, std::int64_t limit = 0) noexcept
      : code_(code), what_(what), value_(value), limit_(limit) {}

  /// True for success.
  constexpr bool ok() const noexcept { return code_ == Errc::ok; }
  /// ok().
  constexpr explicit operator bool() const noexcept { return ok(); }
  /// The error code (Errc::ok on success).
  constexpr Errc code() const noexcept { return code_; }
  /// Name of the argument at fault (empty on success).
  constexpr const char* what() const noexcept { return what_; }
  /// The bad value.
  constexpr std::int64_t value() const noexcept { return value_; }
  /// The limit it broke.
  constexpr std::int64_t limit() const noexcept { return limit_; }

  /// Names for the values of one enumeration (e.g. a dtype's), for messages.
  using Names = const char* (*)(std::int64_t) noexcept;
  /// This status, its value and limit written as unsigned hexadecimal in
  /// message() (a hash, a checksum, a magic number: bits, not a count).
  constexpr Status hex() const noexcept {
    Status s = *this;
    s.shown_ = Shown::hex;
    return s;
  }
  /// This status naming where malformed bytes broke off: value the byte
  /// offset, limit the byte count ("tp_rank (malformed at byte 37 of 80)").
  constexpr Status at_byte() const noexcept {
    Status s = *this;
    s.shown_ = Shown::offset;
    return s;
  }
  /// This status, its value and limit written by `names` in message() (an
  /// enumeration's values: "dtype=fp8_e4m3 (limit f16)").
  constexpr Status named(Names names) const noexcept {
    Status s = *this;
    s.names_ = names;
    s.shown_ = Shown::named;
    return s;
  }

  /// Cold path only: builds e.g. "out_of_blocks: n_blocks=9 (limit 4)";
  /// for duplicate_sequence the second number is the repeated handle's index:
  /// "duplicate_sequence: seqs_at=3 (seq.index 0)".
  std::string message() const {
    if (ok()) return "ok";
    const std::string head = std::string(to_string(code_)) + ": " + what_;
    if (shown_ == Shown::offset) return head + " (malformed at byte " + std::to_string(value_) + " of " + std::to_string(limit_) + ")";
    const char* label = code_ == Errc::duplicate_sequence ? " (seq.index " : " (limit ";
    return head + "=" + shown(value_) + label + shown(limit_) + ")";
  }

  /// Same code, argument, value and limit (how message() writes them aside).
  friend constexpr bool operator==(const Status& a, const Status& b) noexcept {
    return a.code_ == b.code_ && a.value_ == b.value_ && a.limit_ == b.limit_ &&
           std::string_view(a.what_) == std::string_view(b.what_);
  }

 private:
  enum class Shown : std::uint8_t { number, hex, named, offset };
  std::string shown(std::int64_t v) const {
    if (shown_ == Shown::named) return names_(v);
    if (shown_ != Shown::hex) return std::to_string(v);
    static constexpr char digits[] = "0123456789abcdef";
    std::string out;
    for (auto u = static_cast<std::uint64_t>(v); u != 0 || out.empty(); u >>= 4) out.insert(out.begin(), digits[u & 15u]);
    return "0x" + out;
  }

  Errc code_ = Errc::ok;
  const char* what_ = "";
  std::int64_t value_ = 0;
  std::int64_t limit_ = 0;
  Names names_ = nullptr;
  Shown shown_ = Shown::number;
};

/// Thrown when the value of a failed Result is read (operator*, operator->,
/// value()): an error never reads as a default-constructed success. Carries
/// the Status that explains the failure.
class BadResultAccess : public std::logic_error {
 public:
  /// Wraps the failed call's Status.
  explicit BadResultAccess(const Status& s) : std::logic_error("kvcache: value of a failed Result: " + s.message()), status_(s) {}
  /// The failed call's Status.
  const Status& status() const noexcept { return status_; }

 private:
  Status status_;
};

/// Thrown by constructors given a bad configuration (a size out of range, a
/// product that overflows, a capacity too large to allocate). Carries the
/// Status naming the field, its value and the limit.
class ConfigError : public std::invalid_argument {
 public:
  /// `who` names the class ("kvcache::PageTable").
  ConfigError(const char* who, const Status& s) : std::invalid_argument(std::string(who) + ": " + s.message()), status_(s) {}
  /// What was wrong: code, field, value, limit.
  const Status& status() const noexcept { return status_; }

 private:
  Status status_;
};

/// Host bookkeeping a constructor may size: beyond this many bytes a
/// capacity is rejected as capacity_exceeded before anything is allocated.
inline constexpr std::int64_t max_bookkeeping_bytes = std::int64_t{1} << 36;  // 64 GiB

/// The product of `count` elements of `elem_bytes` each, checked against
/// overflow and max_bookkeeping_bytes; throws ConfigError naming `what`.
inline std::size_t checked_elements(const char* who, const char* what, std::int64_t value, std::int64_t count,
                                    std::int64_t elem_bytes) {
  std::int64_t bytes = 0;
  if (count < 0 || __builtin_mul_overflow(count, elem_bytes, &bytes) || bytes > max_bookkeeping_bytes)
    throw ConfigError(who, Status{Errc::capacity_exceeded, what, value, max_bookkeeping_bytes / (elem_bytes > 0 ? elem_bytes : 1)});
  return static_cast<std::size_t>(count);
}

namespace detail {
/// Reading the value of a failed Result: throws BadResultAccess, or prints
/// the Status and aborts when the engine builds without exceptions.
[[noreturn]] inline void bad_result_access(const Status& s) {
#if defined(__cpp_exceptions) || defined(__EXCEPTIONS)
  throw BadResultAccess(s);
#else
  std::fprintf(stderr, "kvcache: value of a failed Result: %s\n", s.message().c_str());
  std::abort();
#endif
}
}  // namespace detail

/// A value or the Status that explains why there is none. Reading the value
/// of a failed Result (operator*, operator->, value()) throws BadResultAccess
/// (aborts under -fno-exceptions): check ok() first.
template <class T>
class [[nodiscard]] Result {
 public:
  /// Success with a value.
  constexpr Result(T value) noexcept : value_(std::move(value)) {}  // NOLINT: implicit by design
  /// Failure: `status` must not be ok.
  constexpr Result(Status status) noexcept : status_(status) {}     // NOLINT: implicit by design

  /// True when the call succeeded.
  constexpr bool ok() const noexcept { return status_.ok(); }
  /// Same as ok().
  constexpr explicit operator bool() const noexcept { return ok(); }
  /// Why the call failed (ok when it did not).
  constexpr const Status& status() const noexcept { return status_; }
  /// The value; throws BadResultAccess on a failed Result.
  constexpr const T& value() const& {
    if (!ok()) detail::bad_result_access(status_);
    return value_;
  }
  /// The value; throws BadResultAccess on a failed Result.
  constexpr T& value() & {
    if (!ok()) detail::bad_result_access(status_);
    return value_;
  }
  /// The value, or `fallback` on a failed Result (never throws).
  constexpr T value_or(T fallback) const noexcept { return ok() ? value_ : fallback; }
  /// The value of a temporary Result, moved out (so `for (x : *call())` owns what it walks).
  constexpr T value() && {
    if (!ok()) detail::bad_result_access(status_);
    return std::move(value_);
  }
  /// The value; throws BadResultAccess on a failed Result.
  constexpr const T& operator*() const& { return value(); }
  /// The value of a temporary Result, by value: a range-for over `*call()` keeps it alive.
  constexpr T operator*() && { return std::move(*this).value(); }
  /// Member access to the value; throws BadResultAccess on a failed Result.
  constexpr const T* operator->() const { return &value(); }

 private:
  Status status_{};
  T value_{};
};

KVCACHE_END_NAMESPACE
