#include "server/session/session_metrics.h"

#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "core/status_macros.h"

namespace memra {

using metrics::CallbackSample;

absl::Status RegisterSessionMetrics(const SessionRegistry* sessions, metrics::Registry& registry) {
  RETURN_IF_ERROR(registry.AddCallbackGauge("memra_sessions", "Live sessions.", [sessions] {
    return static_cast<double>(sessions->size());
  }));
  return absl::OkStatus();
}

absl::Status RegisterLeaseMetrics(const EngineLeases* leases, metrics::Registry& registry) {
  RETURN_IF_ERROR(registry.AddCallbackGauge("memra_engines", "Attached engines.", [leases] {
    return static_cast<double>(leases->size());
  }));
  auto event_count = [&](const char* name, const char* help,
                         uint64_t (EngineLeases::*read)() const) {
    return registry.AddCallbackGauge(
        name, help, [leases, read] { return static_cast<double>((leases->*read)()); });
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
  return absl::OkStatus();
}

absl::Status RegisterArenaPoolMetrics(const ArenaPool* pool, metrics::Registry& registry) {
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
    RETURN_IF_ERROR(registry.AddCallbackGaugeFamily(
        pool_help[i].first, pool_help[i].second, {"engine"},
        [pool, field = pool_fields[i]]() -> std::vector<CallbackSample> {
          std::vector<CallbackSample> samples;
          for (const auto& [engine, stats] : pool->Stats()) {
            samples.push_back({.label_values = {std::to_string(engine)},
                               .value = static_cast<double>(stats.*field)});
          }
          return samples;
        }));
  }

  return absl::OkStatus();
}

}  // namespace memra
