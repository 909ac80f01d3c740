// softverbs' librdmacm: what its two halves share. sv_cm_protocol.cc is
// the connection management protocol (the REQ/REP/REJ/RTU messages on a
// link, the event sequences of rdma_cm(7), delayed resolution, timers);
// sv_cm_abi.cc is the librdmacm entry points the application calls.
// Everything here is guarded by Runtime::mu unless it says otherwise.
#ifndef SOFTVERBS_SV_CM_INTERNAL_H_
#define SOFTVERBS_SV_CM_INTERNAL_H_

#include <deque>
#include <set>

#include "sv_internal.h"

namespace softverbs {

struct EventChannel;
enum class CmState { kIdle, kBound, kListen, kAddr, kRoute, kConnecting, kReqRcvd,
                     kAccepting, kResponse, kConnected, kDisconnected, kRejected };

struct CmId {
  rdma_cm_id id;  // first: handed out as rdma_cm_id*
  EventChannel* chan = nullptr;
  bool sync = false;
  CmState state = CmState::kIdle;
  Device* dev = nullptr;
  int listen_fd = -1;
  EpollTag* listen_tag = nullptr;
  Link* link = nullptr;
  uint32_t peer_qpn = 0;
  // Our QP's number: from rdma_create_qp, or the qp_num an application that
  // made its own QP passes to rdma_connect/rdma_accept. Looked up by number,
  // because the application may destroy the QP behind id->qp's back.
  uint32_t local_qpn = 0;
  uint64_t local_serial = 0;  // that QP's Qp::serial: a number given again is not it
  rdma_conn_param peer{};
  uint64_t deadline_us = 0;
  int unacked = 0;  // events handed out and not yet acked
  std::condition_variable acked;
  bool owns_cqs = false;
  CmId* listener = nullptr;  // for a child, until it is accepted
  // RDMA_OPTION_ID_ACK_TIMEOUT: the QP's local ACK timeout (4.096 us x 2^n).
  uint8_t ack_timeout = 14;
  // RDMA_OPTION_ID_TOS: the traffic class of the path and the QP's address
  // vector (a listener's is its requests', as in the kernel).
  uint8_t tos = 0;
  // rdma_create_ep on the passive side with QP attributes: each request
  // rdma_get_request hands out gets a QP made with these.
  bool ep_qp = false;
  ibv_qp_init_attr ep_attr{};
  ibv_pd* ep_pd = nullptr;
  // A shared-memory segment made ready by the agent while the route
  // resolves, for rdma_connect's link (OnSpares); spare_wanted while asked.
  bool spare_wanted = false;
  ShmSegment spare;
};

constexpr size_t kReqPdata = 56;   // RDMA_PS_TCP REQ private data
constexpr size_t kRepPdata = 196;
constexpr size_t kRejPdata = 148;
constexpr int kRejConsumer = 28;       // IB CM reject reason: consumer
constexpr int kRejInvalidService = 8;  // nobody listening
constexpr uint64_t kConnectTimeoutUs = 5000000;



struct CmEvent {
  rdma_cm_event ev;
  uint8_t pdata[256];
  CmId* owner = nullptr;
};

// The channel fd is one end of a SOCK_SEQPACKET socketpair carrying a
// one-byte token per queued event. Like the kernel's rdma_cm fd it is
// pollable and honours O_NONBLOCK, and closing it does not wake a thread
// blocked on it; unlike an eventfd, softverbs itself can take tokens back
// without ever blocking (MSG_DONTWAIT), whatever the application's flags.
struct EventChannel {
  rdma_event_channel ch;
  int wfd = -1;
  std::mutex mu;
  std::deque<CmEvent*> q;
  std::atomic<int> readers{0};  // threads inside rdma_get_cm_event
  // rdma_destroy_event_channel ran. A channel is never freed (see there):
  // a get that comes after its destroy finds this instead of freed memory.
  std::atomic<bool> destroyed{false};
  bool nonblocking_at_destroy = false;
};

// The CM messages, carried as control messages (CtlSend) on the link.
struct CmReq {
  uint32_t qpn;
  uint16_t src_port;
  uint8_t responder_resources, initiator_depth, flow_control, retry_count, rnr_retry_count, srq;
  uint8_t pdata_len;
  uint8_t pdata[kReqPdata];
  uint8_t shm_offer;
  ShmOffer offer;
};
struct CmRep {
  uint32_t qpn;
  uint8_t responder_resources, initiator_depth, flow_control, rnr_retry_count, srq;
  uint8_t pdata_len;
  uint8_t pdata[kRepPdata];
  uint8_t shm_ok;
};
struct CmRej {
  uint8_t pdata_len;
  uint8_t pdata[kRejPdata];
};

// Events that become visible later (address and route resolution take
// time, as ARP and path queries do on hardware). Guarded by Runtime::mu.
struct Delayed {
  uint64_t due_us;
  CmId* id;
  rdma_cm_event_type type;
};

inline Runtime& Rt() { return Runtime::Get(); }

// ------------------------------------------------- sv_cm_protocol.cc ---

std::deque<Delayed>& DelayedEvents();
std::set<CmId*>& Ids();  // every live id
// An RDMA CM port's TCP port (see sv_cm_protocol.cc).
uint16_t TcpPortFor(uint16_t cm_port);
// One wake-up token into the channel's socket; never blocks.
void SendToken(EventChannel* ch);
// Queues an event on the id's channel (the listener's, for a request).
void PushEvent(CmId* id, rdma_cm_event_type type, int status, CmId* listen = nullptr,
               const void* pdata = nullptr, size_t pdata_len = 0, size_t pad_to = 0);
// Queues it after SOFTVERBS_RESOLVE_US, as address and route resolution take time.
void PushEventLater(CmId* id, rdma_cm_event_type type);
ibv_context* DeviceContext(Device* d);  // the CM's own context of a device
void SetSrc(CmId* id, const sockaddr_in& a);
void SetDst(CmId* id, const sockaddr_in& a);
void AttachDevice(CmId* id, Device* d);
Qp* IdQp(CmId* id);  // the id's QP, if it still exists
// Makes `qpn` (a QP of the application's own, or one the CM made) the id's.
void SetLocalQp(CmId* id, uint32_t qpn);
// The address vector of an id's route (RTR's, and a CM-managed QP's).
ibv_ah_attr CmAddressVector(const CmId* id);
// Moves a CM-managed QP to RTS against the peer's QPN and binds the link.
void ConnectQp(CmId* id, const rdma_conn_param& mine);
void LinkUp(CmId* id);
void DropLink(CmId* id);
void DropSpareWish(CmId* id);  // the agent makes no segment for it any more
// A connected id's DISCONNECTED (and its CM-managed QP to error).
void Disconnected(CmId* id);

}  // namespace softverbs

#endif  // SOFTVERBS_SV_CM_INTERNAL_H_
