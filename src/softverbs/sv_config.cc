// SOFTVERBS_* environment parsing, logging and counters.
#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "sv_internal.h"

namespace softverbs {
namespace {

struct ConfigResult {
  Config config;
  std::string error;  // non-empty: softverbs offers no device
  std::vector<std::string> warnings;
};

bool ParseLong(const char* name, long min, long max, long* out,
               std::string* error) {
  const char* v = getenv(name);
  if (v == nullptr || *v == '\0') return true;
  char* end = nullptr;
  errno = 0;
  long x = strtol(v, &end, 10);
  if (errno != 0 || end == v || *end != '\0' || x < min || x > max) {
    *error = std::string(name) + "='" + v + "' is not valid: expected an integer from " +
             std::to_string(min) + " to " + std::to_string(max);
    return false;
  }
  *out = x;
  return true;
}

const char* kStatusNames[] = {
    "IBV_WC_SUCCESS", "IBV_WC_LOC_LEN_ERR", "IBV_WC_LOC_QP_OP_ERR",
    "IBV_WC_LOC_EEC_OP_ERR", "IBV_WC_LOC_PROT_ERR", "IBV_WC_WR_FLUSH_ERR",
    "IBV_WC_MW_BIND_ERR", "IBV_WC_BAD_RESP_ERR", "IBV_WC_LOC_ACCESS_ERR",
    "IBV_WC_REM_INV_REQ_ERR", "IBV_WC_REM_ACCESS_ERR", "IBV_WC_REM_OP_ERR",
    "IBV_WC_RETRY_EXC_ERR", "IBV_WC_RNR_RETRY_EXC_ERR", "IBV_WC_LOC_RDD_VIOL_ERR",
    "IBV_WC_REM_INV_RD_REQ_ERR", "IBV_WC_REM_ABORT_ERR", "IBV_WC_INV_EECN_ERR",
    "IBV_WC_INV_EEC_STATE_ERR", "IBV_WC_FATAL_ERR", "IBV_WC_RESP_TIMEOUT_ERR",
    "IBV_WC_GENERAL_ERR"};

bool ParseStatus(Config* c, std::string* error) {
  const char* v = getenv("SOFTVERBS_FAIL_STATUS");
  if (v == nullptr || *v == '\0') return true;
  for (size_t i = 1; i < sizeof(kStatusNames) / sizeof(kStatusNames[0]); ++i) {
    if (strcmp(v, kStatusNames[i]) == 0 || strcmp(v, kStatusNames[i] + 7) == 0) {
      c->fail_status = static_cast<int>(i);
      return true;
    }
  }
  *error = std::string("SOFTVERBS_FAIL_STATUS='") + v +
           "' is not valid: expected an error status name such as "
           "IBV_WC_REM_ACCESS_ERR or REM_ACCESS_ERR";
  return false;
}

// Default devices: one per IPv4 interface that is up, non-loopback first.
void DefaultDevices(Config* c) {
  ifaddrs* ifs = nullptr;
  if (getifaddrs(&ifs) != 0) return;
  std::vector<DeviceSpec> lo, other;
  for (ifaddrs* i = ifs; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    if (!(i->ifa_flags & IFF_UP)) continue;
    DeviceSpec d;
    d.addr = reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr;
    d.mask = i->ifa_netmask
                 ? reinterpret_cast<sockaddr_in*>(i->ifa_netmask)->sin_addr
                 : in_addr{htonl(0xffffffff)};
    ((i->ifa_flags & IFF_LOOPBACK) ? lo : other).push_back(d);
  }
  freeifaddrs(ifs);
  int n = 0;
  for (auto* list : {&other, &lo}) {
    for (auto& d : *list) {
      d.name = "softverbs" + std::to_string(n++);
      c->devices.push_back(d);
    }
  }
}

// An address of this host: one an interface has, or any in a loopback
// interface's subnet (the kernel routes all of 127.0.0.1/8 locally, so
// 127.0.0.2 is this host's too, and two devices can sit on loopback).
bool NetmaskFor(in_addr a, in_addr* mask) {
  ifaddrs* ifs = nullptr;
  if (getifaddrs(&ifs) != 0) return false;
  bool found = false;
  for (ifaddrs* i = ifs; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    in_addr have = reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr;
    in_addr m = reinterpret_cast<sockaddr_in*>(i->ifa_netmask)->sin_addr;
    if (have.s_addr == a.s_addr) {
      *mask = m;
      found = true;
      break;
    }
    if ((i->ifa_flags & IFF_LOOPBACK) && (have.s_addr & m.s_addr) == (a.s_addr & m.s_addr)) {
      *mask = m;
      found = true;  // and look on: an interface that has it exactly wins
    }
  }
  freeifaddrs(ifs);
  return found;
}

// SOFTVERBS_DEVICES="mlx5_0:10.0.0.1,mlx5_1:127.0.0.1"
bool ParseDevices(Config* c, std::string* error, std::vector<std::string>* warnings) {
  const char* v = getenv("SOFTVERBS_DEVICES");
  if (v == nullptr || *v == '\0') {
    DefaultDevices(c);
    return true;
  }
  std::string s(v);
  std::vector<std::string> elsewhere;
  size_t pos = 0;
  while (pos <= s.size()) {
    size_t comma = s.find(',', pos);
    std::string item = s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    size_t colon = item.find(':');
    DeviceSpec d;
    if (colon == std::string::npos || colon == 0 || colon >= IBV_SYSFS_NAME_MAX ||
        inet_pton(AF_INET, item.c_str() + colon + 1, &d.addr) != 1) {
      *error = std::string("SOFTVERBS_DEVICES='") + v + "' is not valid at '" + item +
               "': expected NAME:IPV4[,NAME:IPV4...], e.g. mlx5_0:127.0.0.1";
      return false;
    }
    d.name = item.substr(0, colon);
    if (!NetmaskFor(d.addr, &d.mask)) {
      // As an RDMA device is seen from every network namespace while its
      // address lives in one, a device whose address is elsewhere is kept
      // (usable by a process, such as a forked child, that enters the
      // namespace holding it), with a host route: unless no address at all
      // is here, which is a mistake.
      d.mask.s_addr = 0xffffffff;
      elsewhere.push_back(std::string("SOFTVERBS_DEVICES: address ") +
                          (item.c_str() + colon + 1) + " of device " + d.name +
                          " is not an address of this host");
    }
    c->devices.push_back(d);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  if (elsewhere.size() == c->devices.size()) {
    *error = elsewhere[0];
    return false;
  }
  for (const std::string& e : elsewhere) {
    warnings->push_back(e + " (its network namespace?); the device is listed, and works only in "
                            "a process that has the address");
  }
  return true;
}

ConfigResult Load() {
  ConfigResult r;
  Config& c = r.config;
  std::string& e = r.error;
  long spin = c.spin_us, ring_kb = static_cast<long>(c.ring_bytes >> 10), shm = 1,
       delay = 0, drop = 0, fail = 0, qp_wr = c.max_qp_wr, cqe = c.max_cqe,
       sge = c.max_sge, inl = c.max_inline, trace = 0, resolve = c.resolve_us, direct = 1,
       acc_db = 1, removal = 0, addr_change = 0, device_return = 0, odp = 1, one_copy = 1;
  bool ok = ParseLong("SOFTVERBS_SPIN_US", 0, 1000000, &spin, &e) &&
            ParseLong("SOFTVERBS_RING_KB", 4, 1 << 20, &ring_kb, &e) &&
            ParseLong("SOFTVERBS_SHM", 0, 1, &shm, &e) &&
            ParseLong("SOFTVERBS_ODP", 0, 1, &odp, &e) &&
            ParseLong("SOFTVERBS_ONE_COPY", 0, 1, &one_copy, &e) &&
            ParseLong("SOFTVERBS_DIRECT_WAKE", 0, 1, &direct, &e) &&
            ParseLong("SOFTVERBS_ACCEPTOR_DOORBELL", 0, 1, &acc_db, &e) &&
            ParseLong("SOFTVERBS_DELAY_US", 0, 10000000, &delay, &e) &&
            ParseLong("SOFTVERBS_DROP_AFTER_OPS", 0, 1L << 40, &drop, &e) &&
            ParseLong("SOFTVERBS_FAIL_WR", 0, 1L << 40, &fail, &e) &&
            ParseStatus(&c, &e) &&
            ParseLong("SOFTVERBS_MAX_QP_WR", 1, 16384, &qp_wr, &e) &&
            ParseLong("SOFTVERBS_MAX_CQE", 1, 65536, &cqe, &e) &&
            ParseLong("SOFTVERBS_MAX_SGE", 1, 16, &sge, &e) &&
            ParseLong("SOFTVERBS_MAX_INLINE", 0, 4096, &inl, &e) &&
            ParseLong("SOFTVERBS_TRACE", 0, 1, &trace, &e) &&
            ParseLong("SOFTVERBS_RESOLVE_US", 0, 10000000, &resolve, &e) &&
            ParseLong("SOFTVERBS_DEVICE_REMOVAL_MS", 0, 3600000, &removal, &e) &&
            ParseLong("SOFTVERBS_ADDR_CHANGE_MS", 0, 3600000, &addr_change, &e) &&
            ParseLong("SOFTVERBS_DEVICE_RETURN_MS", 0, 3600000, &device_return, &e) &&
            ParseDevices(&c, &e, &r.warnings);
  if ((ring_kb & (ring_kb - 1)) != 0 && ok) {
    e = "SOFTVERBS_RING_KB='" + std::to_string(ring_kb) + "' is not valid: expected a power of two";
    ok = false;
  }
  if (!ok) {
    c.devices.clear();
    return r;
  }
  c.spin_us = static_cast<int>(spin);
  c.ring_bytes = static_cast<size_t>(ring_kb) << 10;
  c.use_shm = shm != 0;
  c.odp = odp != 0;
  c.one_copy = one_copy != 0;
  c.direct_wake = direct != 0;
  c.acceptor_doorbell = acc_db != 0;
  c.delay_us = static_cast<int>(delay);
  c.drop_after_ops = drop;
  c.fail_wr = fail;
  c.max_qp_wr = static_cast<int>(qp_wr);
  c.max_cqe = static_cast<int>(cqe);
  c.max_sge = static_cast<int>(sge);
  c.max_inline = static_cast<int>(inl);
  c.trace = trace != 0;
  c.resolve_us = static_cast<int>(resolve);
  c.device_removal_ms = static_cast<int>(removal);
  c.addr_change_ms = static_cast<int>(addr_change);
  c.device_return_ms = static_cast<int>(device_return);
  if (const char* s = getenv("SOFTVERBS_STATS")) {
    c.stats = (strcmp(s, "1") == 0) ? "stderr" : s;
  }
  if (const char* s = getenv("SOFTVERBS_DEVICE_CPU_DIR")) c.device_cpu_dir = s;
  return r;
}

}  // namespace

const Config& GetConfig() {
  static const ConfigResult* r = [] {
    auto* res = new ConfigResult(Load());
    if (!res->error.empty()) {
      fprintf(stderr, "softverbs: %s; softverbs offers no RDMA device\n", res->error.c_str());
    }
    for (const std::string& w : res->warnings) fprintf(stderr, "softverbs: %s\n", w.c_str());
    return res;
  }();
  return r->config;
}

uint64_t NowUs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000 + ts.tv_nsec / 1000;
}

namespace {
void Log(const char* fmt, va_list ap) {
  char buf[512];
  vsnprintf(buf, sizeof(buf), fmt, ap);
  fprintf(stderr, "softverbs[%d]: %s\n", getpid(), buf);
}
}  // namespace

// Trace lines carry the wall-clock time of day to the microsecond, so that
// they read as one timeline with gRPC's log lines (which carry it too).
void Trace(const char* fmt, ...) {
  if (!GetConfig().trace) return;
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  tm t{};
  localtime_r(&ts.tv_sec, &t);
  fprintf(stderr, "softverbs[%d]: %02d:%02d:%02d.%06ld %s\n", getpid(), t.tm_hour, t.tm_min,
          t.tm_sec, ts.tv_nsec / 1000, buf);
}

void Warn(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  Log(fmt, ap);
  va_end(ap);
}

// ----------------------------------------------------------------- stats ---

namespace {
constexpr int kMaxStatDevices = 16;
struct Counter {
  std::atomic<uint64_t> ops{0}, bytes{0};
};
Counter g_tx[kMaxStatDevices][kStatNumOps];
std::atomic<uint64_t> g_epoll_ctl{0};
std::atomic<uint64_t> g_doorbells[2];  // the agent's, the waiter's
Counter g_rx[kMaxStatDevices][kStatNumOps];
const char* kOpNames[kStatNumOps] = {"SEND", "SEND_WITH_IMM", "RDMA_WRITE",
                                     "RDMA_WRITE_WITH_IMM", "RDMA_READ", "RECV",
                                     "RDMA_WRITE_ONE_COPY", "RDMA_READ_ONE_COPY"};

void DumpStats() {
  const Config& c = GetConfig();
  std::string out;
  auto& rt = Runtime::Get();
  for (size_t d = 0; d < rt.devices.size() && d < kMaxStatDevices; ++d) {
    for (int dir = 0; dir < 2; ++dir) {
      for (int op = 0; op < kStatNumOps; ++op) {
        Counter& k = dir == 0 ? g_tx[d][op] : g_rx[d][op];
        if (k.ops.load() == 0) continue;
        char line[256];
        snprintf(line, sizeof(line),
                 "softverbs-stats pid=%d dev=%s dir=%s op=%s ops=%llu bytes=%llu\n",
                 getpid(), rt.devices[d]->dev.name, dir == 0 ? "tx" : "rx", kOpNames[op],
                 static_cast<unsigned long long>(k.ops.load()),
                 static_cast<unsigned long long>(k.bytes.load()));
        out += line;
      }
    }
  }
  if (out.empty()) {
    out = "softverbs-stats pid=" + std::to_string(getpid()) + " no traffic\n";
  }
  out += "softverbs-stats pid=" + std::to_string(getpid()) +
         " sys=epoll_ctl calls=" + std::to_string(g_epoll_ctl.load()) + "\n";
  out += "softverbs-stats pid=" + std::to_string(getpid()) + " doorbells agent=" +
         std::to_string(g_doorbells[0].load()) + " waiter=" + std::to_string(g_doorbells[1].load()) +
         "\n";
  if (c.stats == "stderr") {
    (void)!write(2, out.data(), out.size());
    return;
  }
  int fd = open(c.stats.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) {
    Warn("SOFTVERBS_STATS: cannot open %s: %s", c.stats.c_str(), strerror(errno));
    return;
  }
  (void)!write(fd, out.data(), out.size());
  close(fd);
}
}  // namespace

void CountDoorbell(bool waiter) { g_doorbells[waiter ? 1 : 0].fetch_add(1, std::memory_order_relaxed); }

int EpollCtl(int epfd, int op, int fd, epoll_event* ev) {
  g_epoll_ctl.fetch_add(1, std::memory_order_relaxed);
  return epoll_ctl(epfd, op, fd, ev);
}

void CountTx(int dev, StatOp op, uint64_t bytes) {
  if (dev < 0 || dev >= kMaxStatDevices) return;
  g_tx[dev][op].ops.fetch_add(1, std::memory_order_relaxed);
  g_tx[dev][op].bytes.fetch_add(bytes, std::memory_order_relaxed);
}

void CountRx(int dev, StatOp op, uint64_t bytes) {
  if (dev < 0 || dev >= kMaxStatDevices) return;
  g_rx[dev][op].ops.fetch_add(1, std::memory_order_relaxed);
  g_rx[dev][op].bytes.fetch_add(bytes, std::memory_order_relaxed);
}

void InstallStatsDump() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (!GetConfig().stats.empty()) atexit(DumpStats);
  });
}

// ------------------------------------- device work on application threads ---

namespace {

thread_local bool tls_agent = false;
thread_local int tls_device_depth = 0;

std::atomic<uint64_t>* g_device_ns = nullptr;  // the mapped total, once made
std::atomic<bool> g_device_tried{false};       // made, or failed and said so
std::mutex g_device_mu;

// The calling thread's CPU time: a thread preempted, or waiting for a
// lock, inside a scope is not working for the device. It is a system call
// (the vDSO does not serve it), and a small gRPC call opens several scopes
// on each side (posts, arms, polls that find the CQ empty): reading it in
// every scope added 25 us of CPU to a 90 us call here. So one scope in
// kSampleEvery, chosen at random (a fixed stride would keep meeting the
// same scope of a call's pattern), is timed and counts kSampleEvery times:
// an unbiased estimate over the thousands of scopes of any measure.
constexpr uint32_t kSampleEvery = 16;
thread_local uint32_t tls_sample_state = 0;
bool SampleThisScope() {
  uint32_t x = tls_sample_state;
  if (x == 0) x = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(&tls_sample_state)) | 1;
  x ^= x << 13;  // xorshift32
  x ^= x >> 17;
  x ^= x << 5;
  tls_sample_state = x;
  return x % kSampleEvery == 0;
}

uint64_t ThreadCpuNs() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

void DeviceWorkForked() {
  // The mapping is the parent's file: the child counts in its own.
  g_device_ns = nullptr;
  g_device_tried.store(false);
}

std::atomic<uint64_t>* DeviceTotal() {
  if (g_device_tried.load(std::memory_order_acquire)) return g_device_ns;
  std::lock_guard<std::mutex> g(g_device_mu);
  if (g_device_tried.load(std::memory_order_relaxed)) return g_device_ns;
  static std::once_flag atfork;
  std::call_once(atfork, [] { pthread_atfork(nullptr, nullptr, DeviceWorkForked); });
  std::string path = GetConfig().device_cpu_dir + "/" + std::to_string(getpid());
  int fd = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  void* m = MAP_FAILED;
  if (fd >= 0 && ftruncate(fd, sizeof(uint64_t)) == 0) {
    m = mmap(nullptr, sizeof(uint64_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  if (m == MAP_FAILED) {
    Warn("SOFTVERBS_DEVICE_CPU_DIR: cannot keep %s: %s; device work is not counted",
         path.c_str(), strerror(errno));
  } else {
    g_device_ns = new (m) std::atomic<uint64_t>(0);
  }
  if (fd >= 0) close(fd);
  g_device_tried.store(true, std::memory_order_release);
  return g_device_ns;
}

}  // namespace

void MarkAgentThread() { tls_agent = true; }
bool OnAgentThread() { return tls_agent; }

DeviceWork::DeviceWork() {
  if (tls_agent || tls_device_depth++ > 0) return;
  static const bool on = !GetConfig().device_cpu_dir.empty();
  if (on && SampleThisScope()) start_ns_ = ThreadCpuNs() + 1;  // +1: 0 means "not counting"
}

DeviceWork::~DeviceWork() {
  if (tls_agent) return;
  --tls_device_depth;
  if (start_ns_ == 0) return;
  if (std::atomic<uint64_t>* total = DeviceTotal()) {
    total->fetch_add((ThreadCpuNs() + 1 - start_ns_) * kSampleEvery, std::memory_order_relaxed);
  }
}

}  // namespace softverbs
