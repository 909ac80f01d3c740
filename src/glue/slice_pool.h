// File: src/glue/slice_pool.h
//
// gRPC slices for received bytes, reused. A small message's bytes are
// copied once, out of the registered receive buffer into a slice that goes
// up to gRPC (the endpoint's ChunkMemory); allocating that slice was the
// one heap allocation left per message. Here a slice of up to
// kLargestPooled bytes comes from a free list of blocks of its size class
// (the slice's refcount, then its bytes, in one block), and goes back to it
// when gRPC drops its last reference, on whatever thread that is. Each of
// the seven classes (powers of two, 256 B to 16 KiB) keeps at most
// kKeptPerClass bytes of free blocks (the rest go back to the heap), so
// the pool holds at most 3.5 MiB however many slices an application once
// held. Larger slices are gRPC's own. The slice's owner hands it to gRPC
// with HandedToGrpc (glue/handoff.h): the block's last unref may come on
// any thread.
#ifndef GRPC_RDMA_SRC_GLUE_SLICE_POOL_H_
#define GRPC_RDMA_SRC_GLUE_SLICE_POOL_H_

#include <cstddef>
#include <cstdint>

struct grpc_slice_refcount;

namespace grpc_rdma {

constexpr size_t kLargestPooled = 16 * 1024;
constexpr size_t kKeptPerClass = 512 * 1024;

// A refcounted block of at least `size` bytes at *data; its refcount (1)
// is the owner token (gRPC's grpc_slice_malloc_large for sizes above
// kLargestPooled). Freed, or given back to the pool, at its last unref.
grpc_slice_refcount* AllocatePooledSlice(size_t size, char** data);

// Counts since the process started, for tests: blocks taken from a free
// list, blocks allocated fresh, blocks freed because their list was full.
struct SlicePoolCounts {
  uint64_t reused = 0, fresh = 0, dropped = 0;
};
SlicePoolCounts GetSlicePoolCounts();

}  // namespace grpc_rdma

#endif  // GRPC_RDMA_SRC_GLUE_SLICE_POOL_H_
