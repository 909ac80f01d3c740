#include "engine/buffer_pool.h"

#include <sys/resource.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/pool_memory.h"
#include "verbs/log.h"
#include "verbs/status.h"

namespace grpc_rdma {

bool PinnedBudget::TryReserve(uint64_t bytes) {
  absl::MutexLock l(&mu_);
  if (bytes > cap_ || used_ > cap_ - bytes) return false;
  used_ += bytes;
  if (used_ > peak_) peak_ = used_;
  return true;
}

void PinnedBudget::Release(uint64_t bytes) {
  std::vector<std::function<void()>> run;
  {
    absl::MutexLock l(&mu_);
    used_ = bytes > used_ ? 0 : used_ - bytes;
    run.swap(waiters_);
  }
  for (auto& cb : run) cb();  // outside the lock: they may reserve again
}

void PinnedBudget::NotifyWhenAvailable(uint64_t bytes, std::function<void()> cb) {
  {
    absl::MutexLock l(&mu_);
    if (bytes > cap_ || used_ > cap_ - bytes) {
      waiters_.push_back(std::move(cb));
      return;
    }
  }
  cb();  // already fits: the caller retries at once
}

void PinnedBudget::Attach(BufferPool* pool) {
  absl::MutexLock l(&pools_mu_);
  pools_.push_back(pool);
}

void PinnedBudget::Detach(BufferPool* pool) {
  absl::MutexLock l(&pools_mu_);
  for (size_t i = 0; i < pools_.size(); ++i) {
    if (pools_[i] == pool) {
      pools_[i] = pools_.back();
      pools_.pop_back();
      return;
    }
  }
}

uint64_t PinnedBudget::ReclaimCaches(const BufferPool* except) {
  // Taken out under the pools' registry lock (a pool cannot go away
  // meanwhile), freed with no lock held: releasing runs waiters' callbacks,
  // and one may drop the last reference to a connection and its pools.
  std::vector<BufferPool::Detached> drop;
  {
    absl::MutexLock l(&pools_mu_);
    for (BufferPool* p : pools_)
      if (p != except) p->DetachCache(&drop);
  }
  uint64_t freed = 0;
  for (auto& d : drop) {
    d.dereg(d.buf->reg);
    PoolFree(d.buf->data, d.buf->size);
    freed += d.buf->size;
    delete d.buf;
  }
  if (freed > 0) Release(freed);
  return freed;
}

PinnedBudget::Lowered PinnedBudget::LowerCapTo(uint64_t bytes) {
  absl::MutexLock l(&mu_);
  if (bytes == 0 || bytes < floor_) return Lowered::kBelowFloor;  // nothing would come back
  if (bytes < cap_) cap_ = bytes;
  bool first = !lowered_;
  lowered_ = true;
  return first ? Lowered::kFirst : Lowered::kAgain;
}

uint64_t PinnedBudget::cap() const {
  absl::MutexLock l(&mu_);
  return cap_;
}

uint64_t PinnedBudget::used() const {
  absl::MutexLock l(&mu_);
  return used_;
}

bool PinnedBudget::pressured() const {
  absl::MutexLock l(&mu_);
  return !waiters_.empty() || used_ > cap_ / 4 * 3;
}

uint64_t PinnedBudget::peak() const {
  absl::MutexLock l(&mu_);
  return peak_;
}

namespace {

int ClassIndex(size_t cls) {
  int i = 0;
  for (size_t c = BufferPool::kMinClass; c < cls; c <<= 1) ++i;
  return i;
}

}  // namespace

size_t BufferPool::ClassFor(size_t size) {
  size_t c = kMinClass;
  while (c < size) c <<= 1;
  return c;
}

BufferPool::BufferPool(PinnedBudget* budget, Registrar registrar, size_t max_class)
    : budget_(budget), registrar_(std::move(registrar)), max_class_(ClassFor(max_class)) {
  {
    absl::MutexLock l(&mu_);
    free_.resize(ClassIndex(max_class_) + 1);
  }
  budget_->Attach(this);
}

BufferPool::~BufferPool() {
  budget_->Detach(this);  // first: no reclaim reaches into this pool after
  Trim(0);
}

absl::StatusOr<PinnedBuffer*> BufferPool::Get(size_t size) {
  size_t cls = ClassFor(size);
  if (cls > max_class_) {
    return absl::InvalidArgumentError(
        absl::StrCat("buffer of ", size, " bytes asked for; the largest class is ", max_class_));
  }
  int idx = ClassIndex(cls);
  {
    absl::MutexLock l(&mu_);
    if (!free_[idx].empty()) {
      PinnedBuffer* b = free_[idx].back();
      free_[idx].pop_back();
      cached_bytes_ -= b->size;
      ++outstanding_;
      return b;
    }
  }
  if (!budget_->TryReserve(cls)) {
    // Cached buffers of other classes hold budget nobody is using: give it
    // back and try once more before reporting backpressure.
    Trim(0);
    if (!budget_->TryReserve(cls)) {
      // And what idle pools of other connections keep cached: a cache is
      // for reuse, never a reason for a connection to wait.
      if (budget_->ReclaimCaches(this) == 0 || !budget_->TryReserve(cls)) return nullptr;
    }
  }
  void* mem = PoolAlloc(cls);
  if (mem == nullptr) {
    budget_->Release(cls);
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", cls, " bytes"));
  }
  absl::StatusOr<Registration> reg = registrar_.reg(mem, cls);
  if (!reg.ok() && reg.status().code() == absl::StatusCode::kResourceExhausted &&
      budget_->ReclaimCaches(this) > 0) {
    reg = registrar_.reg(mem, cls);  // idle caches gave locked memory back
  }
  if (!reg.ok()) {
    PoolFree(mem, cls);
    budget_->Release(cls);
    if (reg.status().code() != absl::StatusCode::kResourceExhausted) return reg.status();
    uint64_t held = budget_->used();
    rlimit r{};
    std::string limit = getrlimit(RLIMIT_MEMLOCK, &r) != 0 ? "unknown"
                        : r.rlim_cur == RLIM_INFINITY
                            ? "unlimited"
                            : absl::StrCat(r.rlim_cur / 1024, " KiB");
    // Registered memory is held elsewhere and will come back: that is the
    // real cap, if a connection can progress within it.
    PinnedBudget::Lowered lowered = budget_->LowerCapTo(held);
    if (lowered == PinnedBudget::Lowered::kBelowFloor) {
      absl::Status s = absl::ResourceExhaustedError(absl::StrCat(
          reg.status().message(), ": the device registers no more memory, most likely the "
          "locked-memory limit (RLIMIT_MEMLOCK, `ulimit -l`: ", limit, "), and ", held,
          " bytes registered is less than one connection needs (", budget_->floor(),
          "). Raise the limit: `ulimit -l unlimited`, LimitMEMLOCK=infinity for a systemd "
          "service, --ulimit memlock=-1 for a container"));
      static std::atomic<bool> said{false};  // the connections concerned fail with it too
      if (!said.exchange(true)) GRPC_RDMA_LOG_ERROR("%s", std::string(s.message()).c_str());
      return s;
    }
    if (lowered == PinnedBudget::Lowered::kFirst) {
      GRPC_RDMA_LOG_ERROR(
          "%s: the device registers no more memory, most likely the locked-memory limit "
          "(RLIMIT_MEMLOCK, `ulimit -l`: %s); grpc-rdma keeps to the %llu bytes it has "
          "registered (instead of TF_RDMA_BUF_SIZE) and transfers wait for memory. Raise the "
          "limit: `ulimit -l unlimited`, LimitMEMLOCK=infinity for a systemd service, "
          "--ulimit memlock=-1 for a container",
          std::string(reg.status().message()).c_str(), limit.c_str(),
          static_cast<unsigned long long>(held));
    }
    return nullptr;
  }
  auto* b = new PinnedBuffer{static_cast<char*>(mem), cls, *reg};
  absl::MutexLock l(&mu_);
  ++outstanding_;
  return b;
}

void BufferPool::Put(PinnedBuffer* b) {
  bool free_it = budget_->pressured();
  {
    absl::MutexLock l(&mu_);
    --outstanding_;
    if (!free_it) {
      free_[ClassIndex(b->size)].push_back(b);
      cached_bytes_ += b->size;
      return;
    }
  }
  registrar_.dereg(b->reg);
  PoolFree(b->data, b->size);
  uint64_t size = b->size;
  delete b;
  budget_->Release(size);  // may run waiters: no lock held here
}

void BufferPool::Trim(uint64_t keep_bytes) {
  std::vector<PinnedBuffer*> drop;
  {
    absl::MutexLock l(&mu_);
    // Largest classes first: they free the most budget.
    for (size_t i = free_.size(); i-- > 0 && cached_bytes_ > keep_bytes;) {
      while (!free_[i].empty() && cached_bytes_ > keep_bytes) {
        drop.push_back(free_[i].back());
        cached_bytes_ -= free_[i].back()->size;
        free_[i].pop_back();
      }
    }
  }
  for (PinnedBuffer* b : drop) {
    registrar_.dereg(b->reg);
    PoolFree(b->data, b->size);
    uint64_t size = b->size;
    delete b;
    budget_->Release(size);  // may run waiters: no lock held here
  }
}

void BufferPool::DetachCache(std::vector<Detached>* out) {
  absl::MutexLock l(&mu_);
  for (auto& cls : free_) {
    for (PinnedBuffer* b : cls) out->push_back(Detached{b, registrar_.dereg});
    cls.clear();
  }
  cached_bytes_ = 0;
}

uint64_t BufferPool::cached_bytes() const {
  absl::MutexLock l(&mu_);
  return cached_bytes_;
}

uint64_t BufferPool::outstanding() const {
  absl::MutexLock l(&mu_);
  return outstanding_;
}

absl::Status BufferPool::SetRemoteWrite(PinnedBuffer* b, bool open) {
  if (!registrar_.set_remote_write) return absl::OkStatus();
  return registrar_.set_remote_write(&b->reg, open);
}

Registrar MakeVerbsRegistrar(std::shared_ptr<ibv_pd> pd, int access) {
  Registrar r;
  r.reg = [pd, access](void* addr, size_t length) -> absl::StatusOr<Registration> {
    ibv_mr* mr = ibv_reg_mr(pd.get(), addr, length, access);
    if (absl::Status s = CheckErrno(mr == nullptr, "ibv_reg_mr",
                                    absl::StrCat("length=", length));
        !s.ok())
      return s;
    return Registration{mr->lkey, mr->rkey, mr};
  };
  r.set_remote_write = [pd, access](Registration* reg, bool open) -> absl::Status {
    auto* mr = static_cast<ibv_mr*>(reg->handle);
    int want = open ? (access | IBV_ACCESS_REMOTE_WRITE) : (access & ~IBV_ACCESS_REMOTE_WRITE);
    // rdma-core's convention: 0, or a negative ibv_rereg_mr_err_code with
    // errno set.
    int rc = ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0, want);
    if (absl::Status s = CheckErrno(rc != 0, "ibv_rereg_mr",
                                    open ? "opening a grant" : "closing a grant");
        !s.ok())
      return s;
    reg->lkey = mr->lkey;
    reg->rkey = mr->rkey;
    return absl::OkStatus();
  };
  r.dereg = [pd](const Registration& reg) {
    auto* mr = static_cast<ibv_mr*>(reg.handle);
    if (absl::Status s = CheckRet(ibv_dereg_mr(mr), "ibv_dereg_mr"); !s.ok())
      GRPC_RDMA_LOG_ERROR("%s", std::string(s.message()).c_str());
  };
  return r;
}

}  // namespace grpc_rdma
