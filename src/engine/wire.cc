#include "engine/wire.h"

#include <string.h>

#include <algorithm>

namespace grpc_rdma {
namespace wire {

const char* ParseHello(const void* data, size_t len, uint64_t max_acc, Hello* out) {
  if (data == nullptr || len < kHelloV2Bytes) return "no Hello (private data too short)";
  *out = Hello{};  // fields an older peer's Hello lacks are 0
  memcpy(out, data, std::min(len, sizeof(*out)));
  if (out->magic != kMagic) return "not a grpc-rdma Hello (magic)";
  if (out->version != kVersion) return "unsupported protocol version";
  if (out->eager_depth < 3 || out->eager_depth > 4096) return "eager depth out of range";
  if (out->acc_size < 64 || out->acc_size > max_acc) return "eager limit out of range";
  if (out->max_chunk != 0 && out->max_chunk < (4u << 10)) return "chunk size out of range";
  return nullptr;
}

}  // namespace wire
}  // namespace grpc_rdma
