// File: src/glue/endpoint.h
//
// A grpc_endpoint (gRPC 1.51's iomgr byte-stream interface, the one chttp2
// reads and writes) over an engine Connection.
//
// - read: empties the slice buffer, then completes with every byte the
//   connection has (at least one);
//   chunks that arrived by rendezvous go up as slices over the registered
//   buffers (no copy), given back to the pool when gRPC drops the slice;
//   eager bytes go up in the slices the engine copied them into
//   (SliceChunkMemory: one copy, out of the registered buffer).
// - write: completes once the engine is done with the slices' bytes.
// - shutdown: pending and later reads and writes fail with the given error
//   (UNAVAILABLE) and the RDMA connection is closed and let go: its QP and
//   pinned buffers are freed once its disconnect is done, even if gRPC
//   never destroys the endpoint (gRPC 1.51 can leak a shut-down one).
// - get_peer / get_local_address: "ipv4:10.0.0.2:50051?transport=rdma", a
//   URI gRPC parses as it parses TCP's "ipv4:10.0.0.2:50051".
// Completions run as gRPC closures through an ExecCtx on the engine's
// poller thread (or the calling thread's ExecCtx when already done).
#ifndef GRPC_RDMA_SRC_GLUE_ENDPOINT_H_
#define GRPC_RDMA_SRC_GLUE_ENDPOINT_H_

#include <memory>

#include "engine/engine.h"
#include "src/core/lib/iomgr/endpoint.h"

namespace grpc_rdma {

// The engine's ChunkMemory for gRPC: received bytes are copied straight
// into refcounted gRPC slices, which the endpoint hands up as they are.
ChunkMemory SliceChunkMemory();

// Takes a share of `conn`; the endpoint closes it when shut down or
// destroyed. `server` says which side accepted (for the stats).
grpc_endpoint* CreateRdmaEndpoint(std::shared_ptr<Connection> conn, bool server);

// Runs `closure` with `error` through the calling thread's ExecCtx, or a
// new one (and an ApplicationCallbackExecCtx) on a thread that has none.
void RunClosure(grpc_closure* closure, grpc_error_handle error);

// absl::Status from the engine -> a gRPC error with status UNAVAILABLE.
grpc_error_handle ToGrpcError(const absl::Status& s);

}  // namespace grpc_rdma

#endif  // GRPC_RDMA_SRC_GLUE_ENDPOINT_H_
