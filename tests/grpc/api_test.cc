// The public API of libgrpc_rdma.so (include/grpc_rdma/), linked as an
// application would link it; its RPCs run over softverbs. Run twice by CTest: as linked (the static
// initializer installs from the environment) and with
// GRPC_RDMA_NO_AUTO_INSTALL=1 (the application installs).
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

#include "echo_service.h"
#include "grpc_rdma/grpc_rdma.h"

namespace {

bool AutoInstall() {
  const char* no = getenv("GRPC_RDMA_NO_AUTO_INSTALL");
  return no == nullptr || strcmp(no, "1") != 0;
}

TEST(ApiTest, BadOptionsAreRefusedAndNamed) {
  grpc_rdma::Options o;
  o.chunk_size = 64 << 10;
  o.acc_size = 128 << 10;  // above chunk_size
  absl::Status s = grpc_rdma::Install(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("TF_RDMA_ACC_SIZE"), absl::string_view::npos) << s.message();
  EXPECT_EQ(grpc_rdma::Installed(), AutoInstall());
}

TEST(ApiTest, InstallIsIdempotent) {
  EXPECT_EQ(grpc_rdma::Installed(), AutoInstall());
  grpc_rdma::Options o;  // the defaults: what the environment gives here
  EXPECT_TRUE(grpc_rdma::Install(o).ok());
  EXPECT_TRUE(grpc_rdma::Installed());
  EXPECT_TRUE(grpc_rdma::Install(o).ok());
  grpc_rdma::Options other = o;
  other.chunk_size = 1 << 20;
  absl::Status s = grpc_rdma::Install(other);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
}

TEST(ApiTest, DisabledChangesNothing) {
  grpc_rdma::Options o;
  o.enabled = false;
  bool before = grpc_rdma::Installed();
  EXPECT_TRUE(grpc_rdma::Install(o).ok());
  EXPECT_EQ(grpc_rdma::Installed(), before);
}

TEST(ApiTest, StatsAsJson) {
  grpc_rdma::Stats s = grpc_rdma::GetStats();
  s.rdma_unavailable = "no \"device\"";
  std::string j = grpc_rdma::StatsJson(s);
  EXPECT_EQ(j.front(), '{');
  EXPECT_EQ(j.back(), '}');
  EXPECT_NE(j.find("\"rdma_client_connections\":0"), std::string::npos) << j;
  EXPECT_NE(j.find("\"rdma_unavailable\":\"no \\\"device\\\"\""), std::string::npos) << j;
  char* c = grpc_rdma_stats_json();
  ASSERT_NE(c, nullptr);
  EXPECT_NE(strstr(c, "\"fallbacks\":"), nullptr);
  free(c);
}

}  // namespace

namespace {

// Installed by the application (or by the static initializer): a gRPC
// server and client in this process then talk over RDMA (softverbs).
TEST(ApiTest, InstalledCarriesRpcsOverRdma) {
  ASSERT_TRUE(grpc_rdma::Install(grpc_rdma::Options()).ok());
  grpc_rdma_test::EchoService service;
  int port = 0;
  auto server = grpc_rdma_test::StartEchoServer("127.0.0.1:0", &port, &service);
  ASSERT_NE(server, nullptr);
  grpc_rdma::Stats before = grpc_rdma::GetStats();
  auto stub = grpc_rdma::test::Echo::NewStub(grpc::CreateCustomChannel(
      "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials(),
      grpc_rdma_test::BigMessageArgs()));
  grpc_rdma::test::Blob req, resp;
  req.set_data(grpc_rdma_test::Pattern(1 << 20, 5));
  grpc::ClientContext ctx;
  ASSERT_TRUE(stub->Unary(&ctx, req, &resp).ok());
  EXPECT_TRUE(resp.data() == req.data());
  grpc_rdma::Stats after = grpc_rdma::GetStats();
  EXPECT_EQ(after.rdma_client_connections, before.rdma_client_connections + 1);
  EXPECT_EQ(after.tcp_client_connections, before.tcp_client_connections);
  EXPECT_GE(after.bytes_sent - before.bytes_sent, 1u << 20);
  EXPECT_EQ(after.rdma_unavailable, "");
  server->Shutdown();
}

}  // namespace
