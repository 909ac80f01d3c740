// RC queue pairs: the state machine, posting, and both ends of the wire
// protocol (requester: frames out, ACK/NAK/READ responses in; responder:
// frames in, checks against its own keys, ACK/NAK out).
#include <arpa/inet.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "sv_internal.h"

namespace softverbs {
namespace {

Runtime& Rt() { return Runtime::Get(); }

constexpr size_t kMaxQueuedFrames = 4096;

ibv_wc_opcode WcOpcode(ibv_wr_opcode op) {
  switch (op) {
    case IBV_WR_SEND:
    case IBV_WR_SEND_WITH_IMM:
      return IBV_WC_SEND;
    case IBV_WR_RDMA_WRITE:
    case IBV_WR_RDMA_WRITE_WITH_IMM:
      return IBV_WC_RDMA_WRITE;
    case IBV_WR_RDMA_READ:
      return IBV_WC_RDMA_READ;
    default:
      return IBV_WC_SEND;
  }
}

StatOp StatFor(ibv_wr_opcode op) {
  switch (op) {
    case IBV_WR_SEND_WITH_IMM: return kStatSendImm;
    case IBV_WR_RDMA_WRITE: return kStatWrite;
    case IBV_WR_RDMA_WRITE_WITH_IMM: return kStatWriteImm;
    case IBV_WR_RDMA_READ: return kStatRead;
    default: return kStatSend;
  }
}

void CompleteSend(Qp* qp, const SendWr& wr, ibv_wc_status status, bool force) {
  if (!force && status == IBV_WC_SUCCESS && !wr.signaled) return;
  ibv_wc wc{};
  wc.wr_id = wr.wr_id;
  wc.status = status;
  wc.opcode = WcOpcode(wr.opcode);
  wc.qp_num = qp->qp.qp_num;
  if (wr.opcode == IBV_WR_RDMA_READ && status == IBV_WC_SUCCESS)
    wc.byte_len = static_cast<uint32_t>(wr.length);
  if (status != IBV_WC_SUCCESS) wc.vendor_err = 0x100 + status;
  PushCqe(qp->scq, wc, false);
}

// The bytes a frame moves: its payload, or a placed WRITE's length.
uint64_t FrameBytes(const FrameHdr& h) {
  return h.type == kFrameWrite && (h.flags & kFlagPlaced) ? h.aux : h.len;
}

void CompleteRecv(Qp* qp, const RecvWr& wr, ibv_wc_status status, const FrameHdr* h) {
  ibv_wc wc{};
  wc.wr_id = wr.wr_id;
  wc.status = status;
  wc.opcode = IBV_WC_RECV;
  wc.qp_num = qp->qp.qp_num;
  wc.src_qp = qp->dest_qpn;
  wc.slid = qp->ah.dlid;
  bool solicited = false;
  if (h != nullptr && status == IBV_WC_SUCCESS) {
    wc.byte_len = static_cast<uint32_t>(FrameBytes(*h));
    if (h->type == kFrameWrite) wc.opcode = IBV_WC_RECV_RDMA_WITH_IMM;
    if (h->flags & kFlagImm) {
      wc.wc_flags |= IBV_WC_WITH_IMM;
      wc.imm_data = h->imm;
    }
    solicited = (h->flags & kFlagSolicited) != 0;
  }
  if (status != IBV_WC_SUCCESS) wc.vendor_err = 0x100 + status;
  PushCqe(qp->rcq, wc, solicited || status != IBV_WC_SUCCESS);
}

// An on-demand paging element of a post, its pages faulted in before the
// post took Rt().mu (PrefaultOdp): where it is in the chain (WR << 32 |
// element) and the result (0 or an errno).
struct Prefaulted {
  uint64_t pos;
  uint64_t addr, length;
  bool write;
  int result;
};

uint64_t PosOf(int wr_index, int sge_index) {
  return (static_cast<uint64_t>(wr_index) << 32) | static_cast<uint32_t>(sge_index);
}

// Faults in the pages of every element of `wr`'s chain that lies in an
// on-demand paging MR it may use (Runtime::odp_ranges, read without
// Rt().mu), as the HCA faults them in on its own time, so that a large or
// cold range does not hold up every other QP waiting for Rt().mu. `out` is
// in chain order; CheckLocal takes the results from it instead of faulting
// again. An element of another PD's MR, outside its MR, or written where
// the MR is not writable is left alone (CheckLocal refuses it); one of a
// WR the post then refuses for another reason is faulted in for nothing,
// within its MR and rights.
void PrefaultOdp(const Qp* qp, const ibv_send_wr* wr, std::vector<Prefaulted>* out) {
  if (Rt().odp_count.load(std::memory_order_acquire) == 0) return;
  {
    std::shared_lock<std::shared_mutex> g(Rt().odp_mu);
    for (int w = 0; wr != nullptr; wr = wr->next, ++w) {
      if ((wr->send_flags & IBV_SEND_INLINE) || wr->num_sge <= 0 ||
          wr->num_sge > static_cast<int>(qp->cap.max_send_sge) || wr->sg_list == nullptr)
        continue;
      bool need_write = wr->opcode == IBV_WR_RDMA_READ;
      for (int i = 0; i < wr->num_sge; ++i) {
        const ibv_sge& e = wr->sg_list[i];
        if (e.length == 0) continue;
        auto it = Rt().odp_ranges.find(e.lkey);
        if (it == Rt().odp_ranges.end()) continue;
        const Runtime::OdpRange& r = it->second;
        if (r.pd != qp->qp.pd) continue;
        if (!r.implicit && (e.addr < r.addr || e.addr - r.addr > r.length ||
                            e.length > r.length - (e.addr - r.addr)))
          continue;
        if (need_write && !(r.access & IBV_ACCESS_LOCAL_WRITE)) continue;
        out->push_back({PosOf(w, i), e.addr, e.length, need_write, -1});
      }
    }
  }
  for (Prefaulted& p : *out)
    p.result = FaultInPages(reinterpret_cast<void*>(p.addr), p.length,
                            p.write ? IBV_ACCESS_LOCAL_WRITE : 0);
}

// Checks a local scatter/gather list against our MR table. `pre`: the
// elements whose pages were faulted in already, in chain order (or null),
// `wr_index` this list's WR in the chain, `cursor` how far `pre` was read.
bool CheckLocal(Qp* qp, const ibv_sge* sge, int n, bool need_write, uint64_t* total,
                const std::vector<Prefaulted>* pre = nullptr, int wr_index = 0,
                size_t* cursor = nullptr) {
  uint64_t sum = 0;
  for (int i = 0; i < n; ++i) {
    sum += sge[i].length;
    if (sge[i].length == 0) continue;
    auto it = Rt().mrs.find(sge[i].lkey);
    if (it == Rt().mrs.end()) return false;
    Mr* mr = it->second;
    if (mr->mr.pd != qp->qp.pd) return false;
    if (need_write && !(mr->access & IBV_ACCESS_LOCAL_WRITE)) return false;
    uint64_t base = reinterpret_cast<uint64_t>(mr->mr.addr);
    if (!mr->implicit && (sge[i].addr < base || sge[i].addr - base > mr->mr.length ||
                          sge[i].length > mr->mr.length - (sge[i].addr - base)))
      return false;
    // On-demand paging: the device faults the pages in as it uses them,
    // and a page that cannot be (not mapped, or read-only for a receive)
    // fails the work request, as the HCA's page fault does.
    if (mr->odp) {
      int fault = -1;
      if (pre != nullptr) {
        uint64_t pos = PosOf(wr_index, i);
        while (*cursor < pre->size() && (*pre)[*cursor].pos < pos) ++*cursor;
        if (*cursor < pre->size() && (*pre)[*cursor].pos == pos &&
            (*pre)[*cursor].write == need_write)
          fault = (*pre)[*cursor].result;
      }
      if (fault < 0)
        fault = FaultInPages(reinterpret_cast<void*>(sge[i].addr), sge[i].length,
                             need_write ? IBV_ACCESS_LOCAL_WRITE : 0);
      if (fault != 0) return false;
    }
  }
  *total = sum;
  return true;
}

// Checks a remote access against our MR table: the key, its PD, the right
// and the bounds. Returns the local address or nullptr.
char* CheckRemote(Qp* qp, uint32_t rkey, uint64_t addr, uint64_t len, int right) {
  auto it = Rt().mrs.find(rkey);
  if (it == Rt().mrs.end()) return nullptr;
  Mr* mr = it->second;
  if (mr->mr.pd != qp->qp.pd || !(mr->access & right) || !(qp->access & right)) return nullptr;
  uint64_t base = reinterpret_cast<uint64_t>(mr->mr.addr);
  if (addr < base || addr - base > mr->mr.length || len > mr->mr.length - (addr - base))
    return nullptr;
  // On-demand paging: a page the device cannot fault in is the access
  // error the HCA reports.
  if (mr->odp && len > 0 &&
      FaultInPages(reinterpret_cast<void*>(addr), len,
                   right == IBV_ACCESS_REMOTE_READ ? 0u : static_cast<unsigned>(IBV_ACCESS_LOCAL_WRITE)) != 0)
    return nullptr;
  return reinterpret_cast<char*>(addr);
}

SmallVec<iovec, 2> SgeIov(const SmallVec<ibv_sge, 2>& sge, uint64_t len) {
  SmallVec<iovec, 2> v;
  for (const ibv_sge& s : sge) {
    if (len == 0) break;
    uint64_t n = std::min<uint64_t>(s.length, len);
    if (n == 0) continue;
    v.push_back({reinterpret_cast<void*>(s.addr), n});
    len -= n;
  }
  return v;
}

void FlushAck(Link* l) {
  if (!l->ack_pending) return;
  OutFrame f;
  f.hdr.type = kFrameAck;
  f.hdr.seq = l->ack_seq;
  l->ack_pending = false;
  LinkEnqueue(l, std::move(f));
}

void SendNak(Link* l, uint64_t seq, ibv_wc_status status) {
  FlushAck(l);
  OutFrame f;
  f.hdr.type = kFrameNak;
  f.hdr.seq = seq;
  f.hdr.aux = status;
  LinkEnqueue(l, std::move(f));
}

// Hands posted WRs to the link, in order.
void QueueFramesLocked(Qp* qp) {
  Link* l = qp->link;
  if (l == nullptr || l->state != LinkState::kUp || qp->qp.state != IBV_QPS_RTS) return;
  for (SendWr& wr : qp->sq) {
    if (wr.queued) continue;
    if (wr.fail_status != 0) {
      if (&wr == &qp->sq.front()) QpToErrorLocked(qp, static_cast<ibv_wc_status>(wr.fail_status));
      return;  // waits for what is ahead of it
    }
    OutFrame f;
    f.hdr.seq = wr.seq;
    f.hdr.rnr_retry = qp->rnr_retry;
    if (wr.flags & IBV_SEND_SOLICITED) f.hdr.flags |= kFlagSolicited;
    switch (wr.opcode) {
      case IBV_WR_SEND_WITH_IMM:
        f.hdr.flags |= kFlagImm;
        f.hdr.imm = wr.imm;
        [[fallthrough]];
      case IBV_WR_SEND:
        f.hdr.type = kFrameSend;
        break;
      case IBV_WR_RDMA_WRITE_WITH_IMM:
        f.hdr.flags |= kFlagImm;
        f.hdr.imm = wr.imm;
        [[fallthrough]];
      case IBV_WR_RDMA_WRITE:
        f.hdr.type = kFrameWrite;
        f.hdr.addr = wr.remote_addr;
        f.hdr.rkey = wr.rkey;
        break;
      default:  // IBV_WR_RDMA_READ
        f.hdr.type = kFrameReadReq;
        f.hdr.addr = wr.remote_addr;
        f.hdr.rkey = wr.rkey;
        f.hdr.aux = static_cast<uint32_t>(wr.length);
        break;
    }
    if (wr.opcode == IBV_WR_RDMA_READ) {
      // Where the bytes go, should they be copied straight from the
      // peer's shared MR (sv_onecopy.cc): the WR's memory stays the
      // application's until the READ completes.
      f.read_into = SgeIov(wr.sge, wr.length);
    } else {
      f.hdr.len = wr.length;
      // Moved: a WR goes to the link once (queued), and its completion
      // needs none of its bytes.
      if (!wr.inline_data.empty()) f.owned = std::move(wr.inline_data);
      else f.iov = SgeIov(wr.sge, wr.length);
    }
    CountTx(qp->device->index, StatFor(wr.opcode), wr.length);
    wr.queued = true;
    LinkEnqueue(l, std::move(f));
    if (wr.drop_link) {
      LinkPump(l);
      Trace("fault: dropping the wire of qpn 0x%x after its send WR %ld", qp->qp.qp_num,
            GetConfig().drop_after_ops);
      LinkKill(l);
      return;
    }
  }
}

// Completes, in order, every WR the peer has acknowledged up to seq.
void AckUpTo(Qp* qp, uint64_t seq) {
  // A READ completes with its response only, never with an ACK.
  while (!qp->sq.empty() && qp->sq.front().queued && qp->sq.front().seq <= seq &&
         qp->sq.front().opcode != IBV_WR_RDMA_READ) {
    CompleteSend(qp, qp->sq.front(), IBV_WC_SUCCESS, false);
    qp->sq.pop_front();
  }
  if (!qp->sq.empty() && qp->sq.front().fail_status != 0) QueueFramesLocked(qp);
}

uint64_t RnrTimerUs(uint8_t code) {
  static const uint32_t kTable[32] = {
      655360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920,
      2560, 3840, 5120, 7680, 10240, 15360, 20480, 30720, 40960, 61440, 81920, 122880,
      163840, 245760, 327680, 491520};
  return kTable[code & 31];
}

void ProtocolError(Link* l, const char* what) {
  Warn("link %s: peer broke the protocol (%s); closing the connection", l->peer_desc.c_str(),
       what);
  LinkKill(l);
}

// Responder: a SEND or WRITE_WITH_IMM needs a posted receive.
// Returns false to wait (RNR), true when a receive was taken or the frame
// was refused.
bool TakeRecv(Link* l, Qp* qp, bool* refused) {
  *refused = false;
  if (!qp->rq.empty()) {
    l->in_recv = std::move(qp->rq.front());
    qp->rq.pop_front();
    l->in_has_recv = true;
    l->rnr_deadline_us = 0;
    return true;
  }
  uint8_t retry = l->in_hdr.rnr_retry;
  uint64_t now = NowUs();
  if (retry == 7) return false;  // infinite RNR retry
  if (l->rnr_deadline_us == 0) {
    l->rnr_deadline_us = now + RnrTimerUs(qp->min_rnr_timer) * retry + 1;
    if (retry != 0) return false;
  }
  if (now < l->rnr_deadline_us) return false;
  l->rnr_deadline_us = 0;
  Trace("qpn 0x%x: no receive posted, RNR retries exhausted", qp->qp.qp_num);
  SendNak(l, l->in_hdr.seq, IBV_WC_RNR_RETRY_EXC_ERR);
  l->rx_dead = true;
  *refused = true;
  return true;
}

}  // namespace

// ------------------------------------------------------------- frames in ---

bool QpHandleFrameBegin(Link* l) {
  Qp* qp = l->qp;
  FrameHdr& h = l->in_hdr;
  if (qp == nullptr) {
    l->in_discard = true;
    return true;
  }
  bool responder_frame = h.type == kFrameSend || h.type == kFrameWrite || h.type == kFrameReadReq;
  if (responder_frame && l->out.size() > kMaxQueuedFrames) {
    // A peer that keeps asking (reads, empty writes) while never draining
    // what we send back would grow our queue without end.
    ProtocolError(l, "too many requests queued without reading the replies");
    return true;
  }
  if (responder_frame &&
      (l->rx_dead || (qp->qp.state != IBV_QPS_RTR && qp->qp.state != IBV_QPS_RTS))) {
    if (!l->rx_dead) {
      // Hardware's requester would time out (retry exceeded) against a
      // responder in error; say so now instead of leaving it waiting.
      SendNak(l, h.seq, IBV_WC_RETRY_EXC_ERR);
      l->rx_dead = true;
    }
    l->in_discard = true;
    return true;
  }
  switch (h.type) {
    case kFrameSend: {
      bool refused;
      if (!TakeRecv(l, qp, &refused)) return false;
      if (refused) {
        l->in_discard = true;
        return true;
      }
      uint64_t cap = 0;
      bool ok = CheckLocal(qp, l->in_recv.sge.data(), static_cast<int>(l->in_recv.sge.size()),
                           true, &cap);
      if (!ok || h.len > cap) {
        ibv_wc_status mine = ok ? IBV_WC_LOC_LEN_ERR : IBV_WC_LOC_PROT_ERR;
        CompleteRecv(qp, l->in_recv, mine, nullptr);
        l->in_has_recv = false;
        SendNak(l, h.seq, ok ? IBV_WC_REM_INV_REQ_ERR : IBV_WC_REM_OP_ERR);
        l->rx_dead = true;
        l->in_discard = true;
        QpToErrorLocked(qp, IBV_WC_WR_FLUSH_ERR);
        return true;
      }
      l->in_target = SgeIov(l->in_recv.sge, h.len);
      return true;
    }
    case kFrameWrite: {
      // A placed WRITE's bytes are in our memory already (sv_onecopy.cc):
      // it is checked as any WRITE, and must name a share of ours.
      const bool placed = (h.flags & kFlagPlaced) != 0;
      if (placed && h.len != 0) {
        ProtocolError(l, "placed write with payload");
        return true;
      }
      const uint64_t bytes = FrameBytes(h);
      char* dst = bytes == 0 ? nullptr
                             : CheckRemote(qp, h.rkey, h.addr, bytes, IBV_ACCESS_REMOTE_WRITE);
      if (placed && dst != nullptr && !LinkSharedWith(l, h.rkey, h.pad)) dst = nullptr;
      if (bytes != 0 && dst == nullptr) {
        Trace("qpn 0x%x: remote write refused rkey=0x%x addr=0x%llx len=%llu%s", qp->qp.qp_num,
              h.rkey, static_cast<unsigned long long>(h.addr),
              static_cast<unsigned long long>(bytes), placed ? " (placed)" : "");
        // The event first: it is queued before the flush or the NAK can
        // make anyone look for it.
        RaiseQpEvent(&qp->qp, IBV_EVENT_QP_ACCESS_ERR);
        SendNak(l, h.seq, IBV_WC_REM_ACCESS_ERR);
        l->rx_dead = true;
        l->in_discard = true;
        QpToErrorLocked(qp, IBV_WC_WR_FLUSH_ERR);
        return true;
      }
      if (h.flags & kFlagImm) {
        bool refused;
        if (!TakeRecv(l, qp, &refused)) return false;
        if (refused) {
          l->in_discard = true;
          return true;
        }
      }
      if (dst != nullptr && !placed) l->in_target.push_back({dst, h.len});
      return true;
    }
    case kFrameShare:
      if (h.len != kShareBodySize) {
        ProtocolError(l, "share frame of the wrong size");
        return true;
      }
      l->in_target.push_back({l->in_share, kShareBodySize});
      return true;
    case kFrameUnshare:
      if (h.len != 0) ProtocolError(l, "unshare frame with payload");
      return true;
    case kFrameReadReq: {
      if (h.len != 0) {
        ProtocolError(l, "read request with payload");
        return true;
      }
      // A placed READ's bytes were copied by the requester already
      // (sv_onecopy.cc): it is checked as any READ, and if it names a
      // readable share of ours, its response carries no bytes. One whose
      // share was closed since (its rights changed, though perhaps not
      // the right to read) but that may still read is answered with its
      // bytes, as through the ring.
      bool placed = (h.flags & kFlagPlaced) != 0;
      if (placed && h.aux == 0) {
        ProtocolError(l, "placed read of no bytes");
        return true;
      }
      char* src = h.aux == 0 ? nullptr
                             : CheckRemote(qp, h.rkey, h.addr, h.aux, IBV_ACCESS_REMOTE_READ);
      if (placed && src != nullptr && !LinkSharedWith(l, h.rkey, h.pad, true)) placed = false;
      if (h.aux != 0 && src == nullptr) {
        RaiseQpEvent(&qp->qp, IBV_EVENT_QP_ACCESS_ERR);  // first, as for a write
        SendNak(l, h.seq, IBV_WC_REM_ACCESS_ERR);
        l->rx_dead = true;
        QpToErrorLocked(qp, IBV_WC_WR_FLUSH_ERR);
        return true;
      }
      FlushAck(l);
      OutFrame f;
      f.hdr.type = kFrameReadResp;
      f.hdr.seq = h.seq;
      if (placed) {
        f.hdr.flags = kFlagPlaced;
        f.hdr.aux = h.aux;
      } else {
        f.hdr.len = h.aux;
        if (src != nullptr) f.iov.push_back({src, h.aux});
      }
      LinkEnqueue(l, std::move(f));
      CountRx(qp->device->index, kStatRead, h.aux);
      return true;
    }
    case kFrameReadResp: {
      if (h.seq == 0 || h.seq >= qp->next_seq) {
        ProtocolError(l, "read response for a request never sent");
        return true;
      }
      // Placed: the bytes are in the READ's memory already; a response
      // may say so only of a READ that went so, or a peer could have a
      // READ completed with none of its bytes. A response with bytes is
      // taken for any READ (a placed one whose share closed meanwhile is
      // answered so; its bytes are written again).
      const bool placed = (h.flags & kFlagPlaced) != 0;
      const bool sent_placed = LinkTakePlacedRead(l, h.seq);
      if (placed && h.len != 0) {
        ProtocolError(l, "placed read response with payload");
        return true;
      }
      const uint64_t bytes = placed ? h.aux : h.len;
      AckUpTo(qp, h.seq - 1);
      if (qp->sq.empty() || !qp->sq.front().queued || qp->sq.front().seq != h.seq ||
          qp->sq.front().opcode != IBV_WR_RDMA_READ || qp->sq.front().length != bytes) {
        if (qp->qp.state == IBV_QPS_ERR) {
          l->in_discard = true;
          return true;
        }
        ProtocolError(l, "read response for no outstanding read");
        return true;
      }
      if (placed && !sent_placed) {
        ProtocolError(l, "placed read response for a read sent for its bytes");
        return true;
      }
      if (!placed) l->in_target = SgeIov(qp->sq.front().sge, h.len);
      return true;
    }
    case kFrameAck:
    case kFrameNak:
    case kFrameDisconnect:
      if (h.len != 0) ProtocolError(l, "control frame with payload");
      return true;
    default:
      ProtocolError(l, "unknown frame type");
      return true;
  }
}

void QpHandleFrameEnd(Link* l) {
  Qp* qp = l->qp;
  FrameHdr& h = l->in_hdr;
  if (h.type == kFrameDisconnect) {
    CmDisconnectFrame(l);
    return;
  }
  if (qp == nullptr || l->state != LinkState::kUp) return;
  switch (h.type) {
    case kFrameSend:
    case kFrameWrite:
      if (l->in_discard) {
        if (l->in_has_recv) {
          l->in_has_recv = false;
          qp->rq.push_front(std::move(l->in_recv));
        }
        return;
      }
      if (l->in_has_recv) {
        CompleteRecv(qp, l->in_recv, IBV_WC_SUCCESS, &h);
        l->in_has_recv = false;
      }
      CountRx(qp->device->index,
              h.type == kFrameSend ? kStatRecv : (h.flags & kFlagImm ? kStatWriteImm : kStatWrite),
              FrameBytes(h));
      // Acknowledged when this receive pass ends (QpRxPassDone): a burst
      // gets one cumulative ACK.
      l->ack_seq = h.seq;
      l->ack_pending = true;
      return;
    case kFrameReadReq:
      return;
    case kFrameShare:
    case kFrameUnshare:
      if (h.type == kFrameUnshare || !l->in_discard)
        LinkHandleShare(l, h, l->in_share, h.type == kFrameShare ? kShareBodySize : 0);
      return;
    case kFrameReadResp:
      if (!l->in_discard && !qp->sq.empty() && qp->sq.front().seq == h.seq &&
          qp->sq.front().opcode == IBV_WR_RDMA_READ) {
        CompleteSend(qp, qp->sq.front(), IBV_WC_SUCCESS, false);
        qp->sq.pop_front();
        AckUpTo(qp, h.seq);
      }
      return;
    case kFrameAck:
      if (h.seq >= qp->next_seq) {
        ProtocolError(l, "ACK for a request never sent");
        return;
      }
      if (qp->qp.state != IBV_QPS_ERR) AckUpTo(qp, h.seq);
      return;
    case kFrameNak:
      if (h.seq == 0 || h.seq >= qp->next_seq) {
        ProtocolError(l, "NAK for a request never sent");
        return;
      }
      if (qp->qp.state == IBV_QPS_ERR) return;
      AckUpTo(qp, h.seq - 1);
      if (qp->sq.empty() || qp->sq.front().seq != h.seq) {
        ProtocolError(l, "NAK for no outstanding request");
        return;
      }
      if (h.aux == 0 || h.aux > IBV_WC_GENERAL_ERR) h.aux = IBV_WC_REM_OP_ERR;
      QpToErrorLocked(qp, static_cast<ibv_wc_status>(h.aux));
      return;
    default:
      return;
  }
}

void QpRxPassDone(Link* l) {
  if (l->state == LinkState::kUp) FlushAck(l);
}

// --------------------------------------------------------- state changes ---

void RaiseQpEvent(ibv_qp* qp, ibv_event_type type) {
  if (qp == nullptr || qp->context == nullptr) return;
  ibv_async_event ev{};
  ev.element.qp = qp;
  ev.event_type = type;
  (void)!write(ToCtx(qp->context)->async_pipe[1], &ev, sizeof(ev));
}

void QpToErrorLocked(Qp* qp, ibv_wc_status head_status) {
  qp->qp.state = IBV_QPS_ERR;
  bool first = true;
  while (!qp->sq.empty()) {
    ibv_wc_status st = first ? head_status : IBV_WC_WR_FLUSH_ERR;
    CompleteSend(qp, qp->sq.front(), st, true);
    qp->sq.pop_front();
    first = false;
  }
  if (Link* l = qp->link) {
    if (l->in_has_recv) {
      CompleteRecv(qp, l->in_recv, IBV_WC_WR_FLUSH_ERR, nullptr);
      l->in_has_recv = false;
    }
    // Whatever is still arriving for a frame in progress (a receive, a
    // write, a read response) must not land in memory the application
    // now gets back: drop it.
    if (l->in_payload && l->in_begun) {
      l->in_target.clear();
      l->in_discard = true;
    }
    // Frames still to be sent may point at memory the application gets
    // back with the flush: keep only what owns its bytes, and finish the
    // frame in progress from a copy so the stream stays framed.
    Ring<OutFrame> keep;
    for (size_t i = 0; i < l->out.size(); ++i) {
      OutFrame& f = l->out[i];
      if (i == 0 && f.sent > 0) {
        if (!f.iov.empty()) {
          Bytes copy;
          for (const iovec& v : f.iov) copy.append(static_cast<char*>(v.iov_base), v.iov_len);
          f.iov.clear();
          f.owned = std::move(copy);
        }
        keep.push_back(std::move(f));
      } else if (f.iov.empty() && f.hdr.type != kFrameSend && f.hdr.type != kFrameWrite &&
                 f.hdr.type != kFrameReadReq) {
        keep.push_back(std::move(f));
      }
    }
    l->out.swap(keep);
  }
  while (!qp->rq.empty()) {
    CompleteRecv(qp, qp->rq.front(), IBV_WC_WR_FLUSH_ERR, nullptr);
    qp->rq.pop_front();
  }
  // A QP in error serves no WRITE: the peer places into none of its MRs.
  if (qp->link != nullptr && qp->link->state == LinkState::kUp) LinkSyncSharesLocked(qp->link);
}

void QpLinkUpLocked(Qp* qp) {
  qp->link_deadline_us = 0;
  if (qp->link != nullptr) LinkSyncSharesLocked(qp->link);
  QueueFramesLocked(qp);
  if (qp->link != nullptr) Rt().ProgressLinkLocked(qp->link);
}

void QpLinkDeadLocked(Qp* qp, bool) {
  if (qp->qp.state != IBV_QPS_RTR && qp->qp.state != IBV_QPS_RTS && qp->qp.state != IBV_QPS_SQD)
    return;
  // As on hardware, a QP learns that its peer is gone when it has something
  // to send: outstanding requests fail at once, an idle QP stays as it is
  // (its receives stay posted) and fails on its next send. Connections under
  // RDMA CM go to error with DISCONNECTED instead (sv_cm_protocol.cc).
  if (qp->cm_managed || !qp->sq.empty()) QpToErrorLocked(qp, IBV_WC_RETRY_EXC_ERR);
}

namespace {

bool Initiates(Qp* qp) {
  uint32_t mine = ntohl(qp->device->spec.addr.s_addr);
  uint32_t theirs = ntohl(qp->peer_addr.s_addr);
  if (mine != theirs) return mine < theirs;
  return qp->qp.qp_num < qp->dest_qpn;
}

uint64_t RetryBudgetUs(Qp* qp) {
  if (qp->timeout == 0) return 0;  // infinite
  double t = 4.096 * static_cast<double>(1ULL << std::min<int>(qp->timeout, 31));
  uint64_t us = static_cast<uint64_t>(t * (qp->retry_cnt + 1));
  return std::max<uint64_t>(us, 3000000);  // peers here may be slow to start
}

}  // namespace

void QpTimersLocked(Qp* qp, uint64_t now) {
  if (qp->cm_managed || qp->qp.state != IBV_QPS_RTS) {
    if (!(qp->qp.state == IBV_QPS_RTR && !qp->cm_managed)) return;
  }
  bool up = qp->link != nullptr && qp->link->state == LinkState::kUp;
  if (up) return;
  if (qp->link != nullptr && qp->link->state == LinkState::kDead) return;
  if (qp->link == nullptr && Initiates(qp) && now >= qp->next_connect_us)
    QpTryConnectLocked(qp);
  if (qp->sq.empty() || qp->qp.state != IBV_QPS_RTS) return;
  uint64_t budget = RetryBudgetUs(qp);
  if (budget == 0) return;
  if (qp->link_deadline_us == 0) {
    qp->link_deadline_us = now + budget;
  } else if (now > qp->link_deadline_us) {
    Trace("qpn 0x%x: peer qpn 0x%x never answered; retries exhausted", qp->qp.qp_num,
          qp->dest_qpn);
    qp->link_deadline_us = 0;
    QpToErrorLocked(qp, IBV_WC_RETRY_EXC_ERR);
  }
}

// ------------------------------------------------------------- data path ---

int PostSend(ibv_qp* ibqp, ibv_send_wr* wr, ibv_send_wr** bad) {
  Qp* qp = ToQp(ibqp);
  const Config& cfg = GetConfig();
  std::vector<Prefaulted> prefaulted;  // allocates only for ODP elements
  PrefaultOdp(qp, wr, &prefaulted);
  size_t prefaulted_read = 0;
  int wr_index = -1;
  std::lock_guard<std::mutex> g(Rt().mu);
  DeviceWork work;  // frames into the wire: an HCA's work (after the lock: no waiting in it)
  for (; wr != nullptr; wr = wr->next) {
    ++wr_index;
    int err = 0;
    if (qp->qp.state != IBV_QPS_RTS && qp->qp.state != IBV_QPS_ERR) err = EINVAL;
    else if (wr->num_sge < 0 || wr->num_sge > static_cast<int>(qp->cap.max_send_sge)) err = EINVAL;
    else if (qp->sq.size() >= qp->cap.max_send_wr) err = ENOMEM;
    else if (wr->opcode != IBV_WR_SEND && wr->opcode != IBV_WR_SEND_WITH_IMM &&
             wr->opcode != IBV_WR_RDMA_WRITE && wr->opcode != IBV_WR_RDMA_WRITE_WITH_IMM &&
             wr->opcode != IBV_WR_RDMA_READ)
      err = EINVAL;
    else if ((wr->send_flags & IBV_SEND_INLINE) && wr->opcode == IBV_WR_RDMA_READ) err = EINVAL;
    if (err != 0) {
      if (bad) *bad = wr;
      return err;
    }
    SendWr s;
    s.wr_id = wr->wr_id;
    s.opcode = wr->opcode;
    s.flags = wr->send_flags;
    s.imm = wr->imm_data;
    s.signaled = qp->sq_sig_all || (wr->send_flags & IBV_SEND_SIGNALED);
    if (wr->opcode != IBV_WR_SEND && wr->opcode != IBV_WR_SEND_WITH_IMM) {
      s.remote_addr = wr->wr.rdma.remote_addr;
      s.rkey = wr->wr.rdma.rkey;
    }
    if (wr->send_flags & IBV_SEND_INLINE) {
      for (int i = 0; i < wr->num_sge; ++i)
        s.inline_data.append(reinterpret_cast<const char*>(wr->sg_list[i].addr),
                             wr->sg_list[i].length);
      if (s.inline_data.size() > qp->cap.max_inline_data) {
        if (bad) *bad = wr;
        return EINVAL;
      }
      s.length = s.inline_data.size();
    } else {
      s.sge.assign(wr->sg_list, wr->sg_list + wr->num_sge);
      if (!CheckLocal(qp, wr->sg_list, wr->num_sge, wr->opcode == IBV_WR_RDMA_READ, &s.length,
                      &prefaulted, wr_index, &prefaulted_read))
        s.fail_status = IBV_WC_LOC_PROT_ERR;
    }
    if (s.length > 0x80000000ULL) s.fail_status = IBV_WC_LOC_LEN_ERR;
    s.seq = qp->next_seq++;
    if (qp->qp.state == IBV_QPS_ERR) {  // as on hardware: accepted, then flushed
      CompleteSend(qp, s, IBV_WC_WR_FLUSH_ERR, true);
      continue;
    }
    ++qp->ops_posted;
    if (cfg.fail_wr != 0 && static_cast<long>(qp->ops_posted) == cfg.fail_wr) {
      Trace("fault: WR %ld of qpn 0x%x fails", cfg.fail_wr, qp->qp.qp_num);
      s.fail_status = cfg.fail_status;
    }
    if (cfg.drop_after_ops != 0 && static_cast<long>(qp->ops_posted) == cfg.drop_after_ops)
      s.drop_link = true;
    qp->sq.push_back(std::move(s));
  }
  if (qp->link != nullptr && qp->link->state == LinkState::kDead && !qp->sq.empty()) {
    QpToErrorLocked(qp, IBV_WC_RETRY_EXC_ERR);  // the peer went away while idle
    return 0;
  }
  QueueFramesLocked(qp);
  if (qp->link != nullptr && qp->link->state == LinkState::kUp) LinkPump(qp->link);
  else Rt().Wake();
  return 0;
}

// ------------------------------------------------- extended post API ---

namespace {

Qp* OfQpEx(ibv_qp_ex* q) { return reinterpret_cast<Qp*>(q); }

ibv_send_wr* NewWr(ibv_qp_ex* q, ibv_wr_opcode op) {
  Qp* qp = OfQpEx(q);
  qp->batch.emplace_back();
  ibv_send_wr* w = &qp->batch.back().wr;
  w->wr_id = q->wr_id;
  w->send_flags = q->wr_flags;
  w->opcode = op;
  return w;
}
// The WR the last ibv_wr_* opened, or none (an error at wr_complete).
PendingWr* Last(ibv_qp_ex* q) {
  Qp* qp = OfQpEx(q);
  if (qp->batch.empty()) {
    qp->batch_error = EINVAL;
    return nullptr;
  }
  return &qp->batch.back();
}

void WrStart(ibv_qp_ex* q) {
  OfQpEx(q)->batch.clear();
  OfQpEx(q)->batch_error = 0;
}
void WrSend(ibv_qp_ex* q) { NewWr(q, IBV_WR_SEND); }
void WrSendImm(ibv_qp_ex* q, __be32 imm) { NewWr(q, IBV_WR_SEND_WITH_IMM)->imm_data = imm; }
void WrRdma(ibv_qp_ex* q, ibv_wr_opcode op, uint32_t rkey, uint64_t addr, __be32 imm) {
  ibv_send_wr* w = NewWr(q, op);
  w->wr.rdma.rkey = rkey;
  w->wr.rdma.remote_addr = addr;
  w->imm_data = imm;
}
void WrRdmaWrite(ibv_qp_ex* q, uint32_t rkey, uint64_t addr) {
  WrRdma(q, IBV_WR_RDMA_WRITE, rkey, addr, 0);
}
void WrRdmaWriteImm(ibv_qp_ex* q, uint32_t rkey, uint64_t addr, __be32 imm) {
  WrRdma(q, IBV_WR_RDMA_WRITE_WITH_IMM, rkey, addr, imm);
}
void WrRdmaRead(ibv_qp_ex* q, uint32_t rkey, uint64_t addr) {
  WrRdma(q, IBV_WR_RDMA_READ, rkey, addr, 0);
}
void WrSetSge(ibv_qp_ex* q, uint32_t lkey, uint64_t addr, uint32_t length) {
  if (PendingWr* p = Last(q)) p->sge.assign(1, ibv_sge{addr, length, lkey});
}
void WrSetSgeList(ibv_qp_ex* q, size_t n, const ibv_sge* list) {
  if (PendingWr* p = Last(q)) p->sge.assign(list, list + n);
}
void WrSetInlineData(ibv_qp_ex* q, void* addr, size_t length) {
  if (PendingWr* p = Last(q)) {
    p->inline_data.assign(static_cast<const char*>(addr), static_cast<const char*>(addr) + length);
    p->wr.send_flags |= IBV_SEND_INLINE;
  }
}
void WrSetInlineDataList(ibv_qp_ex* q, size_t n, const ibv_data_buf* list) {
  if (PendingWr* p = Last(q)) {
    p->inline_data.clear();
    for (size_t i = 0; i < n; ++i)
      p->inline_data.append(static_cast<const char*>(list[i].addr), list[i].length);
    p->wr.send_flags |= IBV_SEND_INLINE;
  }
}
// What a QP made without them is asked for (atomics, memory windows, UD
// addressing, ...): refused at wr_complete.
void Unsupported(ibv_qp_ex* q) { OfQpEx(q)->batch_error = EOPNOTSUPP; }

int WrComplete(ibv_qp_ex* q) {
  Qp* qp = OfQpEx(q);
  std::vector<PendingWr> batch;
  batch.swap(qp->batch);
  int err = qp->batch_error;
  qp->batch_error = 0;
  if (err != 0) return err;
  if (batch.empty()) return 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    PendingWr& p = batch[i];
    if (p.wr.send_flags & IBV_SEND_INLINE) {
      p.sge.assign(1, ibv_sge{reinterpret_cast<uint64_t>(p.inline_data.data()),
                              static_cast<uint32_t>(p.inline_data.size()), 0});
    }
    p.wr.sg_list = p.sge.data();
    p.wr.num_sge = static_cast<int>(p.sge.size());
    p.wr.next = i + 1 < batch.size() ? &batch[i + 1].wr : nullptr;
  }
  ibv_send_wr* bad = nullptr;
  return PostSend(&qp->qp, &batch[0].wr, &bad);
}

}  // namespace

void EnableQpEx(Qp* qp) {
  ibv_qp_ex& x = qp->qpx;
  qp->ex = true;
  x.wr_start = WrStart;
  x.wr_complete = WrComplete;
  x.wr_abort = WrStart;  // an abort drops the batch, as a new start does
  x.wr_send = WrSend;
  x.wr_send_imm = WrSendImm;
  x.wr_rdma_write = WrRdmaWrite;
  x.wr_rdma_write_imm = WrRdmaWriteImm;
  x.wr_rdma_read = WrRdmaRead;
  x.wr_set_sge = WrSetSge;
  x.wr_set_sge_list = WrSetSgeList;
  x.wr_set_inline_data = WrSetInlineData;
  x.wr_set_inline_data_list = WrSetInlineDataList;
  x.wr_atomic_cmp_swp = [](ibv_qp_ex* q, uint32_t, uint64_t, uint64_t, uint64_t) {
    Unsupported(q);
  };
  x.wr_atomic_fetch_add = [](ibv_qp_ex* q, uint32_t, uint64_t, uint64_t) { Unsupported(q); };
  x.wr_bind_mw = [](ibv_qp_ex* q, ibv_mw*, uint32_t, const ibv_mw_bind_info*) {
    Unsupported(q);
  };
  x.wr_local_inv = [](ibv_qp_ex* q, uint32_t) { Unsupported(q); };
  x.wr_send_inv = [](ibv_qp_ex* q, uint32_t) { Unsupported(q); };
  x.wr_send_tso = [](ibv_qp_ex* q, void*, uint16_t, uint16_t) { Unsupported(q); };
  x.wr_set_ud_addr = [](ibv_qp_ex* q, ibv_ah*, uint32_t, uint32_t) { Unsupported(q); };
  x.wr_set_xrc_srqn = [](ibv_qp_ex* q, uint32_t) { Unsupported(q); };
  x.wr_atomic_write = [](ibv_qp_ex* q, uint32_t, uint64_t, const void*) { Unsupported(q); };
}

int PostRecv(ibv_qp* ibqp, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  Qp* qp = ToQp(ibqp);
  std::lock_guard<std::mutex> g(Rt().mu);
  for (; wr != nullptr; wr = wr->next) {
    int err = 0;
    if (qp->qp.state == IBV_QPS_RESET || qp->qp.srq != nullptr) err = EINVAL;
    else if (wr->num_sge < 0 || wr->num_sge > static_cast<int>(qp->cap.max_recv_sge)) err = EINVAL;
    else if (qp->rq.size() >= qp->cap.max_recv_wr) err = ENOMEM;
    if (err != 0) {
      if (bad) *bad = wr;
      return err;
    }
    RecvWr r;
    r.wr_id = wr->wr_id;
    r.sge.assign(wr->sg_list, wr->sg_list + wr->num_sge);
    if (qp->qp.state == IBV_QPS_ERR) {
      CompleteRecv(qp, r, IBV_WC_WR_FLUSH_ERR, nullptr);
      continue;
    }
    qp->rq.push_back(std::move(r));
  }
  // A sender may be waiting in RNR for exactly this receive.
  if (qp->link != nullptr && qp->link->in_payload && !qp->link->in_begun)
    Rt().ProgressLinkLocked(qp->link);
  return 0;
}

// -------------------------------------------------------- modify / query ---

namespace {

bool HasAll(int mask, int need) { return (mask & need) == need; }

int CheckTransition(ibv_qp_state cur, ibv_qp_state next, int mask) {
  if (next == IBV_QPS_RESET || next == IBV_QPS_ERR) return 0;
  switch (cur) {
    case IBV_QPS_RESET:
      if (next != IBV_QPS_INIT) return EINVAL;
      return HasAll(mask, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)
                 ? 0 : EINVAL;
    case IBV_QPS_INIT:
      if (next == IBV_QPS_INIT) return 0;
      if (next != IBV_QPS_RTR) return EINVAL;
      return HasAll(mask, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                              IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                              IBV_QP_MIN_RNR_TIMER)
                 ? 0 : EINVAL;
    case IBV_QPS_RTR:
      if (next != IBV_QPS_RTS) return EINVAL;
      return HasAll(mask, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                              IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC)
                 ? 0 : EINVAL;
    case IBV_QPS_RTS:
    case IBV_QPS_SQD:
      return (next == IBV_QPS_RTS || next == IBV_QPS_SQD) ? 0 : EINVAL;
    default:
      return EINVAL;
  }
}

}  // namespace

int ModifyQpLocked(Qp* qp, ibv_qp_attr* attr, int mask) {
  ibv_qp_state cur = qp->qp.state;
  ibv_qp_state next = (mask & IBV_QP_STATE) ? attr->qp_state : cur;
  if ((mask & IBV_QP_CUR_STATE) && attr->cur_qp_state != cur) return EINVAL;
  if (int e = CheckTransition(cur, next, mask)) return e;
  if ((mask & IBV_QP_PORT) && attr->port_num != 1) return EINVAL;
  if ((mask & IBV_QP_PATH_MTU) && (attr->path_mtu < IBV_MTU_256 || attr->path_mtu > IBV_MTU_4096))
    return EINVAL;
  if ((mask & IBV_QP_RNR_RETRY) && attr->rnr_retry > 7) return EINVAL;
  if ((mask & IBV_QP_RETRY_CNT) && attr->retry_cnt > 7) return EINVAL;
  if ((mask & IBV_QP_TIMEOUT) && attr->timeout > 31) return EINVAL;
  if ((mask & IBV_QP_MIN_RNR_TIMER) && attr->min_rnr_timer > 31) return EINVAL;
  if ((mask & IBV_QP_DEST_QPN) && !qp->cm_managed && attr->dest_qp_num >> 24) return EINVAL;
  in_addr peer{};
  if ((mask & IBV_QP_AV) && !qp->cm_managed && !PeerAddrFromAh(qp->device, attr->ah_attr, &peer))
    return EINVAL;
  if (mask & IBV_QP_ACCESS_FLAGS) qp->access = attr->qp_access_flags;
  if (mask & IBV_QP_PKEY_INDEX) qp->pkey_index = attr->pkey_index;
  if (mask & IBV_QP_PATH_MTU) qp->path_mtu = attr->path_mtu;
  if (mask & IBV_QP_TIMEOUT) qp->timeout = attr->timeout;
  if (mask & IBV_QP_RETRY_CNT) qp->retry_cnt = attr->retry_cnt;
  if (mask & IBV_QP_RNR_RETRY) qp->rnr_retry = attr->rnr_retry;
  if (mask & IBV_QP_MIN_RNR_TIMER) qp->min_rnr_timer = attr->min_rnr_timer;
  if (mask & IBV_QP_SQ_PSN) qp->sq_psn = attr->sq_psn;
  if (mask & IBV_QP_RQ_PSN) qp->rq_psn = attr->rq_psn;
  if (mask & IBV_QP_MAX_QP_RD_ATOMIC) qp->max_rd_atomic = attr->max_rd_atomic;
  if (mask & IBV_QP_MAX_DEST_RD_ATOMIC) qp->max_dest_rd_atomic = attr->max_dest_rd_atomic;
  if (mask & IBV_QP_DEST_QPN) qp->dest_qpn = attr->dest_qp_num;
  if (mask & IBV_QP_AV) {
    qp->ah = attr->ah_attr;
    if (!qp->cm_managed) qp->peer_addr = peer;
  }
  qp->qp.state = next;
  if (next == IBV_QPS_ERR && cur != IBV_QPS_ERR) {
    QpToErrorLocked(qp, IBV_WC_WR_FLUSH_ERR);
  } else if (next == IBV_QPS_RESET) {
    qp->sq.clear();
    qp->rq.clear();
    // Its completions still in the CQs go too (the flushes of its last
    // error, say), as rdma-core's providers clean the CQ at reset: a QP
    // brought back to RTS must not find them first.
    for (Cq* cq : {qp->scq, qp->rcq == qp->scq ? nullptr : qp->rcq}) {
      if (cq == nullptr) continue;
      std::lock_guard<std::mutex> cg(cq->mu);
      cq->entries.RemoveIf([&](const ibv_wc& wc) { return wc.qp_num == qp->qp.qp_num; });
    }
    if (qp->link != nullptr) {
      Link* l = qp->link;
      l->qp = nullptr;
      qp->link = nullptr;
      LinkKill(l);
    }
    qp->next_seq = 1;
  } else if (next == IBV_QPS_RTR && cur == IBV_QPS_INIT && !qp->cm_managed) {
    qp->next_connect_us = 0;
    Rt().Wake();
  } else if (next == IBV_QPS_RTS && cur == IBV_QPS_RTR) {
    QueueFramesLocked(qp);
  }
  // Rights and state decide what the peer may place into (sv_onecopy.cc).
  if (qp->link != nullptr && qp->link->state == LinkState::kUp) LinkSyncSharesLocked(qp->link);
  return 0;
}

}  // namespace softverbs
