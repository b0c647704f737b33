#include "server/daemon.h"

#include <sys/random.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/container/flat_hash_set.h"
#include "absl/time/time.h"
#include "common/codec.h"
#include "common/daemon_restart.h"
#include "common/errors.h"
#include "core/status_macros.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/resource_quota.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "server/device/pinned_host_memory.h"
#include "server/store/remote/redis_cluster.h"
#include "server/store/remote/remote_tier.h"
#include "server/base/unix_socket.h"
#include "spdlog/spdlog.h"

namespace memra {
namespace {

namespace pb = ::memra::kv::v1;

// The admission budget the configuration and the device allow, and how it was derived.
// Host: budget_bytes, capped at the capacity the backend was created with (it cannot grow).
// CUDA: cuda_memory_fraction of the device's TOTAL memory minus cuda_reserve_bytes.
std::pair<uint64_t, std::string> BudgetFor(const DaemonConfig& config, DeviceBackend& backend) {
  const DeviceInfo info = backend.Info();
  if (config.backend == Backend::kCuda) {
    return {UsableCudaBudget(info.total_bytes, config.cuda_memory_fraction,
                             config.cuda_reserve_bytes),
            absl::StrCat("cuda: ", config.cuda_memory_fraction, " x ", info.total_bytes,
                         " total - ", config.cuda_reserve_bytes, " reserve")};
  }
  const uint64_t bytes = std::min(UsableHostBudget(config.budget_bytes), info.total_bytes);
  if (bytes < config.budget_bytes) {
    return {bytes, absl::StrCat("host: budget_bytes ", config.budget_bytes,
                                " capped at the backend's start-up capacity ", info.total_bytes)};
  }
  return {bytes, absl::StrCat("host: budget_bytes ", bytes)};
}

// The daemon's own RLIMIT_NOFILE (soft; unlimited or unreadable: no cap), shared out.
DescriptorShares OwnDescriptorShares() {
  rlimit open_files{};
  uint64_t limit = UINT64_MAX;
  if (getrlimit(RLIMIT_NOFILE, &open_files) == 0 && open_files.rlim_cur != RLIM_INFINITY) {
    limit = open_files.rlim_cur;
  }
  return ShareDescriptors(limit);
}

// Handoff connections the descriptor shares hold, each at its most (open: socket and pending
// descriptors; in flight: unread answers).
uint64_t HandoffConnectionsFor(const DescriptorShares& shares) {
  return std::max<uint64_t>(
      1, std::min(shares.handoff_descriptors / ArenaHandoff::kOpenDescriptorsPerConnection,
                  shares.in_flight / ArenaHandoff::kInFlightDescriptorsPerConnection));
}

// How the handoff connection limit was derived, for its refusal and the start-up log.
std::string HandoffConnectionsSource(const DaemonConfig& config, const DescriptorShares& shares) {
  return absl::StrCat("max_attached_engines ", config.max_attached_engines, " or RLIMIT_NOFILE ",
                      shares.open_files, "'s shares: ", shares.handoff_descriptors,
                      " descriptors open, ", ArenaHandoff::kOpenDescriptorsPerConnection,
                      " per connection; ", shares.in_flight, " in flight, ",
                      ArenaHandoff::kInFlightDescriptorsPerConnection, " per connection");
}

// Caps max_arenas, max_connections and block_store_max_offers by the daemon's own RLIMIT_NOFILE
// (ShareDescriptors), and says so with the caps the daemon applies to its handoff connections
// and step channels (Daemon::HandoffOptions, StepChannelOptions).
void LimitByDescriptors(DaemonConfig& config) {
  const DescriptorShares shares = OwnDescriptorShares();
  const uint64_t arenas = EffectiveMaxArenas(config);
  config.max_arenas = std::min(arenas, shares.arenas);
  config.max_connections = std::min(config.max_connections, shares.connections);
  config.max_connections_per_uid = std::min(config.max_connections_per_uid, config.max_connections);
  config.block_store_max_offers = std::min(config.block_store_max_offers, shares.block_store_offers);
  spdlog::info(
      "descriptors: RLIMIT_NOFILE {} ({} kept for the daemon): at most {} arenas (max_arenas or "
      "vm.max_map_count: {}; descriptors: {}), {} gRPC connections per socket and {} per uid "
      "(max_connections or descriptors: {}), {} handoff connections ({}), {} step channels "
      "(max_attached_engines or descriptors: {}), {} block store offers (block_store_max_offers "
      "or descriptors: {})",
      shares.open_files, kReservedDescriptors, config.max_arenas, arenas, shares.arenas,
      config.max_connections, config.max_connections_per_uid, shares.connections,
      std::min(config.max_attached_engines, HandoffConnectionsFor(shares)),
      HandoffConnectionsSource(config, shares),
      std::min(config.max_attached_engines, shares.step_channels), shares.step_channels,
      config.block_store_max_offers, shares.block_store_offers);
}

// SubscribeEvents streams of one socket: per engine on the engine socket, and all together.
ConcurrencyLimit::Limits EventStreamLimits(const DaemonConfig& config, bool per_engine) {
  return {.total = static_cast<size_t>(config.max_event_streams),
          .total_name = "max_event_streams, per socket",
          .per_key = per_engine ? static_cast<size_t>(config.max_engine_event_streams) : 0,
          .per_key_name = "max_engine_event_streams"};
}

// Leaves server reflection out of one server. Linking gRPC's reflection library registers its
// plugin for every server; its streams are synchronous (a thread each, opened by any client),
// and it is the operators' tool (grpcurl), so only the admin socket keeps it.
class WithoutReflection final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    const std::string reflection = grpc::reflection::ProtoServerReflectionPlugin().name();
    std::erase_if(*plugins, [&](const std::unique_ptr<grpc::ServerBuilderPlugin>& plugin) {
      return plugin->name() == reflection;
    });
  }
};

BlockStoreLimits BlockStoreLimitsOf(const DaemonConfig& config) {
  BlockStoreLimits limits;
  limits.engine_bytes = config.block_store_engine_bytes;
  limits.registrations_per_engine = static_cast<size_t>(config.block_store_max_registrations);
  limits.pins_per_engine = static_cast<size_t>(config.block_store_max_pins);
  // One engine may keep at most a quarter of the device tier's budget from eviction.
  limits.pinned_bytes_per_engine = config.prefix_cache_budget_bytes / 4;
  limits.max_offers = static_cast<size_t>(config.block_store_max_offers);
  limits.max_mapped_buffers = static_cast<size_t>(config.block_store_max_mapped_buffers);
  // Daemon-wide caps split fairly (docs/security-model.md#resources): one engine may map a
  // quarter of the buffers, and hold half of the offers (at most a registration's worth).
  limits.mapped_buffers_per_engine =
      std::max<size_t>(1, limits.max_mapped_buffers / kBlockStoreEngineShareDivisor);
  limits.offers_per_engine =
      std::clamp<size_t>(limits.max_offers / 2, 1, limits.offers_per_engine);
  return limits;
}

LeaseSettings LeaseSettingsOf(const DaemonConfig& config) {
  return LeaseSettings{absl::Milliseconds(config.lease_timeout_ms),
                       absl::Milliseconds(config.lease_grace_ms),
                       absl::Milliseconds(config.reservation_ttl_ms),
                       static_cast<size_t>(config.max_attached_engines)};
}

absl::StatusOr<uint64_t> RandomEpoch() {
  uint64_t epoch = 0;
  while (epoch == 0) {
    if (getrandom(&epoch, sizeof(epoch), 0) != sizeof(epoch)) {
      if (errno == EINTR) continue;
      return PosixError("getrandom", errno);
    }
  }
  return epoch;
}

// The prefix cache the configuration asks for (null when prefix_cache_budget_bytes is 0). Its
// device storage is charged to the one admission budget; admissions demote (with a tier below)
// or evict LRU entries for room. A host tier (prefix_host_tier_bytes) sits between the device
// and the disk: pinned host memory on cuda, plain memory when asked for. A disk tier that
// cannot be set up (prefix_disk_dir unusable, too little free space, no io_uring) refuses the
// start: the operator asked for it. So does a remote tier whose options cannot work (a password
// file that cannot be read); a cluster that does not answer does not: the daemon serves without
// it, reports it down and reconnects (server/store/remote/remote_tier.h).
absl::StatusOr<std::unique_ptr<PrefixCache>> MakePrefixCache(const DaemonConfig& config,
                                                             DeviceBackend* backend,
                                                             DeviceBudget* budget,
                                                             uint64_t epoch) {
  if (config.prefix_cache_budget_bytes == 0) return nullptr;
  PrefixCacheOptions options;
  options.budget_bytes = config.prefix_cache_budget_bytes;
  options.block_tokens = config.prefix_block_tokens;
  options.verify_checksums = config.prefix_verify_checksums;
  options.copy_threads = static_cast<uint32_t>(config.prefix_copy_threads);
  options.slab_bytes = config.prefix_slab_bytes;
  options.disk_dir = config.prefix_disk_dir;
  options.disk_bytes = config.prefix_disk_bytes;
  if (!config.prefix_remote_redis_nodes.empty()) {
    RemoteTierOptions remote;
    ASSIGN_OR_RETURN(remote.cluster.seed_nodes,
                     ParseRedisNodeList(config.prefix_remote_redis_nodes));
    remote.cluster.user = config.prefix_remote_redis_user;
    remote.cluster.password_file = config.prefix_remote_redis_password_file;
    remote.cluster.tls = config.prefix_remote_redis_tls;
    remote.cluster.connect_timeout =
        absl::Milliseconds(config.prefix_remote_redis_connect_timeout_ms);
    remote.cluster.command_timeout = absl::Milliseconds(config.prefix_remote_redis_timeout_ms);
    remote.queue_bytes = config.prefix_remote_queue_bytes;
    remote.ttl = absl::Seconds(config.prefix_remote_ttl_s);
    options.remote = std::move(remote);
    options.remote_lookup_timeout = absl::Milliseconds(config.prefix_remote_lookup_timeout_ms);
    options.remote_fetch_timeout = absl::Milliseconds(config.prefix_remote_fetch_timeout_ms);
  }
  options.host_tier_bytes = config.prefix_host_tier_bytes;
  std::unique_ptr<HostMemoryProvider> host_memory;
  if (config.prefix_host_tier_bytes > 0) {
    if (config.prefix_host_tier_memory == PrefixHostMemory::kPinned) {
      ASSIGN_OR_RETURN(host_memory, NewCudaPinnedHostMemory());
    } else {
      host_memory = NewPlainHostMemory();
    }
  }
  // The daemon's random epoch: a router tells a restarted daemon from a reconnect (0 means
  // "any epoch" to a subscriber, so it is never used).
  options.epoch = epoch == 0 ? 1 : epoch;
  ASSIGN_OR_RETURN(std::unique_ptr<PrefixCache> cache,
                   PrefixCache::Create(options, backend, budget, std::move(host_memory)));
  cache->InstallEvictor(*budget);
  return cache;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Create(DaemonConfig config,
                                                       std::unique_ptr<DeviceBackend> backend,
                                                       Clock* clock,
                                                       std::vector<ListenedFd> passed) {
  if (backend == nullptr || clock == nullptr) {
    return absl::InvalidArgumentError("Daemon::Create needs a backend and a clock");
  }
  RETURN_IF_ERROR(ValidateConfig(config));
  LimitByDescriptors(config);
  std::optional<PreviousDaemon> previous = ReadPreviousDaemon(std::move(passed));
  ASSIGN_OR_RETURN(uint64_t epoch, RandomEpoch());
  ASSIGN_OR_RETURN(CacheScopes scopes, CacheScopes::Create(config.cache_scope_allow));
  // "Bumped": a router tells the restart from a reconnect; 0 is never an epoch.
  if (previous.has_value()) epoch = previous->epoch + 1 == 0 ? 1 : previous->epoch + 1;
  std::unique_ptr<RestartState> restart_state;
  std::string survival_off;
  if (!config.keep_kv_across_restarts) {
    survival_off = "keep_kv_across_restarts = false";
  } else if (!UnderServiceManager()) {
    survival_off = "no service manager ($NOTIFY_SOCKET unset): run under systemd or "
                   "memra-kv-supervise";
  } else if (config.backend == Backend::kCuda && config.cuda_export == CudaExport::kIpc) {
    // Legacy CUDA IPC memory dies with the exporting process: nothing to keep.
    spdlog::warn("KV does not survive a restart on the {} backend with CUDA IPC exports",
                 backend->Name());
    survival_off = "cuda_export = ipc: that memory dies with the daemon";
  } else {
    // Every session holds an arena and every known engine a slot: max_arenas + engines bounds
    // the records (the file is sparse: unused slots cost no memory).
    const uint64_t slots = std::min<uint64_t>(
        EffectiveMaxArenas(config) + config.max_attached_engines + 1, RestartJournal::kMaxSlots);
    absl::StatusOr<std::unique_ptr<RestartState>> created = RestartState::Create(
        slots, epoch, previous.has_value() ? previous->generation + 1 : 1, backend.get());
    if (created.ok()) {
      restart_state = *std::move(created);
    } else {  // serve anyway: the cache matters more than surviving the next restart
      spdlog::error("KV will not survive a restart: {}", created.status().ToString());
      survival_off =
          absl::StrCat("the restart journal could not be made: ", created.status().message());
    }
  }
  if (previous.has_value() && restart_state == nullptr) {
    // Nothing would journal what re-adopted sessions do from now on, so a later restart would
    // bring this start's records back over changed memory: the kept state is dropped instead.
    spdlog::warn("restart: the previous daemon's {} sessions are not re-adopted: this daemon "
                 "keeps no restart journal (keep_kv_across_restarts, or the journal failed)",
                 previous->sessions.size());
    std::vector<std::string> names = previous->leftovers;
    names.push_back(previous->journal_name);
    for (const auto& [name, fd] : previous->arenas) names.push_back(name);
    for (const auto& [name, plan] : previous->plans) names.push_back(name);
    for (const std::string& name : names) {
      if (!name.empty()) (void)SdNotify(absl::StrCat("FDSTOREREMOVE=1\nFDNAME=", name));
    }
    previous.reset();
  }
  auto [budget_bytes, rule] = BudgetFor(config, *backend);
  const uint64_t max_arenas = EffectiveMaxArenas(config);
  const AdmissionLimits limits{.max_arenas = max_arenas,
                               .owner_share_percent = config.max_engine_budget_share,
                               .max_owner_arenas = EffectiveMaxEngineArenas(config, max_arenas)};
  spdlog::info(
      "admission budget {} bytes ({}); at most {} arenas ({} per engine), {}% of the budget per "
      "engine",
      budget_bytes, rule, limits.max_arenas, limits.max_owner_arenas, limits.owner_share_percent);
  auto budget = std::make_unique<DeviceBudget>(budget_bytes, rule, limits);
  absl::StatusOr<std::unique_ptr<PrefixCache>> prefix_cache =
      MakePrefixCache(config, backend.get(), budget.get(), epoch);
  if (!prefix_cache.ok()) {
    return absl::Status(prefix_cache.status().code(),
                        absl::StrCat("prefix cache: ", prefix_cache.status().message()));
  }
  std::unique_ptr<Daemon> daemon(
      new Daemon(std::move(config), std::move(backend), clock,
                 std::move(budget), epoch, std::move(scopes), std::move(restart_state),
                 *std::move(prefix_cache)));
  daemon->survival_off_ = std::move(survival_off);
  if (previous.has_value()) {
    daemon->Readopt(*std::move(previous));
  } else if (daemon->restart_state_ != nullptr) {
    if (absl::Status published = daemon->restart_state_->Publish(); !published.ok()) {
      spdlog::error("restart journal not kept: {}", published.ToString());
    }
  }
  return daemon;
}

void Daemon::Readopt(PreviousDaemon previous) {
  const absl::Time start = absl::Now();
  const DaemonRestart restart{previous.epoch, epoch_};
  for (const std::string& problem : previous.problems) {
    spdlog::warn("restart: {}", problem);
  }
  if (restart_state_ != nullptr) restart_state_->CarrySessionSlotLimit(previous.session_slot_limit);
  // Plans, by the fingerprint the previous daemon recorded.
  absl::flat_hash_map<std::string, std::shared_ptr<const ModelPlan>> plans;
  absl::flat_hash_map<std::string, std::string> plan_names;
  for (auto& [name, plan] : previous.plans) {
    absl::StatusOr<PlanFingerprint> fingerprint = plans_.Register(plan);
    if (!fingerprint.ok()) {
      spdlog::warn("restart: kept plan {} not registered: {}", name,
                   fingerprint.status().ToString());
      continue;
    }
    absl::StatusOr<std::shared_ptr<const ModelPlan>> found = plans_.Find(*fingerprint);
    if (!found.ok()) continue;
    const std::string bytes = FingerprintToBytes(*fingerprint);
    plans[bytes] = *found;
    plan_names[bytes] = name;
  }
  absl::flat_hash_map<uint64_t, std::string> engines;  // id -> its cache scope
  for (const auto& engine : previous.engines) {
    leases_.Readopt(EngineId{engine.id()}, engine.token(),
                    EngineIdentity{.name = engine.name(),
                                   .peer = PeerCredentials{.uid = engine.uid(),
                                                           .gid = engine.gid(),
                                                           .pid = static_cast<pid_t>(engine.pid())},
                                   .cache_scope = engine.cache_scope()});
    engines.emplace(engine.id(), engine.cache_scope());
  }
  leases_.RaiseNextEngineId(previous.next_engine_id);
  sessions_.RaiseNextSessionId(previous.next_session_id);
  absl::flat_hash_map<uint64_t, std::string> not_readopted;
  for (const auto& record : previous.sessions) {
    auto plan = plans.find(record.plan_fingerprint());
    auto arena_fd = previous.arenas.find(record.arena_fd_name());
    std::string reason;
    if (!record.not_recoverable().empty()) {
      reason = record.not_recoverable();
    } else if (!engines.contains(record.owner())) {
      reason = absl::StrCat("its engine ", record.owner(), " was not in the journal");
    } else if (plan == plans.end()) {
      reason = "its model plan was not kept (or its fingerprint changed with the configuration)";
    } else if (arena_fd == previous.arenas.end()) {
      reason = absl::StrCat("its arena's memory (", record.arena_fd_name(), ") was not kept");
    }
    if (reason.empty()) {
      absl::StatusOr<ArenaId> arena = backend_->AdoptArenaFd(
          arena_fd->second.release(), record.arena_bytes(), record.arena_handle());
      previous.arenas.erase(arena_fd);
      if (!arena.ok()) {
        reason = absl::StrCat("its arena could not be mapped again: ", arena.status().message());
      } else {
        DaemonSession::Params params = sessions_.BaseParams();
        params.id = SessionId{record.id()};
        params.owner = EngineId{record.owner()};
        params.slot = record.slot();
        params.cache_scope = engines[record.owner()];
        params.token = record.token();
        params.model = plan->second;
        params.fingerprint = record.plan_fingerprint();
        params.shape.capacity = record.capacity();
        params.shape.layer_lo = record.layer_lo();
        if (record.has_layer_hi()) params.shape.layer_hi = record.layer_hi();
        params.shape.tp_ranks = record.tp_ranks();
        params.shape.spec_snapshot = record.spec_snapshot();
        const CommittedRecord committed{
            .committed_len = record.committed_len(),
            .next_generation = record.next_generation(),
            .ring_bases = {record.ring_bases().begin(), record.ring_bases().end()},
            .tainted = record.tainted()};
        if (restart_state_ != nullptr) {
          restart_state_->NameAdoptedArena(*arena, record.arena_fd_name());
          restart_state_->NameAdoptedPlan(record.plan_fingerprint(), plan_names[plan->first]);
        }
        absl::StatusOr<std::unique_ptr<DaemonSession>> session =
            DaemonSession::Adopt(std::move(params), backend_.get(), budget_.get(), *arena,
                                 record.arena_bytes(), record.layout_version(), committed);
        absl::Status filed =
            session.ok() ? sessions_.Readopt(*std::move(session), previous.session_slot_limit)
                         : session.status();
        if (!filed.ok()) {
          reason = std::string(filed.message());
          if (restart_state_ != nullptr) restart_state_->ArenaFreed(*arena);
          (void)backend_->FreeArena(*arena);
        } else {
          (void)plans_.Register(*plan->second, record.owner());  // counts for its engine again
          ++readopted_.sessions;
          readopted_.bytes += record.arena_bytes();
          continue;
        }
      }
    }
    spdlog::warn("restart: session {} of engine {} not re-adopted: {}", record.id(),
                 record.owner(), reason);
    not_readopted[record.id()] = std::move(reason);
  }
  const size_t lost_now = not_readopted.size();
  // Why sessions were not re-adopted outlives this daemon: the next one tells their engines too
  // (issue 26), until the engine is reclaimed. Earlier restarts' reasons come along, naming the
  // restart they were lost in.
  for (const auto& lost : previous.lost_sessions) {
    if (!engines.contains(lost.owner()) || not_readopted.contains(lost.id())) continue;
    not_readopted[lost.id()] =
        absl::StrCat(lost.reason(), " (at the restart from epoch ", lost.lost_from_epoch(),
                     " to ", lost.lost_at_epoch(), ")");
    if (restart_state_ != nullptr) restart_state_->SessionLost(lost);
  }
  if (restart_state_ != nullptr) {
    for (const auto& record : previous.sessions) {
      auto lost = not_readopted.find(record.id());
      if (lost == not_readopted.end() || !engines.contains(record.owner())) continue;
      memra::kvd::journal::LostSessionRecord journaled;
      journaled.set_id(record.id());
      journaled.set_owner(record.owner());
      journaled.set_reason(lost->second);
      journaled.set_lost_from_epoch(previous.epoch);
      journaled.set_lost_at_epoch(epoch_);
      restart_state_->SessionLost(journaled);
    }
  }
  readopted_.previous_epoch = previous.epoch;
  readopted_.engines = engines.size();
  readopted_.not_readopted = lost_now;
  readopted_.torn_records = previous.torn_records;
  if (previous.unreadable_records > 0) {
    spdlog::warn("restart: {} journal records could not be read; sessions below id {} that are "
                 "not re-adopted answer the restart error",
                 previous.unreadable_records, previous.next_session_id);
  }
  sessions_.SetRestart(restart, std::move(not_readopted), previous.unreadable_records,
                       previous.next_session_id);
  leases_.SetRestart(restart, {});
  if (restart_state_ != nullptr) {
    // This daemon's journal first, then the previous daemon's leftovers go: a crash in between
    // leaves two journals and the next start takes the newer.
    if (absl::Status published = restart_state_->Publish(); !published.ok()) {
      spdlog::error("restart journal not kept: {}", published.ToString());
    }
    restart_state_->ForgetUnusedPlans();
    restart_state_->Forget(previous.journal_name);
    for (const auto& [name, fd] : previous.arenas) restart_state_->Forget(name);
    for (const std::string& name : previous.leftovers) restart_state_->Forget(name);
  }
  readopted_.took = absl::Now() - start;
  spdlog::info(
      "restart: epoch {} -> {} (generation {}): re-adopted {} engines and {} sessions ({} bytes) "
      "in {} ms; {} sessions not re-adopted, {} torn journal records, {} unused arenas freed",
      previous.epoch, epoch_, previous.generation + 1, readopted_.engines, readopted_.sessions,
      readopted_.bytes, absl::ToDoubleMilliseconds(readopted_.took), readopted_.not_readopted,
      readopted_.torn_records, previous.arenas.size());
}

Daemon::Daemon(DaemonConfig config, std::unique_ptr<DeviceBackend> backend, Clock* clock,
               std::unique_ptr<DeviceBudget> budget, uint64_t epoch, CacheScopes scopes,
               std::unique_ptr<RestartState> restart_state,
               std::unique_ptr<PrefixCache> prefix_cache)
    : backend_(std::move(backend)),
      clock_(clock),
      socket_path_(config.SocketPath()),
      admin_socket_path_(config.AdminSocketPath()),
      start_config_(std::move(config)),
      descriptor_shares_(OwnDescriptorShares()),
      budget_(std::move(budget)),
      epoch_(epoch),
      scopes_(std::move(scopes)),
      started_(clock->Now()),
      restart_state_(std::move(restart_state)),
      plans_(FormatDefaults(), start_config_.max_plan_layers,
             static_cast<size_t>(start_config_.max_engine_plans)),
      leases_(clock_, budget_.get(), LeaseSettingsOf(start_config_), restart_state_.get()),
      prefix_cache_(std::move(prefix_cache)),
      arena_pool_(backend_.get(), budget_.get(), start_config_.arena_pool_engine_bytes),
      time_shares_(EngineTimeShares::LimitsFor(start_config_.max_engine_cpu_percent), clock_),
      sessions_(backend_.get(), budget_.get(), &leases_, &plans_, FormatDefaults(),
                start_config_.prefix_capture_on_engine_death ? prefix_cache_.get() : nullptr,
                start_config_.max_engine_sessions, &arena_pool_, restart_state_.get(),
                &time_shares_),
      block_store_(prefix_cache_.get(), backend_.get(), clock_, BlockStoreLimitsOf(start_config_),
                   [this](uint64_t connection, uint64_t engine) {
                     return handoff_.ServesEngine(connection, engine);
                   },
                   epoch_),
      step_channels_(&sessions_, &leases_, StepChannelOptions()),
      handoff_(HandoffOptions(), LookupArena(),
               [this](uint64_t engine, uint64_t connection, uint64_t bytes, ScopedFd fd) {
                 return block_store_.OfferBuffer(engine, connection, bytes, std::move(fd));
               },
               OpenStepChannel()),
      engine_prefix_service_(prefix_cache_.get(), backend_.get(), FindSession(), FindScope(),
                             ServedSocket{ServedSocket::Audience::kEngines, admin_socket_path_},
                             EventStreamLimits(start_config_, /*per_engine=*/true)),
      operator_prefix_service_(
          prefix_cache_.get(), backend_.get(), FindSession(), FindScope(),
          ServedSocket{ServedSocket::Audience::kOperators, admin_socket_path_},
          EventStreamLimits(start_config_, /*per_engine=*/false)),
      cache_service_(&leases_, &plans_, &sessions_, backend_.get(), &handoff_, &scopes_, epoch_),
      block_store_service_(&block_store_, backend_.get(), FindScope()),
      engine_admin_service_(
          AdminParts(ServedSocket{ServedSocket::Audience::kEngines, admin_socket_path_})),
      operator_admin_service_(
          AdminParts(ServedSocket{ServedSocket::Audience::kOperators, admin_socket_path_})) {
  arena_pool_.InstallEvictor(*budget_);
}

RestartSurvival Daemon::restart_survival() const {
  if (restart_state_ == nullptr) {
    return RestartSurvival{.state = RestartSurvival::State::kOff, .detail = survival_off_};
  }
  if (std::optional<std::string> lost = restart_state_->store_lost(); lost.has_value()) {
    return RestartSurvival{.state = RestartSurvival::State::kLost, .detail = *std::move(lost)};
  }
  const size_t stored = restart_state_->stored_fds();
  return RestartSurvival{
      .state = RestartSurvival::State::kOn,
      .detail = absl::StrCat("journal-", restart_state_->generation(), ": ", stored,
                             stored == 1 ? " descriptor" : " descriptors",
                             " (journal, arenas, plans) in the service manager's fd store")};
}

PrefixService::SessionFinder Daemon::FindSession() {
  return [this](const pb::SessionRef& ref) { return sessions_.Find(SessionCredentialsOf(ref)); };
}

PrefixService::ScopeFinder Daemon::FindScope() {
  return [this](const pb::EngineRef& ref) { return leases_.CacheScope(EngineCredentialsOf(ref)); };
}

ArenaHandoff::Options Daemon::HandoffOptions() const {
  ArenaHandoff::Options options;
  options.path = start_config_.HandoffSocketPath();
  options.group = start_config_.socket_group;
  options.mode = start_config_.socket_mode;
  const uint64_t by_descriptors = HandoffConnectionsFor(descriptor_shares_);
  options.max_connections =
      static_cast<size_t>(std::min(start_config_.max_attached_engines, by_descriptors));
  options.max_connections_source = HandoffConnectionsSource(start_config_, descriptor_shares_);
  // Connections with no engine yet: one uid may hold at most half of them.
  options.max_unbound_per_uid =
      std::min(options.max_unbound_per_uid, std::max<size_t>(1, options.max_connections / 2));
  options.instance = epoch_;
  return options;
}

StepChannels::Options Daemon::StepChannelOptions() const {
  StepChannels::Options options;
  options.max_channels = static_cast<size_t>(
      std::min(start_config_.max_attached_engines, descriptor_shares_.step_channels));
  options.max_channels_source =
      absl::StrCat("max_attached_engines ", start_config_.max_attached_engines, " or RLIMIT_NOFILE ",
                   descriptor_shares_.open_files, "'s share: ", descriptor_shares_.step_channels,
                   ", an eventfd each");
  return options;
}

ArenaHandoff::ArenaLookup Daemon::LookupArena() {
  return [this](uint64_t engine_id,
                const handoff::ArenaRequest& request) -> absl::StatusOr<ArenaFd> {
    // The session token first (NOT_FOUND / PERMISSION_DENIED as on every call), then the owner:
    // a token another engine leaked still opens nothing over this engine's connection.
    ASSIGN_OR_RETURN(std::shared_ptr<DaemonSession> session,
                     sessions_.Find(SessionCredentials{SessionId{request.session_id},
                                                       request.session_token}));
    if (session->owner().value != engine_id) {
      return absl::PermissionDeniedError(absl::StrCat(
          "session ", request.session_id, " belongs to engine ", session->owner().value,
          "; this handoff connection is engine ", engine_id,
          "'s: arenas are handed only to the engine that owns the session"));
    }
    return session->DuplicateArenaFd(request.handle);
  };
}

ArenaHandoff::StepChannelOpener Daemon::OpenStepChannel() {
  if (!start_config_.step_channel) return nullptr;
  return [this](uint64_t engine_id) { return step_channels_.Open(EngineId{engine_id}); };
}

AdminService::Parts Daemon::AdminParts(ServedSocket socket) {
  return AdminService::Parts{.leases = &leases_,
                             .plans = &plans_,
                             .sessions = &sessions_,
                             .budget = budget_.get(),
                             .backend = backend_.get(),
                             .clock = clock_,
                             .epoch = epoch_,
                             .started = started_,
                             .set_draining = [this](bool draining) { return SetDraining(draining); },
                             .socket = std::move(socket),
                             .restart_survival = [this] { return restart_survival(); },
                             .remote_tier_up = [this]() -> std::optional<bool> {
                               if (prefix_cache_ == nullptr ||
                                   prefix_cache_->remote_tier() == nullptr) {
                                 return std::nullopt;
                               }
                               return prefix_cache_->remote_tier()->Up();
                             }};
}

Daemon::~Daemon() { Shutdown(); }

absl::Status Daemon::Start() {
  {
    absl::MutexLock lock(&mu_);
    if (server_ != nullptr || shut_down_.load()) {
      return absl::FailedPreconditionError("the daemon was already started");
    }
  }
  RETURN_IF_ERROR(PrepareSocketPath(socket_path_));
  RETURN_IF_ERROR(PrepareSocketPath(admin_socket_path_));
  if (start_config_.step_channel) RETURN_IF_ERROR(step_channels_.Start());
  // Bound before the engine socket: an engine that finds the engine socket finds its ticket.
  RETURN_IF_ERROR(handoff_.Start());
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  // The RPC metrics count the engine socket's calls (the hot path); operators' calls are few.
  ASSIGN_OR_RETURN(auto interceptors, RegisterMetrics());
  std::unique_ptr<ConnectionGate> gate;
  std::unique_ptr<ConnectionGate> admin_gate;
  ASSIGN_OR_RETURN(std::unique_ptr<grpc::Server> server,
                   Serve(socket_path_, start_config_.socket_group, start_config_.socket_mode,
                         /*reflection=*/false,
                         {&cache_service_, &engine_admin_service_, &engine_prefix_service_,
                          &block_store_service_},
                         std::move(interceptors), &gate));
  absl::StatusOr<std::unique_ptr<grpc::Server>> admin_server =
      Serve(admin_socket_path_, start_config_.admin_socket_group,
            start_config_.admin_socket_mode, /*reflection=*/true,
            {&operator_admin_service_, &operator_prefix_service_}, {}, &admin_gate);
  if (!admin_server.ok()) {
    gate->Stop();
    server->Shutdown();
    handoff_.Stop();
    return admin_server.status();
  }
  {
    absl::MutexLock lock(&mu_);
    server_ = std::move(server);
    admin_server_ = *std::move(admin_server);
    gate_ = std::move(gate);
    admin_gate_ = std::move(admin_gate);
  }
  lease_thread_ = std::thread([this] { LeaseLoop(); });
  StartMetricsHttp();
  const LeaseSettings lease = leases_.settings();
  spdlog::info(
      "memra-kvd serving engines on unix:{} (handoff {}), operators on unix:{} (backend {}, "
      "lease timeout {} ms, grace {} ms)",
      socket_path_, handoff_.path(), admin_socket_path_, std::string(backend_->Name()),
               absl::ToInt64Milliseconds(lease.timeout), absl::ToInt64Milliseconds(lease.grace));
  return absl::OkStatus();
}

ConnectionGate::Counts Daemon::engine_socket_connections() const {
  absl::MutexLock lock(&mu_);
  return gate_ == nullptr ? ConnectionGate::Counts{} : gate_->counts();
}

absl::StatusOr<std::unique_ptr<grpc::Server>> Daemon::Serve(
    const std::string& path, const std::string& group, uint32_t mode, bool reflection,
    const std::vector<grpc::Service*>& services,
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
        interceptors,
    std::unique_ptr<ConnectionGate>* gate) const {
  // The gate binds the socket (and applies its permissions) before any call can arrive; gRPC
  // listens on no port of its own and serves only what the gate hands it.
  ASSIGN_OR_RETURN(
      *gate,
      ConnectionGate::Listen(
          path, group, mode, absl::StrCat("socket ", path),
          {.max_connections = static_cast<size_t>(start_config_.max_connections),
           .max_connections_per_uid = static_cast<size_t>(start_config_.max_connections_per_uid)}));
  grpc::ServerBuilder builder;
  for (grpc::Service* service : services) builder.RegisterService(service);
  if (!reflection) builder.SetOption(std::make_unique<WithoutReflection>());
  // Every synchronous call in flight holds a thread: without a cap, open streams (reflection,
  // SubscribeEvents) grew the daemon by a thread each.
  grpc::ResourceQuota threads(absl::StrCat("memra-kvd ", path));
  threads.SetMaxThreads(kMaxRpcThreadsPerSocket);
  builder.SetResourceQuota(threads);
  // A connection with no call for this long is closed (GOAWAY): idle connections hold
  // descriptors.
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS,
                             static_cast<int>(start_config_.connection_idle_timeout_ms));
  if (!interceptors.empty()) {
    builder.experimental().SetInterceptorCreators(std::move(interceptors));
  }
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    (*gate)->Stop();
    return absl::UnavailableError(absl::StrCat("could not start the gRPC server for unix:", path));
  }
  (*gate)->Start(server.get());
  return server;
}

void Daemon::LeaseLoop() {
  // Whether the service manager still keeps what this daemon stores, asked every second (real
  // time: a test's FakeClock does not move it).
  constexpr absl::Duration kStoreProbePeriod = absl::Seconds(1);
  absl::Time next_store_probe = absl::Now();
  while (true) {
    if (restart_state_ != nullptr && absl::Now() >= next_store_probe) {
      restart_state_->ProbeStore();
      next_store_probe = absl::Now() + kStoreProbePeriod;
    }
    const LeaseSettings lease = leases_.settings();
    const absl::Duration period =
        std::clamp(std::min(lease.timeout, lease.grace + absl::Milliseconds(1)) / 5,
                   absl::Milliseconds(5), absl::Milliseconds(200));
    {
      absl::MutexLock lock(&stop_mu_);
      if (stop_mu_.AwaitWithTimeout(absl::Condition(&stop_lease_thread_), period)) return;
    }
    CheckLeases();
  }
}

void Daemon::CheckLeases() {
  for (const ReclaimedEngine& engine : leases_.CollectReclaimable()) {
    handoff_.ForgetEngine(engine.id.value);
    block_store_.ForgetEngine(engine.id.value);
    // Before its sessions go: no new round of its channel starts. A record the serving thread
    // is running now may still reach a session; Release orders after it (the session's lock),
    // and records after the release find no session (NOT_FOUND).
    step_channels_.Close(engine.id);
    const ReleasedSessions released = sessions_.ReleaseOwnedBy(engine.id);
    const uint64_t reserved = leases_.ReturnReservations(engine.id);
    plans_.ForgetEngine(engine.id.value);
    spdlog::info(
        "engine {} (\"{}\", pid {}) reclaimed: {} sessions, {} bytes freed, {} reserved bytes "
        "returned",
        engine.id.value, engine.name, engine.peer.pid, released.sessions, released.bytes, reserved);
  }
  leases_.ExpireReservations();
  FreeUnusablePools();
}

void Daemon::FreeUnusablePools() {
  absl::flat_hash_map<uint64_t, bool> lease_live;
  for (const EngineView& engine : leases_.Engines()) lease_live[engine.id.value] = engine.lease_live;
  // Registrations and pins die with the engine (reclaimed: unknown here), not with its stream:
  // an engine that re-attaches within its grace keeps them as it keeps its sessions. Pins also
  // die with their TTL.
  for (uint64_t engine : block_store_.Engines()) {
    if (!lease_live.contains(engine)) block_store_.ForgetEngine(engine);
  }
  block_store_.ExpirePins();
  block_store_.ExpireOffers();
  for (const auto& [engine, stats] : arena_pool_.Stats()) {
    auto live = lease_live.find(engine);
    if (live == lease_live.end()) {
      // Reclaimed (a release that raced the reclaim may have pooled an arena after it).
      arena_pool_.DrainEngine(engine, /*forget=*/true);
    } else if (!live->second && stats.pooled_arenas > 0) {
      // The lease ended: the engine can create no session to reuse them.
      arena_pool_.DrainEngine(engine, /*forget=*/false);
    }
  }
}

size_t Daemon::SetDraining(bool draining) {
  leases_.SetDraining(draining);
  {
    absl::MutexLock lock(&mu_);
    for (grpc::Server* server : {server_.get(), admin_server_.get()}) {
      if (server != nullptr) server->GetHealthCheckService()->SetServingStatus(!draining);
    }
  }
  return sessions_.size();
}

size_t Daemon::Drain(absl::Duration grace) {
  const size_t open = SetDraining(true);
  spdlog::info("draining: refusing new engines and sessions; {} sessions open, waiting up to {} ms",
               open, absl::ToInt64Milliseconds(grace));
  return sessions_.AwaitEmpty(grace);
}

void Daemon::EndDrain() { sessions_.EndWaits(); }

void Daemon::Shutdown() {
  if (shut_down_.exchange(true)) return;
  {
    absl::MutexLock lock(&stop_mu_);
    stop_lease_thread_ = true;
  }
  if (lease_thread_.joinable()) lease_thread_.join();
  engine_prefix_service_.Stop();
  operator_prefix_service_.Stop();
  leases_.SetDraining(true);
  leases_.CancelStreams();
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<grpc::Server> admin_server;
  std::unique_ptr<ConnectionGate> gate;
  std::unique_ptr<ConnectionGate> admin_gate;
  std::unique_ptr<metrics::MetricsHttpServer> metrics_http;
  {
    absl::MutexLock lock(&mu_);
    metrics_http = std::move(metrics_http_);
    server = std::move(server_);
    admin_server = std::move(admin_server_);
    gate = std::move(gate_);
    admin_gate = std::move(admin_gate_);
  }
  // No new connections first (the gates also remove the socket files).
  for (ConnectionGate* door : {gate.get(), admin_gate.get()}) {
    if (door != nullptr) door->Stop();
  }
  metrics_http.reset();  // joins its threads: no scrape reads the daemon after this
  const auto deadline = std::chrono::system_clock::now() + std::chrono::milliseconds(500);
  for (grpc::Server* serving : {server.get(), admin_server.get()}) {
    if (serving != nullptr) serving->Shutdown(deadline);
  }
  for (grpc::Server* serving : {server.get(), admin_server.get()}) {
    if (serving != nullptr) serving->Wait();
  }
  handoff_.Stop();  // after the servers: no Attach can claim a ticket any more
  step_channels_.Stop();  // no channel opens any more; none reads a session after this
  leases_.ForgetAll();
  for (uint64_t engine : block_store_.Engines()) block_store_.ForgetEngine(engine);
  const ReleasedSessions released = sessions_.ReleaseAll();
  // The remote tier's write-behind (what the released sessions' deaths captured too) gets a
  // bounded chance to reach the cluster; the rest is dropped and counted, never waited for.
  if (prefix_cache_ != nullptr && prefix_cache_->remote_tier() != nullptr) {
    constexpr absl::Duration kRemoteFlushAtShutdown = absl::Seconds(2);
    const uint64_t dropped = prefix_cache_->remote_tier()->FlushOrDrop(kRemoteFlushAtShutdown);
    if (dropped > 0) {
      spdlog::warn("shut down: {} remote tier writes not written within {}; dropped", dropped,
                   absl::FormatDuration(kRemoteFlushAtShutdown));
    }
  }
  // Slabs the prefix cache keeps empty for its next capture go too; those of stored entries are
  // freed with the cache.
  if (prefix_cache_ != nullptr) prefix_cache_->ReleaseEmptySlabs();
  spdlog::info("shut down: released {} sessions ({} bytes); backend holds {} arenas, {} bytes",
               released.sessions, released.bytes, backend_->ArenaCount(),
               backend_->AllocatedBytes());
}

void Daemon::ApplyReload(const DaemonConfig& config) {
  leases_.ApplySettings(LeaseSettingsOf(config));
  auto [budget_bytes, rule] = BudgetFor(config, *backend_);
  const BudgetChange change = budget_->SetBudget(budget_bytes, rule);
  if (change.old_budget != change.new_budget) {
    spdlog::info("admission budget {} -> {} bytes ({}); {} bytes in use", change.old_budget,
                 change.new_budget, rule, change.used_bytes);
  }
  if (change.over_budget_bytes > 0) {
    spdlog::warn("admission: {} bytes in use exceed the new budget by {}; nothing is admitted "
                 "until releases bring usage under it",
                 change.used_bytes, change.over_budget_bytes);
  }
}

}  // namespace memra
