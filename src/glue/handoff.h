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

#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#endif

namespace grpc_rdma {

inline void HandedToGrpc([[maybe_unused]] void* p) {
#if defined(__SANITIZE_THREAD__)
  __tsan_release(p);
#endif
}

inline void TakenFromGrpc([[maybe_unused]] void* p) {
#if defined(__SANITIZE_THREAD__)
  __tsan_acquire(p);
#endif
}

}  // namespace grpc_rdma
