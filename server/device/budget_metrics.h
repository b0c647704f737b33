#ifndef MEMRA_SERVER_DEVICE_BUDGET_METRICS_H_
#define MEMRA_SERVER_DEVICE_BUDGET_METRICS_H_

// The admission budget's Prometheus metrics (README.md "Metrics"): the ledger's figures, read
// at scrape time, and the refusals for room.

#include "absl/status/status.h"
#include "server/device/device_budget.h"
#include "server/metrics/metrics.h"

namespace memra {

// Registers memra_budget_bytes, memra_reserved_bytes, memra_allocated_bytes, memra_free_bytes,
// memra_evictable_bytes, memra_reservations and memra_admission_refusals. The registry's
// refusals (a name taken twice) pass through. REQUIRES: `budget` outlives `registry`'s scrapes.
absl::Status RegisterBudgetMetrics(const DeviceBudget* budget, metrics::Registry& registry);

}  // namespace memra

#endif  // MEMRA_SERVER_DEVICE_BUDGET_METRICS_H_
