// The TF_RDMA_* parser: any environment either parses, or is refused with
// a message naming each bad variable. What parses must pass every later
// check that could turn RDMA off (ValidateOptions; the engine's own, after
// the glue adds its framing room): the invariant behind the bug where a
// documented TF_RDMA_ACC_SIZE silently turned RDMA off.
//
// Input: lines of "N=value", N a digit choosing the variable (so the
// fuzzer reaches values, not names).
#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "config/config.h"
#include "fuzz_check.h"

using namespace grpc_rdma;

namespace {
const char* const kNames[] = {
    "TF_RDMA_CHUNK_SIZE", "TF_RDMA_ACC_SIZE",  "TF_RDMA_BUF_SIZE",        "TF_RDMA_EAGER_DEPTH",
    "TF_RDMA_CHUNKS_IN_FLIGHT", "TF_RDMA_ENABLED", "TF_RDMA_POLL_MODE", "TF_RDMA_SPIN_US",
    "TF_RDMA_PORT",       "TF_RDMA_TOS",
};
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string in(reinterpret_cast<const char*>(data), size);
  std::map<std::string, std::string> env;
  size_t pos = 0;
  while (pos < in.size()) {
    size_t end = in.find('\n', pos);
    if (end == std::string::npos) end = in.size();
    std::string line = in.substr(pos, end - pos);
    pos = end + 1;
    if (line.size() < 2 || line[1] != '=' || line[0] < '0' || line[0] > '9') continue;
    env[kNames[line[0] - '0']] = line.substr(2);
  }
  auto o = ParseOptions([&](const char* name) -> std::optional<std::string> {
    auto it = env.find(name);
    if (it == env.end()) return std::nullopt;
    return it->second;
  });
  if (!o.ok()) {
    std::string m(o.status().message());
    bool named = false;
    for (const auto& [k, v] : env) named |= m.find(k) != std::string::npos;
    FUZZ_CHECK(named, "a refusal names a variable that was set");
    return 0;
  }
  FUZZ_CHECK(ValidateOptions(*o).ok(), "what parses is valid");
  const Options e = EngineOptions(*o);
  absl::Status s = ValidateEngineOptions(e);
  FUZZ_CHECK(s.ok(), "what parses runs the engine");
  FUZZ_CHECK(o->buf_size >= OneConnectionBytes(e), "the pool holds one connection");
  FUZZ_CHECK(!DescribeOptions(*o).empty(), "it can be described");
  return 0;
}
