// handoff.h - what gRPC's own synchronisation orders, said to
// ThreadSanitizer.
//
// The glue hands objects to gRPC and gets them back on another thread:
// a received chunk held by a slice is freed by whichever thread drops
// the slice's last reference. gRPC orders such steps with atomics in its
// own code (slice refcounts, closures, combiners), and gRPC is Debian's
// build, not instrumented, so ThreadSanitizer cannot see that order and
// reports the two ends as a race. HandedToGrpc(p) where the glue lets p go
// to gRPC and TakenFromGrpc(p) where gRPC gives it back (in the callback)
// tell ThreadSanitizer what gRPC's release and acquire did. Outside a
// ThreadSanitizer build they compile to nothing. docs/reliability.md
// ("ThreadSanitizer") lists where they stand.
#pragma once

// GCC says __SANITIZE_THREAD__, clang __has_feature(thread_sanitizer).
#if defined(__SANITIZE_THREAD__)
#define GRPC_RDMA_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define GRPC_RDMA_TSAN 1
#endif
#endif

#if defined(GRPC_RDMA_TSAN)
#include <sanitizer/tsan_interface.h>
#endif

namespace grpc_rdma {

#if defined(GRPC_RDMA_TSAN)
constexpr bool kThreadSanitizer = true;
#else
constexpr bool kThreadSanitizer = false;
#endif

inline void HandedToGrpc([[maybe_unused]] void* p) {
#if defined(GRPC_RDMA_TSAN)
  __tsan_release(p);
#endif
}

inline void TakenFromGrpc([[maybe_unused]] void* p) {
#if defined(GRPC_RDMA_TSAN)
  __tsan_acquire(p);
#endif
}

}  // namespace grpc_rdma
