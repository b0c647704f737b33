#include "tools/kvctl_flags.h"

#include <algorithm>
#include <set>
#include <string>
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
#include "core/group_layout.h"
#include "core/status_macros.h"
#include "tools/text_format.h"

namespace memra::kvctl {
namespace {

using Align = TextTable::Align;

// ---- the commands and their flags: the one source of parsing rules and help text ----------

struct FlagSpec {
  absl::string_view name;        // "--context"
  absl::string_view value_name;  // "TOKENS"; empty: a switch (no value)
  absl::string_view help;
};

constexpr FlagSpec kSocketFlag{"--socket", "PATH",
                               "the daemon's admin socket (default /run/memra-kv/gpu0.admin.sock); "
                               "status, fit and max-context take several, PATH,PATH,...: a group "
                               "of daemons in rank order"};
constexpr FlagSpec kGpuFlag{"--gpu", "N",
                            "the admin socket of GPU N's daemon: /run/memra-kv/gpuN.admin.sock"};
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
                           "shard (default 1); with a group, its TP degree (default: ranks / pp)"};
constexpr FlagSpec kGroupFlag{"--group", "FILE",
                              "a group file (docs/groups.md#the-group-file): the daemon of every "
                              "rank of a TP x PP group, and its tp, pp and stage layers"};
constexpr FlagSpec kPpFlag{"--pp", "N",
                           "with several --socket paths: pipeline stages (default 1); ranks = tp "
                           "x pp, rank = stage x tp + tp rank"};
constexpr FlagSpec kStageLayersFlag{"--stage-layers", "N,N,...",
                                    "with several --socket paths: trunk layers per stage "
                                    "(default: vLLM's split; MTP blocks go to the last stage)"};
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
constexpr FlagSpec kKvDtypeFlag{
    "--kv-dtype", "DTYPE",
    "K/V formats: auto (default: the config's torch_dtype, or fp8_e4m3 for an fp8 KV cache), "
    "bf16 | fp16 | f32 | fp8_e4m3 | fp8_e5m2, a K/V pair (q8_0/q5_1, fp8/fp8, ...), or "
    "reference (the daemon's format defaults, set by its MEMRA_KV_* environment)"};
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
// fit and max-context answer for a group too.
const std::vector<const FlagSpec*> kGroupLayoutFlags = {&kGroupFlag, &kPpFlag, &kStageLayersFlag};

std::vector<const FlagSpec*> Concat(std::vector<const FlagSpec*> a,
                                    const std::vector<const FlagSpec*>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

const std::vector<CommandSpec>& Commands() {
  static const std::vector<CommandSpec> commands = {
      {"status",
       "backend, device, admission ledger and engines (or a group's, rank by rank)",
       "[--group=FILE]",
       {&kGroupFlag},
       "What the daemon holds right now: its backend and device, the admission ledger and the\n"
       "attached engines. For a group (--group=FILE or --socket=A,B,...): one row per rank and\n"
       "the rank with the least free bytes, which decides what the group can still admit.",
       "memra-kvctl --gpu=1 status\n"
       "memra-kvctl status --group=/etc/memra-kv/llama-70b.group",
       "budget = allocated + reserved + free (when a reload shrank the budget below what is held,\n"
       "free is 0 and 'over budget' says by how much). allocated: live arenas and prefix-cache\n"
       "storage; reserved: admission reservations not yet sessions (group reservations\n"
       "included); evictable: prefix-cache bytes admission may evict to make room. granularity:\n"
       "every arena is a multiple of it."},
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
       "    [--layers=LO:HI] [--tp=N] [--spec-snapshot]\n"
       "    [--group=FILE | --socket=A,B,... [--tp=N] [--pp=N] [--stage-layers=N,N,...]]",
       Concat(kModelShapeFlags, kGroupLayoutFlags),
       "How many sessions of one shape fit in this GPU's budget, and how many context tokens of\n"
       "the model that is (the question an engine scheduler asks). For a TP x PP group, each\n"
       "rank's daemon prices its own shard (its stage's layers, its share of the K/V heads) and\n"
       "the tightest rank decides the group's answer (the plan comes from --hf-config or --plan:\n"
       "kvctl needs its layers to lay the group out).",
       "memra-kvctl fit --model=3f5c...e1 --context=128k || echo \"no room now\"\n"
       "memra-kvctl fit --group=llama-70b.group --hf-config=llama-3.1-70b.json --context=128k",
       "sessions: whole sessions that fit in the free bytes now / after evicting every evictable\n"
       "prefix-cache byte / in the whole budget with nothing else held. total tokens: context\n"
       "tokens that fit when packed as full sessions plus one shorter session in the remainder.\n"
       "A group: one row per rank (stage, TP rank, layers, its share of the heads, its daemon's\n"
       "answer), then the group's answer, the least over the ranks, and the rank that decides it.\n"
       "Exits 5 when no session fits now."},
      {"max-context",
       "the largest context one session could have",
       "(--model=FINGERPRINT | --hf-config=PATH | --plan=PATH)\n"
       "    [--layers=LO:HI] [--tp=N] [--spec-snapshot]\n"
       "    [--group=FILE | --socket=A,B,... [--tp=N] [--pp=N] [--stage-layers=N,N,...]]",
       Concat({&kModelFlag, &kHfConfigFlag, &kPlanFlag, &kLayersFlag, &kTpFlag,
               &kSpecSnapshotFlag},
              kGroupLayoutFlags),
       "The largest capacity one session of a model could be created with now, after evicting\n"
       "the prefix cache, and with the GPU's budget empty. (The context is the answer here, so\n"
       "--context is not taken.) For a TP x PP group, the largest context every rank can hold\n"
       "(as fit: the plan from --hf-config or --plan).",
       "memra-kvctl max-context --hf-config=gemma-3-27b-it/config.json\n"
       "memra-kvctl max-context --socket=/run/memra-kv/gpu0.sock,/run/memra-kv/gpu1.sock \\\n"
       "    --tp=2 --hf-config=llama-3.1-70b.json",
       "max context: tokens, now / after eviction / when empty. session bytes: the arena of a\n"
       "session at the max context now. A group: one row per rank, then the group's max context\n"
       "(the least over the ranks) and the rank that decides it. Exits 5 when not even a 1-token\n"
       "session fits now."},
      {"import-model",
       "Hugging Face config.json -> model plan (optionally registered)",
       "--hf-config=PATH [--name=NAME] [--index-pool=N]\n"
       "    [--index-ring-rows=N] [--swa-ring] [--kv-dtype=DTYPE] [--register]",
       {&kHfConfigFlag, &kNameFlag, &kIndexPoolFlag, &kIndexRingRowsFlag, &kSwaRingFlag,
        &kKvDtypeFlag, &kRegisterFlag},
       "Turns a model's Hugging Face config.json into the daemon's model plan: dense (Llama,\n"
       "Qwen, Mistral), Gemma sliding-window + global, MLA (DeepSeek, GLM with an indexer),\n"
       "hybrid linear attention (Qwen3-Next, Jamba). K/V planes (and MLA latent rows) take the\n"
       "dtype the engine keeps its cache in (--kv-dtype; docs/rules.md#formats). An unsupported\n"
       "field, architecture or dtype is refused with its name (exit 4).",
       "memra-kvctl import-model --hf-config=llama-3.1-8b/config.json --register",
       "architecture, name and fingerprint of the plan, its K/V formats and what chose them, and\n"
       "its layers per state kind with their indices. With --register,\n"
       "`cost/fit/max-context --model=FINGERPRINT` name it (engines registering the same plan\n"
       "get the same fingerprint). --json prints the response, the ModelPlan included (`jq\n"
       ".plan` gives a file for --plan)."},
      {"prefixes",
       "prefix-cache entries and the cache's counters",
       "",
       {},
       "Lists the prefix cache's entries (captured token prefixes, restorable by any engine of\n"
       "the same cache scope, model plan and shape) and its byte ledger and counters. Refused (exit 4) when\n"
       "the daemon runs without a prefix cache (prefix_cache_budget_bytes = 0).",
       "memra-kvctl prefixes",
       "ENTRY id, SCOPE (the capturing engine's cache scope: uid:<uid> or a configured name),\n"
       "SHAPE (fingerprint of model plan + layer range + TP), TOKENS at its boundary,\n"
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
    const std::vector<std::string> paths = absl::StrSplit(value, ',');
    for (const std::string& path : paths) {
      if (path.empty()) {
        return Usage(absl::StrCat("--socket=", value, ": an empty path in the list (a group's "
                                  "sockets are PATH,PATH,... in rank order)"));
      }
    }
    invocation.socket_path = paths.front();
    if (paths.size() > 1) invocation.group_sockets = paths;
  } else if (name == "--group") {
    if (value.empty()) return Usage("--group= needs a group file's path");
    invocation.group_path = std::string(value);
  } else if (name == "--pp") {
    ASSIGN_OR_RETURN(const uint64_t stages, ParseWhole(name, value, 1, kMaxGroupRanks));
    invocation.pp = static_cast<uint32_t>(stages);
  } else if (name == "--stage-layers") {
    for (const absl::string_view item : absl::StrSplit(value, ',')) {
      ASSIGN_OR_RETURN(const uint64_t layers, ParseWhole(name, item, 1, UINT32_MAX));
      invocation.stage_layers.push_back(static_cast<uint32_t>(layers));
    }
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
  } else if (name == "--kv-dtype") {
    if (value.empty()) return Usage("--kv-dtype= needs a dtype (omit it for auto)");
    invocation.kv_dtype = std::string(value);
  } else if (name == "--register") {
    invocation.register_plan = true;
  } else {
    return absl::InternalError(absl::StrCat("no parser for ", name));  // a FlagSpec without one
  }
  return absl::OkStatus();
}

// The group flags' combinations (docs/groups.md#memra-kvctl).
absl::Status CheckGroup(const Invocation& invocation, const std::set<std::string>& given) {
  const absl::string_view command = invocation.command;
  if (!invocation.group_sockets.empty() && command != "status" && command != "fit" &&
      command != "max-context") {
    return Usage(absl::StrCat(command, " answers for one daemon: several --socket paths are for "
                              "status, fit and max-context"));
  }
  if (!invocation.IsGroup()) {
    for (const char* flag : {"--pp", "--stage-layers"}) {
      if (given.count(flag)) {
        return Usage(absl::StrCat(flag, " lays out a group: give --socket=A,B,... (or "
                                  "--group=FILE, which sets it)"));
      }
    }
    return absl::OkStatus();
  }
  if (!invocation.group_path.empty()) {
    for (const char* flag : {"--socket", "--gpu", "--tp", "--pp", "--stage-layers"}) {
      if (given.count(flag)) {
        return Usage(absl::StrCat("--group=", invocation.group_path, " names every rank's "
                                  "daemon, tp, pp and stage layers: it does not take ", flag));
      }
    }
  }
  if (given.count("--layers")) {
    return Usage("with a group the layout gives every rank its layers: --stage-layers=N,N,... "
                 "instead of --layers");
  }
  if (given.count("--model")) {
    return Usage("a group's layout needs the plan's layers, which --model leaves in the daemon: "
                 "give --hf-config=PATH or --plan=PATH");
  }
  return absl::OkStatus();
}

// What the command needs beyond well-formed flags.
absl::Status CheckRequired(const Invocation& invocation, const std::set<std::string>& given) {
  if (given.count("--socket") && given.count("--gpu")) {
    return Usage("give --socket=PATH or --gpu=N, not both");
  }
  const absl::string_view command = invocation.command;
  RETURN_IF_ERROR(CheckGroup(invocation, given));
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
}  // namespace

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

std::string CommandWord(const std::vector<std::string>& args) {
  for (const std::string& arg : args) {
    if (!absl::StartsWith(arg, "-")) return arg;
  }
  return "";
}

std::string UsageMessage(const absl::Status& status, absl::string_view command) {
  std::string text = absl::StrCat("memra-kvctl: ", status.message(), "\n\n");
  const CommandSpec* spec = FindCommand(command);
  if (spec != nullptr) {
    absl::StrAppend(&text, CommandUsage(*spec), "\nRun 'memra-kvctl help ", spec->name,
                    "' for the common flags, an example and the output.\n");
  } else {
    absl::StrAppend(&text, CommandList(),
                    "\nRun 'memra-kvctl help' for the flags and exit codes.\n");
  }
  return text;
}

}  // namespace memra::kvctl
