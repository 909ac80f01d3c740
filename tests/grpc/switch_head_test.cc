// The join token's frame in a TCP stream's first bytes
// (src/glue/switch_endpoint.h): where a client puts it, and what a server
// reads from the head of a stream, whole or a byte at a time.
#include <grpc/slice.h>
#include <grpc/slice_buffer.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "glue/switch_endpoint.h"

namespace grpc_rdma {
namespace {

const std::string kPreface("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 24);
const std::string kToken = "0123456789abcdef";

// A frame header: payload length, type, flags 0, stream.
std::string Header(uint32_t len, uint8_t type, uint32_t stream = 0) {
  std::string h(9, '\0');
  h[0] = static_cast<char>(len >> 16);
  h[1] = static_cast<char>(len >> 8);
  h[2] = static_cast<char>(len);
  h[3] = static_cast<char>(type);
  for (int i = 0; i < 4; ++i) h[5 + i] = static_cast<char>(stream >> (24 - 8 * i));
  return h;
}

// What a client's gRPC writes first: the preface and a SETTINGS frame with
// two settings.
std::string ClientStart() { return kPreface + Header(12, 4) + std::string(12, '\x01'); }

TEST(SwitchHead, TheTokenFrameGoesAfterThePrefaceAndItsSettings) {
  std::string start = ClientStart();
  EXPECT_EQ(JoinFrameOffset(start), start.size());
  EXPECT_EQ(JoinFrameOffset(start + Header(4, 8) + "abcd"), start.size());
  // Only the preface and the SETTINGS header are needed to say where.
  EXPECT_EQ(JoinFrameOffset(start.substr(0, 33)), start.size());
  EXPECT_EQ(JoinFrameOffset(start.substr(0, 32)), 0u);
  // TLS's ClientHello, or a first frame that is not SETTINGS: no place.
  EXPECT_EQ(JoinFrameOffset(std::string("\x16\x03\x01\x02\x00", 5) + std::string(40, 'x')), 0u);
  EXPECT_EQ(JoinFrameOffset(kPreface + Header(0, 1, 1)), 0u);
}

// `bytes` cut into slices at `cuts`, the token's frame put in, read back.
std::string InsertedInto(const std::string& bytes, const std::vector<size_t>& cuts, bool* put) {
  grpc_slice_buffer b;
  grpc_slice_buffer_init(&b);
  size_t from = 0;
  for (size_t to : cuts) {
    grpc_slice_buffer_add(&b, grpc_slice_from_copied_buffer(bytes.data() + from, to - from));
    from = to;
  }
  grpc_slice_buffer_add(&b, grpc_slice_from_copied_buffer(bytes.data() + from, bytes.size() - from));
  *put = InsertJoinFrame(&b, JoinFrame(kToken));
  std::string out(b.length, '\0');
  grpc_slice_buffer_move_first_into_buffer(&b, b.length, &out[0]);
  grpc_slice_buffer_destroy(&b);
  return out;
}

TEST(SwitchHead, TheFrameGoesInWhereverTheWriteIsCut) {
  std::string start = ClientStart();
  std::string rest = Header(4, 8) + "abcd";
  std::string want = start + JoinFrame(kToken) + rest;
  const std::vector<std::vector<size_t>> cuts = {
      {}, {1}, {24}, {30}, {33}, {start.size()}, {start.size() + 1}, {5, 24, 33, 40}};
  for (const auto& c : cuts) {
    bool put = false;
    EXPECT_EQ(InsertedInto(start + rest, c, &put), want) << "cut at " << ::testing::PrintToString(c);
    EXPECT_TRUE(put);
  }
  // The preface and SETTINGS not whole in the write, or TLS's bytes: as it was.
  for (const std::string& bytes :
       {start.substr(0, start.size() - 1), std::string("\x16\x03\x01\x00\x05hello") + start}) {
    bool put = true;
    EXPECT_EQ(InsertedInto(bytes, {3}, &put), bytes);
    EXPECT_FALSE(put);
  }
}

TEST(SwitchHead, JoinFrameIsAnHttp2FrameOfItsOwnType) {
  std::string f = JoinFrame(kToken);
  ASSERT_EQ(f.size(), kJoinFrameBytes);
  EXPECT_EQ(f.substr(0, 9), Header(24, kJoinFrameType));
  EXPECT_EQ(f.substr(9, 8), "GRDMAJT1");
  EXPECT_EQ(f.substr(17), kToken);
}

TEST(SwitchHead, ATokenIsReadWholeOrAByteAtATime) {
  std::string head = ClientStart() + JoinFrame(kToken) + Header(4, 8) + "abcd";
  size_t whole = ClientStart().size() + kJoinFrameBytes;
  for (size_t n = 0; n < whole; ++n) {
    std::string token;
    ASSERT_EQ(ReadStreamHead(head.substr(0, n), &token), StreamHead::kNeedMore) << n << " bytes";
  }
  for (size_t n : {whole, head.size()}) {
    std::string token;
    ASSERT_EQ(ReadStreamHead(head.substr(0, n), &token), StreamHead::kToken) << n << " bytes";
    EXPECT_EQ(token, kToken);
  }
}

TEST(SwitchHead, StreamsWithoutATokenAreToldApart) {
  std::string token;
  // TLS: decided at the first byte that differs from the preface.
  EXPECT_EQ(ReadStreamHead(std::string("\x16\x03", 2), &token), StreamHead::kNotPlaintext);
  EXPECT_EQ(ReadStreamHead("PRI * HTTP/1.1", &token), StreamHead::kNotPlaintext);
  // Plaintext HTTP/2 whose next frame is something else (a plain client).
  EXPECT_EQ(ReadStreamHead(ClientStart() + Header(4, 8) + "abcd", &token), StreamHead::kNoToken);
  // The frame's type with the wrong length, stream or label.
  EXPECT_EQ(ReadStreamHead(ClientStart() + Header(23, kJoinFrameType) + std::string(23, 'x'),
                           &token),
            StreamHead::kNoToken);
  EXPECT_EQ(ReadStreamHead(ClientStart() + Header(24, kJoinFrameType, 1) + "GRDMAJT1" + kToken,
                           &token),
            StreamHead::kNoToken);
  EXPECT_EQ(ReadStreamHead(ClientStart() + Header(24, kJoinFrameType) + "GRDMAJT2" + kToken,
                           &token),
            StreamHead::kNoToken);
  // A first frame that is not SETTINGS, or SETTINGS too large to wait for.
  EXPECT_EQ(ReadStreamHead(kPreface + Header(0, 1, 1), &token), StreamHead::kNoToken);
  EXPECT_EQ(ReadStreamHead(kPreface + Header(5000, 4), &token), StreamHead::kNoToken);
  EXPECT_TRUE(token.empty());
  // The largest SETTINGS frame waited for still fits what a server keeps.
  std::string big = kPreface + Header(4096, 4) + std::string(4096, '\0') + JoinFrame(kToken);
  ASSERT_LE(big.size(), kMaxStreamHead);
  EXPECT_EQ(ReadStreamHead(big, &token), StreamHead::kToken);
}

}  // namespace
}  // namespace grpc_rdma
