// File: src/verbs/verbs.h
//
// Move-only owners for every rdma-core object the engine uses. Each one
// releases its object when it goes out of scope; a failure to release is
// logged, never thrown. Declare members in the order objects are created
// (event channel, CM id, PD, completion channel, CQs, MRs, QP): C++ destroys
// members in reverse, which is the order rdma-core requires (QP before its
// CQs, CQs before their channel, everything before the PD).
//
// Creation functions return absl::StatusOr; their messages name the call
// and the object (see status.h).
#ifndef GRPC_RDMA_SRC_VERBS_VERBS_H_
#define GRPC_RDMA_SRC_VERBS_VERBS_H_

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "grpc_rdma/options.h"

namespace grpc_rdma {

// A move-only owner of T*, released by Release(T*).
template <typename T, void (*Release)(T*)>
class Handle {
 public:
  Handle() = default;
  explicit Handle(T* p) : p_(p) {}
  Handle(Handle&& o) noexcept : p_(std::exchange(o.p_, nullptr)) {}
  Handle& operator=(Handle&& o) noexcept {
    if (this != &o) {
      reset();
      p_ = std::exchange(o.p_, nullptr);
    }
    return *this;
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  ~Handle() { reset(); }

  T* get() const { return p_; }
  T* operator->() const { return p_; }
  explicit operator bool() const { return p_ != nullptr; }
  void reset() {
    if (p_ != nullptr) Release(std::exchange(p_, nullptr));
  }
  // Gives up ownership (e.g. to a shared_ptr with Release as its deleter).
  T* release() { return std::exchange(p_, nullptr); }

 private:
  T* p_ = nullptr;
};

namespace internal {
void ReleaseEventChannel(rdma_event_channel* p);
void ReleaseCmId(rdma_cm_id* p);
void ReleasePd(ibv_pd* p);
void ReleaseMr(ibv_mr* p);
void ReleaseCompChannel(ibv_comp_channel* p);
void ReleaseCq(ibv_cq* p);
void ReleaseQp(ibv_qp* p);
}  // namespace internal

using EventChannel = Handle<rdma_event_channel, internal::ReleaseEventChannel>;
using CmId = Handle<rdma_cm_id, internal::ReleaseCmId>;  // its QP must be gone first
using Pd = Handle<ibv_pd, internal::ReleasePd>;
using Mr = Handle<ibv_mr, internal::ReleaseMr>;
using CompChannel = Handle<ibv_comp_channel, internal::ReleaseCompChannel>;
using Cq = Handle<ibv_cq, internal::ReleaseCq>;  // every event it reported must be acked
// A QP, made by rdma_create_qp on a CM id and released with ibv_destroy_qp
// (as librdmacm allows); id->qp is stale after that, so do not use it.
using Qp = Handle<ibv_qp, internal::ReleaseQp>;

// `nonblocking`: rdma_get_cm_event on it never blocks (-1, EAGAIN when
// nothing is queued). A reader that polls the fd first still needs it: the
// event that made the fd readable can be gone before the read, taken back
// by rdma_destroy_id of its id on another thread (the kernel's rdma_cm does
// the same), and a blocking read would then wait for the next event.
absl::StatusOr<EventChannel> CreateEventChannel(bool nonblocking = false);
// `context` is stored in id->context.
absl::StatusOr<CmId> CreateCmId(rdma_event_channel* channel, void* context);
absl::StatusOr<Pd> AllocPd(ibv_context* ctx);
absl::StatusOr<Mr> RegMr(ibv_pd* pd, void* addr, size_t length, int access);
// Whether the device takes RC RDMA writes from an implicit on-demand paging
// MR (the whole address space, nothing pinned: ConnectX, softverbs).
bool ImplicitOdpWrites(ibv_context* ctx);
// That MR, for local access only (no remote rights: the peer reaches
// nothing through it).
absl::StatusOr<Mr> RegImplicitOdp(ibv_pd* pd);
absl::StatusOr<CompChannel> CreateCompChannel(ibv_context* ctx);
absl::StatusOr<Cq> CreateCq(ibv_context* ctx, int cqe, void* cq_context,
                            ibv_comp_channel* channel);
// An RC QP for `id` in `pd` (rdma_create_qp); attr's CQs must be set.
absl::StatusOr<Qp> CreateQp(rdma_cm_id* id, ibv_pd* pd, ibv_qp_init_attr attr);

// Which RDMA device to use, following TF_RDMA_DEV_NAME's rules: the named
// device if it exists; if it does not and the name was given explicitly,
// NOT_FOUND naming what exists; if it does not and the name is only the
// default (mlx5_0), nullopt: use the device RDMA CM resolves for the
// address. No device at all is UNAVAILABLE.
absl::StatusOr<std::optional<std::string>> ChooseDevice(const Options& options);

// TF_RDMA_PORT and TF_RDMA_GID_INDEX, when set: the named device (or, with
// no device named, some device) has that port, and a GID at that index on
// it (or on any of its ports). NOT_FOUND says what each device lacks.
absl::Status CheckPortAndGid(const Options& options);

// The names ibv_get_device_list reports.
std::vector<std::string> DeviceNames();

}  // namespace grpc_rdma

#endif  // GRPC_RDMA_SRC_VERBS_VERBS_H_
