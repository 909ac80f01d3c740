// grpc_rdma_info: what grpc-rdma would do in this process's environment,
// as ibv_devinfo and ucx_info do for theirs. Needs no gRPC server.
//
//   grpc_rdma_info                     version, settings (TF_RDMA_*), the
//                                      RDMA devices and which one is used
//   grpc_rdma_info --probe HOST:PORT   also: does a grpc-rdma server answer
//                                      over RDMA there, and if not, why
//
// Exit status: 0 all well; 1 RDMA is not usable here (bad settings, no
// device, the named device absent); 2 the probe found no RDMA server;
// 3 bad usage.
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <netdb.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <future>
#include <string>

#include "config/config.h"
#include "config/malloc_tune.h"
#include "engine/engine.h"
#include "grpc_rdma/version.h"
#include "verbs/verbs.h"

namespace grpc_rdma {
namespace {

const char* PortState(ibv_port_state s) {
  switch (s) {
    case IBV_PORT_ACTIVE: return "ACTIVE";
    case IBV_PORT_DOWN: return "DOWN";
    case IBV_PORT_INIT: return "INIT";
    case IBV_PORT_ARMED: return "ARMED";
    default: return "other";
  }
}

// One line per port: state, link layer, MTU, and the IPv4 address in GID 0
// when it is IPv4-mapped (RoCE, softverbs).
void ShowDevice(ibv_device* dev, bool used) {
  const char* name = ibv_get_device_name(dev);
  ibv_context* ctx = ibv_open_device(dev);
  if (ctx == nullptr) {
    printf("  %s: cannot open: %s\n", name, strerror(errno));
    return;
  }
  ibv_device_attr da{};
  if (ibv_query_device(ctx, &da) != 0) da.phys_port_cnt = 0;
  for (uint8_t p = 1; p <= da.phys_port_cnt; ++p) {
    ibv_port_attr pa{};
    if (ibv_query_port(ctx, p, &pa) != 0) continue;
    std::string addr;
    ibv_gid gid{};
    if (ibv_query_gid(ctx, p, 0, &gid) == 0 && gid.raw[10] == 0xff && gid.raw[11] == 0xff) {
      char ip[INET_ADDRSTRLEN];
      inet_ntop(AF_INET, &gid.raw[12], ip, sizeof(ip));
      addr = std::string(", IPv4 ") + ip;
    }
    printf("  %s port %u: %s, %s, MTU %d%s%s\n", name, p, PortState(pa.state),
           pa.link_layer == IBV_LINK_LAYER_ETHERNET ? "Ethernet (RoCE)" : "InfiniBand",
           128 << pa.active_mtu, addr.c_str(), used ? "  <- TF_RDMA_DEV_NAME" : "");
  }
  ibv_close_device(ctx);
}

bool ParseTarget(const std::string& target, sockaddr_in* out) {
  size_t colon = target.rfind(':');
  if (colon == std::string::npos || colon == 0) return false;
  std::string host = target.substr(0, colon), port = target.substr(colon + 1);
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0 || res == nullptr) return false;
  *out = *reinterpret_cast<sockaddr_in*>(res->ai_addr);
  freeaddrinfo(res);
  return true;
}

int Probe(const Options& o, const std::string& target) {
  sockaddr_in addr{};
  if (!ParseTarget(target, &addr)) {
    printf("probe %s: not an IPv4 HOST:PORT (RDMA is IPv4 only)\n", target.c_str());
    return 2;
  }
  auto engine = Engine::Create(EngineOptions(o));  // as the glue runs it
  if (!engine.ok()) {
    printf("probe %s: no RDMA engine here: %s\n", target.c_str(),
           std::string(engine.status().message()).c_str());
    return 1;
  }
  auto start = std::chrono::steady_clock::now();
  std::promise<absl::StatusOr<std::shared_ptr<Connection>>> done;
  (*engine)->Connect(addr, o.connect_timeout_ms,
                     [&](absl::StatusOr<std::shared_ptr<Connection>> r) {
                       done.set_value(std::move(r));
                     });
  auto r = done.get_future().get();
  double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                  .count();
  if (!r.ok()) {
    printf("probe %s: no RDMA connection (%.1f ms): %s\n", target.c_str(), ms,
           std::string(r.status().message()).c_str());
    printf("  a gRPC client here would use TCP for it (TF_RDMA_FALLBACK=%s)\n",
           o.fallback == Fallback::kTcp ? "tcp" : "none: it would fail instead");
    return 2;
  }
  printf("probe %s: a grpc-rdma server answers over RDMA (connected in %.1f ms, %s -> %s)\n",
         target.c_str(), ms, (*r)->local().c_str(), (*r)->peer().c_str());
  (*r)->Shutdown(absl::CancelledError("probe done"));
  return 0;
}

int Main(int argc, char** argv) {
  std::string probe;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--probe" && i + 1 < argc) {
      probe = argv[++i];
    } else if (a == "-h" || a == "--help") {
      printf("usage: grpc_rdma_info [--probe HOST:PORT]\n");
      return 0;
    } else {
      fprintf(stderr, "grpc_rdma_info: unknown argument '%s' (usage: grpc_rdma_info "
                      "[--probe HOST:PORT])\n", a.c_str());
      return 3;
    }
  }
  printf("grpc-rdma %s (built for gRPC %s)\n", GRPC_RDMA_VERSION_STRING,
         GRPC_RDMA_GRPC_VERSION_STRING);
  absl::StatusOr<Options> o = ParseOptions(ProcessEnvironment());
  if (!o.ok()) {
    printf("settings: not valid, so gRPC would use TCP: %s\n",
           std::string(o.status().message()).c_str());
    return 1;
  }
  if (absl::Status v = ValidateOptions(*o); !v.ok()) {
    printf("settings: not valid, so gRPC would use TCP: %s\n", std::string(v.message()).c_str());
    return 1;
  }
  printf("settings: %s\n", DescribeOptions(*o).c_str());
  if (o->stats_dump.empty() && o->stats_interval_s == 0) {
    printf("stats: not written (TF_RDMA_STATS to write them at exit)\n");
  } else {
    std::string where = o->stats_dump.empty() ? "stderr" : o->stats_dump;
    if (o->stats_interval_s > 0) {
      printf("stats: to %s every %d s (TF_RDMA_STATS_INTERVAL_S) and at exit\n", where.c_str(),
             o->stats_interval_s);
    } else {
      printf("stats: to %s at exit\n", where.c_str());
    }
  }
  if (!o->enabled) {
    printf("TF_RDMA_ENABLED=false: grpc-rdma leaves gRPC alone (TCP)\n");
    return probe.empty() ? 0 : 2;
  }
  // The plan for a process started with this environment (this tool's own
  // malloc is the process's, so glibc's unless preloaded otherwise).
  MallocPlan m = PlanMalloc(*o);
  if (!m.say.empty()) printf("%s\n", m.say.c_str());
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  printf("RDMA devices: %d\n", list == nullptr ? 0 : n);
  for (int i = 0; list != nullptr && i < n; ++i)
    ShowDevice(list[i], o->device_explicit && o->device == ibv_get_device_name(list[i]));
  if (list != nullptr) ibv_free_device_list(list);
  absl::StatusOr<std::optional<std::string>> dev = ChooseDevice(*o);
  if (!dev.ok()) {
    printf("RDMA is off, gRPC would use TCP: %s\n", std::string(dev.status().message()).c_str());
    return 1;
  }
  if (absl::Status pg = CheckPortAndGid(*o); !pg.ok()) {
    printf("RDMA is off, gRPC would use TCP: %s\n", std::string(pg.message()).c_str());
    return 1;
  }
  if (o->device_explicit) {
    printf("device: %s only (TF_RDMA_DEV_NAME); addresses on other devices use TCP\n",
           o->device.c_str());
  } else {
    printf("device: whichever RDMA CM resolves for each address (TF_RDMA_DEV_NAME not set)\n");
  }
  if (o->port > 0) printf("port: %d only (TF_RDMA_PORT)\n", o->port);
  if (o->gid_index >= 0) {
    printf("GID: index %d only (TF_RDMA_GID_INDEX); routes from another GID use TCP\n",
           o->gid_index);
  }
  if (o->tos >= 0) printf("type of service: %d (TF_RDMA_TOS)\n", o->tos);
  return probe.empty() ? 0 : Probe(*o, probe);
}

}  // namespace
}  // namespace grpc_rdma

int main(int argc, char** argv) { return grpc_rdma::Main(argc, argv); }
