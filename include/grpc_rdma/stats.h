// File: grpc_rdma/stats.h
//
// What the plugin counts, in one table: each counter's name and what it
// counts are listed here once, and the Stats structs, the sums over
// connections and devices, the JSON (grpc_rdma_stats_json, TF_RDMA_STATS)
// and the check that docs/usage.md describes every one are all made from
// these lists. Included by grpc_rdma/grpc_rdma.h.
#ifndef GRPC_RDMA_STATS_H_
#define GRPC_RDMA_STATS_H_

#include <cstdint>
#include <string>
#include <vector>

// X(name, what): counters of one connection's byte stream, summed per
// device and over the process.
#define GRPC_RDMA_STREAM_COUNTERS(X)                                                      \
  X(bytes_sent, "stream bytes sent")                                                      \
  X(bytes_received, "stream bytes received")                                              \
  X(eager_messages, "SENDs of small writes, coalesced up to TF_RDMA_ACC_SIZE")            \
  X(inline_messages, "... of them small enough to go inline (the QP's max_inline_data)")  \
  X(coalesced_writes, "writes that shared a SEND with another")                           \
  X(rendezvous, "large writes sent by rendezvous (announced, pulled in chunks)")          \
  X(rendezvous_pre_granted, "... of them written at once into a grant the peer left")     \
  X(chunks_zero_copy, "received chunks handed to gRPC without a copy")                    \
  X(chunks_copied, "received chunks copied out (pinned memory ran short)")                \
  X(credit_messages, "messages sent only to return credits to the peer")                  \
  X(receive_reposts, "ibv_post_recv calls that gave handled receives back to the device " \
                     "(one per batch of completions)")                                     \
  X(bytes_copied_on_send, "application bytes copied into registered buffers")             \
  X(bytes_copied_on_receive, "received bytes copied out of registered buffers")           \
  X(credit_waits, "times writes waited for the peer's credits (its receive buffers)")     \
  X(memory_waits, "times writes waited for pinned memory (TF_RDMA_BUF_SIZE)")            \
  X(connection_errors, "connections closed by a fault: peer broke the protocol, "         \
                       "completion or device error, grants left unwritten, failed post "   \
                       "(at the top level also those that failed before gRPC got them)")  \
  X(writes_kept, "large writes given back to gRPC once posted, its buffers held for the " \
                 "device until it has read them (zero-copy)")

// X(name, what): counters of the whole process.
#define GRPC_RDMA_PROCESS_COUNTERS(X)                                                     \
  X(rdma_client_connections, "connections this process made over RDMA")                  \
  X(rdma_server_connections, "connections this process accepted over RDMA")              \
  X(tcp_client_connections, "connections made over TCP while the plugin was installed")   \
  X(tcp_server_connections, "connections accepted over TCP while installed")              \
  X(rdma_connections_open, "RDMA connections open now")                                   \
  X(fallbacks, "client connections that tried RDMA and went by TCP")                      \
  X(fallbacks_remembered, "client connections sent to TCP at once (TF_RDMA_FALLBACK_TTL_S)") \
  X(tcp_first_moved, "client connections that started on TCP and moved to RDMA "          \
                     "(TF_RDMA_TCP_FIRST)")                                                \
  X(tcp_first_unjoined, "client connections that started on TCP whose server joined no "  \
                        "RDMA connection to them: they stay on TCP, and the address's "    \
                        "next connections start on RDMA (TF_RDMA_FALLBACK_TTL_S)")        \
  X(connections_refused, "RDMA connection requests this process refused")                 \
  X(pinned_bytes, "registered (pinned) memory in use now, bytes")                         \
  X(grpc_thread_polls, "times a gRPC thread handled RDMA completions itself")            \
  X(grpc_poller_spins, "waits of gRPC's poller thread that spun (TF_RDMA_SPIN_US after "  \
                       "RDMA activity) instead of sleeping")                               \
  X(grpc_poller_spin_hits, "... of them, those that found something ready while spinning") \
  X(grpc_poller_spin_polls, "... of those, found by polling the one busy connection's CQ, "  \
                            "left disarmed for the spinning thread")                       \
  X(grpc_poller_spin_backoffs, "times spinning stopped for a while (100 ms, doubled while "  \
                               "it recurs): yields found the cores wanted by other work")

// X(name, what): counters of one device, besides the stream counters.
#define GRPC_RDMA_DEVICE_COUNTERS(X)                                 \
  X(connections, "RDMA connections made or accepted on the device") \
  X(connections_open, "... of them open now")

#define GRPC_RDMA_DECLARE_COUNTER_(name, what) uint64_t name = 0;

namespace grpc_rdma {

// One connection's stream counters, or their sum.
struct StreamStats {
  GRPC_RDMA_STREAM_COUNTERS(GRPC_RDMA_DECLARE_COUNTER_)
  StreamStats& operator+=(const StreamStats& o) {
#define GRPC_RDMA_ADD_COUNTER_(name, what) name += o.name;
    GRPC_RDMA_STREAM_COUNTERS(GRPC_RDMA_ADD_COUNTER_)
#undef GRPC_RDMA_ADD_COUNTER_
    return *this;
  }
};

// The connections on one RDMA device (ibv_devices' name).
struct DeviceStats : StreamStats {
  std::string name;
  GRPC_RDMA_DEVICE_COUNTERS(GRPC_RDMA_DECLARE_COUNTER_)
};

// A snapshot of what the plugin has done in this process: the stream
// counters summed over all RDMA connections, open and closed, then the
// process's own, then per device.
struct Stats : StreamStats {
  GRPC_RDMA_PROCESS_COUNTERS(GRPC_RDMA_DECLARE_COUNTER_)
  std::string version;       // grpc-rdma's (GRPC_RDMA_VERSION_STRING)
  std::string grpc_version;  // the gRPC release it was built against
  // Why RDMA is off, when it is (empty otherwise).
  std::string rdma_unavailable;
  std::vector<DeviceStats> devices;  // by name; devices with connections only
};

}  // namespace grpc_rdma

#undef GRPC_RDMA_DECLARE_COUNTER_

#endif  // GRPC_RDMA_STATS_H_
