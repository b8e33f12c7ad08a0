// Disaggregated decode on a token-paged cache (Cache<>): a peer prefilled
// the prompt, and this cache admits it with its fresh blocks pending
// (transfer/pending_imports.hpp keeps the imports in flight;
// cache/hybrid_imports.hpp is the layer-group form, with the same calls).
// The row is sealed until commit or abort: every call naming its handle is
// unknown_sequence, so nothing reserves into it, evicts from it or exports
// it to a kernel; its fresh blocks carry no hash, so no lookup finds them.
#pragma once

#include <cstdint>
#include <span>

#include "kvcache/core/block_hash.hpp"
#include "kvcache/pool/block_pool.hpp"
#include "kvcache/cache/hooks.hpp"
#include "kvcache/config.hpp"
#include "kvcache/table/page_table_edits.hpp"
#include "kvcache/prefix/prefix_cache.hpp"
#include "kvcache/prefix/prefix_sharing.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/status.hpp"
#include "kvcache/transfer/pending_imports.hpp"
#include "kvcache/transfer/transfer_plan.hpp"

KVCACHE_BEGIN_NAMESPACE

/// The import calls of the token-paged cache (which derives from it and befriends it).
template <class Cache>
class TokenImports {
 public:
  /// Room for one import per sequence handle.
  explicit TokenImports(std::int32_t max_sequences) : imports_(max_sequences) {}

  /// A sequence for `prompt` whose KV a peer computed: the cached prefix is
  /// shared as admit() shares it, and fresh blocks for the rest are pending
  /// until commit_import() or abort_import(); import_blocks(id) lists them,
  /// as on every cache. All or nothing, with admit()'s errors.
  Result<ImportPlan> import(std::span<const std::int32_t> prompt, const ImportOptions& opt = {}) noexcept {
    return import_row(prompt, opt, nullptr);
  }
  /// import(prompt, opt), the fresh blocks also copied to blocks[0 .. num_blocks) (buffer_too_small when short).
  Result<ImportPlan> import(std::span<const std::int32_t> prompt, std::span<BlockId> blocks, const ImportOptions& opt = {}) noexcept {
    return import_row(prompt, opt, &blocks);
  }
  /// One group of layers: every layer's rows are the same (a hybrid cache has several).
  static constexpr std::int32_t groups() noexcept { return 1; }
  /// The blocks of import `id` to receive, as a GroupBlocks of group 0 (the
  /// only one): local[i] receives the peer's block skip + i; the caller sets
  /// `remote`. unknown_job for an id not in flight; invalid_argument for
  /// another group. Valid until commit or abort.
  Result<GroupBlocks> import_blocks(std::uint64_t id, std::int32_t g = 0) const noexcept {
    const Cache& c = self();
    auto e = imports_.find(id);
    if (!e) return e.status();
    if (g != 0) return Status{Errc::invalid_argument, "group", g, 0};
    const std::int32_t skip = e->cached / c.block_size();
    return GroupBlocks{0, {}, c.table_.blocks_unchecked(e->seq).subspan(std::size_t(skip)), skip};
  }
  /// The transfer of import `id` landed: its blocks are published from
  /// `prompt` and the sequence is handed out. The prompt and extras must be
  /// the ones imported (the import kept their digest): other tokens would
  /// publish the peer's K/V under another prompt's hashes. unknown_job for an
  /// id not in flight; invalid_argument naming prompt.size for another
  /// length, "prompt (not the tokens imported)" for other tokens or extras.
  Result<ImportCommit> commit_import(std::uint64_t id, std::span<const std::int32_t> prompt,
                                     std::span<const ExtraKey> extras = {}) noexcept {
    Cache& c = self();
    auto e = imports_.find(id);
    if (!e) return e.status();
    if (std::int64_t(prompt.size()) != e->tokens) return Status{Errc::invalid_argument, "prompt.size", std::int64_t(prompt.size()), e->tokens};
    if (auto st = PrefixSharing::check_extras(extras); !st) return st;
    if (prompt_digest(c.hasher_, prompt, c.table_.key_unchecked(e->seq), extras) != e->digest)
      return Status{Errc::invalid_argument, "prompt (not the tokens imported)", std::int64_t(prompt.size()), e->tokens};
    PageTableEdits::unseal(c.table_, e->seq);
    auto published = c.publish(e->seq, prompt, extras);  // checked: it cannot fail now
    imports_.remove(id);
    c.notify(hooks::imported, e->seq, e->tokens - e->cached);  // selection: the received pages' bounds are stale
    return ImportCommit{e->seq, published.value_or(0)};
  }
  /// The transfer of import `id` failed or timed out: its received blocks go
  /// back unpublished, and the sequence is handed out with the cached prefix
  /// only. unknown_job for an id not in flight.
  Result<ImportAbort> abort_import(std::uint64_t id) noexcept {
    Cache& c = self();
    auto e = imports_.find(id);
    if (!e) return e.status();
    PageTableEdits::unseal(c.table_, e->seq);
    (void)c.table_.truncate(c.pool_, e->seq, e->tokens - e->cached);  // no participant saw those tokens
    imports_.remove(id);
    return ImportAbort{e->seq, e->cached, e->tokens - e->cached};
  }
  /// The imports in flight.
  const PendingImports& imports() const noexcept { return imports_; }

 protected:
  PendingImports imports_;  ///< The imports in flight.

 private:
  // import(): the row with the hit shared and fresh blocks for the rest (copied to *copy), sealed.
  Result<ImportPlan> import_row(std::span<const std::int32_t> prompt, const ImportOptions& opt, std::span<BlockId>* copy) noexcept {
    Cache& c = self();
    auto plan = c.admit_plan(prompt, {.key = opt.key, .extras = opt.extras, .max_new = opt.max_new}, -1);
    if (!plan) return plan.status();
    if (copy && std::int64_t(copy->size()) < plan->fresh)
      return Status{Errc::buffer_too_small, "blocks", std::int64_t(copy->size()), plan->fresh};
    const SeqId s = PrefixSharing::adopt(c.table_, c.pool_, opt.key, c.prefix_.hits(plan->hit.blocks));
    const std::int32_t cached = plan->hit.blocks * c.block_size(), n = std::int32_t(prompt.size()) - cached;
    c.prefix_.adopted(s, std::int64_t(prompt.size()), cached);
    c.notify(hooks::adopted, s, plan->hit.blocks);
    if (opt.max_new >= 0) c.prefix_.ledger().record(s.index, plan->lifetime);
    if (copy) (void)PageTableEdits::append_fresh(c.table_, c.pool_, s, n, *copy);  // the plan checked room and blocks
    else (void)PageTableEdits::append_fresh(c.table_, c.pool_, s, n);
    PageTableEdits::seal(c.table_, s);  // no call names the row until commit or abort, a guessed handle neither
    const BlockHash digest = prompt_digest(c.hasher_, prompt, opt.key, opt.extras);
    return ImportPlan{imports_.add(s, std::int32_t(prompt.size()), cached, 0, digest), cached, plan->hit.blocks, plan->fresh};
  }
  Cache& self() noexcept { return static_cast<Cache&>(*this); }
  const Cache& self() const noexcept { return static_cast<const Cache&>(*this); }
};

KVCACHE_END_NAMESPACE
