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
//
// Spinning where the waiting thread is (TF_RDMA_POLL_MODE=adaptive): the
// thread that waits for a call is the one in epoll_wait on gRPC's epoll
// set (epoll1 lets one thread at a time do that). For TF_RDMA_SPIN_US
// after RDMA activity (a completion handled, a write), that epoll_wait
// polls the set without blocking until something is ready, so the peer's
// doorbell finds a running thread instead of one to wake; after that it
// blocks as before (no CPU when idle). epoll_wait is interposed (this
// library defines it at glibc's version, see libgrpc_rdma.map.in) and only
// gRPC's own set is touched: it is learned from the first epoll_wait that
// returns one of our registered descriptors; every other caller goes
// straight to glibc's.
//
// While it spins, that thread also polls the CQ of the connection the
// process is busy with itself (SpinPolled below), and that CQ stays
// disarmed until it stops: a message then raises no completion event, the
// connection's descriptor no epoll readiness, and arming costs no system
// calls (over softverbs, the peer rings no doorbell for a CQ polled this
// way, and masking and unmasking the doorbell cost two epoll_ctl calls per
// message). Before it blocks it arms it and looks once more, so a
// completion after that wakes it as before.
#include <dlfcn.h>
#include <fcntl.h>
#include <sched.h>
#include <sys/epoll.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <mutex>

#include "glue/handoff.h"
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
  // A connection's: set under SpinPolled's lock once its endpoint stops
  // polling it, so a poll of it still running then does not leave it to
  // the spinner again.
  std::shared_ptr<bool> spin_stopped;
};

namespace {

// --- spinning in gRPC's poller thread -------------------------------------

using EpollWaitFn = int (*)(int, epoll_event*, int, int);

// epoll_pwait with no signal mask is epoll_wait (glibc implements it so on
// some architectures): used if the next epoll_wait cannot be found.
int PlainEpollWait(int epfd, epoll_event* events, int maxevents, int timeout) {
  return epoll_pwait(epfd, events, maxevents, timeout, nullptr);
}

// The epoll_wait this library's definition stands in front of: glibc's,
// or a sanitizer's interceptor loaded after us. Under ThreadSanitizer
// (scripts/tsan.sh loads this library ahead of TSan's runtime) TSan's
// interceptor, which carries no symbol version, comes next: the versioned
// lookup would skip it for glibc's and TSan would lose what it learns from
// epoll_wait (the order from epoll_ctl to the wake-up).
EpollWaitFn RealEpollWait() {
  static std::atomic<EpollWaitFn> fn{nullptr};
  EpollWaitFn f = fn.load(std::memory_order_acquire);
  if (f == nullptr) {
    if (kThreadSanitizer) f = reinterpret_cast<EpollWaitFn>(dlsym(RTLD_NEXT, "epoll_wait"));
    if (f == nullptr)
      f = reinterpret_cast<EpollWaitFn>(dlvsym(RTLD_NEXT, "epoll_wait", GRPC_RDMA_EPOLL_WAIT_VERSION));
    if (f == nullptr) f = reinterpret_cast<EpollWaitFn>(dlsym(RTLD_NEXT, "epoll_wait"));
    if (f == nullptr) f = PlainEpollWait;
    fn.store(f, std::memory_order_release);
  }
  return f;
}

struct Spin {
  std::atomic<int> grpc_epfd{-1};           // gRPC's epoll set, once learned
  std::atomic<void*> learn_from{nullptr};   // a registered grpc_fd to learn it by
  std::atomic<int64_t> window_ns{0};        // TF_RDMA_SPIN_US; 0: never spin
  std::atomic<int64_t> last_activity{0};    // CLOCK_MONOTONIC ns
  std::atomic<uint64_t> spins{0};           // epoll_waits that spun
  std::atomic<uint64_t> spin_hits{0};       // ... and found something while spinning
  std::atomic<uint64_t> spin_polls{0};      // ... of them by polling SpinPolled's connection
  std::atomic<int64_t> quiet_until{0};      // no spinning before (ns): the cores are wanted
  std::atomic<uint64_t> backoffs{0};        // times spinning stopped for kQuietNs
  std::mutex strike_mu;                     // the two below; taken after a long yield only
  int64_t strikes_at = 0;                   // when `strikes` was last counted (ns)
  int strikes = 0;                          // long yields, one forgiven every kForgiveNs
  int64_t quiet_ns = 0;                     // the last quiet period's length
};

Spin& S() {
  static auto* s = new Spin;
  return *s;
}

// The connection whose CQ the spinning thread polls itself, left
// disarmed: the one connection this process is busy with (a channel's
// calls one after another). Its readable descriptor (the poll that
// Runtime::PollConnection registers) hands it here after its completions
// are handled, unless a thread is blocking in gRPC's set (it would not
// look): that one arms it instead. Whoever next waits in gRPC's set owns
// it: it polls it while it spins (and once in a wait without a timeout),
// and arms it (letting it go) before it blocks. The check and the
// hand-over are under one lock, so a connection is not left disarmed while
// a thread blocks in gRPC's set. Should no thread wait there again (a
// client's last call ended, an application that stopped polling), the
// engine's poller arms it: a poll that leaves a CQ unarmed wakes the
// poller from a wait without end, and its waits are at most 20 ms while
// gRPC's threads poll (Connection::Poll). Nothing is handed over before
// gRPC's set is known, nor once the connection's endpoint stopped polling
// it.
//
// Only while one connection is busy: once another one had something within
// the spin window, every connection is armed again and gRPC's pollers hand
// each ready descriptor to a thread of its own, as before, so calls on
// different connections are handled in parallel. (Polling them all from
// the spinning thread had one thread find every connection's work, and
// cost 4 clients' calls/s 20-30%.) And only while it moves small
// messages: for a spin window after a message of 64 KiB or more moved,
// every connection is armed, a bulk transfer being the device's work
// rather than a wait (without this, gRPC streams of 64 KiB messages moved
// 0.76-0.88x as much server to client).

int64_t NowNs();

struct SpinPolled {
  std::mutex mu;
  int blocking = 0;                   // threads in a blocking epoll_wait on gRPC's set
  std::shared_ptr<Connection> conn;   // left disarmed, or null
  const Connection* last = nullptr;   // the connection that last had something
  int64_t last_ns = 0;                // ... when
  int64_t shared_until = 0;           // another one did too: none is left disarmed before
  int64_t large_until = 0;            // a large message moved: none is left disarmed before
};

SpinPolled& SP() {
  static auto* l = new SpinPolled;
  return *l;
}

// `c` had something at `now`. SP().mu held.
void NoteBusyLocked(const Connection* c, int64_t now, int64_t window) {
  SpinPolled& l = SP();
  if (l.last != c) {
    if (now - l.last_ns < window) l.shared_until = now + window;
    l.last = c;
  }
  l.last_ns = now;
}

// The spin window, or 0 when nothing may be handed to the spinner:
// spinning off, or gRPC's set not known yet (no wait would look). SP().mu
// held (ReleasePolling clears both before it lets the connection go).
int64_t HandOverWindowLocked() {
  if (S().grpc_epfd.load(std::memory_order_relaxed) < 0) return 0;
  return S().window_ns.load(std::memory_order_relaxed);
}

// Whether `conn` (readable now) would be taken by LeaveToSpinner: false
// when nobody would look, or it is not the one busy connection. Notes it
// busy.
bool MayLeaveToSpinner(const std::shared_ptr<Connection>& conn) {
  SpinPolled& l = SP();
  const int64_t now = NowNs();
  std::lock_guard<std::mutex> g(l.mu);
  const int64_t window = HandOverWindowLocked();
  if (window == 0) return false;
  NoteBusyLocked(conn.get(), now, window);
  return l.blocking == 0 && now >= l.shared_until && now >= l.large_until &&
         (l.conn == nullptr || l.conn == conn);
}

// Takes `conn` (its completions just handled); false (the caller arms it)
// when MayLeaveToSpinner would now say no, when it has just moved a large
// message (`large`), or when its endpoint stopped polling it (`stopped`).
bool LeaveToSpinner(const std::shared_ptr<Connection>& conn, bool large, const bool& stopped) {
  SpinPolled& l = SP();
  const int64_t now = NowNs();
  std::lock_guard<std::mutex> g(l.mu);
  const int64_t window = HandOverWindowLocked();
  if (window == 0 || stopped) return false;
  if (large) l.large_until = now + window;
  if (l.blocking > 0 || now < l.shared_until || now < l.large_until) return false;
  if (l.conn == conn) return true;
  if (l.conn != nullptr) return false;  // the other is let go when it is looked at next
  l.conn = conn;
  return true;
}

// The caller stops looking at `c` (SP().conn's former value): arms it, with
// a look. True when it had something.
bool LetGo(std::shared_ptr<Connection> c) { return c != nullptr && c->PollNow(); }

// A look at the connection left to the spinner (no arming): true when it
// had something. Its callbacks run here, their gRPC closures in the
// caller's ExecCtx (gRPC's poller has one, flushed once the wait returns).
// Let go (armed) once another connection is busy too, or a large message
// moved.
bool PollSpinPolled() {
  SpinPolled& l = SP();
  std::shared_ptr<Connection> c;
  bool shared;
  {
    std::lock_guard<std::mutex> g(l.mu);
    if (l.conn == nullptr) return false;
    c = l.conn;
    shared = NowNs() < l.shared_until;
    if (shared) l.conn = nullptr;
  }
  if (shared) return LetGo(std::move(c));
  if (!c->Poll(/*take_events=*/false, /*arm=*/false)) return false;
  const bool large = c->LargeMessagesMoved();
  {
    std::lock_guard<std::mutex> g(l.mu);
    const int64_t now = NowNs(), window = S().window_ns.load(std::memory_order_relaxed);
    NoteBusyLocked(c.get(), now, window);
    if (!large) return true;
    l.large_until = now + window;
    if (l.conn == c) l.conn = nullptr;
  }
  LetGo(std::move(c));  // large messages: their own events, as before
  return true;
}

// Whether work waits on this thread: gRPC closures that callbacks of
// completions handled here queued in its ExecCtx. gRPC runs them once the
// wait returns (end_worker flushes), so a wait that blocks first would
// keep a delivered read or a finished write from gRPC until something
// else woke it: the call's answer may be one of them.
bool WorkQueuedHere() {
  grpc_core::ExecCtx* ctx = grpc_core::ExecCtx::Get();
  return ctx != nullptr && ctx->HasWork();
}

// The caller is about to block in gRPC's set: lets the connection go
// (armed, with a look). True when it had something: then the caller must
// not block, and says so with EndBlocking like one that did.
bool BeginBlocking() {
  std::shared_ptr<Connection> c;
  {
    std::lock_guard<std::mutex> g(SP().mu);
    ++SP().blocking;
    c = std::move(SP().conn);
  }
  return LetGo(std::move(c));
}

void EndBlocking() {
  std::lock_guard<std::mutex> g(SP().mu);
  --SP().blocking;
}

// `conn`'s endpoint stops polling it: not left to the spinner any more,
// nor again by a poll of it still running (`stopped`).
void ForgetSpinPolled(const Connection* conn, bool* stopped) {
  std::shared_ptr<Connection> gone;  // dropped outside the lock
  std::lock_guard<std::mutex> g(SP().mu);
  if (stopped != nullptr) *stopped = true;
  if (SP().conn.get() == conn) gone = std::move(SP().conn);
}

// A yield that comes back after this long, while this process's threads
// did not use the time, gave the core to another program's thread that
// kept it: work of lower priority (a nice 19 batch job, a SCHED_IDLE
// thread) runs until the scheduler's next tick, while a thread that had
// blocked instead would be woken and preempt it. Where such work shares the
// cores, spinning costs 4-5 ms at the 99th percentile (measured: 64 B p99
// 4.9 ms against 0.27 ms without spinning, next to two nice 19 busy loops).
// One such yield now and then is the hypervisor or the peer (a quiet
// ping-pong here: 0-5 in 2 s, of 33,000 spins; next to the two busy loops:
// 500-570 of 4,300): kStrikesOut of them within about kStrikesOut x
// kForgiveNs stop spinning for a quiet period: kQuietNs, doubled (up to
// kQuietMaxNs) each time the strikes come back within two quiet periods of
// the last one's end, as they do while such work goes on (a quiet period
// of 100 ms each time still left 64 B p99 at 2.9 ms next to two idle-class
// busy loops). (A long yield to a thread of this process, copying a large
// message, is no strike: that work was ours.)
constexpr int64_t kYieldTooLongNs = 500 * 1000;
constexpr int kStrikesOut = 3;
constexpr int64_t kForgiveNs = 50 * 1000 * 1000;
constexpr int64_t kQuietNs = 100 * 1000 * 1000;
constexpr int64_t kQuietMaxNs = 10LL * 1000 * 1000 * 1000;

int64_t ProcessCpuNs() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

void StrikeLongYield(int64_t now) {
  std::lock_guard<std::mutex> g(S().strike_mu);
  int64_t forgiven = (now - S().strikes_at) / kForgiveNs;
  if (forgiven >= S().strikes) {
    S().strikes = 0;
    S().strikes_at = now;
  } else {
    S().strikes -= static_cast<int>(forgiven);
    S().strikes_at += forgiven * kForgiveNs;  // the part of a period not yet used counts on
  }
  if (++S().strikes >= kStrikesOut) {
    S().strikes = 0;
    int64_t last_end = S().quiet_until.load(std::memory_order_relaxed);
    bool again = S().quiet_ns > 0 && now - last_end < 2 * S().quiet_ns;
    S().quiet_ns = again ? std::min(2 * S().quiet_ns, kQuietMaxNs) : kQuietNs;
    S().quiet_until.store(now + S().quiet_ns, std::memory_order_relaxed);
    S().backoffs.fetch_add(1, std::memory_order_relaxed);
  }
}

int64_t NowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// While gRPC's set is unknown: did this wait return `learn_from`?
// (epoll1 keeps the grpc_fd in data.ptr, its lowest bit a flag.)
void MaybeLearn(int epfd, const epoll_event* ev, int n) {
  void* want = S().learn_from.load(std::memory_order_relaxed);
  if (want == nullptr) return;
  for (int i = 0; i < n; i++) {
    auto p = reinterpret_cast<uintptr_t>(ev[i].data.ptr) & ~static_cast<uintptr_t>(1);
    if (p == reinterpret_cast<uintptr_t>(want)) {
      // Under the hand-over's lock, and only if `want` is still the one to
      // learn by: ReleasePolling may have forgotten the set meanwhile.
      std::lock_guard<std::mutex> g(SP().mu);
      if (S().learn_from.compare_exchange_strong(want, nullptr))
        S().grpc_epfd.store(epfd, std::memory_order_relaxed);
      return;
    }
  }
}

}  // namespace

// Counters for the stats and tests: waits that spun, and of those, the
// ones that found something ready before their window ended.
uint64_t PollerSpins() { return S().spins.load(std::memory_order_relaxed); }
uint64_t PollerSpinHits() { return S().spin_hits.load(std::memory_order_relaxed); }
uint64_t PollerSpinPolls() { return S().spin_polls.load(std::memory_order_relaxed); }
uint64_t PollerSpinBackoffs() { return S().backoffs.load(std::memory_order_relaxed); }
void SetGrpcEpollSetForTesting(int epfd) { S().grpc_epfd.store(epfd); }
void NoteRdmaActivity() {
  if (S().window_ns.load(std::memory_order_relaxed) > 0) {
    S().last_activity.store(NowNs(), std::memory_order_relaxed);
  }
}

namespace {

int SpinningEpollWait(int epfd, epoll_event* events, int maxevents, int timeout) {
  EpollWaitFn real = RealEpollWait();
  int64_t window = S().window_ns.load(std::memory_order_relaxed);
  if (window > 0 && timeout != 0 && epfd == S().grpc_epfd.load(std::memory_order_relaxed)) {
    int64_t now = NowNs();
    int64_t end = S().last_activity.load(std::memory_order_relaxed) + window;
    if (now < S().quiet_until.load(std::memory_order_relaxed)) end = now;
    if (timeout > 0) end = std::min(end, now + static_cast<int64_t>(timeout) * 1000000);
    if (now < end) {
      S().spins.fetch_add(1, std::memory_order_relaxed);
      const int64_t start = now, cpu_start = ProcessCpuNs();
      do {
        // Work queued on this thread (by any poll here) ends the wait too.
        if (WorkQueuedHere()) return 0;
        if (PollSpinPolled()) {
          // Handled here: gRPC runs what it brought when this wait returns
          // (its ExecCtx is flushed after the poll), as for a ready event.
          S().spin_hits.fetch_add(1, std::memory_order_relaxed);
          S().spin_polls.fetch_add(1, std::memory_order_relaxed);
          NoteRdmaActivity();
          return 0;
        }
        int n = real(epfd, events, maxevents, 0);
        if (n != 0) {
          if (n > 0) S().spin_hits.fetch_add(1, std::memory_order_relaxed);
          return n;
        }
        // Two cores may hold more runnable threads than that (the peer's,
        // the device's, another of gRPC's): a spinner gives its core to any.
        int64_t before = now;
        sched_yield();
        now = NowNs();
        if (now - before > kYieldTooLongNs) {
          // This process's CPU time since the spin began, less what this
          // thread spun before the yield: what its other threads used of
          // the time the yield took (one clock read per spin, not per look:
          // the process clock sums every thread).
          int64_t others = ProcessCpuNs() - cpu_start - (before - start);
          if (others < (now - before) / 2) StrikeLongYield(now);
          break;  // to the blocking wait: the next answer preempts whoever has the core
        }
      } while (now < end);
      if (timeout > 0) {
        // What is left of the caller's timeout, rounded up.
        int64_t left = static_cast<int64_t>(timeout) * 1000000 - (now - start);
        if (left <= 0) return 0;  // SpinPolled's connection: the next wait's
        timeout = static_cast<int>((left + 999999) / 1000000);
      }
    }
  }
  if (epfd == S().grpc_epfd.load(std::memory_order_relaxed)) {
    if (timeout == 0) {
      // A look without waiting (an application that polls its completion
      // queue with a deadline of now): the connection left to the spinner
      // is looked at too.
      if (PollSpinPolled()) return 0;
      return real(epfd, events, maxevents, 0);
    }
    // Blocking in gRPC's set: the connection left to the spinner is armed
    // first, and nothing handled on this thread may wait for the wake-up.
    int n = 0;
    if (!BeginBlocking() && !WorkQueuedHere()) n = real(epfd, events, maxevents, timeout);
    EndBlocking();
    return n;
  }
  int n = real(epfd, events, maxevents, timeout);
  if (n > 0 && S().grpc_epfd.load(std::memory_order_relaxed) < 0) MaybeLearn(epfd, events, n);
  return n;
}

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
  TakenFromGrpc(r);  // the notification's closure, run by any of gRPC's threads
  if (error.ok() && r->poll()) NoteRdmaActivity();
  {
    std::lock_guard<std::mutex> g(Mu());
    if (!r->stopped) {
      // Shut down by someone else (nothing in gRPC 1.51 does): re-arming a
      // shut-down fd would run this again at once, forever.
      if (error.ok()) {
        HandedToGrpc(r);
        grpc_fd_notify_on_read(r->fd, &r->on_readable);
      }
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
  if (S().grpc_epfd.load(std::memory_order_relaxed) < 0) S().learn_from.store(r->fd);
  GRPC_CLOSURE_INIT(&r->on_readable, OnReadable, r, nullptr);
  HandedToGrpc(r);
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
  void* registered = r->fd;
  S().learn_from.compare_exchange_strong(registered, nullptr);
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
  // Only now: a connection handed to the spinner relies on the engine's
  // poller knowing that gRPC's threads poll (its waits are then short).
  if (options_.poll_mode == PollMode::kAdaptive && options_.spin_us > 0) {
    S().window_ns.store(static_cast<int64_t>(options_.spin_us) * 1000);
  }
  GRPC_RDMA_TRACE("completions are polled by gRPC's pollers too");
}

void Runtime::ReleasePolling() {
  {
    std::lock_guard<std::mutex> g(Mu());
    if (E().users == 0 || --E().users > 0) return;
    // No RDMA endpoint or listener left: no spinning, and gRPC may shut
    // down and make a new epoll set (another descriptor) for the next
    // endpoint: learned again then.
    {
      std::lock_guard<std::mutex> sg(SP().mu);  // no hand-over from here on
      S().window_ns.store(0);
      S().grpc_epfd.store(-1);
      S().learn_from.store(nullptr);  // a wait learning it now must not
    }
    if (E().current != nullptr) {
      PollRegistration* r = E().current;
      E().current = nullptr;
      engine()->SetExternalPolling(false);
      UnregisterLocked(r, "grpc_rdma: no RDMA connection left");
    }
  }
  // A connection a last poll handed to the spinner as its endpoint went
  // (the endpoint takes its own off): nobody waits in gRPC's set for it
  // now. Armed, and let go.
  BeginBlocking();
  EndBlocking();
}

PollRegistration* Runtime::PollConnection(std::shared_ptr<Connection> conn) {
  if (options_.poll_mode == PollMode::kBusy || conn->event_fd() < 0) return nullptr;
  std::lock_guard<std::mutex> g(Mu());
  if (!Supported()) return nullptr;
  // The engine's poller lets go first: whatever completes from here on
  // raises an edge gRPC sees once the descriptor is registered.
  conn->SetHostPolled(true);
  // Its completions handled, the CQ is armed again unless the spinning
  // thread takes over (LeaveToSpinner; asked first, so a connection that
  // will be armed is polled once, as before).
  auto stopped = std::make_shared<bool>(false);  // under SpinPolled's lock
  PollRegistration* r = RegisterLocked(conn->event_fd(), "grpc_rdma connection", [conn, stopped] {
    if (!MayLeaveToSpinner(conn)) return conn->PollNow();
    bool did = conn->Poll(/*take_events=*/true, /*arm=*/false);
    if (!LeaveToSpinner(conn, conn->LargeMessagesMoved(), *stopped))
      did |= conn->Poll(/*take_events=*/false, /*arm=*/true);
    return did;
  });
  if (r == nullptr) {
    conn->SetHostPolled(false);
    return nullptr;
  }
  r->spin_stopped = std::move(stopped);
  return r;
}

void Runtime::StopPollingConnection(PollRegistration* r, Connection* conn) {
  if (r == nullptr) return;
  std::shared_ptr<bool> stopped;
  {
    std::lock_guard<std::mutex> g(Mu());
    stopped = r->spin_stopped;  // r may go once unregistered
    UnregisterLocked(r, "grpc_rdma: endpoint shut down");
    // Whatever the connection still has to do (a disconnect waiting for
    // its last sends) is the engine poller's again.
    conn->SetHostPolled(false);
  }
  // The spinning thread may have left its CQ disarmed: armed again (with
  // a look), or the engine's poller would find its completions only on
  // its next round (20 ms while gRPC's threads poll).
  ForgetSpinPolled(conn, stopped.get());
  conn->PollNow();
}

}  // namespace grpc_rdma

// gRPC's epoll1 poller calls epoll_wait through the PLT: this definition,
// exported at glibc's version of it (libgrpc_rdma.map.in), comes first when
// the library is preloaded or linked before libc.
extern "C" __attribute__((visibility("default"))) int epoll_wait(int epfd,
                                                                 struct epoll_event* events,
                                                                 int maxevents, int timeout) {
  return grpc_rdma::SpinningEpollWait(epfd, events, maxevents, timeout);
}
