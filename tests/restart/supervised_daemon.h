#ifndef MEMRA_TESTS_RESTART_SUPERVISED_DAEMON_H_
#define MEMRA_TESTS_RESTART_SUPERVISED_DAEMON_H_

// The real memra-kvd under the real memra-kv-supervise (the fd-store subset of systemd's
// protocol), in a fresh directory: sockets <dir>/kvd.sock and <dir>/kvd.admin.sock, the
// daemon's pid in <dir>/kvd.pid (rewritten at each restart), logs in <dir>/supervise.log. The
// test's BUILD target needs data = ["//server:memra-kvd", "//server:memra-kv-supervise"].
// On destruction the supervisor gets SIGTERM (forwarded: the daemon drains and exits) and the
// directory is removed.

#include <dirent.h>
#include <signal.h>
#include <stdlib.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "client/client.h"
#include "client/internal.h"
#include "gtest/gtest.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "proto/memra/kv/v1/admin.grpc.pb.h"
#include "proto/memra/kv/v1/admin.pb.h"
#include "tests/subprocess.h"

namespace memra::testing {

// Open descriptors of process `pid` (from /proc): how many the supervisor's fd store holds is
// this minus its own few.
inline int OpenFds(pid_t pid) {
  DIR* dir = opendir(absl::StrCat("/proc/", pid, "/fd").c_str());
  if (dir == nullptr) return -1;
  int count = 0;
  while (dirent* entry = readdir(dir)) {
    if (entry->d_name[0] != '.') ++count;
  }
  closedir(dir);
  return count - 1;  // the DIR's own descriptor when pid is this process; harmless otherwise
}

// The number `key` of an engine's facts (tests/e2e/facts.h); a test failure, and 0, when it is
// missing or not a number.
inline uint64_t Number(const std::map<std::string, std::string>& facts, const std::string& key) {
  uint64_t value = 0;
  auto it = facts.find(key);
  if (it == facts.end() || !absl::SimpleAtoi(it->second, &value)) {
    ADD_FAILURE() << "no number \"" << key << "\" in the engine's facts";
  }
  return value;
}

class SupervisedDaemon {
 public:
  explicit SupervisedDaemon(const std::string& tag) {
    std::string pattern = absl::StrCat("/tmp/memra-", tag, "-XXXXXX");
    if (mkdtemp(pattern.data()) == nullptr) {
      ADD_FAILURE() << "mkdtemp " << pattern;
      return;
    }
    dir_ = pattern;
  }
  ~SupervisedDaemon() {
    TerminateAndReap(supervisor_);
    if (!dir_.empty()) {
      std::error_code error;
      std::filesystem::remove_all(dir_, error);
    }
  }
  SupervisedDaemon(const SupervisedDaemon&) = delete;
  SupervisedDaemon& operator=(const SupervisedDaemon&) = delete;

  // Starts the supervisor (`supervised` = true) or memra-kvd alone, with `flags` after the
  // test's defaults, and waits until the daemon answers GetStatus.
  [[nodiscard]] bool Start(const std::vector<std::string>& flags, bool supervised = true) {
    std::vector<std::string> args;
    if (supervised) {
      args = {Runfile("server/memra-kv-supervise"), "--pid_file=" + Path("kvd.pid"),
              "--restart_delay_ms=20", "--max_restarts=50", "--"};
    }
    for (const std::string& arg :
         {Runfile("server/memra-kvd"), "--socket_path=" + socket(), std::string("--socket_mode=0600"),
          std::string("--watchdog=false"), std::string("--metrics_address="),
          std::string("--drain_grace_ms=2000"), std::string("--log_level=info")}) {
      args.push_back(arg);
    }
    args.insert(args.end(), flags.begin(), flags.end());
    const std::string log = Path(supervised ? "supervise.log" : "kvd.log");
    supervisor_ = Spawn(args, log + ".out", log);
    if (!supervised) daemon_without_supervisor_ = supervisor_;
    if (supervisor_ <= 0) return false;
    return WaitServing(0);
  }

  // Waits until a daemon whose epoch differs from `old_epoch` answers (0: any).
  [[nodiscard]] bool WaitServing(uint64_t old_epoch) {
    const bool serving = PollUntil(
        [&] {
          if (!Exists(admin_socket())) return false;
          absl::StatusOr<memra::kv::v1::GetStatusResponse> status = Status();
          return status.ok() && status->epoch() != old_epoch;
        },
        supervisor_);
    EXPECT_TRUE(serving) << "no daemon serving on " << admin_socket() << " (after epoch "
                         << old_epoch << ")";
    return serving;
  }

  absl::StatusOr<memra::kv::v1::GetStatusResponse> Status() {
    ClientOptions options;
    options.deadline = absl::Milliseconds(500);
    absl::StatusOr<std::unique_ptr<KvClient>> admin = KvClient::Connect(admin_socket(), options);
    if (!admin.ok()) return admin.status();
    return ClientInternals::GetStatus(**admin);
  }

  // The engines the daemon knows (ListEngines on the admin socket).
  absl::StatusOr<memra::kv::v1::ListEnginesResponse> Engines() {
    auto channel = grpc::CreateChannel("unix:" + admin_socket(), grpc::InsecureChannelCredentials());
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
    memra::kv::v1::ListEnginesResponse response;
    const grpc::Status status = memra::kv::v1::KvAdmin::NewStub(channel)->ListEngines(
        &context, memra::kv::v1::ListEnginesRequest(), &response);
    if (!status.ok()) {
      return absl::UnavailableError(absl::StrCat("ListEngines: ", status.error_message()));
    }
    return response;
  }

  // The daemon's pid now (the supervisor's child; the process itself without a supervisor).
  pid_t DaemonPid() const {
    if (daemon_without_supervisor_ > 0) return daemon_without_supervisor_;
    std::ifstream in(Path("kvd.pid"));
    pid_t pid = 0;
    in >> pid;
    return pid;
  }

  // SIGKILLs the daemon and waits until the supervisor's next one serves (a new epoch).
  [[nodiscard]] bool KillDaemonAndAwaitRestart() {
    absl::StatusOr<memra::kv::v1::GetStatusResponse> before = Status();
    if (!before.ok()) {
      ADD_FAILURE() << before.status();
      return false;
    }
    const pid_t pid = DaemonPid();
    if (pid <= 0 || kill(pid, SIGKILL) != 0) {
      ADD_FAILURE() << "cannot kill daemon pid " << pid;
      return false;
    }
    return WaitServing(before->epoch());
  }

  // Once every engine is gone (detached or reclaimed): the daemon holds no session, arena,
  // allocation or reservation, and the supervisor's fd store is back to `store_baseline`
  // descriptors (OpenFds of the supervisor with only the journal stored).
  void ExpectNothingLeft(int store_baseline) {
    ASSERT_TRUE(PollUntil([&] {
      absl::StatusOr<memra::kv::v1::GetStatusResponse> now = Status();
      return now.ok() && now->engines() == 0;
    }));
    absl::StatusOr<memra::kv::v1::GetStatusResponse> end = Status();
    ASSERT_TRUE(end.ok()) << end.status();
    EXPECT_EQ(end->sessions(), 0u);
    EXPECT_EQ(end->arena_count(), 0u);
    EXPECT_EQ(end->allocated_bytes(), 0u);
    EXPECT_EQ(end->admission().allocated_bytes(), 0u);
    EXPECT_EQ(end->admission().reserved_bytes(), 0u);
    EXPECT_EQ(OpenFds(supervisor_), store_baseline) << "the fd store leaked";
  }

  pid_t supervisor() const { return supervisor_; }
  const std::string& dir() const { return dir_; }
  std::string socket() const { return Path("kvd.sock"); }
  std::string admin_socket() const { return Path("kvd.admin.sock"); }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  // Forget the unsupervised daemon's pid once the test reaped it.
  void Forget() { supervisor_ = daemon_without_supervisor_ = -1; }

 private:
  std::string dir_;
  pid_t supervisor_ = -1;
  pid_t daemon_without_supervisor_ = -1;
};

}  // namespace memra::testing

#endif  // MEMRA_TESTS_RESTART_SUPERVISED_DAEMON_H_
