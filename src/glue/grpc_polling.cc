// Completions polled by gRPC's own pollers: the engine's event descriptor
// (an epoll fd) is registered with gRPC's polling engine while RDMA
// endpoints or listeners exist, so the gRPC thread that waits for a call
// can handle the completion that ends it, instead of being woken by the
// engine's poller thread after it did (one thread wake-up less per message).
// The engine's poller keeps running: whoever gets to an event first
// handles it. Only with gRPC's epoll1 engine (Linux's default), where a
// registered descriptor is polled by whichever thread polls.
//
// An RDMA endpoint or listener still alive at grpc_shutdown keeps the
// registration, and gRPC waits for it as for any leaked TCP endpoint.
#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <mutex>

#include "glue/runtime.h"
#include "glue/trace.h"
#include "src/core/lib/iomgr/ev_posix.h"
#include "src/core/lib/iomgr/exec_ctx.h"

namespace grpc_rdma {
namespace {

// One registration: from the first endpoint or listener to the last.
// Exactly one of {a pending read notification, a running OnReadable}
// exists while it is active; whichever sees it stopped deletes it.
struct Registration {
  Engine* engine = nullptr;
  grpc_fd* fd = nullptr;
  grpc_closure on_readable;
  bool stopped = false;
};

struct Polling {
  std::mutex mu;
  int users = 0;
  Registration* current = nullptr;
};

Polling& P() {
  static auto* p = new Polling;
  return *p;
}

void OnReadable(void* arg, grpc_error_handle error) {
  auto* r = static_cast<Registration*>(arg);
  if (error.ok()) r->engine->PollNow();
  std::lock_guard<std::mutex> g(P().mu);
  if (r->stopped) {
    delete r;
    return;
  }
  // Shut down by someone else (nothing in gRPC 1.51 does): re-arming a
  // shut-down fd would run this again at once, forever.
  if (!error.ok()) return;
  grpc_fd_notify_on_read(r->fd, &r->on_readable);
}

bool Supported() {
  const char* s = grpc_get_poll_strategy_name();
  return s != nullptr && strcmp(s, "epoll1") == 0;
}

}  // namespace

void Runtime::AcquirePolling() {
  Engine* e = engine();
  if (e == nullptr || options_.poll_mode == PollMode::kBusy) return;
  std::lock_guard<std::mutex> g(P().mu);
  if (P().users++ > 0 || !Supported()) return;
  int fd = fcntl(e->event_fd(), F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return;
  auto* r = new Registration;
  r->engine = e;
  r->fd = grpc_fd_create(fd, "grpc_rdma engine", false);
  GRPC_CLOSURE_INIT(&r->on_readable, OnReadable, r, nullptr);
  grpc_fd_notify_on_read(r->fd, &r->on_readable);
  P().current = r;
  e->SetExternalPolling(true);
  GRPC_RDMA_TRACE("completions are polled by gRPC's pollers too");
}

void Runtime::ReleasePolling() {
  std::lock_guard<std::mutex> g(P().mu);
  if (P().users == 0 || --P().users > 0 || P().current == nullptr) return;
  Registration* r = P().current;
  P().current = nullptr;
  r->stopped = true;
  r->engine->SetExternalPolling(false);
  // Released, not closed by gRPC: that takes it out of gRPC's epoll set
  // (closing our dup would not, the engine's descriptor of the same epoll
  // stays open). The pending notification runs with an error and deletes
  // r; gRPC's iomgr has no object of ours left when it shuts down.
  int fd = -1;
  grpc_fd_orphan(r->fd, nullptr, &fd, "grpc_rdma: no RDMA connection left");
  if (fd >= 0) close(fd);
}

}  // namespace grpc_rdma
