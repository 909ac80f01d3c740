#include "engine/pool_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "verbs/log.h"

namespace grpc_rdma {
namespace {

// Addresses reserved for the file: nothing is backed until a buffer is
// used. Pool classes never share addresses with each other, so this bounds
// the sum over classes of each class's peak (TF_RDMA_BUF_SIZE bounds their
// total at any moment); past it, buffers come from the heap.
constexpr uint64_t kArenaBytes = uint64_t{1} << 36;  // 64 GiB
// Freed buffers keep their pages up to this many bytes in all (a new
// connection's buffers then cost no page faults, as the heap's freed
// memory under TF_RDMA_MALLOC_TUNE costs none); past it, a freed buffer's
// pages go back to the system at once.
constexpr uint64_t kKeepBackedBytes = uint64_t{64} << 20;

struct Arena {
  absl::Mutex mu;
  pid_t pid = 0;  // the process that made it; 0: not tried yet
  int fd = -1;
  char* base = nullptr;  // nullptr: none here (the heap is used)
  uint64_t next = 0;     // addresses handed out so far
  std::map<size_t, std::vector<char*>> free;  // by size: addresses to reuse
  uint64_t backed_free = 0;  // bytes of `free` whose pages are still there
  std::set<char*> backed;    // those buffers
  // Files of the processes this one was forked from: not mapped here, and
  // their buffers are theirs (freeing one here gives nothing back).
  std::vector<char*> parents;
};

Arena& A() {
  static Arena* a = new Arena();  // never destroyed: buffers may outlive main
  return *a;
}

void MakeLocked(Arena& a) {
  if (a.pid != 0 && a.pid != getpid()) {
    // A forked child: the parent's mapping is not here (MADV_DONTFORK) and
    // its file is the parent's. Its own, made anew.
    if (a.fd >= 0) close(a.fd);
    if (a.base != nullptr) {
      // Its addresses stay reserved here, so that nothing of the child's
      // (its own file among them) lands where a parent's buffer pointer,
      // freed here, would be taken for one of the child's.
      (void)mmap(a.base, kArenaBytes, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
      a.parents.push_back(a.base);
    }
    a.fd = -1;
    a.base = nullptr;
    a.next = 0;
    a.free.clear();
    a.backed.clear();
    a.backed_free = 0;
  }
  a.pid = getpid();
  int fd = memfd_create("grpc-rdma-pool", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    LogAt(LogSeverity::kInfo, __FILE__, __LINE__,
          "pool memory: memfd_create: %s; buffers come from the heap", strerror(errno));
    return;
  }
  void* at = MAP_FAILED;
  if (ftruncate(fd, static_cast<off_t>(kArenaBytes)) == 0 &&
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) == 0) {
    at = mmap(nullptr, kArenaBytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
  }
  if (at == MAP_FAILED) {
    LogAt(LogSeverity::kInfo, __FILE__, __LINE__,
          "pool memory: a shared file of %llu bytes: %s; buffers come from the heap",
          static_cast<unsigned long long>(kArenaBytes), strerror(errno));
    close(fd);
    return;
  }
  (void)madvise(at, kArenaBytes, MADV_DONTFORK);
  a.fd = fd;
  a.base = static_cast<char*>(at);
}

bool In(const char* base, const void* p) {
  auto* c = static_cast<const char*>(p);
  return base != nullptr && c >= base && c < base + kArenaBytes;
}

bool InArena(const Arena& a, const void* p) { return In(a.base, p); }

}  // namespace

void* PoolAlloc(size_t size) {
  Arena& a = A();
  {
    absl::MutexLock l(&a.mu);
    if (a.pid != getpid()) MakeLocked(a);
    if (a.base != nullptr) {
      std::vector<char*>& reuse = a.free[size];
      if (!reuse.empty()) {
        // Kept pages first (pushed last), then holes.
        char* p = reuse.back();
        reuse.pop_back();
        if (a.backed.erase(p) != 0) a.backed_free -= size;
        return p;
      }
      if (size <= kArenaBytes - a.next) {
        char* p = a.base + a.next;
        a.next += size;
        return p;
      }
    }
  }
  return std::aligned_alloc(4096, size);
}

void PoolFree(void* p, size_t size) {
  if (p == nullptr) return;
  Arena& a = A();
  {
    absl::MutexLock l(&a.mu);
    for (const char* base : a.parents)
      if (In(base, p)) return;  // a parent's: not mapped here, nothing to give back
    if (InArena(a, p)) {
      // Another pid: a forked child that has made no arena yet, freeing
      // its parent's buffer (the parent's still, nothing to give back).
      if (a.pid == getpid()) {
        auto* c = static_cast<char*>(p);
        std::vector<char*>& reuse = a.free[size];
        if (a.backed_free + size <= kKeepBackedBytes) {
          a.backed_free += size;
          a.backed.insert(c);
          reuse.push_back(c);
        } else {
          // The pages go back now; the addresses wait for the next buffer
          // of this size (zero-filled when touched again, as fresh heap
          // pages), after those that kept theirs.
          (void)fallocate(a.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, c - a.base,
                          static_cast<off_t>(size));
          reuse.insert(reuse.begin(), c);
        }
      }
      return;
    }
  }
  std::free(p);
}

bool PoolMemoryIsShared(const void* p) {
  Arena& a = A();
  absl::MutexLock l(&a.mu);
  return a.pid == getpid() && InArena(a, p);
}

}  // namespace grpc_rdma
