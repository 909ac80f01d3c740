#include "glue/stats.h"

#include <mutex>
#include <unordered_map>
#include <vector>

namespace grpc_rdma {
namespace {

void Add(ConnectionStats* t, const ConnectionStats& s) {
  t->bytes_sent += s.bytes_sent;
  t->bytes_received += s.bytes_received;
  t->eager_messages += s.eager_messages;
  t->coalesced_writes += s.coalesced_writes;
  t->rendezvous += s.rendezvous;
  t->standing_writes += s.standing_writes;
  t->chunks_zero_copy += s.chunks_zero_copy;
  t->chunks_copied += s.chunks_copied;
  t->credit_messages += s.credit_messages;
  t->bytes_copied_on_send += s.bytes_copied_on_send;
  t->bytes_copied_on_receive += s.bytes_copied_on_receive;
}

struct Registry {
  std::mutex mu;  // taken before any engine lock (Connection::stats)
  std::unordered_map<const Connection*, std::weak_ptr<Connection>> open;
  ConnectionStats closed;
};

Registry& R() {
  static auto* r = new Registry;  // never destroyed: used from atexit
  return *r;
}

}  // namespace

Counters& GlobalCounters() {
  static auto* c = new Counters;
  return *c;
}

void TrackConnection(const std::shared_ptr<Connection>& c) {
  std::lock_guard<std::mutex> g(R().mu);
  R().open[c.get()] = c;
}

void UntrackConnection(const Connection* c, const ConnectionStats& final_stats) {
  std::lock_guard<std::mutex> g(R().mu);
  if (R().open.erase(c) != 0) Add(&R().closed, final_stats);
}

ConnectionStats StreamTotals() {
  std::lock_guard<std::mutex> g(R().mu);
  ConnectionStats t = R().closed;
  for (auto& [k, w] : R().open) {
    if (auto c = w.lock()) Add(&t, c->stats());
  }
  return t;
}

}  // namespace grpc_rdma
