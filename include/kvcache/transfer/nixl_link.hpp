// The NIXL adapter in C++: one rank's NIXL agent, its KV pool registered
// once, and the peers it has met; kvcache plans, NIXL moves the bytes. The
// same design and wire form as the Python kvcache.nixl.NixlLink, so a C++
// rank and a Python rank meet each other: a peer's message is an 8-byte
// little-endian length, NIXL's agent metadata, then the rank's handshake
// (to_msgpack). The layouts are checked before NIXL meets the peer, and each
// side's prepared descriptor list (one descriptor per plane region and block:
// TransferPlanner::dlist) is built once per peer, as vLLM's NixlConnector does.
//
// Optional: this header needs NIXL's C++ headers and libnixl, which the PyPI
// wheels do not ship; kvcache.hpp does not include it, and CMake builds its
// test only where it finds nixl.h. The agent runs NIXL's progress thread by
// default, as NIXL's Python agent (and so vLLM) does: a READ completes while
// the peer's process does not poll. NixlLink itself is not thread-safe: the
// engine calls it from one thread.
#pragma once

#if !__has_include(<nixl.h>)
#error "kvcache/transfer/nixl_link.hpp is the NIXL adapter: it needs NIXL's C++ headers (nixl.h) and libnixl"
#else

#include <nixl.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvcache/config.hpp"
#include "kvcache/status.hpp"
#include "kvcache/transfer/handshake_wire.hpp"
#include "kvcache/transfer/layout_handshake.hpp"
#include "kvcache/transfer/transfer_plan.hpp"

KVCACHE_BEGIN_NAMESPACE

/// NIXL's segment type for memory of kind k (device memory is VRAM; host memory, pinned or not, DRAM).
inline nixl_mem_t nixl_segment(MemoryKind k) noexcept { return k == MemoryKind::device ? VRAM_SEG : DRAM_SEG; }

/// A READ in flight (NixlLink::read), until poll() sees it end.
struct NixlTransfer {
  nixlXferReqH* handle = nullptr;  ///< NIXL's request; null once released.
};

/// One rank's NIXL agent with its pool registered, and the peers it has met.
class NixlLink {
 public:
  /// An agent named `name` (empty: the handshake's engine_id) with one
  /// backend ("UCX"; `params` its init parameters, e.g.
  /// {"ucx_error_handling_mode", "none"} for shared memory on one machine),
  /// every region of mine.memory registered once (each by its MemoryKind:
  /// a host pool must say so in LayoutIdentity::memory, or NIXL registers it
  /// as device memory and fails). progress_thread: NIXL's own thread moves
  /// transfers forward (the default, as NIXL's Python nixl_agent_config);
  /// without it a peer's READ of this rank's blocks waits until this rank
  /// polls. status() says whether it worked.
  explicit NixlLink(const LayoutHandshake& mine, std::string name = {}, const std::string& backend = "UCX",
                    const nixl_b_params_t& params = {}, bool progress_thread = true)
      : mine_(mine),
        name_(name.empty() ? mine.id.engine_id : std::move(name)),
        agent_(name_, nixlAgentConfig(progress_thread)) {
    nixlBackendH* b = nullptr;
    if (auto st = call("nixl createBackend", agent_.createBackend(backend, params, b)); !st) {
      status_ = st;
      return;
    }
    for (const MemoryRegion& r : mine_.memory) {
      nixl_reg_dlist_t reg(nixl_segment(r.kind));
      reg.addDesc(nixlBlobDesc(std::uintptr_t(r.addr), std::size_t(r.bytes), std::uint64_t(r.device), ""));
      if (auto st = call("nixl registerMem", agent_.registerMem(reg)); !st) {
        status_ = st;
        return;
      }
      registered_.push_back(std::move(reg));
    }
  }
  NixlLink(const NixlLink&) = delete;
  NixlLink& operator=(const NixlLink&) = delete;
  /// Releases the prepared lists and deregisters the pool.
  ~NixlLink() {
    for (auto& [key, p] : peers_) {
      if (p->local) (void)agent_.releasedDlistH(p->local);
      if (p->remote) (void)agent_.releasedDlistH(p->remote);
    }
    for (const auto& reg : registered_) (void)agent_.deregisterMem(reg);
  }

  /// Whether the agent, its backend and the registrations were made (transfer_failed naming the NIXL call).
  const Status& status() const noexcept { return status_; }
  /// The agent's name.
  const std::string& name() const noexcept { return name_; }

  /// What a peer's add_peer() takes: NIXL's agent metadata and this rank's handshake.
  Result<std::vector<std::uint8_t>> metadata() const {
    nixl_blob_t md;
    if (auto st = call("nixl getLocalMD", agent_.getLocalMD(md)); !st) return st;
    std::vector<std::uint8_t> out(8);
    const auto n = std::uint64_t(md.size());
    for (int i = 0; i < 8; ++i) out[std::size_t(i)] = std::uint8_t(n >> (8 * i));
    out.insert(out.end(), md.begin(), md.end());
    std::vector<std::uint8_t> hs;
    to_msgpack(mine_, hs);
    out.insert(out.end(), hs.begin(), hs.end());
    return out;
  }

  /// Meets a peer from its metadata(): its handshake is read and checked
  /// against this rank's (layout_mismatch names the field) before NIXL loads
  /// its metadata; then both sides' prepared lists are built. Returns the
  /// peer's agent name. A malformed message is invalid_argument and a
  /// mismatch layout_mismatch, before NIXL sees the metadata; a NIXL failure is transfer_failed.
  Result<std::string> add_peer(std::span<const std::uint8_t> message) {
    if (!status_) return status_;
    if (message.size() < 8) return Status{Errc::invalid_argument, "peer message (bytes)", std::int64_t(message.size()), 8};
    std::uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = n << 8 | message[std::size_t(i)];
    if (n > message.size() - 8) return Status{Errc::invalid_argument, "peer message (metadata bytes)", std::int64_t(n & INT64_MAX),
                                              std::int64_t(message.size() - 8)};
    auto remote = from_msgpack(message.subspan(8 + n));
    if (!remote) return remote.status();
    auto peer = std::make_unique<Peer>(Peer{TransferPlanner(mine_, *remote), nullptr, nullptr, {}});
    if (!peer->planner.status()) return peer->planner.status();
    std::string agent;
    const nixl_blob_t md(reinterpret_cast<const char*>(message.data() + 8), std::size_t(n));
    if (auto st = call("nixl loadRemoteMD", agent_.loadRemoteMD(md, agent)); !st) return st;
    peer->name = agent;
    if (auto st = prepare(*peer, true); !st) return st;
    if (auto st = prepare(*peer, false); !st) return release(*peer), st;
    if (auto it = peers_.find(agent); it != peers_.end()) release(*it->second);
    peers_[agent] = std::move(peer);
    return agent;
  }

  /// Posts a READ of `peer`'s blocks into this rank's, as the planner plans
  /// `blocks` with `opt`: descriptor ids on the prepared lists (prepared), or
  /// one request of coalesced descriptors. `notify` (non-empty) reaches the
  /// peer when the read is done (TransferHolds::consumed on its side).
  /// unknown_job for a peer never met; the planner's errors; transfer_failed naming the NIXL call.
  Result<NixlTransfer> read(const std::string& peer, std::span<const GroupBlocks> blocks, const TransferOptions& opt,
                            const std::string& notify = {}, bool prepared = true) {
    const auto it = peers_.find(peer);
    if (it == peers_.end()) return Status{Errc::unknown_job, "peer (never met)", 0, std::int64_t(peers_.size())};
    Peer& p = *it->second;
    nixl_opt_args_t args;
    if (!notify.empty()) args.notif = notify;
    nixlXferReqH* req = nullptr;
    if (prepared) {
      if (auto st = p.planner.plan_ids(blocks, opt, lids_, rids_); !st) return st;
      std::vector<int> li(lids_.size()), ri(rids_.size());
      for (std::size_t i = 0; i < lids_.size(); ++i) {
        if (lids_[i] > INT_MAX || rids_[i] > INT_MAX) return Status{Errc::invalid_argument, "descriptor id (past int)", std::max(lids_[i], rids_[i]), INT_MAX};
        li[i] = int(lids_[i]), ri[i] = int(rids_[i]);
      }
      if (auto st = call("nixl makeXferReq", agent_.makeXferReq(NIXL_READ, p.local, li, p.remote, ri, req, &args)); !st) return st;
    } else {
      if (auto st = p.planner.plan(blocks, opt, plan_); !st) return st.status();
      nixl_xfer_dlist_t local(nixl_segment(mine_.id.memory)), remote(nixl_segment(p.remote_memory));
      for (const TransferDesc& d : plan_) {
        local.addDesc(nixlBasicDesc(std::uintptr_t(d.local), std::size_t(d.bytes), std::uint64_t(mine_.id.device)));
        remote.addDesc(nixlBasicDesc(std::uintptr_t(d.remote), std::size_t(d.bytes), std::uint64_t(p.remote_device)));
      }
      if (auto st = call("nixl createXferReq", agent_.createXferReq(NIXL_READ, local, remote, p.name, req, &args)); !st) return st;
    }
    const nixl_status_t posted = agent_.postXferReq(req);
    if (posted != NIXL_SUCCESS && posted != NIXL_IN_PROG) {
      (void)agent_.releaseXferReq(req);
      return Status{Errc::transfer_failed, "nixl postXferReq", std::int64_t(posted), 0};
    }
    return NixlTransfer{req};
  }

  /// Whether transfer t is done: false while in progress; true once it
  /// completed (t released); transfer_failed (t released) when it failed.
  Result<bool> poll(NixlTransfer& t) {
    if (t.handle == nullptr) return Status{Errc::unknown_job, "transfer (released)", 0, 0};
    const nixl_status_t s = agent_.getXferStatus(t.handle);
    if (s == NIXL_IN_PROG) return false;
    (void)agent_.releaseXferReq(t.handle);
    t.handle = nullptr;
    if (s != NIXL_SUCCESS) return Status{Errc::transfer_failed, "nixl getXferStatus", std::int64_t(s), 0};
    return true;
  }

  /// Notifications received since the last call: (peer, message) pairs appended to out.
  Status notifications(std::vector<std::pair<std::string, std::string>>& out) {
    nixl_notifs_t got;
    if (auto st = call("nixl getNotifs", agent_.getNotifs(got)); !st) return st;
    for (auto& [agent, msgs] : got)
      for (auto& m : msgs) out.emplace_back(agent, std::move(m));
    return {};
  }

  /// NIXL's agent, for what this class does not wrap.
  nixlAgent& agent() noexcept { return agent_; }

 private:
  struct Peer {
    TransferPlanner planner;
    nixlDlistH* local = nullptr;
    nixlDlistH* remote = nullptr;
    std::string name;
    MemoryKind remote_memory = MemoryKind::device;
    std::int32_t remote_device = 0;
  };
  static Status call(const char* what, nixl_status_t s) {
    return s == NIXL_SUCCESS ? Status{} : Status{Errc::transfer_failed, what, std::int64_t(s), 0};
  }
  // Builds one side's prepared list: every plane region's every block, in id order.
  Status prepare(Peer& p, bool local_side) {
    std::vector<TransferDesc> d;
    p.planner.dlist(local_side, d);
    const LayoutHandshake& h = local_side ? mine_ : remote_of(p);
    nixl_xfer_dlist_t list(nixl_segment(h.id.memory));
    for (const TransferDesc& x : d)
      list.addDesc(nixlBasicDesc(std::uintptr_t(local_side ? x.local : x.remote), std::size_t(x.bytes), std::uint64_t(h.id.device)));
    if (local_side) return call("nixl prepXferDlist (local)", agent_.prepXferDlist(list, p.local));
    p.remote_memory = h.id.memory, p.remote_device = h.id.device;
    return call("nixl prepXferDlist (remote)", agent_.prepXferDlist(p.name, list, p.remote));
  }
  const LayoutHandshake& remote_of(const Peer& p) const noexcept { return p.planner.remote(); }
  void release(Peer& p) {
    if (p.local) (void)agent_.releasedDlistH(p.local);
    if (p.remote) (void)agent_.releasedDlistH(p.remote);
    p.local = p.remote = nullptr;
  }

  LayoutHandshake mine_;
  std::string name_;
  nixlAgent agent_;
  Status status_;
  std::vector<nixl_reg_dlist_t> registered_;
  std::map<std::string, std::unique_ptr<Peer>> peers_;
  std::vector<std::int64_t> lids_, rids_;  // scratch of read()
  std::vector<TransferDesc> plan_;
};

KVCACHE_END_NAMESPACE

#endif  // __has_include(<nixl.h>)
