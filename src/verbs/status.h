// File: src/verbs/status.h
//
// The one place where rdma-core's return conventions become absl::Status.
// rdma-core reports failure four ways, and providers disagree on the sign:
//
//   0 or an errno value (possibly negated)   ibv_modify_qp, ibv_post_send, ...
//   NULL with errno                          ibv_create_qp, ibv_reg_mr, ...
//   -1 with errno                            rdma_*, ibv_get_cq_event
//   a negative count                         ibv_poll_cq
//
// Every message names the call and the object, e.g.
//   "ibv_modify_qp(RTR) qpn=0x1a2: Invalid argument".
//
// Also the project's only two status macros (Abseil 20220623 has none).
#ifndef GRPC_RDMA_SRC_VERBS_STATUS_H_
#define GRPC_RDMA_SRC_VERBS_STATUS_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace grpc_rdma {

// An errno value (either sign) from `call` on `object` as a Status; 0 is OK.
absl::Status ErrnoStatus(int err, absl::string_view call, absl::string_view object = "");

// For calls that return 0 or an errno value, of either sign.
absl::Status CheckRet(int ret, absl::string_view call, absl::string_view object = "");

// For calls that return -1 (or NULL) and set errno: reads errno now.
absl::Status CheckErrno(bool failed, absl::string_view call, absl::string_view object = "");

// "qpn=0x1a2", "dev=mlx5_0": object names for messages.
std::string QpName(unsigned qpn);

}  // namespace grpc_rdma

#define GRPC_RDMA_STATUS_CONCAT_INNER_(a, b) a##b
#define GRPC_RDMA_STATUS_CONCAT_(a, b) GRPC_RDMA_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define RETURN_IF_ERROR(expr)                              \
  do {                                                     \
    ::absl::Status grpc_rdma_status_ = (expr);             \
    if (!grpc_rdma_status_.ok()) return grpc_rdma_status_; \
  } while (0)

// `lhs = value of expr` (an absl::StatusOr<T>), or returns its error.
#define ASSIGN_OR_RETURN(lhs, expr)                                                  \
  auto GRPC_RDMA_STATUS_CONCAT_(grpc_rdma_or_, __LINE__) = (expr);                   \
  if (!GRPC_RDMA_STATUS_CONCAT_(grpc_rdma_or_, __LINE__).ok())                       \
    return GRPC_RDMA_STATUS_CONCAT_(grpc_rdma_or_, __LINE__).status();               \
  lhs = std::move(GRPC_RDMA_STATUS_CONCAT_(grpc_rdma_or_, __LINE__)).value()

#endif  // GRPC_RDMA_SRC_VERBS_STATUS_H_
