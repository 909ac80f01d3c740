// A server that joins TCP connections (grpc.rdma.tcp_first) holds an RDMA
// connection that names a TCP connection it has not accepted for
// kJoinWait (5 s, src/glue/server.cc), and closes it then: a timer does,
// with no later connection to sweep it. The client here is an engine of
// its own (not the plugin's), so it can name a TCP connection that never
// comes.
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <memory>

#include "echo_service.h"
#include "engine/engine.h"
#include "engine/testing.h"
#include "grpc_rdma/options.h"

namespace {

using SteadyClock = std::chrono::steady_clock;

TEST(Join, AnRdmaConnectionNoTcpConnectionMeetsIsClosedAfterItsWait) {
  grpc_rdma_test::EchoService service;
  int port = 0;
  grpc::ServerBuilder b;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  b.RegisterService(&service);
  b.AddChannelArgument("grpc.rdma.tcp_first", 1);
  std::unique_ptr<grpc::Server> server = b.BuildAndStart();
  ASSERT_NE(server, nullptr);

  grpc_rdma::Options options;
  auto engine = grpc_rdma::Engine::Create(options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  // Names the TCP connection from 127.0.0.1:1, which never comes.
  sockaddr_in joins = grpc_rdma::testing::Loopback(1);
  std::promise<absl::StatusOr<std::shared_ptr<grpc_rdma::Connection>>> connected;
  (*engine)->Connect(
      grpc_rdma::testing::Loopback(static_cast<uint16_t>(port)), 5000,
      [&](absl::StatusOr<std::shared_ptr<grpc_rdma::Connection>> r) {
        connected.set_value(std::move(r));
      },
      &joins);
  absl::StatusOr<std::shared_ptr<grpc_rdma::Connection>> conn = connected.get_future().get();
  ASSERT_TRUE(conn.ok()) << "the server did not accept the RDMA connection: " << conn.status();
  SteadyClock::time_point accepted = SteadyClock::now();

  // Nothing comes on it (the server writes its header only once it joined),
  // until it is closed.
  auto ended = std::make_shared<std::promise<absl::Status>>();
  (*conn)->Read([ended](absl::StatusOr<grpc_rdma::RecvChunks> r) {
    ended->set_value(r.ok() ? absl::InternalError("bytes came on an unjoined connection")
                            : r.status());
  });
  std::future<absl::Status> f = ended->get_future();
  ASSERT_EQ(f.wait_for(std::chrono::seconds(30)), std::future_status::ready)
      << "the server held the unjoined RDMA connection for over 30 s";
  absl::Status why = f.get();
  auto held = std::chrono::duration_cast<std::chrono::milliseconds>(SteadyClock::now() - accepted);
  EXPECT_FALSE(why.ok());
  EXPECT_NE(why.code(), absl::StatusCode::kInternal) << why;
  EXPECT_GE(held.count(), 3000) << "closed before its wait was over: " << why;
  (*conn)->Shutdown(absl::CancelledError("test over"));
  server->Shutdown();
}

}  // namespace
