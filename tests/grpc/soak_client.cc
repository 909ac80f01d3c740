// soak_client: the client half of the soak (tests/grpc/run_soak.sh). Public
// grpc++ API only; grpc-rdma is preloaded by the driver.
//
//   soak_client TARGET SECONDS QUIET_SECONDS [--workers N] [--seed S] [--grace G]
//
// N workers (default 4) each make calls of every shape of the Echo service
// (unary, upload, download, chat, sink) with sizes from 1 byte to 8 MiB,
// mostly small, for SECONDS; every worker makes a new channel (so a new
// connection) every few dozen calls. Faults of the client's own making, at
// random: a call cancelled part way, a deadline too short for the call.
// Every byte that comes back is checked against what was sent.
//
// Checks (any failure: exit 1, naming the call):
//   - no byte wrong: an OK call's data is what was sent, in order;
//   - no call outlives its deadline by more than 5 s (no hang);
//   - a call ends OK, or CANCELLED when this client cancelled it, or
//     DEADLINE_EXCEEDED when its deadline passed; UNAVAILABLE (the server
//     went: the driver kills and restarts it) only in calls started before
//     the quiet period plus G seconds (default 5, at most half the quiet
//     period: a restart's reconnects);
//   - in the last QUIET_SECONDS (no faults from the driver), from G seconds
//     in, every call that this client does not fault ends OK, and some do;
//   - at the end, with every channel gone, the plugin holds no connection
//     and no pinned memory within 10 s.
// Prints a line every 10 s (calls by outcome, MB moved, connections) and a
// summary line "soak: ok ..." or "soak: FAIL ...".
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "echo_service.h"

namespace {

using grpc_rdma::test::Blob;
using grpc_rdma::test::Echo;
using Clock = std::chrono::steady_clock;

struct Totals {
  std::atomic<uint64_t> ok{0}, cancelled{0}, deadline{0}, unavailable{0}, bytes{0};
  std::atomic<uint64_t> quiet_ok{0};  // OK calls started in the checked quiet period
  std::atomic<uint64_t> channels{0};
  std::mutex mu;
  std::string failure;  // the first
  void Fail(const std::string& why) {
    std::lock_guard<std::mutex> l(mu);
    if (failure.empty()) failure = why;
  }
  bool failed() {
    std::lock_guard<std::mutex> l(mu);
    return !failure.empty();
  }
};

enum class Fault { kNone, kCancel, kShortDeadline };

class Worker {
 public:
  // `quiet_from`: when every call must end as its own faults say.
  Worker(const std::string& target, int id, uint32_t seed, Clock::time_point quiet_from,
         Totals* t)
      : target_(target), id_(id), rng_(seed), quiet_from_(quiet_from), t_(t) {}

  void Run(Clock::time_point end) {
    while (Clock::now() < end && !t_->failed()) {
      if (stub_ == nullptr || calls_on_channel_ >= channel_calls_) NewChannel();
      ++calls_on_channel_;
      OneCall();
    }
    stub_.reset();
  }

 private:
  void NewChannel() {
    stub_ = Echo::NewStub(grpc::CreateCustomChannel(
        target_, grpc::InsecureChannelCredentials(), grpc_rdma_test::BigMessageArgs()));
    calls_on_channel_ = 0;
    channel_calls_ = 10 + static_cast<int>(rng_() % 60);
    ++t_->channels;
  }

  size_t Size() {
    uint32_t r = rng_() % 100;
    if (r < 60) return 1 + rng_() % 8192;                  // eager
    if (r < 85) return 8193 + rng_() % (256 << 10);        // rendezvous, one chunk
    return (256 << 10) + rng_() % ((8 << 20) - (256 << 10));  // several chunks
  }

  // Ends the call's bookkeeping: the status against what was expected.
  void Outcome(const char* what, size_t size, Fault f, const grpc::Status& s,
               Clock::time_point started, std::chrono::milliseconds deadline) {
    auto took = Clock::now() - started;
    char name[160];
    snprintf(name, sizeof(name), "worker %d call %llu (%s, %zu bytes%s)", id_,
             static_cast<unsigned long long>(calls_), what, size,
             f == Fault::kCancel ? ", cancelled" : f == Fault::kShortDeadline ? ", short deadline"
                                                                              : "");
    if (took > deadline + std::chrono::seconds(5)) {
      t_->Fail(std::string(name) + ": ended " +
               std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(took).count()) +
               " ms after it started, past its deadline of " + std::to_string(deadline.count()) +
               " ms by more than 5 s");
      return;
    }
    const bool quiet = started >= quiet_from_;
    switch (s.error_code()) {
      case grpc::StatusCode::OK:
        ++t_->ok;
        if (quiet) ++t_->quiet_ok;
        return;
      case grpc::StatusCode::CANCELLED:
        if (f == Fault::kCancel) {
          ++t_->cancelled;
          return;
        }
        break;
      case grpc::StatusCode::DEADLINE_EXCEEDED:
        if (f == Fault::kShortDeadline || took >= deadline) {
          ++t_->deadline;
          if (f == Fault::kShortDeadline) return;
        }
        break;
      case grpc::StatusCode::UNAVAILABLE:
        ++t_->unavailable;
        if (!quiet) return;
        break;
      default:
        break;
    }
    t_->Fail(std::string(name) + ": status " + std::to_string(static_cast<int>(s.error_code())) +
             " (" + s.error_message() + ")" + (quiet ? " in the quiet period" : ""));
  }

  void Check(bool good, const char* what, size_t size) {
    if (good) return;
    t_->Fail("worker " + std::to_string(id_) + " call " + std::to_string(calls_) + " (" + what +
             ", " + std::to_string(size) + " bytes): the data that came back is not what was sent");
  }

  void OneCall() {
    ++calls_;
    size_t size = Size();
    uint32_t seed = static_cast<uint32_t>(rng_());
    std::string data = grpc_rdma_test::Pattern(size, seed);
    Fault f = Fault::kNone;
    uint32_t r = rng_() % 100;
    if (r < 5) f = Fault::kCancel;
    else if (r < 10) f = Fault::kShortDeadline;
    auto deadline = f == Fault::kShortDeadline ? std::chrono::milliseconds(1 + rng_() % 20)
                                               : std::chrono::milliseconds(30000);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + deadline);
    std::thread canceller;
    if (f == Fault::kCancel) {
      int after_us = static_cast<int>(rng_() % 5000);
      canceller = std::thread([&ctx, after_us] {
        std::this_thread::sleep_for(std::chrono::microseconds(after_us));
        ctx.TryCancel();
      });
    }
    auto started = Clock::now();
    uint32_t shape = rng_() % 5;
    const char* what = "";
    grpc::Status s;
    Blob req, resp;
    switch (shape) {
      case 0: {
        what = "unary";
        req.set_data(data);
        s = stub_->Unary(&ctx, req, &resp);
        if (s.ok()) Check(resp.data() == data, what, size);
        break;
      }
      case 1: {  // the data in 1-4 pieces, answered whole
        what = "upload";
        auto w = stub_->Upload(&ctx, &resp);
        size_t pieces = 1 + rng_() % 4, at = 0;
        for (size_t i = 0; i < pieces && at < size; ++i) {
          size_t n = i + 1 == pieces ? size - at : std::min(size - at, size / pieces + 1);
          req.set_data(data.substr(at, n));
          at += n;
          if (!w->Write(req)) break;
        }
        w->WritesDone();
        s = w->Finish();
        if (s.ok()) Check(resp.data() == data, what, size);
        break;
      }
      case 2: {  // the data 1-8 times
        what = "download";
        req.set_data(data);
        uint32_t repeat = 1 + rng_() % 8;
        req.set_repeat(repeat);
        auto rd = stub_->Download(&ctx, req);
        uint32_t n = 0;
        bool good = true;
        while (rd->Read(&resp)) {
          ++n;
          good = good && resp.data() == data;
        }
        s = rd->Finish();
        if (s.ok()) Check(good && n == repeat, what, size);
        break;
      }
      case 3: {  // 1-8 messages, each echoed before the next goes
        what = "chat";
        auto st = stub_->Chat(&ctx);
        uint32_t n = 1 + rng_() % 8;
        bool good = true;
        uint32_t echoed = 0;
        for (uint32_t i = 0; i < n; ++i) {
          req.set_data(grpc_rdma_test::Pattern(size, seed + i));
          if (!st->Write(req) || !st->Read(&resp)) break;
          good = good && resp.data() == req.data();
          ++echoed;
        }
        st->WritesDone();
        while (st->Read(&resp)) good = false;  // nothing more was sent
        s = st->Finish();
        if (s.ok()) Check(good && echoed == n, what, size);
        break;
      }
      default: {  // 1-16 messages one way, counted
        what = "sink";
        auto w = stub_->Sink(&ctx, &resp);
        uint32_t n = 1 + rng_() % 16, sent = 0;
        req.set_data(data);
        for (uint32_t i = 0; i < n && w->Write(req); ++i) ++sent;
        w->WritesDone();
        s = w->Finish();
        if (s.ok()) Check(sent == n && resp.repeat() == n, what, size);
        break;
      }
    }
    if (canceller.joinable()) canceller.join();
    if (s.ok()) t_->bytes += size;
    Outcome(what, size, f, s, started, deadline);
  }

  std::string target_;
  int id_;
  std::mt19937_64 rng_;
  Clock::time_point quiet_from_;
  Totals* t_;
  std::unique_ptr<Echo::Stub> stub_;
  int calls_on_channel_ = 0, channel_calls_ = 0;
  uint64_t calls_ = 0;
};

int Usage() {
  fprintf(stderr,
          "usage: soak_client TARGET SECONDS QUIET_SECONDS [--workers N] [--seed S] [--grace G]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) return Usage();
  std::string target = argv[1];
  int seconds = atoi(argv[2]), quiet = atoi(argv[3]);
  int workers = 4, grace = -1;  // default: 5 s, or half a shorter quiet period
  uint64_t seed = static_cast<uint64_t>(time(nullptr));
  for (int i = 4; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--workers") workers = atoi(argv[i + 1]);
    else if (a == "--seed") seed = strtoull(argv[i + 1], nullptr, 10);
    else if (a == "--grace") grace = atoi(argv[i + 1]);
    else return Usage();
  }
  if (grace < 0) grace = std::min(5, quiet / 2);
  if (seconds <= 0 || quiet < 0 || quiet > seconds || workers <= 0 || grace > quiet)
    return Usage();
  printf("soak: %d s (the last %d quiet), %d workers, seed %llu\n", seconds, quiet, workers,
         static_cast<unsigned long long>(seed));
  fflush(stdout);

  Totals t;
  auto start = Clock::now();
  auto end = start + std::chrono::seconds(seconds);
  auto quiet_from = end - std::chrono::seconds(quiet) + std::chrono::seconds(grace);
  std::vector<std::thread> threads;
  for (int i = 0; i < workers; ++i) {
    threads.emplace_back([&, i] {
      Worker w(target, i, static_cast<uint32_t>(seed * 7919 + i), quiet_from, &t);
      w.Run(end);
    });
  }
  auto stats_line = [&](const char* prefix) {
    auto st = grpc_rdma_test::RdmaStats();
    printf("%s %llds: ok %llu, cancelled %llu, deadline %llu, unavailable %llu; %.1f MB; "
           "channels %llu; rdma connections %lld (open %lld), tcp %lld; pinned %lld bytes\n",
           prefix,
           static_cast<long long>(
               std::chrono::duration_cast<std::chrono::seconds>(Clock::now() - start).count()),
           static_cast<unsigned long long>(t.ok.load()),
           static_cast<unsigned long long>(t.cancelled.load()),
           static_cast<unsigned long long>(t.deadline.load()),
           static_cast<unsigned long long>(t.unavailable.load()), t.bytes.load() / 1e6,
           static_cast<unsigned long long>(t.channels.load()),
           static_cast<long long>(st["rdma_client_connections"]),
           static_cast<long long>(st["rdma_connections_open"]),
           static_cast<long long>(st["tcp_client_connections"]),
           static_cast<long long>(st["pinned_bytes"]));
    fflush(stdout);
  };
  std::atomic<bool> done{false};
  std::thread progress([&] {
    auto next = start + std::chrono::seconds(10);
    while (!done.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      if (Clock::now() >= next) {
        stats_line("soak:");
        next += std::chrono::seconds(10);
      }
    }
  });
  for (auto& th : threads) th.join();
  done = true;
  progress.join();

  // Every channel is gone: the plugin must let go of what it held.
  std::map<std::string, int64_t> st;
  for (int i = 0; i < 100; ++i) {
    st = grpc_rdma_test::RdmaStats();
    if (st["rdma_connections_open"] == 0 && st["pinned_bytes"] == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  // What each open connection is doing, for the diagnosis; and endpoints
  // gRPC shut down and kept (gRPC's own leak: they hold no RDMA connection
  // and no pinned memory) are noted, not failed.
  const std::string open_text = grpc_rdma_test::ConnectionsText();
  if (st.empty()) t.Fail("grpc-rdma is not in this process (preload it)");
  else if (st["rdma_connections_open"] != 0 || st["pinned_bytes"] != 0) {
    t.Fail("10 s after the last channel went, the plugin still holds " +
           std::to_string(st["rdma_connections_open"]) + " connections and " +
           std::to_string(st["pinned_bytes"]) + " pinned bytes");
    fprintf(stderr, "soak: the open RDMA connections:\n%s", open_text.c_str());
  } else if (!open_text.empty()) {
    printf("soak: note: %s", open_text.c_str());
  }
  if (t.ok.load() == 0) t.Fail("no call ended OK");
  if (quiet > grace && t.quiet_ok.load() == 0) t.Fail("no call ended OK in the quiet period");
  stats_line(t.failed() ? "soak: FAIL at" : "soak: ok at");
  if (t.failed()) {
    printf("soak: FAIL: %s\n", t.failure.c_str());
    return 1;
  }
  return 0;
}
