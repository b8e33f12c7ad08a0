// Disaggregated decode on a hybrid cache: a peer prefilled the prompt, and
// this cache admits it with every group's blocks pending (transfer/
// pending_imports.hpp has the token-paged form). An import's row is sealed:
// every call naming its handle is unknown_sequence until commit or abort,
// so nothing reserves into it, frees it or exports it to a kernel; its fresh
// blocks carry no hash, so no lookup finds them.
//
// Each group receives only what its next query reads: a full or MLA group
// every block past the local prefix hit; a sliding-window or chunked group
// only the blocks from skipped_blocks(prompt) on, with null entries before
// them, so the pool never holds a window's worth of dead pages for a long
// prompt; a cross group the encoder's blocks. When a window group's window
// lies wholly past the hit, the hit's window blocks are kept by a cache hold
// (not the row), so that abort can still hand the sequence back holding the
// hit, as admit() would have, and recompute only the rest.
#pragma once

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <span>
#include <vector>

#include "kvcache/core/block_hash.hpp"
#include "kvcache/pool/block_pool.hpp"
#include "kvcache/config.hpp"
#include "kvcache/groups/group_hits.hpp"
#include "kvcache/groups/group_rows.hpp"
#include "kvcache/groups/group_rule.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/status.hpp"
#include "kvcache/transfer/pending_imports.hpp"
#include "kvcache/transfer/transfer_plan.hpp"

KVCACHE_BEGIN_NAMESPACE

/// HybridCache::import() returns every cache's ImportPlan (num_blocks over every group, skip group 0's).
using HybridImportPlan [[deprecated("HybridCache::import returns ImportPlan, as every cache")]] = ImportPlan;

/// The import calls of HybridCache (which derives from it and befriends it).
template <class Cache>
class HybridImports {
 public:
  /// A sequence for `prompt` whose KV a peer computed: the prefix every group
  /// serves locally is shared as admit() shares it, and each group gets
  /// fresh blocks for what its next query reads past it (import_blocks()
  /// lists them), pending until commit_import() or abort_import(). All or
  /// nothing, with admit()'s errors; opt.extras must be empty (a hybrid cache
  /// hashes no multimodal inputs); opt.max_new >= 0 promises blocks_needed(prompt, max_new),
  /// which must fit the free pool less every earlier promise, as admit()'s.
  Result<ImportPlan> import(std::span<const std::int32_t> prompt, const ImportOptions& opt = {}) {
    Cache& c = self();
    const auto len = std::int64_t(prompt.size());
    if (auto st = c.check_prompt(prompt); !st) return st;
    if (!opt.extras.empty())
      return Status{Errc::invalid_argument, "extras (a hybrid cache hashes no multimodal inputs)", std::int64_t(opt.extras.size()), 0};
    std::int64_t promise = 0;
    if (opt.max_new >= 0) {
      auto need = c.blocks_needed(len, opt.max_new);
      if (!need) return need.status();
      promise = *need;
    }
    if (c.free_.empty()) return no_free_handle(c.cfg_.max_sequences);
    const std::int64_t h = c.match(prompt, opt.key);
    std::int64_t need = 0, shared = 0;  // shared: hit blocks other sequences hold, drawing nothing from the pool
    for (std::int32_t g = 0; g < c.groups(); ++g) {
      const Span x = span_of(g, h, len);
      for (std::int64_t j = x.hit_first; j < x.hits; ++j) {
        const bool held = c.pool_.ref_count(c.hits_.block(g, j)) > 0;
        need += !held, shared += held;
      }
      need += x.end - x.first;
    }
    if (need > c.pool_.num_free()) return Status{Errc::out_of_blocks, "n_blocks", need, c.pool_.num_free()};
    if (opt.max_new >= 0)
      if (const std::int64_t room = c.pool_.num_free() - c.promised_blocks() + shared; promise > room)
        return Status{Errc::out_of_blocks, "max_new (the lifetime need past the free pool less promises)", promise, room};

    // Window hits past which the window lies go into one hold (group order), the rest into the rows.
    c.held_.clear();
    for (std::int32_t g = 0; g < c.groups(); ++g)
      if (const Span x = span_of(g, h, len); x.first > x.hits)
        for (std::int64_t j = x.hit_first; j < x.hits; ++j) c.held_.push_back(c.hits_.block(g, j));
    std::uint64_t hold = 0;
    if (!c.held_.empty()) hold = *c.holds_.hold(c.pool_, c.held_);  // valid hits, retained: cannot fail
    const SeqId id = *c.add_sequence(opt.key);
    auto& s = c.seqs_[id.index];
    c.queries_.queried(len, h);
    for (std::int32_t g = 0; g < c.groups(); ++g) {  // every group's hits retained before any allocation recycles one
      const Span x = span_of(g, h, len);
      c.scratch_.clear();
      for (std::int64_t j = x.first > x.hits ? x.hits : x.hit_first; j < x.hits; ++j) {
        (void)c.pool_.retain(c.hits_.block(g, j));
        c.scratch_.push_back(c.hits_.block(g, j));
      }
      c.rows_[std::size_t(g)].adopt(id.index, std::int32_t(x.first > x.hits ? x.first : x.hit_first), c.scratch_);  // nulls below
    }
    c.selection_.adopted(c.rows_, id.index);
    std::int32_t fresh = 0;
    for (std::int32_t g = 0; g < c.groups(); ++g) {
      GroupRows& rows = c.rows_[std::size_t(g)];
      const Span x = span_of(g, h, len);
      c.scratch_.resize(std::size_t(x.end - x.first));
      (void)c.pool_.allocate(c.scratch_);  // counted above
      for (const BlockId b : c.scratch_) c.owner_[std::size_t(b)] = std::int8_t(g);
      rows.append(id.index, c.scratch_);
      fresh += std::int32_t(c.scratch_.size());
      const GroupRule& r = rows.rule();
      if (!r.caches()) continue;
      c.prefix_.adopt(g, id.index, std::int32_t(x.hits), c.hits_.chain(g, s.key));
      if (!c.cfg_.prefix_caching) continue;
      const auto row = rows.row(id.index);  // the received tokens' ids, what commit publishes (once per rule)
      if (c.prefix_.keeper(g) == g)
        for (std::int64_t p = x.first * r.block_size; p < len; ++p) c.prefix_.keep(row[std::size_t(r.div(p))], r.mod(p), prompt[std::size_t(p)]);
      if (x.first > x.hits) {  // window blocks never received: their chain hashes now, from the prompt
        BlockHash at = c.prefix_.chain(g, id.index);
        for (std::int64_t j = x.hits; j < x.first; ++j)
          at = c.hits_.hash(at, prompt.subspan(std::size_t(j * r.block_size), std::size_t(r.block_size)), s.key.extra);
        c.prefix_.skip(g, id.index, std::int32_t(x.first), at);
      }
    }
    s.computed = h;
    s.reserved = len;
    if (c.cfg_.prefill_chunk == 0) s.ahead = len;  // as admit(): after an abort, the recompute is the prompt's
    c.promises_.record(id.index, promise);
    s.sealed = true;
    const BlockHash digest = prompt_digest(c.hits_.hasher(), prompt, opt.key);  // what commit_import checks
    return ImportPlan{imports_.add(id, std::int32_t(len), std::int32_t(h), hold, digest), std::int32_t(h), std::int32_t(span_of(0, h, len).first), fresh};
  }

  /// Group g's blocks of import `id` to receive: `local` and `skip` of a
  /// GroupBlocks (local[i] receives the peer's block skip + i; the caller
  /// sets `remote`, the peer's row of group g from its first block). unknown_job
  /// for an id not in flight; invalid_argument for a bad group. Valid until commit or abort.
  Result<GroupBlocks> import_blocks(std::uint64_t id, std::int32_t g) const {
    const Cache& c = self();
    auto e = imports_.find(id);
    if (!e) return e.status();
    if (g < 0 || g >= c.groups()) return Status{Errc::invalid_argument, "group", g, c.groups() - 1};
    const Span x = span_of(g, e->cached, e->tokens);
    return GroupBlocks{g, {}, c.rows_[std::size_t(g)].row(e->seq.index).subspan(std::size_t(x.first)), std::int32_t(x.first)};
  }

  /// The names of group g's blocks of import `id`, as import_blocks(id,
  /// g).local lists them: the keys commit_import() publishes them under,
  /// hashed from the prompt the import was given, so a tier load that finds
  /// its sources by them (GroupTiers::plan_onboard) copies exactly what the
  /// commit will name. Returns how many: every received full block (a last
  /// partial block has no name; a cross group's blocks none). unknown_job for
  /// an id not in flight; invalid_argument for a bad group or a cache without
  /// prefix caching (nothing is named); buffer_too_small when out is shorter.
  Result<std::int32_t> import_keys(std::uint64_t id, std::int32_t g, std::span<BlockHash> out) const {
    const Cache& c = self();
    auto e = imports_.find(id);
    if (!e) return e.status();
    if (g < 0 || g >= c.groups()) return Status{Errc::invalid_argument, "group", g, c.groups() - 1};
    if (!c.cfg_.prefix_caching) return Status{Errc::invalid_argument, "prefix_caching (off: no block is named)", 0, 1};
    const GroupRule& r = c.rows_[std::size_t(g)].rule();
    if (!r.caches()) return 0;
    const Span x = span_of(g, e->cached, e->tokens);
    const std::int64_t n = std::max<std::int64_t>(0, e->tokens / r.block_size - x.first);
    if (std::int64_t(out.size()) < n) return Status{Errc::buffer_too_small, "out", std::int64_t(out.size()), n};
    const auto row = c.rows_[std::size_t(c.prefix_.keeper(g))].row(e->seq.index);  // where g's ids are kept
    BlockHash h = c.prefix_.resume(g, e->seq.index);
    for (std::int64_t j = 0; j < n; ++j) {
      h = c.hits_.hash(h, c.prefix_.ids(row[std::size_t(x.first + j)], r.block_size), c.seqs_[e->seq.index].key.extra);
      out[std::size_t(j)] = group_key(h, g);
    }
    return std::int32_t(n);
  }

  /// The transfer of import `id` landed: the sequence (its tokens all
  /// computed) is handed out, and its received full blocks are published
  /// under the prompt's chain hashes (window blocks it never received are not
  /// published, though their tokens stay in the chain). As on every cache,
  /// the prompt must be the one imported: a commit naming another import's
  /// id would hand out a sequence holding another prompt's K/V. unknown_job
  /// for an id not in flight; invalid_argument naming prompt.size for another
  /// length, "prompt (not the tokens imported)" for other tokens, extras for
  /// any (a hybrid cache hashes no multimodal inputs). Nothing changes on an error.
  Result<ImportCommit> commit_import(std::uint64_t id, std::span<const std::int32_t> prompt, std::span<const ExtraKey> extras = {}) {
    const Cache& c = self();
    auto e = imports_.find(id);
    if (!e) return e.status();
    if (std::int64_t(prompt.size()) != e->tokens) return Status{Errc::invalid_argument, "prompt.size", std::int64_t(prompt.size()), e->tokens};
    if (!extras.empty())
      return Status{Errc::invalid_argument, "extras (a hybrid cache hashes no multimodal inputs)", std::int64_t(extras.size()), 0};
    if (prompt_digest(c.hits_.hasher(), prompt, c.seqs_[e->seq.index].key) != e->digest)
      return Status{Errc::invalid_argument, "prompt (not the tokens imported)", std::int64_t(prompt.size()), e->tokens};
    return land(id);
  }
  /// commit_import(id, prompt) without the check that the prompt is the one imported.
  [[deprecated("name the prompt imported: commit_import(id, prompt), as on every cache")]]
  Result<ImportCommit> commit_import(std::uint64_t id) { return land(id); }

  /// The transfer of import `id` failed or timed out: its received blocks go
  /// back unpublished, and the sequence is handed out holding the cached
  /// prefix in every group (as admit() leaves it). unknown_job for an id not in flight.
  Result<ImportAbort> abort_import(std::uint64_t id) {
    Cache& c = self();
    auto e = imports_.find(id);
    if (!e) return e.status();
    const std::uint32_t i = e->seq.index;
    auto& s = c.seqs_[i];
    const std::span<const BlockId> held = c.holds_.blocks_of(e->hold);
    std::size_t k = 0;
    for (std::int32_t g = 0; g < c.groups(); ++g) {
      GroupRows& rows = c.rows_[std::size_t(g)];
      const Span x = span_of(g, e->cached, e->tokens);
      rows.cut(c.pool_, i, std::int32_t(x.hits));  // a cross group starts over: the recompute runs the encoder
      if (x.first <= x.hits) continue;
      const auto hits = held.subspan(k, std::size_t(x.hits - x.hit_first));  // the window hits the hold kept
      k += hits.size();
      for (const BlockId b : hits) (void)c.pool_.retain(b);
      rows.adopt(i, std::int32_t(x.hit_first), hits);
    }
    s.sealed = false;
    s.reserved = e->cached;
    c.prefix_.clear_gaps(i);
    end(*e);
    return ImportAbort{e->seq, e->cached, e->tokens - e->cached};
  }

 private:
  // GroupTiers lands an onboard it planned from the cache's own lookup: no engine id to confuse.
  template <class>
  friend class GroupTiers;
  // Import `id` (in flight) landed: the commit itself.
  Result<ImportCommit> land(std::uint64_t id) {
    Cache& c = self();
    auto e = imports_.find(id);
    if (!e) return e.status();
    const std::uint32_t i = e->seq.index;
    c.seqs_[i].sealed = false;
    for (GroupRows& rows : c.rows_)  // the hit blocks that left the window
      if (rows.rule().frees()) rows.free_below(c.pool_, i, std::int32_t(rows.rule().skipped_blocks(e->tokens)));
    (void)c.mark_computed(i, e->tokens);  // fresh blocks, unhashed: publishing cannot fail
    std::int32_t published = 0;
    for (std::int32_t g = 0; g < c.groups(); ++g) {
      const Span x = span_of(g, e->cached, e->tokens);
      const auto row = c.rows_[std::size_t(g)].row(i);
      if (c.rows_[std::size_t(g)].rule().caches())
        for (std::int64_t j = x.first; j < std::int64_t(row.size()); ++j) published += c.pool_.has_hash(row[std::size_t(j)]);
    }
    c.selection_.received(c.rows_, i, e->cached);  // no page_bounds_update saw the received K
    end(*e);
    return ImportCommit{e->seq, published};
  }

 public:
  /// The imports in flight.
  const PendingImports& imports() const noexcept { return imports_; }

  /// Every live block of sequence s, group by group (what a sender's TransferHolds::hold pins).
  Status live_blocks(SeqId s, std::vector<BlockId>& out) const {
    const Cache& c = self();
    if (auto st = c.validate(s); !st) return st;
    out.clear();
    for (const GroupRows& rows : c.rows_) (void)rows.copy_live(s.index, std::back_inserter(out));  // holes hold nothing
    return {};
  }

  /// The sealed rows are the imports' rows, and their fresh blocks are
  /// unhashed and held by the row alone (and any hold); invariant_violated
  /// otherwise (check_invariants() runs it).
  Status check_imports() const {
    const Cache& c = self();
    std::int32_t sealed = 0;
    for (const auto& s : c.seqs_) sealed += s.live && s.sealed;
    if (sealed != imports_.size()) return Status{Errc::invariant_violated, "import (sealed rows)", sealed, imports_.size()};
    std::vector<std::int32_t> held(imports_.size() == 0 ? 0 : std::size_t(c.pool_.capacity()));
    c.holds_.add_refs(held);
    for (const PendingImports::Entry& e : imports_.entries()) {
      if (!c.seqs_[e.seq.index].sealed) return Status{Errc::invariant_violated, "import (row not sealed)", std::int64_t(e.id), 0};
      for (std::int32_t g = 0; g < c.groups(); ++g) {
        const auto row = c.rows_[std::size_t(g)].row(e.seq.index);
        for (std::size_t j = std::size_t(span_of(g, e.cached, e.tokens).first); j < row.size(); ++j)
          if (c.pool_.has_hash(row[j]) || c.pool_.ref_count(row[j]) != 1 + held[std::size_t(row[j])])
            return Status{Errc::invariant_violated, "import (a received block published or shared)", row[j], g};
      }
    }
    return {};
  }

 protected:
  PendingImports imports_;  ///< The imports in flight (the cache's constructor reserves room for one per handle).

 private:
  // Group g's row of an import of `len` tokens with a hit of h: hits
  // [hit_first, hits) found, fresh blocks [first, end) received.
  struct Span {
    std::int64_t hit_first = 0, hits = 0, first = 0, end = 0;
  };
  Span span_of(std::int32_t g, std::int64_t h, std::int64_t len) const noexcept {
    const GroupRule& r = self().rows_[std::size_t(g)].rule();
    if (!r.caches()) return {0, 0, 0, r.row_blocks(len)};
    const std::int64_t hits = h / r.block_size;
    return {r.hit_first_block(h), hits, std::max(hits, r.skipped_blocks(len)), r.row_blocks(len)};
  }
  // Import e is over: its hold (if any) is released and the entry forgotten.
  void end(const PendingImports::Entry& e) {
    if (e.hold != 0) (void)self().holds_.release(self().pool_, e.hold);
    imports_.remove(e.id);
  }
  Cache& self() noexcept { return static_cast<Cache&>(*this); }
  const Cache& self() const noexcept { return static_cast<const Cache&>(*this); }
};

KVCACHE_END_NAMESPACE
