#ifndef MEMRA_SERVER_DAEMON_H_
#define MEMRA_SERVER_DAEMON_H_

// memra-kvd as a composable object: the composition root. It builds the parts, wires them into
// the gRPC services on two Unix sockets and the handoff socket, and runs the lifecycle: start,
// drain, reload, the lease thread, shutdown. The engine socket (socket_path) serves KvCache,
// KvAdmin and KvPrefixCache with the operator calls refused; the admin socket
// (admin_socket_path, mode 0600 by default) serves KvAdmin and KvPrefixCache in full
// (server/edge/served_socket.h, docs/security-model.md); the handoff socket (handoff_socket_path,
// the engine socket's mode and group) issues the attach tickets and hands arena descriptors to
// the engines that own them (server/edge/arena_handoff.h).
// Both serve the standard health service and reflection. server/main.cc wraps it with configuration, signals and systemd; tests run
// it in-process with a FakeClock. The parts own their state and locks:
//   PlanRegistry (server/session/plan_registry.h)       registered model plans, bounded
//   EngineLeases (server/session/engine_leases.h)       engines, leases, reservations, draining
//   SessionRegistry (server/session/session_registry.h) sessions and the one operation dispatcher
//   CacheService / AdminService / PrefixService the wire edges
//   unix_socket.h                               the socket file before and after binding
//
// Thread-safety: thread-safe. `mu_` guards only the servers and the metrics endpoint; the parts'
// lock order is SessionRegistry's before EngineLeases' (server/session/session_registry.h).
//
// Admission: one DeviceBudget (server/device/device_budget.h) per daemon. Every session arena is
// charged its exact bytes before it is allocated (DaemonSession::Create / Grow) and released
// with it; an engine's reservations lapse after reservation_ttl_ms and go with the engine when it
// is reclaimed. The admin queries (cost, fit, max-context) price with the same sizing function
// and the backend's rounding.
//
// Invariants: (1) a session's engine is attached, or is being reclaimed and the session is
// released by that reclaim; (2) once Shutdown() returns, no arena of this daemon remains
// allocated in the backend; (3) the budget's allocated bytes == the bytes of live session arenas
// (+ prefix storage), and reserved + allocated <= budget after every admission.

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/server.h"
#include "grpcpp/support/server_interceptor.h"
#include "proto/memra/kv/v1/admin.pb.h"
#include "server/edge/admin_service.h"
#include "server/edge/arena_handoff.h"
#include "server/session/arena_pool.h"
#include "server/store/block_store.h"
#include "server/edge/block_store_service.h"
#include "server/device/backend.h"
#include "server/session/cache_scopes.h"
#include "server/edge/cache_service.h"
#include "server/base/clock.h"
#include "server/config.h"
#include "server/edge/connection_gate.h"
#include "server/edge/grpc_socket.h"
#include "server/edge/group_service.h"
#include "server/device/device_budget.h"
#include "server/session/engine_leases.h"
#include "server/metrics/metrics.h"
#include "server/metrics/metrics_http.h"
#include "server/session/plan_registry.h"
#include "server/store/prefix_cache.h"
#include "server/edge/prefix_service.h"
#include "server/restart/readopt.h"
#include "server/restart/restart_state.h"
#include "server/base/sd_notify.h"
#include "server/edge/served_socket.h"
#include "server/session/engine_time_shares.h"
#include "server/session/session_registry.h"
#include "server/edge/step_channel.h"

namespace memra {

class Daemon {
 public:
  // Uses config.SocketPath(), socket_mode, socket_group, AdminSocketPath(), admin_socket_mode,
  // admin_socket_group, lease_timeout_ms, lease_grace_ms.
  // `passed`: the descriptors the service manager handed over at start (TakeListenFds). When
  // they hold a previous daemon's journal (server/restart/restart_state.h), its engines and
  // sessions are re-adopted before this returns and the epoch is the previous one + 1; sessions
  // that cannot come back answer with the restart error (common/daemon_restart.h). Under a service
  // manager with keep_kv_across_restarts, this daemon keeps its own state there for the next one.
  // REQUIRES: `clock` outlives the daemon.
  static absl::StatusOr<std::unique_ptr<Daemon>> Create(DaemonConfig config,
                                                        std::unique_ptr<DeviceBackend> backend,
                                                        Clock* clock,
                                                        std::vector<ListenedFd> passed = {});
  ~Daemon();  // Shutdown()
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  // Binds the engine and admin sockets (removing a stale socket file no daemon answers on;
  // refusing when one does), applies their modes and groups, starts serving and the lease
  // thread.
  absl::Status Start() ABSL_LOCKS_EXCLUDED(mu_);

  // Refuses new engines and sessions (UNAVAILABLE) and waits until every session is released,
  // `grace` has passed, or EndDrain() is called. Returns the sessions still open.
  size_t Drain(absl::Duration grace) ABSL_LOCKS_EXCLUDED(mu_);
  // Makes a running Drain() return now (a second SIGTERM).
  void EndDrain();
  // Stops serving (open calls are cancelled), releases every session, removes the socket files.
  // Idempotent.
  void Shutdown() ABSL_LOCKS_EXCLUDED(mu_);

  // SIGHUP: takes the live-changeable settings that matter here (lease timeout and grace,
  // reservation ttl, the admission budget). The host backend cannot grow past the capacity it
  // started with: a larger budget_bytes is capped there (and logged).
  void ApplyReload(const DaemonConfig& config);

  // Refuse (true) or accept again (false) new engines and sessions; health follows. Returns the
  // sessions open.
  size_t SetDraining(bool draining) ABSL_LOCKS_EXCLUDED(mu_);

  // Applies lease decisions at clock->Now(): expires silent engines, reclaims engines whose
  // grace has passed (releasing each of their sessions once), drops lapsed reservations, frees
  // the arena pools of engines without a live lease. The lease thread calls it periodically;
  // tests call it after moving a FakeClock.
  void CheckLeases();

  // What the start re-adopted from a previous daemon (server/restart/readopt.h).
  Readopted readopted() const { return readopted_; }
  uint64_t epoch() const { return epoch_; }
  // Null when this daemon keeps nothing for a restart.
  const RestartState* restart_state() const { return restart_state_.get(); }
  // Whether KV survives this daemon's crash now, and why not.
  RestartSurvival restart_survival() const;

  // What KvAdmin.GetStatus answers.
  memra::kv::v1::GetStatusResponse GetStatus() const { return operator_admin_service_.Status(); }
  DeviceBudget& budget() const { return *budget_; }
  // The Prometheus endpoint's port; 0 when metrics_address is empty or it could not bind.
  int metrics_port() const ABSL_LOCKS_EXCLUDED(mu_);
  const std::string& socket_path() const { return socket_path_; }
  const std::string& admin_socket_path() const { return admin_socket_path_; }
  const std::string& handoff_socket_path() const { return handoff_.path(); }
  // The engine socket's connections (open, refused at the door); zeros before Start.
  ConnectionGate::Counts engine_socket_connections() const ABSL_LOCKS_EXCLUDED(mu_);
  // Connections and descriptors handed (tests, metrics).
  const ArenaHandoff& handoff() const { return handoff_; }
  // Step channel figures (tests, metrics).
  StepChannelStats step_channel_stats() const { return step_channels_.stats(); }
  DeviceBackend& backend() const { return *backend_; }
  // False once shutting down (the watchdog stops its keep-alives).
  bool Healthy() const { return !shut_down_.load(); }
  // Null when the prefix cache is disabled (tests, metrics).
  PrefixCache* prefix_cache() const { return prefix_cache_.get(); }
  const BlockStore& block_store() const { return block_store_; }

 private:
  Daemon(DaemonConfig config, std::unique_ptr<DeviceBackend> backend, Clock* clock,
         std::unique_ptr<DeviceBudget> budget, uint64_t epoch, CacheScopes scopes,
         std::unique_ptr<RestartState> restart_state,
         std::unique_ptr<PrefixCache> prefix_cache);

  // The session finder and the KvAdmin parts of this daemon (one service instance per socket).
  PrefixService::SessionFinder FindSession();
  PrefixService::ScopeFinder FindScope();
  // The handoff socket's options and its arena lookup: a session of the connection's engine,
  // named with its token, and one of its arenas.
  ArenaHandoff::ArenaLookup LookupArena();
  // The handoff socket's step channel opener; null without step_channel.
  ArenaHandoff::StepChannelOpener OpenStepChannel();
  // Frees the pooled arenas of engines whose lease ended or that were reclaimed, and their
  // block store registrations and pins.
  void FreeUnusablePools();
  AdminService::Parts AdminParts(ServedSocket socket);

  void LeaseLoop() ABSL_LOCKS_EXCLUDED(stop_mu_);
  // Has each part register its gauges and counters (read at scrape time; the part's
  // *_metrics.h) and returns the gRPC interceptors that count and time every call.
  absl::StatusOr<
      std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>>
  RegisterMetrics();
  // Serves metrics_ on metrics_address; a failure is logged, not fatal (the cache matters more
  // than its metrics).
  void StartMetricsHttp() ABSL_LOCKS_EXCLUDED(mu_);

  // Constant after construction; declared in construction order (each part is destroyed
  // before what it points to).
  const std::unique_ptr<DeviceBackend> backend_;
  Clock* const clock_;
  const std::string socket_path_;
  const std::string admin_socket_path_;
  const DaemonConfig start_config_;
  // The daemon's RLIMIT_NOFILE as read at construction, shared out (server/config.h): caps
  // handoff connections and step channels (the other shares cap start_config_'s keys).
  const DescriptorShares descriptor_shares_;
  const std::unique_ptr<DeviceBudget> budget_;
  const uint64_t epoch_;  // random per start; the previous epoch + 1 after a re-adoption
  const CacheScopes scopes_;  // cache_scope_allow
  const absl::Time started_;
  // Null unless under a service manager with keep_kv_across_restarts. Declared before the parts
  // that report to it.
  const std::unique_ptr<RestartState> restart_state_;
  Readopted readopted_;  // set by Create() before serving, constant after
  // Why restart_state_ is null (set by Create() before serving, constant after).
  std::string survival_off_;
  // Every metric of this daemon. Filled by Start() (RegisterMetrics).
  metrics::Registry metrics_;
  PlanRegistry plans_;
  EngineLeases leases_;
  // Null when prefix_cache_budget_bytes is 0. Its arenas live in backend_; its lock comes after
  // a session's own mutex (server/store/prefix_cache.h).
  const std::unique_ptr<PrefixCache> prefix_cache_;
  // Released session arenas per engine (arena_pool_engine_bytes); evicted before prefix entries.
  ArenaPool arena_pool_;
  // Each engine's share of the daemon's time (max_engine_cpu_percent), charged by sessions_.
  EngineTimeShares time_shares_;
  SessionRegistry sessions_;
  // Engines' own pools (block_store.proto); its offers come over handoff_, its bytes live in
  // prefix_cache_.
  BlockStore block_store_;
  // The engines' shared-memory step channels (docs/step-channel.md); started only with
  // step_channel (config), when the handoff socket offers them.
  StepChannels step_channels_;
  ArenaHandoff handoff_;
  // One KvPrefixCache and one KvAdmin per socket (server/edge/served_socket.h).
  PrefixService engine_prefix_service_;
  PrefixService operator_prefix_service_;
  CacheService cache_service_;
  BlockStoreService block_store_service_;  // the engine socket only
  AdminService engine_admin_service_;
  AdminService operator_admin_service_;
  // One KvGroup per socket: group reservations on the engine socket, their listing on the admin.
  GroupService engine_group_service_;
  GroupService operator_group_service_;

  std::atomic<bool> shut_down_{false};

  mutable absl::Mutex mu_;
  // Each a gRPC server behind its door (server/edge/grpc_socket.h); empty before Start.
  GrpcSocket engine_socket_ ABSL_GUARDED_BY(mu_);
  GrpcSocket admin_socket_ ABSL_GUARDED_BY(mu_);
  // Stopped in Shutdown() before anything its callbacks read goes away.
  std::unique_ptr<metrics::MetricsHttpServer> metrics_http_ ABSL_GUARDED_BY(mu_);

  absl::Mutex stop_mu_;
  bool stop_lease_thread_ ABSL_GUARDED_BY(stop_mu_) = false;
  std::thread lease_thread_;  // started by Start(), joined by Shutdown()
};

}  // namespace memra

#endif  // MEMRA_SERVER_DAEMON_H_
