#ifndef MEMRA_SERVER_SESSION_SESSION_METRICS_H_
#define MEMRA_SERVER_SESSION_SESSION_METRICS_H_

// The session layer's Prometheus metrics (README.md "Metrics"), read at scrape time: sessions,
// engines and their lease events, and each engine's arena pool. Each function registers one
// part's; the registry's refusals (a name taken twice) pass through. REQUIRES: the part
// outlives `registry`'s scrapes.

#include "absl/status/status.h"
#include "server/metrics/metrics.h"
#include "server/session/arena_pool.h"
#include "server/session/engine_leases.h"
#include "server/session/session_registry.h"

namespace memra {

// memra_sessions.
absl::Status RegisterSessionMetrics(const SessionRegistry* sessions, metrics::Registry& registry);
// memra_engines, memra_lease_expiries, memra_engines_reclaimed, memra_reservations_expired.
absl::Status RegisterLeaseMetrics(const EngineLeases* leases, metrics::Registry& registry);
// memra_arena_pool_bytes, memra_arena_pool_hits, memra_session_arenas_created: per engine.
absl::Status RegisterArenaPoolMetrics(const ArenaPool* pool, metrics::Registry& registry);

}  // namespace memra

#endif  // MEMRA_SERVER_SESSION_SESSION_METRICS_H_
