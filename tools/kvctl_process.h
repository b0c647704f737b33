#ifndef MEMRA_TOOLS_KVCTL_PROCESS_H_
#define MEMRA_TOOLS_KVCTL_PROCESS_H_

// The real memra-kvctl binary as a separate process, for the end-to-end tests: its exit code and
// what it printed (through files in a test directory).

#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "tests/subprocess.h"

namespace memra::testing {

struct KvctlOutcome {
  int exit_code = -1;
  std::string out;
  std::string err;
};

inline std::string ReadWholeFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Runs memra-kvctl (the test's runfile) with `args`; stdout and stderr go through `dir`/out and
// `dir`/err. exit_code -1 when it could not be started.
inline KvctlOutcome RunKvctlBinary(std::vector<std::string> args, const std::string& dir) {
  args.insert(args.begin(), Runfile("tools/memra-kvctl"));
  const std::string out_path = dir + "/out";
  const std::string err_path = dir + "/err";
  KvctlOutcome outcome;
  const pid_t pid = Spawn(args, out_path, err_path);
  if (pid < 0) return outcome;
  outcome.exit_code = WaitExit(pid);
  outcome.out = ReadWholeFile(out_path);
  outcome.err = ReadWholeFile(err_path);
  return outcome;
}

}  // namespace memra::testing

#endif  // MEMRA_TOOLS_KVCTL_PROCESS_H_
