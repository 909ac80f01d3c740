// File: src/engine/wire.h
//
// The engine's wire format (docs/wire-protocol.md has the full story).
//
// Every message travels as a two-sided SEND into one of the receive buffers
// the peer posted (eager_depth of them, each acc_size + kHeaderBytes), and
// starts with a Header. Rendezvous chunks travel as RDMA WRITE WITH
// IMMEDIATE into a buffer the receiver granted; the immediate is the grant
// id. Both consume one of the peer's posted receives: one credit. A
// mid-size message may instead go at once, whole, into a standing grant
// (kStanding) the receiver made ahead of time.
//
// Both ends are assumed to share byte order (all fields are host order);
// the handshake's magic catches a mismatch.
#ifndef GRPC_RDMA_SRC_ENGINE_WIRE_H_
#define GRPC_RDMA_SRC_ENGINE_WIRE_H_

#include <cstddef>
#include <cstdint>

namespace grpc_rdma {
namespace wire {

constexpr uint32_t kMagic = 0x52444d41;  // "RDMA"
constexpr uint16_t kVersion = 2;

enum Type : uint8_t {
  kData = 1,    // payload: stream bytes (len of them)
  kRts = 2,     // a large write follows: `a` = its total length
  kCts = 3,     // a grant for the peer's transfer: write `len` bytes at
                // offset `offset` of it to `a`/`rkey`, immediate `grant`
  kCredit = 4,  // only returns credits
  kClose = 5,   // the sender closes its stream
  kStanding = 6,  // a standing grant: the peer may write one whole message of
                // more than its eager limit and at most `len` bytes to
                // `a`/`rkey`, immediate `grant`, without announcing it
};

struct Header {
  uint8_t type;
  uint8_t version;
  uint16_t credits;  // receives the sender reposted since its last message
  uint32_t len;      // kData: payload bytes; kCts, kStanding: grant length
  uint64_t a;        // kRts: transfer length; kCts, kStanding: address
  uint32_t rkey;     // kCts, kStanding
  uint32_t grant;    // kCts, kStanding
  uint64_t offset;   // kCts: offset of the grant in the transfer
};
static_assert(sizeof(Header) == 32, "wire layout");
constexpr uint32_t kHeaderBytes = sizeof(Header);

// RDMA CM private data (connect and accept; at most 56 bytes on connect).
struct Hello {
  uint32_t magic;
  uint16_t version;
  uint16_t eager_depth;  // receives the sender posts: the peer's credits
  uint32_t acc_size;     // the largest eager payload the sender accepts
  // How many standing grants (kStanding) the sender accepts outstanding; 0 (a
  // peer from before this field) means 2.
  uint16_t standing_grants;
  uint16_t flags;  // kHello* bits
  // The largest grant the sender can write into (its TF_RDMA_CHUNK_SIZE):
  // the peer grants no more. 0, from an engine older than this field (whose
  // Hello is 16 bytes), means the receiver's own chunk size.
  uint32_t max_chunk;
  // With kHelloJoins (a client's Hello only): the TCP connection this RDMA
  // connection joins, by the client's end of it (IPv4 address and port,
  // network byte order). Its channel started on that TCP connection and
  // moves to this one (src/glue/switch_endpoint.cc).
  uint32_t joins_addr;
  uint16_t joins_port;
  uint16_t reserved;
  // With kHelloJoins: the random token the client also wrote into that TCP
  // stream (an HTTP/2 frame of its own, src/glue/switch_endpoint.cc); the
  // server joins the two only if they match. All zero from a client older
  // than the token.
  uint8_t join_token[16];
};
// The Hello of engines from before max_chunk: still accepted.
constexpr size_t kHelloV2Bytes = 16;
// Every message the sender sends is solicited (IBV_SEND_SOLICITED): the
// receiver may arm its CQ for solicited completions only. Not set by
// engines from before the flag, whose peers must arm for all.
constexpr uint16_t kHelloSolicited = 1;
// The connection joins a TCP connection (joins_addr, joins_port).
constexpr uint16_t kHelloJoins = 2;
static_assert(sizeof(Hello) <= 56, "fits a connect's private data");
static_assert(offsetof(Hello, max_chunk) == kHelloV2Bytes, "older fields first");

// Reads a peer's Hello from RDMA CM private data (`len` bytes at `data`,
// which may be more than a Hello: CM pads it) into `out`, the fields an
// older peer's shorter Hello lacks as 0. nullptr when it is a Hello this
// engine can talk to; otherwise what is wrong with it, for the log.
// `max_acc` is the largest eager limit accepted (kMaxEngineAccSize).
const char* ParseHello(const void* data, size_t len, uint64_t max_acc, Hello* out);

}  // namespace wire
}  // namespace grpc_rdma

#endif  // GRPC_RDMA_SRC_ENGINE_WIRE_H_
