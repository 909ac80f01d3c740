// The engine's rules that need no device: flow control (flow.h), sizing
// (plan.h), the Hello parser (wire.h) and the queues that keep their room
// (ring.h).
#include <gtest/gtest.h>
#include <string.h>

#include <memory>

#include "config/config.h"
#include "engine/flow.h"
#include "engine/plan.h"
#include "engine/ring.h"
#include "engine/wire.h"

namespace grpc_rdma {
namespace {

constexpr uint64_t kKiB = 1024, kMiB = 1024 * kKiB;

TEST(Flow, DataKeepsOneReceiveForControl) {
  Flow f;
  f.Start(/*peer_depth=*/3, /*send_slots=*/10);
  EXPECT_TRUE(f.CanSendData());
  f.Sent();
  EXPECT_TRUE(f.CanSendData());
  f.Sent();
  // One credit left: a control message may go, data may not.
  EXPECT_FALSE(f.CanSendData());
  EXPECT_TRUE(f.CanSendControl());
  f.Sent();
  EXPECT_FALSE(f.CanSendControl());
  EXPECT_EQ(f.credits(), 0);
  EXPECT_TRUE(f.Return(3));
  EXPECT_TRUE(f.CanSendData());
}

TEST(Flow, SendSlotsGateEverything) {
  Flow f;
  f.Start(64, 2);
  f.Sent();
  f.Sent();
  EXPECT_FALSE(f.HasSendSlot());
  EXPECT_FALSE(f.CanSendData());
  EXPECT_FALSE(f.CanSendControl());
  f.SendCompleted();
  EXPECT_TRUE(f.CanSendData());
  EXPECT_EQ(f.credits(), 62);  // a completion frees the slot, not the credit
}

TEST(Flow, MoreCreditsThanReceivesIsRefused) {
  Flow f;
  f.Start(8, 100);
  EXPECT_FALSE(f.Return(1)) << "all 8 credits are ours already";
  f.Sent();
  f.Sent();
  EXPECT_FALSE(f.Return(3));
  EXPECT_EQ(f.credits(), 6) << "a refused return changes nothing";
  EXPECT_TRUE(f.Return(2));
  EXPECT_FALSE(f.Return(0xffff));
  EXPECT_EQ(f.credits(), 8);
}

TEST(Flow, CreditsOwedAreToldOnce) {
  Flow f;
  f.Start(64, 100);
  for (int i = 0; i < 5; ++i) f.Reposted();
  EXPECT_EQ(f.owed(), 5);
  uint16_t told = f.owed();
  f.Reposted();  // between reading and posting: still owed afterwards
  f.Told(told);
  EXPECT_EQ(f.owed(), 1);
}

TEST(Flow, CreditUpdateOnlyWhenAQuarterIsOwed) {
  Flow f;
  f.Start(64, 100);
  const int our_depth = 64;  // a quarter: 16
  for (int i = 0; i < 15; ++i) f.Reposted();
  EXPECT_FALSE(f.UpdateDue(our_depth));
  f.Reposted();
  EXPECT_TRUE(f.UpdateDue(our_depth));
  // Small depths: at least two.
  Flow g;
  g.Start(3, 100);
  g.Reposted();
  EXPECT_FALSE(g.UpdateDue(3));
  g.Reposted();
  EXPECT_TRUE(g.UpdateDue(3));
  // No credit left for it: not due (the next data message carries them).
  for (int i = 0; i < 3; ++i) g.Sent();
  EXPECT_FALSE(g.UpdateDue(3));
}

TEST(Flow, StandingGrantsTakeAtMostHalfThePeersReceives) {
  Flow f;
  f.Start(64, 100);
  int made = 0;
  while (f.RoomForStandingGrant()) {
    f.Sent();
    ++made;
  }
  EXPECT_EQ(made, 32);  // half of 64
  Flow small;
  small.Start(4, 100);
  small.Sent();
  EXPECT_TRUE(small.RoomForStandingGrant());
  small.Sent();
  EXPECT_FALSE(small.RoomForStandingGrant()) << "2 credits stay for data and control";
}

TEST(Plan, EagerLimitIsThePeersIfWeCanStageIt) {
  const uint32_t h = wire::kHeaderBytes;
  // Ours: 8 KiB + 1 KiB eager, 4 MiB chunks: staging buffers of 4 MiB.
  EXPECT_EQ(plan::EagerLimit(9 * kKiB, 4 * kMiB, h), 9 * kKiB);
  // A peer with a 1 MiB + 1 KiB limit, our chunks 64 KiB: what we can stage.
  EXPECT_EQ(plan::EagerLimit(kMiB + kKiB, 64 * kKiB, h), 64 * kKiB - h);
}

TEST(Plan, GrantsFitTheWritersChunks) {
  EXPECT_EQ(plan::GrantLimit(4 * kMiB, 64 * kKiB), 64 * kKiB);
  EXPECT_EQ(plan::GrantLimit(64 * kKiB, 4 * kMiB), 64 * kKiB);
  EXPECT_EQ(plan::GrantLimit(4 * kMiB, 0), 4 * kMiB) << "an older peer: ours";
}

TEST(Plan, StandingGrants) {
  EXPECT_EQ(plan::PeerStandingGrants(0), 2);
  EXPECT_EQ(plan::PeerStandingGrants(3), 3);
  EXPECT_EQ(plan::PeerStandingGrants(100), plan::kStandingGrants);
  EXPECT_EQ(plan::StandingBytes(4 * kMiB, 9 * kKiB), 512 * kKiB);
  EXPECT_EQ(plan::StandingBytes(64 * kKiB, 9 * kKiB), 64 * kKiB);
  EXPECT_EQ(plan::StandingBytes(512 * kKiB, kMiB + kKiB), 0u) << "all such messages are eager";
}

// A peer that ran out of standing grants (it announced what one would
// have held, after using a whole target's worth, while none was withheld)
// is given more, a step at a time, up to what it accepts; anything else
// changes nothing.
TEST(Plan, StandingGrantsGrowWhenThePeerRunsOut) {
  const uint32_t small = 512 * kKiB;
  EXPECT_EQ(plan::StandingTarget(8, 64 * kKiB, small, 22, 8, false), 8 + plan::kStandingStep);
  EXPECT_EQ(plan::StandingTarget(8, small, small, 22, 9, false), 8 + plan::kStandingStep);
  EXPECT_EQ(plan::StandingTarget(8, small + 1, small, 22, 8, false), 8)
      << "too large for one: no help";
  EXPECT_EQ(plan::StandingTarget(8, 64 * kKiB, small, 22, 0, false), 8)
      << "announced before its first grants arrived: it did not run out";
  EXPECT_EQ(plan::StandingTarget(8, 64 * kKiB, small, 22, 7, false), 8);
  EXPECT_EQ(plan::StandingTarget(8, 64 * kKiB, small, 22, 8, true), 8)
      << "grants withheld here (budget, receives): more would not come either";
  EXPECT_EQ(plan::StandingTarget(20, 64 * kKiB, small, 22, 20, false), 22)
      << "never more than accepted";
  EXPECT_EQ(plan::StandingTarget(8, 64 * kKiB, 0, 22, 8, false), 8) << "none made: none to add";
  int t = plan::kStandingStart;
  for (int i = 0; i < 100; ++i) t = plan::StandingTarget(t, 100 * kKiB, small, 22, t, false);
  EXPECT_EQ(t, plan::kStandingGrants - 2);
  // An older peer accepts 10, two of them large: it keeps its 8.
  EXPECT_EQ(plan::StandingTarget(8, 64 * kKiB, small,
                                 10 - plan::LargeStandingSlots(plan::PeerStandingGrants(10)), 8,
                                 false),
            8);
}

TEST(Plan, LargeStandingGrants) {
  // Two of those our peers accept; none from a peer that takes 2 or 3.
  EXPECT_EQ(plan::LargeStandingSlots(plan::kStandingGrants), 2);
  EXPECT_EQ(plan::LargeStandingSlots(8), 2) << "an engine of eight: six small ones";
  EXPECT_EQ(plan::LargeStandingSlots(3), 0);
  EXPECT_EQ(plan::LargeStandingSlots(plan::PeerStandingGrants(0)), 0);
  const uint32_t chunk = 4 * kMiB, small = 512 * kKiB;
  // 1 MiB and gRPC's framing: 2 MiB grants, for any size up to that.
  EXPECT_EQ(plan::LargeStandingBytes(kMiB + 14, chunk, small, 9 * kKiB), 2 * kMiB);
  EXPECT_EQ(plan::LargeStandingBytes(small + 1, chunk, small, 9 * kKiB), 2 * kMiB);
  EXPECT_EQ(plan::LargeStandingBytes(2 * kMiB, chunk, small, 9 * kKiB), 2 * kMiB);
  EXPECT_EQ(plan::LargeStandingBytes(2 * kMiB + 14, chunk, small, 9 * kKiB), 0u)
      << "larger than a large grant: announced, and nothing learnt";
  EXPECT_EQ(plan::LargeStandingBytes(small, chunk, small, 9 * kKiB), 0u) << "a small one holds it";
  EXPECT_EQ(plan::LargeStandingBytes(kMiB, chunk, 0, 2 * kMiB), 0u) << "eager";
  // Chunks of 1 MiB: grants of one.
  EXPECT_EQ(plan::LargeStandingBytes(kMiB, kMiB, small, 9 * kKiB), kMiB);
}

TEST(Plan, AnnouncedTransfersAreCutIntoPiecesInFlight) {
  const uint32_t chunk = 4 * kMiB;
  // gRPC's framing adds a few bytes to a power-of-two message: four 1 MiB
  // pieces and a tail, not four of 2 MiB.
  EXPECT_EQ(plan::PieceSize(4 * kMiB + 14, chunk, 4), kMiB);
  EXPECT_EQ(plan::PieceSize(4 * kMiB, chunk, 4), kMiB);
  EXPECT_EQ(plan::PieceSize(kMiB + 14, chunk, 4), 256 * kKiB);
  // Past the tail: the next power of two (fewer than four pieces).
  EXPECT_EQ(plan::PieceSize(4 * kMiB + 100 * kKiB, chunk, 4), 2 * kMiB);
  // Never below kMinPiece, never above the grant limit.
  EXPECT_EQ(plan::PieceSize(100 * kKiB, chunk, 4), plan::kMinPiece);
  EXPECT_EQ(plan::PieceSize(300 * kKiB, 64 * kKiB, 8), 64 * kKiB);
  // More than the chunks in flight cover, or one chunk in flight: chunks.
  EXPECT_EQ(plan::PieceSize(64 * kMiB, chunk, 4), chunk);
  EXPECT_EQ(plan::PieceSize(2 * kMiB, chunk, 1), chunk);
}

TEST(Plan, GrantsInFlightAndTheTail) {
  EXPECT_TRUE(plan::MayGrant(0, 4, kMiB));
  EXPECT_TRUE(plan::MayGrant(3, 4, kMiB));
  EXPECT_FALSE(plan::MayGrant(4, 4, kMiB));
  EXPECT_TRUE(plan::MayGrant(4, 4, 14)) << "a tail goes with the full pieces";
  EXPECT_FALSE(plan::MayGrant(5, 4, 14)) << "only one";
  EXPECT_FALSE(plan::MayGrant(0, 4, 0)) << "nothing left";
}

wire::Hello GoodHello() {
  wire::Hello h{};
  h.magic = wire::kMagic;
  h.version = wire::kVersion;
  h.eager_depth = 64;
  h.acc_size = 9 * kKiB;
  h.standing_grants = 8;
  h.flags = wire::kHelloSolicited;
  h.max_chunk = 4 * kMiB;
  return h;
}

const char* Parse(const wire::Hello& h, size_t len = sizeof(wire::Hello)) {
  wire::Hello out;
  return wire::ParseHello(&h, len, kMaxEngineAccSize, &out);
}

TEST(Wire, HelloFieldByField) {
  EXPECT_EQ(Parse(GoodHello()), nullptr);
  wire::Hello h = GoodHello();
  h.acc_size = kMaxEngineAccSize;  // TF_RDMA_ACC_SIZE=1M and the framing room
  EXPECT_EQ(Parse(h), nullptr);
  h.acc_size = kMaxEngineAccSize + 1;
  EXPECT_STREQ(Parse(h), "eager limit out of range");
  h = GoodHello();
  h.acc_size = 63;
  EXPECT_STREQ(Parse(h), "eager limit out of range");
  h = GoodHello();
  h.magic ^= 1;
  EXPECT_STREQ(Parse(h), "not a grpc-rdma Hello (magic)");
  h = GoodHello();
  h.version = wire::kVersion + 1;
  EXPECT_STREQ(Parse(h), "unsupported protocol version");
  h = GoodHello();
  h.eager_depth = 2;
  EXPECT_STREQ(Parse(h), "eager depth out of range");
  h.eager_depth = 4097;
  EXPECT_STREQ(Parse(h), "eager depth out of range");
  h = GoodHello();
  h.max_chunk = 4095;
  EXPECT_STREQ(Parse(h), "chunk size out of range");
  EXPECT_STREQ(Parse(GoodHello(), wire::kHelloV2Bytes - 1), "no Hello (private data too short)");
  wire::Hello out;
  EXPECT_STREQ(wire::ParseHello(nullptr, 56, kMaxEngineAccSize, &out),
               "no Hello (private data too short)");
}

TEST(Wire, OlderHelloReadsTheNewFieldsAsZero) {
  wire::Hello h = GoodHello();
  wire::Hello out;
  out.max_chunk = 12345;
  ASSERT_EQ(wire::ParseHello(&h, wire::kHelloV2Bytes, kMaxEngineAccSize, &out), nullptr);
  EXPECT_EQ(out.max_chunk, 0u);
  EXPECT_EQ(out.acc_size, h.acc_size);
  // RDMA CM pads private data: more bytes than a Hello are fine.
  char padded[56] = {};
  memcpy(padded, &h, sizeof(h));
  EXPECT_EQ(wire::ParseHello(padded, sizeof(padded), kMaxEngineAccSize, &out), nullptr);
  EXPECT_EQ(out.max_chunk, h.max_chunk);
}

}  // namespace
}  // namespace grpc_rdma

// ------------------------------------------------------------ RingQueue ---

namespace grpc_rdma {
namespace {

TEST(RingQueue, KeepsOrderAcrossWrapAndGrowth) {
  RingQueue<int> q;
  int next_in = 0, next_out = 0;
  // Fill and drain unevenly so the head wraps before and after each growth.
  for (int round = 0; round < 50; ++round) {
    for (int i = 0; i < round % 7 + 1; ++i) q.push_back(next_in++);
    for (int i = 0; i < round % 5 && !q.empty(); ++i) {
      ASSERT_EQ(q.front(), next_out++);
      q.pop_front();
    }
    int expect = next_out;
    size_t seen = 0;
    for (int v : q) {
      ASSERT_EQ(v, expect++);
      ++seen;
    }
    ASSERT_EQ(seen, q.size());
    if (!q.empty()) {
      EXPECT_EQ(q.back(), next_in - 1);
      EXPECT_EQ(q[0], next_out);
    }
  }
  while (!q.empty()) {
    ASSERT_EQ(q.front(), next_out++);
    q.pop_front();
  }
  EXPECT_EQ(next_out, next_in);
}

TEST(RingQueue, PoppedEntriesAreReleasedAndMovesEmptyTheSource) {
  auto held = std::make_shared<int>(7);
  RingQueue<std::shared_ptr<int>> q;
  q.push_back(held);
  q.push_back(held);
  EXPECT_EQ(held.use_count(), 3);
  q.pop_front();
  EXPECT_EQ(held.use_count(), 2) << "a popped slot still holds its entry";
  RingQueue<std::shared_ptr<int>> moved(std::move(q));
  EXPECT_TRUE(q.empty());
  EXPECT_EQ(moved.size(), 1u);
  q.push_back(held);  // the moved-from queue is usable
  EXPECT_EQ(q.size(), 1u);
  moved.clear();
  q.clear();
  EXPECT_EQ(held.use_count(), 1);
}

}  // namespace
}  // namespace grpc_rdma
