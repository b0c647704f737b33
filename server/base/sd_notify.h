#ifndef MEMRA_SERVER_SD_NOTIFY_H_
#define MEMRA_SERVER_SD_NOTIFY_H_

// The systemd notification protocol (sd_notify(3)), written out so memra-kvd does not link
// libsystemd: one datagram of "KEY=value" lines to the socket named by $NOTIFY_SOCKET.
//
// The unit is Type=notify with NotifyAccess=main, so only the main process (any of its threads)
// may notify. Thread-safe: each call opens its own socket. Reads the environment, so nothing may
// setenv() concurrently (the daemon never does).

#include <sys/types.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace memra {

// Sends `state` as one datagram to $NOTIFY_SOCKET: an absolute path, or "@name" for an abstract
// socket. Unset or empty variable: OK, nothing sent (not started by systemd). A malformed value is
// INVALID_ARGUMENT; a failed send is the errno's status naming the socket.
absl::Status SdNotify(std::string_view state);
// SdNotify with `fds` attached as SCM_RIGHTS (sd_pid_notify_with_fds(3)): how "FDSTORE=1"
// hands descriptors to the service manager's file-descriptor store. The caller keeps its fds.
// FAILED_PRECONDITION when $NOTIFY_SOCKET is unset (descriptors would silently be lost).
absl::Status SdNotifyWithFds(std::string_view state, const std::vector<int>& fds);

// True when $NOTIFY_SOCKET names a service manager (systemd or memra-kv-supervise).
bool UnderServiceManager();

// ---- The service manager's side (memra-kv-supervise, tests and benchmarks that stand where
// systemd would) ----

// The service manager's end of NOTIFY_SOCKET: a datagram socket with SO_PASSCRED (senders'
// pids) bound at <dir>/notify in a fresh 0700 directory made from `directory_prefix` (mkdtemp:
// "/tmp/memra-kv-supervise-" gets six random characters). Closes the socket and removes the path
// and the directory when destroyed. Sets no environment: the caller names path() as
// NOTIFY_SOCKET where it should be (its own environment, or a child's).
class NotifySocketListener {
 public:
  // INTERNAL naming the call and errno when the directory or socket cannot be made.
  static absl::StatusOr<std::unique_ptr<NotifySocketListener>> Create(
      std::string_view directory_prefix);
  ~NotifySocketListener();
  NotifySocketListener(const NotifySocketListener&) = delete;
  NotifySocketListener& operator=(const NotifySocketListener&) = delete;

  int fd() const { return fd_; }
  const std::string& path() const { return path_; }

 private:
  NotifySocketListener(std::string directory, std::string path, int fd)
      : directory_(std::move(directory)), path_(std::move(path)), fd_(fd) {}

  const std::string directory_;
  const std::string path_;
  const int fd_;
};

// One notification as the service manager receives it.
struct Notification {
  std::string state;
  std::vector<int> fds;    // received close-on-exec; the caller owns (and closes) them
  pid_t sender = 0;        // from SCM_CREDENTIALS when the socket has SO_PASSCRED, else 0
  bool truncated = false;  // some descriptors did not fit and were dropped (MSG_CTRUNC)
};
// The next datagram queued on `socket`; nullopt when none is (without `wait`), or when waiting
// failed or timed out (SO_RCVTIMEO).
std::optional<Notification> ReceiveNotification(int socket, bool wait);

// What a notification asks of the fd store: "FDSTORE=1" (keep its descriptors under `name`),
// "FDSTOREREMOVE=1" (drop those under `name`); `name` from "FDNAME=", "stored" when absent (as
// systemd).
struct FdStoreRequest {
  bool store = false;
  bool remove = false;
  std::string name = "stored";
};
FdStoreRequest ParseFdStoreRequest(std::string_view state);

// One descriptor the service manager passed at start (sd_listen_fds_with_names(3)).
struct ListenedFd {
  int fd = -1;
  std::string name;  // from $LISTEN_FDNAMES; "unknown" when absent
};

// The descriptors passed by $LISTEN_PID / $LISTEN_FDS / $LISTEN_FDNAMES, starting at fd 3.
// Empty when the variables are unset or meant for another process (LISTEN_PID != `self`).
// INVALID_ARGUMENT naming the variable for a malformed value or a name count that differs from
// LISTEN_FDS. Pure over its inputs (the caller reads the environment).
absl::StatusOr<std::vector<ListenedFd>> ParseListenFds(const char* listen_pid,
                                                       const char* listen_fds,
                                                       const char* listen_fdnames, pid_t self);
// ParseListenFds on this process's environment; marks each fd close-on-exec and unsets the
// three variables (children must not take them). Call before any thread starts.
absl::StatusOr<std::vector<ListenedFd>> TakeListenFds();

// The keep-alive period the daemon should use: half of $WATCHDOG_USEC, as sd_watchdog_enabled(3)
// advises. nullopt when the watchdog is off, meant for another process ($WATCHDOG_PID differs from
// getpid()), or malformed (ParseWatchdogEnv says why).
std::optional<absl::Duration> WatchdogInterval();

// WatchdogInterval's rules on explicit values (nullptr = unset), with the reason when malformed:
// INVALID_ARGUMENT naming the variable and its value.
absl::StatusOr<std::optional<absl::Duration>> ParseWatchdogEnv(const char* watchdog_usec,
                                                               const char* watchdog_pid,
                                                               pid_t self);

// The daemon's notifications. Thread-safe if `send` is (SdNotify is).
class Notifier {
 public:
  using Sender = std::function<absl::Status(std::string_view state)>;

  // `send` defaults to SdNotify; tests and fakes pass their own.
  explicit Notifier(Sender send = nullptr);

  // "READY=1\nSTATUS=<status>": the socket is listening. Also ends a reload.
  absl::Status Ready(std::string_view status);
  // "RELOADING=1\nMONOTONIC_USEC=<now>": SIGHUP handling began; follow with Ready(). The
  // timestamp is what Type=notify-reload (systemd >= 253) requires; 252 ignores it.
  absl::Status Reloading();
  // "STOPPING=1": draining after SIGTERM.
  absl::Status Stopping();
  // "WATCHDOG=1": keep-alive.
  absl::Status Watchdog();
  // "STATUS=<text>", shown by `systemctl status`. Newlines become spaces (they would start new
  // assignments).
  absl::Status Status(std::string_view text);
  // "EXTEND_TIMEOUT_USEC=<usec>": a drain longer than the unit's TimeoutStopSec asks for more time.
  absl::Status ExtendTimeout(absl::Duration extra);

 private:
  const Sender send_;
};

}  // namespace memra

#endif  // MEMRA_SERVER_SD_NOTIFY_H_
