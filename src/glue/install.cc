// Install: puts the RDMA client and server vtables in place of gRPC's TCP
// ones, from a static initializer (linked or preloaded) or an explicit
// grpc_rdma::Install(). Also the stats snapshot and the trace flag.
#include <arpa/inet.h>
#include <dlfcn.h>
#include <grpc/support/alloc.h>
#include <grpc/support/log.h>
#include <link.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "config/config.h"
#include "config/malloc_tune.h"
#include "glue/endpoint.h"
#include "glue/runtime.h"
#include "glue/stats.h"
#include "glue/trace.h"
#include "grpc_rdma/grpc_rdma.h"
#include "grpc_rdma/version.h"
#include "src/core/lib/json/json.h"
#include "src/core/lib/iomgr/iomgr_internal.h"
#include "verbs/log.h"

// gRPC's own TCP client and server (tcp_client_posix.cc, tcp_server_posix.cc).
extern grpc_tcp_client_vtable grpc_posix_tcp_client_vtable;
extern grpc_tcp_server_vtable grpc_posix_tcp_server_vtable;

namespace grpc_rdma {

grpc_core::TraceFlag grpc_rdma_trace(false, "rdma");

namespace {

std::mutex g_install_mu;
std::atomic<Runtime*> g_runtime{nullptr};

// The library's messages (engine, verbs) through gRPC's logger, so that
// GRPC_VERBOSITY and gpr_set_log_function apply to them as to gRPC's own.
void GprSink(LogSeverity severity, const char* file, int line, const char* message) {
  gpr_log(file, line,
          severity == LogSeverity::kError ? GPR_LOG_SEVERITY_ERROR : GPR_LOG_SEVERITY_INFO,
          "grpc_rdma: %s", message);
}

// A program with a gRPC of its own (linked into it, as some wheels and
// static builds do) calls that one, not the libgrpc.so this library
// patched: its connections never reach grpc-rdma. Said when the process's
// first grpc_init is not libgrpc.so's. (A copy whose symbols are hidden
// cannot be seen from here.)
int FindLibgrpc(dl_phdr_info* info, size_t, void* out) {
  const char* name = info->dlpi_name;
  const char* base = name != nullptr ? strrchr(name, '/') : nullptr;
  base = base != nullptr ? base + 1 : name;
  if (base == nullptr || strncmp(base, "libgrpc.so.", 11) != 0) return 0;
  *static_cast<std::string*>(out) = name;
  return 1;
}

void SayIfAnotherGrpc() {
  std::string path;
  dl_iterate_phdr(FindLibgrpc, &path);
  if (path.empty()) return;
  void* h = dlopen(path.c_str(), RTLD_LAZY | RTLD_NOLOAD);
  if (h == nullptr) return;
  void* patched = dlsym(h, "grpc_init");
  void* first = dlsym(RTLD_DEFAULT, "grpc_init");
  dlclose(h);
  if (patched == nullptr || first == nullptr || first == patched) return;
  Dl_info where{};
  const char* other = dladdr(first, &where) != 0 && where.dli_fname != nullptr &&
                              where.dli_fname[0] != '\0'
                          ? where.dli_fname
                          : "the program";
  gpr_log(GPR_ERROR,
          "grpc_rdma: this process calls a gRPC of its own (grpc_init in %s), not %s, which "
          "grpc-rdma plugs into: its connections use that gRPC's TCP, not RDMA",
          other, path.c_str());
}

bool SameOptions(const Options& a, const Options& b) {
  return DescribeOptions(a) == DescribeOptions(b) && a.stats_dump == b.stats_dump &&
         a.stats_interval_s == b.stats_interval_s;
}

// TF_RDMA_STATS (and TF_RDMA_STATS_INTERVAL_S): one line of JSON to
// stderr, or a file replaced whole (written beside it, then renamed, so a
// reader never sees half of one). Dumps never overlap: the periodic one
// and the one at exit take turns.
std::mutex& DumpMu() {
  static auto* mu = new std::mutex;  // never destroyed: used from atexit
  return *mu;
}
bool g_exited = false;  // with DumpMu: the exit dump is done, no more

void DumpStats(const std::string& where) {
  std::string json = StatsJson(GetStats()) + "\n";
  if (where == "stderr") {
    fputs(("grpc_rdma stats: " + json).c_str(), stderr);
    return;
  }
  // A regular file (or none yet) is replaced; anything else (a pipe, a
  // device, a symbolic link) is written in place.
  struct stat st {};
  bool replace = lstat(where.c_str(), &st) == 0 ? S_ISREG(st.st_mode) : errno == ENOENT;
  std::string tmp = replace ? absl::StrCat(where, ".tmp.", getpid()) : where;
  FILE* f = fopen(tmp.c_str(), "w");
  bool ok = f != nullptr && fputs(json.c_str(), f) >= 0;
  int err = errno;
  if (f != nullptr && fclose(f) != 0 && ok) {
    ok = false;
    err = errno;
  }
  if (ok && (!replace || rename(tmp.c_str(), where.c_str()) == 0)) return;
  if (ok) err = errno;
  if (f != nullptr && replace) unlink(tmp.c_str());
  // Said once: a periodic dump would repeat it every interval.
  static std::atomic<bool> said{false};
  if (!said.exchange(true)) {
    gpr_log(GPR_ERROR, "grpc_rdma: TF_RDMA_STATS=%s: cannot write: %s", where.c_str(),
            strerror(err));
  }
}

std::string DumpDestination(const Options& o) {
  if (!o.stats_dump.empty()) return o.stats_dump;
  return o.stats_interval_s > 0 ? "stderr" : "";
}

void DumpStatsAtExit() {
  Runtime* rt = Runtime::Get();
  if (rt == nullptr) return;
  std::lock_guard<std::mutex> g(DumpMu());
  g_exited = true;
  std::string where = DumpDestination(rt->options());
  if (!where.empty()) DumpStats(where);
}

// TF_RDMA_STATS_INTERVAL_S: a thread that dumps every interval, for the
// life of the process (the stats it reads are never destroyed).
void StartPeriodicDumps(int interval_s, std::string where) {
  std::thread([interval_s, where] {
    for (;;) {
      std::this_thread::sleep_for(std::chrono::seconds(interval_s));
      std::lock_guard<std::mutex> g(DumpMu());
      if (g_exited) return;
      DumpStats(where);
    }
  }).detach();
}

}  // namespace

Runtime* Runtime::Get() { return g_runtime.load(std::memory_order_acquire); }

Engine* Runtime::engine() {
  std::lock_guard<std::mutex> g(mu_);
  if (!tried_) {
    tried_ = true;
    absl::StatusOr<std::unique_ptr<Engine>> e =
        Engine::Create(EngineOptions(options_), SliceChunkMemory());
    if (e.ok()) {
      engine_ = std::move(*e);
      GRPC_RDMA_TRACE("engine up: %s", DescribeOptions(engine_->options()).c_str());
    } else {
      unavailable_ = std::string(e.status().message());
      // The process asked for RDMA (TF_RDMA_ENABLED is true): that it runs
      // without is news at the default verbosity, once.
      gpr_log(GPR_ERROR,
              "grpc_rdma: RDMA is off in this process, gRPC uses TCP: %s "
              "(TF_RDMA_ENABLED=false turns the plugin off without this message)",
              unavailable_.c_str());
    }
  }
  return engine_.get();
}

std::string Runtime::unavailable() {
  std::lock_guard<std::mutex> g(mu_);
  return unavailable_;
}

const Engine* Runtime::started_engine() {
  std::lock_guard<std::mutex> g(mu_);
  return engine_.get();
}

bool Runtime::RecentlyFailed(const std::string& key) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = failed_.find(key);
  if (it == failed_.end()) return false;
  if (std::chrono::steady_clock::now() - it->second.seen >=
      std::chrono::seconds(options_.fallback_ttl_s)) {
    failed_.erase(it);
    return false;
  }
  return it->second.confirmed;
}

bool Runtime::RememberFailure(const std::string& key,
                              std::chrono::steady_clock::time_point tried) {
  if (options_.fallback_ttl_s == 0) return false;
  auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> g(mu_);
  auto it = failed_.find(key);
  bool live = it != failed_.end() &&
              now - it->second.seen < std::chrono::seconds(options_.fallback_ttl_s);
  if (!live) {
    failed_[key] = {now, false};
    return false;
  }
  if (it->second.confirmed) return true;
  // An attempt that started before the first TCP success (connections made
  // at once) confirms nothing: it may have raced the same restart.
  if (it->second.seen >= tried) return false;
  it->second = {now, true};
  return true;
}

void Runtime::ForgetFailure(const std::string& key) {
  std::lock_guard<std::mutex> g(mu_);
  failed_.erase(key);
}

bool Runtime::RecentlyUnjoined(const std::string& key) {
  // TF_RDMA_FALLBACK_TTL_S=0 asks that RDMA be tried every time; for an
  // address that joins none, trying RDMA is starting on it, so the memory
  // then keeps the default's 30 s.
  const int ttl_s = options_.fallback_ttl_s > 0 ? options_.fallback_ttl_s : 30;
  std::lock_guard<std::mutex> g(mu_);
  auto it = unjoined_.find(key);
  if (it == unjoined_.end()) return false;
  if (std::chrono::steady_clock::now() - it->second >= std::chrono::seconds(ttl_s)) {
    unjoined_.erase(it);
    return false;
  }
  return true;
}

void Runtime::RememberUnjoined(const std::string& key) {
  std::lock_guard<std::mutex> g(mu_);
  unjoined_[key] = std::chrono::steady_clock::now();
}

bool ToIpv4(const grpc_resolved_address* addr, sockaddr_in* out) {
  const auto* sa = reinterpret_cast<const sockaddr*>(addr->addr);
  if (sa->sa_family == AF_INET && addr->len >= sizeof(sockaddr_in)) {
    memcpy(out, addr->addr, sizeof(sockaddr_in));
    return true;
  }
  if (sa->sa_family == AF_INET6 && addr->len >= sizeof(sockaddr_in6)) {
    const auto* s6 = reinterpret_cast<const sockaddr_in6*>(addr->addr);
    if (!IN6_IS_ADDR_V4MAPPED(&s6->sin6_addr)) return false;
    *out = sockaddr_in{};
    out->sin_family = AF_INET;
    out->sin_port = s6->sin6_port;
    memcpy(&out->sin_addr, &s6->sin6_addr.s6_addr[12], 4);
    return true;
  }
  return false;
}

bool IsWildcard(const grpc_resolved_address* addr) {
  const auto* sa = reinterpret_cast<const sockaddr*>(addr->addr);
  if (sa->sa_family == AF_INET) {
    return reinterpret_cast<const sockaddr_in*>(sa)->sin_addr.s_addr == htonl(INADDR_ANY);
  }
  if (sa->sa_family == AF_INET6) {
    return IN6_IS_ADDR_UNSPECIFIED(&reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr);
  }
  return false;
}


absl::Status Install(const Options& options) {
  if (!options.enabled) return absl::OkStatus();
  absl::Status valid = ValidateOptions(options);
  if (!valid.ok()) return valid;
  std::lock_guard<std::mutex> g(g_install_mu);
  if (Runtime* rt = g_runtime.load()) {
    if (SameOptions(rt->options(), options)) return absl::OkStatus();
    return absl::FailedPreconditionError(
        "grpc_rdma is already installed with other options (" + DescribeOptions(rt->options()) +
        "); Install takes effect once per process");
  }
  // Before gRPC's first grpc_init() its defaults are not chosen yet, and
  // choosing them then would overwrite ours: choose them now, so grpc_init
  // keeps what is set.
  if (!grpc_have_determined_iomgr_platform()) grpc_set_default_iomgr_platform();
  g_runtime.store(new Runtime(options, &grpc_posix_tcp_client_vtable,
                              &grpc_posix_tcp_server_vtable),
                  std::memory_order_release);
  grpc_set_tcp_client_impl(&kRdmaTcpClientVtable);
  grpc_set_tcp_server_impl(&kRdmaTcpServerVtable);
  if (!DumpDestination(options).empty()) atexit(DumpStatsAtExit);
  if (options.stats_interval_s > 0) {
    StartPeriodicDumps(options.stats_interval_s, DumpDestination(options));
  }
  SayIfAnotherGrpc();
  MallocPlan m = TuneMalloc(options);
  if (!m.say.empty()) gpr_log(GPR_INFO, "grpc_rdma: %s", m.say.c_str());
  return absl::OkStatus();
}

absl::Status Install() {
  gpr_log_verbosity_init();  // see AutoInstall
  absl::StatusOr<Options> o = OptionsFromEnvironment();
  if (!o.ok()) {
    gpr_log(GPR_ERROR, "grpc_rdma: not installed, gRPC uses TCP: %s",
            std::string(o.status().message()).c_str());
    return o.status();
  }
  absl::Status s = Install(*o);
  if (!s.ok()) {
    gpr_log(GPR_ERROR, "grpc_rdma: not installed, gRPC uses TCP: %s",
            std::string(s.message()).c_str());
  }
  return s;
}

bool Installed() { return Runtime::Get() != nullptr; }

Stats GetStats() {
  Stats s;
  StreamSnapshot streams = StreamTotals();
  static_cast<StreamStats&>(s) = streams.total;
  s.devices = std::move(streams.devices);
  Counters& c = GlobalCounters();
  s.rdma_client_connections = c.rdma_client;
  s.rdma_server_connections = c.rdma_server;
  s.tcp_client_connections = c.tcp_client;
  s.tcp_server_connections = c.tcp_server;
  s.rdma_connections_open = c.rdma_open;
  s.fallbacks = c.fallbacks;
  s.fallbacks_remembered = c.fallbacks_remembered;
  s.tcp_first_moved = c.tcp_first_moved;
  s.tcp_first_unjoined = c.tcp_first_unjoined;
  s.grpc_poller_spins = PollerSpins();
  s.grpc_poller_spin_hits = PollerSpinHits();
  s.grpc_poller_spin_polls = PollerSpinPolls();
  s.grpc_poller_spin_backoffs = PollerSpinBackoffs();
  s.version = GRPC_RDMA_VERSION_STRING;
  s.grpc_version = GRPC_RDMA_GRPC_VERSION_STRING;
  if (Runtime* rt = Runtime::Get()) {
    s.rdma_unavailable = rt->unavailable();
    if (const Engine* e = rt->started_engine()) {
      s.pinned_bytes = e->pinned_bytes();
      s.grpc_thread_polls = e->host_polls();
      s.connections_refused = e->refused();
      // Every connection a fault closed, also those that failed before
      // gRPC got them (the devices count the connections gRPC used).
      s.connection_errors = std::max(s.connection_errors, e->connection_errors());
    }
  }
  return s;
}

namespace {
grpc_core::Json::Object StreamJson(const StreamStats& s) {
  grpc_core::Json::Object o;
#define GRPC_RDMA_JSON_FIELD_(name, what) o[#name] = grpc_core::Json(s.name);
  GRPC_RDMA_STREAM_COUNTERS(GRPC_RDMA_JSON_FIELD_)
  return o;
}
}  // namespace

std::string StatsJson(const Stats& s) {
  grpc_core::Json::Object o = StreamJson(s);
  GRPC_RDMA_PROCESS_COUNTERS(GRPC_RDMA_JSON_FIELD_)
  o["version"] = s.version;
  o["grpc_version"] = s.grpc_version;
  o["rdma_unavailable"] = s.rdma_unavailable;
  grpc_core::Json::Object devices;
  for (const DeviceStats& d : s.devices) {
    grpc_core::Json::Object od = StreamJson(d);
#define GRPC_RDMA_JSON_DEVICE_FIELD_(name, what) od[#name] = grpc_core::Json(d.name);
    GRPC_RDMA_DEVICE_COUNTERS(GRPC_RDMA_JSON_DEVICE_FIELD_)
#undef GRPC_RDMA_JSON_DEVICE_FIELD_
    devices[d.name] = grpc_core::Json(std::move(od));
  }
  o["devices"] = grpc_core::Json(std::move(devices));
  return grpc_core::Json(std::move(o)).Dump();
}
#undef GRPC_RDMA_JSON_FIELD_

namespace {
// Linked or preloaded: install from the environment before main(). The
// application's explicit Install() with the same options is then a no-op.
// GRPC_RDMA_NO_AUTO_INSTALL=1 leaves it to the application.
struct AutoInstall {
  AutoInstall() {
    // gRPC prints nothing before its verbosity is read from GRPC_VERBOSITY
    // (grpc_init does it; doing it again is a no-op), and a message of
    // ours may come first: a bad TF_RDMA_* variable, said right here.
    gpr_log_verbosity_init();
    SetLogSink(&GprSink);  // whether installed now or by the application
    const char* no = getenv("GRPC_RDMA_NO_AUTO_INSTALL");
    if (no != nullptr && strcmp(no, "1") == 0) return;
    (void)Install();
  }
} g_auto_install;
}  // namespace

}  // namespace grpc_rdma

extern "C" char* grpc_rdma_connections_text(void) {
  std::string t = grpc_rdma::DescribeOpenConnections();
  char* out = static_cast<char*>(malloc(t.size() + 1));
  if (out != nullptr) memcpy(out, t.c_str(), t.size() + 1);
  return out;
}

extern "C" char* grpc_rdma_stats_json(void) {
  std::string j = grpc_rdma::StatsJson(grpc_rdma::GetStats());
  char* out = static_cast<char*>(malloc(j.size() + 1));
  if (out != nullptr) memcpy(out, j.c_str(), j.size() + 1);
  return out;
}
