#include "tools/kvctl.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/errors.h"
#include "common/grpc_status.h"
#include "core/admission.h"
#include "core/status_macros.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "proto/memra/kv/v1/admin.grpc.pb.h"
#include "proto/memra/kv/v1/prefix.grpc.pb.h"
#include "tools/text_format.h"

namespace memra::kvctl {
namespace {

namespace pb = ::memra::kv::v1;
using Align = TextTable::Align;

// ---- the commands and their flags: the one source of parsing rules and help text ----------

struct FlagSpec {
  absl::string_view name;        // "--context"
  absl::string_view value_name;  // "TOKENS"; empty: a switch (no value)
  absl::string_view help;
};

constexpr FlagSpec kSocketFlag{"--socket", "PATH",
                               "the daemon's socket (default /run/memra-kv/gpu0.sock)"};
constexpr FlagSpec kGpuFlag{"--gpu", "N", "the socket of GPU N's daemon: /run/memra-kv/gpuN.sock"};
constexpr FlagSpec kJsonFlag{"--json", "",
                             "print the daemon's answer as protobuf JSON (field names as in "
                             "admin.proto; 64-bit numbers are strings, bytes are base64)"};
constexpr FlagSpec kTimeoutFlag{"--timeout", "SECONDS",
                                "deadline for connecting and answering (default 10; 0.5 is fine)"};
constexpr FlagSpec kHelpFlag{"--help", "", "this command's help"};

constexpr FlagSpec kModelFlag{"--model", "FINGERPRINT",
                              "a plan registered with the daemon: 64 hex digits (as import-model "
                              "prints) or the base64 --json prints"};
constexpr FlagSpec kHfConfigFlag{"--hf-config", "PATH",
                                 "a Hugging Face config.json on this machine (sent as text; "
                                 "imported with default options, not registered: for the SWA "
                                 "ring, import-model --swa-ring --register, then --model)"};
constexpr FlagSpec kPlanFlag{
    "--plan", "PATH", "a ModelPlan in protobuf JSON (e.g. `import-model --json | jq .plan`)"};

constexpr FlagSpec kContextFlag{"--context", "TOKENS",
                                "session capacity in tokens; k = 1024, m = 1048576 (32k = 32768); "
                                "1..2147483647"};
constexpr FlagSpec kLayersFlag{"--layers", "LO:HI",
                               "only layers LO..HI-1 (a pipeline stage); LO: runs to the last "
                               "layer, MTP blocks included (default: all)"};
constexpr FlagSpec kTpFlag{"--tp", "N",
                           "tensor-parallel ranks sharing the K/V heads: the cost of one rank's "
                           "shard (default 1)"};
constexpr FlagSpec kSpecSnapshotFlag{"--spec-snapshot", "",
                                     "include the spec-decode snapshot buffers"};

constexpr FlagSpec kEngineFlag{"--engine", "ID",
                               "only this engine's sessions (IDs from `engines`)"};
constexpr FlagSpec kEntryFlag{"--entry", "ID", "the prefix entry (IDs from `prefixes`)"};

constexpr FlagSpec kNameFlag{"--name", "NAME",
                             "the plan's name (default: the config's _name_or_path or model_type)"};
constexpr FlagSpec kIndexPoolFlag{"--index-pool", "N",
                                  "DSA indexer tokens per pool key when the config has no "
                                  "index_kpool (default: the importer's)"};
constexpr FlagSpec kIndexRingRowsFlag{"--index-ring-rows", "N",
                                      "indexer tail-ring rows (0: flat plane; default: the "
                                      "default working rows)"};
constexpr FlagSpec kSwaRingFlag{"--swa-ring", "",
                                "sliding-window layers use the SWA ring (rows capped near the "
                                "window instead of the full context)"};
constexpr FlagSpec kRegisterFlag{"--register", "",
                                 "also register the plan with the daemon, so --model=FINGERPRINT "
                                 "names it"};

constexpr const FlagSpec* kCommonFlags[] = {&kSocketFlag, &kGpuFlag, &kJsonFlag, &kTimeoutFlag,
                                            &kHelpFlag};

struct CommandSpec {
  absl::string_view name;
  absl::string_view summary;           // one line, for the overview
  absl::string_view synopsis;          // after "memra-kvctl NAME"
  std::vector<const FlagSpec*> flags;  // besides the common ones
  absl::string_view about;
  absl::string_view example;
  absl::string_view output;
};

const std::vector<const FlagSpec*> kModelShapeFlags = {
    &kModelFlag,  &kHfConfigFlag, &kPlanFlag,        &kContextFlag,
    &kLayersFlag, &kTpFlag,       &kSpecSnapshotFlag};

const std::vector<CommandSpec>& Commands() {
  static const std::vector<CommandSpec> commands = {
      {"status",
       "backend, device, admission ledger and engines",
       "",
       {},
       "What the daemon holds right now: its backend and device, the admission ledger and the\n"
       "attached engines.",
       "memra-kvctl --gpu=1 status",
       "budget = allocated + reserved + free (when a reload shrank the budget below what is held,\n"
       "free is 0 and 'over budget' says by how much). allocated: live arenas and prefix-cache\n"
       "storage; reserved: admission reservations not yet sessions; evictable: prefix-cache bytes\n"
       "admission may evict to make room. granularity: every arena is a multiple of it."},
      {"sessions",
       "live sessions: engine, model, capacity, length, bytes",
       "[--engine=ID]",
       {&kEngineFlag},
       "Every live session (or one engine's): who holds it, which model, how big.",
       "memra-kvctl sessions --engine=3",
       "CAPACITY: tokens the session can hold; LENGTH: committed tokens; ARENA: device bytes;\n"
       "LAYOUT: 1 + grows since creation; STATE: 'txn' while a transaction is open, 'tainted'\n"
       "after the engine declared its memory untrustworthy (it must release the session)."},
      {"engines",
       "attached engines and their leases",
       "",
       {},
       "The engines attached to the daemon and their leases.",
       "memra-kvctl engines",
       "LEASE: 'live' while the engine's Attach stream is open and heartbeats are on time, else\n"
       "'ended' (its sessions are freed after the grace period). ALLOCATED: its sessions' arena\n"
       "bytes; RESERVED: bytes held by its RESV admission reservations; HEARTBEAT: age of the\n"
       "last heartbeat (or of the lease's end)."},
      {"cost", "exact bytes of one session of a model at a context",
       "(--model=FINGERPRINT | --hf-config=PATH | --plan=PATH) --context=TOKENS\n"
       "    [--layers=LO:HI] [--tp=N] [--spec-snapshot]",
       kModelShapeFlags,
       "The exact bytes one session of a model takes at a context, with the breakdown. The\n"
       "daemon answers from the same sizing function CreateSession uses: there is no second\n"
       "formula.",
       "memra-kvctl cost --hf-config=llama-3.1-8b/config.json --context=32k",
       "cost: THE number, what admission charges and the backend allocates (arena bytes).\n"
       "per token: what one more token of context adds at this context. full K/V, sliding K/V\n"
       "and latent (MLA, with its indexer): each class's bytes a token; sliding rows stop at the\n"
       "ring's cap, and once the context passes it their bytes count in fixed. fixed: what does\n"
       "not scale with the context (mirrors, recurrent state, pads, snapshots, full rings).\n"
       "planes = fixed + per token x context; cost rounds planes up to plane alignment and the\n"
       "backend's granularity."},
      {"fit", "how many sessions of a context fit now, after eviction, when empty",
       "(--model=FINGERPRINT | --hf-config=PATH | --plan=PATH) --context=TOKENS\n"
       "    [--layers=LO:HI] [--tp=N] [--spec-snapshot]",
       kModelShapeFlags,
       "How many sessions of one shape fit in this GPU's budget, and how many context tokens of\n"
       "the model that is (the question an engine scheduler asks).",
       "memra-kvctl fit --model=3f5c...e1 --context=128k || echo \"no room now\"",
       "sessions: whole sessions that fit in the free bytes now / after evicting every evictable\n"
       "prefix-cache byte / in the whole budget with nothing else held. total tokens: context\n"
       "tokens that fit when packed as full sessions plus one shorter session in the remainder.\n"
       "Exits 5 when no session fits now."},
      {"max-context",
       "the largest context one session could have",
       "(--model=FINGERPRINT | --hf-config=PATH | --plan=PATH)\n"
       "    [--layers=LO:HI] [--tp=N] [--spec-snapshot]",
       {&kModelFlag, &kHfConfigFlag, &kPlanFlag, &kLayersFlag, &kTpFlag, &kSpecSnapshotFlag},
       "The largest capacity one session of a model could be created with now, after evicting\n"
       "the prefix cache, and with the GPU's budget empty. (The context is the answer here, so\n"
       "--context is not taken.)",
       "memra-kvctl max-context --hf-config=gemma-3-27b-it/config.json",
       "max context: tokens, now / after eviction / when empty. session bytes: the arena of a\n"
       "session at the max context now. Exits 5 when not even a 1-token session fits now."},
      {"import-model",
       "Hugging Face config.json -> model plan (optionally registered)",
       "--hf-config=PATH [--name=NAME] [--index-pool=N]\n"
       "    [--index-ring-rows=N] [--swa-ring] [--register]",
       {&kHfConfigFlag, &kNameFlag, &kIndexPoolFlag, &kIndexRingRowsFlag, &kSwaRingFlag,
        &kRegisterFlag},
       "Turns a model's Hugging Face config.json into the daemon's model plan: dense (Llama,\n"
       "Qwen, Mistral), Gemma sliding-window + global, MLA (DeepSeek, GLM with an indexer),\n"
       "hybrid linear attention (Qwen3-Next, Jamba). An unsupported field or architecture is\n"
       "refused with its name (exit 4).",
       "memra-kvctl import-model --hf-config=llama-3.1-8b/config.json --register",
       "architecture, name and fingerprint of the plan, and its layers per state kind with their\n"
       "indices. With --register, `cost/fit/max-context --model=FINGERPRINT` name it (engines\n"
       "registering the same plan get the same fingerprint). --json prints the response, the\n"
       "ModelPlan included (`jq .plan` gives a file for --plan)."},
      {"prefixes",
       "prefix-cache entries and the cache's counters",
       "",
       {},
       "Lists the prefix cache's entries (captured token prefixes, restorable by any engine of\n"
       "the same model plan and shape) and its byte ledger and counters. Refused (exit 4) when\n"
       "the daemon runs without a prefix cache (prefix_cache_budget_bytes = 0).",
       "memra-kvctl prefixes",
       "ENTRY id, SHAPE (fingerprint of model plan + layer range + TP), TOKENS at its boundary,\n"
       "BLOCKS, block and boundary bytes (blocks shared between entries count in each), PINS\n"
       "(restores in flight), LAST USE tick; then stored / evictable / pinned bytes of the cache\n"
       "(shared blocks once) and hit / partial / miss lookups, restores and evictions."},
      {"evict",
       "drop one prefix-cache entry now",
       "--entry=ID",
       {&kEntryFlag},
       "Evicts one entry (as LRU eviction would): its boundary state and every block no other\n"
       "entry shares are freed and return to the admission budget; subscribers get an evicted\n"
       "event. A pinned entry (being restored) is refused (exit 4).",
       "memra-kvctl evict --entry=12",
       "The bytes freed and the cache's stored bytes after."},
      {"drain",
       "refuse new engines and sessions; existing sessions keep working",
       "",
       {},
       "Stops admitting: new engines and sessions get UNAVAILABLE; live sessions keep working\n"
       "until released. Idempotent. (systemctl stop also drains, then exits.)",
       "memra-kvctl --gpu=0 drain",
       "How many sessions are still open."},
      {"undrain",
       "accept new engines and sessions again",
       "",
       {},
       "Ends a drain: new engines and sessions are accepted again. Idempotent.",
       "memra-kvctl --gpu=0 undrain",
       "A confirmation line."},
  };
  return commands;
}

const CommandSpec* FindCommand(absl::string_view name) {
  for (const CommandSpec& command : Commands()) {
    if (command.name == name) return &command;
  }
  return nullptr;
}

const FlagSpec* FindFlag(const CommandSpec& command, absl::string_view name) {
  for (const FlagSpec* flag : kCommonFlags) {
    if (flag->name == name) return flag;
  }
  for (const FlagSpec* flag : command.flags) {
    if (flag->name == name) return flag;
  }
  return nullptr;
}

bool IsAnyCommandsFlag(absl::string_view name) {
  for (const CommandSpec& command : Commands()) {
    if (FindFlag(command, name) != nullptr) return true;
  }
  return false;
}

std::string FlagUsage(const FlagSpec& flag) {
  return flag.value_name.empty() ? std::string(flag.name)
                                 : absl::StrCat(flag.name, "=", flag.value_name);
}

// Help lines stay within this many columns.
constexpr size_t kHelpWidth = 100;

std::vector<std::string> WrapWords(absl::string_view text, size_t width) {
  std::vector<std::string> lines(1);
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (!lines.back().empty() && lines.back().size() + 1 + word.size() > width)
      lines.emplace_back();
    absl::StrAppend(&lines.back(), lines.back().empty() ? "" : " ", word);
  }
  return lines;
}

// "  --flag=VALUE  help", the help wrapped under itself.
std::string FlagTable(const std::vector<const FlagSpec*>& flags) {
  size_t usage_width = 0;
  for (const FlagSpec* flag : flags) usage_width = std::max(usage_width, FlagUsage(*flag).size());
  const size_t help_width = kHelpWidth - usage_width - 4;  // 2 indent + 2 between columns
  TextTable table({{""}, {""}});
  for (const FlagSpec* flag : flags) {
    std::string usage = absl::StrCat("  ", FlagUsage(*flag));
    for (std::string& line : WrapWords(flag->help, help_width)) {
      table.AddRow({std::exchange(usage, ""), std::move(line)});
    }
  }
  return table.Render();
}

std::string CommonFlagTable() {
  return FlagTable({std::begin(kCommonFlags), std::end(kCommonFlags)});
}

std::string Indent(absl::string_view text) {
  return absl::StrCat("  ", absl::StrReplaceAll(text, {{"\n", "\n  "}}), "\n");
}

// The usage line and the command's own flags: what a usage error prints.
std::string CommandUsage(const CommandSpec& command) {
  std::string text = absl::StrCat("Usage: memra-kvctl ", command.name);
  if (!command.synopsis.empty()) absl::StrAppend(&text, " ", command.synopsis);
  absl::StrAppend(&text, " [common flags]\n");
  if (!command.flags.empty()) absl::StrAppend(&text, "\nFlags:\n", FlagTable(command.flags));
  return text;
}

std::string CommandHelp(const CommandSpec& command) {
  const bool answers_fit = command.name == "fit" || command.name == "max-context";
  return absl::StrCat(
      "memra-kvctl ", command.name, ": ", command.summary, "\n\n", command.about, "\n\n",
      CommandUsage(command), "\nCommon flags:\n", CommonFlagTable(), "\nExample:\n",
      Indent(command.example), "\nOutput:\n", Indent(command.output),
      "\nExit codes: 0 ok, 2 usage error, 3 daemon unreachable, 4 refused by the daemon",
      answers_fit ? ", 5 nothing fits now" : "", "\n(memra-kvctl help explains them).\n");
}

std::string CommandList() {
  TextTable commands({{""}, {""}});
  for (const CommandSpec& command : Commands()) {
    commands.AddRow({absl::StrCat("  ", command.name), std::string(command.summary)});
  }
  commands.AddRow({"  help [COMMAND]", "this overview, or a command's flags, example and output"});
  return absl::StrCat(
      "Usage: memra-kvctl COMMAND [FLAGS]   (flags before or after the command, as "
      "--flag=VALUE)\n\n"
      "Commands:\n",
      commands.Render());
}

std::string OverviewHelp() {
  return absl::StrCat(
      "memra-kvctl: the operator's CLI for memra-kvd, the per-GPU KV-cache daemon.\n\n",
      CommandList(), "\nCommon flags:\n", CommonFlagTable(),
      "\nExit codes:\n"
      "  0  success\n"
      "  1  internal error of memra-kvctl\n"
      "  2  usage error: bad command, flag or value, or an unreadable input file\n"
      "  3  daemon unreachable: no connection within --timeout, or the call ended UNAVAILABLE or\n"
      "     DEADLINE_EXCEEDED (check: systemctl status memra-kvd@N)\n"
      "  4  refused by the daemon: the gRPC code and message are printed, and for\n"
      "     RESOURCE_EXHAUSTED the admission numbers (needed, free, evictable, budget)\n"
      "  5  fit / max-context: nothing fits now (the answer is 0); the answer is still printed\n\n"
      "Example:\n"
      "  memra-kvctl import-model --hf-config=/models/llama-3.1-8b/config.json --register\n"
      "  memra-kvctl cost --model=FINGERPRINT --context=32k\n\n"
      "Run 'memra-kvctl help COMMAND' for a command's flags, an example and what its output "
      "means.\n");
}

// ---- parsing ------------------------------------------------------------------------------

absl::Status Usage(absl::string_view message) { return absl::InvalidArgumentError(message); }

absl::StatusOr<uint64_t> ParseWhole(absl::string_view flag, absl::string_view text, uint64_t min,
                                    uint64_t max) {
  uint64_t value = 0;
  // SimpleAtoi accepts a sign and surrounding space; a flag value is digits only.
  const bool digits = !text.empty() && std::all_of(text.begin(), text.end(), absl::ascii_isdigit);
  if (!digits || !absl::SimpleAtoi(text, &value) || value < min || value > max) {
    return Usage(absl::StrCat(flag, "=", text, ": want a whole number in ", min, "..", max));
  }
  return value;
}

absl::StatusOr<std::string> ParseFingerprint(absl::string_view text) {
  constexpr size_t kFingerprintBytes = 32;  // SHA-256
  if (text.size() == 2 * kFingerprintBytes &&
      std::all_of(text.begin(), text.end(), absl::ascii_isxdigit)) {
    return absl::HexStringToBytes(text);
  }
  std::string decoded;
  if (absl::Base64Unescape(text, &decoded) && decoded.size() == kFingerprintBytes) return decoded;
  return Usage(absl::StrCat("--model=", text,
                            ": want a plan fingerprint, 64 hex digits (or the "
                            "base64 of its 32 bytes), got ",
                            text.size(), " characters"));
}

absl::Status ParseLayers(absl::string_view text, Invocation& invocation) {
  const std::vector<absl::string_view> parts = absl::StrSplit(text, ':');
  constexpr uint64_t kMaxLayer = UINT32_MAX;
  if (parts.size() != 2) {
    return Usage(
        absl::StrCat("--layers=", text, ": want LO:HI (layers LO..HI-1) or LO: (LO to the end)"));
  }
  ASSIGN_OR_RETURN(const uint64_t lo, ParseWhole("--layers LO", parts[0], 0, kMaxLayer));
  invocation.layer_lo = static_cast<uint32_t>(lo);
  if (parts[1].empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(const uint64_t hi, ParseWhole("--layers HI", parts[1], 0, kMaxLayer));
  if (hi <= lo) {
    return Usage(absl::StrCat("--layers=", text, ": HI (", hi, ") must be above LO (", lo,
                              "): the layers are LO..HI-1"));
  }
  invocation.layer_hi = static_cast<uint32_t>(hi);
  return absl::OkStatus();
}

absl::StatusOr<absl::Duration> ParseTimeout(absl::string_view text) {
  constexpr double kMaxSeconds = 3600;
  double seconds = 0;
  if (!absl::SimpleAtod(text, &seconds) || !std::isfinite(seconds) || seconds <= 0 ||
      seconds > kMaxSeconds) {
    return Usage(absl::StrCat("--timeout=", text, ": want seconds above 0 and at most ",
                              kMaxSeconds, " (e.g. 10 or 0.5)"));
  }
  return absl::Seconds(seconds);
}

// One flag's value into the invocation. `flag` is one the command takes.
absl::Status ApplyFlag(const FlagSpec& flag, absl::string_view value, Invocation& invocation) {
  const absl::string_view name = flag.name;
  if (name == "--socket") {
    if (value.empty()) return Usage("--socket= needs a path");
    invocation.socket_path = std::string(value);
  } else if (name == "--gpu") {
    ASSIGN_OR_RETURN(const uint64_t gpu, ParseWhole(name, value, 0, 1023));
    invocation.socket_path = absl::StrFormat(kDefaultSocketPattern, gpu);
  } else if (name == "--json") {
    invocation.json = true;
  } else if (name == "--timeout") {
    ASSIGN_OR_RETURN(invocation.timeout, ParseTimeout(value));
  } else if (name == "--help") {
    invocation.help_topic = invocation.command;
    invocation.command = "help";
  } else if (name == "--model") {
    ASSIGN_OR_RETURN(invocation.model_fingerprint, ParseFingerprint(value));
  } else if (name == "--hf-config" || name == "--plan") {
    if (value.empty()) return Usage(absl::StrCat(name, "= needs a path"));
    (name == "--plan" ? invocation.plan_path : invocation.hf_config_path) = std::string(value);
  } else if (name == "--context") {
    ASSIGN_OR_RETURN(invocation.context, ParseContext(value));
  } else if (name == "--layers") {
    return ParseLayers(value, invocation);
  } else if (name == "--tp") {
    ASSIGN_OR_RETURN(const uint64_t ranks, ParseWhole(name, value, 1, UINT32_MAX));
    invocation.tp_ranks = static_cast<uint32_t>(ranks);
  } else if (name == "--spec-snapshot") {
    invocation.spec_snapshot = true;
  } else if (name == "--engine") {
    ASSIGN_OR_RETURN(invocation.engine_id, ParseWhole(name, value, 1, UINT64_MAX));
  } else if (name == "--entry") {
    ASSIGN_OR_RETURN(invocation.entry_id, ParseWhole(name, value, 1, UINT64_MAX));
  } else if (name == "--name") {
    if (value.empty()) return Usage("--name= needs a name (omit it for the config's own)");
    invocation.name = std::string(value);
  } else if (name == "--index-pool") {
    ASSIGN_OR_RETURN(const uint64_t pool, ParseWhole(name, value, 1, UINT32_MAX));
    invocation.index_pool = static_cast<uint32_t>(pool);
  } else if (name == "--index-ring-rows") {
    ASSIGN_OR_RETURN(const uint64_t rows, ParseWhole(name, value, 0, UINT32_MAX));
    invocation.index_ring_rows = static_cast<uint32_t>(rows);
  } else if (name == "--swa-ring") {
    invocation.swa_ring = true;
  } else if (name == "--register") {
    invocation.register_plan = true;
  } else {
    return absl::InternalError(absl::StrCat("no parser for ", name));  // a FlagSpec without one
  }
  return absl::OkStatus();
}

// What the command needs beyond well-formed flags.
absl::Status CheckRequired(const Invocation& invocation, const std::set<std::string>& given) {
  if (given.count("--socket") && given.count("--gpu")) {
    return Usage("give --socket=PATH or --gpu=N, not both");
  }
  const absl::string_view command = invocation.command;
  if (command == "cost" || command == "fit" || command == "max-context") {
    const int models = given.count("--model") + given.count("--hf-config") + given.count("--plan");
    if (models != 1) {
      return Usage(absl::StrCat(command,
                                " needs exactly one model: --model=FINGERPRINT, "
                                "--hf-config=PATH or --plan=PATH (got ",
                                models, ")"));
    }
    if (command != "max-context" && !given.count("--context")) {
      return Usage(absl::StrCat(command, " needs --context=TOKENS (e.g. --context=32k)"));
    }
  }
  if (command == "evict" && !given.count("--entry")) {
    return Usage("evict needs --entry=ID (IDs from `memra-kvctl prefixes`)");
  }
  if (command == "import-model" && !given.count("--hf-config")) {
    return Usage("import-model needs --hf-config=PATH (the model's config.json)");
  }
  return absl::OkStatus();
}

// The command word: the first argument that is not a flag (flag values are always --flag=VALUE).
std::string CommandWord(const std::vector<std::string>& args) {
  for (const std::string& arg : args) {
    if (!absl::StartsWith(arg, "-")) return arg;
  }
  return "";
}

// ---- talking to the daemon ----------------------------------------------------------------

// What to check when the daemon cannot be reached: the unit of the socket's GPU, or the group
// that may use the socket.
std::string UnreachableHint(const std::string& socket_path, absl::StatusCode code) {
  if (code == absl::StatusCode::kPermissionDenied) {
    return "the socket is for the memra-kv group: usermod -aG memra-kv $USER, then log in again";
  }
  int gpu = -1;
  absl::string_view rest = socket_path;
  std::string unit = "memra-kvd@<gpu>";
  if (absl::ConsumePrefix(&rest, "/run/memra-kv/gpu") && absl::ConsumeSuffix(&rest, ".sock") &&
      absl::SimpleAtoi(rest, &gpu) && gpu >= 0) {
    unit = absl::StrCat("memra-kvd@", gpu);
  }
  return absl::StrCat("is the daemon running? systemctl status ", unit);
}

// A plain connect(2) first: a missing socket, a permission problem or a stale socket file (no
// listener) is named at once, where gRPC would retry quietly until the deadline.
absl::Status ProbeSocket(const std::string& path) {
  sockaddr_un address{};
  if (path.size() >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("socket path is ", path.size(),
                                                   " bytes; Unix sockets allow ",
                                                   sizeof(address.sun_path) - 1));
  }
  address.sun_family = AF_UNIX;
  path.copy(address.sun_path, path.size());
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return PosixError("socket(AF_UNIX)", errno);
  const int result = connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address));
  const int connect_errno = errno;
  close(fd);
  if (result != 0) return PosixError(absl::StrCat("connect ", path), connect_errno);
  return absl::OkStatus();
}

struct Connection {
  std::unique_ptr<pb::KvAdmin::Stub> stub;
  std::unique_ptr<pb::KvPrefixCache::Stub> prefix_stub;
  std::chrono::system_clock::time_point deadline;
};

absl::StatusOr<Connection> Connect(const Invocation& invocation) {
  Connection connection;
  connection.deadline =
      std::chrono::system_clock::now() + absl::ToChronoMilliseconds(invocation.timeout);
  RETURN_IF_ERROR(ProbeSocket(invocation.socket_path));
  std::shared_ptr<grpc::Channel> channel = grpc::CreateChannel(
      absl::StrCat("unix:", invocation.socket_path), grpc::InsecureChannelCredentials());
  if (!channel->WaitForConnected(connection.deadline)) {
    return absl::DeadlineExceededError(
        absl::StrCat("no gRPC connection within ", absl::FormatDuration(invocation.timeout)));
  }
  connection.stub = pb::KvAdmin::NewStub(channel);
  connection.prefix_stub = pb::KvPrefixCache::NewStub(channel);
  return connection;
}

// The admission numbers a RESOURCE_EXHAUSTED refusal carries (FromGrpcStatus restores them from
// the wire's StatusDetails), one per line; "" for any other status.
std::string RefusalDetails(const absl::Status& status) {
  const std::optional<AdmissionRefusal> refusal = GetAdmissionRefusal(status);
  if (!refusal.has_value()) return "";
  return FieldList()
      .Add("  needed", FormatBytes(refusal->needed))
      .Add("  free", FormatBytes(refusal->free))
      .Add("  evictable", FormatBytes(refusal->evictable))
      .Add("  budget", FormatBytes(refusal->budget))
      .Add("  to evict", refusal->bytes_to_evict > 0
                             ? FormatBytes(refusal->bytes_to_evict)
                             : "0 B (it does not fit even after evicting the prefix cache)")
      .Render();
}

// Prints a failed call and says which exit code it is.
int ReportCallFailure(const Invocation& invocation, absl::string_view method,
                      const grpc::Status& grpc_status, std::ostream& err) {
  const absl::Status status = FromGrpcStatus(grpc_status);
  // Code and message only: ToString() would also dump the payloads.
  const std::string reason =
      absl::StrCat(absl::StatusCodeToString(status.code()), ": ", status.message());
  if (status.code() == absl::StatusCode::kUnavailable ||
      status.code() == absl::StatusCode::kDeadlineExceeded) {
    err << "memra-kvctl: memra-kvd on " << invocation.socket_path << " did not answer " << method
        << ": " << reason << "\n  " << UnreachableHint(invocation.socket_path, status.code())
        << "\n";
    return kExitUnreachable;
  }
  err << "memra-kvctl: memra-kvd refused " << method << ": " << reason << "\n"
      << RefusalDetails(status);
  return kExitRefused;
}

int UsageFailure(const absl::Status& status, absl::string_view command, std::ostream& err);

template <typename Stub, typename Request, typename Response>
using StubCall = grpc::Status (Stub::*)(grpc::ClientContext*, const Request&, Response*);

// The connection's stub of the service `Stub` belongs to.
template <typename Stub>
Stub& StubOf(Connection& connection) {
  if constexpr (std::is_same_v<Stub, pb::KvPrefixCache::Stub>) {
    return *connection.prefix_stub;
  } else {
    return *connection.stub;
  }
}

// Connects, makes one call, prints the answer. A `request` that could not be built (an input
// file) is a usage error; `render(response)` is the human output; `fits_nothing(response)`
// selects exit code 5.
template <typename Stub, typename Request, typename Response, typename Render>
int CallAndPrint(const Invocation& invocation, absl::string_view method,
                 StubCall<Stub, Request, Response> call, const absl::StatusOr<Request>& request,
                 Render render, std::ostream& out, std::ostream& err,
                 bool (*fits_nothing)(const Response&) = nullptr) {
  if (!request.ok()) return UsageFailure(request.status(), invocation.command, err);
  absl::StatusOr<Connection> connection = Connect(invocation);
  if (!connection.ok()) {
    err << "memra-kvctl: cannot reach memra-kvd at unix:" << invocation.socket_path << ": "
        << connection.status().message() << "\n  "
        << UnreachableHint(invocation.socket_path, connection.status().code()) << "\n";
    return kExitUnreachable;
  }
  grpc::ClientContext context;
  context.set_deadline(connection->deadline);
  Response response;
  const grpc::Status status = (StubOf<Stub>(*connection).*call)(&context, *request, &response);
  if (!status.ok()) return ReportCallFailure(invocation, method, status, err);
  if (invocation.json) {
    absl::StatusOr<std::string> json = RenderJson(response);
    if (!json.ok()) {
      err << "memra-kvctl: " << json.status() << "\n";
      return kExitInternal;
    }
    out << *json << "\n";
  } else {
    out << render(response);
  }
  return fits_nothing != nullptr && fits_nothing(response) ? kExitFitsNothing : kExitOk;
}

absl::StatusOr<std::string> ReadFile(absl::string_view flag, const std::string& path) {
  FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) return PosixError(absl::StrCat(flag, "=", path), errno);
  std::string text;
  char buffer[1 << 16];
  size_t got = 0;
  while ((got = std::fread(buffer, 1, sizeof(buffer), file)) > 0) text.append(buffer, got);
  const bool failed = std::ferror(file) != 0;
  const int read_errno = errno;
  std::fclose(file);
  if (failed) return PosixError(absl::StrCat(flag, "=", path), read_errno);
  return text;
}

pb::SessionShape ShapeOf(const Invocation& invocation) {
  pb::SessionShape shape;
  shape.set_capacity(invocation.context);
  shape.set_layer_lo(invocation.layer_lo);
  if (invocation.layer_hi.has_value()) shape.set_layer_hi(*invocation.layer_hi);
  shape.set_tp_ranks(invocation.tp_ranks);
  shape.set_spec_snapshot(invocation.spec_snapshot);
  return shape;
}

// A request of a model query: model and shape.
template <typename Request>
absl::StatusOr<Request> QueryRequest(const Invocation& invocation) {
  Request request;
  ASSIGN_OR_RETURN(*request.mutable_model(), LoadModelSelector(invocation));
  *request.mutable_shape() = ShapeOf(invocation);
  return request;
}

absl::StatusOr<pb::ImportModelRequest> ImportRequest(const Invocation& invocation) {
  pb::ImportModelRequest request;
  ASSIGN_OR_RETURN(*request.mutable_hf_config_json(),
                   ReadFile("--hf-config", invocation.hf_config_path));
  request.set_name(invocation.name);
  request.set_index_pool(invocation.index_pool);
  request.set_register_(invocation.register_plan);
  request.set_swa_ring(invocation.swa_ring);
  if (invocation.index_ring_rows.has_value())
    request.set_index_ring_rows(*invocation.index_ring_rows);
  return request;
}

int UsageFailure(const absl::Status& status, absl::string_view command, std::ostream& err) {
  err << "memra-kvctl: " << status.message() << "\n\n";
  const CommandSpec* spec = FindCommand(command);
  if (spec != nullptr) {
    err << CommandUsage(*spec) << "\nRun 'memra-kvctl help " << spec->name
        << "' for the common flags, an example and the output.\n";
  } else {
    err << CommandList() << "\nRun 'memra-kvctl help' for the flags and exit codes.\n";
  }
  return kExitUsage;
}

// ---- rendering helpers ----------------------------------------------------------------------

std::string Count(uint64_t n, absl::string_view one, absl::string_view many) {
  return absl::StrCat(n, " ", n == 1 ? one : many);
}

std::string Age(uint64_t milliseconds) {
  return absl::StrCat(absl::FormatDuration(absl::Milliseconds(milliseconds)), " ago");
}

std::string EngineTable(const google::protobuf::RepeatedPtrField<pb::EngineStatus>& engines) {
  if (engines.empty()) return "no engines attached\n";
  TextTable table({{"ENGINE", Align::kRight},
                   {"NAME"},
                   {"PID", Align::kRight},
                   {"LEASE"},
                   {"SESSIONS", Align::kRight},
                   {"ALLOCATED", Align::kRight},
                   {"RESERVED", Align::kRight},
                   {"RESV", Align::kRight},
                   {"HEARTBEAT"}});
  for (const pb::EngineStatus& engine : engines) {
    table.AddRow({absl::StrCat(engine.engine_id()), engine.engine_name(),
                  absl::StrCat(engine.pid()), engine.lease_live() ? "live" : "ended",
                  absl::StrCat(engine.sessions()), FormatBytes(engine.allocated_bytes()),
                  FormatBytes(engine.reserved_bytes()), absl::StrCat(engine.reservations()),
                  Age(engine.last_heartbeat_age_ms())});
  }
  return table.Render();
}

// "now / after eviction / when empty" rows: the shape fit and max-context share.
class OutlookTable {
 public:
  OutlookTable()
      : table_({{""},
                {"NOW", Align::kRight},
                {"AFTER EVICTION", Align::kRight},
                {"WHEN EMPTY", Align::kRight}}) {}
  OutlookTable& Add(std::string label, std::string now, std::string after_eviction,
                    std::string when_empty) {
    table_.AddRow(
        {std::move(label), std::move(now), std::move(after_eviction), std::move(when_empty)});
    return *this;
  }
  std::string Render() const { return table_.Render(); }

 private:
  TextTable table_;
};

// The ledger an admission answer was computed from, after `first` (the session's size).
std::string Ledger(std::string first_label, std::string first_value, uint64_t free_bytes,
                   uint64_t evictable_bytes, uint64_t budget_bytes) {
  return FieldList()
      .Add(std::move(first_label), std::move(first_value))
      .Add("free", FormatBytes(free_bytes))
      .Add("evictable", FormatBytes(evictable_bytes))
      .Add("budget", FormatBytes(budget_bytes))
      .Render();
}

std::string KindName(int kind) {
  std::string name = pb::StateKind_Name(static_cast<pb::StateKind>(kind));
  absl::string_view short_name = name;
  absl::ConsumePrefix(&short_name, "STATE_KIND_");
  return std::string(short_name);
}

// "0-3,5,7-9": sorted layer indices as ranges.
std::string Ranges(const std::vector<uint32_t>& indices) {
  std::vector<std::string> parts;
  for (size_t i = 0; i < indices.size();) {
    size_t j = i;
    while (j + 1 < indices.size() && indices[j + 1] == indices[j] + 1) ++j;
    parts.push_back(j == i ? absl::StrCat(indices[i]) : absl::StrCat(indices[i], "-", indices[j]));
    i = j + 1;
  }
  return absl::StrJoin(parts, ",");
}

bool NoSessionFitsNow(const pb::FitResponse& fit) { return fit.sessions_now() == 0; }
bool NoContextFitsNow(const pb::MaxContextResponse& max) { return max.max_context_now() == 0; }

}  // namespace

// ---- public ---------------------------------------------------------------------------------

absl::StatusOr<uint64_t> ParseContext(absl::string_view text) {
  absl::string_view digits = text;
  uint64_t multiplier = 1;
  if (absl::ConsumeSuffix(&digits, "k") || absl::ConsumeSuffix(&digits, "K")) {
    multiplier = uint64_t{1} << 10;
  } else if (absl::ConsumeSuffix(&digits, "m") || absl::ConsumeSuffix(&digits, "M")) {
    multiplier = uint64_t{1} << 20;
  }
  if (digits.empty() || !std::all_of(digits.begin(), digits.end(), absl::ascii_isdigit)) {
    return Usage(absl::StrCat("--context=", text,
                              ": want tokens as a whole number, optionally with k (x1024) or m "
                              "(x1048576), e.g. 32768 or 32k"));
  }
  uint64_t number = 0;
  // All digits: SimpleAtoi fails only when the number overflows 64 bits.
  if (!absl::SimpleAtoi(digits, &number) || number == 0 ||
      number > kMaxContextTokens / multiplier) {
    return Usage(
        absl::StrCat("--context=", text, ": a session holds 1..", kMaxContextTokens, " tokens"));
  }
  return number * multiplier;
}

absl::StatusOr<Invocation> ParseArgs(const std::vector<std::string>& args) {
  Invocation invocation;
  invocation.socket_path = absl::StrFormat(kDefaultSocketPattern, 0);
  invocation.command = CommandWord(args);
  if (invocation.command.empty()) {
    // A bare --help (or -h) is the overview; anything else without a command is a usage error.
    for (const std::string& arg : args) {
      if (arg == "--help" || arg == "-h") {
        invocation.command = "help";
        return invocation;
      }
    }
    return Usage("no command given");
  }
  if (invocation.command == "help") {
    for (const std::string& arg : args) {
      if (arg == "help") continue;
      if (!invocation.help_topic.empty() || absl::StartsWith(arg, "-")) {
        return Usage(absl::StrCat("help takes one command name, not '", arg, "'"));
      }
      invocation.help_topic = arg;
    }
    return invocation;
  }
  const CommandSpec* command = FindCommand(invocation.command);
  if (command == nullptr) {
    return Usage(absl::StrCat("unknown command '", invocation.command, "'"));
  }
  std::set<std::string> given;
  bool seen_command = false;
  for (const std::string& arg : args) {
    if (!absl::StartsWith(arg, "-")) {
      if (seen_command) {
        return Usage(
            absl::StrCat("unexpected argument '", arg, "' (flags take values as --flag=VALUE)"));
      }
      seen_command = true;
      continue;
    }
    const std::string::size_type equals = arg.find('=');
    std::string name = arg.substr(0, equals);
    if (name == "-h") name = "--help";
    const FlagSpec* flag = FindFlag(*command, name);
    if (flag == nullptr) {
      return Usage(IsAnyCommandsFlag(name) ? absl::StrCat(command->name, " does not take ", name)
                                           : absl::StrCat("unknown flag ", name));
    }
    if (flag->value_name.empty() && equals != std::string::npos) {
      return Usage(absl::StrCat(name, " is a switch and takes no value (got '", arg, "')"));
    }
    if (!flag->value_name.empty() && equals == std::string::npos) {
      return Usage(absl::StrCat(name, " needs a value: ", FlagUsage(*flag)));
    }
    if (!given.insert(name).second) return Usage(absl::StrCat(name, " given twice"));
    RETURN_IF_ERROR(
        ApplyFlag(*flag, equals == std::string::npos ? "" : arg.substr(equals + 1), invocation));
  }
  if (invocation.command == "help") return invocation;  // --help: the rest need not be complete
  RETURN_IF_ERROR(CheckRequired(invocation, given));
  return invocation;
}

absl::StatusOr<std::string> HelpText(absl::string_view topic) {
  if (topic.empty()) return OverviewHelp();
  const CommandSpec* command = FindCommand(topic);
  if (command == nullptr) {
    return absl::NotFoundError(absl::StrCat("no command '", topic, "'"));
  }
  return CommandHelp(*command);
}

absl::StatusOr<pb::ModelSelector> LoadModelSelector(const Invocation& invocation) {
  pb::ModelSelector selector;
  if (!invocation.model_fingerprint.empty()) {
    selector.set_plan_fingerprint(invocation.model_fingerprint);
  } else if (!invocation.hf_config_path.empty()) {
    ASSIGN_OR_RETURN(*selector.mutable_hf_config_json(),
                     ReadFile("--hf-config", invocation.hf_config_path));
  } else {
    ASSIGN_OR_RETURN(const std::string text, ReadFile("--plan", invocation.plan_path));
    const google::protobuf::util::Status parsed =
        google::protobuf::util::JsonStringToMessage(text, selector.mutable_plan());
    if (!parsed.ok()) {
      return Usage(absl::StrCat("--plan=", invocation.plan_path,
                                ": not a ModelPlan in protobuf JSON: ", parsed.ToString()));
    }
  }
  return selector;
}

absl::StatusOr<std::string> RenderJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string json;
  const google::protobuf::util::Status status =
      google::protobuf::util::MessageToJsonString(message, &json, options);
  if (!status.ok()) {
    return absl::InternalError(
        absl::StrCat("cannot print ", message.GetTypeName(), " as JSON: ", status.ToString()));
  }
  return json;
}

std::string RenderStatus(const pb::GetStatusResponse& status) {
  const pb::AdmissionStatus& admission = status.admission();
  FieldList fields;
  fields.Add("backend", status.backend());
  fields.Add("device", status.device_uuid().empty()
                           ? status.device_name()
                           : absl::StrCat(status.device_name(), " (", status.device_uuid(), ")"));
  if (status.device_total_bytes() > 0) {
    fields.Add("device memory", absl::StrCat(FormatBytes(status.device_total_bytes()), " total, ",
                                             FormatBytes(status.device_free_bytes()), " free"));
  }
  fields.Add("uptime",
             absl::StrFormat("%s (epoch %016x)",
                             absl::FormatDuration(absl::Trunc(
                                 absl::Milliseconds(status.uptime_ms()), absl::Seconds(1))),
                             status.epoch()));
  fields.Add("state",
             status.draining() ? "DRAINING: new engines and sessions get UNAVAILABLE" : "serving");
  fields.Add("sessions",
             absl::StrCat(status.sessions(), " in ", Count(status.arena_count(), "arena", "arenas"),
                          " of ", FormatBytes(status.allocated_bytes())));
  fields.Add("engines", absl::StrCat(status.engines()));
  fields.Add("plans", absl::StrCat(status.plans(), " registered"));
  fields.Add("admission", admission.budget_rule());
  fields.Add("  budget", FormatBytes(admission.budget_bytes()));
  fields.Add("  allocated", FormatBytes(admission.allocated_bytes()));
  fields.Add("  reserved",
             absl::StrCat(FormatBytes(admission.reserved_bytes()), " in ",
                          Count(admission.reservations(), "reservation", "reservations")));
  fields.Add("  free", FormatBytes(admission.free_bytes()));
  fields.Add("  evictable", FormatBytes(admission.evictable_bytes()));
  if (admission.over_budget_bytes() > 0) {
    fields.Add("  OVER BUDGET", FormatBytes(admission.over_budget_bytes()));
  }
  fields.Add("  granularity", FormatBytes(admission.granularity_bytes()));
  return absl::StrCat(fields.Render(), "\n", EngineTable(status.engine_status()));
}

std::string RenderEngines(const pb::ListEnginesResponse& engines) {
  return EngineTable(engines.engines());
}

std::string RenderSessions(const pb::ListSessionsResponse& sessions) {
  if (sessions.sessions().empty()) return "no sessions\n";
  TextTable table({{"SESSION", Align::kRight},
                   {"ENGINE", Align::kRight},
                   {"MODEL"},
                   {"CAPACITY", Align::kRight},
                   {"LENGTH", Align::kRight},
                   {"ARENA", Align::kRight},
                   {"LAYOUT", Align::kRight},
                   {"STATE"},
                   {"FINGERPRINT"}});
  uint64_t total_bytes = 0;
  for (const pb::SessionSummary& session : sessions.sessions()) {
    std::vector<std::string> flags;
    if (session.in_transaction()) flags.push_back("txn");
    if (session.tainted()) flags.push_back("tainted");
    table.AddRow({absl::StrCat(session.session_id()), absl::StrCat(session.engine_id()),
                  session.model_name(), absl::StrCat(session.capacity()),
                  absl::StrCat(session.logical_len()), FormatBytes(session.arena_bytes()),
                  absl::StrCat(session.layout_version()),
                  flags.empty() ? "ok" : absl::StrJoin(flags, ","),
                  HexBytes(session.plan_fingerprint())});
    total_bytes += session.arena_bytes();
  }
  return absl::StrCat(table.Render(), Count(sessions.sessions_size(), "session", "sessions"), ", ",
                      FormatBytes(total_bytes), "\n");
}

std::string RenderCost(const pb::CostResponse& cost) {
  const pb::CostBreakdown& breakdown = cost.breakdown();
  FieldList fields;
  fields.Add("model", cost.model_name());
  fields.Add("fingerprint", HexBytes(cost.plan_fingerprint()));
  fields.Add("context",
             absl::StrCat(cost.capacity(), " tokens, ", Count(cost.layers(), "layer", "layers")));
  fields.Add("cost", absl::StrCat(FormatBytes(cost.arena_bytes()),
                                  "  (admission charges and the backend allocates this)"));
  fields.Add("per token", absl::StrCat(FormatBytes(breakdown.bytes_per_token()),
                                       "  (what one more token adds at this context)"));
  // The classes are coefficients: sliding rows stop scaling at the ring's cap, and past it
  // their bytes are in `fixed`.
  fields.Add("full K/V", absl::StrCat(FormatBytes(breakdown.kv_bytes_per_token()), " a token"));
  fields.Add("sliding K/V", absl::StrCat(FormatBytes(breakdown.ring_bytes_per_token()), " a token",
                                         breakdown.ring_row_cap() == 0
                                             ? " (no ring)"
                                             : absl::StrCat(", up to the ring's ",
                                                            breakdown.ring_row_cap(), " rows")));
  fields.Add("latent", absl::StrCat(FormatBytes(breakdown.latent_bytes_per_token()), " a token"));
  fields.Add("fixed", FormatBytes(breakdown.fixed_bytes()));
  fields.Add("planes", FormatBytes(breakdown.total_plane_bytes()));
  fields.Add("granularity", FormatBytes(cost.granularity_bytes()));
  return fields.Render();
}

std::string RenderFit(const pb::FitResponse& fit, uint64_t context) {
  OutlookTable outlook;
  outlook.Add("sessions", absl::StrCat(fit.sessions_now()),
              absl::StrCat(fit.sessions_after_eviction()), absl::StrCat(fit.sessions_when_empty()));
  outlook.Add("total tokens", absl::StrCat(fit.total_tokens_now()), "-",
              absl::StrCat(fit.total_tokens_when_empty()));
  return absl::StrCat(Ledger("session",
                             absl::StrCat(FormatBytes(fit.session_bytes()), " at ",
                                          Count(context, "token", "tokens")),
                             fit.free_bytes(), fit.evictable_bytes(), fit.budget_bytes()),
                      "\n", outlook.Render());
}

std::string RenderMaxContext(const pb::MaxContextResponse& max) {
  OutlookTable outlook;
  outlook.Add("max context", absl::StrCat(max.max_context_now()),
              absl::StrCat(max.max_context_after_eviction()),
              absl::StrCat(max.max_context_when_empty()));
  return absl::StrCat(
      Ledger("session",
             absl::StrCat(FormatBytes(max.session_bytes_now()), " at the max context now"),
             max.free_bytes(), max.evictable_bytes(), max.budget_bytes()),
      "\n", outlook.Render());
}

std::string RenderImport(const pb::ImportModelResponse& imported) {
  const pb::ModelPlan& plan = imported.plan();
  const std::string fingerprint = HexBytes(imported.plan_fingerprint());
  FieldList fields;
  fields.Add("architecture", imported.architecture());
  fields.Add("name", plan.name());
  fields.Add("fingerprint", fingerprint);
  fields.Add("registered", imported.registered()
                               ? absl::StrCat("yes: --model=", fingerprint, " names it")
                               : "no (--register keeps it in the daemon)");
  fields.Add("layers",
             absl::StrCat(plan.layers_size(), " trunk + ", plan.mtp_blocks_size(), " MTP"));
  fields.Add("swa ring", plan.swa_ring() ? "on" : "off");
  fields.Add("index ring", plan.has_index_ring_rows()
                               ? absl::StrCat(plan.index_ring_rows(), " rows")
                               : "default working rows");
  std::map<int, std::vector<uint32_t>> by_kind;
  for (const auto* layers : {&plan.layers(), &plan.mtp_blocks()}) {
    for (const pb::LayerPlan& layer : *layers) by_kind[layer.kind()].push_back(layer.index());
  }
  TextTable kinds({{"KIND"}, {"LAYERS", Align::kRight}, {"INDICES"}});
  for (const auto& [kind, indices] : by_kind) {
    kinds.AddRow({KindName(kind), absl::StrCat(indices.size()), Ranges(indices)});
  }
  return absl::StrCat(fields.Render(), "\n", kinds.Render());
}

std::string RenderPrefixStats(const pb::PrefixCacheStats& stats) {
  return FieldList()
      .Add("stored", absl::StrCat(FormatBytes(stats.stored_bytes()), " in ", stats.entries(),
                                  " entries, ", stats.blocks(), " blocks of ",
                                  stats.block_tokens(), " tokens (shared blocks once)"))
      .Add("evictable", FormatBytes(stats.evictable_bytes()))
      .Add("pinned", FormatBytes(stats.pinned_bytes()))
      .Add("budget", FormatBytes(stats.budget_bytes()))
      .Add("lookups", absl::StrCat(stats.lookup_hits(), " hit, ", stats.lookup_partials(),
                                   " partial, ", stats.lookup_misses(), " miss"))
      .Add("restores", absl::StrCat(stats.restores(), " (", stats.tokens_restored(), " tokens)"))
      .Add("captures", absl::StrCat(stats.captures(), " (", stats.death_captures(),
                                    " from dead engines)"))
      .Add("evictions", absl::StrCat(stats.evicted_entries(), " evicted, ",
                                     stats.dropped_entries(), " dropped (checksum)"))
      .Render();
}

std::string RenderPrefixes(const pb::ListPrefixesResponse& prefixes) {
  TextTable table({{"ENTRY", Align::kRight},
                   {"SHAPE"},
                   {"TOKENS", Align::kRight},
                   {"BLOCKS", Align::kRight},
                   {"BLOCK BYTES", Align::kRight},
                   {"BOUNDARY BYTES", Align::kRight},
                   {"PINS", Align::kRight},
                   {"LAST USE", Align::kRight}});
  for (const pb::PrefixEntry& entry : prefixes.entries()) {
    table.AddRow({absl::StrCat(entry.entry_id()), HexBytes(entry.shape_fingerprint()).substr(0, 16),
                  absl::StrCat(entry.boundary_tokens()), absl::StrCat(entry.blocks()),
                  FormatBytes(entry.block_bytes()), FormatBytes(entry.boundary_bytes()),
                  absl::StrCat(entry.pins()), absl::StrCat(entry.last_use_tick())});
  }
  return absl::StrCat(table.Render(), Count(prefixes.entries_size(), "entry", "entries"), "\n\n",
                      RenderPrefixStats(prefixes.stats()));
}

std::string RenderEvict(const pb::EvictPrefixResponse& evicted) {
  return absl::StrCat("freed ", FormatBytes(evicted.freed_bytes()), "\n",
                      RenderPrefixStats(evicted.stats()));
}

std::string RenderDrain(const pb::DrainResponse& drained) {
  return absl::StrCat("draining: new engines and sessions get UNAVAILABLE; ",
                      Count(drained.sessions_open(), "session stays", "sessions stay"),
                      " open until released\n");
}

int RunKvctl(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  absl::StatusOr<Invocation> parsed = ParseArgs(args);
  if (!parsed.ok()) return UsageFailure(parsed.status(), CommandWord(args), err);
  const Invocation& invocation = *parsed;
  const std::string& command = invocation.command;

  if (command == "help") {
    absl::StatusOr<std::string> help = HelpText(invocation.help_topic);
    if (!help.ok()) return UsageFailure(help.status(), "", err);
    out << *help;
    return kExitOk;
  }
  using Stub = pb::KvAdmin::Stub;
  if (command == "status") {
    return CallAndPrint(invocation, "GetStatus", &Stub::GetStatus,
                        absl::StatusOr<pb::GetStatusRequest>(pb::GetStatusRequest()), RenderStatus,
                        out, err);
  }
  if (command == "engines") {
    return CallAndPrint(invocation, "ListEngines", &Stub::ListEngines,
                        absl::StatusOr<pb::ListEnginesRequest>(pb::ListEnginesRequest()),
                        RenderEngines, out, err);
  }
  if (command == "sessions") {
    pb::ListSessionsRequest request;
    request.set_engine_id(invocation.engine_id);
    return CallAndPrint(invocation, "ListSessions", &Stub::ListSessions,
                        absl::StatusOr<pb::ListSessionsRequest>(request), RenderSessions, out, err);
  }
  if (command == "prefixes") {
    return CallAndPrint(invocation, "ListPrefixes", &pb::KvPrefixCache::Stub::ListPrefixes,
                        absl::StatusOr<pb::ListPrefixesRequest>(pb::ListPrefixesRequest()),
                        RenderPrefixes, out, err);
  }
  if (command == "evict") {
    pb::EvictPrefixRequest request;
    request.set_entry_id(invocation.entry_id);
    return CallAndPrint(invocation, "EvictPrefix", &pb::KvPrefixCache::Stub::EvictPrefix,
                        absl::StatusOr<pb::EvictPrefixRequest>(request), RenderEvict, out, err);
  }
  if (command == "drain") {
    return CallAndPrint(invocation, "Drain", &Stub::Drain,
                        absl::StatusOr<pb::DrainRequest>(pb::DrainRequest()), RenderDrain, out,
                        err);
  }
  if (command == "undrain") {
    return CallAndPrint(
        invocation, "Undrain", &Stub::Undrain,
        absl::StatusOr<pb::UndrainRequest>(pb::UndrainRequest()),
        [](const pb::UndrainResponse&) { return "accepting new engines and sessions\n"; }, out,
        err);
  }
  if (command == "import-model") {
    return CallAndPrint(invocation, "ImportModel", &Stub::ImportModel, ImportRequest(invocation),
                        RenderImport, out, err);
  }
  if (command == "cost") {
    return CallAndPrint(invocation, "GetCost", &Stub::GetCost,
                        QueryRequest<pb::CostRequest>(invocation), RenderCost, out, err);
  }
  if (command == "fit") {
    return CallAndPrint(
        invocation, "GetFit", &Stub::GetFit, QueryRequest<pb::FitRequest>(invocation),
        [&](const pb::FitResponse& fit) { return RenderFit(fit, invocation.context); }, out, err,
        NoSessionFitsNow);
  }
  if (command == "max-context") {
    return CallAndPrint(invocation, "GetMaxContext", &Stub::GetMaxContext,
                        QueryRequest<pb::MaxContextRequest>(invocation), RenderMaxContext, out, err,
                        NoContextFitsNow);
  }
  err << "memra-kvctl: internal error: command '" << command << "' has no handler\n";
  return kExitInternal;
}

}  // namespace memra::kvctl
