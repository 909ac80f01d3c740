// File: src/glue/switch_endpoint.h
//
// A grpc_endpoint that starts on a TCP connection and moves to an RDMA
// connection once one joins it, so a new channel's first calls wait for
// TCP's connect only, never for RDMA CM's longer exchange (TF_RDMA_TCP_FIRST).
//
// Each direction moves on its own. A writer keeps writing TCP until the
// RDMA connection is attached and no TCP write of its is in flight (the
// client also waits for the server's header, which says the server joined
// the two); it then writes, first on the RDMA connection, a 16-byte
// header: "my TCP stream ends at byte N" (kSwitchMagic, then N,
// little-endian), and every later write goes by RDMA. A reader reads TCP
// until it has N bytes from it, then reads RDMA. The TCP stream stays
// HTTP/2 (the join token's frame below is one every receiver skips), so a
// peer without the plugin sees an ordinary connection.
// An RDMA connection that fails, or brings no header, before this side's
// writes moved leaves the endpoint on TCP; after, the endpoint fails as any
// endpoint whose connection broke. The TCP connection stays open, idle,
// until the endpoint is destroyed.
//
// The join token: a client writes a random token into its TCP stream, as
// an HTTP/2 frame of a type HTTP/2 leaves unassigned (which every HTTP/2
// receiver skips, gRPC's among them) right after the SETTINGS frame that
// follows its preface, and names the same token in its RDMA Hello. The
// server joins an RDMA connection only to the TCP stream that carried its
// token, so no other process on the client's host can take a plaintext
// connection's RDMA half. A stream that does not start with HTTP/2's
// preface (TLS's handshake) carries no token: it is joined by address
// alone, and TLS's own integrity checks stand guard.
#ifndef GRPC_RDMA_SRC_GLUE_SWITCH_ENDPOINT_H_
#define GRPC_RDMA_SRC_GLUE_SWITCH_ENDPOINT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "engine/engine.h"
#include "src/core/lib/iomgr/endpoint.h"

namespace grpc_rdma {

struct Switch;

// The join token's frame: 9-byte HTTP/2 frame header (length 24, type
// kJoinFrameType, no flags, stream 0), then kJoinFrameLabel and the token.
constexpr uint8_t kJoinFrameType = 0xf5;
constexpr char kJoinFrameLabel[] = "GRDMAJT1";  // 8 bytes
constexpr size_t kJoinFrameBytes = 9 + 8 + kJoinTokenBytes;
std::string JoinFrame(absl::string_view token);

// Where a client's first write takes the token's frame: after the preface
// and the SETTINGS frame that follows it, if `head` (the write's first
// bytes) holds both whole; 0 when it does not.
size_t JoinFrameOffset(absl::string_view head);
// Puts `frame` into a client's first write `slices` at JoinFrameOffset,
// however the write's bytes are cut into slices; false (and `slices` as it
// was) when the write does not hold the preface and its SETTINGS whole.
bool InsertJoinFrame(grpc_slice_buffer* slices, absl::string_view frame);

// What the first bytes a server read of a TCP stream say of its token.
enum class StreamHead {
  kNeedMore,      // not decided yet: read on
  kToken,         // plaintext HTTP/2 with a token (*token set)
  kNoToken,       // plaintext HTTP/2 without one: never joined
  kNotPlaintext,  // no HTTP/2 preface (TLS's handshake): joined by address
};
StreamHead ReadStreamHead(absl::string_view head, std::string* token);
// The most bytes ReadStreamHead needs to decide.
constexpr size_t kMaxStreamHead = 24 + 9 + 4096 + kJoinFrameBytes;

// "GRDMASW1" (as little-endian bytes), the first 8 bytes of each
// direction's RDMA stream.
constexpr uint64_t kSwitchMagic = 0x315753414d445247ull;
constexpr size_t kSwitchHeaderBytes = 16;

// Wraps `tcp` (taken over: destroyed with the endpoint). The returned
// handle outlives the endpoint; AttachRdma on it after gRPC destroyed or
// shut the endpoint down shuts the connection down.
std::shared_ptr<Switch> CreateSwitchEndpoint(grpc_endpoint* tcp, bool server,
                                             grpc_endpoint** out);

// Attaches an established RDMA connection that joins the endpoint's TCP
// connection; both directions move to it as described above. false (and
// `conn` shut down) when the endpoint is gone or has one already.
bool AttachRdma(const std::shared_ptr<Switch>& sw, std::shared_ptr<Connection> conn);

// `fn` runs once, when the endpoint goes (shut down or destroyed) before
// an RDMA connection joined it, or at once if it went already: the client
// cancels its RDMA connect there.
void SetOnGone(const std::shared_ptr<Switch>& sw, std::function<void()> fn);

// `fn` runs once if the RDMA connection is dropped before this side's
// writes moved to it (the endpoint stays on TCP). Set before AttachRdma.
void SetOnDropped(const std::shared_ptr<Switch>& sw, std::function<void()> fn);

// A client's: `token` (kJoinTokenBytes) goes into the TCP stream as its
// frame, in gRPC's first write. Set before gRPC has the endpoint.
void SendJoinToken(const std::shared_ptr<Switch>& sw, std::string token);

// A server's: `fn` runs once, when the head of the TCP stream is read, with
// what it says (kToken, kNoToken or kNotPlaintext) and the client's token
// ("" but for kToken). Not if the stream ends first. Set before gRPC has
// the endpoint.
void OnStreamHead(const std::shared_ptr<Switch>& sw,
                  std::function<void(StreamHead, std::string)> fn);

// Whether the endpoint takes no RDMA connection any more: it has one, or
// gRPC shut it down or destroyed it, or it failed.
bool SwitchGone(const std::shared_ptr<Switch>& sw);

// The TCP connection's peer ("10.0.0.2:41234"; "" unless IPv4), as the
// RDMA connection that joins it names it.
std::string SwitchTcpPeer(const std::shared_ptr<Switch>& sw);

// Where each direction stands (for tests and traces).
struct SwitchProgress {
  bool writes_rdma = false;  // the header went out: writes go by RDMA
  bool reads_rdma = false;   // the peer's TCP bytes are all read: reads go by RDMA
  uint64_t tcp_written = 0;  // bytes written on TCP
  uint64_t tcp_read = 0;     // bytes read from TCP
};
SwitchProgress ProgressOf(const std::shared_ptr<Switch>& sw);

// "ipv4:10.0.0.2:41234" (gRPC's address form) -> "10.0.0.2:41234"; "" for
// other forms (IPv6, unix).
std::string Ipv4HostPort(absl::string_view grpc_address);

}  // namespace grpc_rdma

#endif  // GRPC_RDMA_SRC_GLUE_SWITCH_ENDPOINT_H_
