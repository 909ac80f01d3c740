// Sizes: every size the library prints (FormatBytes, as in its messages'
// "e.g. 4194304 or 4 MiB") reads back as the same number, and any text a
// size variable accepts reads as a number in range that prints back.
// Input: 8 bytes of a number, then text.
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

#include "config/config.h"
#include "fuzz_check.h"

using namespace grpc_rdma;

namespace {
absl::StatusOr<Options> WithBufSize(const std::string& text) {
  return ParseOptions([&](const char* name) -> std::optional<std::string> {
    if (std::string(name) == "TF_RDMA_BUF_SIZE") return text;
    return std::nullopt;
  });
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 8) return 0;
  uint64_t n = 0;
  memcpy(&n, data, 8);
  n %= (uint64_t{1} << 40) + 1;  // TF_RDMA_BUF_SIZE: up to 1 TiB
  if (n >= (uint64_t{17} << 20) + (uint64_t{128} << 10)) {  // the default pool's floor
    const std::string printed = FormatBytes(n);
    auto o = WithBufSize(printed);
    FUZZ_CHECK(o.ok(), ("a printed size reads back: " + printed).c_str());
    FUZZ_CHECK(o->buf_size == n, ("a printed size reads back the same: " + printed).c_str());
  }
  std::string text(reinterpret_cast<const char*>(data + 8), size - 8);
  auto o = WithBufSize(text);
  if (o.ok()) {
    FUZZ_CHECK(o->buf_size >= 1 && o->buf_size <= (uint64_t{1} << 40), "in range");
    auto again = WithBufSize(FormatBytes(o->buf_size));
    FUZZ_CHECK(again.ok() && again->buf_size == o->buf_size, "accepted text prints back");
  }
  return 0;
}
