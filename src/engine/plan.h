// File: src/engine/plan.h
//
// The engine's sizing rules, as pure functions of the two ends' settings:
// the eager limit, the pieces an announced transfer is cut into, and the
// standing grants. No verbs, no state: flow_test.cc tests them without a
// device; docs/design.md tells why each is so, with figures.
#ifndef GRPC_RDMA_SRC_ENGINE_PLAN_H_
#define GRPC_RDMA_SRC_ENGINE_PLAN_H_

#include <algorithm>
#include <cstdint>

namespace grpc_rdma {
namespace plan {

// Standing grants: each side keeps landing buffers granted to its peer
// ahead of time, so that a message above the eager limit and within one
// goes at once, in one RDMA WRITE WITH IMMEDIATE, without announcing it.
// A side accepts up to kStandingGrants (its Hello's standing_grants; a
// peer whose Hello says 0 takes 2). It is given kStandingStart of them at
// first, and kStandingStep more each time it ran out (StandingTarget), up
// to what it accepts ...
constexpr int kStandingGrants = 24;
constexpr int kStandingStart = 8;
constexpr int kStandingStep = 4;
// ... of StandingBytes() each, but for up to kLargeStanding of them, made
// only once the peer announced a message too large for those and within
// one grant: LargeStandingBytes() (a parameter server's tensors, large
// unary calls: the same sizes again and again).
constexpr uint32_t kStandingBytesMax = 512 * 1024;
constexpr int kLargeStanding = 2;
// Announced transfers are cut into pieces of at least this size (a power
// of two, so they share the pool's size classes) ...
constexpr uint64_t kMinPiece = 256 << 10;
// ... and a tail of up to this much past the last whole piece (gRPC's
// framing past a power-of-two message) is granted with them.
constexpr uint64_t kTail = 64 << 10;

// The largest write we send eagerly: the peer's TF_RDMA_ACC_SIZE, if our
// own staging buffers (the size class of `own_buffer` bytes, header
// included) can hold it with its `header` bytes.
inline uint32_t EagerLimit(uint32_t peer_acc, uint64_t own_buffer_class, uint32_t header) {
  return static_cast<uint32_t>(std::min<uint64_t>(peer_acc, own_buffer_class - header));
}

// The largest grant we make: our chunk size, and no more than the writer's
// (its Hello's max_chunk; 0 from an engine before that field: ours).
inline uint32_t GrantLimit(uint64_t own_chunk, uint32_t peer_max_chunk) {
  uint64_t g = own_chunk;
  if (peer_max_chunk != 0) g = std::min<uint64_t>(g, peer_max_chunk);
  return static_cast<uint32_t>(g);
}

// How many standing grants the peer accepts (its Hello; 0 means 2).
inline int PeerStandingGrants(uint16_t from_hello) {
  return std::min<int>(kStandingGrants, from_hello == 0 ? 2 : from_hello);
}
// How many small standing grants to keep out: `target` now, or more when
// the peer ran out of them: it announced a message of `announced` bytes
// that one of `standing_bytes` would have held, after using `used` of them
// (at least a whole target's worth since the target last changed: a peer
// that announces before its first grants arrived did not run out), while
// they were all out (not `withheld` for want of budget or receives: then
// the shortage was ours, and more would not come either). Never more than
// `most`.
inline int StandingTarget(int target, uint64_t announced, uint32_t standing_bytes, int most,
                          int used, bool withheld) {
  if (standing_bytes != 0 && announced <= standing_bytes && used >= target && !withheld)
    target += kStandingStep;
  return std::min(target, most);
}

// The size of each standing grant; 0: none are worth making (every message
// that would fit one goes eagerly anyway).
inline uint32_t StandingBytes(uint32_t grant_limit, uint64_t own_acc) {
  uint32_t len = std::min(grant_limit, kStandingBytesMax);
  return len <= own_acc ? 0 : len;
}

// Of the `peer_standing` standing grants the peer accepts, how many may
// be large ones: none when it takes 3 or fewer (an older peer's 2).
inline int LargeStandingSlots(int peer_standing) {
  return peer_standing > kLargeStanding + 1 ? kLargeStanding : 0;
}

// The size of the large standing grants: kLargeStandingBytesMax, or the
// most one grant holds if less; made once the peer announced a message of
// `total` bytes that fits one. Fixed, not sized to that message: grants
// cannot be taken back, and sized to a first 600 KiB message two of them
// would never serve a 1 MiB one. 0 when one cannot hold it, or a standing
// grant of `standing_bytes` already does (or it goes eagerly: up to
// `own_acc`).
constexpr uint32_t kLargeStandingBytesMax = 2 << 20;
inline uint32_t LargeStandingBytes(uint64_t total, uint32_t grant_limit, uint32_t standing_bytes,
                                   uint64_t own_acc) {
  const uint32_t len = std::min(grant_limit, kLargeStandingBytesMax);
  if (total > len || total <= standing_bytes || total <= own_acc) return 0;
  return len;
}

// The piece size of an announced transfer of `total` bytes. When
// `chunks_in_flight` pieces of at most `grant_limit` cover it, it is cut
// into that many (the largest power of two from kMinPiece such that they
// and a tail of at most kTail cover it; else the next one up), so they move
// in parallel and the reader starts on the first while the rest land.
// Otherwise pieces are `grant_limit` bytes.
inline uint64_t PieceSize(uint64_t total, uint32_t grant_limit, int chunks_in_flight) {
  const uint64_t cif = static_cast<uint64_t>(chunks_in_flight);
  if (cif <= 1 || total > cif * grant_limit) return grant_limit;
  uint64_t p2 = kMinPiece;
  while (p2 * 2 * cif <= total) p2 *= 2;
  if (p2 * cif + kTail < total) p2 *= 2;
  return std::min<uint64_t>(grant_limit, p2);
}

// Whether another grant of an announced transfer may go out with
// `in_flight` of its grants unused and `left` bytes not yet granted: up to
// `chunks_in_flight`, and one more for a tail of at most kTail.
inline bool MayGrant(int in_flight, int chunks_in_flight, uint64_t left) {
  if (left == 0 || in_flight > chunks_in_flight) return false;
  return in_flight < chunks_in_flight || left <= kTail;
}

}  // namespace plan
}  // namespace grpc_rdma

#endif  // GRPC_RDMA_SRC_ENGINE_PLAN_H_
