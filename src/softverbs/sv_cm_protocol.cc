// librdmacm over softverbs, the protocol: the connection management
// messages on a link (REQ, REP, REJ, RTU; DREQ is the link's disconnect
// frame), the event sequences of rdma_cm(7), address and route resolution
// that take time, and connect deadlines. The agent thread calls in through
// the CM hooks (SetCmHooks); the entry points are in sv_cm_abi.cc.
//
// An RDMA CM port P is served by a TCP listener on port P ^ 0x8000 of the
// same address, so RDMA CM and TCP port spaces stay separate (a TCP server
// and an RDMA CM server can share one address and port, as on hardware).
// The accepted connection then carries the connection's data (TCP mode) or
// its doorbells (shared-memory mode).
#include <arpa/inet.h>
#include <netinet/tcp.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>

#include <cerrno>
#include <vector>

#include "sv_cm_internal.h"

namespace softverbs {
namespace {

// The CM's process-wide state, started over in the child of a fork
// (ForgetCmStateInChild, with the runtime). Never destroyed.
struct CmGlobals {
  std::deque<Delayed> delayed;
  std::set<CmId*> ids;
  std::vector<ibv_context*> device_ctxs;  // DeviceContext, by device index
  std::vector<ibv_pd*> device_pds;        // DevicePd, likewise
  // SOFTVERBS_DEVICE_REMOVAL_MS: when the devices go (0: not scheduled),
  // and whether they went.
  uint64_t removal_due_us = 0;
  bool removed = false;
  // SOFTVERBS_DEVICE_RETURN_MS: when removed devices come back (0: never,
  // or back already).
  uint64_t return_due_us = 0;
  // SOFTVERBS_ADDR_CHANGE_MS: when the devices' address changes (0: not
  // scheduled), and whether it did.
  uint64_t addr_change_due_us = 0;
  bool addr_changed = false;
};
std::atomic<CmGlobals*> g_cm{new CmGlobals()};

// Started over in the child of a fork, with the runtime.
void ForgetCmStateInChild() { g_cm.store(new CmGlobals()); }
struct RegisterForkHook {
  RegisterForkHook() { SetForkChildHook(&ForgetCmStateInChild); }
} g_register_fork_hook;

ibv_pd* DevicePd(Device* d) {
  std::vector<ibv_pd*>* pds = &g_cm.load()->device_pds;
  if (pds->size() < Rt().devices.size()) pds->resize(Rt().devices.size(), nullptr);
  ibv_pd*& p = (*pds)[d->index];
  if (p == nullptr) p = ibv_alloc_pd(DeviceContext(d));
  return p;
}

}  // namespace

std::deque<Delayed>& DelayedEvents() { return g_cm.load()->delayed; }

std::set<CmId*>& Ids() { return g_cm.load()->ids; }

ibv_context* DeviceContext(Device* d) {
  std::vector<ibv_context*>* ctxs = &g_cm.load()->device_ctxs;
  if (ctxs->size() < Rt().devices.size()) ctxs->resize(Rt().devices.size(), nullptr);
  ibv_context*& c = (*ctxs)[d->index];
  if (c == nullptr) c = ibv_open_device(&d->dev);
  return c;
}

uint16_t TcpPortFor(uint16_t cm_port) {
  return static_cast<uint16_t>(cm_port ^ GetConfig().cm_port_xor);
}

// One wake-up token into the channel's socket. Never blocks: with one token
// per non-empty queue (and one more at most while a reader holds the
// last), the socket's buffer never fills.
void SendToken(EventChannel* ch) {
  char token = 1;
  (void)!send(ch->wfd, &token, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
}

// Queues an event on the id's channel. Caller holds Rt().mu.
void PushEvent(CmId* id, rdma_cm_event_type type, int status, CmId* listen,
               const void* pdata, size_t pdata_len, size_t pad_to) {
  auto* e = new CmEvent();
  memset(&e->ev, 0, sizeof(e->ev));
  e->ev.id = &id->id;
  e->ev.listen_id = listen ? &listen->id : nullptr;
  e->ev.event = type;
  e->ev.status = status;
  e->owner = listen ? listen : id;
  rdma_conn_param& c = e->ev.param.conn;
  c = id->peer;
  if (pad_to > 0) {
    memset(e->pdata, 0, sizeof(e->pdata));
    if (pdata_len > 0) memcpy(e->pdata, pdata, std::min(pdata_len, pad_to));
    c.private_data = e->pdata;
    c.private_data_len = static_cast<uint8_t>(pad_to);
  } else {
    c.private_data = nullptr;
    c.private_data_len = 0;
  }
  c.qp_num = id->peer_qpn;
  EventChannel* ch = (listen ? listen : id)->chan;
  Trace("cm: event %s status %d for id %p", rdma_event_str(type), status, (void*)id);
  bool was_empty;
  {
    std::lock_guard<std::mutex> g(ch->mu);
    was_empty = ch->q.empty();
    ch->q.push_back(e);
  }
  // The channel fd is readable while events are queued: one token stands
  // for "not empty" (rdma_get_cm_event passes it on while events remain),
  // not one per event, which a socket's buffer cannot hold past a few
  // hundred.
  if (was_empty) SendToken(ch);
}

void SetSrc(CmId* id, const sockaddr_in& a) {
  memset(&id->id.route.addr.src_storage, 0, sizeof(id->id.route.addr.src_storage));
  memcpy(&id->id.route.addr.src_sin, &a, sizeof(a));
}
void SetDst(CmId* id, const sockaddr_in& a) {
  memset(&id->id.route.addr.dst_storage, 0, sizeof(id->id.route.addr.dst_storage));
  memcpy(&id->id.route.addr.dst_sin, &a, sizeof(a));
}

void AttachDevice(CmId* id, Device* d) {
  id->dev = d;
  id->id.verbs = DeviceContext(d);
  id->id.port_num = 1;
  id->id.pd = DevicePd(d);
}

Qp* IdQp(CmId* id) {
  if (id->local_qpn == 0) return nullptr;
  auto it = Rt().qps.find(id->local_qpn);
  return it == Rt().qps.end() || it->second->serial != id->local_serial ? nullptr : it->second;
}

void SetLocalQp(CmId* id, uint32_t qpn) {
  auto it = Rt().qps.find(qpn);
  id->local_qpn = qpn;
  id->local_serial = it == Rt().qps.end() ? 0 : it->second->serial;
}

// The address vector of an id's route: the one rdma_init_qp_attr gives for
// RTR, and the one a CM-managed QP gets.
ibv_ah_attr CmAddressVector(const CmId* id) {
  ibv_ah_attr ah{};
  ah.is_global = 1;
  ah.grh.dgid = MappedGid(id->id.route.addr.dst_sin.sin_addr);
  ah.grh.traffic_class = id->tos;
  ah.grh.hop_limit = 64;
  ah.port_num = 1;
  return ah;
}

// Moves a CM-managed QP to RTS against the peer's QPN and binds the link.
void ConnectQp(CmId* id, const rdma_conn_param& mine) {
  Qp* qp = IdQp(id);
  // A QP the application made itself is moved through its states by the
  // application (rdma_init_qp_attr) and finds its peer like any raw QP.
  if (qp == nullptr || !qp->cm_managed || id->link == nullptr) return;
  qp->dest_qpn = id->peer_qpn;
  qp->peer_addr = id->id.route.addr.dst_sin.sin_addr;
  qp->ah = CmAddressVector(id);  // ibv_query_qp reports it
  if (qp->qp.state == IBV_QPS_INIT) qp->qp.state = IBV_QPS_RTR;
  qp->rnr_retry = mine.rnr_retry_count > 7 ? 7 : mine.rnr_retry_count;
  qp->retry_cnt = mine.retry_count > 7 ? 7 : mine.retry_count;
  qp->timeout = id->ack_timeout;
  if (qp->qp.state == IBV_QPS_RTR) qp->qp.state = IBV_QPS_RTS;
  if (qp->link != nullptr && qp->link != id->link) {
    Link* old = qp->link;
    old->qp = nullptr;
    LinkKill(old);
  }
  qp->link = id->link;
  id->link->qp = qp;
}

namespace {

// The CM's timer word: the first delayed event's time, else the removal's
// or the address change's, else 1 while a connect waits for its deadline,
// else 0 (no timers).
void UpdateCmTimers() {
  CmGlobals* g = g_cm.load();
  bool connecting = false;
  for (CmId* id : g->ids) connecting |= id->state == CmState::kConnecting;
  uint64_t next = !g->delayed.empty() ? g->delayed.front().due_us : 0;
  if (g->removal_due_us != 0 && !g->removed && (next == 0 || g->removal_due_us < next))
    next = g->removal_due_us;
  if (g->addr_change_due_us != 0 && !g->addr_changed &&
      (next == 0 || g->addr_change_due_us < next))
    next = g->addr_change_due_us;
  if (g->return_due_us != 0 && (next == 0 || g->return_due_us < next)) next = g->return_due_us;
  Rt().cm_timers.store(next != 0 ? next : connecting ? 1 : 0);
}

// The first connection of the process is up: the removal fault and the
// address change, if set, are due SOFTVERBS_DEVICE_REMOVAL_MS and
// SOFTVERBS_ADDR_CHANGE_MS from now.
void ScheduleDeviceEvents() {
  CmGlobals* g = g_cm.load();
  int ms = GetConfig().device_removal_ms, change_ms = GetConfig().addr_change_ms;
  bool removal = ms != 0 && g->removal_due_us == 0;
  bool change = change_ms != 0 && g->addr_change_due_us == 0;
  if (!removal && !change) return;
  if (removal) g->removal_due_us = NowUs() + static_cast<uint64_t>(ms) * 1000;
  if (change) g->addr_change_due_us = NowUs() + static_cast<uint64_t>(change_ms) * 1000;
  UpdateCmTimers();
  Rt().StartAgent();
  Rt().Wake();
}

// The devices go, as when an HCA is unplugged or its driver unbound: every
// id on one (listening, connecting or connected) gets
// RDMA_CM_EVENT_DEVICE_REMOVAL, connected QPs go to error (posted work
// flushed) and their wires are cut (the peer sees its connection end), and
// new ids find no device (bind and resolve fail with ENODEV).
void RemoveDevices() {
  CmGlobals* g = g_cm.load();
  g->removed = true;
  for (Device* d : Rt().devices) d->removed = true;
  Warn("SOFTVERBS_DEVICE_REMOVAL_MS: the devices are removed now");
  if (int ms = GetConfig().device_return_ms; ms != 0)
    g->return_due_us = NowUs() + static_cast<uint64_t>(ms) * 1000;
  std::vector<CmId*> ids(g->ids.begin(), g->ids.end());
  for (CmId* id : ids) {
    switch (id->state) {
      case CmState::kIdle:
      case CmState::kDisconnected:
      case CmState::kRejected:
        continue;
      case CmState::kListen:
        // A wildcard listener is on no device: the kernel tells it nothing
        // (its requests on the removed device stop coming).
        if (id->id.verbs == nullptr) continue;
        id->state = CmState::kBound;  // requests that still come are refused
        break;
      default:
        id->state = CmState::kDisconnected;
        id->deadline_us = 0;
        DropLink(id);
        if (Qp* qp = IdQp(id); qp != nullptr && qp->qp.state != IBV_QPS_ERR &&
                               qp->qp.state != IBV_QPS_RESET)
          QpToErrorLocked(qp, IBV_WC_WR_FLUSH_ERR);
        break;
    }
    PushEvent(id, RDMA_CM_EVENT_DEVICE_REMOVAL, 0);
  }
}

// The devices' address changes, as on a bonding failover: every listening
// or connected id gets RDMA_CM_EVENT_ADDR_CHANGE, and nothing else happens
// (connections carry on, as the kernel's do).
void ChangeAddress() {
  CmGlobals* g = g_cm.load();
  g->addr_changed = true;
  Warn("SOFTVERBS_ADDR_CHANGE_MS: the devices' address changes now");
  std::vector<CmId*> ids(g->ids.begin(), g->ids.end());
  for (CmId* id : ids) {
    switch (id->state) {
      case CmState::kListen:
      case CmState::kResponse:
      case CmState::kConnected:
        PushEvent(id, RDMA_CM_EVENT_ADDR_CHANGE, 0);
        break;
      default:
        break;
    }
  }
}

}  // namespace

void LinkUp(CmId* id) {
  ScheduleDeviceEvents();
  Link* l = id->link;
  char desc[96];
  snprintf(desc, sizeof(desc), "cm %s:%u %s", inet_ntoa(id->id.route.addr.dst_sin.sin_addr),
           ntohs(id->id.route.addr.dst_sin.sin_port), l->shm ? "shm" : "tcp");
  l->peer_desc = desc;
  l->state = LinkState::kUp;
  Trace("link %s: up", l->peer_desc.c_str());
  Runtime::Get().UpdateLinkWatch(l);
  if (l->qp != nullptr) QpLinkUpLocked(l->qp);
}

void DropSpareWish(CmId* id) {
  if (!id->spare_wanted) return;
  id->spare_wanted = false;
  Rt().spares_wanted.fetch_sub(1, std::memory_order_relaxed);
}

void DropLink(CmId* id) {
  if (Link* l = id->link) {
    id->link = nullptr;
    l->cm = nullptr;
    if (l->qp != nullptr) {
      Qp* qp = l->qp;
      // To error while still on the link: the requests it flushes leave
      // the link's queue too (QpToErrorLocked), so the pump below sends
      // nothing from memory the application now has back.
      if (qp->qp.state == IBV_QPS_RTS || qp->qp.state == IBV_QPS_RTR)
        QpToErrorLocked(qp, IBV_WC_WR_FLUSH_ERR);
      l->qp = nullptr;
      qp->link = nullptr;
    }
    LinkPump(l);
    LinkKill(l);
  }
}

void Disconnected(CmId* id) {
  if (id->state != CmState::kConnected) return;
  id->state = CmState::kDisconnected;
  // Like librdmacm, only a QP it made (rdma_create_qp) is moved to error.
  if (Qp* qp = IdQp(id); qp != nullptr && qp->cm_managed) {
    if (qp->qp.state != IBV_QPS_ERR && qp->qp.state != IBV_QPS_RESET)
      QpToErrorLocked(qp, IBV_WC_WR_FLUSH_ERR);
  }
  PushEvent(id, RDMA_CM_EVENT_DISCONNECTED, 0);
}

void PushEventLater(CmId* id, rdma_cm_event_type type) {
  int delay = GetConfig().resolve_us;
  if (delay == 0) {
    PushEvent(id, type, 0);
    return;
  }
  // Every delay is the same: the queue's front is the first due.
  DelayedEvents().push_back({NowUs() + static_cast<uint64_t>(delay), id, type});
  UpdateCmTimers();
  Rt().StartAgent();  // it delivers the event, even before any QP exists
  Rt().Wake();
}

// ------------------------------------------------------ agent-side hooks ---

namespace {


void OnListener(void* obj) {
  auto* lid = static_cast<CmId*>(obj);
  for (;;) {
    int fd = accept4(lid->listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;
    int one = 1;  // small frames (ACKs, doorbells) must not wait for Nagle
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    Link* l = NewLink(fd, false);
    l->cm = lid;
    l->cm_listener_side = true;
    l->deadline_us = NowUs() + kConnectTimeoutUs;
    l->peer_desc = "cm-accept";
    Rt().Watch(fd, new EpollTag{EpollTag::kLink, l, fd}, true);
    HandleLinkEvent(l, EPOLLIN);
  }
}

void OnReq(Link* l, const std::string& body) {
  CmId* lid = l->cm;
  CmReq r;
  if (body.size() != sizeof(r) || Ids().count(lid) == 0 || lid->state != CmState::kListen) {
    LinkKill(l);
    return;
  }
  memcpy(&r, body.data(), sizeof(r));
  if (r.pdata_len > kReqPdata) r.pdata_len = kReqPdata;
  auto* c = new CmId();
  memset(&c->id, 0, sizeof(c->id));
  c->id.channel = lid->id.channel;
  c->chan = lid->chan;
  c->sync = lid->sync;
  // id.context: the listener's, copied when the program gets the event
  // (rdma_get_cm_event), as librdmacm does; the program may still be
  // setting it after rdma_listen while this runs on the agent thread.
  c->id.ps = lid->id.ps;
  c->id.qp_type = lid->id.qp_type;
  c->listener = lid;
  c->tos = lid->tos;  // inherited, as the kernel's CM does
  c->ack_timeout = lid->ack_timeout;
  sockaddr_in local{}, peer{};
  socklen_t len = sizeof(local);
  getsockname(l->fd, reinterpret_cast<sockaddr*>(&local), &len);
  len = sizeof(peer);
  getpeername(l->fd, reinterpret_cast<sockaddr*>(&peer), &len);
  local.sin_port = lid->id.route.addr.src_sin.sin_port;
  peer.sin_port = htons(r.src_port);
  SetSrc(c, local);
  SetDst(c, peer);
  Device* d = Rt().DeviceForAddr(local.sin_addr);
  if (d == nullptr) d = lid->dev ? lid->dev : Rt().DeviceForRoute(peer.sin_addr);
  if (d == nullptr) {
    delete c;
    LinkKill(l);
    return;
  }
  AttachDevice(c, d);
  c->peer_qpn = r.qpn;
  c->peer.responder_resources = r.initiator_depth;
  c->peer.initiator_depth = r.responder_resources;
  c->peer.flow_control = r.flow_control;
  c->peer.retry_count = r.retry_count;
  c->peer.rnr_retry_count = r.rnr_retry_count;
  c->peer.srq = r.srq;
  if (r.shm_offer && r.offer.boot_hash == Rt().boot_hash && r.offer.netns == Rt().netns &&
      GetConfig().use_shm) {
    r.offer.name[sizeof(r.offer.name) - 1] = 0;
    LinkSetupShmAcceptor(l, r.offer.name, r.offer.nonce);
  }
  l->cm = c;
  l->cm_listener_side = false;
  l->deadline_us = 0;
  c->link = l;
  c->state = CmState::kReqRcvd;
  Ids().insert(c);
  PushEvent(c, RDMA_CM_EVENT_CONNECT_REQUEST, 0, lid, r.pdata, r.pdata_len, kReqPdata);
}

void OnRep(Link* l, const std::string& body) {
  CmId* id = l->cm;
  CmRep r;
  if (body.size() != sizeof(r) || id->state != CmState::kConnecting) {
    LinkKill(l);
    return;
  }
  memcpy(&r, body.data(), sizeof(r));
  if (r.pdata_len > kRepPdata) r.pdata_len = kRepPdata;
  LinkShmConfirmed(l, r.shm_ok != 0);
  id->peer_qpn = r.qpn;
  id->peer.responder_resources = r.initiator_depth;
  id->peer.initiator_depth = r.responder_resources;
  id->peer.flow_control = r.flow_control;
  id->peer.rnr_retry_count = r.rnr_retry_count;
  id->peer.srq = r.srq;
  id->deadline_us = 0;
  l->deadline_us = 0;
  if (IdQp(id) == nullptr || !IdQp(id)->cm_managed) {
    id->state = CmState::kResponse;
    PushEvent(id, RDMA_CM_EVENT_CONNECT_RESPONSE, 0, nullptr, r.pdata, r.pdata_len, kRepPdata);
    return;
  }
  rdma_conn_param mine{};
  Qp* qp = IdQp(id);
  mine.rnr_retry_count = r.rnr_retry_count;  // on IB the REP's count governs us
  mine.retry_count = qp->retry_cnt;
  ConnectQp(id, mine);
  CtlSend(l, kCtlCmRtu, "", 0);
  id->state = CmState::kConnected;
  LinkUp(id);
  PushEvent(id, RDMA_CM_EVENT_ESTABLISHED, 0, nullptr, r.pdata, r.pdata_len, kRepPdata);
}

void OnRej(Link* l, const std::string& body) {
  CmId* id = l->cm;
  CmRej r{};
  if (body.size() != sizeof(r) || id->state != CmState::kConnecting) {
    LinkKill(l);
    return;
  }
  memcpy(&r, body.data(), sizeof(r));
  if (r.pdata_len > kRejPdata) r.pdata_len = kRejPdata;
  LinkShmConfirmed(l, false);
  id->state = CmState::kRejected;
  DropLink(id);
  if (Qp* qp = IdQp(id); qp != nullptr && qp->cm_managed) QpToErrorLocked(qp, IBV_WC_WR_FLUSH_ERR);
  PushEvent(id, RDMA_CM_EVENT_REJECTED, kRejConsumer, nullptr, r.pdata, r.pdata_len, kRejPdata);
}

void OnRtu(Link* l) {
  CmId* id = l->cm;
  if (id->state != CmState::kAccepting) {
    LinkKill(l);
    return;
  }
  id->state = CmState::kConnected;
  LinkUp(id);
  PushEvent(id, RDMA_CM_EVENT_ESTABLISHED, 0);
}

bool OnCtl(Link* l, uint8_t type, const std::string& body) {
  if (l->cm == nullptr) return false;
  switch (type) {
    case kCtlCmReq:
      if (!l->cm_listener_side) return false;
      OnReq(l, body);
      return true;
    case kCtlCmRep:
      if (l->cm_listener_side || !l->initiator) return false;
      OnRep(l, body);
      return true;
    case kCtlCmRej:
      if (l->cm_listener_side || !l->initiator) return false;
      OnRej(l, body);
      return true;
    case kCtlCmRtu:
      if (l->cm_listener_side || l->initiator) return false;
      OnRtu(l);
      return true;
    default:
      return false;
  }
}

void OnLinkDead(Link* l) {
  CmId* id = l->cm;
  l->cm = nullptr;
  if (id == nullptr || l->cm_listener_side) return;
  if (id->link == l) id->link = nullptr;
  switch (id->state) {
    case CmState::kConnecting:
      id->state = CmState::kRejected;
      if (l->connect_error == ECONNREFUSED) {
        PushEvent(id, RDMA_CM_EVENT_REJECTED, kRejInvalidService, nullptr, nullptr, 0,
                  kRejPdata);
      } else {
        PushEvent(id, RDMA_CM_EVENT_CONNECT_ERROR, -ECONNRESET);
      }
      break;
    case CmState::kReqRcvd:
    case CmState::kAccepting:
      id->state = CmState::kDisconnected;
      PushEvent(id, RDMA_CM_EVENT_CONNECT_ERROR, -ECONNRESET);
      break;
    case CmState::kResponse:
    case CmState::kConnected:
      Disconnected(id);
      break;
    default:
      break;
  }
}

void OnDisconnectFrame(Link* l) {
  CmId* id = l->cm;
  if (id == nullptr) return;
  Disconnected(id);
  DropLink(id);
}

void OnTimers(uint64_t now) {
  auto& d = DelayedEvents();
  while (!d.empty() && d.front().due_us <= now) {
    Delayed e = d.front();
    d.pop_front();
    if (Ids().count(e.id)) PushEvent(e.id, e.type, 0);
  }
  CmGlobals* g = g_cm.load();
  if (g->removal_due_us != 0 && !g->removed && g->removal_due_us <= now) RemoveDevices();
  if (g->return_due_us != 0 && g->return_due_us <= now) {
    // Back, as a device whose driver is bound again: new ids bind and
    // resolve on it; what the removal ended stays ended.
    g->return_due_us = 0;
    for (Device* d : Rt().devices) d->removed = false;
    Warn("SOFTVERBS_DEVICE_RETURN_MS: the devices are back now");
  }
  if (g->addr_change_due_us != 0 && !g->addr_changed && g->addr_change_due_us <= now)
    ChangeAddress();
  UpdateCmTimers();
  for (CmId* id : Ids()) {
    if (id->state == CmState::kConnecting && id->deadline_us != 0 && now > id->deadline_us) {
      id->deadline_us = 0;
      id->state = CmState::kRejected;
      DropLink(id);
      PushEvent(id, RDMA_CM_EVENT_UNREACHABLE, -ETIMEDOUT);
    }
  }
}

// Makes one shared-memory segment for an id that waits for its route
// (rdma_resolve_route asked for it), without the runtime lock: its
// rdma_connect then finds the pages reserved instead of reserving them
// itself, under the lock, on the connection's way. An id that no longer
// wants it (connected, destroyed) leaves it to the next one, or it goes.
void OnSpares() {
  ShmSegment s;
  const bool made = ShmSegmentPrepare(&s);
  std::lock_guard<std::mutex> g(Rt().mu);
  for (CmId* id : Ids()) {
    if (!id->spare_wanted) continue;
    id->spare_wanted = false;
    Rt().spares_wanted.fetch_sub(1, std::memory_order_relaxed);
    if (made) id->spare = s;  // else rdma_connect tries for itself, as without
    return;
  }
  // No id wants one (every wish is dropped under mu, as it is counted):
  // nothing is left to make.
  Rt().spares_wanted.store(0, std::memory_order_relaxed);
  ShmSegmentDiscard(&s);
}

__attribute__((constructor)) void InstallHooks() {
  SetCmHooks(CmHooks{OnListener, OnCtl, OnLinkDead, OnDisconnectFrame, OnTimers, OnSpares});
}

}  // namespace

}  // namespace softverbs
