// What attention kernels read of a hybrid cache, per group: the dense block
// table vLLM-style kernels take (null ids where a window or chunk freed a
// block), the CSR of live blocks with each row's first position
// (FlashInfer-style kernels with a window start) and the slots of stored
// positions. Every call checks the group and every handle first, then
// writes through groups/group_exports.hpp, which checks the buffers.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvcache/config.hpp"
#include "kvcache/groups/group_exports.hpp"
#include "kvcache/groups/group_rule.hpp"
#include "kvcache/core/sequence_id.hpp"
#include "kvcache/status.hpp"

KVCACHE_BEGIN_NAMESPACE

/// The export calls of HybridCache (which derives from it and befriends it); they change nothing.
template <class Cache>
class HybridExports {
 public:
  /// Group g's dense block table of `seqs` (export_group_table: null ids
  /// where blocks were skipped; a row an eviction left holes in, compacted).
  Status export_block_table(std::int32_t g, std::span<const SeqId> seqs, std::span<std::int32_t> out,
                            std::int32_t row_stride) const {
    if (auto st = rows_of(g, seqs); !st) return st;
    return export_group_table(self().rows_[std::size_t(g)], idx_, out, row_stride);
  }
  /// Group g's CSR over the live blocks of `seqs`, with the positions each
  /// row does not hold before them (groups/group_exports.hpp): a window's
  /// row starts past the blocks it freed, an evicting row's count its holes
  /// too. Named apart from Cache<>::export_csr, whose last buffer is last_page_len.
  Result<std::int32_t> export_group_csr(std::int32_t g, std::span<const SeqId> seqs, std::span<std::int32_t> indptr,
                                        std::span<std::int32_t> indices, std::span<std::int32_t> first_pos) const {
    if (auto st = rows_of(g, seqs); !st) return st;
    return kvcache::export_group_csr(self().rows_[std::size_t(g)], idx_, indptr, indices, first_pos);
  }
  /// export_group_csr() under its old name, whose last buffer is first_pos, not Cache<>'s last_page_len.
  [[deprecated("kvcache: HybridCache::export_csr is export_group_csr (its last buffer is first_pos)")]]
  Result<std::int32_t> export_csr(std::int32_t g, std::span<const SeqId> seqs, std::span<std::int32_t> indptr,
                                  std::span<std::int32_t> indices, std::span<std::int32_t> first_pos) const {
    return export_group_csr(g, seqs, indptr, indices, first_pos);
  }
  /// Group g's slots of positions [begin, end) of sequence id (a cross group: encoder positions).
  Status slot_mapping(std::int32_t g, SeqId id, std::int64_t begin, std::int64_t end, std::span<std::int32_t> out) const {
    const SeqId one[] = {id};
    if (auto st = rows_of(g, one); !st) return st;
    const auto& rows = self().rows_[std::size_t(g)];
    const GroupRule& r = rows.rule();
    const std::int64_t stored = r.caches() ? self().seqs_[id.index].reserved : rows.live(id.index) > 0 ? r.span : 0;
    return export_group_slots(rows, id.index, stored, begin, end, out);
  }

 protected:
  mutable std::vector<std::uint32_t> idx_;  ///< The rows an export reads (the cache reserves one per handle).

 private:
  // idx_ = the rows of seqs, after checking g and every handle.
  Status rows_of(std::int32_t g, std::span<const SeqId> seqs) const {
    if (g < 0 || g >= self().groups()) return Status{Errc::invalid_argument, "group", g, self().groups() - 1};
    idx_.clear();
    for (const SeqId id : seqs) {
      if (auto st = self().validate(id); !st) return st;
      idx_.push_back(id.index);
    }
    return {};
  }
  const Cache& self() const noexcept { return static_cast<const Cache&>(*this); }
};

KVCACHE_END_NAMESPACE
