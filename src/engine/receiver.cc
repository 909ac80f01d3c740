// The receive path of one connection: messages and chunks from the peer,
// each field checked before use (docs/wire-protocol.md), the grants we
// make for the peer's writes, and the reader's queue.
#include <arpa/inet.h>
#include <string.h>

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "engine/connection.h"
#include "engine/engine_impl.h"
#include "engine/plan.h"
#include "verbs/log.h"

namespace grpc_rdma {
namespace {

constexpr uint64_t kMaxTransfer = 1ull << 40;

}  // namespace

// ------------------------------------------------------------- RecvChunk ---

RecvChunk::RecvChunk(RecvChunk&& o) noexcept { *this = std::move(o); }

RecvChunk& RecvChunk::operator=(RecvChunk&& o) noexcept {
  if (this == &o) return *this;
  Clear();
  owned_ = std::move(o.owned_);
  release_ = std::move(o.release_);
  o.release_ = nullptr;
  owner_ = o.owner_;
  owner_release_ = o.owner_release_;
  o.owner_ = nullptr;
  size_ = o.size_;
  data_ = release_ || owner_ ? o.data_ : owned_.data();
  o.data_ = nullptr;
  o.size_ = 0;
  return *this;
}

RecvChunk::~RecvChunk() { Clear(); }

void RecvChunk::Clear() {
  if (release_) release_();
  release_ = nullptr;
  if (owner_ != nullptr) owner_release_(owner_);
  owner_ = nullptr;
}

void* RecvChunk::TakeOwner() {
  void* o = owner_;
  if (o == nullptr) return nullptr;
  owner_ = nullptr;
  data_ = nullptr;
  size_ = 0;
  return o;
}

RecvChunk RecvChunk::Owned(std::string bytes) {
  RecvChunk c;
  c.owned_ = std::move(bytes);
  c.data_ = c.owned_.data();
  c.size_ = c.owned_.size();
  return c;
}

RecvChunk RecvChunk::Copy(const char* src, size_t size, const ChunkMemory& memory) {
  char* data = nullptr;
  void* owner = memory.allocate != nullptr ? memory.allocate(size, &data) : nullptr;
  if (owner == nullptr) return Owned(std::string(src, size));
  memcpy(data, src, size);
  RecvChunk c;
  c.data_ = data;
  c.size_ = size;
  c.owner_ = owner;
  c.owner_release_ = memory.release;
  return c;
}

RecvChunk RecvChunk::Lent(const char* data, size_t size, std::function<void()> release) {
  RecvChunk c;
  c.data_ = data;
  c.size_ = size;
  c.release_ = std::move(release);
  return c;
}

// ------------------------------------------------------------- receives ---

// Posts receive buffers `index[0..n)` (n at most kRecvChain) as one chain.
bool ConnImpl::PostRecvsLocked(const uint32_t* index, size_t n) {
  if (!qp_) return false;  // settled (SettleZeroCopyLocked): closed
  ibv_sge sge[kRecvChain];
  ibv_recv_wr wr[kRecvChain];
  for (size_t i = 0; i < n; ++i) {
    PinnedBuffer* b = recv_bufs_[index[i]];
    sge[i] = ibv_sge{reinterpret_cast<uint64_t>(b->data), static_cast<uint32_t>(b->size),
                     b->reg.lkey};
    wr[i] = ibv_recv_wr{};
    wr[i].wr_id = kRecvBit | index[i];
    wr[i].sg_list = &sge[i];
    wr[i].num_sge = 1;
    wr[i].next = i + 1 < n ? &wr[i + 1] : nullptr;
  }
  ibv_recv_wr* bad = nullptr;
  return ibv_post_recv(qp_.get(), wr, &bad) == 0;
}

// The receive is handled: post it again (with the others of this pass).
void ConnImpl::RepostLocked(size_t index) { reposts_.push_back(static_cast<uint32_t>(index)); }

// Posts the handled receives as one chain, and owes the peer their
// credits (only now: a credit promises a posted receive).
void ConnImpl::PostRepostsLocked(Deferred* d) {
  if (reposts_.empty()) return;
  if (!qp_) {  // settled (SettleZeroCopyLocked): closed, nothing to post to
    reposts_.clear();
    return;
  }
  for (size_t done = 0; done < reposts_.size();) {
    size_t n = std::min(kRecvChain, reposts_.size() - done);
    if (!PostRecvsLocked(reposts_.data() + done, n)) {
      reposts_.clear();
      FailLocked(absl::InternalError("ibv_post_recv failed"), d);
      return;
    }
    for (size_t i = 0; i < n; ++i) flow_.Reposted();
    ++stats_.receive_reposts;
    done += n;
  }
  reposts_.clear();
}

void ConnImpl::DeliverLocked(Deferred* d) {
  if (!pending_read_) return;
  if (!ready_.empty()) {
    RecvChunks out;
    out.reserve(ready_.size());
    while (!ready_.empty()) {
      out.push_back(std::move(ready_.front()));
      ready_.pop_front();
    }
    d->Deliver(std::move(pending_read_), std::move(out));
    pending_read_ = nullptr;
    return;
  }
  if (state_ == State::kClosed || peer_closed_) {
    absl::Status s = state_ == State::kClosed ? close_status_
                                              : absl::UnavailableError("closed by the peer");
    d->Deliver(std::move(pending_read_), std::move(s));
    pending_read_ = nullptr;
  }
}

void ConnImpl::OnQpEventLocked(ibv_event_type type, Deferred* d) {
  const char* what;
  switch (type) {
    case IBV_EVENT_QP_ACCESS_ERR:
      what = "the peer broke the protocol (an RDMA access outside its grants, refused by the "
             "device)";
      break;
    case IBV_EVENT_QP_REQ_ERR:
      what = "the peer broke the protocol (an invalid request, refused by the device)";
      break;
    case IBV_EVENT_QP_FATAL:
      what = "the device reports a fatal QP error";
      break;
    default:
      return;  // informational (path migration, last WQE reached, ...)
  }
  // The QP went to error with the event, so its flushed receives may have
  // closed the connection already (a flush says nothing of why): the log
  // line is the only place the reason shows.
  GRPC_RDMA_LOG_ERROR("connection %s: %s; %s", peer_.c_str(), what,
                      state_ == State::kClosed ? "it is closed" : "closing it");
  if (state_ == State::kClosed && stats_.connection_errors == 0) {
    // Closed by the flush this same fault caused: it still counts as one.
    stats_.connection_errors = 1;
    engine_->connection_errors.fetch_add(1);
  }
  FailLocked(absl::UnavailableError(what), d);
}

void ConnImpl::Violation(const char* what, Deferred* d) {
  GRPC_RDMA_LOG_ERROR(
      "connection %s: the peer broke the protocol (%s); closing it",
      peer_.c_str(), what);
  FailLocked(absl::UnavailableError(absl::StrCat("peer broke the protocol: ", what)), d);
}

void ConnImpl::OnRecvLocked(const ibv_wc& wc, Deferred* d) {
  size_t index = wc.wr_id & ~kRecvBit;
  if (index >= recv_bufs_.size()) return Violation("unknown receive", d);
  PinnedBuffer* b = recv_bufs_[index];
  if (wc.byte_len < wire::kHeaderBytes) return Violation("message shorter than a header", d);
  wire::Header h;
  memcpy(&h, b->data, sizeof(h));
  if (h.version != wire::kVersion) return Violation("unknown protocol version", d);
  if (!flow_.Return(h.credits)) return Violation("more credits than receives posted", d);
  switch (h.type) {
    case wire::kData:
      if (h.len == 0 || h.len != wc.byte_len - wire::kHeaderBytes ||
          h.len > engine_->options.acc_size)
        return Violation("bad data length", d);
      if (in_active_) return Violation("data in the middle of a rendezvous", d);
      ready_.push_back(
          RecvChunk::Copy(b->data + wire::kHeaderBytes, h.len, engine_->chunk_memory));
      stats_.bytes_received += h.len;
      stats_.bytes_copied_on_receive += h.len;
      break;
    case wire::kRts:
      if (in_active_ || h.a == 0 || h.a > kMaxTransfer) return Violation("bad rendezvous", d);
      in_active_ = true;
      in_total_ = h.a;
      in_received_ = in_granted_ = 0;
      // Announced though a standing grant would have held it: if the peer
      // used them all before they came back, keep more out.
      if (int t = plan::StandingTarget(
              standing_target_, h.a, plan::StandingBytes(grant_limit_, engine_->options.acc_size),
              peer_standing_ - plan::LargeStandingSlots(peer_standing_), standing_used_,
              standing_withheld_);
          t != standing_target_) {
        standing_target_ = t;
        standing_used_ = 0;
      }
      // The next such message need not be announced: large standing
      // grants are made from now on (IssueStandingGrantsLocked).
      large_standing_len_ = std::max(
          large_standing_len_,
          plan::LargeStandingBytes(h.a, grant_limit_,
                                   plan::StandingBytes(grant_limit_, engine_->options.acc_size),
                                   engine_->options.acc_size));
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
    case wire::kStanding:
      if (h.len <= peer_acc_ || h.len > engine_->options.chunk_size ||
          standing_in_.size() >= static_cast<size_t>(plan::kStandingGrants))
        return Violation("bad standing grant", d);
      standing_in_.push_back(OutGrant{0, h.a, h.len, h.rkey, h.grant});
      break;
    case wire::kCredit:
      break;
    case wire::kClose:
      peer_closed_ = true;
      break;
    default:
      return Violation("unknown message type", d);
  }
  RepostLocked(index);
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
    if (land.large) --large_out_;
    else ++standing_used_;
  } else if (wc.byte_len != land.len) {
    return Violation("chunk of the wrong length", d);
  } else if (land.offset != in_received_) {
    // RC keeps the peer's writes in order, and the peer writes its grants
    // in the order given: a chunk ahead of its turn would hand the reader
    // bytes out of place.
    return Violation("chunk out of order", d);
  }
  landings_.erase(it);
  // Closed to the peer first: a peer that writes again into a grant it has
  // used (RC would let it, the memory being still registered for it) gets
  // an access error from the device instead of changing bytes the reader
  // holds.
  if (!CloseGrantLocked(land.buf, d)) {
    remote_pool_->Put(land.buf);
    return;
  }
  // Lend the buffer to the reader, unless pinned memory runs short: then
  // copy and give it back, so a reader that holds data (gRPC keeps a whole
  // message) can never starve the transfer of buffers.
  uint64_t used = engine_->budget.used(), cap = engine_->budget.cap();
  if (used > cap / 4 * 3) {
    ready_.push_back(RecvChunk::Copy(land.buf->data, land.len, engine_->chunk_memory));
    remote_pool_->Put(land.buf);
    ++stats_.chunks_copied;
    stats_.bytes_copied_on_receive += land.len;
  } else {
    PinnedBuffer* buf = land.buf;
    std::shared_ptr<BufferPool> pool = remote_pool_;
    std::shared_ptr<EngineImpl> eng = engine_;  // the pool's budget lives there
    // Back to the pool (thread-safe), and wake the poller if a connection
    // waits for pinned memory (docs/design.md: a wake-up per chunk
    // otherwise). Captures are destroyed in reverse order: `eng` is listed
    // first so the pool (whose destructor releases into the engine's
    // budget) always goes before the engine.
    ready_.push_back(RecvChunk::Lent(land.buf->data, land.len, [eng, pool, buf] {
      pool->Put(buf);
      if (eng->buffer_waiters.load() > 0) eng->Wake();
    }));
    ++stats_.chunks_zero_copy;
  }
  NoteLargeLocked(land.len);
  stats_.bytes_received += land.len;
  if (!land.standing) {
    in_received_ += land.len;
    if (in_received_ == in_total_) in_active_ = false;
    SetGrantDeadlineLocked(/*renew=*/true);  // progress
  }
  RepostLocked(index);
}

// ---------------------------------------------------------------- grants ---

// Keeps the peer's share of standing grants out (plan.h): the small ones
// always, the large ones once a message showed their size (only from
// memory the budget has to spare: never waits for it).
void ConnImpl::IssueStandingGrantsLocked() {
  const int large_slots = plan::LargeStandingSlots(peer_standing_);
  const uint32_t small = plan::StandingBytes(grant_limit_, engine_->options.acc_size);
  // small == 0: every such message is eager anyway.
  while (small != 0 && standing_out_ - large_out_ < standing_target_) {
    if (!IssueStandingGrantLocked(small, false)) {
      standing_withheld_ = true;
      return;
    }
  }
  standing_withheld_ = false;
  while (large_standing_len_ != 0 && large_out_ < large_slots) {
    if (!IssueStandingGrantLocked(large_standing_len_, true)) return;
  }
}

bool ConnImpl::IssueStandingGrantLocked(uint32_t len, bool large) {
  // The peer's receives are for data and for the grants of announced
  // transfers too: standing grants (held until used) take at most half.
  if (!flow_.RoomForStandingGrant()) return false;
  // Held until the peer uses them: only from a budget three quarters
  // free, so standing grants (across all connections) can never take the
  // memory announced transfers need to make progress.
  if (engine_->budget.used() + len > engine_->budget.cap() / 4) return false;
  absl::StatusOr<PinnedBuffer*> b = remote_pool_->Get(len);
  if (!b.ok() || *b == nullptr) return false;
  if (!OpenGrantLocked(*b, nullptr)) {
    remote_pool_->Put(*b);
    return false;
  }
  uint32_t id = NextGrantIdLocked();
  wire::Header h{};
  h.type = wire::kStanding;
  h.len = len;
  h.a = reinterpret_cast<uint64_t>((*b)->data);
  h.rkey = (*b)->reg.rkey;
  h.grant = id;
  if (!SendControlLocked(h)) {
    remote_pool_->Put(*b);
    return false;
  }
  Landing land{*b, len, true};
  land.large = large;
  landings_[id] = land;
  ++standing_out_;
  if (large) ++large_out_;
  return true;
}

void ConnImpl::SetGrantDeadlineLocked(bool renew) {
  if (!in_active_ || in_granted_ == in_received_) {
    grant_deadline_us.store(0);
  } else if (renew || grant_deadline_us.load() == 0) {
    bool was_set = grant_deadline_us.load() != 0;
    grant_deadline_us.store(NowMicros() +
                            static_cast<uint64_t>(engine_->options.grant_timeout_ms) * 1000);
    // A first deadline the poller may not have seen before it went to
    // wait with no timeout (later ones are later: it wakes for the first).
    if (!was_set && engine_->may_block_.load()) engine_->Wake();
  }
}

void ConnImpl::GrantsTimedOutLocked(uint64_t now_us, Deferred* d) {
  uint64_t deadline = grant_deadline_us.load();
  if (deadline == 0 || now_us <= deadline || state_ == State::kClosed) return;
  // A peer that announced a message holds the memory granted for it until
  // it writes: one that never does (gone silent, or an attack) would keep
  // it from every other connection.
  GRPC_RDMA_LOG_ERROR(
      "connection %s: the peer announced a %llu-byte message and left %llu "
      "granted bytes unwritten for %d ms (TF_RDMA_GRANT_TIMEOUT_MS); closing "
      "it",
      peer_.c_str(), static_cast<unsigned long long>(in_total_),
      static_cast<unsigned long long>(in_granted_ - in_received_),
      engine_->options.grant_timeout_ms);
  FailLocked(absl::UnavailableError(
                 "the peer left memory granted to it unwritten past TF_RDMA_GRANT_TIMEOUT_MS"),
             d);
}

bool ConnImpl::OpenGrantLocked(PinnedBuffer* b, Deferred* d) {
  absl::Status s = remote_pool_->SetRemoteWrite(b, true);
  if (s.ok()) return true;
  if (d != nullptr) FailLocked(s, d);
  else GRPC_RDMA_LOG_ERROR("connection %s: %s", peer_.c_str(), std::string(s.message()).c_str());
  return false;
}

bool ConnImpl::CloseGrantLocked(PinnedBuffer* b, Deferred* d) {
  absl::Status s = remote_pool_->SetRemoteWrite(b, false);
  if (s.ok()) return true;
  FailLocked(s, d);
  return false;
}

uint32_t ConnImpl::NextGrantIdLocked() {
  uint32_t id;
  do {
    id = next_grant_++;
  } while (id == 0 || landings_.count(id) != 0);
  return id;
}

void ConnImpl::IssueGrantsLocked(Deferred* d) {
  const Options& o = engine_->options;
  // Standing grants are landings too, but outside TF_RDMA_CHUNKS_IN_FLIGHT:
  // counted in, they could take every slot and the transfer would wait for
  // ever (the peer writes an announced message only into its grants).
  const uint64_t piece = plan::PieceSize(in_total_, grant_limit_, o.chunks_in_flight);
  while (in_active_ && flow_.CanSendData()) {
    uint64_t left = in_total_ - in_granted_;
    int in_flight = static_cast<int>(landings_.size()) - standing_out_;
    if (!plan::MayGrant(in_flight, o.chunks_in_flight, left)) break;
    uint32_t len = static_cast<uint32_t>(std::min<uint64_t>(piece, left));
    PinnedBuffer* buf = GetOrWaitLocked(*remote_pool_, len, d);
    if (buf == nullptr) return;  // granted again when pinned memory comes back
    if (!OpenGrantLocked(buf, d)) {
      remote_pool_->Put(buf);
      return;
    }
    uint32_t id = NextGrantIdLocked();
    wire::Header h{};
    h.type = wire::kCts;
    h.len = len;
    h.a = reinterpret_cast<uint64_t>(buf->data);
    h.rkey = buf->reg.rkey;
    h.grant = id;
    h.offset = in_granted_;
    if (!SendControlLocked(h)) {
      remote_pool_->Put(buf);
      if (flow_.HasSendSlot())
        FailLocked(absl::InternalError("ibv_post_send(CTS) failed"), d);
      return;
    }
    landings_[id] = Landing{buf, len, false, in_granted_};
    in_granted_ += len;
  }
  SetGrantDeadlineLocked(/*renew=*/false);
  // Also during an announced transfer: the peer uses a standing grant only
  // for a message after it (in order on the QP, so it lands after the
  // transfer's last chunk). Held back until the transfer ended, they were
  // all used up in a stream of mid-size messages (docs/design.md).
  if (state_ == State::kUp) IssueStandingGrantsLocked();
}

}  // namespace grpc_rdma
