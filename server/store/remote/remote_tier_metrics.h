#ifndef MEMRA_SERVER_STORE_REMOTE_REMOTE_TIER_METRICS_H_
#define MEMRA_SERVER_STORE_REMOTE_REMOTE_TIER_METRICS_H_

// The remote tier's Prometheus metrics (README.md "Metrics", docs/remote-tier.md): whether the
// cluster answers, writes, reads, refused values, bytes and the cluster client's counters.

#include <functional>
#include <optional>

#include "absl/status/status.h"
#include "server/metrics/metrics.h"
#include "server/store/remote/remote_tier.h"

namespace memra {

// Registers the memra_prefix_remote_* families, each read at scrape time from `read_stats`;
// nullopt (no remote tier) gives no samples. The registry's refusals pass through.
// REQUIRES: what `read_stats` reads outlives `registry`'s scrapes.
absl::Status RegisterRemoteTierMetrics(std::function<std::optional<RemoteTierStats>()> read_stats,
                                       metrics::Registry& registry);

}  // namespace memra

#endif  // MEMRA_SERVER_STORE_REMOTE_REMOTE_TIER_METRICS_H_
