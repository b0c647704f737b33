#ifndef MEMRA_SERVER_SESSION_REGISTRY_H_
#define MEMRA_SERVER_SESSION_REGISTRY_H_

// The daemon's live sessions: creating (with admission and the engine's lease checked), finding
// by id and token, releasing, reclaiming an engine's sessions, and THE dispatcher of session
// operations: Apply() is the only code that runs an operation on a session; the unary RPCs and
// every Step entry reach it through Run() with a typed SessionOp (the service decodes the wire
// into the op once, and encodes the status once).
//
// Thread-safety: thread-safe. `mu_` guards the session map only; the per-step hot path takes it
// for one lookup and then the one session's own mutex. Lock order: `mu_` before EngineLeases'
// lock (Create re-checks the engine under `mu_`, so a session is either refused or visible to
// the reclaim of its engine that follows: no session outlives its engine's lease).
//
// Invariants: (1) every session in the map is in its owner's index entry and in its slot, and
// vice versa; (2) a session removed from the map is released exactly once, by whoever removed
// it; (3) a slot is free, reserved by exactly one creation, or holds exactly one session.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/admission.h"
#include "core/formats.h"
#include "core/model_plan.h"
#include "core/sizing.h"
#include "server/session/arena_pool.h"
#include "server/device/backend.h"
#include "server/session/daemon_session.h"
#include "server/device/device_budget.h"
#include "server/session/engine_leases.h"
#include "server/session/engine_time_shares.h"
#include "server/session/plan_registry.h"
#include "server/session/session_ops.h"
#include "server/store/prefix_cache.h"
#include "server/session/state_journal.h"
#include "common/daemon_restart.h"

namespace memra {

// What a session is named by on every call: its id and the token CreateSession handed out.
struct SessionCredentials {
  SessionId id;
  absl::string_view token;
};
// Or, on the per-step path, its dense slot, for an engine the caller authenticated
// (EngineLeases::Check): only the engine that owns the session may name its slot.
struct SessionSlot {
  EngineId engine;
  uint32_t slot = 0;
};

struct ArenaReservation {
  ReservationId id;
  uint64_t bytes = 0;
  absl::Duration ttl;
};

struct ReleasedSessions {
  size_t sessions = 0;
  uint64_t bytes = 0;
};

// One ReleaseSession as the engine is told it.
struct SessionRelease {
  uint64_t bytes = 0;  // what the session held, freed or pooled
  // Arenas the pool kept for the engine's next sessions: its client may keep them mapped.
  std::vector<std::string> pooled_handles;
  // Arenas the engine's pool has freed since it was last told: its client unmaps them.
  std::vector<std::string> unmap_handles;
};

// One engine's share of the sessions (KvAdmin's engine status).
struct EngineSessionUsage {
  size_t sessions = 0;
  uint64_t arena_bytes = 0;
};

class SessionRegistry {
 public:
  // `capture_on_reclaim`: when set, a reclaimed engine's sessions keep their committed state
  // as prefix entries there before release. `max_sessions_per_engine`: DaemonConfig
  // max_engine_sessions. `pool`: when set, released arenas are pooled per engine and reused
  // (server/session/arena_pool.h); an engine's pool is freed with its sessions at reclaim.
  // `journal`: where sessions' committed state is recorded for a restart (null: nowhere).
  // `time_shares`: when set, every session operation and CreateSession runs within its
  // engine's share of the daemon's time (server/session/engine_time_shares.h) and is refused
  // RESOURCE_EXHAUSTED past it, before anything runs.
  // REQUIRES: every pointer outlives the registry.
  SessionRegistry(DeviceBackend* backend, DeviceBudget* budget, EngineLeases* leases,
                  PlanRegistry* plans, FormatDefaults defaults, PrefixCache* capture_on_reclaim,
                  uint64_t max_sessions_per_engine = UINT64_MAX, ArenaPool* pool = nullptr,
                  StateJournal* journal = nullptr, EngineTimeShares* time_shares = nullptr);

  // Plans, charges (from `reservation` when given) and allocates a session of `shape` for the
  // engine; UNAVAILABLE while draining, the engine's refusals (EngineLeases::Check),
  // RESOURCE_EXHAUSTED when the engine holds (or is creating) max_sessions_per_engine, the
  // plan's NOT_FOUND and DaemonSession::Create's refusals. A session whose engine lost its lease (or
  // the daemon started draining) while its arena was allocated is released, never visible.
  absl::StatusOr<std::shared_ptr<DaemonSession>> Create(const EngineCredentials& engine,
                                                        const PlanFingerprint& plan,
                                                        const SessionShape& shape,
                                                        std::optional<ReservationId> reservation)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Reserves the exact bytes a session of `shape` will be charged.
  absl::StatusOr<ArenaReservation> Reserve(const EngineCredentials& engine,
                                             const PlanFingerprint& plan,
                                             const SessionShape& shape) ABSL_LOCKS_EXCLUDED(mu_);
  // The same for one rank of a group (docs/groups.md), held until `deadline` unless confirmed
  // (ArenaReservation::ttl is the deadline). `expected_bytes` > 0 must equal the shape's price
  // (FAILED_PRECONDITION naming both).
  absl::StatusOr<ArenaReservation> ReserveGroupRank(const EngineCredentials& engine,
                                                    const PlanFingerprint& plan,
                                                    const SessionShape& shape, GroupRankKey group,
                                                    absl::Duration deadline,
                                                    uint64_t expected_bytes)
      ABSL_LOCKS_EXCLUDED(mu_);

  // ---- Restart survival (server/restart/restart_state.h) ----
  // Files a session a restarted daemon re-adopted (DaemonSession::Adopt) in the slot it had
  // (engines address it by that slot); ids issued later are above it. ALREADY_EXISTS for an id
  // or a slot already filed; OUT_OF_RANGE for a slot not below `slot_limit` (the previous
  // journal's session_slot_limit: slots are dense, so a slot past it is a corrupt record, and
  // filing it would grow the slot table to its number).
  absl::Status Readopt(std::shared_ptr<DaemonSession> session, uint64_t slot_limit)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Ids issued from now on are >= `next` (the previous daemon's high-water mark).
  void RaiseNextSessionId(uint64_t next);
  // This daemon restarted from `restart.previous_epoch`; sessions in `not_readopted` (id -> why)
  // get the restart error instead of NOT_FOUND. `unreadable_records` journal records could not
  // be read (every copy damaged): an unknown id below `issued_below` (the previous daemon's
  // next session id) may have been one of them, and gets the restart error saying so.
  void SetRestart(DaemonRestart restart, absl::flat_hash_map<uint64_t, std::string> not_readopted,
                  uint64_t unreadable_records = 0, uint64_t issued_below = 0)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The session parameters every session of this registry gets (the journal, the defaults).
  DaemonSession::Params BaseParams() const;

  // The session: NOT_FOUND unknown id (the restart error for one a restart did not re-adopt),
  // PERMISSION_DENIED wrong token.
  absl::StatusOr<std::shared_ptr<DaemonSession>> Find(const SessionCredentials& session) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // The session in the slot: NOT_FOUND "slot N holds no session of engine E" both for an empty
  // slot and for one another engine's session holds (indistinguishable to the caller).
  absl::StatusOr<std::shared_ptr<DaemonSession>> Find(const SessionSlot& slot) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Removes and releases the session.
  absl::StatusOr<SessionRelease> Release(const SessionCredentials& session)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The handles of `engine`'s pooled arenas freed since it was last told (CreateSession's
  // reply carries them), emptied.
  std::vector<std::string> TakeUnmapped(EngineId engine);

  // THE operation dispatcher: runs `op` on `session` and returns its result
  // (server/session/session_ops.h names each operation's).
  static absl::StatusOr<SessionResult> Apply(DaemonSession& session, const SessionOp& op);
  // Authenticates the session, runs `before` (the engine's device ordering: after the
  // authentication, so nobody makes the daemon wait for a session not theirs), then applies
  // `ops` in order, stopping at the first refusal; their results, in order.
  absl::StatusOr<std::vector<SessionResult>> Run(const SessionCredentials& session,
                                                 absl::Span<const SessionOp> ops,
                                                 absl::FunctionRef<absl::Status()> before)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<SessionResult> Run(const SessionCredentials& session, const SessionOp& op)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<SessionResult> Run(const SessionSlot& slot, const SessionOp& op)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The sessions in `slots` (of engine `engine`), each in the same place of `out` (null where
  // Find(slot) would refuse: SlotRefusal says how), under ONE acquisition of the registry's
  // lock: the step channel resolves a round of records with it. REQUIRES: out.size() ==
  // slots.size().
  void FindSlots(EngineId engine, absl::Span<const uint32_t> slots,
                 absl::Span<std::shared_ptr<DaemonSession>> out) const ABSL_LOCKS_EXCLUDED(mu_);
  // Find(slot)'s refusal for a slot that holds no session of the engine.
  static absl::Status SlotRefusal(const SessionSlot& slot);
  // As Run on a session found already, but never waits for a long operation holding it
  // (DaemonSession::RunUnlessBusy): nullopt, with nothing run, when one does. For short
  // operations: INVALID_ARGUMENT for a GrowOp (itself a long one).
  // `charged_by_caller`: the caller admitted the owner and charges its time for a batch of
  // operations (the step channel, once per round); otherwise each operation is admitted and
  // charged here.
  std::optional<absl::StatusOr<SessionResult>> TryApply(DaemonSession& session,
                                                        const SessionOp& op,
                                                        bool charged_by_caller = false);
  // OK, or `engine`'s refusal for its share of the daemon's time (EngineTimeShares::Admit).
  absl::Status AdmitWork(EngineId engine);
  // The shares charged (null: none), for a caller that charges a batch itself.
  EngineTimeShares* time_shares() const { return time_shares_; }
  // As Run(slot, op), but never waits for a session a long operation holds
  // (DaemonSession::RunUnlessBusy): nullopt, with nothing run, when one does. For short
  // operations: INVALID_ARGUMENT for a GrowOp (itself a long one).
  std::optional<absl::StatusOr<SessionResult>> TryRun(const SessionSlot& slot,
                                                      const SessionOp& op)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Removes and releases every session of `engine` (its lease was reclaimed), each exactly
  // once, then frees its arena pool.
  ReleasedSessions ReleaseOwnedBy(EngineId engine) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes and releases every session and frees every pool (shutdown).
  ReleasedSessions ReleaseAll() ABSL_LOCKS_EXCLUDED(mu_);

  // Waits until no session is open, `grace` has passed or EndWaits() is called; the sessions
  // still open.
  size_t AwaitEmpty(absl::Duration grace) ABSL_LOCKS_EXCLUDED(mu_);
  void EndWaits() ABSL_LOCKS_EXCLUDED(mu_);

  size_t size() const ABSL_LOCKS_EXCLUDED(mu_);
  // The sessions (of `engine` when given), by id.
  std::vector<std::shared_ptr<DaemonSession>> List(std::optional<EngineId> engine) const
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::flat_hash_map<uint64_t, EngineSessionUsage> UsageByEngine() const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Each engine's arena pool figures (empty without a pool).
  absl::flat_hash_map<uint64_t, EngineArenaPoolStats> PoolStatsByEngine() const;

  // How the backend rounds an arena (what admission charges).
  ArenaRounding rounding() const;
  const FormatDefaults& format_defaults() const { return defaults_; }

 private:
  // Apply, then the session's journal record: every Run (by credentials or by slot) ends here
  // or journals the same way, so what an engine is told happened is what a restart restores.
  // Runs within the owner's share of the daemon's time (AdmitWork, then charged).
  absl::StatusOr<SessionResult> ApplyAndJournal(DaemonSession& session, const SessionOp& op);
  // ApplyAndJournal without the time share (its caller admitted and charges).
  static absl::StatusOr<SessionResult> ApplyAndJournalUncharged(DaemonSession& session,
                                                                const SessionOp& op);
  // The same for `op`, except that what ends the engine's own work (Abort, AcknowledgeGrow) is
  // always admitted.
  absl::Status AdmitWork(EngineId engine, const SessionOp& op);
  // Removes `ids` (and their index entries) from the map; the sessions removed.
  std::vector<std::shared_ptr<DaemonSession>> RemoveLocked(const std::vector<uint64_t>& ids)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Create()'s session, allocated and charged but not yet in the map.
  absl::StatusOr<std::shared_ptr<DaemonSession>> AllocateSession(
      const EngineCredentials& engine, uint32_t slot, const PlanFingerprint& plan,
      const SessionShape& shape, std::optional<ReservationId> reservation)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Counts a session `engine` is about to create against max_sessions_per_engine (those it
  // holds and those being created); RESOURCE_EXHAUSTED naming both numbers when none is left.
  // On OK returns the slot reserved for the session; the caller calls EndCreating(engine) under
  // mu_ as it puts the session in the map (and its slot) or gives up on it (FreeSlotLocked).
  absl::StatusOr<uint32_t> BeginCreating(EngineId engine) ABSL_LOCKS_EXCLUDED(mu_);
  void EndCreating(EngineId engine) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FreeSlotLocked(uint32_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Engine death: keeps the session's committed state as a prefix entry when configured.
  void CaptureBeforeRelease(DaemonSession& session);

  DeviceBackend* const backend_;
  DeviceBudget* const budget_;
  EngineLeases* const leases_;
  PlanRegistry* const plans_;
  const FormatDefaults defaults_;
  PrefixCache* const capture_on_reclaim_;
  const uint64_t max_sessions_per_engine_;
  ArenaPool* const pool_;
  StateJournal* const journal_;
  EngineTimeShares* const time_shares_;

  std::atomic<uint64_t> next_session_id_{1};

  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<DaemonSession>> sessions_ ABSL_GUARDED_BY(mu_);
  // Engine id -> the ids of its sessions.
  absl::flat_hash_map<uint64_t, absl::flat_hash_set<uint64_t>> by_engine_ ABSL_GUARDED_BY(mu_);
  bool waits_ended_ ABSL_GUARDED_BY(mu_) = false;
  // Engine id -> sessions between BeginCreating and EndCreating (absent when none).
  absl::flat_hash_map<uint64_t, uint64_t> creating_ ABSL_GUARDED_BY(mu_);
  std::optional<DaemonRestart> restart_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, std::string> not_readopted_ ABSL_GUARDED_BY(mu_);
  uint64_t unreadable_records_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t issued_below_ ABSL_GUARDED_BY(mu_) = 0;
  // Dense slots: slots_[i] is the live session in slot i, or null (free, or reserved by a
  // session being created). Its size never exceeds the most sessions live or being created
  // at once: a slot is reused (free_slots_, last freed first) before a new one is added.
  std::vector<std::shared_ptr<DaemonSession>> slots_ ABSL_GUARDED_BY(mu_);
  std::vector<uint32_t> free_slots_ ABSL_GUARDED_BY(mu_);
};

}  // namespace memra

#endif  // MEMRA_SERVER_SESSION_REGISTRY_H_
