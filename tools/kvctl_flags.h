#ifndef MEMRA_TOOLS_KVCTL_FLAGS_H_
#define MEMRA_TOOLS_KVCTL_FLAGS_H_

// memra-kvctl's command line: the commands and their flags (the one table both parsing and the
// help text are made from), the parsed Invocation, and the text a usage error prints. Exit codes
// and the rest of the CLI: tools/kvctl.h.
//
// Thread-safety: pure functions.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace memra::kvctl {

// The daemon's admin socket (memra-kvd's admin_socket_path default: beside the engine socket
// gpuN.sock). The engine socket refuses the operators' calls (drain, evict, the listings).
inline constexpr char kDefaultSocketPattern[] = "/run/memra-kv/gpu%d.admin.sock";
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
  std::string socket_path;  // --socket, or --gpu's admin socket, or GPU 0's
  // A group of daemons (status, fit, max-context; docs/groups.md): --socket with several
  // comma-separated paths in rank order, or a group file. socket_path is then the first path.
  std::vector<std::string> group_sockets;  // --socket=A,B,...: two or more
  std::string group_path;                  // --group
  uint32_t pp = 0;                         // --pp (0: not given)
  std::vector<uint32_t> stage_layers;      // --stage-layers
  bool IsGroup() const { return !group_sockets.empty() || !group_path.empty(); }
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
  uint32_t tp_ranks = 0;  // --tp; with a group, the group's TP degree
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
  std::string kv_dtype;  // import-model --kv-dtype ("" = auto)
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

// The command word: the first argument that is not a flag (flag values are always --flag=VALUE).
std::string CommandWord(const std::vector<std::string>& args);

// What a usage error prints: the refusal, then `command`'s usage (or the command list when
// `command` is not one) and where to read more.
std::string UsageMessage(const absl::Status& status, absl::string_view command);

}  // namespace memra::kvctl

#endif  // MEMRA_TOOLS_KVCTL_FLAGS_H_
