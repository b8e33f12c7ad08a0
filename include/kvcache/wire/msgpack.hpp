// The subset of MessagePack (msgpack.org) the wire formats use: nil, bool,
// integers, float64, strings, binary and arrays. Maps are not needed: every
// message here is an array whose field order is the format (as msgspec's
// `array_like` structs, which vLLM's KV events are). The writer appends to a
// caller's byte vector (its capacity reused across messages); the reader
// walks a byte span and reports the first malformed or unexpected item as a
// typed error naming what it expected, never reading past the end.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>
#include <vector>

#include "kvcache/config.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Appends MessagePack items to a byte vector, each in its shortest form.
class MsgpackWriter {
 public:
  /// Writes into `out`, after what it already holds.
  explicit MsgpackWriter(std::vector<std::uint8_t>& out) noexcept : out_(&out) {}

  /// nil.
  void nil() { byte(0xc0); }
  /// true or false.
  void boolean(bool v) { byte(v ? 0xc3 : 0xc2); }
  /// An unsigned integer (positive fixint, uint 8/16/32/64).
  void uint(std::uint64_t v) {
    if (v < 128) byte(std::uint8_t(v));
    else if (v <= 0xff) byte(0xcc), byte(std::uint8_t(v));
    else if (v <= 0xffff) byte(0xcd), big(v, 2);
    else if (v <= 0xffffffffu) byte(0xce), big(v, 4);
    else byte(0xcf), big(v, 8);
  }
  /// A signed integer: non-negative values as uint(), others as negative fixint or int 8/16/32/64.
  void sint(std::int64_t v) {
    if (v >= 0) return uint(std::uint64_t(v));
    if (v >= -32) byte(std::uint8_t(v));
    else if (v >= INT8_MIN) byte(0xd0), big(std::uint64_t(v), 1);
    else if (v >= INT16_MIN) byte(0xd1), big(std::uint64_t(v), 2);
    else if (v >= INT32_MIN) byte(0xd2), big(std::uint64_t(v), 4);
    else byte(0xd3), big(std::uint64_t(v), 8);
  }
  /// A float 64.
  void float64(double v) { byte(0xcb), big(std::bit_cast<std::uint64_t>(v), 8); }
  /// A UTF-8 string (the caller's bytes, as they are).
  void str(std::string_view s) {
    const std::uint64_t n = s.size();
    if (n < 32) byte(std::uint8_t(0xa0 | n));
    else if (n <= 0xff) byte(0xd9), big(n, 1);
    else if (n <= 0xffff) byte(0xda), big(n, 2);
    else byte(0xdb), big(n, 4);
    bytes({reinterpret_cast<const std::uint8_t*>(s.data()), s.size()});
  }
  /// Binary bytes.
  void bin(std::span<const std::uint8_t> b) {
    const std::uint64_t n = b.size();
    if (n <= 0xff) byte(0xc4), big(n, 1);
    else if (n <= 0xffff) byte(0xc5), big(n, 2);
    else byte(0xc6), big(n, 4);
    bytes(b);
  }
  /// The header of an array of n items (the caller writes them next).
  void array(std::uint32_t n) {
    if (n < 16) byte(std::uint8_t(0x90 | n));
    else if (n <= 0xffff) byte(0xdc), big(n, 2);
    else byte(0xdd), big(n, 4);
  }

 private:
  void byte(std::uint8_t b) { out_->push_back(b); }
  void big(std::uint64_t v, int n) {
    for (int i = n - 1; i >= 0; --i) out_->push_back(std::uint8_t(v >> (8 * i)));
  }
  void bytes(std::span<const std::uint8_t> b) { out_->insert(out_->end(), b.begin(), b.end()); }
  std::vector<std::uint8_t>* out_;
};

/// Reads MessagePack items from a byte span in order. Each call returns the
/// item or an error (invalid_argument naming what was expected, with the byte
/// offset as its value) and then leaves the position where it was.
class MsgpackReader {
 public:
  /// Reads `bytes` from its start.
  explicit MsgpackReader(std::span<const std::uint8_t> bytes) noexcept : b_(bytes) {}

  /// Bytes read so far.
  std::size_t offset() const noexcept { return at_; }
  /// Every byte has been read.
  bool done() const noexcept { return at_ == b_.size(); }

  /// Consumes a nil if one is next; false (and nothing consumed) otherwise.
  bool nil() noexcept {
    if (at_ < b_.size() && b_[at_] == 0xc0) return ++at_, true;
    return false;
  }
  /// A bool.
  Result<bool> boolean(const char* what) noexcept {
    if (at_ < b_.size() && (b_[at_] == 0xc2 || b_[at_] == 0xc3)) return b_[at_++] == 0xc3;
    return fail(what);
  }
  /// An integer that fits int64 (any msgpack integer encoding).
  Result<std::int64_t> sint(const char* what) noexcept {
    const std::size_t start = at_;
    auto v = integer(what);
    if (!v) return v.status();
    if (!v->negative && v->bits > std::uint64_t(INT64_MAX)) return at_ = start, fail(what);
    return std::int64_t(v->bits);
  }
  /// A non-negative integer.
  Result<std::uint64_t> uint(const char* what) noexcept {
    const std::size_t start = at_;
    auto v = integer(what);
    if (!v) return v.status();
    if (v->negative) return at_ = start, fail(what);
    return v->bits;
  }
  /// A float 64 (or float 32, widened).
  Result<double> float64(const char* what) noexcept {
    if (at_ < b_.size() && b_[at_] == 0xcb && have(9)) {
      const std::uint64_t v = read_big(at_ + 1, 8);
      at_ += 9;
      return std::bit_cast<double>(v);
    }
    if (at_ < b_.size() && b_[at_] == 0xca && have(5)) {
      const auto v = std::uint32_t(read_big(at_ + 1, 4));
      at_ += 5;
      return double(std::bit_cast<float>(v));
    }
    return fail(what);
  }
  /// A string: a view of the reader's bytes.
  Result<std::string_view> str(const char* what) noexcept {
    auto r = sized(what, 0xa0, 0x1f, 0xd9);
    if (!r) return r.status();
    return std::string_view(reinterpret_cast<const char*>(r->data()), r->size());
  }
  /// Binary bytes: a view of the reader's bytes.
  Result<std::span<const std::uint8_t>> bin(const char* what) noexcept { return sized(what, 0, 0, 0xc4); }
  /// An array header: its item count.
  Result<std::uint32_t> array(const char* what) noexcept {
    if (at_ >= b_.size()) return fail(what);
    const std::uint8_t t = b_[at_];
    if ((t & 0xf0) == 0x90) return ++at_, std::uint32_t(t & 0x0f);
    const int n = t == 0xdc ? 2 : t == 0xdd ? 4 : 0;
    if (n == 0 || !have(1 + std::size_t(n))) return fail(what);
    const auto count = std::uint32_t(read_big(at_ + 1, n));
    at_ += 1 + std::size_t(n);
    return count;
  }

 private:
  struct Int {
    std::uint64_t bits = 0;
    bool negative = false;
  };
  Status fail(const char* what) const noexcept {
    return Status{Errc::invalid_argument, what, std::int64_t(at_), std::int64_t(b_.size())}.at_byte();
  }
  bool have(std::size_t n) const noexcept { return b_.size() - at_ >= n; }
  std::uint64_t read_big(std::size_t from, int n) const noexcept {
    std::uint64_t v = 0;
    for (int i = 0; i < n; ++i) v = (v << 8) | b_[from + std::size_t(i)];
    return v;
  }
  Result<Int> integer(const char* what) noexcept {
    if (at_ >= b_.size()) return fail(what);
    const std::uint8_t t = b_[at_];
    if (t < 0x80) return ++at_, Int{t, false};
    if (t >= 0xe0) return ++at_, Int{std::uint64_t(std::int64_t(std::int8_t(t))), true};
    int n = 0;
    bool sign = false;
    switch (t) {
      case 0xcc: n = 1; break;
      case 0xcd: n = 2; break;
      case 0xce: n = 4; break;
      case 0xcf: n = 8; break;
      case 0xd0: n = 1, sign = true; break;
      case 0xd1: n = 2, sign = true; break;
      case 0xd2: n = 4, sign = true; break;
      case 0xd3: n = 8, sign = true; break;
      default: return fail(what);
    }
    if (!have(1 + std::size_t(n))) return fail(what);
    std::uint64_t v = read_big(at_ + 1, n);
    at_ += 1 + std::size_t(n);
    if (!sign) return Int{v, false};
    const int shift = 64 - 8 * n;  // sign-extend
    const auto s = std::int64_t(v << shift) >> shift;
    return Int{std::uint64_t(s), s < 0};
  }
  // A string or bin: `fix`/`fixmask` is the fixstr form (none for bin), `one` the 8-bit-length type.
  Result<std::span<const std::uint8_t>> sized(const char* what, std::uint8_t fix, std::uint8_t fixmask, std::uint8_t one) noexcept {
    if (at_ >= b_.size()) return fail(what);
    const std::uint8_t t = b_[at_];
    std::size_t head = 0, len = 0;
    if (fixmask != 0 && (t & std::uint8_t(~fixmask)) == fix) head = 1, len = t & fixmask;
    else if (t >= one && t <= one + 2) {
      const int n = 1 << (t - one);
      if (!have(1 + std::size_t(n))) return fail(what);
      head = 1 + std::size_t(n), len = std::size_t(read_big(at_ + 1, n));
    } else {
      return fail(what);
    }
    if (!have(head) || b_.size() - at_ - head < len) return fail(what);
    const auto out = b_.subspan(at_ + head, len);
    at_ += head + len;
    return out;
  }

  std::span<const std::uint8_t> b_;
  std::size_t at_ = 0;
};

KVCACHE_END_NAMESPACE
