// gRPC's own endpoint test suite (test/core/iomgr/endpoint_tests.cc from the
// source package of the installed gRPC, compiled unchanged) run against a
// pair of RDMA endpoints over softverbs: the contract chttp2 relies on,
// checked by the tests gRPC checks its TCP endpoint with.
#include <arpa/inet.h>
#include <grpc/grpc.h>
#include <grpc/support/alloc.h>
#include <grpc/support/log.h>
#include <grpc/support/time.h>

#include <condition_variable>
#include <cstdio>
#include <memory>
#include <mutex>

#include "engine/engine.h"
#include "glue/endpoint.h"
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

grpc_endpoint_test_fixture CreateFixture(size_t /*slice_size*/) {
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
  grpc_endpoint_test_fixture f;
  g_last_client = *client;
  f.client_ep = grpc_rdma::CreateRdmaEndpoint(std::move(*client), false);
  f.server_ep = grpc_rdma::CreateRdmaEndpoint(std::move(server), true);
  return f;
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
    grpc_closure destroyed;
    GRPC_CLOSURE_INIT(&destroyed, DestroyPollset, g_pollset, grpc_schedule_on_exec_ctx);
    grpc_pollset_shutdown(g_pollset, &destroyed);
  }
  g_engine.reset();
  gpr_free(g_pollset);
  grpc_shutdown();
  if (failed) {
    printf("gRPC endpoint_tests over RDMA passed; shutdown without destroy failed\n");
    return 1;
  }
  printf("gRPC endpoint_tests over RDMA and shutdown without destroy: 2 passed, 0 failed\n");
  return 0;
}
