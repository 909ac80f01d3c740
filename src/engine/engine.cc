// The engine's facade and registry, and RDMA CM: connection set-up on both
// sides, connect timeouts, listeners. The poller is in poller.cc.
#include "engine/engine.h"

#include <arpa/inet.h>
#include <pthread.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "config/config.h"
#include "engine/engine_impl.h"
#include "verbs/log.h"
#include "verbs/status.h"

namespace grpc_rdma {

uint64_t NowMicros() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000 + ts.tv_nsec / 1000;
}

namespace {

// Our connect/accept parameters: the Hello as private data, and infinite
// RNR retry (credits keep receives posted; a wait is never an error).
rdma_conn_param ConnParam(const wire::Hello* hello) {
  rdma_conn_param p{};
  p.private_data = hello;
  p.private_data_len = sizeof(*hello);
  p.responder_resources = 1;
  p.initiator_depth = 1;
  p.rnr_retry_count = 7;
  p.retry_count = 7;
  return p;
}

// Descriptors a connection holds before it is established: its completion
// channel, and under softverbs its wire's socket, doorbells and the
// shared-memory segment's (5 measured; 1 on hardware, where the CQ, QP and
// CM id have none of their own).
constexpr uint64_t kFdsPerConnection = 5;

int HalfOpenCap(const Options& o) {
  uint64_t cap = static_cast<uint64_t>(std::max(o.max_half_open, 1));
  uint64_t each = static_cast<uint64_t>(o.eager_depth) *
                  BufferPool::ClassFor(o.acc_size + wire::kHeaderBytes);
  if (each > 0) cap = std::min(cap, o.buf_size / 8 / each);
  rlimit fds{};
  if (getrlimit(RLIMIT_NOFILE, &fds) == 0 && fds.rlim_cur != RLIM_INFINITY)
    cap = std::min<uint64_t>(cap, fds.rlim_cur / 4 / kFdsPerConnection);
  return static_cast<int>(std::max<uint64_t>(cap, 1));
}

}  // namespace

// ---------------------------------------------------------------- engine ---

EngineImpl::EngineImpl(const Options& o, ChunkMemory memory)
    : options(o),
      chunk_memory(memory),
      budget(o.buf_size, OneConnectionBytes(o)),
      device_(o.device_explicit ? o.device : ""),
      half_open_cap_(HalfOpenCap(o)) {}

const char* EngineImpl::WrongPathLocked(rdma_cm_id* id, const char* what) {
  ibv_context* ctx = id != nullptr ? id->verbs : nullptr;
  if (ctx == nullptr) return nullptr;
  const char* n = ibv_get_device_name(ctx->device);
  const std::string name = n != nullptr ? n : "?";
  std::string why, key;
  const ibv_sa_path_rec* path = id->route.num_paths > 0 ? id->route.path_rec : nullptr;
  if (!device_.empty() && device_ != name) {
    why = absl::StrCat(what, " is on RDMA device ", name, ", not TF_RDMA_DEV_NAME=", device_);
    key = name;
  } else if (options.port > 0 && id->port_num != 0 && id->port_num != options.port) {
    why = absl::StrCat(what, " is on port ", static_cast<int>(id->port_num), " of ", name,
                       ", not TF_RDMA_PORT=", options.port);
    key = absl::StrCat(name, " port ", static_cast<int>(id->port_num));
  } else if (options.gid_index >= 0 && path != nullptr &&
             (path->sgid.global.subnet_prefix != 0 || path->sgid.global.interface_id != 0)) {
    uint8_t port = id->port_num != 0 ? id->port_num : 1;
    ibv_gid want{};
    if (ibv_query_gid(ctx, port, options.gid_index, &want) != 0 ||
        memcmp(&want, &path->sgid, sizeof(want)) != 0) {
      char gid[INET6_ADDRSTRLEN] = "?";
      inet_ntop(AF_INET6, path->sgid.raw, gid, sizeof(gid));
      why = absl::StrCat(what, " is reached from GID ", gid, " of port ", static_cast<int>(port),
                         " of ", name, ", which is not at TF_RDMA_GID_INDEX=",
                         options.gid_index);
      key = absl::StrCat(name, " gid ", gid);
    }
  }
  if (why.empty()) return nullptr;
  wrong_device_why_ = std::move(why);
  if (std::find(wrong_devices_logged_.begin(), wrong_devices_logged_.end(), key) ==
      wrong_devices_logged_.end()) {
    wrong_devices_logged_.push_back(key);
    GRPC_RDMA_LOG_ERROR(
        "%s: such connections use TCP (said once per device, port or GID; "
        "GRPC_TRACE=rdma shows each)",
        wrong_device_why_.c_str());
  }
  return wrong_device_why_.c_str();
}

absl::Status EngineImpl::SetTosLocked(rdma_cm_id* id) {
  if (options.tos < 0) return absl::OkStatus();
  uint8_t tos = static_cast<uint8_t>(options.tos);
  return CheckErrno(rdma_set_option(id, RDMA_OPTION_ID, RDMA_OPTION_ID_TOS, &tos, 1) != 0,
                    "rdma_set_option(TOS)", absl::StrCat("TF_RDMA_TOS=", options.tos));
}

void EngineImpl::Shutdown() {
  {
    std::lock_guard<std::mutex> g(mu);
    stop_ = true;
  }
  Wake();
  if (poller_.joinable()) poller_.join();
  Deferred d;
  std::map<rdma_cm_id*, std::shared_ptr<ConnImpl>> conns;
  {
    std::lock_guard<std::mutex> g(mu);
    for (auto& [id, c] : conns_) {
      UnwatchLocked(c.get());
      std::lock_guard<std::mutex> cl(c->mu());
      c->CloseLocked(absl::UnavailableError("engine shut down"), &d, true);
      // Nobody polls it after this: zero-copy writes end now (flushed, or
      // the QP destroyed first), not when the owner lets go of it.
      c->SettleZeroCopyLocked(&d);
    }
    conns.swap(conns_);
    listeners_.clear();
  }
  d.Run();
  // conns (and what they own) go here, outside the locks.
}

EngineImpl::~EngineImpl() {
  if (poll_epfd_ >= 0) close(poll_epfd_);
  if (epfd_ >= 0) close(epfd_);
  if (wake_fd_ >= 0) close(wake_fd_);
}

void EngineImpl::Wake() {
  wakeups.fetch_add(1, std::memory_order_relaxed);
  uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
}

void EngineImpl::WatchLocked(ConnImpl* c) {
  // A host-polled connection's channel goes in the poller's own set only,
  // where the poller sees it when no host thread polls (the host's copy of
  // epfd_ must not report it: another thread would wake for every event).
  int target = c->host_polled ? poll_epfd_ : epfd_;
  auto it = conns_.find(c->cm_id());
  if (it == conns_.end() || it->second.get() != c || c->channel_fd() < 0 || stop_) target = -1;
  if (c->watch_set == target) return;
  UnwatchLocked(c);
  if (target < 0) return;
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = reinterpret_cast<uint64_t>(c->cm_id());
  if (epoll_ctl(target, EPOLL_CTL_ADD, c->channel_fd(), &ev) == 0) {
    c->watch_set = target;
  } else {
    // Then the connection is looked at only when the poller wakes for
    // something else (e.g. ELOOP: an application nesting epoll sets deeper).
    static std::atomic<bool> said{false};
    if (!said.exchange(true))
      GRPC_RDMA_LOG_ERROR("cannot watch a connection's completion channel: %s",
                          strerror(errno));
  }
}

void EngineImpl::UnwatchLocked(ConnImpl* c) {
  if (c->watch_set < 0) return;
  epoll_ctl(c->watch_set, EPOLL_CTL_DEL, c->channel_fd(), nullptr);
  c->watch_set = -1;
}

std::shared_ptr<ConnImpl> EngineImpl::Find(rdma_cm_id* id) {
  auto it = conns_.find(id);
  return it == conns_.end() ? nullptr : it->second;
}

void EngineImpl::SnapshotLocked(ConnList* out) const {
  out->clear();
  out->reserve(conns_.size());
  for (const auto& [id, c] : conns_) out->push_back(c);
}

// ------------------------------------------------------------ RDMA CM ---

std::weak_ptr<Connection> EngineImpl::Connect(const sockaddr_in& addr, int timeout_ms,
                                              Engine::ConnectDone done,
                                              const JoinRequest* joins) {
  Deferred d;
  std::weak_ptr<Connection> made;
  {
    std::lock_guard<std::mutex> g(mu);
    absl::StatusOr<CmId> id = CreateCmId(events_.get(), nullptr);
    if (!id.ok()) {
      absl::Status s = absl::UnavailableError(id.status().message());
      d.push_back([done, s] { done(s); });
    } else {
      rdma_cm_id* raw = id->get();
      auto c = std::make_shared<ConnImpl>(shared_from_this(), std::move(*id), false);
      std::lock_guard<std::mutex> cl(c->mu());
      c->connect_done = std::move(done);
      c->connect_deadline_us = NowMicros() + static_cast<uint64_t>(timeout_ms) * 1000;
      if (joins != nullptr) c->SetJoinsLocked(*joins);
      conns_[raw] = c;
      made = c;
      sockaddr_in dst = addr;
      if (rdma_resolve_addr(raw, nullptr, reinterpret_cast<sockaddr*>(&dst), timeout_ms) != 0) {
        FailConnectLocked(c.get(), CheckErrno(true, "rdma_resolve_addr"), &d);
      }
    }
  }
  d.Run();
  Wake();  // the connect deadline needs the poller's attention
  return made;
}

void EngineImpl::CancelConnect(const std::weak_ptr<Connection>& connecting) {
  std::shared_ptr<Connection> conn = connecting.lock();
  if (conn == nullptr) return;
  auto* c = static_cast<ConnImpl*>(conn.get());
  Deferred d;
  {
    std::lock_guard<std::mutex> g(mu);
    std::lock_guard<std::mutex> cl(c->mu());
    // Still connecting (the client's own; an accepted one is not ours to
    // cancel): failed as a timeout fails it, its CM id destroyed.
    if (!c->passive() && c->connect_done && conns_.count(c->cm_id()) != 0) {
      FailConnectLocked(c, absl::UnavailableError("RDMA connect cancelled"), &d);
    }
  }
  d.Run();
}

absl::StatusOr<CmId> EngineImpl::ListenIdLocked(const sockaddr_in& addr, size_t index) {
  ASSIGN_OR_RETURN(CmId id, CreateCmId(events_.get(), nullptr));
  sockaddr_in a = addr;
  RETURN_IF_ERROR(CheckErrno(rdma_bind_addr(id.get(), reinterpret_cast<sockaddr*>(&a)) != 0,
                             "rdma_bind_addr"));
  // A specific address is bound to its device now (a wildcard to none:
  // requests on other devices are refused as they come).
  if (const char* why = WrongPathLocked(id.get(), "the address"))
    return absl::FailedPreconditionError(why);
  RETURN_IF_ERROR(SetTosLocked(id.get()));
  RETURN_IF_ERROR(CheckErrno(rdma_listen(id.get(), 128) != 0, "rdma_listen"));
  id->context = reinterpret_cast<void*>(index + 1);
  return id;
}

absl::StatusOr<uint16_t> EngineImpl::Listen(const sockaddr_in& addr, Engine::AcceptFn on_accept) {
  std::lock_guard<std::mutex> g(mu);
  ASSIGN_OR_RETURN(CmId id, ListenIdLocked(addr, listeners_.size()));
  uint16_t port = ntohs(rdma_get_src_port(id.get()));
  listeners_.push_back(std::move(id));
  accept_fns_.push_back(std::move(on_accept));
  return port;
}

void EngineImpl::RelistenLocked() {
  if (lost_listeners_.empty()) return;
  uint64_t now = NowMicros();
  for (size_t i = 0; i < lost_listeners_.size();) {
    LostListener& l = lost_listeners_[i];
    if (now < l.next_try_us) {
      ++i;
      continue;
    }
    absl::StatusOr<CmId> id = ListenIdLocked(l.addr, l.index);
    if (!id.ok()) {  // still no device there (ENODEV), or the port taken
      l.next_try_us = now + static_cast<uint64_t>(kRelistenMs) * 1000;
      if (!l.said && !absl::StrContains(id.status().message(), strerror(ENODEV))) {
        l.said = true;  // news once; ENODEV is the device still gone
        GRPC_RDMA_LOG_ERROR("cannot listen for RDMA on port %d again yet (%s); trying every %d ms",
                            ntohs(l.addr.sin_port), std::string(id.status().message()).c_str(),
                            kRelistenMs);
      }
      ++i;
      continue;
    }
    GRPC_RDMA_LOG_ERROR("an RDMA device is back under port %d: listening for RDMA there again",
                        ntohs(l.addr.sin_port));
    listeners_[l.index] = std::move(*id);
    lost_listeners_.erase(lost_listeners_.begin() + static_cast<long>(i));
  }
}

void EngineImpl::StopListening(const sockaddr_in& addr) {
  std::vector<CmId> gone;
  {
    std::lock_guard<std::mutex> g(mu);
    for (size_t i = 0; i < listeners_.size(); ++i) {
      if (!listeners_[i]) continue;
      const auto* a = reinterpret_cast<const sockaddr_in*>(rdma_get_local_addr(listeners_[i].get()));
      if (a->sin_family == AF_INET && a->sin_port == addr.sin_port &&
          a->sin_addr.s_addr == addr.sin_addr.s_addr) {
        gone.push_back(std::move(listeners_[i]));
        accept_fns_[i] = nullptr;
      }
    }
    // One whose device went is not tried again.
    for (auto it = lost_listeners_.begin(); it != lost_listeners_.end();) {
      if (it->addr.sin_port == addr.sin_port && it->addr.sin_addr.s_addr == addr.sin_addr.s_addr) {
        accept_fns_[it->index] = nullptr;
        it = lost_listeners_.erase(it);
      } else {
        ++it;
      }
    }
  }
  // Destroyed without the lock: rdma_destroy_id waits until the poller has
  // acknowledged every event of the id, and the poller takes the lock.
}

void EngineImpl::FailConnectLocked(ConnImpl* c, absl::Status s, Deferred* d) {
  if (!s.ok() && s.code() != absl::StatusCode::kUnavailable)
    s = absl::UnavailableError(s.message());
  c->CloseLocked(s, d, false);
  c->SettleZeroCopyLocked(d);
  c->connect_deadline_us = 0;
  auto it = conns_.find(c->cm_id());
  if (it != conns_.end()) {
    UnwatchLocked(c);
    auto keep = it->second;
    conns_.erase(it);
    d->push_back([keep] {});  // destroyed after the locks are dropped
  }
}

void EngineImpl::CheckDeadlinesLocked(Deferred* d) {
  RelistenLocked();
  uint64_t now = NowMicros();
  ConnList late;
  ConnList draining;
  ConnList unwritten;
  for (auto& [id, c] : conns_) {
    if (c->connect_deadline_us != 0 && now > c->connect_deadline_us) late.push_back(c);
    uint64_t drain = c->drain_deadline_us.load();
    if (drain != 0 && now > drain) draining.push_back(c);
    uint64_t grants = c->grant_deadline_us.load();
    if (grants != 0 && now > grants) unwritten.push_back(c);
  }
  for (auto& c : unwritten) {
    std::lock_guard<std::mutex> cl(c->mu());
    c->GrantsTimedOutLocked(now, d);
  }
  for (auto& c : draining) {
    std::lock_guard<std::mutex> cl(c->mu());
    if (c->drain_deadline_us.load() == 0) continue;  // drained meanwhile
    GRPC_RDMA_LOG_ERROR(
        "connection %s: closed, and its last sends were not acknowledged "
        "within %d ms (the peer takes no messages); disconnecting without them",
        c->PeerLocked().c_str(), ConnImpl::kDrainMs);
    c->DisconnectNowLocked();
  }
  for (auto& c : late) {
    std::lock_guard<std::mutex> cl(c->mu());
    if (!c->connect_done) {
      c->connect_deadline_us = 0;
      continue;
    }
    if (c->passive()) {
      const auto* a = reinterpret_cast<const sockaddr_in*>(rdma_get_peer_addr(c->cm_id()));
      char ip[INET_ADDRSTRLEN] = "?";
      inet_ntop(AF_INET, &a->sin_addr, ip, sizeof(ip));
      GRPC_RDMA_LOG_ERROR(
          "an RDMA connection from %s:%d was accepted but never established "
          "within %d ms (TF_RDMA_CONNECT_TIMEOUT_MS); dropping it",
          ip, ntohs(a->sin_port), options.connect_timeout_ms);
      refused.fetch_add(1);
    }
    FailConnectLocked(c.get(), absl::UnavailableError("RDMA connection timed out"), d);
  }
}

void EngineImpl::MakeHalfOpenRoomLocked(Deferred* d) {
  // The cap, lowered further if the locked-memory limit lowered the budget.
  const uint64_t each = static_cast<uint64_t>(options.eager_depth) *
                        BufferPool::ClassFor(options.acc_size + wire::kHeaderBytes);
  const int cap = static_cast<int>(std::max<uint64_t>(
      1, std::min<uint64_t>(static_cast<uint64_t>(half_open_cap_), budget.cap() / 8 / each)));
  for (;;) {
    int half_open = 0;
    std::shared_ptr<ConnImpl> oldest;
    for (auto& [id, c] : conns_) {
      // Accepted, not established: the connect deadline is set at the
      // accept, so the earliest is the oldest.
      if (!c->passive() || !c->accepted || c->connect_deadline_us == 0) continue;
      ++half_open;
      if (oldest == nullptr || c->connect_deadline_us < oldest->connect_deadline_us) oldest = c;
    }
    if (half_open < cap || oldest == nullptr) return;
    std::lock_guard<std::mutex> cl(oldest->mu());
    if (!oldest->connect_done) {
      // Closed already (a fault), waiting for its CM events: not half-open
      // any more, as CheckDeadlinesLocked says.
      oldest->connect_deadline_us = 0;
      continue;
    }
    refused.fetch_add(1);
    ++half_open_dropped_;
    uint64_t now = NowMicros();
    if (now - half_open_logged_us_ >= 1000000) {  // a flood logs once a second
      const auto* a = reinterpret_cast<const sockaddr_in*>(rdma_get_peer_addr(oldest->cm_id()));
      char ip[INET_ADDRSTRLEN] = "?";
      inet_ntop(AF_INET, &a->sin_addr, ip, sizeof(ip));
      std::string limit =
          cap == options.max_half_open
              ? absl::StrCat("TF_RDMA_MAX_HALF_OPEN=", cap)
              : absl::StrCat("TF_RDMA_MAX_HALF_OPEN=", options.max_half_open, ", lowered to ",
                             cap, " for the pinned budget and the descriptor limit");
      GRPC_RDMA_LOG_ERROR(
          "%d RDMA connections are accepted and not yet established, as many as %s allows: "
          "dropping the oldest, from %s:%d, for a new one (%llu dropped so in all; this line "
          "comes at most once a second)",
          half_open, limit.c_str(), ip, ntohs(a->sin_port),
          static_cast<unsigned long long>(half_open_dropped_));
      half_open_logged_us_ = now;
    }
    FailConnectLocked(oldest.get(),
                      absl::UnavailableError("too many half-open RDMA connections"), d);
    return;
  }
}

// Refuses a connection request, counted before the peer can know of it.
void EngineImpl::RejectLocked(rdma_cm_id* id) {
  refused.fetch_add(1);
  rdma_reject(id, nullptr, 0);
}

void EngineImpl::OnConnectRequestLocked(rdma_cm_event* e, void* listener, Deferred* d) {
  size_t li = reinterpret_cast<size_t>(listener);
  wire::Hello peer;
  const char* bad = wire::ParseHello(e->param.conn.private_data,
                                     e->param.conn.private_data_len, kMaxEngineAccSize, &peer);
  if (const char* why = WrongPathLocked(e->id, "a connection request's address")) {
    (void)why;  // logged once per device; the client falls back to TCP
    RejectLocked(e->id);
    rdma_destroy_id(e->id);
    return;
  }
  // A request still queued on a listener that is gone (stopped, or lost
  // with its device) is refused like one for no listener.
  if (li == 0 || li > listeners_.size() || !listeners_[li - 1] || !accept_fns_[li - 1] ||
      bad != nullptr) {
    GRPC_RDMA_LOG_ERROR(
        "refusing an RDMA connection that is not grpc-rdma's (%s)",
        bad != nullptr ? bad : "no listener");
    RejectLocked(e->id);
    rdma_destroy_id(e->id);
    return;
  }
  MakeHalfOpenRoomLocked(d);
  auto c = std::make_shared<ConnImpl>(shared_from_this(), CmId(e->id), true);
  std::lock_guard<std::mutex> cl(c->mu());
  conns_[e->id] = c;
  absl::Status s = c->SetupLocked();
  if (s.ok()) WatchAsyncLocked(e->id->verbs);
  if (!s.ok()) {
    GRPC_RDMA_LOG_ERROR("cannot accept an RDMA connection: %s",
                        std::string(s.message()).c_str());
    RejectLocked(e->id);
    c->CloseLocked(s, d, false);
    conns_.erase(e->id);
    d->push_back([c] {});
    return;
  }
  c->SetPeerLocked(peer);
  WatchLocked(c.get());
  wire::Hello mine = c->MyHello();
  rdma_conn_param p = ConnParam(&mine);
  if (rdma_accept(e->id, &p) != 0) {
    refused.fetch_add(1);  // accepted, then failed: nothing to reject
    c->CloseLocked(CheckErrno(true, "rdma_accept"), d, false);
    UnwatchLocked(c.get());
    conns_.erase(e->id);
    d->push_back([c] {});
    return;
  }
  // Remember which listener: ESTABLISHED hands the connection to it. Until
  // then it holds receive buffers and descriptors for a peer that may
  // never finish the exchange: it gets the connect timeout, as a client's
  // connection does (CheckDeadlinesLocked).
  c->connect_deadline_us =
      NowMicros() + static_cast<uint64_t>(options.connect_timeout_ms) * 1000;
  c->accepted = true;
  c->connect_done = [fn = accept_fns_[li - 1]](absl::StatusOr<std::shared_ptr<Connection>> r) {
    if (r.ok()) fn(*r);
  };
}

namespace {
const char* DeviceNameOf(rdma_cm_id* id) {
  const char* n = id != nullptr && id->verbs != nullptr ? ibv_get_device_name(id->verbs->device)
                                                         : nullptr;
  return n != nullptr ? n : "(unknown)";
}
}  // namespace

void EngineImpl::HandleCmEventLocked(rdma_cm_event* e, void* listener, Deferred* d) {
  if (e->event == RDMA_CM_EVENT_CONNECT_REQUEST) return OnConnectRequestLocked(e, listener, d);
  if (e->event == RDMA_CM_EVENT_DEVICE_REMOVAL || e->event == RDMA_CM_EVENT_ADDR_CHANGE) {
    // A listening id's own event: the kernel waits for a removed device's
    // ids to be destroyed, so the listener goes (clients then find no RDMA
    // listener and fall back to TCP); an address change is only said.
    for (size_t i = 0; i < listeners_.size(); ++i) {
      if (!listeners_[i] || listeners_[i].get() != e->id) continue;
      uint16_t port = ntohs(rdma_get_src_port(e->id));
      if (e->event == RDMA_CM_EVENT_ADDR_CHANGE) {
        GRPC_RDMA_LOG_ERROR("the address of the RDMA device under the listener on port %d "
                            "changed (RDMA_CM_EVENT_ADDR_CHANGE); it keeps listening",
                            port);
        return;
      }
      GRPC_RDMA_LOG_ERROR("the RDMA device under the listener on port %d was removed "
                          "(RDMA_CM_EVENT_DEVICE_REMOVAL): it stops listening for RDMA, and "
                          "clients fall back to TCP, until a device is back there (tried "
                          "every %d ms)",
                          port, kRelistenMs);
      // Its address, port included (the one given may have been 0), to
      // listen on again once a device is back.
      sockaddr_in bound{};
      memcpy(&bound, rdma_get_local_addr(e->id), sizeof(bound));
      lost_listeners_.push_back(
          {i, bound, NowMicros() + static_cast<uint64_t>(kRelistenMs) * 1000, false});
      auto gone = std::make_shared<CmId>(std::move(listeners_[i]));
      d->push_back([gone] {});  // destroyed after the locks are dropped (see StopListening)
      return;
    }
  }
  std::shared_ptr<ConnImpl> c = Find(e->id);
  if (c == nullptr) return;
  std::lock_guard<std::mutex> cl(c->mu());
  switch (e->event) {
    case RDMA_CM_EVENT_ADDR_RESOLVED:
      if (const char* why = WrongPathLocked(e->id, "the server's address"))
        return FailConnectLocked(c.get(), absl::UnavailableError(why), d);
      if (absl::Status s = SetTosLocked(e->id); !s.ok()) return FailConnectLocked(c.get(), s, d);
      if (rdma_resolve_route(e->id, options.connect_timeout_ms) != 0)
        return FailConnectLocked(c.get(), CheckErrno(true, "rdma_resolve_route"), d);
      // The device is bound: PD, CQ, QP and receive buffers are made while
      // the route resolves (a path query on InfiniBand), not after it.
      if (absl::Status s = c->SetupLocked(); !s.ok()) return FailConnectLocked(c.get(), s, d);
      WatchAsyncLocked(e->id->verbs);
      WatchLocked(c.get());
      return;
    case RDMA_CM_EVENT_ROUTE_RESOLVED: {
      if (const char* why = WrongPathLocked(e->id, "the server's address"))
        return FailConnectLocked(c.get(), absl::UnavailableError(why), d);
      wire::Hello mine = c->MyHello();
      rdma_conn_param p = ConnParam(&mine);
      if (rdma_connect(e->id, &p) != 0)
        FailConnectLocked(c.get(), CheckErrno(true, "rdma_connect"), d);
      return;
    }
    case RDMA_CM_EVENT_ESTABLISHED: {
      if (!c->closed() && c->connect_done) {
        if (!c->cm_id()->qp) return FailConnectLocked(c.get(), absl::InternalError("no QP"), d);
        c->connect_deadline_us = 0;
        if (!c->passive()) {
          wire::Hello peer;
          const char* bad = wire::ParseHello(e->param.conn.private_data,
                                             e->param.conn.private_data_len, kMaxEngineAccSize,
                                             &peer);
          if (bad != nullptr)
            return FailConnectLocked(
                c.get(),
                absl::UnavailableError(
                    absl::StrCat("the peer is not a grpc-rdma endpoint: ", bad)),
                d);
          c->SetPeerLocked(peer);
        }
        c->UpLocked();
        Engine::ConnectDone cb = std::move(c->connect_done);
        c->connect_done = nullptr;
        std::shared_ptr<Connection> conn = c;
        d->push_back([cb, conn] { cb(conn); });
        c->PumpLocked(d);
      }
      return;
    }
    case RDMA_CM_EVENT_ADDR_ERROR:
    case RDMA_CM_EVENT_ROUTE_ERROR:
    case RDMA_CM_EVENT_UNREACHABLE:
    case RDMA_CM_EVENT_REJECTED:
    case RDMA_CM_EVENT_CONNECT_ERROR:
      return FailConnectLocked(
          c.get(),
          absl::UnavailableError(absl::StrCat("RDMA connection failed: ", rdma_event_str(e->event),
                                              " (status ", e->status, ")")),
          d);
    case RDMA_CM_EVENT_DEVICE_REMOVAL: {
      // The device is going (unplugged, driver unbound): this connection
      // ends now, its memory and QP are given back so the removal can
      // finish, and a new connection finds no device and goes by TCP.
      static std::atomic<bool> said{false};
      if (!said.exchange(true)) {
        GRPC_RDMA_LOG_ERROR(
            "the RDMA device %s was removed (RDMA_CM_EVENT_DEVICE_REMOVAL): its connections are "
            "closed; new ones fall back to TCP while it is gone",
            DeviceNameOf(e->id));
      }
      absl::Status why = absl::UnavailableError(
          "the RDMA device was removed (RDMA_CM_EVENT_DEVICE_REMOVAL)");
      c->DeviceRemovedLocked(why, d);
      return FailConnectLocked(c.get(), why, d);
    }
    case RDMA_CM_EVENT_ADDR_CHANGE:
      GRPC_RDMA_LOG_ERROR("the address of RDMA device %s changed (RDMA_CM_EVENT_ADDR_CHANGE); "
                          "its connections carry on, new ones resolve anew",
                          DeviceNameOf(e->id));
      return;
    case RDMA_CM_EVENT_DISCONNECTED:
      // The device's word on why first (an access error it refused the
      // peer for is queued before the peer can know of it and go), then
      // what arrived before the disconnect: the stream's tail.
      if (e->id->verbs != nullptr) TakeAsyncEventsLocked(e->id->verbs, d, c.get());
      c->HandleCqLocked(d);
      c->CloseLocked(absl::UnavailableError("RDMA connection closed by the peer"), d, false);
      return FailConnectLocked(c.get(), absl::UnavailableError("disconnected"), d);
    default:
      return;
  }
}

// ------------------------------------------------------------ public API ---

Engine::Engine(std::shared_ptr<EngineImpl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() { impl_->Shutdown(); }

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const Options& options,
                                                       ChunkMemory memory) {
  RETURN_IF_ERROR(ValidateEngineOptions(options));
  ASSIGN_OR_RETURN(std::optional<std::string> device, ChooseDevice(options));
  (void)device;  // RDMA CM binds the device for the address; checked above
  RETURN_IF_ERROR(CheckPortAndGid(options));
  auto impl = std::make_shared<EngineImpl>(options, memory);
  RETURN_IF_ERROR(impl->Start());
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

std::weak_ptr<Connection> Engine::Connect(const sockaddr_in& addr, int timeout_ms,
                                          ConnectDone done, const JoinRequest* joins) {
  return impl_->Connect(addr, timeout_ms, std::move(done), joins);
}

void Engine::CancelConnect(const std::weak_ptr<Connection>& connecting) {
  impl_->CancelConnect(connecting);
}

absl::StatusOr<uint16_t> Engine::Listen(const sockaddr_in& addr, AcceptFn on_accept) {
  return impl_->Listen(addr, std::move(on_accept));
}

void Engine::StopListening(const sockaddr_in& addr) { impl_->StopListening(addr); }

int Engine::event_fd() const { return impl_->event_fd(); }

uint64_t Engine::host_polls() const { return impl_->host_polls.load(std::memory_order_relaxed); }

bool Engine::PollNow() { return impl_->PollNow(); }
void Engine::SetExternalPolling(bool on) {
  impl_->external_polling = on;
  impl_->Wake();  // the poller re-reads it
}

const Options& Engine::options() const { return impl_->options; }

uint64_t Engine::pinned_bytes() const { return impl_->budget.used(); }
uint64_t Engine::poller_wakeups() const { return impl_->wakeups.load(); }
uint64_t Engine::refused() const { return impl_->refused.load(); }
uint64_t Engine::connection_errors() const { return impl_->connection_errors.load(); }

}  // namespace grpc_rdma
