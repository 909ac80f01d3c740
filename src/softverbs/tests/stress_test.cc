// Many QPs on many threads at once. softverbs moves every wire of the
// process from whichever thread gets there (the agent, a thread polling
// its CQ, a thread asleep on a completion channel), so one connection's
// traffic must stay whole and in order whatever the others do, and no
// wake-up may be lost between them. Each pair of QPs here has two threads
// of its own (one per side) running rounds of SEND, RDMA WRITE with
// immediate and RDMA READ, half of the pairs waiting on completion
// channels and half polling, while another thread registers and
// deregisters memory and makes, uses and destroys QP pairs. Every byte is
// checked, and every wait has a deadline: a completion that never comes
// fails the test instead of hanging it.
#include <gtest/gtest.h>
#include <endian.h>
#include <poll.h>
#include <string.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "sv_test_util.h"

using namespace svtest;

namespace {

constexpr int kAll = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
constexpr size_t kMaxMsg = 300000;  // above the 256 KiB a waiter moves itself
const size_t kSizes[] = {1, 64, 4096, 65536, 8, kMaxMsg, 1000, 131072};
constexpr int kWaitMs = 30000;

int Rounds() {
  const char* v = getenv("SOFTVERBS_STRESS_ROUNDS");
  return v != nullptr && atoi(v) > 0 ? atoi(v) : 400;
}

// What went wrong on a thread, for the main thread to report (gtest's
// assertions belong on the main thread).
struct Errors {
  std::mutex mu;
  std::vector<std::string> list;
  void Add(const std::string& e) {
    std::lock_guard<std::mutex> g(mu);
    if (list.size() < 20) list.push_back(e);
  }
  bool Any() {
    std::lock_guard<std::mutex> g(mu);
    return !list.empty();
  }
};

// One side's way of waiting: on its completion channel (armed, then asleep
// in poll() on the channel's fd with a deadline) or by polling the CQ.
class Waiter {
 public:
  Waiter(Side* s, bool channel) : s_(s), channel_(channel) {}

  // Takes completions until `want` of them match `pred` (others, the
  // side's send completions, are checked and counted on the way).
  bool Take(int want, ibv_wc_opcode op, std::vector<ibv_wc>* out, std::string* err) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kWaitMs);
    int got = 0;
    while (got < want) {
      ibv_wc wc[16];
      int n = ibv_poll_cq(s_->cq, 16, wc);
      if (n < 0) {
        *err = "ibv_poll_cq failed";
        return false;
      }
      for (int i = 0; i < n; ++i) {
        if (wc[i].status != IBV_WC_SUCCESS) {
          *err = std::string("completion in error: ") + ibv_wc_status_str(wc[i].status);
          return false;
        }
        if (wc[i].opcode == op) {
          out->push_back(wc[i]);
          ++got;
        } else {
          pending_sends_ -= 1;
        }
      }
      if (n > 0) continue;
      if (std::chrono::steady_clock::now() > deadline) {
        *err = "no completion within the deadline";
        return false;
      }
      if (!channel_) {
        std::this_thread::yield();
        continue;
      }
      if (ibv_req_notify_cq(s_->cq, 0) != 0) {
        *err = "ibv_req_notify_cq failed";
        return false;
      }
      n = ibv_poll_cq(s_->cq, 1, wc);  // what came before the arm
      if (n > 0) {
        if (wc[0].status != IBV_WC_SUCCESS) {
          *err = std::string("completion in error: ") + ibv_wc_status_str(wc[0].status);
          return false;
        }
        if (wc[0].opcode == op) {
          out->push_back(wc[0]);
          ++got;
        } else {
          pending_sends_ -= 1;
        }
        continue;  // armed still: the event, if it comes, is taken below
      }
      pollfd p{s_->channel->fd, POLLIN, 0};
      if (poll(&p, 1, 200) == 1) {
        ibv_cq* cq;
        void* ctx;
        if (ibv_get_cq_event(s_->channel, &cq, &ctx) == 0) ibv_ack_cq_events(cq, 1);
      }
    }
    return true;
  }
  // The side's own send completions not yet taken.
  void Sent(int n) { pending_sends_ += n; }
  bool DrainSends(std::string* err) {
    std::vector<ibv_wc> none;
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kWaitMs);
    while (pending_sends_ > 0) {
      ibv_wc wc[16];
      int n = ibv_poll_cq(s_->cq, 16, wc);
      for (int i = 0; i < n; ++i) {
        if (wc[i].status != IBV_WC_SUCCESS) {
          *err = std::string("send completion in error: ") + ibv_wc_status_str(wc[i].status);
          return false;
        }
        --pending_sends_;
      }
      if (n == 0 && std::chrono::steady_clock::now() > deadline) {
        *err = "send completions missing at the end";
        return false;
      }
      if (n == 0) std::this_thread::yield();
    }
    return true;
  }

 private:
  Side* s_;
  bool channel_;
  int pending_sends_ = 0;
};

// A pair of QPs and what its two threads use. Client: src (sent from),
// land (the server's WRITEs land there), rd (READs land there). Server:
// rx (receives), which the client also READs back.
struct Pair {
  int index = 0;
  bool channel = false;
  Side a, b;
  Buffer src, land, rd, rx;
  bool Open(ibv_context* ctx) {
    QpOptions o;
    o.channel = channel;
    a = MakeSide(ctx, o);
    b = MakeSide(ctx, o);
    if (a.qp == nullptr || b.qp == nullptr || !ConnectPair(ctx, a, b, o, o)) return false;
    src = MakeBuffer(a.pd, kMaxMsg, kAll);
    land = MakeBuffer(a.pd, kMaxMsg, kAll);
    rd = MakeBuffer(a.pd, kMaxMsg, kAll);
    rx = MakeBuffer(b.pd, kMaxMsg, kAll);
    return src.mr && land.mr && rd.mr && rx.mr;
  }
  void Close() {
    for (Side* s : {&a, &b})
      if (s->qp) ibv_destroy_qp(s->qp), s->qp = nullptr;
    for (Buffer* buf : {&src, &land, &rd, &rx}) FreeBuffer(*buf);
    DestroySide(a);
    DestroySide(b);
  }
};

uint32_t Seed(int pair, int round) { return static_cast<uint32_t>(pair * 100003 + round * 7 + 1); }

// Round r: the client SENDs a message of kSizes[r % n]; the server checks
// it and WRITEs it back with an immediate (r) into the client's `land`;
// the client checks that, and every third round READs the server's `rx`
// back and checks it too. Then the next round.
void RunClient(Pair* p, int rounds, Errors* errs) {
  Waiter w(&p->a, p->channel);
  std::string err;
  auto fail = [&](int r, const std::string& what) {
    errs->Add("pair " + std::to_string(p->index) + " client round " + std::to_string(r) + ": " +
              what);
  };
  for (int r = 0; r < rounds && !errs->Any(); ++r) {
    size_t n = kSizes[r % (sizeof(kSizes) / sizeof(kSizes[0]))];
    uint32_t seed = Seed(p->index, r);
    if (PostRecv(p->a.qp, p->land, 0, 0, r) != 0) return fail(r, "post recv");
    Fill(p->src.data.data(), n, seed);
    if (PostSend(p->a.qp, IBV_WR_SEND, p->src, 0, n, r) != 0) return fail(r, "post send");
    w.Sent(1);
    std::vector<ibv_wc> got;
    if (!w.Take(1, IBV_WC_RECV_RDMA_WITH_IMM, &got, &err)) return fail(r, err);
    if (be32toh(got[0].imm_data) != static_cast<uint32_t>(r) || got[0].wr_id != static_cast<uint64_t>(r))
      return fail(r, "WRITE's immediate or receive out of order");
    if (!Check(p->land.data.data(), n, seed)) return fail(r, "WRITE's bytes wrong");
    if (r % 3 == 0) {
      memset(p->rd.data.data(), 0, n);
      if (PostSend(p->a.qp, IBV_WR_RDMA_READ, p->rd, 0, n, 1000000 + r, IBV_SEND_SIGNALED,
                   p->rx.addr(), p->rx.mr->rkey) != 0)
        return fail(r, "post read");
      got.clear();
      if (!w.Take(1, IBV_WC_RDMA_READ, &got, &err)) return fail(r, err);
      if (!Check(p->rd.data.data(), n, seed)) return fail(r, "READ's bytes wrong");
    }
  }
  if (!w.DrainSends(&err)) fail(rounds, err);
}

void RunServer(Pair* p, int rounds, Errors* errs) {
  Waiter w(&p->b, p->channel);
  std::string err;
  auto fail = [&](int r, const std::string& what) {
    errs->Add("pair " + std::to_string(p->index) + " server round " + std::to_string(r) + ": " +
              what);
  };
  for (int r = 0; r < rounds && !errs->Any(); ++r) {
    size_t n = kSizes[r % (sizeof(kSizes) / sizeof(kSizes[0]))];
    if (PostRecv(p->b.qp, p->rx, 0, kMaxMsg, r) != 0) return fail(r, "post recv");
    std::vector<ibv_wc> got;
    if (!w.Take(1, IBV_WC_RECV, &got, &err)) return fail(r, err);
    if (got[0].wr_id != static_cast<uint64_t>(r) || got[0].byte_len != n)
      return fail(r, "SEND out of order or of the wrong length");
    if (!Check(p->rx.data.data(), n, Seed(p->index, r))) return fail(r, "SEND's bytes wrong");
    if (PostSend(p->b.qp, IBV_WR_RDMA_WRITE_WITH_IMM, p->rx, 0, n, r, IBV_SEND_SIGNALED,
                 p->land.addr(), p->land.mr->rkey, static_cast<uint32_t>(r)) != 0)
      return fail(r, "post write");
    w.Sent(1);
    // The client READs rx back every third round: it stays as it is until
    // the next SEND, which the client posts only after that READ.
  }
  if (!w.DrainSends(&err)) fail(rounds, err);
}

// Registers and deregisters memory, and makes a QP pair, moves one
// message over it and destroys it, until told to stop.
void Churn(ibv_context* ctx, std::atomic<bool>* stop, Errors* errs, int* cycles) {
  ibv_pd* pd = ibv_alloc_pd(ctx);
  while (!stop->load()) {
    Buffer m = MakeBuffer(pd, 64 * 1024, kAll);
    if (m.mr == nullptr) errs->Add("churn: ibv_reg_mr failed");
    FreeBuffer(m);
    Pair p;
    p.index = 1000 + *cycles;
    if (!p.Open(ctx)) {
      errs->Add("churn: a QP pair could not be made");
      p.Close();
      break;
    }
    Fill(p.src.data.data(), 4096, 77);
    if (PostRecv(p.b.qp, p.rx, 0, kMaxMsg, 1) != 0 ||
        PostSend(p.a.qp, IBV_WR_SEND, p.src, 0, 4096, 1) != 0)
      errs->Add("churn: post failed");
    std::vector<ibv_wc> rx = PollN(p.b.cq, 1, kWaitMs);
    if (rx.size() != 1 || rx[0].status != IBV_WC_SUCCESS || !Check(p.rx.data.data(), 4096, 77))
      errs->Add("churn: the message did not arrive whole");
    PollN(p.a.cq, 1, kWaitMs);
    p.Close();
    ++*cycles;
  }
  ibv_dealloc_pd(pd);
}

TEST(Stress, ManyQpsOnManyThreadsKeepEveryByteAndWakeUp) {
  ibv_context* ctx = OpenDevice();
  ASSERT_NE(ctx, nullptr) << "no softverbs device (SOFTVERBS_DEVICES)";
  constexpr int kPairs = 8;
  const int rounds = Rounds();
  std::vector<std::unique_ptr<Pair>> pairs;
  for (int i = 0; i < kPairs; ++i) {
    pairs.push_back(std::make_unique<Pair>());
    pairs.back()->index = i;
    pairs.back()->channel = i % 2 == 1;
    ASSERT_TRUE(pairs.back()->Open(ctx)) << "pair " << i;
  }
  Errors errs;
  std::atomic<bool> stop{false};
  int churn_cycles = 0;
  auto start = std::chrono::steady_clock::now();
  std::thread churn(Churn, ctx, &stop, &errs, &churn_cycles);
  std::vector<std::thread> threads;
  for (auto& p : pairs) {
    threads.emplace_back(RunServer, p.get(), rounds, &errs);
    threads.emplace_back(RunClient, p.get(), rounds, &errs);
  }
  for (auto& t : threads) t.join();
  stop.store(true);
  churn.join();
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (const std::string& e : errs.list) ADD_FAILURE() << e;
  EXPECT_GT(churn_cycles, 0) << "the churn thread never finished a cycle";
  printf("%d pairs x %d rounds, %d QP pairs made and destroyed meanwhile, %.1f s\n", kPairs,
         rounds, churn_cycles, secs);
  for (auto& p : pairs) p->Close();
  ibv_close_device(ctx);
}

}  // namespace
