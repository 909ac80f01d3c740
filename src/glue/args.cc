#include "glue/args.h"

#include <grpc/support/log.h>

#include <mutex>
#include <set>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "grpc_rdma/grpc_rdma.h"

namespace grpc_rdma {
namespace {

// Once per key and value: a bad argument on a channel that reconnects
// would otherwise say so on every connection.
void SayBad(const char* key, const std::string& value, const char* allowed) {
  static std::mutex mu;
  static auto* said = new std::set<std::string>;
  {
    std::lock_guard<std::mutex> g(mu);
    if (!said->insert(std::string(key) + "=" + value).second) return;
  }
  gpr_log(GPR_ERROR,
          "grpc_rdma: channel argument %s=%s is not valid (allowed: %s); using the "
          "environment's setting",
          key, value.c_str(), allowed);
}

}  // namespace

ArgSettings SettingsFor(const grpc_event_engine::experimental::EndpointConfig& config,
                        const Options& env) {
  ArgSettings s;
  s.fallback = env.fallback;
  s.connect_timeout_ms = env.connect_timeout_ms;
  s.tcp_first = env.tcp_first;
  if (auto v = config.GetInt(GRPC_RDMA_ARG_ENABLED)) {
    if (*v == 0 || *v == 1) {
      s.enabled = *v == 1;
    } else {
      SayBad(GRPC_RDMA_ARG_ENABLED, std::to_string(*v), "0 or 1");
    }
  }
  if (auto v = config.GetString(GRPC_RDMA_ARG_FALLBACK)) {
    if (*v == "tcp") {
      s.fallback = Fallback::kTcp;
    } else if (*v == "none") {
      s.fallback = Fallback::kNone;
    } else {
      SayBad(GRPC_RDMA_ARG_FALLBACK, std::string(*v), "tcp or none");
    }
  }
  if (auto v = config.GetInt(GRPC_RDMA_ARG_TCP_FIRST)) {
    if (*v == 0 || *v == 1) {
      s.tcp_first = *v == 1;
    } else {
      SayBad(GRPC_RDMA_ARG_TCP_FIRST, std::to_string(*v), "0 or 1");
    }
  }
  if (auto v = config.GetInt(GRPC_RDMA_ARG_CONNECT_TIMEOUT_MS)) {
    if (*v >= 1 && *v <= 600000) {
      s.connect_timeout_ms = *v;
    } else {
      SayBad(GRPC_RDMA_ARG_CONNECT_TIMEOUT_MS, std::to_string(*v), "1 to 600000");
    }
  }
  if (auto v = config.GetString(GRPC_RDMA_ARG_TCP_ONLY_PORTS)) {
    std::vector<int> ports;
    bool ok = true;
    for (absl::string_view item : absl::StrSplit(*v, ',')) {
      int port = 0;
      if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(item), &port) || port < 1 ||
          port > 65535) {
        ok = false;
        break;
      }
      ports.push_back(port);
    }
    if (ok) {
      s.tcp_only_ports = std::move(ports);
    } else {
      SayBad(GRPC_RDMA_ARG_TCP_ONLY_PORTS, std::string(*v),
             "port numbers from 1 to 65535, separated by commas");
    }
  }
  return s;
}

}  // namespace grpc_rdma
