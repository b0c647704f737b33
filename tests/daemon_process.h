#ifndef MEMRA_TESTS_DAEMON_PROCESS_H_
#define MEMRA_TESTS_DAEMON_PROCESS_H_

// The real memra-kvd as a separate process for a multi-process test: its own fresh directory,
// the daemon on <dir>/kvd.sock (engines) and <dir>/kvd.admin.sock (operators: the default admin
// socket beside the engine socket), a bounded wait until it listens on both, and on destruction a daemon
// still running stopped (SIGTERM, SIGKILL after kPatience) and the directory removed with
// whatever the test, its engines and the daemon left there. The test's BUILD target needs
// data = ["//server:memra-kvd"].

#include <signal.h>
#include <stdlib.h>

#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/subprocess.h"

namespace memra::testing {

class DaemonProcess {
 public:
  // Makes /tmp/memra-<tag>-XXXXXX (short: Unix socket paths are < 108 bytes); starts nothing, so
  // a test may put a config file there first. A test failure when the directory cannot be made.
  explicit DaemonProcess(const std::string& tag) {
    std::string pattern = absl::StrCat("/tmp/memra-", tag, "-XXXXXX");
    if (mkdtemp(pattern.data()) == nullptr) {
      ADD_FAILURE() << "mkdtemp " << pattern;
      return;
    }
    dir_ = pattern;
    socket_ = dir_ + "/kvd.sock";
    admin_socket_ = dir_ + "/kvd.admin.sock";
  }
  ~DaemonProcess() {
    TerminateAndReap(pid_);
    if (dir_.empty()) return;
    std::error_code error;
    std::filesystem::remove_all(dir_, error);
  }
  DaemonProcess(const DaemonProcess&) = delete;
  DaemonProcess& operator=(const DaemonProcess&) = delete;

  // Starts memra-kvd with --socket_path=socket(), --socket_mode=0600, no watchdog and no metrics
  // endpoint (no fixed port shared with tests running alongside), then `flags` (a later flag
  // wins), and waits until both sockets exist (the admin socket is bound second). False, with a test failure, when the daemon exits
  // first or never listens.
  [[nodiscard]] bool Start(const std::vector<std::string>& flags = {}) {
    std::vector<std::string> args = {Runfile("server/memra-kvd"), "--socket_path=" + socket_,
                                     "--socket_mode=0600", "--watchdog=false",
                                     "--metrics_address="};
    args.insert(args.end(), flags.begin(), flags.end());
    pid_ = Spawn(args);
    if (pid_ <= 0) return false;
    const bool listening =
        PollUntil([&] { return Exists(socket_) && Exists(admin_socket_); }, pid_);
    EXPECT_TRUE(listening) << "memra-kvd never listened on " << socket_ << " and "
                           << admin_socket_;
    return listening;
  }

  // Sends `signal` to the running daemon; false when there is none or kill() failed.
  bool Signal(int signal) { return pid_ > 0 && kill(pid_, signal) == 0; }

  // The daemon's exit status (tests/subprocess.h WaitExit: -1 after `patience`). Once it is
  // reaped the pid is forgotten, so nothing later signals a pid the system may have reused.
  int WaitExit(absl::Duration patience = kPatience) {
    if (pid_ <= 0) return -1;
    const int status = ::memra::testing::WaitExit(pid_, patience);
    if (status >= 0) pid_ = -1;
    return status;
  }

  pid_t pid() const { return pid_; }
  const std::string& dir() const { return dir_; }
  const std::string& socket() const { return socket_; }
  // The operators' socket (KvAdmin and KvPrefixCache in full; memra-kvctl's).
  const std::string& admin_socket() const { return admin_socket_; }
  // A file in the directory.
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

 private:
  std::string dir_;
  std::string socket_;
  std::string admin_socket_;
  pid_t pid_ = -1;
};

}  // namespace memra::testing

#endif  // MEMRA_TESTS_DAEMON_PROCESS_H_
