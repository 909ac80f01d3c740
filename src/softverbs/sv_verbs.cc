// The exported libibverbs API: devices, contexts, PDs, MRs, QPs, queries and
// the string helpers. Calls that softverbs does not emulate (SRQ, UD address
// handles, multicast, memory import) fail cleanly with EOPNOTSUPP.
#include <fcntl.h>
#include <linux/capability.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "sv_internal.h"

#undef ibv_get_device_list
#undef ibv_query_port
#undef ibv_reg_mr
#undef ibv_reg_mr_iova

using namespace softverbs;

namespace {

Runtime& Rt() { return Runtime::Get(); }

Device* DevOf(ibv_context* c) { return ToCtx(c)->device; }

int PostSrqRecv(ibv_srq*, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  if (bad) *bad = wr;
  return EOPNOTSUPP;
}

void FillDeviceAttr(Device* d, ibv_device_attr* a) {
  const Config& c = GetConfig();
  memset(a, 0, sizeof(*a));
  snprintf(a->fw_ver, sizeof(a->fw_ver), "softverbs-0.1");
  a->node_guid = d->guid;
  a->sys_image_guid = d->guid;
  a->max_mr_size = 1ULL << 40;
  a->page_size_cap = 0xfffff000;
  // No IEEE OUI of its own: the value software devices report (rxe does),
  // never a hardware vendor's, so tools take their generic paths; 0 reads
  // as "no device" to some (rdma-core's device test).
  a->vendor_id = 0xffffff;
  a->vendor_part_id = 0;
  a->hw_ver = 1;
  a->max_qp = 65536;
  a->max_qp_wr = c.max_qp_wr;
  a->device_cap_flags = IBV_DEVICE_RC_RNR_NAK_GEN | IBV_DEVICE_PORT_ACTIVE_EVENT;
  a->max_sge = c.max_sge;
  a->max_sge_rd = c.max_sge;
  a->max_cq = 65536;
  a->max_cqe = c.max_cqe;
  a->max_mr = 1 << 20;
  a->max_pd = 1 << 16;
  a->max_qp_rd_atom = 16;
  a->max_qp_init_rd_atom = 16;
  a->max_res_rd_atom = 16 * 65536;
  a->atomic_cap = IBV_ATOMIC_NONE;
  a->max_pkeys = 1;
  a->local_ca_ack_delay = 15;
  a->phys_port_cnt = 1;
}

void FillPortAttr(Device* d, ibv_port_attr* p) {
  memset(p, 0, sizeof(*p));
  p->state = IBV_PORT_ACTIVE;
  p->max_mtu = IBV_MTU_4096;
  p->active_mtu = IBV_MTU_4096;
  p->gid_tbl_len = 1;
  p->port_cap_flags = 0;
  p->max_msg_sz = 0x80000000u;
  p->pkey_tbl_len = 1;
  p->lid = d->lid;
  p->sm_lid = 1;
  p->max_vl_num = 1;
  p->active_width = 2;   // 4X
  p->active_speed = 32;  // EDR
  p->phys_state = 5;     // LinkUp
  p->link_layer = IBV_LINK_LAYER_INFINIBAND;
}

int QueryPortOp(ibv_context* ctx, uint8_t port, ibv_port_attr* attr, size_t len) {
  if (port != 1) return EINVAL;
  ibv_port_attr full;
  FillPortAttr(DevOf(ctx), &full);
  memcpy(attr, &full, std::min(len, sizeof(full)));
  return 0;
}

// ibv_advise_mr: prefetching pages of on-demand paging MRs faults them in
// now (for writing with PREFETCH_WRITE); NO_FAULT is a hint only. Each
// range must lie in an MR of the PD, as the kernel checks.
int AdviseMrOp(ibv_pd* pd, ibv_advise_mr_advice advice, uint32_t flags, ibv_sge* sg_list,
               uint32_t num_sge) {
  if (advice != IBV_ADVISE_MR_ADVICE_PREFETCH && advice != IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE &&
      advice != IBV_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT)
    return EOPNOTSUPP;
  if ((flags & ~static_cast<uint32_t>(IBV_ADVISE_MR_FLAG_FLUSH)) != 0 || num_sge == 0 ||
      sg_list == nullptr)
    return EINVAL;
  for (uint32_t i = 0; i < num_sge; ++i) {
    {
      std::lock_guard<std::mutex> g(Rt().mu);
      auto it = Rt().mrs.find(sg_list[i].lkey);
      if (it == Rt().mrs.end() || it->second->mr.pd != pd) return EINVAL;
      Mr* mr = it->second;
      uint64_t base = reinterpret_cast<uint64_t>(mr->mr.addr);
      if (!mr->implicit && (sg_list[i].addr < base || sg_list[i].addr - base > mr->mr.length ||
                            sg_list[i].length > mr->mr.length - (sg_list[i].addr - base)))
        return EINVAL;
      if (!mr->odp) continue;  // pinned already
    }
    if (advice == IBV_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT) continue;
    unsigned rights = advice == IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE ? IBV_ACCESS_LOCAL_WRITE : 0;
    if (FaultInPages(reinterpret_cast<void*>(sg_list[i].addr), sg_list[i].length, rights) != 0)
      return EFAULT;
  }
  return 0;
}

int QueryDeviceExOp(ibv_context* ctx, const ibv_query_device_ex_input*,
                    ibv_device_attr_ex* attr, size_t len) {
  ibv_device_attr_ex full;
  memset(&full, 0, sizeof(full));
  FillDeviceAttr(DevOf(ctx), &full.orig_attr);
  full.phys_port_cnt_ex = full.orig_attr.phys_port_cnt;
  full.max_dm_size = 0;
  if (GetConfig().odp) {
    // On-demand paging for local access, implicit included (as mlx5):
    // a WR's own memory is faulted in when it is used, nothing is pinned.
    full.odp_caps.general_caps = IBV_ODP_SUPPORT | IBV_ODP_SUPPORT_IMPLICIT;
    full.odp_caps.per_transport_caps.rc_odp_caps =
        IBV_ODP_SUPPORT_SEND | IBV_ODP_SUPPORT_RECV | IBV_ODP_SUPPORT_WRITE |
        IBV_ODP_SUPPORT_READ;
  }
  memcpy(attr, &full, std::min(len, sizeof(full)));
  return 0;
}

// ibv_create_qp_ex with more than a PD: creation flags none of which is
// set are what ibv_create_qp does; send_ops_flags for sends, RDMA writes
// and reads on an RC QP give it the extended post API (sv_qp.cc); anything
// else (atomics, memory windows, XRC, TSO, RSS, a creation flag) is not
// emulated, and says so as rdma-core does (EOPNOTSUPP).
ibv_qp* CreateQpExOp(ibv_context* ctx, ibv_qp_init_attr_ex* ex) {
  constexpr uint32_t kKnown =
      IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_CREATE_FLAGS | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
  if (!(ex->comp_mask & IBV_QP_INIT_ATTR_PD) || ex->pd == nullptr || ex->pd->context != ctx) {
    errno = EINVAL;
    return nullptr;
  }
  if ((ex->comp_mask & ~kKnown) != 0 ||
      ((ex->comp_mask & IBV_QP_INIT_ATTR_CREATE_FLAGS) && ex->create_flags != 0) ||
      ((ex->comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS) &&
       ((ex->send_ops_flags & ~kQpExSendOps) != 0 || ex->qp_type != IBV_QPT_RC))) {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  ibv_qp_init_attr a = PlainQpAttr(*ex);
  ibv_qp* qp = ibv_create_qp(ex->pd, &a);
  if (qp == nullptr) return nullptr;
  ex->cap = a.cap;
  if (ex->comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS) EnableQpEx(ToQp(qp));
  return qp;
}

}  // namespace

namespace softverbs {

#ifndef MADV_POPULATE_READ  // Linux 5.14; older headers lack them
#define MADV_POPULATE_READ 22
#define MADV_POPULATE_WRITE 23
#endif

// Whether this kernel has MADV_POPULATE_* (5.14 and later), tried once on
// a page of our own.
static bool PopulateWorks() {
  static const bool works = [] {
    static char probe[1];
    const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    void* at = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(probe) & ~(page - 1));
    return madvise(at, page, MADV_POPULATE_READ) == 0;
  }();
  return works;
}

// As the kernel's ib_umem_get pins them: every page of the range is faulted
// in now (for writing when the MR may be written, which also breaks
// copy-on-write sharing), so registering costs here what the page faults
// cost, and a range that is not mapped, or not writable when it must be,
// fails with EFAULT as it does on hardware. Runs without Runtime::mu: a
// large range takes milliseconds. 0 or an errno.
int FaultInPages(void* addr, size_t length, unsigned access) {
  if (length == 0) return 0;
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  uintptr_t a = reinterpret_cast<uintptr_t>(addr);
  uintptr_t start = a & ~(page - 1);
  uintptr_t end = (a + length + page - 1) & ~(page - 1);
  if (end < a) return EINVAL;  // the range wraps
  constexpr unsigned kWritable = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                 IBV_ACCESS_REMOTE_ATOMIC | IBV_ACCESS_MW_BIND;
  int advice = (access & kWritable) ? MADV_POPULATE_WRITE : MADV_POPULATE_READ;
  while (madvise(reinterpret_cast<void*>(start), end - start, advice) != 0) {
    if (errno == EINTR || errno == EAGAIN) continue;
    // ENOMEM: not mapped; EFAULT: an access that would fault (PROT_NONE);
    // EINVAL: a mapping the rights do not allow (read-only memory for a
    // writable MR) or that cannot be faulted in (VM_PFNMAP, VM_IO), which
    // the kernel's pinning refuses too; but also a kernel before 5.14,
    // which has no populate: then registration goes without.
    if (errno == EINVAL && !PopulateWorks()) return 0;
    if (errno == EINVAL || errno == EHWPOISON || errno == EFAULT || errno == ENOMEM)
      return EFAULT;
    return errno;
  }
  return 0;
}

}  // namespace softverbs

extern "C" {

__attribute__((noreturn)) void softverbs_trap(const char* name) {
  fprintf(stderr,
          "softverbs: %s is not implemented by softverbs (called from an application "
          "that needs it)\n",
          name);
  abort();
}

// ------------------------------------------------------------- devices ---

ibv_device** ibv_get_device_list(int* num) {
  auto& rt = Rt();
  if (rt.devices.empty()) {
    if (num) *num = 0;
    errno = ENODEV;
    auto** empty = static_cast<ibv_device**>(calloc(1, sizeof(ibv_device*)));
    return empty;
  }
  auto** list = static_cast<ibv_device**>(calloc(rt.devices.size() + 1, sizeof(ibv_device*)));
  for (size_t i = 0; i < rt.devices.size(); ++i) list[i] = &rt.devices[i]->dev;
  if (num) *num = static_cast<int>(rt.devices.size());
  return list;
}

void ibv_free_device_list(ibv_device** list) { free(list); }

const char* ibv_get_device_name(ibv_device* device) { return device->name; }

__be64 ibv_get_device_guid(ibv_device* device) {
  return reinterpret_cast<Device*>(device)->guid;
}

int ibv_get_device_index(ibv_device* device) { return reinterpret_cast<Device*>(device)->index; }

ibv_context* ibv_open_device(ibv_device* device) {
  auto* c = new Context();
  memset(&c->vctx, 0, sizeof(c->vctx));
  c->device = reinterpret_cast<Device*>(device);
  if (pipe2(c->async_pipe, O_CLOEXEC) != 0) {
    delete c;
    return nullptr;
  }
  // Events are raised from the agent and must never block it: a program
  // that never reads them loses the ones past the pipe's capacity.
  fcntl(c->async_pipe[1], F_SETFL, O_NONBLOCK);
  c->vctx.sz = sizeof(verbs_context);
  c->vctx.query_port = QueryPortOp;
  c->vctx.query_device_ex = QueryDeviceExOp;
  c->vctx.advise_mr = AdviseMrOp;
  c->vctx.create_qp_ex = CreateQpExOp;
  c->vctx.create_cq_ex = CreateCqExOp;
  ibv_context& ctx = c->vctx.context;
  ctx.device = device;
  // A descriptor, as the uverbs device's is on hardware (programs dup it to
  // share the context: ibv_import_device, which says EOPNOTSUPP here).
  ctx.cmd_fd = open("/dev/null", O_RDWR | O_CLOEXEC);
  ctx.async_fd = c->async_pipe[0];
  ctx.num_comp_vectors = 1;
  pthread_mutex_init(&ctx.mutex, nullptr);
  ctx.abi_compat = __VERBS_ABI_IS_EXTENDED;
  ctx.ops.poll_cq = PollCq;
  ctx.ops.req_notify_cq = ReqNotifyCq;
  ctx.ops.post_send = PostSend;
  ctx.ops.post_recv = PostRecv;
  ctx.ops.post_srq_recv = PostSrqRecv;
  return &ctx;
}

int ibv_close_device(ibv_context* context) {
  Context* c = ToCtx(context);
  close(c->async_pipe[0]);
  close(c->async_pipe[1]);
  if (context->cmd_fd >= 0) close(context->cmd_fd);
  pthread_mutex_destroy(&context->mutex);
  delete c;
  return 0;
}

int ibv_get_async_event(ibv_context* context, ibv_async_event* event) {
  ibv_async_event ev;
  if (read(context->async_fd, &ev, sizeof(ev)) != static_cast<ssize_t>(sizeof(ev))) return -1;
  *event = ev;
  return 0;
}

void ibv_ack_async_event(ibv_async_event*) {}

int ibv_query_device(ibv_context* context, ibv_device_attr* attr) {
  FillDeviceAttr(DevOf(context), attr);
  return 0;
}

// The exported symbol takes the pre-v30 port struct (everything before
// port_cap_flags2); binaries built with old headers call it directly.
int ibv_query_port(ibv_context* context, uint8_t port, _compat_ibv_port_attr* attr) {
  return QueryPortOp(context, port, reinterpret_cast<ibv_port_attr*>(attr),
                     offsetof(ibv_port_attr, port_cap_flags2));
}

int ibv_query_gid(ibv_context* context, uint8_t port, int index, ibv_gid* gid) {
  if (port != 1 || index != 0) return -1;
  *gid = DevOf(context)->gid;
  return 0;
}

int _ibv_query_gid_ex(ibv_context* context, uint32_t port, uint32_t index,
                      ibv_gid_entry* entry, uint32_t flags, size_t size) {
  if (port != 1 || index != 0 || flags != 0 || size < sizeof(ibv_gid_entry)) return EINVAL;
  memset(entry, 0, sizeof(*entry));
  entry->gid = DevOf(context)->gid;
  entry->gid_index = 0;
  entry->port_num = 1;
  entry->gid_type = IBV_GID_TYPE_IB;
  entry->ndev_ifindex = 0;
  return 0;
}

// The whole table (one GID here) or EINVAL when it does not fit, as
// libibverbs does: never a partial table.
ssize_t _ibv_query_gid_table(ibv_context* context, ibv_gid_entry* entries, size_t max,
                             uint32_t flags, size_t size) {
  if (max < 1) return -EINVAL;
  int r = _ibv_query_gid_ex(context, 1, 0, entries, flags, size);
  return r == 0 ? 1 : -r;
}

int ibv_query_gid_type(ibv_context*, uint8_t, unsigned int, int* type) {
  *type = 0;  // IB/RoCE v1 in sysfs terms
  return 0;
}

int ibv_read_sysfs_file(const char*, const char*, char*, size_t) {
  errno = ENOENT;
  return -1;
}

int ibv_query_pkey(ibv_context*, uint8_t port, int index, __be16* pkey) {
  if (port != 1 || index != 0) return -1;
  *pkey = htobe16(0xffff);
  return 0;
}

int ibv_get_pkey_index(ibv_context*, uint8_t port, __be16 pkey) {
  return (port == 1 && pkey == htobe16(0xffff)) ? 0 : -1;
}

// ------------------------------------------------------------ PD and MR ---

ibv_pd* ibv_alloc_pd(ibv_context* context) {
  auto* pd = new Pd();
  pd->pd.context = context;
  static std::atomic<uint32_t> handle{1};
  pd->pd.handle = handle.fetch_add(1);
  return &pd->pd;
}

int ibv_dealloc_pd(ibv_pd* ibpd) {
  std::lock_guard<std::mutex> g(Rt().mu);
  for (auto& [k, mr] : Rt().mrs)
    if (mr->mr.pd == ibpd) return EBUSY;
  for (auto& [n, qp] : Rt().qps)
    if (qp->qp.pd == ibpd) return EBUSY;
  delete ToPd(ibpd);
  return 0;
}

// The pages [addr, addr + length) span, in bytes.
uint64_t PagesSpanned(const void* addr, size_t length) {
  if (length == 0) return 0;
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  uint64_t a = reinterpret_cast<uint64_t>(addr);
  return ((a + length + page - 1) / page - a / page) * page;
}

// As the kernel's ib_umem_get: pinned pages count against RLIMIT_MEMLOCK
// unless the process may lock memory without limit (CAP_IPC_LOCK), and
// going over is ENOMEM. Caller holds Rt().mu.
bool MayPinLocked(uint64_t more) {
  __user_cap_header_struct h{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct d[2]{};
  if (syscall(SYS_capget, &h, d) == 0 && (d[CAP_IPC_LOCK / 32].effective &
                                          (1u << (CAP_IPC_LOCK % 32))))
    return true;
  rlimit r{};
  if (getrlimit(RLIMIT_MEMLOCK, &r) != 0 || r.rlim_cur == RLIM_INFINITY) return true;
  return Rt().pinned_bytes + more <= r.rlim_cur;
}

// A new MR of `pd` in the table, its keys given out. Caller holds Rt().mu.
static Mr* NewMrLocked(ibv_pd* pd, void* addr, size_t length, unsigned access) {
  auto* mr = new Mr();
  mr->access = static_cast<int>(access);
  uint32_t key = Rt().AllocKey();
  mr->mr.context = pd->context;
  mr->mr.pd = pd;
  mr->mr.addr = addr;
  mr->mr.length = length;
  mr->mr.handle = key;
  mr->mr.lkey = key;
  mr->mr.rkey = key;
  Rt().mrs[key] = mr;
  return mr;
}

ibv_mr* ibv_reg_mr_iova2(ibv_pd* pd, void* addr, size_t length, uint64_t iova,
                         unsigned int access) {
  // MW_BIND is accepted as the kernel does; a device without memory
  // windows (this one) fails later, at ibv_alloc_mw, with EOPNOTSUPP.
  constexpr unsigned kKnown = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                              IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC |
                              IBV_ACCESS_MW_BIND | IBV_ACCESS_RELAXED_ORDERING |
                              IBV_ACCESS_ON_DEMAND;
  constexpr unsigned kRemote =
      IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
  const bool odp = (access & IBV_ACCESS_ON_DEMAND) != 0;
  // Implicit on-demand paging: the whole address space, at address 0.
  const bool implicit = odp && addr == nullptr && length == SIZE_MAX;
  if ((access & ~kKnown) != 0 ||
      ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) &&
       !(access & IBV_ACCESS_LOCAL_WRITE)) ||
      (addr == nullptr && length != 0 && !implicit) || iova != reinterpret_cast<uint64_t>(addr)) {
    errno = EINVAL;
    return nullptr;
  }
  // On-demand paging (SOFTVERBS_ODP, on by default). An implicit MR takes
  // no remote rights (its rkey would open the whole address space).
  if (odp && (!GetConfig().odp || (implicit && (access & kRemote) != 0))) {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  if (odp) {
    std::lock_guard<std::mutex> g(Rt().mu);
    Mr* mr = NewMrLocked(pd, addr, length, access);
    mr->odp = true;
    mr->implicit = implicit;
    {
      std::unique_lock<std::shared_mutex> w(Rt().odp_mu);
      Rt().odp_ranges[mr->mr.lkey] = {pd, reinterpret_cast<uint64_t>(addr), length, implicit,
                                      access};
    }
    Rt().odp_count.fetch_add(1, std::memory_order_release);
    return &mr->mr;
  }
  if (int err = FaultInPages(addr, length, access)) {
    errno = err;
    return nullptr;
  }
  std::lock_guard<std::mutex> g(Rt().mu);
  uint64_t pinned = PagesSpanned(addr, length);
  if (!MayPinLocked(pinned)) {
    errno = ENOMEM;
    return nullptr;
  }
  Mr* mr = NewMrLocked(pd, addr, length, access);
  mr->pinned = pinned;
  Rt().pinned_bytes += pinned;
  if (MrFindShareLocked(mr)) MrSyncSharesLocked(mr);
  return &mr->mr;
}

ibv_mr* ibv_reg_mr(ibv_pd* pd, void* addr, size_t length, int access) {
  return ibv_reg_mr_iova2(pd, addr, length, reinterpret_cast<uint64_t>(addr),
                          static_cast<unsigned>(access));
}

ibv_mr* ibv_reg_mr_iova(ibv_pd* pd, void* addr, size_t length, uint64_t iova, int access) {
  return ibv_reg_mr_iova2(pd, addr, length, iova, static_cast<unsigned>(access));
}

ibv_mr* ibv_reg_dmabuf_mr(ibv_pd*, uint64_t, size_t, uint64_t, int, int) {
  errno = EOPNOTSUPP;
  return nullptr;
}

// rdma-core's convention: 0, or an ibv_rereg_mr_err_code with errno set.
// The keys stay; what a flag names changes, checked as ibv_reg_mr checks it.
int ibv_rereg_mr(ibv_mr* ibmr, int flags, ibv_pd* pd, void* addr, size_t length, int access) {
  constexpr int kFlags =
      IBV_REREG_MR_CHANGE_TRANSLATION | IBV_REREG_MR_CHANGE_PD | IBV_REREG_MR_CHANGE_ACCESS;
  if (ibmr == nullptr || flags == 0 || (flags & ~kFlags) != 0 ||
      ((flags & IBV_REREG_MR_CHANGE_TRANSLATION) && (addr == nullptr || length == 0)) ||
      ((flags & IBV_REREG_MR_CHANGE_PD) && pd == nullptr) ||
      (access != 0 && !(flags & IBV_REREG_MR_CHANGE_ACCESS))) {
    errno = EINVAL;
    return IBV_REREG_MR_ERR_INPUT;
  }
  {
    std::lock_guard<std::mutex> g(Rt().mu);
    if (ToMr(ibmr)->odp) {  // not emulated for on-demand paging MRs
      errno = EOPNOTSUPP;
      return IBV_REREG_MR_ERR_INPUT;
    }
  }
  if (flags & IBV_REREG_MR_CHANGE_TRANSLATION) {
    // The new range is pinned before the old one is let go, as the kernel
    // does; the rights it is pinned for are the new ones if they change.
    unsigned rights = static_cast<unsigned>(access);
    if (!(flags & IBV_REREG_MR_CHANGE_ACCESS)) {
      std::lock_guard<std::mutex> g(Rt().mu);
      rights = static_cast<unsigned>(ToMr(ibmr)->access);
    }
    if (int err = FaultInPages(addr, length, rights)) {
      errno = err;
      return IBV_REREG_MR_ERR_CMD;
    }
  }
  std::lock_guard<std::mutex> g(Rt().mu);
  Mr* mr = ToMr(ibmr);
  if (flags & IBV_REREG_MR_CHANGE_ACCESS) {
    constexpr unsigned kKnown = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC |
                                IBV_ACCESS_MW_BIND | IBV_ACCESS_RELAXED_ORDERING;
    unsigned a = static_cast<unsigned>(access);
    if ((a & ~kKnown) != 0 ||
        ((a & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) &&
         !(a & IBV_ACCESS_LOCAL_WRITE))) {
      errno = EINVAL;
      return IBV_REREG_MR_ERR_INPUT;
    }
  }
  if (flags & IBV_REREG_MR_CHANGE_TRANSLATION) {  // the last check: nothing changed yet
    uint64_t pinned = PagesSpanned(addr, length);
    Rt().pinned_bytes -= mr->pinned;
    if (!MayPinLocked(pinned)) {
      Rt().pinned_bytes += mr->pinned;
      errno = ENOMEM;
      return IBV_REREG_MR_ERR_CMD;
    }
    Rt().pinned_bytes += pinned;
    mr->pinned = pinned;
    // Peers placing WRITEs into the old pages stop before any WRITE
    // posted from now on (sv_onecopy.cc).
    MrSyncSharesLocked(mr, /*gone=*/true);
    MrDropShareLocked(mr);
    mr->mr.addr = addr;
    mr->mr.length = length;
    MrFindShareLocked(mr);
  }
  if (flags & IBV_REREG_MR_CHANGE_ACCESS) mr->access = access;
  if (flags & IBV_REREG_MR_CHANGE_PD) {
    MrSyncSharesLocked(mr, /*gone=*/true);
    mr->mr.pd = pd;
  }
  MrSyncSharesLocked(mr);
  return 0;
}

int ibv_dereg_mr(ibv_mr* ibmr) {
  std::lock_guard<std::mutex> g(Rt().mu);
  MrSyncSharesLocked(ToMr(ibmr), /*gone=*/true);
  MrDropShareLocked(ToMr(ibmr));
  Rt().mrs.erase(ibmr->lkey);
  if (ToMr(ibmr)->odp) {
    std::unique_lock<std::shared_mutex> w(Rt().odp_mu);
    Rt().odp_ranges.erase(ibmr->lkey);
    Rt().odp_count.fetch_sub(1, std::memory_order_relaxed);
  }
  Rt().pinned_bytes -= ToMr(ibmr)->pinned;
  delete ToMr(ibmr);
  return 0;
}

// ------------------------------------------------------------------ QPs ---

ibv_qp* ibv_create_qp(ibv_pd* pd, ibv_qp_init_attr* attr) {
  const Config& c = GetConfig();
  if (attr->qp_type != IBV_QPT_RC) {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  if (attr->srq != nullptr) {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  ibv_qp_cap& cap = attr->cap;
  if (attr->send_cq == nullptr || attr->recv_cq == nullptr ||
      cap.max_send_wr > static_cast<uint32_t>(c.max_qp_wr) ||
      cap.max_recv_wr > static_cast<uint32_t>(c.max_qp_wr) ||
      cap.max_send_sge > static_cast<uint32_t>(c.max_sge) ||
      cap.max_recv_sge > static_cast<uint32_t>(c.max_sge) ||
      cap.max_inline_data > static_cast<uint32_t>(c.max_inline)) {
    errno = EINVAL;
    return nullptr;
  }
  auto* qp = new Qp();
  qp->ctx = ToCtx(pd->context);
  qp->device = qp->ctx->device;
  qp->pd = ToPd(pd);
  qp->scq = ToCq(attr->send_cq);
  qp->rcq = ToCq(attr->recv_cq);
  qp->cap = cap;
  if (qp->cap.max_send_wr == 0) qp->cap.max_send_wr = 1;
  if (qp->cap.max_send_sge == 0) qp->cap.max_send_sge = 1;
  if (qp->cap.max_recv_sge == 0) qp->cap.max_recv_sge = 1;
  qp->sq_sig_all = attr->sq_sig_all != 0;
  ibv_qp& q = qp->qp;
  q.context = pd->context;
  q.qp_context = attr->qp_context;
  q.pd = pd;
  q.send_cq = attr->send_cq;
  q.recv_cq = attr->recv_cq;
  q.qp_type = IBV_QPT_RC;
  q.state = IBV_QPS_RESET;
  pthread_mutex_init(&q.mutex, nullptr);
  pthread_cond_init(&q.cond, nullptr);
  std::lock_guard<std::mutex> g(Rt().mu);
  q.qp_num = Rt().AllocQpn(qp->device);
  if (q.qp_num == 0) {
    delete qp;
    errno = ENOMEM;
    return nullptr;
  }
  q.handle = q.qp_num;
  qp->serial = ++Rt().qp_serials;
  Rt().qps[q.qp_num] = qp;
  qp->scq->qps.push_back(qp);
  if (qp->rcq != qp->scq) qp->rcq->qps.push_back(qp);
  cap = qp->cap;
  return &qp->qp;
}

int ibv_modify_qp(ibv_qp* ibqp, ibv_qp_attr* attr, int mask) {
  std::lock_guard<std::mutex> g(Rt().mu);
  return ModifyQpLocked(ToQp(ibqp), attr, mask);
}

int ibv_query_qp(ibv_qp* ibqp, ibv_qp_attr* attr, int, ibv_qp_init_attr* init) {
  Qp* qp = ToQp(ibqp);
  std::lock_guard<std::mutex> g(Rt().mu);
  memset(attr, 0, sizeof(*attr));
  attr->qp_state = qp->qp.state;
  attr->cur_qp_state = qp->qp.state;
  attr->path_mtu = qp->path_mtu;
  attr->qp_access_flags = qp->access;
  attr->pkey_index = qp->pkey_index;
  attr->port_num = qp->port;
  attr->dest_qp_num = qp->dest_qpn;
  attr->ah_attr = qp->ah;
  attr->sq_psn = qp->sq_psn;
  attr->rq_psn = qp->rq_psn;
  attr->timeout = qp->timeout;
  attr->retry_cnt = qp->retry_cnt;
  attr->rnr_retry = qp->rnr_retry;
  attr->min_rnr_timer = qp->min_rnr_timer;
  attr->max_rd_atomic = qp->max_rd_atomic;
  attr->max_dest_rd_atomic = qp->max_dest_rd_atomic;
  attr->cap = qp->cap;
  if (init != nullptr) {
    memset(init, 0, sizeof(*init));
    init->qp_context = qp->qp.qp_context;
    init->send_cq = qp->qp.send_cq;
    init->recv_cq = qp->qp.recv_cq;
    init->cap = qp->cap;
    init->qp_type = IBV_QPT_RC;
    init->sq_sig_all = qp->sq_sig_all;
  }
  return 0;
}

int ibv_destroy_qp(ibv_qp* ibqp) {
  Qp* qp = ToQp(ibqp);
  {
    std::lock_guard<std::mutex> g(Rt().mu);
    Rt().qps.erase(qp->qp.qp_num);
    Rt().ReleaseQpn(qp->device, qp->qp.qp_num);
    for (Cq* cq : {qp->scq, qp->rcq}) {
      auto& v = cq->qps;
      v.erase(std::remove(v.begin(), v.end(), qp), v.end());
    }
    if (Link* l = qp->link) {
      l->qp = nullptr;
      qp->link = nullptr;
      // Tell the peer now, as a real HCA's peer would learn on its next send.
      LinkPump(l);
      LinkKill(l);
    }
  }
  pthread_mutex_destroy(&qp->qp.mutex);
  pthread_cond_destroy(&qp->qp.cond);
  delete qp;
  return 0;
}

int ibv_query_qp_data_in_order(ibv_qp*, ibv_wr_opcode, uint32_t) { return 1; }

// The extended post API of a QP made with send_ops_flags (ibv_create_qp_ex),
// NULL for any other, as libibverbs does.
ibv_qp_ex* ibv_qp_to_qp_ex(ibv_qp* qp) {
  if (qp == nullptr || !ToQp(qp)->ex) return nullptr;
  return &ToQp(qp)->qpx;
}

int ibv_query_ece(ibv_qp*, ibv_ece*) { return EOPNOTSUPP; }
int ibv_set_ece(ibv_qp*, ibv_ece*) { return EOPNOTSUPP; }

// ------------------------------------------------- not emulated: refuse ---

ibv_srq* ibv_create_srq(ibv_pd*, ibv_srq_init_attr*) {
  errno = EOPNOTSUPP;
  return nullptr;
}
int ibv_modify_srq(ibv_srq*, ibv_srq_attr*, int) { return EOPNOTSUPP; }
int ibv_query_srq(ibv_srq*, ibv_srq_attr*) { return EOPNOTSUPP; }
int ibv_destroy_srq(ibv_srq*) { return EOPNOTSUPP; }
ibv_ah* ibv_create_ah(ibv_pd*, ibv_ah_attr*) {
  errno = EOPNOTSUPP;
  return nullptr;
}
ibv_ah* ibv_create_ah_from_wc(ibv_pd*, ibv_wc*, ibv_grh*, uint8_t) {
  errno = EOPNOTSUPP;
  return nullptr;
}
int ibv_init_ah_from_wc(ibv_context*, uint8_t, ibv_wc*, ibv_grh*, ibv_ah_attr*) {
  return EOPNOTSUPP;
}
int ibv_destroy_ah(ibv_ah*) { return EOPNOTSUPP; }
int ibv_attach_mcast(ibv_qp*, const ibv_gid*, uint16_t) { return EOPNOTSUPP; }
int ibv_detach_mcast(ibv_qp*, const ibv_gid*, uint16_t) { return EOPNOTSUPP; }
int ibv_resolve_eth_l2_from_gid(ibv_context*, ibv_ah_attr*, uint8_t[6], uint16_t*) {
  return EOPNOTSUPP;
}
ibv_context* ibv_import_device(int) {
  errno = EOPNOTSUPP;
  return nullptr;
}
ibv_pd* ibv_import_pd(ibv_context*, uint32_t) {
  errno = EOPNOTSUPP;
  return nullptr;
}
void ibv_unimport_pd(ibv_pd*) {}
ibv_mr* ibv_import_mr(ibv_pd*, uint32_t) {
  errno = EOPNOTSUPP;
  return nullptr;
}
void ibv_unimport_mr(ibv_mr*) {}
ibv_dm* ibv_import_dm(ibv_context*, uint32_t) {
  errno = EOPNOTSUPP;
  return nullptr;
}
void ibv_unimport_dm(ibv_dm*) {}

// ---------------------------------------------------------------- fork ---

// softverbs pins nothing (registration leaves pages as they are), so a
// child never shares a registered page by accident: fork needs no care,
// which libibverbs says as IBV_FORK_UNNEEDED (as on kernels with
// copy-on-fork for pinned pages), before and after ibv_fork_init.
int ibv_fork_init(void) { return 0; }
int ibv_dontfork_range(void*, size_t) { return 0; }
int ibv_dofork_range(void*, size_t) { return 0; }
enum ibv_fork_status ibv_is_fork_initialized(void) { return IBV_FORK_UNNEEDED; }

// ------------------------------------------------------------- strings ---

const char* ibv_node_type_str(enum ibv_node_type t) {
  switch (t) {
    case IBV_NODE_CA: return "InfiniBand channel adapter";
    case IBV_NODE_SWITCH: return "InfiniBand switch";
    case IBV_NODE_ROUTER: return "InfiniBand router";
    case IBV_NODE_RNIC: return "iWARP NIC";
    case IBV_NODE_USNIC: return "usNIC";
    case IBV_NODE_USNIC_UDP: return "usNIC UDP";
    case IBV_NODE_UNSPECIFIED: return "unspecified";
    default: return "unknown";
  }
}

const char* ibv_port_state_str(enum ibv_port_state s) {
  static const char* kNames[] = {"PORT_NOP", "PORT_DOWN", "PORT_INIT", "PORT_ARMED",
                                 "PORT_ACTIVE", "PORT_ACTIVE_DEFER"};
  return (s >= 0 && s <= 5) ? kNames[s] : "invalid state";
}

const char* ibv_event_type_str(enum ibv_event_type e) {
  static const char* kNames[] = {
      "CQ error", "local work queue catastrophic error", "invalid request local work queue error",
      "local access violation work queue error", "communication established",
      "send queue drained", "path migrated", "path migration request error",
      "local catastrophic error", "port active", "port error", "LID change",
      "P_Key change", "SM change", "SRQ catastrophic error", "SRQ limit reached",
      "last WQE reached", "client reregistration", "GID table change", "WQ fatal"};
  return (e >= 0 && e < 20) ? kNames[e] : "unknown";
}

const char* ibv_wc_status_str(enum ibv_wc_status s) {
  static const char* kNames[] = {
      "success", "local length error", "local QP operation error",
      "local EE context operation error", "local protection error", "Work Request Flushed Error",
      "memory management operation error", "bad response error", "local access error",
      "remote invalid request error", "remote access error", "remote operation error",
      "transport retry counter exceeded", "RNR retry counter exceeded",
      "local RDD violation error", "remote invalid RD request", "aborted error",
      "invalid EE context number", "invalid EE context state", "fatal error",
      "response timeout error", "general error", "TM error", "TM rendezvous pending"};
  return (s >= 0 && s < 24) ? kNames[s] : "unknown";
}

int ibv_rate_to_mult(enum ibv_rate rate) {
  static const int kMult[] = {0, 0, 1, 4, 12, 2, 6, 8, 3};
  return (rate >= 0 && rate <= 8) ? kMult[rate] : 0;
}

enum ibv_rate mult_to_ibv_rate(int mult) {
  switch (mult) {
    case 1: return IBV_RATE_2_5_GBPS;
    case 2: return IBV_RATE_5_GBPS;
    case 4: return IBV_RATE_10_GBPS;
    case 8: return IBV_RATE_20_GBPS;
    case 12: return IBV_RATE_30_GBPS;
    case 16: return IBV_RATE_40_GBPS;
    default: return IBV_RATE_MAX;
  }
}

int ibv_rate_to_mbps(enum ibv_rate rate) {
  switch (rate) {
    case IBV_RATE_2_5_GBPS: return 2500;
    case IBV_RATE_5_GBPS: return 5000;
    case IBV_RATE_10_GBPS: return 10000;
    case IBV_RATE_20_GBPS: return 20000;
    case IBV_RATE_30_GBPS: return 30000;
    case IBV_RATE_40_GBPS: return 40000;
    case IBV_RATE_56_GBPS: return 56000;
    case IBV_RATE_100_GBPS: return 100000;
    case IBV_RATE_200_GBPS: return 200000;
    default: return 0;
  }
}

enum ibv_rate mbps_to_ibv_rate(int mbps) {
  switch (mbps) {
    case 2500: return IBV_RATE_2_5_GBPS;
    case 5000: return IBV_RATE_5_GBPS;
    case 10000: return IBV_RATE_10_GBPS;
    case 20000: return IBV_RATE_20_GBPS;
    case 40000: return IBV_RATE_40_GBPS;
    case 56000: return IBV_RATE_56_GBPS;
    case 100000: return IBV_RATE_100_GBPS;
    case 200000: return IBV_RATE_200_GBPS;
    default: return IBV_RATE_MAX;
  }
}

const char* ibv_get_sysfs_path(void) { return "/sys"; }

}  // extern "C"
