#include "server/edge/arena_handoff.h"

#include <stdlib.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/handoff_channel.h"
#include "common/handoff_wire.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::IsOkAndHolds;
using ::memra::testing::StatusIs;

constexpr uint64_t kEngine = 7;
constexpr uint64_t kArenaBytes = 4096;

// A handoff socket in a fresh directory whose lookup hands a memfd for session 1 (token "t")
// to engine kEngine, and refuses everything else the way the daemon does (code + numbers).
class ArenaHandoffTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/memra-handoff-XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    dir_ = pattern;
    memfd_ = ScopedFd(memfd_create("handoff-test", MFD_CLOEXEC));
    ASSERT_GE(memfd_.get(), 0);
    ASSERT_EQ(ftruncate(memfd_.get(), kArenaBytes), 0);
  }
  void TearDown() override {
    handoff_.reset();
    std::error_code error;
    std::filesystem::remove_all(dir_, error);
  }

  void StartHandoff(ArenaHandoff::Options options = {},
                    ArenaHandoff::StepChannelOpener open_step_channel = nullptr) {
    options.path = dir_ + "/kvd.handoff.sock";
    options.mode = 0600;
    handoff_ = std::make_unique<ArenaHandoff>(
        options, [this](uint64_t engine, const handoff::ArenaRequest& request)
                     -> absl::StatusOr<ArenaFd> {
          {
            absl::MutexLock lock(&mu_);
            ++lookups_;
          }
          if (request.session_id != 1) {
            return absl::NotFoundError(
                absl::StrCat("session ", request.session_id, " does not exist"));
          }
          if (request.session_token != "t") {
            return absl::PermissionDeniedError("wrong session token for session 1");
          }
          if (engine != kEngine) {
            return absl::PermissionDeniedError(absl::StrCat(
                "session 1 belongs to engine ", kEngine, ", not engine ", engine));
          }
          return ArenaFd{.fd = ScopedFd(dup(memfd_.get())), .bytes = kArenaBytes};
        },
        [this](uint64_t engine, uint64_t connection, uint64_t bytes,
               ScopedFd fd) -> absl::StatusOr<uint64_t> {
          struct stat info {};
          if (fstat(fd.get(), &info) != 0 || static_cast<uint64_t>(info.st_size) < bytes) {
            return absl::FailedPreconditionError(absl::StrCat(
                "the offered descriptor holds ", info.st_size, " bytes, not ", bytes));
          }
          absl::MutexLock lock(&mu_);
          offers_.push_back({engine, connection, bytes});
          return 100 + offers_.size();
        },
        std::move(open_step_channel));
    ASSERT_THAT(handoff_->Start(), IsOk());
  }

  std::unique_ptr<HandoffChannel> Connect() {
    absl::StatusOr<std::unique_ptr<HandoffChannel>> channel =
        HandoffChannel::Connect(handoff_->path(), absl::Seconds(5));
    EXPECT_THAT(channel, IsOk());
    return channel.ok() ? *std::move(channel) : nullptr;
  }

  // A raw connection (frames of the test's own making); -1 on failure.
  int ConnectRaw() {
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::strcpy(address.sun_path, handoff_->path().c_str());
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
      close(fd);
      return -1;
    }
    return fd;
  }

  // Reads frames off a raw connection until it closes; the last refusal seen.
  absl::Status LastRefusalBeforeClose(int fd) {
    std::string input;
    absl::Status last = absl::OkStatus();
    char data[2048];
    while (true) {
      const ssize_t n = read(fd, data, sizeof(data));
      if (n <= 0) return last;
      input.append(data, static_cast<size_t>(n));
      while (true) {
        absl::StatusOr<std::optional<handoff::Frame>> frame = handoff::TakeFrame(input);
        if (!frame.ok() || !frame->has_value()) break;
        if ((*frame)->kind == handoff::Kind::kRefusal) last = handoff::DecodeRefusal((*frame)->body);
      }
    }
  }

  int lookups() {
    absl::MutexLock lock(&mu_);
    return lookups_;
  }

  std::string dir_;
  ScopedFd memfd_;
  std::unique_ptr<ArenaHandoff> handoff_;
  absl::Mutex mu_;
  int lookups_ ABSL_GUARDED_BY(mu_) = 0;
  struct Offer {
    uint64_t engine;
    uint64_t connection;
    uint64_t bytes;
  };
  std::vector<Offer> offers_ ABSL_GUARDED_BY(mu_);
};

TEST_F(ArenaHandoffTest, BufferOffersGoToTheIntakeWithTheirDescriptorOnlyFromABoundEngine) {
  StartHandoff();
  std::unique_ptr<HandoffChannel> channel = Connect();
  ASSERT_NE(channel, nullptr);
  EXPECT_THAT(channel->OfferBuffer(memfd_.get(), kArenaBytes),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("this handoff connection has no engine yet", "Attach with its ticket")));
  absl::StatusOr<HandoffClaim> claim = handoff_->ClaimTicket(channel->ticket());
  ASSERT_THAT(claim, IsOk());
  handoff_->BindEngine(claim->connection, kEngine);
  EXPECT_TRUE(handoff_->ServesEngine(claim->connection, kEngine));
  EXPECT_FALSE(handoff_->ServesEngine(claim->connection, kEngine + 1));
  EXPECT_THAT(channel->OfferBuffer(memfd_.get(), kArenaBytes), IsOkAndHolds(101u));
  EXPECT_THAT(channel->OfferBuffer(memfd_.get(), kArenaBytes + 1),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("holds 4096 bytes, not 4097")));
  // An offer without a descriptor is refused; the connection stays open.
  EXPECT_THAT(channel->OfferBuffer(-1, 8),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("offer of 8 bytes came without a descriptor")));
  EXPECT_THAT(channel->OfferBuffer(memfd_.get(), 16), IsOkAndHolds(102u));
  absl::MutexLock lock(&mu_);
  ASSERT_EQ(offers_.size(), 2u);
  EXPECT_EQ(offers_[0].engine, kEngine);
  EXPECT_EQ(offers_[0].connection, claim->connection);
  EXPECT_EQ(offers_[1].bytes, 16u);
}

TEST_F(ArenaHandoffTest, TicketCarriesThePeerCredentialsOnce) {
  StartHandoff();
  struct stat st;
  ASSERT_EQ(stat(handoff_->path().c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);

  std::unique_ptr<HandoffChannel> channel = Connect();
  ASSERT_NE(channel, nullptr);
  ASSERT_EQ(channel->ticket().size(), handoff::kTicketBytes);
  absl::StatusOr<HandoffClaim> claim = handoff_->ClaimTicket(channel->ticket());
  ASSERT_THAT(claim, IsOk());
  EXPECT_EQ(claim->peer.uid, getuid());
  EXPECT_EQ(claim->peer.gid, getgid());
  EXPECT_EQ(claim->peer.pid, getpid());
  handoff_->BindEngine(claim->connection, kEngine);
  EXPECT_THAT(handoff_->ClaimTicket(channel->ticket()),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstrs(absl::StrCat("handoff connection ", claim->connection),
                                  "already used (engine 7)")));
}

TEST_F(ArenaHandoffTest, RefusesMissingMalformedForgedAndClosedTickets) {
  StartHandoff();
  EXPECT_THAT(handoff_->ClaimTicket(""),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstrs("no handoff ticket", handoff_->path())));
  EXPECT_THAT(handoff_->ClaimTicket("short"),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstrs("ticket is 32 bytes, got 5")));
  std::unique_ptr<HandoffChannel> channel = Connect();
  ASSERT_NE(channel, nullptr);
  std::string forged = channel->ticket();
  forged.back() ^= 1;
  EXPECT_THAT(handoff_->ClaimTicket(forged),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstrs("does not match")));
  std::string elsewhere = channel->ticket();
  elsewhere[8] ^= 0x40;  // another connection number (after the u64 instance)
  EXPECT_THAT(handoff_->ClaimTicket(elsewhere),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstrs("which is not open")));
  // A ticket is valid only while its connection is open.
  const std::string ticket = channel->ticket();
  channel.reset();
  for (int i = 0; i < 200 && handoff_->connection_count() > 0; ++i) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_THAT(handoff_->ClaimTicket(ticket),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstrs("which is not open")));
}

// Issue 26: a re-attach that straddles a second restart presents the ticket of the daemon that
// died to the next one, whose connection numbers start at 1 again. The ticket names its
// instance, so it is refused UNAVAILABLE (retry with a fresh ticket), naming both instances,
// not PERMISSION_DENIED against an unrelated connection of the same number.
TEST_F(ArenaHandoffTest, RefusesATicketOfAnotherInstanceAsUnavailable) {
  ArenaHandoff::Options first;
  first.instance = 41;
  StartHandoff(first);
  std::unique_ptr<HandoffChannel> old_channel = Connect();
  ASSERT_NE(old_channel, nullptr);
  const std::string old_ticket = old_channel->ticket();
  old_channel.reset();
  handoff_.reset();  // the daemon died

  ArenaHandoff::Options second;
  second.instance = 42;
  StartHandoff(second);
  std::unique_ptr<HandoffChannel> channel = Connect();  // connection 1 again
  ASSERT_NE(channel, nullptr);
  EXPECT_THAT(handoff_->ClaimTicket(old_ticket),
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstrs("issued by memra-kvd instance (epoch) 41",
                                  "this daemon is instance 42", "fresh ticket")));
  // The refusal claimed nothing: this daemon's own ticket for connection 1 still attaches.
  absl::StatusOr<HandoffClaim> claim = handoff_->ClaimTicket(channel->ticket());
  ASSERT_THAT(claim, IsOk());
  EXPECT_EQ(claim->connection, 1u);
}

TEST_F(ArenaHandoffTest, HandsTheArenaOnlyToTheBoundEngine) {
  StartHandoff();
  std::unique_ptr<HandoffChannel> channel = Connect();
  ASSERT_NE(channel, nullptr);
  const handoff::ArenaRequest request{.session_id = 1, .session_token = "t", .handle = "h"};
  // Before Attach bound it: refused, and the connection stays usable.
  EXPECT_THAT(channel->FetchArena(request),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("this handoff connection has no engine yet", "Attach with its ticket")));
  EXPECT_EQ(lookups(), 0);
  absl::StatusOr<HandoffClaim> claim = handoff_->ClaimTicket(channel->ticket());
  ASSERT_THAT(claim, IsOk());
  handoff_->BindEngine(claim->connection, kEngine);
  absl::StatusOr<ArenaFd> arena = channel->FetchArena(request);
  ASSERT_THAT(arena, IsOk());
  EXPECT_EQ(arena->bytes, kArenaBytes);
  EXPECT_EQ(handoff_->arenas_handed(), 1u);
  // The descriptor is the same memory: a write through it shows in the test's memfd.
  ASSERT_EQ(pwrite(arena->fd.get(), "kv", 2, 100), 2);
  char back[2];
  ASSERT_EQ(pread(memfd_.get(), back, 2, 100), 2);
  EXPECT_EQ(std::string(back, 2), "kv");

  // The lookup's refusals reach the engine with their code and numbers.
  EXPECT_THAT(channel->FetchArena({.session_id = 9, .session_token = "t", .handle = "h"}),
              StatusIs(absl::StatusCode::kNotFound, "session 9 does not exist"));
  EXPECT_THAT(channel->FetchArena({.session_id = 1, .session_token = "x", .handle = "h"}),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstrs("wrong session token")));
  // Another engine's connection is refused the same session.
  std::unique_ptr<HandoffChannel> other = Connect();
  ASSERT_NE(other, nullptr);
  absl::StatusOr<HandoffClaim> other_claim = handoff_->ClaimTicket(other->ticket());
  ASSERT_THAT(other_claim, IsOk());
  handoff_->BindEngine(other_claim->connection, kEngine + 1);
  EXPECT_THAT(other->FetchArena(request),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstrs("belongs to engine 7, not engine 8")));
  EXPECT_THAT(channel->FetchArena(request), IsOk());  // still served
}

TEST_F(ArenaHandoffTest, ConnectionsPastTheLimitAreRefused) {
  ArenaHandoff::Options options;
  options.max_connections = 2;
  StartHandoff(options);
  std::unique_ptr<HandoffChannel> first = Connect();
  std::unique_ptr<HandoffChannel> second = Connect();
  ASSERT_NE(second, nullptr);
  EXPECT_THAT(HandoffChannel::Connect(handoff_->path(), absl::Seconds(5)),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstrs("serves 2 connections and the limit is 2",
                                  "max_attached_engines")));
  first.reset();
  for (int i = 0; i < 200 && handoff_->connection_count() > 1; ++i) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_NE(Connect(), nullptr);  // a slot came free
}

// A backlog of several accept rounds (at most kAcceptsPerRound each, so a flood of connects
// cannot hold the serving thread) is taken whole over the following rounds: every connection
// gets its ticket.
TEST_F(ArenaHandoffTest, ABacklogLongerThanOneAcceptRoundIsServedWhole) {
  ArenaHandoff::Options options;
  options.max_unbound_per_uid = 1000;
  StartHandoff(options);
  const int kConnections = 3 * ArenaHandoff::kAcceptsPerRound + 5;
  std::vector<ScopedFd> raw;
  for (int i = 0; i < kConnections; ++i) {
    raw.emplace_back(ConnectRaw());
    ASSERT_GE(raw.back().get(), 0) << i;
  }
  for (int i = 0; i < 400 && handoff_->connection_count() < static_cast<size_t>(kConnections);
       ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(handoff_->connection_count(), static_cast<size_t>(kConnections));
  for (int i = 0; i < kConnections; ++i) {
    std::string input;
    char data[512];
    std::optional<handoff::Frame> first;
    while (!first.has_value()) {
      const ssize_t n = read(raw[i].get(), data, sizeof(data));
      ASSERT_GT(n, 0) << "connection " << i << " closed before its ticket";
      input.append(data, static_cast<size_t>(n));
      absl::StatusOr<std::optional<handoff::Frame>> frame = handoff::TakeFrame(input);
      ASSERT_THAT(frame, IsOk());
      first = *std::move(frame);
    }
    EXPECT_EQ(first->kind, handoff::Kind::kTicket) << "connection " << i;
  }
}

TEST_F(ArenaHandoffTest, OneUidCannotHoldManyConnectionsWithoutAttaching) {
  ArenaHandoff::Options options;
  options.max_unbound_per_uid = 2;
  StartHandoff(options);
  std::unique_ptr<HandoffChannel> first = Connect();
  std::unique_ptr<HandoffChannel> second = Connect();
  ASSERT_NE(second, nullptr);
  EXPECT_THAT(HandoffChannel::Connect(handoff_->path(), absl::Seconds(5)),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstrs(absl::StrCat("uid ", getuid(), " holds 2 handoff connections"),
                                  "no engine attached; the limit is 2")));
  // Once one of them attaches, the uid may connect again.
  absl::StatusOr<HandoffClaim> claim = handoff_->ClaimTicket(first->ticket());
  ASSERT_THAT(claim, IsOk());
  handoff_->BindEngine(claim->connection, kEngine);
  EXPECT_NE(Connect(), nullptr);
}

TEST_F(ArenaHandoffTest, StalledRequestIsClosedAndOthersAreServedMeanwhile) {
  ArenaHandoff::Options options;
  options.request_deadline = absl::Seconds(2);
  StartHandoff(options);
  const int stalled = ConnectRaw();
  ASSERT_GE(stalled, 0);
  ASSERT_EQ(write(stalled, "\x40\x00", 2), 2);  // half a length prefix, then nothing
  std::unique_ptr<HandoffChannel> channel = Connect();
  ASSERT_NE(channel, nullptr);
  absl::StatusOr<HandoffClaim> claim = handoff_->ClaimTicket(channel->ticket());
  ASSERT_THAT(claim, IsOk());
  handoff_->BindEngine(claim->connection, kEngine);
  const absl::Time start = absl::Now();
  EXPECT_THAT(channel->FetchArena({.session_id = 1, .session_token = "t", .handle = "h"}), IsOk());
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(1500));  // not behind the stalled one
  EXPECT_THAT(LastRefusalBeforeClose(stalled),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       HasSubstrs("not complete within 2000 ms")));
  close(stalled);
}

TEST_F(ArenaHandoffTest, UnclaimedTicketIsClosedAfterItsDeadline) {
  ArenaHandoff::Options options;
  options.claim_deadline = absl::Milliseconds(200);
  StartHandoff(options);
  const int idle = ConnectRaw();
  ASSERT_GE(idle, 0);
  EXPECT_THAT(LastRefusalBeforeClose(idle),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       HasSubstrs("no engine attached", "within 200 ms")));
  close(idle);
  EXPECT_EQ(handoff_->connection_count(), 0u);
}

// A ticket claimed by an Attach that was then refused (no BindEngine) holds no slot for ever.
TEST_F(ArenaHandoffTest, ClaimedButNeverBoundTicketIsClosedAfterItsDeadline) {
  ArenaHandoff::Options options;
  options.claim_deadline = absl::Milliseconds(200);
  StartHandoff(options);
  const int raw = ConnectRaw();
  ASSERT_GE(raw, 0);
  // The ticket frame the daemon sends first, claimed as an Attach would before refusing.
  std::string input;
  std::optional<handoff::Frame> ticket;
  char data[256];
  while (!ticket.has_value()) {
    const ssize_t n = read(raw, data, sizeof(data));
    ASSERT_GT(n, 0);
    input.append(data, static_cast<size_t>(n));
    absl::StatusOr<std::optional<handoff::Frame>> frame = handoff::TakeFrame(input);
    ASSERT_THAT(frame, IsOk());
    ticket = *std::move(frame);
  }
  ASSERT_EQ(ticket->kind, handoff::Kind::kTicket);
  absl::StatusOr<std::string> decoded = handoff::DecodeTicket(ticket->body);
  ASSERT_THAT(decoded, IsOk());
  ASSERT_THAT(handoff_->ClaimTicket(*decoded), IsOk());
  EXPECT_THAT(LastRefusalBeforeClose(raw),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       HasSubstrs("no engine attached", "within 200 ms")));
  close(raw);
  for (int i = 0; i < 400 && handoff_->connection_count() > 0; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(handoff_->connection_count(), 0u);
}

// A re-attach's connection supersedes the engine's earlier one, which is closed.
TEST_F(ArenaHandoffTest, BindingAnEngineAgainClosesItsEarlierConnection) {
  StartHandoff();
  std::unique_ptr<HandoffChannel> first = Connect();
  std::unique_ptr<HandoffChannel> second = Connect();
  ASSERT_NE(second, nullptr);
  absl::StatusOr<HandoffClaim> first_claim = handoff_->ClaimTicket(first->ticket());
  absl::StatusOr<HandoffClaim> second_claim = handoff_->ClaimTicket(second->ticket());
  ASSERT_THAT(first_claim, IsOk());
  ASSERT_THAT(second_claim, IsOk());
  handoff_->BindEngine(first_claim->connection, kEngine);
  handoff_->BindEngine(second_claim->connection, kEngine);
  for (int i = 0; i < 400 && handoff_->connection_count() > 1; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(handoff_->connection_count(), 1u);
  const handoff::ArenaRequest request{.session_id = 1, .session_token = "t", .handle = "h"};
  EXPECT_THAT(second->FetchArena(request), IsOk());
  EXPECT_FALSE(first->FetchArena(request).ok());  // closed by the daemon
}

TEST_F(ArenaHandoffTest, MalformedFrameIsRefusedAndClosed) {
  StartHandoff();
  const int fd = ConnectRaw();
  ASSERT_GE(fd, 0);
  ASSERT_EQ(write(fd, "\x02\x00\x00\x00\x07\x02", 6), 6);  // protocol version 7
  EXPECT_THAT(LastRefusalBeforeClose(fd),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("protocol version 7")));
  close(fd);
  const int ticket_sender = ConnectRaw();
  ASSERT_GE(ticket_sender, 0);
  const std::string ticket = handoff::EncodeTicket(std::string(handoff::kTicketBytes, 'x'));
  ASSERT_EQ(write(ticket_sender, ticket.data(), ticket.size()),
            static_cast<ssize_t>(ticket.size()));
  EXPECT_THAT(LastRefusalBeforeClose(ticket_sender),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("only arena requests (kind 2), step channel requests "
                                  "(kind 5) and buffer offers (kind 16), got kind 1")));
  close(ticket_sender);
}

TEST_F(ArenaHandoffTest, StepChannelRequestsAreAnsweredWithTwoDescriptorsForABoundEngine) {
  // The opener hands the test memfd (as the region) and a pipe's write end (as the eventfd).
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  ScopedFd pipe_read(pipe_fds[0]);
  ScopedFd pipe_write(pipe_fds[1]);
  std::vector<uint64_t> opened_for;
  StartHandoff({}, [&](uint64_t engine) -> absl::StatusOr<handoff::StepChannelFds> {
    opened_for.push_back(engine);
    if (engine != kEngine) {
      return absl::FailedPreconditionError(absl::StrCat("engine ", engine, " is not attached"));
    }
    return handoff::StepChannelFds{
        .region = ArenaFd{.fd = ScopedFd(dup(memfd_.get())), .bytes = kArenaBytes},
        .wake = ScopedFd(dup(pipe_write.get()))};
  });
  EXPECT_TRUE(handoff_->offers_step_channel());
  std::unique_ptr<HandoffChannel> channel = Connect();
  ASSERT_NE(channel, nullptr);
  // No engine bound yet: refused without asking the opener, and the connection stays open.
  EXPECT_THAT(channel->OpenStepChannel().status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstrs("no engine yet")));
  EXPECT_TRUE(opened_for.empty());
  absl::StatusOr<HandoffClaim> claim = handoff_->ClaimTicket(channel->ticket());
  ASSERT_THAT(claim, IsOk());
  handoff_->BindEngine(claim->connection, kEngine);
  absl::StatusOr<handoff::StepChannelFds> fds = channel->OpenStepChannel();
  ASSERT_THAT(fds, IsOk());
  EXPECT_EQ(opened_for, std::vector<uint64_t>{kEngine});
  EXPECT_EQ(fds->region.bytes, kArenaBytes);
  struct stat region;
  struct stat memfd;
  ASSERT_EQ(fstat(fds->region.fd.get(), &region), 0);
  ASSERT_EQ(fstat(memfd_.get(), &memfd), 0);
  EXPECT_EQ(region.st_ino, memfd.st_ino);  // the first descriptor is the region
  ASSERT_EQ(write(fds->wake.get(), "w", 1), 1);  // the second the wake-up descriptor
  char c = 0;
  ASSERT_EQ(read(pipe_read.get(), &c, 1), 1);
  EXPECT_EQ(c, 'w');
  // Arena requests still work on the same connection afterwards.
  EXPECT_THAT(channel->FetchArena({.session_id = 1, .session_token = "t", .handle = "h"}).status(),
              IsOk());
}

TEST_F(ArenaHandoffTest, StepChannelRequestWithoutAnOpenerIsRefusedAndTheConnectionStays) {
  StartHandoff();
  EXPECT_FALSE(handoff_->offers_step_channel());
  std::unique_ptr<HandoffChannel> channel = Connect();
  ASSERT_NE(channel, nullptr);
  absl::StatusOr<HandoffClaim> claim = handoff_->ClaimTicket(channel->ticket());
  ASSERT_THAT(claim, IsOk());
  handoff_->BindEngine(claim->connection, kEngine);
  EXPECT_THAT(channel->OpenStepChannel().status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("offers no step channel", "step_channel = false")));
  EXPECT_THAT(channel->FetchArena({.session_id = 1, .session_token = "t", .handle = "h"}).status(),
              IsOk());
}

TEST_F(ArenaHandoffTest, ForgetEngineClosesItsConnectionAndStopRemovesTheSocket) {
  StartHandoff();
  std::unique_ptr<HandoffChannel> channel = Connect();
  ASSERT_NE(channel, nullptr);
  absl::StatusOr<HandoffClaim> claim = handoff_->ClaimTicket(channel->ticket());
  ASSERT_THAT(claim, IsOk());
  handoff_->BindEngine(claim->connection, kEngine);
  handoff_->ForgetEngine(kEngine);
  EXPECT_THAT(channel->FetchArena({.session_id = 1, .session_token = "t", .handle = "h"}),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstrs("closed the connection")));
  const std::string path = handoff_->path();
  handoff_->Stop();
  EXPECT_FALSE(std::filesystem::exists(path));
}

}  // namespace
}  // namespace memra
