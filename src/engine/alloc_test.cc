// Heap allocations per small message in steady state (issue: a lean
// small-message path). Two engines in one process over softverbs ping-pong
// 64 B messages from their callbacks; this binary counts every operator
// new and malloc of the process (engine, softverbs, test) over thousands
// of round trips after a warm-up.
//
// A round trip allocates nothing: Write copies its iovecs into the
// engine's own (inline) storage, a read is handed its chunks in a
// RecvChunks (inline for two), the engine's queues keep their room, and
// the received bytes go into the reader's ChunkMemory, here a
// preallocated one (a gRPC reader takes a pooled slice there: the one
// copy's destination, src/glue/slice_pool.cc). Softverbs' work requests
// and frames are kept in rings too. Now and then something may still
// allocate (a queue that grows to a new deepest moment).
#include <gtest/gtest.h>
#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <future>
#include <mutex>
#include <new>
#include <thread>

#include "engine/engine.h"
#include "engine/testing.h"

namespace {
std::atomic<uint64_t> g_allocs{0};
}  // namespace

void* operator new(size_t n) {
  g_allocs.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new[](size_t n) {
  g_allocs.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new(size_t n, const std::nothrow_t&) noexcept {
  g_allocs.fetch_add(1, std::memory_order_relaxed);
  return std::malloc(n == 0 ? 1 : n);
}
void* operator new[](size_t n, const std::nothrow_t&) noexcept {
  g_allocs.fetch_add(1, std::memory_order_relaxed);
  return std::malloc(n == 0 ? 1 : n);
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }

namespace grpc_rdma {
namespace {

using testing::Loopback;

// The reader's memory: fixed slots, taken and given back (no heap).
constexpr int kSlots = 256;
constexpr size_t kSlotBytes = 4096;
struct Slots {
  std::mutex mu;
  char bytes[kSlots][kSlotBytes];
  int free_list[kSlots];
  int n_free = 0;
  std::atomic<uint64_t> failed{0};
} g_slots;

void* SlotAllocate(size_t size, char** data) {
  std::lock_guard<std::mutex> l(g_slots.mu);
  if (size > kSlotBytes || g_slots.n_free == 0) {
    g_slots.failed.fetch_add(1);
    return nullptr;  // the engine then uses the heap: counted, and reported
  }
  int i = g_slots.free_list[--g_slots.n_free];
  *data = g_slots.bytes[i];
  return &g_slots.free_list[i];  // any stable, distinct token
}
void SlotRelease(void* owner) {
  std::lock_guard<std::mutex> l(g_slots.mu);
  g_slots.free_list[g_slots.n_free++] =
      static_cast<int>(static_cast<int*>(owner) - g_slots.free_list);
}

// One end of the ping-pong: every message read is answered with one of
// the same size (the server), or starts the next round trip until `left`
// runs out (the client). All from the engine's callbacks: the test's
// thread only waits.
class End {
 public:
  End(std::shared_ptr<Connection> c, bool client) : c_(std::move(c)), client_(client) {}
  void Start() { Next(); }
  void Ping() { Send(); }
  std::atomic<int64_t> left{0};
  std::atomic<bool> failed{false};
  std::atomic<int64_t> round_trips{0};

 private:
  void Next() {
    c_->Read([this](absl::StatusOr<RecvChunks> r) { OnRead(std::move(r)); });
  }
  void OnRead(absl::StatusOr<RecvChunks> r) {
    if (!r.ok()) return;
    for (const RecvChunk& ch : *r) got_ += ch.size();
    r->clear();  // the chunks go back now
    while (got_ >= kMessage) {
      got_ -= kMessage;
      if (!client_) {
        Send();
      } else {
        round_trips.fetch_add(1);
        if (left.fetch_sub(1) > 1) Send();
      }
    }
    Next();
  }
  void Send() {
    auto done = [this](absl::Status s) {
      if (!s.ok()) failed = true;
    };
    if (!scattered) {
      iovec v{msg_, kMessage};
      c_->Write({v}, done);
      return;
    }
    // More pieces than a write keeps inline: its iovecs go to the heap.
    iovec v[8];
    for (int i = 0; i < 8; ++i) v[i] = {msg_ + i * (kMessage / 8), kMessage / 8};
    c_->Write(absl::MakeConstSpan(v, 8), done);
  }

 public:
  std::atomic<bool> scattered{false};  // each write in 8 pieces

 private:

  static constexpr size_t kMessage = 64;
  std::shared_ptr<Connection> c_;
  bool client_;
  size_t got_ = 0;  // the engine runs one read callback at a time
  char msg_[kMessage] = {};
};

// Runs `n` round trips; false if they did not finish within a minute.
bool RoundTrips(End& client, int64_t n) {
  int64_t before = client.round_trips.load();
  client.left = n;
  client.Ping();
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (client.round_trips.load() - before < n) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

class Allocations : public ::testing::TestWithParam<PollMode> {};

TEST_P(Allocations, ASmallRoundTripAllocatesNothing) {
  {
    std::lock_guard<std::mutex> l(g_slots.mu);
    g_slots.n_free = 0;
    for (int i = 0; i < kSlots; ++i) g_slots.free_list[g_slots.n_free++] = i;
  }
  ChunkMemory memory{SlotAllocate, SlotRelease};
  Options o;
  o.poll_mode = GetParam();
  auto se = Engine::Create(o, memory);
  auto ce = Engine::Create(o, memory);
  ASSERT_TRUE(se.ok()) << se.status();
  ASSERT_TRUE(ce.ok()) << ce.status();
  std::promise<std::shared_ptr<Connection>> accepted;
  auto port = (*se)->Listen(Loopback(0), [&](std::shared_ptr<Connection> c) {
    accepted.set_value(std::move(c));
  });
  ASSERT_TRUE(port.ok()) << port.status();
  std::promise<absl::StatusOr<std::shared_ptr<Connection>>> connected;
  (*ce)->Connect(Loopback(*port), 5000, [&](absl::StatusOr<std::shared_ptr<Connection>> r) {
    connected.set_value(std::move(r));
  });
  auto c = connected.get_future().get();
  ASSERT_TRUE(c.ok()) << c.status();
  std::shared_ptr<Connection> s = accepted.get_future().get();
  // The ends outlive the engines: a callback may still run until those
  // are gone.
  auto server = std::make_unique<End>(s, false);
  auto client = std::make_unique<End>(*c, true);
  server->Start();
  client->Start();

  ASSERT_TRUE(RoundTrips(*client, 2000)) << "warm-up did not finish";
  constexpr int64_t kRoundTrips = 20000;
  uint64_t before = g_allocs.load();
  ASSERT_TRUE(RoundTrips(*client, kRoundTrips)) << "round trips did not finish";
  uint64_t allocs = g_allocs.load() - before;
  double per = static_cast<double>(allocs) / kRoundTrips;
  printf("heap allocations per 64 B round trip, whole process: %.4f\n", per);
  // 0.0000-0.0003 as measured (before the inline vectors, rings and
  // pooled slices: 4.8, and 8-9 per side through gRPC's endpoint).
  EXPECT_LE(per, 0.05) << allocs << " allocations in " << kRoundTrips << " round trips";

  // The counter sees the engine's allocations: writes of more pieces than
  // it keeps inline allocate, one per write (the client's and the
  // server's: both answer in 8 pieces).
  client->scattered = true;
  server->scattered = true;
  constexpr int64_t kScattered = 2000;
  ASSERT_TRUE(RoundTrips(*client, 100)) << "scattered warm-up did not finish";
  before = g_allocs.load();
  ASSERT_TRUE(RoundTrips(*client, kScattered)) << "scattered round trips did not finish";
  double scattered = static_cast<double>(g_allocs.load() - before) / kScattered;
  printf("heap allocations per round trip of 8-piece writes: %.2f\n", scattered);
  EXPECT_GE(scattered, 1.9) << "the engine's allocations were not counted: is the counter wired in?";
  EXPECT_FALSE(client->failed.load());
  EXPECT_FALSE(server->failed.load());
  EXPECT_EQ(g_slots.failed.load(), 0u) << "received bytes went to the heap";
  s.reset();
  c->reset();
  ce->reset();
  se->reset();
}

INSTANTIATE_TEST_SUITE_P(PollModes, Allocations,
                         ::testing::Values(PollMode::kAdaptive, PollMode::kEvent, PollMode::kBusy),
                         [](const ::testing::TestParamInfo<PollMode>& i) {
                           switch (i.param) {
                             case PollMode::kAdaptive: return "adaptive";
                             case PollMode::kEvent: return "event";
                             default: return "busy";
                           }
                         });

}  // namespace
}  // namespace grpc_rdma
