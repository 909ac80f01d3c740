#include "verbs/status.h"

#include <cerrno>
#include <cstdio>

#include "absl/strings/str_cat.h"

namespace grpc_rdma {

absl::Status ErrnoStatus(int err, absl::string_view call, absl::string_view object) {
  if (err == 0) return absl::OkStatus();
  if (err < 0) err = -err;  // providers return errno with either sign
  // ErrnoToStatus appends ": <strerror>" and picks the code a caller can
  // act on: ENOMEM is RESOURCE_EXHAUSTED, EINVAL INVALID_ARGUMENT,
  // ECONNREFUSED and friends UNAVAILABLE, and so on.
  return absl::ErrnoToStatus(err, object.empty() ? std::string(call)
                                                 : absl::StrCat(call, " ", object));
}

absl::Status CheckRet(int ret, absl::string_view call, absl::string_view object) {
  return ErrnoStatus(ret, call, object);
}

absl::Status CheckErrno(bool failed, absl::string_view call, absl::string_view object) {
  if (!failed) return absl::OkStatus();
  int err = errno;
  return ErrnoStatus(err == 0 ? EIO : err, call, object);  // a provider may forget errno
}

std::string QpName(unsigned qpn) {
  char buf[32];
  snprintf(buf, sizeof(buf), "qpn=0x%x", qpn);
  return buf;
}

}  // namespace grpc_rdma
