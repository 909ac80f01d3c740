// The per-process runtime: its devices (from SOFTVERBS_DEVICES), key and
// QP number tables with the QP listeners behind the numbers, the address
// lookups, the runtime's restart in the child of a fork, and the hooks
// through which librdmacm.so.1 takes part (SetCmHooks).
#include <arpa/inet.h>
#include <pthread.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <fstream>
#include <random>

#include "sv_internal.h"

namespace softverbs {

namespace {

uint64_t Fnv(const std::string& s) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ULL;
  return h;
}

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
    // The listener whose numbers ran out goes too if its QPs are gone.
    if (!ls.empty() && listener_live[ls.back()] == 0) CloseQpListener(dev, ls.size() - 1);
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
  ++listener_live[ls.back()];
  return (static_cast<uint32_t>(port) << 8) | slot++;
}

void Runtime::ReleaseQpn(Device* dev, uint32_t qpn) {
  auto& ls = qp_listeners[dev->index];
  const auto port = static_cast<uint16_t>(qpn >> 8);
  for (size_t i = 0; i < ls.size(); ++i) {
    if (listener_port[ls[i]] != port) continue;
    // The newest listener still gives out numbers: it stays.
    if (--listener_live[ls[i]] == 0 && i + 1 < ls.size()) CloseQpListener(dev, i);
    return;
  }
}

void Runtime::CloseQpListener(Device* dev, size_t i) {
  auto& ls = qp_listeners[dev->index];
  int fd = ls[i];
  Unwatch(fd);
  close(fd);
  listener_port.erase(fd);
  listener_live.erase(fd);
  ls.erase(ls.begin() + static_cast<std::ptrdiff_t>(i));
}

Device* Runtime::DeviceForAddr(in_addr a) {
  for (Device* d : devices)
    if (!d->removed && d->spec.addr.s_addr == a.s_addr) return d;
  return nullptr;
}

Device* Runtime::DeviceForRoute(in_addr dst) {
  if (Device* d = DeviceForAddr(dst)) return d;
  uint32_t ip = ntohl(dst.s_addr);
  if ((ip >> 24) == 127) {
    for (Device* d : devices)
      if (!d->removed && (ntohl(d->spec.addr.s_addr) >> 24) == 127) return d;
  }
  for (Device* d : devices) {
    uint32_t m = d->spec.mask.s_addr;
    if (!d->removed && (d->spec.addr.s_addr & m) == (dst.s_addr & m)) return d;
  }
  for (Device* d : devices)
    if (!d->removed && (ntohl(d->spec.addr.s_addr) >> 24) != 127) return d;
  for (Device* d : devices)
    if (!d->removed) return d;
  return nullptr;
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

// ------------------------------------------------------------- CM hooks ---

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
void CmPrepareSpares() {
  if (g_cm_hooks.spares) g_cm_hooks.spares();
}
}  // namespace softverbs
