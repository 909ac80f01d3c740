// softverbs' fault knobs, counters and configuration errors. Each case runs
// in a child process (this binary with --scenario), because softverbs reads
// its environment once per process.
#include <gtest/gtest.h>
#include <linux/capability.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "sv_test_util.h"

using namespace svtest;

namespace {

struct Pair {
  ibv_context* ctx = nullptr;
  Side a, b;
  Buffer src, dst;
  bool Open(const QpOptions& o = QpOptions{}) {
    ctx = OpenDevice();
    if (ctx == nullptr) return false;
    a = MakeSide(ctx, o);
    b = MakeSide(ctx, o);
    if (!ConnectPair(ctx, a, b, o, o)) return false;
    src = MakeBuffer(a.pd, 1 << 20, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ |
                                         IBV_ACCESS_REMOTE_WRITE);
    dst = MakeBuffer(b.pd, 1 << 20, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ |
                                         IBV_ACCESS_REMOTE_WRITE);
    return src.mr && dst.mr;
  }
  ~Pair() {
    for (Side* s : {&a, &b}) {
      if (s->qp) ibv_destroy_qp(s->qp);
      s->qp = nullptr;
    }
    FreeBuffer(src);
    FreeBuffer(dst);
    DestroySide(a);
    DestroySide(b);
    if (ctx) ibv_close_device(ctx);
  }
};

int Fail(const char* what) {
  printf("scenario failed: %s\n", what);
  return 1;
}

}  // namespace

// SOFTVERBS_FAIL_WR=3 SOFTVERBS_FAIL_STATUS=REM_OP_ERR
int ScenarioFailWr() {
  Pair p;
  if (!p.Open()) return Fail("open");
  for (int i = 0; i < 5; ++i) PostRecv(p.b.qp, p.dst, 0, 64, i);
  for (int i = 0; i < 5; ++i) PostSend(p.a.qp, IBV_WR_SEND, p.src, 0, 8, i);
  auto tx = PollN(p.a.cq, 5);
  if (tx.size() != 5) return Fail("5 completions");
  if (tx[0].status || tx[1].status) return Fail("first two succeed");
  if (tx[2].status != IBV_WC_REM_OP_ERR) return Fail("third fails as configured");
  if (tx[3].status != IBV_WC_WR_FLUSH_ERR || tx[4].status != IBV_WC_WR_FLUSH_ERR)
    return Fail("rest flushed");
  if (QpState(p.a.qp) != IBV_QPS_ERR) return Fail("QP in error");
  printf("ok\n");
  return 0;
}

// SOFTVERBS_DROP_AFTER_OPS=3
int ScenarioDrop() {
  Pair p;
  if (!p.Open()) return Fail("open");
  for (int i = 0; i < 8; ++i) PostRecv(p.b.qp, p.dst, 0, 64, i);
  for (int i = 0; i < 5; ++i) PostSend(p.a.qp, IBV_WR_SEND, p.src, 0, 8, i);
  auto tx = PollN(p.a.cq, 5);
  if (tx.size() != 5) return Fail("5 completions");
  int ok = 0, bad = 0;
  for (auto& wc : tx) (wc.status == IBV_WC_SUCCESS ? ok : bad)++;
  if (bad == 0) return Fail("some WRs fail once the wire is cut");
  if (tx[4].status != IBV_WC_WR_FLUSH_ERR) return Fail("last flushed");
  // The peer had nothing to send: it finds out on its next send.
  auto rx = PollN(p.b.cq, 8, 200);
  for (auto& wc : rx)
    if (wc.status != IBV_WC_SUCCESS) return Fail("an idle peer's receives stay posted");
  if (QpState(p.b.qp) != IBV_QPS_RTS) return Fail("an idle peer stays in RTS");
  PostSend(p.b.qp, IBV_WR_SEND, p.dst, 0, 8, 99);
  auto bx = PollN(p.b.cq, 1);
  if (bx.empty() || bx[0].wr_id != 99 || bx[0].status != IBV_WC_RETRY_EXC_ERR)
    return Fail("the peer's next send fails with retry exceeded");
  if (QpState(p.b.qp) != IBV_QPS_ERR) return Fail("then the peer is in error");
  printf("ok %d delivered, %d failed\n", ok, bad);
  return 0;
}

// SOFTVERBS_DELAY_US=40000
int ScenarioDelay() {
  Pair p;
  if (!p.Open()) return Fail("open");
  PostRecv(p.b.qp, p.dst, 0, 64, 1);
  auto t0 = std::chrono::steady_clock::now();
  PostSend(p.a.qp, IBV_WR_SEND, p.src, 0, 8, 1);
  if (PollN(p.a.cq, 1).size() != 1) return Fail("completion");
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                std::chrono::steady_clock::now() - t0).count();
  if (ms < 40) return Fail("completion came before the configured delay");
  printf("ok %lld ms\n", static_cast<long long>(ms));
  return 0;
}

// SOFTVERBS_MAX_QP_WR=4 SOFTVERBS_MAX_CQE=16
int ScenarioSmallQueues() {
  ibv_context* ctx = OpenDevice();
  if (ctx == nullptr) return Fail("open");
  ibv_device_attr d{};
  ibv_query_device(ctx, &d);
  if (d.max_qp_wr != 4 || d.max_cqe != 16) return Fail("device reports the limits");
  if (ibv_create_cq(ctx, 17, nullptr, nullptr, 0) != nullptr) return Fail("cq above max_cqe");
  QpOptions big;
  big.max_send_wr = 8;
  Side s = MakeSide(ctx, big);
  bool refused = s.qp == nullptr;
  DestroySide(s);
  ibv_close_device(ctx);
  if (!refused) return Fail("qp above max_qp_wr");
  QpOptions o;
  o.max_send_wr = 4;
  o.max_recv_wr = 4;
  Pair p;
  if (!p.Open(o)) return Fail("pair with 4-deep queues");
  int err = 0, n = 0;
  while (err == 0 && n < 10) {
    err = PostSend(p.a.qp, IBV_WR_SEND, p.src, 0, 8, n);
    if (err == 0) ++n;
  }
  if (n != 4 || err != ENOMEM) return Fail("fifth send is ENOMEM");
  printf("ok\n");
  return 0;
}

// SOFTVERBS_STATS=<file>
int ScenarioStats() {
  Pair p;
  if (!p.Open()) return Fail("open");
  PostRecv(p.b.qp, p.dst, 0, 64, 1);
  PostSend(p.a.qp, IBV_WR_SEND, p.src, 0, 10, 1);
  PostSend(p.a.qp, IBV_WR_RDMA_WRITE, p.src, 0, 1000, 2, IBV_SEND_SIGNALED, p.dst.addr(),
           p.dst.mr->rkey);
  PostSend(p.a.qp, IBV_WR_RDMA_READ, p.src, 0, 500, 3, IBV_SEND_SIGNALED, p.dst.addr(),
           p.dst.mr->rkey);
  if (PollN(p.a.cq, 3).size() != 3) return Fail("3 completions");
  printf("ok\n");
  return 0;  // counters are written at exit
}

// SOFTVERBS_STATS=<file>: rounds of arm, message, event on one wire, the
// receiver asleep on its completion channel when the message comes (the
// sender waits 2 ms after the arm). Prints "events=N".
int ScenarioArmEvents() {
  QpOptions o;
  o.channel = true;
  Pair p;
  if (!p.Open(o)) return Fail("open");
  constexpr int kRounds = 200;
  int events = 0;
  for (int i = 0; i < kRounds; ++i) {
    if (PostRecv(p.b.qp, p.dst, 0, 64, i) != 0) return Fail("post recv");
    if (ibv_req_notify_cq(p.b.cq, 0) != 0) return Fail("arm");
    std::thread sender([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      PostSend(p.a.qp, IBV_WR_SEND, p.src, 0, 8, i);
    });
    pollfd pfd{p.b.channel->fd, POLLIN, 0};
    ibv_cq* cq;
    void* ctx;
    bool got = poll(&pfd, 1, 10000) == 1 && ibv_get_cq_event(p.b.channel, &cq, &ctx) == 0;
    sender.join();
    if (!got) return Fail("no event within 10 s");
    ibv_ack_cq_events(cq, 1);
    ++events;
    auto rx = PollN(p.b.cq, 1);
    if (rx.size() != 1 || rx[0].status != IBV_WC_SUCCESS || rx[0].wr_id != static_cast<uint64_t>(i))
      return Fail("the message");
    if (PollN(p.a.cq, 1).size() != 1) return Fail("send completion");
  }
  printf("events=%d\n", events);
  return 0;  // counters are written at exit
}

// Plain data exchange, for running over a chosen wire (SOFTVERBS_SHM=0).
int ScenarioExchange() {
  Pair p;
  if (!p.Open()) return Fail("open");
  Fill(p.src.data.data(), 1 << 20, 4);
  PostRecv(p.b.qp, p.dst, 0, 1 << 20, 1);
  PostSend(p.a.qp, IBV_WR_SEND, p.src, 0, 1 << 20, 1);
  auto rx = PollN(p.b.cq, 1);
  if (rx.size() != 1 || rx[0].status || !Check(p.dst.data.data(), 1 << 20, 4))
    return Fail("1 MB send");
  Fill(p.dst.data.data(), 1 << 20, 5);
  PostSend(p.a.qp, IBV_WR_RDMA_READ, p.src, 0, 1 << 20, 2, IBV_SEND_SIGNALED, p.dst.addr(),
           p.dst.mr->rkey);
  auto tx = PollN(p.a.cq, 2);
  if (tx.size() != 2 || tx[1].status || !Check(p.src.data.data(), 1 << 20, 5))
    return Fail("1 MB read");
  printf("ok\n");
  return 0;
}

// Device work on the application's thread, as SOFTVERBS_DEVICE_CPU_DIR
// keeps it: the file DIR/<pid> after one 1 MiB exchange, and after a second
// (printed as "device_ns=A,B"; "device_ns=none" without the file).
namespace {
std::string DeviceNs() {
  const char* dir = getenv("SOFTVERBS_DEVICE_CPU_DIR");
  if (dir == nullptr) return "none";
  std::ifstream f(std::string(dir) + "/" + std::to_string(getpid()), std::ios::binary);
  uint64_t ns = 0;
  if (!f.read(reinterpret_cast<char*>(&ns), sizeof(ns))) return "none";
  return std::to_string(ns);
}
}  // namespace

int ScenarioDeviceCpu() {
  std::string first;
  for (int round = 0; round < 2; ++round) {
    Pair p;
    if (!p.Open()) return Fail("open");
    // 300 sends of 64 KiB, each posted and polled on this thread: far more
    // scopes than it takes for the 1-in-16 sampling to time some (the chance
    // that none of them is: below 1e-8).
    Fill(p.src.data.data(), 1 << 20, 7);
    for (int i = 0; i < 300; ++i) {
      PostRecv(p.b.qp, p.dst, 0, 1 << 16, 1);
      PostSend(p.a.qp, IBV_WR_SEND, p.src, 0, 1 << 16, 1);
      auto rx = PollN(p.b.cq, 1);
      if (rx.size() != 1 || rx[0].status || !Check(p.dst.data.data(), 1 << 16, 7))
        return Fail("64 KB send");
      if (PollN(p.a.cq, 1).size() != 1) return Fail("send completion");
    }
    if (round == 0) first = DeviceNs();
  }
  printf("device_ns=%s,%s\n", first.c_str(), DeviceNs().c_str());
  return 0;
}

namespace {

TEST(Faults, FailWrCompletesTheNthRequestInError) {
  std::string out;
  EXPECT_EQ(RunSelf({"SOFTVERBS_FAIL_WR=3", "SOFTVERBS_FAIL_STATUS=REM_OP_ERR"},
                    {"--scenario", "fail-wr"}, &out),
            0)
      << out;
}

TEST(Faults, DropAfterOpsCutsTheWire) {
  std::string out;
  EXPECT_EQ(RunSelf({"SOFTVERBS_DROP_AFTER_OPS=3"}, {"--scenario", "drop"}, &out), 0) << out;
}

TEST(Faults, DelayHoldsCompletions) {
  std::string out;
  EXPECT_EQ(RunSelf({"SOFTVERBS_DELAY_US=40000"}, {"--scenario", "delay"}, &out), 0) << out;
}

TEST(Faults, ShrunkQueuesAreEnforced) {
  std::string out;
  EXPECT_EQ(RunSelf({"SOFTVERBS_MAX_QP_WR=4", "SOFTVERBS_MAX_CQE=16"},
                    {"--scenario", "small-queues"}, &out),
            0)
      << out;
}

TEST(Faults, TcpWireCarriesTheSameTraffic) {
  std::string out;
  EXPECT_EQ(RunSelf({"SOFTVERBS_SHM=0", "SOFTVERBS_TRACE=1"}, {"--scenario", "exchange"}, &out),
            0)
      << out;
  EXPECT_NE(out.find(" tcp"), std::string::npos) << "the link used TCP: " << out;
}

TEST(Faults, SharedMemoryWireOnOneHost) {
  std::string out;
  EXPECT_EQ(RunSelf({"SOFTVERBS_TRACE=1"}, {"--scenario", "exchange"}, &out), 0) << out;
  EXPECT_NE(out.find(" shm"), std::string::npos) << "the link used shared memory: " << out;
}

namespace {

// Runs a scenario with SOFTVERBS_STATS=<a file>: the file's lines, and the
// scenario's output in *out; "" if it failed (the failure is reported).
std::string RunWithStats(const char* scenario, std::string* out) {
  char path[] = "/tmp/softverbs-stats-XXXXXX";
  int fd = mkstemp(path);
  EXPECT_GE(fd, 0);
  if (fd < 0) return "";
  close(fd);
  int rc = RunSelf({std::string("SOFTVERBS_STATS=") + path}, {"--scenario", scenario}, out);
  EXPECT_EQ(rc, 0) << *out;
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  unlink(path);
  return rc == 0 ? ss.str() : "";
}

}  // namespace

TEST(Counters, StatsAtExitCountOperationsAndBytes) {
  std::string out;
  std::string s = RunWithStats("stats", &out);
  ASSERT_FALSE(s.empty());
  EXPECT_NE(s.find("dir=tx op=SEND ops=1 bytes=10"), std::string::npos) << s;
  EXPECT_NE(s.find("dir=tx op=RDMA_WRITE ops=1 bytes=1000"), std::string::npos) << s;
  EXPECT_NE(s.find("dir=tx op=RDMA_READ ops=1 bytes=500"), std::string::npos) << s;
  EXPECT_NE(s.find("dir=rx op=RECV ops=1 bytes=10"), std::string::npos) << s;
  EXPECT_NE(s.find("dir=rx op=RDMA_WRITE ops=1 bytes=1000"), std::string::npos) << s;
}

// Arming a CQ and its event change no epoll set: a store in the wire's
// shared memory says whose doorbell to ring (the channel's waiter or the
// agent). The process's epoll_ctl calls are those of setting the wire and
// the channel up, not two per message, and the doorbells that woke the
// sleeping receiver were its waiter's own.
TEST(Counters, ArmAndEventMakeNoEpollCtlCallAndRingTheWaiter) {
  std::string out;
  std::string s = RunWithStats("arm-events", &out);
  ASSERT_FALSE(s.empty());
  EXPECT_NE(out.find("events=200"), std::string::npos) << out;
  auto field = [&](const char* key) -> long {
    size_t at = s.find(key);
    return at == std::string::npos ? -1 : std::atol(s.c_str() + at + strlen(key));
  };
  long calls = field(" sys=epoll_ctl calls=");
  long waiter = field(" waiter=");
  EXPECT_GT(calls, 0) << s;
  EXPECT_LT(calls, 50) << "200 arms and events: " << s;
  EXPECT_GE(waiter, 100) << "the sleeping receiver's waiter was rung: " << s;
}

TEST(Counters, DeviceWorkOnApplicationThreadsIsKeptWhenAsked) {
  char dir[] = "/tmp/softverbs-cpu-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  std::string out;
  ASSERT_EQ(RunSelf({std::string("SOFTVERBS_DEVICE_CPU_DIR=") + dir}, {"--scenario", "device-cpu"},
                    &out),
            0)
      << out;
  unsigned long long a = 0, b = 0;
  size_t at = out.find("device_ns=");
  ASSERT_NE(at, std::string::npos) << out;
  ASSERT_EQ(sscanf(out.c_str() + at, "device_ns=%llu,%llu", &a, &b), 2) << out;
  // Posting copies 64 KiB into the wire on this thread, 300 times a round:
  // well over a microsecond of CPU, and the total only grows.
  EXPECT_GT(a, 1000u) << out;
  EXPECT_GT(b, a) << out;
  // A directory that cannot take the file: said once, and the traffic is
  // not affected (the scenario checks its bytes).
  std::string missing = std::string(dir) + "/no/such/dir";
  ASSERT_EQ(RunSelf({"SOFTVERBS_DEVICE_CPU_DIR=" + missing}, {"--scenario", "device-cpu"}, &out),
            0)
      << out;
  EXPECT_NE(out.find("SOFTVERBS_DEVICE_CPU_DIR: cannot keep " + missing), std::string::npos)
      << out;
  EXPECT_NE(out.find("device_ns=none,none"), std::string::npos) << out;
  std::string cmd = std::string("rm -rf ") + dir;
  EXPECT_EQ(system(cmd.c_str()), 0);
}

TEST(Config, BadValuesAreNamedAndDisableTheDevice) {
  std::string out;
  EXPECT_EQ(RunSelf({"SOFTVERBS_RING_KB=abc"}, {"--scenario", "list-devices"}, &out), 0) << out;
  EXPECT_NE(out.find("SOFTVERBS_RING_KB='abc' is not valid"), std::string::npos) << out;
  EXPECT_NE(out.find("devices=0"), std::string::npos) << out;
  EXPECT_EQ(RunSelf({"SOFTVERBS_DEVICES=mlx5_0:192.0.2.77"}, {"--scenario", "list-devices"},
                    &out),
            0);
  EXPECT_NE(out.find("not an address of this host"), std::string::npos) << out;
  EXPECT_NE(out.find("devices=0"), std::string::npos) << out;
  // One device here and one whose address is elsewhere (another network
  // namespace): both listed, the second named in a warning.
  EXPECT_EQ(RunSelf({"SOFTVERBS_DEVICES=mlx5_0:127.0.0.1,mlx5_1:192.0.2.77"},
                    {"--scenario", "list-devices"}, &out),
            0);
  EXPECT_NE(out.find("address 192.0.2.77 of device mlx5_1 is not an address of this host"),
            std::string::npos)
      << out;
  EXPECT_EQ(out.find("offers no RDMA device"), std::string::npos) << out;
  EXPECT_NE(out.find("devices=2"), std::string::npos) << out;
  EXPECT_EQ(RunSelf({"SOFTVERBS_RING_KB=12"}, {"--scenario", "list-devices"}, &out), 0);
  EXPECT_NE(out.find("power of two"), std::string::npos) << out;
}

// Registration counts against RLIMIT_MEMLOCK as the kernel's pinning does
// (in a child without CAP_IPC_LOCK, limited to 64 KiB): over it is ENOMEM,
// and deregistering gives the room back.
TEST(MemoryRegion, RegistrationCountsAgainstTheLockedMemoryLimit) {
  std::string out;
  EXPECT_EQ(RunSelf({}, {"--scenario", "memlock"}, &out), 0) << "the step that failed\n" << out;
}

}  // namespace

// Under SOFTVERBS_ODP=0 (a device without on-demand paging): no ODP caps,
// and an ODP MR is refused with EOPNOTSUPP. 0 when so.
int ScenarioOdpOff() {
  ibv_context* ctx = svtest::OpenDevice();
  if (ctx == nullptr) return 2;
  ibv_device_attr_ex attr{};
  if (ibv_query_device_ex(ctx, nullptr, &attr) != 0) return 3;
  if (attr.odp_caps.general_caps != 0) return 4;
  ibv_pd* pd = ibv_alloc_pd(ctx);
  errno = 0;
  if (ibv_reg_mr(pd, nullptr, SIZE_MAX, IBV_ACCESS_ON_DEMAND) != nullptr || errno != EOPNOTSUPP)
    return 5;
  ibv_dealloc_pd(pd);
  ibv_close_device(ctx);
  return 0;
}

// Without CAP_IPC_LOCK (dropped here, as an unprivileged process has it)
// and with 64 KiB of locked memory. Exit status: 0, or the failed step.
int ScenarioMemlock() {
  __user_cap_header_struct h{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct d[2]{};
  if (syscall(SYS_capget, &h, d) != 0) return 10;
  d[CAP_IPC_LOCK / 32].effective &= ~(1u << (CAP_IPC_LOCK % 32));
  d[CAP_IPC_LOCK / 32].permitted &= ~(1u << (CAP_IPC_LOCK % 32));
  if (syscall(SYS_capset, &h, d) != 0) return 11;
  rlimit r{64 << 10, 64 << 10};
  if (setrlimit(RLIMIT_MEMLOCK, &r) != 0) return 12;
  ibv_context* ctx = OpenDevice();
  if (ctx == nullptr) return 13;
  ibv_pd* pd = ibv_alloc_pd(ctx);
  char* buf = static_cast<char*>(aligned_alloc(4096, 1 << 20));
  ibv_mr* a = ibv_reg_mr(pd, buf, 48 << 10, IBV_ACCESS_LOCAL_WRITE);
  if (a == nullptr) return 14;
  errno = 0;
  ibv_mr* b = ibv_reg_mr(pd, buf + (64 << 10), 32 << 10, IBV_ACCESS_LOCAL_WRITE);
  if (b != nullptr || errno != ENOMEM) return 15;  // 48 + 32 KiB > 64 KiB
  // One byte across a page boundary pins two pages.
  ibv_mr* c = ibv_reg_mr(pd, buf + (128 << 10) - 1, 2, IBV_ACCESS_LOCAL_WRITE);
  if (c == nullptr) return 16;  // 56 KiB now
  ibv_mr* e = ibv_reg_mr(pd, buf + (256 << 10), 12 << 10, IBV_ACCESS_LOCAL_WRITE);
  if (e != nullptr) return 17;  // 68 KiB > 64 KiB
  ibv_dereg_mr(a);
  b = ibv_reg_mr(pd, buf + (64 << 10), 32 << 10, IBV_ACCESS_LOCAL_WRITE);
  if (b == nullptr) return 18;  // the room came back
  ibv_dereg_mr(b);
  ibv_dereg_mr(c);
  ibv_dealloc_pd(pd);
  ibv_close_device(ctx);
  free(buf);
  return 0;
}

int ScenarioListDevices() {
  int n = -1;
  ibv_device** l = ibv_get_device_list(&n);
  printf("devices=%d\n", n);
  if (l) ibv_free_device_list(l);
  return 0;
}
