#ifndef MEMRA_TESTS_E2E_PROCESS_H_
#define MEMRA_TESTS_E2E_PROCESS_H_

// Process helpers of the end-to-end tests: runfiles, spawning, bounded waits.

#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

extern char** environ;

namespace memra::testing {

inline constexpr absl::Duration kPatience = absl::Seconds(60);  // bound on every wait; never reached

inline std::string Runfile(const std::string& path) {
  const char* root = getenv("TEST_SRCDIR");
  return absl::StrCat(root != nullptr ? root : ".", "/memra_kv/", path);
}

inline bool Exists(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

inline pid_t Spawn(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const std::string& arg : args) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  pid_t pid = -1;
  EXPECT_EQ(posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ), 0) << args[0];
  return pid;
}

// Exit status of `pid`, waiting at most kPatience (then -1).
inline int WaitExit(pid_t pid) {
  const absl::Time deadline = absl::Now() + kPatience;
  while (absl::Now() < deadline) {
    int status = 0;
    pid_t done = waitpid(pid, &status, WNOHANG);
    if (done == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    absl::SleepFor(absl::Milliseconds(10));
  }
  return -1;
}

// Polls `ready` every 10 ms until it holds or kPatience passes; false if `alive` died first.
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

#endif  // MEMRA_TESTS_E2E_PROCESS_H_
