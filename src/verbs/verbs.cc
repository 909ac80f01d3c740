#include "verbs/verbs.h"

#include <fcntl.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

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
  std::string what = absl::StrCat("lkey=", p->lkey);  // before: dereg frees *p
  LogRelease(CheckRet(ibv_dereg_mr(p), "ibv_dereg_mr", what));
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

absl::StatusOr<EventChannel> CreateEventChannel(bool nonblocking) {
  rdma_event_channel* ch = rdma_create_event_channel();
  if (absl::Status s = CheckErrno(ch == nullptr, "rdma_create_event_channel"); !s.ok()) return s;
  EventChannel owned(ch);
  if (nonblocking) {
    int fl = fcntl(ch->fd, F_GETFL);
    if (absl::Status s = CheckErrno(fl < 0 || fcntl(ch->fd, F_SETFL, fl | O_NONBLOCK) != 0,
                                    "fcntl(O_NONBLOCK) on the RDMA CM event channel");
        !s.ok())
      return s;
  }
  return owned;
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

bool ImplicitOdpWrites(ibv_context* ctx) {
  ibv_device_attr_ex attr{};
  if (ibv_query_device_ex(ctx, nullptr, &attr) != 0) return false;
  const uint64_t general = attr.odp_caps.general_caps;
  return (general & IBV_ODP_SUPPORT) && (general & IBV_ODP_SUPPORT_IMPLICIT) &&
         (attr.odp_caps.per_transport_caps.rc_odp_caps & IBV_ODP_SUPPORT_WRITE);
}

absl::StatusOr<Mr> RegImplicitOdp(ibv_pd* pd) {
  ibv_mr* mr = ibv_reg_mr(pd, nullptr, SIZE_MAX, IBV_ACCESS_ON_DEMAND);
  if (absl::Status s = CheckErrno(mr == nullptr, "ibv_reg_mr(implicit on-demand paging)");
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

namespace {

// Why `name` cannot serve TF_RDMA_PORT / TF_RDMA_GID_INDEX, or "" if it can.
std::string PortAndGidProblem(ibv_device* dev, const Options& o) {
  const char* name = ibv_get_device_name(dev);
  ibv_context* ctx = ibv_open_device(dev);
  if (ctx == nullptr) return absl::StrCat(name, ": cannot be opened (", strerror(errno), ")");
  std::string why;
  ibv_device_attr da{};
  if (ibv_query_device(ctx, &da) != 0) {
    why = absl::StrCat(name, ": ibv_query_device failed");
  } else if (o.port > da.phys_port_cnt) {
    why = absl::StrCat(name, " has ", static_cast<int>(da.phys_port_cnt),
                       da.phys_port_cnt == 1 ? " port" : " ports");
  } else if (o.gid_index >= 0) {
    // On the named port, or on any port of the device.
    int first = o.port > 0 ? o.port : 1, last = o.port > 0 ? o.port : da.phys_port_cnt;
    for (int p = first; p <= last; ++p) {
      ibv_port_attr pa{};
      ibv_gid gid{};
      bool found = ibv_query_port(ctx, static_cast<uint8_t>(p), &pa) == 0 &&
                   o.gid_index < pa.gid_tbl_len &&
                   ibv_query_gid(ctx, static_cast<uint8_t>(p), o.gid_index, &gid) == 0 &&
                   (gid.global.subnet_prefix != 0 || gid.global.interface_id != 0);
      if (found) {
        why.clear();
        break;
      }
      if (why.empty()) {
        why = absl::StrCat("port ", p, " of ", name, " has no GID at index ", o.gid_index,
                           " (its table has ", pa.gid_tbl_len,
                           pa.gid_tbl_len == 1 ? " entry" : " entries", ")");
      }
    }
  }
  ibv_close_device(ctx);
  return why;
}

}  // namespace

absl::Status CheckPortAndGid(const Options& o) {
  if (o.port <= 0 && o.gid_index < 0) return absl::OkStatus();
  const std::string what = absl::StrCat(o.port > 0 ? absl::StrCat("TF_RDMA_PORT=", o.port) : "",
                                        o.port > 0 && o.gid_index >= 0 ? " " : "",
                                        o.gid_index >= 0
                                            ? absl::StrCat("TF_RDMA_GID_INDEX=", o.gid_index)
                                            : "");
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (list == nullptr || n == 0) {
    if (list != nullptr) ibv_free_device_list(list);
    return absl::UnavailableError("no RDMA device found");
  }
  std::vector<std::string> problems;
  bool ok = false;
  for (int i = 0; i < n && !ok; ++i) {
    if (o.device_explicit && o.device != ibv_get_device_name(list[i])) continue;
    std::string why = PortAndGidProblem(list[i], o);
    if (why.empty()) ok = true;
    else problems.push_back(why);
  }
  ibv_free_device_list(list);
  if (ok) return absl::OkStatus();
  return absl::NotFoundError(absl::StrCat(what, ": no such ",
                                          o.gid_index >= 0 ? "port and GID" : "port",
                                          o.device_explicit ? "" : " on any RDMA device", " (",
                                          absl::StrJoin(problems, "; "), ")"));
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
