// File: src/engine/buffer_pool.h
//
// Pinned (registered) memory for the engine, in two parts:
//
// PinnedBudget: the process-wide cap on registered bytes (TF_RDMA_BUF_SIZE).
//   It is a cap, not an up-front allocation: memory is reserved as buffers
//   are made. Running out is backpressure: TryReserve fails, and whoever
//   needs memory asks to be told when some is released. Never an error,
//   never a corrupt message.
//
// BufferPool: one connection's registered buffers, in size classes (powers
//   of two from 4 KiB), cached for reuse. Buffers are registered in that
//   connection's own protection domain (through the Registrar), so a peer
//   can only ever reach memory granted to its own connection.
//
// Thread-safety: both classes are thread-safe. Callbacks passed to
// PinnedBudget::NotifyWhenAvailable run on the thread that releases memory,
// after every internal lock is dropped.
#ifndef GRPC_RDMA_SRC_ENGINE_BUFFER_POOL_H_
#define GRPC_RDMA_SRC_ENGINE_BUFFER_POOL_H_

#include <infiniband/verbs.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace grpc_rdma {

class BufferPool;

class PinnedBudget {
 public:
  // `floor`: the least the cap may be lowered to (LowerCapTo).
  explicit PinnedBudget(uint64_t cap_bytes, uint64_t floor = 0)
      : floor_(floor), cap_(cap_bytes) {}
  PinnedBudget(const PinnedBudget&) = delete;
  PinnedBudget& operator=(const PinnedBudget&) = delete;

  // Reserves `bytes` if they fit under the cap; false otherwise.
  bool TryReserve(uint64_t bytes);
  // Returns bytes reserved earlier and runs the waiting callbacks.
  void Release(uint64_t bytes);
  // Runs `cb` once, the next time memory is released (or now, on this
  // thread, if `bytes` already fit). The caller retries its TryReserve.
  void NotifyWhenAvailable(uint64_t bytes, std::function<void()> cb);

  // The pools drawing on this budget, so that one running short can take
  // back what idle pools keep cached (ReclaimCaches). BufferPool attaches
  // itself for its lifetime.
  void Attach(BufferPool* pool);
  void Detach(BufferPool* pool);
  // Frees every attached pool's cached buffers but `except`'s, returning
  // their bytes (and so waking waiters). Returns the bytes freed.
  uint64_t ReclaimCaches(const BufferPool* except);

  // The device would register no more (the locked-memory limit): the cap
  // becomes `bytes` (never raised again), so that everything that works
  // under TF_RDMA_BUF_SIZE (waiting, copying chunks under pressure) works
  // under that limit. kBelowFloor, and nothing changed, when `bytes` would
  // not let one connection progress: then it is an error, not a wait.
  enum class Lowered { kFirst, kAgain, kBelowFloor };
  Lowered LowerCapTo(uint64_t bytes);
  uint64_t floor() const { return floor_; }

  uint64_t cap() const;
  uint64_t used() const;
  // True while someone waits for memory or more than 3/4 is in use: pools
  // then free returned buffers instead of caching them, so one pool's cache
  // never starves another.
  bool pressured() const;
  uint64_t peak() const;

 private:
  const uint64_t floor_;
  mutable absl::Mutex mu_;
  uint64_t cap_ ABSL_GUARDED_BY(mu_);
  bool lowered_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t used_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t peak_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::function<void()>> waiters_ ABSL_GUARDED_BY(mu_);
  // Separate from mu_: taken before a pool's lock, never inside either.
  absl::Mutex pools_mu_;
  std::vector<BufferPool*> pools_ ABSL_GUARDED_BY(pools_mu_);
};

// What registering memory produced: the keys, and a handle to undo it.
struct Registration {
  uint32_t lkey = 0;
  uint32_t rkey = 0;
  void* handle = nullptr;  // e.g. the ibv_mr*
};

// Registers and deregisters memory; the engine's is ibv_reg_mr in the
// connection's PD (see MakeVerbsRegistrar), tests may use plain memory.
struct Registrar {
  std::function<absl::StatusOr<Registration>(void* addr, size_t length)> reg;
  std::function<void(const Registration&)> dereg;
  // Opens (true) or closes (false) registered memory to the peer's RDMA
  // WRITEs, updating the keys (a device may change them). Empty: the
  // memory's rights never change (plain memory in tests).
  std::function<absl::Status(Registration* reg, bool open)> set_remote_write;
};

// A registered buffer. Owned by its BufferPool; give it back with Put().
struct PinnedBuffer {
  char* data = nullptr;
  size_t size = 0;  // the size class, >= what was asked for
  Registration reg;
};

class BufferPool {
 public:
  static constexpr size_t kMinClass = 4096;

  // Borrows `budget` (must outlive the pool).
  BufferPool(PinnedBudget* budget, Registrar registrar, size_t max_class);
  // Deregisters and frees every buffer; all must have been Put back.
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // A buffer of at least `size` bytes (size <= max_class): a cached one, or
  // a new one if the budget allows, after taking back what this pool and
  // then every other pool keep cached. nullptr when the budget is exhausted:
  // backpressure, see PinnedBudget::NotifyWhenAvailable. A registration
  // refused for want of memory (RESOURCE_EXHAUSTED: the locked-memory
  // limit) while others hold registered memory lowers the budget's cap to
  // what is registered, logs it once, and is backpressure too; any other
  // failure of registration is an error.
  absl::StatusOr<PinnedBuffer*> Get(size_t size);
  // Takes the buffer back: into the cache, or freed (its bytes back to the
  // budget) when the budget is under pressure.
  void Put(PinnedBuffer* b);
  // Opens or closes `b` (handed out by this pool) to the peer's RDMA
  // WRITEs (Registrar::set_remote_write); its keys may change.
  absl::Status SetRemoteWrite(PinnedBuffer* b, bool open);
  // Frees cached buffers (returning their bytes to the budget) until at most
  // `keep_bytes` stay cached.
  void Trim(uint64_t keep_bytes = 0);
  // A cached buffer taken out for freeing elsewhere: what to deregister it
  // with comes along (the pool may be gone by the time it is freed).
  struct Detached {
    PinnedBuffer* buf;
    std::function<void(const Registration&)> dereg;
  };
  // Moves every cached buffer to `out` without freeing any (for
  // PinnedBudget::ReclaimCaches, which frees them with no lock held).
  void DetachCache(std::vector<Detached>* out);

  // The size class for `size`: the next power of two, at least kMinClass.
  static size_t ClassFor(size_t size);

  uint64_t cached_bytes() const;
  uint64_t outstanding() const;  // buffers handed out and not Put back

 private:
  PinnedBudget* const budget_;
  const Registrar registrar_;
  const size_t max_class_;
  mutable absl::Mutex mu_;
  std::vector<std::vector<PinnedBuffer*>> free_ ABSL_GUARDED_BY(mu_);  // by class index
  uint64_t cached_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t outstanding_ ABSL_GUARDED_BY(mu_) = 0;
};

// Registers with ibv_reg_mr in `pd` (a connection's own PD) with `access`;
// set_remote_write adds or takes away IBV_ACCESS_REMOTE_WRITE with
// ibv_rereg_mr. Shares `pd`: the PD lives as long as the pool may
// deregister in it (a pool of lent chunks can outlive its connection).
Registrar MakeVerbsRegistrar(std::shared_ptr<ibv_pd> pd, int access);

}  // namespace grpc_rdma

#endif  // GRPC_RDMA_SRC_ENGINE_BUFFER_POOL_H_
