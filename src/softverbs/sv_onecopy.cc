// One-copy WRITEs on shared-memory wires.
//
// An HCA moves a WRITE's bytes once, by DMA, from the requester's memory to
// the responder's. Through the rings softverbs copies them twice (into the
// ring, out of it). Where the responder's MR is a shared mapping of a memfd
// sealed against shrinking (as grpc-rdma's buffer pool is), the responder
// tells its peer so in-band (kFrameShare: the file, by its descriptor
// number in the responder's process, and where the MR lies in it); the
// requester maps the file and, when it sends a WRITE into that MR, copies
// the bytes straight there and sends only the header (kFlagPlaced). The
// responder checks that header as it checks any WRITE (key, PD, rights,
// bounds) and that it names a share it made, then completes it.
//
// Rights: an MR is shared only while it and its QP allow remote writes.
// Each share has a slot in the wire's segment (ShareSlot): the owner's word
// says open, the requester's says busy placing. The requester sets busy,
// then places only if the word is still open; a change of rights,
// translation or PD, or the MR's deregistration, closes the word, waits
// while the requester is busy, and sends kFrameUnshare. So once that call
// returns nothing of the peer's lands in the MR, as on an HCA. The
// requester's softverbs does the bounds check before it places: unlike an
// HCA, a peer process that ignored it could write the whole shared file
// (same host, same user).
// Ordering: a WRITE is placed only once the peer has copied every earlier
// WRITE out of the ring, so WRITEs land in the order they were posted.
//
// READs: a share says whether the MR may also be read (kFlagReadable: the
// MR and the QP allow remote reads). The requester then copies a READ's
// bytes straight out of the peer's MR into the READ's memory, under the
// same slot, while its WR is outstanding, once every earlier WRITE and
// SEND has left the ring (so it sees them), and sends the request flagged
// placed; the responder checks it as any READ and, if it names a readable
// share of its own, answers with a response that carries no bytes (else,
// if the READ is still allowed, with its bytes). Only MRs that allow remote
// writes are shared at all, so a peer built before READs were placed never
// places into an MR it may only read.
#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <vector>

#include "sv_internal.h"

namespace softverbs {

namespace {

Runtime& Rt() { return Runtime::Get(); }

// MRs smaller than this are not looked up at registration (a read of
// /proc/self/maps); WRITEs smaller than kPlaceMin go through the ring.
constexpr uint64_t kShareMinBytes = 16 * 1024;
constexpr uint64_t kPlaceMin = 4 * 1024;
// WRITEs this large are placed by the agent, not the posting thread.
constexpr uint64_t kAgentPlaceMin = 512 * 1024;
// A placement looks at its slot again after each this many bytes.
constexpr size_t kPlaceStep = 1 << 20;
// Peers' files are mapped once per process while a link uses them; past
// this many, new shares are not taken (the ring path stays).
constexpr size_t kMaxPeerFiles = 256;

struct ShareBody {
  uint32_t pid;
  int32_t fd;
  uint64_t dev, ino;
  uint64_t file_off;  // of map_base
  uint64_t map_base, map_len;
  uint64_t mr_addr, mr_len;
};
static_assert(sizeof(ShareBody) == kShareBodySize, "wire layout");

uint64_t PageSize() {
  static const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  return page;
}

// The files MRs live in, each held open once by the runtime: (dev, ino) ->
// descriptor and the number of MRs in it. Guarded by Rt().mu.
struct FileRef {
  int fd = -1;
  int refs = 0;
};
std::map<std::pair<uint64_t, uint64_t>, FileRef>& Files() {
  static auto* files = new std::map<std::pair<uint64_t, uint64_t>, FileRef>();
  return *files;
}

struct Vma {
  uint64_t start = 0, end = 0, off = 0, dev = 0, ino = 0;
  bool shared = false;
};

// The mapping of /proc/self/maps that holds [addr, addr + len) whole.
bool FindVma(uint64_t addr, uint64_t len, Vma* out) {
  int fd = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  std::string text;
  char buf[16384];
  for (;;) {
    ssize_t n = read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  size_t pos = 0;
  while (pos < text.size()) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string::npos) eol = text.size();
    unsigned long long start, end, off, ino;
    unsigned major, minor;
    char perms[8] = {};
    if (sscanf(text.c_str() + pos, "%llx-%llx %7s %llx %x:%x %llu", &start, &end, perms, &off,
               &major, &minor, &ino) == 7 &&
        start <= addr && addr < end) {
      if (len > end - addr) return false;  // spans mappings: not shared
      out->start = start;
      out->end = end;
      out->off = off;
      out->dev = makedev(major, minor);
      out->ino = ino;
      out->shared = perms[3] == 's';
      return true;
    }
    pos = eol + 1;
  }
  return false;
}

// Mappings of shared files found before: reading /proc/self/maps costs a
// gRPC process 0.2-0.3 ms, and grpc-rdma registers every buffer of a new
// connection (its own PD) again. A cached mapping is taken only if
// /proc/self/map_files still has an entry for exactly its range naming the
// same file (one stat; permitted to root, CAP_SYS_ADMIN or
// CAP_CHECKPOINT_RESTORE: without, every lookup reads the maps). Guarded
// by Rt().mu.
std::vector<Vma>& VmaCache() {
  static auto* cache = new std::vector<Vma>();
  return *cache;
}
bool g_map_files_denied = false;
constexpr size_t kVmaCacheSize = 16;

bool StillMapped(const Vma& v) {
  if (g_map_files_denied) return false;
  char path[96];
  snprintf(path, sizeof(path), "/proc/self/map_files/%" PRIx64 "-%" PRIx64, v.start, v.end);
  struct stat st;
  if (stat(path, &st) != 0) {
    if (errno == EPERM || errno == EACCES) g_map_files_denied = true;
    return false;
  }
  return st.st_dev == v.dev && st.st_ino == v.ino;
}

bool FindVmaCached(uint64_t addr, uint64_t len, Vma* out) {
  std::vector<Vma>& cache = VmaCache();
  for (size_t i = 0; i < cache.size(); ++i) {
    const Vma& v = cache[i];
    if (addr < v.start || addr >= v.end || len > v.end - addr) continue;
    if (StillMapped(v)) {
      *out = v;
      return true;
    }
    cache.erase(cache.begin() + static_cast<long>(i));
    break;
  }
  if (!FindVma(addr, len, out)) return false;
  if (out->shared && out->ino != 0 && !g_map_files_denied) {
    if (cache.size() == kVmaCacheSize) cache.erase(cache.begin());
    cache.push_back(*out);
  }
  return true;
}

bool SameFile(int fd, uint64_t dev, uint64_t ino, struct stat* st) {
  return fstat(fd, st) == 0 && S_ISREG(st->st_mode) && st->st_dev == dev && st->st_ino == ino;
}

// A memfd that cannot shrink: a peer's mapping of it never faults past
// its end (SIGBUS).
bool SealedAgainstShrinking(int fd) {
  int seals = fcntl(fd, F_GET_SEALS);
  return seals >= 0 && (seals & F_SEAL_SHRINK) != 0;
}

// A descriptor of the file of `v` of our own: a reopen of one the process
// holds (memfd_create's), else the mapping's entry in /proc/self/map_files.
int OpenFileOf(const Vma& v) {
  struct stat st;
  int fd = -1;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (dirent* e = readdir(d)) {
      char* endp = nullptr;
      long n = strtol(e->d_name, &endp, 10);
      if (endp == e->d_name || *endp != '\0' || n == dirfd(d)) continue;
      // By path, never by descriptor number: another thread may be
      // opening or closing any of these (and ThreadSanitizer says so).
      // What is opened is checked again below, on our own descriptor.
      char path[64];
      snprintf(path, sizeof(path), "/proc/self/fd/%ld", n);
      if (stat(path, &st) != 0 || !S_ISREG(st.st_mode) || st.st_dev != v.dev ||
          st.st_ino != v.ino)
        continue;
      fd = open(path, O_RDWR | O_CLOEXEC);
      break;
    }
    closedir(d);
  }
  if (fd < 0) {
    char path[96];
    snprintf(path, sizeof(path), "/proc/self/map_files/%" PRIx64 "-%" PRIx64, v.start, v.end);
    fd = open(path, O_RDWR | O_CLOEXEC);
  }
  if (fd >= 0 && (!SameFile(fd, v.dev, v.ino, &st) || !SealedAgainstShrinking(fd))) {
    close(fd);
    fd = -1;
  }
  return fd;
}

bool ShouldShare(const Mr* mr, const Link* l) {
  const Qp* qp = l->qp;
  const bool serving = qp != nullptr && !l->rx_dead &&
                       (qp->qp.state == IBV_QPS_RTR || qp->qp.state == IBV_QPS_RTS ||
                        qp->qp.state == IBV_QPS_SQD);
  return l->state == LinkState::kUp && l->shm != nullptr && serving && !qp->destroyed &&
         mr->share_len != 0 && mr->mr.pd == qp->qp.pd &&
         (mr->access & IBV_ACCESS_REMOTE_WRITE) && (qp->access & IBV_ACCESS_REMOTE_WRITE);
}

// The word a slot holds while open: never 0 (closed).
uint64_t OpenWord(uint32_t gen) { return (uint64_t{gen} << 1) | 1; }

// The MR may be read directly as well (its share says kFlagReadable).
bool ShouldShareReads(const Mr* mr, const Link* l) {
  return (mr->access & IBV_ACCESS_REMOTE_READ) && (l->qp->access & IBV_ACCESS_REMOTE_READ);
}

void SendShare(Link* l, const Mr* mr) {
  if (~l->slots_used == 0) return;  // every slot in use: the ring it is
  int slot = __builtin_ctzll(~l->slots_used);
  l->slots_used |= uint64_t{1} << slot;
  uint32_t gen = ++l->share_gen;
  const bool readable = ShouldShareReads(mr, l);
  l->shared_out[mr->mr.rkey] = Link::Shared{gen, slot, readable};
  LinkOwnSlot(l, slot)->busy.store(0, std::memory_order_relaxed);
  LinkOwnSlot(l, slot)->open.store(OpenWord(gen), std::memory_order_seq_cst);
  ShareBody b{};
  b.pid = static_cast<uint32_t>(getpid());
  b.fd = mr->share_fd;
  b.dev = mr->share_dev;
  b.ino = mr->share_ino;
  b.file_off = mr->share_off;
  b.map_base = mr->share_base;
  b.map_len = mr->share_len;
  b.mr_addr = reinterpret_cast<uint64_t>(mr->mr.addr);
  b.mr_len = mr->mr.length;
  OutFrame f;
  f.hdr.type = kFrameShare;
  if (readable) f.hdr.flags = kFlagReadable;
  f.hdr.rkey = mr->mr.rkey;
  f.hdr.aux = gen;
  f.hdr.imm = static_cast<uint32_t>(slot);
  f.hdr.len = sizeof(b);
  f.owned.append(reinterpret_cast<const char*>(&b), sizeof(b));
  LinkEnqueue(l, std::move(f));
}

// Closes a share's slot, then waits while the peer is placing into it (it
// looks at the slot at least every kPlaceStep bytes): from the return on,
// nothing of the peer's lands in the MR, as on an HCA once its rights are
// gone. False: still busy after 2 s (a peer stopped mid-copy).
bool CloseSlot(Link* l, const Link::Shared& sh) {
  if (l->shm == nullptr) return true;
  ShareSlot* s = LinkOwnSlot(l, sh.slot);
  s->open.store(0, std::memory_order_seq_cst);
  const uint64_t deadline = NowUs() + 2000000;
  while (s->busy.load(std::memory_order_seq_cst) == OpenWord(sh.gen)) {
    if (NowUs() > deadline) return false;
    sched_yield();
  }
  return true;
}

void SendUnshare(Link* l, uint32_t rkey) {
  auto it = l->shared_out.find(rkey);
  if (it == l->shared_out.end()) return;
  const Link::Shared sh = it->second;
  l->shared_out.erase(it);
  if (!CloseSlot(l, sh)) {
    Warn("link %s: the peer kept placing into an MR 2 s after its rights were taken "
         "back; closing the link", l->peer_desc.c_str());
    LinkKill(l);  // closes the link's other slots too
    return;
  }
  l->slots_used &= ~(uint64_t{1} << sh.slot);
  OutFrame f;
  f.hdr.type = kFrameUnshare;
  f.hdr.rkey = rkey;
  LinkEnqueue(l, std::move(f));
}

// Peers' files, each opened (through /proc/<pid>/fd: same host, same user)
// and mapped whole once per process, whatever the links that use it, and
// only if it is the file named and cannot shrink: (dev, ino) -> where, and
// how many links hold it. Guarded by Rt().mu.
struct PeerFileRef {
  int fd = -1;
  char* at = nullptr;
  uint64_t size = 0;
  int refs = 0;
};
std::map<std::pair<uint64_t, uint64_t>, PeerFileRef>& PeerFiles() {
  static auto* files = new std::map<std::pair<uint64_t, uint64_t>, PeerFileRef>();
  return *files;
}

const PeerFileRef* PeerFile(Link* l, const ShareBody& b) {
  auto key = std::make_pair(b.dev, b.ino);
  auto it = PeerFiles().find(key);
  if (it == PeerFiles().end()) {
    if (PeerFiles().size() >= kMaxPeerFiles) return nullptr;
    char path[64];
    snprintf(path, sizeof(path), "/proc/%u/fd/%d", b.pid, b.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) {
      Trace("link %s: one copy: %s: %s; WRITEs go through the ring", l->peer_desc.c_str(),
            path, strerror(errno));
      return nullptr;
    }
    struct stat st;
    if (!SameFile(fd, b.dev, b.ino, &st) || !SealedAgainstShrinking(fd) || st.st_size <= 0) {
      Trace("link %s: one copy: %s is not the file shared, or can shrink", l->peer_desc.c_str(),
            path);
      close(fd);
      return nullptr;
    }
    // Whole: it cannot shrink, and its addresses cost nothing until used.
    void* at = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE,
                    MAP_SHARED | MAP_NORESERVE, fd, 0);
    if (at == MAP_FAILED) {
      Trace("link %s: one copy: mmap of %lld bytes: %s", l->peer_desc.c_str(),
            static_cast<long long>(st.st_size), strerror(errno));
      close(fd);
      return nullptr;
    }
    // A child forked from this process does not get the peer's memory.
    (void)madvise(at, static_cast<size_t>(st.st_size), MADV_DONTFORK);
    it = PeerFiles().emplace(key, PeerFileRef{fd, static_cast<char*>(at),
                                              static_cast<uint64_t>(st.st_size), 0}).first;
  }
  if (l->peer_files.insert(key).second) ++it->second.refs;
  return &it->second;
}

void ReleasePeerFiles(Link* l) {
  for (const auto& key : l->peer_files) {
    auto it = PeerFiles().find(key);
    if (it == PeerFiles().end() || --it->second.refs > 0) continue;
    munmap(it->second.at, it->second.size);
    close(it->second.fd);
    PeerFiles().erase(it);
  }
  l->peer_files.clear();
}

}  // namespace

bool MrFindShareLocked(Mr* mr) {
  if (!GetConfig().one_copy || mr->odp || mr->mr.length < kShareMinBytes) return false;
  uint64_t addr = reinterpret_cast<uint64_t>(mr->mr.addr);
  Vma v;
  if (!FindVmaCached(addr, mr->mr.length, &v) || !v.shared || v.ino == 0) return false;
  auto key = std::make_pair(v.dev, v.ino);
  auto it = Files().find(key);
  if (it == Files().end()) {
    int fd = OpenFileOf(v);
    if (fd < 0) return false;
    it = Files().emplace(key, FileRef{fd, 0}).first;
  }
  ++it->second.refs;
  const uint64_t page = PageSize();
  uint64_t base = addr & ~(page - 1);
  uint64_t end = (addr + mr->mr.length + page - 1) & ~(page - 1);
  mr->share_dev = v.dev;
  mr->share_ino = v.ino;
  mr->share_off = v.off + (base - v.start);
  mr->share_base = base;
  mr->share_len = end - base;
  mr->share_fd = it->second.fd;
  return true;
}

void MrDropShareLocked(Mr* mr) {
  if (mr->share_len == 0) return;
  auto it = Files().find(std::make_pair(mr->share_dev, mr->share_ino));
  if (it != Files().end() && --it->second.refs == 0) {
    close(it->second.fd);
    Files().erase(it);
  }
  mr->share_len = 0;
  mr->share_fd = -1;
}

void MrSyncSharesLocked(Mr* mr, bool gone) {
  for (Link* l : Rt().links) {
    bool want = !gone && ShouldShare(mr, l);
    auto it = l->shared_out.find(mr->mr.rkey);
    bool has = it != l->shared_out.end();
    // Reads allowed or no longer: the share is made anew (the old slot
    // closed first), so that no READ is copied past its rights.
    if (want && has && it->second.readable != ShouldShareReads(mr, l)) {
      SendUnshare(l, mr->mr.rkey);
      if (l->state != LinkState::kUp) continue;  // the unshare closed the link
      has = false;
    }
    if (want && !has) SendShare(l, mr);
    if (!want && has) SendUnshare(l, mr->mr.rkey);
  }
}

void LinkSyncSharesLocked(Link* l) {
  std::vector<uint32_t> drop;
  for (auto& [rkey, sh] : l->shared_out) {
    auto mr = Rt().mrs.find(rkey);
    if (mr == Rt().mrs.end() || !ShouldShare(mr->second, l) ||
        sh.readable != ShouldShareReads(mr->second, l))
      drop.push_back(rkey);
  }
  for (uint32_t rkey : drop) SendUnshare(l, rkey);  // may close the link
  for (auto& [key, mr] : Rt().mrs) {
    if (ShouldShare(mr, l) && l->shared_out.count(key) == 0) SendShare(l, mr);
  }
}

namespace {

// The READ of `seq` is queued on `qp` and not completed (nor flushed).
bool ReadOutstanding(const Qp* qp, uint64_t seq) {
  for (size_t i = 0; i < qp->sq.size(); ++i) {
    const SendWr& wr = qp->sq[i];
    if (!wr.queued || wr.seq > seq) break;  // in order: queued ones first, by seq
    if (wr.seq == seq) return wr.opcode == IBV_WR_RDMA_READ;
  }
  return false;
}

// Copies between `local` (the frame's pieces) and the peer's MR at
// `remote`, WRITE (to_remote) or READ, while the share's slot stays open:
// busy first, then the owner's word (the owner closes first, then waits
// while busy; one of the two sees the other), and the word again every
// kPlaceStep bytes: rights taken back mid-copy stop it there (what moved
// before moved while they were there). False: the slot was closed (the
// share is forgotten; its UNSHARE is on its way).
bool CopyUnderSlot(Link* l, uint32_t rkey, const Link::RemoteMr& r,
                   const SmallVec<iovec, 2>& local, char* remote, bool to_remote) {
  ShareSlot* slot = LinkPeerSlot(l, r.slot);
  const uint64_t word = OpenWord(r.gen);
  slot->busy.store(word, std::memory_order_seq_cst);
  bool open = slot->open.load(std::memory_order_seq_cst) == word;
  uint64_t since_check = 0;
  for (size_t i = 0; open && i < local.size(); ++i) {
    const iovec& v = local[i];
    for (size_t off = 0; off < v.iov_len;) {
      size_t n = std::min<size_t>(v.iov_len - off, kPlaceStep - since_check);
      char* here = static_cast<char*>(v.iov_base) + off;
      if (to_remote) memcpy(remote, here, n);
      else memcpy(here, remote, n);
      remote += n;
      off += n;
      since_check += n;
      if (since_check == kPlaceStep) {
        since_check = 0;
        if (slot->open.load(std::memory_order_seq_cst) != word) {
          open = false;
          break;
        }
      }
    }
  }
  slot->busy.store(0, std::memory_order_release);
  if (!open) l->remote_mrs.erase(rkey);
  return open;
}

}  // namespace

Placement LinkPlace(Link* l, OutFrame* f) {
  FrameHdr& h = f->hdr;
  const bool asked = l->place_asked;  // the agent was woken for this frame already
  l->place_asked = false;
  const bool read = h.type == kFrameReadReq;
  // A WRITE's length is its payload's; a READ's, what it asks for.
  const uint64_t len = read ? h.aux : h.len;
  if ((h.type != kFrameWrite && !read) || (h.flags & kFlagPlaced) || f->sent != 0 ||
      !f->owned.empty() || len < kPlaceMin || len > UINT32_MAX || l->remote_mrs.empty())
    return Placement::kRing;
  // Only for a QP that still sends (a frame left queued by a QP gone to
  // error or destroyed goes as before), and a READ only while its WR is
  // still the application's to complete: its memory is then ours to fill.
  const Qp* qp = l->qp;
  if (qp == nullptr || qp->destroyed || qp->qp.state != IBV_QPS_RTS) return Placement::kRing;
  if (read && !ReadOutstanding(qp, h.seq)) return Placement::kRing;
  auto it = l->remote_mrs.find(h.rkey);
  if (it == l->remote_mrs.end()) return Placement::kRing;
  const Link::RemoteMr& r = it->second;
  if (read && !r.readable) return Placement::kRing;
  if (h.addr < r.addr || h.addr - r.addr > r.length || len > r.length - (h.addr - r.addr))
    return Placement::kRing;  // the responder refuses it: let it, through the ring
  // An earlier WRITE still in the ring (for a READ, a SEND too: it may
  // land in the bytes read).
  if (LinkTxTail(l) < (read ? l->ring_data_end : l->ring_write_end)) return Placement::kRing;
  // A large copy is the device's work, as an HCA's DMA is: the agent does
  // it, and the application's thread goes on (through the ring, the agent
  // copied all but the first ring's worth of a large WRITE too). Placed in
  // one go: in pieces, letting the runtime's lock go between them, 4 MiB
  // streams moved less (docs/performance.md).
  if (len >= kAgentPlaceMin && !OnAgentThread()) {
    if (!asked) Rt().Wake();
    l->place_asked = true;
    return Placement::kLater;
  }
  const uint32_t gen = r.gen;
  char* remote = r.local + (h.addr - r.addr);
  if (!CopyUnderSlot(l, h.rkey, r, read ? f->read_into : f->iov, remote, !read))
    return Placement::kRing;  // closed: the responder refuses it through the ring
  h.flags |= kFlagPlaced;
  h.pad = static_cast<uint8_t>(gen);
  CountTx(qp->device->index, read ? kStatReadOneCopy : kStatWriteOneCopy, len);
  if (read) {
    l->placed_reads.push_back(h.seq);
    f->read_into.clear();
  } else {
    h.aux = static_cast<uint32_t>(len);
    h.len = 0;
    f->iov.clear();
  }
  return Placement::kPlaced;
}

void LinkFramePumped(Link* l, const OutFrame& f) {
  if (f.hdr.len == 0) return;
  if (f.hdr.type == kFrameWrite) l->ring_write_end = l->ring_data_end = LinkTxHead(l);
  if (f.hdr.type == kFrameSend) l->ring_data_end = LinkTxHead(l);
}

void LinkHandleShare(Link* l, const FrameHdr& h, const char* body, size_t n) {
  if (h.type == kFrameUnshare) {
    l->remote_mrs.erase(h.rkey);
    return;
  }
  l->remote_mrs.erase(h.rkey);  // a share anew replaces the last
  if (l->shm == nullptr || !GetConfig().one_copy || n != sizeof(ShareBody)) return;
  ShareBody b;
  memcpy(&b, body, sizeof(b));
  const uint64_t page = PageSize();
  if (b.map_len == 0 || (b.map_base | b.map_len | b.file_off) & (page - 1) ||
      b.map_len > (1ull << 46) || b.mr_addr < b.map_base || b.mr_addr - b.map_base > b.map_len ||
      b.mr_len > b.map_len - (b.mr_addr - b.map_base)) {
    Trace("link %s: one copy: a share of rkey 0x%x that does not add up; ignored",
          l->peer_desc.c_str(), h.rkey);
    return;
  }
  if (h.imm >= static_cast<uint32_t>(kShareSlots)) return;
  const PeerFileRef* file = PeerFile(l, b);
  if (file == nullptr || b.file_off > file->size || b.map_len > file->size - b.file_off) return;
  Link::RemoteMr r;
  r.readable = (h.flags & kFlagReadable) != 0;
  r.addr = b.mr_addr;
  r.length = b.mr_len;
  r.local = file->at + b.file_off + (b.mr_addr - b.map_base);
  r.gen = h.aux;
  r.slot = static_cast<int>(h.imm);
  l->remote_mrs[h.rkey] = r;
}

void LinkForgetShares(Link* l) {
  for (auto& [rkey, sh] : l->shared_out)
    if (!CloseSlot(l, sh))
      Warn("link %s: the peer kept placing into an MR for 2 s after the link closed",
           l->peer_desc.c_str());
  l->remote_mrs.clear();
  l->shared_out.clear();
  l->slots_used = 0;
  l->placed_reads.clear();
  ReleasePeerFiles(l);
}

bool LinkSharedWith(Link* l, uint32_t rkey, uint8_t gen, bool read) {
  auto it = l->shared_out.find(rkey);
  return it != l->shared_out.end() && static_cast<uint8_t>(it->second.gen) == gen &&
         (!read || it->second.readable);
}

bool LinkTakePlacedRead(Link* l, uint64_t seq) {
  while (!l->placed_reads.empty() && l->placed_reads.front() < seq) l->placed_reads.pop_front();
  if (l->placed_reads.empty() || l->placed_reads.front() != seq) return false;
  l->placed_reads.pop_front();
  return true;
}

}  // namespace softverbs
