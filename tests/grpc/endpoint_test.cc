// gRPC's own endpoint test suite (test/core/iomgr/endpoint_tests.cc from the
// source package of the installed gRPC, compiled unchanged) run against a
// pair of RDMA endpoints over softverbs: the contract chttp2 relies on,
// checked by the tests gRPC checks its TCP endpoint with. Then against
// pairs of TCP-first endpoints (src/glue/switch_endpoint.cc) that move to
// RDMA at once, in the middle of the suite's streams, or never; then the
// TCP-first endpoint against a peer that breaks the switch's protocol.
#include <arpa/inet.h>
#include <grpc/grpc.h>
#include <grpc/support/alloc.h>
#include <grpc/support/log.h>
#include <grpc/support/time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "engine/engine.h"
#include "glue/endpoint.h"
#include "glue/switch_endpoint.h"
#include "src/core/lib/iomgr/endpoint_pair.h"
#include "src/core/lib/iomgr/exec_ctx.h"
#include "src/core/lib/iomgr/pollset.h"
#include "test/core/iomgr/endpoint_tests.h"

// From gRPC's test/core/util/test_config.cc, which brings much else along.
gpr_timespec grpc_timeout_seconds_to_deadline(int64_t time_s) {
  return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_seconds(time_s, GPR_TIMESPAN));
}

namespace {

gpr_mu* g_mu;
grpc_pollset* g_pollset;
std::unique_ptr<grpc_rdma::Engine> g_engine;
uint16_t g_port;

std::mutex g_accept_mu;
std::condition_variable g_accept_cv;
std::shared_ptr<grpc_rdma::Connection> g_accepted;
std::weak_ptr<grpc_rdma::Connection> g_last_client;  // the last fixture's

// A connected pair of RDMA connections (client, server).
std::pair<std::shared_ptr<grpc_rdma::Connection>, std::shared_ptr<grpc_rdma::Connection>>
RdmaPair() {
  static std::mutex one_at_a_time;  // the accept below is the connect's
  std::lock_guard<std::mutex> pairing(one_at_a_time);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(g_port);
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  absl::StatusOr<std::shared_ptr<grpc_rdma::Connection>> client;
  g_engine->Connect(addr, 5000, [&](absl::StatusOr<std::shared_ptr<grpc_rdma::Connection>> r) {
    std::lock_guard<std::mutex> g(mu);
    client = std::move(r);
    done = true;
    cv.notify_all();
  });
  {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return done; });
  }
  GPR_ASSERT(client.ok());
  std::shared_ptr<grpc_rdma::Connection> server;
  {
    std::unique_lock<std::mutex> l(g_accept_mu);
    g_accept_cv.wait(l, [] { return g_accepted != nullptr; });
    server = std::move(g_accepted);
  }
  return {std::move(*client), std::move(server)};
}

grpc_endpoint_test_fixture CreateFixture(size_t /*slice_size*/) {
  auto [client, server] = RdmaPair();
  grpc_endpoint_test_fixture f;
  g_last_client = client;
  f.client_ep = grpc_rdma::CreateRdmaEndpoint(std::move(client), false);
  f.server_ep = grpc_rdma::CreateRdmaEndpoint(std::move(server), true);
  return f;
}

// TCP-first pairs: a TCP endpoint pair (a socketpair, gRPC's TCP
// endpoints) under switch endpoints, joined by an RDMA pair at once, while
// the suite's stream runs (once bytes went on TCP, plus a random 0-2 ms),
// or never.
enum class Join { kAtOnce, kMidStream, kNever };
Join g_join = Join::kAtOnce;
std::vector<std::thread> g_joiners;
std::mt19937 g_rng(12345);

struct SwitchPair {
  grpc_endpoint_test_fixture f;
  std::shared_ptr<grpc_rdma::Switch> client, server;
};

std::vector<std::shared_ptr<grpc_rdma::Switch>> g_switches;  // the variant's, both sides

SwitchPair CreateSwitchPair() {
  grpc_endpoint_pair tcp = grpc_iomgr_create_endpoint_pair("switch", nullptr);
  SwitchPair p;
  p.client = grpc_rdma::CreateSwitchEndpoint(tcp.client, false, &p.f.client_ep);
  p.server = grpc_rdma::CreateSwitchEndpoint(tcp.server, true, &p.f.server_ep);
  g_switches.push_back(p.client);
  g_switches.push_back(p.server);
  return p;
}

// After a variant's suite: did its endpoints move as the variant says?
// Joined at once, every one that read moved its reads with 0 bytes from
// TCP; mid-stream, some moved after bytes went on TCP; never, none moved.
bool CheckMoves(Join j, const char* name) {
  int moved = 0, moved_after_tcp = 0, read_tcp_before_move = 0, endpoints = 0;
  for (auto& sw : g_switches) {
    grpc_rdma::SwitchProgress p = grpc_rdma::ProgressOf(sw);
    ++endpoints;
    if (p.reads_rdma) ++moved;
    if (p.writes_rdma && p.tcp_written > 0) ++moved_after_tcp;
    if (j == Join::kAtOnce && (p.tcp_read > 0 || p.tcp_written > 0)) ++read_tcp_before_move;
  }
  g_switches.clear();
  printf("%s: %d endpoints, %d moved their reads to RDMA, %d moved writes after bytes on TCP\n",
         name, endpoints, moved, moved_after_tcp);
  bool ok = j == Join::kAtOnce      ? moved > endpoints / 2 && read_tcp_before_move == 0
            : j == Join::kMidStream ? moved > 0 && moved_after_tcp > 0
                                    : moved == 0;
  if (!ok) fprintf(stderr, "FAIL: %s: the endpoints did not move as this variant should\n", name);
  return ok;
}

using ConnPair =
    std::pair<std::shared_ptr<grpc_rdma::Connection>, std::shared_ptr<grpc_rdma::Connection>>;

void AttachBoth(std::shared_ptr<grpc_rdma::Switch> client,
                std::shared_ptr<grpc_rdma::Switch> server, ConnPair pair) {
  grpc_core::ApplicationCallbackExecCtx callback_exec_ctx;
  grpc_core::ExecCtx exec_ctx;
  grpc_rdma::AttachRdma(server, std::move(pair.second));
  grpc_rdma::AttachRdma(client, std::move(pair.first));
}

grpc_endpoint_test_fixture CreateSwitchFixture(size_t /*slice_size*/) {
  SwitchPair p = CreateSwitchPair();
  if (g_join == Join::kAtOnce) {
    AttachBoth(p.client, p.server, RdmaPair());
  } else if (g_join == Join::kMidStream) {
    // The RDMA pair is made here, before the stream starts, so that the
    // join itself is quick: made in the joiner, on a loaded machine, it
    // once came after every stream had ended, and nothing moved.
    int us = std::uniform_int_distribution<int>(0, 2000)(g_rng);
    g_joiners.emplace_back([client = p.client, server = p.server, us, pair = RdmaPair()] {
      auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
      while (grpc_rdma::ProgressOf(client).tcp_written == 0 &&
             grpc_rdma::ProgressOf(server).tcp_written == 0 &&
             std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(us));
      AttachBoth(client, server, pair);
    });
  }
  return p.f;
}

// Runs the pollset once, for up to 10 ms.
void PollOnce() {
  grpc_core::ExecCtx exec_ctx;
  gpr_mu_lock(g_mu);
  grpc_pollset_worker* worker = nullptr;
  GRPC_LOG_IF_ERROR("pollset_work",
                    grpc_pollset_work(g_pollset, &worker,
                                      grpc_core::Timestamp::Now() +
                                          grpc_core::Duration::Milliseconds(10)));
  gpr_mu_unlock(g_mu);
}

// Runs the pollset until *done or `seconds` pass. Callbacks set *done on
// whichever thread completes them (the engine's, for RDMA).
void PollUntil(const std::atomic<int>* done, int seconds) {
  gpr_timespec deadline = grpc_timeout_seconds_to_deadline(seconds);
  while (*done == 0 && gpr_time_cmp(gpr_now(GPR_CLOCK_MONOTONIC), deadline) < 0) PollOnce();
}

struct ReadResult {
  std::atomic<int> done{0};  // 1 ok, 2 failed; set last
  std::string error;
};

void OnTestRead(void* arg, grpc_error_handle error) {
  auto* r = static_cast<ReadResult*>(arg);
  if (!error.ok()) r->error = grpc_core::StatusToString(error);
  r->done = error.ok() ? 1 : 2;
}

void OnTestWrite(void* arg, grpc_error_handle error) {
  static_cast<std::atomic<int>*>(arg)->store(error.ok() ? 1 : 2);
}

// Reads from `ep` until `want` bytes came (or a read failed, or 10 s):
// what came, and the failure.
std::string ReadBytes(grpc_endpoint* ep, size_t want, std::string* error) {
  std::string got;
  grpc_slice_buffer sb;
  grpc_slice_buffer_init(&sb);
  while (got.size() < want) {
    ReadResult r;
    grpc_closure done;
    GRPC_CLOSURE_INIT(&done, OnTestRead, &r, grpc_schedule_on_exec_ctx);
    {
      grpc_core::ExecCtx exec_ctx;
      grpc_endpoint_read(ep, &sb, &done, true, 1);
    }
    PollUntil(&r.done, 10);
    if (r.done != 1) {
      *error = r.done == 0 ? "no read completed in 10 s" : r.error;
      break;
    }
    for (size_t i = 0; i < sb.count; ++i) {
      got.append(reinterpret_cast<const char*>(GRPC_SLICE_START_PTR(sb.slices[i])),
                 GRPC_SLICE_LENGTH(sb.slices[i]));
    }
    grpc_slice_buffer_reset_and_unref(&sb);
  }
  grpc_slice_buffer_destroy(&sb);
  return got;
}

bool WriteBytes(grpc_endpoint* ep, const std::string& bytes) {
  grpc_slice_buffer sb;
  grpc_slice_buffer_init(&sb);
  grpc_slice_buffer_add(&sb, grpc_slice_from_copied_buffer(bytes.data(), bytes.size()));
  std::atomic<int> done{0};
  grpc_closure cb;
  GRPC_CLOSURE_INIT(&cb, OnTestWrite, &done, grpc_schedule_on_exec_ctx);
  {
    grpc_core::ExecCtx exec_ctx;
    grpc_endpoint_write(ep, &sb, &cb, nullptr, INT_MAX);
  }
  PollUntil(&done, 10);
  grpc_slice_buffer_destroy(&sb);
  return done == 1;
}

std::string Header(uint64_t magic, uint64_t n) {
  std::string h(16, '\0');
  for (int i = 0; i < 8; ++i) h[i] = static_cast<char>(magic >> (8 * i));
  for (int i = 0; i < 8; ++i) h[8 + i] = static_cast<char>(n >> (8 * i));
  return h;
}

// A TCP-first endpoint (the client) against a peer that is not one: gRPC's
// TCP endpoint and an RDMA endpoint written by the test. `tcp_bytes` go on
// TCP first, then `rdma_bytes` on RDMA (nullptr: the RDMA connection is
// shut down instead). Returns what the client read and why it stopped.
struct Rogue {
  std::string read;
  std::string error;
};
// `as_server`: the endpoint under test plays the server's part (its
// writes move as soon as the RDMA connection joins).
Rogue AgainstRoguePeer(const std::string& tcp_bytes, const std::string* rdma_bytes,
                       const std::string& tcp_after, size_t want, bool as_server = false) {
  grpc_endpoint_pair tcp = grpc_iomgr_create_endpoint_pair("rogue", nullptr);
  grpc_endpoint* client = nullptr;
  auto sw = grpc_rdma::CreateSwitchEndpoint(tcp.client, as_server, &client);
  grpc_endpoint_add_to_pollset(client, g_pollset);
  grpc_endpoint_add_to_pollset(tcp.server, g_pollset);
  auto [c, s] = RdmaPair();
  grpc_endpoint* rdma_server = grpc_rdma::CreateRdmaEndpoint(std::move(s), true);
  Rogue out;
  if (!tcp_bytes.empty() && !WriteBytes(tcp.server, tcp_bytes)) out.error = "TCP write failed";
  // The client's first bytes come over TCP before the RDMA connection joins.
  if (!tcp_bytes.empty()) out.read = ReadBytes(client, tcp_bytes.size(), &out.error);
  {
    grpc_core::ApplicationCallbackExecCtx callback_exec_ctx;
    grpc_core::ExecCtx exec_ctx;
    grpc_rdma::AttachRdma(sw, std::move(c));
  }
  if (rdma_bytes != nullptr) {
    if (!WriteBytes(rdma_server, *rdma_bytes)) out.error = "RDMA write failed";
  } else {
    grpc_core::ExecCtx exec_ctx;
    grpc_endpoint_shutdown(rdma_server, GRPC_ERROR_CREATE("the rogue's RDMA connection ends"));
  }
  if (!tcp_after.empty() && !WriteBytes(tcp.server, tcp_after)) out.error = "TCP write failed";
  if (out.error.empty()) out.read += ReadBytes(client, want, &out.error);
  {
    grpc_core::ExecCtx exec_ctx;
    grpc_endpoint_destroy(client);
    grpc_endpoint_destroy(tcp.server);
    grpc_endpoint_destroy(rdma_server);
  }
  return out;
}

// One direction of a stream between two endpoints: writes of `write_size`
// bytes of a running byte pattern until `target` bytes went, while the
// other end reads and checks every byte. Unlike gRPC's suite, a read that
// fails is a failure here.
struct Flow {
  grpc_endpoint* from = nullptr;
  grpc_endpoint* to = nullptr;
  size_t target = 0, write_size = 0;
  // Each side's fields are touched by its own callbacks only (one at a
  // time); the test thread reads them once `done` and `writing` say so.
  size_t written = 0, read = 0;
  uint8_t next_write = 0, next_read = 0;
  bool read_failed = false, corrupt = false;
  std::atomic<bool> write_failed{false};
  std::atomic<bool> writing{false};  // a write of ours is in flight
  std::atomic<int> done{0};  // reads finished or failed (1); set last
  std::string error;
  grpc_slice_buffer out, in;
  grpc_closure on_write, on_read;
};

void FlowWrite(Flow* f);
void FlowRead(Flow* f);

void OnFlowWrite(void* arg, grpc_error_handle error) {
  auto* f = static_cast<Flow*>(arg);
  if (!error.ok()) {
    f->write_failed = true;
    f->writing = false;
    return;
  }
  if (f->written < f->target) {
    FlowWrite(f);
  } else {
    f->writing = false;
  }
}

void FlowWrite(Flow* f) {
  f->writing = true;
  size_t n = std::min(f->write_size, f->target - f->written);
  std::string bytes(n, '\0');
  for (size_t i = 0; i < n; ++i) bytes[i] = static_cast<char>(f->next_write++);
  f->written += n;
  grpc_slice_buffer_reset_and_unref(&f->out);
  grpc_slice_buffer_add(&f->out, grpc_slice_from_copied_buffer(bytes.data(), n));
  grpc_endpoint_write(f->from, &f->out, &f->on_write, nullptr, INT_MAX);
}

void OnFlowRead(void* arg, grpc_error_handle error) {
  auto* f = static_cast<Flow*>(arg);
  for (size_t i = 0; i < f->in.count; ++i) {
    const uint8_t* p = GRPC_SLICE_START_PTR(f->in.slices[i]);
    for (size_t j = 0; j < GRPC_SLICE_LENGTH(f->in.slices[i]); ++j) {
      if (p[j] != f->next_read++) f->corrupt = true;
    }
    f->read += GRPC_SLICE_LENGTH(f->in.slices[i]);
  }
  grpc_slice_buffer_reset_and_unref(&f->in);
  if (!error.ok()) {
    f->read_failed = true;
    f->error = grpc_core::StatusToString(error);
    f->done = 1;
  } else if (f->corrupt || f->read >= f->target) {
    f->done = 1;
  } else {
    FlowRead(f);
  }
}

void FlowRead(Flow* f) { grpc_endpoint_read(f->to, &f->in, &f->on_read, false, 1); }

// Both directions at once across a TCP-first pair that RDMA joins at a
// random moment while they run: every byte arrives, in order, and the
// pair moved with bytes on both sides of the switch.
bool StreamsAcrossTheMove() {
  bool ok = true;
  int moved_mid_stream = 0;
  for (int round = 0; round < 10; ++round) {
    SwitchPair p = CreateSwitchPair();
    g_switches.clear();
    grpc_endpoint_add_to_pollset(p.f.client_ep, g_pollset);
    grpc_endpoint_add_to_pollset(p.f.server_ep, g_pollset);
    Flow flows[2];
    flows[0].from = flows[1].to = p.f.client_ep;
    flows[0].to = flows[1].from = p.f.server_ep;
    flows[0].target = flows[1].target = size_t{20} << 20;
    flows[0].write_size = 65536;
    flows[1].write_size = 4096;
    for (Flow& f : flows) {
      grpc_slice_buffer_init(&f.out);
      grpc_slice_buffer_init(&f.in);
      GRPC_CLOSURE_INIT(&f.on_write, OnFlowWrite, &f, grpc_schedule_on_exec_ctx);
      GRPC_CLOSURE_INIT(&f.on_read, OnFlowRead, &f, grpc_schedule_on_exec_ctx);
    }
    // The RDMA pair is made first, so that the join lands when the delay says.
    int us = std::uniform_int_distribution<int>(500, 20000)(g_rng);
    std::thread joiner([client = p.client, server = p.server, us, pair = RdmaPair()] {
      std::this_thread::sleep_for(std::chrono::microseconds(us));
      AttachBoth(client, server, pair);
    });
    {
      grpc_core::ExecCtx exec_ctx;
      for (Flow& f : flows) {
        FlowWrite(&f);
        FlowRead(&f);
      }
    }
    gpr_timespec deadline = grpc_timeout_seconds_to_deadline(60);
    auto busy = [&] {
      return !(flows[0].done && flows[1].done) || flows[0].writing || flows[1].writing;
    };
    while (busy() && gpr_time_cmp(gpr_now(GPR_CLOCK_MONOTONIC), deadline) < 0) PollOnce();
    if (busy()) {
      // Something is stuck: the endpoints' shutdown ends what is pending,
      // and the callbacks that end it still find the flows.
      grpc_core::ExecCtx exec_ctx;
      grpc_endpoint_shutdown(p.f.client_ep, GRPC_ERROR_CREATE("the test gives up"));
      grpc_endpoint_shutdown(p.f.server_ep, GRPC_ERROR_CREATE("the test gives up"));
    }
    while (flows[0].writing || flows[1].writing || !flows[0].done || !flows[1].done) PollOnce();
    joiner.join();
    grpc_rdma::SwitchProgress c = grpc_rdma::ProgressOf(p.client);
    grpc_rdma::SwitchProgress s = grpc_rdma::ProgressOf(p.server);
    for (Flow& f : flows) {
      if (f.read_failed || f.write_failed || f.corrupt || f.read != f.target) {
        fprintf(stderr,
                "FAIL: round %d, a stream across the move: %zu of %zu bytes read%s%s%s%s %s\n",
                round, f.read, f.target, f.read == f.target ? "" : ", not all read in 60 s",
                f.read_failed ? ", read failed" : "", f.write_failed ? ", write failed" : "",
                f.corrupt ? ", bytes out of order" : "", f.error.c_str());
        ok = false;
      }
    }
    if (c.reads_rdma && s.reads_rdma && c.tcp_written > 0 && s.tcp_written > 0 &&
        c.tcp_written < flows[0].target && s.tcp_written < flows[1].target) {
      ++moved_mid_stream;
    }
    {
      grpc_core::ExecCtx exec_ctx;
      grpc_endpoint_destroy(p.f.client_ep);
      grpc_endpoint_destroy(p.f.server_ep);
    }
    for (Flow& f : flows) {
      grpc_slice_buffer_destroy(&f.out);
      grpc_slice_buffer_destroy(&f.in);
    }
  }
  printf("streams across the move: %d of 10 rounds moved both ways mid-stream\n",
         moved_mid_stream);
  if (moved_mid_stream < 3) {
    fprintf(stderr, "FAIL: only %d of 10 rounds moved in the middle of both streams\n",
            moved_mid_stream);
    ok = false;
  }
  return ok;
}

bool RogueCases() {
  bool ok = true;
  auto expect = [&](bool cond, const char* what, const Rogue& r) {
    if (!cond) {
      fprintf(stderr, "FAIL: %s (read %zu bytes, error: %s)\n", what, r.read.size(),
              r.error.c_str());
      ok = false;
    }
  };
  // A header that is not one, before this side's writes moved (a server
  // that took the RDMA connection for a transport of its own): the
  // connection stays on TCP.
  std::string garbage(16, 'x');
  Rogue r = AgainstRoguePeer("hello", &garbage, " again", 6);
  expect(r.read == "hello again" && r.error.empty(),
         "a garbage RDMA header before our writes moved leaves the connection on TCP", r);
  // The same once this side's writes moved (a server's, at the join): the
  // read fails, naming it.
  r = AgainstRoguePeer("hello", &garbage, "", 1, /*as_server=*/true);
  expect(r.read == "hello" && r.error.find("switch's header") != std::string::npos,
         "a garbage RDMA header after our writes moved fails the read", r);
  // The peer says its TCP stream ended before bytes it sent on TCP.
  std::string early = Header(grpc_rdma::kSwitchMagic, 2) + "more";
  r = AgainstRoguePeer("hello", &early, "", 1);
  expect(r.read == "hello" && r.error.find("ends at 2") != std::string::npos,
         "a header that says TCP ended before its bytes fails the read", r);
  // A valid switch: TCP's bytes, then RDMA's, in order.
  std::string good = Header(grpc_rdma::kSwitchMagic, 5) + " world";
  r = AgainstRoguePeer("hello", &good, "", 6);
  expect(r.read == "hello world" && r.error.empty(), "a valid switch reads both in order", r);
  // The RDMA connection ends before any header: the reads stay on TCP.
  r = AgainstRoguePeer("hello", nullptr, " again", 6);
  expect(r.read == "hello again" && r.error.empty(),
         "an RDMA connection that ends before its header leaves the reads on TCP", r);
  // The same once our writes moved (the server's): what they wrote may be
  // lost with it, so the connection fails.
  r = AgainstRoguePeer("hello", nullptr, "", 1, /*as_server=*/true);
  expect(r.read == "hello" && r.error.find("ended before the peer's header") != std::string::npos,
         "an RDMA connection that ends after our writes moved fails the read", r);
  return ok;
}

void CleanUp() {}

void OnRead(void* arg, grpc_error_handle error) {
  *static_cast<int*>(arg) = error.ok() ? 1 : 2;
}

// gRPC 1.51 can keep an endpoint it shut down and never destroy it (a
// subchannel shut down while its connection waited for SETTINGS): the
// endpoint lets its connection go at shutdown, so the engine frees the
// QP and pinned buffers then, and later reads fail at once.
bool ShutdownLetsTheConnectionGo() {
  grpc_endpoint_test_fixture f = CreateFixture(0);
  std::weak_ptr<grpc_rdma::Connection> client = g_last_client;
  {
    grpc_core::ExecCtx exec_ctx;
    grpc_endpoint_shutdown(f.client_ep, GRPC_ERROR_CREATE("shut down by the test"));
  }
  gpr_timespec deadline = grpc_timeout_seconds_to_deadline(10);
  while (!client.expired() && gpr_time_cmp(gpr_now(GPR_CLOCK_MONOTONIC), deadline) < 0)
    gpr_sleep_until(gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(10, GPR_TIMESPAN)));
  bool ok = true;
  if (!client.expired()) {
    fprintf(stderr, "FAIL: 10 s after grpc_endpoint_shutdown the RDMA connection is still held\n");
    ok = false;
  }
  int read = 0;
  grpc_slice_buffer sb;
  grpc_slice_buffer_init(&sb);
  grpc_closure done;
  GRPC_CLOSURE_INIT(&done, OnRead, &read, grpc_schedule_on_exec_ctx);
  {
    grpc_core::ExecCtx exec_ctx;
    grpc_endpoint_read(f.client_ep, &sb, &done, true, 1);
  }
  if (read != 2) {
    fprintf(stderr, "FAIL: a read after shutdown %s\n", read == 0 ? "did not complete at once" : "succeeded");
    ok = false;
  }
  grpc_slice_buffer_destroy(&sb);
  {
    grpc_core::ExecCtx exec_ctx;
    grpc_endpoint_destroy(f.client_ep);
    grpc_endpoint_destroy(f.server_ep);
  }
  return ok;
}

void DestroyPollset(void* p, grpc_error_handle /*error*/) {
  grpc_pollset_destroy(static_cast<grpc_pollset*>(p));
}

}  // namespace

int main() {
  grpc_init();
  bool failed = false;
  {
    auto engine = grpc_rdma::Engine::Create(grpc_rdma::Options());
    if (!engine.ok()) {
      fprintf(stderr, "no RDMA engine: %s\n", std::string(engine.status().message()).c_str());
      return 1;
    }
    g_engine = std::move(*engine);
    sockaddr_in any{};
    any.sin_family = AF_INET;
    inet_pton(AF_INET, "127.0.0.1", &any.sin_addr);
    auto port = g_engine->Listen(any, [](std::shared_ptr<grpc_rdma::Connection> c) {
      std::lock_guard<std::mutex> g(g_accept_mu);
      g_accepted = std::move(c);
      g_accept_cv.notify_all();
    });
    GPR_ASSERT(port.ok());
    g_port = *port;

    grpc_core::ExecCtx exec_ctx;
    g_pollset = static_cast<grpc_pollset*>(gpr_zalloc(grpc_pollset_size()));
    grpc_pollset_init(g_pollset, &g_mu);
    grpc_endpoint_test_config config = {"rdma", CreateFixture, CleanUp};
    grpc_endpoint_tests(config, g_pollset, g_mu);
    if (!ShutdownLetsTheConnectionGo()) failed = true;
    for (Join j : {Join::kAtOnce, Join::kMidStream, Join::kNever}) {
      g_join = j;
      const char* name = j == Join::kAtOnce      ? "tcp-first, joined at once"
                         : j == Join::kMidStream ? "tcp-first, joined mid-stream"
                                                 : "tcp-first, never joined";
      grpc_endpoint_test_config sc = {name, CreateSwitchFixture, CleanUp};
      grpc_endpoint_tests(sc, g_pollset, g_mu);
      for (std::thread& t : g_joiners) t.join();
      g_joiners.clear();
      if (!CheckMoves(j, name)) failed = true;
      printf("gRPC endpoint_tests over %s: passed\n", name);
    }
    if (!StreamsAcrossTheMove()) failed = true;
    if (!RogueCases()) failed = true;
    grpc_closure destroyed;
    GRPC_CLOSURE_INIT(&destroyed, DestroyPollset, g_pollset, grpc_schedule_on_exec_ctx);
    grpc_pollset_shutdown(g_pollset, &destroyed);
  }
  g_engine.reset();
  gpr_free(g_pollset);
  grpc_shutdown();
  if (failed) {
    printf("gRPC endpoint_tests passed; shutdown without destroy or a TCP-first rogue case "
           "failed\n");
    return 1;
  }
  printf("gRPC endpoint_tests over RDMA and TCP-first (3 ways), shutdown without destroy, "
         "TCP-first rogue cases: all passed\n");
  return 0;
}
