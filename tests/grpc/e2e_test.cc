// gRPC services over grpc-rdma, end to end: an Echo server and its clients
// in one process, written against the public grpc++ API only. This file is
// compiled with no reference to grpc-rdma; CTest runs it twice, once with
// the library preloaded and once linked (tests/grpc/CMakeLists.txt). Every
// test reads the library's counters to prove which transport carried it.
#include <arpa/inet.h>
#include <dlfcn.h>
#include <grpc/support/log.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <chrono>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "echo_service.h"

namespace grpc_rdma_test {
namespace {

using grpc_rdma::test::Blob;
using grpc_rdma::test::Echo;
using Clock = std::chrono::system_clock;  // what grpc++ deadlines take

class E2eTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    service_ = new EchoService;
    server_ = StartEchoServer("127.0.0.1:0", &port_, service_).release();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port_, 0);
  }
  static void TearDownTestSuite() {
    server_->Shutdown();
    delete server_;
    delete service_;
  }

  void SetUp() override {
    before_ = RdmaStats();
    ASSERT_FALSE(before_.empty())
        << "grpc-rdma is not in this process (neither preloaded nor linked)";
  }

  static std::unique_ptr<Echo::Stub> NewStub(int port = port_) {
    auto ch = grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port),
                                        grpc::InsecureChannelCredentials(), BigMessageArgs());
    return Echo::NewStub(ch);
  }

  int64_t Delta(const char* key) { return RdmaStats()[key] - before_[key]; }

  // This test's traffic rode RDMA: new RDMA client connections, no TCP
  // ones, at least `bytes` more stream bytes sent.
  void ExpectRdma(int64_t connections, int64_t bytes) {
    EXPECT_GE(Delta("rdma_client_connections"), connections);
    EXPECT_EQ(Delta("tcp_client_connections"), 0);
    EXPECT_EQ(Delta("fallbacks"), 0);
    EXPECT_GE(Delta("bytes_sent"), bytes);
  }

  static EchoService* service_;
  static grpc::Server* server_;
  static int port_;
  std::map<std::string, int64_t> before_;
};

EchoService* E2eTest::service_;
grpc::Server* E2eTest::server_;
int E2eTest::port_;

TEST_F(E2eTest, UnaryEverySize) {
  auto stub = NewStub();
  const size_t kSizes[] = {0,       1,           8191,        8192,        8193,
                           16384,   1 << 20,     (4 << 20) - 1, 4 << 20,   (4 << 20) + 1,
                           64 << 20};
  int64_t total = 0;
  uint32_t seed = 1;
  for (size_t n : kSizes) {
    Blob req, resp;
    req.set_data(Pattern(n, seed++));
    grpc::ClientContext ctx;
    ctx.set_deadline(Clock::now() + std::chrono::seconds(60));
    grpc::Status s = stub->Unary(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << n << " bytes: " << s.error_message();
    ASSERT_EQ(resp.data().size(), n);
    ASSERT_TRUE(resp.data() == req.data()) << n << " bytes came back different";
    EXPECT_EQ(resp.peer().rfind("ipv4:127.0.0.1:", 0), 0u) << "server saw peer " << resp.peer();
    EXPECT_NE(resp.peer().find("?transport=rdma"), std::string::npos) << resp.peer();
    total += n;
  }
  ExpectRdma(1, total);
  EXPECT_GT(RdmaStats()["pinned_bytes"], 0) << "open RDMA connections hold registered memory";
  EXPECT_GT(Delta("grpc_thread_polls"), 0) << "gRPC's threads never handled a completion";
  EXPECT_GT(Delta("eager_messages"), 0);
  EXPECT_GT(Delta("rendezvous"), 0);
}

// TF_RDMA_POLL_MODE=adaptive (the default) with TF_RDMA_SPIN_US > 0: the
// thread waiting in gRPC's epoll set spins after RDMA activity, and small
// calls' answers are found while it does. CTest also runs this with
// TF_RDMA_SPIN_US=0, where it must never spin.
TEST_F(E2eTest, PollerSpinsForSmallCallsOnlyWhenAsked) {
  const char* spin = getenv("TF_RDMA_SPIN_US");
  const char* mode = getenv("TF_RDMA_POLL_MODE");
  const bool spinning = (spin == nullptr || atoi(spin) > 0) &&
                        (mode == nullptr || strcmp(mode, "adaptive") == 0);
  auto stub = NewStub();
  // Batches of 200 calls until the poller has spun and found an answer:
  // other work on a loaded machine may have stopped spinning a while (the
  // back-off, up to 10 s), so up to 30 s; without spinning, one batch.
  const int kCalls = 200;
  int64_t total = 0, spins = 0, hits = 0;
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  do {
    for (int i = 0; i < kCalls; ++i) {
      Blob req, resp;
      req.set_data(Pattern(64, 900 + i));
      grpc::ClientContext ctx;
      ctx.set_deadline(Clock::now() + std::chrono::seconds(30));
      grpc::Status s = stub->Unary(&ctx, req, &resp);
      ASSERT_TRUE(s.ok()) << "call " << i << ": " << s.error_message();
      ASSERT_TRUE(resp.data() == req.data()) << "call " << i << " came back different";
    }
    total += kCalls;
    spins = Delta("grpc_poller_spins");
    hits = Delta("grpc_poller_spin_hits");
  } while (spinning && (spins == 0 || hits == 0) && std::chrono::steady_clock::now() < until);
  ExpectRdma(1, 64 * total);
  EXPECT_LE(hits, spins);
  if (spinning) {
    EXPECT_GT(spins, 0) << "gRPC's poller never spun after RDMA activity in " << total
                        << " calls: is epoll_wait interposed (libgrpc_rdma.so's epoll_wait at "
                           "glibc's version)? back-offs: "
                        << Delta("grpc_poller_spin_backoffs");
    EXPECT_GT(hits, 0) << "no answer of " << total << " calls was found while spinning";
  } else {
    EXPECT_EQ(spins, 0) << "TF_RDMA_SPIN_US=" << (spin ? spin : "") << " TF_RDMA_POLL_MODE="
                        << (mode ? mode : "") << " must not spin";
  }
}

TEST_F(E2eTest, ClientStreaming) {
  auto stub = NewStub();
  grpc::ClientContext ctx;
  Blob resp;
  auto w = stub->Upload(&ctx, &resp);
  std::string all;
  for (int i = 0; i < 40; ++i) {
    Blob b;
    b.set_data(Pattern(i % 3 == 0 ? 300000 : 1000 + i * 37, 100 + i));
    all += b.data();
    ASSERT_TRUE(w->Write(b));
  }
  ASSERT_TRUE(w->WritesDone());
  grpc::Status s = w->Finish();
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_TRUE(resp.data() == all);
  ExpectRdma(1, static_cast<int64_t>(all.size()));
}

TEST_F(E2eTest, ServerStreaming) {
  auto stub = NewStub();
  grpc::ClientContext ctx;
  Blob req, b;
  req.set_data(Pattern(100000, 7));
  req.set_repeat(50);
  auto r = stub->Download(&ctx, req);
  int n = 0;
  while (r->Read(&b)) {
    ASSERT_TRUE(b.data() == req.data()) << "message " << n;
    ++n;
  }
  grpc::Status s = r->Finish();
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(n, 50);
  ExpectRdma(1, 0);
  EXPECT_GE(Delta("bytes_received"), 50 * 100000);
}

// Streams of messages of 2 MiB and more, both ways: their writes are
// kept (the endpoint holds gRPC's slices for the device and gives the
// write back once posted, docs/design.md), so the writer serializes the
// next message while the device still reads this one. Every byte must
// arrive as written, in order.
TEST_F(E2eTest, StreamsOfLargeMessagesArriveWhole) {
  auto stub = NewStub();
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(Clock::now() + std::chrono::seconds(60));
    Blob resp;
    auto w = stub->Upload(&ctx, &resp);
    const size_t kSizes[] = {4 << 20, (3 << 20) + 1, 5 << 20, 4 << 20, 2 << 20, (6 << 20) - 7};
    std::string all;
    uint32_t seed = 500;
    for (size_t n : kSizes) {
      Blob b;
      b.set_data(Pattern(n, seed++));
      all += b.data();
      ASSERT_TRUE(w->Write(b)) << n << " bytes";
    }
    ASSERT_TRUE(w->WritesDone());
    grpc::Status s = w->Finish();
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(resp.data().size(), all.size());
    ASSERT_TRUE(resp.data() == all) << "the server got other bytes than were written";
  }
  {
    // Both ways at once, each message its own bytes (a buffer given back
    // too early and reused for the next would show): the server echoes
    // each, its writes kept as the client's are.
    grpc::ClientContext ctx;
    ctx.set_deadline(Clock::now() + std::chrono::seconds(60));
    auto rw = stub->Chat(&ctx);
    std::vector<std::string> sent;
    for (int i = 0; i < 8; ++i) sent.push_back(Pattern((4 << 20) + 3 * i, 700 + i));
    std::thread writer([&] {
      for (const std::string& m : sent) {
        Blob b;
        b.set_data(m);
        if (!rw->Write(b)) break;
      }
      rw->WritesDone();
    });
    Blob in;
    size_t n = 0;
    bool same = true;
    while (rw->Read(&in)) {
      if (n >= sent.size() || in.data() != sent[n]) same = false;
      ++n;
    }
    writer.join();
    grpc::Status s = rw->Finish();
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(n, sent.size());
    EXPECT_TRUE(same) << "an echoed message came back with other bytes";
  }
  ExpectRdma(1, 24 << 20);
  EXPECT_GT(Delta("writes_kept"), 0) << "no write was given back before the device read it";
}

TEST_F(E2eTest, BidiStreaming) {
  auto stub = NewStub();
  grpc::ClientContext ctx;
  auto rw = stub->Chat(&ctx);
  int64_t total = 0;
  for (int i = 0; i < 200; ++i) {
    Blob out, in;
    out.set_data(Pattern(static_cast<size_t>((i * 7919) % 70000), 300 + i));
    total += out.data().size();
    ASSERT_TRUE(rw->Write(out));
    ASSERT_TRUE(rw->Read(&in));
    ASSERT_TRUE(in.data() == out.data()) << "message " << i;
  }
  ASSERT_TRUE(rw->WritesDone());
  grpc::Status s = rw->Finish();
  ASSERT_TRUE(s.ok()) << s.error_message();
  ExpectRdma(1, total);
}

TEST_F(E2eTest, ThousandConcurrentRpcsOnOneChannel) {
  auto stub = NewStub();
  constexpr int kN = 1000;
  grpc::CompletionQueue cq;
  struct Call {
    grpc::ClientContext ctx;
    Blob req, resp;
    grpc::Status status;
    std::unique_ptr<grpc::ClientAsyncResponseReader<Blob>> rpc;
  };
  std::vector<Call> calls(kN);
  for (int i = 0; i < kN; ++i) {
    Call& c = calls[i];
    c.req.set_data(Pattern(static_cast<size_t>(i % 13) * 1500, 5000 + i));
    c.ctx.set_deadline(Clock::now() + std::chrono::seconds(60));
    c.rpc = stub->AsyncUnary(&c.ctx, c.req, &cq);
    c.rpc->Finish(&c.resp, &c.status, &c);
  }
  for (int i = 0; i < kN; ++i) {
    void* tag;
    bool ok;
    ASSERT_TRUE(cq.Next(&tag, &ok));
    ASSERT_TRUE(ok);
  }
  for (int i = 0; i < kN; ++i) {
    ASSERT_TRUE(calls[i].status.ok()) << i << ": " << calls[i].status.error_message();
    ASSERT_TRUE(calls[i].resp.data() == calls[i].req.data()) << "call " << i;
  }
  cq.Shutdown();
  ExpectRdma(1, 0);
  // chttp2 batches the frames of concurrent calls into one endpoint write,
  // and each write goes as one SEND: far fewer SENDs than messages.
  EXPECT_LT(Delta("eager_messages"), 2 * kN) << "no batching of concurrent RPCs";
}

TEST_F(E2eTest, FiftyChannels) {
  constexpr int kN = 50;
  std::vector<std::unique_ptr<Echo::Stub>> stubs;
  for (int i = 0; i < kN; ++i) stubs.push_back(NewStub());
  std::vector<std::thread> threads;
  std::atomic<int> good{0};
  for (int i = 0; i < kN; ++i) {
    threads.emplace_back([&, i] {
      for (int k = 0; k < 5; ++k) {
        Blob req, resp;
        req.set_data(Pattern(static_cast<size_t>(i * 1000 + k), i * 10 + k));
        grpc::ClientContext ctx;
        ctx.set_deadline(Clock::now() + std::chrono::seconds(60));
        if (stubs[i]->Unary(&ctx, req, &resp).ok() && resp.data() == req.data()) ++good;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(good.load(), kN * 5);
  ExpectRdma(kN, 0);
}

TEST_F(E2eTest, DeadlineExceeded) {
  // Connected first: the 300 ms deadline is for the call, and setting up
  // the connection can take longer than that on a loaded machine (or under
  // a sanitizer), which would end the call before anything rode RDMA.
  auto ch = grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port_),
                                      grpc::InsecureChannelCredentials(), BigMessageArgs());
  ASSERT_TRUE(ch->WaitForConnected(Clock::now() + std::chrono::seconds(30)));
  auto stub = Echo::NewStub(ch);
  Blob req, resp;
  req.set_data("slow");
  req.set_delay_ms(3000);
  grpc::ClientContext ctx;
  ctx.set_deadline(Clock::now() + std::chrono::milliseconds(300));
  auto t0 = Clock::now();
  grpc::Status s = stub->Unary(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  EXPECT_LT(Clock::now() - t0, std::chrono::milliseconds(2500));
  ExpectRdma(1, 0);
}

TEST_F(E2eTest, ClientCancels) {
  auto stub = NewStub();
  Blob req, resp;
  req.set_delay_ms(5000);
  grpc::ClientContext ctx;
  std::thread canceller([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    ctx.TryCancel();
  });
  auto t0 = Clock::now();
  grpc::Status s = stub->Unary(&ctx, req, &resp);
  canceller.join();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << s.error_message();
  EXPECT_LT(Clock::now() - t0, std::chrono::milliseconds(4000));
  // The channel still works after a cancelled call.
  Blob ok_req, ok_resp;
  ok_req.set_data(Pattern(20000, 9));
  grpc::ClientContext ctx2;
  ASSERT_TRUE(stub->Unary(&ctx2, ok_req, &ok_resp).ok());
  EXPECT_TRUE(ok_resp.data() == ok_req.data());
  ExpectRdma(1, 20000);
}

TEST_F(E2eTest, ServerCancels) {
  auto stub = NewStub();
  grpc::ClientContext ctx;
  Blob req, b;
  req.set_data(Pattern(5000, 11));
  req.set_repeat(100);
  req.set_server_cancel(true);
  auto r = stub->Download(&ctx, req);
  int n = 0;
  while (r->Read(&b)) ++n;
  grpc::Status s = r->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << s.error_message();
  EXPECT_LE(n, 1);
  ExpectRdma(1, 0);
}

// Local credentials parse the peer's address and accept loopback ones
// only: an RDMA peer must read as the IPv4 address it is.
TEST_F(E2eTest, LocalTcpCredentials) {
  EchoService service;
  int port = 0;
  auto server = StartEchoServer("127.0.0.1:0", &port, &service,
                                grpc::experimental::LocalServerCredentials(LOCAL_TCP));
  ASSERT_NE(server, nullptr);
  auto stub = Echo::NewStub(grpc::CreateCustomChannel(
      "127.0.0.1:" + std::to_string(port), grpc::experimental::LocalCredentials(LOCAL_TCP),
      BigMessageArgs()));
  Blob req, resp;
  req.set_data(Pattern(100000, 21));
  grpc::ClientContext ctx;
  ctx.set_deadline(Clock::now() + std::chrono::seconds(30));
  grpc::Status s = stub->Unary(&ctx, req, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(resp.data() == req.data());
  ExpectRdma(1, 100000);
}

// gRPC-native controls, by their names (this file knows nothing of the
// library): a channel argument turns RDMA off for one channel, a server
// argument makes a server listen on TCP only, a channel that must not fall
// back fails there, and a bad value is logged and ignored.
grpc::Status CallOnce(const std::string& target, const grpc::ChannelArguments& args) {
  auto stub = Echo::NewStub(
      grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args));
  Blob req, resp;
  req.set_data(Pattern(20000, 31));
  grpc::ClientContext ctx;
  ctx.set_deadline(Clock::now() + std::chrono::seconds(20));
  grpc::Status s = stub->Unary(&ctx, req, &resp);
  if (s.ok() && resp.data() != req.data()) return grpc::Status(grpc::StatusCode::DATA_LOSS, "");
  return s;
}

TEST_F(E2eTest, AChannelArgumentTurnsRdmaOffForThatChannel) {
  grpc::ChannelArguments off = BigMessageArgs();
  off.SetInt("grpc.rdma.enabled", 0);
  grpc::Status s = CallOnce("127.0.0.1:" + std::to_string(port_), off);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_GE(Delta("tcp_client_connections"), 1);
  EXPECT_EQ(Delta("rdma_client_connections"), 0);
  EXPECT_EQ(Delta("fallbacks"), 0) << "not a fallback: RDMA was not tried";
  before_ = RdmaStats();
  s = CallOnce("127.0.0.1:" + std::to_string(port_), BigMessageArgs());
  ASSERT_TRUE(s.ok()) << s.error_message();
  ExpectRdma(1, 20000);
}

// grpc.rdma.tcp_first (TF_RDMA_TCP_FIRST): the channel's connection starts
// on TCP and moves to RDMA while a bidirectional stream runs in both
// directions at once, messages of every kind of size in flight; every byte
// must come back, in order.
TEST_F(E2eTest, ATcpFirstChannelMovesToRdmaUnderAStream) {
  // The server joins TCP connections only when it is told to as well.
  EchoService service;
  int port = 0;
  grpc::ServerBuilder b;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  b.RegisterService(&service);
  b.SetMaxReceiveMessageSize(-1);
  b.AddChannelArgument("grpc.rdma.tcp_first", 1);
  auto server = b.BuildAndStart();
  ASSERT_NE(server, nullptr);
  grpc::ChannelArguments args = BigMessageArgs();
  args.SetInt("grpc.rdma.tcp_first", 1);
  auto stub = Echo::NewStub(grpc::CreateCustomChannel(
      "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials(), args));
  grpc::ClientContext ctx;
  ctx.set_deadline(Clock::now() + std::chrono::seconds(60));
  auto rw = stub->Chat(&ctx);
  const size_t kSizes[] = {1, 100, 9000, 70000, 300000, 5 << 20};
  std::atomic<bool> stop{false};
  std::atomic<int> written{0};
  std::thread writer([&] {
    for (int i = 0; !stop.load(); ++i) {
      Blob b;
      b.set_data(Pattern(kSizes[i % 6], 5000 + i));
      if (!rw->Write(b)) break;
      written.fetch_add(1);  // gRPC's flow control bounds what is in flight
    }
    rw->WritesDone();
  });
  int read = 0, after_move = -1;
  bool ok = true;
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(40);
  Blob got;
  while (rw->Read(&got)) {
    if (got.data() != Pattern(kSizes[read % 6], 5000 + read)) {
      ADD_FAILURE() << "message " << read << " (" << kSizes[read % 6] << " B) came back different";
      ok = false;
      stop = true;
      break;
    }
    ++read;
    if (after_move < 0 && Delta("tcp_first_moved") >= 1) after_move = read;
    if ((after_move >= 0 && read - after_move >= 100) || std::chrono::steady_clock::now() > until) {
      stop = true;
    }
  }
  writer.join();
  grpc::Status s = rw->Finish();
  ASSERT_TRUE(ok);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(read, written.load()) << "every message written came back";
  EXPECT_GE(after_move, 0) << "the connection never moved to RDMA in 40 s";
  EXPECT_EQ(Delta("tcp_first_moved"), 1);
  EXPECT_GE(Delta("tcp_client_connections"), 1) << "it started on TCP";
  EXPECT_GE(Delta("rdma_client_connections"), 1);
  EXPECT_EQ(Delta("fallbacks"), 0);
  EXPECT_GT(Delta("bytes_sent"), 0) << "nothing went over RDMA";
  server->Shutdown(Clock::now());
}

// A server told by its argument to listen on TCP only (grpc.rdma.enabled
// 0): no RDMA CM listener at its port.
std::unique_ptr<grpc::Server> StartTcpOnlyServer(EchoService* service, int* port) {
  grpc::ServerBuilder b;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), port);
  b.RegisterService(service);
  b.AddChannelArgument("grpc.rdma.enabled", 0);
  return b.BuildAndStart();
}

// A TCP-first channel (grpc.rdma.tcp_first) to 127.0.0.1:`port`, and
// calls on it: Call(i) echoes `size` bytes (seeded by `seed` + i) and says
// whether they came back intact.
struct TcpFirstClient {
  // `channel`: a channel argument gRPC ignores, so that clients told
  // apart by it get connections of their own (gRPC shares one between
  // channels of the same target and arguments).
  TcpFirstClient(int port, size_t size, uint32_t seed, int channel = 0)
      : size(size), seed(seed) {
    grpc::ChannelArguments args = BigMessageArgs();
    args.SetInt("grpc.rdma.tcp_first", 1);
    args.SetInt("grpc_rdma.test.channel", channel);
    stub = Echo::NewStub(grpc::CreateCustomChannel(
        "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials(), args));
  }
  bool Call(int i) {
    Blob req, resp;
    req.set_data(Pattern(size, seed + static_cast<uint32_t>(i)));
    grpc::ClientContext ctx;
    ctx.set_deadline(Clock::now() + std::chrono::seconds(20));
    grpc::Status s = stub->Unary(&ctx, req, &resp);
    return s.ok() && resp.data() == req.data();
  }
  std::unique_ptr<Echo::Stub> stub;
  size_t size;
  uint32_t seed;
};

// A TCP-first channel to a server that listens on RDMA CM but does not
// join TCP connections (its own TF_RDMA_TCP_FIRST off, as in this suite):
// the server closes the RDMA connection, and the channel's calls ride TCP.
// The next channel to that address starts on RDMA.
TEST_F(E2eTest, ATcpFirstChannelToAServerThatJoinsNoneStaysOnTcp) {
  TcpFirstClient client(port_, 3000, 700);
  auto call = [&](int i) { return client.Call(i); };
  // Calls until the refused RDMA connection's end reached the client and
  // it let it go (the fallback is counted just before; a fixed 20 calls
  // were once over in 8 ms, before either), then more: all on TCP.
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  int i = 0;
  while ((Delta("fallbacks") < 1 || RdmaStats()["rdma_connections_open"] > 0) &&
         std::chrono::steady_clock::now() < until) {
    ASSERT_TRUE(call(i++));
  }
  EXPECT_EQ(RdmaStats()["rdma_connections_open"], 0) << "the refused RDMA connection is held";
  for (int j = 0; j < 20; ++j) ASSERT_TRUE(call(i++));
  EXPECT_EQ(Delta("tcp_first_moved"), 0);
  EXPECT_EQ(Delta("fallbacks"), 1) << "the refused join is a fallback";
  EXPECT_EQ(Delta("tcp_first_unjoined"), 1);
  EXPECT_EQ(Delta("rdma_server_connections"), 0) << "the server joined it";
  EXPECT_EQ(Delta("tcp_client_connections"), 1);
  // RDMA CM reached that server: a new channel to it waits for RDMA
  // instead of starting on TCP again, and its first call rides RDMA.
  int64_t rdma_before = Delta("rdma_client_connections");  // the refused one's
  TcpFirstClient next(port_, 3000, 900, /*channel=*/1);
  ASSERT_TRUE(next.Call(0));
  EXPECT_EQ(Delta("tcp_client_connections"), 1) << "the next channel started on TCP again";
  EXPECT_EQ(Delta("rdma_client_connections"), rdma_before + 1);
  EXPECT_EQ(Delta("rdma_server_connections"), 1);
  EXPECT_EQ(Delta("tcp_first_unjoined"), 1);
  EXPECT_EQ(Delta("fallbacks"), 1);
}

// The defaults (grpc.e2e.defaults runs this suite with no TF_RDMA_*
// variable): a channel's connection starts on TCP, the server joins it,
// and it moves to RDMA while calls run; every call checked byte for byte.
class E2eDefaults : public E2eTest {};

TEST_F(E2eDefaults, AChannelStartsOnTcpAndMovesToRdma) {
  ASSERT_EQ(getenv("TF_RDMA_TCP_FIRST"), nullptr) << "run with the defaults (grpc.e2e.defaults)";
  auto stub = NewStub();
  auto call = [&](int i) {
    Blob req, resp;
    req.set_data(Pattern(static_cast<size_t>(1) << (i % 21), 300 + static_cast<uint32_t>(i)));
    grpc::ClientContext ctx;
    ctx.set_deadline(Clock::now() + std::chrono::seconds(20));
    grpc::Status s = stub->Unary(&ctx, req, &resp);
    return s.ok() && resp.data() == req.data();
  };
  ASSERT_TRUE(call(0));
  EXPECT_EQ(Delta("tcp_client_connections"), 1) << "the first call did not start on TCP";
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  int i = 1;
  while (Delta("tcp_first_moved") < 1 && std::chrono::steady_clock::now() < until) {
    ASSERT_TRUE(call(i++)) << "call " << i - 1;
  }
  ASSERT_EQ(Delta("tcp_first_moved"), 1) << "the connection never moved to RDMA in 20 s";
  int64_t sent = Delta("bytes_sent");
  for (int j = 0; j < 42; ++j) ASSERT_TRUE(call(i++)) << "call " << i - 1;
  EXPECT_GE(Delta("bytes_sent") - sent, int64_t{1} << 21) << "the calls after the move skipped RDMA";
  EXPECT_EQ(Delta("tcp_client_connections"), 1);
  EXPECT_EQ(Delta("rdma_client_connections"), 1);
  EXPECT_EQ(Delta("rdma_server_connections"), 1) << "the server joined it";
  EXPECT_EQ(Delta("fallbacks"), 0);
  EXPECT_EQ(Delta("tcp_first_unjoined"), 0);
}

// A TCP-first channel to a server that does not listen on RDMA CM: its
// calls ride TCP before and after the RDMA attempt fails.
TEST_F(E2eTest, ATcpFirstChannelToATcpOnlyServerStaysOnTcp) {
  EchoService service;
  int port = 0;
  auto server = StartTcpOnlyServer(&service, &port);
  ASSERT_NE(server, nullptr);
  TcpFirstClient client(port, 20000, 600);
  auto call = [&](int i) { return client.Call(i); };
  ASSERT_TRUE(call(0));
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  int i = 1;
  while (Delta("fallbacks") < 1 && std::chrono::steady_clock::now() < until) {
    ASSERT_TRUE(call(i++));
  }
  EXPECT_EQ(Delta("fallbacks"), 1) << "the RDMA attempt beside TCP did not fail as it should";
  for (int j = 0; j < 20; ++j) ASSERT_TRUE(call(i++));
  EXPECT_EQ(Delta("tcp_first_moved"), 0);
  EXPECT_EQ(Delta("rdma_client_connections"), 0);
  EXPECT_GE(Delta("tcp_client_connections"), 1);
  server->Shutdown(Clock::now());
}

TEST_F(E2eTest, AServerArgumentMakesItListenOnTcpOnly) {
  EchoService service;
  int port = 0;
  auto server = StartTcpOnlyServer(&service, &port);
  ASSERT_NE(server, nullptr);
  std::string target = "127.0.0.1:" + std::to_string(port);
  // No RDMA CM listener there: a channel that must not fall back fails...
  grpc::ChannelArguments none = BigMessageArgs();
  none.SetString("grpc.rdma.fallback", "none");
  grpc::Status s = CallOnce(target, none);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_EQ(Delta("rdma_server_connections"), 0);
  EXPECT_EQ(Delta("tcp_client_connections"), 0);
  // ...and one that may, goes by TCP.
  s = CallOnce(target, BigMessageArgs());
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_GE(Delta("fallbacks") + Delta("fallbacks_remembered"), 1);
  EXPECT_GE(Delta("tcp_client_connections"), 1);
  EXPECT_GE(Delta("tcp_server_connections"), 1);
  EXPECT_EQ(Delta("rdma_server_connections"), 0);
  server->Shutdown(Clock::now());
}

// A connect the engine fails at once, on gRPC's connecting thread
// (rdma_resolve_addr refuses the wildcard address 0.0.0.0 there, as it
// refuses any address while every device is removed): the answer goes on
// gRPC's ExecCtx. Run by a nested one, inside the connect, it took the
// lock gRPC's connect handshaker held there: the channel hung for good.
TEST_F(E2eTest, AConnectTheEngineFailsAtOnceFailsTheCall) {
  grpc::ChannelArguments none = BigMessageArgs();
  none.SetString("grpc.rdma.fallback", "none");
  auto result = std::make_shared<std::promise<grpc::Status>>();
  std::future<grpc::Status> f = result->get_future();
  std::thread([result, none] { result->set_value(CallOnce("0.0.0.0:9", none)); }).detach();
  if (f.wait_for(std::chrono::seconds(15)) != std::future_status::ready) {
    ADD_FAILURE() << "a call whose RDMA connect failed at once hung (no fallback allowed)";
    fflush(stdout);
    std::_Exit(1);  // a thread is stuck under gRPC's locks: no clean exit
  }
  grpc::Status s = f.get();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_EQ(Delta("tcp_client_connections"), 0);
  EXPECT_EQ(Delta("rdma_client_connections"), 0);
}

// A TCP port free now (bound, then closed): for a server that must name
// its ports in advance.
int FreeTcpPort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  int port = 0;
  if (fd >= 0 && bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  if (fd >= 0) close(fd);
  return port;
}

// A server that was down (nothing listening: RDMA and TCP both refused, as
// while a server restarts) is not remembered as one without RDMA: once it
// is up, the next connection rides RDMA, not TCP for TF_RDMA_FALLBACK_TTL_S.
TEST_F(E2eTest, AServerThatWasDownGetsRdmaWhenItComesBack) {
  int port = FreeTcpPort();
  ASSERT_GT(port, 0);
  std::string target = "127.0.0.1:" + std::to_string(port);
  {
    auto stub = Echo::NewStub(
        grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), BigMessageArgs()));
    Blob req, resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(Clock::now() + std::chrono::seconds(5));
    grpc::Status s = stub->Unary(&ctx, req, &resp);
    ASSERT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  }
  EXPECT_GE(Delta("fallbacks"), 1) << "RDMA was tried, then TCP";
  EXPECT_EQ(Delta("tcp_client_connections"), 0);
  EchoService service;
  int bound = 0;
  auto server = StartEchoServer(target, &bound, &service);
  ASSERT_NE(server, nullptr);
  ASSERT_EQ(bound, port);
  before_ = RdmaStats();
  grpc::Status s = CallOnce(target, BigMessageArgs());
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(Delta("fallbacks_remembered"), 0) << "the down server was remembered as without RDMA";
  ExpectRdma(1, 20000);
  server->Shutdown(Clock::now());
}

// The count on the connections text's last line: endpoints gRPC shut
// down and has not destroyed.
long ShutDownHeld() {
  std::string t = ConnectionsText();
  size_t at = t.find(" endpoint(s) gRPC shut down");
  if (at == std::string::npos) return 0;
  size_t start = t.rfind('\n', at);
  return atol(t.c_str() + (start == std::string::npos ? 0 : start + 1));
}

// gRPC 1.51 never destroys a transport whose subchannel was shut down
// while it waited for the server's SETTINGS (Subchannel::
// OnConnectingFinishedLocked; grpc/grpc#32071, after 1.51): here a server
// (tests/grpc/slow_settings_server.cc) answers the preface after 1 s and
// closes 1 s later, and the channel goes after 300 ms. gRPC shuts the
// endpoint down when the server closes: its RDMA connection (QP, pinned
// buffers) must go then, not stay for good with gRPC's leak.
TEST_F(E2eTest, AConnectionGrpcKeepsAfterShutdownIsLetGo) {
  const char* path = getenv("SLOW_SETTINGS_SERVER");
  ASSERT_NE(path, nullptr) << "SLOW_SETTINGS_SERVER names the server (tests/grpc/CMakeLists.txt)";
  // Its environment, made before fork (the child only execs): without the
  // plugin in LD_PRELOAD (it is no gRPC program), with the rest (a
  // sanitizer's runtime).
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string v = *e;
    if (v.rfind("LD_PRELOAD=", 0) == 0) {
      std::string kept, item, all = v.substr(strlen("LD_PRELOAD="));
      for (size_t i = 0; i <= all.size(); ++i) {
        if (i == all.size() || all[i] == ':' || all[i] == ' ') {
          if (!item.empty() && item.find("libgrpc_rdma") == std::string::npos)
            kept += (kept.empty() ? "" : ":") + item;
          item.clear();
        } else {
          item += all[i];
        }
      }
      v = "LD_PRELOAD=" + kept;
    }
    env.push_back(v);
  }
  std::vector<char*> envp;
  for (std::string& v : env) envp.push_back(&v[0]);
  envp.push_back(nullptr);
  const char* argv[] = {path, "--settings-ms", "2000", "--close-ms", "1000", nullptr};
  int to_child[2], from_child[2];
  ASSERT_EQ(pipe(to_child), 0);
  ASSERT_EQ(pipe(from_child), 0);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    dup2(to_child[0], 0);
    dup2(from_child[1], 1);
    close(to_child[1]);
    close(from_child[0]);
    execve(path, const_cast<char**>(argv), envp.data());
    _exit(127);
  }
  close(to_child[0]);
  close(from_child[1]);
  // Ends the server (stdin closed), killed if it does not go in 10 s.
  auto finish = [&]() -> int {
    close(to_child[1]);
    int status = 0;
    for (int i = 0; i < 1000; ++i) {
      if (waitpid(pid, &status, WNOHANG) == pid) return status;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    return status;
  };
  char line[64] = "";
  unsigned port = 0;
  pollfd pfd{from_child[0], POLLIN, 0};
  ssize_t n = poll(&pfd, 1, 10000) == 1 ? read(from_child[0], line, sizeof(line) - 1) : -1;
  close(from_child[0]);
  if (n <= 0 || sscanf(line, "port %u", &port) != 1) {
    finish();
    FAIL() << "the slow server did not start: " << line;
  }
  const std::string target = "127.0.0.1:" + std::to_string(port);
  const long held_before = ShutDownHeld();
  {
    auto stub = Echo::NewStub(
        grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), BigMessageArgs()));
    Blob req, resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(Clock::now() + std::chrono::milliseconds(500));
    grpc::Status s = stub->Unary(&ctx, req, &resp);
    // No SETTINGS yet: the call waits out its deadline (UNAVAILABLE only if
    // the connect failed meanwhile, e.g. on a loaded machine: then there is
    // nothing to leak, and what follows still holds).
    EXPECT_TRUE(s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
                s.error_code() == grpc::StatusCode::UNAVAILABLE)
        << s.error_code() << " " << s.error_message();
  }  // the channel goes while the connection waits for SETTINGS
  const std::string mine = "client rdma:" + target + " ";
  bool gone = false;
  for (int i = 0; i < 100 && !gone; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    gone = ShutDownHeld() > held_before ||
           (i >= 50 && ConnectionsText().find(mine) == std::string::npos);
  }
  std::string text = ConnectionsText();
  EXPECT_EQ(text.find(mine), std::string::npos)
      << "the connection is still held after the server closed it:\n" << text;
  // What gRPC did (its leak, not ours): said, not checked. 0 means the
  // case did not arise this time (the connect failed, or a gRPC without
  // the leak).
  printf("e2e: endpoints gRPC shut down and kept: %ld (gRPC 1.51: 1)\n",
         ShutDownHeld() - held_before);
  int status = finish();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "slow server status " << status;
}

// grpc_rdma_connections_text: a line for each open RDMA connection, both
// ends of this process's, saying what it is doing; the client's goes with
// its channel.
TEST_F(E2eTest, OpenConnectionsAreDescribed) {
  ASSERT_NE(dlsym(RTLD_DEFAULT, "grpc_rdma_connections_text"), nullptr);
  const std::string client = "client rdma:127.0.0.1:" + std::to_string(port_) + " ";
  {
    auto stub = NewStub();
    Blob req, resp;
    req.set_data(Pattern(100000, 7));
    grpc::ClientContext ctx;
    ctx.set_deadline(Clock::now() + std::chrono::seconds(30));
    ASSERT_TRUE(stub->Unary(&ctx, req, &resp).ok());
    std::string t = ConnectionsText();
    size_t at = t.find(client);
    ASSERT_NE(at, std::string::npos) << t;
    std::string line = t.substr(at, t.find('\n', at) - at);
    EXPECT_NE(line.find(" up, "), std::string::npos) << line;
    EXPECT_NE(line.find(" writes queued"), std::string::npos) << line;
    EXPECT_NE(line.find(" bytes sent"), std::string::npos) << line;
    EXPECT_NE(line.find("; open "), std::string::npos) << line;
    EXPECT_NE(t.find("server rdma:127.0.0.1:"), std::string::npos) << t;
  }
  std::string t;
  for (int i = 0; i < 100; ++i) {
    t = ConnectionsText();
    if (t.find(client) == std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(t.find(client), std::string::npos) << "still listed after its channel went:\n" << t;
}

// grpc.rdma.tcp_only_ports: one server, two ports, one of them TCP only.
TEST_F(E2eTest, AServerArgumentMakesOneOfItsPortsTcpOnly) {
  int tcp_only = FreeTcpPort(), both = FreeTcpPort();
  ASSERT_TRUE(tcp_only != 0 && both != 0 && tcp_only != both);
  EchoService service;
  int p1 = 0, p2 = 0;
  grpc::ServerBuilder b;
  b.AddListeningPort("127.0.0.1:" + std::to_string(tcp_only), grpc::InsecureServerCredentials(),
                     &p1);
  b.AddListeningPort("127.0.0.1:" + std::to_string(both), grpc::InsecureServerCredentials(),
                     &p2);
  b.RegisterService(&service);
  b.AddChannelArgument("grpc.rdma.tcp_only_ports", " 1, " + std::to_string(tcp_only));
  auto server = b.BuildAndStart();
  ASSERT_NE(server, nullptr);
  ASSERT_EQ(p1, tcp_only);
  grpc::ChannelArguments none = BigMessageArgs();
  none.SetString("grpc.rdma.fallback", "none");
  grpc::Status s = CallOnce("127.0.0.1:" + std::to_string(tcp_only), none);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << "no RDMA CM listener there";
  s = CallOnce("127.0.0.1:" + std::to_string(tcp_only), BigMessageArgs());
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_GE(Delta("tcp_server_connections"), 1);
  EXPECT_EQ(Delta("rdma_server_connections"), 0);
  before_ = RdmaStats();
  s = CallOnce("127.0.0.1:" + std::to_string(both), none);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_GE(Delta("rdma_server_connections"), 1) << "the other port serves RDMA";
  server->Shutdown(Clock::now());
}

std::vector<std::string>* g_log_lines = nullptr;
std::mutex g_log_mu;

// gRPC's log lines (the plugin's among them) from construction to Take().
class LogCapture {
 public:
  LogCapture() {
    {
      std::lock_guard<std::mutex> l(g_log_mu);
      g_log_lines = &lines_;
    }
    gpr_set_log_function([](gpr_log_func_args* a) {
      std::lock_guard<std::mutex> l(g_log_mu);
      if (g_log_lines != nullptr) g_log_lines->push_back(a->message);
    });
  }
  ~LogCapture() { Take(); }
  // Stops capturing; the lines seen.
  std::vector<std::string> Take() {
    gpr_set_log_function(nullptr);
    std::lock_guard<std::mutex> l(g_log_mu);
    g_log_lines = nullptr;
    return lines_;
  }

 private:
  std::vector<std::string> lines_;
};

TEST_F(E2eTest, ABadArgumentValueIsLoggedAndTheEnvironmentUsed) {
  LogCapture capture;
  grpc::ChannelArguments bad = BigMessageArgs();
  bad.SetString("grpc.rdma.fallback", "sometimes");
  bad.SetInt("grpc.rdma.connect_timeout_ms", 0);
  bad.SetString("grpc.rdma.tcp_only_ports", "80,http");
  grpc::Status s = CallOnce("127.0.0.1:" + std::to_string(port_), bad);
  const std::vector<std::string> lines = capture.Take();
  ASSERT_TRUE(s.ok()) << s.error_message();
  ExpectRdma(1, 20000);
  bool fallback = false, timeout = false, ports = false;
  for (const std::string& line : lines) {
    fallback |= line.find("grpc.rdma.fallback=sometimes is not valid (allowed: tcp or none)") !=
                std::string::npos;
    timeout |= line.find("grpc.rdma.connect_timeout_ms=0 is not valid") != std::string::npos;
    ports |= line.find("grpc.rdma.tcp_only_ports=80,http is not valid (allowed: port numbers "
                       "from 1 to 65535, separated by commas)") != std::string::npos;
  }
  EXPECT_TRUE(fallback && timeout && ports) << lines.size() << " lines logged";
}

// A second server on the fixture's port, without SO_REUSEPORT: RDMA CM
// cannot listen there (the first server does) and TCP cannot bind it. gRPC
// says the port could not be added; the plugin must not claim the port
// serves TCP, as it did when it logged before TCP's bind was tried.
TEST_F(E2eTest, APortNeitherTransportCanHaveIsNotSaidToServeTcp) {
  LogCapture capture;
  EchoService service;
  grpc::ServerBuilder b;
  int port = 0;
  b.AddListeningPort("127.0.0.1:" + std::to_string(port_), grpc::InsecureServerCredentials(),
                     &port);
  b.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  b.RegisterService(&service);
  std::unique_ptr<grpc::Server> second = b.BuildAndStart();
  const std::vector<std::string> lines = capture.Take();
  EXPECT_EQ(second, nullptr) << "the port is taken";
  EXPECT_EQ(port, 0);
  bool tcp_only = false, rdma_said = false;
  for (const std::string& line : lines) {
    tcp_only |= line.find("serves TCP only") != std::string::npos;
    rdma_said |= line.find("cannot listen on RDMA CM") != std::string::npos;
  }
  EXPECT_FALSE(tcp_only) << "a port that serves nothing was said to serve TCP";
  EXPECT_FALSE(rdma_said);
  EXPECT_GT(lines.size(), 0u) << "gRPC says why the port could not be added";
  // The first server still serves, over RDMA.
  ASSERT_TRUE(CallOnce("127.0.0.1:" + std::to_string(port_), BigMessageArgs()).ok());
}

TEST_F(E2eTest, ServerShutdownMidStream) {
  EchoService service;
  int port = 0;
  auto server = StartEchoServer("127.0.0.1:0", &port, &service);
  ASSERT_NE(server, nullptr);
  auto stub = NewStub(port);
  grpc::ClientContext ctx;
  ctx.set_deadline(Clock::now() + std::chrono::seconds(30));
  Blob req, b;
  req.set_data(Pattern(10000, 12));
  req.set_repeat(100000);
  req.set_delay_ms(10);
  auto r = stub->Download(&ctx, req);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(r->Read(&b));
  std::thread stopper([&] { server->Shutdown(Clock::now() + std::chrono::milliseconds(200)); });
  auto t0 = Clock::now();
  while (r->Read(&b)) {
  }
  grpc::Status s = r->Finish();
  stopper.join();
  EXPECT_FALSE(s.ok());
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(10));
  ExpectRdma(1, 0);
  EXPECT_GE(Delta("rdma_server_connections"), 1);
}

}  // namespace
}  // namespace grpc_rdma_test
