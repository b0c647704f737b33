#ifndef MEMRA_SERVER_STORE_PREFIX_CACHE_METRICS_H_
#define MEMRA_SERVER_STORE_PREFIX_CACHE_METRICS_H_

// The prefix cache's Prometheus metrics (README.md "Metrics"), read at scrape time from
// PrefixCache::Stats(): lookups, entries, slabs, tiers and (server/store/remote/
// remote_tier_metrics.h) its remote tier.

#include "absl/status/status.h"
#include "server/metrics/metrics.h"
#include "server/store/prefix_cache.h"

namespace memra {

// Registers the memra_prefix_* families. `cache` may be null (no prefix cache): the families
// then have no samples. The registry's refusals pass through. REQUIRES: `cache` outlives
// `registry`'s scrapes.
absl::Status RegisterPrefixCacheMetrics(const PrefixCache* cache, metrics::Registry& registry);

}  // namespace memra

#endif  // MEMRA_SERVER_STORE_PREFIX_CACHE_METRICS_H_
