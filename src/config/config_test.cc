#include "config/config.h"

#include <gtest/gtest.h>
#include <malloc.h>

#include "config/malloc_tune.h"

#include <map>

namespace grpc_rdma {
namespace {

EnvLookup Env(std::map<std::string, std::string> vars) {
  return [vars](const char* name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

// The message of a failed parse, or "" when it parsed.
std::string Error(std::map<std::string, std::string> vars) {
  auto o = ParseOptions(Env(std::move(vars)));
  return o.ok() ? "" : std::string(o.status().message());
}

TEST(Options, DefaultsAreRdmaTensorFlows) {
  auto o = ParseOptions(Env({}));
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(o->enabled);
  EXPECT_EQ(o->device, "mlx5_0");
  EXPECT_FALSE(o->device_explicit);
  EXPECT_EQ(o->chunk_size, 4194304u);
  EXPECT_EQ(o->acc_size, 8192u);
  EXPECT_EQ(o->buf_size, 1073741824u);
  EXPECT_EQ(o->poll_mode, PollMode::kAdaptive);
  EXPECT_EQ(o->fallback, Fallback::kTcp);
  EXPECT_EQ(o->stats_dump, "");
  EXPECT_EQ(o->stats_interval_s, 0);
  EXPECT_TRUE(o->malloc_tune);
  EXPECT_TRUE(o->tcp_first) << "a first call waits for TCP's connect only, by default";
  auto rdma_first = ParseOptions(Env({{"TF_RDMA_TCP_FIRST", "0"}}));
  ASSERT_TRUE(rdma_first.ok()) << rdma_first.status();
  EXPECT_FALSE(rdma_first->tcp_first);
}

// TF_RDMA_MALLOC_TUNE: tunes glibc's malloc unless turned off, unless the
// process chose its own malloc settings, unless malloc is not glibc's; and
// says which, except when turned off.
TEST(MallocTune, PlanFollowsTheSettingTheEnvironmentAndTheMalloc) {
  auto off = ParseOptions(Env({{"TF_RDMA_MALLOC_TUNE", "false"}}));
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_FALSE(off->malloc_tune);
  MallocPlan p = PlanMalloc(*off, Env({}), true);
  EXPECT_FALSE(p.tune);
  EXPECT_EQ(p.say, "");
  Options on;
  p = PlanMalloc(on, Env({}), true);
  EXPECT_TRUE(p.tune);
  EXPECT_NE(p.say.find("mmap 32 MiB, trim 256 MiB"), std::string::npos) << p.say;
  EXPECT_NE(p.say.find("TF_RDMA_MALLOC_TUNE=false"), std::string::npos) << p.say;
  for (auto [name, value] : {std::pair<const char*, const char*>{
                                 "GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1"},
                             {"GLIBC_TUNABLES", "glibc.rtld.x=1:glibc.malloc.mmap_max=0"},
                             {"MALLOC_MMAP_THRESHOLD_", "65536"},
                             {"MALLOC_TRIM_THRESHOLD_", "0"},
                             {"MALLOC_TOP_PAD_", "0"},
                             {"MALLOC_MMAP_MAX_", "0"}}) {
    p = PlanMalloc(on, Env({{name, value}}), true);
    EXPECT_FALSE(p.tune) << name << "=" << value;
    EXPECT_NE(p.say.find("left as the process set it"), std::string::npos) << p.say;
  }
  p = PlanMalloc(on, Env({{"GLIBC_TUNABLES", "glibc.pthread.rseq=0"}}), true);
  EXPECT_TRUE(p.tune) << "another tunable is not malloc's";
  p = PlanMalloc(on, Env({}), false);
  EXPECT_FALSE(p.tune);
  EXPECT_NE(p.say.find("not glibc's"), std::string::npos) << p.say;
  EXPECT_NE(ParseOptions(Env({{"TF_RDMA_MALLOC_TUNE", "sometimes"}})).status().message().find(
                "TF_RDMA_MALLOC_TUNE='sometimes'"),
            std::string::npos);
}

// Carried out: glibc's mmap threshold is seen in whether a block of 8 MiB
// is mapped (mallinfo2's hblkhd): glibc's default, 128 KiB rising with
// use, maps a first 8 MiB block; raised to 32 MiB, it comes from the heap.
// Under a sanitizer, whose malloc is not glibc's, nothing is done.
TEST(MallocTune, RaisesGlibcsThresholds) {
  MallocPlan p = TuneMalloc(Options{});
  if (!GlibcMallocInUse()) {  // a sanitizer's build: its malloc is left alone
    EXPECT_FALSE(p.tune);
    EXPECT_NE(p.say.find("not glibc's"), std::string::npos) << p.say;
    return;
  }
  if (p.say.find("left as the process set it") != std::string::npos) {  // malloc variables set
    EXPECT_FALSE(p.tune);
    return;
  }
  struct mallinfo2 before = mallinfo2();
  ASSERT_TRUE(p.tune) << p.say;
  EXPECT_EQ(p.say.find("refused"), std::string::npos) << p.say;
  void* block = malloc(8 << 20);
  struct mallinfo2 during = mallinfo2();
  EXPECT_EQ(during.hblkhd, before.hblkhd) << "an 8 MiB block was mapped: threshold not raised";
  free(block);
}

// Every size the library prints (FormatBytes: "4 MiB", as its messages
// suggest values) reads back; tests/fuzz/size_fuzz found "4 MiB" refused.
TEST(Options, PrintedSizesReadBack) {
  for (uint64_t n : {uint64_t{32} << 20, uint64_t{1} << 40, uint64_t{18} << 20,
                     (uint64_t{17} << 20) + (uint64_t{128} << 10), uint64_t{123456789}}) {
    auto o = ParseOptions(Env({{"TF_RDMA_BUF_SIZE", FormatBytes(n)}}));
    ASSERT_TRUE(o.ok()) << FormatBytes(n) << ": " << o.status();
    EXPECT_EQ(o->buf_size, n) << FormatBytes(n);
  }
  auto o = ParseOptions(Env({{"TF_RDMA_CHUNK_SIZE", " 4 MiB "}}));
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->chunk_size, 4u << 20);
  EXPECT_NE(Error({{"TF_RDMA_CHUNK_SIZE", "4 M iB"}}), "");
}

TEST(Options, RoceSettings) {
  auto o = ParseOptions(Env({}));
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->port, 0) << "unset: any port";
  EXPECT_EQ(o->gid_index, -1);
  EXPECT_EQ(o->tos, -1);
  o = ParseOptions(Env({{"TF_RDMA_PORT", "2"}, {"TF_RDMA_GID_INDEX", "3"}, {"TF_RDMA_TOS", "106"}}));
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->port, 2);
  EXPECT_EQ(o->gid_index, 3);
  EXPECT_EQ(o->tos, 106);
  EXPECT_NE(DescribeOptions(*o).find("port=2 gid_index=3 tos=106"), std::string::npos)
      << DescribeOptions(*o);
  std::string e = Error({{"TF_RDMA_PORT", "0"}});
  EXPECT_NE(e.find("TF_RDMA_PORT='0' is not valid: expected a whole number from 1 to 255"),
            std::string::npos)
      << e;
  e = Error({{"TF_RDMA_TOS", "256"}, {"TF_RDMA_GID_INDEX", "-1"}});
  EXPECT_NE(e.find("TF_RDMA_TOS='256'"), std::string::npos) << e;
  EXPECT_NE(e.find("TF_RDMA_GID_INDEX='-1'"), std::string::npos) << e;
  Options bad;
  bad.tos = 300;
  absl::Status s = ValidateOptions(bad);
  EXPECT_NE(s.message().find("tos is 300: allowed -1 (unset) or 0 to 255"),
            absl::string_view::npos)
      << s;
  bad = Options();
  bad.port = -3;
  EXPECT_FALSE(ValidateOptions(bad).ok());
}

TEST(Options, StatsEveryInterval) {
  auto o = ParseOptions(Env({{"TF_RDMA_STATS", "/var/log/app/rdma.json"},
                             {"TF_RDMA_STATS_INTERVAL_S", "60"}}));
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->stats_dump, "/var/log/app/rdma.json");
  EXPECT_EQ(o->stats_interval_s, 60);
  Options bad;
  bad.stats_interval_s = -1;
  EXPECT_FALSE(ValidateOptions(bad).ok());
}

TEST(Options, ZeroCopy) {
  auto o = ParseOptions(Env({}));
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(o->zero_copy);
  o = ParseOptions(Env({{"TF_RDMA_ZERO_COPY", "false"}}));
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_FALSE(o->zero_copy);
  EXPECT_NE(DescribeOptions(*o).find("zero_copy=false"), std::string::npos);
  std::string e = Error({{"TF_RDMA_ZERO_COPY", "sometimes"}});
  EXPECT_NE(e.find("TF_RDMA_ZERO_COPY='sometimes'"), std::string::npos) << e;
}

TEST(Options, HalfOpenCap) {
  auto o = ParseOptions(Env({}));
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->max_half_open, 256);
  o = ParseOptions(Env({{"TF_RDMA_MAX_HALF_OPEN", "500"}}));
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->max_half_open, 500);
  EXPECT_NE(DescribeOptions(*o).find("max_half_open=500"), std::string::npos);
  Options bad;
  bad.max_half_open = 0;
  EXPECT_FALSE(ValidateOptions(bad).ok());
}

TEST(Options, ValuesUsersAlreadyUse) {
  auto o = ParseOptions(Env({{"TF_RDMA_BUF_SIZE", "10737418240"},
                             {"TF_RDMA_CHUNK_SIZE", "1048576"},
                             {"TF_RDMA_ACC_SIZE", "16384"},
                             {"TF_RDMA_DEV_NAME", "mlx5_1"},
                             {"TF_RDMA_ENABLED", "false"}}));
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->buf_size, 10737418240u);
  EXPECT_EQ(o->chunk_size, 1048576u);
  EXPECT_EQ(o->acc_size, 16384u);
  EXPECT_EQ(o->device, "mlx5_1");
  EXPECT_TRUE(o->device_explicit);
  EXPECT_FALSE(o->enabled);
}

TEST(Options, SizeSuffixesAndSpellings) {
  auto o = ParseOptions(Env({{"TF_RDMA_BUF_SIZE", "2G"},
                             {"TF_RDMA_CHUNK_SIZE", "512KiB"},
                             {"TF_RDMA_ACC_SIZE", " 4k "},
                             {"TF_RDMA_ENABLED", "YES"},
                             {"TF_RDMA_POLL_MODE", "Busy"}}));
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->buf_size, 2ull << 30);
  EXPECT_EQ(o->chunk_size, 512u << 10);
  EXPECT_EQ(o->acc_size, 4096u);
  EXPECT_TRUE(o->enabled);
  EXPECT_EQ(o->poll_mode, PollMode::kBusy);
}

TEST(Options, BadValuesNameTheVariableTheValueAndWhatIsAllowed) {
  std::string e = Error({{"TF_RDMA_CHUNK_SIZE", "abc"}});
  EXPECT_NE(e.find("TF_RDMA_CHUNK_SIZE='abc' is not valid"), std::string::npos) << e;
  EXPECT_NE(e.find("from 4 KiB to 1 GiB"), std::string::npos) << e;

  e = Error({{"TF_RDMA_ACC_SIZE", "-5"}});
  EXPECT_NE(e.find("TF_RDMA_ACC_SIZE='-5'"), std::string::npos) << e;
  e = Error({{"TF_RDMA_ACC_SIZE", "0"}});
  EXPECT_NE(e.find("TF_RDMA_ACC_SIZE='0'"), std::string::npos) << e;
  e = Error({{"TF_RDMA_BUF_SIZE", "99999999999999999999999"}});
  EXPECT_NE(e.find("TF_RDMA_BUF_SIZE="), std::string::npos) << e;
  e = Error({{"TF_RDMA_BUF_SIZE", "2T"}});
  EXPECT_NE(e.find("to 1 TiB"), std::string::npos) << "absurd sizes: " << e;
  e = Error({{"TF_RDMA_CHUNK_SIZE", "4M4"}});
  EXPECT_NE(e.find("TF_RDMA_CHUNK_SIZE='4M4'"), std::string::npos) << e;
  e = Error({{"TF_RDMA_ENABLED", "maybe"}});
  EXPECT_NE(e.find("expected true or false"), std::string::npos) << e;
  e = Error({{"TF_RDMA_POLL_MODE", "fast"}});
  EXPECT_NE(e.find("expected one of adaptive, busy, event"), std::string::npos) << e;
  e = Error({{"TF_RDMA_DEV_NAME", "mlx5 0"}});
  EXPECT_NE(e.find("TF_RDMA_DEV_NAME='mlx5 0'"), std::string::npos) << e;
  e = Error({{"TF_RDMA_CONNECT_TIMEOUT_MS", "0"}});
  EXPECT_NE(e.find("from 1 to 600000"), std::string::npos) << e;
  e = Error({{"TF_RDMA_GRANT_TIMEOUT_MS", "50"}});
  EXPECT_NE(e.find("TF_RDMA_GRANT_TIMEOUT_MS"), std::string::npos) << e;
  EXPECT_NE(e.find("from 100 to 3600000"), std::string::npos) << e;
  e = Error({{"TF_RDMA_MAX_HALF_OPEN", "0"}});
  EXPECT_NE(e.find("TF_RDMA_MAX_HALF_OPEN='0'"), std::string::npos) << e;
  EXPECT_NE(e.find("from 1 to 100000"), std::string::npos) << e;
  e = Error({{"TF_RDMA_STATS_INTERVAL_S", "-5"}});
  EXPECT_NE(e.find("TF_RDMA_STATS_INTERVAL_S='-5'"), std::string::npos) << e;
  e = Error({{"TF_RDMA_STATS_INTERVAL_S", "90000"}});
  EXPECT_NE(e.find("from 0 to 86400"), std::string::npos) << e;
}

TEST(Options, EveryBadVariableIsReported) {
  std::string e = Error({{"TF_RDMA_CHUNK_SIZE", "x"}, {"TF_RDMA_SPIN_US", "y"}});
  EXPECT_NE(e.find("TF_RDMA_CHUNK_SIZE"), std::string::npos) << e;
  EXPECT_NE(e.find("TF_RDMA_SPIN_US"), std::string::npos) << e;
}

TEST(Options, AccSizeAboveChunkSizeIsRejected) {
  std::string e = Error({{"TF_RDMA_ACC_SIZE", "65536"}, {"TF_RDMA_CHUNK_SIZE", "32768"}});
  EXPECT_NE(e.find("TF_RDMA_ACC_SIZE (64 KiB) is larger than TF_RDMA_CHUNK_SIZE (32 KiB)"),
            std::string::npos)
      << e;
}

TEST(Options, BufSizeMustHoldTheChunksInFlight) {
  std::string e = Error({{"TF_RDMA_BUF_SIZE", "8M"}});
  EXPECT_NE(e.find("TF_RDMA_BUF_SIZE (8 MiB) is too small"), std::string::npos) << e;
  // 4 x 4 MiB + 2 x 64 x (8 KiB + 1 KiB of framing room): 17 MiB + 128 KiB.
  EXPECT_NE(e.find("one connection needs 17536 KiB"), std::string::npos) << e;
  EXPECT_NE(e.find("(TF_RDMA_ACC_SIZE 8 KiB + 1 KiB of framing room)"), std::string::npos) << e;
  // 17 MiB passed here once and the engine, which counts the framing
  // room, then refused it: the process ran on TCP.
  EXPECT_NE(Error({{"TF_RDMA_BUF_SIZE", "17M"}}), "");
  EXPECT_EQ(Error({{"TF_RDMA_BUF_SIZE", "17536K"}}), "");
}

// What the documentation recommends for mid-size messages: it parsed, and
// the engine then refused an eager limit of 1 MiB + the framing room.
TEST(Options, LargestAccSizeRunsTheEngine) {
  auto o = ParseOptions(Env({{"TF_RDMA_ACC_SIZE", "1M"}}));
  ASSERT_TRUE(o.ok()) << o.status();
  Options e = EngineOptions(*o);
  EXPECT_EQ(e.acc_size, (1u << 20) + kFramingRoom);
  EXPECT_TRUE(ValidateEngineOptions(e).ok()) << ValidateEngineOptions(e);
}

// Every check that can turn RDMA off is made at parse time with the
// engine's rules: whatever parses, the engine accepts. Edge values of each
// size and count, in every combination.
TEST(Options, WhatParsesTheEngineAccepts) {
  int parsed = 0, refused = 0;
  for (const char* chunk : {"4K", "64K", "1M", "4M", "1G"})
    for (const char* acc : {"64", "4K", "8K", "1047552", "1M"})
      for (const char* buf : {"1", "1M", "17M", "17536K", "129M", "1G", "1T"})
        for (const char* depth : {"3", "64", "4096"})
          for (const char* cif : {"1", "4", "64"}) {
            auto o = ParseOptions(Env({{"TF_RDMA_CHUNK_SIZE", chunk},
                                       {"TF_RDMA_ACC_SIZE", acc},
                                       {"TF_RDMA_BUF_SIZE", buf},
                                       {"TF_RDMA_EAGER_DEPTH", depth},
                                       {"TF_RDMA_CHUNKS_IN_FLIGHT", cif}}));
            if (!o.ok()) {
              ++refused;
              continue;
            }
            ++parsed;
            EXPECT_TRUE(ValidateOptions(*o).ok()) << ValidateOptions(*o);
            absl::Status s = ValidateEngineOptions(EngineOptions(*o));
            EXPECT_TRUE(s.ok()) << "CHUNK_SIZE=" << chunk << " ACC_SIZE=" << acc
                                << " BUF_SIZE=" << buf << " EAGER_DEPTH=" << depth
                                << " CHUNKS_IN_FLIGHT=" << cif << ": " << s;
          }
  // Both kinds occur, or the test proves nothing.
  EXPECT_GT(parsed, 100);
  EXPECT_GT(refused, 100);
}

TEST(Options, ValidateCatchesWhatAnApplicationFilledIn) {
  Options o;
  EXPECT_TRUE(ValidateOptions(o).ok());
  o.acc_size = o.chunk_size * 2;
  EXPECT_FALSE(ValidateOptions(o).ok());
  o = Options{};
  o.chunks_in_flight = 0;
  EXPECT_FALSE(ValidateOptions(o).ok());
}

TEST(Options, Describe) {
  std::string d = DescribeOptions(Options{});
  EXPECT_NE(d.find("chunk_size=4 MiB acc_size=8 KiB buf_size=1 GiB"), std::string::npos) << d;
  EXPECT_EQ(FormatBytes(1000), "1000 B");
}

}  // namespace
}  // namespace grpc_rdma
