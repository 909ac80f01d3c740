// File: src/glue/stats.h
//
// The process-wide counters behind grpc_rdma::GetStats(): connection
// counts are atomics bumped where the event happens; stream counts are the
// engine's per connection, summed over open and closed ones.
#ifndef GRPC_RDMA_SRC_GLUE_STATS_H_
#define GRPC_RDMA_SRC_GLUE_STATS_H_

#include <atomic>
#include <cstdint>

#include "engine/engine.h"

namespace grpc_rdma {

struct Counters {
  std::atomic<uint64_t> rdma_client{0}, rdma_server{0}, tcp_client{0}, tcp_server{0};
  std::atomic<uint64_t> rdma_open{0}, fallbacks{0}, fallbacks_remembered{0};
  // Received bytes the endpoint copied into gRPC slices (small chunks).
  std::atomic<uint64_t> endpoint_bytes_copied{0};
};

Counters& GlobalCounters();

// Open RDMA connections register here; a closed one's counts move to the
// totals in the same step, so a snapshot never counts a connection twice
// or not at all.
void TrackConnection(const std::shared_ptr<Connection>& c);
void UntrackConnection(const Connection* c, const ConnectionStats& final_stats);
// Closed connections' totals plus the open connections' counts, now.
ConnectionStats StreamTotals();

}  // namespace grpc_rdma

#endif  // GRPC_RDMA_SRC_GLUE_STATS_H_
