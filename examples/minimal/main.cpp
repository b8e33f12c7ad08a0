// kvcache, minimal: a Llama-3-8B-like cache over a host buffer the example
// owns. Three sequences (two share a prompt prefix), prompt reservation,
// decode steps, the exported tables, then everything freed and checked.
#include <kvcache/kvcache.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace kv = kvcache;

namespace {

// Stand-in for the engine's K/V projection: every element of a token's K (and
// V) row gets a value derived from (sequence, position), so reads can be checked.
std::uint16_t value_of(std::uint32_t seq, std::int32_t pos, int kv_plane) {
  return static_cast<std::uint16_t>((seq * 4099u + std::uint32_t(pos) * 2u + std::uint32_t(kv_plane)) & 0x7fffu);
}

// The host "scatter": what the write kernel will do, here as plain loops.
void write_tokens(std::vector<std::byte>& pool, const kv::Strides& st, const kv::GeometrySpec& g,
                  std::span<const std::int32_t> slots, std::uint32_t seq, std::int32_t first_pos) {
  std::vector<std::uint16_t> row(static_cast<std::size_t>(g.head_dim));
  for (std::size_t i = 0; i < slots.size(); ++i) {
    if (slots[i] < 0) continue;  // padding
    const std::int64_t block = slots[i] / g.block_size, offset = slots[i] % g.block_size;
    for (int layer = 0; layer < g.num_layers; ++layer)
      for (int plane = 0; plane < 2; ++plane) {
        std::fill(row.begin(), row.end(), value_of(seq, first_pos + std::int32_t(i), plane));
        for (int head = 0; head < g.num_kv_heads; ++head)
          std::memcpy(pool.data() + st.offset(block, layer, plane, offset, head), row.data(), row.size() * 2);
      }
  }
}

// Reads every token of a sequence back through its page table.
bool verify(const std::vector<std::byte>& pool, const kv::Strides& st, const kv::GeometrySpec& g,
            std::span<const kv::BlockId> blocks, std::int32_t tokens, std::uint32_t writer_of_prefix,
            std::int32_t prefix_tokens, std::uint32_t seq) {
  for (std::int32_t pos = 0; pos < tokens; ++pos) {
    const std::uint32_t writer = pos < prefix_tokens ? writer_of_prefix : seq;
    std::uint16_t v = 0;
    const auto off = st.offset(blocks[std::size_t(pos / g.block_size)], g.num_layers - 1, 1, pos % g.block_size,
                               g.num_kv_heads - 1);
    std::memcpy(&v, pool.data() + off + (g.head_dim - 1) * 2, 2);
    if (v != value_of(writer, pos, 1)) return false;
  }
  return true;
}

}  // namespace

int main() {
  const kv::GeometrySpec spec{.num_layers = 32, .num_kv_heads = 8, .head_dim = 128, .block_size = 16,
                              .dtype = kv::DType::f16, .layout = kv::Layout::NHD};
  const auto geometry = kv::Geometry::make(spec);
  if (!geometry) return fmt::print("bad geometry: {}\n", geometry.status().message()), 1;
  constexpr std::int32_t kBlocks = 48;  // null block included
  const std::int64_t bytes = *geometry->pool_bytes(kBlocks);
  const kv::Strides strides = *geometry->strides(kBlocks);
  std::vector<std::byte> pool(static_cast<std::size_t>(bytes));  // the engine owns the KV memory
  fmt::print("geometry: {} layers x {} kv-heads x {} dims, fp16, block {} -> {:.2f} MiB per block, pool of {} "
             "blocks = {:.1f} MiB (host)\n",
             spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size,
             double(geometry->block_bytes()) / (1 << 20), kBlocks, double(bytes) / (1 << 20));

  kv::Cache<> cache({.geometry = *geometry, .num_blocks = kBlocks, .max_sequences = 8,
                     .max_blocks_per_sequence = 16, .event_capacity = 64});

  // Two prompts share a 40-token system prompt; the third is unrelated.
  std::vector<std::int32_t> system(40);
  for (std::size_t i = 0; i < system.size(); ++i) system[i] = std::int32_t(1000 + i);
  auto prompt_a = system, prompt_b = system;
  for (int i = 0; i < 13; ++i) prompt_a.push_back(7 * i);
  for (int i = 0; i < 21; ++i) prompt_b.push_back(11 * i);
  std::vector<std::int32_t> prompt_c(30, 5);

  std::vector<std::int32_t> slots(64);
  // A: prefill the whole prompt, then publish its full blocks for reuse.
  const kv::SeqId a = *cache.add_sequence();
  if (auto r = cache.reserve(a, std::int32_t(prompt_a.size()), slots); !r)
    return fmt::print("reserve failed: {}\n", r.status().message()), 1;
  write_tokens(pool, strides, spec, std::span(slots).first(prompt_a.size()), a.index, 0);
  (void)cache.publish(a, prompt_a);

  // B: starts from A's cached prefix, prefills only the rest.
  const auto hit = *cache.add_sequence(prompt_b);
  const kv::SeqId b = hit.seq;
  const auto rest_b = std::int32_t(prompt_b.size()) - hit.cached_tokens;
  (void)cache.reserve(b, rest_b, slots);
  write_tokens(pool, strides, spec, std::span(slots).first(std::size_t(rest_b)), b.index, hit.cached_tokens);
  fmt::print("sequence B reuses {} cached prompt tokens of {} (prefix shared with A)\n", hit.cached_tokens,
             prompt_b.size());

  const kv::SeqId c = *cache.add_sequence();
  (void)cache.reserve(c, std::int32_t(prompt_c.size()), slots);
  write_tokens(pool, strides, spec, std::span(slots).first(prompt_c.size()), c.index, 0);

  // Decode: one token per sequence per step, one batched reserve each step.
  const std::array<kv::SeqId, 3> seqs{a, b, c};
  const std::array<std::int32_t, 3> ones{1, 1, 1};
  std::array<kv::BlockCopy, 3> copies{};
  std::vector<std::int32_t> step_slots(4);  // padded to a CUDA-graph batch of 4
  for (int step = 0; step < 5; ++step) {
    std::array<std::int32_t, 3> len{};
    (void)cache.export_lengths(seqs, len);
    auto r = cache.reserve_batch(seqs, ones, step_slots, copies);
    if (!r) return fmt::print("decode step failed: {}\n", r.status().message()), 1;
    for (std::size_t i = 0; i < seqs.size(); ++i)
      write_tokens(pool, strides, spec, std::span(step_slots).subspan(i, 1), seqs[i].index, len[i]);
    if (step == 0) fmt::print("decode slot mapping (padded batch of 4): {}\n", step_slots);
  }

  std::vector<std::int32_t> dense(3 * 6), indptr(4), indices(18), last(3), lens(3);
  (void)cache.export_block_table(seqs, dense, 6);
  const auto nnz = *cache.export_csr(seqs, indptr, indices, last);
  (void)cache.export_lengths(seqs, lens);
  fmt::print("\nsequence lengths: {}\n", lens);
  fmt::print("dense block table [3 x 6] (0 = null block):\n");
  for (int r = 0; r < 3; ++r) fmt::print("  {}\n", std::span(dense).subspan(std::size_t(r * 6), 6));
  fmt::print("CSR: indptr {} indices {} last_page_len {}\n", indptr, std::span(indices).first(std::size_t(nnz)), last);
  fmt::print("pool: {} used, {} free ({} cached), shared first blocks: A={} B={}\n", cache.pool().num_used(),
             cache.free_blocks(), cache.pool().num_cached(), dense[0], dense[6]);

  bool ok = true;
  ok &= verify(pool, strides, spec, *cache.table().blocks(a), lens[0], a.index, 0, a.index);
  ok &= verify(pool, strides, spec, *cache.table().blocks(b), lens[1], a.index, hit.cached_tokens, b.index);
  ok &= verify(pool, strides, spec, *cache.table().blocks(c), lens[2], c.index, 0, c.index);
  fmt::print("read back every token through the page tables: {}\n", ok ? "all match" : "MISMATCH");

  std::array<kv::BlockEvent, 64> events{};
  const auto n_events = cache.drain_events(events);
  fmt::print("block events: {} stored (parent-chained hashes for KV-aware routing)\n", n_events);

  for (auto s : seqs) (void)cache.free(s);
  const auto check = cache.check_invariants();
  fmt::print("\nafter freeing everything: {} used, {} free ({} still cached for reuse); invariant check: {}\n",
             cache.pool().num_used(), cache.free_blocks(), cache.pool().num_cached(), check.message());
  return ok && check.ok() ? 0 : 1;
}
