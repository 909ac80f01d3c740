// File: tests/fuzz/fuzz_check.h
//
// FUZZ_CHECK(cond, why): an invariant of a fuzz target. A violation prints
// what broke and aborts, which libFuzzer reports as a crash and keeps the
// input that caused it.
#ifndef GRPC_RDMA_TESTS_FUZZ_FUZZ_CHECK_H_
#define GRPC_RDMA_TESTS_FUZZ_FUZZ_CHECK_H_

#include <cstdio>
#include <cstdlib>

#define FUZZ_CHECK(cond, why)                                                          \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      std::fprintf(stderr, "%s:%d: invariant broken: %s (%s)\n", __FILE__, __LINE__, \
                   #cond, why);                                                        \
      std::abort();                                                                    \
    }                                                                                  \
  } while (0)

#endif  // GRPC_RDMA_TESTS_FUZZ_FUZZ_CHECK_H_
