// One connection's state: set-up, the peer's Hello, the CQ (arming, events,
// completions), the application's calls, and closing. The send and receive
// paths are in sender.cc and receiver.cc.
#include "engine/connection.h"

#include <arpa/inet.h>
#include <poll.h>

#include <algorithm>
#include <cstring>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "engine/engine_impl.h"
#include "engine/plan.h"
#include "verbs/log.h"
#include "verbs/status.h"

namespace grpc_rdma {
namespace {

// Sends up to the QP's inline limit carry their bytes in the work request
// (control messages always; small eager messages too): no registered
// buffer to hold until the completion, and on an HCA no DMA read of one.
// 256 where the device takes it (softverbs' limit; mlx5 takes more), else
// the 64 every device offers.
constexpr int kInline = 64;
constexpr int kWantInline = 256;

absl::Status Closed(absl::string_view why) { return absl::UnavailableError(why); }

}  // namespace

// ---------------------------------------------------------------- set-up ---

ConnImpl::ConnImpl(std::shared_ptr<EngineImpl> engine, CmId id, bool passive)
    : engine_(std::move(engine)), passive_(passive), id_(std::move(id)) {}

ConnImpl::~ConnImpl() {
  if (waiting_budget_) engine_->buffer_waiters.fetch_sub(1);
  // The QP goes before the buffers it may still point at, and the CQ's
  // events are all acked as they are taken (TakeEventsLocked).
  qp_.reset();
  for (PinnedBuffer* b : recv_bufs_)
    if (b) local_pool_->Put(b);
  for (auto& [wr, b] : inflight_) local_pool_->Put(b);
  for (auto& [g, l] : landings_) remote_pool_->Put(l.buf);
  // Zero-copy writes whose chunks never completed: with the QP gone the
  // device reads their buffers no more, and their writers may have them.
  std::vector<WriteDone> unfinished;
  for (auto& [wr, z] : zc_inflight_) {
    if (z->finished && z->done) unfinished.push_back(std::move(z->done));
    z->done = nullptr;
  }
  zc_inflight_.clear();
  for (WriteDone& cb : unfinished) cb(Closed("connection destroyed"));
}

static_assert(sizeof(wire::Hello::join_token) == kJoinTokenBytes, "one token size");

wire::Hello ConnImpl::MyHello() const {
  wire::Hello h{};
  h.magic = wire::kMagic;
  h.version = wire::kVersion;
  h.eager_depth = static_cast<uint16_t>(engine_->options.eager_depth);
  h.acc_size = static_cast<uint32_t>(engine_->options.acc_size);
  h.standing_grants = plan::kStandingGrants;
  h.flags = wire::kHelloSolicited;
  h.max_chunk = static_cast<uint32_t>(engine_->options.chunk_size);
  if (joins_.tcp.sin_port != 0) {
    h.flags |= wire::kHelloJoins;
    h.joins_addr = joins_.tcp.sin_addr.s_addr;
    h.joins_port = joins_.tcp.sin_port;
    memcpy(h.join_token, joins_.token, sizeof(h.join_token));
  }
  return h;
}

namespace {
std::string AddrText(uint32_t addr_be, uint16_t port_be) {
  char ip[INET_ADDRSTRLEN] = "?";
  in_addr a{};
  a.s_addr = addr_be;
  inet_ntop(AF_INET, &a, ip, sizeof(ip));
  return absl::StrCat(ip, ":", ntohs(port_be));
}
}  // namespace

void ConnImpl::SetJoinsLocked(const JoinRequest& joins) {
  joins_ = joins;
  joins_text_ = AddrText(joins.tcp.sin_addr.s_addr, joins.tcp.sin_port);
}

absl::Status ConnImpl::SetupLocked() {
  const Options& o = engine_->options;
  ibv_context* ctx = id_->verbs;
  if (ctx == nullptr) return absl::UnavailableError("RDMA CM bound no device to the connection");
  if (const char* name = ibv_get_device_name(ctx->device)) device_ = name;
  // A PD of its own: the peer can reach nothing another connection owns.
  ASSIGN_OR_RETURN(Pd pd, AllocPd(ctx));
  pd_ = std::shared_ptr<ibv_pd>(pd.release(), internal::ReleasePd);
  ASSIGN_OR_RETURN(channel_, CreateCompChannel(ctx));
  int cqe = 2 * o.eager_depth + 2 * o.chunks_in_flight + 64;
  // Zero-copy sends (TF_RDMA_ZERO_COPY) where the device reads any of our
  // memory: an implicit on-demand paging MR, and a few SGEs per WRITE to
  // gather a chunk from the writer's slices.
  const bool zero_copy = o.zero_copy && ImplicitOdpWrites(ctx);
  ASSIGN_OR_RETURN(cq_, CreateCq(ctx, cqe, this, channel_.get()));
  local_pool_ = std::make_unique<BufferPool>(
      &engine_->budget, MakeVerbsRegistrar(pd_, IBV_ACCESS_LOCAL_WRITE),
      std::max<size_t>(o.acc_size + wire::kHeaderBytes, o.chunk_size));
  // Landing buffers are open to the peer's writes only while granted
  // (OpenGrantLocked), never while lent to the reader.
  remote_pool_ = std::make_shared<BufferPool>(
      &engine_->budget, MakeVerbsRegistrar(pd_, IBV_ACCESS_LOCAL_WRITE), o.chunk_size);
  ibv_qp_init_attr a{};
  a.send_cq = a.recv_cq = cq_.get();
  a.cap.max_send_wr = o.eager_depth + o.chunks_in_flight + 16;
  a.cap.max_recv_wr = o.eager_depth;
  a.cap.max_send_sge = a.cap.max_recv_sge = 1;
  if (zero_copy) a.cap.max_send_sge = kZeroCopySge;
  a.cap.max_inline_data = kWantInline;
  absl::StatusOr<Qp> qp = CreateQp(id_.get(), pd_.get(), a);
  if (!qp.ok()) {
    a.cap.max_inline_data = kInline;
    qp = CreateQp(id_.get(), pd_.get(), a);
  }
  if (!qp.ok() && zero_copy) {  // fewer SGEs than asked: no zero-copy then
    a.cap.max_send_sge = 1;
    qp = CreateQp(id_.get(), pd_.get(), a);
  }
  if (!qp.ok()) return qp.status();
  if (zero_copy && a.cap.max_send_sge > 1) {
    absl::StatusOr<Mr> mr = RegImplicitOdp(pd_.get());
    if (mr.ok()) {
      odp_mr_ = std::move(*mr);
      zero_copy_sends_.store(true, std::memory_order_relaxed);
      max_send_sge_ = static_cast<int>(std::min<uint32_t>(a.cap.max_send_sge, kZeroCopySge));
    }
  }
  qp_ = std::move(*qp);
  max_inline_ = a.cap.max_inline_data;
  flow_.SetSendSlots(static_cast<int>(a.cap.max_send_wr));
  recv_bufs_.assign(o.eager_depth, nullptr);
  for (int i = 0; i < o.eager_depth; ++i) {
    absl::StatusOr<PinnedBuffer*> b = local_pool_->Get(o.acc_size + wire::kHeaderBytes);
    if (!b.ok()) return b.status();
    if (*b == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "registered memory is used up (", engine_->budget.cap(),
          " bytes: TF_RDMA_BUF_SIZE, or less if the locked-memory limit is lower): no room for "
          "a new connection's receive buffers"));
    }
    recv_bufs_[i] = *b;
    uint32_t index = static_cast<uint32_t>(i);
    if (!PostRecvsLocked(&index, 1)) return absl::InternalError("ibv_post_recv failed at set-up");
  }
  ArmCqLocked();
  channel_fd_.store(channel_->fd, std::memory_order_release);
  return absl::OkStatus();
}

void ConnImpl::SetPeerLocked(const wire::Hello& h) {
  const Options& o = engine_->options;
  peer_acc_ = h.acc_size;
  // What we send eagerly must also fit our own staging buffers (the
  // peer's TF_RDMA_ACC_SIZE may be larger than both our sizes): anything
  // above goes by rendezvous.
  eager_limit_ = plan::EagerLimit(
      peer_acc_,
      BufferPool::ClassFor(std::max<size_t>(o.acc_size + wire::kHeaderBytes, o.chunk_size)),
      wire::kHeaderBytes);
  peer_standing_ = plan::PeerStandingGrants(h.standing_grants);
  standing_target_ = std::min(plan::kStandingStart,
                              peer_standing_ - plan::LargeStandingSlots(peer_standing_));
  peer_solicits_ = (h.flags & wire::kHelloSolicited) != 0;
  if (passive_ && (h.flags & wire::kHelloJoins) != 0 && h.joins_port != 0) {
    joins_text_ = AddrText(h.joins_addr, h.joins_port);
    // All zero: a client from before the token (its Hello was shorter).
    static const uint8_t kNone[sizeof(h.join_token)] = {};
    if (memcmp(h.join_token, kNone, sizeof(kNone)) != 0) {
      join_token_.assign(reinterpret_cast<const char*>(h.join_token), sizeof(h.join_token));
    }
  }
  flow_.Start(h.eager_depth, flow_.send_slots());
  // Our grants must fit the writer's staging buffers (its chunk size).
  grant_limit_ = plan::GrantLimit(o.chunk_size, h.max_chunk);
}

void ConnImpl::UpLocked() {
  state_ = State::kUp;
  auto addr = [](const sockaddr* sa) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(sa);
    char buf[INET_ADDRSTRLEN] = "?";
    inet_ntop(AF_INET, &in->sin_addr, buf, sizeof(buf));
    return absl::StrCat("rdma:", buf, ":", ntohs(in->sin_port));
  };
  peer_ = addr(rdma_get_peer_addr(id_.get()));
  local_ = addr(rdma_get_local_addr(id_.get()));
  IssueStandingGrantsLocked();  // before the peer's first mid-size message
}

// ------------------------------------------------------------------- CQ ---

// Every message to the peer is solicited (our Hello says so), so the
// peer's thread is woken for it. Our own send completions need to wake us
// only when something waits for them: queued writes (send slots, staging
// buffers, credits come back with them) or a disconnect waiting for the
// last sends to land.
// Otherwise the CQ is armed for solicited completions only, and a send
// completion waits for the next look at the CQ (on an HCA that costs
// nothing; over softverbs the acknowledgement then rings no doorbell: one
// thread wake-up less per message).
bool ConnImpl::SendsAwaitedLocked() const {
  // A zero-copy write's writer waits for its chunks' completions.
  return !writes_.empty() || disconnect_when_drained_ || waiting_budget_ ||
         state_ != State::kUp || !zc_inflight_.empty();
}

void ConnImpl::ArmCqLocked() {
  if (!cq_) return;
  // A peer from before solicited messages (its Hello says so) must wake us
  // with every message.
  armed_solicited_ = !SendsAwaitedLocked() && peer_solicits_;
  ibv_req_notify_cq(cq_.get(), armed_solicited_ ? 1 : 0);
  if (arms_since_take_ < 2) ++arms_since_take_;  // "more than once" is all it tells
}

unsigned ConnImpl::TakeEventsLocked() {
  if (!channel_ || !cq_) return 0;
  ibv_cq* cq;
  void* ctx;
  // The channel is non-blocking: a get that finds nothing says EAGAIN. No
  // poll first: this runs when the channel said it was readable, and a
  // poll per event and one more to find none were two of the dozen system
  // calls of a 64 B gRPC call over softverbs.
  if (ibv_get_cq_event(channel_.get(), &cq, &ctx) != 0) return 0;
  unsigned n = 1;
  if (arms_since_take_ > 1) {  // armed again after an event: there may be more
    pollfd p{channel_->fd, POLLIN, 0};
    while (poll(&p, 1, 0) == 1 && ibv_get_cq_event(channel_.get(), &cq, &ctx) == 0) ++n;
  }
  arms_since_take_ = 0;
  ibv_ack_cq_events(cq_.get(), n);  // at once: destroying the CQ waits for it
  return n;
}

void ConnImpl::RearmIfSendsAwaitedLocked(Deferred* d) {
  if (!armed_solicited_ || !SendsAwaitedLocked()) return;
  ArmCqLocked();
  HandleCqLocked(d);  // what completed before the arm raises no event
}

int ConnImpl::HandleCqLocked(Deferred* d) {
  if (!cq_) return 0;
  ibv_wc wc[16];
  int seen = 0;
  for (;;) {
    int n = ibv_poll_cq(cq_.get(), 16, wc);
    if (n <= 0) break;
    seen += n;
    for (int i = 0; i < n; ++i) {
      const bool send = !(wc[i].wr_id & kRecvBit);
      if (send) flow_.SendCompleted();  // every send is signalled
      if (wc[i].status != IBV_WC_SUCCESS) {
        if (send) ReleaseInflightLocked(wc[i].wr_id, false, d);
        // Any error while open, a flush included, means the QP is dead
        // (the peer died, or broke a rule and the HCA stopped the QP).
        if (state_ != State::kClosed) {
          // A flush is what a QP that went to error does with the rest of
          // its work (the peer closed or died): the close says so, the log
          // need not. Any other error is news.
          if (wc[i].status != IBV_WC_WR_FLUSH_ERR) {
            GRPC_RDMA_LOG_ERROR("connection %s: %s; closing it", peer_.c_str(),
                                ibv_wc_status_str(wc[i].status));
          }
          absl::Status why = absl::UnavailableError(
              absl::StrCat("RDMA completion error: ", ibv_wc_status_str(wc[i].status)));
          if (wc[i].status != IBV_WC_WR_FLUSH_ERR) {
            FailLocked(why, d);
          } else {
            closed_by_flush_ = true;
            CloseLocked(why, d, true);
          }
        }
        continue;
      }
      if (state_ == State::kClosed) {
        if (send) ReleaseInflightLocked(wc[i].wr_id, true, d);
        continue;
      }
      if (wc[i].opcode == IBV_WC_RECV) {
        OnRecvLocked(wc[i], d);
      } else if (wc[i].opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
        OnChunkLocked(wc[i], d);
      } else {
        ReleaseInflightLocked(wc[i].wr_id, true, d);
      }
    }
    PostRepostsLocked(d);  // this batch's receives, back to the device together
  }
  if (disconnect_when_drained_ && !SendsInFlightLocked()) DisconnectNowLocked();
  DeliverLocked(d);
  PumpLocked(d);
  return seen;
}

// ----------------------------------------------------------- application ---

void ConnImpl::Write(absl::Span<const iovec> data, WriteDone done) {
  Write(data, std::move(done), nullptr);
}

void ConnImpl::Write(absl::Span<const iovec> data, WriteDone done,
                     std::shared_ptr<const void> keep) {
  Deferred d;
  {
    std::lock_guard<std::mutex> g(mu_);
    ++writes_called_;
    if (state_ == State::kClosed) {
      d.Done(std::move(done), close_status_);
      LetGo(std::move(keep), &d);
    } else {
      WriteOp op;
      for (const iovec& v : data) op.total += v.iov_len;
      op.iov.assign(data.begin(), data.end());
      op.done = std::move(done);
      op.keep = std::move(keep);
      if (op.total == 0) {
        d.Done(std::move(op.done), absl::OkStatus());
        LetGo(std::move(op.keep), &d);
      } else {
        writes_.push_back(std::move(op));
        if (state_ == State::kUp) PumpLocked(&d);
        // A write left waiting (send slots, credits, pinned memory) needs
        // our send completions to wake the engine.
        RearmIfSendsAwaitedLocked(&d);
      }
    }
  }
  d.Run();
  DrainPending();
}

void ConnImpl::Read(ReadDone done) {
  Deferred d;
  {
    std::lock_guard<std::mutex> g(mu_);
    ++reads_called_;
    last_read_us_ = NowMicros();
    if (pending_read_) {
      // One read at a time: the pending one stays, and is still called.
      d.Deliver(std::move(done), absl::FailedPreconditionError(
                                     "Read called while another read is pending"));
    } else {
      pending_read_ = std::move(done);
      DeliverLocked(&d);
    }
  }
  d.Run();
  DrainPending();
}

void ConnImpl::Shutdown(absl::Status why) {
  Deferred d;
  {
    std::lock_guard<std::mutex> g(mu_);
    ++shutdowns_called_;
    CloseLocked(why.ok() ? Closed("connection shut down") : why, &d, true);
    RearmIfSendsAwaitedLocked(&d);  // a disconnect may wait for our sends
    // Later reads fail: what arrived and was not read goes (its buffers
    // back to the pool, outside the lock).
    auto unread = std::make_shared<RingQueue<RecvChunk>>(std::move(ready_));
    d.push_back([unread] {});
  }
  d.Run();
  DrainPending();
  engine_->Wake();
}

bool ConnImpl::PollNow() { return Poll(/*take_events=*/true, /*arm=*/true); }

bool ConnImpl::LargeMessagesMoved() {
  std::lock_guard<std::mutex> g(mu_);
  const bool moved = largest_moved_ >= kLargeMessage;
  largest_moved_ = 0;
  return moved;
}

bool ConnImpl::Poll(bool take_events, bool arm) {
  engine_->NoteHostPoll();
  Deferred d;
  int seen = 0;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!channel_ || !cq_) return false;
    // Every event queued (gRPC's poller reports the descriptor only on an
    // edge).
    if (take_events) TakeEventsLocked();
    seen = HandleCqLocked(&d);
    if (arm) {
      // The host goes back to waiting on the descriptor: arm, then look
      // once more (what completed before the arm raises no event).
      ArmCqLocked();
      seen += HandleCqLocked(&d);
    }
  }
  // Left unarmed, its completions raise no event: a poller waiting with no
  // timeout (it armed every CQ before, and has not seen this poll) must
  // wake and look every kBackupUs, in case the host stops looking.
  // (NoteHostPoll above, then this load; the poller does the two the other
  // way round: one of them sees the other.)
  if (!arm && engine_->waiting_for_good_.load(std::memory_order_seq_cst)) engine_->Wake();
  bool did = seen > 0 || !d.empty();
  d.Run();
  // What a poller left pending meanwhile counts too: its callbacks ran
  // here, and the caller (a gRPC poller about to block) must know.
  did |= DrainPending();
  if (did) engine_->host_polls.fetch_add(1, std::memory_order_relaxed);
  return did;
}

bool ConnImpl::LeavePending() {
  poll_pending_.store(true);
  return DrainPending();  // the holder may have let go in between
}

bool ConnImpl::DrainPending() {
  bool did = false;
  while (poll_pending_.load()) {
    std::unique_lock<std::mutex> l(mu_, std::try_to_lock);
    if (!l.owns_lock()) return did;  // its holder drains after letting go
    if (!poll_pending_.exchange(false)) return did;
    Deferred d;
    if (channel_ && cq_) {
      TakeEventsLocked();
      int seen = HandleCqLocked(&d);
      ArmCqLocked();
      seen += HandleCqLocked(&d);
      did |= seen > 0;
    }
    l.unlock();
    did |= !d.empty();
    d.Run();
  }
  return did;
}

void ConnImpl::SetHostPolled(bool on) {
  std::lock_guard<std::mutex> g(engine_->mu);
  host_polled = on;
  engine_->WatchLocked(this);
}

std::string ConnImpl::peer() const {
  std::lock_guard<std::mutex> g(mu_);
  return peer_;
}

std::string ConnImpl::local() const {
  std::lock_guard<std::mutex> g(mu_);
  return local_;
}

std::string ConnImpl::device() const {
  std::lock_guard<std::mutex> g(mu_);
  return device_;
}

std::string ConnImpl::joins() const {
  std::lock_guard<std::mutex> g(mu_);
  return passive_ ? joins_text_ : std::string();
}

std::string ConnImpl::join_token() const {
  std::lock_guard<std::mutex> g(mu_);
  return passive_ ? join_token_ : std::string();
}

ConnectionStats ConnImpl::stats() const {
  std::lock_guard<std::mutex> g(mu_);
  return stats_;
}

std::string ConnImpl::Describe() const {
  std::lock_guard<std::mutex> g(mu_);
  std::string s = absl::StrCat(passive_ ? "server" : "client", " ", peer_, " ", device_, " ");
  switch (state_) {
    case State::kSetup: absl::StrAppend(&s, "setting up"); break;
    case State::kUp: absl::StrAppend(&s, "up"); break;
    case State::kClosed:
      absl::StrAppend(&s, "closed (", close_status_.message(),
                      closed_by_flush_ ? ", by a flush" : "", ")");
      break;
  }
  absl::StrAppend(&s, peer_closed_ ? ", peer closed" : "",
                  pending_read_ ? ", a read waiting" : "", ", ", ready_.size(),
                  " chunks unread, ", writes_.size(), " writes queued");
  if (!writes_.empty()) {
    const WriteOp& w = writes_.front();
    absl::StrAppend(&s, " (first: ", w.copied, " of ", w.total, " bytes",
                    w.rts_sent ? ", announced" : "", ")");
  }
  absl::StrAppend(&s, ", ",
                  inflight_.size() + static_cast<size_t>(inline_inflight_) + zc_inflight_.size(),
                  " sends in flight", disconnect_when_drained_ ? " (disconnect after them)" : "",
                  ", ", out_grants_.size(), " grants to write, ", landings_.size(),
                  " grants out", in_active_ ? absl::StrCat(" (receiving ", in_received_, " of ",
                                                          in_total_, " bytes)")
                                            : std::string(),
                  ", ", stats_.bytes_sent, " bytes sent, ", stats_.bytes_received, " received; ",
                  "its owner called Read ", reads_called_, " times (last ",
                  last_read_us_ != 0 ? absl::StrCat((NowMicros() - last_read_us_) / 1000, " ms ago")
                                     : std::string("never"),
                  "), Write ", writes_called_, " times, Shutdown ", shutdowns_called_, " times");
  return s;
}

// ----------------------------------------------------------------- close ---

void ConnImpl::SettleZeroCopyLocked(Deferred* d) {
  if (zc_inflight_.empty()) return;
  HandleCqLocked(d);
  if (zc_inflight_.empty()) return;
  qp_.reset();
  if (id_) id_->qp = nullptr;  // gone: RDMA CM must not touch it
  for (auto& [wr, z] : zc_inflight_) {
    LetGo(std::move(z->keep), d);
    if (!z->finished || !z->done) continue;
    d->Done(std::move(z->done), z->status.ok() ? close_status_ : z->status);
    z->done = nullptr;  // taken: a moved-from function need not be empty
  }
  zc_inflight_.clear();
}

void ConnImpl::DisconnectNowLocked() {
  if (!disconnect_when_drained_) return;
  disconnect_when_drained_ = false;
  drain_deadline_us.store(0);
  if (id_) rdma_disconnect(id_.get());  // the QP goes to error: what is left flushes
}

void ConnImpl::FailLocked(absl::Status why, Deferred* d) {
  if (state_ == State::kClosed) return;
  stats_.connection_errors = 1;
  engine_->connection_errors.fetch_add(1);
  CloseLocked(std::move(why), d, true);
}

void ConnImpl::DeviceRemovedLocked(absl::Status why, Deferred* d) {
  if (state_ == State::kClosed && closed_by_flush_ && stats_.connection_errors == 0) {
    stats_.connection_errors = 1;
    engine_->connection_errors.fetch_add(1);
    return;
  }
  FailLocked(std::move(why), d);
}

void ConnImpl::CloseLocked(absl::Status why, Deferred* d, bool disconnect) {
  if (state_ == State::kClosed) return;
  bool was_up = state_ == State::kUp;
  state_ = State::kClosed;
  grant_deadline_us.store(0);
  close_status_ = why.ok() ? Closed("connection closed") : why;
  for (WriteOp& op : writes_) {
    if (op.zc != nullptr && op.zc->pending > 0) {
      // Chunks of it are still read by the device from its buffers: done
      // when they complete (or flush), with this status.
      op.zc->done = std::move(op.done);
      op.zc->finished = true;
      op.zc->status = close_status_;
      op.zc->keep = std::move(op.keep);
      continue;
    }
    d->Done(std::move(op.done), close_status_);
    LetGo(std::move(op.keep), d);
  }
  writes_.clear();
  out_grants_.clear();
  DeliverLocked(d);
  // A server connection is connected from rdma_accept on, before it is up.
  if (disconnect && (was_up || accepted) && id_) {
    // Writes reported done are posted, not yet delivered: let them land
    // before the disconnect (every send is signalled, so each completes,
    // delivered or flushed, and HandleCqLocked disconnects then).
    if (was_up && SendsInFlightLocked()) {
      disconnect_when_drained_ = true;
      drain_deadline_us.store(NowMicros() + static_cast<uint64_t>(kDrainMs) * 1000);
    } else {
      rdma_disconnect(id_.get());
    }
  }
  if (connect_done) {
    Engine::ConnectDone cb = std::move(connect_done);
    connect_done = nullptr;
    absl::Status s = close_status_;
    d->push_back([cb, s] { cb(s); });
  }
}

}  // namespace grpc_rdma
