#include "common/handoff_wire.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra::handoff {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::IsOkAndHolds;
using ::memra::testing::StatusIs;

Frame Take(std::string& buffer) {
  absl::StatusOr<std::optional<Frame>> frame = TakeFrame(buffer);
  EXPECT_THAT(frame, IsOk());
  EXPECT_TRUE(frame.ok() && frame->has_value());
  return frame.ok() && frame->has_value() ? **frame : Frame{};
}

TEST(HandoffWireTest, EveryFrameRoundTrips) {
  const std::string ticket(kTicketBytes, '\x7f');
  ArenaRequest request{.session_id = 0x0102030405060708, .session_token = "tok\0en",
                       .handle = std::string(kMaxHandleBytes, 'h')};
  absl::StatusOr<std::string> encoded_request = EncodeArenaRequest(request);
  ASSERT_THAT(encoded_request, IsOk());
  std::string buffer = EncodeTicket(ticket) + *encoded_request + EncodeArena(1u << 20) +
                       EncodeRefusal(absl::PermissionDeniedError("session 3 is not yours"));

  Frame frame = Take(buffer);
  EXPECT_EQ(frame.kind, Kind::kTicket);
  EXPECT_THAT(DecodeTicket(frame.body), IsOkAndHolds(ticket));
  frame = Take(buffer);
  ASSERT_EQ(frame.kind, Kind::kArenaRequest);
  absl::StatusOr<ArenaRequest> decoded = DecodeArenaRequest(frame.body);
  ASSERT_THAT(decoded, IsOk());
  EXPECT_EQ(decoded->session_id, request.session_id);
  EXPECT_EQ(decoded->session_token, request.session_token);
  EXPECT_EQ(decoded->handle, request.handle);
  frame = Take(buffer);
  ASSERT_EQ(frame.kind, Kind::kArena);
  EXPECT_THAT(DecodeArena(frame.body), IsOkAndHolds(uint64_t{1} << 20));
  frame = Take(buffer);
  ASSERT_EQ(frame.kind, Kind::kRefusal);
  EXPECT_THAT(DecodeRefusal(frame.body),
              StatusIs(absl::StatusCode::kPermissionDenied, "session 3 is not yours"));
  EXPECT_TRUE(buffer.empty());
}

TEST(HandoffWireTest, IncompleteFrameWaitsForMore) {
  std::string whole = EncodeArena(7);
  for (size_t cut = 0; cut < whole.size(); ++cut) {
    std::string part = whole.substr(0, cut);
    absl::StatusOr<std::optional<Frame>> frame = TakeFrame(part);
    ASSERT_THAT(frame, IsOk());
    EXPECT_FALSE(frame->has_value()) << cut;
    EXPECT_EQ(part.size(), cut);  // nothing consumed
  }
}

TEST(HandoffWireTest, RefusesBadLengthVersionAndKind) {
  std::string too_long("\x01\x04\x00\x00\x01\x02", 6);  // 1025 bytes announced
  EXPECT_THAT(TakeFrame(too_long), StatusIs(absl::StatusCode::kInvalidArgument,
                                            HasSubstrs("frame of 1025 bytes", "2 to 1024")));
  std::string too_short("\x01\x00\x00\x00\x01", 5);
  EXPECT_THAT(TakeFrame(too_short), StatusIs(absl::StatusCode::kInvalidArgument,
                                             HasSubstrs("frame of 1 bytes")));
  std::string version("\x02\x00\x00\x00\x09\x01", 6);
  EXPECT_THAT(TakeFrame(version), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstrs("protocol version 9", "speaks version 1")));
  // The kinds between the step channel's and the block store's, and past the block store's.
  for (const uint8_t unknown : {uint8_t{7}, uint8_t{15}, uint8_t{18}}) {
    std::string kind("\x02\x00\x00\x00\x01", 5);
    kind.push_back(static_cast<char>(unknown));
    EXPECT_THAT(TakeFrame(kind),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstrs(absl::StrCat("unknown kind ", static_cast<int>(unknown)),
                                    "1 to 6, 16 and 17")));
  }
}

TEST(HandoffWireTest, BufferOfferAndIdRoundTrip) {
  absl::StatusOr<std::string> offer = EncodeBufferOffer(uint64_t{1} << 40);
  ASSERT_THAT(offer, IsOk());
  absl::StatusOr<std::optional<Frame>> frame = TakeFrame(*offer);
  ASSERT_THAT(frame, IsOk());
  ASSERT_TRUE(frame->has_value());
  EXPECT_EQ((*frame)->kind, Kind::kBufferOffer);
  EXPECT_THAT(DecodeBufferOffer((*frame)->body), IsOkAndHolds(uint64_t{1} << 40));
  std::string id = EncodeBufferId(77);
  frame = TakeFrame(id);
  ASSERT_THAT(frame, IsOk());
  EXPECT_EQ((*frame)->kind, Kind::kBufferId);
  EXPECT_THAT(DecodeBufferId((*frame)->body), IsOkAndHolds(77u));
  EXPECT_THAT(EncodeBufferOffer(0), StatusIs(absl::StatusCode::kInvalidArgument,
                                             HasSubstrs("buffer offer of 0 bytes")));
  EXPECT_THAT(DecodeBufferOffer(std::string(8, '\0')),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("buffer offer of 0 bytes")));
  EXPECT_THAT(DecodeBufferOffer(std::string(7, '\0')),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("bytes needs 8 bytes, 7")));
}

TEST(HandoffWireTest, RefusesMalformedBodies) {
  EXPECT_THAT(DecodeTicket("short"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("ticket of 5 bytes", "32")));
  EXPECT_THAT(DecodeArenaRequest(std::string(7, '\0')),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("session_id needs 8 bytes, 7 are left")));
  std::string long_token(8, '\0');
  long_token.push_back(static_cast<char>(65));
  EXPECT_THAT(DecodeArenaRequest(long_token),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("session token of 65 bytes", "at most 64")));
  std::string no_handle(8, '\0');
  no_handle += std::string("\x00\x00\x00", 3);  // empty token, handle_len 0
  EXPECT_THAT(DecodeArenaRequest(no_handle),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("arena handle of 0 bytes", "1 to 256")));
  EXPECT_THAT(DecodeArena(std::string(9, '\0')),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("1 bytes left")));
  EXPECT_THAT(DecodeRefusal(std::string("\x00\x00\x00\x00\x02\x00ok", 8)),
              StatusIs(absl::StatusCode::kUnknown, "ok"));  // code 0 is never OK
  EXPECT_THAT(EncodeArenaRequest({.session_id = 1, .session_token = std::string(65, 't'),
                                  .handle = "h"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("session token of 65 bytes", "at most 64")));
  EXPECT_THAT(EncodeArenaRequest({.session_id = 1, .session_token = "", .handle = std::string(257, 'h')}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("arena handle of 257 bytes", "1 to 256")));
}

TEST(HandoffWireTest, LongRefusalMessagesAreCut) {
  std::string buffer = EncodeRefusal(absl::InternalError(std::string(5000, 'x')));
  EXPECT_LE(buffer.size(), kLengthBytes + kMaxFrameBytes);
  Frame frame = Take(buffer);
  EXPECT_EQ(DecodeRefusal(frame.body).message().size(), kMaxMessageBytes);
}

TEST(HandoffWireTest, SendFrameCarriesADescriptor) {
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  ASSERT_THAT(SendFrame(pair[0], EncodeArena(4096), {pipe_fds[1]}), IsOk());
  char data[64];
  std::vector<ScopedFd> received;
  ASSERT_THAT(ReceiveBytes(pair[1], absl::MakeSpan(data), &received),
              IsOkAndHolds(EncodeArena(4096).size()));
  ASSERT_EQ(received.size(), 1u);
  EXPECT_EQ(fcntl(received[0].get(), F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
  // The received descriptor is the pipe's write end: what goes in comes out of the read end.
  ASSERT_EQ(write(received[0].get(), "z", 1), 1);
  char c = 0;
  ASSERT_EQ(read(pipe_fds[0], &c, 1), 1);
  EXPECT_EQ(c, 'z');
  for (int fd : {pipe_fds[0], pipe_fds[1], pair[0]}) close(fd);
  EXPECT_THAT(ReceiveBytes(pair[1], absl::MakeSpan(data), &received), IsOkAndHolds(0u));
  EXPECT_THAT(SendFrame(pair[1], EncodeArena(1)),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstrs("sending a 14-byte frame")));
  close(pair[1]);
}

TEST(HandoffWireTest, StepChannelFramesCarryTwoDescriptorsInOrder) {
  std::string buffer = EncodeStepChannelRequest() + EncodeStepChannel(4849664);
  Frame request = Take(buffer);
  EXPECT_EQ(request.kind, Kind::kStepChannelRequest);
  EXPECT_THAT(DecodeStepChannelRequest(request.body).status(), IsOk());
  Frame channel = Take(buffer);
  EXPECT_EQ(channel.kind, Kind::kStepChannel);
  EXPECT_THAT(DecodeStepChannel(channel.body), IsOkAndHolds(4849664u));
  EXPECT_THAT(DecodeStepChannelRequest("x").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("1 bytes left")));
  EXPECT_THAT(DecodeStepChannel("1234"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("region_bytes needs 8 bytes, 4 are left")));

  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
  int first[2];
  int second[2];
  ASSERT_EQ(pipe(first), 0);
  ASSERT_EQ(pipe(second), 0);
  ASSERT_THAT(SendFrame(pair[0], EncodeStepChannel(1), {first[1], second[1]}), IsOk());
  EXPECT_THAT(SendFrame(pair[0], EncodeStepChannel(1), {first[1], second[1], first[0]}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("at most 2 descriptors, not 3")));
  char data[64];
  std::vector<ScopedFd> received;
  ASSERT_THAT(ReceiveBytes(pair[1], absl::MakeSpan(data), &received), IsOk());
  ASSERT_EQ(received.size(), 2u);
  // In the order sent: the first is the first pipe's write end.
  ASSERT_EQ(write(received[0].get(), "a", 1), 1);
  ASSERT_EQ(write(received[1].get(), "b", 1), 1);
  char c = 0;
  ASSERT_EQ(read(first[0], &c, 1), 1);
  EXPECT_EQ(c, 'a');
  ASSERT_EQ(read(second[0], &c, 1), 1);
  EXPECT_EQ(c, 'b');
  for (int fd : {first[0], first[1], second[0], second[1], pair[0], pair[1]}) close(fd);
}

}  // namespace
}  // namespace memra::handoff
