// The public API of libgrpc_rdma.so (include/grpc_rdma/), linked as an
// application would link it; its RPCs run over softverbs. Run twice by CTest: as linked (the static
// initializer installs from the environment) and with
// GRPC_RDMA_NO_AUTO_INSTALL=1 (the application installs).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "echo_service.h"
#include "grpc_rdma/grpc_rdma.h"
#include "grpc_rdma/version.h"

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
  s.rdma_unavailable = "no \"device\"\n";
  std::string j = grpc_rdma::StatsJson(s);
  EXPECT_EQ(j.front(), '{');
  EXPECT_EQ(j.back(), '}');
  EXPECT_EQ(j.find('\n'), std::string::npos) << "one line: " << j;
  EXPECT_NE(j.find("\"rdma_unavailable\":\"no \\\"device\\\"\\n\""), std::string::npos) << j;
  EXPECT_NE(j.find("\"version\":\"" GRPC_RDMA_VERSION_STRING "\""), std::string::npos) << j;
  EXPECT_NE(j.find("\"grpc_version\":\"" GRPC_RDMA_GRPC_VERSION_STRING "\""), std::string::npos)
      << j;
  char* c = grpc_rdma_stats_json();
  ASSERT_NE(c, nullptr);
  EXPECT_NE(strstr(c, "\"fallbacks\":"), nullptr);
  EXPECT_NE(strstr(c, "\"version\":\"" GRPC_RDMA_VERSION_STRING "\""), nullptr);
  free(c);
}

// Every counter of the table reaches the JSON with its own value, at the
// top level and per device.
TEST(ApiTest, EveryCounterIsInTheJson) {
  grpc_rdma::Stats s;
  uint64_t v = 1000;
#define SET_(name, what) s.name = ++v;
  GRPC_RDMA_STREAM_COUNTERS(SET_)
  GRPC_RDMA_PROCESS_COUNTERS(SET_)
  grpc_rdma::DeviceStats d;
  d.name = "mlx5_7";
#define SET_DEVICE_(name, what) d.name = ++v;
  GRPC_RDMA_STREAM_COUNTERS(SET_DEVICE_)
  GRPC_RDMA_DEVICE_COUNTERS(SET_DEVICE_)
  s.devices.push_back(d);
  std::string j = grpc_rdma::StatsJson(s);
  std::string top = j.substr(0, j.find("\"devices\":")) + j.substr(j.find("}}") + 2);
  std::string dev = j.substr(j.find("\"mlx5_7\":{"));
  dev = dev.substr(0, dev.find('}'));
  v = 1000;
#define CHECK_(name, what) \
  EXPECT_NE(top.find("\"" #name "\":" + std::to_string(++v)), std::string::npos) << #name << j;
  GRPC_RDMA_STREAM_COUNTERS(CHECK_)
  GRPC_RDMA_PROCESS_COUNTERS(CHECK_)
#define CHECK_DEVICE_(name, what) \
  EXPECT_NE(dev.find("\"" #name "\":" + std::to_string(++v)), std::string::npos) << #name << j;
  GRPC_RDMA_STREAM_COUNTERS(CHECK_DEVICE_)
  GRPC_RDMA_DEVICE_COUNTERS(CHECK_DEVICE_)
}

// docs/usage.md describes every counter (it is where users look them up).
TEST(ApiTest, EveryCounterIsDocumented) {
  FILE* f = fopen(GRPC_RDMA_SOURCE_DIR "/docs/usage.md", "r");
  ASSERT_NE(f, nullptr) << GRPC_RDMA_SOURCE_DIR "/docs/usage.md";
  std::string docs;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof(buf), f)) > 0;) docs.append(buf, n);
  fclose(f);
#define DOCUMENTED_(name, what) \
  EXPECT_NE(docs.find("| `" #name "` |"), std::string::npos) << #name " is not in docs/usage.md";
  GRPC_RDMA_STREAM_COUNTERS(DOCUMENTED_)
  GRPC_RDMA_PROCESS_COUNTERS(DOCUMENTED_)
  GRPC_RDMA_DEVICE_COUNTERS(DOCUMENTED_)
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
  // One call, checked to ride RDMA: the channel waits for RDMA CM instead
  // of starting on TCP (the default, whose first calls ride TCP).
  grpc::ChannelArguments args = grpc_rdma_test::BigMessageArgs();
  args.SetInt(GRPC_RDMA_ARG_TCP_FIRST, 0);
  auto stub = grpc_rdma::test::Echo::NewStub(grpc::CreateCustomChannel(
      "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials(), args));
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
  // Both ends are in this process, on softverbs' mlx5_0.
  ASSERT_EQ(after.devices.size(), 1u);
  EXPECT_EQ(after.devices[0].name, "mlx5_0");
  EXPECT_GE(after.devices[0].connections, 2u);
  EXPECT_GE(after.devices[0].connections_open, 2u);
  EXPECT_EQ(after.devices[0].bytes_sent, after.bytes_sent) << "the only device has it all";
  EXPECT_EQ(after.connection_errors, 0u);
  server->Shutdown();
}

}  // namespace
