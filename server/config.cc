#include "server/config.h"

#include <fcntl.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <exception>
#include <optional>
#include <sstream>
#include <type_traits>
#include <utility>
#include <variant>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "core/status_macros.h"
#include "server/session/cache_scopes.h"
#include "server/store/remote/redis_cluster.h"

// toml11 reports errors by throwing; every call into it stays inside ParseConfig's try block.
#include <toml.hpp>

namespace memra {
namespace {

// Debian's Abseil is built with its own absl::string_view (not std::string_view); the public API
// takes std::string_view and converts here, once.
absl::string_view AsAbsl(std::string_view text) { return {text.data(), text.size()}; }

constexpr uint64_t kKiB = uint64_t{1} << 10;
constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;
constexpr uint64_t kTiB = uint64_t{1} << 40;
constexpr uint64_t kPiB = uint64_t{1} << 50;

// Index = enum value; BackendName/LogLevelName and the "one of" parsing share these.
constexpr std::array<absl::string_view, 2> kBackendNames = {"host", "cuda"};
constexpr std::array<absl::string_view, 2> kCudaExportNames = {"ipc", "vmm"};
constexpr std::array<absl::string_view, 2> kPrefixHostMemoryNames = {"pinned", "plain"};
constexpr std::array<absl::string_view, 7> kLogLevelNames = {"trace", "debug",    "info", "warn",
                                                             "error", "critical", "off"};

// A value as the file or the command line wrote it, before the key's rules apply. The command
// line gives text only, so every rule that takes a number also takes its text.
using RawValue = std::variant<int64_t, double, bool, std::string>;
// A value after the key's rules: unsigned fields and enum indices are uint64_t.
using TypedValue = std::variant<uint64_t, double, bool, std::string>;

// Where a key's value lives: a field of the config or of one of its sections.
using FieldRef =
    std::variant<uint64_t*, uint32_t*, double*, bool*, std::string*, Backend*, LogLevel*,
                 CudaExport*, PrefixHostMemory*, absl::Duration*, std::vector<RedisNodeAddress>*>;
// size_t fields (the parts' counts) are uint64_t fields here.
static_assert(std::is_same_v<size_t, uint64_t>);

// The field at the end of a path of member pointers: At<&DaemonConfig::prefix,
// &PrefixCacheOptions::budget_bytes> is config.prefix.budget_bytes.
template <auto... kPath>
FieldRef At(DaemonConfig& config) {
  return &(config.*....*kPath);
}

// How a key's value is written; decides parsing, rendering and the "accepted" text.
enum class Syntax {
  kInteger,   // decimal, in [min, max]
  kBytes,     // decimal bytes or with a binary suffix ("64GiB"), in [min, max]
  kMode,      // octal permission string ("0660"), at most 0777
  kFraction,  // number in (0, 1]
  kBool,      // true | false
  kChoice,    // one of `choices`; the enum value is the index
  kText,      // string checked by `check_text`
};

struct KeySpec {
  absl::string_view name;
  FieldRef (*field)(DaemonConfig&);
  Syntax syntax;
  bool reloadable;
  absl::string_view help;
  uint64_t min = 0;  // kInteger, kBytes
  uint64_t max = 0;
  // kInteger into an absl::Duration field: what one unit of the written number is.
  absl::Duration unit = absl::ZeroDuration();
  absl::Span<const absl::string_view> choices = {};  // kChoice
  // kText: what is accepted, and the check (nullopt = fine, else the problem).
  absl::string_view text_accepted = {};
  std::optional<std::string> (*check_text)(absl::string_view) = nullptr;
};

std::optional<std::string> CheckSocketPath(absl::string_view path) {
  if (!absl::StartsWith(path, "/")) return "not an absolute path";
  return std::nullopt;
}

std::optional<std::string> CheckDiskDir(absl::string_view path) {
  if (path.empty()) return std::nullopt;  // no disk tier
  if (!absl::StartsWith(path, "/")) return "not an absolute path";
  return std::nullopt;
}

std::optional<std::string> CheckDerivedSocketPath(absl::string_view path) {
  if (path.empty()) return std::nullopt;  // derived from socket_path
  return CheckSocketPath(path);
}

// Group names as useradd/groupadd accept them, or a numeric gid.
std::optional<std::string> CheckGroup(absl::string_view group) {
  if (group.size() > 32) return "longer than 32 characters";
  if (absl::StartsWith(group, "-")) return "starts with '-'";
  for (char c : group) {
    if (!absl::ascii_isalnum(c) && c != '_' && c != '-' && c != '.') {
      return absl::StrCat("contains '", std::string(1, c), "'");
    }
  }
  return std::nullopt;
}

std::optional<std::string> CheckCacheScopeAllow(absl::string_view text) {
  absl::StatusOr<std::vector<CacheScopeRule>> rules = ParseCacheScopeAllow(text);
  if (!rules.ok()) return std::string(rules.status().message());
  return std::nullopt;
}

std::optional<std::string> CheckHostPort(absl::string_view address) {
  if (address.empty()) return std::nullopt;  // metrics disabled
  size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos) return "no \":port\"";
  absl::string_view host = address.substr(0, colon);
  absl::string_view port_text = address.substr(colon + 1);
  if (host.empty()) return "no host before \":port\"";
  bool bracketed = absl::StartsWith(host, "[") && absl::EndsWith(host, "]");
  if (!bracketed && absl::StrContains(host, ':')) return "an IPv6 host must be in brackets";
  uint32_t port;
  if (!absl::SimpleAtoi(port_text, &port) || port == 0 || port > 65535) {
    return absl::StrCat("port \"", port_text, "\" is not 1 to 65535");
  }
  return std::nullopt;
}

std::optional<std::string> CheckRedisNodes(absl::string_view nodes) {
  if (nodes.empty()) return std::nullopt;  // no remote tier
  absl::StatusOr<std::vector<RedisNodeAddress>> parsed = ParseRedisNodeList(nodes);
  if (!parsed.ok()) return std::string(parsed.status().message());
  return std::nullopt;
}

// Redis ACL user names: any printable bytes but spaces (ACL SETUSER takes one argument).
std::optional<std::string> CheckRedisUser(absl::string_view user) {
  if (user.size() > 128) return "longer than 128 characters";
  for (char c : user) {
    if (!absl::ascii_isgraph(c)) return "contains a space or a control character";
  }
  return std::nullopt;
}

std::optional<std::string> CheckOptionalAbsolutePath(absl::string_view path) {
  if (path.empty()) return std::nullopt;
  return CheckSocketPath(path);
}

// The one table of keys, in file order. Adding a setting = a field in DaemonConfig (or one of
// its sections) + a row here.
const std::vector<KeySpec>& Keys() {
  using C = DaemonConfig;
  using Remote = RemoteTierOptions;
  // One key per paragraph reads better than clang-format's one field per line.
  // clang-format off
  static const auto* const keys = new std::vector<KeySpec>{
      {.name = "backend",
       .field = &At<&C::backend>,
       .syntax = Syntax::kChoice, .reloadable = false,
       .help = "Device backend: host (host memory, handed to engines as memfds) or cuda.",
       .choices = kBackendNames},
      {.name = "device",
       .field = &At<&C::device>,
       .syntax = Syntax::kInteger, .reloadable = false,
       .help = "GPU index this instance serves; the unit passes --device=%i.", .min = 0,
       .max = 1023},
      {.name = "socket_path",
       .field = &At<&C::sockets, &SocketsConfig::socket_path>,
       .syntax = Syntax::kText,
       .reloadable = false, .help = "Unix socket engines connect to.",
       .text_accepted = "an absolute path; \"{device}\" is replaced by the GPU index",
       .check_text = &CheckSocketPath},
      {.name = "socket_mode",
       .field = &At<&C::sockets, &SocketsConfig::socket_mode>,
       .syntax = Syntax::kMode,
       .reloadable = false, .help = "Permission bits of the socket."},
      {.name = "socket_group",
       .field = &At<&C::sockets, &SocketsConfig::socket_group>,
       .syntax = Syntax::kText,
       .reloadable = false,
       .help = "Group owning the socket (one of the daemon's groups); empty = the daemon's group.",
       .text_accepted = "a group name or gid, or empty", .check_text = &CheckGroup},
      {.name = "budget_bytes",
       .field = &At<&C::admission, &AdmissionConfig::budget_bytes>,
       .syntax = Syntax::kBytes,
       .reloadable = true,
       .help = "Host backend: the admission budget (bytes); SIGHUP can lower it, raising it "
               "past the start-up value needs a restart.",
       .min = kMiB, .max = kPiB},
      {.name = "cuda_memory_fraction",
       .field = &At<&C::admission, &AdmissionConfig::cuda_memory_fraction>,
       .syntax = Syntax::kFraction, .reloadable = true,
       .help = "CUDA backend: fraction of the device's total memory in the budget, before "
               "cuda_reserve_bytes comes off."},
      {.name = "cuda_reserve_bytes",
       .field = &At<&C::admission, &AdmissionConfig::cuda_reserve_bytes>,
       .syntax = Syntax::kBytes,
       .reloadable = true,
       .help = "CUDA backend: memory left for the driver and other processes (bytes).", .min = 0,
       .max = kTiB},
      {.name = "cuda_export",
       .field = &At<&C::cuda_export>,
       .syntax = Syntax::kChoice,
       .reloadable = false,
       .help = "CUDA backend: how arenas reach engines: ipc (CUDA IPC handles) or vmm (cuMemCreate "
               "shared as file descriptors; survives a daemon restart).",
       .choices = kCudaExportNames},
      {.name = "lease_timeout_ms",
       .field = &At<&C::leases, &LeaseSettings::timeout>,
       .syntax = Syntax::kInteger,
       .reloadable = true,
       .help = "Milliseconds without an engine heartbeat before its lease expires.", .min = 100,
       .max = 3'600'000, .unit = absl::Milliseconds(1)},
      {.name = "lease_grace_ms",
       .field = &At<&C::leases, &LeaseSettings::grace>,
       .syntax = Syntax::kInteger,
       .reloadable = false,
       .help = "Milliseconds after a lease ends before its sessions are reclaimed.", .min = 0,
       .max = 600'000, .unit = absl::Milliseconds(1)},
      {.name = "reservation_ttl_ms",
       .field = &At<&C::leases, &LeaseSettings::reservation_ttl>,
       .syntax = Syntax::kInteger,
       .reloadable = true,
       .help = "Milliseconds an admission reservation is held without a session.", .min = 100,
       .max = 86'400'000, .unit = absl::Milliseconds(1)},
      {.name = "log_level",
       .field = &At<&C::log_level>,
       .syntax = Syntax::kChoice, .reloadable = true,
       .help = "Log level.", .choices = kLogLevelNames},
      {.name = "metrics_address",
       .field = &At<&C::metrics, &MetricsConfig::metrics_address>,
       .syntax = Syntax::kText,
       .reloadable = false, .help = "Prometheus endpoint; empty disables metrics.",
       .text_accepted = "host:port ([v6addr]:port for IPv6), or empty",
       .check_text = &CheckHostPort},
      {.name = "rpc_metrics",
       .field = &At<&C::metrics, &MetricsConfig::rpc_metrics>,
       .syntax = Syntax::kBool,
       .reloadable = false,
       .help = "Per-RPC counts and latency histograms (a gRPC interceptor on every call: about "
               "25 us each)."},
      {.name = "drain_grace_ms",
       .field = &At<&C::drain_grace_ms>,
       .syntax = Syntax::kInteger,
       .reloadable = true,
       .help = "Milliseconds live sessions may run after SIGTERM (the unit allows 45s to stop).",
       .min = 0, .max = 3'600'000},
      {.name = "prefix_cache_budget_bytes",
       .field = &At<&C::prefix, &PrefixCacheOptions::budget_bytes>,
       .syntax = Syntax::kBytes, .reloadable = false,
       .help = "Memory for prefix-cache entries (bytes); 0 disables the prefix cache.", .min = 0,
       .max = kPiB},
      {.name = "prefix_block_tokens",
       .field = &At<&C::prefix, &PrefixCacheOptions::block_tokens>,
       .syntax = Syntax::kInteger, .reloadable = false,
       .help = "Tokens per prefix-cache block (the granularity of prefix matches).", .min = 1,
       .max = 65536},
      {.name = "prefix_capture_on_engine_death",
       .field = &At<&C::sessions, &SessionsConfig::prefix_capture_on_engine_death>,
       .syntax = Syntax::kBool, .reloadable = false,
       .help = "Capture a dead engine's sessions into the prefix cache before freeing them."},
      {.name = "prefix_verify_checksums",
       .field = &At<&C::prefix, &PrefixCacheOptions::verify_checksums>,
       .syntax = Syntax::kBool, .reloadable = false,
       .help = "Verify checksums when restoring a prefix."},
      {.name = "prefix_copy_threads",
       .field = &At<&C::prefix, &PrefixCacheOptions::copy_threads>,
       .syntax = Syntax::kInteger, .reloadable = false,
       .help = "Most threads a prefix capture or restore (or a block-store transfer) is split "
               "over: one per 32 MiB it moves (capped by the CPUs).",
       .min = 1, .max = 256},
      {.name = "prefix_slab_bytes",
       .field = &At<&C::prefix, &PrefixCacheOptions::slab_bytes>,
       .syntax = Syntax::kBytes,
       .reloadable = false,
       .help = "Size of the slabs prefix-cache storage is sub-allocated from (one arena each; "
               "capped at prefix_cache_budget_bytes; a larger piece gets a slab of its own).",
       .min = 64 * kKiB, .max = kTiB},
      {.name = "prefix_remote_redis_nodes",
       .field = &At<&C::prefix_remote, &Remote::cluster, &RedisClusterOptions::seed_nodes>,
       .syntax = Syntax::kText, .reloadable = false,
       .help = "Redis Cluster seed nodes of the prefix cache's remote tier "
               "(docs/remote-tier.md); empty = none. Needs prefix_cache_budget_bytes > 0.",
       .text_accepted = "host:port,... ([v6addr]:port for IPv6), or empty",
       .check_text = &CheckRedisNodes},
      {.name = "prefix_remote_redis_user",
       .field = &At<&C::prefix_remote, &Remote::cluster, &RedisClusterOptions::user>,
       .syntax = Syntax::kText, .reloadable = false,
       .help = "Redis ACL user the remote tier authenticates as; empty = the requirepass "
               "password (the default user).",
       .text_accepted = "an ACL user name (printable, no spaces), or empty",
       .check_text = &CheckRedisUser},
      {.name = "prefix_remote_redis_password_file",
       .field = &At<&C::prefix_remote, &Remote::cluster, &RedisClusterOptions::password_file>,
       .syntax = Syntax::kText, .reloadable = false,
       .help = "File holding the Redis password (mode 0600, the daemon's user); empty = no AUTH.",
       .text_accepted = "an absolute path, or empty", .check_text = &CheckOptionalAbsolutePath},
      {.name = "prefix_remote_redis_tls",
       .field = &At<&C::prefix_remote, &Remote::cluster, &RedisClusterOptions::tls>,
       .syntax = Syntax::kBool, .reloadable = false,
       .help = "TLS to the Redis Cluster; true is refused (Debian's hiredis 0.14 has no TLS)."},
      {.name = "prefix_remote_redis_connect_timeout_ms",
       .field = &At<&C::prefix_remote, &Remote::cluster, &RedisClusterOptions::connect_timeout>,
       .syntax = Syntax::kInteger,
       .reloadable = false, .help = "Milliseconds one connect to a Redis node may take.",
       .min = 1, .max = 60'000, .unit = absl::Milliseconds(1)},
      {.name = "prefix_remote_redis_timeout_ms",
       .field = &At<&C::prefix_remote, &Remote::cluster, &RedisClusterOptions::command_timeout>,
       .syntax = Syntax::kInteger, .reloadable = false,
       .help = "Milliseconds one Redis command may take.", .min = 1, .max = 60'000,
       .unit = absl::Milliseconds(1)},
      {.name = "prefix_remote_queue_bytes",
       .field = &At<&C::prefix_remote, &Remote::queue_bytes>,
       .syntax = Syntax::kBytes, .reloadable = false,
       .help = "Bytes of captured pieces queued for the remote tier's writer; past it a "
               "capture's remote write is dropped (counted), the capture never waits.",
       .min = 1 * kMiB, .max = 64 * kGiB},
      {.name = "prefix_remote_lookup_timeout_ms",
       .field = &At<&C::prefix, &PrefixCacheOptions::remote_lookup_timeout>,
       .syntax = Syntax::kInteger,
       .reloadable = false,
       .help = "Milliseconds a prefix lookup waits for the remote tier before answering from "
               "the local tiers.",
       .min = 1, .max = 60'000, .unit = absl::Milliseconds(1)},
      {.name = "prefix_remote_fetch_timeout_ms",
       .field = &At<&C::prefix, &PrefixCacheOptions::remote_fetch_timeout>,
       .syntax = Syntax::kInteger, .reloadable = false,
       .help = "Milliseconds a restore waits for the remote tier's values before restoring "
               "what the local tiers hold.",
       .min = 1, .max = 600'000, .unit = absl::Milliseconds(1)},
      {.name = "prefix_remote_ttl_s",
       .field = &At<&C::prefix_remote, &Remote::ttl>,
       .syntax = Syntax::kInteger, .reloadable = false,
       .help = "Expiry of values the remote tier writes, in seconds; 0 = none (let the "
               "cluster's maxmemory-policy evict).",
       .min = 0, .max = 365 * 86'400, .unit = absl::Seconds(1)},
      {.name = "prefix_disk_dir",
       .field = &At<&C::prefix, &PrefixCacheOptions::disk_dir>,
       .syntax = Syntax::kText,
       .reloadable = false,
       .help = "Directory of the prefix cache's disk tier (this daemon's own: created 0700, "
               "*.piece files removed at start); empty = no disk tier.",
       .text_accepted = "an absolute path, or empty", .check_text = &CheckDiskDir},
      {.name = "prefix_disk_bytes",
       .field = &At<&C::prefix, &PrefixCacheOptions::disk_bytes>,
       .syntax = Syntax::kBytes,
       .reloadable = false,
       .help = "Bytes of prefix-cache pieces the disk tier may hold (LRU pieces are demoted "
               "there from prefix_cache_budget_bytes); needs prefix_disk_dir.",
       .min = 0, .max = 64 * kTiB},
      {.name = "prefix_host_tier_bytes",
       .field = &At<&C::prefix, &PrefixCacheOptions::host_tier_bytes>,
       .syntax = Syntax::kBytes, .reloadable = false,
       .help = "Bytes of host memory the prefix cache's middle tier may hold (LRU pieces move "
               "GPU -> host -> disk; not charged to budget_bytes); 0 = no host tier.",
       .min = 0, .max = 64 * kTiB},
      {.name = "prefix_host_tier_memory",
       .field = &At<&C::prefix_host_tier_memory>,
       .syntax = Syntax::kChoice, .reloadable = false,
       .help = "Memory of the host tier: pinned (cudaHostAlloc; cuda backend only) or plain "
               "(anonymous memory; on the host backend the device tier already is host memory, "
               "so this only adds a copy).",
       .choices = kPrefixHostMemoryNames},
      {.name = "watchdog",
       .field = &At<&C::watchdog>,
       .syntax = Syntax::kBool, .reloadable = false,
       .help = "Send systemd watchdog keep-alives when asked to (false needs WatchdogSec=0)."},
      {.name = "keep_kv_across_restarts",
       .field = &At<&C::keep_kv_across_restarts>,
       .syntax = Syntax::kBool, .reloadable = false,
       .help = "Under systemd or memra-kv-supervise: keep arenas and a journal in the fd store "
               "and re-adopt sessions after a restart."},
      {.name = "step_channel",
       .field = &At<&C::step_channel>,
       .syntax = Syntax::kBool,
       .reloadable = false,
       .help = "Offer engines the shared-memory step channel (docs/step-channel.md); false = "
               "Step over gRPC only."},
      {.name = "max_plan_layers",
       .field = &At<&C::sessions, &SessionsConfig::max_plan_layers>,
       .syntax = Syntax::kInteger,
       .reloadable = false,
       .help = "Layers (trunk + MTP) a model plan may have; larger plans are refused "
               "(INVALID_ARGUMENT).",
       .min = 1, .max = kMaxPlanLayersAccepted},
      {.name = "max_engine_sessions",
       .field = &At<&C::sessions, &SessionsConfig::max_engine_sessions>,
       .syntax = Syntax::kInteger, .reloadable = false,
       .help = "Sessions one engine may hold at once (RESOURCE_EXHAUSTED past it).", .min = 1,
       .max = 10'000'000},
      {.name = "max_engine_plans",
       .field = &At<&C::sessions, &SessionsConfig::max_engine_plans>,
       .syntax = Syntax::kInteger,
       .reloadable = false,
       .help = "Model plans one engine may have registered at once, of the daemon's 1024 "
               "(RESOURCE_EXHAUSTED past it).",
       .min = 1, .max = 1024},
      {.name = "max_engine_budget_share",
       .field = &At<&C::admission, &AdmissionConfig::max_engine_budget_share>,
       .syntax = Syntax::kInteger, .reloadable = false,
       .help = "Percent of the admission budget one engine's reservations and sessions may hold "
               "(RESOURCE_EXHAUSTED past it); 100 = no cap.",
       .min = 1, .max = 100},
      {.name = "max_attached_engines",
       .field = &At<&C::leases, &LeaseSettings::max_engines>,
       .syntax = Syntax::kInteger, .reloadable = false,
       .help = "Engines attached at once, each an Attach stream (RESOURCE_EXHAUSTED past it).",
       .min = 1, .max = 65'536},
      {.name = "max_engine_event_streams",
       .field = &At<&C::sockets, &SocketsConfig::max_engine_event_streams>,
       .syntax = Syntax::kInteger, .reloadable = false,
       .help = "KvPrefixCache.SubscribeEvents streams one engine may hold open, each a daemon "
               "thread (RESOURCE_EXHAUSTED past it).",
       .min = 1, .max = 1024},
      {.name = "max_event_streams",
       .field = &At<&C::sockets, &SocketsConfig::max_event_streams>,
       .syntax = Syntax::kInteger,
       .reloadable = false,
       .help = "KvPrefixCache.SubscribeEvents streams open at once on each socket, all engines "
               "(or operators) together (RESOURCE_EXHAUSTED past it).",
       .min = 1, .max = 1024},
      {.name = "max_connections",
       .field = &At<&C::connections, &ConnectionGate::Limits::max_connections>,
       .syntax = Syntax::kInteger,
       .reloadable = false,
       .help = "gRPC connections each socket serves at once; past it a new connection is closed "
               "at once (the client sees UNAVAILABLE) and the daemon logs the numbers.",
       .min = 1, .max = 1'000'000},
      {.name = "max_connections_per_uid",
       .field = &At<&C::connections, &ConnectionGate::Limits::max_connections_per_uid>,
       .syntax = Syntax::kInteger, .reloadable = false,
       .help = "gRPC connections each socket serves at once from one uid (the kernel's peer "
               "credentials); past it that uid's new connection is closed at once.",
       .min = 1, .max = 1'000'000},
      {.name = "connection_idle_timeout_ms",
       .field = &At<&C::sockets, &SocketsConfig::connection_idle_timeout_ms>,
       .syntax = Syntax::kInteger, .reloadable = false,
       .help = "A gRPC connection with no call open for this long is closed (GOAWAY); clients "
               "reconnect on their next call.",
       .min = 1'000, .max = 86'400'000},
      {.name = "arena_pool_engine_bytes",
       .field = &At<&C::sessions, &SessionsConfig::arena_pool_engine_bytes>,
       .syntax = Syntax::kBytes, .reloadable = false,
       .help = "Released session arenas kept per engine for its next sessions of the same size "
               "(bytes; evictable by admission, freed when its lease ends); 0 disables the pool.",
       .min = 0, .max = kPiB},
      {.name = "block_store_engine_bytes",
       .field = &At<&C::block_store, &BlockStoreLimits::engine_bytes>,
       .syntax = Syntax::kBytes, .reloadable = false,
       .help = "Bytes of its own KV pool one engine may offer and register with the block store "
               "at once (RESOURCE_EXHAUSTED past it).",
       .min = 1, .max = kPiB},
      {.name = "block_store_max_registrations",
       .field = &At<&C::block_store, &BlockStoreLimits::registrations_per_engine>,
       .syntax = Syntax::kInteger, .reloadable = false,
       .help = "Block store registrations (RegisterEngineBuffers) one engine may hold at once.",
       .min = 1, .max = 4096},
      {.name = "block_store_max_pins",
       .field = &At<&C::block_store, &BlockStoreLimits::pins_per_engine>,
       .syntax = Syntax::kInteger, .reloadable = false,
       .help = "Block store pins (LookupBlocks with pin_ttl_ms) one engine may hold at once.",
       .min = 1, .max = 1'000'000},
      {.name = "block_store_max_offers",
       .field = &At<&C::block_store, &BlockStoreLimits::max_offers>,
       .syntax = Syntax::kInteger, .reloadable = false,
       .help = "Unregistered block store buffer offers (each holding a descriptor) of all "
               "engines together (RESOURCE_EXHAUSTED past it).",
       .min = 1, .max = 1'000'000},
      {.name = "block_store_max_mapped_buffers",
       .field = &At<&C::block_store, &BlockStoreLimits::max_mapped_buffers>,
       .syntax = Syntax::kInteger, .reloadable = false,
       .help = "Registered block store buffers (each a mapping under vm.max_map_count) of all "
               "engines together (RESOURCE_EXHAUSTED past it).",
       .min = 1, .max = 1'000'000},
      {.name = "max_arenas",
       .field = &At<&C::admission, &AdmissionConfig::max_arenas>,
       .syntax = Syntax::kInteger,
       .reloadable = false,
       .help = "Arenas (sessions, reservations, prefix storage) held at once, each a mapping "
               "under vm.max_map_count (RESOURCE_EXHAUSTED past it); 0 = 3/4 of "
               "vm.max_map_count, read at start.",
       .min = 0, .max = 100'000'000},
      {.name = "max_engine_arenas",
       .field = &At<&C::admission, &AdmissionConfig::max_engine_arenas>,
       .syntax = Syntax::kInteger,
       .reloadable = false,
       .help = "Arenas (sessions, reservations) one engine may hold at once (RESOURCE_EXHAUSTED "
               "past it); 0 = half of the arena limit in force.",
       .min = 0, .max = 100'000'000},
      {.name = "max_engine_cpu_percent",
       .field = &At<&C::admission, &AdmissionConfig::max_engine_cpu_percent>,
       .syntax = Syntax::kInteger, .reloadable = false,
       .help = "Percent of one core's time the daemon may spend in one engine's session "
               "operations, 2 s of it banked for bursts (RESOURCE_EXHAUSTED past it, until the "
               "engine has earned time back); 0 = no bound.",
       .min = 0, .max = 6'400},
      {.name = "admin_socket_path",
       .field = &At<&C::sockets, &SocketsConfig::admin_socket_path>,
       .syntax = Syntax::kText,
       .reloadable = false,
       .help = "Unix socket operators (memra-kvctl) connect to; empty = socket_path with .sock "
               "replaced by .admin.sock.",
       .text_accepted = "an absolute path (\"{device}\" is replaced by the GPU index), or empty",
       .check_text = &CheckDerivedSocketPath},
      {.name = "admin_socket_mode",
       .field = &At<&C::sockets, &SocketsConfig::admin_socket_mode>,
       .syntax = Syntax::kMode,
       .reloadable = false, .help = "Permission bits of the admin socket."},
      {.name = "admin_socket_group",
       .field = &At<&C::sockets, &SocketsConfig::admin_socket_group>,
       .syntax = Syntax::kText,
       .reloadable = false,
       .help = "Group owning the admin socket (one of the daemon's groups); empty = the daemon's "
               "group.",
       .text_accepted = "a group name or gid, or empty", .check_text = &CheckGroup},
      {.name = "handoff_socket_path",
       .field = &At<&C::sockets, &SocketsConfig::handoff_socket_path>,
       .syntax = Syntax::kText,
       .reloadable = false,
       .help = "Unix socket engines get their attach ticket and their arenas' descriptors from "
               "(socket_mode and socket_group apply); empty = socket_path with .sock replaced "
               "by .handoff.sock.",
       .text_accepted = "an absolute path (\"{device}\" is replaced by the GPU index), or empty",
       .check_text = &CheckDerivedSocketPath},
      {.name = "cache_scope_allow",
       .field = &At<&C::cache_scope_allow>,
       .syntax = Syntax::kText,
       .reloadable = false,
       .help = "Named prefix-cache scopes engines may attach in, and who may: "
               "\"name:uid,uid,@group; name2:@group\"; empty = each engine's scope is its uid's.",
       .text_accepted = "name:member,...; ... (members: a uid or @group), or empty",
       .check_text = &CheckCacheScopeAllow},
  };
  // clang-format on
  return *keys;
}

const KeySpec* FindKey(absl::string_view name) {
  for (const KeySpec& spec : Keys()) {
    if (spec.name == name) return &spec;
  }
  return nullptr;
}

// Levenshtein distance, for "did you mean" on unknown keys.
size_t EditDistance(absl::string_view a, absl::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::string UnknownKeyMessage(absl::string_view name) {
  std::string message = absl::StrCat("unknown key \"", name, "\"");
  for (const KeySpec& spec : Keys()) {
    if (EditDistance(name, spec.name) <= 2) {
      absl::StrAppend(&message, " (did you mean \"", spec.name, "\"?)");
      break;
    }
  }
  return message;
}

// "8GiB" when exact, else plain bytes.
std::string FormatBytes(uint64_t bytes) {
  static constexpr std::pair<uint64_t, absl::string_view> kUnits[] = {
      {kPiB, "PiB"}, {kTiB, "TiB"}, {kGiB, "GiB"}, {kMiB, "MiB"}, {kKiB, "KiB"}};
  for (const auto& [unit, suffix] : kUnits) {
    if (bytes != 0 && bytes % unit == 0) return absl::StrCat(bytes / unit, suffix);
  }
  return absl::StrCat(bytes);
}

std::string FormatMode(uint64_t mode) {
  std::array<char, 8> digits;
  auto [end, ec] = std::to_chars(digits.data(), digits.data() + digits.size(), mode, 8);
  std::string text(digits.data(), end);
  return absl::StrCat(std::string(text.size() < 4 ? 4 - text.size() : 0, '0'), text);
}

// Shortest text that reads back to the same double, always with a '.' or exponent (a TOML float).
std::string FormatDouble(double value) {
  std::array<char, 32> buffer;
  auto [end, ec] = std::to_chars(buffer.data(), buffer.data() + buffer.size(), value);
  std::string text(buffer.data(), end);
  if (text.find_first_of(".eE") == std::string::npos) text += ".0";
  return text;
}

// A TOML basic string.
std::string Quote(absl::string_view text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      absl::StrAppend(&out, "\\u00", absl::Hex(static_cast<unsigned char>(c), absl::kZeroPad2));
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string Accepted(const KeySpec& spec) {
  switch (spec.syntax) {
    case Syntax::kInteger:
      return absl::StrCat("an integer from ", spec.min, " to ", spec.max);
    case Syntax::kBytes:
      return absl::StrCat("a size from ", FormatBytes(spec.min), " to ", FormatBytes(spec.max),
                          ", in bytes or as \"<n>B|KiB|MiB|GiB|TiB|PiB\"");
    case Syntax::kMode:
      return "an octal mode string from \"0000\" to \"0777\"";
    case Syntax::kFraction:
      return "a number greater than 0 and at most 1";
    case Syntax::kBool:
      return "true or false";
    case Syntax::kChoice:
      return absl::StrCat("one of ", absl::StrJoin(spec.choices, ", "));
    case Syntax::kText:
      return std::string(spec.text_accepted);
  }
  return "";
}

std::optional<uint64_t> ParseByteText(absl::string_view text) {
  static constexpr std::pair<absl::string_view, uint64_t> kSuffixes[] = {
      {"PiB", kPiB}, {"TiB", kTiB}, {"GiB", kGiB}, {"MiB", kMiB}, {"KiB", kKiB}, {"B", 1}};
  text = absl::StripAsciiWhitespace(text);
  uint64_t unit = 1;
  for (const auto& [suffix, multiplier] : kSuffixes) {
    if (absl::EndsWithIgnoreCase(text, suffix)) {
      text = absl::StripTrailingAsciiWhitespace(text.substr(0, text.size() - suffix.size()));
      unit = multiplier;
      break;
    }
  }
  uint64_t count;
  if (text.empty() || !absl::ascii_isdigit(text[0]) || !absl::SimpleAtoi(text, &count)) {
    return std::nullopt;
  }
  uint64_t bytes;
  if (__builtin_mul_overflow(count, unit, &bytes)) return std::nullopt;
  return bytes;
}

// The whole file; NOT_FOUND / PERMISSION_DENIED / ... naming `what` and the path.
absl::StatusOr<std::string> ReadWholeFile(const std::string& path, absl::string_view what) {
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("open ", what, " ", path));
  std::string text;
  char buffer[4096];
  ssize_t n;
  while ((n = read(fd, buffer, sizeof buffer)) != 0) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      int error = errno;
      close(fd);
      return absl::ErrnoToStatus(error, absl::StrCat("read ", what, " ", path));
    }
    text.append(buffer, static_cast<size_t>(n));
  }
  close(fd);
  return text;
}

// Applies the key's rules to a raw value. The error is the problem alone; the caller adds where,
// key and value.
absl::StatusOr<TypedValue> Interpret(const KeySpec& spec, const RawValue& raw) {
  const std::string* text = std::get_if<std::string>(&raw);
  auto refuse = [&](absl::string_view problem) {
    return absl::InvalidArgumentError(absl::StrCat(problem, "; accepted: ", Accepted(spec)));
  };
  switch (spec.syntax) {
    case Syntax::kInteger:
    case Syntax::kBytes: {
      std::optional<uint64_t> number;
      if (const int64_t* i = std::get_if<int64_t>(&raw)) {
        if (*i >= 0) number = static_cast<uint64_t>(*i);
      } else if (text != nullptr) {
        uint64_t parsed;
        if (spec.syntax == Syntax::kBytes) {
          number = ParseByteText(*text);
        } else if (!text->empty() && absl::ascii_isdigit((*text)[0]) &&
                   absl::SimpleAtoi(*text, &parsed)) {
          number = parsed;
        }
      }
      if (!number.has_value()) return refuse("not a valid value");
      if (*number < spec.min || *number > spec.max) return refuse("out of range");
      return TypedValue(*number);
    }
    case Syntax::kMode: {
      if (text == nullptr) return refuse("not a string (write modes in quotes, e.g. \"0660\")");
      uint64_t mode = 0;
      bool octal =
          !text->empty() && text->size() <= 4 &&
          std::all_of(text->begin(), text->end(), [](char c) { return c >= '0' && c <= '7'; });
      if (octal) std::from_chars(text->data(), text->data() + text->size(), mode, 8);
      if (!octal || mode > 0777) return refuse("not a valid mode");
      return TypedValue(mode);
    }
    case Syntax::kFraction: {
      double value = std::nan("");
      if (const double* d = std::get_if<double>(&raw)) value = *d;
      if (const int64_t* i = std::get_if<int64_t>(&raw)) value = static_cast<double>(*i);
      if (text != nullptr && !absl::SimpleAtod(*text, &value)) value = std::nan("");
      if (std::isnan(value)) return refuse("not a number");
      if (!(value > 0.0 && value <= 1.0)) return refuse("out of range");
      return TypedValue(value);
    }
    case Syntax::kBool: {
      if (const bool* b = std::get_if<bool>(&raw)) return TypedValue(*b);
      if (text != nullptr && (*text == "true" || *text == "false")) {
        return TypedValue(*text == "true");
      }
      return refuse("not a boolean");
    }
    case Syntax::kChoice: {
      if (text != nullptr) {
        auto it = std::find(spec.choices.begin(), spec.choices.end(), *text);
        if (it != spec.choices.end()) {
          return TypedValue(static_cast<uint64_t>(it - spec.choices.begin()));
        }
      }
      return refuse("not a known value");
    }
    case Syntax::kText: {
      if (text == nullptr) return refuse("not a string");
      if (std::optional<std::string> problem = spec.check_text(*text)) return refuse(*problem);
      return TypedValue(*text);
    }
  }
  return absl::InternalError("unhandled syntax");
}

// The field `spec` sets in `config`, for reading. (The locators take a mutable config; nothing
// is written through the result.)
FieldRef Read(const KeySpec& spec, const DaemonConfig& config) {
  return spec.field(const_cast<DaemonConfig&>(config));
}

// Narrowing is safe: each key's range fits its field (uint32 keys have max <= UINT32_MAX, enum
// indices are below the choice count, durations are at most a year of their unit).
void Store(const KeySpec& spec, const TypedValue& value, DaemonConfig& config) {
  std::visit(
      [&](auto* field) {
        using T = std::remove_pointer_t<decltype(field)>;
        if constexpr (std::is_same_v<T, absl::Duration>) {
          *field = spec.unit * static_cast<int64_t>(std::get<uint64_t>(value));
        } else if constexpr (std::is_same_v<T, std::vector<RedisNodeAddress>>) {
          // Interpret checked the list (CheckRedisNodes); empty is no node at all.
          const std::string& text = std::get<std::string>(value);
          *field = text.empty() ? T{} : *ParseRedisNodeList(text);
        } else if constexpr (std::is_same_v<T, uint64_t> || std::is_same_v<T, uint32_t> ||
                             std::is_enum_v<T>) {
          *field = static_cast<T>(std::get<uint64_t>(value));
        } else {
          *field = std::get<T>(value);
        }
      },
      spec.field(config));
}

// The value's TOML text, as RenderConfig writes it.
std::string RenderValue(const KeySpec& spec, const DaemonConfig& config) {
  return std::visit(
      [&](const auto* field_pointer) -> std::string {
        const auto& field = *field_pointer;
        using T = std::remove_cvref_t<decltype(field)>;
        if constexpr (std::is_same_v<T, bool>) {
          return field ? "true" : "false";
        } else if constexpr (std::is_same_v<T, double>) {
          return FormatDouble(field);
        } else if constexpr (std::is_same_v<T, std::string>) {
          return Quote(field);
        } else if constexpr (std::is_enum_v<T>) {
          return Quote(spec.choices[static_cast<size_t>(field)]);
        } else if constexpr (std::is_same_v<T, absl::Duration>) {
          absl::Duration remainder;
          return absl::StrCat(absl::IDivDuration(field, spec.unit, &remainder));
        } else if constexpr (std::is_same_v<T, std::vector<RedisNodeAddress>>) {
          return Quote(absl::StrJoin(
              field, ",", [](std::string* out, const RedisNodeAddress& node) {
                absl::StrAppend(out, node.ToString());
              }));
        } else if (spec.syntax == Syntax::kMode) {
          return Quote(FormatMode(field));
        } else if (spec.syntax == Syntax::kBytes && FormatBytes(field) != absl::StrCat(field)) {
          return Quote(FormatBytes(field));
        } else {
          return absl::StrCat(field);
        }
      },
      Read(spec, config));
}

bool SameValue(const KeySpec& spec, const DaemonConfig& a, const DaemonConfig& b) {
  const FieldRef other = Read(spec, b);
  return std::visit(
      [&](auto* field) { return *field == *std::get<decltype(field)>(other); },
      Read(spec, a));
}

void CopyValue(const KeySpec& spec, const DaemonConfig& from, DaemonConfig& to) {
  const FieldRef source = Read(spec, from);
  std::visit([&](auto* field) { *field = *std::get<decltype(field)>(source); }, spec.field(to));
}

// Interprets and stores one value; errors read "<subject>: <problem>; accepted: ...".
absl::Status SetKey(const KeySpec& spec, const RawValue& raw, absl::string_view subject,
                    DaemonConfig& config) {
  absl::StatusOr<TypedValue> value = Interpret(spec, raw);
  if (!value.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(subject, ": ", value.status().message()));
  }
  Store(spec, *value, config);
  return absl::OkStatus();
}

// A TOML value as RawValue and as written (for messages); nullopt for tables, arrays, dates.
std::optional<std::pair<RawValue, std::string>> FromToml(const toml::value& value) {
  switch (value.type()) {
    case toml::value_t::integer:
      return std::pair{RawValue(value.as_integer()), absl::StrCat(value.as_integer())};
    case toml::value_t::floating:
      return std::pair{RawValue(value.as_floating()), FormatDouble(value.as_floating())};
    case toml::value_t::boolean:
      return std::pair{RawValue(value.as_boolean()), value.as_boolean() ? "true" : "false"};
    case toml::value_t::string:
      return std::pair{RawValue(value.as_string().str), Quote(value.as_string().str)};
    default:
      return std::nullopt;
  }
}

}  // namespace

std::string_view PrefixHostMemoryName(PrefixHostMemory memory) {
  absl::string_view name = kPrefixHostMemoryNames[static_cast<size_t>(memory)];
  return std::string_view(name.data(), name.size());
}

std::string_view CudaExportName(CudaExport mode) {
  absl::string_view name = kCudaExportNames[static_cast<size_t>(mode)];
  return {name.data(), name.size()};
}

std::string_view BackendName(Backend backend) {
  absl::string_view name = kBackendNames[static_cast<size_t>(backend)];
  return {name.data(), name.size()};
}

std::string_view LogLevelName(LogLevel level) {
  absl::string_view name = kLogLevelNames[static_cast<size_t>(level)];
  return {name.data(), name.size()};
}

std::string DaemonConfig::SocketPath() const {
  return absl::StrReplaceAll(sockets.socket_path, {{"{device}", absl::StrCat(device)}});
}

namespace {

// `configured` with "{device}" replaced, or (empty) the engine socket's path with ".sock"
// replaced by `suffix`.
std::string DerivedSocketPath(const DaemonConfig& config, const std::string& configured,
                              absl::string_view suffix) {
  if (!configured.empty()) {
    return absl::StrReplaceAll(configured, {{"{device}", absl::StrCat(config.device)}});
  }
  const std::string engine_socket = config.SocketPath();
  absl::string_view stem = engine_socket;
  absl::ConsumeSuffix(&stem, ".sock");
  return absl::StrCat(stem, suffix);
}

}  // namespace

std::string DaemonConfig::AdminSocketPath() const {
  return DerivedSocketPath(*this, sockets.admin_socket_path, ".admin.sock");
}

std::string DaemonConfig::HandoffSocketPath() const {
  return DerivedSocketPath(*this, sockets.handoff_socket_path, ".handoff.sock");
}

bool DaemonConfig::operator==(const DaemonConfig& other) const {
  return std::all_of(Keys().begin(), Keys().end(),
                     [&](const KeySpec& spec) { return SameValue(spec, *this, other); });
}

std::vector<ConfigKeyInfo> ConfigKeys() {
  std::vector<ConfigKeyInfo> out;
  for (const KeySpec& spec : Keys()) {
    out.push_back({std::string_view(spec.name.data(), spec.name.size()),
                   std::string_view(spec.help.data(), spec.help.size()), Accepted(spec),
                   spec.reloadable});
  }
  return out;
}

absl::StatusOr<DaemonConfig> ParseConfig(std::string_view text_view, std::string_view source_view) {
  absl::string_view source_name = AsAbsl(source_view);
  toml::value root;
  try {
    std::istringstream stream{std::string(text_view)};
    root = toml::parse(stream, std::string(source_name));
  } catch (const std::exception& e) {
    // toml11's message already names the file and shows the line with a caret.
    return absl::InvalidArgumentError(absl::StrCat("cannot parse ", source_name, ": ", e.what()));
  }

  // The table is unordered: sort by line so errors come in file order.
  std::vector<std::pair<size_t, const std::pair<const std::string, toml::value>*>> entries;
  for (const auto& entry : root.as_table()) {
    entries.emplace_back(entry.second.location().line(), &entry);
  }
  std::sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) {
    return std::tie(a.first, a.second->first) < std::tie(b.first, b.second->first);
  });

  DaemonConfig config;
  std::vector<std::string> errors;
  for (const auto& [line, entry] : entries) {
    const auto& [key, value] = *entry;
    std::string where = line > 0 ? absl::StrCat(source_name, ":", line) : std::string(source_name);
    const KeySpec* spec = FindKey(key);
    if (spec == nullptr) {
      errors.push_back(absl::StrCat(where, ": ", UnknownKeyMessage(key)));
      continue;
    }
    std::optional<std::pair<RawValue, std::string>> raw = FromToml(value);
    if (!raw.has_value()) {
      errors.push_back(absl::StrCat(where, ": ", key, " is a TOML ", toml::stringize(value.type()),
                                    "; accepted: ", Accepted(*spec)));
      continue;
    }
    absl::Status status =
        SetKey(*spec, raw->first, absl::StrCat(where, ": ", key, " = ", raw->second), config);
    if (!status.ok()) errors.emplace_back(status.message());
  }
  if (!errors.empty()) return absl::InvalidArgumentError(absl::StrJoin(errors, "\n"));
  return config;
}

absl::StatusOr<DaemonConfig> LoadConfigFile(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadWholeFile(path, "config file"));
  return ParseConfig(text, path);
}

uint64_t EffectiveMaxEngineArenas(const DaemonConfig& config, uint64_t max_arenas) {
  if (config.admission.max_engine_arenas != 0) return config.admission.max_engine_arenas;
  return std::max<uint64_t>(1, max_arenas / 2);
}

uint64_t EffectiveMaxArenas(const DaemonConfig& config, const std::string& max_map_count_path) {
  if (config.admission.max_arenas != 0) return config.admission.max_arenas;
  uint64_t max_map_count = kDefaultMaxMapCount;
  absl::StatusOr<std::string> text = ReadWholeFile(max_map_count_path, "vm.max_map_count");
  if (!text.ok() || !absl::SimpleAtoi(absl::StripAsciiWhitespace(*text), &max_map_count)) {
    max_map_count = kDefaultMaxMapCount;
  }
  return std::max<uint64_t>(1, max_map_count / 4 * 3);
}

DescriptorShares ShareDescriptors(uint64_t open_files) {
  const uint64_t shared = open_files > kReservedDescriptors ? open_files - kReservedDescriptors : 0;
  return {.open_files = open_files,
          .arenas = std::max<uint64_t>(1, shared / 2),
          .connections = std::max<uint64_t>(1, shared / 16),
          .handoff_descriptors = std::max<uint64_t>(1, shared / 16 * 3),
          .in_flight = std::max<uint64_t>(1, shared),
          .step_channels = std::max<uint64_t>(1, shared / 32),
          .block_store_offers = std::max<uint64_t>(1, shared / 32)};
}

absl::Status ApplyOverride(DaemonConfig& config, std::string_view key_view,
                           std::string_view value_view) {
  absl::string_view key = AsAbsl(key_view), value = AsAbsl(value_view);
  std::string subject = absl::StrCat("--", key, "=", value);
  const KeySpec* spec = FindKey(key);
  if (spec == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(subject, ": ", UnknownKeyMessage(key)));
  }
  return SetKey(*spec, RawValue(std::string(value)), subject, config);
}

absl::StatusOr<SplitFlags> SplitConfigFlags(int argc, const char* const* argv) {
  SplitFlags split;
  bool after_terminator = false;
  for (int i = 0; i < argc; ++i) {
    absl::string_view arg = argv[i];
    absl::string_view flag = arg;
    bool is_flag = i > 0 && !after_terminator &&
                   (absl::ConsumePrefix(&flag, "--") || absl::ConsumePrefix(&flag, "-"));
    after_terminator = after_terminator || (i > 0 && arg == "--");
    size_t equals = flag.find('=');
    const KeySpec* spec = is_flag ? FindKey(flag.substr(0, equals)) : nullptr;
    if (spec == nullptr) {
      split.rest.emplace_back(arg);
      continue;
    }
    std::string key(spec->name);
    if (equals != absl::string_view::npos) {
      split.overrides.push_back({key, std::string(flag.substr(equals + 1))});
    } else if (spec->syntax == Syntax::kBool) {
      split.overrides.push_back({key, "true"});
    } else if (i + 1 < argc) {
      split.overrides.push_back({key, argv[++i]});
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(arg, ": no value; accepted: ", Accepted(*spec)));
    }
  }
  return split;
}

absl::Status ValidateConfig(const DaemonConfig& config) {
  std::string socket = config.SocketPath();
  if (socket.size() >= sizeof(sockaddr_un{}.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "socket_path = ", Quote(config.sockets.socket_path), " with device = ", config.device,
        " is ",
        Quote(socket), " (", socket.size(), " bytes); a Unix socket path holds at most ",
        sizeof(sockaddr_un{}.sun_path) - 1, " bytes"));
  }
  struct DerivedSocket {
    absl::string_view what;
    absl::string_view key;
    const std::string& configured;
    std::string path;
  };
  const DerivedSocket derived[] = {
      {"admin", "admin_socket_path", config.sockets.admin_socket_path, config.AdminSocketPath()},
      {"handoff", "handoff_socket_path", config.sockets.handoff_socket_path,
       config.HandoffSocketPath()},
  };
  for (const DerivedSocket& other : derived) {
    if (other.path.size() >= sizeof(sockaddr_un{}.sun_path)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the ", other.what, " socket ", Quote(other.path), " (", other.key, " = ",
          Quote(other.configured), ", device = ", config.device, ") is ", other.path.size(),
          " bytes; a Unix socket path holds at most ", sizeof(sockaddr_un{}.sun_path) - 1,
          " bytes"));
    }
    if (other.path == socket) {
      return absl::InvalidArgumentError(
          absl::StrCat(other.key, " and socket_path are both ", Quote(socket),
                       "; engines, operators and the handoff need separate sockets"));
    }
  }
  if (derived[0].path == derived[1].path) {
    return absl::InvalidArgumentError(
        absl::StrCat("admin_socket_path and handoff_socket_path are both ", Quote(derived[0].path),
                     "; operators and the handoff need separate sockets"));
  }
  if (config.prefix.disk_dir.empty() != (config.prefix.disk_bytes == 0) ||
      (!config.prefix.disk_dir.empty() && config.prefix.budget_bytes == 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefix_disk_dir = ", Quote(config.prefix.disk_dir), ", prefix_disk_bytes = ",
        config.prefix.disk_bytes, " and prefix_cache_budget_bytes = ",
        config.prefix.budget_bytes,
        ": a disk tier needs a directory, a byte budget and a prefix cache; no disk tier needs "
        "an empty directory and 0 bytes"));
  }
  if (config.prefix.host_tier_bytes > 0 && config.prefix.budget_bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefix_host_tier_bytes = ", config.prefix.host_tier_bytes,
        " needs a prefix cache (prefix_cache_budget_bytes is 0)"));
  }
  if (config.prefix.host_tier_bytes > 0 &&
      config.prefix_host_tier_memory == PrefixHostMemory::kPinned &&
      config.backend != Backend::kCuda) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefix_host_tier_bytes = ", config.prefix.host_tier_bytes,
        " with prefix_host_tier_memory = pinned needs backend = cuda; the host backend's "
        "device tier already is host memory (prefix_host_tier_memory = plain runs the tier "
        "there anyway)"));
  }
  // Prefix-cache entries are counted against the admission budget (they are evicted to admit).
  if (config.backend == Backend::kHost &&
      config.prefix.budget_bytes > config.admission.budget_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefix_cache_budget_bytes = ", config.prefix.budget_bytes,
                     " exceeds budget_bytes = ", config.admission.budget_bytes,
                     "; the host backend's prefix cache lives inside its budget"));
  }
  if (config.prefix_remote.cluster.tls) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefix_remote_redis_tls = true: ", RedisTlsUnsupportedReason()));
  }
  if (!config.prefix_remote.cluster.user.empty() &&
      config.prefix_remote.cluster.password_file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefix_remote_redis_user = ", Quote(config.prefix_remote.cluster.user),
        " needs prefix_remote_redis_password_file (an ACL user authenticates with a password)"));
  }
  // The remote tier is a tier of the prefix cache: refused, not ignored, without one.
  if (!config.prefix_remote.cluster.seed_nodes.empty() && config.prefix.budget_bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefix_remote_redis_nodes = ",
        RenderValue(*FindKey("prefix_remote_redis_nodes"), config),
        " needs a prefix cache: prefix_cache_budget_bytes is 0"));
  }
  return absl::OkStatus();
}

absl::StatusOr<DaemonConfig> LoadDaemonConfig(const std::string& path,
                                              absl::Span<const ConfigOverride> overrides) {
  DaemonConfig config;
  if (!path.empty()) {
    ASSIGN_OR_RETURN(config, LoadConfigFile(path));
  }
  for (const ConfigOverride& override : overrides) {
    RETURN_IF_ERROR(ApplyOverride(config, override.key, override.value));
  }
  RETURN_IF_ERROR(ValidateConfig(config));
  return config;
}

ReloadOutcome PlanReload(const DaemonConfig& running, const DaemonConfig& reread) {
  ReloadOutcome outcome;
  outcome.applied = running;
  for (const KeySpec& spec : Keys()) {
    if (SameValue(spec, running, reread)) continue;
    if (spec.reloadable) {
      CopyValue(spec, reread, outcome.applied);
      outcome.applied_keys.emplace_back(spec.name);
    } else {
      outcome.not_reloadable_keys.emplace_back(spec.name);
    }
  }
  return outcome;
}

std::string RenderConfig(const DaemonConfig& config) {
  std::string out =
      "# memra-kvd configuration (TOML): one file per GPU, /etc/memra-kv/gpu<N>.conf.\n"
      "# Command-line flags with the same names override these values. Keys marked reloadable\n"
      "# take effect on `systemctl reload memra-kvd@<N>`; the others need a restart.\n"
      "# Every key is listed with its default (generated by RenderConfig).\n";
  for (const KeySpec& spec : Keys()) {
    absl::StrAppend(&out, "\n# ", spec.help, "\n# Accepted: ", Accepted(spec), ".",
                    spec.reloadable ? " Reloadable." : "", "\n", spec.name, " = ",
                    RenderValue(spec, config), "\n");
  }
  return out;
}

}  // namespace memra
