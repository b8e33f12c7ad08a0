// Sequences whose KV a peer is still writing (disaggregated decode). An
// import makes a row: the blocks the local prefix cache already held, then
// fresh blocks the transfer fills. Until commit the row's handle is not
// given out, so nothing can reserve into it, evict from it or export it to a
// kernel; its fresh blocks carry no hash, so no prefix lookup finds them; and
// they are in use, so no allocation recycles them. commit() publishes them
// and hands out the handle; abort() returns them and says what to recompute.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "kvcache/core/block_hash.hpp"
#include "kvcache/pool/block_holds.hpp"
#include "kvcache/pool/block_pool.hpp"
#include "kvcache/config.hpp"
#include "kvcache/table/page_table.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// How import() admits a remote sequence (as admit()'s options).
struct ImportOptions {
  PrefixKey key{};  ///< The sequence's salt and extra, as the peer hashed them.
  std::span<const ExtraKey> extras{};  ///< Multimodal inputs: positions and content hashes.
  std::int64_t max_new = -1;  ///< As AdmitOptions::max_new: the lifetime need promised in the ledger (-1: none).
};

/// What import() set up (every cache's; import_blocks(id, g) lists group g's blocks to receive).
struct ImportPlan {
  std::uint64_t id = 0;  ///< The import, for import_blocks(), commit_import(), abort_import().
  std::int32_t cached_tokens = 0;  ///< Prompt tokens the local prefix cache served in every group (whole blocks): not transferred.
  /// The remote sequence's leading blocks not read, in group 0 (a single-group
  /// cache's only one: cached_tokens / block_size; TransferOptions::skip);
  /// each group's is import_blocks(id, g).skip.
  std::int32_t skip = 0;
  std::int32_t num_blocks = 0;  ///< Local blocks to receive, over every group (Cache<>: its blocks buffer's first num_blocks).
};

/// What commit_import() did.
struct ImportCommit {
  SeqId seq{};  ///< The sequence, now usable (its length: the prompt's).
  std::int32_t published = 0;  ///< Hashes that entered the prefix cache.
};

/// What abort_import() did.
struct ImportAbort {
  SeqId seq{};  ///< The sequence, now usable, holding the cached prefix only.
  std::int32_t cached_tokens = 0;  ///< Tokens it holds: the rest of the prompt is recomputed from here.
  std::int32_t recompute = 0;  ///< Prompt tokens to compute again (reserve them on seq).
};

/// The imports in flight, by id (never reused); at most one per sequence handle.
class PendingImports {
 public:
  /// One import in flight.
  struct Entry {
    std::uint64_t id = 0;  ///< Its id.
    SeqId seq{};  ///< Its row.
    std::int32_t tokens = 0;  ///< The prompt's tokens.
    std::int32_t cached = 0;  ///< Of which the local prefix cache served.
    std::uint64_t hold = 0;  ///< A cache hold the import keeps beside its row (0: none; HybridCache's window hits).
    BlockHash digest{};  ///< prompt_digest of the prompt imported (Cache<>: its commit must name the same tokens).
    friend constexpr bool operator==(const Entry&, const Entry&) = default;
  };

  PendingImports() = default;
  /// Room for `capacity` imports (the cache's sequence handles).
  explicit PendingImports(std::int32_t capacity) { entries_.reserve(std::size_t(capacity)); }

  /// Imports in flight.
  std::int32_t size() const noexcept { return std::int32_t(entries_.size()); }
  /// The imports in flight, oldest first.
  const std::vector<Entry>& entries() const noexcept { return entries_; }
  /// Records an import; returns its id (capacity is the caller's: one per handle).
  std::uint64_t add(SeqId s, std::int32_t tokens, std::int32_t cached, std::uint64_t hold = 0, const BlockHash& digest = {}) noexcept {
    entries_.push_back({++next_, s, tokens, cached, hold, digest});  // within the reserved capacity
    return next_;
  }
  /// The entry of `id`, or unknown_job naming it.
  Result<Entry> find(std::uint64_t id) const noexcept {
    for (const Entry& e : entries_)
      if (e.id == id) return e;
    return Status{Errc::unknown_job, "import", std::int64_t(id & 0x7fffffffffffffffULL), std::int64_t(next_)};
  }
  /// Forgets `id` (found before).
  void remove(std::uint64_t id) noexcept {
    std::erase_if(entries_, [id](const Entry& e) { return e.id == id; });
  }
  /// True when s is an import's row.
  bool pending(SeqId s) const noexcept {
    return std::any_of(entries_.begin(), entries_.end(), [s](const Entry& e) { return e.seq == s; });
  }

  /// Each import's row is sealed, holds its prompt's tokens, and its received
  /// blocks are unpublished and in no other row (a transfer's hold may keep
  /// them too); no other row is sealed; invariant_violated otherwise.
  Status check(const PageTable& t, const BlockPool& pool, const BlockHolds& holds) const {
    std::int32_t sealed = 0;
    t.for_each_stream([&](SeqId s) { sealed += t.sealed(s); });
    if (sealed != size()) return Status{Errc::invariant_violated, "import (sealed rows)", sealed, size()};
    std::vector<std::int32_t> held(entries_.empty() ? 0 : std::size_t(pool.capacity()));
    holds.add_refs(held);
    for (const Entry& e : entries_) {
      if (!t.sealed(e.seq)) return Status{Errc::invariant_violated, "import (row not sealed)", std::int64_t(e.id), 0};
      if (t.tokens_unchecked(e.seq) != e.tokens)
        return Status{Errc::invariant_violated, "import (row length)", t.tokens_unchecked(e.seq), e.tokens};
      const auto blocks = t.blocks_unchecked(e.seq);
      for (std::size_t b = std::size_t(e.cached / t.block_size()); b < blocks.size(); ++b)
        if (pool.has_hash(blocks[b]) || pool.ref_count(blocks[b]) != 1 + held[std::size_t(blocks[b])])
          return Status{Errc::invariant_violated, "import (a received block published or shared)", blocks[b], 0};
    }
    return {};
  }

  friend bool operator==(const PendingImports& a, const PendingImports& b) { return a.entries_ == b.entries_ && a.next_ == b.next_; }

 private:
  std::vector<Entry> entries_;
  std::uint64_t next_ = 0;
};

KVCACHE_END_NAMESPACE
