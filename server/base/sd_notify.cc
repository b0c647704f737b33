#include "server/base/sd_notify.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace memra {
namespace {

// Debian's Abseil has its own absl::string_view; convert at this file's boundary.
absl::string_view AsAbsl(std::string_view text) { return {text.data(), text.size()}; }

// Parses a decimal integer > 0 the whole of `text`, or nullopt.
std::optional<uint64_t> PositiveInteger(const char* text) {
  uint64_t value;
  if (text[0] < '0' || text[0] > '9' || !absl::SimpleAtoi(text, &value) || value == 0) {
    return std::nullopt;
  }
  return value;
}

}  // namespace

absl::Status SdNotify(std::string_view state) { return SdNotifyWithFds(state, {}); }

bool UnderServiceManager() {
  const char* target = std::getenv("NOTIFY_SOCKET");
  return target != nullptr && target[0] != '\0';
}

absl::Status SdNotifyWithFds(std::string_view state, const std::vector<int>& fds) {
  const char* target = std::getenv("NOTIFY_SOCKET");
  if (target == nullptr || target[0] == '\0') {
    if (fds.empty()) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot store ", fds.size(), " descriptors: NOTIFY_SOCKET is not set (not under systemd "
        "or memra-kv-supervise)"));
  }

  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  size_t length = std::strlen(target);
  if ((target[0] != '/' && target[0] != '@') || length >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("NOTIFY_SOCKET=\"", target,
                     "\": expected an absolute path or @abstract name "
                     "shorter than ",
                     sizeof(address.sun_path), " bytes"));
  }
  std::memcpy(address.sun_path, target, length);
  // An abstract name has no terminating NUL: its length is part of the address.
  if (target[0] == '@') address.sun_path[0] = '\0';
  socklen_t address_length =
      static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + length + (target[0] == '/' ? 1 : 0));

  int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::ErrnoToStatus(errno, "socket(AF_UNIX, SOCK_DGRAM) for NOTIFY_SOCKET");
  iovec payload{const_cast<char*>(state.data()), state.size()};
  msghdr message{};
  message.msg_name = &address;
  message.msg_namelen = address_length;
  message.msg_iov = &payload;
  message.msg_iovlen = 1;
  std::vector<char> control;
  if (!fds.empty()) {
    control.resize(CMSG_SPACE(sizeof(int) * fds.size()));
    message.msg_control = control.data();
    message.msg_controllen = control.size();
    cmsghdr* rights = CMSG_FIRSTHDR(&message);
    rights->cmsg_level = SOL_SOCKET;
    rights->cmsg_type = SCM_RIGHTS;
    rights->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(rights), fds.data(), sizeof(int) * fds.size());
  }
  ssize_t sent;
  do {
    sent = sendmsg(fd, &message, MSG_NOSIGNAL);
  } while (sent < 0 && errno == EINTR);
  int error = errno;
  close(fd);
  if (sent < 0) {
    return absl::ErrnoToStatus(error, absl::StrCat("sendto NOTIFY_SOCKET=", target));
  }
  if (static_cast<size_t>(sent) != state.size()) {
    return absl::UnavailableError(absl::StrCat("sendto NOTIFY_SOCKET=", target, " sent ", sent,
                                               " of ", state.size(), " bytes"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<absl::Duration>> ParseWatchdogEnv(const char* watchdog_usec,
                                                               const char* watchdog_pid,
                                                               pid_t self) {
  if (watchdog_usec == nullptr) return std::nullopt;
  std::optional<uint64_t> usec = PositiveInteger(watchdog_usec);
  if (!usec.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat("WATCHDOG_USEC=\"", watchdog_usec,
                                                   "\" is not a positive number of microseconds"));
  }
  if (watchdog_pid != nullptr) {
    std::optional<uint64_t> pid = PositiveInteger(watchdog_pid);
    if (!pid.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("WATCHDOG_PID=\"", watchdog_pid, "\" is not a process id"));
    }
    // The variables were inherited from a parent that systemd watches; not ours to answer.
    if (*pid != static_cast<uint64_t>(self)) return std::nullopt;
  }
  // Half the timeout, so one late wake-up does not get the service killed.
  return absl::Microseconds(*usec) / 2;
}

absl::StatusOr<std::vector<ListenedFd>> ParseListenFds(const char* listen_pid,
                                                       const char* listen_fds,
                                                       const char* listen_fdnames, pid_t self) {
  std::vector<ListenedFd> passed;
  if (listen_pid == nullptr || listen_fds == nullptr) return passed;
  std::optional<uint64_t> pid = PositiveInteger(listen_pid);
  if (!pid.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("LISTEN_PID=\"", listen_pid, "\" is not a process id"));
  }
  if (*pid != static_cast<uint64_t>(self)) return passed;  // meant for another process
  uint64_t count = 0;
  // Bounded far below INT_MAX - 3 so the fd numbers cannot overflow.
  constexpr uint64_t kMaxListenFds = 1 << 20;
  if (!absl::SimpleAtoi(listen_fds, &count) || count > kMaxListenFds) {
    return absl::InvalidArgumentError(absl::StrCat("LISTEN_FDS=\"", listen_fds,
                                                   "\" is not a count of at most ", kMaxListenFds));
  }
  std::vector<std::string> names;
  if (listen_fdnames != nullptr) names = absl::StrSplit(listen_fdnames, ':');
  if (listen_fdnames != nullptr && names.size() != count) {
    return absl::InvalidArgumentError(absl::StrCat("LISTEN_FDNAMES has ", names.size(),
                                                   " names but LISTEN_FDS is ", count));
  }
  for (uint64_t i = 0; i < count; ++i) {
    passed.push_back(ListenedFd{.fd = static_cast<int>(3 + i),
                                .name = listen_fdnames != nullptr ? names[i] : "unknown"});
  }
  return passed;
}

absl::StatusOr<std::vector<ListenedFd>> TakeListenFds() {
  absl::StatusOr<std::vector<ListenedFd>> passed =
      ParseListenFds(std::getenv("LISTEN_PID"), std::getenv("LISTEN_FDS"),
                     std::getenv("LISTEN_FDNAMES"), getpid());
  unsetenv("LISTEN_PID");
  unsetenv("LISTEN_FDS");
  unsetenv("LISTEN_FDNAMES");
  if (!passed.ok()) return passed;
  for (const ListenedFd& listened : *passed) {
    const int flags = fcntl(listened.fd, F_GETFD);
    if (flags < 0 || fcntl(listened.fd, F_SETFD, flags | FD_CLOEXEC) < 0) {
      return absl::ErrnoToStatus(errno, absl::StrCat("passed descriptor ", listened.fd, " (\"",
                                                     listened.name, "\")"));
    }
  }
  return passed;
}

absl::StatusOr<std::unique_ptr<NotifySocketListener>> NotifySocketListener::Create(
    std::string_view directory_prefix) {
  const std::string name_template = std::string(directory_prefix) + "XXXXXX";
  std::string directory = name_template;  // mkdtemp fills in the X's, even when it fails
  if (mkdtemp(directory.data()) == nullptr) {
    return absl::InternalError(
        absl::StrCat("mkdtemp ", name_template, ": ", std::strerror(errno)));
  }
  std::string path = directory + "/notify";
  sockaddr_un address{};
  if (path.size() >= sizeof(address.sun_path)) {
    rmdir(directory.c_str());
    return absl::InternalError(absl::StrCat("notify socket ", path, ": ", path.size(),
                                            " bytes, a Unix socket path holds at most ",
                                            sizeof(address.sun_path) - 1));
  }
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
  const int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  const int on = 1;
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      setsockopt(fd, SOL_SOCKET, SO_PASSCRED, &on, sizeof(on)) != 0) {
    absl::Status error =
        absl::InternalError(absl::StrCat("notify socket ", path, ": ", std::strerror(errno)));
    if (fd >= 0) close(fd);
    unlink(path.c_str());
    rmdir(directory.c_str());
    return error;
  }
  return std::unique_ptr<NotifySocketListener>(
      new NotifySocketListener(std::move(directory), std::move(path), fd));
}

NotifySocketListener::~NotifySocketListener() {
  close(fd_);
  unlink(path_.c_str());
  rmdir(directory_.c_str());
}

std::optional<Notification> ReceiveNotification(int socket, bool wait) {
  constexpr size_t kMaxFds = 253;  // SCM_MAX_FD
  char data[4096];
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds) + CMSG_SPACE(sizeof(ucred))];
  iovec io{data, sizeof(data)};
  msghdr message{};
  message.msg_iov = &io;
  message.msg_iovlen = 1;
  message.msg_control = control;
  message.msg_controllen = sizeof(control);
  ssize_t n;
  do {
    n = recvmsg(socket, &message, MSG_CMSG_CLOEXEC | (wait ? 0 : MSG_DONTWAIT));
  } while (n < 0 && errno == EINTR);
  if (n < 0) return std::nullopt;
  Notification received;
  received.state.assign(data, static_cast<size_t>(n));
  received.truncated = (message.msg_flags & MSG_CTRUNC) != 0;
  for (cmsghdr* c = CMSG_FIRSTHDR(&message); c != nullptr; c = CMSG_NXTHDR(&message, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        received.fds.push_back(fd);
      }
    } else if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_CREDENTIALS) {
      ucred credentials;
      std::memcpy(&credentials, CMSG_DATA(c), sizeof(credentials));
      received.sender = credentials.pid;
    }
  }
  return received;
}

FdStoreRequest ParseFdStoreRequest(std::string_view state) {
  FdStoreRequest request;
  for (absl::string_view line : absl::StrSplit(AsAbsl(state), '\n')) {
    if (line == "FDSTORE=1") request.store = true;
    if (line == "FDSTOREREMOVE=1") request.remove = true;
    if (absl::ConsumePrefix(&line, "FDNAME=")) request.name = std::string(line);
  }
  return request;
}

std::optional<absl::Duration> WatchdogInterval() {
  absl::StatusOr<std::optional<absl::Duration>> interval =
      ParseWatchdogEnv(std::getenv("WATCHDOG_USEC"), std::getenv("WATCHDOG_PID"), getpid());
  if (!interval.ok()) return std::nullopt;
  return *interval;
}

Notifier::Notifier(Sender send) : send_(send ? std::move(send) : Sender(&SdNotify)) {}

absl::Status Notifier::Ready(std::string_view status) {
  return send_(
      absl::StrCat("READY=1\nSTATUS=", absl::StrReplaceAll(AsAbsl(status), {{"\n", " "}})));
}

absl::Status Notifier::Reloading() {
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  uint64_t usec =
      static_cast<uint64_t>(now.tv_sec) * 1'000'000 + static_cast<uint64_t>(now.tv_nsec) / 1000;
  return send_(absl::StrCat("RELOADING=1\nMONOTONIC_USEC=", usec));
}

absl::Status Notifier::Stopping() { return send_("STOPPING=1"); }

absl::Status Notifier::Watchdog() { return send_("WATCHDOG=1"); }

absl::Status Notifier::Status(std::string_view text) {
  return send_(absl::StrCat("STATUS=", absl::StrReplaceAll(AsAbsl(text), {{"\n", " "}})));
}

absl::Status Notifier::ExtendTimeout(absl::Duration extra) {
  return send_(absl::StrCat("EXTEND_TIMEOUT_USEC=", absl::ToInt64Microseconds(extra)));
}

}  // namespace memra
