// File: src/glue/runtime.h
//
// What the installed plugin shares between its client and server sides:
// the options, the engine (created at first use, so a process that never
// connects pays nothing), gRPC's own TCP implementations for fallback, and
// the addresses that recently had no RDMA.
#ifndef GRPC_RDMA_SRC_GLUE_RUNTIME_H_
#define GRPC_RDMA_SRC_GLUE_RUNTIME_H_

#include <netinet/in.h>

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "engine/engine.h"
#include "grpc_rdma/options.h"
#include "src/core/lib/iomgr/resolve_address.h"
#include "src/core/lib/iomgr/tcp_client.h"
#include "src/core/lib/iomgr/tcp_server.h"

namespace grpc_rdma {

struct PollRegistration;  // grpc_polling.cc

class Runtime {
 public:
  // The installed runtime, or nullptr before Install. Never destroyed.
  static Runtime* Get();

  const Options& options() const { return options_; }
  // The engine; nullptr when RDMA cannot be used in this process (no
  // device, bad device name): the reason is logged once and kept in
  // unavailable(), and everything goes by TCP.
  Engine* engine();
  std::string unavailable();
  // The engine if it was made (never makes it): for the stats. Never
  // destroyed once made.
  const Engine* started_engine();

  // gRPC's pollers poll the engine too while there is an RDMA endpoint or
  // listener (grpc_polling.cc); each creation acquires, each end releases.
  // Call with an ExecCtx.
  void AcquirePolling();
  void ReleasePolling();
  // gRPC's pollers poll `conn`'s own descriptor, so different threads can
  // handle different connections; nullptr when they cannot (the engine's
  // poller then does). Stop before the endpoint goes. Call with an ExecCtx.
  PollRegistration* PollConnection(std::shared_ptr<Connection> conn);
  void StopPollingConnection(PollRegistration* r, Connection* conn);

  // Fallback memory, keyed by "ip:port". An address goes straight to TCP
  // for TF_RDMA_FALLBACK_TTL_S seconds once TCP reached it twice where RDMA
  // did not, the second RDMA attempt started after the first TCP success:
  // one such result alone can be stale (a REJECTED for a server that was
  // down when the request went and up when TCP connected, as during a
  // restart). RememberFailure notes one (`tried`: when its RDMA attempt
  // started) and says whether the address is now remembered;
  // ForgetFailure drops what was noted (RDMA reached it, or TCP did not).
  bool RecentlyFailed(const std::string& key);
  bool RememberFailure(const std::string& key, std::chrono::steady_clock::time_point tried);
  void ForgetFailure(const std::string& key);

  // A server that listens on RDMA CM but joined no TCP-first connection of
  // ours (its TF_RDMA_TCP_FIRST off, or a grpc-rdma from before joins):
  // its address's next connections start on RDMA instead, for
  // TF_RDMA_FALLBACK_TTL_S seconds (30 when that is 0, which asks for RDMA
  // to be tried every time).
  bool RecentlyUnjoined(const std::string& key);
  void RememberUnjoined(const std::string& key);

  grpc_tcp_client_vtable* tcp_client() const { return tcp_client_; }
  grpc_tcp_server_vtable* tcp_server() const { return tcp_server_; }

  Runtime(const Options& o, grpc_tcp_client_vtable* c, grpc_tcp_server_vtable* s)
      : options_(o), tcp_client_(c), tcp_server_(s) {}

 private:
  const Options options_;
  grpc_tcp_client_vtable* const tcp_client_;
  grpc_tcp_server_vtable* const tcp_server_;
  std::mutex mu_;
  bool tried_ = false;
  std::unique_ptr<Engine> engine_;
  std::string unavailable_;
  struct Failure {
    std::chrono::steady_clock::time_point seen;  // when TCP last reached it
    bool confirmed;                              // twice: remembered
  };
  std::map<std::string, Failure> failed_;
  std::map<std::string, std::chrono::steady_clock::time_point> unjoined_;  // when seen
};

// Spinning in gRPC's poller thread (grpc_polling.cc): RDMA activity
// opens a window of TF_RDMA_SPIN_US in which the thread waiting in gRPC's
// epoll set polls instead of sleeping. Counters: waits that spun, and
// those that found something ready while spinning.
void NoteRdmaActivity();
uint64_t PollerSpins();
uint64_t PollerSpinHits();
uint64_t PollerSpinPolls();
uint64_t PollerSpinBackoffs();
// Tests: takes `epfd` as gRPC's epoll set (-1: none known), as the first
// epoll_wait that returns one of our registered descriptors would.
void SetGrpcEpollSetForTesting(int epfd);

// The IPv4 address of `addr` (plain or v4-mapped IPv6); false for others.
bool ToIpv4(const grpc_resolved_address* addr, sockaddr_in* out);
// True for 0.0.0.0 and ::.
bool IsWildcard(const grpc_resolved_address* addr);

// The vtables Install puts in place (client.cc, server.cc).
extern grpc_tcp_client_vtable kRdmaTcpClientVtable;
extern grpc_tcp_server_vtable kRdmaTcpServerVtable;

}  // namespace grpc_rdma

#endif  // GRPC_RDMA_SRC_GLUE_RUNTIME_H_
