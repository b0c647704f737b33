#ifndef MEMRA_SERVER_CONFIG_H_
#define MEMRA_SERVER_CONFIG_H_

// memra-kvd's settings: one TOML file per instance (/etc/memra-kv/gpu<N>.conf), overridden by
// command-line flags with the same key names. One table of keys (config.cc) drives file parsing,
// overrides, rendering and reload planning, so a key cannot be accepted in one place and not
// another. Every refusal is INVALID_ARGUMENT naming the key, the value as written and what is
// accepted.
//
// Start-up:   LoadDaemonConfig(path, flags)          parse + overrides + ValidateConfig.
// SIGHUP:     LoadDaemonConfig(path, same flags), then PlanReload(running, reread): flags still
//             win over the file, and keys that cannot change live are reported, not applied.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "server/edge/connection_gate.h"
#include "server/session/engine_leases.h"
#include "server/store/block_store.h"
#include "server/store/prefix_cache.h"
#include "server/store/remote/remote_tier.h"

namespace memra {

enum class Backend { kHost, kCuda };
// How the cuda backend hands arenas to engines: legacy CUDA IPC handles in the owning engine's
// reply (the default), or CUDA VMM allocations exported as POSIX file descriptors over the fd
// side channel (common/cuda_vmm.h), which a restart can keep (docs/failure-model.md).
enum class CudaExport { kIpc, kVmm };
// Where the prefix cache's host tier (the middle tier) gets its memory: page-locked memory
// from the CUDA runtime (cuda backend only), or plain anonymous memory (any backend).
enum class PrefixHostMemory { kPinned, kPlain };
// Same order as spdlog::level::level_enum (trace = 0 ... off = 6): static_cast converts.
enum class LogLevel { kTrace, kDebug, kInfo, kWarn, kError, kCritical, kOff };

std::string_view BackendName(Backend backend);  // "host" | "cuda"
std::string_view CudaExportName(CudaExport mode);  // "ipc" | "vmm"
std::string_view PrefixHostMemoryName(PrefixHostMemory memory);  // "pinned" | "plain"
std::string_view LogLevelName(LogLevel level);  // "trace" ... "off"

// Admission (core/admission.h, server/device/device_budget.h): the budget and how it is shared.
struct AdmissionConfig {
  // Host backend: bytes of memory the daemon may hand out (admission budget).
  uint64_t budget_bytes = uint64_t{8} << 30;
  // CUDA backend: budget = floor(fraction x the device's TOTAL memory) - cuda_reserve_bytes
  // (core/admission.h UsableCudaBudget); fraction in (0, 1].
  double cuda_memory_fraction = 0.9;
  // CUDA backend: bytes left free for the driver and other processes, taken off the budget.
  uint64_t cuda_reserve_bytes = uint64_t{1} << 30;
  // Percent of the admission budget one engine's reservations + sessions may hold.
  uint32_t max_engine_budget_share = 100;
  // Arenas (sessions, reservations, prefix storage) the daemon holds at once; each is a mapping
  // under the kernel's vm.max_map_count. 0 = derived at start: 3/4 of vm.max_map_count
  // (EffectiveMaxArenas).
  uint64_t max_arenas = 0;
  // Arenas one engine may hold of those (sessions, its reservations), so that no engine takes
  // every arena. 0 = half of the arena limit in force (EffectiveMaxEngineArenas).
  uint64_t max_engine_arenas = 0;
  // Percent of one core's time the daemon may spend in one engine's session operations
  // (server/session/engine_time_shares.h), with 2 s of it banked for bursts; past it the
  // engine's calls are RESOURCE_EXHAUSTED until it has earned time back. 0 = no bound.
  uint32_t max_engine_cpu_percent = 100;
};

// The three Unix sockets (server/edge/served_socket.h, server/edge/arena_handoff.h) and what one
// socket serves at once.
struct SocketsConfig {
  // Unix socket path; "{device}" is replaced by `device` (see SocketPath()). Absolute.
  std::string socket_path = "/run/memra-kv/gpu{device}.sock";
  // Permission bits of the socket (octal). 0660: the daemon's group may connect.
  uint32_t socket_mode = 0660;
  // Group owning the socket; empty = the daemon's primary group. Must be one of the daemon's
  // groups (no CAP_CHOWN).
  std::string socket_group;
  // The operators' Unix socket (KvAdmin and KvPrefixCache in full: drain, undrain, eviction,
  // plan import with registration, the lists of sessions, engines and prefixes); the engine
  // socket refuses those calls (PERMISSION_DENIED naming this path). Empty = beside the engine
  // socket: its path with ".sock" replaced by ".admin.sock" (AdminSocketPath()). "{device}" is
  // replaced by `device`.
  std::string admin_socket_path;
  // Permission bits of the admin socket (octal). 0600: only the daemon's user (and root).
  uint32_t admin_socket_mode = 0600;
  // Group owning the admin socket; empty = the daemon's primary group. Must be one of the
  // daemon's groups (no CAP_CHOWN).
  std::string admin_socket_group;
  // The engines' handoff socket (server/edge/arena_handoff.h): an engine connects here before
  // Attach, gets the ticket that binds its peer credentials (SO_PEERCRED) to its lease, and
  // trades its sessions' arena handles for memfd descriptors (SCM_RIGHTS). Same mode and group
  // as the engine socket. Empty = socket_path with ".sock" replaced by ".handoff.sock"
  // (HandoffSocketPath()). "{device}" is replaced by `device`.
  std::string handoff_socket_path;
  // Milliseconds a gRPC connection with no call may stay open before the daemon closes it.
  uint64_t connection_idle_timeout_ms = 300'000;
  // KvPrefixCache.SubscribeEvents streams open at once, per socket and per engine (each holds a
  // daemon thread while open; a stream ends with the lease that opened it).
  uint64_t max_event_streams = 64;
  uint64_t max_engine_event_streams = 4;
};

// The session layer (server/session/): what one engine may hold, and what happens at its death.
struct SessionsConfig {
  // Layers (trunk + MTP) a model plan may have, everywhere a plan arrives. The largest real
  // models have ~130; the maximum keeps a CreateSession reply (the layout) under the client's
  // 4 MiB receive limit.
  uint32_t max_plan_layers = 4096;
  // Model plans one engine may have registered in the daemon's table (of 1,024) at once.
  uint64_t max_engine_plans = 64;
  // Sessions one engine may hold at once.
  uint64_t max_engine_sessions = 4096;
  // Bytes of released session arenas kept per engine for its next sessions of the same size
  // (server/session/arena_pool.h); evictable by admission, freed when the engine's lease ends. 0 =
  // no pool: every CreateSession makes (and every engine maps) a new arena.
  uint64_t arena_pool_engine_bytes = uint64_t{4} << 30;
  // Capture a dying engine's sessions into the prefix cache before freeing them.
  bool prefix_capture_on_engine_death = true;
};

// Prometheus metrics (server/metrics/).
struct MetricsConfig {
  // Prometheus endpoint as host:port ("[v6addr]:port" for IPv6); empty disables metrics.
  std::string metrics_address = "127.0.0.1:9464";
  // Per-RPC call counts and latency histograms (memra_rpc_*). They need a gRPC server
  // interceptor on every call, which costs ~25 us of CPU per call on a 2-vCPU VM (more than a
  // whole one-session Step's own work: bench/README.md), so they are off unless asked for.
  bool rpc_metrics = false;
};

// Every daemon setting, with its default. Plain data: copy freely.
//
// Sections: each part's settings are one member, and where a part takes an options struct the
// section IS that struct (leases, connections, prefix, prefix_remote, block_store), so the
// daemon hands it over as it is. The sections the config owns name their fields as the keys.
// Key names in the file and on the command line stay flat (config.cc's table maps each to its
// field): prefix_cache_budget_bytes is prefix.budget_bytes, lease_timeout_ms is
// leases.timeout, prefix_remote_redis_nodes is prefix_remote.cluster.seed_nodes (parsed).
struct DaemonConfig {
  // Device backend: "host" (sealed memfds handed to engines as descriptors; the default and what
  // tests use) or "cuda".
  Backend backend = Backend::kHost;
  // GPU index this instance serves (the systemd instance name, %i).
  uint32_t device = 0;
  // CUDA backend: "ipc" (cudaIpcGetMemHandle) or "vmm" (cuMemCreate, shared as descriptors;
  // needed for KV to survive a daemon restart on a GPU).
  CudaExport cuda_export = CudaExport::kIpc;
  LogLevel log_level = LogLevel::kInfo;
  // Milliseconds live sessions may run after SIGTERM before everything is freed. The unit's
  // TimeoutStopSec (45s) must cover it, or the daemon must extend the stop timeout.
  uint64_t drain_grace_ms = 30000;
  // Where the prefix cache's host tier (prefix.host_tier_bytes) gets its memory: pinned on cuda
  // (GPU -> pinned host -> disk); on the host backend the device tier already is host memory,
  // so "plain" turns the tier on anyway (tests, trying the chain) at one more host copy.
  PrefixHostMemory prefix_host_tier_memory = PrefixHostMemory::kPinned;
  // Send systemd watchdog keep-alives when the service manager asks for them (WATCHDOG_USEC).
  bool watchdog = true;
  // Under a service manager (systemd, memra-kv-supervise): keep session arenas and the restart
  // journal in its fd store, and re-adopt them after a restart (server/restart/restart_state.h).
  bool keep_kv_across_restarts = true;
  // Offer attached engines a shared-memory step channel (docs/step-channel.md): Step entries
  // addressed by slot as records in a ring, served by one daemon thread. false: Step over gRPC
  // only (Attached.step_channel tells the engine).
  bool step_channel = true;
  // Named prefix-cache scopes and who may attach in them (server/session/cache_scopes.h):
  // "name:uid,uid,@group; name2:@group2". Empty: every engine's scope is its uid's.
  std::string cache_scope_allow;
  AdmissionConfig admission;
  // lease_timeout_ms (timeout: without a heartbeat before its lease expires), lease_grace_ms
  // (grace: after a lease ends before its sessions are reclaimed), reservation_ttl_ms
  // (reservation_ttl: an admission reservation held without a session), max_attached_engines
  // (max_engines: engines attached at once, each an Attach stream).
  LeaseSettings leases{.timeout = absl::Milliseconds(10000),
                       .grace = absl::Milliseconds(2000),
                       .reservation_ttl = absl::Milliseconds(30000),
                       .max_engines = 256};
  SocketsConfig sockets;
  // max_connections, max_connections_per_uid: gRPC connections each socket accepts at once, in
  // all and from one uid (SO_PEERCRED); past them a new connection is closed at once.
  ConnectionGate::Limits connections{.max_connections = 512, .max_connections_per_uid = 256};
  SessionsConfig sessions;
  // The prefix cache: prefix_cache_budget_bytes (budget_bytes; 0 disables the prefix cache),
  // prefix_block_tokens, prefix_verify_checksums, prefix_copy_threads, prefix_slab_bytes, the
  // host tier (prefix_host_tier_bytes; its memory is prefix_host_tier_memory), the disk tier
  // (prefix_disk_dir, prefix_disk_bytes) and how long it waits for the remote tier
  // (prefix_remote_lookup_timeout_ms, prefix_remote_fetch_timeout_ms). The daemon sets its
  // epoch.
  PrefixCacheOptions prefix;
  // The prefix cache's remote tier in a Redis Cluster (docs/remote-tier.md); none while
  // cluster.seed_nodes is empty: prefix_remote_redis_nodes, _user, _password_file (the
  // password is never a config value: it would be logged and rendered), _tls (true is refused:
  // Debian's hiredis 0.14 has no TLS), _connect_timeout_ms, _timeout_ms,
  // prefix_remote_queue_bytes (a capture that would pass it drops its remote write, never
  // waits), prefix_remote_ttl_s (0 = none: the cluster's maxmemory policy evicts).
  RemoteTierOptions prefix_remote;
  // The block store (server/store/block_store.h): block_store_engine_bytes (engine_bytes),
  // block_store_max_registrations and block_store_max_pins (per engine), block_store_max_offers
  // and block_store_max_mapped_buffers (daemon-wide). The daemon derives the per-engine shares.
  BlockStoreLimits block_store;
  MetricsConfig metrics;

  // socket_path with "{device}" replaced.
  std::string SocketPath() const;
  // admin_socket_path with "{device}" replaced, or (empty) derived from SocketPath().
  std::string AdminSocketPath() const;
  // handoff_socket_path with "{device}" replaced, or (empty) derived from SocketPath().
  std::string HandoffSocketPath() const;

  // Equal in every key (fields no key sets, such as prefix.epoch, are not compared).
  bool operator==(const DaemonConfig& other) const;
};

// The largest max_plan_layers accepted: a CreateSession reply lists every plane of every layer,
// and at this many layers of the widest kind it stays under gRPC's default 4 MiB receive limit
// (tests/service/limits_test.cc checks the worst case), so no reply can be refused after its
// session was created and charged.
inline constexpr uint32_t kMaxPlanLayersAccepted = 16384;

// vm.max_map_count as the kernel ships it, when `max_map_count_path` cannot be read.
inline constexpr uint64_t kDefaultMaxMapCount = 65530;
// The arena limit in force: max_arenas when set, else 3/4 of the kernel's vm.max_map_count read
// from `max_map_count_path` (the rest is left for the daemon's own mappings: libraries, thread
// stacks, heap).
uint64_t EffectiveMaxArenas(const DaemonConfig& config,
                            const std::string& max_map_count_path = "/proc/sys/vm/max_map_count");

// The per-engine arena limit in force: max_engine_arenas when set, else half of `max_arenas`
// (the daemon-wide limit in force), at least 1.
uint64_t EffectiveMaxEngineArenas(const DaemonConfig& config, uint64_t max_arenas);

// Descriptors the daemon keeps for itself (libraries, listeners, eventfds, logs, metrics) before
// it shares out its RLIMIT_NOFILE.
inline constexpr uint64_t kReservedDescriptors = 128;
// What the daemon's own RLIMIT_NOFILE (read at start) allows, so that running out of
// descriptors is a limit's clean refusal, not EMFILE somewhere. Of what is left after
// kReservedDescriptors: half for arenas (a memfd each on the host backend), a sixteenth for each
// socket's gRPC connections (two sockets, two descriptors each: a quarter in all), three
// sixteenths for handoff connections (each its socket and the descriptors it sent ahead of its
// offers), a thirty-second for step channels (an eventfd each) and a thirty-second for block
// store offers (a memfd each until registered). Descriptors in flight (answers an engine has not
// read) count against the daemon's uid in a pool of their own, as large as RLIMIT_NOFILE: all of
// it less the reserve is the handoff connections'.
struct DescriptorShares {
  uint64_t open_files = 0;           // RLIMIT_NOFILE (soft)
  uint64_t arenas = 0;               // caps max_arenas
  uint64_t connections = 0;          // caps max_connections (per socket)
  uint64_t handoff_descriptors = 0;  // open: handoff connections x what each may hold open
  uint64_t in_flight = 0;            // in flight: handoff connections x unread answers
  uint64_t step_channels = 0;        // open step channels, daemon-wide
  uint64_t block_store_offers = 0;   // caps block_store_max_offers
};
DescriptorShares ShareDescriptors(uint64_t open_files);

// One configuration key, for help text and flag definitions.
struct ConfigKeyInfo {
  std::string_view name;
  std::string_view help;  // what it sets and its unit
  std::string accepted;   // accepted values, e.g. "100 to 3600000"
  bool reloadable;        // SIGHUP applies it without a restart
};
// In file order.
std::vector<ConfigKeyInfo> ConfigKeys();

// Parses TOML text: top-level `key = value` lines only. `source_name` (usually the path) is used
// in messages as "<source_name>:<line>". Unknown keys, wrong types and out-of-range values are
// INVALID_ARGUMENT; all of them in the text are reported, in line order. Keys absent from the
// text keep their defaults. Does not run ValidateConfig (overrides may still change fields).
absl::StatusOr<DaemonConfig> ParseConfig(std::string_view text, std::string_view source_name);

// Reads and parses `path`. NOT_FOUND / PERMISSION_DENIED when it cannot be read.
absl::StatusOr<DaemonConfig> LoadConfigFile(const std::string& path);

// Sets one key from command-line text, with the same validation as the file. Numbers, bools and
// modes are given as text ("64GiB", "true", "0660"). Unknown key or bad value: INVALID_ARGUMENT.
absl::Status ApplyOverride(DaemonConfig& config, std::string_view key, std::string_view value);

// Checks between fields that no single key can check (resolved socket path length, prefix budget
// within the host budget). INVALID_ARGUMENT naming the keys and values.
absl::Status ValidateConfig(const DaemonConfig& config);

struct ConfigOverride {
  std::string key;
  std::string value;
};

// Command-line arguments split into configuration overrides and the rest, so every key is a flag
// without a flag definition per key.
struct SplitFlags {
  std::vector<ConfigOverride> overrides;  // in command-line order
  std::vector<std::string> rest;          // argv[0] and everything else (--config, --help, ...)
};
// `--<key>=<value>` and `--<key> <value>` (also with a single '-') for a configuration key become
// overrides; a bool key may stand alone (`--watchdog` = true). Arguments after "--" are left
// alone. Values are not checked here (ApplyOverride does); a key missing its value is
// INVALID_ARGUMENT naming it.
absl::StatusOr<SplitFlags> SplitConfigFlags(int argc, const char* const* argv);

// Exit status for a configuration error (EX_CONFIG from sysexits.h). memra-kvd@.service has
// RestartPreventExitStatus=78: a bad config is reported once, not restarted in a loop.
inline constexpr int kConfigErrorExitCode = 78;

// The daemon's one entry point: defaults, then the file at `path` (skipped when empty), then each
// override in order, then ValidateConfig.
absl::StatusOr<DaemonConfig> LoadDaemonConfig(const std::string& path,
                                              absl::Span<const ConfigOverride> overrides);

// What a SIGHUP can do with a re-read configuration.
struct ReloadOutcome {
  // `running` with every reloadable key taken from the re-read configuration.
  DaemonConfig applied;
  // Reloadable keys whose value changed (now in `applied`), in file order.
  std::vector<std::string> applied_keys;
  // Keys that changed in the file but need a restart; `applied` keeps the running value. The
  // daemon logs "could not change <key> without a restart" for each.
  std::vector<std::string> not_reloadable_keys;
};
// Live-changeable: log_level, budget_bytes, cuda_memory_fraction, cuda_reserve_bytes,
// lease_timeout_ms, reservation_ttl_ms, prefix_cache_budget_bytes, drain_grace_ms.
ReloadOutcome PlanReload(const DaemonConfig& running, const DaemonConfig& reread);

// A complete, commented configuration file that ParseConfig reads back to `config`.
// deploy/memra-kv.conf.example is RenderConfig(DaemonConfig{}) (checked by config_test).
std::string RenderConfig(const DaemonConfig& config);

}  // namespace memra

#endif  // MEMRA_SERVER_CONFIG_H_
