// Completion queues and completion channels.
//
// A completion channel's fd is pollable, honours O_NONBLOCK and a thread
// blocked in ibv_get_cq_event can be cancelled, as with the kernel's. It is
// an epoll set (see CompChannel in sv_internal.h): the event tokens' socket,
// plus the waiter doorbells of the wires whose completions it reports, from
// their CQ's first arm on, so the waiting thread is woken by the peer's
// doorbell itself (which the peer rings instead of the agent's while the CQ
// is armed).
#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "sv_internal.h"

namespace softverbs {

namespace {

// A QP's wire may wake the channel's waiter when both of the QP's CQs
// report to that channel: whatever the frames complete, the waiter is the
// one to hear of it.
// Shared-memory wires with a waiter doorbell only: its socket carries
// nothing but doorbells, which moving the wire always reads, so the waiter
// never spins on a socket left readable (a TCP wire's data stays unread
// while the receiver waits for a posted receive or a delay knob holds it).
bool DelegableTo(const Qp* qp, const ibv_comp_channel* ch) {
  const Link* l = qp->link;
  return l != nullptr && l->state == LinkState::kUp && l->shm != nullptr && l->wdb_fd >= 0 &&
         qp->scq != nullptr &&
         qp->rcq != nullptr && qp->scq->cq.channel == ch && qp->rcq->cq.channel == ch;
}

// A thread of the application (a waiter on the channel, a poll) moves
// frames of a wire's backlog itself until it has moved
// kWaiterMovesAtMost bytes, none with a payload above kWaiterFrameAtMost
// (a mid-size message that a unary call waits for is copied on the thread
// that then handles it, without waking the agent), and hands the rest of
// the wire to the agent, which moves it while the application's thread
// goes on with what it already has (two cores at work on a stream or a
// bulk transfer instead of one). The frame limit takes a message written
// whole into one of grpc-rdma's standing grants (up to 512 KiB) with
// gRPC's framing past a power of two: at 256 KiB, a 256 KiB unary call's
// message (a few bytes over) went to the agent, a thread wake-up more on
// each side (docs/performance.md).
constexpr uint64_t kWaiterMovesAtMost = 64 * 1024;
constexpr uint64_t kWaiterFrameAtMost = 576 * 1024;

// Caller holds Runtime::mu. The peer rings the waiter's doorbell from now
// until the CQ's event (or more work than a waiter takes) clears the word.
// The TCP socket and the agent's doorbell stay with the agent: the TCP
// socket carries the peer's death, which the agent handles.
void LinkDelegate(Link* l, CompChannel* ch) {
  if (l->delegated_to != ch) {
    LinkUndelegate(l);
    epoll_event ev{};
    ev.events = EPOLLIN;  // level-triggered: wakes until the doorbell is read
    if (EpollCtl(ch->ch.fd, EPOLL_CTL_ADD, l->wdb_fd, &ev) != 0) return;
    l->delegated_to = ch;
    ch->delegated.push_back(l);
    ch->n_delegated.store(static_cast<int>(ch->delegated.size()), std::memory_order_relaxed);
  }
  LinkSetWaiter(l, true);
}

}  // namespace

// The channel this thread is driving in ibv_get_cq_event, and the first
// event that drive raised: it goes straight back to the caller, without a
// token through the socket (whose write would also wake the other threads
// waiting on the channel, for an event they cannot have).
thread_local CompChannel* tls_driving = nullptr;
thread_local ibv_cq* tls_direct_event = nullptr;

void LinkUndelegate(Link* l) {
  CompChannel* ch = l->delegated_to;
  if (ch == nullptr) return;
  l->delegated_to = nullptr;
  LinkSetWaiter(l, false);
  if (l->wdb_fd >= 0) EpollCtl(ch->ch.fd, EPOLL_CTL_DEL, l->wdb_fd, nullptr);
  ch->delegated.erase(std::remove(ch->delegated.begin(), ch->delegated.end(), l),
                      ch->delegated.end());
  ch->n_delegated.store(static_cast<int>(ch->delegated.size()), std::memory_order_relaxed);
}

void PushCqe(Cq* cq, const ibv_wc& wc, bool solicited) {
  if (cq == nullptr) return;
  bool notify = false;
  {
    std::lock_guard<std::mutex> g(cq->mu);
    if (static_cast<int>(cq->entries.size()) >= cq->cq.cqe) {
      if (!cq->overrun) Warn("CQ %p overrun (%d entries): completion lost", (void*)cq, cq->cq.cqe);
      cq->overrun = true;
      return;
    }
    cq->entries.push_back(wc);
    if (cq->armed && (!cq->solicited_only || solicited || wc.status != IBV_WC_SUCCESS)) {
      cq->armed = false;
      notify = cq->cq.channel != nullptr;
    }
  }
  if (notify) {
    // The CQ is disarmed: its owner will poll before it arms again, so the
    // peers ring the agent again (a program that takes an event and then
    // leaves its QPs alone is served at once, as by an HCA). Doorbells
    // rung for the waiter meanwhile are read now: left, they would wake
    // the channel's next wait for nothing.
    bool wake = false;
    for (Qp* qp : cq->qps) {
      Link* l = qp->link;
      if (l == nullptr) continue;
      if (l->delegated_to != nullptr) {
        // The agent takes what is behind this frame, beside the thread
        // that handles this event: frames that rang the waiter while the
        // caller moved this one (when the agent's doorbell and the
        // waiter's were one socket, the agent was woken for them), or, at
        // a receive, a message of up to kWaiterFrameAtMost already on its
        // way. Not for a bulk WRITE placed by the peer: it leaves nothing
        // to copy here, and an agent woken for it only takes a core from
        // the peer placing the next one (docs/performance.md).
        bool rung = LinkSetWaiter(l, false);
        wake |= !OnAgentThread() &&
                (rung || ((wc.opcode & IBV_WC_RECV) && LinkRxNextIsMessage(l, kWaiterFrameAtMost)));
      }
      if (qp->scq == cq) LinkSetLazyAcks(l, false);
    }
    if (wake) Runtime::Get().Wake();
    auto* ch = reinterpret_cast<CompChannel*>(cq->cq.channel);
    if (tls_driving == ch && tls_direct_event == nullptr) {
      tls_direct_event = &cq->cq;
      return;
    }
    {
      std::lock_guard<std::mutex> g(ch->mu);
      ch->events.push_back(&cq->cq);
    }
    char token = 1;
    if (send(ch->wfd, &token, 1, MSG_DONTWAIT | MSG_NOSIGNAL) != 1) {
      size_t unread;
      {
        std::lock_guard<std::mutex> g(ch->mu);
        --ch->surplus;  // an event without its token
        unread = ch->events.size();
      }
      Warn("completion channel %d: %zu events unread, event token dropped", ch->ch.fd, unread);
    }
  }
}

int PollCq(ibv_cq* ibcq, int n, ibv_wc* wc) {
  Cq* cq = ToCq(ibcq);
  bool armed = false;
  auto take = [&] {
    std::lock_guard<std::mutex> g(cq->mu);
    armed = cq->armed;
    int got = 0;
    while (got < n && !cq->entries.empty()) {
      wc[got++] = cq->entries.front();
      cq->entries.pop_front();
    }
    return got;
  };
  int got = take();
  if (got > 0 || n <= 0) return got;
  // Progress on poll: an application that busy-polls drives its own QPs'
  // wires, without a hop through the agent thread.
  Runtime& rt = Runtime::Get();
  if (rt.agent_waiting.load(std::memory_order_relaxed) != 0) return 0;
  std::unique_lock<std::mutex> lk(rt.mu, std::try_to_lock);
  if (!lk.owns_lock()) return 0;
  bool did = false, left = false;
  {
    DeviceWork work;
    uint64_t now = NowUs();
    for (Qp* qp : cq->qps) {
      Link* l = qp->link;
      if (l == nullptr || l->state != LinkState::kUp) continue;
      // An armed CQ's owner is about to sleep on its channel: producers must
      // keep ringing the doorbell (see ReqNotifyCq).
      if (!armed) LinkMarkPolled(l, now);
      // As a waiter does (DriveDelegated): a share, the rest to the agent.
      l->rx_budget = kWaiterMovesAtMost;
      l->rx_frame_max = kWaiterFrameAtMost;
      did |= rt.ProgressLinkLocked(l);
      l->rx_budget = l->rx_frame_max = UINT64_MAX;
      // Stopped by those limits, the rest is the agent's: woken, as the
      // doorbell the peer skipped for a polled ring would have woken it (a
      // sleeping agent finds the data; one between passes would wait its
      // millisecond timer for a frame nobody has begun). A frame that
      // cannot go yet (a delay knob) wakes it only if it sleeps, once per
      // sleep: it may sleep for 200 ms otherwise.
      left |= l->rx_limited || (l->in_payload && !l->in_begun && LinkAgentSleeping(l));
    }
  }
  lk.unlock();
  if (left) rt.Wake();
  return did ? take() : 0;
}

int ReqNotifyCq(ibv_cq* ibcq, int solicited_only) {
  Cq* cq = ToCq(ibcq);
  Runtime& rt = Runtime::Get();
  std::lock_guard<std::mutex> g(rt.mu);  // no completion slips in between
  DeviceWork work;
  {
    std::lock_guard<std::mutex> gc(cq->mu);
    cq->armed = true;
    cq->solicited_only = solicited_only != 0;
  }
  if (cq->cq.channel != nullptr && GetConfig().direct_wake) {
    auto* ch = reinterpret_cast<CompChannel*>(cq->cq.channel);
    for (Qp* qp : cq->qps)
      if (DelegableTo(qp, cq->cq.channel)) LinkDelegate(qp->link, ch);
  }
  // Arming is how a program says it stops polling and will sleep on the
  // channel. Producers skip the doorbell while the consumer polled within
  // kPollGraceUs, and the agent then only looks every millisecond: forget
  // the polls, so every frame from now on rings (a frame that slipped in
  // before this is found by the poll programs make after arming, or by the
  // agent). Without this a message could wait ~1 ms for the agent's timer.
  for (Qp* qp : cq->qps) {
    LinkForgetPolls(qp->link);
    if (qp->scq != cq) continue;
    LinkSetLazyAcks(qp->link, solicited_only != 0);
    // Armed for every completion now: acknowledgements written unrung
    // while it was solicited-only must not wait for the agent's timeout.
    if (solicited_only == 0 && qp->link != nullptr && LinkHasRxData(qp->link))
      rt.ProgressLinkLocked(qp->link);
  }
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return 0;
}

namespace {

// Takes back the unread events of one CQ, and their tokens. A token some
// reader already took is not there (EAGAIN, never a block); that reader
// finds no event left and waits again.
void PurgeChannel(CompChannel* ch, ibv_cq* gone) {
  std::lock_guard<std::mutex> g(ch->mu);
  size_t removed = 0;
  for (auto it = ch->events.begin(); it != ch->events.end();) {
    if (*it == gone) {
      it = ch->events.erase(it);
      ++removed;
    } else {
      ++it;
    }
  }
  for (char token; removed > 0; --removed)
    if (recv(ch->rfd, &token, 1, MSG_DONTWAIT) != 1) break;
  ch->surplus += static_cast<long>(removed);  // the tokens not there (yet)
}

// Takes one event whose token is there; false when none is.
bool TakeEvent(CompChannel* ch, ibv_cq** cq, void** cq_context) {
  for (;;) {
    {
      // Nothing queued and no token left over: no recv (a non-blocking
      // get that finds no event cost one per message).
      std::lock_guard<std::mutex> g(ch->mu);
      if (ch->events.empty() && ch->surplus <= 0) return false;
    }
    char token;
    bool got = recv(ch->rfd, &token, 1, MSG_DONTWAIT) == 1;
    std::lock_guard<std::mutex> g(ch->mu);
    if (!got) {
      // An event whose token could not be sent (surplus < 0) is taken
      // without one; otherwise the token is on its way, or another
      // reader took it.
      if (ch->events.empty() || ch->surplus >= 0) return false;
      ++ch->surplus;
    } else if (ch->events.empty()) {  // its CQ was destroyed meanwhile
      --ch->surplus;
      continue;
    }
    ibv_cq* p = ch->events.front();
    ch->events.pop_front();
    ToCq(p)->events_read.fetch_add(1);  // under mu: destroy_cq sees it
    *cq = p;
    *cq_context = p->cq_context;
    return true;
  }
}


// Moves what the delegated wires brought (their doorbells woke us): the
// completions it makes raise this channel's events as usual.
// With `direct`, returns the first event it raised, if any (handed to the
// caller, not queued: see tls_driving); without, every event is queued.
ibv_cq* DriveDelegated(CompChannel* ch, bool direct) {
  // Nothing delegated (a wire delegated a moment from now rings again):
  // no need for the runtime's lock.
  if (ch->n_delegated.load(std::memory_order_relaxed) == 0) return nullptr;
  Runtime& rt = Runtime::Get();
  std::lock_guard<std::mutex> g(rt.mu);
  DeviceWork work;
  tls_driving = direct ? ch : nullptr;
  tls_direct_event = nullptr;
  SmallVec<Link*, 8> links;  // a copy: handling may undelegate
  links.assign(ch->delegated.data(), ch->delegated.data() + ch->delegated.size());
  for (Link* l : links) {
    if (l->delegated_to != ch) continue;
    l->rx_budget = kWaiterMovesAtMost;
    l->rx_frame_max = kWaiterFrameAtMost;
    HandleLinkEvent(l, EPOLLIN, l->wdb_fd);
    l->rx_budget = l->rx_frame_max = UINT64_MAX;
    if (l->delegated_to == ch && (LinkHasRxData(l) || (l->in_payload && !l->in_begun))) {
      // More frames in the ring (their doorbells are read), or a frame
      // left to the agent whose payload is still to come: the agent's,
      // and so are the doorbells, until the next arm.
      LinkSetWaiter(l, false);
      rt.Wake();
    }
  }
  tls_driving = nullptr;
  ibv_cq* first = tls_direct_event;
  tls_direct_event = nullptr;
  // Counted as read under rt.mu, as TakeEvent does under the channel's
  // lock: ibv_destroy_cq (which needs the CQ's QPs gone, under rt.mu) then
  // waits for its ack.
  if (first != nullptr) ToCq(first)->events_read.fetch_add(1);
  return first;
}

}  // namespace

// ------------------------------------------------------- extended CQ ---

namespace {

Cq* OfEx(ibv_cq_ex* c) { return reinterpret_cast<Cq*>(c); }

// One completion into `current` (the read_* functions read it).
int NextPoll(ibv_cq_ex* c) {
  Cq* cq = OfEx(c);
  int n = PollCq(&cq->cq, 1, &cq->current);
  if (n < 0) return EINVAL;
  if (n == 0) return ENOENT;
  c->status = cq->current.status;
  c->wr_id = cq->current.wr_id;
  return 0;
}
int StartPoll(ibv_cq_ex* c, ibv_poll_cq_attr* attr) {
  if (attr == nullptr || attr->comp_mask != 0) return EINVAL;
  return NextPoll(c);
}
void EndPoll(ibv_cq_ex*) {}
ibv_wc_opcode ReadOpcode(ibv_cq_ex* c) { return OfEx(c)->current.opcode; }
uint32_t ReadVendorErr(ibv_cq_ex* c) { return OfEx(c)->current.vendor_err; }
uint32_t ReadByteLen(ibv_cq_ex* c) { return OfEx(c)->current.byte_len; }
__be32 ReadImmData(ibv_cq_ex* c) { return OfEx(c)->current.imm_data; }
uint32_t ReadQpNum(ibv_cq_ex* c) { return OfEx(c)->current.qp_num; }
uint32_t ReadSrcQp(ibv_cq_ex* c) { return OfEx(c)->current.src_qp; }
unsigned int ReadWcFlags(ibv_cq_ex* c) { return OfEx(c)->current.wc_flags; }
uint32_t ReadSlid(ibv_cq_ex* c) { return OfEx(c)->current.slid; }
uint8_t ReadSl(ibv_cq_ex* c) { return OfEx(c)->current.sl; }
uint8_t ReadDlidPathBits(ibv_cq_ex* c) { return OfEx(c)->current.dlid_path_bits; }

}  // namespace

// ibv_create_cq_ex: the fields an ibv_wc has (IBV_WC_STANDARD_FLAGS);
// timestamps, VLAN, flow tags, tag matching and parent domains are not
// emulated and say so as rdma-core does (EOPNOTSUPP).
ibv_cq_ex* CreateCqExOp(ibv_context* ctx, ibv_cq_init_attr_ex* a) {
  constexpr uint32_t kMasks = IBV_CQ_INIT_ATTR_MASK_FLAGS | IBV_CQ_INIT_ATTR_MASK_PD;
  if (a == nullptr || (a->comp_mask & ~kMasks) != 0) {
    errno = EINVAL;
    return nullptr;
  }
  if ((a->wc_flags & ~static_cast<uint64_t>(IBV_WC_STANDARD_FLAGS)) != 0 ||
      (a->comp_mask & IBV_CQ_INIT_ATTR_MASK_PD) ||
      ((a->comp_mask & IBV_CQ_INIT_ATTR_MASK_FLAGS) &&
       (a->flags & ~static_cast<uint32_t>(IBV_CREATE_CQ_ATTR_SINGLE_THREADED)) != 0)) {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  if (a->cqe > static_cast<uint32_t>(INT32_MAX) || a->comp_vector > INT32_MAX) {
    errno = EINVAL;
    return nullptr;
  }
  ibv_cq* plain = ibv_create_cq(ctx, static_cast<int>(a->cqe), a->cq_context, a->channel,
                                static_cast<int>(a->comp_vector));
  if (plain == nullptr) return nullptr;
  ibv_cq_ex* c = &ToCq(plain)->cqx;
  c->start_poll = StartPoll;
  c->next_poll = NextPoll;
  c->end_poll = EndPoll;
  c->read_opcode = ReadOpcode;
  c->read_vendor_err = ReadVendorErr;
  c->read_byte_len = ReadByteLen;
  c->read_imm_data = ReadImmData;
  c->read_qp_num = ReadQpNum;
  c->read_src_qp = ReadSrcQp;
  c->read_wc_flags = ReadWcFlags;
  c->read_slid = ReadSlid;
  c->read_sl = ReadSl;
  c->read_dlid_path_bits = ReadDlidPathBits;
  return c;
}

}  // namespace softverbs

using namespace softverbs;

extern "C" {

ibv_comp_channel* ibv_create_comp_channel(ibv_context* context) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) return nullptr;
  int ep = epoll_create1(EPOLL_CLOEXEC);
  epoll_event ev{};
  ev.events = EPOLLIN;
  if (ep < 0 || EpollCtl(ep, EPOLL_CTL_ADD, sv[0], &ev) != 0) {
    int e = errno;
    if (ep >= 0) close(ep);
    close(sv[0]);
    close(sv[1]);
    errno = e;
    return nullptr;
  }
  auto* ch = new CompChannel();
  ch->ch.context = context;
  ch->ch.fd = ep;
  ch->ch.refcnt = 0;
  ch->rfd = sv[0];
  ch->wfd = sv[1];
  return &ch->ch;
}

int ibv_destroy_comp_channel(ibv_comp_channel* channel) {
  auto* ch = reinterpret_cast<CompChannel*>(channel);
  std::lock_guard<std::mutex> g(Runtime::Get().mu);
  if (ch->ch.refcnt != 0) return EBUSY;
  // No CQ uses it; a wire its QP let go of may still be delegated.
  while (!ch->delegated.empty()) LinkUndelegate(ch->delegated.back());
  close(ch->ch.fd);
  close(ch->rfd);
  close(ch->wfd);
  delete ch;
  return 0;
}

ibv_cq* ibv_create_cq(ibv_context* context, int cqe, void* cq_context,
                      ibv_comp_channel* channel, int comp_vector) {
  const Config& c = GetConfig();
  if (cqe <= 0 || cqe > c.max_cqe || comp_vector < 0 ||
      comp_vector >= context->num_comp_vectors) {
    errno = EINVAL;
    return nullptr;
  }
  auto* cq = new Cq();
  cq->cq.context = context;
  cq->cq.channel = channel;
  cq->cq.cq_context = cq_context;
  cq->cq.cqe = cqe;
  pthread_mutex_init(&cq->cq.mutex, nullptr);
  pthread_cond_init(&cq->cq.cond, nullptr);
  if (channel != nullptr) {
    std::lock_guard<std::mutex> g(Runtime::Get().mu);
    ++channel->refcnt;
  }
  return &cq->cq;
}

int ibv_resize_cq(ibv_cq* ibcq, int cqe) {
  Cq* cq = ToCq(ibcq);
  std::lock_guard<std::mutex> g(cq->mu);
  if (cqe <= 0 || cqe > GetConfig().max_cqe || cqe < static_cast<int>(cq->entries.size()))
    return EINVAL;
  cq->cq.cqe = cqe;
  return 0;
}

int ibv_destroy_cq(ibv_cq* ibcq) {
  Cq* cq = ToCq(ibcq);
  Runtime& rt = Runtime::Get();
  {
    std::lock_guard<std::mutex> g(rt.mu);
    if (!cq->qps.empty()) return EBUSY;
  }
  // Events still queued in the channel are dropped, as the kernel drops
  // them; then, as with rdma-core, wait until every event handed to the
  // application has been acked (none can be handed out any more).
  {
    std::lock_guard<std::mutex> g(cq->mu);
    cq->armed = false;
  }
  if (cq->cq.channel != nullptr)
    PurgeChannel(reinterpret_cast<CompChannel*>(cq->cq.channel), &cq->cq);
  pthread_mutex_lock(&cq->cq.mutex);
  while (cq->cq.comp_events_completed < cq->events_read.load())
    pthread_cond_wait(&cq->cq.cond, &cq->cq.mutex);
  pthread_mutex_unlock(&cq->cq.mutex);
  if (cq->cq.channel != nullptr) {
    std::lock_guard<std::mutex> g(rt.mu);
    --cq->cq.channel->refcnt;
  }
  pthread_mutex_destroy(&cq->cq.mutex);
  pthread_cond_destroy(&cq->cq.cond);
  delete cq;
  return 0;
}

int ibv_get_cq_event(ibv_comp_channel* channel, ibv_cq** cq, void** cq_context) {
  auto* ch = reinterpret_cast<CompChannel*>(channel);
  for (;;) {
    if (TakeEvent(ch, cq, cq_context)) {
      // The channel became readable for this event's token and perhaps
      // for a delegated wire's doorbell too, on one edge: move what the
      // wires brought now (what it raises is queued, with its token), or
      // a caller that waits for the next edge would not hear of it.
      DriveDelegated(ch, /*direct=*/false);
      return 0;
    }
    if (ibv_cq* direct = DriveDelegated(ch, /*direct=*/true)) {
      *cq = direct;
      *cq_context = direct->cq_context;
      return 0;
    }
    if (TakeEvent(ch, cq, cq_context)) return 0;
    int flags = fcntl(ch->ch.fd, F_GETFL);
    if (flags < 0) return -1;
    if (flags & O_NONBLOCK) {
      errno = EAGAIN;
      return -1;
    }
    // A cancellation point, as the kernel channel's read is.
    epoll_event ev;
    if (epoll_wait(ch->ch.fd, &ev, 1, -1) < 0) return -1;
  }
}

void ibv_ack_cq_events(ibv_cq* cq, unsigned int nevents) {
  pthread_mutex_lock(&cq->mutex);
  cq->comp_events_completed += nevents;
  pthread_cond_signal(&cq->cond);
  pthread_mutex_unlock(&cq->mutex);
}

}  // extern "C"
