// File: src/engine/connection.h
//
// One connection: an RC QP in a PD of its own, with its CQ, completion
// channel and buffer pools, and the state of both directions of its byte
// stream. Its methods live in four files, one job each:
//
//   connection.cc  state: set-up, the peer's Hello, close, the CQ (arming,
//                  events, completions), the application's calls
//   sender.cc      the send path: eager coalescing, standing-grant writes,
//                  announced transfers (RTS, then chunks into the peer's
//                  grants), credit updates
//   receiver.cc    the receive path: messages and chunks from the peer,
//                  checked field by field (wire.h), the grants we make,
//                  the reader's queue
//   flow.h         credits and send slots, as a value
//
// Locking: each connection has a mutex of its own, mu_, that guards all of
// its state; `...Locked` methods need it held. No connection ever waits for
// another's lock. The engine's registry lock (EngineImpl::mu) is taken
// before a connection's, never after (the engine's RDMA CM handling holds
// both); a connection's code never takes it. Callbacks are collected in a
// Deferred while the lock is held and run after it is dropped.
#ifndef GRPC_RDMA_SRC_ENGINE_CONNECTION_H_
#define GRPC_RDMA_SRC_ENGINE_CONNECTION_H_

#include <algorithm>
#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/functional/function_ref.h"
#include "engine/buffer_pool.h"
#include "engine/deferred.h"
#include "engine/engine.h"
#include "engine/flow.h"
#include "engine/ring.h"
#include "engine/wire.h"
#include "verbs/verbs.h"

namespace grpc_rdma {

uint64_t NowMicros();

class EngineImpl;

class ConnImpl : public Connection, public std::enable_shared_from_this<ConnImpl> {
 public:
  ConnImpl(std::shared_ptr<EngineImpl> engine, CmId id, bool passive);
  ~ConnImpl() override;

  // Connection (each takes mu_).
  void Write(absl::Span<const iovec> data, WriteDone done) override;
  void Write(absl::Span<const iovec> data, WriteDone done,
             std::shared_ptr<const void> keep) override;
  bool zero_copy_sends() const override {
    return zero_copy_sends_.load(std::memory_order_relaxed);
  }
  void Read(ReadDone done) override;
  void Shutdown(absl::Status why) override;
  int event_fd() const override { return channel_fd(); }
  bool PollNow() override;
  bool Poll(bool take_events, bool arm) override;
  bool LargeMessagesMoved() override;
  void SetHostPolled(bool on) override;
  std::string peer() const override;
  std::string local() const override;
  std::string device() const override;
  std::string joins() const override;
  std::string join_token() const override;
  ConnectionStats stats() const override;
  std::string Describe() const override;

  // The connection's lock, for the engine's RDMA CM handling and poller.
  std::mutex& mu() const { return mu_; }

  // For a poller that found the lock taken (it never waits for one
  // connection while others may have work): marks the CQ as owed a look,
  // which whoever holds the lock takes after dropping it (DrainPending);
  // if the lock is free by now, takes it itself. Callbacks run on the
  // calling thread, with no lock held. True when it handled something.
  bool LeavePending();
  // Handles the CQ if a poller left it pending (see LeavePending). Called
  // after mu_ is dropped on every application path. True when it handled
  // something (a completion, a callback run): a host poller's caller must
  // know, since callbacks may have queued work on its thread (gRPC
  // closures in its ExecCtx) that it must run before it blocks.
  bool DrainPending();

  // --- with mu() held ---
  absl::Status SetupLocked();                   // PD, CQ, pools, QP, receives
  void SetPeerLocked(const wire::Hello& hello);  // from the handshake
  void UpLocked();
  int HandleCqLocked(Deferred* d);              // polls the CQ dry; completions seen
  void NoteLargeLocked(size_t n) { largest_moved_ = std::max(largest_moved_, n); }
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
  // CloseLocked for a fault (the peer broke the protocol, a completion or
  // device error, a failed post): counted in connection_errors.
  void FailLocked(absl::Status why, Deferred* d);
  // The device went (RDMA_CM_EVENT_DEVICE_REMOVAL): FailLocked, and counted
  // as a fault too when the QP's flush (the removal's first sign, often
  // polled before the CM event comes) already closed the connection.
  void DeviceRemovedLocked(absl::Status why, Deferred* d);
  bool closed() const { return state_ == State::kClosed; }
  wire::Hello MyHello() const;
  // A client's: the TCP connection (its end) this one joins, said in its Hello.
  void SetJoinsLocked(const JoinRequest& joins);
  // Client, until established: the caller's callback. Server, from
  // rdma_accept: the listener's, to hand the connection over.
  Engine::ConnectDone connect_done;
  bool accepted = false;  // server: rdma_accept done

  // Fixed from set-up on (read without a lock); qp() is null once the
  // connection settled its zero-copy writes (SettleZeroCopyLocked).
  int channel_fd() const { return channel_fd_.load(std::memory_order_acquire); }
  rdma_cm_id* cm_id() const { return id_.get(); }
  bool passive() const { return passive_; }
  // Set-up done: its QP (for the device's asynchronous events).
  ibv_qp* qp() const { return qp_.get(); }
  // With its lock held: an affiliated asynchronous event of its QP. An
  // access error is the peer reaching outside its grants (the device
  // refused the RDMA WRITE or READ): logged, and the connection closed.
  void OnQpEventLocked(ibv_event_type type, Deferred* d);

  // --- with EngineImpl::mu held ---
  bool host_polled = false;          // SetHostPolled: a host event loop polls it
  int watch_set = -1;                // the epoll set its channel is in (-1: none)
  uint64_t connect_deadline_us = 0;  // 0: none (established)
  // Closed with sends still in flight: the disconnect waits for them until
  // this time (0: not waiting), then goes ahead (DisconnectNowLocked), so a
  // peer that never acknowledges (no receives posted, infinite RNR retry)
  // cannot keep a closed connection's memory. Read by the poller without
  // the connection's lock.
  std::atomic<uint64_t> drain_deadline_us{0};
  static constexpr int kDrainMs = 2000;
  // Grants of an announced transfer out and unwritten: the peer must land
  // a chunk by this time (0: nothing outstanding), renewed by each chunk,
  // or the connection is closed (TF_RDMA_GRANT_TIMEOUT_MS). Read by the
  // poller without the connection's lock.
  std::atomic<uint64_t> grant_deadline_us{0};
  // With its lock held: the grant deadline passed; closes if still so.
  void GrantsTimedOutLocked(uint64_t now_us, Deferred* d);
  // With its lock held: the disconnect a close left waiting for its last
  // sends, now.
  void DisconnectNowLocked();
  const std::string& PeerLocked() const { return peer_; }
  // With its lock held, closed and leaving the registry (no one polls it
  // after): zero-copy writes whose chunks have not completed get their
  // flushed completions now if the device has given them, else the QP is
  // destroyed (the device reads their buffers no more) and they end with
  // the close's status.
  void SettleZeroCopyLocked(Deferred* d);

 private:
  enum class State { kSetup, kUp, kClosed };
  // Receive work requests carry this bit and the receive buffer's index.
  static constexpr uint64_t kRecvBit = 1ull << 63;
  // A write some of whose chunks went from its own buffers (zero-copy):
  // its `done` waits for those chunks' completions, since the device
  // reads the buffers until then.
  struct ZcWrite {
    WriteDone done;
    int pending = 0;        // zero-copy chunks posted and not completed
    bool finished = false;  // every chunk posted (or the connection closed): done set
    absl::Status status;    // what done reports (a failed chunk, a close)
    // The write's `keep` once it is wholly posted (its `done` ran then) or
    // closed with chunks out: this holds its buffers until the last chunk
    // completes or flushes.
    std::shared_ptr<const void> keep;
  };
  struct WriteOp {
    absl::InlinedVector<iovec, 4> iov;  // gRPC's writes of small messages: 1-3
    size_t total = 0;
    size_t copied = 0;   // bytes taken out of iov so far
    bool rts_sent = false;
    WriteDone done;
    std::shared_ptr<ZcWrite> zc;  // set once a chunk goes zero-copy
    std::shared_ptr<const void> keep;  // Write's `keep`, if any
  };
  struct OutGrant {  // a peer's grant (CTS, or a standing one) for our writes
    uint64_t offset, addr;
    uint32_t len, rkey, grant;
  };
  struct Landing {  // our grant for the peer's writes
    PinnedBuffer* buf;
    uint32_t len;
    bool standing = false;  // one whole message of up to len bytes
    uint64_t offset = 0;    // announced transfer: where in it this chunk goes
    bool large = false;     // a large standing grant (plan::LargeStandingBytes)
  };
  // A grant id not in use (ids wrap after 2^32 grants; 0 is never one).
  uint32_t NextGrantIdLocked();

  // sender.cc
  bool SendControlLocked(wire::Header h);  // inline SEND
  // The smallest of the peer's standing grants that holds `total` bytes
  // (its index in standing_in_), or -1.
  int FitStandingLocked(size_t total) const;
  // Writes the whole head write into standing_in_[which] (taken).
  bool WriteStandingLocked(size_t which, Deferred* d);
  bool PostGrantedWriteLocked(PinnedBuffer* b, uint32_t len, const OutGrant& g, Deferred* d);
  // Posts one RDMA WRITE WITH IMMEDIATE of `sge` into the peer's grant `g`
  // (counted as a send); false when the post failed (nothing counted).
  bool PostChunkLocked(const OutGrant& g, ibv_sge* sge, int n, uint64_t wr_id);
  // A chunk of the head write is posted: counted, and the write finished
  // (FinishHeadWriteLocked, which pops it) when it was the last.
  void ChunkWrittenLocked(WriteOp& op, uint32_t len, Deferred* d);
  bool SendEagerLocked(Deferred* d);
  size_t NextEagerBytesLocked() const;
  static constexpr size_t kMaxInlineBytes = 256;  // the most an eager SEND carries inline
  bool WriteChunkLocked(Deferred* d);
  // Writes bytes [offset, offset + len) of the head write into the peer's
  // grant `g`: zero-copy where it can (a large piece in a few of the
  // writer's buffers), else copied into a registered staging buffer.
  // `take` removes the grant from its queue once the write goes (not while
  // it waits for pinned memory). False: closed, or waiting.
  bool WriteIntoGrantLocked(const OutGrant& g, size_t offset, uint32_t len,
                            absl::FunctionRef<void()> take, Deferred* d);
  // Zero-copy (odp_mr_): the SGEs for bytes [offset, offset + len) of `op`,
  // at most `max` of them; 0 when more would be needed.
  int GatherLocked(const WriteOp& op, size_t offset, size_t len, ibv_sge* sge, int max) const;
  // Posts `len` bytes of `op` gathered in `sge` (no copy) into grant `g`,
  // taken by the caller: the write's `done` then waits for its completion.
  bool WriteZeroCopyLocked(WriteOp& op, const OutGrant& g, uint32_t len, ibv_sge* sge, int n,
                           Deferred* d);
  // The head write is wholly posted: its `done` now, or once its
  // zero-copy chunks complete.
  void FinishHeadWriteLocked(Deferred* d);
  // A zero-copy chunk completed (ok: delivered).
  void ZeroCopyDoneLocked(uint64_t wr_id, bool ok, Deferred* d);
  // Smaller chunks are copied: a zero-copy write's writer waits for the
  // chunk's completion, where a copied one's goes on at once; measured on
  // softverbs, streams of 64 KiB to 1 MiB messages were slower zero-copy,
  // 4 MiB ones faster (docs/performance.md).
  static constexpr size_t kZeroCopyMin = 1 << 20;
  static constexpr int kZeroCopySge = 8;
  void CopyOut(WriteOp& op, size_t offset, char* to, size_t len);
  // A buffer, or nullptr: closed on error, or waiting for pinned memory.
  PinnedBuffer* GetOrWaitLocked(BufferPool& pool, size_t size, Deferred* d);
  void ReleaseInflightLocked(uint64_t wr_id, bool ok, Deferred* d);
  // receiver.cc
  void OnRecvLocked(const ibv_wc& wc, Deferred* d);
  void OnChunkLocked(const ibv_wc& wc, Deferred* d);
  static constexpr size_t kRecvChain = 16;  // receives posted in one call at most
  bool PostRecvsLocked(const uint32_t* index, size_t n);
  // A handled receive goes back to the device with the others of its pass
  // over the CQ: one ibv_post_recv for all of them (PostRepostsLocked, at
  // the end of each batch of completions), their credits owed from then.
  void RepostLocked(size_t index);
  void PostRepostsLocked(Deferred* d);
  void IssueStandingGrantsLocked();
  // One standing grant of `len` bytes; false when none can be made now.
  bool IssueStandingGrantLocked(uint32_t len, bool large);
  // Opens a landing buffer to the peer's writes for a grant (its rkey may
  // change), or closes it once the grant is used, before it is lent to the
  // reader: the peer can write exactly the buffers it holds a grant for.
  // False: the device refused, and the connection is failed.
  bool OpenGrantLocked(PinnedBuffer* b, Deferred* d);
  bool CloseGrantLocked(PinnedBuffer* b, Deferred* d);
  void IssueGrantsLocked(Deferred* d);
  // Grants out and unwritten: the deadline set (renew: moved on, after a
  // chunk landed), or cleared when none are out.
  void SetGrantDeadlineLocked(bool renew);
  void DeliverLocked(Deferred* d);
  void Violation(const char* what, Deferred* d);

  // Shared: a connection (and chunks it lent) may outlive the Engine.
  const std::shared_ptr<EngineImpl> engine_;
  const bool passive_;
  mutable std::mutex mu_;
  std::atomic<bool> poll_pending_{false};  // LeavePending
  // Owners, in the order rdma-core needs them torn down in reverse.
  CmId id_;
  // Shared with the pools' registrars: lent chunks may outlive us, and
  // their memory regions must go before the PD.
  std::shared_ptr<ibv_pd> pd_;
  // Implicit on-demand paging MR (TF_RDMA_ZERO_COPY, where the device has
  // it): large chunks go from the writer's own buffers. Empty otherwise.
  Mr odp_mr_;
  std::atomic<bool> zero_copy_sends_{false};  // odp_mr_ set (read without mu_)
  int max_send_sge_ = 1;
  CompChannel channel_;
  std::atomic<int> channel_fd_{-1};
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
  std::string device_;  // from set-up on
  JoinRequest joins_{};  // a client's: the TCP connection it joins (port 0: none)
  std::string joins_text_;  // "ip:port": a client's, or the peer's (its Hello)
  std::string join_token_;  // a server's: the token the peer's Hello carried
  // Writes are queued and the peer's credits (or our send slots) are out:
  // counted once per such wait in credit_waits.
  bool credit_blocked_ = false;
  absl::Status close_status_;
  uint32_t peer_acc_ = 0;
  uint32_t eager_limit_ = 0;  // largest eager write: peer_acc_, if we can stage it
  uint32_t max_inline_ = 0;   // the QP's inline limit: eager messages this small go inline
  int peer_standing_ = 0;     // standing grants the peer accepts (its Hello)
  int standing_target_ = 0;   // small standing grants to keep out (plan::StandingTarget)
  int standing_used_ = 0;     // small ones the peer used since the target last changed
  bool standing_withheld_ = false;  // the last top-up stopped short (budget, receives)
  bool peer_solicits_ = false;  // the peer's messages are all solicited
  bool armed_solicited_ = false;  // the CQ's last arm was solicited-only
  // ibv_req_notify_cq calls since an event was last taken: each raises at
  // most one event, so after one is taken another can be queued only if
  // the CQ was armed more than once in between.
  int arms_since_take_ = 0;
  uint32_t grant_limit_ = 0;  // our largest grant: both chunk sizes' minimum
  Flow flow_;
  std::vector<PinnedBuffer*> recv_bufs_;
  absl::InlinedVector<uint32_t, 16> reposts_;  // receives to post again (RepostLocked)
  // Staging buffers of posted sends, in post order (wr_id, buffer): sends
  // complete in that order, so the one completing is at or near the front
  // (a deque, not a map: no allocation per send).
  std::deque<std::pair<uint64_t, PinnedBuffer*>> inflight_;
  // Inline data SENDs posted and not completed: no buffer to hold, but a
  // close waits for them as for the others (their wr_ids carry kInlineWr).
  int inline_inflight_ = 0;
  static constexpr uint64_t kInlineWr = 1ull << 62;
  static_assert((kInlineWr & kRecvBit) == 0, "a send's tag must not read as a receive");
  // Zero-copy chunks posted and not completed (their wr_ids carry kZeroCopyWr).
  static constexpr uint64_t kZeroCopyWr = 1ull << 61;
  std::unordered_map<uint64_t, std::shared_ptr<ZcWrite>> zc_inflight_;
  // Data reported written that may not have landed yet: a close waits for it.
  bool SendsInFlightLocked() const {
    return !inflight_.empty() || inline_inflight_ > 0 || !zc_inflight_.empty();
  }
  uint64_t next_wr_ = 1;
  RingQueue<WriteOp> writes_;
  std::deque<OutGrant> out_grants_;   // the peer's CTS for writes_.front()
  size_t out_next_offset_ = 0;  // next grant offset expected for writes_.front()
  std::deque<OutGrant> standing_in_;  // the peer's standing grants for us
  // Inbound announced transfer.
  bool in_active_ = false;
  uint64_t in_total_ = 0, in_received_ = 0, in_granted_ = 0;
  std::map<uint32_t, Landing> landings_;
  int standing_out_ = 0;  // our standing grants not yet used
  int large_out_ = 0;     // of them, large ones
  // The size of the large standing grants to make (0: none yet), once
  // the peer announced a message one could hold (plan::LargeStandingBytes).
  uint32_t large_standing_len_ = 0;
  uint32_t next_grant_ = 1;
  bool waiting_budget_ = false;
  std::atomic<bool> budget_woken_{false};  // set by the budget's wake-up
  // Reader side.
  RingQueue<RecvChunk> ready_;
  ReadDone pending_read_;
  bool peer_closed_ = false;
  bool closed_by_flush_ = false;  // a flushed completion closed it
  // For Describe: what its owner did with it (calls of Read, Write and
  // Shutdown, and when it last read).
  uint64_t reads_called_ = 0, writes_called_ = 0, shutdowns_called_ = 0;
  uint64_t last_read_us_ = 0;
  ConnectionStats stats_;
  size_t largest_moved_ = 0;  // the largest message or chunk since LargeMessagesMoved
};

}  // namespace grpc_rdma

#endif  // GRPC_RDMA_SRC_ENGINE_CONNECTION_H_
