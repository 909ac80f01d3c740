// The send path of one connection: eager coalescing under credits, whole
// messages into the peer's standing grants, announced transfers (RTS, then
// chunks into the peer's grants), and credit updates.
#include <arpa/inet.h>
#include <string.h>

#include <algorithm>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "engine/connection.h"
#include "engine/engine_impl.h"

namespace grpc_rdma {

bool ConnImpl::SendControlLocked(wire::Header h) {
  if (!qp_ || !flow_.HasSendSlot()) return false;  // no QP: settled (SettleZeroCopyLocked)
  h.version = static_cast<uint8_t>(wire::kVersion);
  h.credits = flow_.owed();
  ibv_sge sge{reinterpret_cast<uint64_t>(&h), sizeof(h), 0};
  ibv_send_wr wr{}, *bad = nullptr;
  wr.wr_id = next_wr_++;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_INLINE | IBV_SEND_SIGNALED | IBV_SEND_SOLICITED;
  if (ibv_post_send(qp_.get(), &wr, &bad) != 0) return false;
  flow_.Told(h.credits);  // only once they are on their way
  flow_.Sent();
  return true;
}

void ConnImpl::CopyOut(WriteOp& op, size_t offset, char* to, size_t len) {
  stats_.bytes_copied_on_send += len;
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
    FailLocked(b.status(), d);
    return nullptr;
  }
  if (*b == nullptr && !waiting_budget_) {
    // Backpressure: the poller runs this connection again when pinned
    // memory comes back. One waiter at a time, for the size Get reserves.
    waiting_budget_ = true;
    ++stats_.memory_waits;
    // Counted, then one more try: a buffer a reader gave back just before
    // the count went up (and so woke nobody) is found now.
    engine_->buffer_waiters.fetch_add(1);
    b = pool.Get(size);
    if (!b.ok() || *b != nullptr) {
      waiting_budget_ = false;
      engine_->buffer_waiters.fetch_sub(1);
      if (b.ok()) return *b;
      FailLocked(b.status(), d);
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

void ConnImpl::ReleaseInflightLocked(uint64_t wr_id, bool ok, Deferred* d) {
  if (wr_id & kInlineWr) {
    --inline_inflight_;
    return;
  }
  if (wr_id & kZeroCopyWr) {
    ZeroCopyDoneLocked(wr_id, ok, d);
    return;
  }
  auto it = std::find_if(inflight_.begin(), inflight_.end(),
                         [wr_id](const auto& e) { return e.first == wr_id; });
  if (it == inflight_.end()) return;
  local_pool_->Put(it->second);
  inflight_.erase(it);
}

// Bytes the next eager SEND will carry (SendEagerLocked's loop, without
// taking anything).
size_t ConnImpl::NextEagerBytesLocked() const {
  size_t len = 0;
  for (const WriteOp& op : writes_) {
    if (len >= eager_limit_ || op.total > eager_limit_) break;
    size_t n = std::min(op.total - op.copied, eager_limit_ - len);
    len += n;
    if (op.copied + n < op.total) break;
  }
  return len;
}

// Coalesces the small writes at the head of the queue into one SEND: from
// the stack, inline, when it fits the QP's inline limit; else from a
// registered staging buffer held until the send completes.
bool ConnImpl::SendEagerLocked(Deferred* d) {
  if (!qp_) return false;  // settled (SettleZeroCopyLocked): closed
  alignas(8) char stack[kMaxInlineBytes];
  const bool inline_send = NextEagerBytesLocked() + wire::kHeaderBytes <=
                           std::min<size_t>(max_inline_, sizeof(stack));
  PinnedBuffer* buf = nullptr;
  char* base = stack;
  if (!inline_send) {
    buf = GetOrWaitLocked(*local_pool_, eager_limit_ + wire::kHeaderBytes, d);
    if (buf == nullptr) return false;
    base = buf->data;
  }
  char* p = base + wire::kHeaderBytes;
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
    d->Done(std::move(op.done), absl::OkStatus());
    LetGo(std::move(op.keep), d);  // not under mu_: letting go may run the writer's code
    writes_.pop_front();
  }
  wire::Header h{};
  h.type = wire::kData;
  h.version = static_cast<uint8_t>(wire::kVersion);
  h.len = static_cast<uint32_t>(len);
  h.credits = flow_.owed();
  memcpy(base, &h, sizeof(h));
  ibv_sge sge{reinterpret_cast<uint64_t>(base), static_cast<uint32_t>(len + sizeof(h)),
              buf != nullptr ? buf->reg.lkey : 0};
  ibv_send_wr wr{}, *bad = nullptr;
  wr.wr_id = next_wr_++ | (inline_send ? kInlineWr : 0);
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_SOLICITED | (inline_send ? IBV_SEND_INLINE : 0);
  if (ibv_post_send(qp_.get(), &wr, &bad) != 0) {
    if (buf != nullptr) local_pool_->Put(buf);
    FailLocked(absl::InternalError("ibv_post_send failed"), d);
    return false;
  }
  flow_.Told(h.credits);
  if (buf != nullptr) {
    inflight_.emplace_back(wr.wr_id, buf);
  } else {
    ++inline_inflight_;
  }
  flow_.Sent();
  stats_.bytes_sent += len;
  ++stats_.eager_messages;
  if (inline_send) ++stats_.inline_messages;
  if (ops > 1) stats_.coalesced_writes += ops;
  return true;
}

// Posts `len` bytes of staging buffer `b` (taken: it goes back to the pool
// when the write completes, or now if the post fails) as an RDMA WRITE
// WITH IMMEDIATE into the peer's grant `g`. On failure the connection is
// closed.
bool ConnImpl::PostGrantedWriteLocked(PinnedBuffer* b, uint32_t len, const OutGrant& g,
                                      Deferred* d) {
  if (!qp_) {  // settled (SettleZeroCopyLocked): closed, nothing goes out
    local_pool_->Put(b);
    return false;
  }
  ibv_sge sge{reinterpret_cast<uint64_t>(b->data), len, b->reg.lkey};
  const uint64_t wr_id = next_wr_++;
  if (!PostChunkLocked(g, &sge, 1, wr_id)) {
    local_pool_->Put(b);
    FailLocked(absl::InternalError("ibv_post_send(RDMA_WRITE_WITH_IMM) failed"), d);
    return false;
  }
  inflight_.emplace_back(wr_id, b);
  return true;
}

bool ConnImpl::PostChunkLocked(const OutGrant& g, ibv_sge* sge, int n, uint64_t wr_id) {
  ibv_send_wr wr{}, *bad = nullptr;
  wr.wr_id = wr_id;
  wr.sg_list = sge;
  wr.num_sge = n;
  wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
  wr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_SOLICITED;
  wr.imm_data = htonl(g.grant);
  wr.wr.rdma.remote_addr = g.addr;
  wr.wr.rdma.rkey = g.rkey;
  if (ibv_post_send(qp_.get(), &wr, &bad) != 0) return false;
  flow_.Sent();
  return true;
}

void ConnImpl::ChunkWrittenLocked(WriteOp& op, uint32_t len, Deferred* d) {
  op.copied += len;
  stats_.bytes_sent += len;
  if (op.copied == op.total) {
    FinishHeadWriteLocked(d);
    out_next_offset_ = 0;
  }
}

void ConnImpl::FinishHeadWriteLocked(Deferred* d) {
  WriteOp& op = writes_.front();
  if (op.zc != nullptr && op.keep != nullptr && op.zc->pending > 0) {
    // `keep` holds the bytes the device still reads: the writer goes on
    // now, and the last chunk's completion lets `keep` go.
    op.zc->finished = true;
    op.zc->keep = std::move(op.keep);
    ++stats_.writes_kept;
    d->Done(std::move(op.done), absl::OkStatus());
  } else if (op.zc != nullptr) {
    op.zc->done = std::move(op.done);
    op.zc->finished = true;
    if (op.zc->pending == 0) {  // its zero-copy chunks completed already
      d->Done(std::move(op.zc->done), op.zc->status);
      op.zc->done = nullptr;  // taken: a moved-from function need not be empty
    }
  } else {
    d->Done(std::move(op.done), absl::OkStatus());
  }
  LetGo(std::move(op.keep), d);
  writes_.pop_front();
}

void ConnImpl::ZeroCopyDoneLocked(uint64_t wr_id, bool ok, Deferred* d) {
  auto it = zc_inflight_.find(wr_id);
  if (it == zc_inflight_.end()) return;
  std::shared_ptr<ZcWrite> z = std::move(it->second);
  zc_inflight_.erase(it);
  if (!ok && z->status.ok())
    z->status = state_ == State::kClosed ? close_status_ : absl::UnavailableError("RDMA write failed");
  if (--z->pending > 0) return;
  LetGo(std::move(z->keep), d);  // set only once finished: nothing more to post
  if (!z->finished || !z->done) return;
  d->Done(std::move(z->done), z->status);
  z->done = nullptr;  // taken: a moved-from function need not be empty
}

int ConnImpl::GatherLocked(const WriteOp& op, size_t offset, size_t len, ibv_sge* sge,
                           int max) const {
  int n = 0;
  for (const iovec& v : op.iov) {
    if (len == 0) break;
    if (offset >= v.iov_len) {
      offset -= v.iov_len;
      continue;
    }
    if (n == max) return 0;
    size_t take = std::min(len, v.iov_len - offset);
    sge[n].addr = reinterpret_cast<uint64_t>(v.iov_base) + offset;
    sge[n].length = static_cast<uint32_t>(take);
    sge[n].lkey = odp_mr_->lkey;
    ++n;
    len -= take;
    offset = 0;
  }
  return len == 0 ? n : 0;
}

// Bytes of `op` as one RDMA WRITE WITH IMMEDIATE gathered from the
// writer's own buffers (no copy): the write's `done` then waits for the
// chunk's completion (FinishHeadWriteLocked, ZeroCopyDoneLocked).
bool ConnImpl::WriteZeroCopyLocked(WriteOp& op, const OutGrant& g, uint32_t len, ibv_sge* sge,
                                   int n, Deferred* d) {
  if (!qp_) return false;  // settled: closed
  const uint64_t wr_id = next_wr_++ | kZeroCopyWr;
  if (!PostChunkLocked(g, sge, n, wr_id)) {
    FailLocked(absl::InternalError("ibv_post_send(RDMA_WRITE_WITH_IMM, zero-copy) failed"), d);
    return false;
  }
  if (op.zc == nullptr) op.zc = std::make_shared<ZcWrite>();
  ++op.zc->pending;
  zc_inflight_[wr_id] = op.zc;
  ChunkWrittenLocked(op, len, d);  // may pop op: last use of it
  return true;
}

bool ConnImpl::WriteIntoGrantLocked(const OutGrant& g, size_t offset, uint32_t len,
                                    absl::FunctionRef<void()> take, Deferred* d) {
  WriteOp& op = writes_.front();
  if (odp_mr_ && len >= kZeroCopyMin) {
    ibv_sge sge[kZeroCopySge];
    int n = GatherLocked(op, offset, len, sge, max_send_sge_);
    if (n > 0) {
      take();
      return WriteZeroCopyLocked(op, g, len, sge, n, d);
    }
  }
  PinnedBuffer* b = GetOrWaitLocked(*local_pool_, len, d);
  if (b == nullptr) return false;
  take();
  CopyOut(op, offset, b->data, len);
  if (!PostGrantedWriteLocked(b, len, g, d)) return false;
  ChunkWrittenLocked(op, len, d);  // may pop op
  return true;
}

// Writes one granted chunk of the rendezvous at the head of the queue.
bool ConnImpl::WriteChunkLocked(Deferred* d) {
  const OutGrant g = out_grants_.front();
  return WriteIntoGrantLocked(g, g.offset, g.len, [this] { out_grants_.pop_front(); }, d);
}

int ConnImpl::FitStandingLocked(size_t total) const {
  int best = -1;
  for (size_t i = 0; i < standing_in_.size(); ++i) {
    if (standing_in_[i].len >= total && (best < 0 || standing_in_[i].len < standing_in_[best].len))
      best = static_cast<int>(i);
  }
  return best;
}

// Writes the whole message at the head of the queue into one of the
// peer's standing grants.
bool ConnImpl::WriteStandingLocked(size_t which, Deferred* d) {
  const OutGrant g = standing_in_[which];
  auto take = [this, which] {
    standing_in_.erase(standing_in_.begin() + static_cast<std::ptrdiff_t>(which));
  };
  const size_t total = writes_.front().total;
  if (!WriteIntoGrantLocked(g, 0, static_cast<uint32_t>(total), take, d)) return false;
  NoteLargeLocked(total);
  ++stats_.rendezvous;
  ++stats_.rendezvous_pre_granted;
  return true;
}

void ConnImpl::PumpLocked(Deferred* d) {
  if (budget_woken_.exchange(false) && waiting_budget_) {
    waiting_budget_ = false;
    engine_->buffer_waiters.fetch_sub(1);
  }
  // The credit rule (flow.h): data needs two credits, so one of the peer's
  // receives stays for control messages.
  for (;;) {
    if (state_ != State::kUp) return;
    IssueGrantsLocked(d);
    if (state_ != State::kUp) return;
    if (!flow_.HasSendSlot() || !flow_.CanSendData()) {
      // Completions (slots) or the peer's credit updates pump again.
      bool ready = !out_grants_.empty() || (!writes_.empty() && !writes_.front().rts_sent);
      if (ready && !credit_blocked_) {
        credit_blocked_ = true;
        ++stats_.credit_waits;
      }
      break;
    }
    credit_blocked_ = false;
    if (!out_grants_.empty()) {
      if (!WriteChunkLocked(d)) break;
      continue;
    }
    if (writes_.empty()) break;
    WriteOp& op = writes_.front();
    if (op.total > peer_acc_ && !op.rts_sent && op.copied == 0) {
      int which = FitStandingLocked(op.total);
      if (which >= 0) {
        if (!WriteStandingLocked(static_cast<size_t>(which), d)) break;
        continue;
      }
    }
    if (op.total > eager_limit_) {
      if (op.rts_sent) break;  // waiting for grants
      wire::Header h{};
      h.type = wire::kRts;
      h.a = op.total;
      if (!SendControlLocked(h)) {
        FailLocked(absl::InternalError("ibv_post_send(RTS) failed"), d);
        return;
      }
      op.rts_sent = true;
      out_next_offset_ = 0;
      NoteLargeLocked(op.total);
      ++stats_.rendezvous;
      continue;
    }
    if (!SendEagerLocked(d)) break;
  }
  // Nothing to say but credits, and the peer may be waiting for them.
  if (state_ == State::kUp && flow_.UpdateDue(engine_->options.eager_depth)) {
    wire::Header h{};
    h.type = wire::kCredit;
    if (SendControlLocked(h)) ++stats_.credit_messages;
    else FailLocked(absl::InternalError("ibv_post_send(CREDIT) failed"), d);
  }
}

}  // namespace grpc_rdma
