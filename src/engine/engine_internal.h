// Engine internals shared by engine.cc (poller, RDMA CM) and connection.cc
// (the data path). One mutex, EngineImpl::mu, guards every connection's
// state; callbacks are collected in a Deferred and run after it is dropped.
#ifndef GRPC_RDMA_SRC_ENGINE_ENGINE_INTERNAL_H_
#define GRPC_RDMA_SRC_ENGINE_ENGINE_INTERNAL_H_

#include <sys/epoll.h>

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "engine/buffer_pool.h"
#include "engine/engine.h"
#include "engine/wire.h"
#include "verbs/verbs.h"

namespace grpc_rdma {

uint64_t NowMicros();

// Callbacks to run once the engine lock is released.
using Deferred = std::vector<std::function<void()>>;

class EngineImpl;

class ConnImpl : public Connection, public std::enable_shared_from_this<ConnImpl> {
 public:
  ConnImpl(std::shared_ptr<EngineImpl> engine, CmId id, bool passive);
  ~ConnImpl() override;

  // Connection
  void Write(std::vector<iovec> data, WriteDone done) override;
  void Read(ReadDone done) override;
  void Shutdown(absl::Status why) override;
  int event_fd() const override { return channel_fd(); }
  bool PollNow() override;
  void SetHostPolled(bool on) override;
  std::string peer() const override { return peer_; }
  std::string local() const override { return local_; }
  ConnectionStats stats() const override;

  // Called with EngineImpl::mu held.
  absl::Status SetupLocked();                   // PD, CQ, pools, QP, receives
  void SetPeerLocked(const wire::Hello& hello);  // from the handshake
  void UpLocked();
  int HandleCqLocked(Deferred* d);              // polls the CQ dry; completions seen
  void ArmCqLocked();
  // Takes and acks the completion channel's events (non-blocking): how
  // many.
  unsigned TakeEventsLocked();
  // Re-arms for every completion when something now waits for our own send
  // completions but the CQ is armed for solicited ones only (Write or
  // Shutdown on an application thread), and looks at the CQ once.
  void RearmIfSendsAwaitedLocked(Deferred* d);
  bool SendsAwaitedLocked() const;
  void PumpLocked(Deferred* d);                 // send what can be sent
  void CloseLocked(absl::Status why, Deferred* d, bool disconnect);
  void ReleaseInflightLocked(uint64_t wr_id);
  bool closed() const { return state_ == State::kClosed; }
  int channel_fd() const { return channel_ ? channel_->fd : -1; }
  ibv_comp_channel* channel() const { return channel_.get(); }
  rdma_cm_id* cm_id() const { return id_.get(); }
  bool passive() const { return passive_; }
  wire::Hello MyHello() const;

  bool host_polled = false;          // SetHostPolled: a host event loop polls it
  int watch_set = -1;                // the epoll set its channel is in (-1: none)
  Engine::ConnectDone connect_done;  // client, until established
  bool accepted = false;             // server: rdma_accept done
  uint64_t connect_deadline_us = 0;

 private:
  enum class State { kSetup, kUp, kClosed };
  struct WriteOp {
    std::vector<iovec> iov;
    size_t total = 0;
    size_t copied = 0;   // bytes taken out of iov so far
    bool rts_sent = false;
    WriteDone done;
  };
  struct OutGrant {  // a peer's CTS for our rendezvous
    uint64_t offset, addr;
    uint32_t len, rkey, grant;
  };
  struct Landing {  // our grant for the peer's rendezvous
    PinnedBuffer* buf;
    uint32_t len;
    bool standing = false;  // kPre: one whole message of up to len bytes
  };

  void OnRecvLocked(const ibv_wc& wc, Deferred* d);
  void OnChunkLocked(const ibv_wc& wc, Deferred* d);
  bool PostRecvLocked(size_t index);
  bool SendControlLocked(wire::Header h);  // inline SEND
  bool WritePreGrantedLocked(Deferred* d);
  bool PostGrantedWriteLocked(PinnedBuffer* b, uint32_t len, const OutGrant& g, Deferred* d);
  void IssueStandingGrantsLocked();
  bool SendEagerLocked(Deferred* d);
  bool WriteChunkLocked(Deferred* d);
  void IssueGrantsLocked(Deferred* d);
  // A buffer, or nullptr: closed on error, or waiting for pinned memory.
  PinnedBuffer* GetOrWaitLocked(BufferPool& pool, size_t size, Deferred* d);
  void DeliverLocked(Deferred* d);
  void CopyOut(WriteOp& op, size_t offset, char* to, size_t len);
  void Violation(const char* what, Deferred* d);
  uint16_t TakeCreditsLocked();

  // Shared: a connection (and chunks it lent) may outlive the Engine.
  const std::shared_ptr<EngineImpl> engine_;
  const bool passive_;
  // Owners, in the order rdma-core needs them torn down in reverse.
  CmId id_;
  // Shared with the pools' registrars: lent chunks may outlive us, and
  // their memory regions must go before the PD.
  std::shared_ptr<ibv_pd> pd_;
  CompChannel channel_;
  Cq cq_;
  std::unique_ptr<BufferPool> local_pool_;   // eager send/receive buffers
  // Rendezvous landing buffers. Shared with the chunks lent to the reader,
  // which may outlive the connection (RecvChunks must go before the Engine).
  std::shared_ptr<BufferPool> remote_pool_;
  Qp qp_;

  State state_ = State::kSetup;
  // Closed locally while sends were still in flight: disconnect once their
  // completions are in (a disconnect moves the QP to error, and the HCA
  // would flush them undelivered).
  bool disconnect_when_drained_ = false;
  std::string peer_, local_;
  absl::Status close_status_;
  uint32_t peer_acc_ = 0;
  uint32_t eager_limit_ = 0;  // largest eager write: peer_acc_, if we can stage it
  int peer_standing_ = 0;  // standing grants the peer accepts (its Hello)
  bool peer_solicits_ = false;  // the peer's messages are all solicited
  bool armed_solicited_ = false;  // the CQ's last arm was solicited-only
  // ibv_req_notify_cq calls since an event was last taken: each raises at
  // most one event, so after one is taken another can be queued only if
  // the CQ was armed more than once in between.
  int arms_since_take_ = 0;
  int peer_depth_ = 0;
  uint32_t grant_limit_ = 0;  // our largest grant: both chunk sizes' minimum
  int peer_credits_ = 0;
  int credits_to_return_ = 0;
  std::vector<PinnedBuffer*> recv_bufs_;
  std::unordered_map<uint64_t, PinnedBuffer*> inflight_;  // wr_id -> staging
  uint64_t next_wr_ = 1;
  std::deque<WriteOp> writes_;
  std::deque<OutGrant> out_grants_;
  size_t out_next_offset_ = 0;  // next grant offset expected for writes_.front()
  // Inbound rendezvous.
  bool in_active_ = false;
  uint64_t in_total_ = 0, in_received_ = 0, in_granted_ = 0;
  std::map<uint32_t, Landing> landings_;
  int standing_out_ = 0;                // our kPre grants not yet used
  std::deque<OutGrant> pre_grants_;     // the peer's kPre grants for us
  uint32_t next_grant_ = 1;
  bool waiting_budget_ = false;
  std::atomic<bool> budget_woken_{false};  // set by the budget's wake-up
  int sq_free_ = 0;                         // send queue slots not in use
  // Reader side.
  std::deque<RecvChunk> ready_;
  ReadDone pending_read_;
  bool peer_closed_ = false;
  ConnectionStats stats_;
};

class EngineImpl : public std::enable_shared_from_this<EngineImpl> {
 public:
  explicit EngineImpl(const Options& o);
  ~EngineImpl();
  absl::Status Start();
  // Stops the poller and closes every connection (Engine's destructor);
  // the memory stays until the last connection and lent chunk are gone.
  void Shutdown();

  void Connect(const sockaddr_in& addr, int timeout_ms, Engine::ConnectDone done);
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
  // Connections waiting for pinned memory (waiting_budget_): a buffer the
  // reader gives back wakes the poller only while there are any.
  std::atomic<int> buffer_waiters{0};
  std::atomic<uint64_t> wakeups{0};  // Wake() calls
  static constexpr int kExternalGraceUs = 250;
  static constexpr uint64_t kHostActiveUs = 100000;
  static constexpr uint64_t kBackupUs = 20000;
  bool PollNow();

  // Wakes the poller (new fds, budget freed, work queued from other threads).
  void Wake();
  // Puts the connection's completion channel in the shared epoll set, or
  // in the poller's own one while a host polls it, or (gone) in none.
  void WatchLocked(ConnImpl* c);
  void UnwatchLocked(ConnImpl* c);
  // Remembers that a host event loop polled just now (see Engine).
  void NoteHostPoll() { last_host_poll_us.store(NowMicros(), std::memory_order_relaxed); }

  std::mutex mu;
  const Options options;
  PinnedBudget budget;

 private:
  void PollerMain();
  void HandleCmEventLocked(rdma_cm_event* e, Deferred* d);
  // The events, then connect deadlines and every CQ; true when anything
  // happened. HandleEventListLocked: the events alone (the shared set's
  // ones nested in the poller's set among them).
  bool HandleEventsLocked(const epoll_event* evs, int n, bool take_wake, Deferred* d);
  void HandleEventListLocked(const epoll_event* evs, int n, bool take_wake, Deferred* d);
  void OnConnectRequestLocked(rdma_cm_event* e, Deferred* d);
  void FailConnectLocked(ConnImpl* c, absl::Status s, Deferred* d);
  std::shared_ptr<ConnImpl> Find(rdma_cm_id* id);
  bool PollAllLocked(Deferred* d);

  EventChannel events_;
  std::vector<CmId> listeners_;
  std::vector<Engine::AcceptFn> accept_fns_;  // indexed like listeners_
  std::map<rdma_cm_id*, std::shared_ptr<ConnImpl>> conns_;
  int epfd_ = -1;       // shared with a host loop: CM, wake-ups, connections no host polls
  int poll_epfd_ = -1;  // the poller's own: epfd_ and the host-polled connections
  int wake_fd_ = -1;
  bool stop_ = false;
  std::thread poller_;
};

}  // namespace grpc_rdma

#endif  // GRPC_RDMA_SRC_ENGINE_ENGINE_INTERNAL_H_
