#ifndef MEMRA_TOOLS_KVCTL_H_
#define MEMRA_TOOLS_KVCTL_H_

// memra-kvctl: the operator's CLI over memra-kvd's KvAdmin service (proto/memra/kv/v1/admin.proto).
// The binary (tools/kvctl_main.cc) is RunKvctl over argv; everything else is a library so that
// parsing, rendering and exit codes are unit-tested: the command line in tools/kvctl_flags.h,
// the connection in tools/kvctl_connection.h, the output in tools/kvctl_render.h, and here the
// commands (what each one asks the daemon and prints) and their exit codes. `memra-kvctl help` and
// tools/README.md teach the commands; HelpText() is the one source of that text.
//
// Exit codes (the contract scripts rely on; keep tools/README.md and HelpText() in step):
//   0  success
//   1  internal error of memra-kvctl itself (e.g. an answer it could not print)
//   2  usage error: bad command, flag or value, or an input file that cannot be read or parsed
//   3  the daemon is unreachable: no connection within --timeout, or the call ended UNAVAILABLE
//      or DEADLINE_EXCEEDED (the daemon stopped answering)
//   4  the daemon refused the request (any other gRPC error: NOT_FOUND, INVALID_ARGUMENT,
//      RESOURCE_EXHAUSTED with its AdmissionRefusal numbers, ...)
//   5  the answer is "nothing fits": `fit` with sessions_now == 0, `max-context` with
//      max_context_now == 0. The answer is printed as usual.
//
// Thread-safety: pure functions and one-shot calls; nothing is shared.

#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/memra/kv/v1/admin.pb.h"
#include "tools/kvctl_flags.h"
#include "tools/kvctl_render.h"

namespace memra::kvctl {

enum ExitCode : int {
  kExitOk = 0,
  kExitInternal = 1,
  kExitUsage = 2,
  kExitUnreachable = 3,
  kExitRefused = 4,
  kExitFitsNothing = 5,
};

// Reads the files an invocation names into the request's model selector.
absl::StatusOr<kv::v1::ModelSelector> LoadModelSelector(const Invocation& invocation);

// The whole CLI: parses `args` (argv without the program name), talks to the daemon, prints the
// answer to `out` and diagnostics to `err`; returns the exit code.
int RunKvctl(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

}  // namespace memra::kvctl

#endif  // MEMRA_TOOLS_KVCTL_H_
