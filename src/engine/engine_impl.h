// File: src/engine/engine_impl.h
//
// The engine behind the Engine facade: the registry of connections and
// listeners, RDMA CM (engine.cc), and the poller (poller.cc).
//
// Locking: `mu` guards the registry (connections, listeners), the epoll
// sets' membership and RDMA CM handling; it is never held across a
// connection's data path. Order: mu, then a connection's own lock (the CM
// handling sets connections up and closes them with both held); never the
// other way. The poller and PollNow take the connections to look at from
// the registry under mu, then drop it and handle each under its own lock,
// so a busy connection (a chunk copy, a post) holds up nobody else.
#ifndef GRPC_RDMA_SRC_ENGINE_ENGINE_IMPL_H_
#define GRPC_RDMA_SRC_ENGINE_ENGINE_IMPL_H_

#include <sys/epoll.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "engine/buffer_pool.h"
#include "engine/connection.h"
#include "engine/engine.h"
#include "verbs/verbs.h"

namespace grpc_rdma {

using ConnList = std::vector<std::shared_ptr<ConnImpl>>;

class EngineImpl : public std::enable_shared_from_this<EngineImpl> {
 public:
  EngineImpl(const Options& o, ChunkMemory memory);
  ~EngineImpl();
  absl::Status Start();
  // Stops the poller and closes every connection (Engine's destructor);
  // the memory stays until the last connection and lent chunk are gone.
  void Shutdown();

  std::weak_ptr<Connection> Connect(const sockaddr_in& addr, int timeout_ms,
                                    Engine::ConnectDone done, const JoinRequest* joins);
  void CancelConnect(const std::weak_ptr<Connection>& connecting);
  absl::StatusOr<uint16_t> Listen(const sockaddr_in& addr, Engine::AcceptFn on_accept);
  void StopListening(const sockaddr_in& addr);

  int event_fd() const { return epfd_; }
  // A host event loop polls event_fd() (SetExternalPolling): the poller
  // does not spin. While the host called PollNow within kHostActiveUs, the
  // poller only looks every kBackupUs; otherwise it leaves each event to
  // the host for kExternalGraceUs before handling it.
  std::atomic<bool> external_polling{false};
  std::atomic<uint64_t> last_host_poll_us{0};
  std::atomic<uint64_t> host_polls{0};  // PollNow calls that found work
  // Connections waiting for pinned memory: a buffer the reader gives back
  // wakes the poller only while there are any.
  std::atomic<int> buffer_waiters{0};
  std::atomic<uint64_t> wakeups{0};  // Wake() calls
  // Connection requests rejected, and accepted connections dropped
  // before they were established (timed out, or over the half-open cap).
  std::atomic<uint64_t> refused{0};
  std::atomic<uint64_t> connection_errors{0};  // connections a fault closed (FailLocked)
  static constexpr int kExternalGraceUs = 250;
  static constexpr uint64_t kHostActiveUs = 100000;
  static constexpr uint64_t kBackupUs = 20000;
  bool PollNow();

  // Wakes the poller (new fds, budget freed, work queued from other threads).
  void Wake();
  // The poller may be about to wait with no timeout: whoever sets a new
  // deadline (a grant's) wakes it so that it waits no longer than that.
  std::atomic<bool> may_block_{false};
  // Set while the poller waits with no timeout, or one above kBackupUs
  // (not its kBackupUs looks while the host polls), before it reads
  // last_host_poll_us: a host poll that leaves a CQ unarmed
  // (ConnImpl::Poll) and finds it set wakes the poller, which then arms
  // every CQ and looks every kBackupUs.
  std::atomic<bool> waiting_for_good_{false};
  // Puts the connection's completion channel in the shared epoll set, or
  // in the poller's own one while a host polls it, or (gone) in none.
  void WatchLocked(ConnImpl* c);
  void UnwatchLocked(ConnImpl* c);
  // Remembers that a host event loop polled just now (see Engine).
  void NoteHostPoll() { last_host_poll_us.store(NowMicros(), std::memory_order_seq_cst); }

  std::mutex mu;  // the registry's lock (see above)
  const Options options;
  const ChunkMemory chunk_memory;  // where received bytes are copied
  PinnedBudget budget;

 private:
  // poller.cc
  void PollerMain();
  // Handles what epoll reported (with mu held): RDMA CM events, the
  // wake-up, and the shared set's events nested in the poller's set; the
  // connections whose channels were reported go into `ready`.
  void HandleEventListLocked(const epoll_event* evs, int n, bool take_wake, ConnList* ready,
                             Deferred* d);
  // Fails connections past their connect deadline (with mu held).
  void CheckDeadlinesLocked(Deferred* d);
  // Each connection under its own lock (mu not held): the channel events of
  // `ready` taken, then every CQ polled dry; `arm`: armed and looked at
  // once more (what completed before the arm raises no event). True when
  // anything happened. A connection whose lock is taken is not waited for:
  // it is left to the lock's holder (ConnImpl::LeavePending), and
  // `*skipped` says so, so that the poller looks again soon.
  bool PollConnections(const ConnList& ready, const ConnList& all, bool arm, Deferred* d,
                       bool* skipped);
  // The poller's wait after it skipped a busy connection: instead of
  // epoll (whose level-triggered channels would report it at once, over
  // and over), a pause on the wake-up descriptor alone.
  static constexpr int kSkippedRetryMs = 1;
  // Every connection, into `out` (emptied first; its capacity is kept, so
  // a poller that reuses one list allocates nothing per pass).
  void SnapshotLocked(ConnList* out) const;
  // engine.cc
  // TF_RDMA_DEV_NAME when the user named a device, else empty: then every
  // connection and listener must be on that device (an address that
  // resolves to another goes by TCP, with a log line once per device).
  // Likewise TF_RDMA_PORT, and TF_RDMA_GID_INDEX for the route's source
  // GID (checked once the route is resolved).
  const std::string device_;
  // With mu: nullptr when `id` is on the named device, port and GID index
  // (or none was named), else why not; logged the first time for each
  // other device, port or GID.
  const char* WrongPathLocked(rdma_cm_id* id, const char* what);
  // TF_RDMA_TOS on `id`, if set (before its route is resolved, or on a
  // listener, whose requests inherit it).
  absl::Status SetTosLocked(rdma_cm_id* id);
  void RejectLocked(rdma_cm_id* id);
  // Server connections accepted and not yet established ("half-open")
  // are at most this many: Options::max_half_open, lowered so that they
  // hold at most an eighth of the pinned budget and a quarter of the
  // descriptor limit (HalfOpenCap). A connection request past it drops
  // the oldest of them, so that a peer that never completes the exchange
  // can hold neither the budget nor the descriptors, nor keep honest
  // peers out for longer than it takes them to connect.
  const int half_open_cap_;
  // With mu: makes room for one more half-open connection.
  void MakeHalfOpenRoomLocked(Deferred* d);
  uint64_t half_open_logged_us_ = 0;  // with mu: the last drop logged
  uint64_t half_open_dropped_ = 0;    // with mu: drops in all
  std::string wrong_device_why_;
  std::vector<std::string> wrong_devices_logged_;
  // `listener`: the listening id's context, read before the event was
  // acked (e->listen_id is not kept: the id may be gone by now).
  void HandleCmEventLocked(rdma_cm_event* e, void* listener, Deferred* d);
  void OnConnectRequestLocked(rdma_cm_event* e, void* listener, Deferred* d);
  // With mu and the connection's lock held.
  void FailConnectLocked(ConnImpl* c, absl::Status s, Deferred* d);
  std::shared_ptr<ConnImpl> Find(rdma_cm_id* id);
  void TakeCmEventsLocked(Deferred* d);
  // The device's asynchronous events (access errors on a QP: a peer
  // writing or reading outside its grants), watched once per device
  // context in the shared set, tagged with the context's address | 1.
  void WatchAsyncLocked(ibv_context* ctx);
  // `held`: a connection whose lock the caller holds already.
  void TakeAsyncEventsLocked(ibv_context* ctx, Deferred* d, ConnImpl* held = nullptr);
  std::vector<ibv_context*> async_ctxs_;

  EventChannel events_;
  std::vector<CmId> listeners_;
  // Listeners whose device was removed (RDMA_CM_EVENT_DEVICE_REMOVAL): the
  // address each was bound to, and when to try it again. Every
  // kRelistenMs the engine binds and listens there anew, with the same
  // accept function (index into listeners_), until a device is back
  // there (a driver bound again) or StopListening forgets it.
  struct LostListener {
    size_t index;
    sockaddr_in addr;
    uint64_t next_try_us;
    bool said;  // a failure other than "no device" was logged
  };
  std::vector<LostListener> lost_listeners_;
  static constexpr int kRelistenMs = 1000;
  // With mu: one try for each lost listener that is due.
  void RelistenLocked();
  // With mu: a bound and listening id on `addr` (port 0: any), its
  // context set to listener number `index` + 1.
  absl::StatusOr<CmId> ListenIdLocked(const sockaddr_in& addr, size_t index);
  std::vector<Engine::AcceptFn> accept_fns_;  // indexed like listeners_
  std::map<rdma_cm_id*, std::shared_ptr<ConnImpl>> conns_;
  int epfd_ = -1;       // shared with a host loop: CM, wake-ups, connections no host polls
  int poll_epfd_ = -1;  // the poller's own: epfd_ and the host-polled connections
  int wake_fd_ = -1;
  bool stop_ = false;
  std::thread poller_;
};

}  // namespace grpc_rdma

#endif  // GRPC_RDMA_SRC_ENGINE_ENGINE_IMPL_H_
