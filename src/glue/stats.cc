#include "glue/stats.h"

#include <mutex>
#include <unordered_map>

namespace grpc_rdma {
namespace {

struct Registry {
  std::mutex mu;
  std::unordered_map<const Connection*, std::weak_ptr<Connection>> open;
};

Registry& Open() {
  static auto* r = new Registry;  // never destroyed: used from atexit
  return *r;
}

}  // namespace

void Counters::AddClosed(const ConnectionStats& s) {
  bytes_sent += s.bytes_sent;
  bytes_received += s.bytes_received;
  eager += s.eager_messages;
  coalesced += s.coalesced_writes;
  rendezvous += s.rendezvous;
  zero_copy += s.chunks_zero_copy;
  copied += s.chunks_copied;
}

Counters& GlobalCounters() {
  static auto* c = new Counters;
  return *c;
}

void TrackConnection(const std::shared_ptr<Connection>& c) {
  std::lock_guard<std::mutex> g(Open().mu);
  Open().open[c.get()] = c;
}

void UntrackConnection(const Connection* c) {
  std::lock_guard<std::mutex> g(Open().mu);
  Open().open.erase(c);
}

ConnectionStats OpenConnectionTotals() {
  std::vector<std::shared_ptr<Connection>> live;
  {
    std::lock_guard<std::mutex> g(Open().mu);
    for (auto& [k, w] : Open().open) {
      if (auto c = w.lock()) live.push_back(std::move(c));
    }
  }
  ConnectionStats t;
  for (auto& c : live) {
    ConnectionStats s = c->stats();
    t.bytes_sent += s.bytes_sent;
    t.bytes_received += s.bytes_received;
    t.eager_messages += s.eager_messages;
    t.coalesced_writes += s.coalesced_writes;
    t.rendezvous += s.rendezvous;
    t.chunks_zero_copy += s.chunks_zero_copy;
    t.chunks_copied += s.chunks_copied;
  }
  return t;
}

}  // namespace grpc_rdma
