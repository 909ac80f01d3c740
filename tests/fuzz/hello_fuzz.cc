// The Hello a peer sends in RDMA CM private data (wire::ParseHello), and
// what the engine derives from one it accepts (plan.h): any bytes are
// either refused with a reason or give limits the engine can live with.
// The first four input bytes choose this side's chunk size and chunks in
// flight; the rest is the private data.
#include <cstdint>
#include <cstring>

#include "config/config.h"
#include "engine/plan.h"
#include "engine/wire.h"
#include "fuzz_check.h"

using namespace grpc_rdma;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  // Our own settings, as the config allows them: chunk 4 KiB..1 GiB.
  uint32_t raw = 0;
  memcpy(&raw, data, 4);
  const uint64_t own_chunk = uint64_t{4096} << (raw % 19);  // 4 KiB .. 1 GiB
  const int chunks_in_flight = 1 + static_cast<int>((raw >> 8) % 64);
  const uint64_t own_acc = 64u << ((raw >> 16) % 15);  // 64 B .. 1 MiB
  data += 4;
  size -= 4;
  wire::Hello h{};
  const char* why = wire::ParseHello(data, size, kMaxEngineAccSize, &h);
  if (why != nullptr) {
    FUZZ_CHECK(*why != '\0', "a refusal says why");
    return 0;
  }
  FUZZ_CHECK(size >= wire::kHelloV2Bytes, "accepted from too few bytes");
  FUZZ_CHECK(h.magic == wire::kMagic && h.version == wire::kVersion, "magic and version");
  FUZZ_CHECK(h.eager_depth >= 3 && h.eager_depth <= 4096, "eager depth in range");
  FUZZ_CHECK(h.acc_size >= 64 && h.acc_size <= kMaxEngineAccSize, "eager limit in range");
  if (size < sizeof(wire::Hello))
    FUZZ_CHECK(h.max_chunk == 0 || size > wire::kHelloV2Bytes, "an old Hello has no max_chunk");
  // What the engine derives from it (ConnImpl::SetPeerLocked).
  const uint32_t grant = plan::GrantLimit(own_chunk, h.max_chunk);
  FUZZ_CHECK(grant >= 4096 && grant <= own_chunk, "grants fit both chunk sizes");
  const uint32_t eager = plan::EagerLimit(h.acc_size, own_acc + 1024 + wire::kHeaderBytes,
                                          wire::kHeaderBytes);
  FUZZ_CHECK(eager <= h.acc_size, "never more eagerly than the peer takes");
  const int standing = plan::PeerStandingGrants(h.standing_grants);
  FUZZ_CHECK(standing >= 1 && standing <= plan::kStandingGrants, "standing grants bounded");
  const uint32_t standing_bytes = plan::StandingBytes(grant, own_acc);
  FUZZ_CHECK(standing_bytes == 0 || (standing_bytes > own_acc && standing_bytes <= grant),
             "a standing grant is worth making and fits");
  // Announced transfers of a few sizes: pieces fit the grants and progress.
  for (uint64_t total : {uint64_t{1}, uint64_t{65536}, own_chunk, own_chunk * 3 + 17,
                         uint64_t{1} << 32}) {
    const uint64_t piece = plan::PieceSize(total, grant, chunks_in_flight);
    FUZZ_CHECK(piece >= 1 && piece <= grant, "a piece fits a grant");
    FUZZ_CHECK(plan::MayGrant(0, chunks_in_flight, total), "a transfer can start");
  }
  return 0;
}
