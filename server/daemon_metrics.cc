// The daemon's Prometheus metrics: what it holds (read from the ledger, the session map and the
// prefix cache at scrape time, so a scrape never shows stale numbers), what happened (counters),
// and every gRPC call counted and timed by server/metrics/rpc_metrics.h. README.md "Metrics" lists
// them.

#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "core/status_macros.h"
#include "proto/memra/kv/v1/admin.grpc.pb.h"
#include "proto/memra/kv/v1/cache.grpc.pb.h"
#include "proto/memra/kv/v1/prefix.grpc.pb.h"
#include "server/daemon.h"
#include "server/metrics/rpc_metrics.h"
#include "spdlog/spdlog.h"

namespace memra {

namespace pb = ::memra::kv::v1;

absl::StatusOr<std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>>
Daemon::RegisterMetrics() {
  using metrics::CallbackSample;
  auto ledger_gauge = [this](const char* name, const char* help, auto read) {
    return metrics_.AddCallbackGauge(name, help, [this, read] {
      return static_cast<double>(read(budget_->Snapshot()));
    });
  };
  RETURN_IF_ERROR(ledger_gauge("memra_budget_bytes", "Admission budget of this GPU (bytes).",
                               [](const AdmissionLedger& l) { return l.budget(); }));
  RETURN_IF_ERROR(ledger_gauge("memra_reserved_bytes",
                               "Bytes held by admission reservations not yet used.",
                               [](const AdmissionLedger& l) { return l.reserved(); }));
  RETURN_IF_ERROR(ledger_gauge(
      "memra_allocated_bytes",
      "Bytes of live allocations charged to the budget (sessions, grows, prefix storage).",
      [](const AdmissionLedger& l) { return l.allocated(); }));
  RETURN_IF_ERROR(ledger_gauge("memra_free_bytes", "Budget bytes neither reserved nor allocated.",
                               [](const AdmissionLedger& l) { return l.free(); }));
  RETURN_IF_ERROR(ledger_gauge("memra_evictable_bytes",
                               "Bytes admission may evict to make room (pooled arenas, prefix "
                               "entries).",
                               [](const AdmissionLedger& l) { return l.evictable(); }));
  RETURN_IF_ERROR(ledger_gauge("memra_reservations", "Live admission reservations.",
                               [](const AdmissionLedger& l) { return l.reservation_count(); }));
  RETURN_IF_ERROR(metrics_.AddCallbackGauge("memra_sessions", "Live sessions.", [this] {
    return static_cast<double>(sessions_.size());
  }));
  RETURN_IF_ERROR(metrics_.AddCallbackGauge("memra_engines", "Attached engines.", [this] {
    return static_cast<double>(leases_.size());
  }));
  auto event_count = [this](const char* name, const char* help,
                            uint64_t (EngineLeases::*read)() const) {
    return metrics_.AddCallbackGauge(
        name, help, [this, read] { return static_cast<double>((leases_.*read)()); });
  };
  RETURN_IF_ERROR(event_count("memra_lease_expiries",
                              "Engines whose heartbeats stopped (lease timeout), since start.",
                              &EngineLeases::lease_expiries));
  RETURN_IF_ERROR(event_count("memra_engines_reclaimed",
                              "Engines whose sessions and reservations were reclaimed, since start.",
                              &EngineLeases::engines_reclaimed));
  RETURN_IF_ERROR(event_count("memra_reservations_expired",
                              "Reservations that lapsed unused, since start.",
                              &EngineLeases::reservations_expired));
  RETURN_IF_ERROR(metrics_.AddCallbackGauge(
      "memra_admission_refusals", "Admissions refused for room (RESOURCE_EXHAUSTED), since start.",
      [this] { return static_cast<double>(budget_->refusals()); }));

  // The arena pool, per engine.
  const std::pair<const char*, const char*> pool_help[] = {
      {"memra_arena_pool_bytes", "Bytes of released session arenas pooled for the engine."},
      {"memra_arena_pool_hits", "CreateSessions served from the engine's pool, since start."},
      {"memra_session_arenas_created",
       "Session arenas created for the engine (each a new mapping there), since start."},
  };
  uint64_t EngineArenaPoolStats::*const pool_fields[] = {&EngineArenaPoolStats::pooled_bytes,
                                                         &EngineArenaPoolStats::hits,
                                                         &EngineArenaPoolStats::new_arenas};
  for (size_t i = 0; i < std::size(pool_fields); ++i) {
    RETURN_IF_ERROR(metrics_.AddCallbackGaugeFamily(
        pool_help[i].first, pool_help[i].second, {"engine"},
        [this, field = pool_fields[i]]() -> std::vector<CallbackSample> {
          std::vector<CallbackSample> samples;
          for (const auto& [engine, stats] : arena_pool_.Stats()) {
            samples.push_back({.label_values = {std::to_string(engine)},
                               .value = static_cast<double>(stats.*field)});
          }
          return samples;
        }));
  }

  // The prefix cache (absent when disabled: the families then have no samples).
  auto prefix = [this](auto read) {
    return [this, read]() -> std::vector<CallbackSample> {
      if (prefix_cache_ == nullptr) return {};
      return read(prefix_cache_->Stats());
    };
  };
  auto one = [](uint64_t value) {
    return std::vector<CallbackSample>{{.label_values = {}, .value = static_cast<double>(value)}};
  };
  RETURN_IF_ERROR(metrics_.AddCallbackGaugeFamily(
      "memra_prefix_lookups", "Prefix lookups by result (hit, partial, miss), since start.",
      {"result"}, prefix([](const PrefixCacheStats& s) {
        return std::vector<CallbackSample>{
            {.label_values = {"hit"}, .value = static_cast<double>(s.lookup_hits)},
            {.label_values = {"partial"}, .value = static_cast<double>(s.lookup_partials)},
            {.label_values = {"miss"}, .value = static_cast<double>(s.lookup_misses)}};
      })));
  const std::pair<const char*, const char*> prefix_help[] = {
      {"memra_prefix_tokens_restored", "Tokens restored from prefix entries, since start."},
      {"memra_prefix_stored_bytes", "Bytes the prefix cache stores (shared blocks once)."},
      {"memra_prefix_entries", "Prefix entries stored."},
      {"memra_prefix_evictions", "Prefix entries evicted (budget or admission), since start."},
      {"memra_prefix_dropped", "Prefix entries dropped (checksum mismatch), since start."},
      {"memra_prefix_captures", "Prefix entries captured, since start."},
  };
  uint64_t PrefixCacheStats::*const prefix_fields[] = {
      &PrefixCacheStats::tokens_restored, &PrefixCacheStats::stored_bytes,
      &PrefixCacheStats::entries,         &PrefixCacheStats::evicted_entries,
      &PrefixCacheStats::dropped_entries, &PrefixCacheStats::captures,
  };
  for (size_t i = 0; i < std::size(prefix_fields); ++i) {
    RETURN_IF_ERROR(metrics_.AddCallbackGaugeFamily(
        prefix_help[i].first, prefix_help[i].second, {},
        prefix([one, field = prefix_fields[i]](const PrefixCacheStats& s) {
          return one(s.*field);
        })));
  }
  // Slab storage under the stored bytes (server/store/slab_allocator.h).
  const std::pair<const char*, const char*> slab_help[] = {
      {"memra_prefix_slabs", "Slabs (arenas) the prefix cache's storage lives in."},
      {"memra_prefix_slab_bytes", "Bytes of those slabs: what the device budget is charged."},
      {"memra_prefix_slab_free_bytes",
       "Free bytes inside slabs that hold stored pieces (fragmentation)."},
      {"memra_prefix_slab_empty_bytes", "Bytes of emptied slabs kept for the next capture."},
  };
  uint64_t SlabStats::*const slab_fields[] = {&SlabStats::slabs, &SlabStats::slab_bytes,
                                              &SlabStats::free_bytes, &SlabStats::empty_bytes};
  for (size_t i = 0; i < std::size(slab_fields); ++i) {
    RETURN_IF_ERROR(metrics_.AddCallbackGaugeFamily(
        slab_help[i].first, slab_help[i].second, {},
        prefix([one, field = slab_fields[i]](const PrefixCacheStats& s) {
          return one(s.slabs.*field);
        })));
  }
  // Tiers (server/store/prefix_cache.h): one sample per tier the daemon has, labelled by medium.
  const std::pair<const char*, const char*> tier_help[] = {
      {"memra_prefix_tier_stored_bytes", "Bytes of prefix pieces in each tier (device, disk)."},
      {"memra_prefix_tier_budget_bytes", "Each prefix tier's budget."},
      {"memra_prefix_tier_hits", "Restores whose slowest piece was in this tier, since start."},
      {"memra_prefix_tier_promotions", "Prefix pieces moved out of this tier by restores, since "
                                       "start."},
      {"memra_prefix_tier_demotions", "Prefix pieces moved into this tier (LRU), since start."},
  };
  uint64_t PrefixTierStats::*const tier_fields[] = {
      &PrefixTierStats::stored_bytes, &PrefixTierStats::budget_bytes, &PrefixTierStats::hits,
      &PrefixTierStats::promotions, &PrefixTierStats::demotions};
  for (size_t i = 0; i < std::size(tier_fields); ++i) {
    RETURN_IF_ERROR(metrics_.AddCallbackGaugeFamily(
        tier_help[i].first, tier_help[i].second, {"medium"},
        prefix([field = tier_fields[i]](const PrefixCacheStats& s) {
          std::vector<CallbackSample> samples;
          for (const PrefixTierStats& tier : s.tiers) {
            samples.push_back({.label_values = {std::string(StorageMediumName(tier.medium))},
                               .value = static_cast<double>(tier.*field)});
          }
          return samples;
        })));
  }
  RETURN_IF_ERROR(metrics_.AddCallbackGauge(
      "memra_restart_survival",
      "1 while the KV would survive this daemon's crash (a service manager keeps its journal and "
      "arenas); 0 when it would not (none configured, or the service manager stopped answering).",
      [this] {
        return restart_survival().state == RestartSurvival::State::kOn ? 1.0 : 0.0;
      }));
  // The remote tier (server/store/remote/remote_tier.h): no samples without one.
  auto remote = [prefix](auto read) {
    return prefix([read](const PrefixCacheStats& s) -> std::vector<CallbackSample> {
      if (!s.remote.has_value()) return {};
      return read(*s.remote);
    });
  };
  RETURN_IF_ERROR(metrics_.AddCallbackGaugeFamily(
      "memra_prefix_remote_up",
      "1 while the remote tier's Redis Cluster answers (client made, circuit breaker closed).",
      {}, remote([](const RemoteTierStats& r) {
        return std::vector<CallbackSample>{{.label_values = {}, .value = r.up ? 1.0 : 0.0}};
      })));
  RETURN_IF_ERROR(metrics_.AddCallbackGaugeFamily(
      "memra_prefix_remote_writes",
      "Remote-tier writes by result (written, dropped: queue full or tier down, error), since "
      "start.",
      {"result"}, remote([](const RemoteTierStats& r) {
        return std::vector<CallbackSample>{
            {.label_values = {"written"}, .value = static_cast<double>(r.writes)},
            {.label_values = {"dropped"}, .value = static_cast<double>(r.dropped_writes)},
            {.label_values = {"error"}, .value = static_cast<double>(r.write_errors)}};
      })));
  RETURN_IF_ERROR(metrics_.AddCallbackGaugeFamily(
      "memra_prefix_remote_reads",
      "Remote-tier reads by result (ok, error, timeout: past the caller's deadline, refused: "
      "tier down or readers busy), since start.",
      {"result"}, remote([](const RemoteTierStats& r) {
        return std::vector<CallbackSample>{
            {.label_values = {"ok"}, .value = static_cast<double>(r.reads)},
            {.label_values = {"error"}, .value = static_cast<double>(r.read_errors)},
            {.label_values = {"timeout"}, .value = static_cast<double>(r.read_timeouts)},
            {.label_values = {"refused"}, .value = static_cast<double>(r.read_refusals)}};
      })));
  RETURN_IF_ERROR(metrics_.AddCallbackGaugeFamily(
      "memra_prefix_remote_refused_values",
      "Remote values refused by a restore (corrupt: DATA_LOSS, deleted; shape_mismatch: "
      "another build or plan), since start.",
      {"reason"}, remote([](const RemoteTierStats& r) {
        return std::vector<CallbackSample>{
            {.label_values = {"corrupt"}, .value = static_cast<double>(r.corrupt)},
            {.label_values = {"shape_mismatch"},
             .value = static_cast<double>(r.shape_mismatches)}};
      })));
  const std::pair<const char*, const char*> remote_help[] = {
      {"memra_prefix_remote_written_bytes", "Bytes of values the remote tier wrote, since start."},
      {"memra_prefix_remote_pulled_bytes",
       "Bytes of verified pieces restores pulled from the remote tier, since start."},
      {"memra_prefix_remote_queued_bytes", "Bytes queued for the remote tier's writer."},
      {"memra_prefix_remote_breaker_opens",
       "Times the remote tier's circuit breaker opened (cluster down), since start."},
      {"memra_prefix_remote_partial_lookups",
       "Remote-tier lookups answered for some keys only (a node down or in back-off: its keys "
       "read as misses; also counted as reads ok), since start."},
  };
  uint64_t RemoteTierStats::*const remote_fields[] = {
      &RemoteTierStats::written_bytes, &RemoteTierStats::pulled_bytes,
      &RemoteTierStats::queued_bytes, &RemoteTierStats::breaker_opens,
      &RemoteTierStats::partial_lookups};
  for (size_t i = 0; i < std::size(remote_fields); ++i) {
    RETURN_IF_ERROR(metrics_.AddCallbackGaugeFamily(
        remote_help[i].first, remote_help[i].second, {},
        remote([field = remote_fields[i]](const RemoteTierStats& r) {
          return std::vector<CallbackSample>{
              {.label_values = {}, .value = static_cast<double>(r.*field)}};
        })));
  }
  RETURN_IF_ERROR(metrics_.AddCallbackGaugeFamily(
      "memra_prefix_remote_cluster_events",
      "The Redis Cluster client's counters (moved, ask: redirects followed; refresh: slot maps "
      "applied; connect; connection_failure; node_down_refusal: calls refused without I/O "
      "while their node was in back-off), since start.",
      {"event"}, remote([](const RemoteTierStats& r) {
        const RedisClusterStats& c = r.cluster;
        return std::vector<CallbackSample>{
            {.label_values = {"moved"}, .value = static_cast<double>(c.moved_redirects)},
            {.label_values = {"ask"}, .value = static_cast<double>(c.ask_redirects)},
            {.label_values = {"refresh"}, .value = static_cast<double>(c.slot_map_refreshes)},
            {.label_values = {"connect"}, .value = static_cast<double>(c.connects)},
            {.label_values = {"connection_failure"},
             .value = static_cast<double>(c.connection_failures)},
            {.label_values = {"node_down_refusal"},
             .value = static_cast<double>(c.node_down_refusals)}};
      })));
  RETURN_IF_ERROR(metrics_.AddCallbackGaugeFamily(
      "memra_prefix_slab_fragmentation",
      "Share (0-1) of the bytes of occupied slabs that no stored piece uses.", {},
      prefix([](const PrefixCacheStats& s) {
        return std::vector<CallbackSample>{
            {.label_values = {}, .value = static_cast<double>(s.slabs.fragmentation_ppm) / 1e6}};
      })));

  if (!start_config_.rpc_metrics || start_config_.metrics_address.empty()) {
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
  if (start_config_.metrics_address.empty()) return;
  absl::StatusOr<std::unique_ptr<metrics::MetricsHttpServer>> http =
      metrics::MetricsHttpServer::Start(start_config_.metrics_address, &metrics_);
  if (!http.ok()) {
    spdlog::error("metrics are off: {} (memra-kvd keeps serving; fix metrics_address)",
                  http.status().ToString());
    return;
  }
  spdlog::info("metrics on http://{}/metrics (port {})", start_config_.metrics_address,
               (*http)->bound_port());
  absl::MutexLock lock(&mu_);
  metrics_http_ = *std::move(http);
}

int Daemon::metrics_port() const {
  absl::MutexLock lock(&mu_);
  return metrics_http_ == nullptr ? 0 : metrics_http_->bound_port();
}

}  // namespace memra
