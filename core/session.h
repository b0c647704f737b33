#ifndef MEMRA_CORE_SESSION_H_
#define MEMRA_CORE_SESSION_H_

// One sequence's cache state (the reference's `Cache`) as the daemon holds it: the session-level
// KV transaction over every K/V layer, the latent layers' lengths and pool-key state, the
// recurrent position, taint, and the spec-decode snapshot. Everything that changes a length goes
// through here; the daemon then performs the plane copies this returns and rewrites the
// device mirrors (Mirrors()).
//
// Invariants: (1) latent layers' len == staged_len() (they are appended by the same forward);
// (2) a latent layer's index_pools_ready <= len / pool, and its live indexer tail
// [pools_ready * pool, len) is resident (index_resident_from <= that start) whenever no append is
// prepared; (3) position() == committed_len()
// except between SpecRollback and the engine's replay (the reference's `pos`); (4) a tainted
// session refuses transactions, snapshots, rollback, capture and reuse.
//
// Thread-safety: a value type; the daemon serialises access per session.

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/latent.h"
#include "core/sizing.h"
#include "core/transaction.h"

namespace memra {

// A plane of this session, by layer and kind (resolved to (arena, offset) by the daemon).
struct PlaneRef {
  uint32_t layer = 0;
  PlaneKind kind = PlaneKind::kKeys;
  bool operator==(const PlaneRef&) const = default;
};

// A byte-range copy between two planes. For grow, `src` is in the source session and `dst` in
// the target session; otherwise both are in this session.
struct PlaneCopy {
  PlaneRef src;
  uint64_t src_offset = 0;
  PlaneRef dst;
  uint64_t dst_offset = 0;
  uint64_t bytes = 0;
  bool operator==(const PlaneCopy&) const = default;
};

// The value a length or base mirror (i32[1]) must hold.
struct MirrorValue {
  PlaneRef plane;
  int32_t value = 0;
  bool operator==(const MirrorValue&) const = default;
};

// What a restarted daemon needs to bring a session back at its committed length
// (server/restart/restart_state.h journals it; SessionState::Committed / Recover).
struct CommittedRecord {
  uint64_t committed_len = 0;
  uint64_t next_generation = 1;
  // Per K/V layer in layer order: a ring layer's base (absolute row at physical row 0); 0 for
  // flat layers.
  std::vector<uint64_t> ring_bases;
  bool tainted = false;
  bool operator==(const CommittedRecord&) const = default;
};

// One decode step of a session in one operation (SessionState::Advance): finish the previous
// step's transaction and open the next one.
struct AdvanceRequest {
  // The transaction to finish (publishing its prepared append first, when it has one the
  // engine has not published), committing `accepted_rows` of its staged rows; 0: none (the
  // session's first step).
  uint64_t generation = 0;
  uint64_t accepted_rows = 0;
  // Rows the next transaction prepares; 0: begin none (the session's last step).
  uint64_t next_rows = 0;
};

struct AdvanceResult {
  bool published = false;             // the finished transaction's append was published here
  std::optional<uint64_t> committed;  // committed length after finishing (generation != 0)
  std::optional<TransactionId> begun;     // next_rows != 0
  std::optional<AppendPlan> prepared;     // next_rows != 0
};

class SessionState {
 public:
  // `cache_id` must be unique per session and layout version: transactions bind to it.
  static absl::StatusOr<SessionState> Create(uint64_t cache_id, const SessionPlan& plan,
                                             uint64_t capacity);

  // Rebuilds a session of `plan` at `capacity` holding `record`: the committed rows published
  // as a hydration at the recorded ring bases (so every ring window stays where the engine's
  // rows are), the generation sequence continued, taint kept. No transaction, no spec snapshot;
  // latent layers take the hydration's conservative residency (only the live indexer tail).
  // INVALID_ARGUMENT / FAILED_PRECONDITION (naming the layer and the numbers) when the record
  // does not fit the plan: a base count that differs from the K/V layers, a base past the
  // committed length, a window the base cannot expose.
  static absl::StatusOr<SessionState> Recover(uint64_t cache_id, const SessionPlan& plan,
                                              uint64_t capacity, const CommittedRecord& record);
  // This state's CommittedRecord. Mid-transaction the committed length is the one kept; ring
  // bases are the current ones (a published rebase moved the committed rows with it).
  CommittedRecord Committed() const;

  uint64_t cache_id() const { return kv_.cache_id(); }
  uint64_t capacity() const { return kv_.capacity(); }
  uint64_t committed_len() const { return kv_.committed_len(); }
  uint64_t staged_len() const { return kv_.staged_len(); }
  uint64_t position() const { return position_; }
  bool tainted() const { return tainted_; }
  bool has_spec_buffers() const { return has_spec_buffers_; }
  bool spec_snapshot_valid() const { return spec_.has_value(); }
  const KvTransactionCache& kv() const { return kv_; }
  const std::vector<LatentLayerState>& latent() const { return latent_; }
  const std::vector<uint32_t>& recurrent_layers() const { return recurrent_layers_; }
  const std::optional<AppendPlan>& pending_append() const { return pending_append_; }

  // Current values of every len/base mirror of this session.
  std::vector<MirrorValue> Mirrors() const;
  // The same into `out` (cleared first), reusing its storage: the daemon calls it after every
  // operation, per session per step.
  void MirrorsInto(std::vector<MirrorValue>& out) const;

  // FAILED_PRECONDITION when tainted, naming `what`.
  absl::Status EnsureUsable(std::string_view what) const;
  void MarkTainted() { tainted_ = true; }

  absl::StatusOr<TransactionId> Begin();
  // Plans the append and remembers it for PublishAppend (one pending plan per transaction).
  absl::StatusOr<AppendPlan> PrepareAppend(uint64_t generation, uint64_t rows);
  // Applies the remembered plan: ring rebases, staged length, latent lengths. A latent layer's
  // pools_ready becomes len / pool (every call boundary leaves the drain there).
  absl::Status PublishAppend(uint64_t generation);
  // Accepts `accepted_rows` of the staged rows and ends the transaction; returns the new
  // committed length. Rejected latent rows are truncated with their pool keys. Like Abort,
  // Rewind and SpecRollback, refused (changing nothing) when the indexer's live tail at the new
  // length is not resident (CheckIndexTailResident).
  absl::StatusOr<uint64_t> Commit(uint64_t generation, uint64_t accepted_rows);
  // Ends the transaction keeping nothing it staged.
  absl::Status Abort(uint64_t generation);
  // PublishAppend (only when `generation` has a prepared append not yet published) + Commit
  // of `generation`, then Begin + PrepareAppend(next_rows): exactly those operations, so the
  // same rules and the same refusals (the first one's). All or nothing: a refusal changes
  // nothing, even when an earlier part alone would have been accepted. INVALID_ARGUMENT when
  // the request names neither a transaction nor rows. `check_commit` runs where the caller's
  // own checks of a separate Commit request run (after the publish, before the commit).
  absl::StatusOr<AdvanceResult> Advance(
      const AdvanceRequest& request,
      absl::FunctionRef<absl::Status()> check_commit = [] { return absl::OkStatus(); });
  // Engine-facing rewind (never forward past staged rows). Ends any transaction.
  absl::Status Rewind(uint64_t target);
  // Exactly when Rewind(target) would be accepted (rings and indexer tails resident).
  bool CanRewindTo(uint64_t target) const;

  // Spec decode: records lengths and returns the copies recurrent state -> snapshot buffers.
  // Covers all four plane kinds (flat KV, ring KV, recurrent, latent), closing the reference's
  // documented latent hole. REQUIRES spec buffers, no active transaction.
  absl::StatusOr<std::vector<PlaneCopy>> SpecSnapshot();
  // Rolls back to snapshot length + accept_len; returns the copies snapshot buffers ->
  // recurrent state. Refuses (changing nothing) when a ring checkpoint was lapped.
  absl::StatusOr<std::vector<PlaneCopy>> SpecRollback(uint64_t accept_len);

  // Makes a FRESH session hold `logical_len` rows the engine already wrote (e.g. reloaded from
  // its own offload tier): each K/V layer resident from resident_starts[i] (flat layers 0; ring
  // layers the physical row 0 of their live window); empty `resident_starts` takes, per ring
  // layer, the aligned live window AlignedWindowStart(logical_len, window) the reference's
  // restore_plan copies. Latent layers take logical_len with every whole pool's key final (the
  // engine wrote them). The one way to publish rows without a transaction; refused otherwise.
  absl::Status Hydrate(uint64_t logical_len, absl::Span<const uint64_t> resident_starts);

  // Back to a fresh session on the same planes (engines keep slots warm). Refused if tainted.
  absl::Status Reset();

  // Grow: moves the committed state of a quiescent `source` into a FRESH `target` of the same
  // model and larger capacity (flat prefix or ring window, latent rows + pool keys + live
  // indexer tail, recurrent state). Returns the copies source planes -> target planes; the
  // target's planes must be zero-filled (fresh arena) so unbuilt pool-key slots read zero.
  // Validates everything before changing `target`; `source` is never changed.
  static absl::StatusOr<std::vector<PlaneCopy>> Grow(const SessionState& source,
                                                     SessionState& target);

  bool operator==(const SessionState&) const = default;

 private:
  SessionState(KvTransactionCache kv, std::vector<LatentLayerState> latent,
               std::vector<uint32_t> recurrent_layers, std::vector<LayerGeometry> geometry,
               bool has_spec_buffers);
  const LayerGeometry* Geometry(uint32_t layer) const;

  absl::StatusOr<TransactionId> ActiveTransaction(uint64_t generation) const;
  // PublishAppend's checks and changes for `plan` (nullptr: none is prepared), leaving
  // pending_append_ alone; the rings it rebases are recorded in `undo`, which the caller
  // restores when this or a later part is refused.
  absl::Status PublishPlan(uint64_t generation, const AppendPlan* plan,
                           KvTransactionCache::Undo& undo);
  // Advance's parts, in place; `pending` is the append prepared before it (moved out of
  // pending_append_). On a refusal the caller puts the state back.
  absl::StatusOr<AdvanceResult> AdvanceInPlace(const AdvanceRequest& request,
                                               const std::optional<AppendPlan>& pending,
                                               KvTransactionCache::Undo& kv_undo,
                                               absl::FunctionRef<absl::Status()> check_commit);
  // Every latent layer's live indexer tail at `len` is resident (CheckIndexTailResident).
  absl::Status CheckLatentTailsResident(uint64_t len) const;
  void SetLatentLengths(uint64_t len);

  struct SpecCheckpoint {
    uint64_t committed_len = 0;
    uint64_t position = 0;
    bool operator==(const SpecCheckpoint&) const = default;
  };

  KvTransactionCache kv_;
  std::vector<LatentLayerState> latent_;
  std::vector<uint32_t> recurrent_layers_;
  std::vector<LayerGeometry> geometry_;  // every layer with state, in layer order
  bool has_spec_buffers_ = false;
  uint64_t position_ = 0;
  bool tainted_ = false;
  std::optional<AppendPlan> pending_append_;
  std::optional<SpecCheckpoint> spec_;
};

}  // namespace memra

#endif  // MEMRA_CORE_SESSION_H_
