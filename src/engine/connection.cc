// The data path of one connection: eager coalescing under credits,
// rendezvous into granted buffers, the reader queue, and closing.
#include <arpa/inet.h>
#include <poll.h>
#include <string.h>

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "engine/engine_internal.h"
#include "verbs/status.h"

namespace grpc_rdma {
namespace {

constexpr uint64_t kRecvBit = 1ull << 63;
constexpr uint64_t kMaxTransfer = 1ull << 40;
// Standing grants (kPre): each side keeps up to this many landing buffers
// of up to kStandingBytes granted to its peer ahead of time, so a message
// above the eager limit and within them goes at once, in one RDMA WRITE,
// instead of paying the RTS/CTS round trip; still received without a copy.
// Eight, so a stream of mid-size messages (chttp2 writes one at a time,
// each done once copied) rarely finds them all in use before the receiver
// grants them again (64 KiB streaming: 440-530 MB/s with two, 510-960 with
// eight, same run); they take at most half of the peer's receives.
constexpr int kStandingGrants = 8;
constexpr uint32_t kStandingBytes = 512 * 1024;
constexpr int kInline = 64;  // control messages go inline: no buffer needed
// Announced transfers: pieces no smaller than this, and a tail of up to
// kTail granted beyond TF_RDMA_CHUNKS_IN_FLIGHT (see IssueGrantsLocked).
constexpr uint64_t kMinPiece = 256 << 10;
constexpr uint64_t kTail = 64 << 10;

absl::Status Closed(absl::string_view why) { return absl::UnavailableError(why); }

}  // namespace

// ------------------------------------------------------------- RecvChunk ---

RecvChunk::RecvChunk(RecvChunk&& o) noexcept { *this = std::move(o); }

RecvChunk& RecvChunk::operator=(RecvChunk&& o) noexcept {
  if (this == &o) return *this;
  if (release_) release_();
  owned_ = std::move(o.owned_);
  release_ = std::move(o.release_);
  o.release_ = nullptr;
  size_ = o.size_;
  data_ = release_ ? o.data_ : owned_.data();
  o.data_ = nullptr;
  o.size_ = 0;
  return *this;
}

RecvChunk::~RecvChunk() {
  if (release_) release_();
}

RecvChunk RecvChunk::Owned(std::string bytes) {
  RecvChunk c;
  c.owned_ = std::move(bytes);
  c.data_ = c.owned_.data();
  c.size_ = c.owned_.size();
  return c;
}

RecvChunk RecvChunk::Lent(const char* data, size_t size, std::function<void()> release) {
  RecvChunk c;
  c.data_ = data;
  c.size_ = size;
  c.release_ = std::move(release);
  return c;
}

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
}

wire::Hello ConnImpl::MyHello() const {
  wire::Hello h{};
  h.magic = wire::kMagic;
  h.version = wire::kVersion;
  h.eager_depth = static_cast<uint16_t>(engine_->options.eager_depth);
  h.acc_size = static_cast<uint32_t>(engine_->options.acc_size);
  h.standing_grants = kStandingGrants;
  h.flags = wire::kHelloSolicited;
  h.max_chunk = static_cast<uint32_t>(engine_->options.chunk_size);
  return h;
}

absl::Status ConnImpl::SetupLocked() {
  const Options& o = engine_->options;
  ibv_context* ctx = id_->verbs;
  if (ctx == nullptr) return absl::UnavailableError("RDMA CM bound no device to the connection");
  // A PD of its own: the peer can reach nothing another connection owns.
  ASSIGN_OR_RETURN(Pd pd, AllocPd(ctx));
  pd_ = std::shared_ptr<ibv_pd>(pd.release(), internal::ReleasePd);
  ASSIGN_OR_RETURN(channel_, CreateCompChannel(ctx));
  int cqe = 2 * o.eager_depth + 2 * o.chunks_in_flight + 64;
  ASSIGN_OR_RETURN(cq_, CreateCq(ctx, cqe, this, channel_.get()));
  local_pool_ = std::make_unique<BufferPool>(
      &engine_->budget, MakeVerbsRegistrar(pd_, IBV_ACCESS_LOCAL_WRITE),
      std::max<size_t>(o.acc_size + wire::kHeaderBytes, o.chunk_size));
  remote_pool_ = std::make_shared<BufferPool>(
      &engine_->budget,
      MakeVerbsRegistrar(pd_, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE),
      o.chunk_size);
  ibv_qp_init_attr a{};
  a.send_cq = a.recv_cq = cq_.get();
  a.cap.max_send_wr = o.eager_depth + o.chunks_in_flight + 16;
  a.cap.max_recv_wr = o.eager_depth;
  a.cap.max_send_sge = a.cap.max_recv_sge = 1;
  a.cap.max_inline_data = kInline;
  ASSIGN_OR_RETURN(qp_, CreateQp(id_.get(), pd_.get(), a));
  sq_free_ = static_cast<int>(a.cap.max_send_wr);
  recv_bufs_.assign(o.eager_depth, nullptr);
  for (int i = 0; i < o.eager_depth; ++i) {
    absl::StatusOr<PinnedBuffer*> b = local_pool_->Get(o.acc_size + wire::kHeaderBytes);
    if (!b.ok()) return b.status();
    if (*b == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "TF_RDMA_BUF_SIZE (", engine_->budget.cap(), " bytes) is used up: no room for a new "
          "connection's receive buffers"));
    }
    recv_bufs_[i] = *b;
    if (!PostRecvLocked(i)) return absl::InternalError("ibv_post_recv failed at set-up");
  }
  ArmCqLocked();
  return absl::OkStatus();
}

void ConnImpl::SetPeerLocked(const wire::Hello& h) {
  peer_acc_ = h.acc_size;
  // What we send eagerly must also fit our own staging buffers (the
  // peer's TF_RDMA_ACC_SIZE may be larger than both our sizes): anything
  // above goes by rendezvous.
  const Options& o = engine_->options;
  size_t own =
      BufferPool::ClassFor(std::max<size_t>(o.acc_size + wire::kHeaderBytes, o.chunk_size));
  eager_limit_ = static_cast<uint32_t>(std::min<size_t>(peer_acc_, own - wire::kHeaderBytes));
  peer_standing_ = std::min<int>(kStandingGrants, h.standing_grants == 0 ? 2 : h.standing_grants);
  peer_solicits_ = (h.flags & wire::kHelloSolicited) != 0;
  peer_depth_ = h.eager_depth;
  peer_credits_ = h.eager_depth;
  // Our grants must fit the writer's staging buffers (its chunk size).
  grant_limit_ = static_cast<uint32_t>(engine_->options.chunk_size);
  if (h.max_chunk != 0) grant_limit_ = std::min(grant_limit_, h.max_chunk);
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

bool ConnImpl::PostRecvLocked(size_t index) {
  PinnedBuffer* b = recv_bufs_[index];
  ibv_sge sge{reinterpret_cast<uint64_t>(b->data), static_cast<uint32_t>(b->size), b->reg.lkey};
  ibv_recv_wr wr{}, *bad = nullptr;
  wr.wr_id = kRecvBit | index;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  return ibv_post_recv(qp_.get(), &wr, &bad) == 0;
}

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
  return !writes_.empty() || disconnect_when_drained_ || waiting_budget_ || state_ != State::kUp;
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

// ----------------------------------------------------------- application ---

void ConnImpl::Write(std::vector<iovec> data, WriteDone done) {
  Deferred d;
  {
    std::lock_guard<std::mutex> g(engine_->mu);
    if (state_ == State::kClosed) {
      absl::Status s = close_status_;
      d.push_back([done, s] { done(s); });
    } else {
      WriteOp op;
      for (const iovec& v : data) op.total += v.iov_len;
      op.iov = std::move(data);
      op.done = std::move(done);
      if (op.total == 0) {
        WriteDone cb = std::move(op.done);
        d.push_back([cb] { cb(absl::OkStatus()); });
      } else {
        writes_.push_back(std::move(op));
        if (state_ == State::kUp) PumpLocked(&d);
        // A write left waiting (send slots, credits, pinned memory) needs
        // our send completions to wake the engine.
        RearmIfSendsAwaitedLocked(&d);
      }
    }
  }
  for (auto& f : d) f();
}

void ConnImpl::Read(ReadDone done) {
  Deferred d;
  {
    std::lock_guard<std::mutex> g(engine_->mu);
    pending_read_ = std::move(done);
    DeliverLocked(&d);
  }
  for (auto& f : d) f();
}

void ConnImpl::Shutdown(absl::Status why) {
  Deferred d;
  {
    std::lock_guard<std::mutex> g(engine_->mu);
    CloseLocked(why.ok() ? Closed("connection shut down") : why, &d, true);
    RearmIfSendsAwaitedLocked(&d);  // a disconnect may wait for our sends
    // Later reads fail: what arrived and was not read goes (its buffers
    // back to the pool, outside the lock).
    auto unread = std::make_shared<std::deque<RecvChunk>>(std::move(ready_));
    ready_.clear();
    d.push_back([unread] {});
  }
  for (auto& f : d) f();
  engine_->Wake();
}

bool ConnImpl::PollNow() {
  engine_->NoteHostPoll();
  Deferred d;
  int seen = 0;
  {
    std::lock_guard<std::mutex> g(engine_->mu);
    if (!channel_ || !cq_) return false;
    // Every event queued (gRPC's poller reports the descriptor only on an
    // edge).
    TakeEventsLocked();
    seen = HandleCqLocked(&d);
    // The host goes back to waiting on the descriptor: arm, then look once
    // more (what completed before the arm raises no event).
    ArmCqLocked();
    seen += HandleCqLocked(&d);
  }
  bool did = seen > 0 || !d.empty();
  for (auto& f : d) f();
  if (did) engine_->host_polls.fetch_add(1, std::memory_order_relaxed);
  return did;
}

void ConnImpl::SetHostPolled(bool on) {
  std::lock_guard<std::mutex> g(engine_->mu);
  host_polled = on;
  engine_->WatchLocked(this);
}

ConnectionStats ConnImpl::stats() const {
  std::lock_guard<std::mutex> g(engine_->mu);
  return stats_;
}

void ConnImpl::DeliverLocked(Deferred* d) {
  if (!pending_read_) return;
  if (!ready_.empty()) {
    std::vector<RecvChunk> out;
    while (!ready_.empty()) {
      out.push_back(std::move(ready_.front()));
      ready_.pop_front();
    }
    ReadDone cb = std::move(pending_read_);
    pending_read_ = nullptr;
    auto shared = std::make_shared<std::vector<RecvChunk>>(std::move(out));
    d->push_back([cb, shared] { cb(std::move(*shared)); });
    return;
  }
  if (state_ == State::kClosed || peer_closed_) {
    absl::Status s = state_ == State::kClosed ? close_status_ : Closed("closed by the peer");
    ReadDone cb = std::move(pending_read_);
    pending_read_ = nullptr;
    d->push_back([cb, s] { cb(s); });
  }
}

// ------------------------------------------------------------- send path ---

uint16_t ConnImpl::TakeCreditsLocked() {
  uint16_t c = static_cast<uint16_t>(credits_to_return_);
  credits_to_return_ = 0;
  return c;
}

bool ConnImpl::SendControlLocked(wire::Header h) {
  if (sq_free_ <= 0) return false;
  h.version = static_cast<uint8_t>(wire::kVersion);
  h.credits = static_cast<uint16_t>(credits_to_return_);
  ibv_sge sge{reinterpret_cast<uint64_t>(&h), sizeof(h), 0};
  ibv_send_wr wr{}, *bad = nullptr;
  wr.wr_id = next_wr_++;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_INLINE | IBV_SEND_SIGNALED | IBV_SEND_SOLICITED;
  if (ibv_post_send(qp_.get(), &wr, &bad) != 0) return false;
  credits_to_return_ = 0;  // only once they are on their way
  --peer_credits_;
  --sq_free_;
  return true;
}

void ConnImpl::CopyOut(WriteOp& op, size_t offset, char* to, size_t len) {
  for (const iovec& v : op.iov) {
    if (len == 0) break;
    if (offset >= v.iov_len) {
      offset -= v.iov_len;
      continue;
    }
    size_t n = std::min(len, v.iov_len - offset);
    memcpy(to, static_cast<char*>(v.iov_base) + offset, n);
    to += n;
    len -= n;
    offset = 0;
  }
}

PinnedBuffer* ConnImpl::GetOrWaitLocked(BufferPool& pool, size_t size, Deferred* d) {
  absl::StatusOr<PinnedBuffer*> b = pool.Get(size);
  if (!b.ok()) {
    CloseLocked(b.status(), d, true);
    return nullptr;
  }
  if (*b == nullptr && !waiting_budget_) {
    // Backpressure: the poller runs this connection again when pinned
    // memory comes back. One waiter at a time, for the size Get reserves.
    waiting_budget_ = true;
    // Counted, then one more try: a buffer a reader gave back just before
    // the count went up (and so woke nobody) is found now.
    engine_->buffer_waiters.fetch_add(1);
    b = pool.Get(size);
    if (!b.ok() || *b != nullptr) {
      waiting_budget_ = false;
      engine_->buffer_waiters.fetch_sub(1);
      if (b.ok()) return *b;
      CloseLocked(b.status(), d, true);
      return nullptr;
    }
    engine_->budget.NotifyWhenAvailable(
        BufferPool::ClassFor(size), [w = std::weak_ptr<ConnImpl>(weak_from_this())] {
          if (auto c = w.lock()) {
            c->budget_woken_ = true;
            c->engine_->Wake();
          }
        });
  }
  return *b;
}

// Coalesces the small writes at the head of the queue into one SEND.
bool ConnImpl::SendEagerLocked(Deferred* d) {
  PinnedBuffer* buf = GetOrWaitLocked(*local_pool_, eager_limit_ + wire::kHeaderBytes, d);
  if (buf == nullptr) return false;
  char* p = buf->data + wire::kHeaderBytes;
  size_t len = 0;
  int ops = 0;
  while (!writes_.empty() && len < eager_limit_) {
    WriteOp& op = writes_.front();
    if (op.total > eager_limit_) break;  // a large write goes by rendezvous
    size_t n = std::min(op.total - op.copied, eager_limit_ - len);
    CopyOut(op, op.copied, p + len, n);
    op.copied += n;
    len += n;
    ++ops;
    if (op.copied < op.total) break;
    WriteDone cb = std::move(op.done);
    d->push_back([cb] { cb(absl::OkStatus()); });
    writes_.pop_front();
  }
  wire::Header h{};
  h.type = wire::kData;
  h.version = static_cast<uint8_t>(wire::kVersion);
  h.len = static_cast<uint32_t>(len);
  h.credits = TakeCreditsLocked();
  memcpy(buf->data, &h, sizeof(h));
  ibv_sge sge{reinterpret_cast<uint64_t>(buf->data), static_cast<uint32_t>(len + sizeof(h)),
              buf->reg.lkey};
  ibv_send_wr wr{}, *bad = nullptr;
  wr.wr_id = next_wr_++;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_SOLICITED;
  if (ibv_post_send(qp_.get(), &wr, &bad) != 0) {
    local_pool_->Put(buf);
    CloseLocked(absl::InternalError("ibv_post_send failed"), d, true);
    return false;
  }
  inflight_[wr.wr_id] = buf;
  --peer_credits_;
  --sq_free_;
  stats_.bytes_sent += len;
  ++stats_.eager_messages;
  if (ops > 1) stats_.coalesced_writes += ops;
  return true;
}

// Posts `len` bytes of staging buffer `b` (taken: it goes back to the pool
// when the write completes, or now if the post fails) as an RDMA WRITE
// WITH IMMEDIATE into the peer's grant `g`. On failure the connection is
// closed.
bool ConnImpl::PostGrantedWriteLocked(PinnedBuffer* b, uint32_t len, const OutGrant& g,
                                      Deferred* d) {
  ibv_sge sge{reinterpret_cast<uint64_t>(b->data), len, b->reg.lkey};
  ibv_send_wr wr{}, *bad = nullptr;
  wr.wr_id = next_wr_++;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
  wr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_SOLICITED;
  wr.imm_data = htonl(g.grant);
  wr.wr.rdma.remote_addr = g.addr;
  wr.wr.rdma.rkey = g.rkey;
  if (ibv_post_send(qp_.get(), &wr, &bad) != 0) {
    local_pool_->Put(b);
    CloseLocked(absl::InternalError("ibv_post_send(RDMA_WRITE_WITH_IMM) failed"), d, true);
    return false;
  }
  inflight_[wr.wr_id] = b;
  --peer_credits_;
  --sq_free_;
  return true;
}

// Writes one granted chunk of the rendezvous at the head of the queue.
bool ConnImpl::WriteChunkLocked(Deferred* d) {
  OutGrant g = out_grants_.front();
  PinnedBuffer* b = GetOrWaitLocked(*local_pool_, g.len, d);
  if (b == nullptr) return false;
  out_grants_.pop_front();
  WriteOp& op = writes_.front();
  CopyOut(op, g.offset, b->data, g.len);
  if (!PostGrantedWriteLocked(b, g.len, g, d)) return false;
  op.copied += g.len;
  stats_.bytes_sent += g.len;
  if (op.copied == op.total) {
    WriteDone cb = std::move(op.done);
    d->push_back([cb] { cb(absl::OkStatus()); });
    writes_.pop_front();
    out_next_offset_ = 0;
  }
  return true;
}

// Writes the whole message at the head of the queue into the peer's
// oldest standing grant.
bool ConnImpl::WritePreGrantedLocked(Deferred* d) {
  WriteOp& op = writes_.front();
  OutGrant g = pre_grants_.front();
  PinnedBuffer* b = GetOrWaitLocked(*local_pool_, op.total, d);
  if (b == nullptr) return false;
  pre_grants_.pop_front();
  CopyOut(op, 0, b->data, op.total);
  if (!PostGrantedWriteLocked(b, static_cast<uint32_t>(op.total), g, d)) return false;
  op.copied = op.total;
  stats_.bytes_sent += op.total;
  ++stats_.rendezvous;
  ++stats_.pre_granted;
  WriteDone cb = std::move(op.done);
  d->push_back([cb] { cb(absl::OkStatus()); });
  writes_.pop_front();
  return true;
}

void ConnImpl::PumpLocked(Deferred* d) {
  if (budget_woken_.exchange(false) && waiting_budget_) {
    waiting_budget_ = false;
    engine_->buffer_waiters.fetch_sub(1);
  }
  // Credit rule: one of the peer's receives stays for credit updates, so
  // the two sides can never both wait for credits.
  for (;;) {
    if (state_ != State::kUp) return;
    IssueGrantsLocked(d);
    if (state_ != State::kUp) return;
    if (sq_free_ <= 0) break;  // completions will free slots and pump again
    if (!out_grants_.empty() && peer_credits_ >= 2) {
      if (!WriteChunkLocked(d)) break;
      continue;
    }
    if (writes_.empty() || peer_credits_ < 2) break;
    WriteOp& op = writes_.front();
    if (op.total > peer_acc_ && !op.rts_sent && op.copied == 0 && !pre_grants_.empty() &&
        op.total <= pre_grants_.front().len) {
      if (!WritePreGrantedLocked(d)) break;
      continue;
    }
    if (op.total > eager_limit_) {
      if (op.rts_sent) break;  // waiting for grants
      wire::Header h{};
      h.type = wire::kRts;
      h.a = op.total;
      if (!SendControlLocked(h)) {
        CloseLocked(absl::InternalError("ibv_post_send(RTS) failed"), d, true);
        return;
      }
      op.rts_sent = true;
      out_next_offset_ = 0;
      ++stats_.rendezvous;
      continue;
    }
    if (!SendEagerLocked(d)) break;
  }
  // Nothing to say but credits, and the peer may be waiting for them.
  if (state_ == State::kUp && peer_credits_ >= 1 &&
      credits_to_return_ >= std::max(2, engine_->options.eager_depth / 4)) {
    wire::Header h{};
    h.type = wire::kCredit;
    if (SendControlLocked(h)) ++stats_.credit_messages;
    else if (sq_free_ > 0) CloseLocked(absl::InternalError("ibv_post_send(CREDIT) failed"), d, true);
  }
}

// ----------------------------------------------------------- receive path ---

// Keeps kStandingGrants landing buffers granted to the peer ahead of time
// (only from memory the budget has to spare: never waits for it).
void ConnImpl::IssueStandingGrantsLocked() {
  const Options& o = engine_->options;
  uint32_t len = std::min(grant_limit_, kStandingBytes);
  if (len <= o.acc_size) return;  // every such message is eager anyway
  // The peer's receives are for data and for the grants of announced
  // transfers too: standing grants (held until used) take at most half.
  while (standing_out_ < peer_standing_ && peer_credits_ > std::max(2, peer_depth_ / 2) &&
         sq_free_ > 0) {
    // Held until the peer uses them: only from a budget three quarters
    // free, so standing grants (across all connections) can never take the
    // memory announced transfers need to make progress.
    if (engine_->budget.used() + len > engine_->budget.cap() / 4) return;
    absl::StatusOr<PinnedBuffer*> b = remote_pool_->Get(len);
    if (!b.ok() || *b == nullptr) return;
    uint32_t id = next_grant_++;
    wire::Header h{};
    h.type = wire::kPre;
    h.len = len;
    h.a = reinterpret_cast<uint64_t>((*b)->data);
    h.rkey = (*b)->reg.rkey;
    h.grant = id;
    if (!SendControlLocked(h)) {
      remote_pool_->Put(*b);
      return;
    }
    landings_[id] = Landing{*b, len, true};
    ++standing_out_;
  }
}

void ConnImpl::IssueGrantsLocked(Deferred* d) {
  const Options& o = engine_->options;
  // Standing grants are landings too, but outside TF_RDMA_CHUNKS_IN_FLIGHT:
  // counted in, they could take every slot and the transfer would wait for
  // ever (the peer writes an announced message only into its grants).
  // A transfer that TF_RDMA_CHUNKS_IN_FLIGHT chunks would cover is cut
  // into that many pieces (a power of two, at least kMinPiece, so they
  // share the pool's size classes): they move in parallel, and the reader
  // gets the first while the rest are still on their way (a 4 MiB unary
  // call with 4 MiB chunks: one 4 MiB piece before, four of 1 MiB now;
  // p50 18.1 -> 16.3 ms, 1 MiB 4.1 -> 3.7 ms, medians of six, same run).
  // gRPC's framing makes such messages a few bytes longer than the power
  // of two: that tail (at most kTail) is granted along with the full
  // pieces, one landing over the limit, rather than a round trip later.
  uint64_t piece = grant_limit_;
  const uint64_t cif = static_cast<uint64_t>(o.chunks_in_flight);
  if (cif > 1 && in_total_ <= cif * grant_limit_) {
    // The largest power of two (from kMinPiece) that cif pieces and a tail
    // cover; if they do not, the next one up (fewer than cif pieces).
    uint64_t p2 = kMinPiece;
    while (p2 * 2 * cif <= in_total_) p2 *= 2;
    if (p2 * cif + kTail < in_total_) p2 *= 2;
    piece = std::min<uint64_t>(grant_limit_, p2);
  }
  while (in_active_ && in_granted_ < in_total_ && peer_credits_ >= 2) {
    uint64_t left = in_total_ - in_granted_;
    int in_flight = static_cast<int>(landings_.size()) - standing_out_;
    if (in_flight > o.chunks_in_flight || (in_flight == o.chunks_in_flight && left > kTail)) break;
    uint32_t len = static_cast<uint32_t>(std::min<uint64_t>(piece, left));
    PinnedBuffer* buf = GetOrWaitLocked(*remote_pool_, len, d);
    if (buf == nullptr) return;  // granted again when pinned memory comes back
    uint32_t id = next_grant_++;
    wire::Header h{};
    h.type = wire::kCts;
    h.len = len;
    h.a = reinterpret_cast<uint64_t>(buf->data);
    h.rkey = buf->reg.rkey;
    h.grant = id;
    h.offset = in_granted_;
    if (!SendControlLocked(h)) {
      remote_pool_->Put(buf);
      if (sq_free_ > 0) CloseLocked(absl::InternalError("ibv_post_send(CTS) failed"), d, true);
      return;
    }
    landings_[id] = Landing{buf, len};
    in_granted_ += len;
  }
  // Also during an announced transfer: the peer uses a standing grant only
  // for a message after it (in order on the QP, so it lands after the
  // transfer's last chunk). Held back until the transfer ended, they were
  // all used up in a stream of mid-size messages, the next message was
  // announced again, and so on: 64 KiB streaming 672-783 -> 967-1146 MB/s
  // (same run), 71% -> 88% of messages into standing grants.
  if (state_ == State::kUp) IssueStandingGrantsLocked();
}

void ConnImpl::Violation(const char* what, Deferred* d) {
  fprintf(stderr, "grpc_rdma: connection %s: the peer broke the protocol (%s); closing it\n",
          peer_.c_str(), what);
  CloseLocked(absl::UnavailableError(absl::StrCat("peer broke the protocol: ", what)), d, true);
}

void ConnImpl::OnRecvLocked(const ibv_wc& wc, Deferred* d) {
  size_t index = wc.wr_id & ~kRecvBit;
  if (index >= recv_bufs_.size()) return Violation("unknown receive", d);
  PinnedBuffer* b = recv_bufs_[index];
  if (wc.byte_len < wire::kHeaderBytes) return Violation("message shorter than a header", d);
  wire::Header h;
  memcpy(&h, b->data, sizeof(h));
  if (h.version != wire::kVersion) return Violation("unknown protocol version", d);
  if (h.credits > peer_depth_ || peer_credits_ + h.credits > peer_depth_)
    return Violation("more credits than receives posted", d);
  peer_credits_ += h.credits;
  switch (h.type) {
    case wire::kData:
      if (h.len == 0 || h.len != wc.byte_len - wire::kHeaderBytes ||
          h.len > engine_->options.acc_size)
        return Violation("bad data length", d);
      if (in_active_) return Violation("data in the middle of a rendezvous", d);
      ready_.push_back(RecvChunk::Owned(std::string(b->data + wire::kHeaderBytes, h.len)));
      stats_.bytes_received += h.len;
      break;
    case wire::kRts:
      if (in_active_ || h.a == 0 || h.a > kMaxTransfer) return Violation("bad rendezvous", d);
      in_active_ = true;
      in_total_ = h.a;
      in_received_ = in_granted_ = 0;
      break;
    case wire::kCts: {
      if (writes_.empty() || !writes_.front().rts_sent) return Violation("grant for nothing", d);
      const WriteOp& op = writes_.front();
      if (h.offset != out_next_offset_ || h.len == 0 || h.len > engine_->options.chunk_size ||
          h.offset + h.len > op.total)
        return Violation("grant out of order or out of bounds", d);
      out_grants_.push_back(OutGrant{h.offset, h.a, h.len, h.rkey, h.grant});
      out_next_offset_ += h.len;
      break;
    }
    case wire::kPre:
      if (h.len <= peer_acc_ || h.len > engine_->options.chunk_size ||
          pre_grants_.size() >= static_cast<size_t>(kStandingGrants))
        return Violation("bad standing grant", d);
      pre_grants_.push_back(OutGrant{0, h.a, h.len, h.rkey, h.grant});
      break;
    case wire::kCredit:
      break;
    case wire::kClose:
      peer_closed_ = true;
      break;
    default:
      return Violation("unknown message type", d);
  }
  if (!PostRecvLocked(index)) {
    CloseLocked(absl::InternalError("ibv_post_recv failed"), d, true);
    return;
  }
  ++credits_to_return_;
}

void ConnImpl::OnChunkLocked(const ibv_wc& wc, Deferred* d) {
  size_t index = wc.wr_id & ~kRecvBit;
  uint32_t grant = ntohl(wc.imm_data);
  auto it = landings_.find(grant);
  if (index >= recv_bufs_.size() || it == landings_.end())
    return Violation("chunk for no grant", d);
  Landing land = it->second;
  if (land.standing) {
    // One whole message, above the eager limit, within the grant, and not
    // in the middle of an announced transfer.
    if (wc.byte_len <= engine_->options.acc_size || wc.byte_len > land.len || in_active_)
      return Violation("bad write into a standing grant", d);
    land.len = wc.byte_len;
    --standing_out_;
  } else if (wc.byte_len != land.len) {
    return Violation("chunk of the wrong length", d);
  }
  landings_.erase(it);
  // Lend the buffer to the reader, unless pinned memory runs short: then
  // copy and give it back, so a reader that holds data (gRPC keeps a whole
  // message) can never starve the transfer of buffers.
  uint64_t used = engine_->budget.used(), cap = engine_->budget.cap();
  if (used > cap / 4 * 3) {
    ready_.push_back(RecvChunk::Owned(std::string(land.buf->data, land.len)));
    remote_pool_->Put(land.buf);
    ++stats_.chunks_copied;
  } else {
    PinnedBuffer* buf = land.buf;
    std::shared_ptr<BufferPool> pool = remote_pool_;
    std::shared_ptr<EngineImpl> eng = engine_;  // the pool's budget lives there
    // Back to the pool (thread-safe), and wake the poller if a connection
    // waits for pinned memory (a wake-up per chunk otherwise: the poller
    // thread ran once per mid-size gRPC call, a thread switch each).
    // Captures are destroyed in reverse order: `eng` is listed first so
    // the pool (whose destructor releases into the engine's budget) always
    // goes before the engine.
    ready_.push_back(RecvChunk::Lent(land.buf->data, land.len, [eng, pool, buf] {
      pool->Put(buf);
      if (eng->buffer_waiters.load() > 0) eng->Wake();
    }));
    ++stats_.chunks_zero_copy;
  }
  stats_.bytes_received += land.len;
  if (!land.standing) {
    in_received_ += land.len;
    if (in_received_ == in_total_) in_active_ = false;
  }
  if (!PostRecvLocked(index)) {
    CloseLocked(absl::InternalError("ibv_post_recv failed"), d, true);
    return;
  }
  ++credits_to_return_;
}

void ConnImpl::ReleaseInflightLocked(uint64_t wr_id) {
  auto it = inflight_.find(wr_id);
  if (it == inflight_.end()) return;
  local_pool_->Put(it->second);
  inflight_.erase(it);
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
      if (!(wc[i].wr_id & kRecvBit)) ++sq_free_;  // every send is signalled
      if (wc[i].status != IBV_WC_SUCCESS) {
        if (!(wc[i].wr_id & kRecvBit)) ReleaseInflightLocked(wc[i].wr_id);
        // Any error while open, a flush included, means the QP is dead
        // (the peer died, or broke a rule and the HCA stopped the QP).
        if (state_ != State::kClosed) {
          // A flush is what a QP that went to error does with the rest of
          // its work (the peer closed or died): the close says so, the log
          // need not. Any other error is news.
          if (wc[i].status != IBV_WC_WR_FLUSH_ERR) {
            fprintf(stderr, "grpc_rdma: connection %s: %s; closing it\n", peer_.c_str(),
                    ibv_wc_status_str(wc[i].status));
          }
          CloseLocked(absl::UnavailableError(absl::StrCat("RDMA completion error: ",
                                                          ibv_wc_status_str(wc[i].status))),
                      d, true);
        }
        continue;
      }
      if (state_ == State::kClosed) {
        if (!(wc[i].wr_id & kRecvBit)) ReleaseInflightLocked(wc[i].wr_id);
        continue;
      }
      if (wc[i].opcode == IBV_WC_RECV) {
        OnRecvLocked(wc[i], d);
      } else if (wc[i].opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
        OnChunkLocked(wc[i], d);
      } else {
        ReleaseInflightLocked(wc[i].wr_id);
      }
    }
  }
  if (disconnect_when_drained_ && inflight_.empty()) {
    disconnect_when_drained_ = false;
    if (id_) rdma_disconnect(id_.get());
  }
  DeliverLocked(d);
  PumpLocked(d);
  return seen;
}

// ----------------------------------------------------------------- close ---

void ConnImpl::CloseLocked(absl::Status why, Deferred* d, bool disconnect) {
  if (state_ == State::kClosed) return;
  bool was_up = state_ == State::kUp;
  state_ = State::kClosed;
  close_status_ = why.ok() ? Closed("connection closed") : why;
  for (WriteOp& op : writes_) {
    WriteDone cb = std::move(op.done);
    absl::Status s = close_status_;
    d->push_back([cb, s] { cb(s); });
  }
  writes_.clear();
  out_grants_.clear();
  DeliverLocked(d);
  // A server connection is connected from rdma_accept on, before it is up.
  if (disconnect && (was_up || accepted) && id_) {
    // Writes reported done are posted, not yet delivered: let them land
    // before the disconnect (every send is signalled, so each completes,
    // delivered or flushed, and HandleCqLocked disconnects then).
    if (was_up && !inflight_.empty()) {
      disconnect_when_drained_ = true;
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
