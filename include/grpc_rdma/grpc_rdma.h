// File: grpc_rdma/grpc_rdma.h
//
// The public API of libgrpc_rdma.so. Most applications need none of it:
// linking the library, or starting with LD_PRELOAD=libgrpc_rdma.so, installs
// it from the TF_RDMA_* environment (docs/usage.md) before main() runs.
//
//   grpc_rdma::Options o;                  // or OptionsFromEnvironment()
//   o.chunk_size = 1 << 20;
//   absl::Status s = grpc_rdma::Install(o);  // before or after grpc_init()
//   ...
//   grpc_rdma::Stats st = grpc_rdma::GetStats();
//   if (st.rdma_client_connections == 0) { /* everything went by TCP */ }
//
// Once installed, every gRPC client connection to an IPv4 address first
// tries RDMA (RDMA CM, within TF_RDMA_CONNECT_TIMEOUT_MS) and falls back to
// TCP when the path or the peer has no RDMA (TF_RDMA_FALLBACK); every gRPC
// server listens on TCP and on RDMA CM at the same address and port.
#ifndef GRPC_RDMA_GRPC_RDMA_H_
#define GRPC_RDMA_GRPC_RDMA_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpc_rdma/options.h"

// gRPC channel and server arguments that override the environment for one
// channel or one server (the environment stays the default):
//
//   grpc::ChannelArguments args;
//   args.SetInt(GRPC_RDMA_ARG_ENABLED, 0);        // this channel: TCP only
//   args.SetString(GRPC_RDMA_ARG_FALLBACK, "none");
//   grpc::ServerBuilder b;
//   b.AddChannelArgument(GRPC_RDMA_ARG_ENABLED, 0);  // this server: TCP only
//
// A bad value is logged once and the environment's setting used.
//
// int 0 or 1 (default 1): 0 makes the channel connect by TCP, or the
// server listen on TCP only (not on RDMA CM), whatever TF_RDMA_ENABLED says.
// 1 changes nothing: RDMA off in the process stays off.
#define GRPC_RDMA_ARG_ENABLED "grpc.rdma.enabled"
// string "tcp" or "none": TF_RDMA_FALLBACK for this channel.
#define GRPC_RDMA_ARG_FALLBACK "grpc.rdma.fallback"
// int, milliseconds, 1 to 600000: TF_RDMA_CONNECT_TIMEOUT_MS for this
// channel.
#define GRPC_RDMA_ARG_CONNECT_TIMEOUT_MS "grpc.rdma.connect_timeout_ms"

namespace grpc_rdma {

// Parses the TF_RDMA_* variables (InvalidArgument names every bad one).
absl::StatusOr<Options> OptionsFromEnvironment();

// Makes gRPC's TCP client and server use RDMA where it can, keeping gRPC's
// own as the fallback. With options.enabled false it changes nothing.
// Idempotent: the first successful call wins; later calls return OK and
// change nothing (FailedPrecondition if they ask for other options). Bad
// options: InvalidArgument, and gRPC is left as it was (TCP).
// Thread-safe; may be called before or after grpc_init().
absl::Status Install(const Options& options);
// Install(OptionsFromEnvironment()); a bad environment is reported (and
// logged) and gRPC keeps working over TCP.
absl::Status Install();
// True once Install has put the RDMA transport in place.
bool Installed();

// A snapshot of what the plugin has done in this process.
struct Stats {
  // Connections by transport: made by this process as a client, accepted
  // as a server; TCP ones counted only while the plugin is installed.
  uint64_t rdma_client_connections = 0;
  uint64_t rdma_server_connections = 0;
  uint64_t tcp_client_connections = 0;
  uint64_t tcp_server_connections = 0;
  uint64_t rdma_connections_open = 0;
  // Client connections that tried RDMA and went by TCP (no RDMA path, the
  // peer without the plugin, timeout), and those that went to TCP at once
  // because the address had no RDMA recently (TF_RDMA_FALLBACK_TTL_S).
  uint64_t fallbacks = 0;
  uint64_t fallbacks_remembered = 0;
  // Stream bytes and protocol counts, summed over RDMA connections.
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  uint64_t eager_messages = 0;
  uint64_t coalesced_writes = 0;
  uint64_t rendezvous = 0;
  uint64_t rendezvous_pre_granted = 0;  // ... written at once into a standing grant
  uint64_t chunks_zero_copy = 0;
  uint64_t chunks_copied = 0;
  // Host copies of stream bytes, RDMA connections: on send, application
  // bytes into registered buffers; on receive, bytes out of registered
  // buffers (the engine's and the endpoint's). A copy per byte each way is
  // bytes_copied_on_send == bytes_sent; zero-copy paths add nothing.
  uint64_t bytes_copied_on_send = 0;
  uint64_t bytes_copied_on_receive = 0;
  // Registered (pinned) memory in use now, bytes.
  uint64_t pinned_bytes = 0;
  // Times a gRPC polling thread found RDMA work and did it itself (the fast
  // path; see docs/design.md), rather than leaving it to the engine's thread.
  uint64_t grpc_thread_polls = 0;
  // Why RDMA is off, when it is (empty otherwise).
  std::string rdma_unavailable;
};

Stats GetStats();
// {"rdma_client_connections":1,...}: one line of JSON.
std::string StatsJson(const Stats& stats);

}  // namespace grpc_rdma

// For programs that do not link the library at build time (dlsym): the
// current stats as a JSON object in memory from malloc (the caller frees
// it), or NULL when out of memory.
extern "C" char* grpc_rdma_stats_json(void);

#endif  // GRPC_RDMA_GRPC_RDMA_H_
