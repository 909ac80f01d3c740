// softverbs internals: the objects behind the verbs handles, the per-process
// runtime and its agent thread, and what each file offers the others (one
// section per file, named in its heading). The files:
//   sv_config.cc     SOFTVERBS_* settings, logging, traffic counters
//   sv_runtime.cc    the runtime: devices, key and QP number tables, fork
//   sv_agent.cc      the agent thread and each link's event dispatch
//   sv_handshake.cc  link handshakes and control messages, raw QP connect
//   sv_link.cc       the wires: TCP socket, shared-memory rings, doorbells
//   sv_qp.cc         the QP engine: posting, frames, ACKs, RNR, errors
//   sv_cq.cc         CQs and completion channels
//   sv_verbs.cc      the libibverbs entry points
//   sv_cm_protocol.cc, sv_cm_abi.cc  librdmacm (sv_cm_internal.h)
//
// Threading model (one rule for the whole device):
// - Runtime::mu guards every QP, link, MR table and CM object. Verbs calls
//   take it; the agent thread takes it while it moves data; ibv_poll_cq tries
//   it to make progress when its CQ is empty (progress on poll).
// - Each CQ has its own lock for its completion queue, so polling a
//   non-empty CQ never waits on data movement.
// - Nothing that can block (socket connect, sleeping) runs under Runtime::mu.
#ifndef SOFTVERBS_SV_INTERNAL_H_
#define SOFTVERBS_SV_INTERNAL_H_

#include <infiniband/verbs.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <rdma/rdma_cma.h>
#include <sys/uio.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <set>
#include <shared_mutex>
#include <unordered_map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "sv_containers.h"

namespace softverbs {

// ------------------------------------- sv_config.cc: settings, logs ---

// One soft device: an RDMA port bound to one of the host's IPv4 addresses.
struct DeviceSpec {
  std::string name;
  in_addr addr{};
  in_addr mask{};
};

// Everything softverbs reads from the environment (SOFTVERBS_*), parsed once.
struct Config {
  std::vector<DeviceSpec> devices;
  int spin_us = 20;              // agent busy-polls this long after activity
  size_t ring_bytes = 1 << 20;   // shared-memory ring per direction per QP
  bool use_shm = true;           // same host and netns: shared memory wire
  bool odp = true;               // on-demand paging MRs (IBV_ACCESS_ON_DEMAND), implicit too
  bool one_copy = true;          // WRITEs into shared-file MRs placed directly (sv_onecopy.cc)
  bool direct_wake = true;       // doorbells wake a channel's waiter (CompChannel)
  bool acceptor_doorbell = true;  // fault: false = acceptors open no doorbell socket
  int delay_us = 0;              // fault: hold every inbound frame this long
  long drop_after_ops = 0;       // fault: cut a QP's wire after N send WRs
  long fail_wr = 0;              // fault: the Nth send WR of a QP fails
  int fail_status = IBV_WC_GENERAL_ERR;
  int max_qp_wr = 16384;         // device limits (fault: shrink them)
  int max_cqe = 65536;
  int max_sge = 16;
  int max_inline = 256;
  std::string stats;             // "", "stderr" or a file to append to
  std::string device_cpu_dir;    // "" or where DIR/<pid> keeps device work on app threads
  bool trace = false;
  int cm_port_xor = 0x8000;      // RDMA CM port P listens on TCP port P^xor
  int resolve_us = 1000;         // address and route resolution take this long
  int device_removal_ms = 0;     // fault: the devices go this long after the first connection
  int addr_change_ms = 0;        // event: their address changes this long after it
  int device_return_ms = 0;      // removed devices come back this long after the removal
};

const Config& GetConfig();
void Trace(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void Warn(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
uint64_t NowUs();

// ------------------------------------- sv_config.cc: traffic counters ---

enum StatOp { kStatSend, kStatSendImm, kStatWrite, kStatWriteImm, kStatRead,
              kStatRecv, kStatWriteOneCopy, kStatReadOneCopy, kStatNumOps };
void CountTx(int dev_index, StatOp op, uint64_t bytes);
void CountRx(int dev_index, StatOp op, uint64_t bytes);
void InstallStatsDump();

// Device work done on application threads: posting copies a send's bytes
// into the wire, and polls, arms and completion-channel waits move frames
// in; an HCA does all of that. A DeviceWork scope around such work adds the
// thread's CPU time in it (CLOCK_THREAD_CPUTIME_ID: preemption and lock
// waits inside are not counted; one scope in 16 at random is timed and
// counts 16 times, as the clock is a system call) to a running total, which benchmarks count apart from the host's own work, as
// they count the agent thread's. Kept only with SOFTVERBS_DEVICE_CPU_DIR:
// nanoseconds, a uint64_t in the file DIR/<pid>, updated in place (a
// process forked from it starts its own). Nested scopes count once; the
// agent thread's work is never counted here (its CPU time is its own).
class DeviceWork {
 public:
  DeviceWork();
  ~DeviceWork();
  DeviceWork(const DeviceWork&) = delete;
  DeviceWork& operator=(const DeviceWork&) = delete;

 private:
  uint64_t start_ns_ = 0;  // 0: not counting
};
void MarkAgentThread();
bool OnAgentThread();

// epoll_ctl, counted: SOFTVERBS_STATS reports the calls (the data path
// makes none; connections and channels make a few each).
int EpollCtl(int epfd, int op, int fd, epoll_event* ev);
// A doorbell rung: to the peer's agent or to its waiter (SOFTVERBS_STATS).
void CountDoorbell(bool waiter);

// --------------------------------------------------------------- objects ---

struct Device {
  ibv_device dev;  // first: handed out as ibv_device*
  int index = 0;
  DeviceSpec spec;
  uint16_t lid = 0;
  ibv_gid gid{};
  uint64_t guid = 0;
  bool removed = false;  // SOFTVERBS_DEVICE_REMOVAL_MS: gone (under Runtime::mu)
};

struct Context {
  verbs_context vctx;  // ends with the ibv_context handed out
  Device* device = nullptr;
  int async_pipe[2] = {-1, -1};
};

struct Pd {
  ibv_pd pd;
};

struct Mr {
  ibv_mr mr;
  int access = 0;
  uint64_t pinned = 0;  // whole pages counted against RLIMIT_MEMLOCK
  // IBV_ACCESS_ON_DEMAND: nothing pinned; pages are checked (faulted in)
  // as work requests use them. Implicit: the whole address space.
  bool odp = false;
  bool implicit = false;
  // One copy (sv_onecopy.cc): the MR's pages are a shared mapping of a
  // memfd sealed against shrinking, which a peer on this host may map to
  // place its WRITEs directly. share_len == 0: not such memory.
  uint64_t share_dev = 0, share_ino = 0;
  uint64_t share_off = 0;   // file offset of share_base
  uint64_t share_base = 0;  // page-aligned start of the MR's pages
  uint64_t share_len = 0;   // bytes of whole pages from share_base
  int share_fd = -1;        // the runtime's descriptor of the file (shared per file)
};

struct Cq;
struct Qp;
struct Link;

// A completion channel. Events travel as tokens through a SOCK_SEQPACKET
// socketpair (rfd/wfd), one per event; the events themselves (which CQ)
// wait in `events`, so a CQ's unread events can be taken back when it is
// destroyed. The fd the application sees, ch.fd, is an epoll set holding
// rfd and, from the first arm of one of the channel's CQs on, the waiter
// doorbells (Link::wdb_fd) of the links of its QPs ("delegated" links),
// which stay in it until the link or the channel goes. Arming a CQ sets a
// word in each such link's receive ring (LinkSetWaiter) and its event
// clears it: while it is set the peer rings the waiter's doorbell instead
// of the agent's, so a frame wakes the thread waiting on the channel
// directly, and that thread moves the frame itself in ibv_get_cq_event,
// instead of waiting behind the agent thread's own wake-up. Neither arm
// nor event changes an epoll set: a store each in shared memory.
struct CompChannel {
  ibv_comp_channel ch;
  int rfd = -1, wfd = -1;
  std::mutex mu;
  std::deque<ibv_cq*> events;  // guarded by mu
  // Tokens in the socket (or on their way) beyond the queued events: left
  // by a purge that could not take a token not yet sent. Readers look at
  // the socket only when this or the queue says a token may be there.
  long surplus = 0;  // guarded by mu
  std::vector<Link*> delegated;  // guarded by Runtime::mu
  std::atomic<int> n_delegated{0};  // its size, to look without the lock
};

struct Cq {
  // An ibv_cq_ex begins as an ibv_cq does (ibv_cq_ex_to_cq is a cast):
  // every CQ is both; ibv_create_cq_ex fills in the poll functions.
  union {
    ibv_cq cq;
    ibv_cq_ex cqx;
  };
  ibv_wc current{};  // the extended poll's completion, start_poll to next_poll
  std::mutex mu;
  Ring<ibv_wc> entries;  // guarded by mu
  bool armed = false;          // guarded by mu
  bool solicited_only = false;
  bool overrun = false;
  std::atomic<uint32_t> events_read{0};  // handed out by ibv_get_cq_event
  std::vector<Qp*> qps;  // guarded by Runtime::mu
};

struct SendWr {
  uint64_t wr_id = 0;
  ibv_wr_opcode opcode = IBV_WR_SEND;
  unsigned flags = 0;
  uint32_t imm = 0;
  uint64_t remote_addr = 0;
  uint32_t rkey = 0;
  SmallVec<ibv_sge, 2> sge;
  Bytes inline_data;  // IBV_SEND_INLINE: copied at post time
  uint64_t length = 0;
  uint64_t seq = 0;
  bool queued = false;      // handed to the link
  bool signaled = false;
  int fail_status = 0;      // completes with this error instead (fault, bad lkey)
  bool drop_link = false;   // fault: cut the wire once this WR is sent
};

struct RecvWr {
  uint64_t wr_id = 0;
  SmallVec<ibv_sge, 2> sge;
};

// Wire frame header. Every frame on a link starts with one.
enum FrameType : uint8_t {
  kFrameSend = 1,
  kFrameWrite = 2,
  kFrameReadReq = 3,
  kFrameReadResp = 4,
  kFrameAck = 5,
  kFrameNak = 6,
  kFrameDisconnect = 7,
  // One copy (sv_onecopy.cc), shared-memory wires only: the responder
  // tells its peer that it may place WRITEs into an MR directly (a
  // ShareBody follows), and that it may no longer (no payload).
  kFrameShare = 8,
  kFrameUnshare = 9,
};
// kFlagPlaced: a WRITE whose bytes the requester already placed in the
// shared MR (no payload follows, `aux` is its length and `pad` the share's
// generation); a READ_REQ whose bytes the requester already copied out of
// the shared MR (`pad` the generation), and the READ_RESP that answers it
// (no payload, `aux` the length). kFlagReadable, on a SHARE: the MR may be
// read directly too (its READs are allowed; older peers ignore the flag).
enum FrameFlags : uint8_t {
  kFlagImm = 1,
  kFlagSolicited = 2,
  kFlagPlaced = 4,
  kFlagReadable = 8,
};

struct FrameHdr {
  uint8_t type;
  uint8_t flags;
  uint8_t rnr_retry;
  uint8_t pad;
  uint32_t imm;
  uint32_t rkey;
  uint32_t aux;     // NAK: ibv_wc_status; READ_REQ: bytes asked for
  uint64_t seq;
  uint64_t addr;
  uint64_t len;     // payload bytes that follow this header
};
static_assert(sizeof(FrameHdr) == 40, "wire layout");

struct OutFrame {
  FrameHdr hdr{};
  SmallVec<iovec, 2> iov;  // payload, borrowed from registered memory
  SmallVec<iovec, 2> read_into;  // READ_REQ: the local memory asked to be filled
  Bytes owned;             // payload owned by the frame (inline data)
  size_t sent = 0;         // bytes of header + payload written so far
  size_t total() const { return sizeof(FrameHdr) + hdr.len; }
};

enum class LinkState { kConnecting, kHandshake, kUp, kDead };

struct ShmRing;

// A QP's wire: a socket (data in TCP mode; doorbells, liveness and the
// handshake in both modes) plus, in shared-memory mode, two rings.
struct Link {
  int fd = -1;
  LinkState state = LinkState::kConnecting;
  bool initiator = false;
  Qp* qp = nullptr;
  // shared memory mode
  void* shm = nullptr;
  size_t shm_size = 0;
  ShmRing* tx = nullptr;
  ShmRing* rx = nullptr;
  // The rings' geometry, validated once and kept here: the peer can write
  // the segment, so nothing but head and tail is ever read back from it.
  char* tx_data = nullptr;
  char* rx_data = nullptr;
  uint64_t ring_size = 0;
  bool ring_corrupt = false;
  std::string shm_name;  // set while we own the name (initiator, pre-ack)
  uint64_t shm_nonce = 0;
  // Doorbells in shared-memory mode: a Unix datagram socket of ours, bound
  // to an abstract name made of the nonce and our side, and the peer's
  // name. Much cheaper to ring than a byte through TCP loopback; the TCP
  // socket stays for the handshake and the peer's death (EOF), and carries
  // the doorbells if the datagram path is not there.
  // A second one, the waiter's doorbell (its name's side in capitals), is
  // watched by no agent: a completion channel's set holds it while the
  // link is delegated to the channel (see CompChannel).
  int db_fd = -1;
  int wdb_fd = -1;
  std::string db_peer;   // abstract address, leading NUL included
  std::string wdb_peer;  // the peer's waiter doorbell
  bool db_peer_ok = false;
  // outbound
  Ring<OutFrame> out;
  bool want_write = false;  // TCP mode: socket full, wait for EPOLLOUT
  // inbound parser
  FrameHdr in_hdr{};
  size_t in_hdr_got = 0;
  bool in_payload = false;
  bool in_begun = false;
  uint64_t in_left = 0;
  SmallVec<iovec, 2> in_target;  // empty + discard: payload is dropped
  size_t in_idx = 0, in_off = 0;
  bool in_discard = false;
  uint64_t in_seen_us = 0;        // fault knob: delay
  // LinkReceive starts no new frame once it has taken rx_budget bytes in
  // one pass, and begins none with a payload above rx_frame_max (a
  // completion-channel waiter moves one mid-size message itself and
  // leaves a stream's next ones, and bulk, to the agent).
  uint64_t rx_budget = UINT64_MAX;
  uint64_t rx_frame_max = UINT64_MAX;
  bool rx_limited = false;  // the last LinkReceive stopped at one of those two
  uint64_t rnr_deadline_us = 0;   // waiting for a posted receive
  bool rx_dead = false;           // after a fatal NAK, drop what follows
  RecvWr in_recv;                 // receive consumed by the frame in progress
  bool in_has_recv = false;
  char in_share[64];              // a kFrameShare's body (kShareBodySize)
  uint64_t ack_seq = 0;           // cumulative ACK not yet queued
  bool ack_pending = false;
  // handshake / control
  std::string ctl_in;
  std::string ctl_out;
  uint64_t deadline_us = 0;
  std::string peer_desc;
  struct CmId* cm = nullptr;  // the CM id this link belongs to, if any
  int connect_error = 0;      // errno of a failed connect()
  bool cm_listener_side = false;
  CompChannel* delegated_to = nullptr;  // see CompChannel
  // One copy (sv_onecopy.cc). As responder: the MRs shared with the peer,
  // rkey -> the share's generation and slot. As requester: the peer's MRs
  // we may place into, the files they live in (each mapped whole, once per
  // process: a grant opened again maps nothing anew), and the ring position
  // after the last WRITE sent through the ring (a WRITE is placed only once
  // the peer has copied that one out, so WRITEs land in order; a READ is
  // copied directly only once every earlier WRITE and SEND is out, so it
  // sees them: ring_data_end), and the sequence numbers of the READs copied
  // so (their responses carry no bytes), oldest first.
  struct RemoteMr {
    uint64_t addr = 0, length = 0;  // the MR, in the peer's addresses
    char* local = nullptr;          // where addr is mapped here
    uint32_t gen = 0;
    int slot = 0;  // LinkPeerSlot
    bool readable = false;  // kFlagReadable
  };
  struct Shared {
    uint32_t gen = 0;
    int slot = 0;  // LinkOwnSlot
    bool readable = false;
  };
  std::unordered_map<uint32_t, Shared> shared_out;
  uint32_t share_gen = 0;
  uint64_t slots_used = 0;  // LinkOwnSlot's, a bit each
  std::unordered_map<uint32_t, RemoteMr> remote_mrs;
  std::set<std::pair<uint64_t, uint64_t>> peer_files;  // (dev, ino) of files held
  uint64_t ring_write_end = 0;
  uint64_t ring_data_end = 0;  // the same after the last WRITE or SEND (for READs)
  bool place_asked = false;  // the agent was woken to place the front WRITE or READ
  std::deque<uint64_t> placed_reads;
};

// A work request built with the extended post API (ibv_wr_*), between
// ibv_wr_start and ibv_wr_complete.
struct PendingWr {
  ibv_send_wr wr{};
  SmallVec<ibv_sge, 2> sge;
  Bytes inline_data;  // ibv_wr_set_inline_data*: posted as one SGE over it
};

struct Qp {
  // First: handed out as ibv_qp*, and as ibv_qp_ex* (which begins with an
  // ibv_qp) when made with send_ops_flags.
  union {
    ibv_qp qp;
    ibv_qp_ex qpx;
  };
  bool ex = false;  // made with send_ops_flags: ibv_qp_to_qp_ex answers
  std::vector<PendingWr> batch;  // the extended post API's WRs, in order
  int batch_error = 0;           // a wr_set_* without a WR before it, ...
  Context* ctx = nullptr;
  Device* device = nullptr;
  Pd* pd = nullptr;
  Cq* scq = nullptr;
  Cq* rcq = nullptr;
  ibv_qp_cap cap{};
  bool sq_sig_all = false;
  // attributes
  uint8_t port = 1;
  int access = 0;
  uint32_t dest_qpn = 0;
  in_addr peer_addr{};
  uint8_t timeout = 14, retry_cnt = 7, rnr_retry = 7, min_rnr_timer = 12;
  uint32_t sq_psn = 0, rq_psn = 0;
  uint8_t max_rd_atomic = 1, max_dest_rd_atomic = 1;
  ibv_mtu path_mtu = IBV_MTU_1024;
  uint16_t pkey_index = 0;
  ibv_ah_attr ah{};
  // queues
  Ring<SendWr> sq;  // posted, not yet completed (in order)
  Ring<RecvWr> rq;
  uint64_t next_seq = 1;
  uint64_t ops_posted = 0;
  Link* link = nullptr;
  uint64_t link_deadline_us = 0;  // raw path: give up connecting after this
  uint64_t next_connect_us = 0;
  bool cm_managed = false;
  bool destroyed = false;
  // Unique in the process, where a QP number may come back (its listener
  // closed, the port given out again): what holds a number checks this.
  uint64_t serial = 0;
};

// -------------------------- sv_runtime.cc, sv_agent.cc: the runtime ---

// What the agent's epoll reports an fd as.
struct EpollTag {
  enum Kind { kWake, kQpListener, kLink, kCmListener } kind;
  void* obj;
  int fd;
  // Set by Unwatch (under Runtime::mu): an event still in the agent's batch
  // must not reach obj, which may be gone.
  bool dead = false;
  // What the agent's epoll set asks of fd now (UpdateLinkWatch skips a
  // change to the same).
  uint32_t events = 0;
};

class Runtime {
 public:
  static Runtime& Get();

  std::mutex mu;
  std::vector<Device*> devices;

  // Key and QP tables (guarded by mu).
  std::map<uint32_t, Mr*> mrs;
  // Registered bytes (whole pages), counted against RLIMIT_MEMLOCK as the
  // kernel counts pinned pages, unless the process has CAP_IPC_LOCK.
  uint64_t pinned_bytes = 0;
  std::map<uint32_t, Qp*> qps;
  uint32_t AllocKey();
  // On-demand paging MRs by key, readable without mu: a post faults an
  // ODP range's pages in before it takes mu (a cold or large range takes
  // a while, and every other QP waits for mu meanwhile). Changed with mu
  // held and odp_mu exclusive, at registration and deregistration (an ODP
  // MR's range never changes: rereg refuses it); odp_count lets a process
  // with no ODP MR skip odp_mu.
  struct OdpRange {
    const ibv_pd* pd = nullptr;
    uint64_t addr = 0, length = 0;
    bool implicit = false;
    unsigned access = 0;
  };
  std::shared_mutex odp_mu;
  std::unordered_map<uint32_t, OdpRange> odp_ranges;  // guarded by odp_mu
  std::atomic<int> odp_count{0};
  // Allocates a QP number; the upper 16 bits are the TCP port of the QP
  // listener that peers connect to (256 numbers per listener).
  uint32_t AllocQpn(Device* dev);
  // The QP with this number is gone: a listener whose numbers are all given
  // out and whose QPs are all gone is closed (else a process that makes
  // and destroys QPs would keep one more socket per 256 of them).
  void ReleaseQpn(Device* dev, uint32_t qpn);

  Device* DeviceForAddr(in_addr a);   // bound to exactly a
  Device* DeviceForRoute(in_addr dst);  // the one that reaches dst

  // Agent thread.
  void StartAgent();
  void Wake();
  // Registers fd with the agent's epoll (EPOLLIN, plus EPOLLOUT if asked).
  // The runtime owns the tag; Unwatch retires it. A retired tag is freed
  // only after the agent has finished an epoll batch that began after the
  // retirement, so a batch in flight never sees a freed tag.
  void Watch(int fd, EpollTag* tag, bool want_out);
  void Unwatch(int fd);
  // Sets what wakes the agent for a link's fd: input and hang-ups, and
  // writability only while something may wait for it (connecting, the
  // handshake, TCP-mode data, unsent control bytes): an edge-triggered
  // EPOLLOUT on a shared-memory link's doorbell socket fires whenever the
  // peer's doorbell acknowledges ours, a wake-up for nothing.
  void UpdateLinkWatch(Link* l);

  // Makes progress on every link (caller holds mu). Returns true if any
  // byte moved or any state changed.
  bool ProgressLocked();
  bool ProgressLinkLocked(Link* l);

  std::vector<Link*> links;  // guarded by mu
  std::vector<std::vector<int>> qp_listeners;  // per device: listen fds
  std::map<int, uint16_t> listener_port;       // listen fd -> port
  std::map<int, int> listener_live;            // listen fd -> its QPs not destroyed
  uint64_t qp_serials = 0;                     // the last Qp::serial given
  std::vector<uint32_t> qpn_next;              // per device: next slot

  uint64_t boot_hash = 0, netns = 0;

  // Set while the agent waits for mu: pollers then leave it alone, or a
  // busy-polling application would starve the agent with try_lock.
  std::atomic<int> agent_waiting{0};
  // Non-zero while the CM has timed work: the agent then sleeps at most a
  // millisecond, and above 1 it is when the first delayed event is due
  // (NowUs), which the agent meets within the timer slack (tens of us) rather than the
  // millisecond (address and route resolution take SOFTVERBS_RESOLVE_US,
  // not up to a millisecond more); 1 is coarse work only (connect
  // deadlines).
  std::atomic<uint64_t> cm_timers{0};
  // Ids whose route is being resolved and that want a shared-memory
  // segment ready for their rdma_connect: the agent makes them, outside mu.
  std::atomic<int> spares_wanted{0};

 private:
  Runtime();
  void AgentMain();
  void CloseQpListener(Device* dev, size_t i);  // the i-th of dev's QP listeners
  int epfd_ = -1;
  int wake_fd_ = -1;
  std::map<int, EpollTag*> tags_;            // guarded by mu (wake tag: agent only)
  std::vector<EpollTag*> retired_now_, retired_prev_;
  EpollTag* wake_tag_ = nullptr;
  std::once_flag agent_once_;
  std::atomic<bool> sleeping_{false};
};


// ------------------------------------------------- sv_cq.cc: CQs ---

// The context ops behind ibv_poll_cq, ibv_req_notify_cq and ibv_create_cq_ex.
int PollCq(ibv_cq* cq, int n, ibv_wc* wc);
int ReqNotifyCq(ibv_cq* cq, int solicited_only);
ibv_cq_ex* CreateCqExOp(ibv_context* ctx, ibv_cq_init_attr_ex* attr);
// Caller holds Runtime::mu:
void PushCqe(Cq* cq, const ibv_wc& wc, bool solicited);
void LinkUndelegate(Link* l);  // takes the link out of its channel's set

// ------------------------------------------- sv_qp.cc: the QP engine ---

// The context ops behind ibv_post_send and ibv_post_recv.
int PostSend(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad);
int PostRecv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad);
// Caller holds Runtime::mu:
int ModifyQpLocked(Qp* qp, ibv_qp_attr* attr, int mask);
void QpToErrorLocked(Qp* qp, ibv_wc_status head_status);
// An affiliated asynchronous event of `qp` for ibv_get_async_event (as an
// HCA raises IBV_EVENT_QP_ACCESS_ERR on the responder of a refused RDMA
// WRITE or READ); dropped if the context's queue is full.
void RaiseQpEvent(ibv_qp* qp, ibv_event_type type);
void QpLinkUpLocked(Qp* qp);
void QpLinkDeadLocked(Qp* qp, bool peer_gone);
// Faults in every page of [addr, addr + length) as pinning does (for
// writing when `access` allows a write): 0, or EFAULT when a page is not
// mapped or not so accessible (sv_verbs.cc). On-demand paging MRs use it
// per work request.
int FaultInPages(void* addr, size_t length, unsigned access);
bool QpHandleFrameBegin(Link* l);  // false: wait (RNR or delay)
void QpHandleFrameEnd(Link* l);
void QpRxPassDone(Link* l);  // flushes the cumulative ACK
void QpTimersLocked(Qp* qp, uint64_t now);
// The extended post API (send, send with immediate, RDMA write with and
// without immediate, RDMA read) on an RC QP.
constexpr uint64_t kQpExSendOps = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM |
                                  IBV_QP_EX_WITH_RDMA_WRITE |
                                  IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM | IBV_QP_EX_WITH_RDMA_READ;
void EnableQpEx(Qp* qp);

// ------------------------------------------- sv_link.cc: the wires ---
// Caller holds Runtime::mu.

Link* NewLink(int fd, bool initiator);
void LinkEnqueue(Link* l, OutFrame f);
bool LinkPump(Link* l);
bool LinkReceive(Link* l);
void LinkKill(Link* l);
void LinkDoorbell(Link* l);
uint64_t LinkTxHead(Link* l);  // shared-memory wire: bytes ever written
uint64_t LinkTxTail(Link* l);  // ... and ever copied out by the peer
// One copy's rights, in the wire's segment (sv_onecopy.cc): per shared MR,
// the word its owner sets while the peer may place into it, and the word
// the peer sets while it does. kShareSlots per direction.
struct ShareSlot {
  std::atomic<uint64_t> open;
  std::atomic<uint64_t> busy;
};
constexpr int kShareSlots = 64;
ShareSlot* LinkOwnSlot(Link* l, int i);   // for an MR of ours
ShareSlot* LinkPeerSlot(Link* l, int i);  // for one of the peer's

// --------------------------------------- sv_onecopy.cc: one-copy WRITEs ---

// An MR's pages as a shared file mapping, found at registration (Mr::share_*
// set, the file's descriptor taken); false, nothing set, for other memory.
// Caller holds Rt().mu.
bool MrFindShareLocked(Mr* mr);
void MrDropShareLocked(Mr* mr);  // at deregistration or a new translation
// Shares or unshares `mr` on every link it now should or should not be:
// after registration, a change of rights or translation, deregistration
// (gone = true).
void MrSyncSharesLocked(Mr* mr, bool gone = false);
// The same for every MR on one link: when it comes up, when its QP's
// rights change.
void LinkSyncSharesLocked(Link* l);
// PumpShm, before a frame's first byte: a WRITE the peer shared the target
// of is copied there now, or a READ the peer shared the source of is
// copied from there now, and becomes a placed frame (kPlaced), or goes
// through the ring (kRing), or, a large one met on an application's
// thread, waits for the agent to place it (kLater: the agent is woken; the
// frame and those after it stay queued).
enum class Placement { kRing, kPlaced, kLater };
Placement LinkPlace(Link* l, OutFrame* f);
void LinkFramePumped(Link* l, const OutFrame& f);  // a frame went whole
// kFrameShare / kFrameUnshare received (body: the share's payload).
void LinkHandleShare(Link* l, const FrameHdr& h, const char* body, size_t n);
void LinkForgetShares(Link* l);  // the link is dead: unmap, close
// A placed WRITE (or, `read`, a placed READ: a readable share) names a
// share this link made, of this generation.
bool LinkSharedWith(Link* l, uint32_t rkey, uint8_t gen, bool read = false);
// A READ_RESP for `seq` arrived: whether that READ was copied directly
// (forgetting it, and any older ones, whose responses will not come).
bool LinkTakePlacedRead(Link* l, uint64_t seq);
constexpr size_t kShareBodySize = 64;
// A shared-memory segment made ready for a link that is to initiate:
// named in /dev/shm, its pages reserved, mapped, its rings empty. Made
// without any lock (reserving 2 MiB takes about 0.4 ms), so ahead of time
// when it can be (a spare, see CmPrepareSpares).
struct ShmSegment {
  std::string name;
  uint64_t nonce = 0;
  void* p = nullptr;  // null: none
  size_t size = 0;
};
bool ShmSegmentPrepare(ShmSegment* out);  // false: none (no shm, /dev/shm full)
void ShmSegmentDiscard(ShmSegment* s);    // unlinked and unmapped
// Offers shared memory on `l`: `prepared` (taken) if it holds a segment,
// else one made now.
bool LinkSetupShmInitiator(Link* l, ShmSegment* prepared = nullptr);
bool LinkSetupShmAcceptor(Link* l, const std::string& name, uint64_t nonce);
void LinkShmConfirmed(Link* l, bool ok);  // initiator: peer's answer
void LinkSetSleeping(Link* l, bool sleeping);
bool LinkAgentSleeping(Link* l);  // what LinkSetSleeping last said
// Whose doorbell the peer rings for this link's receive ring: the
// waiter's (a completion channel's, see CompChannel) or the agent's.
// Handing it back to the agent reads what the waiter's socket holds, and
// says whether it held any doorbell.
bool LinkSetWaiter(Link* l, bool waiter);
void LinkDrainWaiterDoorbell(Link* l);  // what the waiter's socket holds
// Progress on poll: a consumer that keeps polling needs no doorbells; the
// agent then wakes every millisecond in case the poller stops.
constexpr uint64_t kPollGraceUs = 50;
void LinkMarkPolled(Link* l, uint64_t now);
void LinkForgetPolls(Link* l);  // the consumer stopped polling (armed its CQ)
// The consumer's send CQ is armed for solicited events only (or no longer):
// acknowledgements need (no longer skip) the doorbell.
void LinkSetLazyAcks(Link* l, bool lazy);
bool LinkRecentlyPolled(Link* l, uint64_t now);
bool LinkHasRxData(Link* l);
bool LinkRxNextIsMessage(Link* l, uint64_t at_most);
// Between frames, the receive ring begins with a SEND or WRITE of at most
// `at_most` bytes (copied through the ring, or placed).

// ------------------------------------- sv_handshake.cc: handshakes ---
// Caller holds Runtime::mu.

// Connects from `from` (any address when INADDR_ANY) to addr:port.
int ConnectNonBlocking(in_addr addr, uint16_t port, in_addr from = in_addr{0});
// Control messages on a link socket before it is up: [u32 len][u8 type][body].
enum CtlType : uint8_t {
  kCtlHello = 1, kCtlHelloAck = 2,
  kCtlCmReq = 10, kCtlCmRep = 11, kCtlCmRej = 12, kCtlCmRtu = 13,
};
void CtlSend(Link* l, uint8_t type, const void* body, size_t len);
bool CtlFlush(Link* l);
// Pops one complete control message; false if none yet.
bool CtlPop(Link* l, uint8_t* type, std::string* body);
// Sends what is queued and handles each control message that has arrived.
void HandshakeStepLocked(Link* l);
void HandleQpListener(int fd);  // accepts raw QP connections
// Starts the raw-path connection of an initiating QP to its peer.
void QpTryConnectLocked(Qp* qp);

// The shared-memory offer a HELLO or a CM REQ carries.
struct ShmOffer {
  char name[48];
  uint64_t nonce;
  uint64_t boot_hash;
  uint64_t netns;
  uint64_t ring_bytes;
};

// ----------------------------------------- sv_agent.cc: the agent ---
// (and Runtime's agent members above). Caller holds Runtime::mu.

// A link's event. `fired` is the descriptor the event is for (the link's
// socket or its doorbell socket), or -1 when not known (a thread woken
// through a completion channel, which sees only that one of the channel's
// descriptors is ready).
void HandleLinkEvent(Link* l, uint32_t events, int fired = -1);
// Reads every doorbell waiting on one of a link's datagram sockets; how
// many there were.
int DrainDoorbells(int fd);

// ----------------------------- sv_runtime.cc: runtime, fork, CM hooks ---

// Returns the IPv4 address a GID or LID names, relative to our device.
bool PeerAddrFromAh(const Device* dev, const ibv_ah_attr& ah, in_addr* out);
// In the child of a fork, Runtime::Get starts over with a new runtime and
// first calls `hook` (librdmacm's: its process-wide CM state,
// sv_cm_protocol.cc), registered once.
void SetForkChildHook(void (*hook)());
// CM hooks: librdmacm.so.1 (sv_cm_protocol.cc) installs them when it
// loads; without it they do nothing. Caller holds Runtime::mu.
struct CmHooks {
  void (*listener)(void* listener);
  bool (*ctl)(Link* l, uint8_t type, const std::string& body);
  void (*link_dead)(Link* l);
  void (*disconnect)(Link* l);
  void (*timers)(uint64_t now);
  void (*spares)();  // the one hook called WITHOUT Runtime::mu
};
void SetCmHooks(const CmHooks& hooks);
void CmHandleListener(void* listener);
bool CmHandleCtl(Link* l, uint8_t type, const std::string& body);
void CmLinkDead(Link* l);
void CmDisconnectFrame(Link* l);
void CmTimersLocked(uint64_t now);
void CmPrepareSpares();  // without Runtime::mu, when spares_wanted

// ------------------------------------------------------ handles, GIDs ---

template <typename T, typename M>
T* ContainerOf(M* member, M T::*field) {
  return reinterpret_cast<T*>(reinterpret_cast<char*>(member) -
                              reinterpret_cast<size_t>(&(static_cast<T*>(nullptr)->*field)));
}

inline Context* ToCtx(ibv_context* c) {
  return reinterpret_cast<Context*>(reinterpret_cast<char*>(c) -
                                    offsetof(verbs_context, context));
}
inline Qp* ToQp(ibv_qp* q) { return reinterpret_cast<Qp*>(q); }
inline Cq* ToCq(ibv_cq* c) { return reinterpret_cast<Cq*>(c); }
inline Pd* ToPd(ibv_pd* p) { return reinterpret_cast<Pd*>(p); }
inline Mr* ToMr(ibv_mr* m) { return reinterpret_cast<Mr*>(m); }

// The IPv4-mapped GID of an address (::ffff:a.b.c.d), as RoCE v2 reports
// for an IPv4 address: every softverbs device's GID, and the peer's.
inline ibv_gid MappedGid(in_addr a) {
  ibv_gid g{};
  g.raw[10] = g.raw[11] = 0xff;
  memcpy(&g.raw[12], &a.s_addr, 4);
  return g;
}

// The fields of an extended QP creation that a plain one has.
inline ibv_qp_init_attr PlainQpAttr(const ibv_qp_init_attr_ex& ex) {
  ibv_qp_init_attr a{};
  a.qp_context = ex.qp_context;
  a.send_cq = ex.send_cq;
  a.recv_cq = ex.recv_cq;
  a.srq = ex.srq;
  a.cap = ex.cap;
  a.qp_type = ex.qp_type;
  a.sq_sig_all = ex.sq_sig_all;
  return a;
}

}  // namespace softverbs

#endif  // SOFTVERBS_SV_INTERNAL_H_
