#include "server/restart/restart_metrics.h"

#include <utility>

namespace memra {

absl::Status RegisterRestartMetrics(std::function<RestartSurvival()> survival,
                                    metrics::Registry& registry) {
  return registry.AddCallbackGauge(
      "memra_restart_survival",
      "1 while the KV would survive this daemon's crash (a service manager keeps its journal and "
      "arenas); 0 when it would not (none configured, or the service manager stopped answering).",
      [survival] { return survival().state == RestartSurvival::State::kOn ? 1.0 : 0.0; });
}

}  // namespace memra
