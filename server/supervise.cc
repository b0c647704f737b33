// memra-kv-supervise: the subset of systemd's service-manager protocol memra-kvd needs to keep
// its KV across a restart where there is no systemd (containers, development machines):
//
//   memra-kv-supervise [--pid_file=PATH] [--restart_delay_ms=200] [--max_restarts=5]
//                      [--fd_store_max=N] -- /usr/bin/memra-kvd [memra-kvd flags...]
//
// It provides $NOTIFY_SOCKET (a datagram socket in a private 0700 directory), accepts from the
// daemon's process only (SCM_CREDENTIALS): READY=1, STOPPING=1, STATUS=, WATCHDOG=1 (logged or
// ignored), FDSTORE=1 + FDNAME= with descriptors (kept, by name, at most --fd_store_max), and
// FDSTOREREMOVE=1 + FDNAME= (closed). When the daemon dies of a signal or exits with a status
// other than 0 or 78 (EX_CONFIG), it is started again after --restart_delay_ms with every kept
// descriptor at fd 3.. and $LISTEN_PID / $LISTEN_FDS / $LISTEN_FDNAMES, as systemd does for a
// unit with FileDescriptorStoreMax= and Restart=on-failure. At most --max_restarts restarts a
// minute (then it exits 1). SIGTERM, SIGINT and SIGHUP are forwarded; after a forwarded SIGTERM
// or SIGINT the daemon's exit ends the supervisor with the daemon's status. The daemon speaks
// only systemd's protocol: under systemd, run memra-kvd directly (deploy/memra-kvd@.service).

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <poll.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/base/sd_notify.h"

namespace {

constexpr int kConfigErrorExit = 78;

struct Options {
  std::string pid_file;
  int restart_delay_ms = 200;
  int max_restarts = 5;
  size_t fd_store_max = 65536;
  std::vector<std::string> command;
};

void Log(const std::string& line) {
  std::fprintf(stderr, "memra-kv-supervise: %s\n", line.c_str());
  std::fflush(stderr);
}

bool ParseOptions(int argc, char** argv, Options& options) {
  int i = 1;
  for (; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    absl::string_view value;
    auto flag = [&](absl::string_view name) {
      const std::string prefix = absl::StrCat("--", name, "=");
      if (!absl::StartsWith(arg, prefix)) return false;
      value = absl::string_view(arg).substr(prefix.size());
      return true;
    };
    if (flag("pid_file")) {
      options.pid_file = std::string(value);
    } else if (flag("restart_delay_ms")) {
      if (!absl::SimpleAtoi(value, &options.restart_delay_ms) || options.restart_delay_ms < 0) {
        return false;
      }
    } else if (flag("max_restarts")) {
      if (!absl::SimpleAtoi(value, &options.max_restarts) || options.max_restarts < 0) {
        return false;
      }
    } else if (flag("fd_store_max")) {
      if (!absl::SimpleAtoi(value, &options.fd_store_max)) return false;
    } else {
      Log(absl::StrCat("unknown argument \"", arg, "\""));
      return false;
    }
  }
  for (; i < argc; ++i) options.command.push_back(argv[i]);
  return !options.command.empty();
}

// The kept descriptors, by name (a name stored again replaces the older descriptor).
class FdStore {
 public:
  explicit FdStore(size_t max) : max_(max) {}
  ~FdStore() {
    for (auto& [name, fd] : fds_) close(fd);
  }

  void Store(const std::string& name, int fd) {
    if (auto it = fds_.find(name); it != fds_.end()) {
      close(it->second);
      it->second = fd;
      return;
    }
    if (fds_.size() >= max_) {
      Log(absl::StrCat("fd store full (", max_, "): \"", name, "\" refused"));
      close(fd);
      return;
    }
    fds_.emplace(name, fd);
  }
  void Remove(const std::string& name) {
    if (auto it = fds_.find(name); it != fds_.end()) {
      close(it->second);
      fds_.erase(it);
    }
  }
  const std::map<std::string, int>& fds() const { return fds_; }

 private:
  const size_t max_;
  std::map<std::string, int> fds_;
};

// The child: the kept descriptors at 3.., the LISTEN_* variables naming them, NOTIFY_SOCKET.
pid_t Spawn(const Options& options, const FdStore& store, const std::string& notify_path) {
  std::vector<int> fds;
  std::vector<std::string> names;
  for (const auto& [name, fd] : store.fds()) {
    fds.push_back(fd);
    names.push_back(name);
  }
  const pid_t pid = fork();
  if (pid != 0) return pid;
  // Child. First move every kept fd above the target range, then down into 3..: no dup2 can
  // overwrite a descriptor still to be moved.
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  const int high = 3 + static_cast<int>(fds.size()) + 16;
  for (int& fd : fds) fd = fcntl(fd, F_DUPFD, high);
  for (size_t i = 0; i < fds.size(); ++i) {
    const int target = 3 + static_cast<int>(i);
    if (fds[i] < 0 || dup2(fds[i], target) < 0) _exit(127);
    close(fds[i]);
  }
  // Everything else the supervisor holds closes on exec (opened with CLOEXEC).
  setenv("NOTIFY_SOCKET", notify_path.c_str(), 1);
  if (fds.empty()) {
    unsetenv("LISTEN_PID");
    unsetenv("LISTEN_FDS");
    unsetenv("LISTEN_FDNAMES");
  } else {
    setenv("LISTEN_PID", std::to_string(getpid()).c_str(), 1);
    setenv("LISTEN_FDS", std::to_string(fds.size()).c_str(), 1);
    setenv("LISTEN_FDNAMES", absl::StrJoin(names, ":").c_str(), 1);
  }
  std::vector<char*> argv;
  for (const std::string& arg : options.command) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  execv(argv[0], argv.data());
  std::fprintf(stderr, "memra-kv-supervise: exec %s: %s\n", argv[0], std::strerror(errno));
  _exit(127);
}

// Applies one notification from the daemon (only the daemon's own pid is heard: NotifyAccess=
// main); descriptors not stored are closed.
void Receive(int socket_fd, pid_t child, FdStore& store) {
  std::optional<memra::Notification> received = memra::ReceiveNotification(socket_fd, false);
  if (!received.has_value()) return;
  if (received->truncated) Log("a notification's descriptors were truncated");
  if (received->sender != child) {
    for (int fd : received->fds) close(fd);
    Log(absl::StrCat("ignored a notification from pid ", received->sender));
    return;
  }
  const memra::FdStoreRequest request = memra::ParseFdStoreRequest(received->state);
  for (absl::string_view line : absl::StrSplit(received->state, '\n')) {
    if (line == "READY=1") Log("the daemon is ready");
    if (line == "STOPPING=1") Log("the daemon is stopping");
  }
  if (request.store) {
    for (int fd : received->fds) store.Store(request.name, fd);
    received->fds.clear();
  }
  if (request.remove) store.Remove(request.name);
  for (int fd : received->fds) close(fd);
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  if (!ParseOptions(argc, argv, options)) {
    std::fprintf(stderr,
                 "usage: %s [--pid_file=PATH] [--restart_delay_ms=200] [--max_restarts=5] "
                 "[--fd_store_max=N] -- /path/to/memra-kvd [flags...]\n",
                 argv[0]);
    return 2;
  }
  absl::StatusOr<std::unique_ptr<memra::NotifySocketListener>> listener =
      memra::NotifySocketListener::Create("/tmp/memra-kv-supervise-");
  if (!listener.ok()) {
    Log(std::string(listener.status().message()));
    return 1;
  }
  const int notify = (*listener)->fd();
  const std::string& notify_path = (*listener)->path();
  sigset_t handled;
  sigemptyset(&handled);
  for (int signal : {SIGCHLD, SIGTERM, SIGINT, SIGHUP}) sigaddset(&handled, signal);
  sigprocmask(SIG_BLOCK, &handled, nullptr);
  const int signals = signalfd(-1, &handled, SFD_CLOEXEC | SFD_NONBLOCK);

  FdStore store(options.fd_store_max);
  std::deque<absl::Time> restarts;
  bool stopping = false;
  int exit_status = 0;
  pid_t child = Spawn(options, store, notify_path);
  auto write_pid = [&] {
    if (options.pid_file.empty()) return;
    const std::string temporary = options.pid_file + ".tmp";
    if (FILE* file = std::fopen(temporary.c_str(), "w"); file != nullptr) {
      std::fprintf(file, "%d\n", child);
      std::fclose(file);
      std::rename(temporary.c_str(), options.pid_file.c_str());
    }
  };
  write_pid();
  Log(absl::StrCat("started ", options.command[0], " as pid ", child));
  while (child > 0) {
    pollfd waits[2] = {{notify, POLLIN, 0}, {signals, POLLIN, 0}};
    if (poll(waits, 2, -1) < 0 && errno != EINTR) break;
    if ((waits[0].revents & POLLIN) != 0) Receive(notify, child, store);
    if ((waits[1].revents & POLLIN) == 0) continue;
    signalfd_siginfo info;
    while (read(signals, &info, sizeof(info)) == sizeof(info)) {
      if (info.ssi_signo == SIGTERM || info.ssi_signo == SIGINT) stopping = true;
      if (info.ssi_signo != SIGCHLD) kill(child, static_cast<int>(info.ssi_signo));
    }
    int status = 0;
    if (waitpid(child, &status, WNOHANG) != child) continue;
    // Drain what the daemon sent before it died (its last FDSTOREREMOVEs count).
    for (int i = 0; i < 1024; ++i) {
      pollfd pending{notify, POLLIN, 0};
      if (poll(&pending, 1, 0) <= 0) break;
      Receive(notify, child, store);
    }
    const bool clean = WIFEXITED(status) &&
                       (WEXITSTATUS(status) == 0 || WEXITSTATUS(status) == kConfigErrorExit);
    exit_status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    Log(absl::StrCat("pid ", child, " ended: ",
                     WIFEXITED(status) ? absl::StrCat("exit ", WEXITSTATUS(status))
                                       : absl::StrCat("signal ", WTERMSIG(status)),
                     "; ", store.fds().size(), " descriptors kept"));
    if (stopping || clean) break;
    const absl::Time now = absl::Now();
    while (!restarts.empty() && now - restarts.front() > absl::Minutes(1)) restarts.pop_front();
    if (static_cast<int>(restarts.size()) >= options.max_restarts) {
      Log(absl::StrCat(restarts.size(), " restarts in a minute: giving up"));
      exit_status = 1;
      break;
    }
    restarts.push_back(now);
    absl::SleepFor(absl::Milliseconds(options.restart_delay_ms));
    child = Spawn(options, store, notify_path);
    write_pid();
    Log(absl::StrCat("restarted as pid ", child, " with ", store.fds().size(),
                     " kept descriptors"));
  }
  return exit_status;  // the listener closes and removes the notify socket
}
