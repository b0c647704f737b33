#ifndef MEMRA_SERVER_RESTART_READOPT_H_
#define MEMRA_SERVER_RESTART_READOPT_H_

// Re-adoption: the inverse of what RestartState journals (server/restart/restart_state.h). A
// starting daemon, before it serves, takes back what the previous daemon kept in the service
// manager's fd store: its model plans, engines and sessions at their committed length. What
// cannot come back is named, logged and journaled as lost, so its engine gets the restart error
// (common/daemon_restart.h) from this daemon and the next ones until the engine is reclaimed.
//
// Thread-safety: runs once, before the daemon serves; the parts it fills are thread-safe.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/time/time.h"
#include "server/device/backend.h"
#include "server/device/device_budget.h"
#include "server/restart/restart_state.h"
#include "server/session/engine_leases.h"
#include "server/session/plan_registry.h"
#include "server/session/session_registry.h"

namespace memra {

// What a start re-adopted from a previous daemon (all zero on a first start).
struct Readopted {
  uint64_t previous_epoch = 0;  // 0: nothing was re-adopted
  size_t engines = 0;
  size_t sessions = 0;
  uint64_t bytes = 0;
  size_t not_readopted = 0;
  size_t torn_records = 0;
  absl::Duration took;
};

// The parts a re-adoption fills. `restart_state` is null when this daemon keeps no journal;
// the others are non-null. REQUIRES: all outlive the call.
struct ReadoptParts {
  PlanRegistry* plans;
  EngineLeases* leases;
  SessionRegistry* sessions;
  DeviceBackend* backend;
  DeviceBudget* budget;
  RestartState* restart_state;
  uint64_t epoch;  // this daemon's
};

// What this daemon keeps for the next one: its journal, or why nothing.
struct RestartKeeping {
  std::unique_ptr<RestartState> state;  // null: nothing is kept
  std::string off;                      // why `state` is null (KvAdmin status, metrics)
};
struct RestartKeepingOptions {
  bool keep = true;  // keep_kv_across_restarts
  // Why the device memory cannot outlive this daemon (cuda_export = ipc); empty: it can.
  std::string memory_dies;
  uint64_t slots = 0;  // journal records: arenas + engines
  uint64_t epoch = 0;  // this daemon's
};
// Decides whether this daemon keeps its state for a restart (configured, under a service
// manager, memory that outlives it) and makes the journal, generation after `previous`'s. A
// journal that cannot be made is logged and named in `off`, never fatal: the cache matters more
// than surviving the next restart. When nothing is kept, `previous` is dropped
// (DropPreviousDaemon) and reset. REQUIRES: `backend` outlives the state.
RestartKeeping KeepForRestart(const RestartKeepingOptions& options,
                              std::optional<PreviousDaemon>& previous, DeviceBackend* backend);

// Re-adopts what `previous` kept: plans, engines, sessions at their committed length; publishes
// this daemon's journal and removes the previous daemon's leftovers from the store.
Readopted Readopt(PreviousDaemon previous, const ReadoptParts& parts);

// Drops what `previous` kept, for a daemon that keeps no restart journal: nothing would journal
// what re-adopted sessions do from now on, so a later restart would bring this start's records
// back over changed memory. Removes every kept name from the service manager's store.
void DropPreviousDaemon(PreviousDaemon previous);

}  // namespace memra

#endif  // MEMRA_SERVER_RESTART_READOPT_H_
