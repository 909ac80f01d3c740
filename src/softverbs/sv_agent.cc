// The per-process runtime: devices, key and QP tables, QP listeners, and the
// agent thread that moves data for QPs whose owner is not polling.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <sched.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <fstream>
#include <random>
#include <thread>

#include "sv_internal.h"

namespace softverbs {

namespace {

uint64_t Fnv(const std::string& s) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ULL;
  return h;
}

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

namespace {
// Never destroyed: the agent thread may run while the process exits.
std::atomic<Runtime*> g_runtime{nullptr};
std::atomic<bool> g_forked{false};
std::atomic<void (*)()> g_fork_child_hook{nullptr};
void OnForkChild() { g_forked.store(true, std::memory_order_release); }
}  // namespace

void SetForkChildHook(void (*hook)()) { g_fork_child_hook.store(hook); }

Runtime& Runtime::Get() {
  // In the child of a fork, the parent's runtime is not the child's: its
  // agent thread did not come along, its epoll set and sockets are shared
  // with the parent (whose agent would take the child's events), and a lock
  // another thread held stays held. The child starts over with a runtime of
  // its own, as it would open the device anew; what the parent made (ids,
  // QPs) is not for the child to use, as on hardware.
  if (g_forked.load(std::memory_order_acquire) && g_forked.exchange(false)) {
    if (void (*hook)() = g_fork_child_hook.load()) hook();
    g_runtime.store(new Runtime(), std::memory_order_release);
  }
  Runtime* rt = g_runtime.load(std::memory_order_acquire);
  if (rt == nullptr) {
    static std::once_flag once;
    std::call_once(once, [] {
      g_runtime.store(new Runtime(), std::memory_order_release);
      pthread_atfork(nullptr, nullptr, OnForkChild);
    });
    rt = g_runtime.load(std::memory_order_acquire);
  }
  return *rt;
}

Runtime::Runtime() {
  const Config& c = GetConfig();
  std::random_device rd;
  int i = 0;
  for (const DeviceSpec& s : c.devices) {
    auto* d = new Device();
    memset(&d->dev, 0, sizeof(d->dev));
    d->index = i++;
    d->spec = s;
    d->dev.node_type = IBV_NODE_CA;
    d->dev.transport_type = IBV_TRANSPORT_IB;
    snprintf(d->dev.name, sizeof(d->dev.name), "%s", s.name.c_str());
    snprintf(d->dev.dev_name, sizeof(d->dev.dev_name), "uverbs%d", d->index);
    snprintf(d->dev.dev_path, sizeof(d->dev.dev_path), "/sys/class/infiniband_verbs/uverbs%d",
             d->index);
    snprintf(d->dev.ibdev_path, sizeof(d->dev.ibdev_path), "/sys/class/infiniband/%s",
             d->dev.name);
    uint32_t ip = ntohl(s.addr.s_addr);
    d->lid = static_cast<uint16_t>(ip & 0xffff);
    // IPv4-mapped GID, as RoCE v2 reports for an IPv4 address.
    d->gid = MappedGid(s.addr);
    d->guid = htobe64(0x02c9000000000000ULL | (static_cast<uint64_t>(ip) << 8) | d->index);
    devices.push_back(d);
    qp_listeners.emplace_back();
    qpn_next.push_back(256);  // forces a new listener on first use
  }
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  boot_hash = Fnv(boot);
  struct stat st {};
  if (stat("/proc/self/ns/net", &st) == 0) netns = static_cast<uint64_t>(st.st_ino);
  InstallStatsDump();
}

uint32_t Runtime::AllocKey() {
  static uint32_t next = [] {
    std::random_device rd;
    return (rd() & 0x00ffff00u) | 0x100u;
  }();
  for (;;) {
    uint32_t k = next;
    next += 0x101;
    if (k != 0 && mrs.find(k) == mrs.end()) return k;
  }
}

uint32_t Runtime::AllocQpn(Device* dev) {
  uint32_t& slot = qpn_next[dev->index];
  auto& ls = qp_listeners[dev->index];
  if (slot >= 256) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return 0;
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr = dev->spec.addr;
    socklen_t len = sizeof(a);
    if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || listen(fd, 128) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
      Warn("cannot listen on %s for QP connections: %s", inet_ntoa(dev->spec.addr),
           strerror(errno));
      close(fd);
      return 0;
    }
    ls.push_back(fd);
    listener_port[fd] = ntohs(a.sin_port);
    StartAgent();
    Watch(fd, new EpollTag{EpollTag::kQpListener, nullptr, fd}, false);
    slot = 0;
  }
  uint16_t port = listener_port[ls.back()];
  return (static_cast<uint32_t>(port) << 8) | slot++;
}

Device* Runtime::DeviceForAddr(in_addr a) {
  for (Device* d : devices)
    if (d->spec.addr.s_addr == a.s_addr) return d;
  return nullptr;
}

Device* Runtime::DeviceForRoute(in_addr dst) {
  if (Device* d = DeviceForAddr(dst)) return d;
  uint32_t ip = ntohl(dst.s_addr);
  if ((ip >> 24) == 127) {
    for (Device* d : devices)
      if ((ntohl(d->spec.addr.s_addr) >> 24) == 127) return d;
  }
  for (Device* d : devices) {
    uint32_t m = d->spec.mask.s_addr;
    if ((d->spec.addr.s_addr & m) == (dst.s_addr & m)) return d;
  }
  for (Device* d : devices)
    if ((ntohl(d->spec.addr.s_addr) >> 24) != 127) return d;
  return devices.empty() ? nullptr : devices[0];
}

bool PeerAddrFromAh(const Device* dev, const ibv_ah_attr& ah, in_addr* out) {
  if (ah.is_global) {
    const uint8_t* g = ah.grh.dgid.raw;
    static const uint8_t kPrefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    if (memcmp(g, kPrefix, 12) != 0) return false;
    memcpy(&out->s_addr, g + 12, 4);
    return true;
  }
  if (ah.dlid == 0) return false;
  uint32_t ip = (ntohl(dev->spec.addr.s_addr) & 0xffff0000u) | ah.dlid;
  out->s_addr = htonl(ip);
  return true;
}

// ----------------------------------------------------------------- agent ---

void Runtime::StartAgent() {
  std::call_once(agent_once_, [this] {
    epfd_ = epoll_create1(EPOLL_CLOEXEC);
    wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    epoll_event ev{};
    ev.events = EPOLLIN;
    wake_tag_ = new EpollTag{EpollTag::kWake, nullptr, wake_fd_};
    ev.data.ptr = wake_tag_;
    epoll_ctl(epfd_, EPOLL_CTL_ADD, wake_fd_, &ev);
    std::thread([this] {
      pthread_setname_np(pthread_self(), "softverbs-agent");  // for top, gdb, perf
      AgentMain();
    }).detach();
  });
}

void Runtime::Wake() {
  if (wake_fd_ < 0) return;
  uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
}

void Runtime::Watch(int fd, EpollTag* tag, bool want_out) {
  StartAgent();
  tags_[fd] = tag;
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP | EPOLLET | (want_out ? static_cast<uint32_t>(EPOLLOUT) : 0u);
  ev.data.ptr = tag;
  tag->events = ev.events;
  epoll_ctl(epfd_, EPOLL_CTL_ADD, fd, &ev);
}

void Runtime::UpdateLinkWatch(Link* l) {
  if (epfd_ < 0) return;
  const uint32_t in =
      l->delegated_to == nullptr || !l->agent_masked ? static_cast<uint32_t>(EPOLLIN) : 0u;
  auto mod = [&](int fd, uint32_t events) {
    auto it = tags_.find(fd);
    if (fd < 0 || it == tags_.end() || it->second->events == events) return;
    epoll_event ev{};
    ev.events = events;
    ev.data.ptr = it->second;
    it->second->events = events;
    epoll_ctl(epfd_, EPOLL_CTL_MOD, fd, &ev);
  };
  bool out = l->state != LinkState::kUp || l->shm == nullptr || !l->ctl_out.empty();
  // With a doorbell socket of its own, a shared-memory link's TCP socket
  // is quiet (the peer's death, or doorbells from a peer without a
  // datagram socket): the agent keeps watching it, so masking and
  // unmasking a delegated link costs one epoll_ctl call, not two.
  const bool fd_quiet = l->shm != nullptr && l->db_fd >= 0 && l->state == LinkState::kUp;
  mod(l->fd, EPOLLRDHUP | EPOLLET | (fd_quiet ? static_cast<uint32_t>(EPOLLIN) : in) |
                 (out ? static_cast<uint32_t>(EPOLLOUT) : 0u));
  mod(l->db_fd, EPOLLET | in);
}

void Runtime::Unwatch(int fd) {
  if (epfd_ >= 0) epoll_ctl(epfd_, EPOLL_CTL_DEL, fd, nullptr);
  auto it = tags_.find(fd);
  if (it != tags_.end()) {
    it->second->dead = true;
    retired_now_.push_back(it->second);
    tags_.erase(it);
  }
}

bool Runtime::ProgressLinkLocked(Link* l) {
  if (l->state != LinkState::kUp) return false;
  bool did = LinkReceive(l);
  if (l->state == LinkState::kUp && !l->out.empty()) did |= LinkPump(l);
  return did;
}

bool Runtime::ProgressLocked() {
  bool did = false;
  uint64_t now = NowUs();
  for (size_t i = 0; i < links.size(); ++i) did |= ProgressLinkLocked(links[i]);
  for (auto& [qpn, qp] : qps) QpTimersLocked(qp, now);
  CmTimersLocked(now);
  // Handshakes that never finish (a port scanner, a peer that hung): the
  // CM's own connection attempts are timed by the CM, with its events.
  for (size_t i = 0; i < links.size(); ++i) {
    Link* l = links[i];
    if (l->deadline_us != 0 && now > l->deadline_us &&
        (l->state == LinkState::kConnecting || l->state == LinkState::kHandshake) &&
        (l->cm == nullptr || l->cm_listener_side)) {
      Trace("link %s: handshake timed out", l->peer_desc.c_str());
      LinkKill(l);
    }
  }
  // Reap dead links nobody refers to.
  for (size_t i = 0; i < links.size();) {
    Link* l = links[i];
    if (l->state == LinkState::kDead && l->qp == nullptr && l->cm == nullptr) {
      links[i] = links.back();
      links.pop_back();
      delete l;
    } else {
      ++i;
    }
  }
  return did;
}

void Runtime::AgentMain() {
  const int spin_us = GetConfig().spin_us;
  uint64_t last_active = NowUs();
  epoll_event evs[64];
  for (;;) {
    int timeout_ms = 0;
    bool slept = false;
    if (NowUs() - last_active >= static_cast<uint64_t>(spin_us)) {
      agent_waiting.fetch_add(1, std::memory_order_relaxed);
      std::unique_lock<std::mutex> g(mu);
      agent_waiting.fetch_sub(1, std::memory_order_relaxed);
      for (Link* l : links) LinkSetSleeping(l, true);
      std::atomic_thread_fence(std::memory_order_seq_cst);
      bool pending = false;
      bool timers = false;
      uint64_t now = NowUs();
      for (Link* l : links) {
        if (LinkRecentlyPolled(l, now)) timers = true;
        // The rest of a frame that has begun is on its way: keep spinning
        // rather than pay a doorbell round trip per ring's worth.
        if (l->state == LinkState::kUp && l->in_payload && l->in_begun && l->in_left > 0 &&
            l->shm != nullptr)
          pending = true;
        if (LinkHasRxData(l) && !(l->in_payload && !l->in_begun)) pending = true;
        if (l->in_payload && !l->in_begun) timers = true;
        if (l->state == LinkState::kConnecting || l->state == LinkState::kHandshake)
          timers = true;
      }
      for (auto& [qpn, qp] : qps)
        if (qp->link_deadline_us != 0) timers = true;
      if (cm_timers.load(std::memory_order_relaxed) != 0) timers = true;
      if (pending) {
        for (Link* l : links) LinkSetSleeping(l, false);
      } else {
        timeout_ms = timers ? 1 : 200;
        slept = true;
      }
    }
    int n = epoll_wait(epfd_, evs, 64, timeout_ms);
    agent_waiting.fetch_add(1, std::memory_order_relaxed);
    std::unique_lock<std::mutex> g(mu);
    agent_waiting.fetch_sub(1, std::memory_order_relaxed);
    if (slept)
      for (Link* l : links) LinkSetSleeping(l, false);
    bool did = false;
    for (int i = 0; i < n; ++i) {
      auto* tag = static_cast<EpollTag*>(evs[i].data.ptr);
      if (tag->dead) continue;
      switch (tag->kind) {
        case EpollTag::kWake: {
          uint64_t v;
          (void)!read(wake_fd_, &v, sizeof(v));
          break;
        }
        case EpollTag::kQpListener:
          HandleQpListener(tag->fd);
          break;
        case EpollTag::kCmListener:
          CmHandleListener(tag->obj);
          break;
        case EpollTag::kLink:
          HandleLinkEvent(static_cast<Link*>(tag->obj), evs[i].events, tag->fd);
          break;
      }
      did = true;
    }
    did |= ProgressLocked();
    for (EpollTag* t : retired_prev_) delete t;
    retired_prev_.swap(retired_now_);
    retired_now_.clear();
    if (did) last_active = NowUs();
    else if (!slept) sched_yield();
  }
}

// ------------------------------------------------------------ handshakes ---

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

namespace {

// Reads every doorbell waiting on a datagram socket, a batch per call.
void DrainDoorbells(int fd) {
  constexpr unsigned kBatch = 16;
  char byte[kBatch];
  iovec v[kBatch];
  mmsghdr m[kBatch];
  for (unsigned i = 0; i < kBatch; ++i) {
    v[i] = {&byte[i], 1};  // a doorbell carries nothing: truncated is fine
    m[i] = {};
    m[i].msg_hdr.msg_iov = &v[i];
    m[i].msg_hdr.msg_iovlen = 1;
  }
  while (recvmmsg(fd, m, kBatch, MSG_DONTWAIT, nullptr) == static_cast<int>(kBatch)) {
  }
}

}  // namespace

void HandleLinkEvent(Link* l, uint32_t events, int fired) {
  if (l->state == LinkState::kDead) return;
  if (l->state == LinkState::kConnecting) {
    if (!(events & (EPOLLOUT | EPOLLERR | EPOLLHUP))) return;
    int err = 0;
    socklen_t len = sizeof(err);
    getsockopt(l->fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err == EINPROGRESS) return;
    if (err != 0) {
      Trace("link %s: connect: %s", l->peer_desc.c_str(), strerror(err));
      if (l->qp != nullptr && !l->qp->cm_managed) {
        Qp* qp = l->qp;
        qp->link = nullptr;
        l->qp = nullptr;
        qp->next_connect_us = NowUs() + 2000;
      }
      l->connect_error = err;
      LinkKill(l);
      return;
    }
    l->state = LinkState::kHandshake;
  }
  if (l->state == LinkState::kHandshake) {
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
    if (l->state != LinkState::kUp) return;
  }
  if (l->state != LinkState::kUp) return;
  if (l->shm != nullptr) {
    // Only doorbells and EOF arrive on the sockets in this mode: doorbells
    // on the datagram socket, EOF (and the doorbells of a peer without a
    // datagram socket) on the TCP socket. Each is read only when it may
    // have something: a read that finds nothing is a system call for
    // nothing, per message.
    if (l->db_fd >= 0 && fired != l->fd) DrainDoorbells(l->db_fd);
    if (fired == l->fd || (fired < 0 && l->db_fd < 0)) {
      char buf[256];
      for (;;) {
        ssize_t r = recv(l->fd, buf, sizeof(buf), MSG_DONTWAIT);
        if (r > 0) continue;
        if (r < 0 && (errno == EAGAIN || errno == EINTR)) break;
        Trace("link %s: peer gone (%s)", l->peer_desc.c_str(), r == 0 ? "EOF" : strerror(errno));
        LinkReceive(l);  // what the peer wrote before it went away
        LinkKill(l);
        return;
      }
    }
  }
  Runtime::Get().ProgressLinkLocked(l);
}

}  // namespace softverbs

namespace softverbs {
namespace {
CmHooks g_cm_hooks{};
}  // namespace

void SetCmHooks(const CmHooks& hooks) { g_cm_hooks = hooks; }
void CmHandleListener(void* listener) {
  if (g_cm_hooks.listener) g_cm_hooks.listener(listener);
}
bool CmHandleCtl(Link* l, uint8_t type, const std::string& body) {
  return g_cm_hooks.ctl ? g_cm_hooks.ctl(l, type, body) : false;
}
void CmLinkDead(Link* l) {
  if (g_cm_hooks.link_dead) g_cm_hooks.link_dead(l);
}
void CmDisconnectFrame(Link* l) {
  if (g_cm_hooks.disconnect) g_cm_hooks.disconnect(l);
}
void CmTimersLocked(uint64_t now) {
  if (g_cm_hooks.timers) g_cm_hooks.timers(now);
}
}  // namespace softverbs
