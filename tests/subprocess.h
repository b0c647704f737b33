#ifndef MEMRA_TESTS_SUBPROCESS_H_
#define MEMRA_TESTS_SUBPROCESS_H_

// Tests that run the project's real binaries as separate processes (the e2e tests): where Bazel
// put a binary, starting it with its output in files, and waiting for its exit with a bound.

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

extern char** environ;

namespace memra::testing {

// A data dependency's path in the test's runfiles, e.g. Runfile("server/memra-kvd").
inline std::string Runfile(const std::string& path) {
  const char* root = getenv("TEST_SRCDIR");
  return absl::StrCat(root != nullptr ? root : ".", "/memra_kv/", path);
}

inline bool Exists(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

// Starts args[0] with `args` and this process's environment; stdout and stderr go to the given
// files (truncated) when the paths are not empty. -1 (and a test failure) when it cannot start.
inline pid_t Spawn(const std::vector<std::string>& args, const std::string& stdout_path = "",
                   const std::string& stderr_path = "") {
  std::vector<char*> argv;
  for (const std::string& arg : args) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  posix_spawn_file_actions_t files;
  posix_spawn_file_actions_init(&files);
  for (const auto& [fd, path] : {std::pair{STDOUT_FILENO, &stdout_path},
                                 std::pair{STDERR_FILENO, &stderr_path}}) {
    if (!path->empty()) {
      posix_spawn_file_actions_addopen(&files, fd, path->c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                       0600);
    }
  }
  pid_t pid = -1;
  const int spawned = posix_spawn(&pid, argv[0], &files, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&files);
  EXPECT_EQ(spawned, 0) << args[0];
  return spawned == 0 ? pid : -1;
}

// Exit status of `pid` (128 + signal when a signal ended it), waiting at most `patience`
// (then -1).
inline int WaitExit(pid_t pid, absl::Duration patience = absl::Seconds(60)) {
  const absl::Time deadline = absl::Now() + patience;
  while (absl::Now() < deadline) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return -1;
}

// SIGKILLs and reaps `pid` (nothing when it is <= 0): a test's cleanup of a process it left.
inline void KillAndReap(pid_t pid) {
  if (pid <= 0) return;
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
}

// SIGTERM, so a daemon a test left running still takes its clean path (frees and unlinks
// everything); SIGKILL when it has not exited within `patience`. Nothing when `pid` <= 0.
inline void TerminateAndReap(pid_t pid, absl::Duration patience = absl::Seconds(60)) {
  if (pid > 0 && kill(pid, SIGTERM) == 0 && WaitExit(pid, patience) < 0) KillAndReap(pid);
}

// Bound on every wait of an e2e test; never reached when things work.
inline constexpr absl::Duration kPatience = absl::Seconds(60);

// Polls `ready` every 10 ms until it holds or kPatience passes; false if `must_stay_alive`
// (when > 0) exited first.
template <typename Ready>
bool PollUntil(Ready ready, pid_t must_stay_alive = 0) {
  const absl::Time deadline = absl::Now() + kPatience;
  while (absl::Now() < deadline) {
    if (ready()) return true;
    if (must_stay_alive > 0 && waitpid(must_stay_alive, nullptr, WNOHANG) == must_stay_alive) {
      return false;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return false;
}

}  // namespace memra::testing

#endif  // MEMRA_TESTS_SUBPROCESS_H_
