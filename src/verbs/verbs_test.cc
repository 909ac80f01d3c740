// src/verbs over softverbs (the test runs with softverbs first on the
// library path and SOFTVERBS_DEVICES=mlx5_0:127.0.0.1,mlx5_1:<lo alias>).
#include "verbs/verbs.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <poll.h>

#include <chrono>
#include <future>
#include <thread>

#include <cerrno>
#include <string>
#include <vector>

#include "verbs/log.h"
#include "verbs/status.h"

namespace grpc_rdma {
namespace {

struct Logged {
  LogSeverity severity;
  std::string file, message;
  int line;
};
std::vector<Logged>* g_logged = nullptr;

TEST(Log, MessagesGoToTheSinkWithWhereTheyCameFrom) {
  std::vector<Logged> got;
  g_logged = &got;
  SetLogSink([](LogSeverity s, const char* file, int line, const char* message) {
    g_logged->push_back({s, file, message, line});
  });
  int line = __LINE__ + 1;
  GRPC_RDMA_LOG_ERROR("connection %s: %d", "10.0.0.1:5", 42);
  std::string big(3000, 'x');
  GRPC_RDMA_LOG_ERROR("%s", big.c_str());
  SetLogSink(nullptr);
  testing::internal::CaptureStderr();
  GRPC_RDMA_LOG_ERROR("to stderr %d", 7);
  std::string err = testing::internal::GetCapturedStderr();
  g_logged = nullptr;
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].severity, LogSeverity::kError);
  EXPECT_EQ(got[0].message, "connection 10.0.0.1:5: 42");
  EXPECT_NE(got[0].file.find("verbs_test.cc"), std::string::npos) << got[0].file;
  EXPECT_EQ(got[0].line, line);
  EXPECT_EQ(got[1].message, std::string(1023, 'x')) << "long messages are cut, not dropped";
  EXPECT_EQ(err, "grpc_rdma: to stderr 7\n") << "without a sink: stderr, prefixed";
}

TEST(Status, NamesTheCallAndTheObjectForEitherSign) {
  absl::Status a = ErrnoStatus(EINVAL, "ibv_modify_qp(RTR)", QpName(0x1a2));
  EXPECT_EQ(a.message(), "ibv_modify_qp(RTR) qpn=0x1a2: Invalid argument");
  EXPECT_EQ(a.code(), absl::StatusCode::kInvalidArgument);
  absl::Status b = CheckRet(-ENOMEM, "ibv_post_send", QpName(7));
  EXPECT_EQ(b.message(), "ibv_post_send qpn=0x7: Cannot allocate memory");
  EXPECT_EQ(b.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(CheckRet(0, "x").ok());
  errno = 0;
  EXPECT_EQ(CheckErrno(true, "ibv_reg_mr").message(), "ibv_reg_mr: Input/output error")
      << "a provider that forgets errno still yields an error";
  errno = ECONNREFUSED;
  EXPECT_EQ(CheckErrno(true, "rdma_connect").code(), absl::StatusCode::kUnavailable);
}

absl::Status Fails() { return absl::InternalError("boom"); }
absl::StatusOr<int> Seven() { return 7; }
absl::StatusOr<int> NoInt() { return absl::NotFoundError("none"); }

absl::Status UseMacros(int* out, bool fail_first, bool fail_second) {
  if (fail_first) RETURN_IF_ERROR(Fails());
  ASSIGN_OR_RETURN(int v, fail_second ? NoInt() : Seven());
  *out = v;
  return absl::OkStatus();
}

TEST(Status, Macros) {
  int v = 0;
  EXPECT_EQ(UseMacros(&v, true, false).message(), "boom");
  EXPECT_EQ(UseMacros(&v, false, true).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(UseMacros(&v, false, false).ok());
  EXPECT_EQ(v, 7);
}

TEST(Device, NamedDefaultExplicitAndAbsent) {
  Options o;  // mlx5_0, not explicit
  auto d = ChooseDevice(o);
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_TRUE(d->has_value());
  EXPECT_EQ(**d, "mlx5_0");

  o.device = "mlx5_9";
  o.device_explicit = true;
  d = ChooseDevice(o);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(d.status().message().find("TF_RDMA_DEV_NAME=mlx5_9: no such RDMA device"),
            std::string::npos);
  EXPECT_NE(d.status().message().find("mlx5_0"), std::string::npos) << "lists what exists";

  o.device_explicit = false;  // the default name absent: let RDMA CM choose
  d = ChooseDevice(o);
  ASSERT_TRUE(d.ok());
  EXPECT_FALSE(d->has_value());
}

TEST(Owners, CreateInOrderReleaseInReverse) {
  auto ch = CreateEventChannel();
  ASSERT_TRUE(ch.ok()) << ch.status();
  auto id = CreateCmId(ch->get(), nullptr);
  ASSERT_TRUE(id.ok()) << id.status();
  sockaddr_in dst{};
  dst.sin_family = AF_INET;
  dst.sin_port = htons(40999);
  inet_pton(AF_INET, "127.0.0.1", &dst.sin_addr);
  ASSERT_EQ(rdma_resolve_addr(id->get(), nullptr, reinterpret_cast<sockaddr*>(&dst), 1000), 0);
  rdma_cm_event* e = nullptr;
  ASSERT_EQ(rdma_get_cm_event(ch->get(), &e), 0);
  EXPECT_EQ(e->event, RDMA_CM_EVENT_ADDR_RESOLVED);
  rdma_ack_cm_event(e);
  ibv_context* ctx = (*id)->verbs;
  ASSERT_NE(ctx, nullptr);
  {
    auto pd = AllocPd(ctx);
    ASSERT_TRUE(pd.ok()) << pd.status();
    auto cch = CreateCompChannel(ctx);
    ASSERT_TRUE(cch.ok()) << cch.status();
    auto cq = CreateCq(ctx, 64, nullptr, cch->get());
    ASSERT_TRUE(cq.ok()) << cq.status();
    std::vector<char> buf(4096);
    auto mr = RegMr(pd->get(), buf.data(), buf.size(), IBV_ACCESS_LOCAL_WRITE);
    ASSERT_TRUE(mr.ok()) << mr.status();
    ibv_qp_init_attr a{};
    a.send_cq = a.recv_cq = cq->get();
    a.cap.max_send_wr = a.cap.max_recv_wr = 8;
    a.cap.max_send_sge = a.cap.max_recv_sge = 1;
    auto qp = CreateQp(id->get(), pd->get(), a);
    ASSERT_TRUE(qp.ok()) << qp.status();
    EXPECT_NE((*qp)->qp_num, 0u);
    Qp moved = std::move(*qp);
    EXPECT_FALSE(*qp);
    EXPECT_TRUE(moved);
    // Scope end: QP, MR, CQ, channel, PD, in that order.
  }
  ibv_pd* raw = nullptr;
  {
    auto pd = AllocPd(ctx);
    ASSERT_TRUE(pd.ok());
    raw = pd->get();
    Pd again = std::move(*pd);
    EXPECT_EQ(again.get(), raw);
  }
}

// The engine's channel: polled readable, its one event then taken back by
// rdma_destroy_id of the event's id (as the engine's other event thread
// destroys a dropped connection's id), a read must say EAGAIN, not wait for
// the next event with the engine's lock held.
TEST(Owners, ANonBlockingChannelDoesNotWaitWhenItsEventIsTakenBack) {
  auto ch = CreateEventChannel(/*nonblocking=*/true);
  ASSERT_TRUE(ch.ok()) << ch.status();
  auto id = CreateCmId(ch->get(), nullptr);
  ASSERT_TRUE(id.ok()) << id.status();
  sockaddr_in dst{};
  dst.sin_family = AF_INET;
  dst.sin_port = htons(40998);
  inet_pton(AF_INET, "127.0.0.1", &dst.sin_addr);
  ASSERT_EQ(rdma_resolve_addr(id->get(), nullptr, reinterpret_cast<sockaddr*>(&dst), 1000), 0);
  pollfd p{(*ch)->fd, POLLIN, 0};
  ASSERT_EQ(poll(&p, 1, 10000), 1) << "ADDR_RESOLVED never came";
  id->reset();  // rdma_destroy_id: its queued event goes with it
  std::promise<std::pair<int, int>> done;
  auto got = done.get_future();
  std::thread reader([&] {
    rdma_cm_event* e = nullptr;
    int r = rdma_get_cm_event(ch->get(), &e);
    int err = errno;
    if (r == 0) rdma_ack_cm_event(e);
    done.set_value({r, err});
  });
  const bool returned = got.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  if (!returned) {
    // Blocked: an event of a new id lets the reader go, and the test fails.
    auto other = CreateCmId(ch->get(), nullptr);
    const bool pushed =
        other.ok() &&
        rdma_resolve_addr(other->get(), nullptr, reinterpret_cast<sockaddr*>(&dst), 1000) == 0;
    if (pushed) reader.join();
    else reader.detach();  // nothing can let it go: leave it blocked
    FAIL() << "rdma_get_cm_event waited for the next event";
  }
  reader.join();
  auto [r, err] = got.get();
  EXPECT_EQ(r, -1);
  EXPECT_EQ(err, EAGAIN) << strerror(err);
}

TEST(Owners, ErrorsNameTheCall) {
  auto ch = CreateEventChannel();
  ASSERT_TRUE(ch.ok());
  auto id = CreateCmId(ch->get(), nullptr);
  ASSERT_TRUE(id.ok());
  ibv_qp_init_attr a{};
  auto qp = CreateQp(id->get(), nullptr, a);  // no device bound yet
  ASSERT_FALSE(qp.ok());
  EXPECT_NE(qp.status().message().find("rdma_create_qp"), std::string::npos) << qp.status();
}

}  // namespace
}  // namespace grpc_rdma
