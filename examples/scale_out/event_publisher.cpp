// A KV-event publisher as vLLM runs one for KV-aware routers, on libzmq: a
// PUB socket sends each step's drained block events as three frames
// (topic, 8-byte big-endian sequence number, msgpack KVEventBatch), and a
// ROUTER socket answers replay requests (a subscriber that missed batches
// sends [empty, start sequence]; it gets [empty, seq, payload] per kept
// batch from there, then [empty, -1, ""]). The cache is a small serving
// loop: requests with shared system prompts are admitted, published, freed,
// and the pool recycles old ones, so stored and removed events both flow.
//
//   kvcache_event_publisher [--pub tcp://127.0.0.1:5557] [--replay tcp://127.0.0.1:5558]
//                           [--steps 40] [--interval-ms 50] [--linger-ms 3000] [--topic kv]
//
// After the steps it keeps answering replays until no request came for
// linger-ms. python/tests/test_scale_out.py subscribes with pyzmq.
#include <kvcache/cache.hpp>
#include <kvcache/wire/kv_events_wire.hpp>

#include <fmt/core.h>
#include <zmq.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace kv = kvcache;

namespace {

struct Args {
  std::string pub = "tcp://127.0.0.1:5557", replay = "tcp://127.0.0.1:5558", topic = "kv";
  int steps = 40, interval_ms = 50, linger_ms = 3000;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--pub") a.pub = v;
    else if (k == "--replay") a.replay = v;
    else if (k == "--topic") a.topic = v;
    else if (k == "--steps") a.steps = std::stoi(v);
    else if (k == "--interval-ms") a.interval_ms = std::stoi(v);
    else if (k == "--linger-ms") a.linger_ms = std::stoi(v);
    else throw std::invalid_argument("unknown option " + k);
  }
  return a;
}

void send(void* socket, std::span<const std::uint8_t> frame, bool more) {
  if (zmq_send(socket, frame.data(), frame.size(), more ? ZMQ_SNDMORE : 0) < 0)
    throw std::runtime_error(std::string("zmq_send: ") + zmq_strerror(zmq_errno()));
}
std::span<const std::uint8_t> bytes(const std::string& s) { return {reinterpret_cast<const std::uint8_t*>(s.data()), s.size()}; }

// Answers every replay request waiting on the ROUTER socket; returns how many.
int serve_replays(void* router, const kv::EventReplay& replay) {
  int served = 0;
  for (;;) {
    std::vector<std::vector<std::uint8_t>> frames;
    int more = 1;
    while (more) {
      zmq_msg_t msg;
      zmq_msg_init(&msg);
      if (zmq_msg_recv(&msg, router, frames.empty() ? ZMQ_DONTWAIT : 0) < 0) {
        zmq_msg_close(&msg);
        return served;  // nothing waiting
      }
      const auto* p = static_cast<const std::uint8_t*>(zmq_msg_data(&msg));
      frames.emplace_back(p, p + zmq_msg_size(&msg));
      size_t len = sizeof(more);
      zmq_getsockopt(router, ZMQ_RCVMORE, &more, &len);
      zmq_msg_close(&msg);
    }
    if (frames.size() != 3) continue;  // [identity, empty, start]: anything else is ignored, as vLLM does
    const auto start = kv::read_sequence_frame(frames[2]);
    if (!start) continue;
    const std::vector<std::uint8_t> empty;
    replay.replay(*start, [&](std::int64_t seq, std::span<const std::uint8_t> payload) {
      send(router, frames[0], true);
      send(router, empty, true);
      send(router, kv::sequence_frame(seq), true);
      send(router, payload, false);
    });
    send(router, frames[0], true);
    send(router, empty, true);
    send(router, kv::sequence_frame(-1), true);
    send(router, empty, false);
    ++served;
  }
}

}  // namespace

int main(int argc, char** argv) try {
  const Args args = parse(argc, argv);
  kv::Cache<> cache({.geometry = *kv::Geometry::make({.num_layers = 2, .num_kv_heads = 2, .head_dim = 16, .block_size = 16}),
                     .num_blocks = 48, .max_sequences = 8, .max_blocks_per_sequence = 16, .event_capacity = 1024});
  void* ctx = zmq_ctx_new();
  void* pub = zmq_socket(ctx, ZMQ_PUB);
  void* router = zmq_socket(ctx, ZMQ_ROUTER);
  const int linger = 0;
  zmq_setsockopt(pub, ZMQ_LINGER, &linger, sizeof(linger));
  zmq_setsockopt(router, ZMQ_LINGER, &linger, sizeof(linger));
  if (zmq_bind(pub, args.pub.c_str()) != 0 || zmq_bind(router, args.replay.c_str()) != 0)
    throw std::runtime_error(std::string("zmq_bind: ") + zmq_strerror(zmq_errno()));

  kv::EventReplay replay(10'000);
  std::vector<kv::BlockEvent> events(1024);
  std::vector<std::int32_t> ids(events.size() * 16);
  std::vector<std::uint8_t> payload;
  std::uint32_t rng = 12345;
  const auto next = [&] { return rng = rng * 1664525u + 1013904223u; };
  const auto now_s = [] {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  };
  std::int64_t sent_events = 0;
  for (int step = 0; step < args.steps; ++step) {
    // A request: one of four system prompts, a user suffix; prefilled, published, finished.
    std::vector<std::int32_t> prompt(std::size_t(48 + next() % 64));
    const std::int32_t system = std::int32_t(next() % 4);
    for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = i < 32 ? system * 1000 + std::int32_t(i) : std::int32_t(next() % 30000);
    std::vector<std::int32_t> slots(prompt.size());
    auto a = cache.admit(prompt, slots);
    if (!a) throw std::runtime_error("admit: " + a.status().message());
    if (auto p = cache.publish(a->seq, prompt); !p) throw std::runtime_error("publish: " + p.status().message());
    if (auto st = cache.free(a->seq); !st) throw std::runtime_error("free: " + st.message());

    const auto n = std::size_t(*cache.drain_events(events, ids));
    if (n > 0) {
      payload.clear();
      (void)kv::encode_kv_events(std::span(events).first(n), std::span(ids).first(n * 16), 16, {.ts = now_s(), .dp_rank = 0},
                                 payload);
      const std::int64_t seq = replay.push(payload);
      send(pub, bytes(args.topic), true);
      send(pub, kv::sequence_frame(seq), true);
      send(pub, payload, false);
      sent_events += std::int64_t(n);
    }
    serve_replays(router, replay);
    std::this_thread::sleep_for(std::chrono::milliseconds(args.interval_ms));
  }
  fmt::print("published {} batches ({} block events); answering replays\n", replay.next_sequence(), sent_events);
  std::fflush(stdout);
  auto quiet_since = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - quiet_since < std::chrono::milliseconds(args.linger_ms)) {
    if (serve_replays(router, replay) > 0) quiet_since = std::chrono::steady_clock::now();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  zmq_close(pub);
  zmq_close(router);
  zmq_ctx_term(ctx);
  return 0;
} catch (const std::exception& e) {
  fmt::print(stderr, "kvcache_event_publisher: {}\n", e.what());
  return 1;
}
