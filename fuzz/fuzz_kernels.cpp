// libFuzzer target: the host kernels with arbitrary addresses, tables,
// ranges and moves. The host backend validates everything it can see before
// writing, so a call either succeeds or returns an error with the pool and
// the outputs untouched; ASan and UBSan catch any read or write outside them.
// Quantized pools too: their group and channel entries must stay inside
// each plane.
#include <kvcache/kernels/block_copy.hpp>
#include <kvcache/kernels/compaction.hpp>
#include <kvcache/kernels/gather.hpp>
#include <kvcache/kernels/page_bounds.hpp>
#include <kvcache/kernels/page_select.hpp>
#include <kvcache/kernels/rope.hpp>
#include <kvcache/kernels/scatter.hpp>
#include <kvcache/kernels/seal.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "input.hpp"

namespace kv = kvcache;

namespace {
struct Input : fuzz_input::Bytes {
  // Mostly small values, sometimes extreme: int32 edges and negatives.
  std::int32_t value(std::int32_t small) {
    switch (byte() % 8) {
      case 0: return INT32_MAX - std::int32_t(byte() % 4);
      case 1: return -std::int32_t(byte() % 4) - 1;
      case 2: return INT32_MIN;
      default: return std::int32_t(byte() % std::uint32_t(small + 1));
    }
  }
  std::vector<std::int32_t> ints(std::size_t count, std::int32_t small) {
    std::vector<std::int32_t> v(count);
    for (auto& x : v) x = value(small);
    return v;
  }
};

[[noreturn]] void fail(const char* what, const kv::Status& st) {
  std::fprintf(stderr, "fuzz_kernels: %s wrote after an error: %s\n", what, st.message().c_str());
  std::abort();
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in{{data, size}};
  kv::GeometrySpec spec{.num_layers = 1 + std::int32_t(in.byte() % 2), .num_kv_heads = 1 + std::int32_t(in.byte() % 2),
                        .head_dim = 2, .block_size = 1 + std::int32_t(in.byte() % 4), .dtype = kv::DType::f32,
                        .layout = kv::Layout(in.byte() % 2), .planes = kv::KvPlanes(in.byte() % 2)};
  // One input in four (by its length, so the seed corpus keeps its meaning)
  // runs a quantized pool: 16-value rows, one group each, codes of 8, 4 or 2 bits.
  if (size % 4 == 3) {
    const kv::DType codes[] = {kv::DType::int8, kv::DType::int4, kv::DType::fp4_e2m1, kv::DType::fp8_e4m3, kv::DType::int2};
    const std::uint32_t b = in.byte();
    spec.head_dim = 16;
    spec.dtype = codes[b % 5];
    const bool minimum = (b & 8) != 0 && kv::is_integer_code(spec.dtype);
    spec.format.k = spec.format.v = {.scales = kv::Scales::group, .group = 16, .minimum = minimum};
    // Sometimes KIVI's keys: integer codes scaled per (block, head, channel).
    if ((b & 16) != 0 && kv::is_integer_code(spec.dtype)) spec.format.k = {.scales = kv::Scales::channel, .minimum = minimum};
  }
  const auto g = kv::Geometry::make(spec);
  const std::int64_t blocks = 4;
  std::vector<std::byte> mem(std::size_t(*g->pool_bytes(blocks)), std::byte{1});
  const auto pool = *kv::make_pool_view(*g, mem.data(), blocks);
  const auto before = mem;
  const std::int32_t slots_in_pool = std::int32_t(blocks) * spec.block_size;
  std::vector<float> src(64 * 64, 0.5f), out(64 * 64, 0.0f);
  const auto out_before = out;
  kv::Status st{};
  const std::int32_t tokens = std::int32_t(in.byte() % 8);
  switch (in.byte() % 8) {
    case 0: {  // scatter by slot mapping; a channel-scaled pool's blocks are sealed whole instead
      if (spec.format.k.scales == kv::Scales::channel) {
        auto sealed = in.ints(std::size_t(tokens), 4);
        const std::int32_t n = std::min(tokens, 64 / spec.block_size);  // the source holds 64 tokens
        kv::SealParams p{pool, {src.data(), src.data(), kv::DType::f32, 8 * 64, 8 * 8, 8}, sealed.data(), n, in.value(2),
                         in.value(2)};
        st = kv::seal_blocks_host(p);
        break;
      }
      auto slots = in.ints(std::size_t(tokens), slots_in_pool);
      kv::ScatterParams p{pool, {src.data(), src.data(), kv::DType::f32, 8 * 64, 8 * 8, 8}, kv::TokenAddress{slots.data()},
                          tokens, in.value(2), in.value(2)};
      st = kv::scatter_host(p);
      break;
    }
    case 1: {  // scatter through a CSR page table
      const std::int32_t seqs = std::int32_t(in.byte() % 3);
      auto seq = in.ints(std::size_t(tokens), 3), pos = in.ints(std::size_t(tokens), 12);
      auto indptr = in.ints(std::size_t(seqs) + 1, 4), indices = in.ints(8, 4);
      for (auto& x : indptr)  // indices holds 8 entries: larger offsets break the caller's contract
        if (x > 8) x = 8;
      kv::ScatterParams p{pool, {src.data(), src.data(), kv::DType::f32, 8 * 64, 8 * 8, 8},
                          kv::TokenAddress{nullptr, seq.data(), pos.data(), indptr.data(), indices.data(), seqs}, tokens};
      st = kv::scatter_host(p);
      break;
    }
    case 2: {  // gather
      const std::int32_t seqs = std::int32_t(in.byte() % 3);
      auto indptr = in.ints(std::size_t(seqs) + 1, 8), indices = in.ints(8, 4), out_indptr = in.ints(std::size_t(seqs) + 1, 16);
      for (auto& x : indptr)
        if (x > 8) x = 8;
      for (auto& x : out_indptr)
        if (x > 16) x = 16;
      kv::GatherParams p{pool, in.value(2), indptr.data(), indices.data(), out_indptr.data(), seqs,
                         seqs > 0 ? out_indptr[std::size_t(seqs)] : 0, out.data(), out.data() + 2048, kv::DType::f32,
                         2 * 8 * 4, 8};
      st = kv::gather_host(p);
      break;
    }
    case 3: {  // block copy
      std::vector<kv::BlockCopy> pairs(static_cast<std::size_t>(tokens));
      for (auto& c : pairs) c = {in.value(4), in.value(4)};
      st = kv::block_copy_host({pool, pool, pairs.data(), tokens});
      break;
    }
    case 4: {  // compaction
      std::vector<kv::SlotMove> moves(static_cast<std::size_t>(tokens));
      for (auto& m : moves) m = {in.value(slots_in_pool), in.value(slots_in_pool)};
      kv::CompactionParams p{pool, moves.data(), tokens, in.value(2), in.value(2), in.value(2), in.value(2)};
      st = kv::compaction_host(p);
      break;
    }
    case 5: {  // Quest page selection: any CSR, offsets, budget, forced pages, queries (NaN too) and scratch
      const std::int32_t seqs = std::int32_t(in.byte() % 3), group = 1 + std::int32_t(in.byte() % 3), H = spec.num_kv_heads;
      auto indptr = in.ints(std::size_t(seqs) + 1, 8), indices = in.ints(8, 4), out_indptr = in.ints(std::size_t(seqs * H) + 1, 16);
      for (auto& x : indptr)  // indices holds 8 entries, the output 32: larger offsets break the caller's contract
        if (x > 8) x = 8;
      for (auto& x : out_indptr)
        if (x > 32) x = 32;
      if (in.byte() % 2 && seqs > 0 && kv::check_csr(indptr.data(), seqs).ok())  // often the offsets it asks for
        (void)kv::page_select_indptr(indptr.data(), seqs, H, std::max(1, in.value(4)), out_indptr.data(), out_indptr.size());
      std::vector<float> bounds(std::size_t(blocks * H * 2 * 2), 0.25f), queries(std::size_t(seqs * H * group * 2) + 1, 0.5f);
      for (auto& q : queries) q = in.byte() % 16 == 0 ? (in.byte() % 2 ? NAN : INFINITY) : float(std::int32_t(in.byte() % 9) - 4);
      std::vector<std::byte> scratch(std::size_t(in.byte() % 64) * 4);
      std::vector<std::int32_t> picked(32, -3);
      const auto picked_before = picked;
      kv::PageSelectParams p{bounds.data(), blocks, H, 2, queries.data(), group, indptr.data(), indices.data(), seqs,
                             seqs > 0 ? indptr[std::size_t(seqs)] : 0, in.value(4), in.value(2), in.value(2), out_indptr.data(),
                             picked.data(), scratch.data(), scratch.size()};
      st = kv::page_select_host(p);
      if (!st.ok() && picked != picked_before) fail("page_select", st);
      break;
    }
    case 6: {  // Quest metadata: fold written slots (any values) into the bounds
      std::vector<float> bounds(std::size_t(blocks * spec.num_kv_heads * 2 * spec.head_dim), 0.5f);
      const auto bounds_before = bounds;
      auto slots = in.ints(std::size_t(tokens), slots_in_pool);
      kv::PageBoundsUpdateParams p{pool, in.value(2), slots.data(), tokens, bounds.data()};
      p.first_slot_starts_page = in.byte() % 2 == 0;
      st = kv::page_bounds_update_host(p);
      if (!st.ok() && bounds != bounds_before) fail("page_bounds_update", st);
      break;
    }
    default: {  // rope on listed blocks with a table from make_rope_table
      const std::int32_t max_delta = std::int32_t(in.byte() % 4);
      // A table for every dim (a quantized pool's rows are 16 wide); a failed make leaves it 1 / 0.
      std::vector<float> cs(std::size_t((max_delta + 1) * spec.head_dim / 2), 1.0f), sn(cs.size(), 0.0f);
      const double theta = in.byte() % 4 == 0 ? -1.0 : 10000.0;
      (void)kv::make_rope_table(theta, spec.head_dim, max_delta, cs, sn);
      auto blocks_list = in.ints(std::size_t(tokens), 4), deltas = in.ints(std::size_t(tokens), 4);
      kv::RopeParams p{pool, in.value(2), in.value(2), blocks_list.data(), deltas.data(), tokens, cs.data(), sn.data(), max_delta};
      st = kv::rope_host(p);
    }
  }
  if (!st.ok() && (mem != before || out != out_before)) fail("a kernel", st);
  return 0;
}
