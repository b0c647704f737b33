#include "server/base/sd_notify.h"

#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;
using ::testing::MatchesRegex;
using ::testing::Optional;

// Sets an environment variable for one test and restores it after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = getenv(name)) old_ = old;
    if (value == nullptr) {
      unsetenv(name);
    } else {
      setenv(name, value, 1);
    }
  }
  ~ScopedEnv() {
    if (old_.has_value()) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// A fake service manager: a datagram socket bound where NOTIFY_SOCKET will point.
class FakeNotifyListener {
 public:
  // `abstract`: bind "@memra-sd-notify-test-<pid>" instead of a path in a fresh temp dir. The
  // temp dir is under /tmp because a sandbox's TEST_TMPDIR can be longer than sun_path allows.
  explicit FakeNotifyListener(bool abstract) {
    fd_ = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    EXPECT_GE(fd_, 0) << std::strerror(errno);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    socklen_t length;
    if (abstract) {
      name_ = absl::StrCat("@memra-sd-notify-test-", getpid());
      std::memcpy(address.sun_path, name_.data(), name_.size());
      address.sun_path[0] = '\0';
      length = offsetof(sockaddr_un, sun_path) + name_.size();
    } else {
      char dir[] = "/tmp/memra-sd-notify-XXXXXX";
      EXPECT_NE(mkdtemp(dir), nullptr) << std::strerror(errno);
      dir_ = dir;
      name_ = dir_ + "/notify.sock";
      std::strcpy(address.sun_path, name_.c_str());
      length = sizeof(address);
    }
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&address), length), 0) << std::strerror(errno);
    // A generous bound so a broken sender fails the test instead of hanging it; never hit when
    // the datagram was sent (it is queued before SdNotify returns).
    timeval timeout{.tv_sec = 30, .tv_usec = 0};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  }
  ~FakeNotifyListener() {
    close(fd_);
    if (!dir_.empty()) {
      unlink(name_.c_str());
      rmdir(dir_.c_str());
    }
  }

  const std::string& name() const { return name_; }

  // The next datagram, waiting for it.
  std::string Receive() {
    char buffer[4096];
    ssize_t n = recv(fd_, buffer, sizeof(buffer), 0);
    EXPECT_GE(n, 0) << std::strerror(errno);
    return n < 0 ? "" : std::string(buffer, static_cast<size_t>(n));
  }

  // The next datagram with the descriptors it carried (owned by the caller).
  std::pair<std::string, std::vector<int>> ReceiveWithFds() {
    std::optional<Notification> received = ReceiveNotification(fd_, /*wait=*/true);
    EXPECT_TRUE(received.has_value()) << std::strerror(errno);
    if (!received.has_value()) return {};
    return {received->state, received->fds};
  }

  // True when nothing more is queued.
  bool Empty() {
    char buffer[1];
    return recv(fd_, buffer, sizeof(buffer), MSG_DONTWAIT) < 0 && errno == EAGAIN;
  }

 private:
  int fd_ = -1;
  std::string dir_;
  std::string name_;
};

class SdNotifyTest : public ::testing::TestWithParam<bool> {};

TEST_P(SdNotifyTest, SendsExactDatagrams) {
  FakeNotifyListener listener(/*abstract=*/GetParam());
  ScopedEnv env("NOTIFY_SOCKET", listener.name().c_str());
  Notifier notifier;

  ASSERT_THAT(SdNotify("READY=1"), IsOk());
  EXPECT_EQ(listener.Receive(), "READY=1");
  ASSERT_THAT(notifier.Ready("serving gpu0, budget 8GiB"), IsOk());
  EXPECT_EQ(listener.Receive(), "READY=1\nSTATUS=serving gpu0, budget 8GiB");
  ASSERT_THAT(notifier.Watchdog(), IsOk());
  EXPECT_EQ(listener.Receive(), "WATCHDOG=1");
  ASSERT_THAT(notifier.Status("draining\n3 sessions"), IsOk());
  EXPECT_EQ(listener.Receive(), "STATUS=draining 3 sessions");
  ASSERT_THAT(notifier.Reloading(), IsOk());
  EXPECT_THAT(listener.Receive(), MatchesRegex("RELOADING=1\nMONOTONIC_USEC=[0-9]+"));
  ASSERT_THAT(notifier.ExtendTimeout(absl::Seconds(60)), IsOk());
  EXPECT_EQ(listener.Receive(), "EXTEND_TIMEOUT_USEC=60000000");
  ASSERT_THAT(notifier.Stopping(), IsOk());
  EXPECT_EQ(listener.Receive(), "STOPPING=1");
  EXPECT_TRUE(listener.Empty());
}

INSTANTIATE_TEST_SUITE_P(PathAndAbstract, SdNotifyTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Abstract" : "Path"; });

TEST(SdNotifyTest, UnsetOrEmptyIsANoOp) {
  {
    ScopedEnv env("NOTIFY_SOCKET", nullptr);
    EXPECT_THAT(SdNotify("READY=1"), IsOk());
  }
  ScopedEnv env("NOTIFY_SOCKET", "");
  EXPECT_THAT(Notifier().Stopping(), IsOk());
}

TEST(SdNotifyTest, MalformedSocketIsInvalidArgument) {
  {
    ScopedEnv env("NOTIFY_SOCKET", "run/notify");
    EXPECT_THAT(SdNotify("READY=1"), StatusIs(absl::StatusCode::kInvalidArgument,
                                              HasSubstrs("NOTIFY_SOCKET=\"run/notify\"",
                                                         "absolute path or @abstract name")));
  }
  std::string too_long = "/" + std::string(200, 'x');
  ScopedEnv env("NOTIFY_SOCKET", too_long.c_str());
  EXPECT_THAT(SdNotify("READY=1"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs(too_long, "108 bytes")));
}

TEST(SdNotifyTest, NoListenerIsAnErrorNamingTheSocket) {
  ScopedEnv env("NOTIFY_SOCKET", "/nonexistent-memra-dir/notify.sock");
  EXPECT_THAT(SdNotify("READY=1"),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstrs("sendto NOTIFY_SOCKET=/nonexistent-memra-dir/notify.sock")));
}

TEST(SdNotifyWithFdsTest, DescriptorsTravelAsScmRights) {
  FakeNotifyListener listener(/*abstract=*/false);
  ScopedEnv env("NOTIFY_SOCKET", listener.name().c_str());
  EXPECT_TRUE(UnderServiceManager());
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  ASSERT_THAT(SdNotifyWithFds("FDSTORE=1\nFDNAME=arena-1-3", {pipe_fds[1]}), IsOk());
  auto [state, fds] = listener.ReceiveWithFds();
  EXPECT_EQ(state, "FDSTORE=1\nFDNAME=arena-1-3");
  ASSERT_EQ(fds.size(), 1u);
  // The received descriptor is the same pipe: what it writes, ours reads.
  ASSERT_EQ(write(fds[0], "x", 1), 1);
  char byte = 0;
  ASSERT_EQ(read(pipe_fds[0], &byte, 1), 1);
  EXPECT_EQ(byte, 'x');
  for (int fd : {pipe_fds[0], pipe_fds[1], fds[0]}) close(fd);
}

TEST(NotifySocketListenerTest, ReceivesWithTheSendersPidAndRemovesItsDirectory) {
  std::string path;
  {
    absl::StatusOr<std::unique_ptr<NotifySocketListener>> listener =
        NotifySocketListener::Create("/tmp/memra-listener-test-");
    ASSERT_THAT(listener, IsOk());
    path = (*listener)->path();
    EXPECT_THAT(path, MatchesRegex("/tmp/memra-listener-test-[A-Za-z0-9]{6}/notify"));
    struct stat directory;
    ASSERT_EQ(stat(path.substr(0, path.size() - 7).c_str(), &directory), 0);
    EXPECT_EQ(directory.st_mode & 0777, 0700u);
    ScopedEnv env("NOTIFY_SOCKET", path.c_str());
    int pipe_fds[2];
    ASSERT_EQ(pipe(pipe_fds), 0);
    ASSERT_THAT(SdNotifyWithFds("FDSTORE=1\nFDNAME=journal-2", {pipe_fds[0]}), IsOk());
    std::optional<Notification> received =
        ReceiveNotification((*listener)->fd(), /*wait=*/false);
    ASSERT_TRUE(received.has_value());
    EXPECT_EQ(received->state, "FDSTORE=1\nFDNAME=journal-2");
    EXPECT_EQ(received->sender, getpid());  // SO_PASSCRED
    ASSERT_EQ(received->fds.size(), 1u);
    for (int fd : {pipe_fds[0], pipe_fds[1], received->fds[0]}) close(fd);
  }
  EXPECT_NE(access(path.c_str(), F_OK), 0) << "the socket outlived its listener";
  EXPECT_NE(access(path.substr(0, path.size() - 7).c_str(), F_OK), 0)
      << "the directory outlived its listener";
}

TEST(NotifySocketListenerTest, RefusalsNameTheCallAndTheNumbers) {
  EXPECT_THAT(NotifySocketListener::Create("/nonexistent-memra-dir/listener-"),
              StatusIs(absl::StatusCode::kInternal,
                       HasSubstrs("mkdtemp /nonexistent-memra-dir/listener-XXXXXX",
                                  "No such file or directory")));
  // A directory whose "<dir>/notify" is longer than sun_path holds: refused, nothing left.
  const std::string long_prefix = "/tmp/" + std::string(100, 'd');
  absl::StatusOr<std::unique_ptr<NotifySocketListener>> too_long =
      NotifySocketListener::Create(long_prefix);
  EXPECT_THAT(too_long, StatusIs(absl::StatusCode::kInternal,
                                 HasSubstrs("notify socket " + long_prefix, "/notify: 118 bytes",
                                            "holds at most 107")));
}

TEST(SdNotifyWithFdsTest, WithoutAServiceManagerDescriptorsAreRefusedNotLost) {
  ScopedEnv env("NOTIFY_SOCKET", nullptr);
  EXPECT_FALSE(UnderServiceManager());
  EXPECT_THAT(SdNotifyWithFds("FDSTORE=1\nFDNAME=journal-1", {0, 1}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("cannot store 2 descriptors", "NOTIFY_SOCKET is not set")));
  EXPECT_THAT(SdNotifyWithFds("READY=1", {}), IsOk());
}

TEST(ListenFdsTest, NamesAndNumbersFromThree) {
  absl::StatusOr<std::vector<ListenedFd>> passed =
      ParseListenFds("42", "3", "journal-2:arena-2-7:plan-ab", 42);
  ASSERT_THAT(passed, IsOk());
  ASSERT_EQ(passed->size(), 3u);
  EXPECT_EQ((*passed)[0].fd, 3);
  EXPECT_EQ((*passed)[0].name, "journal-2");
  EXPECT_EQ((*passed)[2].fd, 5);
  EXPECT_EQ((*passed)[2].name, "plan-ab");
  absl::StatusOr<std::vector<ListenedFd>> unnamed = ParseListenFds("42", "1", nullptr, 42);
  ASSERT_THAT(unnamed, IsOk());
  EXPECT_EQ((*unnamed)[0].name, "unknown");
}

TEST(ListenFdsTest, UnsetOrForAnotherProcessIsNothing) {
  absl::StatusOr<std::vector<ListenedFd>> unset = ParseListenFds(nullptr, nullptr, nullptr, 42);
  ASSERT_THAT(unset, IsOk());
  EXPECT_TRUE(unset->empty());
  absl::StatusOr<std::vector<ListenedFd>> other = ParseListenFds("41", "2", "a:b", 42);
  ASSERT_THAT(other, IsOk());
  EXPECT_TRUE(other->empty());
}

TEST(ListenFdsTest, BadValuesNameTheVariable) {
  EXPECT_THAT(ParseListenFds("x", "1", nullptr, 42),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("LISTEN_PID=\"x\"")));
  EXPECT_THAT(ParseListenFds("42", "-1", nullptr, 42),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("LISTEN_FDS=\"-1\"", "at most 1048576")));
  EXPECT_THAT(ParseListenFds("42", "2", "only-one", 42),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("LISTEN_FDNAMES has 1 names but LISTEN_FDS is 2")));
}

TEST(WatchdogEnvTest, HalfTheTimeoutForThisProcess) {
  EXPECT_THAT(ParseWatchdogEnv("30000000", nullptr, 42), IsOk());
  EXPECT_EQ(*ParseWatchdogEnv("30000000", nullptr, 42), absl::Seconds(15));
  EXPECT_EQ(*ParseWatchdogEnv("30000000", "42", 42), absl::Seconds(15));
  EXPECT_EQ(*ParseWatchdogEnv("3", "42", 42), absl::Nanoseconds(1500));
}

TEST(WatchdogEnvTest, OffOrForAnotherProcess) {
  EXPECT_EQ(*ParseWatchdogEnv(nullptr, nullptr, 42), std::nullopt);
  EXPECT_EQ(*ParseWatchdogEnv(nullptr, "42", 42), std::nullopt);
  EXPECT_EQ(*ParseWatchdogEnv("30000000", "41", 42), std::nullopt);
}

TEST(WatchdogEnvTest, BadValuesNameTheVariable) {
  for (const char* bad : {"", "0", "-5", "abc", "30s", "1.5", " 30"}) {
    EXPECT_THAT(ParseWatchdogEnv(bad, nullptr, 42),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstrs(absl::StrCat("WATCHDOG_USEC=\"", bad, "\""),
                                    "not a positive number of microseconds")));
  }
  EXPECT_THAT(ParseWatchdogEnv("30000000", "me", 42),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("WATCHDOG_PID=\"me\"", "not a process id")));
}

TEST(WatchdogEnvTest, WatchdogIntervalReadsTheEnvironment) {
  std::string self = absl::StrCat(getpid());
  {
    ScopedEnv usec("WATCHDOG_USEC", "20000000");
    ScopedEnv pid("WATCHDOG_PID", self.c_str());
    EXPECT_THAT(WatchdogInterval(), Optional(absl::Seconds(10)));
  }
  {
    ScopedEnv usec("WATCHDOG_USEC", "20000000");
    ScopedEnv pid("WATCHDOG_PID", nullptr);
    EXPECT_THAT(WatchdogInterval(), Optional(absl::Seconds(10)));
  }
  {
    ScopedEnv usec("WATCHDOG_USEC", "garbage");
    EXPECT_EQ(WatchdogInterval(), std::nullopt);
  }
  ScopedEnv usec("WATCHDOG_USEC", nullptr);
  EXPECT_EQ(WatchdogInterval(), std::nullopt);
}

TEST(NotifierTest, UsesTheGivenSender) {
  std::string last;
  Notifier notifier([&](std::string_view state) {
    last = std::string(state);
    return absl::UnavailableError("fake");
  });
  EXPECT_THAT(notifier.Stopping(), StatusIs(absl::StatusCode::kUnavailable, "fake"));
  EXPECT_EQ(last, "STOPPING=1");
}

}  // namespace
}  // namespace memra
