// File: src/config/malloc_tune.cc
#include "config/malloc_tune.h"

#include <dlfcn.h>
#include <malloc.h>

#include "absl/strings/str_cat.h"

namespace grpc_rdma {

MallocPlan PlanMalloc(const Options& o, const EnvLookup& env, bool glibc_malloc) {
  MallocPlan p;
  if (!o.malloc_tune) return p;
  std::optional<std::string> tunables = env("GLIBC_TUNABLES");
  const bool own = (tunables && tunables->find("glibc.malloc.") != std::string::npos) ||
                   env("MALLOC_MMAP_THRESHOLD_") || env("MALLOC_TRIM_THRESHOLD_") ||
                   env("MALLOC_TOP_PAD_") || env("MALLOC_MMAP_MAX_");
  if (own) {
    p.say = "malloc: left as the process set it (GLIBC_TUNABLES or MALLOC_*_ variables)";
  } else if (!glibc_malloc) {
    p.say = "malloc: not glibc's (tcmalloc, jemalloc or a sanitizer's), left alone";
  } else {
    p.tune = true;
    p.say = absl::StrCat(
        "malloc: glibc's thresholds raised (mmap ", kMallocMmapThreshold >> 20, " MiB, trim ",
        kMallocTrimThreshold >> 20,
        " MiB): large freed blocks are reused, not given back to the kernel each time "
        "(TF_RDMA_MALLOC_TUNE=false keeps glibc's defaults)");
  }
  return p;
}

bool GlibcMallocInUse() {
  void* libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
  if (libc == nullptr) return false;
  void* glibc_malloc = dlsym(libc, "malloc");
  dlclose(libc);
  return glibc_malloc != nullptr && glibc_malloc == dlsym(RTLD_DEFAULT, "malloc");
}

MallocPlan PlanMalloc(const Options& o) {
  return PlanMalloc(o, ProcessEnvironment(), GlibcMallocInUse());
}

MallocPlan TuneMalloc(const Options& o) {
  MallocPlan p = PlanMalloc(o);
  if (p.tune) {
    // Once per process; every later call reports what that one did.
    static const std::string* refused = [] {
      bool mmap_ok = mallopt(M_MMAP_THRESHOLD, static_cast<int>(kMallocMmapThreshold)) == 1;
      bool trim_ok = mallopt(M_TRIM_THRESHOLD, static_cast<int>(kMallocTrimThreshold)) == 1;
      if (mmap_ok && trim_ok) return static_cast<std::string*>(nullptr);
      return new std::string(absl::StrCat("malloc: glibc refused ",
                                          mmap_ok ? "" : "the mmap threshold",
                                          !mmap_ok && !trim_ok ? " and " : "",
                                          trim_ok ? "" : "the trim threshold",
                                          " (mallopt); those stay at its defaults"));
    }();
    if (refused != nullptr) p.say = *refused;
  }
  return p;
}

}  // namespace grpc_rdma
