// File: src/glue/trace.h
//
// The "rdma" trace flag (GRPC_TRACE=rdma, as gRPC's own flags): one line
// per connection event, through gRPC's logger.
#ifndef GRPC_RDMA_SRC_GLUE_TRACE_H_
#define GRPC_RDMA_SRC_GLUE_TRACE_H_

#include <grpc/support/log.h>

#include "src/core/lib/debug/trace.h"

namespace grpc_rdma {
extern grpc_core::TraceFlag grpc_rdma_trace;
}  // namespace grpc_rdma

#define GRPC_RDMA_TRACE(...)                                     \
  do {                                                           \
    if (GRPC_TRACE_FLAG_ENABLED(::grpc_rdma::grpc_rdma_trace)) { \
      gpr_log(GPR_INFO, "grpc_rdma: " __VA_ARGS__);              \
    }                                                            \
  } while (0)

#endif  // GRPC_RDMA_SRC_GLUE_TRACE_H_
