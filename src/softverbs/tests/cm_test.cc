// softverbs' librdmacm: the event sequences of rdma_cm(7), private data at
// InfiniBand sizes, rejects, separate port spaces, and a peer that dies.
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <rdma/rdma_verbs.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "sv_test_util.h"

using namespace svtest;

namespace {

// CM port P listens on TCP port P ^ 0x8000: ports from 40000 map below the
// ephemeral range, where no outgoing connection can be holding them.
std::atomic<int> g_port{40000 + (getpid() % 4000) * 4};

sockaddr_in Addr(uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  return a;
}

// Waits for the next event; fails the test if it is not `want`.
rdma_cm_event* Expect(rdma_event_channel* ch, rdma_cm_event_type want, int ms = 10000) {
  pollfd p{ch->fd, POLLIN, 0};
  if (poll(&p, 1, ms) != 1) {
    ADD_FAILURE() << "no event, wanted " << rdma_event_str(want);
    return nullptr;
  }
  rdma_cm_event* e = nullptr;
  if (rdma_get_cm_event(ch, &e) != 0) {
    ADD_FAILURE() << "rdma_get_cm_event: " << strerror(errno);
    return nullptr;
  }
  EXPECT_EQ(e->event, want) << rdma_event_str(e->event) << " status " << e->status;
  return e;
}

struct Listener {
  rdma_event_channel* ch = nullptr;
  rdma_cm_id* id = nullptr;
  uint16_t port = 0;
  bool Start() {
    ch = rdma_create_event_channel();
    if (ch == nullptr || rdma_create_id(ch, &id, this, RDMA_PS_TCP) != 0) return false;
    port = static_cast<uint16_t>(g_port.fetch_add(1));
    sockaddr_in a = Addr(port);
    return rdma_bind_addr(id, reinterpret_cast<sockaddr*>(&a)) == 0 && rdma_listen(id, 8) == 0;
  }
  ~Listener() {
    if (id) rdma_destroy_id(id);
    if (ch) rdma_destroy_event_channel(ch);
  }
};

struct Client {
  rdma_event_channel* ch = nullptr;
  rdma_cm_id* id = nullptr;
  bool Resolve(uint16_t port) {
    ch = rdma_create_event_channel();
    if (ch == nullptr || rdma_create_id(ch, &id, nullptr, RDMA_PS_TCP) != 0) return false;
    sockaddr_in a = Addr(port);
    if (rdma_resolve_addr(id, nullptr, reinterpret_cast<sockaddr*>(&a), 2000) != 0) return false;
    rdma_cm_event* e = Expect(ch, RDMA_CM_EVENT_ADDR_RESOLVED);
    if (e == nullptr) return false;
    rdma_ack_cm_event(e);
    if (id->verbs == nullptr || rdma_resolve_route(id, 2000) != 0) return false;
    e = Expect(ch, RDMA_CM_EVENT_ROUTE_RESOLVED);
    if (e == nullptr) return false;
    rdma_ack_cm_event(e);
    return true;
  }
  ~Client() {
    if (id) {
      if (id->qp) rdma_destroy_qp(id);
      rdma_destroy_id(id);
    }
    if (ch) rdma_destroy_event_channel(ch);
  }
};

ibv_qp_init_attr QpAttr() {
  ibv_qp_init_attr a{};
  a.qp_type = IBV_QPT_RC;
  a.cap.max_send_wr = 16;
  a.cap.max_recv_wr = 16;
  a.cap.max_send_sge = 1;
  a.cap.max_recv_sge = 1;
  return a;
}

// After the client's rdma_connect: the listener's request accepted with a
// QP of its own, ESTABLISHED on both sides. The accepted id, or null (a
// failure added).
rdma_cm_id* AcceptNext(Listener& l, Client& c) {
  rdma_cm_event* e = Expect(l.ch, RDMA_CM_EVENT_CONNECT_REQUEST);
  if (e == nullptr) return nullptr;
  rdma_cm_id* child = e->id;
  rdma_ack_cm_event(e);
  ibv_qp_init_attr sa = QpAttr();
  if (rdma_create_qp(child, nullptr, &sa) != 0 || rdma_accept(child, nullptr) != 0) {
    ADD_FAILURE() << "cannot accept: " << strerror(errno);
    return nullptr;
  }
  for (rdma_event_channel* ch : {c.ch, l.ch}) {
    e = Expect(ch, RDMA_CM_EVENT_ESTABLISHED);
    if (e) rdma_ack_cm_event(e);
  }
  return child;
}

// The client disconnects; both sides see it, and the accepted side goes.
void Close(Listener& l, Client& c, rdma_cm_id* child) {
  rdma_disconnect(c.id);
  for (rdma_event_channel* ch : {c.ch, l.ch}) {
    rdma_cm_event* e = Expect(ch, RDMA_CM_EVENT_DISCONNECTED);
    if (e) rdma_ack_cm_event(e);
  }
  rdma_destroy_qp(child);
  rdma_destroy_id(child);
}

TEST(Cm, ConnectTransferDisconnectWithPrivateData) {
  Listener l;
  ASSERT_TRUE(l.Start());
  Client c;
  ASSERT_TRUE(c.Resolve(l.port));
  ibv_qp_init_attr qa = QpAttr();
  ASSERT_EQ(rdma_create_qp(c.id, nullptr, &qa), 0);
  ASSERT_NE(c.id->send_cq, nullptr) << "CQs made for a NULL-CQ QP";

  const char req[] = "hello-from-client";
  rdma_conn_param p{};
  p.private_data = req;
  p.private_data_len = sizeof(req);
  p.responder_resources = 3;
  p.initiator_depth = 2;
  p.rnr_retry_count = 7;
  ASSERT_EQ(rdma_connect(c.id, &p), 0);

  rdma_cm_event* e = Expect(l.ch, RDMA_CM_EVENT_CONNECT_REQUEST);
  ASSERT_NE(e, nullptr);
  rdma_cm_id* child = e->id;
  EXPECT_EQ(e->listen_id, l.id);
  EXPECT_EQ(child->context, &l) << "a child inherits the listener's context";
  EXPECT_EQ(e->param.conn.private_data_len, 56) << "IB REQ private data, zero padded";
  EXPECT_EQ(memcmp(e->param.conn.private_data, req, sizeof(req)), 0);
  EXPECT_EQ(static_cast<const char*>(e->param.conn.private_data)[55], 0);
  EXPECT_EQ(e->param.conn.responder_resources, 2) << "swapped relative to the sender";
  EXPECT_EQ(e->param.conn.initiator_depth, 3);
  EXPECT_EQ(e->param.conn.qp_num, c.id->qp->qp_num);
  rdma_ack_cm_event(e);

  ibv_qp_init_attr sa = QpAttr();
  ASSERT_EQ(rdma_create_qp(child, nullptr, &sa), 0);
  Buffer rbuf = MakeBuffer(child->pd, 4096, IBV_ACCESS_LOCAL_WRITE);
  ASSERT_EQ(PostRecv(child->qp, rbuf, 0, 4096, 42), 0);
  const char rep[] = "welcome";
  rdma_conn_param ap{};
  ap.private_data = rep;
  ap.private_data_len = sizeof(rep);
  ASSERT_EQ(rdma_accept(child, &ap), 0);

  e = Expect(c.ch, RDMA_CM_EVENT_ESTABLISHED);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->param.conn.private_data_len, 196) << "IB REP private data, zero padded";
  EXPECT_STREQ(static_cast<const char*>(e->param.conn.private_data), "welcome");
  rdma_ack_cm_event(e);
  e = Expect(l.ch, RDMA_CM_EVENT_ESTABLISHED);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->id, child);
  rdma_ack_cm_event(e);

  Buffer sbuf = MakeBuffer(c.id->pd, 4096, IBV_ACCESS_LOCAL_WRITE);
  Fill(sbuf.data.data(), 3000, 21);
  ASSERT_EQ(PostSend(c.id->qp, IBV_WR_SEND, sbuf, 0, 3000, 1), 0);
  auto rx = PollN(child->recv_cq, 1);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].byte_len, 3000u);
  EXPECT_TRUE(Check(rbuf.data.data(), 3000, 21));
  EXPECT_EQ(PollN(c.id->send_cq, 1).size(), 1u);

  ASSERT_EQ(PostRecv(child->qp, rbuf, 0, 4096, 43), 0);
  ASSERT_EQ(rdma_disconnect(c.id), 0);
  e = Expect(c.ch, RDMA_CM_EVENT_DISCONNECTED);
  if (e) rdma_ack_cm_event(e);
  e = Expect(l.ch, RDMA_CM_EVENT_DISCONNECTED);
  if (e) rdma_ack_cm_event(e);
  rx = PollN(child->recv_cq, 1);
  ASSERT_EQ(rx.size(), 1u);
  EXPECT_EQ(rx[0].status, IBV_WC_WR_FLUSH_ERR) << "the peer's QP goes to error";

  rdma_destroy_qp(child);
  FreeBuffer(rbuf);
  FreeBuffer(sbuf);
  rdma_destroy_id(child);
}

TEST(Cm, RejectCarriesPrivateData) {
  Listener l;
  ASSERT_TRUE(l.Start());
  Client c;
  ASSERT_TRUE(c.Resolve(l.port));
  ASSERT_EQ(rdma_connect(c.id, nullptr), 0);
  rdma_cm_event* e = Expect(l.ch, RDMA_CM_EVENT_CONNECT_REQUEST);
  ASSERT_NE(e, nullptr);
  rdma_cm_id* child = e->id;
  rdma_ack_cm_event(e);
  const char why[] = "go away";
  ASSERT_EQ(rdma_reject(child, why, sizeof(why)), 0);
  e = Expect(c.ch, RDMA_CM_EVENT_REJECTED);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->status, 28) << "IB CM consumer reject";
  EXPECT_EQ(e->param.conn.private_data_len, 148);
  EXPECT_STREQ(static_cast<const char*>(e->param.conn.private_data), "go away");
  rdma_ack_cm_event(e);
  rdma_destroy_id(child);
}

// The new id of a CONNECT_REQUEST takes the listening id's context as it is
// when the program gets the event, as librdmacm's does (it is copied in
// rdma_get_cm_event), not as it was when the request arrived: a program
// may set the context after rdma_listen, and the device must not read it
// from another thread meanwhile.
TEST(Cm, ARequestTakesTheListenersContextWhenItIsGot) {
  Listener l;
  ASSERT_TRUE(l.Start());
  Client c;
  ASSERT_TRUE(c.Resolve(l.port));
  ASSERT_EQ(rdma_connect(c.id, nullptr), 0);
  pollfd p{l.ch->fd, POLLIN, 0};
  ASSERT_EQ(poll(&p, 1, 10000), 1) << "no CONNECT_REQUEST";
  int later = 0;
  l.id->context = &later;  // set after the request arrived
  rdma_cm_event* e = Expect(l.ch, RDMA_CM_EVENT_CONNECT_REQUEST);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->listen_id, l.id);
  EXPECT_EQ(e->id->context, &later);
  rdma_cm_id* child = e->id;
  rdma_ack_cm_event(e);
  rdma_reject(child, nullptr, 0);
  rdma_destroy_id(child);
}

// RDMA_OPTION_ID_ACK_TIMEOUT reaches the QP (it was accepted and dropped:
// the QP kept 14); sizes and unknown options fail as librdmacm's do.
TEST(Cm, AckTimeoutOptionReachesTheQp) {
  Listener l;
  ASSERT_TRUE(l.Start());
  Client c;
  ASSERT_TRUE(c.Resolve(l.port));
  ibv_qp_init_attr qa = QpAttr();
  ASSERT_EQ(rdma_create_qp(c.id, nullptr, &qa), 0);
  int wide = 21;
  EXPECT_EQ(rdma_set_option(c.id, RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, &wide, sizeof(wide)),
            -1);
  EXPECT_EQ(errno, EINVAL);
  uint8_t t = 21;
  EXPECT_EQ(rdma_set_option(c.id, 7, RDMA_OPTION_ID_ACK_TIMEOUT, &t, sizeof(t)), -1);
  EXPECT_EQ(errno, ENOSYS);
  ASSERT_EQ(rdma_set_option(c.id, RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, &t, sizeof(t)), 0);
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTS;
  int mask = 0;
  ASSERT_EQ(rdma_init_qp_attr(c.id, &a, &mask), 0);
  EXPECT_EQ(a.timeout, 21);
  ASSERT_EQ(rdma_connect(c.id, nullptr), 0);
  rdma_cm_id* child = AcceptNext(l, c);
  ASSERT_NE(child, nullptr);
  ibv_qp_init_attr init{};
  ASSERT_EQ(ibv_query_qp(c.id->qp, &a, IBV_QP_TIMEOUT, &init), 0);
  EXPECT_EQ(a.timeout, 21) << "the connected QP's ACK timeout";
  ASSERT_EQ(ibv_query_qp(child->qp, &a, IBV_QP_TIMEOUT, &init), 0);
  EXPECT_EQ(a.timeout, 14) << "the other side keeps the default";
  Close(l, c, child);
}

// RDMA_OPTION_ID_TOS: the traffic class reaches the path record and the
// QP's address vector; a listener's is its requests' (as in the kernel);
// the path's source GID is the device's GID at index 0.
TEST(Cm, TosReachesThePathAndTheQp) {
  Listener l;
  ASSERT_TRUE(l.Start());
  uint8_t server_tos = 40, client_tos = 106;
  ASSERT_EQ(rdma_set_option(l.id, RDMA_OPTION_ID, RDMA_OPTION_ID_TOS, &server_tos, 1), 0);
  int wide = 3;
  EXPECT_EQ(rdma_set_option(l.id, RDMA_OPTION_ID, RDMA_OPTION_ID_TOS, &wide, sizeof(wide)), -1);
  EXPECT_EQ(errno, EINVAL);
  Client c;
  c.ch = rdma_create_event_channel();
  ASSERT_NE(c.ch, nullptr);
  ASSERT_EQ(rdma_create_id(c.ch, &c.id, nullptr, RDMA_PS_TCP), 0);
  sockaddr_in a = Addr(l.port);
  ASSERT_EQ(rdma_resolve_addr(c.id, nullptr, reinterpret_cast<sockaddr*>(&a), 2000), 0);
  rdma_cm_event* e = Expect(c.ch, RDMA_CM_EVENT_ADDR_RESOLVED);
  ASSERT_NE(e, nullptr);
  rdma_ack_cm_event(e);
  ASSERT_EQ(rdma_set_option(c.id, RDMA_OPTION_ID, RDMA_OPTION_ID_TOS, &client_tos, 1), 0);
  ASSERT_EQ(rdma_resolve_route(c.id, 2000), 0);
  e = Expect(c.ch, RDMA_CM_EVENT_ROUTE_RESOLVED);
  ASSERT_NE(e, nullptr);
  rdma_ack_cm_event(e);
  ASSERT_NE(c.id->route.path_rec, nullptr);
  EXPECT_EQ(c.id->route.path_rec->traffic_class, client_tos);
  ibv_gid gid0{};
  ASSERT_EQ(ibv_query_gid(c.id->verbs, 1, 0, &gid0), 0);
  EXPECT_EQ(memcmp(&c.id->route.path_rec->sgid, &gid0, sizeof(gid0)), 0);
  EXPECT_EQ(memcmp(&c.id->route.path_rec->dgid.raw[12], &a.sin_addr, 4), 0);
  ibv_qp_init_attr qa = QpAttr();
  ASSERT_EQ(rdma_create_qp(c.id, nullptr, &qa), 0);
  ASSERT_EQ(rdma_connect(c.id, nullptr), 0);
  rdma_cm_id* child = AcceptNext(l, c);
  ASSERT_NE(child, nullptr);
  ibv_qp_attr q{};
  ibv_qp_init_attr init{};
  ASSERT_EQ(ibv_query_qp(c.id->qp, &q, IBV_QP_AV, &init), 0);
  EXPECT_EQ(q.ah_attr.grh.traffic_class, client_tos);
  EXPECT_EQ(q.ah_attr.is_global, 1);
  ASSERT_EQ(ibv_query_qp(child->qp, &q, IBV_QP_AV, &init), 0);
  EXPECT_EQ(q.ah_attr.grh.traffic_class, server_tos) << "the listener's, inherited";
  Close(l, c, child);
}

// A client's source address and port space in the hints come back in the
// result, as librdmacm gives them: rdma_create_ep binds that source (it
// chooses the device when a host has several).
TEST(Cm, GetaddrinfoKeepsTheHintsSourceAndPortSpace) {
  sockaddr_in src{};
  src.sin_family = AF_INET;
  src.sin_port = htons(4791);
  inet_pton(AF_INET, "127.0.0.1", &src.sin_addr);
  rdma_addrinfo hints{}, *res = nullptr;
  hints.ai_port_space = RDMA_PS_IB;
  hints.ai_src_addr = reinterpret_cast<sockaddr*>(&src);
  hints.ai_src_len = sizeof(src);
  ASSERT_EQ(rdma_getaddrinfo("127.0.0.1", "7000", &hints, &res), 0);
  ASSERT_NE(res->ai_dst_addr, nullptr);
  ASSERT_NE(res->ai_src_addr, nullptr);
  ASSERT_EQ(res->ai_src_len, sizeof(sockaddr_in));
  EXPECT_EQ(memcmp(res->ai_src_addr, &src, sizeof(src)), 0);
  EXPECT_EQ(res->ai_port_space, RDMA_PS_IB);
  EXPECT_EQ(ntohs(reinterpret_cast<sockaddr_in*>(res->ai_dst_addr)->sin_port), 7000);
  rdma_freeaddrinfo(res);
}

// The synchronous server of librdmacm's examples (rdma_server): an
// endpoint made with QP attributes hands out requests that have a QP, so
// a receive can be posted before the accept (it crashed: no QP).
TEST(Cm, ASynchronousServerEndpointHandsOutRequestsWithQps) {
  uint16_t port = static_cast<uint16_t>(g_port.fetch_add(1));
  std::string service = std::to_string(port);
  rdma_addrinfo hints{}, *res = nullptr;
  hints.ai_flags = RAI_PASSIVE;
  hints.ai_port_space = RDMA_PS_TCP;
  ASSERT_EQ(rdma_getaddrinfo("127.0.0.1", service.c_str(), &hints, &res), 0);
  ibv_qp_init_attr qa = QpAttr();
  qa.cap.max_inline_data = 16;
  qa.sq_sig_all = 1;
  rdma_cm_id* listen = nullptr;
  ASSERT_EQ(rdma_create_ep(&listen, res, nullptr, &qa), 0) << strerror(errno);
  rdma_freeaddrinfo(res);
  ASSERT_EQ(rdma_listen(listen, 1), 0);

  std::atomic<int> client_rc{-100};
  std::thread client([&] {
    rdma_addrinfo h{}, *r = nullptr;
    h.ai_port_space = RDMA_PS_TCP;
    if (rdma_getaddrinfo("127.0.0.1", service.c_str(), &h, &r) != 0) return client_rc.store(1);
    ibv_qp_init_attr ca = QpAttr();
    ca.cap.max_inline_data = 16;
    ca.sq_sig_all = 1;
    rdma_cm_id* id = nullptr;
    int rc = rdma_create_ep(&id, r, nullptr, &ca);
    rdma_freeaddrinfo(r);
    if (rc != 0) return client_rc.store(2);
    if (rdma_connect(id, nullptr) != 0) return client_rc.store(3);
    char msg[16] = "sync hello";
    if (rdma_post_send(id, nullptr, msg, sizeof(msg), nullptr, IBV_SEND_INLINE) != 0)
      return client_rc.store(4);
    ibv_wc wc;
    if (rdma_get_send_comp(id, &wc) <= 0 || wc.status != IBV_WC_SUCCESS) return client_rc.store(5);
    rdma_disconnect(id);
    rdma_destroy_ep(id);
    client_rc.store(0);
  });
  struct Join {  // on every way out (a refused request ends the connect)
    std::thread& t;
    ~Join() { t.join(); }
  } join{client};

  rdma_cm_id* req = nullptr;
  ASSERT_EQ(rdma_get_request(listen, &req), 0) << strerror(errno);
  if (req->qp == nullptr) {
    ADD_FAILURE() << "the request has no QP (the endpoint's attributes were dropped)";
    rdma_reject(req, nullptr, 0);
    return;
  }
  char buf[16] = {};
  ibv_mr* mr = rdma_reg_msgs(req, buf, sizeof(buf));
  ASSERT_NE(mr, nullptr);
  ASSERT_EQ(rdma_post_recv(req, nullptr, buf, sizeof(buf), mr), 0);
  ASSERT_EQ(rdma_accept(req, nullptr), 0) << strerror(errno);
  ibv_wc wc{};
  ASSERT_EQ(rdma_get_recv_comp(req, &wc), 1);
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_STREQ(buf, "sync hello");
  client.join();
  client = std::thread([] {});  // for Join
  EXPECT_EQ(client_rc.load(), 0) << "the client's step that failed";
  rdma_disconnect(req);
  rdma_dereg_mr(mr);
  rdma_destroy_ep(req);
  rdma_destroy_ep(listen);
}

TEST(Cm, NobodyListeningIsRejected) {
  Client c;
  ASSERT_TRUE(c.Resolve(static_cast<uint16_t>(g_port.fetch_add(1))));
  ASSERT_EQ(rdma_connect(c.id, nullptr), 0);
  rdma_cm_event* e = Expect(c.ch, RDMA_CM_EVENT_REJECTED);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->status, 8) << "invalid service id";
  rdma_ack_cm_event(e);
}

TEST(Cm, PrivateDataLimits) {
  Listener l;
  ASSERT_TRUE(l.Start());
  Client c;
  ASSERT_TRUE(c.Resolve(l.port));
  char big[57] = {};
  rdma_conn_param p{};
  p.private_data = big;
  p.private_data_len = 57;
  EXPECT_EQ(rdma_connect(c.id, &p), -1);
  EXPECT_EQ(errno, EINVAL);
}

// This process's shared-memory segments in /dev/shm ("softverbs-PID-..."):
// made for a connect and not yet taken (unlinked) by the accepting side.
int OurSegments() {
  const std::string prefix = "softverbs-" + std::to_string(getpid()) + "-";
  int n = 0;
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) n += strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0;
    closedir(d);
  }
  return n;
}

// Waits up to 5 s for OurSegments() to be `want`; returns what it is.
int AwaitSegments(int want) {
  int n = OurSegments();
  for (int i = 0; i < 500 && n != want; ++i) {
    usleep(10000);
    n = OurSegments();
  }
  return n;
}

// The shared-memory wire's segment is made by the agent while the route
// resolves (SOFTVERBS_RESOLVE_US), not by rdma_connect under the runtime
// lock; rdma_connect offers that one, and an id destroyed before it
// connects leaves none behind.
TEST(Cm, TheWiresSegmentIsMadeWhileTheRouteResolvesAndNeverLeftBehind) {
  // None without shared memory, nor without a resolution delay to make
  // it in (then rdma_connect makes it, as it always did).
  const char* shm_env = getenv("SOFTVERBS_SHM");
  const char* resolve_env = getenv("SOFTVERBS_RESOLVE_US");
  const int wire = shm_env != nullptr && strcmp(shm_env, "0") == 0 ? 0 : 1;
  const int spare = resolve_env != nullptr && strcmp(resolve_env, "0") == 0 ? 0 : wire;
  Listener l;
  ASSERT_TRUE(l.Start());
  const int base = OurSegments();
  {
    Client c;
    ASSERT_TRUE(c.Resolve(l.port));
    EXPECT_EQ(AwaitSegments(base + spare), base + spare) << "made while the route resolved";
  }
  EXPECT_EQ(AwaitSegments(base), base) << "an id destroyed before connecting left its segment";

  Client c;
  ASSERT_TRUE(c.Resolve(l.port));
  ASSERT_EQ(AwaitSegments(base + spare), base + spare);
  ibv_qp_init_attr qa = QpAttr();
  ASSERT_EQ(rdma_create_qp(c.id, nullptr, &qa), 0);
  ASSERT_EQ(rdma_connect(c.id, nullptr), 0);
  // The offered segment, or none once the accepting side (this process's
  // agent) took it; one that rdma_connect made instead of offering the
  // spare would leave the spare behind (below).
  EXPECT_LE(OurSegments(), base + wire) << "rdma_connect made another segment than the spare";
  rdma_cm_id* child = AcceptNext(l, c);
  ASSERT_NE(child, nullptr);
  EXPECT_EQ(AwaitSegments(base), base) << "the accepting side took the segment, and no other is left";
  Close(l, c, child);
}

TEST(Cm, TcpAndRdmaCmShareAnAddressAndPort) {
  // The test's ports lie in Linux's ephemeral range, where a connection of
  // a test running beside this one may hold the TCP port by chance: a few
  // tries with other ports tell that apart from a port space that is not
  // separate (which fails every time).
  int err = 0;
  for (int attempt = 0; attempt < 5; ++attempt) {
    Listener l;
    ASSERT_TRUE(l.Start());
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a = Addr(l.port);
    err = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 ? 0 : errno;
    if (err == 0) {
      EXPECT_EQ(listen(fd, 1), 0);
    }
    close(fd);
    if (err != EADDRINUSE) break;
  }
  EXPECT_EQ(err, 0) << strerror(err);
}

TEST(Cm, NonBlockingChannelSaysEagain) {
  rdma_event_channel* ch = rdma_create_event_channel();
  ASSERT_NE(ch, nullptr);
  fcntl(ch->fd, F_SETFL, fcntl(ch->fd, F_GETFL) | O_NONBLOCK);
  rdma_cm_event* e = nullptr;
  EXPECT_EQ(rdma_get_cm_event(ch, &e), -1);
  EXPECT_EQ(errno, EAGAIN);
  rdma_destroy_event_channel(ch);
}

// Many events pending on one channel before anyone reads: the channel fd
// stays readable until the last is taken, as the kernel's does (one token
// per event through a socket ran out of buffer near 280 events, and the
// rest never woke a program that polls the fd, as the engine does).
// Destroying ids whose events are pending takes their readability along.
TEST(Cm, AChannelWithManyPendingEventsStaysReadable) {
  rdma_event_channel* ch = rdma_create_event_channel();
  ASSERT_NE(ch, nullptr);
  fcntl(ch->fd, F_SETFL, fcntl(ch->fd, F_GETFL) | O_NONBLOCK);
  constexpr int kIds = 600;
  std::vector<rdma_cm_id*> ids(kIds, nullptr);
  sockaddr_in a = Addr(40000);
  for (int i = 0; i < kIds; ++i) {
    ASSERT_EQ(rdma_create_id(ch, &ids[i], nullptr, RDMA_PS_TCP), 0);
    ASSERT_EQ(rdma_resolve_addr(ids[i], nullptr, reinterpret_cast<sockaddr*>(&a), 2000), 0);
  }
  // The first 100 ids go before anything is read: their events go too.
  for (int i = 0; i < 100; ++i) ASSERT_EQ(rdma_destroy_id(ids[i]), 0);
  int got = 0;
  for (;;) {
    pollfd p{ch->fd, POLLIN, 0};
    if (poll(&p, 1, 3000) != 1) break;
    rdma_cm_event* e = nullptr;
    if (rdma_get_cm_event(ch, &e) != 0) {
      ASSERT_EQ(errno, EAGAIN) << strerror(errno);
      continue;  // readable for an event a destroy took back
    }
    EXPECT_EQ(e->event, RDMA_CM_EVENT_ADDR_RESOLVED);
    rdma_ack_cm_event(e);
    if (++got == kIds - 100) break;
  }
  EXPECT_EQ(got, kIds - 100) << "events stranded on a channel that is not readable";
  pollfd p{ch->fd, POLLIN, 0};
  EXPECT_EQ(poll(&p, 1, 50), 0) << "readable with no event left";
  for (int i = 100; i < kIds; ++i) rdma_destroy_id(ids[i]);
  rdma_destroy_event_channel(ch);
}

// A channel destroyed while another thread still uses it (rping destroys
// its channel without joining its CM thread, which may be between two
// gets): a get after the destroy behaves as a read of the kernel's closed
// fd would, never touching freed memory or a reused descriptor. Blocking:
// it stays blocked (rping's thread then waits for the process to exit,
// instead of failing it with EBADF); non-blocking: EBADF.
TEST(Cm, AGetAfterTheChannelIsDestroyedNeitherFailsNorReadsAnotherFd) {
  rdma_event_channel* blocking = rdma_create_event_channel();
  ASSERT_NE(blocking, nullptr);
  rdma_destroy_event_channel(blocking);
  // Static, and the channel by value: the thread outlives this test's
  // stack frame (ThreadSanitizer caught it reading the frame's reused
  // memory).
  static std::atomic<bool> returned{false};
  std::thread late([blocking] {
    rdma_cm_event* e = nullptr;
    rdma_get_cm_event(blocking, &e);
    returned = true;
  });
  late.detach();  // it never comes back
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_FALSE(returned.load()) << "a blocking get on a destroyed channel returned";

  rdma_event_channel* nb = rdma_create_event_channel();
  ASSERT_NE(nb, nullptr);
  fcntl(nb->fd, F_SETFL, fcntl(nb->fd, F_GETFL) | O_NONBLOCK);
  int old_fd = nb->fd;
  rdma_destroy_event_channel(nb);
  // The descriptor number goes to something else, with data waiting.
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv), 0);
  char byte = 7;
  int other = sv[0] == old_fd || sv[1] == old_fd ? (sv[0] == old_fd ? sv[0] : sv[1]) : -1;
  ASSERT_EQ(send(other == sv[0] ? sv[1] : sv[0], &byte, 1, 0), 1);
  rdma_cm_event* e = nullptr;
  errno = 0;
  EXPECT_EQ(rdma_get_cm_event(nb, &e), -1);
  EXPECT_EQ(errno, EBADF);
  if (other >= 0) {
    char got = 0;
    EXPECT_EQ(recv(other, &got, 1, MSG_DONTWAIT), 1) << "the get read another descriptor";
  }
  close(sv[0]);
  close(sv[1]);
}

TEST(Cm, PeerDeathFlushesAndDisconnects) {
  Listener l;
  ASSERT_TRUE(l.Start());
  std::string out;
  int rc = -2;
  std::thread child([&] {
    rc = RunSelf({}, {"--scenario", "cm-connect-die", std::to_string(l.port)}, &out);
  });
  rdma_cm_event* e = Expect(l.ch, RDMA_CM_EVENT_CONNECT_REQUEST, 30000);
  ASSERT_NE(e, nullptr);
  rdma_cm_id* id = e->id;
  rdma_ack_cm_event(e);
  ibv_qp_init_attr qa = QpAttr();
  ASSERT_EQ(rdma_create_qp(id, nullptr, &qa), 0);
  Buffer b = MakeBuffer(id->pd, 4096, IBV_ACCESS_LOCAL_WRITE);
  for (int i = 0; i < 4; ++i) ASSERT_EQ(PostRecv(id->qp, b, 0, 4096, i), 0);
  ASSERT_EQ(rdma_accept(id, nullptr), 0);
  e = Expect(l.ch, RDMA_CM_EVENT_ESTABLISHED);
  if (e) rdma_ack_cm_event(e);
  e = Expect(l.ch, RDMA_CM_EVENT_DISCONNECTED, 30000);
  if (e) rdma_ack_cm_event(e);
  child.join();
  EXPECT_EQ(rc, -1) << "the child kills itself: " << out;
  auto rx = PollN(id->recv_cq, 4);
  ASSERT_EQ(rx.size(), 4u);
  EXPECT_EQ(rx[0].status, IBV_WC_SUCCESS) << "the message sent before dying";
  for (int i = 1; i < 4; ++i) EXPECT_EQ(rx[i].status, IBV_WC_WR_FLUSH_ERR);
  rdma_destroy_qp(id);
  FreeBuffer(b);
  rdma_destroy_id(id);
}

// --- the shared-memory ring between two processes ---------------------------
//
// TSan sees one process and does not model the ring's fences, so the ring
// gets a stress test of its own: two processes, both sending at once,
// messages of 1 byte to three ring sizes through a 4 KiB ring (each one
// wraps the ring, fills it, and waits for the other side to drain it),
// every byte and the order checked on both sides. Over the TCP wire too
// (the suite's tcp variants), where it checks the framing instead.
constexpr int kStressMessages = 4000;  // each way
constexpr int kStressWindow = 8;       // sends in flight per side (QpAttr: 16 WRs)
constexpr size_t kStressMax = 12 * 1024;
constexpr uint32_t kChildBase = 1000000, kParentBase = 2000000;

uint32_t StressSize(uint32_t base, int i) {
  uint32_t x = (base + static_cast<uint32_t>(i)) * 2654435761u;
  x ^= x >> 13;
  return 1 + x % kStressMax;
}

// Sends kStressMessages (sizes and bytes from my_base) and receives as many
// (from peer_base) at once, from one thread. "" or what went wrong.
// The end: the side that `sends_done` then sends an empty message (it has
// all it was sent, and all it sent was acknowledged); the other side waits
// for it and only then disconnects. A disconnect before the last
// acknowledgement came back would flush the peer's last send.
std::string StressBothWays(rdma_cm_id* id, uint32_t my_base, uint32_t peer_base, bool sends_done) {
  constexpr int kSlots = 2 * kStressWindow;
  Buffer rx = MakeBuffer(id->pd, kSlots * kStressMax, IBV_ACCESS_LOCAL_WRITE);
  Buffer tx = MakeBuffer(id->pd, kStressWindow * kStressMax, 0);
  std::string err;
  std::deque<uint64_t> posted;  // receive slots, in the order they were posted
  for (int s = 0; s < kSlots && err.empty(); ++s) {
    if (PostRecv(id->qp, rx, s * kStressMax, kStressMax, s) != 0) err = "ibv_post_recv failed";
    posted.push_back(s);
  }
  int sent = 0, acked = 0, received = 0;
  bool peer_done = false;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(150);
  std::vector<ibv_cq*> cqs{id->send_cq};
  if (id->recv_cq != id->send_cq) cqs.push_back(id->recv_cq);
  while (err.empty() && (acked < kStressMessages || received < kStressMessages ||
                         (!sends_done && !peer_done))) {
    if (std::chrono::steady_clock::now() > deadline) {
      err = "timed out";
      break;
    }
    while (sent < kStressMessages && sent - acked < kStressWindow) {
      size_t at = static_cast<size_t>(sent % kStressWindow) * kStressMax;
      uint32_t len = StressSize(my_base, sent);
      Fill(tx.data.data() + at, len, my_base + static_cast<uint32_t>(sent));
      if (PostSend(id->qp, IBV_WR_SEND, tx, at, len, static_cast<uint64_t>(sent)) != 0) {
        err = "ibv_post_send failed";
        break;
      }
      ++sent;
    }
    for (ibv_cq* cq : cqs) {
      ibv_wc wc[16];
      int n = ibv_poll_cq(cq, 16, wc);
      for (int i = 0; i < n && err.empty(); ++i) {
        if (wc[i].status != IBV_WC_SUCCESS) {
          err = std::string("completion: ") + ibv_wc_status_str(wc[i].status);
        } else if (wc[i].opcode == IBV_WC_SEND) {
          if (wc[i].wr_id != static_cast<uint64_t>(acked)) err = "sends completed out of order";
          ++acked;
        } else if (received == kStressMessages) {
          if (wc[i].byte_len != 0) err = "a message after the last one";
          peer_done = true;
        } else {
          uint32_t want = StressSize(peer_base, received);
          size_t at = static_cast<size_t>(wc[i].wr_id) * kStressMax;
          if (wc[i].wr_id != posted.front())
            err = "receives completed out of order";
          else if (wc[i].byte_len != want)
            err = "message " + std::to_string(received) + ": " + std::to_string(wc[i].byte_len) +
                  " bytes, sent " + std::to_string(want);
          else if (!Check(rx.data.data() + at, want, peer_base + static_cast<uint32_t>(received)))
            err = "message " + std::to_string(received) + " (" + std::to_string(want) +
                  " bytes) arrived changed";
          posted.pop_front();
          ++received;
          if (err.empty() && PostRecv(id->qp, rx, at, kStressMax, wc[i].wr_id) != 0)
            err = "ibv_post_recv failed";
          posted.push_back(wc[i].wr_id);
        }
      }
    }
  }
  if (err.empty() && sends_done && PostSend(id->qp, IBV_WR_SEND, tx, 0, 0, kStressMessages) != 0)
    err = "ibv_post_send failed (the end)";  // its completion may be a flush: not read
  if (!err.empty())
    err += " (sent " + std::to_string(sent) + ", completed " + std::to_string(acked) +
           ", received " + std::to_string(received) + ")";
  FreeBuffer(rx);
  FreeBuffer(tx);
  return err;
}

TEST(Cm, TwoProcessesStressTheSharedRing) {
  Listener l;
  ASSERT_TRUE(l.Start());
  std::string out;
  int rc = -2;
  std::thread child([&] {
    rc = RunSelf({"SOFTVERBS_RING_KB=4"}, {"--scenario", "ring-stress", std::to_string(l.port)},
                 &out, 180);
  });
  rdma_cm_event* e = Expect(l.ch, RDMA_CM_EVENT_CONNECT_REQUEST, 30000);
  if (e == nullptr) {
    child.join();
    FAIL() << out;
  }
  rdma_cm_id* id = e->id;
  rdma_ack_cm_event(e);
  ibv_qp_init_attr qa = QpAttr();
  ASSERT_EQ(rdma_create_qp(id, nullptr, &qa), 0);
  rdma_conn_param p{};
  p.rnr_retry_count = 7;  // the peer may not have reposted yet: wait, as hardware does
  ASSERT_EQ(rdma_accept(id, &p), 0);
  e = Expect(l.ch, RDMA_CM_EVENT_ESTABLISHED);
  if (e) rdma_ack_cm_event(e);
  auto start = std::chrono::steady_clock::now();
  std::string err = StressBothWays(id, kParentBase, kChildBase, /*sends_done=*/false);
  EXPECT_EQ(err, "") << "this side";
  rdma_disconnect(id);  // after the other side's end (or at once on a failure)
  e = Expect(l.ch, RDMA_CM_EVENT_DISCONNECTED, 180000);
  if (e) rdma_ack_cm_event(e);
  child.join();
  EXPECT_EQ(rc, 0) << "the other side: " << out;
  RecordProperty("seconds", std::to_string(std::chrono::duration<double>(
                                std::chrono::steady_clock::now() - start).count()));
  rdma_destroy_qp(id);
  rdma_destroy_id(id);
}

}  // namespace

// Child side of PeerDeathFlushesAndDisconnects: connect, send one message,
// then die without a word.
int ScenarioCmConnectDie(uint16_t port) {
  Client c;
  if (!c.Resolve(port)) return 2;
  ibv_qp_init_attr qa = QpAttr();
  if (rdma_create_qp(c.id, nullptr, &qa) != 0) return 3;
  if (rdma_connect(c.id, nullptr) != 0) return 4;
  rdma_cm_event* e = Expect(c.ch, RDMA_CM_EVENT_ESTABLISHED);
  if (e == nullptr) return 5;
  rdma_ack_cm_event(e);
  Buffer b = MakeBuffer(c.id->pd, 64, IBV_ACCESS_LOCAL_WRITE);
  if (PostSend(c.id->qp, IBV_WR_SEND, b, 0, 64, 1) != 0) return 6;
  if (PollN(c.id->send_cq, 1).size() != 1) return 7;
  kill(getpid(), SIGKILL);
  return 8;
}

// Child side of TwoProcessesStressTheSharedRing: connect (this side makes
// the shared segment, so SOFTVERBS_RING_KB here sizes both rings), then
// both ways at once, then the end message, then wait for the disconnect.
int ScenarioRingStress(uint16_t port) {
  Client c;
  if (!c.Resolve(port)) return 2;
  ibv_qp_init_attr qa = QpAttr();
  if (rdma_create_qp(c.id, nullptr, &qa) != 0) return 3;
  rdma_conn_param p{};
  p.rnr_retry_count = 7;
  if (rdma_connect(c.id, &p) != 0) return 4;
  rdma_cm_event* e = Expect(c.ch, RDMA_CM_EVENT_ESTABLISHED);
  if (e == nullptr) return 5;
  rdma_ack_cm_event(e);
  std::string err = StressBothWays(c.id, kChildBase, kParentBase, /*sends_done=*/true);
  if (!err.empty()) {
    fprintf(stderr, "ring-stress: %s\n", err.c_str());
    return 6;
  }
  e = Expect(c.ch, RDMA_CM_EVENT_DISCONNECTED, 60000);  // the other side's, once it has the end
  if (e) rdma_ack_cm_event(e);
  printf("ring-stress: %d messages each way, every byte as sent\n", kStressMessages);
  return 0;
}
