// The tiers' jobs in flight (tiers.hpp): each job's moves with what its
// target's events name, the pins a staging load keeps, and the epoch that
// makes a job planned before a reset unknown. A job's id is its epoch
// (high 32 bits) and its JobTable serial: completing it twice, or after a
// reset, finds nothing. Nothing here touches a tier: Tiers plans, pins and
// publishes; this keeps the books.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvcache/config.hpp"
#include "kvcache/core/block_hash.hpp"
#include "kvcache/core/job_table.hpp"
#include "kvcache/status.hpp"
#include "kvcache/tiers/tier_plan.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Jobs planned between tiers and not yet completed.
class TierJobs {
 public:
  /// What a move's block is: its hash, the hash before it and its layer group (-1: none).
  struct Moved {
    BlockHash hash;           ///< The block's hash.
    BlockHash parent;         ///< The hash before it in its chain (for the target's stored event).
    std::int32_t group = -1;  ///< Its layer group (-1: none).
    friend bool operator==(const Moved&, const Moved&) = default;
  };
  /// One job in flight.
  struct Job {
    std::uint64_t id = 0;             ///< What complete() takes: the epoch, then the serial.
    Tier from = Tier::device;         ///< Source tier.
    Tier to = Tier::host;             ///< Target tier.
    std::vector<BlockMove> moves;     ///< The moves the engine runs.
    std::vector<Moved> blocks;        ///< Of each move, what it carries.
    std::vector<std::int32_t> pins;   ///< Target blocks a staging load skipped, pinned until it completes.
    std::int32_t skipped = 0;         ///< Blocks of the plan's chain left out.
    friend bool operator==(const Job&, const Job&) = default;
  };

  /// Room for `max_jobs` jobs in flight.
  explicit TierJobs(std::int32_t max_jobs) : jobs_(max_jobs) {}

  std::int32_t size() const noexcept { return jobs_.size(); }  ///< Jobs in flight.
  std::uint32_t epoch() const noexcept { return epoch_; }      ///< Resets so far.

  /// capacity_exceeded naming max_jobs when no job can be added.
  Status room() const noexcept {
    if (jobs_.full()) return Status{Errc::capacity_exceeded, "max_jobs", jobs_.capacity(), jobs_.capacity()};
    return {};
  }
  /// A job in a free slot (room() checked), its lists emptied with their capacity kept.
  Job& add(Tier from, Tier to) noexcept {
    const std::uint32_t serial = jobs_.add();
    Job& j = *jobs_.find(serial);
    j.id = (std::uint64_t(epoch_) << 32) | serial, j.from = from, j.to = to, j.skipped = 0;
    j.moves.clear(), j.blocks.clear(), j.pins.clear();
    return j;
  }
  /// What the engine sees of job j.
  static TierJob view(const Job& j) noexcept { return TierJob{j.id, j.from, j.to, j.moves, j.skipped}; }

  /// Job `id` in flight, with failed(i) set for each move listed in `failed`
  /// (each a move's index, at most once): unknown_job for an id never
  /// planned, completed, or planned before a reset; invalid_argument for a
  /// bad index. Changes nothing but the marks.
  Result<Job*> completing(std::uint64_t id, std::span<const std::int32_t> failed) {
    Job* j = std::uint32_t(id >> 32) == epoch_ ? jobs_.find(std::uint32_t(id)) : nullptr;
    if (j == nullptr) return Status{Errc::unknown_job, "job", std::int64_t(id & 0xffffffffu), epoch_};
    const auto n = std::int32_t(j->moves.size());
    bad_.assign(std::size_t(n), 0);
    for (const std::int32_t f : failed) {
      if (n == 0) return Status{Errc::invalid_argument, "failed (the job has no moves)", f, 0};
      if (f < 0 || f >= n) return Status{Errc::invalid_argument, "failed (a move index)", f, n - 1};
      if (bad_[std::size_t(f)]) return Status{Errc::invalid_argument, "failed (an index listed twice)", f, n - 1};
      bad_[std::size_t(f)] = 1;
    }
    return j;
  }
  /// Whether move i of the job being completed failed.
  bool failed(std::size_t i) const noexcept { return bad_[i] != 0; }
  /// Marks move i of the job being completed failed (a disk slot that did not verify).
  void fail(std::size_t i) noexcept { bad_[i] = 1; }
  /// The job is done: its id is never found again.
  void remove(const Job& j) noexcept { jobs_.remove(std::uint32_t(j.id)); }

  /// f(job) for each job in flight.
  template <class F>
  void for_each(F&& f) const {
    jobs_.for_each([&](std::uint32_t, const Job& j) { f(j); });
  }
  /// Every job is abandoned (the caller undid what they hold): a new epoch.
  void clear() noexcept {
    jobs_.clear();
    ++epoch_;
  }

  /// The same jobs in flight, ids to come and epoch.
  friend bool operator==(const TierJobs& a, const TierJobs& b) { return a.jobs_ == b.jobs_ && a.epoch_ == b.epoch_; }

 private:
  JobTable<Job> jobs_;  // max_jobs slots, ids never given twice
  std::uint32_t epoch_ = 0;
  std::vector<char> bad_;  // completing()'s failed moves (scratch)
};

KVCACHE_END_NAMESPACE
