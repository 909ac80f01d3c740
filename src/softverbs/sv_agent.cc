// The agent thread: one epoll set over every link, QP listener and CM
// listener of the process, moving data for QPs whose owner is not polling,
// running timers, and dispatching each link's events (HandleLinkEvent).
#include <arpa/inet.h>
#include <pthread.h>
#include <sched.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <thread>

#include "sv_internal.h"

namespace softverbs {

// ----------------------------------------------------------------- agent ---

void Runtime::StartAgent() {
  std::call_once(agent_once_, [this] {
    epfd_ = epoll_create1(EPOLL_CLOEXEC);
    wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    epoll_event ev{};
    ev.events = EPOLLIN;
    wake_tag_ = new EpollTag{EpollTag::kWake, nullptr, wake_fd_};
    ev.data.ptr = wake_tag_;
    EpollCtl(epfd_, EPOLL_CTL_ADD, wake_fd_, &ev);
    std::thread([this] {
      pthread_setname_np(pthread_self(), "softverbs-agent");  // for top, gdb, perf
      MarkAgentThread();  // its CPU time is the device's already
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
  EpollCtl(epfd_, EPOLL_CTL_ADD, fd, &ev);
}

void Runtime::UpdateLinkWatch(Link* l) {
  if (epfd_ < 0) return;
  auto mod = [&](int fd, uint32_t events) {
    auto it = tags_.find(fd);
    if (fd < 0 || it == tags_.end() || it->second->events == events) return;
    epoll_event ev{};
    ev.events = events;
    ev.data.ptr = it->second;
    it->second->events = events;
    EpollCtl(epfd_, EPOLL_CTL_MOD, fd, &ev);
  };
  bool out = l->state != LinkState::kUp || l->shm == nullptr || !l->ctl_out.empty();
  mod(l->fd, EPOLLRDHUP | EPOLLET | EPOLLIN | (out ? static_cast<uint32_t>(EPOLLOUT) : 0u));
  mod(l->db_fd, EPOLLET | EPOLLIN);
}

void Runtime::Unwatch(int fd) {
  if (epfd_ >= 0) EpollCtl(epfd_, EPOLL_CTL_DEL, fd, nullptr);
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
    // A shared-memory segment for a connection on its way (its route
    // resolving), made here with no lock held; one per round, so CM events
    // and doorbells are not held up behind many, and no sleep while more
    // are wanted.
    if (spares_wanted.load(std::memory_order_relaxed) > 0) CmPrepareSpares();
    int timeout_ms = 0;
    uint64_t first_due = 0;  // a CM event due before timeout_ms is over
    bool slept = false;
    if (NowUs() - last_active >= static_cast<uint64_t>(spin_us) &&
        spares_wanted.load(std::memory_order_relaxed) == 0) {
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
      const uint64_t cm = cm_timers.load(std::memory_order_relaxed);
      if (cm != 0) timers = true;
      if (cm > 1) first_due = cm;
      if (pending) {
        for (Link* l : links) LinkSetSleeping(l, false);
      } else {
        timeout_ms = timers ? 1 : 200;
        slept = true;
      }
    }
    int n = -1;
    // epoll_pwait2 is Linux 5.11 and later, and a container's seccomp
    // profile may refuse it: then whole milliseconds, as before.
    static bool no_pwait2 = false;
    if (slept && first_due != 0 && !no_pwait2) {
      uint64_t now = NowUs();
      uint64_t us = std::min<uint64_t>(first_due > now ? first_due - now : 0,
                                       static_cast<uint64_t>(timeout_ms) * 1000);
      timespec ts{static_cast<time_t>(us / 1000000), static_cast<long>(us % 1000000) * 1000};
      n = epoll_pwait2(epfd_, evs, 64, &ts, nullptr);
      if (n < 0 && (errno == ENOSYS || errno == EPERM)) {
        no_pwait2 = true;
        n = epoll_wait(epfd_, evs, 64, timeout_ms);
      }
    } else {
      n = epoll_wait(epfd_, evs, 64, timeout_ms);
    }
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

// Reads every doorbell waiting on a datagram socket, a batch per call.
int DrainDoorbells(int fd) {
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
  int total = 0, n;
  while ((n = recvmmsg(fd, m, kBatch, MSG_DONTWAIT, nullptr)) > 0) {
    total += n;
    if (n < static_cast<int>(kBatch)) break;
  }
  return total;
}

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
    HandshakeStepLocked(l);
    if (l->state != LinkState::kUp) return;
  }
  if (l->state != LinkState::kUp) return;
  if (l->shm != nullptr) {
    // Only doorbells and EOF arrive on the sockets in this mode: doorbells
    // on the datagram sockets (the agent's, or the waiter's: a thread woken
    // through a completion channel), EOF (and the doorbells of a peer
    // without a datagram socket) on the TCP socket. Each is read only when
    // it may have something: a read that finds nothing is a system call
    // for nothing, per message.
    if (fired >= 0 && fired == l->wdb_fd) LinkDrainWaiterDoorbell(l);
    else if (l->db_fd >= 0 && fired != l->fd) DrainDoorbells(l->db_fd);
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
