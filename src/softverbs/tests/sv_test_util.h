// Helpers for softverbs' tests: they use only the public libibverbs and
// librdmacm API, exactly as an application would.
#ifndef SOFTVERBS_TESTS_SV_TEST_UTIL_H_
#define SOFTVERBS_TESTS_SV_TEST_UTIL_H_

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <cstdint>
#include <string>
#include <vector>

namespace svtest {

// A registered buffer.
struct Buffer {
  std::vector<char> data;
  ibv_mr* mr = nullptr;
  uint64_t addr() const { return reinterpret_cast<uint64_t>(data.data()); }
};

// One side of a connection: its own PD, CQ and QP.
struct Side {
  ibv_pd* pd = nullptr;
  ibv_comp_channel* channel = nullptr;
  ibv_cq* cq = nullptr;
  ibv_qp* qp = nullptr;
};

struct QpOptions {
  int max_send_wr = 64;
  int max_recv_wr = 64;
  int max_inline = 64;
  uint8_t rnr_retry = 7;
  uint8_t min_rnr_timer = 1;   // 0.01 ms
  uint8_t timeout = 14;
  int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  bool channel = false;
};

// Opens the first softverbs device (the tests run with SOFTVERBS_DEVICES).
ibv_context* OpenDevice();

// Creates PD/CQ/QP (RESET) for a side.
Side MakeSide(ibv_context* ctx, const QpOptions& o);
// Moves both QPs through INIT, RTR and RTS against each other.
bool ConnectPair(ibv_context* ctx, Side& a, Side& b, const QpOptions& oa, const QpOptions& ob);
void DestroySide(Side& s);

Buffer MakeBuffer(ibv_pd* pd, size_t size, int access);
void FreeBuffer(Buffer& b);

// Polls until n completions arrived or timeout_ms passed.
std::vector<ibv_wc> PollN(ibv_cq* cq, int n, int timeout_ms = 10000);

int PostSend(ibv_qp* qp, ibv_wr_opcode op, const Buffer& b, size_t off, size_t len,
             uint64_t wr_id, unsigned flags = IBV_SEND_SIGNALED, uint64_t remote_addr = 0,
             uint32_t rkey = 0, uint32_t imm = 0);
int PostRecv(ibv_qp* qp, const Buffer& b, size_t off, size_t len, uint64_t wr_id);

ibv_qp_state QpState(ibv_qp* qp);

// Fills with a pattern that depends on seed and position.
void Fill(char* p, size_t n, uint32_t seed);
bool Check(const char* p, size_t n, uint32_t seed);

// Runs this test binary again as a child with extra environment and
// arguments; returns its exit status (or -1) and its combined output.
int RunSelf(const std::vector<std::string>& env, const std::vector<std::string>& args,
            std::string* output, int timeout_s = 60);

// Path of the running test binary.
std::string SelfPath();

}  // namespace svtest

#endif  // SOFTVERBS_TESTS_SV_TEST_UTIL_H_
