// Completions polled by gRPC's own pollers, so the gRPC thread that waits
// for a call handles the completion that ends it, instead of being woken by
// the engine's poller thread after it did (one thread wake-up less per
// message). Only with gRPC's epoll1 engine (Linux's default), where a
// registered descriptor is polled by whichever thread polls.
//
// Two kinds of registration:
// - each RDMA connection's own descriptor (its completion channel), from
//   endpoint creation to destruction. epoll1 hands each ready descriptor to
//   one thread and wakes another for the next, so calls on different
//   connections are handled by different threads at once, as with TCP
//   (one descriptor for all connections had every call of the process
//   handled by one thread at a time: 4 clients' calls/s no higher than 1
//   client's). The engine's poller leaves that descriptor to gRPC while
//   gRPC's threads poll, and steps in when they stop (as for the engine's
//   own descriptor, below).
// - the engine's event descriptor (an epoll fd: RDMA CM events, wake-ups,
//   connections no gRPC poller watches), while RDMA endpoints or listeners
//   exist. The engine's poller keeps running: whoever gets to an event
//   first handles it.
//
// An RDMA endpoint or listener still alive at grpc_shutdown keeps its
// registration, and gRPC waits for it as for any leaked TCP endpoint.
#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <mutex>

#include "glue/runtime.h"
#include "glue/trace.h"
#include "src/core/lib/iomgr/ev_posix.h"
#include "src/core/lib/iomgr/exec_ctx.h"

namespace grpc_rdma {

// One descriptor registered with gRPC's pollers. Exactly one of {a pending
// read notification, a running OnReadable} exists while it is registered;
// whichever sees it stopped deletes it.
struct PollRegistration {
  std::function<bool()> poll;  // handles what is ready, without blocking
  grpc_fd* fd = nullptr;
  grpc_closure on_readable;
  bool stopped = false;  // under Mu()
};

namespace {

std::mutex& Mu() {
  static auto* mu = new std::mutex;
  return *mu;
}

struct EnginePolling {
  int users = 0;
  PollRegistration* current = nullptr;
};

EnginePolling& E() {
  static auto* p = new EnginePolling;
  return *p;
}

void OnReadable(void* arg, grpc_error_handle error) {
  auto* r = static_cast<PollRegistration*>(arg);
  if (error.ok()) r->poll();
  {
    std::lock_guard<std::mutex> g(Mu());
    if (!r->stopped) {
      // Shut down by someone else (nothing in gRPC 1.51 does): re-arming a
      // shut-down fd would run this again at once, forever.
      if (error.ok()) grpc_fd_notify_on_read(r->fd, &r->on_readable);
      return;
    }
  }
  delete r;  // outside the lock: it may hold the last reference to a connection
}

bool Supported() {
  const char* s = grpc_get_poll_strategy_name();
  return s != nullptr && strcmp(s, "epoll1") == 0;
}

// Registers a duplicate of `fd` (the original stays its owner's); nullptr
// when that cannot be done. Mu() held.
PollRegistration* RegisterLocked(int fd, const char* name, std::function<bool()> poll) {
  int dup = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (dup < 0) return nullptr;
  auto* r = new PollRegistration;
  r->poll = std::move(poll);
  r->fd = grpc_fd_create(dup, name, false);
  GRPC_CLOSURE_INIT(&r->on_readable, OnReadable, r, nullptr);
  grpc_fd_notify_on_read(r->fd, &r->on_readable);
  return r;
}

// Mu() held. Released, not closed by gRPC: that takes the descriptor out
// of gRPC's epoll set (closing our duplicate would not: the original of
// the same open file stays open). The pending notification then runs with
// an error and deletes r; gRPC's iomgr has no object of ours left when it
// shuts down.
void UnregisterLocked(PollRegistration* r, const char* why) {
  r->stopped = true;
  int fd = -1;
  grpc_fd_orphan(r->fd, nullptr, &fd, why);
  if (fd >= 0) close(fd);
}

}  // namespace

void Runtime::AcquirePolling() {
  Engine* e = engine();
  if (e == nullptr || options_.poll_mode == PollMode::kBusy) return;
  std::lock_guard<std::mutex> g(Mu());
  if (E().users++ > 0 || !Supported()) return;
  E().current = RegisterLocked(e->event_fd(), "grpc_rdma engine", [e] { return e->PollNow(); });
  if (E().current == nullptr) return;
  e->SetExternalPolling(true);
  GRPC_RDMA_TRACE("completions are polled by gRPC's pollers too");
}

void Runtime::ReleasePolling() {
  std::lock_guard<std::mutex> g(Mu());
  if (E().users == 0 || --E().users > 0 || E().current == nullptr) return;
  PollRegistration* r = E().current;
  E().current = nullptr;
  engine()->SetExternalPolling(false);
  UnregisterLocked(r, "grpc_rdma: no RDMA connection left");
}

PollRegistration* Runtime::PollConnection(std::shared_ptr<Connection> conn) {
  if (options_.poll_mode == PollMode::kBusy || conn->event_fd() < 0) return nullptr;
  std::lock_guard<std::mutex> g(Mu());
  if (!Supported()) return nullptr;
  // The engine's poller lets go first: whatever completes from here on
  // raises an edge gRPC sees once the descriptor is registered.
  conn->SetHostPolled(true);
  PollRegistration* r =
      RegisterLocked(conn->event_fd(), "grpc_rdma connection", [conn] { return conn->PollNow(); });
  if (r == nullptr) conn->SetHostPolled(false);
  return r;
}

void Runtime::StopPollingConnection(PollRegistration* r, Connection* conn) {
  if (r == nullptr) return;
  std::lock_guard<std::mutex> g(Mu());
  UnregisterLocked(r, "grpc_rdma: endpoint destroyed");
  // Whatever the connection still has to do (a disconnect waiting for its
  // last sends) is the engine poller's again.
  conn->SetHostPolled(false);
}

}  // namespace grpc_rdma
