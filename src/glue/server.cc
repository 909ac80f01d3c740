// The server side: gRPC's TCP server vtable, replaced by one that wraps
// gRPC's own TCP server (every TCP call goes to it) and also listens on RDMA
// CM at each address and port the TCP server binds. Accepted RDMA
// connections reach gRPC through the same accept callback as TCP ones.
#include <arpa/inet.h>
#include <grpc/support/alloc.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "glue/args.h"
#include "glue/endpoint.h"
#include "glue/runtime.h"
#include "glue/stats.h"
#include "glue/switch_endpoint.h"
#include "glue/trace.h"
#include "grpc_rdma/grpc_rdma.h"
#include "src/core/lib/iomgr/exec_ctx.h"
#include "src/core/lib/iomgr/timer.h"

namespace grpc_rdma {
namespace {

// What RDMA accept callbacks share with the server; it outlives the server
// because the engine may still hold an accept callback when the server goes.
struct AcceptState {
  std::mutex mu;  // held while a connection is handed to gRPC
  bool gone = false;
  bool started = false;
  grpc_tcp_server* self = nullptr;  // the wrapper, as gRPC knows it
  std::vector<grpc_pollset*> pollsets;
  size_t next_pollset = 0;
  grpc_tcp_server_cb on_accept = nullptr;
  void* on_accept_arg = nullptr;
  // Connections accepted before start(): handed over at start.
  std::vector<std::pair<std::shared_ptr<Connection>, unsigned>> early;
  // The ports (by index) RDMA CM listens on: their TCP connections may be
  // joined by an RDMA connection (TF_RDMA_TCP_FIRST clients), if the
  // server's own TF_RDMA_TCP_FIRST (or argument) says so.
  std::set<unsigned> rdma_ports;
  bool join_tcp = false;
};

// TCP connections an RDMA connection may join, and RDMA connections that
// came before the TCP connection they join was offered (its head read).
// Keyed "client-ip:client-port>server-port": the client's end of the TCP
// connection as the RDMA connection names it, and the server's address and
// port it reached ("10.0.0.2:41234>10.0.0.1:50051"). An RDMA connection
// joins a TCP connection only if it names the token that stream carried
// (a stream with no preface, TLS's, carries none: any from its host may).
struct Joins {
  std::mutex mu;
  // An ended endpoint stays kJoinWait after a sweep found it ended, so an
  // RDMA connection that comes late is closed at once, not kept waiting.
  struct Tcp {
    std::weak_ptr<Switch> sw;
    std::string token;  // "" for a stream that is not plaintext HTTP/2
    // false: plaintext without a token; an RDMA connection that names it
    // is closed at once rather than kept waiting.
    bool joinable = true;
    std::chrono::steady_clock::time_point ended{};  // when a sweep found it gone
  };
  std::map<std::string, Tcp> tcp;
  size_t swept_at = 64;  // sweep when the map reaches this
  struct Early {
    std::shared_ptr<Connection> conn;
    std::chrono::steady_clock::time_point until;
  };
  // Several may wait for one stream, so that one naming it with a wrong
  // token cannot keep its own client's out.
  std::multimap<std::string, Early> rdma;
};
Joins& J() {
  static auto* j = new Joins;
  return *j;
}

// How long an RDMA connection waits for the TCP connection it joins to be
// accepted, and how many may wait: in all, and for one stream.
constexpr auto kJoinWait = std::chrono::seconds(5);
constexpr size_t kMaxEarly = 256;
constexpr size_t kMaxEarlyPerStream = 4;

// Under J().mu: the RDMA connections that waited too long, taken out.
void ExpireEarlyLocked(std::vector<std::shared_ptr<Connection>>* out) {
  auto now = std::chrono::steady_clock::now();
  for (auto it = J().rdma.begin(); it != J().rdma.end();) {
    if (it->second.until <= now) {
      out->push_back(std::move(it->second.conn));
      it = J().rdma.erase(it);
    } else {
      ++it;
    }
  }
}

// Whether two tokens are the same, in a time that does not depend on where
// they differ.
bool SameToken(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

// Whether `conn` may join the TCP stream `tcp` (its token, if it has one).
bool MayJoin(const std::shared_ptr<Connection>& conn, const Joins::Tcp& tcp) {
  return tcp.joinable && (tcp.token.empty() || SameToken(conn->join_token(), tcp.token));
}

// A peer that keeps naming streams with tokens they did not carry (a client
// misconfigured, or a scan) gets one ERROR line per kRefusalLogEvery, with
// the count of the refusals not logged since, so that it cannot flood the
// log; each refusal is traced (GRPC_TRACE=rdma). Whether this one is
// logged, and how many were not before it.
constexpr auto kRefusalLogEvery = std::chrono::seconds(10);
bool RefusalLogDue(uint64_t* unlogged) {
  static std::mutex mu;
  static std::chrono::steady_clock::time_point next;
  static uint64_t skipped = 0;
  std::lock_guard<std::mutex> g(mu);
  auto now = std::chrono::steady_clock::now();
  if (now < next) {
    ++skipped;
    return false;
  }
  next = now + kRefusalLogEvery;
  *unlogged = skipped;
  skipped = 0;
  return true;
}

// Without J().mu: an RDMA connection that may not join the stream it names.
void Refuse(const std::shared_ptr<Connection>& conn, bool joinable) {
  if (conn == nullptr) return;
  if (!joinable) {
    GRPC_RDMA_TRACE("%s: the TCP connection from %s it joins carries no join token (a plain "
                    "client's, or a TCP-first client's from before the token): closed",
                    conn->peer().c_str(), conn->joins().c_str());
    conn->Shutdown(absl::UnavailableError("that TCP stream carries no join token"));
    return;
  }
  GRPC_RDMA_TRACE("%s: names the TCP connection from %s with a join token that stream did not "
                  "carry: refused", conn->peer().c_str(), conn->joins().c_str());
  uint64_t unlogged = 0;
  if (RefusalLogDue(&unlogged)) {
    std::string more;
    if (unlogged != 0)
      more = " (and " + std::to_string(unlogged) + " more since the last such line, not logged)";
    gpr_log(GPR_ERROR,
            "grpc_rdma: refusing an RDMA connection from %s that names the TCP connection from "
            "%s with a join token that stream did not carry%s",
            conn->peer().c_str(), conn->joins().c_str(), more.c_str());
  }
  conn->Shutdown(absl::PermissionDeniedError("wrong join token"));
}

void DropEarly(std::vector<std::shared_ptr<Connection>>* conns) {
  for (auto& c : *conns) {
    GRPC_RDMA_TRACE("%s: no open TCP connection to join: closed", c->peer().c_str());
    c->Shutdown(absl::UnavailableError("no open TCP connection to join"));
  }
}

// A TCP connection whose head was read: registered for an RDMA connection
// to join (with its token, if it carries one; by address, if it is not
// plaintext HTTP/2), or joined at once by one that came first. A plaintext
// stream without a token is registered as one nobody joins.
void OfferTcp(const std::shared_ptr<Switch>& sw, const std::string& key, StreamHead head,
              std::string token) {
  Joins::Tcp entry{sw, std::move(token), head != StreamHead::kNoToken, {}};
  std::shared_ptr<Connection> early;
  std::vector<std::shared_ptr<Connection>> expired, refused;
  {
    std::lock_guard<std::mutex> g(J().mu);
    ExpireEarlyLocked(&expired);
    // Of those that came first, the one with the stream's token joins it;
    // the others are refused (or, with its token too, closed: it is taken).
    auto range = J().rdma.equal_range(key);
    for (auto it = range.first; it != range.second; ++it) {
      if (!MayJoin(it->second.conn, entry)) {
        refused.push_back(std::move(it->second.conn));
      } else if (early == nullptr) {
        early = std::move(it->second.conn);
      } else {
        expired.push_back(std::move(it->second.conn));
      }
    }
    J().rdma.erase(range.first, range.second);
    if (early == nullptr) {
      J().tcp[key] = entry;
      if (J().tcp.size() >= J().swept_at) {
        auto now = std::chrono::steady_clock::now();
        for (auto t = J().tcp.begin(); t != J().tcp.end();) {
          Joins::Tcp& e = t->second;
          if (!e.sw.expired()) {
            ++t;
          } else if (e.ended == std::chrono::steady_clock::time_point{}) {
            e.ended = now;
            ++t;
          } else {
            t = now - e.ended > kJoinWait ? J().tcp.erase(t) : std::next(t);
          }
        }
        J().swept_at = std::max<size_t>(64, 2 * J().tcp.size());
      }
    }
  }
  DropEarly(&expired);
  for (const auto& c : refused) Refuse(c, entry.joinable);
  if (early != nullptr) AttachRdma(sw, std::move(early));
}

// Closes the RDMA connection `waiting` for `key` after kJoinWait, if it
// still waits then. An iomgr timer, not one of the default EventEngine's:
// that engine lives only while something holds it, and one destroyed with
// a timer pending (a server shut down within kJoinWait of an early RDMA
// connection) aborts the process; iomgr runs pending timers, cancelled, at
// gRPC's shutdown. Needs an ExecCtx.
struct EarlyTimer {
  grpc_timer timer;
  grpc_closure fired;
  std::string key;
  std::weak_ptr<Connection> waiting;
};

void OnEarlyTimer(void* arg, grpc_error_handle /*error: fired or shut down, the same*/) {
  std::unique_ptr<EarlyTimer> t(static_cast<EarlyTimer*>(arg));
  std::shared_ptr<Connection> late;
  std::shared_ptr<Connection> w = t->waiting.lock();  // let go without J().mu
  {
    std::lock_guard<std::mutex> g(J().mu);
    auto range = J().rdma.equal_range(t->key);
    for (auto it = range.first; w != nullptr && it != range.second; ++it) {
      if (it->second.conn == w) {
        late = std::move(it->second.conn);
        J().rdma.erase(it);
        break;
      }
    }
  }
  if (late != nullptr) {
    std::vector<std::shared_ptr<Connection>> one{std::move(late)};
    DropEarly(&one);
  }
}

void StartEarlyTimer(const std::string& key, std::weak_ptr<Connection> waiting) {
  auto* t = new EarlyTimer{};
  t->key = key;
  t->waiting = std::move(waiting);
  GRPC_CLOSURE_INIT(&t->fired, OnEarlyTimer, t, nullptr);
  grpc_timer_init(&t->timer,
                  grpc_core::Timestamp::Now() +
                      grpc_core::Duration::Milliseconds(
                          std::chrono::duration_cast<std::chrono::milliseconds>(kJoinWait).count()),
                  &t->fired);
}

// An accepted RDMA connection that joins a TCP connection (conn->joins()).
void JoinTcp(std::shared_ptr<Connection> conn) {
  std::string joins = conn->joins();
  std::string peer = conn->peer();  // "rdma:ip:port"
  std::string peer_ip = peer.substr(peer.find(':') + 1);
  peer_ip = peer_ip.substr(0, peer_ip.rfind(':'));
  if (joins.substr(0, joins.rfind(':')) != peer_ip) {
    gpr_log(GPR_ERROR,
            "grpc_rdma: refusing an RDMA connection from %s that says it joins the TCP "
            "connection from %s: another host's",
            peer.c_str(), joins.c_str());
    conn->Shutdown(absl::PermissionDeniedError("joins another host's TCP connection"));
    return;
  }
  std::string local = conn->local();  // "rdma:ip:port"
  std::string key = joins + ">" + local.substr(local.find(':') + 1);
  std::shared_ptr<Switch> sw, not_joined;  // not_joined: let go without J().mu
  std::shared_ptr<Connection> refused;
  bool joinable = true;
  std::vector<std::shared_ptr<Connection>> expired;
  {
    std::lock_guard<std::mutex> g(J().mu);
    ExpireEarlyLocked(&expired);
    auto it = J().tcp.find(key);
    bool ended = false;
    if (it != J().tcp.end()) {
      sw = it->second.sw.lock();
      ended = sw == nullptr;  // its TCP connection came and went: nothing to join
      // A wrong token is refused; the stream stays offered to the right one.
      if (!ended && !MayJoin(conn, it->second)) {
        not_joined = std::move(sw);
        joinable = it->second.joinable;
        refused = std::move(conn);
      } else {
        J().tcp.erase(it);
      }
    }
    if (refused != nullptr) {
      // Refused below, without J().mu.
    } else if (ended) {
      expired.push_back(std::move(conn));
    } else if (sw == nullptr) {
      if (J().rdma.size() >= kMaxEarly || J().rdma.count(key) >= kMaxEarlyPerStream) {
        expired.push_back(std::move(conn));
      } else {
        std::weak_ptr<Connection> waiting = conn;
        J().rdma.emplace(key, Joins::Early{std::move(conn),
                                           std::chrono::steady_clock::now() + kJoinWait});
        // Closed after kJoinWait even if nothing else comes to sweep it:
        // its client waits on it (for our header) until then.
        StartEarlyTimer(key, waiting);
      }
    }
  }
  DropEarly(&expired);
  Refuse(refused, joinable);
  if (sw != nullptr) AttachRdma(sw, std::move(conn));
}

struct Server {
  grpc_tcp_server* tcp = nullptr;
  grpc_closure* shutdown_complete = nullptr;  // the caller's
  grpc_closure on_tcp_destroyed;
  std::shared_ptr<AcceptState> as = std::make_shared<AcceptState>();
  std::mutex mu;
  std::vector<sockaddr_in> rdma_listeners;
  unsigned ports_added = 0;
  bool rdma = true;  // GRPC_RDMA_ARG_ENABLED=0: TCP only
  std::vector<int> tcp_only_ports;  // GRPC_RDMA_ARG_TCP_ONLY_PORTS
};

grpc_tcp_server_vtable* Tcp() { return Runtime::Get()->tcp_server(); }

// gRPC's TCP server also calls the grpc_tcp_server_* functions, and so this
// vtable, on itself (its unref shuts its listeners down that way): every
// entry point tells the wrappers from gRPC's own servers by this registry.
struct Registry {
  std::mutex mu;
  std::set<const void*> servers;
};
Registry& Wrappers() {
  static auto* r = new Registry;
  return *r;
}
Server* Ours(grpc_tcp_server* s) {
  std::lock_guard<std::mutex> g(Wrappers().mu);
  return Wrappers().servers.count(s) ? reinterpret_cast<Server*>(s) : nullptr;
}
// The TCP server behind `s`: the wrapped one, or `s` itself.
grpc_tcp_server* TcpOf(grpc_tcp_server* s) {
  Server* w = Ours(s);
  return w != nullptr ? w->tcp : s;
}

// Under as->mu, after start: gives one RDMA connection to gRPC.
void HandOverLocked(AcceptState* as, std::shared_ptr<Connection> conn, unsigned port_index) {
  auto* acceptor = static_cast<grpc_tcp_server_acceptor*>(gpr_malloc(sizeof(grpc_tcp_server_acceptor)));
  acceptor->from_server = as->self;
  acceptor->port_index = port_index;
  acceptor->fd_index = 0;
  acceptor->external_connection = false;
  acceptor->listener_fd = -1;
  acceptor->pending_data = nullptr;
  grpc_pollset* pollset = as->pollsets.empty()
                              ? nullptr
                              : as->pollsets[as->next_pollset++ % as->pollsets.size()];
  grpc_endpoint* ep = CreateRdmaEndpoint(std::move(conn), /*server=*/true);
  as->on_accept(as->on_accept_arg, ep, pollset, acceptor);
}

void OnRdmaAccept(const std::shared_ptr<AcceptState>& as, std::shared_ptr<Connection> conn,
                  unsigned port_index) {
  grpc_core::ApplicationCallbackExecCtx callback_exec_ctx;
  grpc_core::ExecCtx exec_ctx;
  if (!conn->joins().empty()) {
    bool join;
    {
      std::lock_guard<std::mutex> g(as->mu);
      join = as->join_tcp && !as->gone;
    }
    if (join) return JoinTcp(std::move(conn));
    // The client's TCP connection carries on alone.
    GRPC_RDMA_TRACE("%s: asks to join a TCP connection; this server joins none "
                    "(TF_RDMA_TCP_FIRST is off): closed",
                    conn->peer().c_str());
    conn->Shutdown(absl::UnavailableError("this server joins no TCP connection"));
    return;
  }
  std::lock_guard<std::mutex> g(as->mu);
  if (as->gone) {
    conn->Shutdown(absl::UnavailableError("server shut down"));
    return;
  }
  if (!as->started) {
    as->early.emplace_back(std::move(conn), port_index);
    return;
  }
  HandOverLocked(as.get(), std::move(conn), port_index);
}

void StopRdma(Server* s) {
  std::vector<sockaddr_in> listeners;
  {
    std::lock_guard<std::mutex> g(s->mu);
    listeners.swap(s->rdma_listeners);
  }
  Engine* engine = listeners.empty() ? nullptr : Runtime::Get()->engine();
  for (const sockaddr_in& a : listeners) {
    GRPC_RDMA_TRACE("server: stops listening on RDMA CM port %u", ntohs(a.sin_port));
    engine->StopListening(a);
    Runtime::Get()->ReleasePolling();
  }
}

// gRPC's TCP server is gone: so goes the wrapper.
void OnTcpDestroyed(void* arg, grpc_error_handle error) {
  Server* s = static_cast<Server*>(arg);
  {
    std::lock_guard<std::mutex> g(Wrappers().mu);
    Wrappers().servers.erase(s);
  }
  StopRdma(s);
  std::vector<std::pair<std::shared_ptr<Connection>, unsigned>> early;
  {
    std::lock_guard<std::mutex> g(s->as->mu);  // waits for a hand-over under way
    s->as->gone = true;
    early.swap(s->as->early);
  }
  for (auto& [c, i] : early) c->Shutdown(absl::UnavailableError("server shut down"));
  if (s->shutdown_complete != nullptr) {
    grpc_core::ExecCtx::Run(DEBUG_LOCATION, s->shutdown_complete, std::move(error));
  }
  delete s;
}

// TCP connections keep going straight to gRPC, but name the wrapper as
// their server.
void OnTcpAccept(void* arg, grpc_endpoint* ep, grpc_pollset* pollset,
                 grpc_tcp_server_acceptor* acceptor) {
  auto* as = static_cast<AcceptState*>(arg);
  acceptor->from_server = as->self;
  GlobalCounters().tcp_server.fetch_add(1);
  bool joinable;
  {
    std::lock_guard<std::mutex> g(as->mu);
    joinable = as->join_tcp && as->rdma_ports.count(acceptor->port_index) != 0;
  }
  if (joinable) {
    grpc_endpoint* wrapped = nullptr;
    std::shared_ptr<Switch> sw = CreateSwitchEndpoint(ep, /*server=*/true, &wrapped);
    std::string client = SwitchTcpPeer(sw);
    std::string server = Ipv4HostPort(grpc_endpoint_get_local_address(wrapped));
    if (!client.empty() && !server.empty()) {  // IPv6: RDMA CM serves IPv4 only
      std::weak_ptr<Switch> weak = sw;
      std::string key = client + ">" + server;
      OnStreamHead(sw, [weak, key](StreamHead head, std::string token) {
        if (std::shared_ptr<Switch> s = weak.lock()) OfferTcp(s, key, head, std::move(token));
      });
    }
    ep = wrapped;
  }
  as->on_accept(as->on_accept_arg, ep, pollset, acceptor);
}

grpc_error_handle Create(grpc_closure* shutdown_complete,
                         const grpc_event_engine::experimental::EndpointConfig& config,
                         grpc_tcp_server** server) {
  auto* s = new Server;
  s->shutdown_complete = shutdown_complete;
  ArgSettings settings = SettingsFor(config, Runtime::Get()->options());
  s->rdma = settings.enabled;
  s->tcp_only_ports = std::move(settings.tcp_only_ports);
  s->as->join_tcp = settings.tcp_first;
  GRPC_CLOSURE_INIT(&s->on_tcp_destroyed, OnTcpDestroyed, s, nullptr);
  grpc_error_handle err = Tcp()->create(&s->on_tcp_destroyed, config, &s->tcp);
  if (!err.ok()) {
    delete s;
    return err;
  }
  s->as->self = reinterpret_cast<grpc_tcp_server*>(s);
  {
    std::lock_guard<std::mutex> g(Wrappers().mu);
    Wrappers().servers.insert(s);
  }
  *server = reinterpret_cast<grpc_tcp_server*>(s);
  return absl::OkStatus();
}

void Start(grpc_tcp_server* server, const std::vector<grpc_pollset*>* pollsets,
           grpc_tcp_server_cb on_accept_cb, void* cb_arg) {
  Server* s = Ours(server);
  if (s == nullptr) return Tcp()->start(server, pollsets, on_accept_cb, cb_arg);
  AcceptState* as = s->as.get();
  {
    std::lock_guard<std::mutex> g(as->mu);
    if (pollsets != nullptr) as->pollsets = *pollsets;
    as->on_accept = on_accept_cb;
    as->on_accept_arg = cb_arg;
    as->started = true;
    for (auto& [c, i] : as->early) HandOverLocked(as, std::move(c), i);
    as->early.clear();
  }
  Tcp()->start(s->tcp, pollsets, OnTcpAccept, as);
}

// Where RDMA CM should listen for a TCP port of this server: false (and
// why, traced) when the port serves TCP only.
bool RdmaAddressFor(Server* s, const grpc_resolved_address* addr, int port, sockaddr_in* sin) {
  *sin = sockaddr_in{};
  if (IsWildcard(addr)) {
    sin->sin_family = AF_INET;
    sin->sin_addr.s_addr = htonl(INADDR_ANY);
  } else if (!ToIpv4(addr, sin)) {
    return false;  // IPv6 only: TCP alone
  }
  sin->sin_port = htons(static_cast<uint16_t>(port));
  if (!s->rdma) {
    GRPC_RDMA_TRACE("server: port %d serves TCP only (" GRPC_RDMA_ARG_ENABLED "=0)", port);
    return false;
  }
  if (std::find(s->tcp_only_ports.begin(), s->tcp_only_ports.end(), port) !=
      s->tcp_only_ports.end()) {
    GRPC_RDMA_TRACE("server: port %d serves TCP only (" GRPC_RDMA_ARG_TCP_ONLY_PORTS ")", port);
    return false;
  }
  return Runtime::Get()->engine() != nullptr;
}

// The ERROR line for a port RDMA CM could not listen on, said once TCP
// serves it (when TCP cannot either, gRPC's own error says why, and a line
// saying the port serves TCP would be wrong).
void SayTcpOnly(const sockaddr_in& sin, const absl::Status& why) {
  char ip[INET_ADDRSTRLEN] = "?";
  inet_ntop(AF_INET, &sin.sin_addr, ip, sizeof(ip));
  gpr_log(GPR_ERROR, "grpc_rdma: cannot listen on RDMA CM %s:%d (%s): this port serves TCP only",
          ip, ntohs(sin.sin_port), std::string(why.message()).c_str());
}

// RDMA CM listens at `sin` for the server's port `port_index`; why not,
// for SayTcpOnly once TCP has the port.
absl::Status ListenRdma(Server* s, sockaddr_in sin, unsigned port_index) {
  std::weak_ptr<AcceptState> weak = s->as;
  absl::StatusOr<uint16_t> port =
      Runtime::Get()->engine()->Listen(sin, [weak, port_index](std::shared_ptr<Connection> c) {
        if (auto as = weak.lock()) {
          OnRdmaAccept(as, std::move(c), port_index);
        } else {
          c->Shutdown(absl::UnavailableError("server shut down"));
        }
      });
  if (!port.ok()) return port.status();
  char ip[INET_ADDRSTRLEN] = "?";
  inet_ntop(AF_INET, &sin.sin_addr, ip, sizeof(ip));
  GRPC_RDMA_TRACE("server: listening on RDMA CM %s:%d and TCP", ip, ntohs(sin.sin_port));
  sin.sin_port = htons(*port);
  Runtime::Get()->AcquirePolling();
  {
    std::lock_guard<std::mutex> g(s->as->mu);
    s->as->rdma_ports.insert(port_index);
  }
  std::lock_guard<std::mutex> g(s->mu);
  s->rdma_listeners.push_back(sin);
  return absl::OkStatus();
}

int RequestedPort(const grpc_resolved_address* addr) {
  const auto* sa = reinterpret_cast<const sockaddr*>(addr->addr);
  if (sa->sa_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(sa)->sin_port);
  if (sa->sa_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(sa)->sin6_port);
  return 0;
}

grpc_error_handle AddPort(grpc_tcp_server* server, const grpc_resolved_address* addr,
                          int* out_port) {
  Server* s = Ours(server);
  if (s == nullptr) return Tcp()->add_port(server, addr, out_port);
  sockaddr_in sin{};
  // A port named in advance (as a server restarted on its port is): RDMA CM
  // listens before TCP does. The other way round, a client retrying the
  // restarting server could find TCP up and no RDMA listener yet, and
  // remember the address as TCP-only (TF_RDMA_FALLBACK_TTL_S). Port 0 has
  // no such clients: TCP picks the port, then RDMA CM listens on it.
  int wanted = RequestedPort(addr);
  if (wanted > 0 && RdmaAddressFor(s, addr, wanted, &sin)) {
    unsigned port_index;
    {
      std::lock_guard<std::mutex> g(s->mu);
      port_index = s->ports_added;  // taken once TCP has it too
    }
    absl::Status rdma = ListenRdma(s, sin, port_index);
    grpc_error_handle err = Tcp()->add_port(s->tcp, addr, out_port);
    if (!err.ok()) {
      if (rdma.ok()) {
        Runtime::Get()->engine()->StopListening(sin);
        Runtime::Get()->ReleasePolling();
        {
          std::lock_guard<std::mutex> g(s->as->mu);
          s->as->rdma_ports.erase(port_index);
        }
        std::lock_guard<std::mutex> g(s->mu);
        s->rdma_listeners.pop_back();
      }
      return err;
    }
    if (!rdma.ok()) SayTcpOnly(sin, rdma);
    std::lock_guard<std::mutex> g(s->mu);
    ++s->ports_added;
    return err;
  }
  grpc_error_handle err = Tcp()->add_port(s->tcp, addr, out_port);
  if (!err.ok()) return err;
  unsigned port_index;
  {
    std::lock_guard<std::mutex> g(s->mu);
    port_index = s->ports_added++;
  }
  if (RdmaAddressFor(s, addr, *out_port, &sin)) {
    if (absl::Status rdma = ListenRdma(s, sin, port_index); !rdma.ok()) SayTcpOnly(sin, rdma);
  }
  return err;
}

grpc_core::TcpServerFdHandler* CreateFdHandler(grpc_tcp_server* s) {
  return Tcp()->create_fd_handler(TcpOf(s));
}
unsigned PortFdCount(grpc_tcp_server* s, unsigned port_index) {
  return Tcp()->port_fd_count(TcpOf(s), port_index);
}
int PortFd(grpc_tcp_server* s, unsigned port_index, unsigned fd_index) {
  return Tcp()->port_fd(TcpOf(s), port_index, fd_index);
}
grpc_tcp_server* Ref(grpc_tcp_server* s) {
  Tcp()->ref(TcpOf(s));
  return s;
}
void ShutdownStartingAdd(grpc_tcp_server* s, grpc_closure* shutdown_starting) {
  Tcp()->shutdown_starting_add(TcpOf(s), shutdown_starting);
}
void Unref(grpc_tcp_server* s) { Tcp()->unref(TcpOf(s)); }
void ShutdownListeners(grpc_tcp_server* s) {
  if (Server* w = Ours(s)) StopRdma(w);
  Tcp()->shutdown_listeners(TcpOf(s));
}

}  // namespace

grpc_tcp_server_vtable kRdmaTcpServerVtable = {
    Create, Start, AddPort, CreateFdHandler, PortFdCount, PortFd,
    Ref,    ShutdownStartingAdd, Unref, ShutdownListeners};

}  // namespace grpc_rdma
