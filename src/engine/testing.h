// Helpers shared by the engine's tests and benchmark.
#ifndef GRPC_RDMA_SRC_ENGINE_TESTING_H_
#define GRPC_RDMA_SRC_ENGINE_TESTING_H_

#include <arpa/inet.h>
#include <netinet/in.h>

#include <cstdint>
#include <string>

namespace grpc_rdma::testing {

inline sockaddr_in Loopback(uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  return a;
}

// n bytes that depend on seed and position (a shifted stream mismatches).
inline std::string Pattern(size_t n, uint32_t seed) {
  std::string s(n, '\0');
  uint32_t x = seed * 2654435761u + 7;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1103515245u + 12345u;
    s[i] = static_cast<char>(x >> 16);
  }
  return s;
}

}  // namespace grpc_rdma::testing

#endif  // GRPC_RDMA_SRC_ENGINE_TESTING_H_
