// A server that joins TCP connections (grpc.rdma.tcp_first), met by an RDMA
// connection from an engine of the test's own (not the plugin's), so it can
// name any TCP connection with any token:
//  - one that names a TCP connection the server never accepts is held for
//    kJoinWait (5 s, src/glue/server.cc) and closed then, by a timer, with
//    no later connection to sweep it;
//  - one that names a TCP connection with a token that stream did not carry
//    is refused at once, and the stream stays joinable with its own token,
//    also when both came before the stream;
//  - a plaintext stream that carries no token is joined by no one: one that
//    names it is closed at once;
//  - wrong tokens one after another are each refused at once but logged
//    once per 10 s, not each time;
//  - a joined stream's token, sent again, joins nothing;
//  - at most four RDMA connections wait for one stream's head.
// The TCP connections are the test's own sockets, which write what a
// TF_RDMA_TCP_FIRST client's gRPC writes first: HTTP/2's preface, a SETTINGS
// frame and the join token's frame (src/glue/switch_endpoint.h).
#include <grpc/support/log.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "echo_service.h"
#include "engine/engine.h"
#include "engine/testing.h"
#include "grpc_rdma/options.h"

namespace {

using SteadyClock = std::chrono::steady_clock;
using ConnPtr = std::shared_ptr<grpc_rdma::Connection>;

constexpr char kPreface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

// A joining server on 127.0.0.1 and an engine to meet it.
class Join : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    b.RegisterService(&service_);
    b.AddChannelArgument("grpc.rdma.tcp_first", 1);
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    grpc_rdma::Options options;
    auto engine = grpc_rdma::Engine::Create(options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = std::move(*engine);
  }
  void TearDown() override {
    for (int fd : fds_) close(fd);
    if (server_) server_->Shutdown();
  }

  // An RDMA connection to the server that joins `joins` with `token`.
  absl::StatusOr<ConnPtr> ConnectJoining(const sockaddr_in& joins, const std::string& token) {
    grpc_rdma::JoinRequest req;
    req.tcp = joins;
    memcpy(req.token, token.data(), std::min(token.size(), sizeof(req.token)));
    std::promise<absl::StatusOr<ConnPtr>> connected;
    engine_->Connect(
        grpc_rdma::testing::Loopback(static_cast<uint16_t>(port_)), 5000,
        [&](absl::StatusOr<ConnPtr> r) { connected.set_value(std::move(r)); }, &req);
    return connected.get_future().get();
  }

  // A TCP socket of the test's own, bound on loopback (not yet connected):
  // its descriptor, and its end as the server will see its peer.
  int BoundSocket(sockaddr_in* me) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    EXPECT_GE(fd, 0);
    fds_.push_back(fd);
    sockaddr_in any = grpc_rdma::testing::Loopback(0);
    EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&any), sizeof(any)), 0) << strerror(errno);
    socklen_t len = sizeof(*me);
    EXPECT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(me), &len), 0);
    return fd;
  }
  // Connects `fd` to the server and writes `bytes` on it.
  void ConnectAndWrite(int fd, const std::string& bytes) {
    sockaddr_in to = grpc_rdma::testing::Loopback(static_cast<uint16_t>(port_));
    EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)), 0) << strerror(errno);
    EXPECT_EQ(write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  }
  // A TCP connection of the test's own to the server, which writes `bytes`;
  // its end, as the server sees its peer.
  sockaddr_in TcpWriting(const std::string& bytes) {
    sockaddr_in me{};
    ConnectAndWrite(BoundSocket(&me), bytes);
    return me;
  }

  int port_ = 0;
  grpc_rdma_test::EchoService service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc_rdma::Engine> engine_;
  std::vector<int> fds_;
};

// HTTP/2's preface and an empty SETTINGS frame, as a client's gRPC starts.
std::string PrefaceAndSettings() {
  std::string s(kPreface, 24);
  s.append("\0\0\0\x04\0\0\0\0\0", 9);
  return s;
}

// The join token's frame (switch_endpoint.h: length 24, type 0xf5, stream 0,
// "GRDMAJT1", the token).
std::string TokenFrame(const std::string& token) {
  std::string f("\0\0\x18\xf5\0\0\0\0\0", 9);
  return f + "GRDMAJT1" + token;
}

// What comes on `conn` within `wait`: the first bytes (up to 16), or how
// it ended.
struct Outcome {
  std::string bytes;
  absl::Status ended;
  std::chrono::milliseconds after{0};
};
// `after` counts from `started`: by default, from this call.
Outcome FirstBytes(const ConnPtr& conn, std::chrono::seconds wait,
                   SteadyClock::time_point started = SteadyClock::now()) {
  auto p = std::make_shared<std::promise<absl::StatusOr<std::string>>>();
  conn->Read([p](absl::StatusOr<grpc_rdma::RecvChunks> r) {
    if (!r.ok()) return p->set_value(r.status());
    std::string s;
    for (const auto& c : *r) s.append(c.data(), c.size());
    p->set_value(s);
  });
  std::future<absl::StatusOr<std::string>> f = p->get_future();
  Outcome o;
  if (f.wait_for(wait) != std::future_status::ready) {
    o.ended = absl::DeadlineExceededError("nothing came");
    conn->Shutdown(absl::CancelledError("test over"));
    f.wait();
    return o;
  }
  o.after = std::chrono::duration_cast<std::chrono::milliseconds>(SteadyClock::now() - started);
  absl::StatusOr<std::string> r = f.get();
  if (r.ok()) {
    o.bytes = r->substr(0, 16);
  } else {
    o.ended = r.status();
  }
  return o;
}

// An RDMA connection the server should refuse at once (the stream it names
// came, with another token or none): what came on it, timed from before the
// connect. The server closes it right after its accept, so the client may
// hear of the close before it hears the connection is up: its connect then
// fails (a flushed receive), which is the same refusal, seen earlier.
Outcome RefusedOne(const std::function<absl::StatusOr<ConnPtr>()>& connect) {
  SteadyClock::time_point started = SteadyClock::now();
  absl::StatusOr<ConnPtr> conn = connect();
  if (!conn.ok()) {
    fprintf(stderr, "refused before the connect completed: %s\n",
            conn.status().ToString().c_str());
    Outcome o;
    o.ended = conn.status();
    o.after = std::chrono::duration_cast<std::chrono::milliseconds>(SteadyClock::now() - started);
    return o;
  }
  Outcome o = FirstBytes(*conn, std::chrono::seconds(30), started);
  (*conn)->Shutdown(absl::CancelledError("test over"));
  return o;
}

TEST_F(Join, AnRdmaConnectionNoTcpConnectionMeetsIsClosedAfterItsWait) {
  // Names the TCP connection from 127.0.0.1:1, which never comes. Timed
  // from before the connect: the server's wait starts at its accept, which
  // may come before the client hears of it.
  SteadyClock::time_point started = SteadyClock::now();
  auto conn = ConnectJoining(grpc_rdma::testing::Loopback(1), std::string(16, 'x'));
  ASSERT_TRUE(conn.ok()) << "the server did not accept the RDMA connection: " << conn.status();
  // Nothing comes on it (the server writes its header only once it joined),
  // until it is closed.
  Outcome o = FirstBytes(*conn, std::chrono::seconds(30), started);
  ASSERT_TRUE(o.bytes.empty()) << "bytes came on an unjoined connection";
  ASSERT_FALSE(absl::IsDeadlineExceeded(o.ended))
      << "the server held the unjoined RDMA connection for over 30 s";
  EXPECT_GE(o.after.count(), 3000) << "closed before its wait was over: " << o.ended;
  (*conn)->Shutdown(absl::CancelledError("test over"));
}

TEST_F(Join, AWrongTokenIsRefusedAtOnceAndTheRightOneJoins) {
  const std::string token = "0123456789abcdef";
  sockaddr_in tcp = TcpWriting(PrefaceAndSettings() + TokenFrame(token));

  Outcome o = RefusedOne([&] { return ConnectJoining(tcp, "fedcba9876543210"); });
  EXPECT_TRUE(o.bytes.empty()) << "the server joined an RDMA connection with a wrong token";
  EXPECT_FALSE(o.ended.ok()) << "the wrong token was not refused";
  EXPECT_FALSE(absl::IsDeadlineExceeded(o.ended)) << "the wrong token was not refused";
  EXPECT_LT(o.after.count(), 3000) << "the wrong token was held, not refused at once";

  // The stream's own token joins it: the server's switch header comes
  // first on the RDMA connection ("GRDMASW1", then its TCP bytes).
  auto right = ConnectJoining(tcp, token);
  ASSERT_TRUE(right.ok()) << right.status();
  o = FirstBytes(*right, std::chrono::seconds(30));
  ASSERT_TRUE(o.ended.ok()) << "the right token did not join: " << o.ended;
  EXPECT_EQ(o.bytes.substr(0, 8), "GRDMASW1");
  (*right)->Shutdown(absl::CancelledError("test over"));
}

TEST_F(Join, AWrongTokenThatCameFirstKeepsNoOneOut) {
  // Both RDMA connections wait for the stream they name: it has not come.
  const std::string token = "0123456789abcdef";
  sockaddr_in tcp{};
  int fd = BoundSocket(&tcp);
  auto wrong = ConnectJoining(tcp, "fedcba9876543210");
  ASSERT_TRUE(wrong.ok()) << wrong.status();
  auto right = ConnectJoining(tcp, token);
  ASSERT_TRUE(right.ok()) << right.status();
  // The server takes them in on its own RDMA CM events, which may come
  // after the client's: let it, so that they wait before the stream comes.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ConnectAndWrite(fd, PrefaceAndSettings() + TokenFrame(token));

  Outcome o = FirstBytes(*right, std::chrono::seconds(30));
  ASSERT_TRUE(o.ended.ok()) << "the right token, second to come, did not join: " << o.ended;
  EXPECT_EQ(o.bytes.substr(0, 8), "GRDMASW1");
  o = FirstBytes(*wrong, std::chrono::seconds(30));
  EXPECT_TRUE(o.bytes.empty()) << "the server joined an RDMA connection with a wrong token";
  EXPECT_FALSE(absl::IsDeadlineExceeded(o.ended)) << "the wrong token was not refused";
  EXPECT_LT(o.after.count(), 3000) << "the wrong token was held, not refused with the stream's head";
  (*wrong)->Shutdown(absl::CancelledError("test over"));
  (*right)->Shutdown(absl::CancelledError("test over"));
}

TEST_F(Join, TheSameTokenAgainAfterTheJoinIsNotJoined) {
  const std::string token = "0123456789abcdef";
  sockaddr_in tcp = TcpWriting(PrefaceAndSettings() + TokenFrame(token));
  auto first = ConnectJoining(tcp, token);
  ASSERT_TRUE(first.ok()) << first.status();
  Outcome o = FirstBytes(*first, std::chrono::seconds(30));
  ASSERT_TRUE(o.ended.ok()) << "the stream's token did not join: " << o.ended;
  ASSERT_EQ(o.bytes.substr(0, 8), "GRDMASW1");
  // The stream is joined: one more naming it, its token copied, is met as
  // one naming a connection the server does not know (held, then closed).
  SteadyClock::time_point started = SteadyClock::now();
  auto again = ConnectJoining(tcp, token);
  if (again.ok()) {
    o = FirstBytes(*again, std::chrono::seconds(30), started);
    EXPECT_TRUE(o.bytes.empty()) << "a joined stream was joined again";
    EXPECT_FALSE(o.ended.ok());
    EXPECT_FALSE(absl::IsDeadlineExceeded(o.ended)) << "held for over 30 s";
    EXPECT_GE(o.after.count(), 3000) << "closed before its wait was over: " << o.ended;
    (*again)->Shutdown(absl::CancelledError("test over"));
  } else {
    ADD_FAILURE() << "the server did not accept the second RDMA connection: " << again.status();
  }
  (*first)->Shutdown(absl::CancelledError("test over"));
}

// At most kMaxEarlyPerStream (4, src/glue/server.cc) RDMA connections wait
// for one stream's head; one more is closed at once. The stream then still
// joins its own token.
TEST_F(Join, AtMostFourWaitForOneStreamAndItStillJoinsItsOwn) {
  const std::string token = "0123456789abcdef";
  sockaddr_in tcp{};
  int fd = BoundSocket(&tcp);
  std::vector<ConnPtr> waiting;
  for (int i = 0; i < 4; ++i) {
    auto c = ConnectJoining(tcp, std::string(16, static_cast<char>('a' + i)));
    ASSERT_TRUE(c.ok()) << "wrong token " << i << ": " << c.status();
    waiting.push_back(*c);
  }
  // The server takes them in on its own RDMA CM events, which may come
  // after the client's: let it, so that all four wait.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  Outcome o = RefusedOne([&] { return ConnectJoining(tcp, std::string(16, 'e')); });
  EXPECT_TRUE(o.bytes.empty()) << "a fifth connection for one stream was joined";
  EXPECT_FALSE(o.ended.ok()) << "a fifth connection for one stream was kept";
  EXPECT_FALSE(absl::IsDeadlineExceeded(o.ended)) << "held for over 30 s";
  EXPECT_LT(o.after.count(), 3000) << "a fifth connection waited, not closed at once";

  ConnectAndWrite(fd, PrefaceAndSettings() + TokenFrame(token));
  for (size_t i = 0; i < waiting.size(); ++i) {
    o = FirstBytes(waiting[i], std::chrono::seconds(30));
    EXPECT_TRUE(o.bytes.empty()) << "wrong token " << i << " was joined";
    EXPECT_FALSE(absl::IsDeadlineExceeded(o.ended)) << "wrong token " << i << " not refused";
    EXPECT_LT(o.after.count(), 3000) << "wrong token " << i << " held, not refused with the head";
    waiting[i]->Shutdown(absl::CancelledError("test over"));
  }
  auto right = ConnectJoining(tcp, token);
  ASSERT_TRUE(right.ok()) << right.status();
  o = FirstBytes(*right, std::chrono::seconds(30));
  ASSERT_TRUE(o.ended.ok()) << "the stream's own token did not join after the refusals: " << o.ended;
  EXPECT_EQ(o.bytes.substr(0, 8), "GRDMASW1");
  (*right)->Shutdown(absl::CancelledError("test over"));
}

TEST_F(Join, APlaintextStreamWithoutATokenIsJoinedByNoOne) {
  // What a TCP-first client from before the token, or a plain client, sends.
  sockaddr_in tcp = TcpWriting(PrefaceAndSettings() + std::string("\0\0\0\x04\x01\0\0\0\0", 9));
  Outcome o = RefusedOne([&] { return ConnectJoining(tcp, std::string(16, '\0')); });
  EXPECT_TRUE(o.bytes.empty()) << "a stream without a token was joined";
  EXPECT_FALSE(o.ended.ok()) << "a stream without a token was joined";
  EXPECT_FALSE(absl::IsDeadlineExceeded(o.ended)) << "held for over 30 s";
  EXPECT_LT(o.after.count(), 3000) << "held, not closed at once: " << o.ended;
}

// gpr_log's lines about refused join tokens in this process, counted from
// its start (gRPC's log goes through this from before gRPC starts).
std::atomic<int> g_refusal_lines{0};
void CountRefusals(gpr_log_func_args* args) {
  if (strstr(args->message, "refusing an RDMA connection") != nullptr) ++g_refusal_lines;
  fprintf(stderr, "%s:%d] %s\n", args->file, args->line, args->message);
}
const bool g_counting = [] {
  gpr_set_log_function(CountRefusals);
  return true;
}();

TEST_F(Join, WrongTokensOneAfterAnotherAreLoggedOnceNotEachTime) {
  // A client that keeps trying tokens a stream did not carry (a scan, or
  // one misconfigured) must not flood the server's log: one ERROR line per
  // 10 s (src/glue/server.cc), each refusal still at once.
  ASSERT_TRUE(g_counting);
  const std::string token = "0123456789abcdef";
  sockaddr_in tcp = TcpWriting(PrefaceAndSettings() + TokenFrame(token));
  const int before = g_refusal_lines.load();
  constexpr int kTries = 6;
  for (int i = 0; i < kTries; ++i) {
    Outcome o = RefusedOne(
        [&] { return ConnectJoining(tcp, "fedcba987654321" + std::to_string(i)); });
    EXPECT_TRUE(o.bytes.empty()) << "try " << i << ": joined with a wrong token";
    EXPECT_FALSE(o.ended.ok()) << "try " << i << ": not refused";
    EXPECT_FALSE(absl::IsDeadlineExceeded(o.ended)) << "try " << i << ": not refused";
  }
  // Two at most: the tries may straddle one 10 s mark on a slow machine.
  EXPECT_LE(g_refusal_lines.load() - before, 2) << "every refusal was logged";
  // The first refusal in a process is always logged (this test's, or an
  // earlier test's in the same process).
  EXPECT_GE(g_refusal_lines.load(), 1) << "no refusal was ever logged";
  // The stream is still joinable with its own token.
  auto right = ConnectJoining(tcp, token);
  ASSERT_TRUE(right.ok()) << right.status();
  Outcome o = FirstBytes(*right, std::chrono::seconds(30));
  ASSERT_TRUE(o.ended.ok()) << "the right token did not join after the wrong ones: " << o.ended;
  EXPECT_EQ(o.bytes.substr(0, 8), "GRDMASW1");
  (*right)->Shutdown(absl::CancelledError("test over"));
}

}  // namespace
