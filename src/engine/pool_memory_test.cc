#include "engine/pool_memory.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <set>
#include <vector>
#include <sstream>
#include <string>

namespace grpc_rdma {
namespace {

// The line of /proc/self/maps that holds p.
std::string MapsLineOf(const void* p) {
  std::ifstream f("/proc/self/maps");
  std::string line;
  auto a = reinterpret_cast<uintptr_t>(p);
  while (std::getline(f, line)) {
    unsigned long long start = 0, end = 0;
    if (sscanf(line.c_str(), "%llx-%llx", &start, &end) == 2 && start <= a && a < end) return line;
  }
  return "";
}

TEST(PoolMemory, BuffersAreASharedMappingOfTheSealedPoolFile) {
  void* p = PoolAlloc(64 * 1024);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 4096, 0u);
  ASSERT_TRUE(PoolMemoryIsShared(p));
  std::string line = MapsLineOf(p);
  // "start-end rw-s offset dev inode /memfd:grpc-rdma-pool (deleted)"
  std::istringstream in(line);
  std::string range, perms;
  in >> range >> perms;
  EXPECT_EQ(perms, "rw-s") << line;
  EXPECT_NE(line.find("memfd:grpc-rdma-pool"), std::string::npos) << line;
  memset(p, 7, 64 * 1024);
  PoolFree(p, 64 * 1024);
}

TEST(PoolMemory, FreedBuffersKeepTheirPagesUpToALimitAndTheirAddressesForTheirSize) {
  const size_t kSize = 1 << 20;
  constexpr int kN = 80;  // 80 MiB freed: more than the 64 MiB kept
  std::set<char*> first;
  for (int i = 0; i < kN; ++i) {
    auto* p = static_cast<char*>(PoolAlloc(kSize));
    ASSERT_NE(p, nullptr);
    memset(p, 0x5a, kSize);
    first.insert(p);
  }
  ASSERT_EQ(first.size(), static_cast<size_t>(kN));
  for (char* p : first) PoolFree(p, kSize);
  int kept = 0, punched = 0;
  std::vector<char*> again;
  for (int i = 0; i < kN; ++i) {
    auto* q = static_cast<char*>(PoolAlloc(kSize));
    ASSERT_TRUE(first.count(q)) << "the addresses of freed buffers are reused for their size";
    again.push_back(q);
    // A punched hole reads back zero-filled; kept pages keep their bytes.
    if (q[0] == 0 && q[kSize - 1] == 0) ++punched;
    else if (q[0] == 0x5a && q[kSize - 1] == 0x5a) ++kept;
  }
  EXPECT_GE(punched, kN - 64) << "past 64 MiB, freed pages go back to the system";
  EXPECT_GE(kept, 48) << "up to 64 MiB of freed buffers keep their pages";
  EXPECT_EQ(kept + punched, kN);
  auto* r = static_cast<char*>(PoolAlloc(2 * kSize));
  ASSERT_NE(r, nullptr);
  for (char* q : again) EXPECT_TRUE(r + 2 * kSize <= q || r >= q + kSize) << "no overlap";
  for (char* q : again) PoolFree(q, kSize);
  PoolFree(r, 2 * kSize);
}

TEST(PoolMemory, AForkedChildNeitherSeesNorFreesItsParentsBuffers) {
  const size_t kSize = 64 * 1024;
  auto* p = static_cast<char*>(PoolAlloc(kSize));
  ASSERT_NE(p, nullptr);
  memset(p, 'A', kSize);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // The parent's buffer is not mapped here (MADV_DONTFORK); giving it
    // back must not punch the parent's pages out of the shared file, nor
    // make its address one the child hands out twice.
    auto* q = static_cast<char*>(PoolAlloc(kSize));
    if (q == nullptr) _exit(2);
    memset(q, 'B', kSize);
    PoolFree(p, kSize);
    auto* r = static_cast<char*>(PoolAlloc(kSize));
    if (r == nullptr) _exit(2);
    if (r == q || q == p || r == p) _exit(3);
    memset(r, 'C', kSize);
    if (q[0] != 'B' || q[kSize - 1] != 'B') _exit(4);
    PoolFree(q, kSize);
    PoolFree(r, kSize);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "the child died: status " << status;
  EXPECT_EQ(WEXITSTATUS(status), 0);
  for (size_t i = 0; i < kSize; i += 512) ASSERT_EQ(p[i], 'A') << "at " << i;
  PoolFree(p, kSize);
}

}  // namespace
}  // namespace grpc_rdma
