#ifndef MEMRA_SERVER_DAEMON_SESSION_H_
#define MEMRA_SERVER_DAEMON_SESSION_H_

// One session as the daemon serves it: core's SessionState (every rule), the arena its planes
// live in, and the device work core's decisions call for (plane copies, i32 length/base mirrors).
//
// Thread-safety: thread-safe; every operation holds this session's own mutex for its whole
// duration (core state change + device work), so operations on one session are serialised and
// operations on different sessions never contend.
//
// Invariants: (1) the mirrors in device memory hold state_.Mirrors() after every operation that
// returned OK; (2) if device work fails after core state changed, the session is tainted before
// the error is returned (never silently half-applied); (3) after Release() every operation is
// NOT_FOUND and no arena is held; (4) previous_ is set only between Grow and AcknowledgeGrow.

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/functional/function_ref.h"
#include "absl/types/span.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "core/formats.h"
#include "core/model_plan.h"
#include "core/session.h"
#include "core/sizing.h"
#include "common/mapped_region.h"
#include "server/session/arena_pool.h"
#include "server/session/session_ops.h"
#include "server/device/backend.h"
#include "server/device/device_budget.h"
#include "server/base/ids.h"
#include "server/device/placement.h"
#include "server/base/secret_token.h"
#include "server/session/state_journal.h"

namespace memra {

class DaemonSession final {
 public:
  struct Params {
    SessionId id;
    EngineId owner;
    // The owner's prefix-cache scope (server/session/cache_scopes.h): where its captures are
    // stored, also after the owner is gone (a capture on engine death).
    std::string cache_scope;
    std::string token;  // 16 random bytes
    std::shared_ptr<const ModelPlan> model;
    std::string fingerprint;  // the model plan's fingerprint bytes
    FormatDefaults defaults;
    SessionShape shape;
    // Where the session's committed state is recorded for a restart; null: nowhere.
    StateJournal* journal = nullptr;
    uint32_t slot = 0;  // the registry's dense slot (StepEntry.slot)
  };

  // Plans the planes (core sizing), charges the arena's exact bytes to `budget` (from
  // `reservation` when given: it must hold exactly those bytes for params.owner), allocates and
  // exports one arena, writes the mirrors. INVALID_ARGUMENT for a bad request or a reservation
  // of another shape; NOT_FOUND for a reservation the owner does not hold; RESOURCE_EXHAUSTED
  // (with an AdmissionRefusal) when the budget has no room. Nothing stays allocated or charged
  // on failure; a reservation refused before its commit stays live.
  // REQUIRES: backend and budget outlive the session.
  //
  // With `pool`, an arena of exactly the session's bytes that the same engine released is
  // reused when there is one (its charge replaces the new one; a reservation is then used and
  // its bytes returned), and Release() gives the arenas back to the pool instead of freeing
  // them. A reused arena is reset as a new session needs it (ClearReusedArena).
  static absl::StatusOr<std::unique_ptr<DaemonSession>> Create(
      Params params, DeviceBackend* backend, DeviceBudget* budget,
      std::optional<ReservationId> reservation = std::nullopt, ArenaPool* pool = nullptr);
  // Restart survival: the session a previous daemon journaled, on `arena` (already adopted by
  // the backend from its kept descriptor, `arena_bytes` of it), at `layout_version` and
  // `record`'s committed state (SessionState::Recover). params.shape.capacity is the layout's
  // capacity. Charges the arena's bytes to params.owner. INVALID_ARGUMENT when the arena's size
  // differs from what the plan places; the budget's refusals; Recover's. On failure nothing is
  // charged and the arena is left to the caller. Its arenas are freed at release, never
  // pooled.
  static absl::StatusOr<std::unique_ptr<DaemonSession>> Adopt(
      Params params, DeviceBackend* backend, DeviceBudget* budget, ArenaId arena,
      uint64_t arena_bytes, uint64_t layout_version, const CommittedRecord& record);
  ~DaemonSession();  // Release()

  // Records the committed state in params().journal when it changed since the last record.
  // Every operation that may change it is followed by this (SessionRegistry::Run, Create,
  // RestoreLocked). No-op without a journal or after Release.
  void JournalNow() ABSL_LOCKS_EXCLUDED(mu_);

  SessionId id() const { return params_.id; }
  const Params& params() const { return params_; }
  EngineId owner() const { return params_.owner; }
  absl::string_view cache_scope() const { return params_.cache_scope; }
  const ModelPlan& model_plan() const { return *params_.model; }
  const FormatDefaults& format_defaults() const { return params_.defaults; }
  const SessionShape& session_shape() const { return params_.shape; }
  uint32_t slot() const { return params_.slot; }
  // Constant-time comparison (the token is a secret).
  bool TokenMatches(absl::string_view token) const;
  // Bytes of the arenas held now (0 after Release).
  uint64_t arena_bytes() const { return arena_bytes_.load(std::memory_order_relaxed); }

  // Transactions (core/session.h rules). Each returns its result (server/session/session_ops.h).
  absl::StatusOr<TransactionId> Begin() ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<AppendPlan> PrepareAppend(uint64_t generation, uint64_t rows)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<PublishedAppend> PublishAppend(uint64_t generation) ABSL_LOCKS_EXCLUDED(mu_);
  // `token_ids`: none, or exactly `accepted_rows` (the committed rows' tokens; INVALID_ARGUMENT
  // otherwise, before anything changes).
  absl::StatusOr<CommittedLength> Commit(uint64_t generation, uint64_t accepted_rows,
                                         absl::Span<const int32_t> token_ids = {})
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<CommittedLength> Abort(uint64_t generation) ABSL_LOCKS_EXCLUDED(mu_);
  // One decode step (SessionState::Advance): all or nothing, mirrors written once at the end.
  // `token_ids` as Commit's, for the finished transaction's accepted rows.
  absl::StatusOr<SessionAdvanced> Advance(const AdvanceRequest& request,
                                          absl::Span<const int32_t> token_ids)
      ABSL_LOCKS_EXCLUDED(mu_);

  absl::Status Rewind(uint64_t target) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<bool> CanRewind(uint64_t target) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Hydrate(uint64_t logical_len, absl::Span<const uint64_t> resident_starts)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status SpecSnapshot() ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status SpecRollback(uint64_t accept_len) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Reset() ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Taint(absl::string_view reason) ABSL_LOCKS_EXCLUDED(mu_);
  // New arena of `target_capacity`, committed rows copied by the daemon, layout version + 1.
  // The old arena stays allocated (engines may still be reading it) until AcknowledgeGrow;
  // both are charged to the budget meanwhile (RESOURCE_EXHAUSTED reports the new arena's bytes).
  // Returns the state and the new layout.
  absl::StatusOr<SessionReport> Grow(uint64_t target_capacity) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status AcknowledgeGrow(uint64_t layout_version) ABSL_LOCKS_EXCLUDED(mu_);

  // The state now, and the current layout when `with_layout`.
  absl::StatusOr<SessionReport> GetState(bool with_layout = false) ABSL_LOCKS_EXCLUDED(mu_);

  // Runs `run` (operations of this session) unless a long operation (Grow, a prefix view or
  // restore, Release: allocation and copies, seconds on a device) holds the session now; false,
  // with nothing run, when one does. For the step channel's one serving thread, which must
  // not wait for one engine's session while it serves every engine.
  bool RunUnlessBusy(absl::FunctionRef<void()> run) ABSL_LOCKS_EXCLUDED(long_op_mu_, mu_);

  // A new descriptor of the arena whose export handle is `handle` (the current layout's, or the
  // previous one's while a grow awaits acknowledgement), for the handoff socket. Never waits on
  // the session's mutex (the handoff thread serves every engine: a Grow holding it for seconds
  // stalled every Attach): it reads the exports' own snapshot, and an arena freed meanwhile is
  // the backend's NOT_FOUND (arena ids are never reused). NOT_FOUND when the session was
  // released or has no arena with that handle; the backend's refusal (cuda: FAILED_PRECONDITION,
  // its exports are IPC handles).
  absl::StatusOr<ArenaFd> DuplicateArenaFd(absl::string_view handle) ABSL_LOCKS_EXCLUDED(mu_);

  // Frees every arena (or pools it for the owner: a session created with a pool, not tainted);
  // later operations are NOT_FOUND. Returns the bytes the session held. Idempotent.
  uint64_t Release() ABSL_LOCKS_EXCLUDED(mu_);
  // The export handles of the arenas Release() pooled (the engine may keep them mapped).
  std::vector<std::string> pooled_handles() const ABSL_LOCKS_EXCLUDED(mu_);

  // ---- Prefix cache hooks (server/session/session_prefix.h; the rules are the store's) ----
  // `committed_tokens`: the token ids of rows [0, committed_len) as commits reported them, or
  // nullopt when unknown (a commit without token ids, a hydration).
  using LockedView = absl::FunctionRef<absl::Status(
      const SessionState& state, const SessionLayoutVersion& layout,
      const std::optional<std::vector<int32_t>>& committed_tokens)>;
  // Runs `view` under the session's mutex (no state change interleaves with its reads).
  absl::Status ViewLocked(LockedView view) ABSL_LOCKS_EXCLUDED(mu_);
  // `restore` validates against the state, performs the device copies and returns the state the
  // session adopts; then the mirrors are written and the committed tokens become
  // token_ids[0, committed_len). Refused while a grow awaits acknowledgement; a refusal of
  // `restore` changes nothing.
  using Restorer = absl::FunctionRef<absl::StatusOr<SessionState>(
      const SessionState& state, const SessionLayoutVersion& layout)>;
  absl::Status RestoreLocked(Restorer restore, absl::Span<const int32_t> token_ids)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  DaemonSession(Params params, DeviceBackend* backend, DeviceBudget* budget, ArenaPool* pool,
                SessionState state, SessionLayoutVersion layout);

  // A pooled arena holds its previous session's bytes. Zeroes what a new session reads before
  // it writes: the recurrent state planes (and their spec copies) and the pool-key planes, as on
  // a fresh arena. K/V, latent and indexer rows are left: no row at or past a length is ever
  // read (rules.md#mirrors), and they were the same engine's. Mirrors are written after.
  absl::Status ClearReusedArena() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Frees the layout's arena and then its admission charge.
  absl::Status FreeLayout(const SessionLayoutVersion& layout) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Status CheckLive() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes every mirror whose value differs from what was last written.
  absl::Status SyncMirrors() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status RunCopies(const SessionLayoutVersion& src, const SessionLayoutVersion& dst,
                         const std::vector<PlaneCopy>& copies) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Device work after a core state change failed: taint, log, return `status`.
  absl::Status TaintAfter(absl::string_view op, absl::Status status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  SessionStatus StatusLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  PlacedLayout PlacedLocked(const SessionLayoutVersion& layout) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UpdateArenaBytes() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After a length moved down: committed_tokens_ follows it (unknown if it grew).
  void TruncateCommittedTokens() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void JournalLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A commit's token ids: none, or exactly `accepted_rows` (INVALID_ARGUMENT otherwise).
  absl::Status CheckCommitTokenIds(uint64_t accepted_rows,
                                   absl::Span<const int32_t> token_ids) const;
  // A commit moved the committed length from `base` to `committed`: the token ids follow.
  void RecordCommittedTokens(uint64_t base, uint64_t committed,
                             absl::Span<const int32_t> token_ids)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Constant after construction.
  const Params params_;
  DeviceBackend* const backend_;
  DeviceBudget* const budget_;
  ArenaPool* const pool_;  // null: arenas are freed on release

  std::atomic<uint64_t> arena_bytes_{0};

  // What DuplicateArenaFd reads: the exported arenas as of the last layout change
  // (UpdateArenaBytes), under a mutex of their own that is held for no work.
  struct ExportedArena {
    std::string handle;
    ArenaId arena;
    uint64_t bytes = 0;
  };
  mutable absl::Mutex exports_mu_ ABSL_ACQUIRED_AFTER(mu_);
  std::vector<ExportedArena> exports_ ABSL_GUARDED_BY(exports_mu_);
  uint64_t exports_version_ ABSL_GUARDED_BY(exports_mu_) = 0;  // the current layout's
  bool exports_released_ ABSL_GUARDED_BY(exports_mu_) = false;

  // Held, before mu_, by the long operations (Grow, ViewLocked, RestoreLocked, Release) and by
  // RunUnlessBusy, which only tries it: so RunUnlessBusy waits on mu_ for short operations only.
  absl::Mutex long_op_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  mutable absl::Mutex mu_;
  SessionState state_ ABSL_GUARDED_BY(mu_);
  SessionLayoutVersion current_ ABSL_GUARDED_BY(mu_);
  std::optional<SessionLayoutVersion> previous_ ABSL_GUARDED_BY(mu_);
  // One per state_.Mirrors() entry, in its order: where that mirror lives in current_'s arena
  // and the value last written there (nullopt: not since current_ became the layout). Emptied
  // when the layout changes; rebuilt when the mirror list's planes differ from it.
  struct MirrorSlot {
    PlaneRef plane;
    uint64_t offset = 0;
    std::optional<int32_t> written;
  };
  std::vector<MirrorSlot> mirror_slots_ ABSL_GUARDED_BY(mu_);
  // SyncMirrors' working storage, kept between calls so an operation allocates nothing for its
  // mirrors (contents meaningless outside SyncMirrors).
  std::vector<MirrorValue> mirror_values_ ABSL_GUARDED_BY(mu_);
  std::vector<I32Write> mirror_writes_ ABSL_GUARDED_BY(mu_);
  bool released_ ABSL_GUARDED_BY(mu_) = false;
  // What the journal last recorded (layout version, committed state, reason): unchanged state
  // is not written again.
  struct Journaled {
    uint64_t layout_version = 0;
    CommittedRecord committed;
    std::string not_recoverable;
    bool operator==(const Journaled&) const = default;
  };
  std::optional<Journaled> journaled_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> pooled_handles_ ABSL_GUARDED_BY(mu_);  // set by Release()
  // Token ids of committed rows; nullopt = unknown (see ViewLocked).
  std::optional<std::vector<int32_t>> committed_tokens_ ABSL_GUARDED_BY(mu_) =
      std::vector<int32_t>();
};

}  // namespace memra

#endif  // MEMRA_SERVER_DAEMON_SESSION_H_
