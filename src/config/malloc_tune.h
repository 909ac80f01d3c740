// File: src/config/malloc_tune.h
//
// TF_RDMA_MALLOC_TUNE: glibc malloc's thresholds, raised at install so that
// the large buffers gRPC allocates for every message (each a fresh block of
// the message's size) are reused from the heap instead of being mapped,
// faulted in page by page and handed back to the kernel each time, as MPI
// libraries over RDMA tune it with mallopt. It helps TCP as much as RDMA in
// the same process (docs/performance.md). Never done silently: the plan is
// one line for the log (and grpc_rdma_info), and it is left alone when the
// process set malloc's environment variables (GLIBC_TUNABLES' malloc
// tunables, MALLOC_*_) or runs another malloc. A program's own mallopt
// calls are not seen: made before the plugin installs, they are overridden;
// made after, they win.
#ifndef GRPC_RDMA_SRC_CONFIG_MALLOC_TUNE_H_
#define GRPC_RDMA_SRC_CONFIG_MALLOC_TUNE_H_

#include <cstddef>
#include <string>

#include "config/config.h"
#include "grpc_rdma/options.h"

namespace grpc_rdma {

// glibc's M_MMAP_THRESHOLD (its largest allowed value on 64-bit) and
// M_TRIM_THRESHOLD as set.
constexpr size_t kMallocMmapThreshold = size_t{32} << 20;
constexpr size_t kMallocTrimThreshold = size_t{256} << 20;

struct MallocPlan {
  bool tune = false;  // mallopt is to be called
  std::string say;    // one line for the log; empty when the setting is off
};

// What TF_RDMA_MALLOC_TUNE does in this process. `env` reads the
// environment (GLIBC_TUNABLES, MALLOC_*_); `glibc_malloc` says whether the
// process's malloc is glibc's.
MallocPlan PlanMalloc(const Options& o, const EnvLookup& env, bool glibc_malloc);
// The same for this process: its environment and its malloc.
MallocPlan PlanMalloc(const Options& o);

// Whether malloc, as the process resolves it, is glibc's (not tcmalloc,
// jemalloc or a sanitizer's).
bool GlibcMallocInUse();

// Carries out this process's plan (once per process); returns it.
MallocPlan TuneMalloc(const Options& o);

}  // namespace grpc_rdma

#endif  // GRPC_RDMA_SRC_CONFIG_MALLOC_TUNE_H_
