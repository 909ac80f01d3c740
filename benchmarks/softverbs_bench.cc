// softverbs_bench: what the software RDMA device costs, measured in one run
// on one host with two processes, beside the kernel's TCP loopback and
// memcpy. Prints a table; figures are ratios within this run (shared,
// noisy machines make absolute times meaningless across runs).
//
//   small-message round trip: SEND/RECV ping-pong, both sides busy-polling
//     their CQ, vs a TCP_NODELAY ping-pong with blocking send/recv;
//   4 MB RDMA WRITE and READ bandwidth against a passive peer (its
//     softverbs agent serves them), vs memcpy of the same 4 MB buffers:
//     between heap buffers (softverbs copies each byte twice, into its
//     shared-memory ring and out) and between buffers that are shared
//     mappings of a sealed memfd, as grpc-rdma's pool makes them (once,
//     straight from one process's buffer to the other's);
//   memory registration: ibv_reg_mr and ibv_dereg_mr of 4 KiB to 64 MiB,
//     on fresh memory (never touched: registering faults every page in,
//     as pinning does) and on memory already in use; a second table.
#include <arpa/inet.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  int iters = 20000;
  int bw_iters = 200;
  std::vector<size_t> sizes = {64, 4096};
};

[[noreturn]] void Die(const char* what) {
  fprintf(stderr, "softverbs_bench: %s: %s\n", what, strerror(errno));
  exit(1);
}

void WriteAll(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = write(fd, c, n);
    if (w <= 0) Die("write");
    c += w;
    n -= static_cast<size_t>(w);
  }
}

void ReadAll(int fd, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    ssize_t r = read(fd, c, n);
    if (r <= 0) Die("read");
    c += r;
    n -= static_cast<size_t>(r);
  }
}

// What the two processes tell each other over a pipe pair.
struct Info {
  uint32_t qpn;
  uint16_t lid;
  uint64_t addr;
  uint32_t rkey;
  uint64_t shared_addr;  // the memfd buffer
  uint32_t shared_rkey;
};

struct Endpoint {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* cq = nullptr;
  ibv_qp* qp = nullptr;
  ibv_mr* mr = nullptr;
  char* buf = nullptr;
  ibv_mr* smr = nullptr;  // over sbuf: a shared mapping of a sealed memfd
  char* sbuf = nullptr;
  size_t size = 0;
  uint16_t lid = 0;

  void Open(size_t bytes) {
    int n = 0;
    ibv_device** list = ibv_get_device_list(&n);
    if (n == 0) Die("no RDMA device (run over softverbs: softverbs-run)");
    ctx = ibv_open_device(list[0]);
    ibv_free_device_list(list);
    pd = ibv_alloc_pd(ctx);
    cq = ibv_create_cq(ctx, 256, nullptr, nullptr, 0);
    ibv_qp_init_attr a{};
    a.send_cq = a.recv_cq = cq;
    a.qp_type = IBV_QPT_RC;
    a.cap.max_send_wr = 128;
    a.cap.max_recv_wr = 128;
    a.cap.max_send_sge = a.cap.max_recv_sge = 1;
    qp = ibv_create_qp(pd, &a);
    size = bytes;
    buf = static_cast<char*>(aligned_alloc(4096, bytes));
    memset(buf, 1, bytes);
    mr = ibv_reg_mr(pd, buf, bytes,
                    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
    int fd = memfd_create("softverbs-bench", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(bytes)) != 0 ||
        fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) != 0)
      Die("memfd");
    void* at = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (at == MAP_FAILED) Die("mmap memfd");
    close(fd);  // softverbs finds the file through the mapping
    sbuf = static_cast<char*>(at);
    memset(sbuf, 1, bytes);
    smr = ibv_reg_mr(pd, sbuf, bytes,
                     IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
    if (!smr) Die("ibv_reg_mr of the memfd buffer");
    ibv_port_attr port{};
    ibv_query_port(ctx, 1, &port);
    lid = port.lid;
    if (!qp || !mr) Die("verbs setup");
  }
  Info Mine() const {
    return {qp->qp_num, lid, reinterpret_cast<uint64_t>(buf), mr->rkey,
            reinterpret_cast<uint64_t>(sbuf), smr->rkey};
  }
  void Connect(const Info& peer) {
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_INIT;
    a.port_num = 1;
    a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                                  IBV_QP_ACCESS_FLAGS))
      Die("INIT");
    a = {};
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = IBV_MTU_4096;
    a.dest_qp_num = peer.qpn;
    a.max_dest_rd_atomic = 4;
    a.min_rnr_timer = 1;
    a.ah_attr.dlid = peer.lid;
    a.ah_attr.port_num = 1;
    if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                  IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                                  IBV_QP_MIN_RNR_TIMER))
      Die("RTR");
    a = {};
    a.qp_state = IBV_QPS_RTS;
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.max_rd_atomic = 4;
    if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT |
                                  IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC))
      Die("RTS");
  }
  void PostRecv(size_t len) {
    ibv_sge s{reinterpret_cast<uint64_t>(buf), static_cast<uint32_t>(len), mr->lkey};
    ibv_recv_wr wr{}, *bad;
    wr.sg_list = &s;
    wr.num_sge = 1;
    if (ibv_post_recv(qp, &wr, &bad)) Die("post_recv");
  }
  void Post(ibv_wr_opcode op, size_t len, bool signaled, uint64_t raddr = 0, uint32_t rkey = 0,
            bool shared = false) {
    ibv_sge s{reinterpret_cast<uint64_t>(shared ? sbuf : buf), static_cast<uint32_t>(len),
              shared ? smr->lkey : mr->lkey};
    ibv_send_wr wr{}, *bad;
    wr.sg_list = &s;
    wr.num_sge = 1;
    wr.opcode = op;
    wr.send_flags = signaled ? IBV_SEND_SIGNALED : 0;
    wr.wr.rdma.remote_addr = raddr;
    wr.wr.rdma.rkey = rkey;
    if (ibv_post_send(qp, &wr, &bad)) Die("post_send");
  }
  // Busy-polls until one completion of the given kind is available; the
  // other kind is counted for later.
  int done[2] = {0, 0};  // [0] sends/writes, [1] receives
  void WaitFor(bool recv) {
    while (done[recv] == 0) {
      ibv_wc wc[8];
      int n = ibv_poll_cq(cq, 8, wc);
      if (n < 0) Die("poll_cq");
      for (int i = 0; i < n; ++i) {
        if (wc[i].status != IBV_WC_SUCCESS) {
          fprintf(stderr, "softverbs_bench: completion error %s\n",
                  ibv_wc_status_str(wc[i].status));
          exit(1);
        }
        ++done[(wc[i].opcode & IBV_WC_RECV) != 0];
      }
    }
    --done[recv];
  }
};

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

// ------------------------------------------------------------ softverbs ---

struct VerbsResult {
  std::vector<double> p50_us, p99_us;
  double bw_gbs[4] = {};  // WRITE, READ between heap buffers; the same between memfd ones
  double memcpy_gbs = 0;
};

constexpr int kReps = 5;
double MemcpyGbs(int iters);

void VerbsServer(int rd, int wr, const Options& o) {
  Endpoint e;
  e.Open(4 << 20);
  Info mine = e.Mine(), peer;
  WriteAll(wr, &mine, sizeof(mine));
  ReadAll(rd, &peer, sizeof(peer));
  e.Connect(peer);
  const size_t kMax = *std::max_element(o.sizes.begin(), o.sizes.end());
  for (int i = 0; i < 64; ++i) e.PostRecv(kMax);
  for (size_t size : o.sizes) {
    int total = o.iters + o.iters / 10;
    char go = 1;
    WriteAll(wr, &go, 1);
    for (int i = 0; i < total; ++i) {
      e.WaitFor(true);
      e.PostRecv(kMax);
      e.Post(IBV_WR_SEND, size, false);
    }
    // Unsignaled sends complete with the next signaled one: drain.
    e.Post(IBV_WR_SEND, 0, true);
    e.WaitFor(false);
    ReadAll(rd, &go, 1);
  }
  // Bandwidth: stay passive; the agent thread serves the writes.
  char done;
  ReadAll(rd, &done, 1);
  _exit(0);
}

VerbsResult VerbsClient(int rd, int wr, const Options& o) {
  VerbsResult r;
  Endpoint e;
  e.Open(4 << 20);
  Info mine = e.Mine(), peer;
  ReadAll(rd, &peer, sizeof(peer));
  WriteAll(wr, &mine, sizeof(mine));
  e.Connect(peer);
  const size_t kMax = *std::max_element(o.sizes.begin(), o.sizes.end());
  for (int i = 0; i < 64; ++i) e.PostRecv(kMax);
  int posted = 64;
  for (size_t size : o.sizes) {
    char go;
    ReadAll(rd, &go, 1);
    int warm = o.iters / 10;
    std::vector<double> us;
    us.reserve(o.iters);
    for (int i = 0; i < o.iters + warm; ++i) {
      auto t0 = Clock::now();
      e.Post(IBV_WR_SEND, size, true);
      e.WaitFor(true);
      auto t1 = Clock::now();
      e.WaitFor(false);
      if (--posted < 32) {
        for (int k = 0; k < 32; ++k) e.PostRecv(kMax);
        posted += 32;
      }
      if (i >= warm) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
    // The server's final signaled 0-byte send.
    e.WaitFor(true);
    --posted;
    WriteAll(wr, &go, 1);
    r.p50_us.push_back(Percentile(us, 0.5));
    r.p99_us.push_back(Percentile(us, 0.99));
  }
  // 4 MB WRITEs and READs, 4 in flight, between heap buffers and between
  // memfd ones; the median of kReps runs, each interleaved with a memcpy
  // run so that all see the same machine.
  const size_t kChunk = 4 << 20;
  std::vector<double> gbs[4], mem;
  for (int rep = 0; rep < kReps; ++rep) {
    for (int k = 0; k < 4; ++k) {
      const ibv_wr_opcode op = k % 2 == 0 ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ;
      const bool shared = k >= 2;
      auto t0 = Clock::now();
      int inflight = 0;
      for (int i = 0; i < o.bw_iters; ++i) {
        e.Post(op, kChunk, true, shared ? peer.shared_addr : peer.addr,
               shared ? peer.shared_rkey : peer.rkey, shared);
        if (++inflight == 4) {
          e.WaitFor(false);
          --inflight;
        }
      }
      while (inflight-- > 0) e.WaitFor(false);
      double s = std::chrono::duration<double>(Clock::now() - t0).count();
      gbs[k].push_back(static_cast<double>(kChunk) * o.bw_iters / s / 1e9);
    }
    mem.push_back(MemcpyGbs(o.bw_iters));
  }
  for (int k = 0; k < 4; ++k) r.bw_gbs[k] = Percentile(gbs[k], 0.5);
  r.memcpy_gbs = Percentile(mem, 0.5);
  char done = 1;
  WriteAll(wr, &done, 1);
  return r;
}

// ------------------------------------------------------------------ TCP ---

std::vector<double> TcpPingPong(size_t size, int iters) {
  int lfd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) || listen(lfd, 1) ||
      getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &len))
    Die("tcp listen");
  int warm = iters / 10;
  pid_t pid = fork();
  if (pid == 0) {
    int c = accept(lfd, nullptr, nullptr);
    int one = 1;
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    std::vector<char> b(size);
    for (int i = 0; i < iters + warm; ++i) {
      ReadAll(c, b.data(), size);
      WriteAll(c, b.data(), size);
    }
    _exit(0);
  }
  close(lfd);
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a))) Die("tcp connect");
  std::vector<char> b(size, 1);
  std::vector<double> us;
  for (int i = 0; i < iters + warm; ++i) {
    auto t0 = Clock::now();
    WriteAll(fd, b.data(), size);
    ReadAll(fd, b.data(), size);
    if (i >= warm)
      us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  close(fd);
  waitpid(pid, nullptr, 0);
  return us;
}

double MemcpyGbs(int iters) {
  const size_t kChunk = 4 << 20;
  std::vector<char> a(kChunk, 1), b(kChunk, 2);
  auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) {
    memcpy(b.data(), a.data(), kChunk);
    std::swap(a, b);
  }
  double s = std::chrono::duration<double>(Clock::now() - t0).count();
  return static_cast<double>(kChunk) * iters / s / 1e9;
}

// Registration of `bytes` with the rights the engine's buffers have, median
// of `reps`, in microseconds: on fresh anonymous memory (mapped and never
// touched, as a new buffer is) and on memory in use (touched before), and
// the deregistration of the latter.
struct RegCost {
  double fresh_us, resident_us, dereg_us;
};

RegCost MeasureRegistration(ibv_pd* pd, size_t bytes, int reps) {
  const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  std::vector<double> fresh, resident, dereg;
  auto us = [](Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double, std::micro>(b - a).count();
  };
  for (int i = 0; i < reps; ++i) {
    void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) Die("mmap");
    auto t0 = Clock::now();
    ibv_mr* mr = ibv_reg_mr(pd, m, bytes, access);
    auto t1 = Clock::now();
    if (mr == nullptr) Die("ibv_reg_mr (fresh memory)");
    fresh.push_back(us(t0, t1));
    if (ibv_dereg_mr(mr) != 0) Die("ibv_dereg_mr");
    memset(m, 3, bytes);  // now in use
    t0 = Clock::now();
    mr = ibv_reg_mr(pd, m, bytes, access);
    t1 = Clock::now();
    if (mr == nullptr) Die("ibv_reg_mr (memory in use)");
    if (ibv_dereg_mr(mr) != 0) Die("ibv_dereg_mr");
    auto t2 = Clock::now();
    resident.push_back(us(t0, t1));
    dereg.push_back(us(t1, t2));
    munmap(m, bytes);
  }
  auto med = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  return {med(fresh), med(resident), med(dereg)};
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--iters" && i + 1 < argc) {
      o.iters = atoi(argv[++i]);
    } else if (a == "--bw-iters" && i + 1 < argc) {
      o.bw_iters = atoi(argv[++i]);
    } else {
      fprintf(stderr, "usage: softverbs_bench [--iters N] [--bw-iters N]\n");
      return 2;
    }
  }
  if (o.iters < 10 || o.bw_iters < 1) {
    fprintf(stderr, "softverbs_bench: --iters must be >= 10 and --bw-iters >= 1\n");
    return 2;
  }
  fprintf(stderr, "softverbs_bench: round trips (%d per size), then 4 MB writes and reads (%d)...\n",
          o.iters, o.bw_iters);
  // Two processes: fork before either touches verbs.
  int up[2], down[2];
  if (pipe(up) || pipe(down)) Die("pipe");
  pid_t pid = fork();
  if (pid == 0) {
    VerbsServer(down[0], up[1], o);
    _exit(0);
  }
  VerbsResult v = VerbsClient(up[0], down[1], o);
  int status = 0;
  waitpid(pid, &status, 0);
  fprintf(stderr, "softverbs_bench: TCP loopback and memcpy...\n");
  std::vector<double> tcp50, tcp99;
  for (size_t s : o.sizes) {
    auto us = TcpPingPong(s, o.iters);
    tcp50.push_back(Percentile(us, 0.5));
    tcp99.push_back(Percentile(us, 0.99));
  }
  double mem = v.memcpy_gbs;

  printf("| measure (one host, two processes) | softverbs | baseline | ratio |\n");
  printf("|---|---:|---:|---:|\n");
  for (size_t i = 0; i < o.sizes.size(); ++i) {
    printf("| %zu B round trip p50, us (baseline: TCP loopback) | %.2f | %.2f | %.2f |\n",
           o.sizes[i], v.p50_us[i], tcp50[i], v.p50_us[i] / tcp50[i]);
    printf("| %zu B round trip p99, us (baseline: TCP loopback) | %.2f | %.2f | %.2f |\n",
           o.sizes[i], v.p99_us[i], tcp99[i], v.p99_us[i] / tcp99[i]);
  }
  const char* kBw[4] = {"WRITE, heap buffers", "READ, heap buffers",
                        "WRITE, memfd buffers (one copy)", "READ, memfd buffers (one copy)"};
  for (int k = 0; k < 4; ++k)
    printf("| 4 MB RDMA %s, GB/s, median of %d (baseline: memcpy 4 MB) | %.2f | %.2f | %.2f |\n",
           kBw[k], kReps, v.bw_gbs[k], mem, v.bw_gbs[k] / mem);

  // Registration, in this process (its own device context).
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (n == 0) Die("no RDMA device");
  ibv_context* ctx = ibv_open_device(list[0]);
  ibv_free_device_list(list);
  ibv_pd* pd = ctx ? ibv_alloc_pd(ctx) : nullptr;
  if (pd == nullptr) Die("ibv_alloc_pd");
  printf("\n| ibv_reg_mr of | fresh memory, us | memory in use, us | ibv_dereg_mr, us | "
         "in use, GB/s registered |\n");
  printf("|---:|---:|---:|---:|---:|\n");
  for (size_t kib : {4, 64, 1024, 4096, 16384, 65536}) {
    size_t bytes = kib << 10;
    RegCost c = MeasureRegistration(pd, bytes, kib >= 16384 ? 5 : 21);
    printf("| %zu KiB | %.1f | %.1f | %.1f | %.1f |\n", kib, c.fresh_us, c.resident_us, c.dereg_us,
           static_cast<double>(bytes) / (c.resident_us * 1e3));
  }
  ibv_dealloc_pd(pd);
  ibv_close_device(ctx);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
