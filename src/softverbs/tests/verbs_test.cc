// softverbs through the public libibverbs API: data movement, every error
// completion a real HCA gives, the QP state machine and completion channels.
#include <arpa/inet.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <dirent.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <linux/userfaultfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <set>
#include <string>
#include <thread>

#include "sv_test_util.h"

using namespace svtest;

namespace {

constexpr int kAll = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

class VerbsTest : public ::testing::Test {
 protected:
  void SetUp() override { Open(QpOptions{}, QpOptions{}); }
  void Open(const QpOptions& oa, const QpOptions& ob) {
    ctx_ = OpenDevice();
    ASSERT_NE(ctx_, nullptr) << "no softverbs device (SOFTVERBS_DEVICES)";
    a_ = MakeSide(ctx_, oa);
    b_ = MakeSide(ctx_, ob);
    ASSERT_NE(a_.qp, nullptr);
    ASSERT_NE(b_.qp, nullptr);
    ASSERT_TRUE(ConnectPair(ctx_, a_, b_, oa, ob));
  }
  void TearDown() override {
    // QPs first: nothing may still point into the buffers.
    for (Side* s : {&a_, &b_}) {
      if (s->qp) ibv_destroy_qp(s->qp);
      s->qp = nullptr;
    }
    for (Buffer* buf : bufs_) FreeBuffer(*buf);
    DestroySide(a_);
    DestroySide(b_);
    if (ctx_) ibv_close_device(ctx_);
  }
  Buffer& Buf(ibv_pd* pd, size_t size, int access = kAll) {
    owned_.push_back(std::make_unique<Buffer>(MakeBuffer(pd, size, access)));
    bufs_.push_back(owned_.back().get());
    EXPECT_NE(owned_.back()->mr, nullptr);
    return *owned_.back();
  }

  ibv_context* ctx_ = nullptr;
  Side a_, b_;
  std::vector<std::unique_ptr<Buffer>> owned_;
  std::vector<Buffer*> bufs_;
};

TEST_F(VerbsTest, DeviceAndPortAttributes) {
  ibv_device_attr d{};
  ASSERT_EQ(ibv_query_device(ctx_, &d), 0);
  EXPECT_EQ(d.phys_port_cnt, 1);
  EXPECT_GT(d.max_qp_wr, 0);
  ibv_port_attr p{};
  ASSERT_EQ(ibv_query_port(ctx_, 1, &p), 0);
  EXPECT_EQ(p.state, IBV_PORT_ACTIVE);
  EXPECT_NE(p.lid, 0);
  EXPECT_NE(ibv_query_port(ctx_, 2, &p), 0);
  ibv_gid gid{};
  ASSERT_EQ(ibv_query_gid(ctx_, 1, 0, &gid), 0);
  EXPECT_EQ(gid.raw[10], 0xff);
  EXPECT_STREQ(ibv_get_device_name(ctx_->device), getenv("SV_TEST_DEVICE_NAME")
                                                      ? getenv("SV_TEST_DEVICE_NAME")
                                                      : "mlx5_0");
}

TEST_F(VerbsTest, SendRecvWithImmediateAndEmptyMessages) {
  Buffer& src = Buf(a_.pd, 8192);
  Buffer& dst = Buf(b_.pd, 8192);
  Fill(src.data.data(), 8192, 7);
  const size_t sizes[] = {0, 1, 100, 4096, 8192};
  for (int i = 0; i < 5; ++i) ASSERT_EQ(PostRecv(b_.qp, dst, 0, 8192, 100 + i), 0);
  for (int i = 0; i < 5; ++i) {
    ibv_wr_opcode op = (i % 2) ? IBV_WR_SEND_WITH_IMM : IBV_WR_SEND;
    ASSERT_EQ(PostSend(a_.qp, op, src, 0, sizes[i], i, IBV_SEND_SIGNALED, 0, 0, 0x1000 + i), 0);
    auto rx = PollN(b_.cq, 1);
    ASSERT_EQ(rx.size(), 1u);
    EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS);
    EXPECT_EQ(rx[0].opcode, IBV_WC_RECV);
    EXPECT_EQ(rx[0].wr_id, 100u + i);
    EXPECT_EQ(rx[0].byte_len, sizes[i]);
    EXPECT_EQ(rx[0].src_qp, a_.qp->qp_num);
    if (i % 2) {
      EXPECT_TRUE(rx[0].wc_flags & IBV_WC_WITH_IMM);
      EXPECT_EQ(be32toh(rx[0].imm_data), 0x1000u + i);
    } else {
      EXPECT_FALSE(rx[0].wc_flags & IBV_WC_WITH_IMM);
    }
    EXPECT_TRUE(Check(dst.data.data(), sizes[i], 7));
    auto tx = PollN(a_.cq, 1);
    ASSERT_EQ(tx.size(), 1u);
    EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
    EXPECT_EQ(tx[0].opcode, IBV_WC_SEND);
    EXPECT_EQ(tx[0].wr_id, static_cast<uint64_t>(i));
  }
}

TEST_F(VerbsTest, ScatterGatherOnBothSides) {
  Buffer& src = Buf(a_.pd, 300);
  Buffer& dst = Buf(b_.pd, 300);
  Fill(src.data.data(), 300, 3);
  ibv_sge rs[3] = {{dst.addr() + 200, 50, dst.mr->lkey},
                   {dst.addr(), 100, dst.mr->lkey},
                   {dst.addr() + 100, 100, dst.mr->lkey}};
  ibv_recv_wr rwr{}, *rbad;
  rwr.sg_list = rs;
  rwr.num_sge = 3;
  ASSERT_EQ(ibv_post_recv(b_.qp, &rwr, &rbad), 0);
  ibv_sge ss[2] = {{src.addr(), 120, src.mr->lkey}, {src.addr() + 120, 80, src.mr->lkey}};
  ibv_send_wr swr{}, *sbad;
  swr.sg_list = ss;
  swr.num_sge = 2;
  swr.opcode = IBV_WR_SEND;
  swr.send_flags = IBV_SEND_SIGNALED;
  ASSERT_EQ(ibv_post_send(a_.qp, &swr, &sbad), 0);
  auto rx = PollN(b_.cq, 1);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].byte_len, 200u);
  EXPECT_EQ(memcmp(dst.data.data() + 200, src.data.data(), 50), 0);
  EXPECT_EQ(memcmp(dst.data.data(), src.data.data() + 50, 100), 0);
  EXPECT_EQ(memcmp(dst.data.data() + 100, src.data.data() + 150, 50), 0);
}

TEST_F(VerbsTest, RdmaWriteReadAndWriteWithImmediate) {
  Buffer& local = Buf(a_.pd, 1 << 16);
  Buffer& remote = Buf(b_.pd, 1 << 16);
  Fill(local.data.data(), 1 << 15, 11);
  ASSERT_EQ(PostSend(a_.qp, IBV_WR_RDMA_WRITE, local, 0, 1 << 15, 1, IBV_SEND_SIGNALED,
                     remote.addr() + 100, remote.mr->rkey),
            0);
  auto tx = PollN(a_.cq, 1);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(tx[0].opcode, IBV_WC_RDMA_WRITE);
  EXPECT_TRUE(Check(remote.data.data() + 100, 1 << 15, 11));
  EXPECT_EQ(PollN(b_.cq, 1, 50).size(), 0u) << "a plain write makes no responder completion";

  Fill(remote.data.data() + 40000, 5000, 12);
  ASSERT_EQ(PostSend(a_.qp, IBV_WR_RDMA_READ, local, 50000, 5000, 2, IBV_SEND_SIGNALED,
                     remote.addr() + 40000, remote.mr->rkey),
            0);
  tx = PollN(a_.cq, 1);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(tx[0].opcode, IBV_WC_RDMA_READ);
  EXPECT_EQ(tx[0].byte_len, 5000u);
  EXPECT_TRUE(Check(local.data.data() + 50000, 5000, 12));

  Buffer& rbuf = Buf(b_.pd, 64);
  ASSERT_EQ(PostRecv(b_.qp, rbuf, 0, 64, 77), 0);
  ASSERT_EQ(PostSend(a_.qp, IBV_WR_RDMA_WRITE_WITH_IMM, local, 0, 1000, 3, IBV_SEND_SIGNALED,
                     remote.addr(), remote.mr->rkey, 0xabcd),
            0);
  auto rx = PollN(b_.cq, 1);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(rx[0].opcode, IBV_WC_RECV_RDMA_WITH_IMM);
  EXPECT_EQ(rx[0].wr_id, 77u);
  EXPECT_EQ(rx[0].byte_len, 1000u);
  EXPECT_EQ(be32toh(rx[0].imm_data), 0xabcdu);
}

TEST_F(VerbsTest, InlineDataIsCopiedAtPostTime) {
  Buffer& dst = Buf(b_.pd, 64);
  ASSERT_EQ(PostRecv(b_.qp, dst, 0, 64, 1), 0);
  char msg[32] = "inline payload";
  ibv_sge sge{reinterpret_cast<uint64_t>(msg), 15, 0};  // no lkey needed
  ibv_send_wr wr{}, *bad;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
  ASSERT_EQ(ibv_post_send(a_.qp, &wr, &bad), 0);
  memset(msg, 'X', sizeof(msg));
  auto rx = PollN(b_.cq, 1);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_STREQ(dst.data.data(), "inline payload");
  std::string big(65, 'a');
  sge = {reinterpret_cast<uint64_t>(big.data()), 65, 0};
  EXPECT_EQ(ibv_post_send(a_.qp, &wr, &bad), EINVAL) << "above max_inline_data";
}

TEST_F(VerbsTest, UnsignaledSendsMakeNoCompletion) {
  Buffer& src = Buf(a_.pd, 64);
  Buffer& dst = Buf(b_.pd, 64);
  for (int i = 0; i < 4; ++i) ASSERT_EQ(PostRecv(b_.qp, dst, 0, 64, i), 0);
  for (int i = 0; i < 3; ++i) ASSERT_EQ(PostSend(a_.qp, IBV_WR_SEND, src, 0, 8, i, 0), 0);
  ASSERT_EQ(PostSend(a_.qp, IBV_WR_SEND, src, 0, 8, 9, IBV_SEND_SIGNALED), 0);
  EXPECT_EQ(PollN(b_.cq, 4).size(), 4u);
  auto tx = PollN(a_.cq, 4, 300);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].wr_id, 9u);
}

// QP numbers come 256 to a listening socket; a listener whose numbers are
// all given out and whose QPs are all gone is closed: a process that makes
// and destroys QPs all day keeps no more sockets than it started with (it
// kept one more per 256 QPs).
TEST(Verbs, QpListenersGoWithTheirQps) {
  auto fds = [] {
    int n = 0;
    if (DIR* d = opendir("/proc/self/fd")) {
      while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
      closedir(d);
    }
    return n;
  };
  // A device of its own and no connected QPs: nothing else opens sockets.
  ibv_context* ctx = OpenDevice();
  ASSERT_NE(ctx, nullptr);
  ibv_pd* pd = ibv_alloc_pd(ctx);
  ibv_cq* cq = ibv_create_cq(ctx, 16, nullptr, nullptr, 0);
  ASSERT_TRUE(pd != nullptr && cq != nullptr);
  ibv_qp_init_attr qa{};
  qa.send_cq = qa.recv_cq = cq;
  qa.qp_type = IBV_QPT_RC;
  qa.cap.max_send_wr = qa.cap.max_recv_wr = 4;
  qa.cap.max_send_sge = qa.cap.max_recv_sge = 1;
  ibv_qp* kept = ibv_create_qp(pd, &qa);  // its listener stays: it has a QP
  ASSERT_NE(kept, nullptr);
  const int before = fds();
  std::set<uint32_t> listeners;  // the ports in the QP numbers
  for (int i = 0; i < 1000; ++i) {
    ibv_qp* qp = ibv_create_qp(pd, &qa);
    ASSERT_NE(qp, nullptr) << i << ": " << strerror(errno);
    listeners.insert(qp->qp_num >> 8);
    ASSERT_EQ(ibv_destroy_qp(qp), 0);
  }
  EXPECT_GE(listeners.size(), 3u) << "1,000 QPs took several listeners";
  EXPECT_LE(fds(), before + 1) << "at most the listener giving out numbers now";
  // The first listener's last QP goes: so does that listener.
  ibv_destroy_qp(kept);
  EXPECT_LE(fds(), before) << "the kept QP's listener stayed after it";
  ibv_destroy_cq(cq);
  ibv_dealloc_pd(pd);
  ibv_close_device(ctx);
}

TEST_F(VerbsTest, SendQueueFullIsEnomem) {
  Buffer& src = Buf(a_.pd, 64);
  int posted = 0, err = 0;
  for (int i = 0; i < 200 && err == 0; ++i) {  // no receives: nothing completes
    err = PostSend(a_.qp, IBV_WR_SEND, src, 0, 8, i);
    if (err == 0) ++posted;
  }
  EXPECT_EQ(err, ENOMEM);
  EXPECT_EQ(posted, 64);
}

// Remote access errors: the requester gets IBV_WC_REM_ACCESS_ERR, both QPs
// go to the error state and what follows is flushed.
class RemoteAccessTest : public VerbsTest {
 protected:
  void ExpectAccessError(ibv_wr_opcode op, uint64_t addr, uint32_t rkey, size_t len = 64) {
    Buffer& local = Buf(a_.pd, 4096);
    ASSERT_EQ(PostSend(a_.qp, op, local, 0, len, 1, IBV_SEND_SIGNALED, addr, rkey), 0);
    ASSERT_EQ(PostSend(a_.qp, IBV_WR_SEND, local, 0, 8, 2, 0), 0);
    auto tx = PollN(a_.cq, 2);
    ASSERT_EQ(tx.size(), 2u);
    EXPECT_EQ(tx[0].wr_id, 1u);
    EXPECT_EQ(tx[0].status, IBV_WC_REM_ACCESS_ERR) << ibv_wc_status_str(tx[0].status);
    EXPECT_EQ(tx[1].wr_id, 2u);
    EXPECT_EQ(tx[1].status, IBV_WC_WR_FLUSH_ERR) << "unsignaled WRs flush with a completion";
    EXPECT_EQ(QpState(a_.qp), IBV_QPS_ERR);
    for (int i = 0; i < 100 && QpState(b_.qp) != IBV_QPS_ERR; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    EXPECT_EQ(QpState(b_.qp), IBV_QPS_ERR);
    // The responder's QP raises IBV_EVENT_QP_ACCESS_ERR, as an HCA's does:
    // the only word its owner gets of why (its receives just flush).
    bool seen = false;
    pollfd p{b_.qp->context->async_fd, POLLIN, 0};
    while (!seen && poll(&p, 1, 2000) == 1) {
      ibv_async_event ev;
      ASSERT_EQ(ibv_get_async_event(b_.qp->context, &ev), 0);
      seen = ev.event_type == IBV_EVENT_QP_ACCESS_ERR && ev.element.qp == b_.qp;
      ibv_ack_async_event(&ev);
    }
    EXPECT_TRUE(seen) << "no IBV_EVENT_QP_ACCESS_ERR for the responder's QP";
  }
};

TEST_F(RemoteAccessTest, UnknownRkey) {
  Buffer& remote = Buf(b_.pd, 4096);
  ExpectAccessError(IBV_WR_RDMA_WRITE, remote.addr(), remote.mr->rkey ^ 0x5a5a00);
}

TEST_F(RemoteAccessTest, WriteOutOfBounds) {
  Buffer& remote = Buf(b_.pd, 4096);
  ExpectAccessError(IBV_WR_RDMA_WRITE, remote.addr() + 4090, remote.mr->rkey);
}

TEST_F(RemoteAccessTest, ReadBeforeTheRegion) {
  Buffer& remote = Buf(b_.pd, 4096);
  ExpectAccessError(IBV_WR_RDMA_READ, remote.addr() - 8, remote.mr->rkey);
}

TEST_F(RemoteAccessTest, RegionOfAnotherProtectionDomain) {
  ibv_pd* other = ibv_alloc_pd(ctx_);
  Buffer& remote = Buf(other, 4096);
  ExpectAccessError(IBV_WR_RDMA_WRITE, remote.addr(), remote.mr->rkey);
  FreeBuffer(remote);
  EXPECT_EQ(ibv_dealloc_pd(other), 0);
}

TEST_F(RemoteAccessTest, WriteWithoutRemoteWriteRight) {
  Buffer& remote = Buf(b_.pd, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
  ExpectAccessError(IBV_WR_RDMA_WRITE, remote.addr(), remote.mr->rkey);
}

TEST_F(RemoteAccessTest, ReadWithoutRemoteReadRight) {
  Buffer& remote = Buf(b_.pd, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  ExpectAccessError(IBV_WR_RDMA_READ, remote.addr(), remote.mr->rkey);
}

TEST_F(VerbsTest, BadLkeyIsLocalProtectionError) {
  Buffer& src = Buf(a_.pd, 64);
  ibv_sge sge{src.addr(), 64, src.mr->lkey + 7};
  ibv_send_wr wr{}, *bad;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED;
  ASSERT_EQ(ibv_post_send(a_.qp, &wr, &bad), 0);
  auto tx = PollN(a_.cq, 1);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_LOC_PROT_ERR);
  EXPECT_EQ(QpState(a_.qp), IBV_QPS_ERR);
}

TEST_F(VerbsTest, ReceiveTooSmallIsLengthError) {
  Buffer& src = Buf(a_.pd, 256);
  Buffer& dst = Buf(b_.pd, 256);
  ASSERT_EQ(PostRecv(b_.qp, dst, 0, 16, 5), 0);
  ASSERT_EQ(PostSend(a_.qp, IBV_WR_SEND, src, 0, 100, 6), 0);
  auto rx = PollN(b_.cq, 1);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].status, IBV_WC_LOC_LEN_ERR);
  auto tx = PollN(a_.cq, 1);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_REM_INV_REQ_ERR);
}

TEST_F(VerbsTest, ErrorStateFlushesPostedReceives) {
  Buffer& dst = Buf(b_.pd, 64);
  for (int i = 0; i < 5; ++i) ASSERT_EQ(PostRecv(b_.qp, dst, 0, 64, i), 0);
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_ERR;
  ASSERT_EQ(ibv_modify_qp(b_.qp, &a, IBV_QP_STATE), 0);
  auto rx = PollN(b_.cq, 5);
  ASSERT_EQ(rx.size(), 5u);
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(rx[i].status, IBV_WC_WR_FLUSH_ERR);
    EXPECT_EQ(rx[i].wr_id, static_cast<uint64_t>(i));
  }
  ASSERT_EQ(PostRecv(b_.qp, dst, 0, 64, 9), 0);  // in ERR: flushed at once
  rx = PollN(b_.cq, 1);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].status, IBV_WC_WR_FLUSH_ERR);
}

// Back to RESET, a QP's completions left in its CQ go (as rdma-core's
// providers clean the CQ), and it can be brought up again: rdma-core's
// rereg tests fail a QP, reset it, reconnect it and expect clean traffic.
TEST_F(VerbsTest, ResetClearsTheQpsCompletionsAndItComesBack) {
  Buffer& src = Buf(a_.pd, 64);
  Buffer& dst = Buf(b_.pd, 64);
  for (int i = 0; i < 3; ++i) ASSERT_EQ(PostRecv(b_.qp, dst, 0, 64, i), 0);
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_ERR;
  ASSERT_EQ(ibv_modify_qp(b_.qp, &a, IBV_QP_STATE), 0);
  ASSERT_EQ(ibv_modify_qp(a_.qp, &a, IBV_QP_STATE), 0);
  a.qp_state = IBV_QPS_RESET;
  ASSERT_EQ(ibv_modify_qp(b_.qp, &a, IBV_QP_STATE), 0);
  ASSERT_EQ(ibv_modify_qp(a_.qp, &a, IBV_QP_STATE), 0);
  EXPECT_EQ(PollN(b_.cq, 1, 100).size(), 0u) << "the three flushes were left from before";
  ASSERT_TRUE(ConnectPair(ctx_, a_, b_, QpOptions{}, QpOptions{}));
  memcpy(src.data.data(), "again", 5);
  ASSERT_EQ(PostRecv(b_.qp, dst, 0, 64, 7), 0);
  ASSERT_EQ(PostSend(a_.qp, IBV_WR_SEND, src, 0, 5, 8), 0);
  auto tx = PollN(a_.cq, 1);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
  auto rx = PollN(b_.cq, 1);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(rx[0].wr_id, 7u);
  EXPECT_EQ(memcmp(dst.data.data(), "again", 5), 0);
}

// ibv_create_qp_ex: a PD with creation flags, none set, is a plain QP (its
// caps reported back); what is not emulated says EOPNOTSUPP, as rdma-core
// does, so callers take their not-supported path.
TEST_F(VerbsTest, CreateQpExTakesEmptyCreationFlagsAndRefusesTheRest) {
  ibv_qp_init_attr_ex ex{};
  ex.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_CREATE_FLAGS;
  ex.pd = a_.pd;
  ex.send_cq = ex.recv_cq = a_.cq;
  ex.qp_type = IBV_QPT_RC;
  ex.cap.max_send_wr = ex.cap.max_recv_wr = 4;
  ex.cap.max_send_sge = ex.cap.max_recv_sge = 1;
  ibv_qp* qp = ibv_create_qp_ex(ctx_, &ex);
  ASSERT_NE(qp, nullptr) << strerror(errno);
  EXPECT_GE(ex.cap.max_send_wr, 4u);
  EXPECT_EQ(qp->qp_type, IBV_QPT_RC);
  EXPECT_EQ(ibv_destroy_qp(qp), 0);
  ex.create_flags = IBV_QP_CREATE_SCATTER_FCS;
  errno = 0;
  EXPECT_EQ(ibv_create_qp_ex(ctx_, &ex), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP);
  ex.create_flags = 0;
  ex.comp_mask |= IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
  ex.send_ops_flags = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP;
  errno = 0;
  EXPECT_EQ(ibv_create_qp_ex(ctx_, &ex), nullptr) << "atomics are not emulated";
  EXPECT_EQ(errno, EOPNOTSUPP);
  ex.send_ops_flags = IBV_QP_EX_WITH_SEND;
  qp = ibv_create_qp_ex(ctx_, &ex);
  ASSERT_NE(qp, nullptr) << strerror(errno);
  EXPECT_NE(ibv_qp_to_qp_ex(qp), nullptr);
  EXPECT_EQ(ibv_qp_to_qp_ex(a_.qp), nullptr) << "made without send_ops_flags";
  EXPECT_EQ(ibv_destroy_qp(qp), 0);
  ex.comp_mask = IBV_QP_INIT_ATTR_CREATE_FLAGS;  // no PD
  errno = 0;
  EXPECT_EQ(ibv_create_qp_ex(ctx_, &ex), nullptr);
  EXPECT_EQ(errno, EINVAL);
}

// ibv_create_cq_ex with the standard fields, polled with start/next/end
// and the read_* functions (as UCX and rdma-core's tests do); fields that
// are not emulated (timestamps), a parent domain, creation flags other
// than single-threaded: EOPNOTSUPP.
TEST_F(VerbsTest, AnExtendedCqIsPolledWithItsOwnApi) {
  ibv_cq_init_attr_ex ca{};
  ca.cqe = 64;
  ca.wc_flags = IBV_WC_EX_WITH_BYTE_LEN | IBV_WC_EX_WITH_IMM | IBV_WC_EX_WITH_QP_NUM;
  ca.comp_mask = IBV_CQ_INIT_ATTR_MASK_FLAGS;
  ca.flags = IBV_CREATE_CQ_ATTR_SINGLE_THREADED;
  ibv_cq_ex* cqx = ibv_create_cq_ex(ctx_, &ca);
  ASSERT_NE(cqx, nullptr) << strerror(errno);
  // b_ again, its QP on the extended CQ, and the pair connected anew.
  ASSERT_EQ(ibv_destroy_qp(b_.qp), 0);
  ASSERT_EQ(ibv_destroy_cq(b_.cq), 0);
  b_.cq = ibv_cq_ex_to_cq(cqx);
  ibv_qp_init_attr qa{};
  qa.send_cq = qa.recv_cq = b_.cq;
  qa.qp_type = IBV_QPT_RC;
  qa.cap.max_send_wr = qa.cap.max_recv_wr = 16;
  qa.cap.max_send_sge = qa.cap.max_recv_sge = 1;
  b_.qp = ibv_create_qp(b_.pd, &qa);
  ASSERT_NE(b_.qp, nullptr);
  ibv_qp_attr reset{};
  reset.qp_state = IBV_QPS_RESET;
  ASSERT_EQ(ibv_modify_qp(a_.qp, &reset, IBV_QP_STATE), 0);
  ASSERT_TRUE(ConnectPair(ctx_, a_, b_, QpOptions{}, QpOptions{}));
  Buffer& src = Buf(a_.pd, 64);
  Buffer& dst = Buf(b_.pd, 64);
  ASSERT_EQ(PostRecv(b_.qp, dst, 0, 64, 41), 0);
  ASSERT_EQ(PostSend(a_.qp, IBV_WR_SEND_WITH_IMM, src, 0, 24, 42, IBV_SEND_SIGNALED, 0, 0,
                     0xfeed),
            0);
  ibv_poll_cq_attr pa{};
  int r = ENOENT;
  for (int i = 0; i < 10000 && r == ENOENT; ++i) {
    r = ibv_start_poll(cqx, &pa);
    if (r == ENOENT) std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  ASSERT_EQ(r, 0) << "no completion";
  EXPECT_EQ(cqx->status, IBV_WC_SUCCESS);
  EXPECT_EQ(cqx->wr_id, 41u);
  EXPECT_EQ(ibv_wc_read_opcode(cqx), IBV_WC_RECV);
  EXPECT_EQ(ibv_wc_read_byte_len(cqx), 24u);
  EXPECT_EQ(ntohl(ibv_wc_read_imm_data(cqx)), 0xfeedu);
  EXPECT_EQ(ibv_wc_read_qp_num(cqx), b_.qp->qp_num);
  EXPECT_NE(ibv_wc_read_wc_flags(cqx) & IBV_WC_WITH_IMM, 0u);
  EXPECT_EQ(ibv_next_poll(cqx), ENOENT);
  ibv_end_poll(cqx);
  pa.comp_mask = 1;
  EXPECT_EQ(ibv_start_poll(cqx, &pa), EINVAL);

  ca.wc_flags = IBV_WC_EX_WITH_COMPLETION_TIMESTAMP;
  errno = 0;
  EXPECT_EQ(ibv_create_cq_ex(ctx_, &ca), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP);
  ca.wc_flags = IBV_WC_EX_WITH_BYTE_LEN;
  ca.flags = IBV_CREATE_CQ_ATTR_IGNORE_OVERRUN;
  errno = 0;
  EXPECT_EQ(ibv_create_cq_ex(ctx_, &ca), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP);
}

// The extended post API (ibv_wr_*) on an RC QP: a batch of a send, an
// RDMA write of inline data and an RDMA read goes out in order with one
// ibv_wr_complete; a set without a WR fails the batch (EINVAL), an abort
// posts nothing.
TEST_F(VerbsTest, TheExtendedPostApiPostsABatch) {
  ibv_qp_init_attr_ex ex{};
  ex.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
  ex.pd = a_.pd;
  ex.send_cq = ex.recv_cq = a_.cq;
  ex.qp_type = IBV_QPT_RC;
  ex.cap.max_send_wr = ex.cap.max_recv_wr = 16;
  ex.cap.max_send_sge = ex.cap.max_recv_sge = 1;
  ex.cap.max_inline_data = 64;
  ex.send_ops_flags = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_READ;
  ASSERT_EQ(ibv_destroy_qp(a_.qp), 0);
  a_.qp = ibv_create_qp_ex(ctx_, &ex);
  ASSERT_NE(a_.qp, nullptr) << strerror(errno);
  ibv_qp_attr reset{};
  reset.qp_state = IBV_QPS_RESET;
  ASSERT_EQ(ibv_modify_qp(b_.qp, &reset, IBV_QP_STATE), 0);
  ASSERT_TRUE(ConnectPair(ctx_, a_, b_, QpOptions{}, QpOptions{}));
  ibv_qp_ex* qx = ibv_qp_to_qp_ex(a_.qp);
  ASSERT_NE(qx, nullptr);
  Buffer& src = Buf(a_.pd, 64);
  Buffer& back = Buf(a_.pd, 64);
  Buffer& dst = Buf(b_.pd, 64);
  memcpy(src.data.data(), "sent", 4);
  memcpy(dst.data.data() + 32, "read me", 7);
  ASSERT_EQ(PostRecv(b_.qp, dst, 0, 16, 100), 0);

  ibv_wr_start(qx);
  ibv_wr_set_sge(qx, src.mr->lkey, src.addr(), 4);  // before any WR
  ibv_wr_send(qx);
  EXPECT_EQ(ibv_wr_complete(qx), EINVAL);
  ibv_wr_start(qx);
  ibv_wr_send(qx);
  ibv_wr_set_sge(qx, src.mr->lkey, src.addr(), 4);
  ibv_wr_abort(qx);
  EXPECT_EQ(PollN(a_.cq, 1, 100).size(), 0u) << "an aborted batch posts nothing";

  ibv_wr_start(qx);
  qx->wr_id = 1;
  qx->wr_flags = IBV_SEND_SIGNALED;
  ibv_wr_send(qx);
  ibv_wr_set_sge(qx, src.mr->lkey, src.addr(), 4);
  qx->wr_id = 2;
  ibv_wr_rdma_write(qx, dst.mr->rkey, dst.addr() + 16);
  char text[] = "written inline";
  ibv_wr_set_inline_data(qx, text, sizeof(text) - 1);
  qx->wr_id = 3;
  ibv_wr_rdma_read(qx, dst.mr->rkey, dst.addr() + 32);
  ibv_wr_set_sge(qx, back.mr->lkey, back.addr(), 7);
  ASSERT_EQ(ibv_wr_complete(qx), 0);
  auto tx = PollN(a_.cq, 3);
  ASSERT_EQ(tx.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(tx[i].status, IBV_WC_SUCCESS) << i;
    EXPECT_EQ(tx[i].wr_id, static_cast<uint64_t>(i + 1));
  }
  EXPECT_EQ(tx[0].opcode, IBV_WC_SEND);
  EXPECT_EQ(tx[1].opcode, IBV_WC_RDMA_WRITE);
  EXPECT_EQ(tx[2].opcode, IBV_WC_RDMA_READ);
  auto rx = PollN(b_.cq, 1);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].byte_len, 4u);
  EXPECT_EQ(memcmp(dst.data.data(), "sent", 4), 0);
  EXPECT_EQ(memcmp(dst.data.data() + 16, "written inline", 14), 0);
  EXPECT_EQ(memcmp(back.data.data(), "read me", 7), 0);
}

// A child of fork starts over: the parent's agent thread (started here by
// the connected pair) did not come along and its epoll set is shared with
// the parent, yet the child opens the device and moves data on a pair of
// its own, while the parent's pair keeps working. (rdma-core's CM tests
// fork their two players from a process that used the device before.)
TEST_F(VerbsTest, AChildOfForkGetsARuntimeOfItsOwn) {
  Buffer& src = Buf(a_.pd, 64);
  Buffer& dst = Buf(b_.pd, 64);
  ASSERT_EQ(PostRecv(b_.qp, dst, 0, 64, 1), 0);
  ASSERT_EQ(PostSend(a_.qp, IBV_WR_SEND, src, 0, 8, 2), 0);
  ASSERT_EQ(PollN(b_.cq, 1).size(), 1u);
  ASSERT_EQ(PollN(a_.cq, 1).size(), 1u);
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ibv_context* ctx = OpenDevice();
    if (ctx == nullptr) _exit(10);
    Side x = MakeSide(ctx, QpOptions{}), y = MakeSide(ctx, QpOptions{});
    if (x.qp == nullptr || y.qp == nullptr) _exit(11);
    if (!ConnectPair(ctx, x, y, QpOptions{}, QpOptions{})) _exit(12);
    Buffer s = MakeBuffer(x.pd, 64, kAll), d = MakeBuffer(y.pd, 64, kAll);
    memcpy(s.data.data(), "child", 5);
    if (PostRecv(y.qp, d, 0, 64, 3) != 0 || PostSend(x.qp, IBV_WR_SEND, s, 0, 5, 4) != 0) _exit(13);
    auto rx = PollN(y.cq, 1, 5000);
    if (rx.size() != 1 || rx[0].status != IBV_WC_SUCCESS) _exit(14);
    _exit(memcmp(d.data.data(), "child", 5) == 0 ? 0 : 15);
  }
  int status = 0;
  for (int i = 0; i < 200 && waitpid(child, &status, WNOHANG) == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (waitpid(child, &status, WNOHANG) == 0) {
    kill(child, SIGKILL);
    waitpid(child, &status, 0);
    FAIL() << "the child hung (the parent's runtime in a forked process)";
  }
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the step that failed in the child";
  ASSERT_EQ(PostRecv(b_.qp, dst, 0, 64, 5), 0);
  ASSERT_EQ(PostSend(a_.qp, IBV_WR_SEND, src, 0, 8, 6), 0);
  auto rx = PollN(b_.cq, 1);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS) << "the parent's pair after the fork";
}

TEST_F(VerbsTest, IdleQpLearnsOfAGonePeerOnItsNextSend) {
  Buffer& src = Buf(a_.pd, 64);
  Buffer& dst = Buf(a_.pd, 64);
  for (int i = 0; i < 3; ++i) ASSERT_EQ(PostRecv(a_.qp, dst, 0, 64, 10 + i), 0);
  ASSERT_EQ(ibv_destroy_qp(b_.qp), 0);
  b_.qp = nullptr;
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(PollN(a_.cq, 1, 100).size(), 0u) << "an idle QP's receives stay posted";
  EXPECT_EQ(QpState(a_.qp), IBV_QPS_RTS);
  ASSERT_EQ(PostSend(a_.qp, IBV_WR_SEND, src, 0, 8, 1), 0);
  auto wc = PollN(a_.cq, 4);
  ASSERT_EQ(wc.size(), 4u);
  EXPECT_EQ(wc[0].wr_id, 1u);
  EXPECT_EQ(wc[0].status, IBV_WC_RETRY_EXC_ERR);
  for (int i = 1; i < 4; ++i) EXPECT_EQ(wc[i].status, IBV_WC_WR_FLUSH_ERR);
  EXPECT_EQ(QpState(a_.qp), IBV_QPS_ERR);
}

TEST_F(VerbsTest, PostingInTheWrongStateIsRefused) {
  Side c = MakeSide(ctx_, QpOptions{});
  Buffer& src = Buf(c.pd, 64);
  EXPECT_EQ(PostRecv(c.qp, src, 0, 64, 1), EINVAL) << "receive in RESET";
  EXPECT_EQ(PostSend(c.qp, IBV_WR_SEND, src, 0, 8, 1), EINVAL) << "send in RESET";
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  EXPECT_EQ(ibv_modify_qp(c.qp, &a, IBV_QP_STATE), EINVAL) << "RESET to RTR";
  a.qp_state = IBV_QPS_INIT;
  EXPECT_EQ(ibv_modify_qp(c.qp, &a, IBV_QP_STATE), EINVAL) << "INIT without port/access";
  a.port_num = 1;
  EXPECT_EQ(ibv_modify_qp(c.qp, &a,
                          IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS),
            0);
  EXPECT_EQ(PostSend(c.qp, IBV_WR_SEND, src, 0, 8, 1), EINVAL) << "send in INIT";
  FreeBuffer(src);
  bufs_.pop_back();
  DestroySide(c);
}

TEST(MemoryRegion, RemoteWriteNeedsLocalWrite) {
  ibv_context* ctx = OpenDevice();
  ASSERT_NE(ctx, nullptr);
  ibv_pd* pd = ibv_alloc_pd(ctx);
  char buf[64];
  errno = 0;
  EXPECT_EQ(ibv_reg_mr(pd, buf, sizeof(buf), IBV_ACCESS_REMOTE_WRITE), nullptr);
  EXPECT_EQ(errno, EINVAL);
  ibv_mr* mr = ibv_reg_mr(pd, buf, sizeof(buf), IBV_ACCESS_LOCAL_WRITE);
  ASSERT_NE(mr, nullptr);
  EXPECT_EQ(mr->lkey, mr->rkey);
  EXPECT_EQ(ibv_dealloc_pd(pd), EBUSY) << "PD still has an MR";
  ibv_dereg_mr(mr);
  EXPECT_EQ(ibv_dealloc_pd(pd), 0);
  ibv_close_device(ctx);
}

// What rdma-core's own tests found different from libibverbs and the
// kernel (each failed before its fix).
TEST(Conformance, DeviceAttributesAsLibibverbsGivesThem) {
  ibv_context* ctx = OpenDevice();
  ASSERT_NE(ctx, nullptr);
  ibv_device_attr_ex ex{};
  ASSERT_EQ(ibv_query_device_ex(ctx, nullptr, &ex), 0);
  EXPECT_EQ(ex.phys_port_cnt_ex, ex.orig_attr.phys_port_cnt) << "phys_port_cnt_ex left 0";
  EXPECT_EQ(ex.phys_port_cnt_ex, 1u);
  EXPECT_NE(ex.orig_attr.vendor_id, 0u) << "vendor id 0 reads as no device";
  // The GID table whole, or EINVAL when it does not fit; never part of it.
  ibv_gid_entry entries[4]{};
  EXPECT_EQ(ibv_query_gid_table(ctx, entries, 4, 0), 1);
  EXPECT_EQ(ibv_query_gid_table(ctx, entries, 0, 0), -EINVAL);
  ibv_close_device(ctx);
}

// softverbs' stand-in for libmlx5 answers the direct-verbs capability
// check with "no" instead of aborting (every other export still traps).
TEST(Conformance, Mlx5CapabilityCheckSaysNo) {
  Dl_info info{};
  ASSERT_NE(dladdr(reinterpret_cast<void*>(&ibv_get_device_list), &info), 0);
  std::string dir(info.dli_fname);
  dir.resize(dir.rfind('/'));
  void* h = dlopen((dir + "/libmlx5.so.1").c_str(), RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(h, nullptr) << "no stand-in libmlx5.so.1 beside " << info.dli_fname << ": "
                        << dlerror();
  auto is_supported = reinterpret_cast<bool (*)(ibv_device*)>(dlsym(h, "mlx5dv_is_supported"));
  ASSERT_NE(is_supported, nullptr);
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  ASSERT_GT(n, 0);
  EXPECT_FALSE(is_supported(list[0]));
  ibv_free_device_list(list);
}

TEST(Conformance, ForkNeedsNoCareAndSaysSo) {
  EXPECT_EQ(ibv_is_fork_initialized(), IBV_FORK_UNNEEDED);
  EXPECT_EQ(ibv_fork_init(), 0);
  EXPECT_NE(ibv_is_fork_initialized(), IBV_FORK_DISABLED)
      << "ibv_fork_init succeeded, so fork is safe";
}

TEST(Conformance, MwBindAccessIsAcceptedAndWindowsAreNotSupported) {
  ibv_context* ctx = OpenDevice();
  ASSERT_NE(ctx, nullptr);
  ibv_pd* pd = ibv_alloc_pd(ctx);
  char buf[64];
  ibv_mr* mr = ibv_reg_mr(pd, buf, sizeof(buf), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND);
  EXPECT_NE(mr, nullptr) << strerror(errno);
  errno = 0;
  EXPECT_EQ(ibv_alloc_mw(pd, IBV_MW_TYPE_1), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP);
  if (mr) ibv_dereg_mr(mr);
  ibv_dealloc_pd(pd);
  ibv_close_device(ctx);
}

// Registration pins pages as the kernel's ib_umem_get does: each page is
// faulted in (what registering costs), and a range that is not mapped, or
// not writable for a writable MR, fails with EFAULT (as ibv_reg_mr does on
// hardware), also when ibv_rereg_mr moves an MR there.
TEST(Conformance, RegistrationFaultsPagesInAndRefusesWhatIsNotMapped) {
  ibv_context* ctx = OpenDevice();
  ASSERT_NE(ctx, nullptr);
  ibv_pd* pd = ibv_alloc_pd(ctx);
  ASSERT_NE(pd, nullptr);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t n = 8;
  char* mem = static_cast<char*>(
      mmap(nullptr, n * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(mem, MAP_FAILED);
  auto resident = [&](char* at, size_t pages) {
    std::vector<unsigned char> v(pages);
    EXPECT_EQ(mincore(at, pages * page, v.data()), 0) << strerror(errno);
    size_t r = 0;
    for (unsigned char c : v) r += c & 1;
    return r;
  };
  ASSERT_EQ(resident(mem, n), 0u) << "fresh anonymous memory has no pages yet";
  // Pages 1-3, from inside page 1 to inside page 3.
  ibv_mr* mr = ibv_reg_mr(pd, mem + page + 100, 2 * page, IBV_ACCESS_LOCAL_WRITE);
  ASSERT_NE(mr, nullptr) << strerror(errno);
  EXPECT_EQ(resident(mem + page, 3), 3u) << "every page the MR spans is faulted in";
  EXPECT_EQ(resident(mem, 1) + resident(mem + 4 * page, n - 4), 0u) << "and only those";
  // Not mapped: EFAULT, and nothing counted.
  ASSERT_EQ(munmap(mem + 6 * page, 2 * page), 0);
  errno = 0;
  EXPECT_EQ(ibv_reg_mr(pd, mem + 5 * page, 2 * page, IBV_ACCESS_LOCAL_WRITE), nullptr);
  EXPECT_EQ(errno, EFAULT) << strerror(errno);
  // Read-only memory: a writable MR is refused, a read-only one is not.
  ASSERT_EQ(mprotect(mem + 4 * page, page, PROT_READ), 0);
  errno = 0;
  EXPECT_EQ(ibv_reg_mr(pd, mem + 4 * page, page, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE),
            nullptr);
  EXPECT_EQ(errno, EFAULT) << strerror(errno);
  ibv_mr* ro = ibv_reg_mr(pd, mem + 4 * page, page, IBV_ACCESS_REMOTE_READ);
  EXPECT_NE(ro, nullptr) << strerror(errno);
  if (ro) ibv_dereg_mr(ro);
  // Moved onto unmapped memory: refused, the MR stays where it was.
  errno = 0;
  EXPECT_EQ(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_TRANSLATION, nullptr, mem + 6 * page, page, 0),
            IBV_REREG_MR_ERR_CMD);
  EXPECT_EQ(errno, EFAULT) << strerror(errno);
  EXPECT_EQ(mr->addr, mem + page + 100);
  EXPECT_EQ(ibv_dereg_mr(mr), 0);
  munmap(mem, 6 * page);
  ibv_dealloc_pd(pd);
  ibv_close_device(ctx);
}

// On-demand paging, as mlx5 has it: the device says so, an implicit MR
// covers the whole address space for local access (no remote rights),
// registering pins and faults in nothing, and each work request faults in
// the pages it uses; one from memory that is not mapped fails with a
// local protection error instead of reaching the wire.
TEST_F(VerbsTest, OnDemandPagingMrsPinNothingAndFaultPagesInPerWorkRequest) {
  ibv_device_attr_ex attr{};
  ASSERT_EQ(ibv_query_device_ex(ctx_, nullptr, &attr), 0);
  EXPECT_TRUE(attr.odp_caps.general_caps & IBV_ODP_SUPPORT_IMPLICIT);
  EXPECT_TRUE(attr.odp_caps.per_transport_caps.rc_odp_caps & IBV_ODP_SUPPORT_WRITE);
  errno = 0;
  EXPECT_EQ(ibv_reg_mr(a_.pd, nullptr, SIZE_MAX, IBV_ACCESS_ON_DEMAND | IBV_ACCESS_LOCAL_WRITE |
                                                     IBV_ACCESS_REMOTE_WRITE),
            nullptr)
      << "an implicit MR with remote rights";
  EXPECT_EQ(errno, EOPNOTSUPP);
  ibv_mr* odp = ibv_reg_mr(a_.pd, nullptr, SIZE_MAX, IBV_ACCESS_ON_DEMAND);
  ASSERT_NE(odp, nullptr) << strerror(errno);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t n = 16;
  char* mem = static_cast<char*>(
      mmap(nullptr, n * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(mem, MAP_FAILED);
  // An explicit ODP MR over fresh memory faults nothing in (a pinned one
  // faults in every page: RegistrationFaultsPagesIn...).
  ibv_mr* fresh = ibv_reg_mr(a_.pd, mem, n * page, IBV_ACCESS_ON_DEMAND | IBV_ACCESS_LOCAL_WRITE);
  ASSERT_NE(fresh, nullptr) << strerror(errno);
  unsigned char in_core = 1;
  ASSERT_EQ(mincore(mem, page, &in_core), 0);
  EXPECT_EQ(in_core & 1, 0) << "registering faulted nothing in";
  EXPECT_EQ(ibv_dereg_mr(fresh), 0);
  Fill(mem, 8 * page, 7);
  Buffer& dst = Buf(b_.pd, 8 * page);
  // An RDMA WRITE straight from the application's memory, two pieces.
  ibv_sge sge[2] = {{reinterpret_cast<uint64_t>(mem), static_cast<uint32_t>(3 * page), odp->lkey},
                    {reinterpret_cast<uint64_t>(mem + 3 * page), static_cast<uint32_t>(5 * page),
                     odp->lkey}};
  ibv_send_wr wr{}, *bad = nullptr;
  wr.wr_id = 1;
  wr.sg_list = sge;
  wr.num_sge = 2;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = dst.addr();
  wr.wr.rdma.rkey = dst.mr->rkey;
  ASSERT_EQ(ibv_post_send(a_.qp, &wr, &bad), 0);
  auto wc = PollN(a_.cq, 1);
  ASSERT_EQ(wc.size(), 1u);
  EXPECT_EQ(wc[0].status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc[0].status);
  EXPECT_TRUE(Check(dst.data.data(), 8 * page, 7)) << "the bytes arrived as they were";
  // From memory it may not read (as gone): the work request fails, nothing
  // is sent. (PROT_NONE rather than unmapped: nothing else can be mapped
  // into the hole meanwhile.)
  ASSERT_EQ(mprotect(mem + 8 * page, 8 * page, PROT_NONE), 0);
  ibv_sge gone{reinterpret_cast<uint64_t>(mem + 8 * page), static_cast<uint32_t>(page), odp->lkey};
  wr.wr_id = 2;
  wr.sg_list = &gone;
  wr.num_sge = 1;
  ASSERT_EQ(ibv_post_send(a_.qp, &wr, &bad), 0);
  wc = PollN(a_.cq, 1);
  ASSERT_EQ(wc.size(), 1u);
  EXPECT_EQ(wc[0].status, IBV_WC_LOC_PROT_ERR) << ibv_wc_status_str(wc[0].status);
  munmap(mem, n * page);
  EXPECT_EQ(ibv_dereg_mr(odp), 0);
  // Turned off (SOFTVERBS_ODP=0, as a device without it): no caps, no MR.
  std::string out;
  EXPECT_EQ(RunSelf({"SOFTVERBS_ODP=0"}, {"--scenario", "odp-off"}, &out), 0) << out;
}

// Without MADV_POPULATE (kernels before 5.14) softverbs cannot fault pages
// in ahead of use at all: ODP then neither waits nor fails at the post.
bool PopulateWorks() {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* p = mmap(nullptr, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return false;
  bool ok = madvise(p, page, 22 /* MADV_POPULATE_READ */) == 0;
  munmap(p, page);
  return ok;
}

// A work request's on-demand paging range is faulted in without the
// runtime's lock, as an HCA faults pages in without holding up its other
// QPs. The range here is a page that userfaultfd keeps from being faulted
// in until the test says so: the post waits for it, and meanwhile a
// registration (which takes the runtime's lock) must go through. With the
// fault under the lock it would wait for the page as well. Twelve other
// ODP MRs are registered first (the engine has one per connection).
TEST_F(VerbsTest, AnOnDemandPageFaultHoldsUpNothingElse) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  if (!PopulateWorks()) GTEST_SKIP() << "this kernel has no MADV_POPULATE_READ";
  int uffd = static_cast<int>(syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK));
  if (uffd < 0) {
    // Kernels without it (ENOSYS), or not allowed here: a container's
    // seccomp policy, or vm.unprivileged_userfaultfd=0 for others than root.
    GTEST_SKIP() << "userfaultfd: " << strerror(errno);
  }
  uffdio_api api{};
  api.api = UFFD_API;
  ASSERT_EQ(ioctl(uffd, UFFDIO_API, &api), 0) << strerror(errno);
  char* mem = static_cast<char*>(
      mmap(nullptr, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(mem, MAP_FAILED);
  uffdio_register reg{};
  reg.range.start = reinterpret_cast<uint64_t>(mem);
  reg.range.len = page;
  reg.mode = UFFDIO_REGISTER_MODE_MISSING;
  ASSERT_EQ(ioctl(uffd, UFFDIO_REGISTER, &reg), 0) << strerror(errno);
  std::vector<std::vector<char>> others_mem(12, std::vector<char>(page));
  std::vector<ibv_mr*> others;
  for (auto& m : others_mem) {
    others.push_back(ibv_reg_mr(a_.pd, m.data(), m.size(), IBV_ACCESS_ON_DEMAND));
    ASSERT_NE(others.back(), nullptr) << strerror(errno);
  }
  ibv_mr* odp = ibv_reg_mr(a_.pd, nullptr, SIZE_MAX, IBV_ACCESS_ON_DEMAND);
  ASSERT_NE(odp, nullptr) << strerror(errno);
  Buffer& dst = Buf(b_.pd, page);

  ibv_sge sge{reinterpret_cast<uint64_t>(mem), static_cast<uint32_t>(page), odp->lkey};
  ibv_send_wr wr{}, *bad = nullptr;
  wr.wr_id = 1;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = dst.addr();
  wr.wr.rdma.rkey = dst.mr->rkey;
  std::vector<char> other(page);
  std::future<int> posted;
  std::future<ibv_mr*> registered;
  // Declared after the futures, so it goes first: whatever fails below,
  // closing userfaultfd lets the page fault in (a zero page) and the two
  // threads end instead of the futures waiting for them forever.
  struct CloseAtExit {
    int* fd;
    ~CloseAtExit() {
      if (*fd >= 0) close(*fd);
      *fd = -1;
    }
  } close_uffd{&uffd};
  posted = std::async(std::launch::async, [&] { return ibv_post_send(a_.qp, &wr, &bad); });
  // The post is in the page fault once userfaultfd reports it.
  pollfd pfd{uffd, POLLIN, 0};
  ASSERT_EQ(poll(&pfd, 1, 10000), 1) << "the post never touched the page";
  uffd_msg msg{};
  ASSERT_EQ(read(uffd, &msg, sizeof(msg)), static_cast<ssize_t>(sizeof(msg)));
  ASSERT_EQ(msg.event, UFFD_EVENT_PAGEFAULT);
  // Meanwhile: something else that takes the runtime's lock.
  registered = std::async(std::launch::async, [&] {
    return ibv_reg_mr(a_.pd, other.data(), other.size(), IBV_ACCESS_LOCAL_WRITE);
  });
  bool went_through = registered.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  EXPECT_TRUE(went_through) << "a registration waited for another QP's page fault";
  EXPECT_EQ(posted.wait_for(std::chrono::milliseconds(0)), std::future_status::timeout)
      << "the post did not wait for its page";
  // The page arrives.
  std::vector<char> content(page);
  Fill(content.data(), page, 41);
  uffdio_copy copy{};
  copy.dst = reinterpret_cast<uint64_t>(mem);
  copy.src = reinterpret_cast<uint64_t>(content.data());
  copy.len = page;
  ASSERT_EQ(ioctl(uffd, UFFDIO_COPY, &copy), 0) << strerror(errno);
  ASSERT_EQ(posted.get(), 0);
  ibv_mr* other_mr = registered.get();
  ASSERT_NE(other_mr, nullptr) << strerror(errno);
  auto wc = PollN(a_.cq, 1);
  ASSERT_EQ(wc.size(), 1u);
  EXPECT_EQ(wc[0].status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc[0].status);
  EXPECT_TRUE(Check(dst.data.data(), page, 41)) << "the page's bytes arrived";
  EXPECT_EQ(ibv_dereg_mr(other_mr), 0);
  EXPECT_EQ(ibv_dereg_mr(odp), 0);
  for (ibv_mr* m : others) EXPECT_EQ(ibv_dereg_mr(m), 0);
  munmap(mem, page);
}

// One element shared by two WRs of a chain, read by one and written by
// the other: each is judged with its own right. A READ into read-only
// memory fails (it would otherwise crash the process when the response
// lands), whatever the WRITE from the same memory found.
TEST_F(VerbsTest, EachWorkRequestOfAChainIsFaultedInForItsOwnAccess) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  if (!PopulateWorks()) GTEST_SKIP() << "this kernel has no MADV_POPULATE_READ";
  char* mem = static_cast<char*>(
      mmap(nullptr, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(mem, MAP_FAILED);
  Fill(mem, page, 5);
  ASSERT_EQ(mprotect(mem, page, PROT_READ), 0);
  ibv_mr* odp = ibv_reg_mr(a_.pd, mem, page, IBV_ACCESS_ON_DEMAND | IBV_ACCESS_LOCAL_WRITE);
  ASSERT_NE(odp, nullptr) << strerror(errno);
  Buffer& remote = Buf(b_.pd, page);
  Fill(remote.data.data(), page, 6);
  ibv_sge sge{reinterpret_cast<uint64_t>(mem), static_cast<uint32_t>(page), odp->lkey};
  ibv_send_wr wr[2]{}, *bad = nullptr;
  for (int i = 0; i < 2; ++i) {
    wr[i].wr_id = static_cast<uint64_t>(i + 1);
    wr[i].sg_list = &sge;
    wr[i].num_sge = 1;
    wr[i].send_flags = IBV_SEND_SIGNALED;
    wr[i].wr.rdma.remote_addr = remote.addr();
    wr[i].wr.rdma.rkey = remote.mr->rkey;
  }
  wr[0].opcode = IBV_WR_RDMA_READ;  // into read-only memory
  wr[0].next = &wr[1];
  wr[1].opcode = IBV_WR_RDMA_WRITE;  // from it: fine on its own
  ASSERT_EQ(ibv_post_send(a_.qp, &wr[0], &bad), 0);
  auto wc = PollN(a_.cq, 2);
  ASSERT_EQ(wc.size(), 2u);
  EXPECT_EQ(wc[0].wr_id, 1u);
  EXPECT_EQ(wc[0].status, IBV_WC_LOC_PROT_ERR) << ibv_wc_status_str(wc[0].status);
  EXPECT_EQ(wc[1].status, IBV_WC_WR_FLUSH_ERR) << ibv_wc_status_str(wc[1].status);
  EXPECT_TRUE(Check(mem, page, 5)) << "the read-only memory is as it was";
  EXPECT_EQ(ibv_dereg_mr(odp), 0);
  munmap(mem, page);
}

TEST_F(VerbsTest, RereggedRegionIsUsedByItsNewAddressAndRights) {
  // rdma-core's convention: 0, or a negative ibv_rereg_mr_err_code with
  // errno set.
  Buffer& local = Buf(a_.pd, 64);
  Buffer& remote = Buf(b_.pd, 64, IBV_ACCESS_LOCAL_WRITE);
  errno = 0;
  EXPECT_EQ(ibv_rereg_mr(remote.mr, 0x80, nullptr, nullptr, 0, 0), IBV_REREG_MR_ERR_INPUT);
  EXPECT_EQ(errno, EINVAL);
  EXPECT_EQ(ibv_rereg_mr(remote.mr, IBV_REREG_MR_CHANGE_TRANSLATION, nullptr, nullptr, 0, 0),
            IBV_REREG_MR_ERR_INPUT)
      << "a new translation needs an address and a length";
  // Writable from afar now, and at a new place.
  std::vector<char> moved(64, 0);
  ASSERT_EQ(ibv_rereg_mr(remote.mr, IBV_REREG_MR_CHANGE_TRANSLATION | IBV_REREG_MR_CHANGE_ACCESS,
                         nullptr, moved.data(), moved.size(), kAll),
            0);
  Fill(local.data.data(), 64, 21);
  ASSERT_EQ(PostSend(a_.qp, IBV_WR_RDMA_WRITE, local, 0, 64, 1, IBV_SEND_SIGNALED,
                     reinterpret_cast<uint64_t>(moved.data()), remote.mr->rkey),
            0);
  auto tx = PollN(a_.cq, 1);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS) << ibv_wc_status_str(tx[0].status);
  EXPECT_TRUE(Check(moved.data(), 64, 21));
  // Back where it was, without remote rights: refused.
  ASSERT_EQ(ibv_rereg_mr(remote.mr, IBV_REREG_MR_CHANGE_TRANSLATION | IBV_REREG_MR_CHANGE_ACCESS,
                         nullptr, remote.data.data(), 64, IBV_ACCESS_LOCAL_WRITE),
            0);
}

class RnrTest : public VerbsTest {
 protected:
  void SetUp() override {}
};

TEST_F(RnrTest, RetryCountExceededWithoutAReceive) {
  QpOptions o;
  o.rnr_retry = 2;
  o.min_rnr_timer = 1;
  Open(o, o);
  Buffer& src = Buf(a_.pd, 64);
  auto t0 = std::chrono::steady_clock::now();
  ASSERT_EQ(PostSend(a_.qp, IBV_WR_SEND, src, 0, 8, 1), 0);
  auto tx = PollN(a_.cq, 1);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_RNR_RETRY_EXC_ERR);
  EXPECT_EQ(QpState(a_.qp), IBV_QPS_ERR);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
}

TEST_F(RnrTest, InfiniteRetryWaitsForTheReceive) {
  QpOptions o;
  o.rnr_retry = 7;
  Open(o, o);
  Buffer& src = Buf(a_.pd, 64);
  Buffer& dst = Buf(b_.pd, 64);
  Fill(src.data.data(), 64, 5);
  ASSERT_EQ(PostSend(a_.qp, IBV_WR_SEND, src, 0, 64, 1), 0);
  EXPECT_EQ(PollN(a_.cq, 1, 200).size(), 0u) << "must wait, not fail";
  ASSERT_EQ(PostRecv(b_.qp, dst, 0, 64, 2), 0);
  auto tx = PollN(a_.cq, 1);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
  EXPECT_TRUE(Check(dst.data.data(), 64, 5));
}

class ChannelTest : public VerbsTest {
 protected:
  void SetUp() override {
    QpOptions o;
    o.channel = true;
    Open(o, o);
  }
  // b's channel in non-blocking mode; its fd.
  int NonBlockingChannel() {
    int fd = b_.channel->fd;
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    return fd;
  }
  bool Readable(int fd, int ms) {
    pollfd p{fd, POLLIN, 0};
    return poll(&p, 1, ms) == 1;
  }
  void SendOne(Buffer& src, Buffer& dst, uint64_t id) {
    ASSERT_EQ(PostRecv(b_.qp, dst, 0, 64, id), 0);
    ASSERT_EQ(PostSend(a_.qp, IBV_WR_SEND, src, 0, 8, id), 0);
  }
};

TEST_F(ChannelTest, OneEventPerArmAndNonBlockingRead) {
  Buffer& src = Buf(a_.pd, 64);
  Buffer& dst = Buf(b_.pd, 64);
  int fd = NonBlockingChannel();
  ibv_cq* cq;
  void* cq_ctx;
  EXPECT_EQ(ibv_get_cq_event(b_.channel, &cq, &cq_ctx), -1);
  EXPECT_EQ(errno, EAGAIN);

  SendOne(src, dst, 1);  // not armed: no event
  EXPECT_EQ(PollN(b_.cq, 1).size(), 1u);
  EXPECT_FALSE(Readable(fd, 50));

  ASSERT_EQ(ibv_req_notify_cq(b_.cq, 0), 0);
  SendOne(src, dst, 2);
  SendOne(src, dst, 3);
  EXPECT_TRUE(Readable(fd, 5000));
  ASSERT_EQ(ibv_get_cq_event(b_.channel, &cq, &cq_ctx), 0);
  EXPECT_EQ(cq, b_.cq);
  EXPECT_FALSE(Readable(fd, 100)) << "one event per arm";
  EXPECT_EQ(PollN(b_.cq, 2).size(), 2u);
  ibv_ack_cq_events(b_.cq, 1);
  PollN(a_.cq, 3);
}

// After an event the CQ is disarmed; its wires stay in the channel's set
// and the agent watches them again. Messages that come meanwhile are found
// by a poll of the CQ, raise no event, and leave the channel readable at
// most until their doorbell is read (a non-blocking read says EAGAIN); the
// next arm raises the next event as usual.
TEST_F(ChannelTest, MessagesWhileDisarmedAreFoundByAPollOrTheChannel) {
  Buffer& src = Buf(a_.pd, 64);
  Buffer& dst = Buf(b_.pd, 64);
  int fd = NonBlockingChannel();
  ibv_cq* cq;
  void* cq_ctx;
  for (int round = 0; round < 3; ++round) {
    uint64_t id = 10 * round;
    ASSERT_EQ(ibv_req_notify_cq(b_.cq, 0), 0);
    SendOne(src, dst, id + 1);
    ASSERT_TRUE(Readable(fd, 5000));
    ASSERT_EQ(ibv_get_cq_event(b_.channel, &cq, &cq_ctx), 0);
    ibv_ack_cq_events(cq, 1);
    ASSERT_EQ(PollN(b_.cq, 1).size(), 1u);
    // Disarmed: two more, nobody waiting; a poll finds them.
    SendOne(src, dst, id + 2);
    SendOne(src, dst, id + 3);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    std::vector<ibv_wc> got = PollN(b_.cq, 2, 5000);
    ASSERT_EQ(got.size(), 2u) << "round " << round;
    EXPECT_EQ(got[0].wr_id, id + 2);
    EXPECT_EQ(got[1].wr_id, id + 3);
    // One more, found through the channel: readable, no event, moved.
    SendOne(src, dst, id + 4);
    for (int i = 0; i < 500 && Readable(fd, 10); ++i) {
      errno = 0;
      EXPECT_EQ(ibv_get_cq_event(b_.channel, &cq, &cq_ctx), -1) << "an event while disarmed";
      EXPECT_EQ(errno, EAGAIN);
    }
    got = PollN(b_.cq, 1, 5000);
    ASSERT_EQ(got.size(), 1u) << "round " << round;
    EXPECT_EQ(got[0].wr_id, id + 4);
    EXPECT_FALSE(Readable(fd, 50));
    PollN(a_.cq, 4);
  }
}

TEST_F(ChannelTest, BlockedWaiterCanBeCancelled) {
  struct Arg {
    ibv_comp_channel* ch;
    bool returned = false;
  } arg{b_.channel};
  pthread_t t;
  ASSERT_EQ(pthread_create(
                &t, nullptr,
                [](void* p) -> void* {
                  auto* a = static_cast<Arg*>(p);
                  ibv_cq* cq;
                  void* ctx;
                  ibv_get_cq_event(a->ch, &cq, &ctx);
                  a->returned = true;
                  return nullptr;
                },
                &arg),
            0);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_EQ(pthread_cancel(t), 0);
  void* result = nullptr;
  ASSERT_EQ(pthread_join(t, &result), 0);
  EXPECT_EQ(result, PTHREAD_CANCELED);
  EXPECT_FALSE(arg.returned);
}

// A thread asleep on the channel is woken by the peer's doorbell and moves
// small frames itself; bulk ones go back to the agent. Either way every
// event arrives and every byte is right: messages of 1 B to 1 MiB in a
// row, each waited for on the channel in blocking mode.
TEST_F(ChannelTest, BlockingWaiterGetsEveryMessageSmallAndBulk) {
  const size_t kMax = 1 << 20;
  Buffer& src = Buf(a_.pd, kMax);
  Buffer& dst = Buf(b_.pd, kMax);
  const size_t kSizes[] = {1, 64, 4096, 65536, 65537, 300000, kMax, 8};
  for (int round = 0; round < 3; ++round) {
    for (size_t i = 0; i < sizeof(kSizes) / sizeof(kSizes[0]); ++i) {
      uint32_t seed = round * 100 + static_cast<uint32_t>(i);
      size_t n = kSizes[i];
      Fill(src.data.data(), n, seed);
      ASSERT_EQ(PostRecv(b_.qp, dst, 0, kMax, seed), 0);
      ASSERT_EQ(ibv_req_notify_cq(b_.cq, 0), 0);
      std::vector<ibv_wc> early = PollN(b_.cq, 1, 0);  // arm, then look once
      // The sender waits a little so the receiver is asleep on the channel.
      std::thread sender([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        PostSend(a_.qp, IBV_WR_SEND, src, 0, n, seed);
      });
      std::vector<ibv_wc> rx = early;
      if (rx.empty()) {
        ibv_cq* cq;
        void* ctx;
        ASSERT_EQ(ibv_get_cq_event(b_.channel, &cq, &ctx), 0) << strerror(errno);
        EXPECT_EQ(cq, b_.cq);
        ibv_ack_cq_events(cq, 1);
        rx = PollN(b_.cq, 1);
      }
      sender.join();
      ASSERT_EQ(rx.size(), 1u) << "message " << n << " B";
      EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS);
      EXPECT_EQ(rx[0].wr_id, seed);
      EXPECT_EQ(rx[0].byte_len, n);
      EXPECT_TRUE(Check(dst.data.data(), n, seed)) << "message " << n << " B";
      ASSERT_EQ(PollN(a_.cq, 1).size(), 1u);
    }
  }
}

// A thread asleep on an armed CQ's channel hears of a peer that went away
// with a send of ours outstanding (the peer's QP destroyed before it posted
// a receive): the send completes with an error and raises the event. The
// wire's TCP socket, which carries the peer's going, is watched by the
// agent alone while the doorbells wake the channel.
TEST_F(ChannelTest, AWaiterHearsOfAPeerThatWentAway) {
  Buffer& src = Buf(b_.pd, 64);
  Buffer& dst = Buf(b_.pd, 64);
  // One message both ways first: the wire is up and delegated.
  ASSERT_EQ(PostRecv(b_.qp, dst, 0, 64, 1), 0);
  ASSERT_EQ(ibv_req_notify_cq(b_.cq, 0), 0);
  Buffer& asrc = Buf(a_.pd, 64);
  ASSERT_EQ(PostSend(a_.qp, IBV_WR_SEND, asrc, 0, 8, 1), 0);
  ibv_cq* cq;
  void* ctx;
  ASSERT_EQ(ibv_get_cq_event(b_.channel, &cq, &ctx), 0) << strerror(errno);
  ibv_ack_cq_events(cq, 1);
  ASSERT_EQ(PollN(b_.cq, 1).size(), 1u);
  ASSERT_EQ(PollN(a_.cq, 1).size(), 1u);

  // a posts no receive: b's send waits (RNR, retried forever) until a goes.
  ASSERT_EQ(ibv_req_notify_cq(b_.cq, 0), 0);
  ASSERT_EQ(PostSend(b_.qp, IBV_WR_SEND, src, 0, 8, 2), 0);
  std::thread killer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ibv_destroy_qp(a_.qp);
  });
  bool woken = Readable(b_.channel->fd, 5000);
  killer.join();
  a_.qp = nullptr;
  ASSERT_TRUE(woken) << "the waiter did not hear of the gone peer in 5 s";
  ASSERT_EQ(ibv_get_cq_event(b_.channel, &cq, &ctx), 0) << strerror(errno);
  ibv_ack_cq_events(cq, 1);
  auto wc = PollN(b_.cq, 1);
  ASSERT_EQ(wc.size(), 1u);
  EXPECT_EQ(wc[0].wr_id, 2u);
  EXPECT_EQ(wc[0].status, IBV_WC_RETRY_EXC_ERR);
  EXPECT_EQ(QpState(b_.qp), IBV_QPS_ERR);
}

// An event loop's way: the channel non-blocking, poll() first. A readable
// channel may hold no event yet (the doorbell of a frame that completes
// nothing armed); ibv_get_cq_event then says EAGAIN instead of blocking.
TEST_F(ChannelTest, NonBlockingEventLoopNeverBlocksAndMissesNothing) {
  Buffer& src = Buf(a_.pd, 4096);
  Buffer& dst = Buf(b_.pd, 4096);
  int fd = NonBlockingChannel();
  const int kMessages = 200;
  int posted = 0;
  for (; posted < 60; ++posted) ASSERT_EQ(PostRecv(b_.qp, dst, 0, 4096, posted), 0);
  std::thread sender([&] {
    for (int i = 0; i < kMessages; ++i) {
      PostSend(a_.qp, IBV_WR_SEND, src, 0, 1 + i * 17 % 4096, i);
      if (i % 10 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  int got = 0, eagain = 0;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (got < kMessages && std::chrono::steady_clock::now() < deadline) {
    ASSERT_EQ(ibv_req_notify_cq(b_.cq, 0), 0);
    ibv_wc wc[16];
    int n = ibv_poll_cq(b_.cq, 16, wc);
    if (n > 0) {
      for (int k = 0; k < n; ++k) {
        EXPECT_EQ(wc[k].status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc[k].wr_id, static_cast<uint64_t>(got));
        ++got;
        if (posted < kMessages) {
          ASSERT_EQ(PostRecv(b_.qp, dst, 0, 4096, posted++), 0);
        }
      }
      continue;
    }
    if (!Readable(fd, 1000)) continue;
    ibv_cq* cq;
    void* ctx;
    if (ibv_get_cq_event(b_.channel, &cq, &ctx) == 0) {
      ibv_ack_cq_events(cq, 1);
    } else {
      EXPECT_EQ(errno, EAGAIN);
      ++eagain;
    }
  }
  sender.join();
  EXPECT_EQ(got, kMessages);
  EXPECT_EQ(PollN(a_.cq, kMessages).size(), static_cast<size_t>(kMessages));
}

// Send completions under each way of arming: for solicited events only, a
// send completion raises none but is there for the next poll (softverbs
// then lets the acknowledgement wait in the ring, unrung); armed for all,
// it raises the event (the acknowledgement rings the doorbell).
TEST_F(ChannelTest, SendCompletionsUnderSolicitedAndFullArming) {
  Buffer& src = Buf(a_.pd, 64);
  Buffer& dst = Buf(b_.pd, 64);
  int fd = a_.channel->fd;
  ibv_cq* cq;
  void* ctx;
  for (int solicited_only = 1; solicited_only >= 0; --solicited_only) {
    ASSERT_EQ(PostRecv(b_.qp, dst, 0, 64, 10 + solicited_only), 0);
    ASSERT_EQ(ibv_req_notify_cq(a_.cq, solicited_only), 0);
    ASSERT_EQ(PostSend(a_.qp, IBV_WR_SEND, src, 0, 8, 20 + solicited_only), 0);
    EXPECT_EQ(PollN(b_.cq, 1).size(), 1u);  // delivered (the peer acks it)
    if (solicited_only) {
      EXPECT_FALSE(Readable(fd, 100)) << "a send completion is not solicited";
    } else {
      ASSERT_TRUE(Readable(fd, 5000)) << "armed for all: the send completion raises the event";
      ASSERT_EQ(ibv_get_cq_event(a_.channel, &cq, &ctx), 0);
      EXPECT_EQ(cq, a_.cq);
      ibv_ack_cq_events(cq, 1);
    }
    auto tx = PollN(a_.cq, 1);
    ASSERT_EQ(tx.size(), 1u);
    EXPECT_EQ(tx[0].wr_id, 20u + solicited_only);
    EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
  }
}

TEST_F(ChannelTest, ChannelInUseCannotBeDestroyed) {
  EXPECT_EQ(ibv_destroy_comp_channel(b_.channel), EBUSY);
}

TEST_F(VerbsTest, LargeWriteThroughTheRingIsByteExact) {
  const size_t kSize = 64u << 20;  // much larger than the wire's ring
  Buffer& local = Buf(a_.pd, kSize);
  Buffer& remote = Buf(b_.pd, kSize);
  Fill(local.data.data(), kSize, 99);
  ASSERT_EQ(PostSend(a_.qp, IBV_WR_RDMA_WRITE, local, 0, kSize, 1, IBV_SEND_SIGNALED,
                     remote.addr(), remote.mr->rkey),
            0);
  auto tx = PollN(a_.cq, 1, 60000);
  ASSERT_EQ(tx.size(), 1u);
  EXPECT_EQ(tx[0].status, IBV_WC_SUCCESS);
  EXPECT_TRUE(Check(remote.data.data(), kSize, 99));
}

TEST_F(VerbsTest, ManyMessagesInFlightStayInOrder) {
  Buffer& src = Buf(a_.pd, 64 * 1024);
  Buffer& dst = Buf(b_.pd, 64 * 1024);
  int received = 0, sent = 0;
  for (int round = 0; round < 20; ++round) {
    for (int i = 0; i < 32; ++i) {
      uint64_t id = round * 32 + i;
      ASSERT_EQ(PostRecv(b_.qp, dst, i * 2048, 2048, id), 0);
      Fill(src.data.data() + i * 2048, 2048, static_cast<uint32_t>(id));
    }
    for (int i = 0; i < 32; ++i)
      ASSERT_EQ(PostSend(a_.qp, IBV_WR_SEND, src, i * 2048, 1 + (i * 61) % 2048,
                         round * 32 + i),
                0);
    auto rx = PollN(b_.cq, 32);
    ASSERT_EQ(rx.size(), 32u);
    for (int i = 0; i < 32; ++i) {
      EXPECT_EQ(rx[i].wr_id, static_cast<uint64_t>(round * 32 + i));
      EXPECT_EQ(rx[i].byte_len, 1u + (i * 61) % 2048);
      EXPECT_TRUE(Check(dst.data.data() + i * 2048, rx[i].byte_len, round * 32 + i));
    }
    received += static_cast<int>(rx.size());
    sent += static_cast<int>(PollN(a_.cq, 32).size());
  }
  EXPECT_EQ(received, 640);
  EXPECT_EQ(sent, 640);
}

}  // namespace
