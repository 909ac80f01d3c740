#include "glue/stats.h"

#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>

namespace grpc_rdma {
namespace {

struct Open {
  std::weak_ptr<Connection> conn;
  std::string device;
  const EndpointCopies* endpoint_copies = nullptr;
  std::chrono::steady_clock::time_point since;
};

struct Registry {
  std::mutex mu;  // taken before any engine lock (Connection::stats)
  std::unordered_map<const Connection*, Open> open;
  // Per device: connections ever tracked, and closed ones' stream counts.
  std::map<std::string, DeviceStats> devices;
};

Registry& R() {
  static auto* r = new Registry;  // never destroyed: used from atexit
  return *r;
}

// One connection's counts as its device will sum them.
StreamStats CountsOf(Connection& c, const EndpointCopies* endpoint_copies) {
  StreamStats s = c.stats();
  if (endpoint_copies != nullptr) {
    s.bytes_copied_on_receive += endpoint_copies->received.load();
    s.bytes_copied_on_send += endpoint_copies->sent.load();
  }
  return s;
}

}  // namespace

Counters& GlobalCounters() {
  static auto* c = new Counters;
  return *c;
}

void TrackConnection(const std::shared_ptr<Connection>& c, const EndpointCopies* endpoint_copies) {
  std::string device = c->device();
  if (device.empty()) device = "?";
  std::lock_guard<std::mutex> g(R().mu);
  DeviceStats& d = R().devices[device];
  d.name = device;
  ++d.connections;
  R().open[c.get()] = Open{c, std::move(device), endpoint_copies, std::chrono::steady_clock::now()};
}

void UntrackConnection(const Connection* c) {
  std::lock_guard<std::mutex> g(R().mu);
  auto it = R().open.find(c);
  if (it == R().open.end()) return;
  if (auto conn = it->second.conn.lock()) {
    R().devices[it->second.device] += CountsOf(*conn, it->second.endpoint_copies);
  }
  R().open.erase(it);
}

std::string DescribeOpenConnections() {
  std::lock_guard<std::mutex> g(R().mu);
  std::string out;
  auto now = std::chrono::steady_clock::now();
  for (auto& [k, o] : R().open) {
    auto c = o.conn.lock();
    if (c == nullptr) continue;
    long ms = static_cast<long>(
        std::chrono::duration_cast<std::chrono::milliseconds>(now - o.since).count());
    out += c->Describe() + "; open " + std::to_string(ms) + " ms\n";
  }
  if (uint64_t held = GlobalCounters().rdma_shut_down_held.load()) {
    out += std::to_string(held) +
           " endpoint(s) gRPC shut down and has not destroyed (their RDMA connections are "
           "let go already; for a moment after a shutdown, or for good: gRPC 1.51 never "
           "destroys one whose subchannel was shut down while it waited for SETTINGS)\n";
  }
  return out;
}

StreamSnapshot StreamTotals() {
  std::lock_guard<std::mutex> g(R().mu);
  std::map<std::string, DeviceStats> devices = R().devices;
  for (auto& [k, o] : R().open) {
    DeviceStats& d = devices[o.device];
    ++d.connections_open;
    if (auto c = o.conn.lock()) d += CountsOf(*c, o.endpoint_copies);
  }
  StreamSnapshot out;
  for (auto& [name, d] : devices) {
    out.total += d;
    out.devices.push_back(std::move(d));
  }
  return out;
}

}  // namespace grpc_rdma
