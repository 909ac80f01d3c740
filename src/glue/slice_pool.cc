#include "glue/slice_pool.h"

#include <grpc/slice.h>

#include <atomic>
#include <mutex>
#include <new>

#include "glue/handoff.h"
#include "src/core/lib/slice/slice_refcount.h"

// A block on a free list is poisoned for AddressSanitizer, so a slice read
// after its last unref is still reported, as it was with the heap's.
#if defined(__SANITIZE_ADDRESS__)
#define GRPC_RDMA_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define GRPC_RDMA_ASAN 1
#endif
#endif
#if defined(GRPC_RDMA_ASAN)
#include <sanitizer/asan_interface.h>
#define POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define POISON(p, n) ((void)(p), (void)(n))
#define UNPOISON(p, n) ((void)(p), (void)(n))
#endif

namespace grpc_rdma {
namespace {

// Size classes, powers of two from 256 B: a block wastes less than half
// (gRPC's framing puts a 1 KiB message just above 1 KiB: a 2 KiB block).
constexpr int kClasses = 7;
constexpr size_t kClassBytes[kClasses] = {256, 512, 1024, 2048, 4096, 8192, kLargestPooled};
static_assert(kClassBytes[kClasses - 1] == kLargestPooled, "the largest class");

struct Block : grpc_slice_refcount {
  explicit Block(int c) : grpc_slice_refcount(&GiveBack), cls(c) {}
  int cls;
  Block* next = nullptr;  // on a free list
  char* bytes();
  static void GiveBack(grpc_slice_refcount* r);
};
// The bytes follow the header, 16-byte aligned as malloc's are.
constexpr size_t kHeader = (sizeof(Block) + 15) / 16 * 16;
char* Block::bytes() { return reinterpret_cast<char*>(this) + kHeader; }

struct FreeList {
  std::mutex mu;
  Block* head = nullptr;
  size_t count = 0;
};

// Never destroyed: gRPC may drop a slice after static destructors ran.
FreeList* Lists() {
  static FreeList* lists = new FreeList[kClasses];
  return lists;
}

std::atomic<uint64_t> g_reused{0}, g_fresh{0}, g_dropped{0};

size_t Kept(int cls) { return kKeptPerClass / kClassBytes[cls]; }

void Block::GiveBack(grpc_slice_refcount* r) {
  Block* b = static_cast<Block*>(r);
  // The thread that filled it handed it to gRPC (ToSlice); gRPC's
  // refcount ordered that before this last unref.
  TakenFromGrpc(b);
  int cls = b->cls;
  FreeList& l = Lists()[cls];
  {
    std::lock_guard<std::mutex> g(l.mu);
    if (l.count < Kept(cls)) {
      POISON(b->bytes(), kClassBytes[cls]);
      b->next = l.head;
      l.head = b;
      ++l.count;
      return;
    }
  }
  g_dropped.fetch_add(1, std::memory_order_relaxed);
  b->~Block();
  ::operator delete(static_cast<void*>(b));
}

}  // namespace

grpc_slice_refcount* AllocatePooledSlice(size_t size, char** data) {
  int cls = 0;
  while (cls < kClasses && kClassBytes[cls] < size) ++cls;
  if (cls == kClasses) {
    // Never inlined: the bytes must live in the refcounted block.
    grpc_slice s = grpc_slice_malloc_large(size);
    *data = reinterpret_cast<char*>(GRPC_SLICE_START_PTR(s));
    return s.refcount;
  }
  FreeList& l = Lists()[cls];
  Block* b = nullptr;
  {
    std::lock_guard<std::mutex> g(l.mu);
    if (l.head != nullptr) {
      b = l.head;
      l.head = b->next;
      --l.count;
    }
  }
  void* mem;
  if (b != nullptr) {
    g_reused.fetch_add(1, std::memory_order_relaxed);
    b->~Block();
    mem = b;
  } else {
    g_fresh.fetch_add(1, std::memory_order_relaxed);
    mem = ::operator new(kHeader + kClassBytes[cls]);
  }
  Block* fresh = new (mem) Block(cls);  // refcount 1
  *data = fresh->bytes();
  UNPOISON(*data, kClassBytes[cls]);
  return fresh;
}

SlicePoolCounts GetSlicePoolCounts() {
  SlicePoolCounts c;
  c.reused = g_reused.load(std::memory_order_relaxed);
  c.fresh = g_fresh.load(std::memory_order_relaxed);
  c.dropped = g_dropped.load(std::memory_order_relaxed);
  return c;
}

}  // namespace grpc_rdma
