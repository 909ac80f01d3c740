#include "engine/buffer_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <random>
#include <set>
#include <thread>

namespace grpc_rdma {
namespace {

// Plain-memory registration that counts what is registered.
struct FakeReg {
  std::atomic<int> live{0};
  std::atomic<int> fail_next{0};
  Registrar Get() {
    Registrar r;
    r.reg = [this](void*, size_t) -> absl::StatusOr<Registration> {
      if (fail_next.exchange(0)) return absl::ResourceExhaustedError("ibv_reg_mr: no memory");
      ++live;
      return Registration{1, 2, nullptr};
    };
    r.dereg = [this](const Registration&) { --live; };
    return r;
  }
};

TEST(PinnedBudget, CapPeakAndWaiters) {
  PinnedBudget b(100);
  EXPECT_TRUE(b.TryReserve(60));
  EXPECT_FALSE(b.TryReserve(41));
  EXPECT_TRUE(b.TryReserve(40));
  EXPECT_EQ(b.used(), 100u);
  EXPECT_FALSE(b.TryReserve(1));
  int woken = 0;
  b.NotifyWhenAvailable(10, [&] { ++woken; });
  EXPECT_EQ(woken, 0) << "nothing released yet";
  b.Release(30);
  EXPECT_EQ(woken, 1);
  b.Release(10);
  EXPECT_EQ(woken, 1) << "once only";
  b.NotifyWhenAvailable(10, [&] { ++woken; });
  EXPECT_EQ(woken, 2) << "runs at once when it already fits";
  EXPECT_EQ(b.peak(), 100u);
  EXPECT_FALSE(b.TryReserve(1000)) << "more than the cap never fits";
}

TEST(BufferPool, SizeClasses) {
  EXPECT_EQ(BufferPool::ClassFor(1), 4096u);
  EXPECT_EQ(BufferPool::ClassFor(4096), 4096u);
  EXPECT_EQ(BufferPool::ClassFor(4097), 8192u);
  EXPECT_EQ(BufferPool::ClassFor(3 << 20), 4u << 20);
}

TEST(BufferPool, CachedBuffersAreReused) {
  PinnedBudget budget(1 << 20);
  FakeReg reg;
  BufferPool pool(&budget, reg.Get(), 64 << 10);
  auto a = pool.Get(5000);
  ASSERT_TRUE(a.ok());
  ASSERT_NE(*a, nullptr);
  EXPECT_EQ((*a)->size, 8192u);
  EXPECT_EQ(budget.used(), 8192u);
  PinnedBuffer* first = *a;
  pool.Put(first);
  EXPECT_EQ(pool.cached_bytes(), 8192u);
  auto b = pool.Get(8000);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(*b, first) << "the cached buffer comes back";
  EXPECT_EQ(reg.live, 1);
  pool.Put(*b);
  EXPECT_EQ(pool.outstanding(), 0u);
}

TEST(BufferPool, ExhaustionIsBackpressureNotAnError) {
  PinnedBudget budget(64 << 10);
  FakeReg reg;
  BufferPool pool(&budget, reg.Get(), 64 << 10);
  std::vector<PinnedBuffer*> held;
  for (int i = 0; i < 4; ++i) {
    auto b = pool.Get(16 << 10);
    ASSERT_TRUE(b.ok() && *b != nullptr);
    held.push_back(*b);
  }
  auto none = pool.Get(16 << 10);
  ASSERT_TRUE(none.ok()) << "not an error";
  EXPECT_EQ(*none, nullptr) << "but no buffer";
  bool woken = false;
  budget.NotifyWhenAvailable(16 << 10, [&] { woken = true; });
  EXPECT_TRUE(budget.pressured());
  pool.Put(held.back());
  held.pop_back();
  EXPECT_TRUE(woken) << "under pressure a returned buffer is freed, not cached";
  EXPECT_EQ(pool.cached_bytes(), 0u);
  EXPECT_EQ(budget.used(), 48u << 10);
  auto again = pool.Get(16 << 10);
  ASSERT_TRUE(again.ok() && *again != nullptr);
  held.push_back(*again);
  for (PinnedBuffer* b : held) pool.Put(b);
}

TEST(BufferPool, OneCacheNeverStarvesAnotherPool) {
  PinnedBudget budget(64 << 10);
  FakeReg reg;
  BufferPool a(&budget, reg.Get(), 64 << 10), b(&budget, reg.Get(), 64 << 10);
  auto big = a.Get(64 << 10);
  ASSERT_TRUE(big.ok() && *big);
  auto none = b.Get(4096);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(*none, nullptr) << "all memory is with pool a";
  bool woken = false;
  budget.NotifyWhenAvailable(4096, [&] { woken = true; });
  a.Put(*big);  // pressure: freed, not cached in a
  EXPECT_TRUE(woken);
  auto now = b.Get(4096);
  ASSERT_TRUE(now.ok() && *now) << "pool b gets the memory pool a gave back";
  b.Put(*now);
}

// An idle pool's cache (a connection that moved data a while ago and now
// sits) is taken back when another pool finds the budget spent; the idle
// pool still works afterwards, from fresh buffers.
TEST(BufferPool, IdlePoolsCachesAreTakenBackForAnotherPool) {
  PinnedBudget budget(256 << 10);
  FakeReg reg;
  auto idle = std::make_unique<BufferPool>(&budget, reg.Get(), 256 << 10);
  BufferPool busy(&budget, reg.Get(), 256 << 10);
  auto x = idle->Get(64 << 10), y = idle->Get(64 << 10);
  ASSERT_TRUE(x.ok() && *x && y.ok() && *y);
  idle->Put(*x);
  idle->Put(*y);
  ASSERT_EQ(idle->cached_bytes(), 128u << 10) << "not under pressure: cached";
  auto big = busy.Get(256 << 10);
  ASSERT_TRUE(big.ok());
  ASSERT_NE(*big, nullptr) << "the idle pool's 128 KiB cache is given back for it";
  EXPECT_EQ(idle->cached_bytes(), 0u);
  EXPECT_EQ(reg.live, 1) << "the cached buffers were deregistered";
  EXPECT_EQ(budget.used(), 256u << 10);
  busy.Put(*big);  // pressured: freed
  auto again = idle->Get(64 << 10);
  ASSERT_TRUE(again.ok() && *again);
  idle->Put(*again);
  idle.reset();  // detaches: a reclaim after this must not reach it
  EXPECT_EQ(budget.ReclaimCaches(nullptr), 0u);
  EXPECT_EQ(budget.used(), 0u);
  EXPECT_EQ(reg.live, 0);
}

TEST(BufferPool, OtherClassesAreTrimmedToMakeRoom) {
  PinnedBudget budget(32 << 10);
  FakeReg reg;
  BufferPool pool(&budget, reg.Get(), 64 << 10);
  auto small = pool.Get(16 << 10);
  ASSERT_TRUE(small.ok() && *small);
  pool.Put(*small);  // cached: 16 KiB of budget held
  auto big = pool.Get(32 << 10);
  ASSERT_TRUE(big.ok());
  ASSERT_NE(*big, nullptr) << "the cached 16 KiB buffer is freed for it";
  EXPECT_EQ(reg.live, 1);
  pool.Put(*big);
}

TEST(BufferPool, ErrorsAreReportedAndLeakNothing) {
  PinnedBudget budget(1 << 20);
  FakeReg reg;
  BufferPool pool(&budget, reg.Get(), 64 << 10);
  auto too_big = pool.Get(1 << 20);
  ASSERT_FALSE(too_big.ok());
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kInvalidArgument);
  reg.fail_next = 1;
  auto failed = pool.Get(4096);
  ASSERT_FALSE(failed.ok());
  EXPECT_NE(failed.status().message().find("ibv_reg_mr"), std::string::npos);
  EXPECT_EQ(budget.used(), 0u) << "the reservation is given back";
}

// The device refuses a registration for want of memory (the locked-memory
// limit) while the budget still has room: the cap becomes what is
// registered and the refusal is backpressure, woken by a release; below
// the floor (what one connection needs) it is an error.
TEST(BufferPool, ARefusedRegistrationLowersTheCapWhileMemoryIsHeld) {
  PinnedBudget budget(1 << 20, 16 << 10);
  FakeReg reg;
  BufferPool pool(&budget, reg.Get(), 64 << 10);
  auto a = pool.Get(8 << 10);
  auto b = pool.Get(8 << 10);
  ASSERT_TRUE(a.ok() && *a && b.ok() && *b);
  reg.fail_next = 1;
  auto refused = pool.Get(8 << 10);
  ASSERT_TRUE(refused.ok()) << refused.status();
  EXPECT_EQ(*refused, nullptr) << "backpressure, not an error";
  EXPECT_EQ(budget.cap(), 16u << 10) << "the cap is what is registered";
  bool woken = false;
  budget.NotifyWhenAvailable(8 << 10, [&] { woken = true; });
  EXPECT_FALSE(woken) << "it does not fit under the lowered cap";
  pool.Put(*a);  // pressure: freed
  EXPECT_TRUE(woken);
  auto again = pool.Get(8 << 10);
  ASSERT_TRUE(again.ok() && *again);
  pool.Put(*again);
  pool.Put(*b);
  // Below the floor: nothing would let a connection progress.
  PinnedBudget small(1 << 20, 64 << 10);
  BufferPool p2(&small, reg.Get(), 64 << 10);
  auto c = p2.Get(8 << 10);
  ASSERT_TRUE(c.ok() && *c);
  reg.fail_next = 1;
  auto err = p2.Get(8 << 10);
  ASSERT_FALSE(err.ok());
  EXPECT_EQ(err.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(err.status().message().find("less than one connection needs"), std::string::npos)
      << err.status();
  EXPECT_EQ(small.cap(), 1u << 20) << "not lowered";
  p2.Put(*c);
}

TEST(BufferPool, ManyThreadsUnderASmallBudget) {
  PinnedBudget budget(256 << 10);
  FakeReg reg;
  {
    BufferPool pool(&budget, reg.Get(), 64 << 10);
    std::atomic<int> got{0}, backpressure{0};
    std::vector<std::thread> ts;
    for (int t = 0; t < 4; ++t) {
      ts.emplace_back([&, t] {
        std::mt19937 rng(t);
        std::vector<PinnedBuffer*> mine;
        for (int i = 0; i < 20000; ++i) {
          if (mine.size() < 4 && rng() % 2) {
            auto b = pool.Get(1 + rng() % (64 << 10));
            ASSERT_TRUE(b.ok());
            if (*b == nullptr) {
              ++backpressure;
            } else {
              (*b)->data[0] = static_cast<char>(t);  // it is real memory
              mine.push_back(*b);
              ++got;
            }
          } else if (!mine.empty()) {
            pool.Put(mine.back());
            mine.pop_back();
          }
          if (i % 1000 == 0) pool.Trim(64 << 10);
        }
        for (PinnedBuffer* b : mine) pool.Put(b);
      });
    }
    for (auto& t : ts) t.join();
    EXPECT_GT(got, 0);
    EXPECT_EQ(pool.outstanding(), 0u);
    EXPECT_LE(budget.peak(), 256u << 10) << "never above the cap";
    EXPECT_EQ(budget.used(), pool.cached_bytes());
  }
  EXPECT_EQ(budget.used(), 0u) << "the pool's destructor returns everything";
  EXPECT_EQ(reg.live, 0);
}

TEST(BufferPool, RegistersInTheConnectionsPd) {
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  ASSERT_GT(n, 0) << "runs over softverbs";
  ibv_context* ctx = ibv_open_device(list[0]);
  ibv_free_device_list(list);
  ibv_pd* pd = ibv_alloc_pd(ctx);
  PinnedBudget budget(1 << 20);
  {
    BufferPool pool(&budget,
                    MakeVerbsRegistrar(std::shared_ptr<ibv_pd>(pd, [](ibv_pd*) {}),
                                       IBV_ACCESS_LOCAL_WRITE),
                    64 << 10);
    auto b = pool.Get(10000);
    ASSERT_TRUE(b.ok()) << b.status();
    ASSERT_NE(*b, nullptr);
    auto* mr = static_cast<ibv_mr*>((*b)->reg.handle);
    EXPECT_EQ(mr->pd, pd);
    EXPECT_EQ(mr->addr, (*b)->data);
    EXPECT_EQ(mr->length, 16384u);
    EXPECT_EQ((*b)->reg.lkey, mr->lkey);
    pool.Put(*b);
  }
  EXPECT_EQ(ibv_dealloc_pd(pd), 0) << "every MR was deregistered";
  ibv_close_device(ctx);
}

}  // namespace
}  // namespace grpc_rdma
