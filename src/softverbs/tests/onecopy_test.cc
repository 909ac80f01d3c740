// One-copy WRITEs and READs (sv_onecopy.cc): a WRITE into (a READ out of)
// an MR that is a shared mapping of a memfd sealed against shrinking is
// copied once, straight between the two processes' memory; every check an
// HCA makes still holds. Each case
// runs in a child (this binary with --scenario one-copy MODE) so that its
// SOFTVERBS_STATS line at exit tells which WRITEs went with one copy.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>

#include "sv_test_util.h"

using namespace svtest;

namespace {

constexpr int kAll = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
constexpr size_t kRegion = 1 << 20;

int Fail(const char* what) {
  printf("scenario failed: %s\n", what);
  return 1;
}

// A region as grpc-rdma's pool makes it: a memfd, mapped shared.
struct Region {
  int fd = -1;
  char* p = nullptr;
  ibv_mr* mr = nullptr;
  bool Make(ibv_pd* pd, bool seal) {
    fd = memfd_create("onecopy-test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0 || ftruncate(fd, kRegion) != 0) return false;
    if (seal && fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) != 0) return false;
    void* at = mmap(nullptr, kRegion, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (at == MAP_FAILED) return false;
    p = static_cast<char*>(at);
    mr = ibv_reg_mr(pd, p, kRegion, kAll);
    return mr != nullptr;
  }
  ~Region() {
    if (mr) ibv_dereg_mr(mr);
    if (p) munmap(p, kRegion);
    if (fd >= 0) close(fd);
  }
  uint64_t addr(size_t off) const { return reinterpret_cast<uint64_t>(p) + off; }
};

struct Pair {
  ibv_context* ctx = nullptr;
  Side a, b;
  Buffer src, msg;
  bool Open() {
    ctx = OpenDevice();
    if (ctx == nullptr) return false;
    QpOptions o;
    a = MakeSide(ctx, o);
    b = MakeSide(ctx, o);
    if (!ConnectPair(ctx, a, b, o, o)) return false;
    src = MakeBuffer(a.pd, kRegion, kAll);
    msg = MakeBuffer(b.pd, 4096, kAll);
    return src.mr && msg.mr;
  }
  // A message from b to a: once a has it, a has taken every frame b sent
  // before it (a share or an unshare among them).
  bool Sync() {
    if (PostRecv(a.qp, src, 0, 64, 900) != 0) return false;
    if (PostSend(b.qp, IBV_WR_SEND, msg, 0, 1, 901) != 0) return false;
    auto ra = PollN(a.cq, 1);
    auto rb = PollN(b.cq, 1);
    return ra.size() == 1 && ra[0].status == IBV_WC_SUCCESS && rb.size() == 1 &&
           rb[0].status == IBV_WC_SUCCESS;
  }
  ibv_wc_status Write(size_t src_off, size_t len, uint64_t remote, uint32_t rkey,
                      ibv_wr_opcode op = IBV_WR_RDMA_WRITE, uint32_t imm = 0) {
    if (PostSend(a.qp, op, src, src_off, len, 7, IBV_SEND_SIGNALED, remote, rkey, imm) != 0)
      return IBV_WC_GENERAL_ERR;
    auto tx = PollN(a.cq, 1);
    return tx.size() == 1 ? tx[0].status : IBV_WC_RESP_TIMEOUT_ERR;
  }
  ~Pair() {
    for (Side* s : {&a, &b}) {
      if (s->qp) ibv_destroy_qp(s->qp);
      s->qp = nullptr;
    }
    FreeBuffer(src);
    FreeBuffer(msg);
    DestroySide(a);
    DestroySide(b);
    if (ctx) ibv_close_device(ctx);
  }
};

// Runs the scenario in a child with the environment given; returns its
// SOFTVERBS_STATS lines.
std::string RunWithStats(const std::string& mode, std::vector<std::string> env) {
  char path[] = "/tmp/softverbs-onecopy-XXXXXX";
  int fd = mkstemp(path);
  EXPECT_GE(fd, 0);
  close(fd);
  env.push_back(std::string("SOFTVERBS_STATS=") + path);
  std::string out;
  EXPECT_EQ(RunSelf(env, {"--scenario", "one-copy", mode}, &out), 0) << out;
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  unlink(path);
  return ss.str() + out;
}

// "ops=N" of the line for dir/op, or -1.
long Ops(const std::string& stats, const std::string& dir_op) {
  size_t at = stats.find(dir_op + " ops=");
  if (at == std::string::npos) return -1;
  return std::atol(stats.c_str() + at + dir_op.size() + 5);
}

}  // namespace

// MODE: "sealed" (the region can be shared) or "unsealed" (it cannot: a
// file that may shrink would fault the requester). The checks are the same:
// only the counters tell the two apart.
int ScenarioOneCopy(const char* mode) {
  const bool sealed = strncmp(mode, "sealed", 6) == 0;
  // "sealed-nosync": the WRITE after the rights are taken back is posted at
  // once, before the requester can have read the UNSHARE: the slot in the
  // wire's segment, closed before ibv_rereg_mr returns, must stop it.
  const bool nosync = strcmp(mode, "sealed-nosync") == 0;
  Pair p;
  if (!p.Open()) return Fail("open");
  Region m;
  if (!m.Make(p.b.pd, sealed)) return Fail("memfd region");
  if (!p.Sync()) return Fail("sync after registration");

  // A WRITE and a WRITE with immediate, byte-exact.
  Fill(p.src.data.data(), 256 << 10, 1);
  if (p.Write(0, 256 << 10, m.addr(4096), m.mr->rkey) != IBV_WC_SUCCESS) return Fail("write");
  if (!Check(m.p + 4096, 256 << 10, 1)) return Fail("write's bytes");
  if (m.p[4095] != 0 || m.p[4096 + (256 << 10)] != 0) return Fail("bytes around the write");
  Fill(p.src.data.data() + 300000, 65536, 2);
  if (PostRecv(p.b.qp, p.msg, 0, 64, 55) != 0) return Fail("post recv");
  if (p.Write(300000, 65536, m.addr(512 << 10), m.mr->rkey, IBV_WR_RDMA_WRITE_WITH_IMM,
              0x1234) != IBV_WC_SUCCESS)
    return Fail("write with immediate");
  auto rx = PollN(p.b.cq, 1);
  if (rx.size() != 1 || rx[0].status != IBV_WC_SUCCESS ||
      rx[0].opcode != IBV_WC_RECV_RDMA_WITH_IMM || rx[0].byte_len != 65536 ||
      be32toh(rx[0].imm_data) != 0x1234 || rx[0].wr_id != 55)
    return Fail("the immediate's completion");
  if (!Check(m.p + (512 << 10), 65536, 2)) return Fail("write with immediate's bytes");
  // One of 512 KiB or more is placed by softverbs' agent thread, not the
  // posting one.
  Fill(p.src.data.data(), 768 << 10, 6);
  if (p.Write(0, 768 << 10, m.addr(0), m.mr->rkey) != IBV_WC_SUCCESS) return Fail("large write");
  if (!Check(m.p, 768 << 10, 6)) return Fail("large write's bytes");

  // WRITEs land in the order they were posted: a small one (through the
  // ring) and a large one over it, posted back to back, many times.
  for (int i = 0; i < 50; ++i) {
    Fill(p.src.data.data(), 2048, 100 + i);
    Fill(p.src.data.data() + 4096, 16384, 200 + i);
    if (PostSend(p.a.qp, IBV_WR_RDMA_WRITE, p.src, 0, 2048, 10, 0, m.addr(0), m.mr->rkey) != 0 ||
        PostSend(p.a.qp, IBV_WR_RDMA_WRITE, p.src, 4096, 16384, 11, IBV_SEND_SIGNALED, m.addr(0),
                 m.mr->rkey) != 0)
      return Fail("post the pair");
    auto tx = PollN(p.a.cq, 1);
    if (tx.size() != 1 || tx[0].status != IBV_WC_SUCCESS) return Fail("the pair");
    if (!Check(m.p, 16384, 200 + i)) return Fail("the later WRITE's bytes are not the last");
  }

  // Rights taken back: no WRITE posted after lands, though the requester
  // had the region mapped.
  if (ibv_rereg_mr(m.mr, IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0, IBV_ACCESS_LOCAL_WRITE) !=
      0)
    return Fail("rereg");
  if (!nosync && !p.Sync()) return Fail("sync after rereg");
  memset(m.p, 0x5a, kRegion);
  Fill(p.src.data.data(), 65536, 3);
  if (p.Write(0, 65536, m.addr(0), m.mr->rkey) != IBV_WC_REM_ACCESS_ERR)
    return Fail("a write without the right is refused");
  for (size_t i = 0; i < kRegion; ++i)
    if (m.p[i] != 0x5a) return Fail("a refused write changed the region");
  printf("ok\n");
  return 0;
}

// Deregistered: the same, on a fresh pair (the refusal above left its QP
// in error).
int ScenarioOneCopyDereg() {
  Pair p;
  if (!p.Open()) return Fail("open");
  Region m;
  if (!m.Make(p.b.pd, true)) return Fail("memfd region");
  if (!p.Sync()) return Fail("sync");
  Fill(p.src.data.data(), 65536, 4);
  if (p.Write(0, 65536, m.addr(0), m.mr->rkey) != IBV_WC_SUCCESS) return Fail("write");
  if (!Check(m.p, 65536, 4)) return Fail("write's bytes");
  uint32_t rkey = m.mr->rkey;
  if (ibv_dereg_mr(m.mr) != 0) return Fail("dereg");
  m.mr = nullptr;
  if (!p.Sync()) return Fail("sync after dereg");
  memset(m.p, 0x33, kRegion);
  Fill(p.src.data.data(), 65536, 5);
  if (p.Write(0, 65536, m.addr(0), rkey) != IBV_WC_REM_ACCESS_ERR)
    return Fail("a write to a deregistered region is refused");
  for (size_t i = 0; i < kRegion; ++i)
    if (m.p[i] != 0x33) return Fail("a refused write changed the deregistered region");
  printf("ok\n");
  return 0;
}

// The responder's QP moved to error (`destroy` false: the wire stays up,
// and the requester hears of nothing) or destroyed (its wire closed) while
// the requester still holds the share: a WRITE posted then must not land.
int ScenarioOneCopyQpGone(bool destroy) {
  Pair p;
  if (!p.Open()) return Fail("open");
  Region m;
  if (!m.Make(p.b.pd, true)) return Fail("memfd region");
  if (!p.Sync()) return Fail("sync");
  Fill(p.src.data.data(), 65536, 7);
  if (p.Write(0, 65536, m.addr(0), m.mr->rkey) != IBV_WC_SUCCESS) return Fail("write");
  memset(m.p, 0x77, kRegion);
  if (destroy) {
    if (ibv_destroy_qp(p.b.qp) != 0) return Fail("destroy the responder's QP");
    p.b.qp = nullptr;
  } else {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_ERR;
    if (ibv_modify_qp(p.b.qp, &attr, IBV_QP_STATE) != 0) return Fail("responder's QP to ERR");
  }
  Fill(p.src.data.data(), 65536, 8);
  if (PostSend(p.a.qp, IBV_WR_RDMA_WRITE, p.src, 0, 65536, 9, IBV_SEND_SIGNALED, m.addr(0),
               m.mr->rkey) != 0)
    return Fail("post");
  PollN(p.a.cq, 1, 500);  // an error, or nothing
  for (size_t i = 0; i < kRegion; ++i)
    if (m.p[i] != 0x77) return Fail("a write to a gone QP's region landed");
  printf("ok\n");
  return 0;
}

// READs: out of a shared region that allows them, copied once into the
// requester's memory, in order after earlier WRITEs, and never once the
// right to read is taken back. MODE: "read" (sealed), "read-nosync" (the
// READ after the rights change is posted at once: the closed slot must
// stop it), "read-unsealed" (nothing shared: all through the ring).
int ScenarioOneCopyRead(const char* mode) {
  const bool sealed = strcmp(mode, "read-unsealed") != 0;
  const bool nosync = strcmp(mode, "read-nosync") == 0;
  Pair p;
  if (!p.Open()) return Fail("open");
  Region m;
  if (!m.Make(p.b.pd, sealed)) return Fail("memfd region");
  if (!p.Sync()) return Fail("sync after registration");
  Fill(m.p, kRegion, 11);
  // On the posting thread, on the agent's (512 KiB and more), through the
  // ring (below 4 KiB): byte-exact, and nothing around them touched.
  struct {
    size_t remote_off, len;
  } reads[] = {{4096, 256 << 10}, {0, 768 << 10}, {100, 2048}};
  for (const auto& r : reads) {
    memset(p.src.data.data(), 0xee, kRegion);
    if (p.Write(8, r.len, m.addr(r.remote_off), m.mr->rkey, IBV_WR_RDMA_READ) != IBV_WC_SUCCESS)
      return Fail("read");
    if (memcmp(p.src.data.data() + 8, m.p + r.remote_off, r.len) != 0) return Fail("read's bytes");
    if (static_cast<unsigned char>(p.src.data[7]) != 0xee ||
        static_cast<unsigned char>(p.src.data[8 + r.len]) != 0xee)
      return Fail("bytes around the read");
  }
  // A READ sees every WRITE and SEND posted before it: one (`op`, `len`
  // bytes) and a READ over it, posted back to back, many times; a SEND
  // lands in a receive buffer in the region.
  auto then_read = [&](ibv_wr_opcode op, size_t len, int times, int pattern) -> const char* {
    for (int i = 0; i < times; ++i) {
      if (op == IBV_WR_SEND) {
        ibv_sge sge{m.addr(0), static_cast<uint32_t>(len), m.mr->lkey};
        ibv_recv_wr rwr{}, *bad = nullptr;
        rwr.wr_id = 70;
        rwr.sg_list = &sge;
        rwr.num_sge = 1;
        if (ibv_post_recv(p.b.qp, &rwr, &bad) != 0) return "post a receive into the region";
      }
      Fill(p.src.data.data(), len, pattern + i);
      if (PostSend(p.a.qp, op, p.src, 0, len, 10, 0, m.addr(0), m.mr->rkey) != 0 ||
          PostSend(p.a.qp, IBV_WR_RDMA_READ, p.src, 65536, 16384, 11, IBV_SEND_SIGNALED, m.addr(0),
                   m.mr->rkey) != 0)
        return "post the pair";
      auto tx = PollN(p.a.cq, 1);
      if (tx.size() != 1 || tx[0].status != IBV_WC_SUCCESS) return "the pair";
      if (op == IBV_WR_SEND) {
        auto rx = PollN(p.b.cq, 1);
        if (rx.size() != 1 || rx[0].status != IBV_WC_SUCCESS) return "the send's receive";
      }
      if (!Check(p.src.data.data() + 65536, len, pattern + i))
        return "a READ missed what was posted before it";
    }
    return nullptr;
  };
  // A small WRITE (through the ring); one copied once (16 KiB: both go
  // without the ring); a SEND (through the ring).
  if (const char* e = then_read(IBV_WR_RDMA_WRITE, 2048, 50, 100)) return Fail(e);
  if (const char* e = then_read(IBV_WR_RDMA_WRITE, 16384, 50, 150)) return Fail(e);
  if (const char* e = then_read(IBV_WR_SEND, 2048, 20, 30)) return Fail(e);
  // Reads only (no remote writes): not shared any more, READs go through
  // the ring and still bring the bytes.
  if (ibv_rereg_mr(m.mr, IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0,
                   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ) != 0)
    return Fail("rereg to reads only");
  if (!p.Sync()) return Fail("sync after rereg to reads only");
  Fill(m.p, 65536, 12);
  if (p.Write(0, 65536, m.addr(0), m.mr->rkey, IBV_WR_RDMA_READ) != IBV_WC_SUCCESS)
    return Fail("read of a region that allows reads only");
  if (!Check(p.src.data.data(), 65536, 12)) return Fail("read-only region's bytes");
  if (ibv_rereg_mr(m.mr, IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0, kAll) != 0)
    return Fail("rereg back");
  if (!p.Sync()) return Fail("sync after rereg back");
  // The right to read taken back (writes still allowed): no READ posted
  // after copies a byte, though the requester has the region mapped.
  if (ibv_rereg_mr(m.mr, IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0,
                   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE) != 0)
    return Fail("rereg");
  if (!nosync && !p.Sync()) return Fail("sync after rereg");
  memset(m.p, 0x5a, kRegion);
  memset(p.src.data.data(), 0xee, kRegion);
  if (p.Write(0, 65536, m.addr(0), m.mr->rkey, IBV_WR_RDMA_READ) != IBV_WC_REM_ACCESS_ERR)
    return Fail("a read without the right is refused");
  for (size_t i = 0; i < kRegion; ++i)
    if (static_cast<unsigned char>(p.src.data[i]) != 0xee)
      return Fail("a refused read brought bytes");
  printf("ok\n");
  return 0;
}

// A READ out of a shared region that the requester's own QP flushes (moved
// to error, `destroy` false) or drops (destroyed) right after posting it:
// once the flush is polled, or the destroy has returned, the READ's memory
// is the application's again, and nothing may copy into it later, though
// the agent was asked to copy it once (768 KiB) or the posting thread did
// (64 KiB). Prints how many READs were flushed and how many came whole.
int ScenarioOneCopyReadFlushed(bool destroy) {
  int flushed = 0, whole = 0;
  for (int i = 0; i < 60; ++i) {
    const size_t len = i % 3 == 2 ? (64 << 10) : (768 << 10);
    Pair p;
    if (!p.Open()) return Fail("open");
    Region m;
    if (!m.Make(p.b.pd, true)) return Fail("memfd region");
    if (!p.Sync()) return Fail("sync after registration");
    Fill(m.p, len, 40 + i);
    memset(p.src.data.data(), 0xee, kRegion);
    // Let softverbs' agent stop spinning after the sync, so the flush most
    // often comes before it wakes for the 768 KiB READ.
    usleep(2000);
    if (PostSend(p.a.qp, IBV_WR_RDMA_READ, p.src, 0, len, 21, IBV_SEND_SIGNALED, m.addr(0),
                 m.mr->rkey) != 0)
      return Fail("post the read");
    if (destroy) {
      if (ibv_destroy_qp(p.a.qp) != 0) return Fail("destroy the requester's QP");
      p.a.qp = nullptr;
    } else {
      ibv_qp_attr attr{};
      attr.qp_state = IBV_QPS_ERR;
      if (ibv_modify_qp(p.a.qp, &attr, IBV_QP_STATE) != 0) return Fail("requester's QP to ERR");
      auto tx = PollN(p.a.cq, 1);
      if (tx.size() != 1) return Fail("no completion for the read");
      if (tx[0].status == IBV_WC_SUCCESS) {
        if (!Check(p.src.data.data(), len, 40 + i)) return Fail("a whole read's bytes");
        ++whole;
        continue;
      }
      if (tx[0].status != IBV_WC_WR_FLUSH_ERR) return Fail("the read neither came nor flushed");
      ++flushed;
    }
    // The memory is the application's now: what it writes stays.
    memset(p.src.data.data(), 0xcc, len + 4096);
    usleep(10000);
    for (size_t j = 0; j < len + 4096; ++j)
      if (static_cast<unsigned char>(p.src.data[j]) != 0xcc)
        return Fail("bytes of a flushed or dropped read landed after it was given back");
  }
  printf("flushed %d whole %d\n", flushed, whole);
  printf("ok\n");
  return 0;
}

TEST(OneCopy, AReadFlushedByItsOwnQpBringsNoBytesAfterTheFlush) {
  std::string s = RunWithStats("read-flush-error", {});
  EXPECT_NE(s.find("ok\n"), std::string::npos) << s;
  // Moved to error right after the post, most READs are flushed; if none
  // were, the case checked nothing.
  EXPECT_EQ(s.find("flushed 0 "), std::string::npos) << s;
}

TEST(OneCopy, AReadDroppedWithItsQpBringsNoBytesAfterTheDestroy) {
  std::string s = RunWithStats("read-flush-destroy", {});
  EXPECT_NE(s.find("ok\n"), std::string::npos) << s;
}

TEST(OneCopy, ReadsOutOfASealedMemfdRegionAreCopiedOnceInOrderAndStayChecked) {
  std::string s = RunWithStats("read", {});
  // The 256 KiB and 768 KiB ones and the 50 after a WRITE copied once at
  // least; of the pairs with a WRITE through the ring, the READ whenever
  // that WRITE had left the ring.
  EXPECT_GE(Ops(s, "dir=tx op=RDMA_READ_ONE_COPY"), 52) << s;
  // Every READ is counted by both sides, copied once or not: the three and
  // 100 of the pairs with a WRITE, 20 with a SEND, the one of a region
  // that allows reads only; the refused one on the requester's side.
  EXPECT_EQ(Ops(s, "dir=tx op=RDMA_READ"), 125) << s;
  EXPECT_EQ(Ops(s, "dir=rx op=RDMA_READ"), 124) << s;
}

TEST(OneCopy, TheRightToReadTakenBackStopsAReadPostedAtOnce) {
  std::string s = RunWithStats("read-nosync", {});
  EXPECT_GE(Ops(s, "dir=tx op=RDMA_READ_ONE_COPY"), 52) << s;
}

TEST(OneCopy, ReadsOutOfARegionThatMayShrinkGoThroughTheRing) {
  std::string s = RunWithStats("read-unsealed", {});
  EXPECT_EQ(Ops(s, "dir=tx op=RDMA_READ_ONE_COPY"), -1) << s;
  EXPECT_EQ(Ops(s, "dir=rx op=RDMA_READ"), 124) << s;
}

TEST(OneCopy, AWriteAfterTheRespondersQpIsGoneLandsNowhere) {
  std::string s = RunWithStats("qp-gone", {});
  EXPECT_EQ(Ops(s, "dir=tx op=RDMA_WRITE_ONE_COPY"), 1) << s;
}

TEST(OneCopy, AWriteToAQpInErrorLandsNowhere) {
  std::string s = RunWithStats("qp-error", {});
  EXPECT_EQ(Ops(s, "dir=tx op=RDMA_WRITE_ONE_COPY"), 1) << s;
}

TEST(OneCopy, WritesIntoASealedMemfdRegionAreCopiedOnceAndStayChecked) {
  std::string s = RunWithStats("sealed", {});
  // The first three WRITEs at least; of each ordered pair, the large one
  // whenever the small one had left the ring.
  long placed = Ops(s, "dir=tx op=RDMA_WRITE_ONE_COPY");
  EXPECT_GE(placed, 3) << s;
  // Every WRITE is counted as one by both sides, placed or not: the three,
  // 50 pairs, and the refused one on the requester's side.
  EXPECT_EQ(Ops(s, "dir=tx op=RDMA_WRITE"), 103) << s;
  EXPECT_EQ(Ops(s, "dir=rx op=RDMA_WRITE"), 102) << s;
}

TEST(OneCopy, RightsTakenBackStopAWritePostedAtOnce) {
  std::string s = RunWithStats("sealed-nosync", {});
  EXPECT_GE(Ops(s, "dir=tx op=RDMA_WRITE_ONE_COPY"), 3) << s;
}

TEST(OneCopy, AWriteToADeregisteredRegionIsRefusedAndLandsNowhere) {
  std::string s = RunWithStats("dereg", {});
  EXPECT_EQ(Ops(s, "dir=tx op=RDMA_WRITE_ONE_COPY"), 1) << s;
}

TEST(OneCopy, ARegionThatMayShrinkGoesThroughTheRing) {
  std::string s = RunWithStats("unsealed", {});
  EXPECT_EQ(Ops(s, "dir=tx op=RDMA_WRITE_ONE_COPY"), -1) << s;
  EXPECT_EQ(Ops(s, "dir=rx op=RDMA_WRITE"), 102) << s;
}

TEST(OneCopy, OffWithSoftverbsOneCopy0) {
  std::string s = RunWithStats("sealed", {"SOFTVERBS_ONE_COPY=0"});
  EXPECT_EQ(Ops(s, "dir=tx op=RDMA_WRITE_ONE_COPY"), -1) << s;
  EXPECT_EQ(Ops(s, "dir=rx op=RDMA_WRITE"), 102) << s;
}
