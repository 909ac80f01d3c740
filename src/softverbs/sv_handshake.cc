// Link handshakes: the non-blocking connect, the control messages that
// travel on a link's socket before it is up ([u32 len][u8 type][body]),
// the raw QP path's HELLO/HELLO_ACK (a QP connected by ibv_modify_qp
// reaches its peer's QP listener, named by the upper bits of the QPN), and
// the shared-memory offer each carries.
#include <arpa/inet.h>
#include <netinet/tcp.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include "sv_internal.h"

namespace softverbs {

namespace {

void SetNoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

struct HelloMsg {
  uint32_t src_qpn;
  uint32_t dst_qpn;
  uint8_t shm_offer;
  uint8_t pad[7];
  ShmOffer offer;
};
struct HelloAckMsg {
  uint8_t ok;
  uint8_t shm_ok;
};

}  // namespace

int ConnectNonBlocking(in_addr addr, uint16_t port, in_addr from) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  SetNoDelay(fd);
  if (from.s_addr != 0) {
    sockaddr_in b{};
    b.sin_family = AF_INET;
    b.sin_addr = from;
    if (bind(fd, reinterpret_cast<sockaddr*>(&b), sizeof(b)) != 0) {
      int e = errno;
      close(fd);
      errno = e;
      return -1;
    }
  }
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr = addr;
  a.sin_port = htons(port);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 && errno != EINPROGRESS) {
    int e = errno;
    close(fd);
    errno = e;
    return -1;
  }
  return fd;
}

void CtlSend(Link* l, uint8_t type, const void* body, size_t len) {
  uint32_t n = static_cast<uint32_t>(len);
  l->ctl_out.append(reinterpret_cast<const char*>(&n), 4);
  l->ctl_out.push_back(static_cast<char>(type));
  l->ctl_out.append(static_cast<const char*>(body), len);
  CtlFlush(l);
}

bool CtlFlush(Link* l) {
  while (!l->ctl_out.empty() && l->fd >= 0) {
    ssize_t w = send(l->fd, l->ctl_out.data(), l->ctl_out.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    if (w < 0) {
      if (errno != EAGAIN && errno != EINTR) {
        LinkKill(l);
        return false;
      }
      // The rest goes when the socket is writable: make sure that wakes us.
      if (l->state == LinkState::kUp) Runtime::Get().UpdateLinkWatch(l);
      return false;
    }
    l->ctl_out.erase(0, static_cast<size_t>(w));
  }
  return l->ctl_out.empty();
}

// Reads exactly one control message, never past it: what follows on the
// socket belongs to the data stream.
bool CtlPop(Link* l, uint8_t* type, std::string* body) {
  for (;;) {
    size_t need = 5;
    if (l->ctl_in.size() >= 5) {
      uint32_t n;
      memcpy(&n, l->ctl_in.data(), 4);
      if (n > 4096) {
        Warn("link %s: bad control message length %u; closing", l->peer_desc.c_str(), n);
        LinkKill(l);
        return false;
      }
      need = 5 + n;
    }
    if (l->ctl_in.size() == need && need > 5) break;
    if (l->ctl_in.size() == 5 && need == 5) break;
    char buf[4096 + 5];
    ssize_t r = recv(l->fd, buf, need - l->ctl_in.size(), MSG_DONTWAIT);
    if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) {
      LinkKill(l);
      return false;
    }
    if (r < 0) return false;
    l->ctl_in.append(buf, static_cast<size_t>(r));
  }
  *type = static_cast<uint8_t>(l->ctl_in[4]);
  body->assign(l->ctl_in, 5, std::string::npos);
  l->ctl_in.clear();
  return true;
}

void HandleQpListener(int lfd) {
  for (;;) {
    int fd = accept4(lfd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;
    SetNoDelay(fd);
    Link* l = NewLink(fd, false);
    l->deadline_us = NowUs() + 30 * 1000000ULL;
    l->peer_desc = "qp-accept";
    Runtime::Get().Watch(fd, new EpollTag{EpollTag::kLink, l, fd}, true);
    HandleLinkEvent(l, EPOLLIN);
  }
}

namespace {

// Acceptor of a raw (non-CM) QP connection: the HELLO names our QP.
void AcceptHello(Link* l, const std::string& body) {
  HelloMsg h;
  if (body.size() != sizeof(h)) {
    LinkKill(l);
    return;
  }
  memcpy(&h, body.data(), sizeof(h));
  auto& rt = Runtime::Get();
  auto it = rt.qps.find(h.dst_qpn);
  Qp* qp = it == rt.qps.end() ? nullptr : it->second;
  HelloAckMsg ack{};
  sockaddr_in from{};
  socklen_t len = sizeof(from);
  bool from_peer = getpeername(l->fd, reinterpret_cast<sockaddr*>(&from), &len) == 0 &&
                   qp != nullptr && from.sin_addr.s_addr == qp->peer_addr.s_addr;
  if (qp == nullptr || !from_peer || qp->cm_managed || qp->dest_qpn != h.src_qpn ||
      (qp->qp.state != IBV_QPS_RTR && qp->qp.state != IBV_QPS_RTS) ||
      (qp->link != nullptr && qp->link->state != LinkState::kDead)) {
    Trace("hello for qpn 0x%x from 0x%x refused", h.dst_qpn, h.src_qpn);
    CtlSend(l, kCtlHelloAck, &ack, sizeof(ack));
    LinkKill(l);
    return;
  }
  ack.ok = 1;
  if (h.shm_offer && h.offer.boot_hash == rt.boot_hash && h.offer.netns == rt.netns &&
      GetConfig().use_shm) {
    std::string name(h.offer.name, strnlen(h.offer.name, sizeof(h.offer.name)));
    ack.shm_ok = LinkSetupShmAcceptor(l, name, h.offer.nonce) ? 1 : 0;
  }
  CtlSend(l, kCtlHelloAck, &ack, sizeof(ack));
  if (qp->link != nullptr) {
    LinkUndelegate(qp->link);  // no longer this QP's wire: nobody's to wake
    qp->link->qp = nullptr;
  }
  qp->link = l;
  l->qp = qp;
  char desc[64];
  snprintf(desc, sizeof(desc), "qpn 0x%x<-0x%x %s", qp->qp.qp_num, h.src_qpn,
           ack.shm_ok ? "shm" : "tcp");
  l->peer_desc = desc;
  l->state = LinkState::kUp;
  Trace("link %s: up", l->peer_desc.c_str());
  Runtime::Get().UpdateLinkWatch(l);
  QpLinkUpLocked(qp);
}

void InitiatorHelloAck(Link* l, const std::string& body) {
  HelloAckMsg ack{};
  if (body.size() != sizeof(ack)) {
    LinkKill(l);
    return;
  }
  memcpy(&ack, body.data(), sizeof(ack));
  LinkShmConfirmed(l, ack.shm_ok != 0);
  if (!ack.ok) {
    // The peer QP is not ready yet (or gone): the QP retries until its
    // retry budget runs out, like a requester retrying a lost packet.
    Qp* qp = l->qp;
    if (qp != nullptr) {
      qp->link = nullptr;
      l->qp = nullptr;
      qp->next_connect_us = NowUs() + 2000;
    }
    LinkKill(l);
    return;
  }
  if (l->qp != nullptr) {
    char desc[64];
    snprintf(desc, sizeof(desc), "qpn 0x%x->0x%x %s", l->qp->qp.qp_num, l->qp->dest_qpn,
             l->shm ? "shm" : "tcp");
    l->peer_desc = desc;
  }
  l->state = LinkState::kUp;
  Trace("link %s: up", l->peer_desc.c_str());
  Runtime::Get().UpdateLinkWatch(l);
  if (l->qp != nullptr) QpLinkUpLocked(l->qp);
}

}  // namespace

// Starts the raw-path connection of an initiating QP (the side with the
// lower address/QPN) to its peer's QP listener.
void QpTryConnectLocked(Qp* qp) {
  uint16_t port = static_cast<uint16_t>(qp->dest_qpn >> 8);
  // From our device's address: the peer checks that this is who its QP
  // was told to expect.
  int fd = ConnectNonBlocking(qp->peer_addr, port, qp->device->spec.addr);
  if (fd < 0) {
    qp->next_connect_us = NowUs() + 2000;
    return;
  }
  Link* l = NewLink(fd, true);
  l->qp = qp;
  qp->link = l;
  l->peer_desc = "qp-connect";
  HelloMsg h{};
  h.src_qpn = qp->qp.qp_num;
  h.dst_qpn = qp->dest_qpn;
  if (LinkSetupShmInitiator(l)) {
    h.shm_offer = 1;
    snprintf(h.offer.name, sizeof(h.offer.name), "%s", l->shm_name.c_str());
    h.offer.nonce = l->shm_nonce;
    h.offer.boot_hash = Runtime::Get().boot_hash;
    h.offer.netns = Runtime::Get().netns;
    h.offer.ring_bytes = GetConfig().ring_bytes;
  }
  // Queued now, sent once connect() completes.
  uint32_t n = sizeof(h);
  l->ctl_out.append(reinterpret_cast<const char*>(&n), 4);
  l->ctl_out.push_back(static_cast<char>(kCtlHello));
  l->ctl_out.append(reinterpret_cast<const char*>(&h), sizeof(h));
  Runtime::Get().Watch(fd, new EpollTag{EpollTag::kLink, l, fd}, true);
}

// The handshake of a link: what is queued goes out, and each control
// message that has arrived is handled (HELLO/HELLO_ACK of a raw QP here,
// the CM's through its hooks); anything else closes the link.
void HandshakeStepLocked(Link* l) {
  CtlFlush(l);
  uint8_t type;
  std::string body;
  while (l->state == LinkState::kHandshake && CtlPop(l, &type, &body)) {
    if (type == kCtlHello && !l->initiator) {
      AcceptHello(l, body);
    } else if (type == kCtlHelloAck && l->initiator) {
      InitiatorHelloAck(l, body);
    } else if (!CmHandleCtl(l, type, body)) {
      Warn("link %s: unexpected control message %u; closing", l->peer_desc.c_str(), type);
      LinkKill(l);
    }
  }
}

}  // namespace softverbs
