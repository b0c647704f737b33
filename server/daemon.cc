#include "server/daemon.h"

#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/codec.h"
#include "common/errors.h"
#include "core/status_macros.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "proto/memra/kv/v1/admin.grpc.pb.h"
#include "proto/memra/kv/v1/cache.grpc.pb.h"
#include "proto/memra/kv/v1/prefix.grpc.pb.h"
#include "server/base/unix_socket.h"
#include "server/device/budget_metrics.h"
#include "server/metrics/rpc_metrics.h"
#include "server/parts_factory.h"
#include "server/restart/restart_metrics.h"
#include "server/session/session_metrics.h"
#include "server/store/prefix_cache_metrics.h"
#include "server/store/remote/remote_tier.h"
#include "spdlog/spdlog.h"

namespace memra {
namespace {

namespace pb = ::memra::kv::v1;

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
  // Every session holds an arena and every known engine a slot: max_arenas + engines bounds the
  // journal's records (the file is sparse: unused slots cost no memory).
  RestartKeeping keeping = KeepForRestart(
      {.keep = config.keep_kv_across_restarts,
       // Legacy CUDA IPC memory dies with the exporting process: nothing to keep.
       .memory_dies = config.backend == Backend::kCuda && config.cuda_export == CudaExport::kIpc
                          ? "cuda_export = ipc: that memory dies with the daemon"
                          : "",
       .slots = std::min<uint64_t>(EffectiveMaxArenas(config) + config.leases.max_engines + 1,
                                   RestartJournal::kMaxSlots),
       .epoch = epoch},
      previous, backend.get());
  std::unique_ptr<DeviceBudget> budget = MakeDeviceBudget(config, *backend);
  absl::StatusOr<std::unique_ptr<PrefixCache>> prefix_cache =
      MakePrefixCache(config, backend.get(), budget.get(), epoch);
  if (!prefix_cache.ok()) {
    return absl::Status(prefix_cache.status().code(),
                        absl::StrCat("prefix cache: ", prefix_cache.status().message()));
  }
  std::unique_ptr<Daemon> daemon(
      new Daemon(std::move(config), std::move(backend), clock,
                 std::move(budget), epoch, std::move(scopes), std::move(keeping.state),
                 *std::move(prefix_cache)));
  daemon->survival_off_ = std::move(keeping.off);
  if (previous.has_value()) {
    daemon->readopted_ = Readopt(*std::move(previous),
                                 ReadoptParts{.plans = &daemon->plans_,
                                              .leases = &daemon->leases_,
                                              .sessions = &daemon->sessions_,
                                              .backend = daemon->backend_.get(),
                                              .budget = daemon->budget_.get(),
                                              .restart_state = daemon->restart_state_.get(),
                                              .epoch = daemon->epoch_});
  } else if (daemon->restart_state_ != nullptr) {
    if (absl::Status published = daemon->restart_state_->Publish(); !published.ok()) {
      spdlog::error("restart journal not kept: {}", published.ToString());
    }
  }
  return daemon;
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
      plans_(FormatDefaults(), start_config_.sessions.max_plan_layers,
             start_config_.sessions.max_engine_plans),
      leases_(clock_, budget_.get(), start_config_.leases, restart_state_.get()),
      prefix_cache_(std::move(prefix_cache)),
      arena_pool_(backend_.get(), budget_.get(), start_config_.sessions.arena_pool_engine_bytes),
      time_shares_(EngineTimeShares::LimitsFor(start_config_.admission.max_engine_cpu_percent),
                   clock_),
      sessions_(backend_.get(), budget_.get(), &leases_, &plans_, FormatDefaults(),
                start_config_.sessions.prefix_capture_on_engine_death ? prefix_cache_.get()
                                                                      : nullptr,
                start_config_.sessions.max_engine_sessions, &arena_pool_, restart_state_.get(),
                &time_shares_),
      block_store_(prefix_cache_.get(), backend_.get(), clock_, BlockStoreLimitsOf(start_config_),
                   [this](uint64_t connection, uint64_t engine) {
                     return handoff_.ServesEngine(connection, engine);
                   },
                   epoch_),
      step_channels_(&sessions_, &leases_, StepChannelOptionsOf(start_config_, descriptor_shares_)),
      handoff_(HandoffOptionsOf(start_config_, descriptor_shares_, epoch_), LookupArena(),
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
          AdminParts(ServedSocket{ServedSocket::Audience::kOperators, admin_socket_path_})),
      engine_group_service_(&leases_, &sessions_,
                            ServedSocket{ServedSocket::Audience::kEngines, admin_socket_path_},
                            socket_path_),
      operator_group_service_(
          &leases_, &sessions_,
          ServedSocket{ServedSocket::Audience::kOperators, admin_socket_path_}, socket_path_) {
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
    if (engine_socket_.server != nullptr || shut_down_.load()) {
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
  const ConnectionGate::Limits& limits = start_config_.connections;
  const uint64_t idle_ms = start_config_.sockets.connection_idle_timeout_ms;
  ASSIGN_OR_RETURN(GrpcSocket engine_socket,
                   ServeGrpcSocket({.path = socket_path_,
                                    .group = start_config_.sockets.socket_group,
                                    .mode = start_config_.sockets.socket_mode,
                                    .limits = limits,
                                    .idle_timeout_ms = idle_ms},
                                   {&cache_service_, &engine_admin_service_,
                                    &engine_prefix_service_, &block_store_service_,
                                    &engine_group_service_},
                                   std::move(interceptors)));
  absl::StatusOr<GrpcSocket> admin_socket =
      ServeGrpcSocket({.path = admin_socket_path_,
                       .group = start_config_.sockets.admin_socket_group,
                       .mode = start_config_.sockets.admin_socket_mode,
                       .reflection = true,
                       .limits = limits,
                       .idle_timeout_ms = idle_ms},
                      {&operator_admin_service_, &operator_prefix_service_,
                       &operator_group_service_}, {});
  if (!admin_socket.ok()) {
    engine_socket.gate->Stop();
    engine_socket.server->Shutdown();
    handoff_.Stop();
    return admin_socket.status();
  }
  {
    absl::MutexLock lock(&mu_);
    engine_socket_ = std::move(engine_socket);
    admin_socket_ = *std::move(admin_socket);
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
  return engine_socket_.gate == nullptr ? ConnectionGate::Counts{}
                                        : engine_socket_.gate->counts();
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
    for (grpc::Server* server : {engine_socket_.server.get(), admin_socket_.server.get()}) {
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
  GrpcSocket sockets[2];
  std::unique_ptr<metrics::MetricsHttpServer> metrics_http;
  {
    absl::MutexLock lock(&mu_);
    metrics_http = std::move(metrics_http_);
    sockets[0] = std::move(engine_socket_);
    sockets[1] = std::move(admin_socket_);
  }
  // No new connections first (the gates also remove the socket files).
  for (GrpcSocket& socket : sockets) {
    if (socket.gate != nullptr) socket.gate->Stop();
  }
  metrics_http.reset();  // joins its threads: no scrape reads the daemon after this
  const auto deadline = std::chrono::system_clock::now() + std::chrono::milliseconds(500);
  for (GrpcSocket& socket : sockets) {
    if (socket.server != nullptr) socket.server->Shutdown(deadline);
  }
  for (GrpcSocket& socket : sockets) {
    if (socket.server != nullptr) socket.server->Wait();
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
  leases_.ApplySettings(config.leases);
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

absl::StatusOr<std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>>
Daemon::RegisterMetrics() {
  RETURN_IF_ERROR(RegisterBudgetMetrics(budget_.get(), metrics_));
  RETURN_IF_ERROR(RegisterSessionMetrics(&sessions_, metrics_));
  RETURN_IF_ERROR(RegisterLeaseMetrics(&leases_, metrics_));
  RETURN_IF_ERROR(RegisterArenaPoolMetrics(&arena_pool_, metrics_));
  RETURN_IF_ERROR(RegisterPrefixCacheMetrics(prefix_cache_.get(), metrics_));
  RETURN_IF_ERROR(RegisterRestartMetrics([this] { return restart_survival(); }, metrics_));
  if (!start_config_.metrics.rpc_metrics || start_config_.metrics.metrics_address.empty()) {
    return std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>();
  }
  std::vector<std::string> methods(metrics::kHealthServiceMethods.begin(),
                                   metrics::kHealthServiceMethods.end());
  for (const char* service :
       {pb::KvCache::service_full_name(), pb::KvAdmin::service_full_name(),
        pb::KvPrefixCache::service_full_name(), "grpc.reflection.v1alpha.ServerReflection"}) {
    ASSIGN_OR_RETURN(std::vector<std::string> served, metrics::ProtoServiceMethods(service));
    methods.insert(methods.end(), served.begin(), served.end());
  }
  return metrics::MakeRpcMetricsInterceptors(&metrics_, methods);
}

void Daemon::StartMetricsHttp() {
  if (start_config_.metrics.metrics_address.empty()) return;
  absl::StatusOr<std::unique_ptr<metrics::MetricsHttpServer>> http =
      metrics::MetricsHttpServer::Start(start_config_.metrics.metrics_address, &metrics_);
  if (!http.ok()) {
    spdlog::error("metrics are off: {} (memra-kvd keeps serving; fix metrics_address)",
                  http.status().ToString());
    return;
  }
  spdlog::info("metrics on http://{}/metrics (port {})", start_config_.metrics.metrics_address,
               (*http)->bound_port());
  absl::MutexLock lock(&mu_);
  metrics_http_ = *std::move(http);
}

int Daemon::metrics_port() const {
  absl::MutexLock lock(&mu_);
  return metrics_http_ == nullptr ? 0 : metrics_http_->bound_port();
}

}  // namespace memra
