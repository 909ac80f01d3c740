// File: src/glue/stats.h
//
// The process-wide counters behind grpc_rdma::GetStats(): connection
// counts are atomics bumped where the event happens; stream counts are the
// engine's per connection (plus the endpoint's copies), summed per device
// over open and closed connections.
#ifndef GRPC_RDMA_SRC_GLUE_STATS_H_
#define GRPC_RDMA_SRC_GLUE_STATS_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "grpc_rdma/stats.h"

namespace grpc_rdma {

struct Counters {
  std::atomic<uint64_t> rdma_client{0}, rdma_server{0}, tcp_client{0}, tcp_server{0};
  std::atomic<uint64_t> rdma_open{0}, fallbacks{0}, fallbacks_remembered{0};
  std::atomic<uint64_t> tcp_first_moved{0};
  std::atomic<uint64_t> tcp_first_unjoined{0};
  // RDMA endpoints gRPC shut down and has not destroyed (yet): their
  // connections are let go already (src/glue/endpoint.cc, Release).
  std::atomic<uint64_t> rdma_shut_down_held{0};
};

Counters& GlobalCounters();

// Bytes an endpoint copied besides its connection's own counts: received
// chunks copied into gRPC slices, and pieces of large writes copied to be
// kept for the device (endpoint.cc, WriteKeep).
struct EndpointCopies {
  std::atomic<uint64_t> received{0};
  std::atomic<uint64_t> sent{0};
};

// Open RDMA connections register here, with the endpoint's copies (read
// until Untrack); a closed one's counts move to its device's totals in the
// same step, so a snapshot never counts a connection twice or not at all.
// Untrack after Shutdown: the counts are then final.
void TrackConnection(const std::shared_ptr<Connection>& c, const EndpointCopies* endpoint_copies);
void UntrackConnection(const Connection* c);

// Per device (by name) and summed: closed connections' totals plus the
// open connections' counts, now.
struct StreamSnapshot {
  StreamStats total;
  std::vector<DeviceStats> devices;
};
StreamSnapshot StreamTotals();

// Each open RDMA connection gRPC holds (an endpoint neither shut down nor
// destroyed), one line each: Connection::Describe, and how long it has
// been open; then a line counting the endpoints gRPC shut down and still
// holds, if any.
std::string DescribeOpenConnections();

}  // namespace grpc_rdma

#endif  // GRPC_RDMA_SRC_GLUE_STATS_H_
