#include <catch2/catch.hpp>

#include <kvcache/table/page_table.hpp>
#include <kvcache/table/page_table_edits.hpp>
#include <kvcache/table/page_table_export.hpp>

#include <algorithm>
#include <array>
#include <vector>

using namespace kvcache;

namespace {
struct Fixture {
  BlockPool pool;
  PageTable table;
  Fixture(std::int32_t blocks, std::int32_t streams, std::int32_t per_stream, std::int32_t bs)
      : pool(blocks), table(pool, streams, per_stream, bs) {}
  void require_ok() const {
    auto a = pool.check();
    auto b = table.check(pool);
    INFO(a.message() << " / " << b.message());
    REQUIRE(a.ok());
    REQUIRE(b.ok());
  }
  // The call fails with `code` naming `what`, and pool and table are unchanged.
  template <class F>
  void fails_unchanged(Errc code, const char* what, F&& call) {
    const BlockPool p0 = pool;
    const PageTable t0 = table;
    const Status st = call();
    INFO(st.message());
    REQUIRE(st.code() == code);
    REQUIRE(std::string(st.what()) == what);
    REQUIRE(pool == p0);
    REQUIRE(table == t0);
  }
};
}  // namespace

TEST_CASE("construction errors name the bad value") {
  BlockPool pool(8);
  CHECK_THROWS_WITH(PageTable(pool, 0, 4, 16), Catch::Contains("max_streams=0"));
  CHECK_THROWS_WITH(PageTable(pool, 4, 4, -1), Catch::Contains("block_size=-1"));
  BlockPool big(4096);
  CHECK_THROWS_WITH(PageTable(big, 4, 4, 1 << 20), Catch::Contains("num_blocks*block_size=4294967296"));
  // The product is checked before anything is computed from it.
  CHECK_THROWS_WITH(PageTable(pool, 4, 1 << 30, 16), Catch::Contains("max_blocks_per_stream*block_size=17179869184"));
  // Capacities past the bookkeeping limit are a typed error, not bad_alloc.
  try {
    PageTable(pool, 1 << 30, 16, 16);
    FAIL("no error");
  } catch (const ConfigError& e) {
    CHECK(e.status().code() == Errc::capacity_exceeded);
    CHECK(std::string(e.status().what()) == "max_sequences");
    CHECK(e.status().value() == (1 << 30));
  }
}

TEST_CASE("reserve returns the slot mapping block by block") {
  Fixture f(16, 4, 8, 4);
  auto s = *f.table.add();
  std::array<std::int32_t, 6> slots{};
  auto r = f.table.reserve(f.pool, s, 6, slots);
  REQUIRE(r.ok());
  CHECK(r->new_blocks == 2);
  CHECK(r->copy.src == -1);
  const auto blocks = *f.table.blocks(s);
  REQUIRE(blocks.size() == 2);
  for (int i = 0; i < 6; ++i) CHECK(slots[std::size_t(i)] == blocks[std::size_t(i / 4)] * 4 + i % 4);
  std::array<std::int32_t, 3> more{};
  REQUIRE(f.table.reserve(f.pool, s, 3, more).ok());  // fills block 2 then opens block 3
  CHECK(more[0] == blocks[1] * 4 + 2);
  CHECK(more[1] == blocks[1] * 4 + 3);
  CHECK(more[2] == (*f.table.blocks(s))[2] * 4);
  CHECK(*f.table.tokens(s) == 9);
  f.require_ok();
}

TEST_CASE("reserve failures change nothing") {
  Fixture f(6, 2, 3, 4);  // 5 usable blocks, 12 tokens per stream
  auto a = *f.table.add();
  auto b = *f.table.add();
  std::vector<std::int32_t> slots(32, 0);
  REQUIRE(f.table.reserve(f.pool, a, 12, slots).ok());
  f.fails_unchanged(Errc::capacity_exceeded, "n_tokens", [&] { return f.table.reserve(f.pool, a, 1, slots).status(); });
  f.fails_unchanged(Errc::invalid_argument, "n_tokens", [&] { return f.table.reserve(f.pool, b, -1, slots).status(); });
  f.fails_unchanged(Errc::buffer_too_small, "slots",
                    [&] { return f.table.reserve(f.pool, b, 5, std::span(slots).first(4)).status(); });
  REQUIRE(f.table.reserve(f.pool, b, 4, slots).ok());  // 4 blocks used, 1 left
  f.fails_unchanged(Errc::out_of_blocks, "n_blocks", [&] { return f.table.reserve(f.pool, b, 5, slots).status(); });
  f.require_ok();
}

TEST_CASE("stale handles are detected after free, forks of freed sequences fail") {
  Fixture f(8, 2, 4, 4);
  auto s = *f.table.add();
  std::array<std::int32_t, 5> slots{};
  REQUIRE(f.table.reserve(f.pool, s, 5, slots).ok());
  REQUIRE(f.table.release(f.pool, s).ok());
  CHECK(f.pool.num_used() == 0);
  f.fails_unchanged(Errc::unknown_sequence, "seq.generation", [&] { return f.table.fork(f.pool, s).status(); });
  f.fails_unchanged(Errc::unknown_sequence, "seq.generation", [&] { return f.table.release(f.pool, s); });
  f.fails_unchanged(Errc::unknown_sequence, "seq.index",
                    [&] { return f.table.truncate(f.pool, SeqId{7, 0}, 1); });
  auto again = *f.table.add();  // the slot is reused with a new generation
  CHECK(again.index == s.index);
  CHECK(again.generation == s.generation + 1);
  auto none = f.table.add();
  REQUIRE(none.ok());
  f.fails_unchanged(Errc::capacity_exceeded, "max_sequences", [&] { return f.table.add().status(); });
  f.require_ok();
}

TEST_CASE("truncate releases emptied blocks and rejects too many tokens") {
  Fixture f(8, 2, 4, 4);
  auto s = *f.table.add();
  std::array<std::int32_t, 10> slots{};
  REQUIRE(f.table.reserve(f.pool, s, 10, slots).ok());
  CHECK(f.pool.num_used() == 3);
  f.fails_unchanged(Errc::truncate_too_many, "n_tokens", [&] { return f.table.truncate(f.pool, s, 11); });
  f.fails_unchanged(Errc::invalid_argument, "n_tokens", [&] { return f.table.truncate(f.pool, s, -2); });
  REQUIRE(f.table.truncate(f.pool, s, 3).ok());
  CHECK(*f.table.tokens(s) == 7);
  CHECK(f.pool.num_used() == 2);
  std::array<std::int32_t, 1> one{};
  REQUIRE(f.table.reserve(f.pool, s, 1, one).ok());
  CHECK(one[0] == (*f.table.blocks(s))[1] * 4 + 3);  // rewrites position 7 in place
  REQUIRE(f.table.truncate(f.pool, s, 8).ok());
  CHECK(f.pool.num_used() == 0);
  f.require_ok();
}

TEST_CASE("fork shares blocks, writing the shared partial tail copies it first") {
  Fixture f(10, 3, 4, 4);
  auto parent = *f.table.add();
  std::array<std::int32_t, 6> slots{};
  REQUIRE(f.table.reserve(f.pool, parent, 6, slots).ok());
  auto child = *f.table.fork(f.pool, parent);
  const auto pb = *f.table.blocks(parent);
  CHECK(f.pool.ref_count(pb[0]) == 2);
  CHECK(f.pool.ref_count(pb[1]) == 2);
  CHECK(f.pool.num_used() == 2);
  f.require_ok();

  std::array<std::int32_t, 1> one{};
  auto r = f.table.reserve(f.pool, child, 1, one);
  REQUIRE(r.ok());
  const auto cb = *f.table.blocks(child);
  CHECK(r->copy == BlockCopy{pb[1], cb[1]});
  CHECK(cb[0] == pb[0]);  // full block stays shared
  CHECK(cb[1] != pb[1]);
  CHECK(one[0] == cb[1] * 4 + 2);
  CHECK(f.pool.ref_count(pb[1]) == 1);
  // The parent's tail is now its own: written in place, no copy.
  auto rp = f.table.reserve(f.pool, parent, 1, one);
  REQUIRE(rp.ok());
  CHECK(rp->copy.src == -1);
  CHECK(one[0] == pb[1] * 4 + 2);
  f.require_ok();
  REQUIRE(f.table.release(f.pool, parent).ok());
  REQUIRE(f.table.release(f.pool, child).ok());
  CHECK(f.pool.num_used() == 0);
  f.require_ok();
}

TEST_CASE("reserve_batch packs slots, pads with -1, and is all or nothing") {
  Fixture f(12, 4, 4, 4);
  auto a = *f.table.add();
  auto b = *f.table.add();
  std::vector<std::int32_t> slots(8, 99);
  std::array<BlockCopy, 2> copies{};
  const std::array<SeqId, 2> seqs{a, b};
  const std::array<std::int32_t, 2> counts{3, 2};
  auto r = f.table.reserve_batch(f.pool, seqs, counts, slots, copies);
  REQUIRE(r.ok());
  CHECK(r->slots == 5);
  CHECK(r->copies == 0);
  const auto ab = *f.table.blocks(a), bb = *f.table.blocks(b);
  CHECK(slots == std::vector<std::int32_t>{ab[0] * 4, ab[0] * 4 + 1, ab[0] * 4 + 2, bb[0] * 4, bb[0] * 4 + 1, -1, -1, -1});
  f.require_ok();

  const std::array<SeqId, 2> dup{a, a};
  f.fails_unchanged(Errc::duplicate_sequence, "seqs_at",
                    [&] { return f.table.reserve_batch(f.pool, dup, counts, slots, copies).status(); });
  CHECK(f.table.reserve_batch(f.pool, dup, counts, slots, copies).status().message() ==
        "duplicate_sequence: seqs_at=1 (seq.index " + std::to_string(a.index) + ")");
  const std::array<std::int32_t, 2> huge{3, 40};
  f.fails_unchanged(Errc::capacity_exceeded, "n_tokens",
                    [&] { return f.table.reserve_batch(f.pool, seqs, huge, slots, copies).status(); });
  const std::array<std::int32_t, 2> big{13, 4};  // would need 4 + 1 blocks... only if slots fit
  f.fails_unchanged(Errc::buffer_too_small, "slots",
                    [&] { return f.table.reserve_batch(f.pool, seqs, big, slots, copies).status(); });
  const std::array<std::int32_t, 1> short_counts{1};
  f.fails_unchanged(Errc::invalid_argument, "counts.size",
                    [&] { return f.table.reserve_batch(f.pool, seqs, short_counts, slots, copies).status(); });
  CHECK(slots == std::vector<std::int32_t>(8, -1));  // a failed batch leaves no slot a scatter could write

  // a's next token fits its tail and is appended during validation; a later
  // error (b's count, a repeated a, too few slots, too few blocks) undoes it.
  const std::array<std::int32_t, 2> one_then_huge{1, 40}, ones{1, 1};
  f.fails_unchanged(Errc::capacity_exceeded, "n_tokens",
                    [&] { return f.table.reserve_batch(f.pool, seqs, one_then_huge, slots, copies).status(); });
  f.fails_unchanged(Errc::duplicate_sequence, "seqs_at",
                    [&] { return f.table.reserve_batch(f.pool, dup, ones, slots, copies).status(); });
  std::vector<std::int32_t> one_slot(1);
  const std::array<std::int32_t, 2> one_then_two{1, 2};
  f.fails_unchanged(Errc::buffer_too_small, "slots",
                    [&] { return f.table.reserve_batch(f.pool, seqs, one_then_two, one_slot, copies).status(); });
  const std::array<std::int32_t, 2> one_then_many{1, 14};  // b needs 3 more blocks, 2 are free
  while (f.pool.num_free() > 2) REQUIRE(f.pool.allocate_one().ok());
  std::vector<std::int32_t> room(16, 99);
  f.fails_unchanged(Errc::out_of_blocks, "n_blocks",
                    [&] { return f.table.reserve_batch(f.pool, seqs, one_then_many, room, copies).status(); });
  CHECK(room == std::vector<std::int32_t>(16, -1));
}

TEST_CASE("a decode batch (every count 1) gives the slots and blocks of single reserves") {
  for (const std::int32_t bs : {4, 3}) {  // the mask path and the division path
    INFO("block size " << bs);
    Fixture batched(40, 6, 8, bs), single(40, 6, 8, bs);
    std::vector<SeqId> seqs;
    std::vector<std::int32_t> prompt(16);
    for (std::int32_t s = 0; s < 5; ++s) {  // lengths 1..13: every offset in a block
      seqs.push_back(*batched.table.add());
      REQUIRE(*single.table.add() == seqs.back());
      REQUIRE(batched.table.reserve(batched.pool, seqs.back(), 1 + 3 * s, prompt).ok());
      REQUIRE(single.table.reserve(single.pool, seqs.back(), 1 + 3 * s, prompt).ok());
    }
    const std::vector<std::int32_t> ones(seqs.size(), 1);
    std::vector<std::int32_t> got(seqs.size() + 2, 99), want(seqs.size());
    std::vector<BlockCopy> copies(seqs.size());
    for (std::int32_t step = 0; step < 2 * bs + 1; ++step) {  // every stream crosses into new blocks
      auto r = batched.table.reserve_batch(batched.pool, seqs, ones, got, copies);
      REQUIRE(r.ok());
      REQUIRE(r->slots == std::int32_t(seqs.size()));
      for (std::size_t k = 0; k < seqs.size(); ++k)
        REQUIRE(single.table.reserve(single.pool, seqs[k], 1, std::span(want).subspan(k, 1)).ok());
      REQUIRE(std::vector<std::int32_t>(got.begin(), got.begin() + std::ptrdiff_t(seqs.size())) == want);
      REQUIRE(got[seqs.size()] == -1);
      REQUIRE(batched.table == single.table);
      REQUIRE(batched.pool == single.pool);
      batched.require_ok();
    }
    // A step where some streams need a new block and the pool has too few:
    // the appends already made in the same pass are undone.
    while (batched.table.tokens(seqs[0]).value() % bs != 0) {
      auto r = batched.table.reserve_batch(batched.pool, seqs, ones, got, copies);
      REQUIRE(r.ok());
    }
    while (batched.pool.num_free() > 0) REQUIRE(batched.pool.allocate_one().ok());
    batched.fails_unchanged(Errc::out_of_blocks, "n_blocks",
                            [&] { return batched.table.reserve_batch(batched.pool, seqs, ones, got, copies).status(); });
    REQUIRE(got == std::vector<std::int32_t>(got.size(), -1));
  }
}

TEST_CASE("exports: dense table, CSR and lengths") {
  Fixture f(16, 4, 4, 4);
  auto a = *f.table.add();
  auto b = *f.table.add();
  auto c = *f.table.add();
  std::vector<std::int32_t> slots(16);
  REQUIRE(f.table.reserve(f.pool, a, 5, slots).ok());
  REQUIRE(f.table.reserve(f.pool, c, 8, slots).ok());
  const std::array<SeqId, 3> seqs{a, b, c};
  const auto ab = *f.table.blocks(a), cb = *f.table.blocks(c);

  std::vector<std::int32_t> dense(12, -5);
  REQUIRE(export_block_table(f.table, seqs, dense, 4).ok());
  CHECK(dense == std::vector<std::int32_t>{ab[0], ab[1], 0, 0, 0, 0, 0, 0, cb[0], cb[1], 0, 0});

  std::vector<std::int32_t> indptr(4, -5), indices(4, -5), last(3, -5);
  auto nnz = export_csr(f.table, seqs, indptr, indices, last);
  REQUIRE(nnz.ok());
  CHECK(*nnz == 4);
  CHECK(indptr == std::vector<std::int32_t>{0, 2, 2, 4});
  CHECK(indices == std::vector<std::int32_t>{ab[0], ab[1], cb[0], cb[1]});
  CHECK(last == std::vector<std::int32_t>{1, 0, 4});  // partial, empty, full last page

  std::vector<std::int32_t> lens(3, -5);
  REQUIRE(export_lengths(f.table, seqs, lens).ok());
  CHECK(lens == std::vector<std::int32_t>{5, 0, 8});

  // Errors leave the output buffers untouched.
  std::vector<std::int32_t> poison(12, -9);
  CHECK(export_block_table(f.table, seqs, poison, 1).code() == Errc::buffer_too_small);
  CHECK(export_block_table(f.table, seqs, std::span(poison).first(11), 4).code() == Errc::buffer_too_small);
  std::vector<std::int32_t> small_indices(3, -9);
  CHECK(export_csr(f.table, seqs, poison, small_indices, poison).status().code() == Errc::buffer_too_small);
  CHECK(small_indices == std::vector<std::int32_t>(3, -9));
  REQUIRE(f.table.release(f.pool, b).ok());
  CHECK(export_lengths(f.table, seqs, poison).code() == Errc::unknown_sequence);
  CHECK(poison == std::vector<std::int32_t>(12, -9));
}

TEST_CASE("eviction edits: drop_front keeps a dead front, errors change nothing") {
  Fixture f(16, 2, 8, 4);
  auto s = *f.table.add();
  std::vector<std::int32_t> slots(16);
  REQUIRE(f.table.reserve(f.pool, s, 10, slots).ok());  // blocks b0 b1 b2 (2 tokens)
  const BlockId b1 = (*f.table.blocks(s))[1];
  f.fails_unchanged(Errc::invalid_argument, "n_tokens", [&] { return drop_front(f.table, f.pool, s, 11); });
  f.fails_unchanged(Errc::invalid_argument, "n_tokens", [&] { return drop_front(f.table, f.pool, s, -1); });
  REQUIRE(drop_front(f.table, f.pool, s, 5).ok());  // b0 leaves; b1 keeps 1 dead slot
  CHECK(*f.table.tokens(s) == 5);
  CHECK(*f.table.front(s) == 1);
  CHECK((*f.table.blocks(s))[0] == b1);
  CHECK(*f.table.appended(s) == 10);
  f.require_ok();
  // A reserve continues after the live tokens, not after `tokens` slots.
  REQUIRE(f.table.reserve(f.pool, s, 3, slots).ok());
  CHECK(slots[0] == (*f.table.blocks(s))[1] * 4 + 2);
  f.require_ok();
  std::array<std::int32_t, 1> len{};
  REQUIRE(export_lengths(f.table, std::array{s}, len).ok());
  CHECK(len[0] == 1 + 8);  // front + tokens: the slots a kernel reads
  // Block 0 is partly dead: only whole live blocks may be removed.
  f.fails_unchanged(Errc::invalid_argument, "logical_block", [&] { return remove_blocks(f.table, f.pool, s, std::array{0}); });
  f.fails_unchanged(Errc::invalid_argument, "first_rewritten",
                    [&] { return drop_tail(f.table, f.pool, s, 1, 9); });
  f.fails_unchanged(Errc::invalid_argument, "n_tokens", [&] { return drop_tail(f.table, f.pool, s, 9, 0); });
  REQUIRE(drop_tail(f.table, f.pool, s, 2, 3).ok());
  CHECK(*f.table.tokens(s) == 6);
  CHECK(*f.table.appended(s) == 13);
  f.require_ok();
  REQUIRE(drop_front(f.table, f.pool, s, 6).ok());  // everything: the row is empty and the front resets
  CHECK(f.table.blocks(s)->empty());
  CHECK(*f.table.front(s) == 0);
  f.require_ok();
}

TEST_CASE("admission edits: extend_tail fills the tail block only, share_into shares a row into an empty one") {
  Fixture f(16, 3, 8, 4);
  auto a = *f.table.add(), b = *f.table.add(), c = *f.table.add();
  std::vector<std::int32_t> slots(16);
  REQUIRE(f.table.reserve(f.pool, a, 6, slots).ok());  // 2 blocks, the tail holds 2
  const BlockId tail = (*f.table.blocks(a))[1];
  auto slot = extend_tail(f.table, a, 1);
  REQUIRE(slot.ok());
  CHECK(*slot == tail * 4 + 2);  // reserve() would have given the same slot
  CHECK(*f.table.tokens(a) == 7);
  CHECK(*f.table.appended(a) == 7);
  f.require_ok();
  f.fails_unchanged(Errc::invalid_argument, "n_tokens (past the tail block)", [&] { return extend_tail(f.table, a, 2).status(); });
  f.fails_unchanged(Errc::invalid_argument, "n_tokens (past the tail block)", [&] { return extend_tail(f.table, a, 0).status(); });
  REQUIRE(extend_tail(f.table, a, 1).ok());  // the tail is full now
  f.fails_unchanged(Errc::invalid_argument, "n_tokens (past the tail block)", [&] { return extend_tail(f.table, a, 1).status(); });
  f.fails_unchanged(Errc::invalid_argument, "n_tokens (past the tail block)", [&] { return extend_tail(f.table, b, 1).status(); });
  f.require_ok();

  REQUIRE(share_into(f.table, f.pool, a, b).ok());
  const auto shared = *f.table.blocks(a);
  CHECK(std::ranges::equal(*f.table.blocks(b), shared));
  CHECK(*f.table.tokens(b) == 8);
  for (const BlockId x : shared) CHECK(f.pool.ref_count(x) == 2);
  f.require_ok();
  f.fails_unchanged(Errc::invalid_argument, "into.blocks (not empty)", [&] { return share_into(f.table, f.pool, a, b); });
  f.fails_unchanged(Errc::invalid_argument, "into (is from)", [&] { return share_into(f.table, f.pool, c, c); });
  REQUIRE(f.table.release(f.pool, b).ok());
  f.fails_unchanged(Errc::unknown_sequence, "seq.generation", [&] { return share_into(f.table, f.pool, a, b); });
  f.require_ok();
}
