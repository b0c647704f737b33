#include "server/device/budget_metrics.h"

#include "core/admission.h"
#include "core/status_macros.h"

namespace memra {

absl::Status RegisterBudgetMetrics(const DeviceBudget* budget, metrics::Registry& registry) {
  auto ledger_gauge = [&](const char* name, const char* help, auto read) {
    return registry.AddCallbackGauge(name, help, [budget, read] {
      return static_cast<double>(read(budget->Snapshot()));
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
  RETURN_IF_ERROR(registry.AddCallbackGauge(
      "memra_admission_refusals", "Admissions refused for room (RESOURCE_EXHAUSTED), since start.",
      [budget] { return static_cast<double>(budget->refusals()); }));
  return absl::OkStatus();
}

}  // namespace memra
