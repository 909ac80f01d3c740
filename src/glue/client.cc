// The client side: gRPC's TCP client vtable, replaced. Each connect tries
// RDMA CM first (IPv4 addresses, within TF_RDMA_CONNECT_TIMEOUT_MS and the
// call's deadline) and otherwise hands the very same request to gRPC's own
// TCP client, which then completes it.
#include <sys/random.h>
#include <arpa/inet.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/types/optional.h"
#include "glue/args.h"
#include "glue/endpoint.h"
#include "glue/runtime.h"
#include "glue/stats.h"
#include "glue/switch_endpoint.h"
#include "glue/trace.h"
#include "grpc_rdma/grpc_rdma.h"
#include "src/core/lib/event_engine/channel_args_endpoint_config.h"
#include "src/core/lib/iomgr/exec_ctx.h"

namespace grpc_rdma {
namespace {

using grpc_event_engine::experimental::ChannelArgsEndpointConfig;
using grpc_event_engine::experimental::EndpointConfig;

// One connect request. Handles the plugin gives out have bit 62 set, so
// they never collide with the TCP client's own.
struct Attempt {
  int64_t handle = 0;
  grpc_closure* on_connect = nullptr;
  grpc_endpoint** endpoint = nullptr;
  grpc_pollset_set* interested_parties = nullptr;
  ChannelArgsEndpointConfig config;  // a copy: the caller's is a temporary
  grpc_resolved_address addr;
  grpc_core::Timestamp deadline;
  std::string key;  // "ip:port"
  ArgSettings settings;  // the environment's, or the channel's arguments
  bool tcp = false;        // handed to gRPC's TCP client
  bool tcp_first = false;  // TCP now, RDMA beside it once TCP is up (TF_RDMA_TCP_FIRST)
  bool rdma_failed = false;  // RDMA was tried and failed: TCP is the fallback
  std::chrono::steady_clock::time_point rdma_started;  // when RDMA was tried
  bool remembered = false;   // sent to TCP at once (RecentlyFailed)
  int64_t tcp_handle = 0;  // its handle (0: it completes without one)
  grpc_closure tcp_done;
};

constexpr int64_t kHandleBit = int64_t{1} << 62;

struct Pending {
  std::mutex mu;
  std::map<int64_t, std::shared_ptr<Attempt>> attempts;
  std::atomic<int64_t> next{1};
};

Pending& P() {
  static auto* p = new Pending;
  return *p;
}

// A TCP-first connection's TCP is up: gRPC gets it at once, wrapped in an
// endpoint that moves to RDMA, and RDMA CM connects beside it, naming it.
void StartRdmaBeside(Attempt* a) {
  grpc_endpoint* tcp = *a->endpoint;
  std::string local = Ipv4HostPort(grpc_endpoint_get_local_address(tcp));
  std::shared_ptr<Switch> sw = CreateSwitchEndpoint(tcp, /*server=*/false, a->endpoint);
  sockaddr_in dst{};
  JoinRequest joins;
  bool ok = ToIpv4(&a->addr, &dst);
  size_t colon = local.rfind(':');
  int port = 0;
  if (colon == std::string::npos ||
      inet_pton(AF_INET, local.substr(0, colon).c_str(), &joins.tcp.sin_addr) != 1 ||
      !absl::SimpleAtoi(local.substr(colon + 1), &port) || port <= 0 || port > 65535) {
    ok = false;
  }
  // The token only this process and the server see (in the TCP stream).
  if (ok) {
    ssize_t got;
    do {
      got = getrandom(joins.token, sizeof(joins.token), 0);
    } while (got < 0 && errno == EINTR);
    ok = got == static_cast<ssize_t>(sizeof(joins.token));
  }
  Engine* engine = Runtime::Get()->engine();
  if (!ok || engine == nullptr) {
    GRPC_RDMA_TRACE("%s: TCP connection from %s: no RDMA beside it", a->key.c_str(),
                    local.c_str());
    return;
  }
  joins.tcp.sin_family = AF_INET;
  joins.tcp.sin_port = htons(static_cast<uint16_t>(port));
  SendJoinToken(sw, std::string(reinterpret_cast<const char*>(joins.token), sizeof(joins.token)));
  std::string key = a->key;
  auto started = std::chrono::steady_clock::now();
  GRPC_RDMA_TRACE("%s: TCP up (from %s); connecting over RDMA beside it (timeout %d ms)",
                  key.c_str(), local.c_str(), a->settings.connect_timeout_ms);
  std::weak_ptr<Connection> connecting = engine->Connect(
      dst, a->settings.connect_timeout_ms,
      [sw, key, started](absl::StatusOr<std::shared_ptr<Connection>> r) {
        absl::optional<grpc_core::ApplicationCallbackExecCtx> callback_exec_ctx;
        absl::optional<grpc_core::ExecCtx> exec_ctx;
        if (!grpc_core::ApplicationCallbackExecCtx::Available()) callback_exec_ctx.emplace();
        if (grpc_core::ExecCtx::Get() == nullptr) exec_ctx.emplace();
        if (r.ok()) {
          // Connected, which says little yet: a server that joins none
          // closes it, and the endpoint drops it (on_dropped). RDMA CM
          // reached it, so its address has RDMA: the next connections to
          // it start there, not on TCP.
          SetOnDropped(sw, [key] {
            GlobalCounters().fallbacks.fetch_add(1);
            GlobalCounters().tcp_first_unjoined.fetch_add(1);
            Runtime::Get()->RememberUnjoined(key);
            GRPC_RDMA_TRACE("%s: the server did not join RDMA to the TCP connection: it stays "
                            "on TCP; the address's next connections start on RDMA "
                            "(TF_RDMA_FALLBACK_TTL_S)",
                            key.c_str());
          });
          AttachRdma(sw, std::move(*r));  // tcp_first_moved counts once it moves
          return;
        }
        // The channel closed its connection first (the server then closes
        // an RDMA connection that comes for it): nothing learnt of RDMA.
        if (SwitchGone(sw)) return;
        // TCP reached it and RDMA did not: the connection stays on TCP,
        // and the address is noted as for any fallback.
        GlobalCounters().fallbacks.fetch_add(1);
        bool remembered = Runtime::Get()->RememberFailure(key, started);
        GRPC_RDMA_TRACE("%s: no RDMA beside TCP (%s): the connection stays on TCP%s",
                        key.c_str(), std::string(r.status().message()).c_str(),
                        remembered ? "; TCP only for it for TF_RDMA_FALLBACK_TTL_S" : "");
      },
      &joins);
  // The channel closes its connection before RDMA is up (a short-lived
  // client): the RDMA connection is not finished for nothing.
  SetOnGone(sw, [connecting] {
    if (Engine* e = Runtime::Get()->engine()) e->CancelConnect(connecting);
  });
}

// gRPC's TCP client finished an attempt we handed it. `arg` stays alive
// until here: the attempt leaves the map only here or when a cancel
// succeeded (and then this does not run).
void OnTcpDone(void* arg, grpc_error_handle error) {
  auto* a = static_cast<Attempt*>(arg);
  std::shared_ptr<Attempt> keep;
  {
    std::lock_guard<std::mutex> g(P().mu);
    auto it = P().attempts.find(a->handle);
    if (it != P().attempts.end()) {
      keep = it->second;
      P().attempts.erase(it);
    }
  }
  if (error.ok()) GlobalCounters().tcp_client.fetch_add(1);
  if (a->tcp_first) {
    if (error.ok()) StartRdmaBeside(a);
    grpc_core::Closure::Run(DEBUG_LOCATION, a->on_connect, std::move(error));
    return;
  }
  // An address is noted as having no RDMA only when TCP reached it (and
  // remembered when that happens twice, see Runtime::RememberFailure):
  // when neither did (the server down or restarting), nothing was learnt
  // about RDMA, and its next connection tries RDMA again.
  if (a->rdma_failed && error.ok()) {
    if (Runtime::Get()->RememberFailure(a->key, a->rdma_started)) {
      GRPC_RDMA_TRACE("%s: reached by TCP and not by RDMA again: TCP for it for "
                      "TF_RDMA_FALLBACK_TTL_S", a->key.c_str());
    } else {
      GRPC_RDMA_TRACE("%s: reached by TCP, not by RDMA: its next connection tries RDMA "
                      "again to confirm", a->key.c_str());
    }
  }
  // TCP did not reach it either: the server is down, and what was noted of
  // it (remembered or not) says nothing of what comes back.
  if ((a->remembered || a->rdma_failed) && !error.ok()) Runtime::Get()->ForgetFailure(a->key);
  grpc_core::Closure::Run(DEBUG_LOCATION, a->on_connect, std::move(error));
}

// Under P().mu, with `a` registered: gives the request to gRPC's TCP client.
void StartTcpLocked(Attempt* a) {
  GRPC_CLOSURE_INIT(&a->tcp_done, OnTcpDone, a, nullptr);
  a->tcp = true;
  a->tcp_handle = Runtime::Get()->tcp_client()->connect(
      &a->tcp_done, a->endpoint, a->interested_parties, a->config, &a->addr, a->deadline);
}

void OnRdmaConnected(const std::shared_ptr<Attempt>& a,
                     absl::StatusOr<std::shared_ptr<Connection>> r) {
  // Usually on the poller, which has no ExecCtx: one is made here. Inline
  // on the connecting thread when the engine fails at once (an address no
  // device routes): then on_connect must go on the caller's ExecCtx, run
  // when gRPC flushes it. A nested one would run it here, inside Connect,
  // while gRPC's connect handshaker holds the lock on_connect takes.
  absl::optional<grpc_core::ApplicationCallbackExecCtx> callback_exec_ctx;
  absl::optional<grpc_core::ExecCtx> exec_ctx;
  if (!grpc_core::ApplicationCallbackExecCtx::Available()) callback_exec_ctx.emplace();
  if (grpc_core::ExecCtx::Get() == nullptr) exec_ctx.emplace();
  std::unique_lock<std::mutex> lock(P().mu);
  if (P().attempts.count(a->handle) == 0) {  // cancelled meanwhile
    lock.unlock();
    if (r.ok()) (*r)->Shutdown(absl::CancelledError("connect cancelled"));
    return;
  }
  if (r.ok()) {
    P().attempts.erase(a->handle);
    lock.unlock();
    Runtime::Get()->ForgetFailure(a->key);  // a fallback noted before was stale
    *a->endpoint = CreateRdmaEndpoint(std::move(*r), /*server=*/false);
    grpc_core::ExecCtx::Run(DEBUG_LOCATION, a->on_connect, absl::OkStatus());
    return;
  }
  if (a->settings.fallback == Fallback::kNone) {
    P().attempts.erase(a->handle);
    lock.unlock();
    gpr_log(GPR_ERROR,
            "grpc_rdma: no RDMA connection to %s (%s) and TF_RDMA_FALLBACK=none (or the "
            "channel's " GRPC_RDMA_ARG_FALLBACK ")",
            a->key.c_str(), std::string(r.status().message()).c_str());
    *a->endpoint = nullptr;
    grpc_core::ExecCtx::Run(DEBUG_LOCATION, a->on_connect, ToGrpcError(r.status()));
    return;
  }
  a->rdma_failed = true;  // remembered if TCP reaches it (OnTcpDone)
  GlobalCounters().fallbacks.fetch_add(1);
  GRPC_RDMA_TRACE("%s: no RDMA (%s): using TCP", a->key.c_str(),
                  std::string(r.status().message()).c_str());
  StartTcpLocked(a.get());
}

int64_t Connect(grpc_closure* on_connect, grpc_endpoint** endpoint,
                grpc_pollset_set* interested_parties, const EndpointConfig& config,
                const grpc_resolved_address* addr, grpc_core::Timestamp deadline) {
  Runtime* rt = Runtime::Get();
  auto a = std::make_shared<Attempt>();
  a->handle = kHandleBit | P().next.fetch_add(1);
  a->on_connect = on_connect;
  a->endpoint = endpoint;
  a->interested_parties = interested_parties;
  a->addr = *addr;
  a->deadline = deadline;
  // gRPC 1.51 passes a ChannelArgsEndpointConfig on every path that reaches
  // this vtable; anything else cannot be kept past this call, so it goes
  // to TCP at once, as it is.
  const auto* args = dynamic_cast<const ChannelArgsEndpointConfig*>(&config);
  if (args == nullptr) {
    return rt->tcp_client()->connect(on_connect, endpoint, interested_parties, config, addr,
                                     deadline);
  }
  a->config = *args;
  a->settings = SettingsFor(config, rt->options());
  sockaddr_in sin{};
  bool v4 = ToIpv4(addr, &sin);
  if (v4) {
    char ip[INET_ADDRSTRLEN] = "?";
    inet_ntop(AF_INET, &sin.sin_addr, ip, sizeof(ip));
    a->key = absl::StrCat(ip, ":", ntohs(sin.sin_port));
  }
  int64_t left_ms = (deadline - grpc_core::Timestamp::Now()).millis();
  Engine* engine = v4 && a->settings.enabled ? rt->engine() : nullptr;
  // A channel that must not fall back tries RDMA even where others found
  // none lately.
  bool remembered = engine != nullptr && a->settings.fallback == Fallback::kTcp &&
                    rt->RecentlyFailed(a->key);
  // A server that joined none of our TCP-first connections lately: this
  // one starts on RDMA.
  bool unjoined = engine != nullptr && a->settings.tcp_first && rt->RecentlyUnjoined(a->key);
  {
    std::lock_guard<std::mutex> g(P().mu);
    P().attempts[a->handle] = a;
    a->tcp_first = engine != nullptr && !remembered && a->settings.tcp_first &&
                   a->settings.fallback == Fallback::kTcp && !unjoined;
    if (engine == nullptr || remembered || left_ms <= 0 || a->tcp_first) {
      a->remembered = remembered;
      if (remembered) GlobalCounters().fallbacks_remembered.fetch_add(1);
      StartTcpLocked(a.get());
      return a->handle;
    }
  }
  // Without the lock: the engine may answer on this very thread (a CM id
  // or address it cannot make), and the answer takes the lock.
  int timeout = static_cast<int>(std::min<int64_t>(a->settings.connect_timeout_ms, left_ms));
  GRPC_RDMA_TRACE("%s: connecting over RDMA (timeout %d ms)", a->key.c_str(), timeout);
  a->rdma_started = std::chrono::steady_clock::now();
  engine->Connect(sin, timeout, [a](absl::StatusOr<std::shared_ptr<Connection>> r) {
    OnRdmaConnected(a, std::move(r));
  });
  return a->handle;
}

bool CancelConnect(int64_t handle) {
  if ((handle & kHandleBit) == 0) return Runtime::Get()->tcp_client()->cancel_connect(handle);
  std::shared_ptr<Attempt> a;
  {
    std::lock_guard<std::mutex> g(P().mu);
    auto it = P().attempts.find(handle);
    if (it == P().attempts.end()) return false;  // already done
    a = it->second;
    if (!a->tcp) {  // still trying RDMA: it will find itself gone
      P().attempts.erase(it);
      return true;
    }
  }
  if (!Runtime::Get()->tcp_client()->cancel_connect(a->tcp_handle)) return false;
  std::lock_guard<std::mutex> g(P().mu);
  P().attempts.erase(handle);
  return true;
}

}  // namespace

grpc_tcp_client_vtable kRdmaTcpClientVtable = {Connect, CancelConnect};

}  // namespace grpc_rdma
