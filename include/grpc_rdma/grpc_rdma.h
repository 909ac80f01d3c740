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
#include "grpc_rdma/stats.h"

// gRPC channel and server arguments that override the environment for one
// channel or one server (the environment stays the default):
//
//   grpc::ChannelArguments args;
//   args.SetInt(GRPC_RDMA_ARG_ENABLED, 0);        // this channel: TCP only
//   args.SetString(GRPC_RDMA_ARG_FALLBACK, "none");
//   grpc::ServerBuilder b;
//   b.AddChannelArgument(GRPC_RDMA_ARG_ENABLED, 0);  // this server: TCP only
//   b.AddChannelArgument(GRPC_RDMA_ARG_TCP_ONLY_PORTS, "50052");  // that port
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
// int 0 or 1: TF_RDMA_TCP_FIRST for this channel (1: its connections start
// on TCP and move to RDMA once RDMA CM is done), or on a server (1: it
// joins such connections' RDMA halves to their TCP connections).
#define GRPC_RDMA_ARG_TCP_FIRST "grpc.rdma.tcp_first"
// string, comma-separated port numbers ("50052,50053"), on a server: those
// of its listening ports serve TCP only (not RDMA CM); the others serve
// both. Name ports the server binds by number (a port 0 asks gRPC to pick
// one, which cannot be named in advance).
#define GRPC_RDMA_ARG_TCP_ONLY_PORTS "grpc.rdma.tcp_only_ports"

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

// What the plugin has done in this process (grpc_rdma/stats.h lists every
// counter). Cheap enough to call often: a lock per open connection.
Stats GetStats();
// One line of JSON: {"bytes_sent":...,"devices":{"mlx5_0":{"bytes_sent":...,
// "connections":1,...}},...,"version":"0.1.0"}, keys in alphabetical order.
std::string StatsJson(const Stats& stats);

}  // namespace grpc_rdma

// For programs that do not link the library at build time (dlsym): the
// current stats as a JSON object in memory from malloc (the caller frees
// it), or NULL when out of memory.
extern "C" char* grpc_rdma_stats_json(void);
// Likewise: each open RDMA connection, a line each (client or server,
// peer, device, state, what is pending, bytes moved, time open), for
// diagnosing a connection that does not go away; empty when none. It takes
// each connection's lock: not from a gpr_log function (the engine logs
// with its locks held).
extern "C" char* grpc_rdma_connections_text(void);

#endif  // GRPC_RDMA_GRPC_RDMA_H_
