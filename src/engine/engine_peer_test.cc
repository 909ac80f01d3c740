// The engine against peers that misbehave or die, many connections, the
// poll modes and softverbs' fault knobs. Child processes are this binary
// run again with --child MODE (softverbs reads its environment per process).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <rdma/rdma_cma.h>
#include <signal.h>
#include <linux/capability.h>
#include <spawn.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <dirent.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <future>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "engine/engine.h"
#include "engine/testing.h"
#include "engine/buffer_pool.h"
#include "engine/wire.h"

extern char** environ;

namespace grpc_rdma {
namespace {

using testing::Loopback;
using testing::Pattern;



// Reads a connection until `want` bytes or the end; returns what came and how it ended.
struct Drain {
  std::mutex mu;
  std::string data;
  absl::Status end;
  std::promise<void> done;
  size_t want;
  bool finished = false;
  Drain(std::shared_ptr<Connection> c, size_t w) : want(w) { Next(std::move(c)); }
  void Next(std::shared_ptr<Connection> c) {
    c->Read([this, c](absl::StatusOr<RecvChunks> r) {
      {
        std::lock_guard<std::mutex> l(mu);
        if (finished) return;
        if (!r.ok()) {
          end = r.status();
          finished = true;
          done.set_value();
          return;
        }
        for (auto& ch : *r) data.append(ch.data(), ch.size());
        if (data.size() >= want) {
          finished = true;
          done.set_value();
          return;
        }
      }
      Next(c);  // not under mu: Read may run its callback at once
    });
  }
};

pid_t Spawn(const std::vector<std::string>& args, const std::vector<std::string>& env = {}) {
  char self[4096];
  ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  self[n > 0 ? n : 0] = 0;
  std::vector<std::string> a = {self};
  a.insert(a.end(), args.begin(), args.end());
  std::vector<char*> argv, envp;
  for (auto& s : a) argv.push_back(s.data());
  argv.push_back(nullptr);
  std::vector<std::string> e(env);
  for (char** p = environ; *p; ++p) e.push_back(*p);  // first match wins: ours first
  for (auto& s : e) envp.push_back(s.data());
  envp.push_back(nullptr);
  pid_t pid = -1;
  posix_spawn(&pid, self, nullptr, nullptr, argv.data(), envp.data());
  return pid;
}

// This process's stderr into a file while it lives (the engine logs there).
class StderrCapture {
 public:
  StderrCapture() {
    char path[] = "/tmp/engine_peer_test.XXXXXX";
    fd_ = mkstemp(path);
    if (fd_ >= 0) unlink(path);
    fflush(stderr);
    saved_ = dup(2);
    if (fd_ >= 0) dup2(fd_, 2);
  }
  ~StderrCapture() {
    fflush(stderr);
    dup2(saved_, 2);
    close(saved_);
    if (fd_ >= 0) close(fd_);
  }
  std::string Text() {
    fflush(stderr);
    std::string out;
    char buf[4096];
    for (off_t at = 0;;) {
      ssize_t n = pread(fd_, buf, sizeof(buf), at);
      if (n <= 0) break;
      out.append(buf, static_cast<size_t>(n));
      at += n;
    }
    return out;
  }
  // Waits up to `ms` for `what` to be logged.
  bool WaitFor(const std::string& what, int ms) {
    for (int i = 0; i < ms / 10; ++i) {
      if (Text().find(what) != std::string::npos) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return Text().find(what) != std::string::npos;
  }

 private:
  int fd_ = -1, saved_ = -1;
};

TEST(EnginePeers, ManyConnectionsAtOnce) {
  auto se = Engine::Create(Options{});
  auto ce = Engine::Create(Options{});
  ASSERT_TRUE(se.ok() && ce.ok());
  constexpr int kConns = 24;
  std::mutex mu;
  std::vector<std::unique_ptr<Drain>> drains;
  std::atomic<int> accepted{0};
  auto port = (*se)->Listen(Loopback(0), [&](std::shared_ptr<Connection> c) {
    std::lock_guard<std::mutex> l(mu);
    drains.push_back(std::make_unique<Drain>(c, 300000));
    ++accepted;
  });
  ASSERT_TRUE(port.ok());
  std::vector<std::shared_ptr<Connection>> conns(kConns);
  std::vector<std::promise<void>> up(kConns);
  for (int i = 0; i < kConns; ++i) {
    (*ce)->Connect(Loopback(*port), 5000, [&, i](absl::StatusOr<std::shared_ptr<Connection>> r) {
      ASSERT_TRUE(r.ok()) << r.status();
      conns[i] = *r;
      up[i].set_value();
    });
  }
  for (auto& p : up) p.get_future().wait();
  std::string payload = Pattern(300000, 5);
  std::atomic<int> written{0};
  for (auto& c : conns) {
    iovec v{payload.data(), payload.size()};
    c->Write({v}, [&](absl::Status s) {
      EXPECT_TRUE(s.ok());
      ++written;
    });
  }
  for (int i = 0; i < 1000 && accepted < kConns; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_EQ(accepted.load(), kConns);
  std::vector<Drain*> ds;
  {
    std::lock_guard<std::mutex> l(mu);
    for (auto& d : drains) ds.push_back(d.get());
  }
  for (Drain* d : ds) {
    ASSERT_EQ(d->done.get_future().wait_for(std::chrono::seconds(60)), std::future_status::ready);
    EXPECT_TRUE(d->data == payload);
  }
  EXPECT_EQ(written.load(), kConns);
  se->reset();
  ce->reset();
}

// What a process holds, for the storm test below.
struct Holdings {
  int fds = 0, threads = 0, shm_segments = 0;
  uint64_t pinned = 0;
  bool operator==(const Holdings& o) const {
    return fds == o.fds && threads == o.threads && shm_segments == o.shm_segments &&
           pinned == o.pinned;
  }
  std::string Text() const {
    return absl::StrCat(fds, " descriptors, ", threads, " threads, ", shm_segments,
                        " shared-memory segments, ", pinned, " bytes pinned");
  }
};
int CountDir(const char* dir, const std::string& prefix) {
  int n = 0;
  if (DIR* d = opendir(dir)) {
    while (dirent* e = readdir(d))
      if (e->d_name[0] != '.' && std::string(e->d_name).rfind(prefix, 0) == 0) ++n;
    closedir(d);
  }
  return n;
}
Holdings HoldingsNow(Engine& a, Engine& b) {
  Holdings h;
  h.fds = CountDir("/proc/self/fd", "");
  h.threads = CountDir("/proc/self/task", "");
  h.shm_segments = CountDir("/dev/shm", absl::StrCat("softverbs-", getpid(), "-"));
  h.pinned = a.pinned_bytes() + b.pinned_bytes();
  return h;
}
int EnvInt(const char* name, int dflt) {
  const char* v = getenv(name);
  return v != nullptr && *v != '\0' ? atoi(v) : dflt;
}

// Connection storms leave nothing behind: after STORM_CYCLES (500)
// cycles of connect, a message each way and close, then STORM_AT_ONCE
// (100) connections opened together, used and closed, the process holds
// the descriptors, threads and pinned memory it held after its first
// connection, and softverbs' shared-memory segments are all gone (a leak
// of one descriptor or one buffer per connection shows as hundreds).
// Larger runs: STORM_CYCLES=10000 STORM_AT_ONCE=1000 (docs/reliability.md).
TEST(EnginePeers, ConnectionStormsLeaveNothingBehind) {
  const int cycles = EnvInt("STORM_CYCLES", 500), at_once = EnvInt("STORM_AT_ONCE", 100);
  rlimit nofile{};
  getrlimit(RLIMIT_NOFILE, &nofile);
  nofile.rlim_cur = nofile.rlim_max;  // ~12 descriptors per connection pair
  setrlimit(RLIMIT_NOFILE, &nofile);
  Options o;
  o.eager_depth = 8;  // 1,000 connections' receive buffers fit the default budget
  // Opened together, they all wait to be established at once: a server
  // expecting such bursts raises the half-open cap to the burst.
  o.max_half_open = std::max(o.max_half_open, at_once);
  auto se = Engine::Create(o);
  auto ce = Engine::Create(o);
  ASSERT_TRUE(se.ok() && ce.ok());
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::shared_ptr<Connection>> accepted;
  auto port = (*se)->Listen(Loopback(0), [&](std::shared_ptr<Connection> c) {
    std::lock_guard<std::mutex> l(mu);
    accepted.push_back(std::move(c));
    cv.notify_all();
  });
  ASSERT_TRUE(port.ok());
  // Opens n connections together; both ends of each, or empty on failure.
  auto open = [&](int n) {
    std::vector<std::pair<std::shared_ptr<Connection>, std::shared_ptr<Connection>>> pairs;
    std::vector<std::promise<absl::StatusOr<std::shared_ptr<Connection>>>> ps(n);
    for (int i = 0; i < n; ++i)
      (*ce)->Connect(Loopback(*port), 10000, [&ps, i](auto r) { ps[i].set_value(std::move(r)); });
    for (int i = 0; i < n; ++i) {
      auto r = ps[i].get_future().get();
      if (!r.ok()) {
        ADD_FAILURE() << "connection " << i << " of " << n << ": " << r.status();
        return decltype(pairs){};
      }
      pairs.push_back({*r, nullptr});
    }
    std::unique_lock<std::mutex> l(mu);
    if (!cv.wait_for(l, std::chrono::seconds(30), [&] { return accepted.size() >= size_t(n); })) {
      ADD_FAILURE() << accepted.size() << " of " << n << " accepted";
      return decltype(pairs){};
    }
    // Accepted in any order: each server end is paired with some client end;
    // every message is the same, so which does not matter.
    for (int i = 0; i < n; ++i) {
      pairs[i].second = accepted.front();
      accepted.pop_front();
    }
    return pairs;
  };
  // A message from each client end; every server end gets one whole.
  auto use_and_close = [&](auto& pairs) {
    std::string hello = Pattern(100, 8);
    std::vector<std::unique_ptr<Drain>> drains;
    for (auto& [c, s] : pairs) drains.push_back(std::make_unique<Drain>(s, hello.size()));
    for (auto& [c, s] : pairs) {
      iovec v{hello.data(), hello.size()};
      c->Write({v}, [](absl::Status) {});
    }
    bool ok = true;
    for (auto& d : drains) {
      ok &= d->done.get_future().wait_for(std::chrono::seconds(30)) == std::future_status::ready;
      std::lock_guard<std::mutex> l(d->mu);
      ok &= d->data == hello;
      d->finished = true;
    }
    for (auto& [c, s] : pairs) {
      c->Shutdown(absl::CancelledError("storm"));
      s->Shutdown(absl::CancelledError("storm"));
    }
    pairs.clear();
    return ok;
  };
  auto settled = [&](const Holdings& want) {
    Holdings now;
    for (int i = 0; i < 1000; ++i) {  // closes finish on the pollers and softverbs' agent
      now = HoldingsNow(**se, **ce);
      if (now == want) return now;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return now;
  };
  // What the process holds once the first connection is closed for good:
  // nothing pinned, and the same for a few samples in a row.
  auto quiet = [&] {
    Holdings last = HoldingsNow(**se, **ce);
    for (int i = 0, same = 0; i < 500 && same < 5; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      Holdings now = HoldingsNow(**se, **ce);
      same = now == last && now.pinned == 0 ? same + 1 : 0;
      last = now;
    }
    return last;
  };
  auto first = open(1);
  ASSERT_EQ(first.size(), 1u);
  ASSERT_TRUE(use_and_close(first));
  const Holdings base = quiet();
  ASSERT_EQ(base.pinned, 0u) << "the first connection's memory never came back: " << base.Text();
  for (int i = 0; i < cycles; ++i) {
    auto one = open(1);
    ASSERT_EQ(one.size(), 1u) << "cycle " << i;
    ASSERT_TRUE(use_and_close(one)) << "cycle " << i;
  }
  Holdings after = settled(base);
  EXPECT_EQ(after, base) << "after " << cycles << " cycles: " << after.Text() << "; before: "
                         << base.Text();
  auto many = open(at_once);
  ASSERT_EQ(many.size(), static_cast<size_t>(at_once));
  Holdings open_now = HoldingsNow(**se, **ce);
  EXPECT_GT(open_now.fds, base.fds + at_once) << "the connections were open together";
  ASSERT_TRUE(use_and_close(many));
  after = settled(base);
  EXPECT_EQ(after, base) << "after " << at_once << " at once: " << after.Text() << "; before: "
                         << base.Text();
  se->reset();
  ce->reset();
}

// A peer that dies in the middle of a large transfer: the reader sees the
// stream end (UNAVAILABLE), and the pinned memory comes back.
TEST(EnginePeers, PeerKilledMidTransfer) {
  Options o;
  o.chunk_size = 64 << 10;
  auto se = Engine::Create(o);
  ASSERT_TRUE(se.ok());
  std::promise<std::shared_ptr<Connection>> accepted;
  auto port = (*se)->Listen(Loopback(0), [&](std::shared_ptr<Connection> c) {
    accepted.set_value(std::move(c));
  });
  ASSERT_TRUE(port.ok());
  uint64_t before = (*se)->pinned_bytes();
  pid_t child = Spawn({"--child", "write-forever", std::to_string(*port)});
  ASSERT_GT(child, 0);
  auto fut = accepted.get_future();
  ASSERT_EQ(fut.wait_for(std::chrono::seconds(60)), std::future_status::ready);
  auto conn = fut.get();
  Drain d(conn, SIZE_MAX);
  // Let data flow (a few MiB: on a loaded machine that may take seconds, so
  // wait for the bytes, not for a time), then kill the writer without a word.
  for (int i = 0; i < 2000; ++i) {
    {
      std::lock_guard<std::mutex> l(d.mu);
      if (d.data.size() > (4u << 20)) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  ASSERT_EQ(d.done.get_future().wait_for(std::chrono::seconds(20)), std::future_status::ready);
  EXPECT_EQ(d.end.code(), absl::StatusCode::kUnavailable) << d.end;
  EXPECT_GT(d.data.size(), 0u);
  std::string expect = Pattern(d.data.size(), 77);
  EXPECT_TRUE(d.data == expect) << "what arrived is intact";
  absl::Status w;
  std::promise<absl::Status> wd;
  std::string x = "after the peer died";
  iovec v{x.data(), x.size()};
  conn->Write({v}, [&](absl::Status s) { wd.set_value(s); });
  EXPECT_EQ(wd.get_future().get().code(), absl::StatusCode::kUnavailable);
  conn.reset();
  for (int i = 0; i < 200 && (*se)->pinned_bytes() > before; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_LE((*se)->pinned_bytes(), before) << "nothing pinned stays behind";
}

// A peer written against raw verbs: connects like an engine, gets a grant,
// then writes outside it and tries to read what it was only allowed to
// write. Its own operations fail with access errors; the engine closes that
// connection and says why; another connection carries on.
// Modes: "read" reads a grant (write-only), "write_past" writes past one,
// "pre_small" writes a message the eager limit allows into a standing grant
// (a protocol violation only the engine can see).
class RoguePeer : public ::testing::TestWithParam<std::string> {};

TEST_P(RoguePeer, GetsAccessErrorsAndOthersCarryOn) {
  StderrCapture log;
  std::mutex mu;  // these before the engine: its callbacks use them
  std::vector<std::shared_ptr<Connection>> accepted;
  auto se = Engine::Create(Options{});
  ASSERT_TRUE(se.ok());
  auto port = (*se)->Listen(Loopback(0), [&](std::shared_ptr<Connection> c) {
    std::lock_guard<std::mutex> l(mu);
    accepted.push_back(std::move(c));
  });
  ASSERT_TRUE(port.ok());
  std::vector<std::string> env = {"ROGUE_MODE=" + GetParam()};
  pid_t child = Spawn({"--child", "rogue", std::to_string(*port)}, env);
  int status = 0;
  waitpid(child, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the rogue's abuse must go as expected (" << GetParam()
                                    << ")";
  // The honest path still works on the same engine.
  auto ce = Engine::Create(Options{});
  ASSERT_TRUE(ce.ok());
  std::promise<absl::StatusOr<std::shared_ptr<Connection>>> cp;
  (*ce)->Connect(Loopback(*port), 5000, [&](auto r) { cp.set_value(std::move(r)); });
  auto c = cp.get_future().get();
  ASSERT_TRUE(c.ok()) << c.status();
  for (int i = 0; i < 200; ++i) {
    std::lock_guard<std::mutex> l(mu);
    if (accepted.size() == 2) break;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::shared_ptr<Connection> honest;
  {
    std::lock_guard<std::mutex> l(mu);
    ASSERT_EQ(accepted.size(), 2u);
    honest = accepted[1];
  }
  std::shared_ptr<Connection> rogue;
  {
    std::lock_guard<std::mutex> l(mu);
    rogue = accepted[0];
  }
  std::promise<absl::Status> rw;
  std::string x = "to the rogue";
  iovec xv{x.data(), x.size()};
  rogue->Write({xv}, [&](absl::Status s) { rw.set_value(s); });
  EXPECT_EQ(rw.get_future().get().code(), absl::StatusCode::kUnavailable)
      << "the engine closed the rogue's connection";
  // And said why, naming the connection (the device refuses a WRITE or
  // READ outside a grant; only the engine sees a small write into a
  // standing grant).
  std::string why = GetParam() == "pre_small" ? "bad write into a standing grant"
                                              : "an RDMA access outside its grants";
  EXPECT_TRUE(log.WaitFor("the peer broke the protocol (" + why, 5000))
      << "nothing logged of the rogue's " << GetParam() << ":\n" << log.Text();
  Drain d(honest, 1 << 20);
  std::string payload = Pattern(1 << 20, 3);
  iovec v{payload.data(), payload.size()};
  (*c)->Write({v}, [](absl::Status) {});
  ASSERT_EQ(d.done.get_future().wait_for(std::chrono::seconds(20)), std::future_status::ready);
  EXPECT_TRUE(d.data == payload);
}

INSTANTIATE_TEST_SUITE_P(ReadOrWritePast, RoguePeer,
                         ::testing::Values("read", "write_past", "pre_small"),
                         [](const auto& i) {
                           return i.param == "read"         ? std::string("ReadGrant")
                                  : i.param == "write_past" ? std::string("WritePastGrant")
                                                            : std::string("SmallWriteIntoStandingGrant");
                         });

// An engine that accepts a rogue peer (the child below) per Run, keeping
// what it accepted, and writing `write_on_accept` bytes to each (the rogue
// then gets an announcement to answer); Run returns the rogue's exit
// status (-1: it did not exit normally).
class RogueServer {
 public:
  explicit RogueServer(const Options& o = Options{}, size_t write_on_accept = 0)
      : payload_(Pattern(write_on_accept, 6)) {
    auto se = Engine::Create(o);
    if (!se.ok()) return;
    engine_ = std::move(*se);
    auto port = engine_->Listen(Loopback(0), [this](std::shared_ptr<Connection> c) {
      if (!payload_.empty()) {
        iovec v{payload_.data(), payload_.size()};
        c->Write({v}, [](absl::Status) {});  // the rogue's grants end it
      }
      std::lock_guard<std::mutex> l(mu_);
      accepted_.push_back(std::move(c));
    });
    if (port.ok()) port_ = *port;
  }
  bool ok() const { return port_ != 0; }
  // Waits up to `ms` for the engine to have counted `n` connections closed
  // by a fault (a rogue's may fail before it is handed over); the count then.
  uint64_t WaitForErrors(uint64_t n, int ms) {
    uint64_t errors = 0;
    for (int waited = 0;; waited += 10) {
      errors = engine_->connection_errors();
      if (errors >= n || waited >= ms) return errors;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  int Run(const std::vector<std::string>& env) {
    pid_t child = Spawn({"--child", "rogue", std::to_string(port_)}, env);
    int status = 0;
    waitpid(child, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

 private:
  uint16_t port_ = 0;
  std::string payload_;
  std::mutex mu_;
  std::vector<std::shared_ptr<Connection>> accepted_;
  std::unique_ptr<Engine> engine_;  // last: goes first, before what its callbacks use
};

// Standing grants follow the peer's Hello: a peer from before the field
// (0) gets the 2 it always accepted, a peer that accepts 8 gets as many as
// half its receives allow (8 posted: 4), so grants for announced transfers
// always find receives.
TEST(EnginePeers, StandingGrantsFollowThePeersHello) {
  RogueServer server;
  ASSERT_TRUE(server.ok());
  for (auto [standing, expected] : {std::pair<int, int>{0, 2}, {8, 4}}) {
    EXPECT_EQ(server.Run({"ROGUE_MODE=count_pre", "ROGUE_STANDING=" + std::to_string(standing)}),
              100 + expected)
        << "standing grants for a Hello of " << standing;
  }
}

// A standing grant the peer used is made again at once, even when the
// peer has announced a transfer meanwhile: held back until the transfer
// ended, a stream of mid-size messages used them all up and then went
// announced, message after message.
TEST(EnginePeers, StandingGrantsAreRenewedDuringAnAnnouncedTransfer) {
  RogueServer server;
  ASSERT_TRUE(server.ok());
  EXPECT_EQ(server.Run({"ROGUE_MODE=pre_then_rts"}), 100 + 1)
      << "standing grants renewed while the transfer was open";
}

// Grants fit the writer: no larger than the chunk size the peer's Hello
// gives (its staging buffers), or than our own when the peer is older
// (a 16-byte Hello) or says 0; a Hello with an absurd one is refused.
TEST(EnginePeers, GrantsFollowThePeersChunkSize) {
  Options o;
  o.chunk_size = 512 << 10;
  o.chunks_in_flight = 1;  // the rogue's 1 MiB is not cut finer to fill more
  RogueServer server(o);
  ASSERT_TRUE(server.ok());
  struct Case {
    const char* max_chunk;
    const char* hello_bytes;
    int expected;  // exit status
  } cases[] = {
      {"131072", "20", 100 + 2},      // the peer's 128 KiB
      {"4194304", "20", 100 + 8},     // our 512 KiB
      {"0", "20", 100 + 8},           // not said: ours
      {"131072", "16", 100 + 8},      // an older peer's Hello: the field is not there
      {"1000", "20", 12},             // under 4 KiB: refused
  };
  for (const Case& c : cases) {
    EXPECT_EQ(server.Run({"ROGUE_MODE=cts_len", std::string("ROGUE_MAX_CHUNK=") + c.max_chunk,
                          std::string("ROGUE_HELLO_BYTES=") + c.hello_bytes}),
              c.expected)
        << "max_chunk " << c.max_chunk << " in a Hello of " << c.hello_bytes << " bytes";
  }
}

// A peer whose Hello does not say its messages are solicited (an engine
// from before) must still wake an idle engine with each message: the
// engine arms for all completions for it. softverbs' direct wake-up is off
// here (read once per process: ctest runs each test in its own), so a
// message that raises no completion event wakes nobody, as on an HCA.
TEST(EnginePeers, UnsolicitedMessagesOfAnOlderPeerAreNotLeftWaiting) {
  setenv("SOFTVERBS_DIRECT_WAKE", "0", 1);
  auto se = Engine::Create(Options{});
  ASSERT_TRUE(se.ok());
  std::promise<std::shared_ptr<Connection>> accepted;
  auto port = (*se)->Listen(Loopback(0), [&](std::shared_ptr<Connection> c) {
    accepted.set_value(std::move(c));
  });
  ASSERT_TRUE(port.ok());
  pid_t child = Spawn({"--child", "rogue", std::to_string(*port)}, {"ROGUE_MODE=unsolicited"});
  auto conn = accepted.get_future().get();
  Drain d(conn, 2);
  EXPECT_EQ(d.done.get_future().wait_for(std::chrono::seconds(2)), std::future_status::ready)
      << "the message waited in the CQ with nobody woken";
  {
    std::lock_guard<std::mutex> l(d.mu);
    EXPECT_EQ(d.data, "hi");
    d.finished = true;
  }
  int status = 0;
  waitpid(child, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  conn->Shutdown(absl::CancelledError("test over"));
}

void RunWithKnobs(const std::vector<std::string>& env, const char* mode) {
  pid_t child = Spawn({"--child", mode}, env);
  int status = 0;
  waitpid(child, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << mode;
}

TEST(EnginePeers, CutWireFailsOperationsCleanly) {
  RunWithKnobs({"SOFTVERBS_DROP_AFTER_OPS=20"}, "cut-wire");
}

// Runs this binary's child `mode` (with `env` first in its environment) and
// waits at most 60 s: its exit status, 128 + the signal that ended it, or
// -1 when it had not ended (it is then killed).
int RunChildBounded(const char* mode, const std::vector<std::string>& env) {
  pid_t child = Spawn({"--child", mode}, env);
  if (child <= 0) return -2;
  int status = 0;
  pid_t r = 0;
  for (int t = 0; t < 6000 && (r = waitpid(child, &status, WNOHANG)) == 0; ++t)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (r == 0) {
    kill(child, SIGKILL);
    waitpid(child, &status, 0);
    return -1;
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// A zero-copy write's buffer is the device's until the write is done: the
// writer overwrites it in its callback, and the reader still gets every
// original byte (ChildZeroCopyOverwrite). Made to call done at the post, it
// fails (step 9: changed bytes).
TEST(EnginePeers, AZeroCopyWriteReadsItsBufferUntilDoneOnly) {
  StderrCapture log;
  EXPECT_EQ(RunChildBounded("zero-copy-overwrite",
                            {"SOFTVERBS_RING_KB=64", "SOFTVERBS_DELAY_US=2000"}),
            0)
      << "the step that failed (ChildZeroCopyOverwrite; 9: bytes changed, 10: not zero-copy, "
         "11: the read failed)\n"
      << log.Text();
}

// A zero-copy write in flight ends when its engine is destroyed, though
// its owner still holds the connection (ChildZeroCopyShutdown). Without the
// settling at shutdown it waited for the owner (step 7: no end in 10 s).
TEST(EnginePeers, AZeroCopyWriteEndsWhenItsEngineGoes) {
  StderrCapture log;
  EXPECT_EQ(RunChildBounded("zero-copy-shutdown",
                            {"SOFTVERBS_RING_KB=64", "SOFTVERBS_DELAY_US=20000"}),
            0)
      << "the step that failed (ChildZeroCopyShutdown; 7: the write never ended)\n"
      << log.Text();
}

// A write with a `keep` may be done before the device has read its
// buffers, which are then held by the `keep` alone: overwritten when it is
// let go, the reader still gets every original byte (ChildZeroCopyKeep).
// Made to let `keep` go at the post, it fails (the device read freed
// memory: the child crashed).
TEST(EnginePeers, AKeptWriteIsDoneAtThePostAndItsBuffersHeldUntilRead) {
  StderrCapture log;
  EXPECT_EQ(RunChildBounded("zero-copy-keep", {"SOFTVERBS_RING_KB=64", "SOFTVERBS_DELAY_US=2000"}),
            0)
      << "the step that failed (ChildZeroCopyKeep; 9: bytes changed, 10: not zero-copy, "
         "12: a keep never let go, 13: no write done before its keep went)\n"
      << log.Text();
}

// A kept write in flight when its engine is destroyed: it ends, and its
// `keep` is let go (no buffer held for good).
TEST(EnginePeers, AKeptWriteLetsGoWhenItsEngineGoes) {
  StderrCapture log;
  EXPECT_EQ(RunChildBounded("zero-copy-keep-shutdown",
                            {"SOFTVERBS_RING_KB=64", "SOFTVERBS_DELAY_US=20000"}),
            0)
      << "the step that failed (ChildZeroCopyKeep; 7: the write never ended, 8: it ended OK, "
         "12: its keep was never let go)\n"
      << log.Text();
}

// A removed device is a fault on every connection it carried, counted once
// each, in whichever order its two signs (flushed work, the CM event)
// arrive: three processes, as the order varies from run to run.
TEST(EnginePeers, ARemovedDeviceIsAFaultOnEachConnection) {
  for (int i = 0; i < 3; ++i) {
    StderrCapture log;
    EXPECT_EQ(RunChildBounded("device-removed", {"SOFTVERBS_DEVICE_REMOVAL_MS=1000"}), 0)
        << "the step that failed (ChildDeviceRemoved; 9-11: a fault not counted; -1: hung)\n"
        << log.Text();
  }
}

// An address change (RDMA_CM_EVENT_ADDR_CHANGE on the listener and on both
// ends of a connection) is logged and nothing else: the stream it comes in
// the middle of carries on whole, no fault is counted, the listener still
// accepts.
TEST(EnginePeers, AnAddressChangeIsLoggedAndConnectionsCarryOn) {
  StderrCapture log;
  // Due 1.5 s after the first connection is up; the stream takes ~4 s.
  EXPECT_EQ(RunChildBounded("addr-change", {"SOFTVERBS_ADDR_CHANGE_MS=1500"}), 0)
      << "the step that failed (ChildAddrChange; -1: hung)\n" << log.Text();
  std::string t = log.Text();
  size_t begins = t.find("stream begins"), change = t.find("the devices' address changes now"),
         ends = t.find("stream ends");
  ASSERT_NE(change, std::string::npos) << t;
  EXPECT_TRUE(begins < change && change < ends) << "the change came outside the stream\n" << t;
  EXPECT_NE(t.find("changed (RDMA_CM_EVENT_ADDR_CHANGE); it keeps listening"), std::string::npos)
      << t;
  size_t lines = 0;
  for (size_t at = 0; (at = t.find("its connections carry on", at)) != std::string::npos; ++at)
    ++lines;
  EXPECT_EQ(lines, 2u) << "one line for each end of the connection\n" << t;
}

TEST(EnginePeers, DelayedCompletionsStillDeliverEverything) {
  RunWithKnobs({"SOFTVERBS_DELAY_US=2000"}, "transfer");
}

TEST(EnginePeers, TinyRingsForceBackpressureOnTheWire) {
  RunWithKnobs({"SOFTVERBS_RING_KB=16"}, "transfer");
}

TEST(EnginePeers, EventAndBusyPollModes) {
  RunWithKnobs({"TEST_POLL_MODE=event"}, "transfer");
  RunWithKnobs({"TEST_POLL_MODE=busy"}, "transfer");
}

}  // namespace

// ------------------------------------------------------------- children ---

namespace {

absl::StatusOr<std::shared_ptr<Connection>> ConnectTo(Engine& e, uint16_t port) {
  std::promise<absl::StatusOr<std::shared_ptr<Connection>>> p;
  e.Connect(Loopback(port), 5000, [&](auto r) { p.set_value(std::move(r)); });
  return p.get_future().get();
}

int ChildWriteForever(uint16_t port) {
  Options o;
  o.chunk_size = 64 << 10;
  // The data first: the test starts watching the stream once we connect.
  std::string all = Pattern(256 << 20, 77);
  auto e = Engine::Create(o);
  if (!e.ok()) return 2;
  auto c = ConnectTo(**e, port);
  if (!c.ok()) return 3;
  size_t off = 0;
  for (;;) {  // until killed
    size_t n = std::min<size_t>(1 << 20, all.size() - off);
    std::promise<void> p;
    iovec v{all.data() + off, n};
    (*c)->Write({v}, [&](absl::Status) { p.set_value(); });
    p.get_future().wait();
    off += n;
    if (off == all.size()) return 4;
  }
}

// The rogue's receives: 65536-byte slots of `mem`, one per wr_id. Counts
// the engine's control messages of `type` that arrive within `ms`
// milliseconds, stopping at the first when `first` is set (kept in *out).
int AwaitControl(ibv_cq* cq, const char* mem, uint8_t type, int ms, bool first,
                 wire::Header* out) {
  int seen = 0;
  for (int i = 0; i < ms && !(first && seen > 0); ++i) {
    ibv_wc wc;
    while (ibv_poll_cq(cq, 1, &wc) == 1) {
      if (wc.opcode != IBV_WC_RECV || wc.status != IBV_WC_SUCCESS) continue;
      wire::Header m{};
      memcpy(&m, mem + wc.wr_id * 65536, sizeof(m));
      if (m.type != type) continue;
      if (seen++ == 0 && out != nullptr) *out = m;
    }
    usleep(1000);
  }
  return seen;
}

// Waits for one of the engine's standing grants (sent when the connection
// comes up), then writes 100 bytes into it: the HCA allows the write, but
// a message the eager limit allows has no business there, and the engine
// must close the connection.
// One message (or two) whose header breaks a rule of the wire protocol
// (docs/wire-protocol.md), sent right after the connection is up; then
// stays connected while the engine reads it. 0 when sent.
// The rogue's messages: one signalled inline SEND of `n` bytes at `p`
// (`extra`: IBV_SEND_SOLICITED, as an engine sends, or nothing, as an
// engine from before did). True when posted.
bool SendInline(ibv_qp* qp, const void* p, size_t n, unsigned extra) {
  ibv_sge s{reinterpret_cast<uint64_t>(p), static_cast<uint32_t>(n), 0};
  ibv_send_wr w{}, *bad;
  w.sg_list = &s;
  w.num_sge = 1;
  w.opcode = IBV_WR_SEND;
  w.send_flags = IBV_SEND_INLINE | IBV_SEND_SIGNALED | extra;
  return ibv_post_send(qp, &w, &bad) == 0;
}

int RogueHeader(rdma_cm_id* id, const std::string& which) {
  auto send = [&](const void* p, size_t n) {
    return SendInline(id->qp, p, n, IBV_SEND_SOLICITED);
  };
  wire::Header h{};
  h.version = wire::kVersion;
  char msg[sizeof(h) + 4] = {};
  size_t n = sizeof(h);
  if (which == "short") {
    n = 8;
  } else if (which == "version") {
    h.type = wire::kCredit;
    h.version = 9;
  } else if (which == "credits") {
    h.type = wire::kCredit;
    h.credits = 60000;
  } else if (which == "data_empty") {
    h.type = wire::kData;
  } else if (which == "data_length") {
    h.type = wire::kData;
    h.len = 10;  // 4 follow
    n += 4;
  } else if (which == "data_in_rendezvous") {
    wire::Header rts{};
    rts.version = wire::kVersion;
    rts.type = wire::kRts;
    rts.a = 1 << 20;
    if (!send(&rts, sizeof(rts))) return 19;
    h.type = wire::kData;
    h.len = 4;
    n += 4;
  } else if (which == "rendezvous_empty") {
    h.type = wire::kRts;
  } else if (which == "rendezvous_huge") {
    h.type = wire::kRts;
    h.a = uint64_t{1} << 62;
  } else if (which == "grant_for_nothing") {
    h.type = wire::kCts;
    h.len = 4096;
  } else if (which == "standing_small") {
    h.type = wire::kStanding;
    h.len = 64;  // not above the engine's eager limit
  } else if (which == "unknown_type") {
    h.type = 99;
  } else {
    return 30;
  }
  memcpy(msg, &h, sizeof(h));
  if (!send(msg, n)) return 19;
  usleep(500 * 1000);
  return 0;
}

int RogueSmallWriteIntoStandingGrant(rdma_cm_id* id, ibv_cq* cq, char* mem, ibv_mr* mr) {
  wire::Header pre{};
  if (AwaitControl(cq, mem, wire::kStanding, 5000, true, &pre) == 0) return 15;
  ibv_sge s{reinterpret_cast<uint64_t>(mem), 100, mr->lkey};
  ibv_send_wr w{}, *bad;
  w.sg_list = &s;
  w.num_sge = 1;
  w.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
  w.send_flags = IBV_SEND_SIGNALED;
  w.imm_data = htonl(pre.grant);
  w.wr.rdma.remote_addr = pre.a;
  w.wr.rdma.rkey = pre.rkey;
  w.wr_id = 98;
  ibv_post_send(id->qp, &w, &bad);
  for (int i = 0; i < 5000; ++i) {
    ibv_wc wc;
    if (ibv_poll_cq(cq, 1, &wc) == 1 && wc.wr_id == 98) return wc.status == IBV_WC_SUCCESS ? 0 : 16;
    usleep(1000);
  }
  return 17;
}

// Takes the engine's two standing grants, writes a valid message into one
// and announces a 100 KB write in the same post (so the engine sees both
// at once), returning credits; then, without ever writing the announced
// chunks, counts the standing grants the engine makes while the transfer
// is open. Exit status: 100 + that count, or 18-20.
int RoguePreThenRts(rdma_cm_id* id, ibv_cq* cq, char* mem, ibv_mr* mr) {
  wire::Header pre{};
  if (AwaitControl(cq, mem, wire::kStanding, 300, false, &pre) != 2) return 18;
  ibv_sge data{reinterpret_cast<uint64_t>(mem + 8 * 65536), 20000, mr->lkey};
  ibv_send_wr w{}, *bad;
  w.sg_list = &data;
  w.num_sge = 1;
  w.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
  w.imm_data = htonl(pre.grant);
  w.wr.rdma.remote_addr = pre.a;
  w.wr.rdma.rkey = pre.rkey;
  wire::Header rts{};
  rts.type = wire::kRts;
  rts.version = wire::kVersion;
  rts.credits = 2;  // for the two grants' receives
  rts.a = 100000;     // one grant: credits stay for a standing one
  ibv_sge rs{reinterpret_cast<uint64_t>(&rts), sizeof(rts), 0};
  ibv_send_wr r{};
  r.sg_list = &rs;
  r.num_sge = 1;
  r.opcode = IBV_WR_SEND;
  r.send_flags = IBV_SEND_INLINE;
  w.next = &r;
  if (ibv_post_send(id->qp, &w, &bad) != 0) return 19;
  int cts = 0, more_pre = 0;
  for (int i = 0; i < 500; ++i) {
    ibv_wc wc;
    while (ibv_poll_cq(cq, 1, &wc) == 1) {
      if (wc.opcode != IBV_WC_RECV || wc.status != IBV_WC_SUCCESS) continue;
      wire::Header m{};
      memcpy(&m, mem + wc.wr_id * 65536, sizeof(m));
      cts += m.type == wire::kCts;
      more_pre += m.type == wire::kStanding;
    }
    usleep(1000);
  }
  return cts == 0 ? 20 : 100 + more_pre;
}

// Writes a whole message ('A's, above the eager limit) into one of the
// engine's standing grants, waits while the engine hands it to its reader,
// then writes 'B's to the same place with a plain RDMA WRITE. 0 when the
// device refuses that second write (the grant was closed once used), 21
// when it lands, 22-24 otherwise.
int RogueRewriteUsedGrant(rdma_cm_id* id, ibv_cq* cq, char* mem, ibv_mr* mr) {
  wire::Header pre{};
  if (AwaitControl(cq, mem, wire::kStanding, 5000, true, &pre) == 0) return 22;
  char* src = mem + 8 * 65536;
  auto write = [&](char fill, ibv_wr_opcode op) {
    memset(src, fill, 20000);
    ibv_sge s{reinterpret_cast<uint64_t>(src), 20000, mr->lkey};
    ibv_send_wr w{}, *bad;
    w.sg_list = &s;
    w.num_sge = 1;
    w.opcode = op;
    w.send_flags = IBV_SEND_SIGNALED | IBV_SEND_SOLICITED;
    w.imm_data = htonl(pre.grant);
    w.wr.rdma.remote_addr = pre.a;
    w.wr.rdma.rkey = pre.rkey;
    w.wr_id = 97;
    if (ibv_post_send(id->qp, &w, &bad) != 0) return -1;
    for (int i = 0; i < 5000; ++i) {
      ibv_wc wc;
      while (ibv_poll_cq(cq, 1, &wc) == 1)
        if (wc.wr_id == 97) return static_cast<int>(wc.status);
      usleep(1000);
    }
    return -1;
  };
  if (write('A', IBV_WR_RDMA_WRITE_WITH_IMM) != IBV_WC_SUCCESS) return 23;
  usleep(300 * 1000);  // the engine lends the message to its reader
  int second = write('B', IBV_WR_RDMA_WRITE);
  if (second == IBV_WC_SUCCESS) return 21;
  return second == IBV_WC_REM_ACCESS_ERR ? 0 : 24;
}

// A peer speaking raw rdma_cm to an engine's listener (the children
// below): its event channel and id, and the steps every such child takes.
struct RawPeer {
  rdma_event_channel* ch = nullptr;
  rdma_cm_id* id = nullptr;
  // The next CM event is `want` (it is acked either way).
  bool Next(rdma_cm_event_type want) {
    rdma_cm_event* e = nullptr;
    if (rdma_get_cm_event(ch, &e) != 0) return false;
    bool ok = e->event == want;
    rdma_ack_cm_event(e);
    return ok;
  }
  // A channel and an id, resolved (address and route) to 127.0.0.1:port.
  bool Resolve(uint16_t port) {
    ch = rdma_create_event_channel();
    if (ch == nullptr || rdma_create_id(ch, &id, nullptr, RDMA_PS_TCP) != 0) return false;
    sockaddr_in dst = Loopback(port);
    return rdma_resolve_addr(id, nullptr, reinterpret_cast<sockaddr*>(&dst), 2000) == 0 &&
           Next(RDMA_CM_EVENT_ADDR_RESOLVED) && rdma_resolve_route(id, 2000) == 0 &&
           Next(RDMA_CM_EVENT_ROUTE_RESOLVED);
  }
};

// An RC QP's attributes with one CQ and `wr` work requests each way.
ibv_qp_init_attr RcAttr(ibv_cq* cq, uint32_t wr) {
  ibv_qp_init_attr qa{};
  qa.send_cq = qa.recv_cq = cq;
  qa.qp_type = IBV_QPT_RC;
  qa.cap.max_send_wr = qa.cap.max_recv_wr = wr;
  qa.cap.max_send_sge = qa.cap.max_recv_sge = 1;
  return qa;
}

// Deaf: connects as an engine would (its Hello promises 8 receives), asks
// for infinite RNR retry and posts no receive at all, then waits to be
// killed: whatever the engine sends it is never acknowledged.
int ChildDeaf(uint16_t port) {
  RawPeer peer;
  if (!peer.Resolve(port)) return 11;
  rdma_cm_id* id = peer.id;
  ibv_pd* pd = ibv_alloc_pd(id->verbs);
  ibv_cq* cq = ibv_create_cq(id->verbs, 16, nullptr, nullptr, 0);
  ibv_qp_init_attr qa = RcAttr(cq, 8);
  if (pd == nullptr || cq == nullptr || rdma_create_qp(id, pd, &qa)) return 12;
  wire::Hello h{wire::kMagic, wire::kVersion, 8, 8192, 0, 0, 0, 0, 0, 0, {}};
  rdma_conn_param p{};
  p.private_data = &h;
  p.private_data_len = sizeof(h);
  p.rnr_retry_count = 7;
  p.retry_count = 7;
  if (rdma_connect(id, &p) || !peer.Next(RDMA_CM_EVENT_ESTABLISHED)) return 13;
  for (;;) pause();
}

// Half-open: connects with raw rdma_cm and a QP of its own, as if it were
// an engine, takes the server's accept (CONNECT_RESPONSE) and never
// completes the exchange (no rdma_establish, so no RTU): the server's
// connection stays set up and never established. Then waits to be killed.
// HALF_OPEN_COUNT (1) such connections, one after the other (each
// answered before the next), all kept.
int ChildHalfOpen(uint16_t port) {
  int count = getenv("HALF_OPEN_COUNT") ? atoi(getenv("HALF_OPEN_COUNT")) : 1;
  rlimit nofile{};  // a few descriptors per connection: as many as allowed
  getrlimit(RLIMIT_NOFILE, &nofile);
  nofile.rlim_cur = nofile.rlim_max;
  setrlimit(RLIMIT_NOFILE, &nofile);
  for (int i = 0; i < count; ++i) {
    auto* peer = new RawPeer;  // kept until the process is killed
    if (!peer->Resolve(port)) return 11;
    rdma_cm_id* id = peer->id;
    ibv_pd* pd = ibv_alloc_pd(id->verbs);
    ibv_cq* cq = ibv_create_cq(id->verbs, 16, nullptr, nullptr, 0);
    ibv_qp_init_attr qa = RcAttr(cq, 4);
    ibv_qp* qp = pd && cq ? ibv_create_qp(pd, &qa) : nullptr;
    if (qp == nullptr) return 12;
    wire::Hello h{wire::kMagic, wire::kVersion, 8, 8192, 0, 0, 0, 0, 0, 0, {}};
    rdma_conn_param p{};
    p.private_data = &h;
    p.private_data_len = sizeof(h);
    p.qp_num = qp->qp_num;
    p.retry_count = 7;
    if (rdma_connect(id, &p) || !peer->Next(RDMA_CM_EVENT_CONNECT_RESPONSE)) return 13;
  }
  printf("half-open %d\n", count);
  fflush(stdout);
  for (;;) pause();
}

// Connects with raw rdma_cm as if it were an engine, announces a large
// write, and abuses the grant it gets.
int ChildRogue(uint16_t port) {
  RawPeer peer;
  if (!peer.Resolve(port)) return 10;
  rdma_cm_id* id = peer.id;
  ibv_pd* pd = ibv_alloc_pd(id->verbs);
  ibv_cq* cq = ibv_create_cq(id->verbs, 64, nullptr, nullptr, 0);
  ibv_qp_init_attr qa = RcAttr(cq, 16);
  qa.cap.max_inline_data = 64;
  if (rdma_create_qp(id, pd, &qa)) return 11;
  // Registered memory that outlives the process's exit: the rogue returns
  // with receives still posted and the engine may still send (its close),
  // so softverbs' thread may write here while exit runs; freed memory
  // there would be heap corruption (ASan caught it, and its report then
  // deadlocked with the leak check at exit).
  struct Mem {
    char* p;
    char* data() { return p; }
    size_t size() const { return 9 << 16; }
  } mem{static_cast<char*>(mmap(nullptr, 9 << 16, PROT_READ | PROT_WRITE,
                                MAP_PRIVATE | MAP_ANONYMOUS, -1, 0))};
  if (mem.p == MAP_FAILED) return 11;
  ibv_mr* mr = ibv_reg_mr(pd, mem.data(), mem.size(), IBV_ACCESS_LOCAL_WRITE);
  for (int i = 0; i < 8; ++i) {
    ibv_sge s{reinterpret_cast<uint64_t>(mem.data() + i * 65536), 65536, mr->lkey};
    ibv_recv_wr w{}, *bad;
    w.wr_id = i;
    w.sg_list = &s;
    w.num_sge = 1;
    ibv_post_recv(id->qp, &w, &bad);
  }
  const char* standing = getenv("ROGUE_STANDING");
  const char* max_chunk = getenv("ROGUE_MAX_CHUNK");
  const char* hello_bytes = getenv("ROGUE_HELLO_BYTES");  // 16: an older engine's
  wire::Hello h{wire::kMagic, wire::kVersion, 8, 8192,
                static_cast<uint16_t>(standing ? atoi(standing) : 0), 0,
                static_cast<uint32_t>(max_chunk ? atoi(max_chunk) : 0), 0, 0, 0, {}};
  rdma_conn_param p{};
  p.private_data = &h;
  p.private_data_len = hello_bytes ? atoi(hello_bytes) : sizeof(h);
  p.rnr_retry_count = 7;
  p.retry_count = 7;
  if (rdma_connect(id, &p) || !peer.Next(RDMA_CM_EVENT_ESTABLISHED)) return 12;
  const char* mode_env = getenv("ROGUE_MODE");
  std::string mode = mode_env ? mode_env : "read";
  if (mode.rfind("header_", 0) == 0) return RogueHeader(id, mode.substr(7));
  if (mode == "pre_small") return RogueSmallWriteIntoStandingGrant(id, cq, mem.data(), mr);
  if (mode == "pre_then_rts") return RoguePreThenRts(id, cq, mem.data(), mr);
  if (mode == "rewrite_used") return RogueRewriteUsedGrant(id, cq, mem.data(), mr);
  if (mode == "unsolicited") {
    // An engine from before solicited messages: after a pause (the peer's
    // poller goes to sleep), one DATA message without IBV_SEND_SOLICITED.
    usleep(300 * 1000);
    wire::Header h{};
    h.type = wire::kData;
    h.version = wire::kVersion;
    h.len = 2;
    char msg[sizeof(h) + 2];
    memcpy(msg, &h, sizeof(h));
    memcpy(msg + sizeof(h), "hi", 2);
    if (!SendInline(id->qp, msg, sizeof(msg), 0)) return 19;
    usleep(3000 * 1000);  // stay connected while the engine reads it
    return 0;
  }
  if (mode == "count_pre")  // exit status 100 + standing grants received
    return 100 + AwaitControl(cq, mem.data(), wire::kStanding, 300, false, nullptr);
  if (mode == "grant_out_of_order" || mode == "grant_out_of_bounds") {
    // The engine announces a message (RogueServer's write_on_accept); the
    // grant starts past its first byte, or runs past its last.
    wire::Header rts_in{};
    if (AwaitControl(cq, mem.data(), wire::kRts, 5000, true, &rts_in) == 0) return 13;
    wire::Header g{};
    g.type = wire::kCts;
    g.version = wire::kVersion;
    const bool order = mode == "grant_out_of_order";
    g.offset = order ? 4096 : 0;
    g.len = order ? 4096 : static_cast<uint32_t>(rts_in.a + 4096);
    g.a = reinterpret_cast<uint64_t>(mem.data() + 8 * 65536);
    g.rkey = mr->rkey;
    g.grant = 1;
    if (!SendInline(id->qp, &g, sizeof(g), IBV_SEND_SOLICITED)) return 15;
    usleep(500 * 1000);  // connected while the engine reads it
    return 0;
  }
  // Announce a 1 MiB write: the engine answers with a grant.
  wire::Header rts{};
  rts.type = wire::kRts;
  rts.version = wire::kVersion;
  rts.a = 1 << 20;
  SendInline(id->qp, &rts, sizeof(rts), 0);
  if (mode == "chunk_short" || mode == "chunk_no_grant") {
    // The first grant, written with half its length, or under a grant id
    // the engine never gave (into the granted memory, so the device lets it).
    wire::Header g{};
    if (AwaitControl(cq, mem.data(), wire::kCts, 5000, true, &g) == 0) return 13;
    const bool short_chunk = mode == "chunk_short";
    ibv_sge ws{reinterpret_cast<uint64_t>(mem.data() + 8 * 65536),
               short_chunk ? g.len / 2 : g.len, mr->lkey};
    ibv_send_wr ww{}, *wbad;
    ww.sg_list = &ws;
    ww.num_sge = 1;
    ww.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    ww.imm_data = htonl(short_chunk ? g.grant : g.grant + 1000);
    ww.wr.rdma.remote_addr = g.a;
    ww.wr.rdma.rkey = g.rkey;
    if (ibv_post_send(id->qp, &ww, &wbad) != 0) return 15;
    usleep(500 * 1000);  // connected while the engine reads it
    return 0;
  }
  if (mode == "reorder") {
    // Two grants (the engine's chunks are 64 KiB here), written second
    // first, each as a whole chunk from the last 64 KiB of mem.
    std::vector<wire::Header> grants;
    for (int i = 0; i < 5000 && grants.size() < 2; ++i) {
      ibv_wc wc;
      while (grants.size() < 2 && ibv_poll_cq(cq, 1, &wc) == 1) {
        if (wc.opcode != IBV_WC_RECV || wc.status != IBV_WC_SUCCESS) continue;
        wire::Header m{};
        memcpy(&m, mem.data() + wc.wr_id * 65536, sizeof(m));
        if (m.type == wire::kCts) grants.push_back(m);
      }
      usleep(1000);
    }
    if (grants.size() < 2) return 13;
    for (int k : {1, 0}) {
      const wire::Header& g = grants[static_cast<size_t>(k)];
      ibv_sge ws{reinterpret_cast<uint64_t>(mem.data() + 8 * 65536), g.len, mr->lkey};
      ibv_send_wr ww{}, *wbad;
      ww.sg_list = &ws;
      ww.num_sge = 1;
      ww.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
      ww.imm_data = htonl(g.grant);
      ww.wr.rdma.remote_addr = g.a;
      ww.wr.rdma.rkey = g.rkey;
      if (ibv_post_send(id->qp, &ww, &wbad) != 0) return 15;
    }
    usleep(500 * 1000);  // connected while the engine reads them
    return 0;
  }
  wire::Header cts{};
  if (AwaitControl(cq, mem.data(), wire::kCts, 5000, true, &cts) == 0) return 13;
  if (mode == "cts_len") return 100 + cts.len / 65536;  // exit status: grant in 64 KiB
  if (mode == "silent") {
    // Holds the grant and writes nothing: the engine must close the
    // connection (0), not keep the memory for as long as we stay (14).
    pollfd pf{peer.ch->fd, POLLIN, 0};
    if (poll(&pf, 1, 5000) != 1) return 14;
    return peer.Next(RDMA_CM_EVENT_DISCONNECTED) ? 0 : 16;
  }
  // Read the granted buffer (it is write-only), or write just past it:
  // either way a remote access error, and the engine's QP stops.
  bool write_past = mode == "write_past";
  ibv_sge rs{reinterpret_cast<uint64_t>(mem.data()), 64, mr->lkey};
  ibv_send_wr r{}, *rbad;
  r.sg_list = &rs;
  r.num_sge = 1;
  r.opcode = write_past ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ;
  r.send_flags = IBV_SEND_SIGNALED;
  r.wr.rdma.remote_addr = write_past ? cts.a + cts.len - 32 : cts.a;
  r.wr.rdma.rkey = cts.rkey;
  r.wr_id = 99;
  ibv_post_send(id->qp, &r, &rbad);
  ibv_wc_status read_status = IBV_WC_SUCCESS;
  for (int i = 0; i < 5000; ++i) {
    ibv_wc wc;
    if (ibv_poll_cq(cq, 1, &wc) == 1 && wc.wr_id == 99) {
      read_status = wc.status;
      break;
    }
    usleep(1000);
  }
  if (read_status != IBV_WC_REM_ACCESS_ERR) {
    fprintf(stderr, "rogue: %s: %s\n", write_past ? "write past the grant" : "read of a grant",
            ibv_wc_status_str(read_status));
    return 14;
  }
  return 0;  // the QP is now in error; the engine must have closed its side
}

// With two devices, mlx5_0 on 127.0.0.1 and mlx5_1 on 127.0.0.2 (the
// parent sets SOFTVERBS_DEVICES): an engine told TF_RDMA_DEV_NAME=mlx5_1
// listens and connects on mlx5_1 only. Exit status: 0, or which check
// failed (20-27).
int ChildTwoDevices() {
  auto addr = [](const char* ip, uint16_t port) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    inet_pton(AF_INET, ip, &a.sin_addr);
    return a;
  };
  // Before the engines: an accept may still land while they shut down at
  // the end, and must find these alive.
  std::mutex mu;
  std::vector<std::shared_ptr<Connection>> accepted;
  Options named_o;
  named_o.device = "mlx5_1";
  named_o.device_explicit = true;
  auto named = Engine::Create(named_o);
  auto any = Engine::Create(Options{});
  if (!named.ok() || !any.ok()) return 19;
  auto keep = [&](std::shared_ptr<Connection> c) {
    std::lock_guard<std::mutex> l(mu);
    accepted.push_back(std::move(c));
  };
  auto connect = [](Engine& e, sockaddr_in a) {
    std::promise<absl::StatusOr<std::shared_ptr<Connection>>> p;
    e.Connect(a, 5000, [&](auto r) { p.set_value(std::move(r)); });
    return p.get_future().get();
  };
  auto says = [](const absl::Status& s) {
    std::string m(s.message());
    return m.find("RDMA device mlx5_0, not TF_RDMA_DEV_NAME=mlx5_1") != std::string::npos;
  };
  absl::StatusOr<uint16_t> bad = (*named)->Listen(addr("127.0.0.1", 0), keep);
  if (bad.ok() || !says(bad.status())) return 20;
  absl::StatusOr<uint16_t> p2 = (*named)->Listen(addr("127.0.0.2", 0), keep);
  if (!p2.ok()) return 21;
  absl::StatusOr<uint16_t> p1 = (*any)->Listen(addr("127.0.0.1", 0), keep);
  if (!p1.ok()) return 22;
  auto c = connect(**named, addr("127.0.0.1", *p1));
  if (c.ok() || !says(c.status())) return 23;
  auto c2 = connect(**named, addr("127.0.0.2", *p2));
  if (!c2.ok()) return 24;
  if ((*c2)->device() != "mlx5_1") return 28;
  // Listening on every address: requests that arrive on mlx5_0 refused.
  absl::StatusOr<uint16_t> pw = (*named)->Listen(addr("0.0.0.0", 0), keep);
  if (!pw.ok()) return 25;
  if ((*named)->refused() != 0) return 29;
  if (connect(**any, addr("127.0.0.1", *pw)).ok()) return 26;
  if ((*named)->refused() != 1) return 30;  // counted
  if (!connect(**any, addr("127.0.0.2", *pw)).ok()) return 27;
  auto c1 = connect(**any, addr("127.0.0.1", *p1));
  if (!c1.ok() || (*c1)->device() != "mlx5_0") return 31;
  return 0;
}

int ChildTransfer() {
  Options o;
  o.chunk_size = 128 << 10;
  if (const char* m = getenv("TEST_POLL_MODE")) {
    o.poll_mode = strcmp(m, "busy") == 0 ? PollMode::kBusy : PollMode::kEvent;
  }
  auto se = Engine::Create(o);
  auto ce = Engine::Create(o);
  if (!se.ok() || !ce.ok()) return 2;
  std::promise<std::shared_ptr<Connection>> acc;
  auto port = (*se)->Listen(Loopback(0), [&](std::shared_ptr<Connection> c) {
    acc.set_value(std::move(c));
  });
  if (!port.ok()) return 3;
  auto c = ConnectTo(**ce, *port);
  if (!c.ok()) return 4;
  auto s = acc.get_future().get();
  std::string payload;
  for (int i = 0; i < 30; ++i) payload += Pattern(i % 3 == 0 ? (1 << 20) + i : 100 + i * 37, i);
  Drain d(s, payload.size());
  size_t off = 0;
  for (int i = 0; i < 30; ++i) {
    size_t n = i % 3 == 0 ? (1 << 20) + i : 100 + i * 37;
    iovec v{payload.data() + off, n};
    off += n;
    (*c)->Write({v}, [](absl::Status) {});
  }
  if (d.done.get_future().wait_for(std::chrono::seconds(60)) != std::future_status::ready) return 5;
  if (d.data != payload) return 6;
  return 0;
}

// Without CAP_IPC_LOCK and with 6 MiB of locked memory (far below
// TF_RDMA_BUF_SIZE; one connection needs 5.2 MiB with 1 MiB chunks):
// receives 24 MiB from the parent in 1 MiB chunks, every byte right, the
// engine keeping to what it could register. Exit status: 0, or the step.
int ChildMemlockReceiver(uint16_t port) {
  __user_cap_header_struct h{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct cap[2]{};
  if (syscall(SYS_capget, &h, cap) != 0) return 10;
  cap[CAP_IPC_LOCK / 32].effective &= ~(1u << (CAP_IPC_LOCK % 32));
  cap[CAP_IPC_LOCK / 32].permitted &= ~(1u << (CAP_IPC_LOCK % 32));
  if (syscall(SYS_capset, &h, cap) != 0) return 11;
  rlim_t limit = getenv("TEST_MEMLOCK_KB")
                     ? std::strtoull(getenv("TEST_MEMLOCK_KB"), nullptr, 10) << 10
                     : 6 << 20;
  rlimit r{limit, limit};
  if (setrlimit(RLIMIT_MEMLOCK, &r) != 0) return 12;
  Options o;
  o.chunk_size = 1 << 20;
  auto e = Engine::Create(o);
  if (!e.ok()) return 2;
  auto c = ConnectTo(**e, port);
  if (!c.ok()) {
    fprintf(stderr, "memlock child: %s\n", std::string(c.status().message()).c_str());
    return 4;
  }
  std::string payload = Pattern(24 << 20, 5);
  Drain d(*c, payload.size());
  // Out with _exit: the engine's threads may still call into `d`.
  auto out = [](int code) {
    fflush(stderr);
    _exit(code);
  };
  if (d.done.get_future().wait_for(std::chrono::seconds(60)) != std::future_status::ready) out(5);
  if (!d.end.ok()) {
    fprintf(stderr, "memlock child: the read ended: %s\n", std::string(d.end.message()).c_str());
    out(6);
  }
  // Transfers waited for pinned memory, and the stats say so.
  if ((*c)->stats().memory_waits == 0) out(8);
  out(d.data == payload ? 0 : 7);
  return 0;
}

int ChildCutWire() {
  Options o;
  o.chunk_size = 64 << 10;
  auto se = Engine::Create(o);
  auto ce = Engine::Create(o);
  if (!se.ok() || !ce.ok()) return 2;
  std::promise<std::shared_ptr<Connection>> acc;
  auto port = (*se)->Listen(Loopback(0), [&](std::shared_ptr<Connection> c) {
    acc.set_value(std::move(c));
  });
  auto c = ConnectTo(**ce, *port);
  if (!c.ok()) return 4;
  auto s = acc.get_future().get();
  Drain d(s, SIZE_MAX);
  std::string payload = Pattern(4 << 20, 1);
  std::promise<absl::Status> wd;
  iovec v{payload.data(), payload.size()};
  (*c)->Write({v}, [&](absl::Status st) { wd.set_value(st); });
  // The wire is cut after 20 operations: both ends must see the end, not hang.
  if (d.done.get_future().wait_for(std::chrono::seconds(30)) != std::future_status::ready) return 5;
  if (d.end.code() != absl::StatusCode::kUnavailable) return 6;
  auto wf = wd.get_future();
  if (wf.wait_for(std::chrono::seconds(30)) != std::future_status::ready) return 7;
  return 0;
}

// Two engines of this process (both with `o`) and one connection from
// the client's to the server's: 0, or the step that failed (2: an engine,
// 3: the listen, 4: the connect, 5: the accept). What the caller's
// callbacks touch must be declared before its EnginePair, so that the
// engines go first.
struct EnginePair {
  std::unique_ptr<Engine> server, client;
  std::shared_ptr<Connection> c, s;  // the client's end, the server's
};
int MakeEnginePair(const Options& o, EnginePair* p) {
  auto acc = std::make_shared<std::promise<std::shared_ptr<Connection>>>();
  auto se = Engine::Create(o);
  auto ce = Engine::Create(o);
  if (!se.ok() || !ce.ok()) return 2;
  p->server = std::move(*se);
  p->client = std::move(*ce);
  auto port = p->server->Listen(Loopback(0), [acc](std::shared_ptr<Connection> c) {
    acc->set_value(std::move(c));
  });
  if (!port.ok()) return 3;
  auto c = ConnectTo(*p->client, *port);
  if (!c.ok()) return 4;
  p->c = std::move(*c);
  auto af = acc->get_future();
  if (af.wait_for(std::chrono::seconds(10)) != std::future_status::ready) return 5;
  p->s = af.get();
  return 0;
}

// Zero-copy sends read the writer's buffer until the write is done, and
// not after: both ends here, softverbs' rings 64 KiB (so a chunk is read
// from the buffer in steps, as the receiver frees ring space) and inbound
// frames held 2 ms (SOFTVERBS_RING_KB, SOFTVERBS_DELAY_US); each 4 MiB
// write's buffer is overwritten inside its done callback. Every byte the
// reader gets must be the original; the sender's copy counter proves the
// chunks went zero-copy. 0 when so; else the step that failed.
int ChildZeroCopyOverwrite() {
  Options o;  // a 4 MiB write goes in four 1 MiB chunks: zero-copy (kZeroCopyMin)
  std::shared_ptr<Drain> d;
  EnginePair pair;
  if (int step = MakeEnginePair(o, &pair)) return step;
  std::shared_ptr<Connection> c = pair.c, s = pair.s;
  const int kWrites = 4;
  const size_t kSize = 4 << 20;
  std::string expect;
  d = std::make_shared<Drain>(s, kSize * kWrites);
  for (int i = 0; i < kWrites; ++i) {
    auto buf = std::make_shared<std::string>(Pattern(kSize, 100 + i));
    expect += *buf;
    auto wd = std::make_shared<std::promise<absl::Status>>();
    iovec v{buf->data(), buf->size()};
    c->Write({v}, [wd, buf](absl::Status st) {
      memset(buf->data(), 'X', buf->size());  // the writer takes its buffer back
      wd->set_value(st);
    });
    auto f = wd->get_future();
    if (f.wait_for(std::chrono::seconds(30)) != std::future_status::ready) return 6;
    if (!f.get().ok()) return 7;
  }
  if (d->done.get_future().wait_for(std::chrono::seconds(30)) != std::future_status::ready)
    return 8;
  if (!d->end.ok()) return 11;  // the reader's stream failed
  uint64_t copied = c->stats().bytes_copied_on_send;
  fprintf(stderr, "zero-copy child: %zu bytes read, %s; %llu bytes copied on send\n",
          d->data.size(), d->data == expect ? "all original" : "CHANGED",
          static_cast<unsigned long long>(copied));
  if (d->data != expect) return 9;
  if (copied > kSize / 4) return 10;  // the chunks were staged, not zero-copy
  return 0;
}

// Writes with a `keep` (Connection::Write): done may come once they are
// posted, and the buffers are then the device's until `keep` goes. Each
// 4 MiB write's `keep` overwrites its buffer when let go (as a writer
// that reuses it would); rings 64 KiB and inbound frames held 2 ms keep
// the chunks in flight past the post. Every byte the reader gets must be
// the original, every `keep` must go, and at least one write must have
// been done before its `keep` went (else the keep changed nothing).
// `shutdown`: one 64 MiB write (more than the chunks in flight at once,
// so it is not wholly posted), and the writer's engine destroyed while
// its chunks are in flight: done must come with an error, and `keep` must
// still go. 0 when so; else the step that failed.
int ChildZeroCopyKeep(bool shutdown) {
  Options o;
  std::shared_ptr<Drain> d;
  struct Track {
    std::mutex mu;
    int kept = 0;          // keeps let go
    int done_first = 0;    // of those, the ones whose write was done before
    std::vector<bool> done;
  };
  auto t = std::make_shared<Track>();
  EnginePair pair;
  if (int step = MakeEnginePair(o, &pair)) return step;
  std::shared_ptr<Connection> c = pair.c, s = pair.s;
  if (!c->zero_copy_sends()) return 10;
  const int kWrites = shutdown ? 1 : 4;
  const size_t kSize = shutdown ? (64 << 20) : (4 << 20);
  t->done.assign(kWrites, false);
  std::string expect;
  d = std::make_shared<Drain>(s, shutdown ? SIZE_MAX : kSize * kWrites);
  std::vector<std::future<absl::Status>> dones;
  for (int i = 0; i < kWrites; ++i) {
    auto buf = std::make_shared<std::string>(Pattern(kSize, 100 + i));
    expect += *buf;
    std::shared_ptr<const void> keep(buf->data(), [buf, t, i](const void*) {
      std::lock_guard<std::mutex> l(t->mu);
      memset(buf->data(), 'X', buf->size());  // the writer reuses its buffer
      ++t->kept;
      if (t->done[i]) ++t->done_first;
    });
    auto wd = std::make_shared<std::promise<absl::Status>>();
    dones.push_back(wd->get_future());
    iovec v{buf->data(), buf->size()};
    c->Write(
        {v},
        [wd, t, i](absl::Status st) {
          {
            std::lock_guard<std::mutex> l(t->mu);
            t->done[i] = true;
          }
          wd->set_value(st);
        },
        std::move(keep));
  }
  if (shutdown) {
    for (int i = 0; i < 1000; ++i) {  // until some of it arrived
      {
        std::lock_guard<std::mutex> l(d->mu);
        if (!d->data.empty()) break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (c->stats().bytes_sent == 0) return 6;
    pair.client.reset();  // the writer's engine goes; `c` is still held
    if (dones[0].wait_for(std::chrono::seconds(10)) != std::future_status::ready) return 7;
    if (dones[0].get().ok()) return 8;  // it cannot all have been posted
  } else {
    for (auto& f : dones) {
      if (f.wait_for(std::chrono::seconds(30)) != std::future_status::ready) return 6;
      if (!f.get().ok()) return 7;
    }
    if (d->done.get_future().wait_for(std::chrono::seconds(30)) != std::future_status::ready)
      return 8;
    if (!d->end.ok()) return 11;
  }
  int kept = 0, done_first = 0;
  for (int i = 0; i < 1000; ++i) {  // the last completions may follow the data
    {
      std::lock_guard<std::mutex> l(t->mu);
      kept = t->kept;
      done_first = t->done_first;
    }
    if (kept == kWrites) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  uint64_t copied = shutdown ? 0 : c->stats().bytes_copied_on_send;
  fprintf(stderr, "keep child: %d of %d keeps let go, %d after their write was done; %s\n", kept,
          kWrites, done_first,
          shutdown ? "engine destroyed mid-write"
                   : (d->data == expect ? "all bytes original" : "bytes CHANGED"));
  if (kept != kWrites) return 12;
  if (shutdown) return 0;
  if (d->data != expect) return 9;
  if (copied > kSize / 4) return 10;  // staged, not zero-copy
  if (done_first == 0) return 13;
  return 0;
}

// A zero-copy write in flight when its engine is destroyed (its owner still
// holding the connection): the write ends, with an error, at the engine's
// shutdown, not whenever the owner lets go (rings 64 KiB and frames held
// 20 ms keep the chunks in flight). 0 when so; else the step.
int ChildZeroCopyShutdown() {
  Options o;
  // What callbacks touch outlives the engines (declared first).
  std::shared_ptr<Drain> d;
  auto wd = std::make_shared<std::promise<absl::Status>>();
  EnginePair pair;
  if (int step = MakeEnginePair(o, &pair)) return step;
  std::shared_ptr<Connection> c = pair.c, s = pair.s;
  d = std::make_shared<Drain>(s, SIZE_MAX);
  auto buf = std::make_shared<std::string>(Pattern(16 << 20, 5));
  iovec v{buf->data(), buf->size()};
  c->Write({v}, [wd, buf](absl::Status st) { wd->set_value(st); });
  // Until some of it arrived: chunks granted and posted, zero-copy.
  for (int i = 0; i < 1000; ++i) {
    {
      std::lock_guard<std::mutex> l(d->mu);
      if (!d->data.empty()) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ConnectionStats st = c->stats();
  if (st.bytes_sent == 0) return 6;
  pair.client.reset();  // the client's engine goes; `c` is still held
  auto f = wd->get_future();
  if (f.wait_for(std::chrono::seconds(10)) != std::future_status::ready) return 7;
  if (f.get().ok()) return 8;  // it cannot all have landed
  return 0;
}

// Both ends in this process, a stream flowing from one to the other, and
// the devices removed (SOFTVERBS_DEVICE_REMOVAL_MS, as an unplugged HCA):
// both connections end with an error and each engine counts one fault,
// whichever came first, the QP's flushed work or the CM's
// RDMA_CM_EVENT_DEVICE_REMOVAL. Exit status: 0, or the step.
int ChildDeviceRemoved() {
  Options o;
  o.chunk_size = 64 << 10;
  // What callbacks may touch outlives the engines (declared after it, so
  // destroyed first): a late callback on an early return finds it alive.
  auto acc = std::make_shared<std::promise<std::shared_ptr<Connection>>>();
  std::string payload = Pattern(1 << 20, 9);
  std::shared_ptr<Drain> d;
  auto se = Engine::Create(o);
  auto ce = Engine::Create(o);
  if (!se.ok() || !ce.ok()) return 2;
  auto port = (*se)->Listen(Loopback(0), [acc](std::shared_ptr<Connection> c) {
    acc->set_value(std::move(c));
  });
  if (!port.ok()) return 3;
  auto c = ConnectTo(**ce, *port);
  if (!c.ok()) return 4;
  // The removal is due SOFTVERBS_DEVICE_REMOVAL_MS after the client's side
  // is up; the server's may come later, or never if the removal came first.
  auto af = acc->get_future();
  if (af.wait_for(std::chrono::seconds(10)) != std::future_status::ready) return 12;
  auto s = af.get();
  d = std::make_shared<Drain>(s, SIZE_MAX);
  absl::Status last;
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (last.ok() && std::chrono::steady_clock::now() < until) {
    auto wd = std::make_shared<std::promise<absl::Status>>();
    iovec v{payload.data(), payload.size()};
    (*c)->Write({v}, [wd](absl::Status st) { wd->set_value(st); });
    auto f = wd->get_future();
    if (f.wait_for(std::chrono::seconds(30)) != std::future_status::ready) return 5;
    last = f.get();
  }
  if (last.ok()) return 6;  // the removal never ended the stream
  if (d->done.get_future().wait_for(std::chrono::seconds(10)) != std::future_status::ready)
    return 7;
  if (d->end.ok()) return 8;
  for (int i = 0; i < 500 && ((*se)->connection_errors() == 0 || (*ce)->connection_errors() == 0);
       ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  fprintf(stderr, "device-removed child: write ended: %s; read ended: %s; faults %llu/%llu\n",
          std::string(last.message()).c_str(), std::string(d->end.message()).c_str(),
          (unsigned long long)(*se)->connection_errors(),
          (unsigned long long)(*ce)->connection_errors());
  if ((*se)->connection_errors() != 1) return 9;
  if ((*ce)->connection_errors() != 1) return 10;
  if (s->stats().connection_errors != 1 || (*c)->stats().connection_errors != 1) return 11;
  return 0;
}

// Both ends in this process, 40 MiB flowing from one to the other, paced
// over about 4 s, and the devices' address changed in the middle
// (SOFTVERBS_ADDR_CHANGE_MS, as a bonding failover): every byte arrives,
// nothing is counted as a fault, and the listener still takes a new
// connection. Says "stream begins" and "stream ends" on stderr (the test
// checks that the change came between). Exit status: 0, or the step.
int ChildAddrChange() {
  Options o;
  o.chunk_size = 256 << 10;
  auto accepted = std::make_shared<std::promise<std::shared_ptr<Connection>>>();
  auto second = std::make_shared<std::promise<void>>();
  auto count = std::make_shared<std::atomic<int>>(0);
  std::string payload = Pattern(40 << 20, 12);
  std::shared_ptr<Drain> d;
  auto se = Engine::Create(o);
  auto ce = Engine::Create(o);
  if (!se.ok() || !ce.ok()) return 2;
  auto port = (*se)->Listen(Loopback(0), [accepted, second, count](std::shared_ptr<Connection> c) {
    if (count->fetch_add(1) == 0) accepted->set_value(std::move(c));
    else second->set_value();
  });
  if (!port.ok()) return 3;
  auto c = ConnectTo(**ce, *port);
  if (!c.ok()) return 4;
  auto af = accepted->get_future();
  if (af.wait_for(std::chrono::seconds(10)) != std::future_status::ready) return 12;
  auto s = af.get();
  d = std::make_shared<Drain>(s, payload.size());
  fprintf(stderr, "addr-change child: stream begins\n");
  fflush(stderr);
  for (size_t off = 0; off < payload.size(); off += 1 << 20) {
    auto wd = std::make_shared<std::promise<absl::Status>>();
    iovec v{payload.data() + off, 1 << 20};
    (*c)->Write({v}, [wd](absl::Status st) { wd->set_value(st); });
    auto f = wd->get_future();
    if (f.wait_for(std::chrono::seconds(30)) != std::future_status::ready) return 5;
    if (!f.get().ok()) return 6;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (d->done.get_future().wait_for(std::chrono::seconds(30)) != std::future_status::ready)
    return 7;
  if (!d->end.ok() || d->data != payload) return 8;
  fprintf(stderr, "addr-change child: stream ends\n");
  fflush(stderr);
  if ((*se)->connection_errors() != 0 || (*ce)->connection_errors() != 0) return 9;
  auto again = ConnectTo(**ce, *port);
  if (!again.ok()) return 10;
  if (second->get_future().wait_for(std::chrono::seconds(10)) != std::future_status::ready)
    return 11;
  return 0;
}

// A peer that never completes the connection exchange (no RTU after the
// server's accept): the server's half-set-up connection, with its receive
// buffers pinned, is dropped once TF_RDMA_CONNECT_TIMEOUT_MS has passed,
// with a log line, and the memory comes back; an honest peer then connects.
TEST(EnginePeers, AHalfOpenConnectionIsDroppedAfterTheConnectTimeout) {
  StderrCapture log;
  Options o;
  o.connect_timeout_ms = 300;
  auto se = Engine::Create(o);
  ASSERT_TRUE(se.ok());
  std::atomic<int> accepted{0};
  auto port = (*se)->Listen(Loopback(0), [&](std::shared_ptr<Connection>) { ++accepted; });
  ASSERT_TRUE(port.ok());
  uint64_t before = (*se)->pinned_bytes();
  pid_t child = Spawn({"--child", "half-open", std::to_string(*port)});
  ASSERT_GT(child, 0);
  bool pinned = false;
  for (int i = 0; i < 500 && !pinned; ++i) {
    pinned = (*se)->pinned_bytes() > before;
    if (!pinned) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(pinned) << "the server set the half-open connection up";
  bool back = false;
  for (int i = 0; i < 500 && !back; ++i) {  // 300 ms, then the poller's 10 ms look
    back = (*se)->pinned_bytes() <= before;
    if (!back) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(back) << (*se)->pinned_bytes() << " bytes still pinned for a connection never "
                    << "established";
  EXPECT_TRUE(log.WaitFor("never established", 2000)) << log.Text();
  EXPECT_EQ(accepted.load(), 0);
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  auto ce = Engine::Create(Options{});
  ASSERT_TRUE(ce.ok());
  auto c = ConnectTo(**ce, *port);
  EXPECT_TRUE(c.ok()) << c.status();
  for (int i = 0; i < 200 && accepted.load() == 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(accepted.load(), 1);
}

// A flood of half-open connections (a peer that never completes the
// exchange, faster than the connect timeout drops them) holds no more
// than the cap: each one past it drops the oldest, with a log line that
// names the setting, counted as refused; the memory they hold stays
// within the cap's share, and an honest peer still connects over RDMA
// while the flood's connections are held. (Without the cap, all 12 stay
// set up for the whole minute of the connect timeout.)
TEST(EnginePeers, HalfOpenConnectionsPastTheCapDropTheOldest) {
  StderrCapture log;
  Options o;
  o.connect_timeout_ms = 60000;  // no drop by timeout during the test
  o.max_half_open = 4;
  auto se = Engine::Create(o);
  ASSERT_TRUE(se.ok());
  std::atomic<int> accepted{0};
  auto port = (*se)->Listen(Loopback(0), [&](std::shared_ptr<Connection>) { ++accepted; });
  ASSERT_TRUE(port.ok());
  const uint64_t before = (*se)->pinned_bytes();
  // What a half-open connection pins: its receive buffers.
  const Options& eo = (*se)->options();
  const uint64_t each = static_cast<uint64_t>(eo.eager_depth) *
                        BufferPool::ClassFor(eo.acc_size + wire::kHeaderBytes);
  pid_t first = Spawn({"--child", "half-open", std::to_string(*port)});
  ASSERT_GT(first, 0);
  for (int i = 0; i < 1000 && (*se)->pinned_bytes() < before + each; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_GE((*se)->pinned_bytes(), before + each) << "the first half-open connection set up";
  pid_t flood = Spawn({"--child", "half-open", std::to_string(*port)}, {"HALF_OPEN_COUNT=11"});
  ASSERT_GT(flood, 0);
  // 12 in all, 4 kept: 8 dropped, one per request past the cap.
  for (int i = 0; i < 2000 && (*se)->refused() < 8; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  int status = 0;
  ASSERT_EQ(waitpid(flood, &status, WNOHANG), 0) << "the flooding peer exited with " << status;
  EXPECT_EQ((*se)->refused(), 8u);
  // The dropped ones' memory comes back after the drop (their destruction
  // is deferred): within a few seconds, never more than 4 held after.
  bool within = false;
  for (int i = 0; i < 500 && !within; ++i) {
    within = (*se)->pinned_bytes() <= before + 4 * each;
    if (!within) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(within) << (*se)->pinned_bytes() - before << " bytes pinned: more than 4 "
                      << "half-open connections' receive buffers (" << each << " bytes each)";
  EXPECT_TRUE(log.WaitFor("are accepted and not yet established", 2000)) << log.Text();
  EXPECT_TRUE(log.WaitFor("TF_RDMA_MAX_HALF_OPEN=4", 100)) << log.Text();
  EXPECT_EQ(accepted.load(), 0);
  // An honest peer gets in while the flood's connections are held.
  auto ce = Engine::Create(Options{});
  ASSERT_TRUE(ce.ok());
  auto c = ConnectTo(**ce, *port);
  EXPECT_TRUE(c.ok()) << c.status();
  for (int i = 0; i < 500 && accepted.load() == 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(accepted.load(), 1);
  EXPECT_EQ((*se)->refused(), 9u) << "the honest peer's request dropped one more";
  kill(first, SIGKILL);
  kill(flood, SIGKILL);
  waitpid(first, nullptr, 0);
  waitpid(flood, nullptr, 0);
}

// A connection closed while its last sends are still unacknowledged, to a
// peer that never takes them (no receives, infinite RNR retry): the close
// waits for them only so long, then disconnects, so the memory comes back
// while the peer is still there.
TEST(EnginePeers, ACloseDoesNotWaitForeverOnAPeerThatTakesNothing) {
  StderrCapture log;
  auto se = Engine::Create(Options{});
  ASSERT_TRUE(se.ok());
  std::promise<std::shared_ptr<Connection>> accepted;
  auto port = (*se)->Listen(Loopback(0), [&](std::shared_ptr<Connection> c) {
    accepted.set_value(std::move(c));
  });
  ASSERT_TRUE(port.ok());
  uint64_t before = (*se)->pinned_bytes();
  pid_t child = Spawn({"--child", "deaf", std::to_string(*port)});
  ASSERT_GT(child, 0);
  auto fut = accepted.get_future();
  ASSERT_EQ(fut.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  auto conn = fut.get();
  std::string msg(100, 'x');
  std::promise<absl::Status> wd;
  iovec v{msg.data(), msg.size()};
  conn->Write({v}, [&](absl::Status s) { wd.set_value(s); });
  EXPECT_TRUE(wd.get_future().get().ok());  // copied out: done, not delivered
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  conn->Shutdown(absl::UnavailableError("the test closes it"));
  conn.reset();
  bool back = false;
  for (int i = 0; i < 1000 && !back; ++i) {  // the drain limit is 2 s
    back = (*se)->pinned_bytes() <= before;
    if (!back) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(back) << (*se)->pinned_bytes() << " bytes still pinned for a closed connection";
  EXPECT_TRUE(log.WaitFor("were not acknowledged", 1000)) << log.Text();
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
}

// Chunks written out of the order of their grants (each in bounds, each
// whole): the engine closes the connection and says why, rather than hand
// the reader bytes out of place.
// A grant is open to the peer only until it is used: a message written
// into a standing grant is lent to the reader without a copy, and the
// peer's registration of that memory must not let it change those bytes
// afterwards. The device refuses the second write (the rogue sees an
// access error), the engine closes the connection and says why, and the
// bytes the reader holds are the message's.
TEST(EnginePeers, AUsedGrantIsClosedToThePeer) {
  StderrCapture log;
  std::mutex mu;  // these before the engine: its callbacks use them
  std::vector<RecvChunk> held;
  std::shared_ptr<Connection> conn;
  auto se = Engine::Create(Options{});
  ASSERT_TRUE(se.ok());
  auto port = (*se)->Listen(Loopback(0), [&](std::shared_ptr<Connection> c) {
    c->Read([&](absl::StatusOr<RecvChunks> r) {
      if (!r.ok()) return;
      std::lock_guard<std::mutex> l(mu);
      for (RecvChunk& ch : *r) held.push_back(std::move(ch));  // held, not given back
    });
    std::lock_guard<std::mutex> l(mu);
    conn = std::move(c);
  });
  ASSERT_TRUE(port.ok());
  pid_t child = Spawn({"--child", "rogue", std::to_string(*port)}, {"ROGUE_MODE=rewrite_used"});
  int status = 0;
  waitpid(child, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "21: the second write landed in memory lent to the reader; 22-24: the rogue failed";
  std::string got;
  {
    std::lock_guard<std::mutex> l(mu);
    for (const RecvChunk& ch : held) got.append(ch.data(), ch.size());
  }
  EXPECT_EQ(got.size(), 20000u);
  EXPECT_EQ(got.find_first_not_of('A'), std::string::npos)
      << "the reader's bytes are the message's, not what the peer wrote after";
  EXPECT_TRUE(log.WaitFor("an RDMA access outside its grants", 5000)) << log.Text();
  for (int i = 0; i < 500 && (*se)->connection_errors() == 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ((*se)->connection_errors(), 1u) << "counted as a fault";
  std::lock_guard<std::mutex> l(mu);
  held.clear();  // before the engine goes
}

TEST(EnginePeers, ChunksOutOfOrderAreAViolation) {
  StderrCapture log;
  Options o;
  o.chunk_size = 64 << 10;
  RogueServer server(o);
  ASSERT_TRUE(server.ok());
  EXPECT_EQ(server.Run({"ROGUE_MODE=reorder"}), 0) << "the rogue got its two grants";
  EXPECT_TRUE(log.WaitFor("the peer broke the protocol (chunk out of order)", 5000))
      << log.Text();
  EXPECT_EQ(server.WaitForErrors(1, 5000), 1u) << "counted in connection_errors";
}

// The rogue-peer matrix for message headers: one case per rule the
// receiver checks in a message (version, credits, data length, rendezvous
// size, grants, type). Each: the engine logs which rule, closes only that
// connection, and counts it; then an honest peer connects to the same
// engine and is served.
struct HeaderCase {
  const char* mode;
  const char* rule;  // as the log says it
};
void PrintTo(const HeaderCase& c, std::ostream* os) { *os << c.mode; }
class HeaderViolation : public ::testing::TestWithParam<HeaderCase> {};

TEST_P(HeaderViolation, ClosesThatConnectionAndSaysWhy) {
  StderrCapture log;
  RogueServer server;
  ASSERT_TRUE(server.ok());
  EXPECT_EQ(server.Run({std::string("ROGUE_MODE=header_") + GetParam().mode}), 0);
  EXPECT_TRUE(log.WaitFor(std::string("the peer broke the protocol (") + GetParam().rule + ")",
                          5000))
      << log.Text();
  EXPECT_EQ(server.WaitForErrors(1, 5000), 1u) << "counted in connection_errors";
  EXPECT_EQ(server.Run({"ROGUE_MODE=count_pre"}), 100 + 2)
      << "an engine from before the standing grants' field, behaving: served as before";
}

INSTANTIATE_TEST_SUITE_P(
    Rules, HeaderViolation,
    ::testing::Values(HeaderCase{"short", "message shorter than a header"},
                      HeaderCase{"version", "unknown protocol version"},
                      HeaderCase{"credits", "more credits than receives posted"},
                      HeaderCase{"data_empty", "bad data length"},
                      HeaderCase{"data_length", "bad data length"},
                      HeaderCase{"data_in_rendezvous", "data in the middle of a rendezvous"},
                      HeaderCase{"rendezvous_empty", "bad rendezvous"},
                      HeaderCase{"rendezvous_huge", "bad rendezvous"},
                      HeaderCase{"grant_for_nothing", "grant for nothing"},
                      HeaderCase{"standing_small", "bad standing grant"},
                      HeaderCase{"unknown_type", "unknown message type"}),
    [](const auto& i) { return std::string(i.param.mode); });

// The chunk rules: a chunk shorter than its grant, and one under a grant id
// the engine never gave; each logged and counted, that connection closed.
TEST(EnginePeers, ChunksOfTheWrongLengthOrForNoGrantAreViolations) {
  Options o;
  o.chunk_size = 64 << 10;
  for (auto [mode, rule] : {std::pair<const char*, const char*>{"chunk_short",
                                                                 "chunk of the wrong length"},
                            {"chunk_no_grant", "chunk for no grant"}}) {
    StderrCapture log;
    RogueServer server(o);
    ASSERT_TRUE(server.ok());
    EXPECT_EQ(server.Run({std::string("ROGUE_MODE=") + mode}), 0) << mode;
    EXPECT_TRUE(log.WaitFor(std::string("the peer broke the protocol (") + rule + ")", 5000))
        << mode << ": " << log.Text();
    EXPECT_EQ(server.WaitForErrors(1, 5000), 1u) << mode;
  }
}

// The grant rules, as the writer checks them: the engine announces a
// 100,000-byte message to the rogue, which answers with a grant that does
// not start where the message's next bytes are, or one that reaches past
// its end; each logged and counted, that connection closed, the write
// failed rather than anything written where it was not asked.
TEST(EnginePeers, GrantsOutOfOrderOrOutOfBoundsAreViolations) {
  for (const char* mode : {"grant_out_of_order", "grant_out_of_bounds"}) {
    StderrCapture log;
    RogueServer server(Options{}, 100000);
    ASSERT_TRUE(server.ok());
    EXPECT_EQ(server.Run({std::string("ROGUE_MODE=") + mode}), 0)
        << mode << ": 13 is no announcement from the engine";
    EXPECT_TRUE(log.WaitFor("the peer broke the protocol (grant out of order or out of bounds)",
                            5000))
        << mode << ": " << log.Text();
    EXPECT_EQ(server.WaitForErrors(1, 5000), 1u) << mode;
  }
}

// A peer that announces a large message, takes the grants and writes
// nothing (gone silent, or an attack on the pinned memory: 100 such peers
// held 1,022 of 1,024 MiB) loses the connection after
// TF_RDMA_GRANT_TIMEOUT_MS, with a line that says so.
TEST(EnginePeers, GrantsLeftUnwrittenCloseTheConnection) {
  StderrCapture log;
  Options o;
  o.grant_timeout_ms = 300;
  RogueServer server(o);
  ASSERT_TRUE(server.ok());
  EXPECT_EQ(server.Run({"ROGUE_MODE=silent"}), 0) << "14: the engine kept the connection";
  EXPECT_TRUE(log.WaitFor("granted bytes unwritten for 300 ms (TF_RDMA_GRANT_TIMEOUT_MS)", 5000))
      << log.Text();
  EXPECT_EQ(server.WaitForErrors(1, 5000), 1u) << "counted in connection_errors";
}

// A locked-memory limit below TF_RDMA_BUF_SIZE (a user's `ulimit -l`, a
// container's default) closed the connection at the first registration
// it refused; now it becomes the cap, said once, and transfers wait.
TEST(EnginePeers, TheLockedMemoryLimitBecomesTheCapAndTransfersWait) {
  StderrCapture log;
  std::string payload = Pattern(24 << 20, 5);
  std::mutex mu;  // these before the engine: its callbacks use them
  std::vector<std::shared_ptr<Connection>> accepted;
  auto se = Engine::Create(Options{});
  ASSERT_TRUE(se.ok());
  auto port = (*se)->Listen(Loopback(0), [&](std::shared_ptr<Connection> c) {
    iovec v{payload.data(), payload.size()};
    c->Write({v}, [](absl::Status) {});
    std::lock_guard<std::mutex> l(mu);
    accepted.push_back(std::move(c));
  });
  ASSERT_TRUE(port.ok());
  pid_t child = Spawn({"--child", "memlock-receiver", std::to_string(*port)});
  int status = 0;
  waitpid(child, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the step that failed (ChildMemlockReceiver)\n"
                                    << log.Text();
  EXPECT_TRUE(log.WaitFor("the device registers no more memory, most likely the locked-memory "
                          "limit (RLIMIT_MEMLOCK, `ulimit -l`: 6144 KiB); grpc-rdma keeps to",
                          1000))
      << log.Text();
}

// TF_RDMA_DEV_NAME is the device every connection uses: one that would
// run over another device goes by TCP instead (the engine fails it, the
// glue falls back), and the log says so once per device.
TEST(EnginePeers, ANamedDeviceIsTheOnlyOneUsed) {
  StderrCapture log;
  pid_t child = Spawn({"--child", "two-devices"},
                      {"SOFTVERBS_DEVICES=mlx5_0:127.0.0.1,mlx5_1:127.0.0.2"});
  int status = 0;
  waitpid(child, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the check that failed (ChildTwoDevices)\n" << log.Text();
  EXPECT_TRUE(log.WaitFor("is on RDMA device mlx5_0, not TF_RDMA_DEV_NAME=mlx5_1: such "
                          "connections use TCP",
                          1000))
      << log.Text();
}

}  // namespace
}  // namespace grpc_rdma

int main(int argc, char** argv) {
  if (argc >= 3 && strcmp(argv[1], "--child") == 0) {
    std::string m = argv[2];
    uint16_t port = argc >= 4 ? static_cast<uint16_t>(atoi(argv[3])) : 0;
    if (m == "write-forever") return grpc_rdma::ChildWriteForever(port);
    if (m == "rogue") return grpc_rdma::ChildRogue(port);
    if (m == "half-open") return grpc_rdma::ChildHalfOpen(port);
    if (m == "deaf") return grpc_rdma::ChildDeaf(port);
    if (m == "transfer") return grpc_rdma::ChildTransfer();
    if (m == "cut-wire") return grpc_rdma::ChildCutWire();
    if (m == "device-removed") return grpc_rdma::ChildDeviceRemoved();
    if (m == "zero-copy-overwrite") return grpc_rdma::ChildZeroCopyOverwrite();
    if (m == "zero-copy-shutdown") return grpc_rdma::ChildZeroCopyShutdown();
    if (m == "zero-copy-keep") return grpc_rdma::ChildZeroCopyKeep(false);
    if (m == "zero-copy-keep-shutdown") return grpc_rdma::ChildZeroCopyKeep(true);
    if (m == "addr-change") return grpc_rdma::ChildAddrChange();
    if (m == "two-devices") return grpc_rdma::ChildTwoDevices();
    if (m == "memlock-receiver") return grpc_rdma::ChildMemlockReceiver(port);
    return 100;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
