// File: grpc_rdma/options.h
//
// Options: everything that tunes grpc-rdma, with the defaults RDMA-TensorFlow
// users know. They normally come from the environment (TF_RDMA_* variables,
// see docs/usage.md), parsed once by grpc_rdma::OptionsFromEnvironment();
// an application may also fill an Options itself and pass it to
// grpc_rdma::Install().
//
//   grpc_rdma::Options o;            // the defaults
//   o.chunk_size = 1 << 20;
#ifndef GRPC_RDMA_OPTIONS_H_
#define GRPC_RDMA_OPTIONS_H_

#include <cstdint>
#include <string>

namespace grpc_rdma {

// How the engine waits for completions.
enum class PollMode {
  kAdaptive,  // spin for spin_us after activity, then block (no CPU when idle)
  kBusy,      // always spin: lowest latency, one core per poller
  kEvent,     // always block on the completion channel
};

// What a client does when a connection cannot use RDMA.
enum class Fallback {
  kTcp,   // use gRPC's TCP for that connection (and remember it for a while)
  kNone,  // fail the connection (UNAVAILABLE); gRPC retries as usual
};

struct Options {
  // TF_RDMA_ENABLED: false leaves gRPC untouched.
  bool enabled = true;
  // TF_RDMA_DEV_NAME: the HCA to use. Set explicitly (device_explicit), it
  // is the only device used: an address on another device goes by TCP,
  // and a named device that is absent is an error. Otherwise the device
  // RDMA CM resolves for each address is used.
  std::string device = "mlx5_0";
  bool device_explicit = false;
  // TF_RDMA_PORT: the device port (1 to 255) every connection must use, as
  // the device name is enforced; 0 (unset): whichever RDMA CM resolves.
  int port = 0;
  // TF_RDMA_GID_INDEX (RoCE): the GID table index every connection's
  // source GID must be at (RDMA CM picks the GID from the address; one at
  // another index goes by TCP). -1 (unset): any.
  int gid_index = -1;
  // TF_RDMA_TOS: the IP type of service (RoCE traffic class, 0 to 255) of
  // every connection, set with rdma_set_option. -1 (unset): the system's.
  int tos = -1;
  // TF_RDMA_CHUNK_SIZE, bytes: large payloads are cut into chunks of this
  // size, several in flight.
  uint64_t chunk_size = 4ull << 20;
  // TF_RDMA_ACC_SIZE, bytes: small payloads are coalesced up to this size and
  // sent eagerly; larger ones go by rendezvous.
  uint64_t acc_size = 8ull << 10;
  // TF_RDMA_BUF_SIZE, bytes: the cap of pinned (registered) memory, grown on
  // demand; running out means waiting, never failing.
  uint64_t buf_size = 1ull << 30;
  // TF_RDMA_CHUNKS_IN_FLIGHT: rendezvous chunks in flight per transfer.
  int chunks_in_flight = 4;
  // TF_RDMA_EAGER_DEPTH: eager buffers each side posts per connection (the
  // sender's credits).
  int eager_depth = 64;
  // TF_RDMA_POLL_MODE (adaptive | busy | event) and TF_RDMA_SPIN_US.
  PollMode poll_mode = PollMode::kAdaptive;
  int spin_us = 200;
  // TF_RDMA_CONNECT_TIMEOUT_MS: how long a client tries RDMA CM before it
  // falls back (or fails).
  int connect_timeout_ms = 1000;
  // TF_RDMA_MAX_HALF_OPEN: how many connections a server holds accepted
  // but not yet established (their peer has not finished the exchange);
  // one more drops the oldest of them. The engine lowers it so that they
  // hold at most an eighth of the pinned budget (TF_RDMA_BUF_SIZE, or the
  // locked-memory limit when lower) and a quarter of the process's
  // descriptor limit (RLIMIT_NOFILE).
  int max_half_open = 256;
  // TF_RDMA_GRANT_TIMEOUT_MS: how long a peer may leave the memory granted
  // for a large message it announced unwritten (no chunk landing) before
  // the connection is closed and the memory freed.
  int grant_timeout_ms = 30000;
  // TF_RDMA_FALLBACK (tcp | none) and TF_RDMA_FALLBACK_TTL_S: how long an
  // address that had no RDMA goes straight to TCP.
  Fallback fallback = Fallback::kTcp;
  int fallback_ttl_s = 30;
  // TF_RDMA_STATS: where the stats go when the process exits: empty (the
  // default) for nowhere, "stderr", or a file path (written anew: a
  // regular file is replaced, by a rename, so a reader sees a whole one).
  std::string stats_dump;
  // TF_RDMA_STATS_INTERVAL_S: also every this many seconds while the
  // process runs (0, the default: at exit only), to TF_RDMA_STATS, or to
  // stderr when that is unset. A file is replaced whole each time.
  int stats_interval_s = 0;
  // TF_RDMA_ZERO_COPY: large messages go to the peer straight from the
  // application's (gRPC's) buffers, without a copy into registered memory,
  // where the device can read any of the process's memory (on-demand
  // paging, implicit: ConnectX HCAs, softverbs); elsewhere, and for chunks
  // under 1 MiB, they are copied as before.
  bool zero_copy = true;
  // TF_RDMA_MALLOC_TUNE: raise glibc malloc's mmap and trim thresholds at
  // install, as MPI libraries over RDMA do, so the large buffers gRPC
  // allocates for each message are reused instead of being mapped, faulted
  // in and given back every time (said in the log; left alone when the
  // process set glibc's malloc tunables itself or runs another malloc).
  bool malloc_tune = true;
  // TF_RDMA_TCP_FIRST (on by default): a new connection starts on TCP, so
  // its first calls wait for TCP's connect only, and moves to RDMA once RDMA
  // CM has set up an RDMA connection beside it (each direction at a byte
  // boundary both sides agree on; docs/design.md). Off: a connection waits
  // for RDMA CM (or its failure) before its first byte. Ignored, as off,
  // with TF_RDMA_FALLBACK=none, and for an address whose server joined none
  // lately. A server joins such connections only with it on.
  bool tcp_first = true;
};

}  // namespace grpc_rdma

#endif  // GRPC_RDMA_OPTIONS_H_
