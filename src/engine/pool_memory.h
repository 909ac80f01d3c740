// File: src/engine/pool_memory.h
//
// Where the engine's registered buffers come from: one memfd per process,
// sealed against shrinking and growing, mapped shared (and not into a
// forked child), handed out in the pool's size classes.
//
// Why not the heap: a device on this host may then map the same pages.
// softverbs does (its one-copy WRITEs, docs/softverbs.md): a peer that
// writes into these buffers copies its bytes once, straight here, instead
// of into a ring and out of it. An HCA registers such memory as it
// registers any other. Freed buffers keep their pages up to 64 MiB in all
// (the next connection's buffers then fault nothing in); past that a freed
// buffer's pages go back to the system (a hole punched in the file). Its
// addresses are kept for the next buffer of its class.
//
// Where the memfd cannot be had (no memfd, an address-space limit),
// buffers come from the heap as before. A child forked from the process
// makes its own file (the parent's addresses stay reserved there, and a
// parent's buffer freed in the child is left alone).
//
// Thread-safety: thread-safe.
#ifndef GRPC_RDMA_SRC_ENGINE_POOL_MEMORY_H_
#define GRPC_RDMA_SRC_ENGINE_POOL_MEMORY_H_

#include <cstddef>

namespace grpc_rdma {

// `size`: a power of two, at least 4096. nullptr when there is no memory.
void* PoolAlloc(size_t size);
// Gives back what PoolAlloc returned, with the same size.
void PoolFree(void* p, size_t size);
// True if p came from the shared file (for tests).
bool PoolMemoryIsShared(const void* p);

}  // namespace grpc_rdma

#endif  // GRPC_RDMA_SRC_ENGINE_POOL_MEMORY_H_
