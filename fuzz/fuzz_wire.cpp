// libFuzzer target: the wire formats read from untrusted bytes. A peer's
// handshake (from_msgpack) is either an error or a handshake that re-encodes
// to the same bytes and decodes to itself; when it describes a layout a
// planner accepts, plans over its first blocks stay within its pools'
// descriptors. Any byte string walked item by item by MsgpackReader never
// reads past its end (AddressSanitizer) and never fails without naming what
// it expected at an offset inside the input.
#include <kvcache/transfer/handshake_wire.hpp>
#include <kvcache/transfer/transfer_plan.hpp>
#include <kvcache/wire/msgpack.hpp>

#include <cstdio>
#include <cstdlib>
#include <span>
#include <vector>

#include "input.hpp"

namespace kv = kvcache;

namespace {
const auto need = fuzz_input::need_for("fuzz_wire");

// Reads one item of any kind (arrays to a bounded depth); false when none could be read.
bool walk(kv::MsgpackReader& r, int depth) {
  const std::size_t at = r.offset();
  if (r.nil()) return true;
  if (auto a = r.array("array"); a.ok()) {
    for (std::uint32_t i = 0; i < *a && depth < 16; ++i)
      if (!walk(r, depth + 1)) return false;
    return depth < 16;
  }
  if (r.boolean("bool").ok() || r.sint("int").ok() || r.uint("uint").ok() || r.float64("float").ok() || r.str("str").ok() ||
      r.bin("bin").ok())
    return true;
  need(r.offset() == at, "a failed read moved the position");
  return false;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::uint8_t> bytes(data, size);
  kv::MsgpackReader r(bytes);
  while (!r.done() && walk(r, 0)) {
  }
  need(r.offset() <= size, "read past the end");

  const auto h = kv::from_msgpack(bytes);
  if (!h.ok()) {
    need(h.status().code() == kv::Errc::invalid_argument || h.status().code() == kv::Errc::layout_mismatch, "error code");
    return 0;
  }
  std::vector<std::uint8_t> again;
  kv::to_msgpack(*h, again);
  const auto back = kv::from_msgpack(again);
  need(back.ok() && *back == *h, "a decoded handshake does not survive its own encoding");
  const kv::TransferPlanner planner(*h, *h);
  if (!planner.status().ok() || h->num_blocks < 3) return 0;
  const std::vector<std::int32_t> blocks{1, 2};
  const kv::GroupBlocks gb{0, blocks, blocks};
  std::vector<kv::TransferDesc> plan;
  const auto total = planner.plan(std::span(&gb, 1), {}, plan);
  need(total.ok(), "a plan between a layout and itself failed");
  std::int64_t sum = 0;
  for (const kv::TransferDesc& d : plan) {
    need(d.local == d.remote && d.bytes > 0, "a descriptor between a layout and itself moves elsewhere");
    sum += d.bytes;
  }
  need(sum == *total, "the plan's bytes");
  return 0;
}
