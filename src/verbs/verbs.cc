#include "verbs/verbs.h"

#include <fcntl.h>

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "verbs/log.h"
#include "verbs/status.h"

namespace grpc_rdma {
namespace internal {
namespace {

// Teardown cannot fail upward (it runs in destructors): say what happened.
void LogRelease(const absl::Status& s) {
  if (!s.ok()) GRPC_RDMA_LOG_ERROR("%s", std::string(s.message()).c_str());
}

}  // namespace

void ReleaseEventChannel(rdma_event_channel* p) { rdma_destroy_event_channel(p); }

void ReleaseCmId(rdma_cm_id* p) {
  LogRelease(CheckErrno(rdma_destroy_id(p) != 0, "rdma_destroy_id"));
}

void ReleasePd(ibv_pd* p) { LogRelease(CheckRet(ibv_dealloc_pd(p), "ibv_dealloc_pd")); }

void ReleaseMr(ibv_mr* p) {
  LogRelease(CheckRet(ibv_dereg_mr(p), "ibv_dereg_mr", absl::StrCat("lkey=", p->lkey)));
}

void ReleaseCompChannel(ibv_comp_channel* p) {
  LogRelease(CheckRet(ibv_destroy_comp_channel(p), "ibv_destroy_comp_channel"));
}

void ReleaseCq(ibv_cq* p) { LogRelease(CheckRet(ibv_destroy_cq(p), "ibv_destroy_cq")); }

void ReleaseQp(ibv_qp* p) {
  unsigned qpn = p->qp_num;
  LogRelease(CheckRet(ibv_destroy_qp(p), "ibv_destroy_qp", QpName(qpn)));
}

}  // namespace internal

absl::StatusOr<EventChannel> CreateEventChannel() {
  rdma_event_channel* ch = rdma_create_event_channel();
  if (absl::Status s = CheckErrno(ch == nullptr, "rdma_create_event_channel"); !s.ok()) return s;
  return EventChannel(ch);
}

absl::StatusOr<CmId> CreateCmId(rdma_event_channel* channel, void* context) {
  rdma_cm_id* id = nullptr;
  if (absl::Status s =
          CheckErrno(rdma_create_id(channel, &id, context, RDMA_PS_TCP) != 0, "rdma_create_id");
      !s.ok())
    return s;
  return CmId(id);
}

absl::StatusOr<Pd> AllocPd(ibv_context* ctx) {
  ibv_pd* pd = ibv_alloc_pd(ctx);
  if (absl::Status s = CheckErrno(pd == nullptr, "ibv_alloc_pd", ctx->device->name); !s.ok())
    return s;
  return Pd(pd);
}

absl::StatusOr<Mr> RegMr(ibv_pd* pd, void* addr, size_t length, int access) {
  ibv_mr* mr = ibv_reg_mr(pd, addr, length, access);
  if (absl::Status s = CheckErrno(mr == nullptr, "ibv_reg_mr", absl::StrCat("length=", length));
      !s.ok())
    return s;
  return Mr(mr);
}

absl::StatusOr<CompChannel> CreateCompChannel(ibv_context* ctx) {
  ibv_comp_channel* ch = ibv_create_comp_channel(ctx);
  if (absl::Status s = CheckErrno(ch == nullptr, "ibv_create_comp_channel", ctx->device->name);
      !s.ok())
    return s;
  // Non-blocking, as rdma-core advises for event loops: a readable channel
  // need not hold an event by the time it is read (another thread took it),
  // and ibv_get_cq_event must then fail with EAGAIN, not block.
  int flags = fcntl(ch->fd, F_GETFL);
  if (flags < 0 || fcntl(ch->fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    int e = errno;
    ibv_destroy_comp_channel(ch);
    errno = e;
    return CheckErrno(true, "fcntl(O_NONBLOCK) on a completion channel", ctx->device->name);
  }
  return CompChannel(ch);
}

absl::StatusOr<Cq> CreateCq(ibv_context* ctx, int cqe, void* cq_context,
                            ibv_comp_channel* channel) {
  ibv_cq* cq = ibv_create_cq(ctx, cqe, cq_context, channel, 0);
  if (absl::Status s = CheckErrno(cq == nullptr, "ibv_create_cq", absl::StrCat("cqe=", cqe));
      !s.ok())
    return s;
  return Cq(cq);
}

absl::StatusOr<Qp> CreateQp(rdma_cm_id* id, ibv_pd* pd, ibv_qp_init_attr attr) {
  attr.qp_type = IBV_QPT_RC;
  if (absl::Status s = CheckErrno(rdma_create_qp(id, pd, &attr) != 0, "rdma_create_qp");
      !s.ok())
    return s;
  return Qp(id->qp);
}

std::vector<std::string> DeviceNames() {
  std::vector<std::string> names;
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (list == nullptr) return names;
  for (int i = 0; i < n; ++i) names.push_back(ibv_get_device_name(list[i]));
  ibv_free_device_list(list);
  return names;
}

absl::StatusOr<std::optional<std::string>> ChooseDevice(const Options& options) {
  std::vector<std::string> names = DeviceNames();
  if (names.empty()) {
    return absl::UnavailableError(
        "no RDMA device found (ibv_get_device_list is empty): RDMA is not available here");
  }
  for (const std::string& n : names)
    if (n == options.device) return std::optional<std::string>(n);
  if (options.device_explicit) {
    return absl::NotFoundError(absl::StrCat("TF_RDMA_DEV_NAME=", options.device,
                                            ": no such RDMA device; this host has ",
                                            absl::StrJoin(names, ", ")));
  }
  return std::optional<std::string>();
}

}  // namespace grpc_rdma
