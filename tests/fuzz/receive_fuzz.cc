// File: tests/fuzz/receive_fuzz.cc
//
// The engine's receive path, fed what a peer can send it. One engine listens
// (in this process, over softverbs); for each input a raw RDMA CM peer
// connects with a valid Hello and then plays a sequence of operations the
// input spells out: messages with any header fields (DATA, RTS, CTS,
// CREDIT, CLOSE, STANDING or no type at all, any version, credits, length,
// address, key, grant id and offset), bytes shorter than a header, announced
// transfers, RDMA WRITEs with and without immediate into the grants the
// engine made (whole, short, long, shifted, under another grant id), and
// pauses in which it takes the engine's grants.
//
// Every payload byte the peer sends is pattern(stream position) for the
// position the byte would have in the engine's byte stream if the engine
// accepted what carries it. Invariants, checked after each input:
//   - bytes the reader holds never change: each chunk, kept until the end
//     of the input, still has the bytes it was delivered with;
//   - what the engine delivered is a prefix of that stream (no byte
//     invented, lost, reordered or delivered twice), for every input whose
//     writes each went once, whole and under their own grant id, to a
//     grant not written before: a peer that writes a granted buffer twice
//     before the engine has seen the first write's completion decides what
//     that message holds (on hardware as here), so the other inputs are
//     held to no more than the bytes the peer put on the wire;
//   - the input ends within its time (libFuzzer's -timeout), and then the
//     connection closes and every pinned byte it held is given back;
//   - and the sanitizers' (ASan, UBSan) on the engine's code.
#include <arpa/inet.h>
#include <errno.h>
#include <fuzzer/FuzzedDataProvider.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <rdma/rdma_cma.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/engine.h"
#include "engine/wire.h"
#include "fuzz_check.h"

namespace {

using grpc_rdma::Connection;
using grpc_rdma::Engine;
using grpc_rdma::RecvChunk;
using grpc_rdma::RecvChunks;
namespace wire = grpc_rdma::wire;
using Clock = std::chrono::steady_clock;

// The stream byte at position p.
inline char PatternAt(uint64_t p) {
  uint64_t x = (p + 1) * 0x9E3779B97F4A7C15ull;
  return static_cast<char>(x >> 56);
}

// The engine's side: the connection of the current input and what it
// delivered.
struct Server {
  std::unique_ptr<Engine> engine;
  uint16_t port = 0;
  uint64_t baseline_pinned = 0;
  std::mutex mu;
  std::condition_variable cv;
  uint64_t generation = 0;  // the input's; a connection of another is dropped
  std::shared_ptr<Connection> conn;
  std::string got;
  std::vector<RecvChunk> held;    // every chunk delivered, kept
  std::vector<std::string> snap;  // and its bytes when delivered
  bool closed = false;
};
Server* g_server = nullptr;

void ReadOn(std::shared_ptr<Connection> c, uint64_t gen) {
  c->Read([c, gen](absl::StatusOr<RecvChunks> r) {
    {
      std::lock_guard<std::mutex> l(g_server->mu);
      if (gen != g_server->generation) return;
      if (!r.ok()) {
        g_server->closed = true;
        g_server->cv.notify_all();
        return;
      }
      for (RecvChunk& ch : *r) {
        g_server->got.append(ch.data(), ch.size());
        g_server->snap.emplace_back(ch.data(), ch.size());
        g_server->held.push_back(std::move(ch));
      }
      g_server->cv.notify_all();
    }
    ReadOn(c, gen);  // no lock held: the callback may run at once
  });
}

constexpr size_t kSlot = 65536;  // one receive buffer of the peer
constexpr int kRecvs = 8;
constexpr size_t kMem = (kRecvs + 8) * kSlot;  // receives, then what it sends

// The peer: raw rdma_cm and verbs, as a buggy or hostile engine would be.
class Peer {
 public:
  ~Peer() { Close(); }

  // Connects and sends the Hello; "" on success, else which step failed
  // and what came instead (an invariant names it when it breaks).
  std::string Connect(uint16_t port) {
    deadline_ = Clock::now() + std::chrono::milliseconds(kCmMs);
    ch_ = rdma_create_event_channel();
    if (ch_ == nullptr) return Errno("rdma_create_event_channel");
    if (rdma_create_id(ch_, &id_, nullptr, RDMA_PS_TCP) != 0) return Errno("rdma_create_id");
    sockaddr_in dst{};
    dst.sin_family = AF_INET;
    dst.sin_port = htons(port);
    inet_pton(AF_INET, "127.0.0.1", &dst.sin_addr);
    if (rdma_resolve_addr(id_, nullptr, reinterpret_cast<sockaddr*>(&dst), 10000) != 0)
      return Errno("rdma_resolve_addr");
    std::string why = Next(RDMA_CM_EVENT_ADDR_RESOLVED);
    if (!why.empty()) return why;
    if (rdma_resolve_route(id_, 10000) != 0) return Errno("rdma_resolve_route");
    if (!(why = Next(RDMA_CM_EVENT_ROUTE_RESOLVED)).empty()) return why;
    pd_ = ibv_alloc_pd(id_->verbs);
    if (pd_ == nullptr) return Errno("ibv_alloc_pd");
    cq_ = ibv_create_cq(id_->verbs, 128, nullptr, nullptr, 0);
    if (cq_ == nullptr) return Errno("ibv_create_cq");
    ibv_qp_init_attr qa{};
    qa.send_cq = qa.recv_cq = cq_;
    qa.qp_type = IBV_QPT_RC;
    qa.cap.max_send_wr = 64;
    qa.cap.max_recv_wr = kRecvs;
    qa.cap.max_send_sge = qa.cap.max_recv_sge = 1;
    qa.cap.max_inline_data = 64;
    if (rdma_create_qp(id_, pd_, &qa) != 0) return Errno("rdma_create_qp");
    qp_ = id_->qp;
    // Mapped, not malloc'd: softverbs may still write into the receive
    // slots while the connection goes down.
    mem_ = static_cast<char*>(
        mmap(nullptr, kMem, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    if (mem_ == MAP_FAILED) {
      mem_ = nullptr;
      return Errno("mmap");
    }
    mr_ = ibv_reg_mr(pd_, mem_, kMem, IBV_ACCESS_LOCAL_WRITE);
    if (mr_ == nullptr) return Errno("ibv_reg_mr");
    for (int i = 0; i < kRecvs; ++i)
      if (!PostRecv(i)) return Errno("ibv_post_recv");
    wire::Hello h{wire::kMagic, wire::kVersion, kRecvs, 8192, 4, wire::kHelloSolicited, 0};
    rdma_conn_param p{};
    p.private_data = &h;
    p.private_data_len = sizeof(h);
    p.rnr_retry_count = 1;  // more messages than credits: an error, not a hang
    p.retry_count = 1;
    if (rdma_connect(id_, &p) != 0) return Errno("rdma_connect");
    return Next(RDMA_CM_EVENT_ESTABLISHED);
  }

  // A message: header `h` and `n` stream bytes from position `at`.
  void Send(const wire::Header& h, uint64_t at, size_t n) {
    char* buf = mem_ + kRecvs * kSlot;
    memcpy(buf, &h, sizeof(h));
    for (size_t i = 0; i < n; ++i) buf[sizeof(h) + i] = PatternAt(at + i);
    Post(IBV_WR_SEND, buf, sizeof(h) + n, 0, 0, 0);
  }
  // Raw bytes (fewer than a header).
  void SendRaw(const std::string& bytes) {
    char* buf = mem_ + kRecvs * kSlot;
    memcpy(buf, bytes.data(), bytes.size());
    Post(IBV_WR_SEND, buf, bytes.size(), 0, 0, 0);
  }
  // `n` stream bytes from position `at`, written to addr/rkey, with the
  // immediate `imm` unless !with_imm.
  void Write(uint64_t addr, uint32_t rkey, uint64_t at, size_t n, bool with_imm, uint32_t imm) {
    n = std::min(n, 7 * kSlot);
    char* buf = mem_ + (kRecvs + 1) * kSlot;
    for (size_t i = 0; i < n; ++i) buf[i] = PatternAt(at + i);
    Post(with_imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE, buf, n, addr, rkey, imm);
  }

  // Takes what has completed for `ms` milliseconds: the engine's grants are
  // kept, our receives reposted. Stops early once our sends are all done
  // if `until_sent`.
  void Pump(int ms, bool until_sent) {
    auto end = Clock::now() + std::chrono::milliseconds(ms);
    do {
      ibv_wc wc[16];
      int n = ibv_poll_cq(cq_, 16, wc);
      for (int i = 0; i < n; ++i) {
        if (wc[i].status != IBV_WC_SUCCESS) {
          broken_ = true;  // our QP is in error: nothing more completes
          continue;
        }
        if (wc[i].opcode != IBV_WC_RECV) {
          --sends_out_;
          continue;
        }
        wire::Header m{};
        if (wc[i].byte_len >= sizeof(m)) memcpy(&m, mem_ + wc[i].wr_id * kSlot, sizeof(m));
        if (m.type == wire::kCts) cts.push_back(m);
        if (m.type == wire::kStanding) standing.push_back(m);
        PostRecv(static_cast<int>(wc[i].wr_id));
      }
      if (broken_ || (until_sent && sends_out_ == 0)) return;
      if (n == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
    } while (Clock::now() < end);
  }

  bool broken() const { return broken_; }

  void Close() {
    if (id_ != nullptr && qp_ != nullptr) {
      rdma_disconnect(id_);
      Next(RDMA_CM_EVENT_DISCONNECTED, 2000);  // not waited for longer: nothing checks it
    }
    if (qp_ != nullptr) rdma_destroy_qp(id_);
    qp_ = nullptr;
    if (mr_ != nullptr) ibv_dereg_mr(mr_);
    mr_ = nullptr;
    if (cq_ != nullptr) ibv_destroy_cq(cq_);
    cq_ = nullptr;
    if (pd_ != nullptr) ibv_dealloc_pd(pd_);
    pd_ = nullptr;
    if (id_ != nullptr) rdma_destroy_id(id_);
    id_ = nullptr;
    if (ch_ != nullptr) rdma_destroy_event_channel(ch_);
    ch_ = nullptr;
    if (mem_ != nullptr) munmap(mem_, kMem);
    mem_ = nullptr;
  }

  std::vector<wire::Header> cts, standing;  // the engine's grants, as they came

 private:
  // How long the connection's steps may take in all. The engine answers a
  // connection request from its own thread; next to other builds and tests
  // (as in CI, where this runs beside a compiler) that thread can wait
  // whole seconds for a CPU, so the bound is generous. With the handover's
  // wait (RunInput) it stays below the target's -timeout (run_fuzzers.sh),
  // so a lost answer is a named failure, not libFuzzer's timeout.
  static constexpr int kCmMs = 20000;
  Clock::time_point deadline_{};

  static std::string Errno(const char* what) {
    return std::string(what) + " failed: " + strerror(errno);
  }
  // The next CM event within `ms` (0: by the connection's deadline), if it
  // is `want` (acked either way); otherwise what came instead.
  std::string Next(rdma_cm_event_type want, int ms = 0) {
    // libFuzzer's -timeout watchdog is a SIGALRM (every timeout/2 + 1 s):
    // an interrupted wait goes on for what is left of it.
    pollfd p{ch_->fd, POLLIN, 0};
    auto end = ms > 0 ? Clock::now() + std::chrono::milliseconds(ms) : deadline_;
    int r;
    do {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now());
      r = poll(&p, 1, std::max<int>(0, static_cast<int>(left.count())));
    } while (r < 0 && errno == EINTR);
    if (r != 1)
      return std::string("no ") + rdma_event_str(want) + " within " +
             (ms > 0 ? std::to_string(ms) + " ms" : std::string("the connection's ") +
                                                       std::to_string(kCmMs) + " ms") +
             (r < 0 ? std::string(": poll: ") + strerror(errno) : std::string());
    rdma_cm_event* e = nullptr;
    if (rdma_get_cm_event(ch_, &e) != 0) return Errno("rdma_get_cm_event");
    std::string why;
    if (e->event != want)
      why = std::string(rdma_event_str(e->event)) + " (status " + std::to_string(e->status) +
            ") instead of " + rdma_event_str(want);
    rdma_ack_cm_event(e);
    return why;
  }
  bool PostRecv(int i) {
    ibv_sge s{reinterpret_cast<uint64_t>(mem_ + i * kSlot), kSlot, mr_->lkey};
    ibv_recv_wr w{}, *bad;
    w.wr_id = static_cast<uint64_t>(i);
    w.sg_list = &s;
    w.num_sge = 1;
    return ibv_post_recv(qp_, &w, &bad) == 0;
  }
  void Post(ibv_wr_opcode op, char* buf, size_t n, uint64_t addr, uint32_t rkey, uint32_t imm) {
    if (broken_ || sends_out_ >= 48) return;
    ibv_sge s{reinterpret_cast<uint64_t>(buf), static_cast<uint32_t>(n), mr_->lkey};
    ibv_send_wr w{}, *bad;
    w.wr_id = 1;
    w.sg_list = &s;
    w.num_sge = n > 0 ? 1 : 0;
    w.opcode = op;
    w.send_flags = IBV_SEND_SIGNALED | IBV_SEND_SOLICITED;
    w.imm_data = htonl(imm);
    w.wr.rdma.remote_addr = addr;
    w.wr.rdma.rkey = rkey;
    if (ibv_post_send(qp_, &w, &bad) == 0) ++sends_out_;
  }

  rdma_event_channel* ch_ = nullptr;
  rdma_cm_id* id_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_cq* cq_ = nullptr;
  ibv_qp* qp_ = nullptr;
  ibv_mr* mr_ = nullptr;
  char* mem_ = nullptr;
  int sends_out_ = 0;
  bool broken_ = false;
};

// What an input asks the peer to do.
enum Op : uint8_t { kMessage, kRaw, kAnnounce, kChunk, kStandingWrite, kPlainWrite, kPause, kOps };

// FUZZ_TRACE=1: each input's operations on stderr (to read a kept input).
bool Tracing() {
  static const bool on = getenv("FUZZ_TRACE") != nullptr;
  return on;
}
#define TRACE(...)                              \
  do {                                          \
    if (Tracing()) fprintf(stderr, __VA_ARGS__); \
  } while (0)

void RunInput(FuzzedDataProvider& in) {
  Server& s = *g_server;
  uint64_t gen;
  {
    std::lock_guard<std::mutex> l(s.mu);
    gen = ++s.generation;
    s.conn.reset();
    s.got.clear();
    s.held.clear();
    s.snap.clear();
    s.closed = false;
  }
  Peer peer;
  std::string why = peer.Connect(s.port);
  if (!why.empty()) fprintf(stderr, "the peer's connect: %s\n", why.c_str());
  FUZZ_CHECK(why.empty(), "the peer connects to the engine");
  {
    std::unique_lock<std::mutex> l(s.mu);
    FUZZ_CHECK(s.cv.wait_for(l, std::chrono::seconds(20), [&] { return s.conn != nullptr; }),
               "the engine hands the connection over");
  }
  ReadOn(s.conn, gen);
  peer.Pump(2, false);  // the standing grants the engine makes at once

  uint64_t pos = 0;          // stream position of the next accepted byte
  uint64_t xfer_base = 0;    // an announced transfer's first byte
  uint64_t on_wire = 0;      // payload bytes the peer sent or wrote
  // Each write went once, whole, under its own grant id, to a grant not
  // written before (see the invariants above).
  bool clean = true;
  std::vector<uint64_t> written;  // grant addresses written to
  auto first_write_to = [&](uint64_t a) {
    bool first = std::find(written.begin(), written.end(), a) == written.end();
    written.push_back(a);
    return first;
  };
  for (int step = 0; step < 24 && in.remaining_bytes() > 0 && !peer.broken(); ++step) {
    switch (static_cast<Op>(in.ConsumeIntegralInRange<int>(0, kOps - 1))) {
      case kMessage: {
        wire::Header h{};
        h.type = in.ConsumeBool() ? wire::kData : in.ConsumeIntegral<uint8_t>();
        h.version = in.ConsumeIntegralInRange<int>(0, 7) == 0 ? in.ConsumeIntegral<uint8_t>()
                                                             : wire::kVersion;
        h.credits = in.ConsumeIntegralInRange<uint16_t>(0, in.ConsumeBool() ? 2 : 0xffff);
        size_t n = in.ConsumeIntegralInRange<size_t>(0, 9000);
        h.len = in.ConsumeBool() ? static_cast<uint32_t>(n) : in.ConsumeIntegral<uint32_t>();
        h.a = in.ConsumeIntegral<uint64_t>();
        h.rkey = in.ConsumeIntegral<uint32_t>();
        h.grant = in.ConsumeIntegral<uint32_t>();
        h.offset = in.ConsumeIntegral<uint64_t>();
        TRACE("message type %u version %u credits %u len %u (payload %zu at %llu) a %llx rkey %x grant %u offset %llu\n",
              h.type, h.version, h.credits, h.len, n, (unsigned long long)pos,
              (unsigned long long)h.a, h.rkey, h.grant, (unsigned long long)h.offset);
        peer.Send(h, pos, n);
        on_wire += n;
        if (h.type == wire::kData && h.version == wire::kVersion && h.len == n && n > 0) pos += n;
        break;
      }
      case kRaw:
        TRACE("raw bytes\n");
        peer.SendRaw(in.ConsumeBytesAsString(in.ConsumeIntegralInRange<size_t>(0, 31)));
        break;
      case kAnnounce: {
        wire::Header h{};
        h.type = wire::kRts;
        h.version = wire::kVersion;
        h.credits = in.ConsumeIntegralInRange<uint16_t>(0, 2);
        h.a = in.ConsumeBool() ? in.ConsumeIntegralInRange<uint64_t>(0, 300000)
                               : in.ConsumeIntegral<uint64_t>();
        TRACE("announce %llu at %llu\n", (unsigned long long)h.a, (unsigned long long)pos);
        peer.Send(h, 0, 0);
        xfer_base = pos;
        if (h.a > 0 && h.a <= 300000) pos += h.a;
        break;
      }
      case kChunk: {
        if (peer.cts.empty()) break;
        const wire::Header g =
            peer.cts[in.ConsumeIntegralInRange<size_t>(0, peer.cts.size() - 1)];
        size_t n = in.ConsumeBool() ? g.len : in.ConsumeIntegralInRange<size_t>(0, g.len + 4096);
        int64_t shift = in.ConsumeBool() ? 0 : in.ConsumeIntegralInRange<int64_t>(-8192, 8192);
        uint32_t imm = in.ConsumeBool() ? g.grant : in.ConsumeIntegral<uint32_t>();
        TRACE("chunk: grant %u (offset %llu len %u): %zu bytes shift %lld imm %u\n", g.grant,
              (unsigned long long)g.offset, g.len, n, (long long)shift, imm);
        if (!first_write_to(g.a) || shift != 0 || n != g.len || imm != g.grant) clean = false;
        on_wire += n;
        peer.Write(g.a + shift, g.rkey, xfer_base + g.offset, n, true, imm);
        break;
      }
      case kStandingWrite: {
        if (peer.standing.empty()) break;
        size_t i = in.ConsumeIntegralInRange<size_t>(0, peer.standing.size() - 1);
        const wire::Header g = peer.standing[i];
        if (in.ConsumeBool()) peer.standing.erase(peer.standing.begin() + i);  // used up
        size_t n = in.ConsumeIntegralInRange<size_t>(0, g.len + 4096);
        uint32_t imm = in.ConsumeBool() ? g.grant : in.ConsumeIntegral<uint32_t>();
        TRACE("standing write: grant %u (len %u): %zu bytes imm %u at %llu\n", g.grant, g.len, n,
              imm, (unsigned long long)pos);
        if (!first_write_to(g.a) || imm != g.grant) clean = false;
        on_wire += n;
        peer.Write(g.a, g.rkey, pos, n, true, imm);
        if (n > 8192 && n <= g.len && imm == g.grant) pos += n;
        break;
      }
      case kPlainWrite: {  // no immediate: the engine is not told
        std::vector<wire::Header>& from = in.ConsumeBool() ? peer.cts : peer.standing;
        if (from.empty()) break;
        const wire::Header g = from[in.ConsumeIntegralInRange<size_t>(0, from.size() - 1)];
        int64_t shift = in.ConsumeIntegralInRange<int64_t>(-8192, 8192);
        size_t n = in.ConsumeIntegralInRange<size_t>(0, g.len);
        TRACE("plain write: grant %u: %zu bytes shift %lld\n", g.grant, n, (long long)shift);
        clean = false;
        on_wire += n;
        peer.Write(g.a + shift, g.rkey, 0, n, false, 0);
        break;
      }
      case kPause:
        peer.Pump(in.ConsumeIntegralInRange<int>(0, 5), false);
        TRACE("pause: %zu grants, %zu standing grants\n", peer.cts.size(), peer.standing.size());
        break;
      default:
        break;
    }
  }
  // Our sends completed (or our QP failed), then the engine has had time
  // to deliver what it accepted.
  peer.Pump(1000, true);
  {
    std::unique_lock<std::mutex> l(s.mu);
    while (!s.closed && s.cv.wait_for(l, std::chrono::milliseconds(20)) !=
                            std::cv_status::timeout) {
    }
    TRACE("delivered %zu of %llu, %s, %s\n", s.got.size(), (unsigned long long)pos,
          s.closed ? "closed" : "open", clean ? "clean" : "writes overlapped");
    for (size_t i = 0; i < s.held.size(); ++i)
      FUZZ_CHECK(s.held[i].size() == s.snap[i].size() &&
                     memcmp(s.held[i].data(), s.snap[i].data(), s.snap[i].size()) == 0,
                 "bytes the reader holds never change");
    FUZZ_CHECK(s.got.size() <= on_wire, "no more bytes delivered than the peer put on the wire");
    if (clean) {
      for (size_t i = 0; i < s.got.size(); ++i)
        FUZZ_CHECK(s.got[i] == PatternAt(i), "every delivered byte is the peer's, in order");
      FUZZ_CHECK(s.got.size() <= pos, "nothing delivered beyond what the peer's messages carry");
    }
    s.held.clear();  // given back before the connection goes
  }
  peer.Close();
  std::shared_ptr<Connection> c;
  {
    std::lock_guard<std::mutex> l(s.mu);
    c = std::move(s.conn);
  }
  c->Shutdown(absl::UnavailableError("fuzz input done"));
  c.reset();
  auto end = Clock::now() + std::chrono::seconds(5);
  while (s.engine->pinned_bytes() > s.baseline_pinned && Clock::now() < end)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  FUZZ_CHECK(s.engine->pinned_bytes() <= s.baseline_pinned,
             "a closed connection gives back every pinned byte within 5 s");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // One softverbs device on loopback, resolution without its emulated
  // delay (this target measures nothing).
  setenv("SOFTVERBS_DEVICES", "mlx5_0:127.0.0.1", 0);
  setenv("SOFTVERBS_RESOLVE_US", "0", 0);
  grpc_rdma::Options o;
  o.chunk_size = 64 << 10;  // announced transfers in few, small grants
  o.buf_size = 64 << 20;
  o.eager_depth = 16;
  o.malloc_tune = false;
  auto e = Engine::Create(o);
  FUZZ_CHECK(e.ok(), "an engine over softverbs (run under softverbs-run, or with its libraries)");
  g_server = new Server();
  g_server->engine = std::move(*e);
  sockaddr_in any{};
  any.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.1", &any.sin_addr);
  auto port = g_server->engine->Listen(any, [](std::shared_ptr<Connection> c) {
    std::lock_guard<std::mutex> l(g_server->mu);
    if (g_server->conn == nullptr) g_server->conn = std::move(c);
    g_server->cv.notify_all();
  });
  FUZZ_CHECK(port.ok(), "the engine listens on loopback");
  g_server->port = *port;
  g_server->baseline_pinned = g_server->engine->pinned_bytes();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  RunInput(in);
  return 0;
}
