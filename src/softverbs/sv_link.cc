// Links: the wire under one connected QP pair.
//
// TCP mode: frames travel on the socket. Shared-memory mode (peer in the same
// host and network namespace): frames travel through two single-producer
// single-consumer byte rings in one segment, and the socket only carries
// doorbells (one byte: "look at the rings") and the peer's death (EOF).
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <random>

#include "sv_internal.h"

namespace softverbs {

struct ShmRing {
  alignas(64) std::atomic<uint64_t> head;  // written by the producer only
  alignas(64) std::atomic<uint64_t> tail;  // written by the consumer only
  alignas(64) std::atomic<uint32_t> consumer_idle;
  std::atomic<uint32_t> producer_waiting;
  // Set by the consumer while its send CQ is armed for solicited events
  // only: a frame that only acknowledges can then wait in the ring without
  // a doorbell (it completes sends, which raise no event; whoever looks at
  // the ring next takes it, as an HCA writes such a CQE and wakes nobody).
  std::atomic<uint32_t> lazy_acks;
  // Set by the consumer while a thread of its is to be woken through a
  // completion channel (its CQs armed, the wire's waiter doorbell in the
  // channel's set: sv_cq.cc): producers then ring that doorbell instead of
  // the agent's. Zero from older peers, which never set it (the word was
  // padding): their consumers are always rung through their agent.
  std::atomic<uint32_t> ring_waiter;
  // When an application last polled this ring from ibv_poll_cq: while it
  // keeps polling, producers need not ring the doorbell.
  std::atomic<uint64_t> consumer_polled_us;
  uint64_t size;
  uint64_t data_off;
  // Set by the producer before it rings the waiter's doorbell, taken by
  // the consumer when it hands the ring back to the agent: only then is
  // the waiter's socket read (most events find it empty, and a read that
  // finds nothing is a system call for nothing). Older peers: padding.
  std::atomic<uint32_t> waiter_rung;
};
// ring_waiter and waiter_rung took padding: everything else stays where it was.
static_assert(offsetof(ShmRing, ring_waiter) == 140 && offsetof(ShmRing, consumer_polled_us) == 144 &&
                  offsetof(ShmRing, waiter_rung) == 168 && sizeof(ShmRing) == 192,
              "wire layout");

namespace {

constexpr uint64_t kShmMagic = 0x736f667476726273ULL;  // "softvrbs"
constexpr size_t kShmHeader = 4096;

struct ShmSeg {
  uint64_t magic;
  uint64_t nonce;
  uint64_t ring_bytes;
  ShmRing ring[2];  // [0]: initiator -> acceptor, [1]: the reverse
  // One copy's rights (sv_onecopy.cc): [0] for the initiator's MRs, [1]
  // for the acceptor's. Zero (closed) as the segment is made.
  ShareSlot slots[2][kShareSlots];
};
static_assert(sizeof(ShmSeg) <= kShmHeader, "header page");

// Both ends publish their position every kStep bytes, so that while one
// side copies a large payload in, the other is already copying it out (and
// freeing space) instead of waiting for the whole copy.
constexpr size_t kStep = 128 * 1024;

// head - tail must stay within [0, size]; anything else is a peer that
// scribbled on the segment, and the link is cut.
bool Sane(Link* l, uint64_t head, uint64_t tail) {
  if (head - tail <= l->ring_size) return true;
  l->ring_corrupt = true;
  return false;
}

// The consumer is asleep and polls nothing: only a doorbell wakes it.
bool ConsumerAsleep(Link* l) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return l->tx->consumer_idle.load(std::memory_order_relaxed) &&
         NowUs() - l->tx->consumer_polled_us.load(std::memory_order_relaxed) > kPollGraceUs;
}

// A frame more than a step long is announced to a sleeping consumer once
// its first step is in the ring, not once all of it is: the consumer's
// wake-up and copy out then overlap the rest of the copy in (as an HCA's
// receiver sees a WRITE's first packets while the last are on the wire),
// and a frame larger than the ring never waits for the consumer to wake
// to a full ring. `frame_left`: the frame's bytes not yet written when
// this piece begins; 0 for a frame that does not call for it.
struct EarlyBell {
  uint64_t frame_left = 0;
  bool rang = false;
};

size_t RingWrite(Link* l, const char* src, size_t n, EarlyBell* bell = nullptr) {
  ShmRing* r = l->tx;
  char* data = l->tx_data;
  const uint64_t size = l->ring_size;
  uint64_t head = r->head.load(std::memory_order_relaxed);
  size_t done = 0;
  while (done < n) {
    uint64_t tail = r->tail.load(std::memory_order_acquire);
    if (!Sane(l, head, tail)) break;
    size_t w = std::min<uint64_t>({n - done, size - (head - tail), kStep});
    if (w == 0) break;
    size_t at = head & (size - 1);
    size_t first = std::min<uint64_t>(w, size - at);
    memcpy(data + at, src + done, first);
    if (w > first) memcpy(data, src + done + first, w - first);
    head += w;
    done += w;
    r->head.store(head, std::memory_order_release);
    if (bell != nullptr && !bell->rang && bell->frame_left >= done + kStep &&
        ConsumerAsleep(l)) {
      bell->rang = true;
      LinkDoorbell(l);
    }
  }
  return done;
}

size_t RingRead(Link* l, char* dst, size_t n) {
  ShmRing* r = l->rx;
  const char* data = l->rx_data;
  const uint64_t size = l->ring_size;
  uint64_t tail = r->tail.load(std::memory_order_relaxed);
  size_t done = 0;
  while (done < n) {
    uint64_t head = r->head.load(std::memory_order_acquire);
    if (!Sane(l, head, tail)) break;
    size_t got = std::min<uint64_t>({n - done, head - tail, kStep});
    if (got == 0) break;
    if (dst != nullptr) {
      size_t at = tail & (size - 1);
      size_t first = std::min<uint64_t>(got, size - at);
      memcpy(dst + done, data + at, first);
      if (got > first) memcpy(dst + done + first, data, got - first);
    }
    tail += got;
    done += got;
    r->tail.store(tail, std::memory_order_release);
  }
  return done;
}

// Reads up to n bytes of the inbound stream; dst == nullptr discards.
// Returns the count, or -1 when the link is gone.
ssize_t LinkRead(Link* l, char* dst, size_t n) {
  if (l->shm != nullptr) {
    size_t got = RingRead(l, dst, n);
    if (l->ring_corrupt) {
      Warn("link %s: the peer corrupted the shared ring; closing", l->peer_desc.c_str());
      return -1;
    }
    return static_cast<ssize_t>(got);
  }
  static thread_local char scratch[65536];
  char* to = dst != nullptr ? dst : scratch;
  size_t want = dst != nullptr ? n : std::min(n, sizeof(scratch));
  ssize_t r = recv(l->fd, to, want, MSG_DONTWAIT);
  if (r > 0) return r;
  if (r == 0) return -1;
  if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
  return -1;
}

void* MapSegment(int fd, size_t size) {
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  return p == MAP_FAILED ? nullptr : p;
}

}  // namespace

std::string DoorbellName(uint64_t nonce, char side) {
  char name[64];
  int n = snprintf(name, sizeof(name), "%csoftverbs-db-%016llx-%c", '\0',
                   static_cast<unsigned long long>(nonce), side);
  return std::string(name, static_cast<size_t>(n));
}

// A datagram socket bound to the abstract name of `side`'s doorbell; -1
// when it cannot be had.
int BindDoorbell(uint64_t nonce, char side) {
  int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  std::string name = DoorbellName(nonce, side);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  memcpy(a.sun_path, name.data(), name.size());
  if (bind(fd, reinterpret_cast<sockaddr*>(&a),
           static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size())) != 0) {
    Trace("doorbell socket: %s", strerror(errno));
    close(fd);
    return -1;
  }
  return fd;
}

// Our doorbell sockets for side `side` ('i' initiator, 'a' acceptor): the
// agent's ('i', 'a'), and the waiter's ('I', 'A'), which only a completion
// channel's set holds (sv_cq.cc). No agent's socket: the TCP socket
// carries the doorbells. No waiter's: the wire's doorbells always wake the
// agent (the channel's waiter hears from it).
void OpenDoorbell(Link* l, char side) {
  if (side == 'a' && !GetConfig().acceptor_doorbell) {
    Trace("doorbell socket: off (SOFTVERBS_ACCEPTOR_DOORBELL=0); doorbells go through TCP");
    return;
  }
  l->db_fd = BindDoorbell(l->shm_nonce, side);
  if (l->db_fd < 0) {
    Trace("doorbells go through TCP");
    return;
  }
  l->wdb_fd = BindDoorbell(l->shm_nonce, side == 'i' ? 'I' : 'A');
  l->db_peer = DoorbellName(l->shm_nonce, side == 'i' ? 'a' : 'i');
  l->wdb_peer = DoorbellName(l->shm_nonce, side == 'i' ? 'A' : 'I');
}

// Once the link uses shared memory: the agent watches our doorbell socket.
void WatchDoorbell(Link* l) {
  if (l->db_fd < 0) return;
  l->db_peer_ok = true;
  Runtime::Get().Watch(l->db_fd, new EpollTag{EpollTag::kLink, l, l->db_fd}, false);
}

void CloseDoorbell(Link* l) {
  if (l->wdb_fd >= 0) close(l->wdb_fd);  // out of any channel's set already
  l->wdb_fd = -1;
  if (l->db_fd < 0) return;
  Runtime::Get().Unwatch(l->db_fd);
  close(l->db_fd);
  l->db_fd = -1;
  l->db_peer_ok = false;
}

Link* NewLink(int fd, bool initiator) {
  auto* l = new Link();
  l->fd = fd;
  l->initiator = initiator;
  l->state = initiator ? LinkState::kConnecting : LinkState::kHandshake;
  Runtime::Get().links.push_back(l);
  return l;
}

// shm_open, as glibc does it on Linux (a file in /dev/shm), but with an
// open() of our own: ThreadSanitizer intercepts that one (glibc's is inside
// libc), so a descriptor number another thread used and closed before is
// a new descriptor to it, not a race with that thread's last use.
static int ShmOpen(const char* name, int flags, mode_t mode) {
  std::string path = std::string("/dev/shm") + name;
  return open(path.c_str(), flags | O_NOFOLLOW | O_CLOEXEC, mode);
}

bool ShmSegmentPrepare(ShmSegment* out) {
  const Config& c = GetConfig();
  if (!c.use_shm) return false;
  static std::atomic<uint32_t> counter{0};
  std::random_device rd;
  const uint64_t nonce = (static_cast<uint64_t>(rd()) << 32) | rd();
  char name[48];
  snprintf(name, sizeof(name), "/softverbs-%d-%u-%08x", getpid(), counter.fetch_add(1),
           static_cast<unsigned>(nonce));
  int fd = ShmOpen(name, O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    Trace("shm_open(%s): %s; using TCP", name, strerror(errno));
    return false;
  }
  size_t size = kShmHeader + 2 * c.ring_bytes;
  void* p = nullptr;
  // Reserve the pages now: a sparse segment on a full /dev/shm would kill
  // the process with SIGBUS mid-transfer instead of falling back to TCP.
  int err = posix_fallocate(fd, 0, static_cast<off_t>(size));
  if (err == 0) p = MapSegment(fd, size);
  else Trace("shm: cannot reserve %zu bytes in /dev/shm (%s); using TCP", size, strerror(err));
  close(fd);
  if (p == nullptr) {
    shm_unlink(name);
    return false;
  }
  auto* seg = static_cast<ShmSeg*>(p);
  seg->nonce = nonce;
  seg->ring_bytes = c.ring_bytes;
  for (int i = 0; i < 2; ++i) {
    ShmRing& r = seg->ring[i];
    r.head.store(0);
    r.tail.store(0);
    r.consumer_idle.store(0);
    r.producer_waiting.store(0);
    r.lazy_acks.store(0);
    r.ring_waiter.store(0);
    r.waiter_rung.store(0);
    r.consumer_polled_us.store(0);
    r.size = c.ring_bytes;
    r.data_off = kShmHeader + i * c.ring_bytes;
  }
  std::atomic_thread_fence(std::memory_order_release);
  seg->magic = kShmMagic;
  out->name = name;
  out->nonce = nonce;
  out->p = p;
  out->size = size;
  return true;
}

void ShmSegmentDiscard(ShmSegment* s) {
  if (s->p == nullptr) return;
  shm_unlink(s->name.c_str());
  munmap(s->p, s->size);
  s->p = nullptr;
}

bool LinkSetupShmInitiator(Link* l, ShmSegment* prepared) {
  ShmSegment own;
  ShmSegment* s = prepared != nullptr && prepared->p != nullptr ? prepared : &own;
  if (s == &own && !ShmSegmentPrepare(&own)) return false;
  l->shm_nonce = s->nonce;
  l->shm_name = s->name;
  l->shm = s->p;
  l->shm_size = s->size;
  s->p = nullptr;  // the link's now
  OpenDoorbell(l, 'i');  // before the offer: the peer may ring once it is up
  return true;
}

bool LinkSetupShmAcceptor(Link* l, const std::string& name, uint64_t nonce) {
  // Only a segment softverbs made for us: our name prefix, a regular file of
  // our own user that nobody else can open. Anything else is left alone
  // (not even unlinked) and the link uses TCP.
  if (name.rfind("/softverbs-", 0) != 0 || name.find('/', 1) != std::string::npos) return false;
  int fd = ShmOpen(name.c_str(), O_RDWR, 0);
  if (fd < 0) return false;
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid() ||
      (st.st_mode & 077) != 0) {
    close(fd);
    return false;
  }
  void* p = nullptr;
  off_t size = st.st_size;
  if (size > static_cast<off_t>(kShmHeader)) p = MapSegment(fd, static_cast<size_t>(size));
  close(fd);
  if (p == nullptr) return false;
  shm_unlink(name.c_str());
  auto* seg = static_cast<ShmSeg*>(p);
  if (seg->magic != kShmMagic || seg->nonce != nonce ||
      kShmHeader + 2 * seg->ring_bytes != static_cast<uint64_t>(size) ||
      (seg->ring_bytes & (seg->ring_bytes - 1)) != 0 ||
      seg->ring[0].size != seg->ring_bytes || seg->ring[1].size != seg->ring_bytes ||
      seg->ring[0].data_off != kShmHeader ||
      seg->ring[1].data_off != kShmHeader + seg->ring_bytes) {
    munmap(p, static_cast<size_t>(size));
    return false;
  }
  l->shm = p;
  l->shm_size = static_cast<size_t>(size);
  l->tx = &seg->ring[1];
  l->rx = &seg->ring[0];
  l->ring_size = seg->ring_bytes;
  l->rx_data = static_cast<char*>(p) + kShmHeader;
  l->tx_data = static_cast<char*>(p) + kShmHeader + seg->ring_bytes;
  l->shm_nonce = nonce;
  OpenDoorbell(l, 'a');  // before our answer: the initiator rings once it has it
  WatchDoorbell(l);
  return true;
}

void LinkShmConfirmed(Link* l, bool ok) {
  if (l->shm == nullptr) return;
  if (!l->shm_name.empty()) {
    shm_unlink(l->shm_name.c_str());
    l->shm_name.clear();
  }
  if (!ok) {
    munmap(l->shm, l->shm_size);
    l->shm = nullptr;
    if (l->db_fd >= 0) close(l->db_fd);
    if (l->wdb_fd >= 0) close(l->wdb_fd);
    l->db_fd = l->wdb_fd = -1;
    return;
  }
  WatchDoorbell(l);
  // Our own geometry, from our config: never what the segment says now.
  auto* seg = static_cast<ShmSeg*>(l->shm);
  l->tx = &seg->ring[0];
  l->rx = &seg->ring[1];
  l->ring_size = GetConfig().ring_bytes;
  l->tx_data = static_cast<char*>(l->shm) + kShmHeader;
  l->rx_data = static_cast<char*>(l->shm) + kShmHeader + l->ring_size;
}

namespace {

ssize_t RingName(int fd, const std::string& name) {
  char b = 0;
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  memcpy(a.sun_path, name.data(), name.size());
  return sendto(fd, &b, 1, MSG_DONTWAIT | MSG_NOSIGNAL, reinterpret_cast<sockaddr*>(&a),
                static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size()));
}

}  // namespace

void LinkDoorbell(Link* l) {
  char b = 0;
  if (l->db_peer_ok) {
    // The peer's waiter, when it says one is to be woken (the caller's
    // fence, in ConsumerAsleep or before a space doorbell, orders this
    // read after the ring's head or tail): the word is set before the
    // waiter sleeps and cleared before its agent is to take over, so
    // bytes written before a clear are seen by whoever clears it. A
    // waiter's socket that is gone (the peer's link closing) falls back to
    // the agent's.
    if (l->tx->ring_waiter.load(std::memory_order_seq_cst) != 0) {
      l->tx->waiter_rung.store(1, std::memory_order_seq_cst);
      ssize_t r = RingName(l->db_fd, l->wdb_peer);
      if (r == 1 || errno == EAGAIN) return CountDoorbell(true);
    }
    ssize_t r = RingName(l->db_fd, l->db_peer);
    // EAGAIN: the peer has doorbells unread already, which is enough.
    if (r == 1 || errno == EAGAIN) return CountDoorbell(false);
    Trace("link %s: doorbell socket: %s; doorbells go through TCP", l->peer_desc.c_str(),
          strerror(errno));
    l->db_peer_ok = false;
  }
  (void)!send(l->fd, &b, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
  CountDoorbell(false);
}

// The side that made the segment sends on ring[0] and owns slots[0].
ShareSlot* LinkOwnSlot(Link* l, int i) {
  auto* seg = static_cast<ShmSeg*>(l->shm);
  return &seg->slots[l->tx == &seg->ring[0] ? 0 : 1][i];
}

ShareSlot* LinkPeerSlot(Link* l, int i) {
  auto* seg = static_cast<ShmSeg*>(l->shm);
  return &seg->slots[l->tx == &seg->ring[0] ? 1 : 0][i];
}

uint64_t LinkTxHead(Link* l) {
  return l->tx != nullptr ? l->tx->head.load(std::memory_order_relaxed) : 0;
}

uint64_t LinkTxTail(Link* l) {
  return l->tx != nullptr ? l->tx->tail.load(std::memory_order_acquire) : 0;
}

void LinkDrainWaiterDoorbell(Link* l) {
  if (l->wdb_fd < 0) return;
  if (l->rx != nullptr) l->rx->waiter_rung.store(0, std::memory_order_seq_cst);
  DrainDoorbells(l->wdb_fd);
}

bool LinkSetWaiter(Link* l, bool waiter) {
  if (l == nullptr || l->rx == nullptr || l->state != LinkState::kUp) return false;
  uint32_t was = l->rx->ring_waiter.exchange(waiter ? 1 : 0, std::memory_order_seq_cst);
  // Handed back to the agent: a doorbell the waiter's socket still holds
  // was rung for frames behind the ones the caller moved (or for those it
  // moved, racing it); left there it would wake the channel's next wait
  // for nothing, a thread wake-up per message.
  if (was == 0 || waiter || l->wdb_fd < 0) return false;
  return l->rx->waiter_rung.exchange(0, std::memory_order_seq_cst) != 0 &&
         DrainDoorbells(l->wdb_fd) > 0;
}

void LinkSetLazyAcks(Link* l, bool lazy) {
  if (l != nullptr && l->rx != nullptr && l->state == LinkState::kUp)
    l->rx->lazy_acks.store(lazy ? 1 : 0, std::memory_order_seq_cst);
}

void LinkMarkPolled(Link* l, uint64_t now) {
  if (l->rx != nullptr && l->state == LinkState::kUp)
    l->rx->consumer_polled_us.store(now, std::memory_order_relaxed);
}

void LinkForgetPolls(Link* l) {
  if (l != nullptr && l->rx != nullptr && l->state == LinkState::kUp)
    l->rx->consumer_polled_us.store(0, std::memory_order_seq_cst);
}

bool LinkRecentlyPolled(Link* l, uint64_t now) {
  return l->rx != nullptr && l->state == LinkState::kUp &&
         now - l->rx->consumer_polled_us.load(std::memory_order_relaxed) < 20000;
}

void LinkSetSleeping(Link* l, bool sleeping) {
  if (l->rx == nullptr || l->state != LinkState::kUp) return;
  l->rx->consumer_idle.store(sleeping ? 1 : 0, std::memory_order_seq_cst);
}

bool LinkAgentSleeping(Link* l) {
  return l->rx != nullptr && l->state == LinkState::kUp &&
         l->rx->consumer_idle.load(std::memory_order_relaxed) != 0;
}

bool LinkRxNextIsMessage(Link* l, uint64_t at_most) {
  if (l->rx == nullptr || l->state != LinkState::kUp) return false;
  const uint64_t tail = l->rx->tail.load(std::memory_order_relaxed);
  const uint64_t n = l->rx->head.load(std::memory_order_acquire) - tail;
  // Between frames, the next one's header is at the tail. The peer writes
  // the ring: what is read here is a hint for a wake-up, nothing more.
  if (l->in_payload || l->in_hdr_got != 0 || n < sizeof(FrameHdr) || n > l->ring_size)
    return false;
  FrameHdr h;
  const uint64_t at = tail & (l->ring_size - 1);
  const uint64_t first = std::min<uint64_t>(sizeof(h), l->ring_size - at);
  memcpy(&h, l->rx_data + at, first);
  if (first < sizeof(h)) memcpy(reinterpret_cast<char*>(&h) + first, l->rx_data, sizeof(h) - first);
  if (h.type != kFrameSend && h.type != kFrameWrite) return false;
  return (h.flags & kFlagPlaced) ? h.aux <= at_most : h.len <= at_most;
}

bool LinkHasRxData(Link* l) {
  if (l->rx == nullptr || l->state != LinkState::kUp) return false;
  return l->rx->head.load(std::memory_order_acquire) !=
         l->rx->tail.load(std::memory_order_relaxed);
}

void LinkEnqueue(Link* l, OutFrame f) { l->out.push_back(std::move(f)); }

namespace {

// Collects the unsent pieces of f, from f.sent on.
size_t FramePieces(const OutFrame& f, iovec* v, size_t max) {
  size_t n = 0;
  size_t off = f.sent;
  if (off < sizeof(FrameHdr)) {
    v[n++] = {const_cast<char*>(reinterpret_cast<const char*>(&f.hdr)) + off,
              sizeof(FrameHdr) - off};
    off = 0;
  } else {
    off -= sizeof(FrameHdr);
  }
  if (!f.owned.empty()) {
    if (off < f.owned.size() && n < max)
      v[n++] = {const_cast<char*>(f.owned.data()) + off, f.owned.size() - off};
    return n;
  }
  for (const iovec& p : f.iov) {
    if (n == max) break;
    if (off >= p.iov_len) {
      off -= p.iov_len;
      continue;
    }
    v[n++] = {static_cast<char*>(p.iov_base) + off, p.iov_len - off};
    off = 0;
  }
  return n;
}

// Shared-memory pump: returns bytes written.
// Writes what fits of the queued frames; *urgent says whether any of them
// is more than an acknowledgement.
size_t PumpShm(Link* l, bool* urgent) {
  size_t total = 0;
  EarlyBell bell;  // once per pump: the consumer, once awake, takes all
  while (!l->out.empty()) {
    OutFrame& f = l->out.front();
    if (f.sent == 0 && LinkPlace(l, &f) == Placement::kLater) break;
    // Acknowledgements and shares wake nobody: whoever looks at the ring
    // next takes them.
    const bool quiet =
        f.hdr.type == kFrameAck || f.hdr.type == kFrameShare || f.hdr.type == kFrameUnshare;
    iovec v[32];
    size_t n = FramePieces(f, v, 32);
    bool full = false;
    for (size_t i = 0; i < n && !full; ++i) {
      bell.frame_left = !quiet ? f.total() - f.sent : 0;
      size_t w = RingWrite(l, static_cast<char*>(v[i].iov_base), v[i].iov_len, &bell);
      f.sent += w;
      total += w;
      if (w > 0 && !quiet) *urgent = true;
      if (w < v[i].iov_len) full = true;
    }
    if (f.sent == f.total()) {
      LinkFramePumped(l, f);
      l->out.pop_front();
      continue;
    }
    if (!full) continue;  // more than 32 pieces: go round again
    // Ring full: ask the consumer for a doorbell, then look once more in
    // case it drained the ring before it could see the flag.
    l->tx->producer_waiting.store(1, std::memory_order_seq_cst);
    uint64_t used = l->tx->head.load() - l->tx->tail.load(std::memory_order_seq_cst);
    if (used >= l->ring_size) break;
  }
  return total;
}

}  // namespace

bool LinkPump(Link* l) {
  if (l->state != LinkState::kUp || l->out.empty()) return false;
  if (l->shm != nullptr) {
    bool urgent = false;
    size_t w = PumpShm(l, &urgent);
    if (l->ring_corrupt) {
      Warn("link %s: the peer corrupted the shared ring; closing", l->peer_desc.c_str());
      LinkKill(l);
      return true;
    }
    // Once more at the end, early bell or not: a consumer that woke for
    // it may have gone back to sleep before the last bytes were in.
    if (w > 0 && ConsumerAsleep(l) &&
        (urgent || !l->tx->lazy_acks.load(std::memory_order_relaxed)))
      LinkDoorbell(l);
    return w > 0;
  }
  bool moved = false;
  while (!l->out.empty()) {
    OutFrame& f = l->out.front();
    iovec v[64];
    size_t n = FramePieces(f, v, 64);
    msghdr mh{};
    mh.msg_iov = v;
    mh.msg_iovlen = n;
    ssize_t w = sendmsg(l->fd, &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
        l->want_write = true;
        return moved;
      }
      Trace("link %s: send: %s", l->peer_desc.c_str(), strerror(errno));
      LinkKill(l);
      return true;
    }
    moved = true;
    f.sent += static_cast<size_t>(w);
    if (f.sent == f.total()) l->out.pop_front();
  }
  l->want_write = false;
  return moved;
}

bool LinkReceive(Link* l) {
  bool moved = false;
  bool freed = false;  // consumed ring space: the producer may be waiting
  uint64_t taken = 0;
  l->rx_limited = false;
  while (l->state == LinkState::kUp) {
    if (!l->in_payload) {
      if (l->in_hdr_got == 0 && taken >= l->rx_budget) {
        l->rx_limited = LinkHasRxData(l);
        break;
      }
      ssize_t r = LinkRead(l, reinterpret_cast<char*>(&l->in_hdr) + l->in_hdr_got,
                           sizeof(FrameHdr) - l->in_hdr_got);
      if (r < 0) {
        Trace("link %s: read failed (header)", l->peer_desc.c_str());
        LinkKill(l);
        return true;
      }
      if (r > 0) moved = freed = true;
      taken += static_cast<uint64_t>(r);
      l->in_hdr_got += static_cast<size_t>(r);
      if (l->in_hdr_got < sizeof(FrameHdr)) break;
      l->in_payload = true;
      l->in_begun = false;
      l->in_seen_us = NowUs();
    }
    if (!l->in_begun && l->in_hdr.len > l->rx_frame_max) {
      l->rx_limited = true;
      break;
    }
    if (!l->in_begun) {
      int delay = GetConfig().delay_us;
      if (delay > 0 && NowUs() < l->in_seen_us + static_cast<uint64_t>(delay)) break;
      l->in_target.clear();
      l->in_idx = l->in_off = 0;
      l->in_discard = false;
      l->in_left = l->in_hdr.len;
      if (!QpHandleFrameBegin(l)) break;  // e.g. RNR: wait for a receive
      if (l->state != LinkState::kUp) break;
      l->in_begun = true;
      moved = true;
    }
    while (l->in_left > 0) {
      char* dst = nullptr;
      size_t want = l->in_left;
      if (!l->in_discard) {
        while (l->in_idx < l->in_target.size() &&
               l->in_off == l->in_target[l->in_idx].iov_len) {
          ++l->in_idx;
          l->in_off = 0;
        }
        if (l->in_idx == l->in_target.size()) {
          l->in_discard = true;  // targets shorter than payload (checked)
        } else {
          iovec& t = l->in_target[l->in_idx];
          dst = static_cast<char*>(t.iov_base) + l->in_off;
          want = std::min<uint64_t>(want, t.iov_len - l->in_off);
        }
      }
      ssize_t r = LinkRead(l, dst, want);
      if (r < 0) {
        LinkKill(l);
        return true;
      }
      if (r == 0) break;
      moved = freed = true;
      taken += static_cast<uint64_t>(r);
      l->in_left -= static_cast<uint64_t>(r);
      if (!l->in_discard) l->in_off += static_cast<size_t>(r);
    }
    if (l->in_left > 0) break;
    l->in_payload = false;
    l->in_hdr_got = 0;
    QpHandleFrameEnd(l);
    moved = true;
  }
  QpRxPassDone(l);
  if (freed && l->rx != nullptr) {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (l->rx->producer_waiting.load(std::memory_order_relaxed)) {
      l->rx->producer_waiting.store(0, std::memory_order_relaxed);
      // A producer that polls its CQ (it marks its own receive ring, our
      // transmit ring) will see the space without being woken.
      if (NowUs() - l->tx->consumer_polled_us.load(std::memory_order_relaxed) > kPollGraceUs)
        LinkDoorbell(l);
    }
  }
  return moved;
}

void LinkKill(Link* l) {
  if (l->state == LinkState::kDead) return;
  bool was_up = l->state == LinkState::kUp;
  l->state = LinkState::kDead;
  Trace("link %s: closed", l->peer_desc.c_str());
  // First, while the segment is mapped: the peer may still have it and
  // our MRs mapped, so their slots close now (and a placement in progress
  // is waited out), or it could go on writing into memory we free.
  LinkForgetShares(l);
  LinkUndelegate(l);
  CloseDoorbell(l);
  if (l->fd >= 0) {
    Runtime::Get().Unwatch(l->fd);
    close(l->fd);
    l->fd = -1;
  }
  if (l->shm != nullptr) {
    if (!l->shm_name.empty()) shm_unlink(l->shm_name.c_str());
    munmap(l->shm, l->shm_size);
    l->shm = nullptr;
    l->tx = l->rx = nullptr;
  }
  l->out.clear();
  (void)was_up;
  if (l->qp != nullptr) QpLinkDeadLocked(l->qp, true);
  if (l->cm != nullptr) CmLinkDead(l);
}

}  // namespace softverbs
