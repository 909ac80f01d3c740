#include "sv_test_util.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <thread>

extern char** environ;

namespace svtest {

ibv_context* OpenDevice() {
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (list == nullptr || n == 0) {
    if (list) ibv_free_device_list(list);
    return nullptr;
  }
  ibv_context* ctx = ibv_open_device(list[0]);
  ibv_free_device_list(list);
  return ctx;
}

Side MakeSide(ibv_context* ctx, const QpOptions& o) {
  Side s;
  s.pd = ibv_alloc_pd(ctx);
  if (o.channel) s.channel = ibv_create_comp_channel(ctx);
  ibv_device_attr d{};
  ibv_query_device(ctx, &d);
  s.cq = ibv_create_cq(ctx, std::min(1024, d.max_cqe), nullptr, s.channel, 0);
  ibv_qp_init_attr a{};
  a.send_cq = s.cq;
  a.recv_cq = s.cq;
  a.qp_type = IBV_QPT_RC;
  a.cap.max_send_wr = o.max_send_wr;
  a.cap.max_recv_wr = o.max_recv_wr;
  a.cap.max_send_sge = 4;
  a.cap.max_recv_sge = 4;
  a.cap.max_inline_data = o.max_inline;
  s.qp = ibv_create_qp(s.pd, &a);
  return s;
}

namespace {

bool ToRts(ibv_context* ctx, ibv_qp* qp, uint32_t dest_qpn, const QpOptions& o) {
  ibv_port_attr port{};
  if (ibv_query_port(ctx, 1, &port) != 0) return false;
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.port_num = 1;
  a.qp_access_flags = o.access;
  if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                                IBV_QP_ACCESS_FLAGS) != 0)
    return false;
  a = {};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = IBV_MTU_1024;
  a.dest_qp_num = dest_qpn;
  a.max_dest_rd_atomic = 4;
  a.min_rnr_timer = o.min_rnr_timer;
  a.ah_attr.dlid = port.lid;
  a.ah_attr.port_num = 1;
  if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                                IBV_QP_MIN_RNR_TIMER) != 0)
    return false;
  a = {};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = o.timeout;
  a.retry_cnt = 7;
  a.rnr_retry = o.rnr_retry;
  a.max_rd_atomic = 4;
  return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT |
                                   IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                   IBV_QP_MAX_QP_RD_ATOMIC) == 0;
}

}  // namespace

bool ConnectPair(ibv_context* ctx, Side& a, Side& b, const QpOptions& oa, const QpOptions& ob) {
  if (a.qp == nullptr || b.qp == nullptr) return false;
  return ToRts(ctx, a.qp, b.qp->qp_num, oa) && ToRts(ctx, b.qp, a.qp->qp_num, ob);
}

void DestroySide(Side& s) {
  if (s.qp) ibv_destroy_qp(s.qp);
  if (s.cq) ibv_destroy_cq(s.cq);
  if (s.channel) ibv_destroy_comp_channel(s.channel);
  if (s.pd) ibv_dealloc_pd(s.pd);
  s = Side{};
}

Buffer MakeBuffer(ibv_pd* pd, size_t size, int access) {
  Buffer b;
  b.data.assign(size, 0);
  b.mr = ibv_reg_mr(pd, b.data.data(), size, access);
  return b;
}

void FreeBuffer(Buffer& b) {
  if (b.mr) ibv_dereg_mr(b.mr);
  b.mr = nullptr;
}

std::vector<ibv_wc> PollN(ibv_cq* cq, int n, int timeout_ms) {
  std::vector<ibv_wc> out;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (static_cast<int>(out.size()) < n && std::chrono::steady_clock::now() < deadline) {
    ibv_wc wc[16];
    int got = ibv_poll_cq(cq, 16, wc);
    if (got < 0) break;
    out.insert(out.end(), wc, wc + got);
    if (got == 0) std::this_thread::yield();
  }
  return out;
}

int PostSend(ibv_qp* qp, ibv_wr_opcode op, const Buffer& b, size_t off, size_t len,
             uint64_t wr_id, unsigned flags, uint64_t remote_addr, uint32_t rkey, uint32_t imm) {
  ibv_sge sge{};
  sge.addr = b.addr() + off;
  sge.length = static_cast<uint32_t>(len);
  sge.lkey = b.mr ? b.mr->lkey : 0;
  ibv_send_wr wr{}, *bad = nullptr;
  wr.wr_id = wr_id;
  wr.opcode = op;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.send_flags = flags;
  wr.imm_data = htobe32(imm);
  wr.wr.rdma.remote_addr = remote_addr;
  wr.wr.rdma.rkey = rkey;
  return ibv_post_send(qp, &wr, &bad);
}

int PostRecv(ibv_qp* qp, const Buffer& b, size_t off, size_t len, uint64_t wr_id) {
  ibv_sge sge{};
  sge.addr = b.addr() + off;
  sge.length = static_cast<uint32_t>(len);
  sge.lkey = b.mr->lkey;
  ibv_recv_wr wr{}, *bad = nullptr;
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  return ibv_post_recv(qp, &wr, &bad);
}

ibv_qp_state QpState(ibv_qp* qp) {
  ibv_qp_attr a{};
  ibv_qp_init_attr i{};
  ibv_query_qp(qp, &a, IBV_QP_STATE, &i);
  return a.qp_state;
}

void Fill(char* p, size_t n, uint32_t seed) {
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1103515245u + 12345u;
    p[i] = static_cast<char>(x >> 16);
  }
}

bool Check(const char* p, size_t n, uint32_t seed) {
  std::vector<char> want(n);
  Fill(want.data(), n, seed);
  return n == 0 || memcmp(p, want.data(), n) == 0;
}

std::string SelfPath() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "";
  buf[n] = 0;
  return buf;
}

int RunSelf(const std::vector<std::string>& env, const std::vector<std::string>& args,
            std::string* output, int timeout_s) {
  int p[2];
  if (pipe(p) != 0) return -1;
  std::vector<std::string> envs;
  for (char** e = environ; *e; ++e) {
    std::string cur = *e;
    bool overridden = false;
    for (const auto& o : env)
      if (cur.compare(0, cur.find('=') + 1, o, 0, o.find('=') + 1) == 0) overridden = true;
    if (!overridden) envs.push_back(cur);
  }
  for (const auto& e : env) envs.push_back(e);
  std::vector<char*> envp, argv;
  for (auto& e : envs) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::string self = SelfPath();
  argv.push_back(self.data());
  std::vector<std::string> a = args;
  for (auto& s : a) argv.push_back(s.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, p[1], 1);
  posix_spawn_file_actions_adddup2(&fa, p[1], 2);
  posix_spawn_file_actions_addclose(&fa, p[0]);
  pid_t pid;
  int r = posix_spawn(&pid, self.c_str(), &fa, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  close(p[1]);
  if (r != 0) {
    close(p[0]);
    return -1;
  }
  output->clear();
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  for (;;) {
    pollfd pf{p[0], POLLIN, 0};
    int ms = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                  deadline - std::chrono::steady_clock::now())
                                  .count());
    if (ms <= 0) {
      kill(pid, SIGKILL);
      *output += "\n[killed: timeout]\n";
      break;
    }
    if (poll(&pf, 1, ms) <= 0) continue;
    char buf[4096];
    ssize_t n = read(p[0], buf, sizeof(buf));
    if (n <= 0) break;
    output->append(buf, static_cast<size_t>(n));
  }
  close(p[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace svtest
