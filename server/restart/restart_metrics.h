#ifndef MEMRA_SERVER_RESTART_RESTART_METRICS_H_
#define MEMRA_SERVER_RESTART_RESTART_METRICS_H_

// Restart survival's Prometheus metric (README.md "Metrics").

#include <functional>

#include "absl/status/status.h"
#include "server/metrics/metrics.h"
#include "server/session/state_journal.h"

namespace memra {

// Registers memra_restart_survival, read at scrape time from `survival`. The registry's
// refusals pass through. REQUIRES: what `survival` reads outlives `registry`'s scrapes.
absl::Status RegisterRestartMetrics(std::function<RestartSurvival()> survival,
                                    metrics::Registry& registry);

}  // namespace memra

#endif  // MEMRA_SERVER_RESTART_RESTART_METRICS_H_
