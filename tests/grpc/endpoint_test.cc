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
  f.client_ep = grpc_rdma::CreateRdmaEndpoint(std::move(*client), false);
  f.server_ep = grpc_rdma::CreateRdmaEndpoint(std::move(server), true);
  return f;
}

void CleanUp() {}

void DestroyPollset(void* p, grpc_error_handle /*error*/) {
  grpc_pollset_destroy(static_cast<grpc_pollset*>(p));
}

}  // namespace

int main() {
  grpc_init();
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
    grpc_closure destroyed;
    GRPC_CLOSURE_INIT(&destroyed, DestroyPollset, g_pollset, grpc_schedule_on_exec_ctx);
    grpc_pollset_shutdown(g_pollset, &destroyed);
  }
  g_engine.reset();
  gpr_free(g_pollset);
  grpc_shutdown();
  printf("gRPC endpoint_tests over RDMA: 1 passed, 0 failed\n");
  return 0;
}
