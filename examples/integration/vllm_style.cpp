// Integration guide: a vLLM-style engine on kvcache.
//
// A scheduler admits requests first come, first served while their prompt
// fits; a step runs one batch: new requests' prefill, then every running
// sequence's decode token. The engine's side of each step:
//   1. admit(prompt, slots, opt): the prefix hit and the prompt's slots, all
//      or nothing; the prefill writes K/V through that slot mapping;
//   2. reserve_batch(seqs, counts, ids, slots, copies): the decode step's
//      slot mapping for the whole batch (-1 padded), and copy-on-write
//      commands. On out_of_blocks nothing changed: preempt the newest
//      request (free it; recompute it later) and call again;
//   3. on the stream: block_copy(copies), then the model, whose attention
//      layers scatter K/V by slot (reshape_and_cache) and read the dense
//      block table (export_block_table + export_lengths);
//   4. sample; a finished request frees its sequence (published blocks stay
//      cached for the next prompt that shares them).
// Parallel sampling (n = 2) forks the prompt's sequence: both samples share
// every block, and the first write into the shared tail block comes back as a
// copy command. With publish_on_reserve every full block, prompt or output,
// is published as it is reserved.
//
// Here the "GPU" is the host backend (scatter_host, block_copy_host) and the
// model is toy::k_value; after every step each sequence's whole row is read
// back through the exported block table. The run is repeated with a pool
// large enough never to preempt: every sample's tokens must be the same.
#include <kvcache/kernels/block_copy.hpp>
#include <kvcache/kernels/scatter.hpp>
#include <kvcache/kvcache.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <map>
#include <vector>

#include "toy_model.hpp"

namespace kv = kvcache;

namespace {
constexpr std::int32_t kLayers = 2, kHeads = 2, kDim = 4, kB = 4, kMaxSeqs = 16, kRowBlocks = 16;

struct Request {
  int id;
  std::vector<std::int32_t> prompt;
  std::int32_t max_new;
  int n;  // parallel samples
};

struct Sample {
  int req, idx, order;             // order: admission order (the newest is preempted first)
  kv::SeqId seq;
  std::vector<std::int32_t> tokens;  // prompt + output; tokens[0 .. held) have K/V in the pool
  std::int32_t held, prompt_len;
};

struct Stats {
  int steps = 0, preemptions = 0, copies = 0;
  std::int64_t hit_tokens = 0, prefill_tokens = 0;
  std::map<std::pair<int, int>, std::vector<std::int32_t>> outputs;  // (request, sample) -> output tokens
};

// The toy sampler: a function of the history, so a recomputed request
// continues exactly where it was preempted.
std::int32_t sample_next(const Sample& s) {
  const auto n = std::int32_t(s.tokens.size());
  return 1 + (s.tokens.back() * 31 + n * 7 + s.idx * 101 + s.req * 13) % 250;
}

class Engine {
 public:
  explicit Engine(std::int32_t num_blocks)
      : geometry_(*kv::Geometry::make({.num_layers = kLayers, .num_kv_heads = kHeads, .head_dim = kDim,
                                       .block_size = kB, .dtype = kv::DType::f32,
                                       .planes = kv::KvPlanes::separate})),  // vLLM's per-layer K and V tensors
        memory_(std::size_t(*geometry_.pool_bytes(num_blocks))),
        pool_(*kv::make_pool_view(geometry_, memory_.data(), num_blocks)),
        cache_({.geometry = geometry_, .num_blocks = num_blocks, .max_sequences = kMaxSeqs,
                .max_blocks_per_sequence = kRowBlocks, .publish_on_reserve = true}) {}

  Stats run(const std::vector<Request>& requests) {
    requests_ = &requests;
    std::deque<Request> waiting(requests.begin(), requests.end());
    std::map<int, std::vector<std::int32_t>> resume;  // a preempted request's tokens so far (n = 1)
    while (!waiting.empty() || !running_.empty()) {
      ++stats_.steps;
      toy::expect(stats_.steps < 1000, "the scheduler makes progress");
      // 1. Admission, first come first served, while the prompt fits.
      std::vector<Sample> admitted;
      while (!waiting.empty() && std::int32_t(running_.size()) + waiting.front().n <= kMaxSeqs) {
        const Request& r = waiting.front();
        const auto it = resume.find(r.id);
        const std::vector<std::int32_t> prompt = it != resume.end() ? it->second : r.prompt;
        if (!cache_.can_admit(prompt, {})) break;  // counts the prefix hit
        slots_.resize(prompt.size());
        auto a = cache_.admit(prompt, slots_, {});
        toy::expect(a.ok(), "admit after can_admit");
        write_kv(prompt, a->cached_tokens, std::span(slots_).first(std::size_t(a->reserved)));
        stats_.hit_tokens += a->cached_tokens;
        stats_.prefill_tokens += a->reserved;
        const Sample s{r.id, 0, next_order_++, a->seq, prompt, std::int32_t(prompt.size()), std::int32_t(r.prompt.size())};
        admitted.push_back(s);
        for (int i = 1; i < r.n; ++i) {  // parallel sampling: each sample shares the prompt's blocks
          Sample twin = s;
          twin.idx = i;
          twin.seq = cache_.fork(s.seq).value();
          admitted.push_back(twin);
        }
        if (it != resume.end()) resume.erase(it);
        waiting.pop_front();
      }
      for (auto& s : admitted) s.tokens.push_back(sample_next(s));  // the prefill's logits give the first token

      // 2. The decode batch: every running sequence's newest token.
      while (!running_.empty()) {
        seqs_.clear(), ids_.clear();
        for (const auto& s : running_) seqs_.push_back(s.seq), ids_.push_back(s.tokens[std::size_t(s.held)]);
        counts_.assign(running_.size(), 1);
        slots_.assign(running_.size(), -1);
        copies_.resize(running_.size());
        auto r = cache_.reserve_batch(seqs_, counts_, ids_, slots_, copies_);
        if (r) {
          // 3. On the stream: copy-on-write copies first, then the model writes K/V by slot.
          toy::expect(kv::block_copy_host({pool_, pool_, copies_.data(), r->copies}).ok(), "block_copy");
          stats_.copies += r->copies;
          for (std::size_t k = 0; k < running_.size(); ++k) {
            Sample& s = running_[k];
            write_kv(s.tokens, s.held, std::span(slots_).subspan(k, 1));
            ++s.held;
          }
          break;
        }
        toy::expect(r.status().code() == kv::Errc::out_of_blocks, "reserve_batch: " + r.status().message());
        preempt(waiting, resume);  // nothing changed: make room and try again
      }
      running_.insert(running_.end(), admitted.begin(), admitted.end());

      // The attention kernels' view: the dense block table and lengths; read every row back.
      check_rows();
      // 4. Sample; finished requests free their sequences.
      std::vector<Sample> still;
      for (auto& s : running_) {
        if (s.held == std::int32_t(s.tokens.size())) s.tokens.push_back(sample_next(s));  // decoded this step
        const auto& req = requests[std::size_t(s.req)];
        if (std::int32_t(s.tokens.size()) - s.prompt_len >= req.max_new) {
          stats_.outputs[{s.req, s.idx}] = std::vector<std::int32_t>(s.tokens.begin() + s.prompt_len, s.tokens.end());
          toy::expect(cache_.free(s.seq).ok(), "free");
        } else {
          still.push_back(s);
        }
      }
      running_ = std::move(still);
      toy::expect(cache_.check_invariants().ok(), "invariants");
    }
    return stats_;
  }

 private:
  // The model's K/V for tokens[first ..) at the given slots (-1: skip), all layers in one launch.
  void write_kv(const std::vector<std::int32_t>& tokens, std::int32_t first, std::span<const std::int32_t> slots) {
    const auto n = std::int32_t(slots.size());
    k_.assign(std::size_t(kLayers * n * kHeads * kDim), 0.0f);
    v_.assign(k_.size(), 0.0f);
    for (std::int32_t l = 0; l < kLayers; ++l)
      for (std::int32_t t = 0; t < n; ++t)
        for (std::int32_t h = 0; h < kHeads; ++h)
          for (std::int32_t d = 0; d < kDim; ++d) {
            const auto at = std::size_t(((l * n + t) * kHeads + h) * kDim + d);
            k_[at] = toy::k_value(tokens[std::size_t(first + t)], first + t, l, h);
            v_[at] = -k_[at];
          }
    const std::int64_t f = sizeof(float);
    kv::ScatterParams p{pool_, {k_.data(), v_.data(), kv::DType::f32, n * kHeads * kDim * f, kHeads * kDim * f, kDim * f},
                        kv::TokenAddress{slots.data()}, n, /*first_layer*/ 0, /*num_layers*/ kLayers};
    toy::expect(kv::scatter_host(p).ok(), "scatter");
  }

  // vLLM preempts the newest request (recompute): free all its samples. A
  // single sample resumes with its output so far as the prompt (its blocks
  // are still cached: the recompute is mostly a prefix hit); parallel
  // samples restart from the prompt.
  void preempt(std::deque<Request>& waiting, std::map<int, std::vector<std::int32_t>>& resume) {
    const auto newest = std::max_element(running_.begin(), running_.end(),
                                         [](const Sample& a, const Sample& b) { return a.order < b.order; });
    toy::expect(newest != running_.end() && running_.size() > 1, "a lone request fits the pool");
    const int req = newest->req;
    std::vector<Sample> kept;
    int samples = 0;
    for (auto& s : running_) {
      if (s.req != req) {
        kept.push_back(s);
        continue;
      }
      toy::expect(cache_.free(s.seq).ok(), "free on preemption");
      if (++samples == 1) resume[req] = std::vector<std::int32_t>(s.tokens.begin(), s.tokens.begin() + s.held);
    }
    if (samples > 1) resume.erase(req);
    running_ = std::move(kept);
    waiting.push_front((*requests_)[std::size_t(req)]);
    ++stats_.preemptions;
  }

  // What attention reads: row k of the block table, lengths[k] slots; every
  // K and V must be the one the model wrote for that token and position.
  void check_rows() {
    if (running_.empty()) return;
    seqs_.clear();
    for (const auto& s : running_) seqs_.push_back(s.seq);
    table_.assign(seqs_.size() * kRowBlocks, -1);
    lengths_.assign(seqs_.size(), 0);
    toy::expect(cache_.export_block_table(seqs_, table_, kRowBlocks).ok(), "export_block_table");
    toy::expect(cache_.export_lengths(seqs_, lengths_).ok(), "export_lengths");
    for (std::size_t k = 0; k < seqs_.size(); ++k) {
      const Sample& s = running_[k];
      toy::expect(lengths_[k] == s.held, "lengths");
      for (std::int32_t j = 0; j < s.held; ++j)
        for (std::int32_t l = 0; l < kLayers; ++l)
          for (std::int32_t h = 0; h < kHeads; ++h) {
            const std::int32_t block = table_[k * kRowBlocks + std::size_t(j / kB)];
            float key, value;
            std::memcpy(&key, pool_.row(block, l, 0, j % kB, h), sizeof key);
            std::memcpy(&value, pool_.row(block, l, 1, j % kB, h), sizeof value);
            const float want = toy::k_value(s.tokens[std::size_t(j)], j, l, h);
            toy::expect(key == want && value == -want,
                        fmt::format("request {} sample {} position {}: K {} (want {})", s.req, s.idx, j, key, want));
          }
    }
  }

  kv::Geometry geometry_;
  std::vector<std::byte> memory_;  // the engine's KV memory (cudaMalloc on a GPU)
  kv::PoolView pool_;
  kv::Cache<> cache_;
  const std::vector<Request>* requests_ = nullptr;
  std::vector<Sample> running_;
  int next_order_ = 0;
  Stats stats_;
  std::vector<kv::SeqId> seqs_;
  std::vector<std::int32_t> counts_, ids_, slots_, table_, lengths_;
  std::vector<kv::BlockCopy> copies_;
  std::vector<float> k_, v_;
};

std::vector<Request> workload() {
  const std::vector<std::int32_t> system{7, 3, 9, 4, 11, 2, 8, 5};  // two blocks every request shares
  std::vector<Request> rs;
  for (int i = 0; i < 6; ++i) {
    std::vector<std::int32_t> prompt = system;
    for (int t = 0; t < 3 + i % 3; ++t) prompt.push_back(20 + 10 * i + t);  // 11..13 tokens: a partial tail block
    rs.push_back({i, prompt, 12, i == 2 ? 2 : 1});                        // request 2 samples twice
  }
  return rs;
}

Stats serve(std::int32_t num_blocks, const std::vector<Request>& rs) { return Engine(num_blocks).run(rs); }
}  // namespace

int main() {
  try {
    const auto rs = workload();
    const Stats tight = serve(24, rs), roomy = serve(200, rs);
    fmt::print("vLLM-style engine: {} requests (one with n = 2), a shared 8-token system prompt, 12 new tokens each\n",
               rs.size());
    for (const auto* s : {&tight, &roomy})
      fmt::print("  pool of {:>3} blocks: {:>2} steps, {} preemptions, {:>2} prompt tokens from the prefix cache, "
                 "{:>2} prefilled, {} copy-on-write copies\n",
                 s == &tight ? 24 : 200, s->steps, s->preemptions, s->hit_tokens, s->prefill_tokens, s->copies);
    toy::expect(tight.outputs.size() == 7 && tight.outputs == roomy.outputs, "the same tokens with and without preemption");
    toy::expect(tight.preemptions > 0 && roomy.preemptions == 0, "the tight pool preempts, the roomy one does not");
    toy::expect(tight.hit_tokens > 0 && roomy.hit_tokens >= 5 * 8, "prefix hits on the system prompt");
    toy::expect(roomy.copies > 0, "the forked samples copy their shared tail block");
    toy::expect(tight.outputs.at({2, 0}) != tight.outputs.at({2, 1}), "the two samples differ");
    fmt::print("every row read back through the block table after every step; outputs identical\n");
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "{}\n", e.what());
    return 1;
  }
}
