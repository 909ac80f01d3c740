// File: src/glue/stats.h
//
// The process-wide counters behind grpc_rdma::GetStats(). Lock-free: every
// field is an atomic bumped where the event happens.
#ifndef GRPC_RDMA_SRC_GLUE_STATS_H_
#define GRPC_RDMA_SRC_GLUE_STATS_H_

#include <atomic>
#include <cstdint>

#include "engine/engine.h"

namespace grpc_rdma {

struct Counters {
  std::atomic<uint64_t> rdma_client{0}, rdma_server{0}, tcp_client{0}, tcp_server{0};
  std::atomic<uint64_t> rdma_open{0}, fallbacks{0}, fallbacks_remembered{0};
  // Totals of connections already closed; open ones are summed live.
  std::atomic<uint64_t> bytes_sent{0}, bytes_received{0}, eager{0}, coalesced{0},
      rendezvous{0}, zero_copy{0}, copied{0};

  void AddClosed(const ConnectionStats& s);
};

Counters& GlobalCounters();

// Open RDMA connections register here so a snapshot can add their counts.
void TrackConnection(const std::shared_ptr<Connection>& c);
void UntrackConnection(const Connection* c);
// Sums ConnectionStats over the open connections.
ConnectionStats OpenConnectionTotals();

}  // namespace grpc_rdma

#endif  // GRPC_RDMA_SRC_GLUE_STATS_H_
