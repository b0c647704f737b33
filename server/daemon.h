#ifndef MEMRA_SERVER_DAEMON_H_
#define MEMRA_SERVER_DAEMON_H_

// memra-kvd as a composable object: the gRPC services (memra.kv.v1 KvCache and KvAdmin, the
// standard health service and reflection) on a Unix socket, the session registry, engines and
// their leases. server/main.cc wraps it with configuration, signals and systemd; tests run it
// in-process with a FakeClock.
//
// Thread-safety: thread-safe. Locking: `mu_` (engines, plans, draining) is taken before
// `sessions_mu_` (the session map), never the other way round; the per-step hot path takes only
// `sessions_mu_`, for a map lookup, and then the one session's own mutex.
//
// Leases: an engine's lease ends when its Attach stream ends or when no heartbeat arrives for
// lease_timeout_ms (the stream is then cancelled). lease_grace_ms after that, every session of
// the engine is released and the engine forgotten. Lease decisions use the injected Clock.
//
// Admission: one DeviceBudget (server/device_budget.h) per daemon. Every session arena is charged
// its exact bytes before it is allocated (DaemonSession::Create / Grow) and released with it; an
// engine's reservations lapse after reservation_ttl_ms and go with the engine when it is
// reclaimed. The admin queries (cost, fit, max-context) price with the same sizing function and
// the backend's rounding.
//
// Invariants: (1) every session in sessions_ is in exactly one engine's `sessions` set and vice
// versa; (2) once Shutdown() returns, no arena of this daemon remains allocated in the backend;
// (3) the budget's allocated bytes == the bytes of live session arenas (+ prefix storage), and
// reserved + allocated <= budget after every admission.

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/admission.h"
#include "core/formats.h"
#include "core/model_plan.h"
#include "grpcpp/server.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/server_interceptor.h"
#include "proto/memra/kv/v1/admin.pb.h"
#include "proto/memra/kv/v1/cache.pb.h"
#include "server/backend.h"
#include "server/clock.h"
#include "server/config.h"
#include "server/daemon_session.h"
#include "server/metrics.h"
#include "server/metrics_http.h"
#include "server/prefix_cache.h"
#include "server/prefix_service.h"
#include "server/device_budget.h"

namespace memra {

class Daemon {
 public:
  // Uses config.SocketPath(), socket_mode, socket_group, lease_timeout_ms, lease_grace_ms.
  // REQUIRES: `clock` outlives the daemon.
  static absl::StatusOr<std::unique_ptr<Daemon>> Create(DaemonConfig config,
                                                        std::unique_ptr<DeviceBackend> backend,
                                                        Clock* clock);
  ~Daemon();  // Shutdown()
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  // Binds the Unix socket (removing a stale socket file no daemon answers on; refusing when
  // one does), applies socket_mode/socket_group, starts serving and the lease thread.
  absl::Status Start() ABSL_LOCKS_EXCLUDED(mu_);

  // Refuses new engines and sessions (UNAVAILABLE) and waits until every session is released,
  // `grace` has passed, or EndDrain() is called. Returns the sessions still open.
  size_t Drain(absl::Duration grace) ABSL_LOCKS_EXCLUDED(mu_, sessions_mu_);
  // Makes a running Drain() return now (a second SIGTERM).
  void EndDrain() ABSL_LOCKS_EXCLUDED(sessions_mu_);
  // Stops serving (open calls are cancelled), releases every session, removes the socket file.
  // Idempotent.
  void Shutdown() ABSL_LOCKS_EXCLUDED(mu_, sessions_mu_);

  // SIGHUP: takes the live-changeable settings that matter here (lease timeout and grace,
  // reservation ttl, the admission budget). The host backend cannot grow past the capacity it
  // started with: a larger budget_bytes is capped there (and logged).
  void ApplyReload(const DaemonConfig& config) ABSL_LOCKS_EXCLUDED(mu_);

  // Refuse (true) or accept again (false) new engines and sessions; health follows. Returns the
  // sessions open.
  size_t SetDraining(bool draining) ABSL_LOCKS_EXCLUDED(mu_, sessions_mu_);

  // Applies lease decisions at clock->Now(): expires silent engines, reclaims engines whose
  // grace has passed. The lease thread calls it periodically; tests call it after moving a
  // FakeClock.
  void CheckLeases() ABSL_LOCKS_EXCLUDED(mu_, sessions_mu_);

  // What KvAdmin.GetStatus answers.
  memra::kv::v1::GetStatusResponse GetStatus() ABSL_LOCKS_EXCLUDED(mu_, sessions_mu_);
  DeviceBudget& budget() const { return *budget_; }
  // The Prometheus endpoint's port; 0 when metrics_address is empty or it could not bind.
  int metrics_port() const ABSL_LOCKS_EXCLUDED(mu_);
  const std::string& socket_path() const { return socket_path_; }
  DeviceBackend& backend() const { return *backend_; }
  // False once shutting down (the watchdog stops its keep-alives).
  bool Healthy() const { return !shut_down_.load(); }

 private:
  class CacheService;
  class AdminService;

  struct Engine {
    EngineId id;
    std::string name;
    int64_t pid = 0;
    std::string token;
    absl::Time last_heartbeat;
    std::optional<absl::Time> lease_ended;   // stream ended or heartbeats stopped
    grpc::ServerContext* context = nullptr;  // while its Attach call runs
    absl::flat_hash_set<uint64_t> sessions;
  };

  Daemon(DaemonConfig config, std::unique_ptr<DeviceBackend> backend, Clock* clock,
         std::unique_ptr<DeviceBudget> budget, uint64_t epoch);

  // Attach: registers the engine and returns it (id, token); then heartbeats; then EndStream.
  absl::StatusOr<memra::kv::v1::Attached> BeginLease(const memra::kv::v1::Hello& hello,
                                                     grpc::ServerContext* context)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Heartbeat(EngineId engine) ABSL_LOCKS_EXCLUDED(mu_);
  void EndStream(EngineId engine) ABSL_LOCKS_EXCLUDED(mu_);

  absl::StatusOr<std::string> RegisterPlan(const memra::kv::v1::ModelPlan& plan)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Validates, fingerprints and registers a plan (idempotent); returns the fingerprint bytes.
  absl::StatusOr<std::string> RegisterValidPlan(ModelPlan plan) ABSL_LOCKS_EXCLUDED(mu_);
  // The registered plan with these fingerprint bytes (NOT_FOUND).
  absl::StatusOr<std::shared_ptr<const ModelPlan>> FindPlan(const std::string& fingerprint) const
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<memra::kv::v1::ReserveResponse> Reserve(
      const memra::kv::v1::ReserveRequest& request) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<uint64_t> CancelReservation(
      const memra::kv::v1::CancelReservationRequest& request) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status CreateSession(const memra::kv::v1::CreateSessionRequest& request,
                             memra::kv::v1::CreateSessionResponse* response)
      ABSL_LOCKS_EXCLUDED(mu_, sessions_mu_);
  absl::StatusOr<uint64_t> ReleaseSession(const memra::kv::v1::SessionRef& ref)
      ABSL_LOCKS_EXCLUDED(mu_, sessions_mu_);
  // The session `ref` names: NOT_FOUND unknown id, PERMISSION_DENIED wrong token.
  absl::StatusOr<std::shared_ptr<DaemonSession>> FindSession(const memra::kv::v1::SessionRef& ref)
      ABSL_LOCKS_EXCLUDED(sessions_mu_);
  // One entry of a batched Step (also what the single-session transaction RPCs run).
  void RunStepEntry(const memra::kv::v1::StepEntry& entry, memra::kv::v1::StepResult* result)
      ABSL_LOCKS_EXCLUDED(sessions_mu_);

  absl::Status CheckEngine(const memra::kv::v1::EngineRef& ref) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops reservations whose ttl has passed, logging each once.
  void ExpireReservations() ABSL_LOCKS_EXCLUDED(mu_);
  ArenaRounding rounding() const;

  // KvAdmin.
  absl::Status ListSessions(const memra::kv::v1::ListSessionsRequest& request,
                            memra::kv::v1::ListSessionsResponse* response)
      ABSL_LOCKS_EXCLUDED(mu_, sessions_mu_);
  absl::Status GetCost(const memra::kv::v1::CostRequest& request,
                       memra::kv::v1::CostResponse* response) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status GetFit(const memra::kv::v1::FitRequest& request,
                      memra::kv::v1::FitResponse* response) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status GetMaxContext(const memra::kv::v1::MaxContextRequest& request,
                             memra::kv::v1::MaxContextResponse* response)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status ImportModel(const memra::kv::v1::ImportModelRequest& request,
                           memra::kv::v1::ImportModelResponse* response) ABSL_LOCKS_EXCLUDED(mu_);
  // A query's model: a registered plan, an inline plan or a HF config.json.
  absl::StatusOr<std::shared_ptr<const ModelPlan>> ResolveModel(
      const memra::kv::v1::ModelSelector& selector) const ABSL_LOCKS_EXCLUDED(mu_);
  void LeaseLoop() ABSL_LOCKS_EXCLUDED(stop_mu_);
  // Registers the daemon's gauges and counters (read at scrape time) and returns the gRPC
  // interceptors that count and time every call (server/daemon_metrics.cc).
  absl::StatusOr<
      std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>>
  RegisterMetrics();
  // Serves metrics_ on metrics_address; a failure is logged, not fatal (the cache matters more
  // than its metrics).
  void StartMetricsHttp() ABSL_LOCKS_EXCLUDED(mu_);
  // Engine death: keeps the session's committed state as a prefix entry when configured.
  void CaptureBeforeRelease(DaemonSession& session);

  // Constant after construction.
  const std::unique_ptr<DeviceBackend> backend_;
  Clock* const clock_;
  const std::string socket_path_;
  const DaemonConfig start_config_;
  const FormatDefaults format_defaults_;
  const std::unique_ptr<CacheService> cache_service_;
  const std::unique_ptr<AdminService> admin_service_;
  const std::unique_ptr<DeviceBudget> budget_;
  // Every metric of this daemon (server/daemon_metrics.cc). Filled by Start().
  metrics::Registry metrics_;
  std::atomic<uint64_t> lease_expiries_{0};
  std::atomic<uint64_t> engines_reclaimed_{0};
  std::atomic<uint64_t> reservations_expired_{0};
  const uint64_t epoch_;  // random per start
  const absl::Time started_;

  std::atomic<uint64_t> next_session_id_{1};
  std::atomic<bool> shut_down_{false};

  mutable absl::Mutex mu_ ABSL_ACQUIRED_BEFORE(sessions_mu_);
  absl::Duration lease_timeout_ ABSL_GUARDED_BY(mu_);
  absl::Duration lease_grace_ ABSL_GUARDED_BY(mu_);
  absl::Duration reservation_ttl_ ABSL_GUARDED_BY(mu_);
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_engine_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<uint64_t, Engine> engines_ ABSL_GUARDED_BY(mu_);
  // Fingerprint bytes -> validated plan.
  absl::flat_hash_map<std::string, std::shared_ptr<const ModelPlan>> plans_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<grpc::Server> server_ ABSL_GUARDED_BY(mu_);
  // Stopped in Shutdown() before anything its callbacks read goes away.
  std::unique_ptr<metrics::MetricsHttpServer> metrics_http_ ABSL_GUARDED_BY(mu_);

  mutable absl::Mutex sessions_mu_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<DaemonSession>> sessions_
      ABSL_GUARDED_BY(sessions_mu_);
  bool drain_ended_ ABSL_GUARDED_BY(sessions_mu_) = false;

  absl::Mutex stop_mu_;
  bool stop_lease_thread_ ABSL_GUARDED_BY(stop_mu_) = false;
  std::thread lease_thread_;  // started by Start(), joined by Shutdown()

  // Prefix cache (null when prefix_cache_budget_bytes is 0). Constant after construction;
  // declared last so it is destroyed first (its arenas live in backend_). Its lock comes after
  // a session's own mutex (server/prefix_cache.h).
  std::unique_ptr<PrefixCache> prefix_cache_;
  std::unique_ptr<PrefixService> prefix_service_;

 public:
  // Null when the prefix cache is disabled (tests, metrics).
  PrefixCache* prefix_cache() const { return prefix_cache_.get(); }
};

}  // namespace memra

#endif  // MEMRA_SERVER_DAEMON_H_
