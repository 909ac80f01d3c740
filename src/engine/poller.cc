// The engine's poller thread and the host's polling of the engine's
// descriptor (Engine::PollNow): who looks at RDMA CM events and at the
// connections' completion channels, and when.
//
// The registry lock (EngineImpl::mu) is held only to read the epoll sets'
// events, handle RDMA CM events and take a snapshot of the connections;
// each connection's CQ is then handled under that connection's own lock,
// with the registry lock dropped (engine_impl.h).
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <thread>

#include "absl/container/inlined_vector.h"
#include "engine/engine_impl.h"
#include "verbs/log.h"
#include "verbs/status.h"

namespace grpc_rdma {
namespace {

// epoll tags: the CM channel and the wake fd have fixed ones; a
// connection's completion channel is tagged with its CM id.
constexpr uint64_t kTagCm = 1, kTagWake = 2;
// In the poller's own set: the shared set (epfd_) has something ready.
constexpr uint64_t kTagShared = 3;

}  // namespace

absl::Status EngineImpl::Start() {
  // Non-blocking: see TakeCmEventsLocked.
  ASSIGN_OR_RETURN(events_, CreateEventChannel(/*nonblocking=*/true));
  epfd_ = epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (epfd_ < 0 || wake_fd_ < 0) return ErrnoStatus(errno, "epoll_create1/eventfd");
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kTagCm;
  epoll_ctl(epfd_, EPOLL_CTL_ADD, events_->fd, &ev);
  ev.data.u64 = kTagWake;
  epoll_ctl(epfd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  poll_epfd_ = epoll_create1(EPOLL_CLOEXEC);
  if (poll_epfd_ < 0) return ErrnoStatus(errno, "epoll_create1");
  ev.data.u64 = kTagShared;
  epoll_ctl(poll_epfd_, EPOLL_CTL_ADD, epfd_, &ev);
  poller_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "rdma-engine");  // for top, gdb, perf
    PollerMain();
  });
  return absl::OkStatus();
}

// Takes what is queued, and never waits for more: the channel is
// non-blocking. It once was checked readable (poll) and then read with a
// blocking rdma_get_cm_event, under mu: when the one queued event was
// taken back in between by rdma_destroy_id of its id (a connection the
// engine dropped, destroyed after mu was let go, on the other thread that
// handles events), the read waited, mu held, for the next CM event, and
// every connection of the process with it (a half-open flood's honest
// client timed out waiting for the server's SETTINGS).
void EngineImpl::TakeCmEventsLocked(Deferred* d) {
  for (;;) {
    rdma_cm_event* e = nullptr;
    if (rdma_get_cm_event(events_.get(), &e) != 0 || e == nullptr) {
      // Nothing queued (EAGAIN), or a failure to say: librdmacm fails
      // with ENOMEM before reading, and the channel then stays readable.
      static std::atomic<bool> said{false};
      if (errno != EAGAIN && errno != EWOULDBLOCK && !said.exchange(true))
        GRPC_RDMA_LOG_ERROR("cannot take an RDMA CM event: %s (said once)", strerror(errno));
      break;
    }
    // Copy what we need, then ack before acting (acting may destroy ids).
    rdma_cm_event copy = *e;
    uint8_t pdata[256];
    if (e->param.conn.private_data && e->param.conn.private_data_len) {
      size_t n = std::min<size_t>(e->param.conn.private_data_len, sizeof(pdata));
      memcpy(pdata, e->param.conn.private_data, n);
      copy.param.conn.private_data = pdata;
      copy.param.conn.private_data_len = static_cast<uint8_t>(n);
    }
    // The listener's context too: once the event is acked, StopListening
    // (on another thread, without mu) may destroy the listening id.
    void* listener = e->listen_id != nullptr ? e->listen_id->context : nullptr;
    copy.listen_id = nullptr;
    rdma_ack_cm_event(e);
    HandleCmEventLocked(&copy, listener, d);
  }
}

void EngineImpl::WatchAsyncLocked(ibv_context* ctx) {
  if (ctx == nullptr || ctx->async_fd < 0) return;
  for (ibv_context* c : async_ctxs_)
    if (c == ctx) return;
  // Non-blocking: the poller and a host loop may both be woken for one event.
  int fl = fcntl(ctx->async_fd, F_GETFL);
  if (fl < 0 || fcntl(ctx->async_fd, F_SETFL, fl | O_NONBLOCK) != 0) return;
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = reinterpret_cast<uint64_t>(ctx) | 1;
  if (epoll_ctl(epfd_, EPOLL_CTL_ADD, ctx->async_fd, &ev) == 0) async_ctxs_.push_back(ctx);
}

void EngineImpl::TakeAsyncEventsLocked(ibv_context* ctx, Deferred* d, ConnImpl* held) {
  // Only a watched context's fd is non-blocking.
  if (std::find(async_ctxs_.begin(), async_ctxs_.end(), ctx) == async_ctxs_.end()) return;
  ibv_async_event ev;
  while (ibv_get_async_event(ctx, &ev) == 0) {
    ibv_event_type type = ev.event_type;
    ibv_qp* qp = nullptr;
    switch (type) {
      case IBV_EVENT_QP_FATAL:
      case IBV_EVENT_QP_REQ_ERR:
      case IBV_EVENT_QP_ACCESS_ERR:
      case IBV_EVENT_COMM_EST:
      case IBV_EVENT_SQ_DRAINED:
      case IBV_EVENT_PATH_MIG:
      case IBV_EVENT_PATH_MIG_ERR:
      case IBV_EVENT_QP_LAST_WQE_REACHED:
        qp = ev.element.qp;
        break;
      default:
        break;
    }
    ibv_ack_async_event(&ev);
    if (qp == nullptr) continue;
    for (auto& [id, c] : conns_) {
      if (c->qp() != qp) continue;
      if (c.get() == held) {
        c->OnQpEventLocked(type, d);
      } else {
        std::lock_guard<std::mutex> cl(c->mu());
        c->OnQpEventLocked(type, d);
      }
      break;
    }
  }
}

// The poller thread and PollNow (a host event loop) may both be woken for
// the same event: whoever comes second finds it gone, so every source read
// here is non-blocking (a check that it is readable is not enough: what
// made it readable can be gone before the read, see TakeCmEventsLocked).
void EngineImpl::HandleEventListLocked(const epoll_event* evs, int n, bool take_wake,
                                       ConnList* ready, Deferred* d) {
  for (int i = 0; i < n; ++i) {
    uint64_t tag = evs[i].data.u64;
    if (tag == kTagShared) {
      epoll_event shared[64];
      int m = epoll_wait(epfd_, shared, 64, 0);
      if (m > 0) HandleEventListLocked(shared, m, take_wake, ready, d);
    } else if (tag == kTagWake) {
      if (!take_wake) continue;  // the poller's: it may be waiting for it
      uint64_t v;
      (void)!read(wake_fd_, &v, sizeof(v));
    } else if (tag == kTagCm) {
      TakeCmEventsLocked(d);
    } else if (tag & 1) {
      TakeAsyncEventsLocked(reinterpret_cast<ibv_context*>(tag & ~uint64_t{1}), d);
    } else if (auto c = Find(reinterpret_cast<rdma_cm_id*>(tag))) {
      ready->push_back(std::move(c));
    }
  }
}

bool EngineImpl::PollConnections(const ConnList& ready, const ConnList& all, bool arm,
                                 Deferred* d, bool* skipped) {
  size_t before = d->size();
  int seen = 0;
  absl::InlinedVector<std::shared_ptr<ConnImpl>, 4> busy;  // no allocation per pass
  for (const auto& c : ready) {
    std::unique_lock<std::mutex> l(c->mu(), std::try_to_lock);
    if (l.owns_lock()) c->TakeEventsLocked();
    else busy.push_back(c);
  }
  for (const auto& c : all) {
    std::unique_lock<std::mutex> l(c->mu(), std::try_to_lock);
    if (!l.owns_lock()) {
      busy.push_back(c);
      continue;
    }
    seen += c->HandleCqLocked(d);
    if (arm) {
      c->ArmCqLocked();
      seen += c->HandleCqLocked(d);
    }
  }
  // Busy: in a copy, a post or another thread's look at its CQ. Waiting
  // for it would hold up every other connection; its holder looks at the
  // CQ when it lets go (or we do, if it has let go by now).
  bool drained = false;
  for (const auto& c : busy) drained |= c->LeavePending();
  if (skipped != nullptr) *skipped |= !busy.empty();
  return drained || seen > 0 || d->size() > before;
}

bool EngineImpl::PollNow() {
  NoteHostPoll();
  epoll_event evs[64];
  Deferred d;
  bool did = false;
  // The lists this thread used last time, emptied but not freed: a host
  // thread polls once per wake-up, and two allocations per poll were most
  // of a small message's. A call from within a callback below (none is
  // known) gets lists of its own.
  thread_local ConnList tl_ready, tl_all;
  thread_local bool tl_in_use = false;
  ConnList own_ready, own_all;
  const bool reuse = !tl_in_use;
  ConnList& ready = reuse ? tl_ready : own_ready;
  ConnList& all = reuse ? tl_all : own_all;
  tl_in_use = true;
  {
    std::lock_guard<std::mutex> g(mu);
    if (stop_) {
      if (reuse) tl_in_use = false;
      return false;
    }
    int n;
    do {  // all of it: what stays ready inner raises no new edge outside
      n = epoll_wait(epfd_, evs, 64, 0);
      HandleEventListLocked(evs, n, /*take_wake=*/false, &ready, &d);
      did |= n > 0;
    } while (n == 64);
    CheckDeadlinesLocked(&d);
    SnapshotLocked(&all);
  }
  // The event loop goes back to waiting on event_fd(): every CQ handled,
  // armed so the next completion raises an event, and looked at once more.
  did |= PollConnections(ready, all, /*arm=*/true, &d, nullptr);
  did |= !d.empty();
  d.Run();
  ready.clear();  // no connection kept alive by a list between polls
  all.clear();
  if (reuse) tl_in_use = false;
  if (did) host_polls.fetch_add(1, std::memory_order_relaxed);
  return did;
}

void EngineImpl::PollerMain() {
  const bool busy = options.poll_mode == PollMode::kBusy;
  const bool adaptive = options.poll_mode == PollMode::kAdaptive;
  uint64_t last_active = NowMicros();
  epoll_event evs[64];
  bool skipped = false;  // the last sweep left a busy connection to its holder
  // Reused from pass to pass (emptied after each use, so no connection
  // outlives its last pass here): a spinning poller makes thousands of
  // passes a second, and a fresh list each was most of a small message's
  // allocations.
  ConnList all, ready;
  for (;;) {
    // Idle: block until an armed CQ, the CM or a wake-up says something
    // (no periodic wake-ups: an idle connection costs nothing).
    int timeout = -1;
    const bool external = external_polling.load(std::memory_order_relaxed);
    if (busy || (adaptive && !external &&
                 NowMicros() - last_active < static_cast<uint64_t>(options.spin_us)))
      timeout = 0;
    Deferred early;
    {
      {
        std::lock_guard<std::mutex> g(mu);
        if (stop_) return;
        // Before the look at the deadlines: one set after it sees this and
        // wakes us (ConnImpl::SetGrantDeadlineLocked).
        may_block_.store(true);
        bool deadline = false;
        uint64_t grants = UINT64_MAX;  // the earliest grant deadline
        for (auto& [id, c] : conns_) {
          deadline |= c->connect_deadline_us != 0 || c->drain_deadline_us.load() != 0;
          uint64_t g = c->grant_deadline_us.load();
          if (g != 0 && g < grants) grants = g;
        }
        if (deadline && (timeout < 0 || timeout > 10)) timeout = 10;
        // A listener lost with its device is tried again every kRelistenMs.
        if (!lost_listeners_.empty() && (timeout < 0 || timeout > kRelistenMs))
          timeout = kRelistenMs;
        if (grants != UINT64_MAX) {
          // Seconds away as a rule: wake for it then, not every 10 ms.
          uint64_t now = NowMicros();
          int ms = grants <= now ? 0
                                 : static_cast<int>(std::min<uint64_t>(
                                       (grants - now) / 1000 + 1, 60000));
          if (timeout < 0 || timeout > ms) timeout = ms;
        }
        if (timeout != 0) SnapshotLocked(&all);
      }
      // About to block: arm every CQ, then look once more: a completion
      // that came in before the arm raises no event.
      if (timeout != 0 && PollConnections({}, all, /*arm=*/true, &early, &skipped)) timeout = 0;
      all.clear();
    }
    if (timeout >= 0) may_block_.store(false);  // spinning or a timed wait
    early.Run();
    int n;
    // A wait without end, or longer than kBackupUs, unless the host polls:
    // said before the look at when it last did (see waiting_for_good_).
    if (timeout < 0 || timeout > static_cast<int>(kBackupUs / 1000))
      waiting_for_good_.store(true, std::memory_order_seq_cst);
    uint64_t since_host = NowMicros() - last_host_poll_us.load(std::memory_order_seq_cst);
    if (skipped && timeout != 0) {
      // A busy connection's channel may stay readable until its holder
      // lets go: pause instead of letting epoll report it over and over.
      skipped = false;
      waiting_for_good_.store(false);
      pollfd p{wake_fd_, POLLIN, 0};
      poll(&p, 1, kSkippedRetryMs);
      n = epoll_wait(poll_epfd_, evs, 64, 0);
    } else if (external && timeout != 0 && since_host < kHostActiveUs) {
      waiting_for_good_.store(false);
      // The host loop is polling (it called PollNow lately): it handles
      // events, on the threads that wait for them. Waking this thread for
      // each would cost a thread switch per message; look only every
      // kBackupUs, in case the host stops polling.
      pollfd p{wake_fd_, POLLIN, 0};
      int ms = static_cast<int>(kBackupUs / 1000);
      if (timeout > 0 && timeout < ms) ms = timeout;
      poll(&p, 1, ms);
      n = epoll_wait(poll_epfd_, evs, 64, 0);
    } else {
      // Everything: the shared set and the host-polled connections.
      n = epoll_wait(poll_epfd_, evs, 64, timeout);
      waiting_for_good_.store(false);  // not through the grace below
      if (n > 0 && external && timeout != 0) {
        // The host loop was woken too: let its thread, the one that waits
        // for what this event brings, handle it; step in only if it has
        // not within the grace (nobody is polling there).
        std::this_thread::sleep_for(std::chrono::microseconds(kExternalGraceUs));
        n = epoll_wait(poll_epfd_, evs, 64, 0);
      }
    }
    may_block_.store(false);
    Deferred d;
    {
      {
        std::lock_guard<std::mutex> g(mu);
        if (stop_) return;
        HandleEventListLocked(evs, n, /*take_wake=*/true, &ready, &d);
        CheckDeadlinesLocked(&d);
        SnapshotLocked(&all);
      }
      if (PollConnections(ready, all, /*arm=*/false, &d, &skipped) || n > 0 || !d.empty())
        last_active = NowMicros();
      ready.clear();
      all.clear();
    }
    d.Run();
  }
}

}  // namespace grpc_rdma
