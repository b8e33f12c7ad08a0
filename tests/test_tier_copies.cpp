// The bytes of the tiers: blocks round-trip device -> host -> device and
// device -> host -> disk -> device byte for byte on the host backend (every
// layout: NHD and HND, interleaved and separate planes, MLA's one plane;
// host memory always holds whole blocks contiguously), through a real file
// of sealed slots. The disk file's checks: a flipped byte, a torn trailer, a
// block in the wrong slot or from another layout is a miss, and a restarted
// engine finds its disk blocks again from their trailers, each in its layer group.
#include <catch2/catch.hpp>

#include <kvcache/kernels/block_copy.hpp>
#include <kvcache/tiers/disk_layout.hpp>
#include <kvcache/tiers/tiers.hpp>

#include <fcntl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

using namespace kvcache;

namespace {

struct TempFile {
  std::string path;
  int fd = -1;
  TempFile() {
    char name[] = "/tmp/kvcache_disk_tier_XXXXXX";
    fd = mkstemp(name);
    path = name;
  }
  ~TempFile() {
    if (fd >= 0) close(fd);
    std::remove(path.c_str());
  }
};

std::vector<BlockHash> chain(std::uint64_t seed, std::int32_t n) {
  std::vector<BlockHash> c;
  for (std::int32_t i = 0; i < n; ++i) c.push_back({seed * 7919u + std::uint64_t(i) + 1, ~seed});
  return c;
}

// The engine's side of a disk job, straight between the file and the host
// pool (whole blocks, contiguous): a store writes each block and its sealed
// tail with one pwritev (seal_tail: no bounce copy), a load reads each slot
// back with one preadv into the host block and a tail buffer, and then
// complete_disk_load verifies every slot before it publishes it. Returns
// what the completion returned (the leading moves that landed intact).
Result<std::int32_t> run_disk_job(Tiers& t, const TierJob& j, const std::vector<BlockHash>& c, const DiskLayout& d, int fd,
                                  const Geometry& hg, std::vector<std::byte>& host) {
  const auto block = [&](std::int32_t b) { return std::span(host).subspan(std::size_t(b * hg.block_bytes()), std::size_t(hg.block_bytes())); };
  std::vector<std::vector<std::byte>> tails(j.moves.size(), std::vector<std::byte>(std::size_t(d.tail_bytes())));
  for (std::size_t m = 0; m < j.moves.size(); ++m) {
    const BlockMove& mv = j.moves[m];
    const std::span<std::byte> payload = j.to == Tier::disk ? block(mv.src) : block(mv.dst);
    iovec io[2] = {{payload.data(), payload.size()}, {tails[m].data(), tails[m].size()}};
    if (j.to == Tier::disk) {
      REQUIRE(d.seal_tail(payload, tails[m], mv.dst, c[std::size_t(mv.index)], t.host().group(mv.src)).ok());
      REQUIRE(pwritev(fd, io, 2, off_t(d.offset(mv.dst))) == ssize_t(d.slot_bytes()));
    } else {
      REQUIRE(preadv(fd, io, 2, off_t(d.offset(mv.src))) == ssize_t(d.slot_bytes()));
    }
  }
  if (j.to == Tier::disk) return t.complete(j.id);
  return t.complete_disk_load(j.id, d, [&](const BlockMove& mv) {
    const auto m = std::size_t(&mv - j.moves.data());
    return LandedSlot{block(mv.dst), tails[m]};
  });
}

void copy_blocks(const PoolView& src, const PoolView& dst, const TierJob& j) {
  std::vector<BlockCopy> pairs;
  for (const BlockMove& m : j.moves) pairs.push_back({m.src, m.dst});
  REQUIRE(block_copy_host({src, dst, pairs.data(), std::int32_t(pairs.size())}).ok());
}

}  // namespace

TEST_CASE("tiers move blocks byte for byte: device -> host -> device and device -> host -> disk -> device, every layout") {
  std::mt19937_64 rng(Catch::rngSeed() ^ 77);
  const Layout layouts[] = {Layout::NHD, Layout::HND};
  const KvPlanes planes[] = {KvPlanes::interleaved, KvPlanes::separate};
  const DType types[] = {DType::f16, DType::f32, DType::bf16, DType::fp8_e4m3};
  for (int v = 0; v < 16; ++v) {
    const bool mla = v % 5 == 4;
    GeometrySpec spec{.num_layers = 3, .num_kv_heads = mla ? 1 : 2, .head_dim = mla ? 24 : 8, .block_size = 4,
                      .dtype = types[v % 4], .layout = layouts[v % 2], .planes = planes[(v / 2) % 2], .v_head_dim = mla ? 0 : -1};
    CAPTURE(v, mla);
    const Geometry dg = *Geometry::make(spec);
    GeometrySpec host_spec = spec;
    host_spec.planes = KvPlanes::interleaved;  // host memory: whole blocks, every layer contiguous
    const Geometry hg = *Geometry::make(host_spec);
    constexpr std::int32_t kDevice = 12, kHost = 6, kDisk = 8;
    std::vector<std::byte> device(std::size_t(*dg.pool_bytes(kDevice))), host(std::size_t(*hg.pool_bytes(kHost)));
    for (auto& b : device) b = std::byte(rng());
    const std::vector<std::byte> original = device;
    const PoolView dv = *make_pool_view(dg, device.data(), kDevice), hv = *make_pool_view(hg, host.data(), kHost);
    Tiers t({.host_blocks = kHost, .disk_blocks = kDisk, .block_size = 4});
    const DiskLayout d = *DiskLayout::make(hg.block_bytes(), kDisk, layout_digest(host_spec));
    TempFile file;
    REQUIRE(ftruncate(file.fd, off_t(d.file_bytes())) == 0);

    // Device blocks 1..4 hold a 4-block chain: offload them to host, then to disk.
    const auto c = chain(std::uint64_t(v), 4);
    const std::vector<std::int32_t> src{1, 2, 3, 4};
    auto down = t.plan_store(Tier::device, Tier::host, c, src);
    REQUIRE(down.ok());
    copy_blocks(dv, hv, *down);
    REQUIRE(t.complete(down->id).ok());
    std::vector<std::int32_t> slots;
    for (const auto& h : c) slots.push_back(t.host().find(h));
    auto to_disk = t.plan_store(Tier::host, Tier::disk, c, slots);
    REQUIRE(to_disk.ok());
    REQUIRE(*run_disk_job(t, *to_disk, c, d, file.fd, hg, host) == 4);

    // Host -> device into other device blocks (5..8): the same bytes.
    auto up = t.plan_load(Tier::host, Tier::device, c, std::vector<std::int32_t>{5, 6, 7, 8});
    REQUIRE(up.ok());
    copy_blocks(hv, dv, *up);
    REQUIRE(*t.complete(up->id) == 4);
    for (std::int32_t i = 0; i < 4; ++i)
      REQUIRE(for_each_block_piece(dg, kDevice, 1 + i, [&](std::int64_t off, std::int64_t bytes) {
                const std::int64_t to = off + (*dg.strides(kDevice)).block * 4;  // block 5 + i
                CHECK(std::memcmp(device.data() + to, original.data() + off, std::size_t(bytes)) == 0);
              }).ok());

    // Host memory forgets them (other chains fill it); then disk -> host -> device into blocks 8 .. 11.
    for (std::uint64_t s = 100; s < 103; ++s) {
      const auto other = chain(s + std::uint64_t(v) * 10, 2);
      auto j = t.plan_store(Tier::device, Tier::host, other, std::vector<std::int32_t>{9, 10});
      REQUIRE(j.ok());
      copy_blocks(dv, hv, *j);
      REQUIRE(t.complete(j->id).ok());
    }
    std::vector<Tier> where(4);
    REQUIRE(t.lookup(c, 0, 100, where)->disk == 4);
    auto stage = t.plan_load(Tier::disk, Tier::host, c);
    REQUIRE(stage.ok());
    REQUIRE(stage->moves.size() == 4);
    CHECK(t.complete(stage->id).status().what() == std::string("job (a disk load: complete_disk_load checks its slots)"));
    REQUIRE(*run_disk_job(t, *stage, c, d, file.fd, hg, host) == 4);
    std::fill(device.begin(), device.end(), std::byte{0});
    auto back = t.plan_load(Tier::host, Tier::device, c, std::vector<std::int32_t>{8, 9, 10, 11});
    REQUIRE(back.ok());
    copy_blocks(hv, dv, *back);
    REQUIRE(*t.complete(back->id) == 4);
    for (std::int32_t i = 0; i < 4; ++i) {
      std::vector<std::byte> a, b;
      REQUIRE(for_each_block_piece(dg, kDevice, 1 + i, [&](std::int64_t off, std::int64_t bytes) {
                a.insert(a.end(), original.begin() + off, original.begin() + off + bytes);
              }).ok());
      REQUIRE(for_each_block_piece(dg, kDevice, 8 + i, [&](std::int64_t off, std::int64_t bytes) {
                b.insert(b.end(), device.begin() + off, device.begin() + off + bytes);
              }).ok());
      CHECK(a == b);
    }
    CHECK(t.check_invariants().ok());
  }
}

TEST_CASE("a disk slot with a flipped byte, a torn trailer, another slot's block or another layout is a miss") {
  const GeometrySpec spec{.num_layers = 2, .num_kv_heads = 2, .head_dim = 16, .block_size = 8};
  const Geometry g = *Geometry::make(spec);
  const DiskLayout d = *DiskLayout::make(g.block_bytes(), 4, layout_digest(spec));
  CHECK(d.slot_bytes() % 4096 == 0);
  CHECK(d.slot_bytes() >= g.block_bytes() + DiskLayout::trailer_bytes);
  std::vector<std::byte> image(std::size_t(d.slot_bytes()));
  for (std::size_t i = 0; i < image.size(); ++i) image[i] = std::byte(i * 31 + 7);
  const BlockHash h{42, 43};
  REQUIRE(d.seal(image, 2, h).ok());
  CHECK(d.verify(image, 2, h).ok());
  CHECK(*d.sealed_hash(image, 2) == h);
  for (const std::size_t at : {std::size_t(0), std::size_t(g.block_bytes() / 2), std::size_t(g.block_bytes() - 1)}) {
    auto bad = image;
    bad[at] ^= std::byte{0x10};
    CHECK(d.verify(bad, 2, h).what() == std::string("checksum"));
  }
  auto torn = image;
  torn[image.size() - 3] ^= std::byte{1};
  CHECK(d.verify(torn, 2, h).what() == std::string("trailer"));
  CHECK(d.verify(image, 1, h).what() == std::string("slot"));
  CHECK(d.verify(image, 2, BlockHash{42, 44}).what() == std::string("hash"));
  GeometrySpec other = spec;
  other.layout = Layout::HND;
  const DiskLayout e = *DiskLayout::make(g.block_bytes(), 4, layout_digest(other));
  CHECK(e.verify(image, 2, h).what() == std::string("digest"));
  // Two int8 formats in groups of 16, with and without a minimum: the digest tells them apart (codes read
  // with the other's entries would be wrong values of the right size).
  GeometrySpec with_min = spec, without_min = spec;
  with_min.dtype = without_min.dtype = DType::int8;
  with_min.format = {{.scales = Scales::group, .group = 16, .minimum = true}, {.scales = Scales::group, .group = 16, .minimum = true}};
  without_min.format = {{.scales = Scales::group, .group = 16}, {.scales = Scales::group, .group = 16}};
  auto quantized = image;
  REQUIRE(DiskLayout::make(g.block_bytes(), 4, layout_digest(with_min))->seal(quantized, 2, h).ok());
  CHECK(DiskLayout::make(g.block_bytes(), 4, layout_digest(without_min))->verify(quantized, 2, h).what() == std::string("digest"));
  // The trailer-only forms: the block's bytes where they are, the slot's tail (or only its trailer) apart.
  const auto payload = std::span(image).first(std::size_t(d.block_bytes()));
  const auto tail = std::span(image).subspan(std::size_t(d.block_bytes()));
  CHECK(std::int64_t(tail.size()) == d.tail_bytes());
  CHECK(d.verify(payload, tail, 2, h).ok());
  CHECK(d.verify(payload, tail.last(DiskLayout::trailer_bytes), 2, h).ok());
  CHECK(d.verify(payload, tail.first(100), 2, h).what() == std::string("tail (tail_bytes, or the trailer's 64)"));
  CHECK(d.verify(payload.first(10), tail, 2, h) == Status{Errc::buffer_too_small, "payload", 10, d.block_bytes()});
  std::vector<std::byte> tail2(std::size_t(d.tail_bytes()), std::byte{0x55});
  REQUIRE(d.seal_tail(payload, tail2, 2, h).ok());
  CHECK(std::equal(tail2.begin(), tail2.end(), tail.begin()));  // the same bytes seal() wrote
  CHECK(d.seal_tail(payload, std::span(tail2).first(8), 2, h) == Status{Errc::buffer_too_small, "tail", 8, d.tail_bytes()});
  // Checksums and hashes are bits: the messages write them in hexadecimal, never as negative numbers.
  auto flipped = image;
  flipped[0] ^= std::byte{1};
  const std::string msg = d.verify(flipped, 2, h).message();
  CHECK(msg.rfind("invalid_argument: checksum=0x", 0) == 0);
  CHECK(msg.find('-') == std::string::npos);
  std::vector<std::byte> zeros(image.size());
  CHECK(d.sealed_hash(zeros, 0).status().what() == std::string("trailer"));  // never written
  CHECK(d.verify(std::span(image).first(100), 2, h) == Status{Errc::buffer_too_small, "image", 100, d.slot_bytes()});
  CHECK(d.seal(image, 4, h) == Status{Errc::invalid_argument, "slot", 4, 3});
  CHECK(DiskLayout::make(0, 4, 1).status() == Status{Errc::invalid_argument, "block_bytes", 0, 1});
  CHECK(DiskLayout::make(64, 4, 1, 1000).status().what() == std::string("align (a power of two, 64 or more)"));
  CHECK(DiskLayout::make(64, 4, 1, 512)->slot_bytes() == 512);
}

TEST_CASE("a flipped byte on disk fails the load at that block, and a restarted engine finds its disk blocks again") {
  const GeometrySpec spec{.num_layers = 1, .num_kv_heads = 2, .head_dim = 8, .block_size = 4, .dtype = DType::f32};
  const Geometry g = *Geometry::make(spec);
  constexpr std::int32_t kHost = 8, kDisk = 6;
  std::vector<std::byte> host(std::size_t(*g.pool_bytes(kHost)));
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = std::byte(i * 13 + 1);
  const DiskLayout d = *DiskLayout::make(g.block_bytes(), kDisk, layout_digest(spec));
  TempFile file;
  REQUIRE(ftruncate(file.fd, off_t(d.file_bytes())) == 0);
  const auto c = chain(9, 4);
  std::vector<std::int32_t> disk_slots;
  {
    Tiers t({.host_blocks = kHost, .disk_blocks = kDisk, .block_size = 4});
    auto in = t.plan_store(Tier::device, Tier::host, c, std::vector<std::int32_t>{1, 2, 3, 4});
    REQUIRE(t.complete(in->id).ok());  // (the host bytes are already there)
    std::vector<std::int32_t> slots;
    for (const auto& h : c) slots.push_back(t.host().find(h));
    auto j = t.plan_store(Tier::host, Tier::disk, c, slots);
    for (const BlockMove& m : j->moves) disk_slots.push_back(m.dst);
    REQUIRE(*run_disk_job(t, *j, c, d, file.fd, g, host) == 4);
  }
  // Block 2's slot gets a flipped byte on disk.
  std::byte b{};
  REQUIRE(pread(file.fd, &b, 1, off_t(d.offset(disk_slots[2]) + 5)) == 1);
  b ^= std::byte{0x40};
  REQUIRE(pwrite(file.fd, &b, 1, off_t(d.offset(disk_slots[2]) + 5)) == 1);

  // A new engine: scan the file's trailers, restore the disk tier.
  Tiers t({.host_blocks = kHost, .disk_blocks = kDisk, .block_size = 4});
  std::vector<std::int32_t> found_slots;
  std::vector<BlockHash> found;
  std::vector<std::byte> image(std::size_t(d.slot_bytes()));
  for (std::int32_t s = 0; s < kDisk; ++s) {
    REQUIRE(pread(file.fd, image.data(), image.size(), off_t(d.offset(s))) == ssize_t(image.size()));
    if (auto h = d.sealed_hash(image, s)) found_slots.push_back(s), found.push_back(*h);
  }
  CHECK(found.size() == 4);
  REQUIRE(t.restore_disk(found_slots, found).ok());
  CHECK(t.restore_disk(found_slots, found).code() == Errc::blocks_in_use);
  std::vector<Tier> where(4);
  CHECK(t.lookup(c, 0, 100, where)->disk == 4);
  auto up = t.plan_load(Tier::disk, Tier::host, c);
  REQUIRE(up.ok());
  CHECK(*run_disk_job(t, *up, c, d, file.fd, g, host) == 2);  // the library verified each slot: block 2 a miss, never wrong KV
  CHECK(t.lookup(c, 0, 100, where)->host == 2);
  CHECK(t.host().find(c[2]) == -1);
  CHECK(t.host().find(c[3]) >= 0);  // landed intact, past the hit
  CHECK(t.disk().find(c[2]) == -1);  // not offered again
  CHECK(t.check_invariants().ok());
  Tiers fresh({.host_blocks = 2, .disk_blocks = 2});
  const std::int32_t twice[] = {1, 1};
  const BlockHash two[] = {{1, 1}, {2, 2}};
  CHECK(fresh.restore_disk(twice, two) == Status{Errc::invalid_argument, "slots (listed twice)", 1, 0});
  CHECK(Tiers({.host_blocks = 2}).restore_disk(twice, two).what() == std::string("disk_blocks (no disk tier)"));
}

TEST_CASE("a restarted disk tier names each block's layer group again, from its trailer") {
  // Two layer groups of 4- and 8-token blocks (as GroupTiers gives the tiers), every slot holding one page.
  const GeometrySpec spec{.num_layers = 1, .num_kv_heads = 2, .head_dim = 8, .block_size = 8, .dtype = DType::f32};
  const Geometry g = *Geometry::make(spec);
  constexpr std::int32_t kHost = 8, kDisk = 6;
  const std::int32_t sizes[] = {4, 8};
  std::vector<std::byte> host(std::size_t(*g.pool_bytes(kHost)));
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = std::byte(i * 7 + 3);
  const DiskLayout d = *DiskLayout::make(g.block_bytes(), kDisk, layout_digest(spec));
  TempFile file;
  REQUIRE(ftruncate(file.fd, off_t(d.file_bytes())) == 0);
  const auto c = chain(5, 4);
  const std::int32_t group_of[] = {0, 1, 1, 0};
  {
    Tiers t({.host_blocks = kHost, .disk_blocks = kDisk, .block_size = 16}, sizes);
    std::vector<Offload> blocks;
    for (std::int32_t i = 0; i < 4; ++i)
      blocks.push_back({.block = i + 1, .hash = c[std::size_t(i)], .parent = {}, .group = group_of[i]});
    auto in = t.plan_store(Tier::device, Tier::host, blocks);
    REQUIRE(in.ok());
    REQUIRE(t.complete(in->id).ok());
    std::vector<std::int32_t> slots;
    for (const auto& h : c) slots.push_back(t.host().find(h));
    auto j = t.plan_store(Tier::host, Tier::disk, c, slots);
    REQUIRE(j.ok());
    REQUIRE(*run_disk_job(t, *j, c, d, file.fd, g, host) == 4);  // each slot sealed with its host block's group
  }
  // A new engine scans its file: each intact trailer names the block's hash and group.
  Tiers t({.host_blocks = kHost, .disk_blocks = kDisk, .block_size = 16, .event_capacity = 64}, sizes);
  std::vector<std::int32_t> slots, groups;
  std::vector<BlockHash> hashes;
  std::vector<std::byte> image(std::size_t(d.slot_bytes()));
  for (std::int32_t s = 0; s < kDisk; ++s) {
    REQUIRE(pread(file.fd, image.data(), image.size(), off_t(d.offset(s))) == ssize_t(image.size()));
    const auto found = d.sealed(image, s);
    if (!found) continue;
    CHECK(*d.sealed(std::span(image).last(DiskLayout::trailer_bytes), s) == *found);  // the trailer alone says the same
    slots.push_back(s), hashes.push_back(found->hash), groups.push_back(found->group);
  }
  REQUIRE(slots.size() == 4);
  // Bad lists are typed errors that change nothing.
  const Tiers before = t;
  const std::vector<std::int32_t> short_groups(groups.begin(), groups.begin() + 2);
  CHECK(t.restore_disk(slots, hashes, short_groups) == Status{Errc::invalid_argument, "groups (one per slot, or none)", 2, 4});
  auto outside = groups;
  outside[1] = 2;
  CHECK(t.restore_disk(slots, hashes, outside) == Status{Errc::invalid_argument, "groups", 2, 1});
  outside[1] = -2;
  CHECK(t.restore_disk(slots, hashes, outside) == Status{Errc::invalid_argument, "groups", -2, 1});
  CHECK(t == before);
  REQUIRE(t.restore_disk(slots, hashes, groups).ok());
  for (std::size_t i = 0; i < slots.size(); ++i) {
    const auto k = std::size_t(std::find(c.begin(), c.end(), hashes[i]) - c.begin());
    REQUIRE(k < c.size());
    CHECK(t.disk().group(slots[i]) == group_of[k]);
  }
  // The restored blocks' events name their group and its block size, and so does a block staged back to host memory.
  std::vector<BlockEvent> ev(64);
  std::int32_t n = t.drain_events(Tier::disk, ev);
  REQUIRE(n == 4);
  for (std::int32_t e = 0; e < n; ++e) {
    const BlockEvent& x = ev[std::size_t(e)];
    const auto k = std::size_t(std::find(c.begin(), c.end(), x.hash) - c.begin());
    REQUIRE(k < c.size());
    CHECK(x.group == group_of[k]);
    CHECK(x.block_size == sizes[group_of[k]]);
  }
  auto up = t.plan_load(Tier::disk, Tier::host, c);
  REQUIRE(up.ok());
  REQUIRE(*run_disk_job(t, *up, c, d, file.fd, g, host) == 4);
  n = t.drain_events(Tier::host, ev);
  REQUIRE(n == 4);
  for (std::int32_t e = 0; e < n; ++e) {
    const auto k = std::size_t(std::find(c.begin(), c.end(), ev[std::size_t(e)].hash) - c.begin());
    CHECK(ev[std::size_t(e)].group == group_of[k]);
  }
  CHECK(t.check_invariants().ok());
  // Without groups (a file written before groups, or a plain tier) every block names none.
  Tiers plain({.host_blocks = kHost, .disk_blocks = kDisk, .block_size = 16});
  REQUIRE(plain.restore_disk(slots, hashes).ok());
  for (const std::int32_t s : slots) CHECK(plain.disk().group(s) == -1);
  // A group below -1 is not sealed; a trailer of version 01 (no group) reads as unsealed: a miss, never a block.
  CHECK(d.seal(image, 0, c[0], -2) == Status{Errc::invalid_argument, "group", -2, -1});
  REQUIRE(d.seal(image, 0, c[0], 1).ok());
  DiskTrailer old;
  std::memcpy(&old, image.data() + image.size() - sizeof old, sizeof old);
  old.magic = 0x31304b4c42564b4bULL;  // "KKVBLK01"
  std::memcpy(image.data() + image.size() - sizeof old, &old, sizeof old);
  CHECK(d.sealed(image, 0).status().what() == std::string("trailer"));
  CHECK(d.sealed(image, 6).status() == Status{Errc::invalid_argument, "slot", 6, 5});
}
