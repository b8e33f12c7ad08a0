// Disaggregated transfers without NIXL: layout handshakes (built, sent as
// msgpack, read back, checked), registration regions, and transfer plans,
// executed by memcpy between two in-process pools and compared byte for byte
// with what the peer holds at every (block, layer, K|V, token, head).
#include <catch2/catch.hpp>

#include <kvcache/transfer/handshake_wire.hpp>
#include <kvcache/transfer/transfer_plan.hpp>

#include <cstring>
#include <limits>
#include <random>
#include <vector>

using namespace kvcache;

namespace {

// A host pool of `blocks` blocks of g, filled with bytes unique per position.
struct HostPool {
  Geometry g;
  std::int64_t blocks;
  std::vector<std::uint8_t> bytes;
  HostPool(const GeometrySpec& s, std::int64_t n, std::uint32_t seed) : g(*Geometry::make(s)), blocks(n), bytes(std::size_t(*g.pool_bytes(n))) {
    std::mt19937 rng(seed);
    for (auto& b : bytes) b = std::uint8_t(rng());
  }
  std::uint64_t base() const { return reinterpret_cast<std::uint64_t>(bytes.data()); }
  LayoutHandshake describe(std::int32_t rank = 0, std::int32_t size = 1) const {
    return *describe_layout(g, blocks, base(), {.engine_id = "e", .tp_rank = rank, .tp_size = size});
  }
  // The bytes of one head of one token of (block, layer, kv).
  std::span<const std::uint8_t> at(std::int32_t b, std::int32_t l, std::int32_t kv, std::int32_t t, std::int32_t h) const {
    const auto s = *g.strides(blocks);
    return {bytes.data() + s.offset(b, l, kv, t, h), std::size_t(g.spec().head_dim * g.element_bytes())};
  }
};

void run(std::span<const TransferDesc> plan) {
  for (const TransferDesc& d : plan)
    std::memcpy(reinterpret_cast<void*>(d.local), reinterpret_cast<const void*>(d.remote), std::size_t(d.bytes));
}

bool same(std::span<const std::uint8_t> a, std::span<const std::uint8_t> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size()) == 0;
}

// Every (layer, K|V, token) of local block lb[i]'s `heads` heads holds the peer's rb[i] from head `first` on.
void check_copied(const HostPool& local, const std::vector<std::int32_t>& lb, const HostPool& remote,
                  const std::vector<std::int32_t>& rb, std::int32_t heads, std::int32_t first) {
  for (std::size_t i = 0; i < rb.size(); ++i)
    for (std::int32_t l = 0; l < local.g.spec().num_layers; ++l)
      for (std::int32_t kv = 0; kv < 2; ++kv)
        for (std::int32_t t = 0; t < local.g.block_size(); ++t)
          for (std::int32_t h = 0; h < heads; ++h) CHECK(same(local.at(lb[i], l, kv, t, h), remote.at(rb[i], l, kv, t, first + h)));
}

const GeometrySpec kSpec{.num_layers = 3, .num_kv_heads = 4, .head_dim = 8, .block_size = 4, .dtype = DType::f16};

}  // namespace

TEST_CASE("handshake: a plain pool's regions, registration and compatibility hash") {
  GeometrySpec sep = kSpec;
  sep.planes = KvPlanes::separate;
  const HostPool a(kSpec, 10, 1), b(sep, 10, 2);
  const LayoutHandshake ha = a.describe(), hb = b.describe();
  REQUIRE(ha.memory.size() == 1);
  CHECK(ha.memory[0].addr == a.base());
  CHECK(ha.memory[0].bytes == std::int64_t(a.bytes.size()));
  CHECK(ha.regions.size() == 3);  // one per layer, K then V adjacent
  CHECK(ha.regions[1].k_bytes == a.g.plane_bytes());
  CHECK(ha.regions[1].v_bytes == a.g.plane_bytes());
  CHECK(ha.regions[1].block_stride == a.g.block_bytes());
  CHECK(hb.regions.size() == 6);  // K and V regions per layer
  CHECK(hb.regions[1].v_bytes == b.g.plane_bytes());
  CHECK(hb.regions[1].block_stride == b.g.plane_bytes());
  // Addresses and plane arrangement differ; what must match does not.
  CHECK(ha.compat_hash == hb.compat_hash);
  CHECK(check_compatible(ha, hb).ok());
  CHECK(compat_hash(ha) == ha.compat_hash);

  CHECK(describe_layout(a.g, 10, 0, {}).status().what() == std::string("base"));
  CHECK(describe_layout(a.g, 0, a.base(), {}).status().what() == std::string("num_blocks"));
  CHECK(describe_layout(a.g, 10, a.base(), {.tp_rank = 2, .tp_size = 2}).status().what() == std::string("tp_rank"));
}

TEST_CASE("handshake: msgpack round trip, and every malformed byte string is an error, never a crash") {
  const HostPool a(kSpec, 10, 1);
  LayoutHandshake h = a.describe(1, 2);
  h.id.engine_id = "prefill-0";
  h.id.hash_seed = 42;
  h.compat_hash = compat_hash(h);
  std::vector<std::uint8_t> bytes;
  to_msgpack(h, bytes);
  const auto back = from_msgpack(bytes);
  REQUIRE(back.ok());
  CHECK(*back == h);

  for (std::size_t n = 0; n < bytes.size(); ++n) {  // every truncation
    const auto cut = from_msgpack(std::span(bytes).first(n));
    REQUIRE_FALSE(cut.ok());
    CHECK(cut.status().code() == Errc::invalid_argument);
    // The message names the field and where the bytes broke off, never the offset as the field's value.
    const std::string msg = cut.status().message();
    CHECK(msg.find("(malformed at byte " + std::to_string(cut.status().value()) + " of " + std::to_string(n) + ")") != std::string::npos);
    CHECK(msg.find('=') == std::string::npos);
  }
  const std::vector<std::uint8_t> noise{0x37, 0x12, 0xfe, 0x00};  // not a msgpack array at all
  CHECK(from_msgpack(noise).status().message() == "invalid_argument: handshake (fields) (malformed at byte 0 of 4)");
  auto longer = bytes;
  longer.push_back(0);
  CHECK(from_msgpack(longer).status().what() == std::string("handshake (trailing bytes)"));
  std::mt19937 rng(7);
  for (int trial = 0; trial < 2000; ++trial) {  // random flips: an error or a handshake that re-encodes to itself
    auto bad = bytes;
    bad[rng() % bad.size()] ^= std::uint8_t(1u << (rng() % 8));
    const auto r = from_msgpack(bad);
    if (!r.ok()) continue;
    std::vector<std::uint8_t> again;
    to_msgpack(*r, again);
    CHECK(from_msgpack(again).ok());
  }
  // A region that points outside its registration is refused.
  LayoutHandshake out = h;
  out.regions[2].base += std::uint64_t(out.memory[0].bytes);
  bytes.clear();
  to_msgpack(out, bytes);
  CHECK(from_msgpack(bytes).status().what() == std::string("region (outside its memory)"));
  // K and V pieces whose sum overflows int64 (found by fuzz_wire): refused, not undefined behaviour.
  out = h;
  out.regions[2].k_bytes = out.regions[2].v_bytes = std::numeric_limits<std::int64_t>::max();
  bytes.clear();
  to_msgpack(out, bytes);
  CHECK(from_msgpack(bytes).status().what() == std::string("region (outside its memory)"));
}

TEST_CASE("handshake: a mismatch is layout_mismatch naming the field") {
  const HostPool a(kSpec, 10, 1);
  const LayoutHandshake local = a.describe();
  const auto differs = [&](auto edit, const char* field) {
    LayoutHandshake r = local;
    edit(r);
    r.compat_hash = compat_hash(r);
    const Status st = check_compatible(local, r);
    CHECK(st.code() == Errc::layout_mismatch);
    CHECK(std::string(st.what()) == field);
  };
  differs([](LayoutHandshake& r) { r.groups[0].block_size = 8; }, "block_size");
  differs([](LayoutHandshake& r) { r.groups[0].dtype = DType::bf16; }, "dtype");
  differs([](LayoutHandshake& r) { r.groups[0].layout = Layout::HND; }, "layout");
  differs([](LayoutHandshake& r) { r.groups[0].head_dim = 16; }, "head_dim");
  differs([](LayoutHandshake& r) { r.groups[0].layers = 2; }, "layers");
  differs([](LayoutHandshake& r) { r.groups[0].kind = AttentionKind::mla; }, "kind");
  differs([](LayoutHandshake& r) { r.id.hash_seed = 9; }, "hash_seed");
  differs([](LayoutHandshake& r) { r.id.hash_algorithm = "siphash128"; }, "hash_algorithm");
  differs([](LayoutHandshake& r) { r.groups[0].num_kv_heads = 8; }, "num_kv_heads (over every rank)");
  differs([](LayoutHandshake& r) { r.groups.push_back(r.groups[0]); }, "groups");
  differs([](LayoutHandshake& r) { r.groups[0].format.k.scales = Scales::tensor; }, "format.k.scales");
  differs([](LayoutHandshake& r) { r.groups[0].format.v.group = 32; }, "format.v.group");
  differs([](LayoutHandshake& r) { r.groups[0].format.v.minimum = true; }, "format.v.minimum");
  // A field changed after the hash was taken: the peer's hash does not match its fields.
  LayoutHandshake r = local;
  r.groups[0].block_size = 8;
  CHECK(std::string(check_compatible(local, r).what()).starts_with("compat_hash"));

  // Heads split by tensor parallelism: a slice needs HND and the right peer rank.
  const HostPool nhd2({.num_layers = 3, .num_kv_heads = 2, .head_dim = 8, .block_size = 4}, 10, 3);
  CHECK(std::string(check_compatible(nhd2.describe(0, 2), local).what()) == "layout (a head slice needs HND)");
  GeometrySpec h4 = kSpec, h2 = kSpec;
  h4.layout = h2.layout = Layout::HND;
  h2.num_kv_heads = 2;
  const HostPool p4(h4, 10, 4), p2(h2, 10, 5);
  CHECK(check_compatible(p2.describe(1, 2), p4.describe(0, 1)).ok());
  CHECK(std::string(check_compatible(p2.describe(1, 4), p4.describe(1, 2)).what()).starts_with("tp_rank"));
  CHECK(std::string(check_compatible(p4.describe(0, 1), p2.describe(1, 2)).what()).starts_with("num_kv_heads (a reader"));
}

TEST_CASE("plan: interleaved blocks coalesce into runs, and the memcpy round trip is byte-exact") {
  const HostPool remote(kSpec, 12, 1);
  HostPool local(kSpec, 12, 2);
  const TransferPlanner planner(local.describe(), remote.describe());
  REQUIRE(planner.status().ok());
  const std::vector<std::int32_t> rb{3, 4, 5, 9, 10}, lb{1, 2, 3, 7, 11};
  const GroupBlocks gb{0, rb, lb};
  std::vector<TransferDesc> plan;
  const auto bytes = planner.plan(std::span(&gb, 1), {}, plan);
  REQUIRE(bytes.ok());
  CHECK(*bytes == 5 * local.g.block_bytes());
  CHECK(plan.size() == 3);  // {3,4,5}->{1,2,3}, {9}->{7}, {10}->{11}: runs contiguous on both sides
  std::vector<TransferDesc> flat;
  REQUIRE(planner.plan(std::span(&gb, 1), {.coalesce = false}, flat).ok());
  CHECK(flat.size() == 5 * 3 * 2);  // block × layer × K|V
  run(plan);
  check_copied(local, lb, remote, rb, 4, 0);
  CHECK(same(local.at(4, 0, 0, 0, 0), HostPool(kSpec, 12, 2).at(4, 0, 0, 0, 0)));  // an unplanned block is untouched
}

TEST_CASE("plan: separate planes on one side, interleaved on the other, and the index form") {
  GeometrySpec sep = kSpec;
  sep.planes = KvPlanes::separate;
  const HostPool remote(kSpec, 12, 1);
  HostPool local(sep, 16, 2);
  const TransferPlanner planner(local.describe(), remote.describe());
  REQUIRE(planner.status().ok());
  CHECK(planner.num_plane_regions() == 6);
  const std::vector<std::int32_t> rb{1, 2, 3, 4}, lb{5, 6, 7, 8};
  const GroupBlocks gb{0, rb, lb};
  std::vector<TransferDesc> plan;
  REQUIRE(planner.plan(std::span(&gb, 1), {}, plan).ok());
  CHECK(plan.size() == 6 * 4);  // local runs of one plane meet remote pieces a block apart: nothing merges
  run(plan);
  check_copied(local, lb, remote, rb, 4, 0);

  // The index form names the same pieces in each side's prepared list.
  std::vector<std::int64_t> lids, rids;
  REQUIRE(planner.plan_ids(std::span(&gb, 1), {}, lids, rids).ok());
  std::vector<TransferDesc> ldl, rdl, flat;
  planner.dlist(true, ldl);
  planner.dlist(false, rdl);
  CHECK(ldl.size() == std::size_t(6 * 16));
  CHECK(rdl.size() == std::size_t(6 * 12));
  REQUIRE(planner.plan(std::span(&gb, 1), {.coalesce = false}, flat).ok());
  REQUIRE(lids.size() == flat.size());
  for (std::size_t k = 0; k < flat.size(); ++k) {
    CHECK(lids[k] % 16 == lb[k % 4]);  // plane-major on the local side: blocks inside planes
    CHECK(ldl[std::size_t(lids[k])].local == flat[k].local);
    CHECK(rdl[std::size_t(rids[k])].remote == flat[k].remote);
    CHECK(ldl[std::size_t(lids[k])].bytes == flat[k].bytes);
  }
}

TEST_CASE("plan: a decode rank with twice the tensor parallelism reads its half of the heads (HND)") {
  GeometrySpec h4 = kSpec, h2 = kSpec;
  h4.layout = h2.layout = Layout::HND;
  h2.num_kv_heads = 2;
  const HostPool remote(h4, 8, 1);
  for (std::int32_t rank = 0; rank < 2; ++rank) {
    HostPool local(h2, 8, 2);
    const TransferPlanner planner(local.describe(rank, 2), remote.describe(0, 1));
    REQUIRE(planner.status().ok());
    const std::vector<std::int32_t> rb{2, 3, 4}, lb{5, 6, 7};
    const GroupBlocks gb{0, rb, lb};
    std::vector<TransferDesc> plan;
    REQUIRE(planner.plan(std::span(&gb, 1), {}, plan).ok());
    CHECK(plan.size() == 3 * 6);  // a slice of each plane: nothing contiguous on the peer's side
    run(plan);
    check_copied(local, lb, remote, rb, 2, 2 * rank);
  }
}

TEST_CASE("plan: the suffix after a local prefix hit, and only the window of a sliding-window group") {
  const std::int32_t full_layers[] = {0, 2}, window_layers[] = {1, 3};
  const LayerGroupSpec groups[] = {{.kind = AttentionKind::full, .layers = full_layers, .num_kv_heads = 2, .head_dim = 8},
                                   {.kind = AttentionKind::sliding_window, .layers = window_layers, .num_kv_heads = 2,
                                    .head_dim = 8, .window = 8}};
  const LayerGroups lg = *LayerGroups::make({.groups = groups, .block_size = 4});
  std::vector<std::uint8_t> rpool(std::size_t(lg.page_bytes() * 32)), lpool(std::size_t(lg.page_bytes() * 32));
  for (std::size_t i = 0; i < rpool.size(); ++i) rpool[i] = std::uint8_t(i * 7 + 3);
  const auto hr = *describe_layout(lg, 32, reinterpret_cast<std::uint64_t>(rpool.data()), {});
  const auto hl = *describe_layout(lg, 32, reinterpret_cast<std::uint64_t>(lpool.data()), {});
  CHECK(hl.regions.size() == 4);  // one per (group, layer), K and V adjacent in the page
  const TransferPlanner planner(hl, hr);
  REQUIRE(planner.status().ok());
  // A 22-token sequence: 6 blocks per group. The decode side holds the first 2 full-attention blocks.
  const std::vector<std::int32_t> rfull{1, 2, 3, 4, 5, 6}, lfull{10, 11, 12, 13};
  const std::vector<std::int32_t> rwin{7, 8, 9, 10, 11, 12}, lwin{0, 0, 20, 21, 22, 23};  // nulls: out of window
  const GroupBlocks full{0, rfull, lfull, 2};
  std::vector<TransferDesc> plan;
  REQUIRE(planner.plan(std::span(&full, 1), {}, plan).ok());
  // Remote blocks 3..6 into local 10..13: a group's layers fill its pages, and both runs are consecutive.
  REQUIRE(plan.size() == 1);
  CHECK(plan[0].bytes == 4 * lg.page_bytes());
  CHECK(plan[0].remote == reinterpret_cast<std::uint64_t>(rpool.data()) + std::uint64_t(3 * lg.page_bytes()));
  const GroupBlocks win{1, rwin, lwin};
  REQUIRE(planner.plan(std::span(&win, 1), {.num_tokens = 22, .window_only = true}, plan).ok());
  // The next query (position 22) reads 15 .. 22: blocks 3, 4, 5.
  std::int64_t total = 0;
  for (const auto& d : plan) total += d.bytes;
  CHECK(total == 3 * 2 * (lg.token_bytes(1) / 2) * lg.block_size(1));
  for (const auto& d : plan) CHECK(d.local >= reinterpret_cast<std::uint64_t>(lpool.data()) + std::uint64_t(21 * lg.page_bytes()));
  // Without window_only the nulls would be read into: refused, naming them.
  CHECK(planner.plan(std::span(&win, 1), {}, plan).status().what() == std::string("local block"));
  CHECK(plan.empty());
}

TEST_CASE("plan: bad block lists are errors naming the value, and leave the output empty") {
  const HostPool remote(kSpec, 8, 1), local(kSpec, 8, 2);
  const TransferPlanner planner(local.describe(), remote.describe());
  const std::vector<std::int32_t> rb{1, 2, 3}, lb{4, 5};
  std::vector<TransferDesc> plan{{1, 2, 3}};
  const GroupBlocks short_local{0, rb, lb};
  CHECK(planner.plan(std::span(&short_local, 1), {}, plan).status().what() == std::string("local.size (remote.size - skip)"));
  CHECK(plan.empty());
  const GroupBlocks skip1{0, rb, lb, 1}, skip4{0, rb, lb, 4}, skip_neg{0, rb, lb, -1};
  CHECK(planner.plan(std::span(&skip1, 1), {}, plan).ok());
  CHECK(planner.plan(std::span(&skip4, 1), {}, plan).status().what() == std::string("skip"));
  CHECK(planner.plan(std::span(&skip_neg, 1), {}, plan).status().what() == std::string("skip"));
  const std::vector<std::int32_t> far{1, 8}, zero{0, 1};
  const GroupBlocks bad_remote{0, far, lb}, null_local{0, std::span(rb).first(2), zero};
  CHECK(planner.plan(std::span(&bad_remote, 1), {}, plan).status().what() == std::string("remote block"));
  CHECK(planner.plan(std::span(&null_local, 1), {}, plan).status().what() == std::string("local block"));
  const GroupBlocks bad_group{1, rb, lb, 1};
  CHECK(planner.plan(std::span(&bad_group, 1), {}, plan).status().what() == std::string("group"));
  const HostPool other({.num_layers = 3, .num_kv_heads = 4, .head_dim = 8, .block_size = 8}, 8, 3);
  const TransferPlanner mismatched(local.describe(), other.describe());
  CHECK(mismatched.status().code() == Errc::layout_mismatch);
  CHECK(mismatched.plan(std::span(&skip1, 1), {}, plan).status().code() == Errc::layout_mismatch);
}

TEST_CASE("handshake: a quantized pool's format travels, is checked on read, and must match") {
  const SideFormat k32{.scales = Scales::group, .group = 32, .minimum = true}, v64{.scales = Scales::group, .group = 64};
  const GeometrySpec q{.num_layers = 2, .num_kv_heads = 2, .head_dim = 64, .block_size = 4, .dtype = DType::int4, .format = {k32, v64}};
  const HostPool a(q, 6, 1), b(q, 6, 2);
  const LayoutHandshake ha = a.describe(), hb = b.describe();
  CHECK(ha.groups[0].format == q.format);
  CHECK(ha.regions[0].k_bytes == a.g.plane_bytes());  // codes and group entries move as one plane
  CHECK(check_compatible(ha, hb).ok());
  std::vector<std::uint8_t> bytes;
  to_msgpack(ha, bytes);
  const auto back = from_msgpack(bytes);
  REQUIRE(back.ok());
  CHECK(*back == ha);
  CHECK(check_compatible(hb, *back).ok());

  // The same codes with another scheme are another layout (value: the peer's, limit: ours).
  GeometrySpec other = q;
  other.format.k.group = 64;
  const HostPool c(other, 6, 3);
  CHECK(check_compatible(ha, c.describe()).message() == "layout_mismatch: format.k.group=64 (limit 32)");
  other = q;
  other.dtype = DType::int8;
  CHECK(check_compatible(ha, HostPool(other, 6, 4).describe()).message() == "layout_mismatch: dtype=int8 (limit int4)");  // names, not numbers

  // A format no Geometry would take is refused on read, naming the field.
  const auto read_with = [&](auto edit) {
    LayoutHandshake h = ha;
    edit(h.groups[0]);
    std::vector<std::uint8_t> out;
    to_msgpack(h, out);
    return from_msgpack(out).status().message();
  };
  CHECK(read_with([](GroupLayout& g) { g.format.k.group = 48; }) == "invalid_argument: format.k.group (16, 32, 64 or 128)=48 (limit 128)");
  CHECK(read_with([](GroupLayout& g) { g.format.v.scales = Scales::none; g.format.v.group = 0; }) ==
        "invalid_argument: format.v.scales (an integer code needs scales)=0 (limit 1)");
  CHECK(read_with([](GroupLayout& g) { g.format.k.scales = Scales(5); }) == "invalid_argument: format.k.scales=5 (limit 4)");
  CHECK(read_with([](GroupLayout& g) { g.dtype = DType(9); }) == "invalid_argument: dtype=9 (limit 8)");
  CHECK(read_with([](GroupLayout& g) { g.v_head_dim = 0; }) == "invalid_argument: format.v.scales (the group has no V plane)=3 (limit 0)");

  // A version 1 peer (groups without a format) is another wire version.
  bytes[16] = 1;  // the version follows the 14-field array header and the 15-byte tag
  CHECK(from_msgpack(bytes).status().message() == "layout_mismatch: wire_version=1 (limit 2)");
}
