// The GGUF loader (gguf.hpp) on files written here: every value it
// dequantizes (Q8_0, Q4_1, F16, F32) against the codes written, the Q/K rows
// back in rotate-half order, tied output weights; and every way a file can
// be wrong refused with the thing named. SmolLM2 itself is checked against
// the dense reference by python/tests/test_pretrained.py.
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "gguf.hpp"
#include "model.hpp"

namespace {

constexpr std::uint32_t kF32 = 0, kF16 = 1, kQ4_1 = 3, kQ8_0 = 8;
constexpr std::int32_t kVocab = 4, kDim = 64, kHeads = 2, kKvHeads = 1, kHidden = 32, kHd = kDim / kHeads;

struct Writer {
  std::vector<char> data;
  std::uint64_t tensors = 0, kvs = 0;
  template <class T>
  static void put(std::vector<char>& b, T x) {
    const char* p = reinterpret_cast<const char*>(&x);
    b.insert(b.end(), p, p + sizeof x);
  }
  static void str(std::vector<char>& b, const std::string& s) {
    put(b, std::uint64_t(s.size()));
    b.insert(b.end(), s.begin(), s.end());
  }
  std::vector<char> meta;
  void u32(const std::string& k, std::uint32_t v) { str(meta, k), put(meta, std::uint32_t(4)), put(meta, v), ++kvs; }
  void f32(const std::string& k, float v) { str(meta, k), put(meta, std::uint32_t(6)), put(meta, v), ++kvs; }
  void text(const std::string& k, const std::string& v) { str(meta, k), put(meta, std::uint32_t(8)), str(meta, v), ++kvs; }
  void strings(const std::string& k, std::int32_t n) {
    str(meta, k), put(meta, std::uint32_t(9)), put(meta, std::uint32_t(8)), put(meta, std::uint64_t(n)), ++kvs;
    for (std::int32_t i = 0; i < n; ++i) str(meta, "t" + std::to_string(i));
  }
  std::vector<char> infos;
  void tensor(const std::string& name, std::uint64_t cols, std::uint64_t rows, std::uint32_t type,
              const std::vector<char>& bytes) {
    while (data.size() % 32) data.push_back(0);
    str(infos, name), put(infos, std::uint32_t(2)), put(infos, cols), put(infos, rows), put(infos, type);
    put(infos, std::uint64_t(data.size()));
    data.insert(data.end(), bytes.begin(), bytes.end());
    ++tensors;
  }
  std::vector<char> file() const {
    std::vector<char> b{'G', 'G', 'U', 'F'};
    put(b, std::uint32_t(3)), put(b, tensors), put(b, kvs);
    b.insert(b.end(), meta.begin(), meta.end());
    b.insert(b.end(), infos.begin(), infos.end());
    while (b.size() % 32) b.push_back(0);
    b.insert(b.end(), data.begin(), data.end());
    return b;
  }
};

// Value i of a tensor: F32 and F16 hold (i % 7) / 4 - 0.5; Q8_0 codes (i % 9) - 4 at scale 0.5; Q4_1
// nibbles i % 16 at scale 0.25 and minimum -1 (all exact in f16).
float want(std::uint32_t type, std::uint64_t i) {
  if (type == kQ8_0) return 0.5f * float(int(i % 9) - 4);
  if (type == kQ4_1) return 0.25f * float(i % 16) - 1.0f;
  return float(i % 7) / 4.0f - 0.5f;
}

std::vector<char> encode(std::uint32_t type, std::uint64_t n) {
  std::vector<char> b;
  const auto half = [&](std::uint16_t h) { Writer::put(b, h); };
  for (std::uint64_t i = 0; i < n; ++i) {
    if (type == kF32) Writer::put(b, want(type, i));
    if (type == kF16) half(kvcache::cvt::f32_to_f16(want(type, i)));
    if (type == kQ8_0) {
      if (i % 32 == 0) half(0x3800);  // 0.5
      b.push_back(char(std::int8_t(int(i % 9) - 4)));
    }
    if (type == kQ4_1 && i % 32 == 0) {
      half(0x3400), half(0xBC00);  // 0.25, -1
      for (std::uint64_t j = 0; j < 16; ++j) b.push_back(char(((i + j) % 16) | (((i + j + 16) % 16) << 4)));
    }
  }
  return b;
}

Writer llama(std::uint32_t q_type = kQ4_1, const std::string& arch = "llama") {
  Writer w;
  w.text("general.architecture", arch);
  w.u32("general.alignment", 32);
  for (const auto& [k, v] : {std::pair{"block_count", 1}, {"embedding_length", kDim}, {"feed_forward_length", kHidden},
                             {"attention.head_count", kHeads}, {"attention.head_count_kv", kKvHeads},
                             {"context_length", 128}})
    w.u32(std::string("llama.") + k, std::uint32_t(v));
  w.f32("llama.rope.freq_base", 1e5f);
  w.f32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  w.strings("tokenizer.ggml.tokens", kVocab);
  const auto t = [&](const std::string& name, std::uint64_t cols, std::uint64_t rows, std::uint32_t type) {
    w.tensor(name, cols, rows, type, encode(type, cols * rows));
  };
  t("token_embd.weight", kDim, kVocab, kQ8_0);
  t("blk.0.attn_norm.weight", kDim, 1, kF32);
  t("blk.0.attn_q.weight", kDim, kDim, q_type);
  t("blk.0.attn_k.weight", kDim, kKvHeads * kHd, kQ4_1);
  t("blk.0.attn_v.weight", kDim, kKvHeads * kHd, kF16);
  t("blk.0.attn_output.weight", kDim, kDim, kF32);
  t("blk.0.ffn_norm.weight", kDim, 1, kF32);
  t("blk.0.ffn_gate.weight", kDim, kHidden, kF32);
  t("blk.0.ffn_up.weight", kDim, kHidden, kF32);
  t("blk.0.ffn_down.weight", kHidden, kDim, kF32);
  t("output_norm.weight", kDim, 1, kF32);
  return w;
}

std::string write(const std::vector<char>& bytes, const std::string& name) {
  static int n = 0;
  const std::string path =
      (std::filesystem::temp_directory_path() / ("kvcache_test_gguf_" + std::to_string(::getpid()) + "_" +
                                                 std::to_string(n++) + name))
          .string();
  std::ofstream(path, std::ios::binary).write(bytes.data(), std::streamsize(bytes.size()));
  return path;
}

std::string error_of(const std::vector<char>& bytes) {
  const std::string path = write(bytes, ".gguf");
  try {
    (void)engine::load_model(path);
  } catch (const std::runtime_error& e) {
    std::remove(path.c_str());
    return e.what();
  }
  std::remove(path.c_str());
  return "(loaded)";
}

}  // namespace

TEST_CASE("gguf: every dequantized value, the Q/K rows in rotate-half order, tied output weights") {
  const std::string path = write(llama().file(), ".gguf");
  const engine::Model m = engine::load_model(path);
  std::remove(path.c_str());
  const auto& c = m.config();
  CHECK(c.vocab == kVocab);
  CHECK(c.dim == kDim);
  CHECK(c.layers == 1);
  CHECK(c.q_heads == kHeads);
  CHECK(c.kv_heads == kKvHeads);
  CHECK(c.hidden == kHidden);
  CHECK(c.context == 128);
  CHECK(c.rope_theta == 1e5f);
  for (std::uint64_t i = 0; i < std::uint64_t(kVocab * kDim); ++i)
    REQUIRE(m.embedding(0)[i] == want(kQ8_0, i));
  CHECK(std::memcmp(m.output(), m.embedding(0), sizeof(float) * kVocab * kDim) == 0);  // no output.weight: tied
  const auto& l = m.layer(0);
  for (std::uint64_t i = 0; i < std::uint64_t(kDim * kKvHeads * kHd); ++i) REQUIRE(l.wv[i] == want(kF16, i));
  for (std::uint64_t i = 0; i < std::uint64_t(kDim); ++i) REQUIRE(l.attn_norm[i] == want(kF32, i));
  // The file's row 2i + s of a head is the model's row s * (head_dim / 2) + i.
  for (std::int32_t h = 0; h < kHeads; ++h)
    for (std::int32_t i = 0; i < kHd / 2; ++i)
      for (std::int32_t s = 0; s < 2; ++s)
        for (std::int32_t col = 0; col < kDim; ++col) {
          const auto file_row = std::uint64_t(h * kHd + 2 * i + s), row = std::uint64_t(h * kHd + s * kHd / 2 + i);
          REQUIRE(l.wq[row * kDim + std::uint64_t(col)] == want(kQ4_1, file_row * kDim + std::uint64_t(col)));
        }
}

TEST_CASE("gguf: a file that is wrong is refused, the thing named") {
  auto file = llama().file();
  CHECK_THAT(error_of({file.begin(), file.begin() + 200}), Catch::Contains("past the end of the file"));
  CHECK_THAT(error_of({file.begin(), file.end() - 100}), Catch::Contains("past the end of the file"));
  auto bad_version = file;
  bad_version[4] = 9;
  CHECK_THAT(error_of(bad_version), Catch::Contains("GGUF version 9"));
  CHECK_THAT(error_of(llama(12).file()), Catch::Contains("blk.0.attn_q.weight: tensor type 12"));
  CHECK_THAT(error_of(llama(kQ4_1, "gemma3").file()), Catch::Contains("architecture gemma3"));
  Writer w = llama();
  w.tensors = 2;  // the table lists fewer tensors than the loader needs
  CHECK_THAT(error_of(w.file()), Catch::Contains("is missing"));
}
