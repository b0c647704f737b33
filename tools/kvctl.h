#ifndef MEMRA_TOOLS_KVCTL_H_
#define MEMRA_TOOLS_KVCTL_H_

// memra-kvctl: the operator's CLI over memra-kvd's KvAdmin service (proto/memra/kv/v1/admin.proto).
// The binary (tools/kvctl_main.cc) is RunKvctl over argv; everything else is here so that parsing,
// rendering and exit codes are unit-tested. `memra-kvctl help` and tools/README.md teach the
// commands; HelpText() is the one source of that text.
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

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "proto/memra/kv/v1/admin.pb.h"
#include "proto/memra/kv/v1/prefix.pb.h"

namespace memra::kvctl {

enum ExitCode : int {
  kExitOk = 0,
  kExitInternal = 1,
  kExitUsage = 2,
  kExitUnreachable = 3,
  kExitRefused = 4,
  kExitFitsNothing = 5,
};

inline constexpr char kDefaultSocketPattern[] = "/run/memra-kv/gpu%d.sock";
inline constexpr absl::Duration kDefaultTimeout = absl::Seconds(10);
// The capacity range CreateSession accepts (cache.proto), checked here so a typo is a usage
// error that names the flag rather than a refusal from the daemon.
inline constexpr uint64_t kMaxContextTokens = (uint64_t{1} << 31) - 1;

// A parsed command line. Which fields mean anything depends on `command`; ParseArgs refuses
// flags the command does not take.
struct Invocation {
  std::string command;     // "status", "sessions", ..., "help"
  std::string help_topic;  // "help CMD" / "CMD --help": CMD; empty: the overview

  // Common.
  std::string socket_path;  // --socket, or --gpu's path, or GPU 0's
  absl::Duration timeout = kDefaultTimeout;
  bool json = false;

  // Model selection (cost, fit, max-context): exactly one of these is set. import-model uses
  // hf_config_path alone.
  std::string model_fingerprint;  // raw 32 bytes (from --model's hex or base64)
  std::string hf_config_path;
  std::string plan_path;

  // Session shape (cost, fit, max-context).
  uint64_t context = 0;  // --context; required by cost and fit
  uint32_t layer_lo = 0;
  std::optional<uint32_t> layer_hi;
  uint32_t tp_ranks = 0;
  bool spec_snapshot = false;

  // sessions.
  uint64_t engine_id = 0;  // 0: every engine

  // evict.
  uint64_t entry_id = 0;

  // import-model.
  std::string name;
  uint32_t index_pool = 0;
  std::optional<uint32_t> index_ring_rows;
  bool swa_ring = false;
  bool register_plan = false;
};

// argv without the program name. Refusals are INVALID_ARGUMENT whose message names the flag and
// value and what is accepted.
absl::StatusOr<Invocation> ParseArgs(const std::vector<std::string>& args);

// --context: decimal tokens with an optional binary suffix: k/K = 1024, m/M = 1048576
// ("32k" = 32768, "1M" = 1048576), in 1..kMaxContextTokens.
absl::StatusOr<uint64_t> ParseContext(absl::string_view text);

// The overview (empty topic) or one command's help. NOT_FOUND for an unknown command.
absl::StatusOr<std::string> HelpText(absl::string_view topic);

// Reads the files an invocation names into the request's model selector.
absl::StatusOr<kv::v1::ModelSelector> LoadModelSelector(const Invocation& invocation);

// Human output of each answer (what the command prints without --json); every line ends in
// '\n'. RenderFit takes the context asked about, which FitResponse does not repeat.
std::string RenderStatus(const kv::v1::GetStatusResponse& status);
std::string RenderEngines(const kv::v1::ListEnginesResponse& engines);
std::string RenderSessions(const kv::v1::ListSessionsResponse& sessions);
std::string RenderCost(const kv::v1::CostResponse& cost);
std::string RenderFit(const kv::v1::FitResponse& fit, uint64_t context);
std::string RenderMaxContext(const kv::v1::MaxContextResponse& max_context);
std::string RenderImport(const kv::v1::ImportModelResponse& imported);
std::string RenderDrain(const kv::v1::DrainResponse& drained);
std::string RenderPrefixes(const kv::v1::ListPrefixesResponse& prefixes);
std::string RenderEvict(const kv::v1::EvictPrefixResponse& evicted);

// --json: protobuf JSON, every primitive field printed, field names as in the .proto, one line.
absl::StatusOr<std::string> RenderJson(const google::protobuf::Message& message);

// The whole CLI: parses `args` (argv without the program name), talks to the daemon, prints the
// answer to `out` and diagnostics to `err`; returns the exit code.
int RunKvctl(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

}  // namespace memra::kvctl

#endif  // MEMRA_TOOLS_KVCTL_H_
