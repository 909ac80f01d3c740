// librdmacm over softverbs, the entry points: event channels, ids, address
// and route resolution, listen/connect/accept/reject/disconnect with
// private data at InfiniBand's sizes, rdma_getaddrinfo and the endpoint
// calls, as rdma-core 44 exports them. The protocol behind them is in
// sv_cm_protocol.cc.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <map>
#include <mutex>
#include <set>
#include <vector>

#include "sv_cm_internal.h"
#include "sv_cm_internal.h"

namespace softverbs {
namespace {

bool ToSin(const sockaddr* a, sockaddr_in* out) {
  if (a == nullptr) return false;
  if (a->sa_family == AF_INET) {
    memcpy(out, a, sizeof(*out));
    return true;
  }
  if (a->sa_family == AF_INET6) {
    auto* s6 = reinterpret_cast<const sockaddr_in6*>(a);
    memset(out, 0, sizeof(*out));
    out->sin_family = AF_INET;
    out->sin_port = s6->sin6_port;
    if (IN6_IS_ADDR_UNSPECIFIED(&s6->sin6_addr)) return true;
    if (IN6_IS_ADDR_V4MAPPED(&s6->sin6_addr)) {
      memcpy(&out->sin_addr, &s6->sin6_addr.s6_addr[12], 4);
      return true;
    }
  }
  return false;
}

// The device's own PD, for a QP made with none (as librdmacm keeps one per
// device): made once per context, kept for the life of the process.
ibv_pd* DefaultPd(ibv_context* ctx) {
  static std::mutex mu;
  static std::map<ibv_context*, ibv_pd*>* pds = new std::map<ibv_context*, ibv_pd*>;
  std::lock_guard<std::mutex> g(mu);
  ibv_pd*& pd = (*pds)[ctx];
  if (pd == nullptr) pd = ibv_alloc_pd(ctx);
  return pd;
}

// The fields REQ and REP share, from the application's parameters (whose
// private data length was checked against the message's limit already).
template <typename Msg>
void CopyParam(const rdma_conn_param& p, Msg* m) {
  m->responder_resources = p.responder_resources;
  m->initiator_depth = p.initiator_depth;
  m->flow_control = p.flow_control;
  m->rnr_retry_count = p.rnr_retry_count;
  m->srq = p.srq;
  m->pdata_len = p.private_data_len;
  if (p.private_data_len > 0 && p.private_data != nullptr)
    memcpy(m->pdata, p.private_data, p.private_data_len);
}

int Fail(int e) {
  errno = e;
  return -1;
}

CmId* ToId(rdma_cm_id* id) { return reinterpret_cast<CmId*>(id); }

// Synchronous ids (created without a channel) wait for their own event.
int WaitSync(CmId* id, rdma_cm_event_type want, rdma_cm_event** out = nullptr) {
  rdma_cm_event* e = nullptr;
  if (rdma_get_cm_event(&id->chan->ch, &e) != 0) return -1;
  int status = e->status;
  rdma_cm_event_type got = e->event;
  if (out != nullptr && got == want) {
    *out = e;
    return 0;
  }
  rdma_ack_cm_event(e);
  if (got == want) return 0;
  if (got == RDMA_CM_EVENT_REJECTED) return Fail(ECONNREFUSED);
  return Fail(status < 0 ? -status : (status ? status : EIO));
}

}  // namespace
}  // namespace softverbs

using namespace softverbs;

extern "C" {

rdma_event_channel* rdma_create_event_channel(void) {
  if (Rt().devices.empty()) {
    errno = ENODEV;
    return nullptr;
  }
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) return nullptr;
  auto* ch = new EventChannel();
  ch->ch.fd = sv[0];
  ch->wfd = sv[1];
  return &ch->ch;
}

void rdma_destroy_event_channel(rdma_event_channel* channel) {
  auto* ch = reinterpret_cast<EventChannel*>(channel);
  // Programs destroy a channel while another thread still uses it (rping
  // does, without joining its CM thread): that thread is blocked in a get,
  // or between two gets, about to block again. With the kernel's fd it
  // simply stays blocked. Here too: the flag and the readers count are
  // each set before the other is read (seq_cst), so either this sees the
  // reader and leaves the channel open, or the reader sees the flag and
  // blocks for good; and the struct is kept (on a list, so leak checkers
  // see it reachable), so a late get never reads freed memory or a closed
  // or reused fd.
  int fl = fcntl(ch->ch.fd, F_GETFL);
  ch->nonblocking_at_destroy = fl >= 0 && (fl & O_NONBLOCK) != 0;
  ch->destroyed.store(true);
  static auto* retired = new std::vector<EventChannel*>;
  static std::mutex retired_mu;
  {
    std::lock_guard<std::mutex> g(retired_mu);
    retired->push_back(ch);
  }
  if (ch->readers.load() > 0) {
    Trace("cm: event channel destroyed while a thread waits on it; left open");
    return;
  }
  close(ch->ch.fd);
  close(ch->wfd);
  std::lock_guard<std::mutex> g(ch->mu);
  for (CmEvent* e : ch->q) delete e;
  ch->q.clear();
}

int rdma_create_id(rdma_event_channel* channel, rdma_cm_id** out, void* context,
                   rdma_port_space ps) {
  if (out == nullptr) return Fail(EINVAL);
  if (ps != RDMA_PS_TCP && ps != RDMA_PS_IB) return Fail(EOPNOTSUPP);
  auto* id = new CmId();
  memset(&id->id, 0, sizeof(id->id));
  if (channel == nullptr) {
    channel = rdma_create_event_channel();
    if (channel == nullptr) {
      delete id;
      return -1;
    }
    id->sync = true;
  }
  id->chan = reinterpret_cast<EventChannel*>(channel);
  id->id.channel = channel;
  id->id.context = context;
  id->id.ps = ps;
  id->id.qp_type = IBV_QPT_RC;
  std::lock_guard<std::mutex> g(Rt().mu);
  Ids().insert(id);
  *out = &id->id;
  return 0;
}

int rdma_destroy_id(rdma_cm_id* cid) {
  CmId* id = ToId(cid);
  std::unique_lock<std::mutex> lk(Rt().mu);
  id->acked.wait(lk, [&] { return id->unacked == 0; });
  // Not in the set: an id the child of a fork inherited. Its segment (a
  // wish counted in the parent's runtime, a name the parent will offer)
  // stays the parent's.
  const bool ours = Ids().erase(id) == 1;
  // Undelivered events of this id go away with it, and so does the
  // readability they gave the channel fd (as the kernel does), so a thread
  // blocked on the channel stays blocked instead of waking to nothing.
  {
    EventChannel* ch = id->chan;
    std::lock_guard<std::mutex> g(ch->mu);
    const bool had_events = !ch->q.empty();
    for (auto it = ch->q.begin(); it != ch->q.end();) {
      if ((*it)->owner == id || (*it)->ev.id == cid) {
        delete *it;
        it = ch->q.erase(it);
      } else {
        ++it;
      }
    }
    // Emptied: take back the "not empty" token. One another thread already
    // took is simply not there (EAGAIN); that thread finds the queue empty
    // and waits again.
    char token;
    if (had_events && ch->q.empty()) (void)!recv(ch->ch.fd, &token, 1, MSG_DONTWAIT);
  }
  DropLink(id);
  if (ours) {
    DropSpareWish(id);
    ShmSegmentDiscard(&id->spare);
  }
  for (Link* l : Rt().links)
    if (l->cm == id) l->cm = nullptr;
  auto& delayed = DelayedEvents();
  for (auto it = delayed.begin(); it != delayed.end();)
    it = it->id == id ? delayed.erase(it) : it + 1;
  if (id->listen_fd >= 0) {
    Rt().Unwatch(id->listen_fd);  // retires listen_tag
    close(id->listen_fd);
  }
  free(id->id.route.path_rec);
  bool sync = id->sync && id->listener == nullptr;
  rdma_event_channel* ch = &id->chan->ch;
  lk.unlock();
  if (sync) rdma_destroy_event_channel(ch);
  delete id;
  return 0;
}

int rdma_bind_addr(rdma_cm_id* cid, sockaddr* addr) {
  CmId* id = ToId(cid);
  sockaddr_in a;
  if (!ToSin(addr, &a)) return Fail(EAFNOSUPPORT);
  std::lock_guard<std::mutex> g(Rt().mu);
  if (id->state != CmState::kIdle) return Fail(EINVAL);
  Device* d = nullptr;
  if (a.sin_addr.s_addr != htonl(INADDR_ANY)) {
    d = Rt().DeviceForAddr(a.sin_addr);
    if (d == nullptr) return Fail(ENODEV);
  }
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in t = a;
  if (a.sin_port != 0) t.sin_port = htons(TcpPortFor(ntohs(a.sin_port)));
  if (bind(fd, reinterpret_cast<sockaddr*>(&t), sizeof(t)) != 0) {
    int e = errno;
    close(fd);
    return Fail(e);
  }
  socklen_t len = sizeof(t);
  getsockname(fd, reinterpret_cast<sockaddr*>(&t), &len);
  a.sin_port = htons(TcpPortFor(ntohs(t.sin_port)));
  id->listen_fd = fd;
  SetSrc(id, a);
  if (d != nullptr) AttachDevice(id, d);
  id->state = CmState::kBound;
  return 0;
}

int rdma_listen(rdma_cm_id* cid, int backlog) {
  CmId* id = ToId(cid);
  std::lock_guard<std::mutex> g(Rt().mu);
  if (id->state != CmState::kBound || id->listen_fd < 0) return Fail(EINVAL);
  if (listen(id->listen_fd, backlog > 0 ? backlog : 128) != 0) return -1;
  id->state = CmState::kListen;
  id->listen_tag = new EpollTag{EpollTag::kCmListener, id, id->listen_fd};
  Rt().Watch(id->listen_fd, id->listen_tag, false);
  return 0;
}

int rdma_resolve_addr(rdma_cm_id* cid, sockaddr* src, sockaddr* dst, int) {
  CmId* id = ToId(cid);
  sockaddr_in d, s{};
  if (!ToSin(dst, &d) || d.sin_addr.s_addr == htonl(INADDR_ANY)) return Fail(EINVAL);
  {
    std::lock_guard<std::mutex> g(Rt().mu);
    if (id->state != CmState::kIdle && id->state != CmState::kBound) return Fail(EINVAL);
    Device* dev = nullptr;
    if (src != nullptr && ToSin(src, &s) && s.sin_addr.s_addr != htonl(INADDR_ANY)) {
      dev = Rt().DeviceForAddr(s.sin_addr);
      if (dev == nullptr) return Fail(ENODEV);
    } else if (id->dev != nullptr) {
      dev = id->dev;
    } else {
      dev = Rt().DeviceForRoute(d.sin_addr);
    }
    if (dev == nullptr) return Fail(ENODEV);
    AttachDevice(id, dev);
    if (id->state == CmState::kIdle) {
      s.sin_family = AF_INET;
      s.sin_addr = dev->spec.addr;
      s.sin_port = 0;
      SetSrc(id, s);
    }
    SetDst(id, d);
    id->state = CmState::kAddr;
    PushEventLater(id, RDMA_CM_EVENT_ADDR_RESOLVED);
  }
  return id->sync ? WaitSync(id, RDMA_CM_EVENT_ADDR_RESOLVED) : 0;
}

int rdma_resolve_route(rdma_cm_id* cid, int) {
  CmId* id = ToId(cid);
  {
    std::lock_guard<std::mutex> g(Rt().mu);
    if (id->state != CmState::kAddr) return Fail(EINVAL);
    if (id->id.route.path_rec == nullptr) {
      id->id.route.path_rec = static_cast<ibv_sa_path_rec*>(calloc(1, sizeof(ibv_sa_path_rec)));
      id->id.route.num_paths = 1;
      id->id.route.path_rec->mtu = IBV_MTU_4096;
      id->id.route.path_rec->pkey = htobe16(0xffff);
    }
    // RoCE-style GIDs: the IPv4-mapped addresses (the device's is its GID
    // at index 0), and the traffic class RDMA_OPTION_ID_TOS asked for.
    ibv_sa_path_rec* pr = id->id.route.path_rec;
    if (id->dev != nullptr) pr->sgid = id->dev->gid;
    pr->dgid = MappedGid(id->id.route.addr.dst_sin.sin_addr);
    pr->traffic_class = id->tos;
    pr->hop_limit = 64;
    id->state = CmState::kRoute;
    // While the route resolves, the agent makes the shared-memory segment
    // rdma_connect will offer (none to wait for: rdma_connect makes it).
    if (GetConfig().use_shm && GetConfig().resolve_us > 0 && !id->spare_wanted &&
        id->spare.p == nullptr) {
      id->spare_wanted = true;
      Rt().spares_wanted.fetch_add(1, std::memory_order_relaxed);
    }
    PushEventLater(id, RDMA_CM_EVENT_ROUTE_RESOLVED);
  }
  return id->sync ? WaitSync(id, RDMA_CM_EVENT_ROUTE_RESOLVED) : 0;
}

int rdma_create_qp(rdma_cm_id* cid, ibv_pd* pd, ibv_qp_init_attr* attr) {
  CmId* id = ToId(cid);
  if (id->id.verbs == nullptr || attr == nullptr) return Fail(EINVAL);
  if (pd == nullptr) pd = id->id.pd;
  if (pd == nullptr) pd = DefaultPd(id->id.verbs);
  if (pd == nullptr) return -1;
  ibv_qp_init_attr a = *attr;
  bool made_cqs = false;
  if (a.send_cq == nullptr || a.recv_cq == nullptr) {
    if (id->id.send_cq == nullptr) {
      int n = static_cast<int>(std::max(a.cap.max_send_wr, a.cap.max_recv_wr)) + 1;
      id->id.send_cq_channel = ibv_create_comp_channel(id->id.verbs);
      id->id.recv_cq_channel = ibv_create_comp_channel(id->id.verbs);
      id->id.send_cq = ibv_create_cq(id->id.verbs, n, cid, id->id.send_cq_channel, 0);
      id->id.recv_cq = ibv_create_cq(id->id.verbs, n, cid, id->id.recv_cq_channel, 0);
      made_cqs = true;
      if (id->id.send_cq == nullptr || id->id.recv_cq == nullptr) {
        int e = errno;
        id->owns_cqs = true;
        rdma_destroy_qp(cid);  // releases what was made
        errno = e;
        return -1;
      }
    }
    if (a.send_cq == nullptr) a.send_cq = id->id.send_cq;
    if (a.recv_cq == nullptr) a.recv_cq = id->id.recv_cq;
  }
  ibv_qp* qp = ibv_create_qp(pd, &a);
  if (qp == nullptr) {
    int e = errno;
    if (made_cqs) {
      id->owns_cqs = true;
      rdma_destroy_qp(cid);
    }
    errno = e;
    return -1;
  }
  attr->cap = a.cap;
  std::lock_guard<std::mutex> g(Rt().mu);
  Qp* q = ToQp(qp);
  q->cm_managed = true;
  q->access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  q->qp.state = IBV_QPS_INIT;
  id->id.qp = qp;
  SetLocalQp(id, qp->qp_num);
  id->owns_cqs = made_cqs || id->owns_cqs;
  return 0;
}

int rdma_create_qp_ex(rdma_cm_id* cid, ibv_qp_init_attr_ex* ex) {
  ibv_qp_init_attr a = PlainQpAttr(*ex);
  ibv_pd* pd = (ex->comp_mask & IBV_QP_INIT_ATTR_PD) ? ex->pd : nullptr;
  int r = rdma_create_qp(cid, pd, &a);
  if (r == 0) ex->cap = a.cap;
  return r;
}

void rdma_destroy_qp(rdma_cm_id* cid) {
  CmId* id = ToId(cid);
  if (id->id.qp != nullptr) ibv_destroy_qp(id->id.qp);
  id->id.qp = nullptr;
  id->local_qpn = 0;
  id->local_serial = 0;
  if (id->owns_cqs) {
    ibv_destroy_cq(id->id.send_cq);
    ibv_destroy_cq(id->id.recv_cq);
    ibv_destroy_comp_channel(id->id.send_cq_channel);
    ibv_destroy_comp_channel(id->id.recv_cq_channel);
    id->id.send_cq = id->id.recv_cq = nullptr;
    id->id.send_cq_channel = id->id.recv_cq_channel = nullptr;
    id->owns_cqs = false;
  }
}

int rdma_connect(rdma_cm_id* cid, rdma_conn_param* param) {
  CmId* id = ToId(cid);
  {
    std::lock_guard<std::mutex> g(Rt().mu);
    if (id->state != CmState::kRoute) return Fail(EINVAL);
    if (param != nullptr && param->private_data_len > kReqPdata) return Fail(EINVAL);
    sockaddr_in d = id->id.route.addr.dst_sin;
    int fd = ConnectNonBlocking(d.sin_addr, TcpPortFor(ntohs(d.sin_port)));
    if (fd < 0) return -1;
    Link* l = NewLink(fd, true);
    l->cm = id;
    l->peer_desc = "cm-connect";
    l->deadline_us = NowUs() + kConnectTimeoutUs;
    id->link = l;
    CmReq r{};
    if (id->local_qpn == 0 && param != nullptr) SetLocalQp(id, param->qp_num);
    Qp* qp = IdQp(id);
    r.qpn = id->local_qpn;
    sockaddr_in s = id->id.route.addr.src_sin;
    if (s.sin_port == 0) {
      sockaddr_in local{};
      socklen_t len = sizeof(local);
      getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len);
      s.sin_port = local.sin_port;
      SetSrc(id, s);
    }
    r.src_port = ntohs(s.sin_port);
    if (param != nullptr) {
      CopyParam(*param, &r);
      r.retry_count = param->retry_count;
      if (qp != nullptr && qp->cm_managed) {
        qp->rnr_retry = param->rnr_retry_count > 7 ? 7 : param->rnr_retry_count;
        qp->retry_cnt = param->retry_count > 7 ? 7 : param->retry_count;
      }
    }
    DropSpareWish(id);
    if (LinkSetupShmInitiator(l, &id->spare)) {
      r.shm_offer = 1;
      snprintf(r.offer.name, sizeof(r.offer.name), "%s", l->shm_name.c_str());
      r.offer.nonce = l->shm_nonce;
      r.offer.boot_hash = Rt().boot_hash;
      r.offer.netns = Rt().netns;
      r.offer.ring_bytes = GetConfig().ring_bytes;
    }
    uint32_t n = sizeof(r);
    l->ctl_out.append(reinterpret_cast<const char*>(&n), 4);
    l->ctl_out.push_back(static_cast<char>(kCtlCmReq));
    l->ctl_out.append(reinterpret_cast<const char*>(&r), sizeof(r));
    id->state = CmState::kConnecting;
    id->deadline_us = NowUs() + kConnectTimeoutUs;
    uint64_t none = 0;  // a delayed event's due time stays
    Rt().cm_timers.compare_exchange_strong(none, 1);
    Rt().Watch(fd, new EpollTag{EpollTag::kLink, l, fd}, true);
  }
  if (!id->sync) return 0;
  return WaitSync(id, IdQp(id) ? RDMA_CM_EVENT_ESTABLISHED : RDMA_CM_EVENT_CONNECT_RESPONSE);
}

int rdma_accept(rdma_cm_id* cid, rdma_conn_param* param) {
  CmId* id = ToId(cid);
  {
    std::lock_guard<std::mutex> g(Rt().mu);
    if (id->state != CmState::kReqRcvd || id->link == nullptr) return Fail(EINVAL);
    if (param != nullptr && param->private_data_len > kRepPdata) return Fail(EINVAL);
    Link* l = id->link;
    CmRep r{};
    rdma_conn_param mine{};
    mine.rnr_retry_count = 7;
    mine.retry_count = 7;
    if (param != nullptr) {
      mine = *param;
      CopyParam(*param, &r);
    }
    // On IB the REQ's RNR retry count governs what this side sends.
    mine.rnr_retry_count = id->peer.rnr_retry_count;
    mine.retry_count = id->peer.retry_count;
    if (id->local_qpn == 0 && param != nullptr) SetLocalQp(id, param->qp_num);
    r.qpn = id->local_qpn;
    r.shm_ok = l->shm != nullptr ? 1 : 0;
    ConnectQp(id, mine);
    CtlSend(l, kCtlCmRep, &r, sizeof(r));
    id->state = CmState::kAccepting;
  }
  return id->sync ? WaitSync(id, RDMA_CM_EVENT_ESTABLISHED) : 0;
}

int rdma_reject(rdma_cm_id* cid, const void* pdata, uint8_t len) {
  CmId* id = ToId(cid);
  std::lock_guard<std::mutex> g(Rt().mu);
  if (id->state != CmState::kReqRcvd || id->link == nullptr) return Fail(EINVAL);
  if (len > kRejPdata) return Fail(EINVAL);
  CmRej r{};
  r.pdata_len = len;
  if (len > 0 && pdata != nullptr) memcpy(r.pdata, pdata, len);
  CtlSend(id->link, kCtlCmRej, &r, sizeof(r));
  id->state = CmState::kRejected;
  DropLink(id);
  return 0;
}

int rdma_establish(rdma_cm_id* cid) {
  CmId* id = ToId(cid);
  std::lock_guard<std::mutex> g(Rt().mu);
  if (id->state != CmState::kResponse || id->link == nullptr) return Fail(EINVAL);
  if (Qp* qp = IdQp(id)) {
    rdma_conn_param mine{};
    mine.rnr_retry_count = id->peer.rnr_retry_count;
    mine.retry_count = qp->retry_cnt;
    ConnectQp(id, mine);
  }
  CtlSend(id->link, kCtlCmRtu, "", 0);
  id->state = CmState::kConnected;
  LinkUp(id);
  return 0;
}

int rdma_disconnect(rdma_cm_id* cid) {
  CmId* id = ToId(cid);
  std::lock_guard<std::mutex> g(Rt().mu);
  if (id->state != CmState::kConnected) {
    if (id->state == CmState::kDisconnected) return 0;
    return Fail(EINVAL);
  }
  if (Link* l = id->link) {
    OutFrame f;
    f.hdr.type = kFrameDisconnect;
    if (Qp* qp = IdQp(id); qp != nullptr && qp->cm_managed) QpToErrorLocked(qp, IBV_WC_WR_FLUSH_ERR);
    LinkEnqueue(l, std::move(f));
    LinkPump(l);
  }
  Disconnected(id);
  return 0;
}

int rdma_get_cm_event(rdma_event_channel* channel, rdma_cm_event** event) {
  auto* ch = reinterpret_cast<EventChannel*>(channel);
  if (event == nullptr) return Fail(EINVAL);
  ch->readers.fetch_add(1);
  struct Leave {
    EventChannel* ch;
    ~Leave() { ch->readers.fetch_sub(1); }
  } leave{ch};
  if (ch->destroyed.load()) {
    // After rdma_destroy_event_channel (see there): what a read of the
    // kernel's closed fd gives, and a blocking one stays blocked.
    if (ch->nonblocking_at_destroy) return Fail(EBADF);
    for (;;) pause();
  }
  for (;;) {
    char token;
    ssize_t r = recv(ch->ch.fd, &token, 1, 0);  // blocks unless the app set O_NONBLOCK
    if (r != 1) {
      if (r >= 0) errno = ENODATA;
      return -1;
    }
    // Taken and counted under the lock rdma_destroy_id holds, so an id is
    // never destroyed between the two, and no event outlives its id.
    std::lock_guard<std::mutex> rg(Rt().mu);
    std::lock_guard<std::mutex> g(ch->mu);
    // Empty: rdma_destroy_id took this event back after we read its token;
    // block again, as the kernel's fd would have.
    if (ch->q.empty()) continue;
    CmEvent* e = ch->q.front();
    ch->q.pop_front();
    if (!ch->q.empty()) SendToken(ch);  // more to come: the fd stays readable
    ++e->owner->unacked;
    // A request's new id takes the listener's context now (the listening
    // id is alive: destroying it takes its pending events back under
    // Rt().mu, which we hold).
    if (e->ev.event == RDMA_CM_EVENT_CONNECT_REQUEST && e->ev.listen_id != nullptr)
      e->ev.id->context = e->ev.listen_id->context;
    *event = &e->ev;
    return 0;
  }
}

int rdma_ack_cm_event(rdma_cm_event* event) {
  auto* e = reinterpret_cast<CmEvent*>(event);
  {
    std::lock_guard<std::mutex> g(Rt().mu);
    if (e->owner != nullptr && Ids().count(e->owner)) {
      --e->owner->unacked;
      e->owner->acked.notify_all();
    }
  }
  delete e;
  return 0;
}

const char* rdma_event_str(rdma_cm_event_type event) {
  static const char* kNames[] = {
      "RDMA_CM_EVENT_ADDR_RESOLVED", "RDMA_CM_EVENT_ADDR_ERROR",
      "RDMA_CM_EVENT_ROUTE_RESOLVED", "RDMA_CM_EVENT_ROUTE_ERROR",
      "RDMA_CM_EVENT_CONNECT_REQUEST", "RDMA_CM_EVENT_CONNECT_RESPONSE",
      "RDMA_CM_EVENT_CONNECT_ERROR", "RDMA_CM_EVENT_UNREACHABLE", "RDMA_CM_EVENT_REJECTED",
      "RDMA_CM_EVENT_ESTABLISHED", "RDMA_CM_EVENT_DISCONNECTED",
      "RDMA_CM_EVENT_DEVICE_REMOVAL", "RDMA_CM_EVENT_MULTICAST_JOIN",
      "RDMA_CM_EVENT_MULTICAST_ERROR", "RDMA_CM_EVENT_ADDR_CHANGE",
      "RDMA_CM_EVENT_TIMEWAIT_EXIT"};
  return (event >= 0 && event < 16) ? kNames[event] : "UNKNOWN EVENT";
}

// As librdmacm: an unknown level or option is ENOSYS, a value of the wrong
// size EINVAL. The ACK timeout goes to the QP the CM moves to RTS (and to
// rdma_init_qp_attr); the others are accepted and have no effect here.
int rdma_set_option(rdma_cm_id* cid, int level, int optname, void* optval, size_t optlen) {
  if (cid == nullptr || optval == nullptr) return Fail(EINVAL);
  if (level == RDMA_OPTION_IB && optname == RDMA_OPTION_IB_PATH) return 0;
  if (level != RDMA_OPTION_ID) return Fail(ENOSYS);
  switch (optname) {
    case RDMA_OPTION_ID_TOS: {
      if (optlen != sizeof(uint8_t)) return Fail(EINVAL);
      std::lock_guard<std::mutex> g(Rt().mu);
      ToId(cid)->tos = *static_cast<uint8_t*>(optval);
      return 0;
    }
    case RDMA_OPTION_ID_REUSEADDR:
    case RDMA_OPTION_ID_AFONLY:
      return optlen == sizeof(int) ? 0 : Fail(EINVAL);
    case RDMA_OPTION_ID_ACK_TIMEOUT: {
      if (optlen != sizeof(uint8_t)) return Fail(EINVAL);
      uint8_t t = *static_cast<uint8_t*>(optval);
      if (t > 31) return Fail(EINVAL);
      std::lock_guard<std::mutex> g(Rt().mu);
      CmId* id = ToId(cid);
      id->ack_timeout = t;
      if (Qp* qp = IdQp(id)) qp->timeout = t;  // a QP already past RTS keeps up
      return 0;
    }
    default:
      return Fail(ENOSYS);
  }
}

int rdma_migrate_id(rdma_cm_id* cid, rdma_event_channel* channel) {
  CmId* id = ToId(cid);
  if (channel == nullptr) return Fail(EINVAL);  // synchronous ids: not emulated here
  std::lock_guard<std::mutex> g(Rt().mu);
  id->chan = reinterpret_cast<EventChannel*>(channel);
  id->id.channel = channel;
  id->sync = false;
  return 0;
}

int rdma_notify(rdma_cm_id*, ibv_event_type) { return 0; }

__be16 rdma_get_src_port(rdma_cm_id* id) { return id->route.addr.src_sin.sin_port; }
__be16 rdma_get_dst_port(rdma_cm_id* id) { return id->route.addr.dst_sin.sin_port; }

ibv_context** rdma_get_devices(int* num) {
  auto& rt = Rt();
  std::lock_guard<std::mutex> g(rt.mu);
  auto** list = static_cast<ibv_context**>(calloc(rt.devices.size() + 1, sizeof(ibv_context*)));
  for (size_t i = 0; i < rt.devices.size(); ++i) list[i] = DeviceContext(rt.devices[i]);
  if (num) *num = static_cast<int>(rt.devices.size());
  return list;
}

void rdma_free_devices(ibv_context** list) { free(list); }

int rdma_init_qp_attr(rdma_cm_id* cid, ibv_qp_attr* attr, int* mask) {
  CmId* id = ToId(cid);
  std::lock_guard<std::mutex> g(Rt().mu);
  // The application says which state it wants the attributes for.
  ibv_qp_state want = attr->qp_state;
  memset(attr, 0, sizeof(*attr));
  if (want == IBV_QPS_INIT) {
    attr->qp_state = IBV_QPS_INIT;
    attr->port_num = 1;
    attr->qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                            IBV_ACCESS_REMOTE_READ;
    *mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
  } else if (want == IBV_QPS_RTR) {
    attr->qp_state = IBV_QPS_RTR;
    attr->path_mtu = IBV_MTU_4096;
    attr->dest_qp_num = id->peer_qpn;
    attr->max_dest_rd_atomic = id->peer.responder_resources;
    attr->min_rnr_timer = 12;
    attr->ah_attr = CmAddressVector(id);
    *mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
            IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
  } else if (want == IBV_QPS_RTS) {
    attr->qp_state = IBV_QPS_RTS;
    attr->timeout = id->ack_timeout;
    attr->retry_cnt = 7;
    attr->rnr_retry = 7;
    attr->max_rd_atomic = id->peer.initiator_depth;
    *mask = IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
            IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
  } else {
    return Fail(EINVAL);
  }
  return 0;
}

int rdma_getaddrinfo(const char* node, const char* service, const rdma_addrinfo* hints,
                     rdma_addrinfo** res) {
  addrinfo h{}, *ai = nullptr;
  h.ai_family = AF_INET;
  h.ai_socktype = SOCK_STREAM;
  bool passive = hints != nullptr && (hints->ai_flags & RAI_PASSIVE);
  if (passive) h.ai_flags |= AI_PASSIVE;
  if (hints != nullptr && (hints->ai_flags & RAI_NUMERICHOST)) h.ai_flags |= AI_NUMERICHOST;
  int r = getaddrinfo(node, service, &h, &ai);
  if (r != 0) {
    errno = ENOENT;
    return r;
  }
  auto* out = static_cast<rdma_addrinfo*>(calloc(1, sizeof(rdma_addrinfo)));
  out->ai_flags = hints ? hints->ai_flags : 0;
  out->ai_family = AF_INET;
  out->ai_qp_type = IBV_QPT_RC;
  out->ai_port_space = RDMA_PS_TCP;
  auto* sa = static_cast<sockaddr*>(calloc(1, sizeof(sockaddr_in)));
  memcpy(sa, ai->ai_addr, sizeof(sockaddr_in));
  if (hints != nullptr) {
    if (hints->ai_qp_type != 0) out->ai_qp_type = hints->ai_qp_type;
    if (hints->ai_port_space != 0) out->ai_port_space = hints->ai_port_space;
  }
  if (passive) {
    out->ai_src_addr = sa;
    out->ai_src_len = sizeof(sockaddr_in);
  } else {
    out->ai_dst_addr = sa;
    out->ai_dst_len = sizeof(sockaddr_in);
    // The source the caller names in the hints is the result's source, as
    // librdmacm gives it (rdma_create_ep then binds it, choosing the device).
    if (hints != nullptr && hints->ai_src_addr != nullptr &&
        hints->ai_src_len >= sizeof(sockaddr_in) && hints->ai_src_addr->sa_family == AF_INET) {
      auto* src = static_cast<sockaddr*>(calloc(1, sizeof(sockaddr_in)));
      memcpy(src, hints->ai_src_addr, sizeof(sockaddr_in));
      out->ai_src_addr = src;
      out->ai_src_len = sizeof(sockaddr_in);
    }
  }
  freeaddrinfo(ai);
  *res = out;
  return 0;
}

void rdma_freeaddrinfo(rdma_addrinfo* res) {
  while (res != nullptr) {
    rdma_addrinfo* next = res->ai_next;
    free(res->ai_src_addr);
    free(res->ai_dst_addr);
    free(res->ai_src_canonname);
    free(res->ai_dst_canonname);
    free(res->ai_connect);
    free(res);
    res = next;
  }
}

int rdma_create_ep(rdma_cm_id** out, rdma_addrinfo* res, ibv_pd* pd,
                   ibv_qp_init_attr* qp_init_attr) {
  rdma_cm_id* id = nullptr;
  if (rdma_create_id(nullptr, &id, nullptr, static_cast<rdma_port_space>(res->ai_port_space)) != 0)
    return -1;
  int r = 0;
  if (res->ai_flags & RAI_PASSIVE) {
    r = rdma_bind_addr(id, res->ai_src_addr);
  } else {
    r = rdma_resolve_addr(id, res->ai_src_addr, res->ai_dst_addr, 2000);
    if (r == 0) r = rdma_resolve_route(id, 2000);
  }
  if (r == 0 && qp_init_attr != nullptr && !(res->ai_flags & RAI_PASSIVE))
    r = rdma_create_qp(id, pd, qp_init_attr);
  if (r == 0 && qp_init_attr != nullptr && (res->ai_flags & RAI_PASSIVE)) {
    // For the requests rdma_get_request will hand out (librdmacm does the
    // same): each gets a QP with these attributes.
    CmId* c = ToId(id);
    c->ep_qp = true;
    c->ep_attr = *qp_init_attr;
    c->ep_pd = pd;
  }
  if (r != 0) {
    int e = errno;
    rdma_destroy_id(id);
    errno = e;
    return -1;
  }
  *out = id;
  return 0;
}

void rdma_destroy_ep(rdma_cm_id* id) {
  if (id->qp != nullptr) rdma_destroy_qp(id);
  rdma_destroy_id(id);
}

int rdma_get_request(rdma_cm_id* listen, rdma_cm_id** out) {
  CmId* id = ToId(listen);
  if (!id->sync) return Fail(EINVAL);
  rdma_cm_event* e = nullptr;
  if (WaitSync(id, RDMA_CM_EVENT_CONNECT_REQUEST, &e) != 0) return -1;
  rdma_cm_id* req = e->id;
  rdma_ack_cm_event(e);
  if (id->ep_qp) {
    ibv_qp_init_attr a = id->ep_attr;
    if (rdma_create_qp(req, id->ep_pd, &a) != 0) {
      int err = errno;
      rdma_reject(req, nullptr, 0);
      rdma_destroy_id(req);
      errno = err;
      return -1;
    }
  }
  *out = req;
  return 0;
}

int rdma_join_multicast(rdma_cm_id*, sockaddr*, void*) { return Fail(EOPNOTSUPP); }
int rdma_join_multicast_ex(rdma_cm_id*, rdma_cm_join_mc_attr_ex*, void*) {
  return Fail(EOPNOTSUPP);
}
int rdma_leave_multicast(rdma_cm_id*, sockaddr*) { return Fail(EOPNOTSUPP); }
int rdma_create_srq(rdma_cm_id*, ibv_pd*, ibv_srq_init_attr*) { return Fail(EOPNOTSUPP); }
int rdma_create_srq_ex(rdma_cm_id*, ibv_srq_init_attr_ex*) { return Fail(EOPNOTSUPP); }
void rdma_destroy_srq(rdma_cm_id*) {}
int rdma_get_remote_ece(rdma_cm_id*, ibv_ece*) { return Fail(EOPNOTSUPP); }
int rdma_set_local_ece(rdma_cm_id*, ibv_ece*) { return Fail(EOPNOTSUPP); }
int rdma_reject_ece(rdma_cm_id* id, const void* pdata, uint8_t len) {
  return rdma_reject(id, pdata, len);
}

}  // extern "C"
