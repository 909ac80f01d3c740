// The engine over softverbs: two engines (client and server) in one process.
#include "engine/engine.h"
#include "engine/testing.h"
#include "engine/connection.h"
#include "engine/plan.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <future>
#include <mutex>
#include <random>
#include <thread>

namespace grpc_rdma {
namespace {

using testing::Loopback;
using testing::Pattern;


// Collects everything read from a connection.
class Sink {
 public:
  explicit Sink(std::shared_ptr<Connection> c) : c_(std::move(c)) { Next(); }
  // Waits until `n` bytes arrived (true) or the stream ended / timed out.
  bool WaitFor(size_t n, int ms = 60000) {
    std::unique_lock<std::mutex> l(mu_);
    return cv_.wait_for(l, std::chrono::milliseconds(ms),
                        [&] { return data_.size() >= n || !status_.ok(); }) &&
           data_.size() >= n;
  }
  bool WaitClosed(int ms = 10000) {
    std::unique_lock<std::mutex> l(mu_);
    return cv_.wait_for(l, std::chrono::milliseconds(ms), [&] { return !status_.ok(); });
  }
  std::string data() {
    std::lock_guard<std::mutex> l(mu_);
    return data_;
  }
  absl::Status status() {
    std::lock_guard<std::mutex> l(mu_);
    return status_;
  }
  // Keep received chunks (do not release them) to pin memory.
  void Hold(bool h) { hold_ = h; }
  size_t zero_copy_chunks() {
    std::lock_guard<std::mutex> l(mu_);
    return zero_copy_;
  }

 private:
  void Next() {
    c_->Read([this](absl::StatusOr<RecvChunks> r) { Handle(std::move(r)); });
  }
  void Handle(absl::StatusOr<RecvChunks> r) {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (!r.ok()) {
        status_ = r.status();
        cv_.notify_all();
        return;
      }
      for (RecvChunk& ch : *r) {
        data_.append(ch.data(), ch.size());
        zero_copy_ += ch.zero_copy();
        if (hold_) held_.push_back(std::move(ch));
      }
      cv_.notify_all();
    }
    // Not under mu_: Read may run its callback at once, on this thread.
    c_->Read([this](absl::StatusOr<RecvChunks> r2) { Handle(std::move(r2)); });
  }

  std::shared_ptr<Connection> c_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::string data_;
  absl::Status status_;
  std::atomic<bool> hold_{false};
  std::vector<RecvChunk> held_;
  size_t zero_copy_ = 0;
};


struct Pair {
  std::unique_ptr<Engine> server, client;
  std::shared_ptr<Connection> s, c;
  ChunkMemory server_memory;  // the server engine's, if set before Open
  // Engines fail pending reads when they go: do it while the Sinks those
  // reads report to still exist.
  void Close() {
    s.reset();
    c.reset();
    client.reset();
    server.reset();
  }
  bool Open(const Options& o) { return Open(o, o); }
  // Server and client configured apart (TF_RDMA_* set differently).
  bool Open(const Options& server_options, const Options& client_options) {
    auto se = Engine::Create(server_options, server_memory);
    auto ce = Engine::Create(client_options);
    if (!se.ok() || !ce.ok()) return false;
    server = std::move(*se);
    client = std::move(*ce);
    std::promise<std::shared_ptr<Connection>> accepted;
    auto port = server->Listen(Loopback(0), [&](std::shared_ptr<Connection> c) {
      accepted.set_value(std::move(c));
    });
    if (!port.ok()) return false;
    std::promise<absl::StatusOr<std::shared_ptr<Connection>>> connected;
    client->Connect(Loopback(*port), 5000, [&](absl::StatusOr<std::shared_ptr<Connection>> r) {
      connected.set_value(std::move(r));
    });
    auto r = connected.get_future().get();
    if (!r.ok()) {
      ADD_FAILURE() << r.status();
      return false;
    }
    c = *r;
    s = accepted.get_future().get();
    return true;
  }
};

absl::Status WriteAll(Connection& c, const std::string& data) {
  std::promise<absl::Status> done;
  iovec v{const_cast<char*>(data.data()), data.size()};
  c.Write({v}, [&](absl::Status s) { done.set_value(s); });
  return done.get_future().get();
}

TEST(Engine, ConnectsAndCarriesBytesBothWays) {
  Pair p;
  ASSERT_TRUE(p.Open(Options{}));
  EXPECT_EQ(p.c->peer().rfind("rdma:127.0.0.1:", 0), 0u) << p.c->peer();
  Sink at_server(p.s), at_client(p.c);
  ASSERT_TRUE(WriteAll(*p.c, "hello over rdma").ok());
  ASSERT_TRUE(at_server.WaitFor(15));
  EXPECT_EQ(at_server.data(), "hello over rdma");
  ASSERT_TRUE(WriteAll(*p.s, "and back").ok());
  ASSERT_TRUE(at_client.WaitFor(8));
  EXPECT_EQ(at_client.data(), "and back");
  EXPECT_EQ(p.c->device(), "mlx5_0");
  EXPECT_EQ(p.s->device(), "mlx5_0");
  EXPECT_EQ(p.c->stats().connection_errors, 0u);
  EXPECT_EQ(p.s->stats().connection_errors, 0u);
  EXPECT_EQ(p.server->refused(), 0u);
  p.Close();
}

// TF_RDMA_TOS reaches both ends' QPs (the server's through its listener,
// as the kernel's CM passes it on); TF_RDMA_PORT and TF_RDMA_GID_INDEX
// that the device has are met; ones it lacks are errors at start that say
// what the device has.
TEST(Engine, RoceSettingsReachTheQpsOrAreRefusedAtStart) {
  Options o;
  o.tos = 106;
  o.port = 1;
  o.gid_index = 0;
  Pair p;
  ASSERT_TRUE(p.Open(o));
  for (auto& c : {p.c, p.s}) {
    auto* impl = dynamic_cast<ConnImpl*>(c.get());
    ASSERT_NE(impl, nullptr);
    ibv_qp_attr a{};
    ibv_qp_init_attr init{};
    ASSERT_EQ(ibv_query_qp(impl->qp(), &a, IBV_QP_AV, &init), 0);
    EXPECT_EQ(a.ah_attr.grh.traffic_class, 106) << (c == p.c ? "client" : "server");
  }
  Sink at_server(p.s);
  ASSERT_TRUE(WriteAll(*p.c, "over port 1, GID 0, TOS 106").ok());
  ASSERT_TRUE(at_server.WaitFor(27));
  p.Close();

  Options bad;
  bad.port = 2;
  auto e = Engine::Create(bad);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(e.status().message().find("TF_RDMA_PORT=2: no such port on any RDMA device "
                                      "(mlx5_0 has 1 port)"),
            absl::string_view::npos)
      << e.status();
  bad = Options();
  bad.gid_index = 3;
  bad.device_explicit = true;  // mlx5_0
  e = Engine::Create(bad);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("TF_RDMA_GID_INDEX=3: no such port and GID (port 1 of "
                                      "mlx5_0 has no GID at index 3 (its table has 1 entry))"),
            absl::string_view::npos)
      << e.status();
}

// Backpressure from the peer's receive buffers, counted: while the
// server's poller is held in a read callback it reposts no receives and
// returns no credits, so the client's 100 eager messages (more than
// TF_RDMA_EAGER_DEPTH) must wait for credits; once let go, all arrive.
TEST(Engine, WritesThatWaitForThePeersCreditsAreCounted) {
  Options o;
  o.eager_depth = 16;
  Pair p;
  ASSERT_TRUE(p.Open(o));
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::promise<std::string> first;
  p.s->Read([&, released](absl::StatusOr<RecvChunks> r) {
    std::string got;
    if (r.ok()) {
      for (RecvChunk& ch : *r) got.append(ch.data(), ch.size());
    }
    first.set_value(got);
    released.wait();  // the server's poller, held
  });
  const size_t n = 100, size = o.acc_size;  // one message per SEND
  std::string all = Pattern(n * size, 4);
  std::atomic<size_t> written{0};
  for (size_t i = 0; i < n; ++i) {
    iovec v{all.data() + i * size, size};
    p.c->Write({v}, [&](absl::Status s) {
      if (s.ok()) written.fetch_add(1);
    });
  }
  std::string head = first.get_future().get();
  uint64_t waits = 0;
  for (int i = 0; i < 500 && waits == 0; ++i) {
    waits = p.c->stats().credit_waits;
    if (waits == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_GE(waits, 1u) << "100 messages against " << o.eager_depth << " receives";
  EXPECT_LT(written.load(), n) << "every write went out with the receiver held";
  release.set_value();
  Sink rest(p.s);
  ASSERT_TRUE(rest.WaitFor(all.size() - head.size()));
  EXPECT_TRUE(head + rest.data() == all);
  EXPECT_EQ(p.s->stats().credit_waits, 0u) << "the server wrote nothing";
  EXPECT_EQ(p.c->stats().connection_errors, 0u);
  p.Close();
}

// Small writes that queue while the peer has given no credits go out
// coalesced, several to a SEND, once credits come back, every byte in
// order. The server's poller is held in its first read callback, so the
// client's credits run out whatever the timing.
TEST(Engine, SmallWritesQueuedBehindCreditsShareSends) {
  Options o;
  o.eager_depth = 16;
  Pair p;
  ASSERT_TRUE(p.Open(o));
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::promise<std::string> first;
  p.s->Read([&, released](absl::StatusOr<RecvChunks> r) {
    std::string got;
    if (r.ok()) {
      for (RecvChunk& ch : *r) got.append(ch.data(), ch.size());
    }
    first.set_value(got);
    released.wait();  // the server's poller, held
  });
  const size_t n = 400, size = 100;  // far more writes than credits
  std::string all = Pattern(n * size, 8);
  for (size_t i = 0; i < n; ++i) {
    iovec v{all.data() + i * size, size};
    p.c->Write({v}, [](absl::Status) {});
  }
  std::string head = first.get_future().get();
  uint64_t waits = 0;
  for (int i = 0; i < 500 && waits == 0; ++i) {
    waits = p.c->stats().credit_waits;
    if (waits == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_GE(waits, 1u) << n << " writes against " << o.eager_depth << " receives";
  release.set_value();
  Sink rest(p.s);
  ASSERT_TRUE(rest.WaitFor(all.size() - head.size()));
  EXPECT_TRUE(head + rest.data() == all) << "bytes differ";
  EXPECT_GT(p.c->stats().coalesced_writes, 0u) << "queued small writes shared SENDs";
  p.Close();
}

TEST(Engine, RandomWriteSizesAreByteExactAndInOrderBothWays) {
  Options o;
  o.chunk_size = 256 << 10;  // several chunks per large write
  Pair p;
  ASSERT_TRUE(p.Open(o));
  Sink at_server(p.s), at_client(p.c);
  std::mt19937 rng(42);
  std::vector<size_t> sizes = {0, 1, 8191, 8192, 8193, 16384, 1 << 20, (4 << 20) + 1, 64 << 20};
  for (int i = 0; i < 40; ++i) sizes.push_back(rng() % 20000);
  std::shuffle(sizes.begin(), sizes.end(), rng);
  std::string to_server, to_client;
  for (size_t i = 0; i < sizes.size(); ++i) {
    to_server += Pattern(sizes[i], static_cast<uint32_t>(i));
    to_client += Pattern(sizes[i] / 2, static_cast<uint32_t>(i + 1000));
  }
  // Many writes outstanding at once, both directions at the same time.
  auto writer = [&](Connection& c, const std::string& all) {
    std::atomic<int> left{static_cast<int>(sizes.size())};
    std::promise<void> done;
    size_t off = 0;
    std::atomic<bool> ok{true};
    for (size_t i = 0; i < sizes.size(); ++i) {
      size_t n = (&all == &to_server) ? sizes[i] : sizes[i] / 2;
      iovec v{const_cast<char*>(all.data()) + off, n};
      off += n;
      c.Write({v}, [&](absl::Status s) {
        if (!s.ok()) ok = false;
        if (--left == 0) done.set_value();
      });
    }
    done.get_future().wait();
    return ok.load();
  };
  auto f1 = std::async(std::launch::async, [&] { return writer(*p.c, to_server); });
  auto f2 = std::async(std::launch::async, [&] { return writer(*p.s, to_client); });
  EXPECT_TRUE(f1.get());
  EXPECT_TRUE(f2.get());
  ASSERT_TRUE(at_server.WaitFor(to_server.size()));
  ASSERT_TRUE(at_client.WaitFor(to_client.size()));
  EXPECT_TRUE(at_server.data() == to_server) << "bytes differ";
  EXPECT_TRUE(at_client.data() == to_client) << "bytes differ";
  ConnectionStats cs = p.c->stats();
  EXPECT_GT(cs.eager_messages, 0u);
  // Whether small writes shared SENDs here depends on timing (each may go
  // at once): SmallWritesQueuedBehindCreditsShareSends checks coalescing.
  EXPECT_GT(cs.rendezvous, 0u);
  EXPECT_GT(p.s->stats().chunks_zero_copy, 0u) << "chunks lent to the reader";
  p.Close();
}

TEST(Engine, APoolMuchSmallerThanTheDataIsBackpressureNotFailure) {
  Options o;
  o.chunk_size = 64 << 10;
  o.eager_depth = 16;
  o.buf_size = 4 * (64 << 10) + 2 * 16 * (32 << 10) + (512 << 10);
  Pair p;
  ASSERT_TRUE(p.Open(o));
  Sink at_server(p.s);
  at_server.Hold(true);  // the reader keeps everything, as gRPC keeps a message
  std::string big = Pattern(16 << 20, 9);
  ASSERT_TRUE(WriteAll(*p.c, big).ok());
  ASSERT_TRUE(at_server.WaitFor(big.size()));
  EXPECT_TRUE(at_server.data() == big);
  EXPECT_GT(p.s->stats().chunks_copied, 0u) << "copied once pinned memory ran short";
  EXPECT_LE(p.server->pinned_bytes(), o.buf_size);
  p.Close();
}

// The copy counters: a small message is copied once on each side (into the
// staging buffer, out of the receive buffer); a large one not at all on
// receive while its chunks are lent to the reader, and on send once with
// TF_RDMA_ZERO_COPY=false, not at all with it (softverbs has implicit
// on-demand paging: chunks go from the writer's buffer).
void CountsCopies(bool zero_copy) {
  Pair p;
  Options o;
  o.zero_copy = zero_copy;
  ASSERT_TRUE(p.Open(o));
  Sink at_server(p.s);
  // 4 MiB: four 1 MiB chunks, large enough to go zero-copy.
  std::string small = Pattern(1000, 1), big = Pattern(4 << 20, 2);
  ASSERT_TRUE(WriteAll(*p.c, small).ok());
  ASSERT_TRUE(at_server.WaitFor(small.size()));
  EXPECT_EQ(p.c->stats().bytes_copied_on_send, small.size());
  EXPECT_EQ(p.s->stats().bytes_copied_on_receive, small.size());
  uint64_t lent_before = p.s->stats().chunks_zero_copy;
  ASSERT_TRUE(WriteAll(*p.c, big).ok());
  ASSERT_TRUE(at_server.WaitFor(small.size() + big.size()));
  EXPECT_TRUE(at_server.data() == small + big);
  ConnectionStats c = p.c->stats(), s = p.s->stats();
  EXPECT_EQ(c.bytes_copied_on_send, small.size() + (zero_copy ? 0 : big.size()));
  EXPECT_GT(s.chunks_zero_copy, lent_before);
  EXPECT_EQ(s.chunks_copied, 0u);
  EXPECT_EQ(s.bytes_copied_on_receive, small.size()) << "lent chunks are not copied";
  EXPECT_EQ(c.bytes_copied_on_receive, 0u);
  EXPECT_EQ(s.bytes_copied_on_send, 0u);
  p.Close();
}

TEST(Engine, CountsTheBytesItCopies) { CountsCopies(false); }
TEST(Engine, CountsTheBytesItCopiesWithZeroCopySends) { CountsCopies(true); }

// Eager messages that fit the QP's inline limit (256 bytes over softverbs,
// the 32-byte header included) travel inside the work request; larger ones
// from a registered buffer. Both arrive byte for byte, in order.
TEST(Engine, SmallEagerMessagesGoInline) {
  Pair p;
  ASSERT_TRUE(p.Open(Options{}));
  Sink at_server(p.s);
  std::string tiny = Pattern(1, 3), fits = Pattern(256 - 32, 4), over = Pattern(256 - 31, 5);
  ASSERT_TRUE(WriteAll(*p.c, tiny).ok());
  ASSERT_TRUE(WriteAll(*p.c, fits).ok());
  ASSERT_TRUE(at_server.WaitFor(tiny.size() + fits.size()));
  ConnectionStats c = p.c->stats();
  EXPECT_EQ(c.inline_messages, c.eager_messages) << "every message so far fits inline";
  EXPECT_GE(c.inline_messages, 1u);
  uint64_t inline_before = c.inline_messages, eager_before = c.eager_messages;
  ASSERT_TRUE(WriteAll(*p.c, over).ok());
  ASSERT_TRUE(at_server.WaitFor(tiny.size() + fits.size() + over.size()));
  c = p.c->stats();
  EXPECT_EQ(c.eager_messages, eager_before + 1);
  EXPECT_EQ(c.inline_messages, inline_before) << "257 bytes with the header: not inline";
  EXPECT_TRUE(at_server.data() == tiny + fits + over);
  // Both ways, many: the server's answers too.
  Sink at_client(p.c);
  std::string all;
  for (int i = 0; i < 200; ++i) {
    std::string m = Pattern(1 + (i * 7) % 300, 100 + i);
    all += m;
    ASSERT_TRUE(WriteAll(*p.s, m).ok());
  }
  ASSERT_TRUE(at_client.WaitFor(all.size()));
  EXPECT_TRUE(at_client.data() == all);
  EXPECT_GT(p.s->stats().inline_messages, 0u);
  EXPECT_LT(p.s->stats().inline_messages, p.s->stats().eager_messages);
  p.Close();
}

// Received bytes the engine copies go into the reader's ChunkMemory (the
// glue's: gRPC slices), once, and are released once: when the chunk goes,
// or by the reader after it took them over.
std::atomic<int> g_chunk_allocs{0}, g_chunk_releases{0};
void* CountingAllocate(size_t size, char** data) {
  ++g_chunk_allocs;
  auto* block = new std::string(size, '\0');
  *data = block->data();
  return block;
}
void CountingRelease(void* owner) {
  ++g_chunk_releases;
  delete static_cast<std::string*>(owner);
}

std::vector<RecvChunk> ReadAtLeast(Connection& c, size_t n) {
  std::vector<RecvChunk> got;
  size_t have = 0;
  while (have < n) {
    std::promise<absl::StatusOr<RecvChunks>> done;
    c.Read([&](absl::StatusOr<RecvChunks> r) { done.set_value(std::move(r)); });
    auto f = done.get_future();
    if (f.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
      ADD_FAILURE() << "no bytes within 10 s";
      break;
    }
    absl::StatusOr<RecvChunks> r = f.get();
    if (!r.ok()) {
      ADD_FAILURE() << r.status();
      break;
    }
    for (RecvChunk& ch : *r) {
      have += ch.size();
      got.push_back(std::move(ch));
    }
  }
  return got;
}

TEST(Engine, CopiedBytesGoIntoTheReadersMemory) {
  g_chunk_allocs = g_chunk_releases = 0;
  Pair p;
  p.server_memory = ChunkMemory{CountingAllocate, CountingRelease};
  ASSERT_TRUE(p.Open(Options{}));
  std::string first = Pattern(1000, 3), second = Pattern(300, 4);
  ASSERT_TRUE(WriteAll(*p.c, first).ok());
  std::vector<RecvChunk> got = ReadAtLeast(*p.s, first.size());
  ASSERT_TRUE(WriteAll(*p.c, second).ok());
  for (RecvChunk& ch : ReadAtLeast(*p.s, second.size())) got.push_back(std::move(ch));
  ASSERT_GE(got.size(), 2u);
  std::string data;
  for (const RecvChunk& ch : got) {
    data.append(ch.data(), ch.size());
    EXPECT_NE(ch.owner(), nullptr) << "copied into the reader's memory";
    EXPECT_FALSE(ch.zero_copy());
  }
  EXPECT_EQ(data, first + second);
  EXPECT_EQ(g_chunk_allocs.load(), static_cast<int>(got.size()));
  EXPECT_EQ(g_chunk_releases.load(), 0);
  EXPECT_EQ(p.s->stats().bytes_copied_on_receive, first.size() + second.size());
  // Taken over: the chunk is empty and releases nothing; moved: released
  // once, by the chunk it moved to.
  void* taken = got[0].TakeOwner();
  ASSERT_NE(taken, nullptr);
  EXPECT_EQ(got[0].size(), 0u);
  EXPECT_EQ(got[0].TakeOwner(), nullptr);
  RecvChunk moved = std::move(got[1]);
  EXPECT_EQ(got[1].owner(), nullptr);
  got.clear();
  EXPECT_EQ(g_chunk_releases.load(), g_chunk_allocs.load() - 2);
  { RecvChunk gone = std::move(moved); }
  EXPECT_EQ(g_chunk_releases.load(), g_chunk_allocs.load() - 1);
  CountingRelease(taken);
  EXPECT_EQ(g_chunk_releases.load(), g_chunk_allocs.load());
  p.Close();
}

// A landing buffer lent to the reader goes back to the pool when the
// reader lets go of it; that wakes the poller thread only if a connection
// waits for pinned memory (it used to, each time: a thread switch per
// mid-size message).
TEST(Engine, BuffersGivenBackWakeNobodyWhenNobodyWaits) {
  Pair p;
  ASSERT_TRUE(p.Open(Options{}));
  Sink at_server(p.s);
  std::string msg = Pattern(64 << 10, 5);
  size_t got = 0;
  ASSERT_TRUE(WriteAll(*p.c, msg).ok());  // standing grants in place
  ASSERT_TRUE(at_server.WaitFor(got += msg.size()));
  uint64_t wakeups_before = p.server->poller_wakeups();
  size_t lent_before = p.s->stats().chunks_zero_copy;
  constexpr int kMessages = 40;
  for (int i = 0; i < kMessages; ++i) {
    ASSERT_TRUE(WriteAll(*p.c, msg).ok());
    ASSERT_TRUE(at_server.WaitFor(got += msg.size()));
  }
  uint64_t lent = p.s->stats().chunks_zero_copy - lent_before;
  uint64_t wakeups = p.server->poller_wakeups() - wakeups_before;
  EXPECT_GE(lent, kMessages / 2u) << "the messages were lent to the reader";
  EXPECT_LT(wakeups, lent / 4) << lent << " buffers given back woke the poller " << wakeups
                               << " times";
  p.Close();
}

TEST(Engine, ConnectingToNobodyIsUnavailable) {
  auto e = Engine::Create(Options{});
  ASSERT_TRUE(e.ok()) << e.status();
  std::promise<absl::Status> r;
  (*e)->Connect(Loopback(40999), 2000, [&](absl::StatusOr<std::shared_ptr<Connection>> c) {
    r.set_value(c.status());
  });
  absl::Status s = r.get_future().get();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
}

TEST(Engine, ShutdownFailsThePeersReadsAndLaterWrites) {
  Pair p;
  ASSERT_TRUE(p.Open(Options{}));
  Sink at_client(p.c);
  p.s->Shutdown(absl::UnavailableError("server going away"));
  ASSERT_TRUE(at_client.WaitClosed());
  EXPECT_EQ(at_client.status().code(), absl::StatusCode::kUnavailable);
  absl::Status w = WriteAll(*p.s, "too late");
  EXPECT_EQ(w.code(), absl::StatusCode::kUnavailable);
  p.Close();
}

TEST(Engine, BadOptionsAndAbsentDevicesAreClearErrors) {
  Options o;
  o.acc_size = o.chunk_size * 2;
  EXPECT_EQ(Engine::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Options{};
  o.device = "mlx5_9";
  o.device_explicit = true;
  auto e = Engine::Create(o);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kNotFound) << e.status();
}

}  // namespace
}  // namespace grpc_rdma

namespace grpc_rdma {
namespace {

// A write reported done may still be on its way: a Shutdown right after it
// must let it land before the disconnect (it would be flushed otherwise).
TEST(Engine, ShutdownAfterWritesDoneStillDeliversThem) {
  for (int round = 0; round < 10; ++round) {
    Pair p;
    ASSERT_TRUE(p.Open(Options{}));
    Sink at_server(p.s);
    std::string all;
    std::vector<std::string> pieces;
    for (int i = 0; i < 64; ++i) pieces.push_back(Pattern(i % 8 == 7 ? 300000 : 3000, i + round));
    std::atomic<int> left{static_cast<int>(pieces.size())};
    std::promise<void> all_done;
    for (auto& piece : pieces) {
      all += piece;
      iovec v{piece.data(), piece.size()};
      p.c->Write({v}, [&](absl::Status s) {
        EXPECT_TRUE(s.ok()) << s;
        if (--left == 0) all_done.set_value();
      });
    }
    all_done.get_future().get();
    p.c->Shutdown(absl::UnavailableError("client done"));
    ASSERT_TRUE(at_server.WaitClosed()) << "round " << round;
    ASSERT_EQ(at_server.data().size(), all.size()) << "round " << round;
    EXPECT_TRUE(at_server.data() == all) << "round " << round;
    p.Close();
  }
}

// After a local Shutdown, reads fail even when unread data was waiting.
TEST(Engine, ReadsFailAfterLocalShutdownWithUnreadData) {
  Pair p;
  ASSERT_TRUE(p.Open(Options{}));
  ASSERT_TRUE(WriteAll(*p.c, Pattern(5000, 1)).ok());
  ASSERT_TRUE(WriteAll(*p.c, Pattern(500000, 2)).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // let it land
  p.s->Shutdown(absl::UnavailableError("server gone"));
  std::promise<absl::Status> read;
  p.s->Read([&](absl::StatusOr<RecvChunks> r) { read.set_value(r.status()); });
  absl::Status s = read.get_future().get();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  p.Close();
}

// One read at a time: a second Read fails at once, and the pending one
// still gets the bytes (the glue relies on every read being called back).
TEST(Engine, ASecondPendingReadFailsAndTheFirstStillCompletes) {
  Pair p;
  ASSERT_TRUE(p.Open(Options{}));
  std::promise<absl::StatusOr<size_t>> first;
  p.s->Read([&](absl::StatusOr<RecvChunks> r) {
    if (!r.ok()) {
      first.set_value(r.status());
      return;
    }
    size_t n = 0;
    for (const RecvChunk& c : *r) n += c.size();
    first.set_value(n);
  });
  std::promise<absl::Status> second;
  p.s->Read([&](absl::StatusOr<RecvChunks> r) { second.set_value(r.status()); });
  auto f2 = second.get_future();
  ASSERT_EQ(f2.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  EXPECT_EQ(f2.get().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(WriteAll(*p.c, Pattern(100, 3)).ok());
  auto f1 = first.get_future();
  ASSERT_EQ(f1.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  absl::StatusOr<size_t> got = f1.get();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_GT(*got, 0u);
  p.Close();
}

}  // namespace
}  // namespace grpc_rdma

namespace grpc_rdma {
namespace {

// gRPC may keep a received slice (a lent chunk) after the connection and
// the engine are gone: the chunk's memory region and its PD must still go
// cleanly when it is dropped (no "ibv_dealloc_pd: busy", nothing leaked).
TEST(Engine, LentChunkOutlivingItsConnectionFreesItsPd) {
  ::testing::internal::CaptureStderr();
  {
    std::vector<RecvChunk> kept;  // outlives the connections and engines
    size_t zero_copy = 0;
    {
      Pair p;
      ASSERT_TRUE(p.Open(Options{}));
      ASSERT_TRUE(WriteAll(*p.c, Pattern(1 << 20, 3)).ok());
      size_t got = 0;
      while (got < (1u << 20)) {
        std::promise<absl::StatusOr<RecvChunks>> r;
        p.s->Read([&](absl::StatusOr<RecvChunks> x) { r.set_value(std::move(x)); });
        auto chunks = r.get_future().get();
        ASSERT_TRUE(chunks.ok()) << chunks.status();
        for (RecvChunk& c : *chunks) {
          got += c.size();
          zero_copy += c.zero_copy();
          kept.push_back(std::move(c));
        }
      }
      p.Close();  // connections and engines go; `kept` still holds chunks
    }
    EXPECT_GT(zero_copy, 0u);
  }  // the chunks go last
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err.find("ibv_dealloc_pd"), std::string::npos) << err;
}

}  // namespace
}  // namespace grpc_rdma

namespace grpc_rdma {
namespace {

// Mid-size messages (above the eager limit, within a standing grant) go at
// once into the receiver's standing grants: in order with eager data and
// announced transfers, byte-exact, and received without a copy.
TEST(Engine, MidSizeMessagesUseStandingGrants) {
  Pair p;
  ASSERT_TRUE(p.Open(Options{}));
  Sink at_server(p.s);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // grants arrive
  std::string all;
  const size_t kSizes[] = {100000, 50, 200000, 9000, 262144, 1 << 20, 70000, 3};
  for (int round = 0; round < 5; ++round) {
    for (size_t i = 0; i < sizeof(kSizes) / sizeof(kSizes[0]); ++i) {
      std::string m = Pattern(kSizes[i], round * 100 + i);
      all += m;
      ASSERT_TRUE(WriteAll(*p.c, m).ok());
    }
  }
  ASSERT_TRUE(at_server.WaitFor(all.size()));
  EXPECT_TRUE(at_server.data() == all);
  ConnectionStats st = p.c->stats();
  EXPECT_GT(st.rendezvous_pre_granted, 0u) << "no message went into a standing grant";
  EXPECT_GT(st.rendezvous, st.rendezvous_pre_granted) << "1 MiB messages must still be announced";
  EXPECT_GT(at_server.zero_copy_chunks(), 0u);
  p.Close();
}

// A message announced once that a large standing grant could hold (1 MiB
// and gRPC's framing: above a small standing grant's 512 KiB, within 2
// MiB) makes the receiver keep large standing grants out: such messages,
// of any size up to 2 MiB, then go unannounced, in one write from the
// writer's own buffers (zero-copy from 1 MiB); larger ones are still
// announced.
TEST(Engine, AnnouncedLargeMessagesGetLargeStandingGrants) {
  Pair p;
  ASSERT_TRUE(p.Open(Options{}));
  Sink at_server(p.s);
  std::string all;
  auto send = [&](size_t size, int seed) {
    std::string m = Pattern(size, seed);
    all += m;
    ASSERT_TRUE(WriteAll(*p.c, m).ok());
    ASSERT_TRUE(at_server.WaitFor(all.size()));
    // The used grant's successor on its way (the poller grants at once).
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  };
  const size_t kMiB1 = (1 << 20) + 14;
  for (int i = 0; i < 5; ++i) send(kMiB1, i);
  ConnectionStats st = p.c->stats();
  EXPECT_EQ(st.rendezvous, 5u);
  EXPECT_EQ(st.rendezvous - st.rendezvous_pre_granted, 1u) << "only the first is announced";
  EXPECT_EQ(st.bytes_copied_on_send, kMiB1)
      << "the first one's 256 KiB pieces are copied, the others written from the writer's buffers";
  send((3 << 20) / 2, 7);
  send((2 << 20) + 14, 8);
  st = p.c->stats();
  EXPECT_EQ(st.rendezvous - st.rendezvous_pre_granted, 2u)
      << "1.5 MiB fits a large grant; 2 MiB and framing is announced";
  EXPECT_TRUE(at_server.data() == all);
  EXPECT_EQ(p.s->stats().chunks_copied, 0u);
  p.Close();
}

}  // namespace
}  // namespace grpc_rdma

namespace grpc_rdma {
namespace {

// Standing grants are landing buffers too, but they must not count against
// TF_RDMA_CHUNKS_IN_FLIGHT: with as few chunks in flight as there are
// standing grants outstanding, an announced transfer would never be
// granted and both sides would wait for ever.
TEST(Engine, AnnouncedTransfersProgressWithOneChunkInFlight) {
  Options o;
  o.chunks_in_flight = 1;
  o.chunk_size = 256 << 10;
  Pair p;
  ASSERT_TRUE(p.Open(o));
  Sink at_server(p.s);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // grants arrive
  const size_t kSizes[] = {1 << 20, 100000, (2 << 20) + 7, 3};
  auto msgs = std::make_shared<std::vector<std::string>>();
  std::string all;
  for (size_t i = 0; i < sizeof(kSizes) / sizeof(kSizes[0]); ++i) {
    msgs->push_back(Pattern(kSizes[i], 500 + i));
    all += msgs->back();
  }
  auto ok = std::make_shared<std::atomic<int>>(0);
  for (std::string& m : *msgs) {  // not waited for: they would block for ever
    p.c->Write({iovec{m.data(), m.size()}}, [msgs, ok](absl::Status s) {
      if (s.ok()) ++*ok;
    });
  }
  ASSERT_TRUE(at_server.WaitFor(all.size(), 20000)) << "an announced transfer was never granted";
  EXPECT_EQ(ok->load(), 4);
  EXPECT_TRUE(at_server.data() == all);
  EXPECT_GT(p.c->stats().rendezvous, p.c->stats().rendezvous_pre_granted);
  p.Close();
}

}  // namespace
}  // namespace grpc_rdma

namespace grpc_rdma {
namespace {

// TF_RDMA_CHUNK_SIZE and TF_RDMA_ACC_SIZE are per-process settings, and
// the two ends of a connection need not agree: a grant (announced or
// standing) must never be larger than the writer's own chunk size, nor an
// eager message larger than its own buffers, whichever side has the larger
// ones.
TEST(Engine, EndsWithDifferentChunkAndEagerSizesInteroperate) {
  Options small, large;
  small.chunk_size = 64 << 10;
  large.chunk_size = 1 << 20;
  large.acc_size = 256 << 10;
  for (int server_small = 0; server_small < 2; ++server_small) {
    Pair p;
    ASSERT_TRUE(server_small ? p.Open(small, large) : p.Open(large, small));
    Sink at_server(p.s), at_client(p.c);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // grants arrive
    const size_t kSizes[] = {100000, 20000, 300000, (4 << 20) + 3, 600000, 65536, 1 << 20};
    std::string to_server, to_client;
    for (size_t i = 0; i < sizeof(kSizes) / sizeof(kSizes[0]); ++i) {
      std::string m = Pattern(kSizes[i], 700 + i), r = Pattern(kSizes[i], 800 + i);
      ASSERT_TRUE(WriteAll(*p.c, m).ok()) << "size " << kSizes[i];
      ASSERT_TRUE(WriteAll(*p.s, r).ok()) << "size " << kSizes[i];
      to_server += m;
      to_client += r;
    }
    ASSERT_TRUE(at_server.WaitFor(to_server.size(), 20000)) << at_server.status();
    ASSERT_TRUE(at_client.WaitFor(to_client.size(), 20000)) << at_client.status();
    EXPECT_TRUE(at_server.data() == to_server);
    EXPECT_TRUE(at_client.data() == to_client);
    // Toward the small end, standing grants of 64 KiB (above its 8 KiB
    // eager limit) are used; the large end's 64 KiB grants would be under
    // its 256 KiB eager limit, so it makes none.
    EXPECT_GT((server_small ? p.c : p.s)->stats().rendezvous_pre_granted, 0u);
    EXPECT_EQ((server_small ? p.s : p.c)->stats().rendezvous_pre_granted, 0u);
    p.Close();
  }
}

}  // namespace
}  // namespace grpc_rdma

namespace grpc_rdma {
namespace {

// An announced transfer that the chunks in flight would cover is cut into
// that many pieces, so they move in parallel and the reader gets the first
// early: 4 MiB + 3 bytes with 4 MiB chunks, 4 in flight, arrives as four
// 1 MiB pieces and the 3-byte tail, 3 MiB as three 1 MiB pieces.
TEST(Engine, AnnouncedTransfersAreCutIntoPiecesThatMoveTogether) {
  Pair p;
  ASSERT_TRUE(p.Open(Options{}));
  Sink at_server(p.s);
  std::string big = Pattern((4 << 20) + 3, 77);
  ASSERT_TRUE(WriteAll(*p.c, big).ok());
  ASSERT_TRUE(at_server.WaitFor(big.size()));
  EXPECT_TRUE(at_server.data() == big);
  EXPECT_EQ(p.s->stats().chunks_zero_copy, 5u);
  // 3 MiB: four 512 KiB pieces would leave 1 MiB over; three of 1 MiB.
  std::string three = Pattern(3 << 20, 78);
  ASSERT_TRUE(WriteAll(*p.c, three).ok());
  ASSERT_TRUE(at_server.WaitFor(big.size() + three.size()));
  EXPECT_TRUE(at_server.data() == big + three);
  EXPECT_EQ(p.s->stats().chunks_zero_copy, 5u + 3u);
  p.Close();
}

// A connection a host event loop polls itself (SetHostPolled): its
// descriptor becomes readable when data comes and PollNow hands the data
// over; when the host stops polling, the engine's poller still delivers
// (after its grace), and once given back it delivers as before.
TEST(Engine, AHostPolledConnectionIsHandledByTheHostOrElseByThePoller) {
  Pair p;
  ASSERT_TRUE(p.Open(Options{}));
  ASSERT_GE(p.s->event_fd(), 0);
  p.server->SetExternalPolling(true);
  p.s->SetHostPolled(true);
  // While the host polls, the poller only looks every 20 ms: most messages
  // are handed over by PollNow on this thread, a few may be the poller's.
  int by_host = 0, readable_seen = 0;
  for (int i = 0; i < 5; ++i) {
    p.s->PollNow();
    std::mutex mu;
    std::string got;
    std::thread::id reader;
    p.s->Read([&](absl::StatusOr<RecvChunks> r) {
      std::lock_guard<std::mutex> l(mu);
      reader = std::this_thread::get_id();
      if (r.ok())
        for (RecvChunk& c : *r) got.append(c.data(), c.size());
    });
    std::string msg = "polled by the host " + std::to_string(i);
    ASSERT_TRUE(WriteAll(*p.c, msg).ok());
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    bool readable = false;
    for (;;) {
      pollfd pfd{p.s->event_fd(), POLLIN, 0};
      readable |= poll(&pfd, 1, 10) == 1;
      p.s->PollNow();
      std::lock_guard<std::mutex> l(mu);
      if (!got.empty() || std::chrono::steady_clock::now() > deadline) break;
    }
    std::lock_guard<std::mutex> l(mu);
    ASSERT_EQ(got, msg);
    if (reader == std::this_thread::get_id()) {
      ++by_host;
      readable_seen += readable;
    }
  }
  EXPECT_GE(by_host, 3) << "PollNow handed over too few messages";
  EXPECT_GE(readable_seen, 1) << "the descriptor never said a message was there";
  // Nobody polls any more (100 ms without PollNow): the poller steps in.
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  Sink at_server(p.s);
  ASSERT_TRUE(WriteAll(*p.c, "by the poller").ok());
  EXPECT_TRUE(at_server.WaitFor(13, 5000)) << "a host-polled connection left waiting";
  p.s->SetHostPolled(false);
  p.server->SetExternalPolling(false);
  ASSERT_TRUE(WriteAll(*p.c, "and by the engine").ok());
  EXPECT_TRUE(at_server.WaitFor(13 + 17, 5000)) << "not delivered once given back";
  EXPECT_EQ(at_server.data(), "by the pollerand by the engine");
  p.Close();
}

// One page whose first touch blocks the touching thread until Release():
// memory that makes the engine stop in the middle of a copy, for as long as
// a test wants (userfaultfd, user-mode faults only, so no privilege needed).
class StuckPage {
 public:
  static constexpr size_t kSize = 4096;
  StuckPage() {
    uffd_ = static_cast<int>(syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY));
    if (uffd_ < 0) {
      error_ = std::string("userfaultfd: ") + strerror(errno);
      return;
    }
    uffdio_api api{};
    api.api = UFFD_API;
    void* m = mmap(nullptr, kSize, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (ioctl(uffd_, UFFDIO_API, &api) != 0 || m == MAP_FAILED) {
      error_ = std::string("UFFDIO_API or mmap: ") + strerror(errno);
      return;
    }
    page_ = static_cast<char*>(m);
    uffdio_register reg{};
    reg.range.start = reinterpret_cast<uint64_t>(page_);
    reg.range.len = kSize;
    reg.mode = UFFDIO_REGISTER_MODE_MISSING;
    if (ioctl(uffd_, UFFDIO_REGISTER, &reg) != 0)
      error_ = std::string("UFFDIO_REGISTER: ") + strerror(errno);
  }
  ~StuckPage() {
    Release(std::string(kSize, '\0'));
    if (page_ != nullptr) munmap(page_, kSize);
    if (uffd_ >= 0) close(uffd_);
  }
  const std::string& error() const { return error_; }
  char* data() const { return page_; }
  // True once a thread touched the page (and is now stuck on it).
  bool WaitTouched(int ms) {
    pollfd p{uffd_, POLLIN, 0};
    if (poll(&p, 1, ms) != 1) return false;
    uffd_msg msg;
    return read(uffd_, &msg, sizeof(msg)) == sizeof(msg) && msg.event == UFFD_EVENT_PAGEFAULT;
  }
  // Fills the page with `bytes`, which lets the stuck thread go on.
  void Release(const std::string& bytes) {
    if (released_ || page_ == nullptr || uffd_ < 0) return;
    released_ = true;
    static char src[kSize] __attribute__((aligned(4096)));
    memcpy(src, bytes.data(), std::min(bytes.size(), kSize));
    uffdio_copy copy{};
    copy.dst = reinterpret_cast<uint64_t>(page_);
    copy.src = reinterpret_cast<uint64_t>(src);
    copy.len = kSize;
    ioctl(uffd_, UFFDIO_COPY, &copy);
  }

 private:
  int uffd_ = -1;
  char* page_ = nullptr;
  bool released_ = false;
  std::string error_;
};

// Writes `n` bytes of `page` on `c` from another thread: the engine stops
// in the copy, holding c's lock, until the page is released. The future
// has the write's status.
std::future<absl::Status> WriteFromStuckPage(Connection& c, StuckPage& page, size_t n) {
  return std::async(std::launch::async, [&c, &page, n] {
    std::promise<absl::Status> done;
    iovec v{page.data(), n};
    c.Write({v}, [&](absl::Status st) { done.set_value(st); });
    return done.get_future().get();
  });
}

// Receives handled in one pass over the CQ go back to the device in one
// ibv_post_recv. The server's own writer is held in the middle of a copy
// (its connection's lock held) while the client sends 16 messages, so no
// thread can handle their completions one by one; once the writer lets
// go, the 16 are handled in one pass. One post per message would count 16.
TEST(Engine, ReceivesHandledTogetherArePostedAgainTogether) {
  StuckPage page;
  ASSERT_EQ(page.error(), "");
  Pair p;
  ASSERT_TRUE(p.Open(Options{}));
  Sink at_server(p.s), at_client(p.c);
  ASSERT_TRUE(WriteAll(*p.c, "x").ok());
  ASSERT_TRUE(at_server.WaitFor(1));
  const uint64_t before = p.s->stats().receive_reposts;
  const uint64_t eager_before = p.c->stats().eager_messages;

  std::string stuck_bytes = Pattern(100, 9);
  auto s_write = WriteFromStuckPage(*p.s, page, 100);
  ASSERT_TRUE(page.WaitTouched(5000)) << "the server's writer never copied";
  std::string all = "x";
  for (int i = 0; i < 16; ++i) {
    std::string m = Pattern(100, 300 + i);
    all += m;
    ASSERT_TRUE(WriteAll(*p.c, m).ok());  // one SEND each: none waits to share one
  }
  EXPECT_EQ(p.c->stats().eager_messages - eager_before, 16u);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // all 16 arrive meanwhile
  EXPECT_EQ(at_server.data(), "x") << "handled while the connection's lock was held?";
  page.Release(stuck_bytes);
  ASSERT_TRUE(s_write.get().ok());
  ASSERT_TRUE(at_server.WaitFor(all.size()));
  EXPECT_TRUE(at_server.data() == all);
  ASSERT_TRUE(at_client.WaitFor(100));
  EXPECT_TRUE(at_client.data() == stuck_bytes);
  const uint64_t posts = p.s->stats().receive_reposts - before;
  EXPECT_GE(posts, 1u);
  EXPECT_LE(posts, 2u) << "16 receives went back in " << posts << " posts";
  // Every receive went back: the connection takes several times its
  // receives' worth more.
  std::string more = Pattern(64 * 1024, 7);
  for (int i = 0; i < 64; ++i) ASSERT_TRUE(WriteAll(*p.c, more.substr(i * 1024, 1024)).ok());
  EXPECT_TRUE(at_server.WaitFor(all.size() + more.size()));
  EXPECT_TRUE(at_server.data() == all + more);
  p.Close();
}

// A writer that used every standing grant before the used ones came back
// (a stream of mid-size messages faster than the reader's thread turns
// grants around) had to announce the next message; the reader then keeps
// more grants out. Here the server's connection is held in a copy while
// the client writes, so no grant comes back: before, the client had the
// start's 8; after one such stall, it has more.
TEST(Engine, AWriterThatRanOutOfStandingGrantsIsGivenMore) {
  StuckPage first, second;
  ASSERT_EQ(first.error(), "");
  ASSERT_EQ(second.error(), "");
  Pair p;
  ASSERT_TRUE(p.Open(Options{}));
  Sink at_server(p.s), at_client(p.c);
  const std::string msg = Pattern(100 * 1024, 11);  // above the eager limit, within a grant
  ASSERT_TRUE(WriteAll(*p.c, msg).ok());
  ASSERT_TRUE(at_server.WaitFor(msg.size()));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the used grant comes back
  size_t expect = msg.size(), back = 0;
  // Holds the server's connection in a copy, the client writes `n`
  // messages, and counts how many went into standing grants.
  auto stalled = [&](StuckPage& page, int n) -> uint64_t {
    auto held = WriteFromStuckPage(*p.s, page, 100);
    EXPECT_TRUE(page.WaitTouched(5000)) << "the server's writer never copied";
    const ConnectionStats before = p.c->stats();
    std::atomic<int> written{0};
    for (int i = 0; i < n; ++i) {
      iovec v{const_cast<char*>(msg.data()), msg.size()};
      p.c->Write({v}, [&](absl::Status st) {
        EXPECT_TRUE(st.ok()) << st;
        ++written;
      });
    }
    // Until the client ran out: it announced a message (RTS), whose grant
    // cannot come while the server is held.
    auto announced = [&] {
      ConnectionStats st = p.c->stats();
      return (st.rendezvous - st.rendezvous_pre_granted) -
             (before.rendezvous - before.rendezvous_pre_granted);
    };
    for (int i = 0; i < 10000 && announced() == 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    EXPECT_EQ(announced(), 1u) << "the client never ran out of standing grants";
    const uint64_t granted = p.c->stats().rendezvous_pre_granted - before.rendezvous_pre_granted;
    page.Release(std::string(StuckPage::kSize, 'h'));
    EXPECT_TRUE(held.get().ok());
    for (int i = 0; i < 5000 && written.load() < n; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    EXPECT_EQ(written.load(), n);
    expect += n * msg.size();
    back += 100;
    EXPECT_TRUE(at_server.WaitFor(expect));
    EXPECT_TRUE(at_client.WaitFor(back));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // new grants reach the client
    return granted;
  };
  const uint64_t at_first = stalled(first, 16);
  EXPECT_EQ(at_first, static_cast<uint64_t>(plan::kStandingStart))
      << "the grants a connection starts with";
  const uint64_t after = stalled(second, 24);
  EXPECT_EQ(after, static_cast<uint64_t>(plan::kStandingStart + plan::kStandingStep))
      << "the writer ran out once: one step more";
  EXPECT_EQ(at_server.data().size(), expect);
  p.Close();
}

// No connection waits on another: while one connection's writer is stuck
// in the middle of copying its data (holding that connection's lock), a
// second connection of the same engines carries bytes both ways. With one
// lock for all connections the second write waited for the first copy.
TEST(Engine, AConnectionStuckInACopyHoldsUpNoOther) {
  StuckPage page;
  ASSERT_EQ(page.error(), "");
  Options o;
  auto se = Engine::Create(o);
  auto ce = Engine::Create(o);
  ASSERT_TRUE(se.ok() && ce.ok());
  std::unique_ptr<Engine> server = std::move(*se), client = std::move(*ce);
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::shared_ptr<Connection>> accepted;
  auto port = server->Listen(Loopback(0), [&](std::shared_ptr<Connection> c) {
    std::lock_guard<std::mutex> l(mu);
    accepted.push_back(std::move(c));
    cv.notify_all();
  });
  ASSERT_TRUE(port.ok()) << port.status();
  auto connect = [&]() -> std::shared_ptr<Connection> {
    std::promise<absl::StatusOr<std::shared_ptr<Connection>>> done;
    client->Connect(Loopback(*port), 5000, [&](absl::StatusOr<std::shared_ptr<Connection>> r) {
      done.set_value(std::move(r));
    });
    auto r = done.get_future().get();
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : nullptr;
  };
  std::shared_ptr<Connection> a = connect(), b = connect();
  ASSERT_TRUE(a && b);
  {
    std::unique_lock<std::mutex> l(mu);
    ASSERT_TRUE(cv.wait_for(l, std::chrono::seconds(5), [&] { return accepted.size() == 2; }));
  }
  // Which accepted connection is whose: a's first bytes tell.
  auto sa = std::make_unique<Sink>(accepted[0]);
  auto sb = std::make_unique<Sink>(accepted[1]);
  ASSERT_TRUE(WriteAll(*a, "A").ok());
  ASSERT_TRUE(sa->WaitFor(1, 5000) || sb->WaitFor(1, 5000));
  std::shared_ptr<Connection> a_peer = accepted[0], b_peer = accepted[1];
  if (sb->data() == "A") {
    std::swap(sa, sb);
    std::swap(a_peer, b_peer);
  }
  ASSERT_EQ(sa->data(), "A");
  Sink at_b(b);

  // a's writer copies from the stuck page: it stops in the copy.
  std::string a_bytes = Pattern(StuckPage::kSize, 7);
  auto a_write = WriteFromStuckPage(*a, page, StuckPage::kSize);
  ASSERT_TRUE(page.WaitTouched(5000)) << "the engine never copied from a's data";
  // Meanwhile b carries bytes both ways.
  auto b_write = std::async(std::launch::async, [&] { return WriteAll(*b, "over b"); });
  bool b_wrote = b_write.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  EXPECT_TRUE(b_wrote) << "a write on b waited for a's copy";
  EXPECT_TRUE(sb->WaitFor(6, 5000)) << "b's bytes did not arrive while a was in its copy";
  bool reply = false;
  if (b_wrote) {
    auto b_back = std::async(std::launch::async, [&] { return WriteAll(*b_peer, "and back"); });
    reply = b_back.wait_for(std::chrono::seconds(5)) == std::future_status::ready &&
            at_b.WaitFor(8, 5000);
    page.Release(a_bytes);
    EXPECT_TRUE(b_back.get().ok());
  }
  EXPECT_TRUE(reply) << "b's peer could not answer while a was in its copy";
  page.Release(a_bytes);  // a goes on; so does b, if it waited
  EXPECT_TRUE(a_write.get().ok());
  EXPECT_TRUE(b_write.get().ok());
  ASSERT_TRUE(sa->WaitFor(1 + StuckPage::kSize));
  EXPECT_TRUE(sa->data() == "A" + a_bytes) << "a's bytes differ";
  EXPECT_EQ(sb->data(), "over b");
  EXPECT_EQ(at_b.data(), "and back");
  a.reset();
  b.reset();
  a_peer.reset();
  b_peer.reset();
  accepted.clear();
  client.reset();
  server.reset();
}

}  // namespace
}  // namespace grpc_rdma
