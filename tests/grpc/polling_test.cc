// Waits in gRPC's epoll set (src/glue/grpc_polling.cc). The wait is where
// gRPC's poller thread handles RDMA completions (the connection left to
// the spinner, the look before it blocks); their callbacks queue gRPC
// closures on that thread, which gRPC runs only once the wait returns. A
// wait that then blocked left a delivered read unprocessed until something
// else woke the thread: a unary call stalled past its deadline.
#include <grpc/grpc.h>
#include <gtest/gtest.h>
#include <sys/epoll.h>
#include <unistd.h>

#include <chrono>

#include "glue/runtime.h"
#include "src/core/lib/iomgr/closure.h"
#include "src/core/lib/iomgr/exec_ctx.h"

namespace grpc_rdma {
namespace {

using Clock = std::chrono::steady_clock;

int64_t MillisSince(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
}

TEST(GrpcPolling, AWaitInGrpcsSetDoesNotBlockWithWorkQueuedOnItsThread) {
  grpc_init();
  int epfd = epoll_create1(EPOLL_CLOEXEC);  // an empty set: nothing ever ready
  ASSERT_GE(epfd, 0);
  SetGrpcEpollSetForTesting(epfd);
  epoll_event ev[4];
  {
    grpc_core::ExecCtx exec_ctx;
    // Nothing queued: the wait blocks for its timeout, as a poller's does
    // (so the case below reaches the blocking wait too).
    Clock::time_point t = Clock::now();
    EXPECT_EQ(epoll_wait(epfd, ev, 4, 300), 0);
    EXPECT_GE(MillisSince(t), 250) << "the wait did not block: the test proves nothing";

    // A closure queued on this thread, as a read delivered by a poll here.
    bool ran = false;
    grpc_closure closure;
    GRPC_CLOSURE_INIT(
        &closure, [](void* arg, grpc_error_handle) { *static_cast<bool*>(arg) = true; }, &ran,
        nullptr);
    grpc_core::ExecCtx::Run(DEBUG_LOCATION, &closure, absl::OkStatus());
    t = Clock::now();
    EXPECT_EQ(epoll_wait(epfd, ev, 4, 20000), 0);
    EXPECT_LT(MillisSince(t), 10000) << "blocked with a gRPC closure queued on this thread";
    EXPECT_FALSE(ran) << "the wait runs no closure: gRPC does, once it returns";
    grpc_core::ExecCtx::Get()->Flush();
    EXPECT_TRUE(ran);
  }
  SetGrpcEpollSetForTesting(-1);
  close(epfd);
  grpc_shutdown();
}

}  // namespace
}  // namespace grpc_rdma
