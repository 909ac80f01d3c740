// The pool of received-bytes slices (src/glue/slice_pool.cc): blocks come
// back at the last unref, are reused by size class, and the free lists
// stay bounded.
#include "glue/slice_pool.h"

#include <grpc/slice.h>
#include <gtest/gtest.h>

#include <cstring>
#include <thread>
#include <vector>

namespace grpc_rdma {
namespace {

grpc_slice Wrap(grpc_slice_refcount* rc, char* data, size_t size) {
  grpc_slice s;
  s.refcount = rc;
  s.data.refcounted.bytes = reinterpret_cast<uint8_t*>(data);
  s.data.refcounted.length = size;
  return s;
}

TEST(SlicePool, ABlockComesBackAtTheLastUnrefAndIsReused) {
  char* a = nullptr;
  grpc_slice_refcount* rc = AllocatePooledSlice(64, &a);
  ASSERT_NE(a, nullptr);
  memset(a, 'x', 64);
  grpc_slice s = Wrap(rc, a, 64);
  grpc_slice extra = grpc_slice_ref(s);  // as gRPC's parser keeps a piece
  grpc_slice_unref(s);
  char* b = nullptr;
  grpc_slice_refcount* rc2 = AllocatePooledSlice(64, &b);
  EXPECT_NE(b, a) << "a block still referenced was handed out again";
  grpc_slice_unref(Wrap(rc2, b, 64));  // back: now the head of the list
  EXPECT_EQ(memcmp(GRPC_SLICE_START_PTR(extra), std::string(64, 'x').data(), 64), 0);
  grpc_slice_unref(extra);  // back: a is the head now
  SlicePoolCounts before = GetSlicePoolCounts();
  char* c = nullptr;
  grpc_slice_refcount* rc3 = AllocatePooledSlice(200, &c);  // same class (256 B)
  EXPECT_EQ(c, a);
  EXPECT_EQ(GetSlicePoolCounts().reused, before.reused + 1);
  EXPECT_EQ(GetSlicePoolCounts().fresh, before.fresh);
  memset(c, 'y', 256);  // the whole class is usable
  grpc_slice_unref(Wrap(rc3, c, 200));
}

TEST(SlicePool, ClassesAreBySize) {
  char* small = nullptr;
  char* big = nullptr;
  grpc_slice_refcount* r1 = AllocatePooledSlice(100, &small);
  grpc_slice_unref(Wrap(r1, small, 100));
  // 9 KiB (an 8 KiB message with gRPC's framing) is not served from the
  // 256 B class's block just given back.
  grpc_slice_refcount* r2 = AllocatePooledSlice(9 * 1024, &big);
  EXPECT_NE(big, small);
  memset(big, 1, 9 * 1024);
  grpc_slice_unref(Wrap(r2, big, 9 * 1024));
}

TEST(SlicePool, LargeSlicesAreNotPooled) {
  SlicePoolCounts before = GetSlicePoolCounts();
  char* d = nullptr;
  grpc_slice_refcount* rc = AllocatePooledSlice(kLargestPooled + 1, &d);
  ASSERT_NE(d, nullptr);
  memset(d, 2, kLargestPooled + 1);
  grpc_slice_unref(Wrap(rc, d, kLargestPooled + 1));
  SlicePoolCounts after = GetSlicePoolCounts();
  EXPECT_EQ(after.reused, before.reused);
  EXPECT_EQ(after.fresh, before.fresh);
  EXPECT_EQ(after.dropped, before.dropped);
}

TEST(SlicePool, FreeListsAreBounded) {
  // More 16 KiB blocks held at once than the class keeps (1 MiB): those
  // beyond it go back to the heap when released.
  const size_t kept = kKeptPerClass / kLargestPooled;
  std::vector<std::pair<grpc_slice_refcount*, char*>> held;
  for (size_t i = 0; i < kept + 10; ++i) {
    char* d = nullptr;
    grpc_slice_refcount* rc = AllocatePooledSlice(kLargestPooled, &d);
    held.push_back({rc, d});
  }
  SlicePoolCounts before = GetSlicePoolCounts();
  for (auto& [rc, d] : held) grpc_slice_unref(Wrap(rc, d, kLargestPooled));
  EXPECT_GE(GetSlicePoolCounts().dropped - before.dropped, 10u);
}

TEST(SlicePool, ReleasedOnAnotherThread) {
  char* d = nullptr;
  grpc_slice_refcount* rc = AllocatePooledSlice(1000, &d);
  std::thread([&] { grpc_slice_unref(Wrap(rc, d, 1000)); }).join();
  char* again = nullptr;
  grpc_slice_refcount* rc2 = AllocatePooledSlice(1000, &again);
  EXPECT_EQ(again, d);
  grpc_slice_unref(Wrap(rc2, again, 1000));
}

}  // namespace
}  // namespace grpc_rdma
