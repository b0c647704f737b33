#ifndef MEMRA_CORE_TRANSACTION_H_
#define MEMRA_CORE_TRANSACTION_H_

// The KV transaction state machine (docs/rules.md#transactions; the reference's
// TpKvTransactionState and ResidentTpKvCache, docs/rules.md#the-reference), generalised so ONE
// session-level transaction drives every K/V layer of a session: flat layers and ring layers,
// ring layers with different windows.
//
// Protocol: Begin -> PrepareAppend(rows) -> (engine writes, performing any ring rebase copy)
// -> PublishAppendRebase + PublishAppendPlan -> CommitTarget(accepted) -> PublishFinalize.
// A refused call changes nothing.
//
// Invariants: (1) committed_len <= staged_len <= capacity; (2) staged_len == committed_len
// whenever no transaction is active; (3) every ring layer's aligned window at committed_len is
// resident; (4) generations strictly increase and are never reused (grow carries them over).
//
// Tightened against the reference, deliberately (each pinned by a test saying so):
//   * a transaction and its plans are bound to the cache that issued them (the reference's
//     (generation, base) pair validates on any cache that happens to agree);
//   * an engine-facing rewind may not move past the staged length: only hydration may set a
//     length the cache never staged.
//
// Thread-safety: a value type; the session that owns it synchronises.

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/kv_ring.h"

namespace memra {

struct TransactionId {
  uint64_t cache_id = 0;    // the issuing cache (our binding; the reference has none)
  uint64_t generation = 0;  // > 0
  uint64_t base_len = 0;    // committed length when the transaction began
  bool operator==(const TransactionId&) const = default;
};

// The reference's TpKvTransactionState: lengths and the active transaction, no layers.
class TransactionState {
 public:
  TransactionState() = default;

  uint64_t committed_len() const { return committed_len_; }
  uint64_t staged_len() const { return staged_len_; }
  uint64_t next_generation() const { return next_generation_; }
  const std::optional<TransactionId>& active() const { return active_; }
  // No rows and no transaction (grow and hydration targets must be fresh). Unlike the
  // reference, the generation counter is not part of freshness: a reset session keeps counting
  // so a transaction from before the reset can never validate again.
  bool IsFresh() const { return committed_len_ == 0 && staged_len_ == 0 && !active_; }

  absl::StatusOr<TransactionId> Begin(uint64_t cache_id);
  absl::Status Validate(const TransactionId& transaction) const;
  absl::StatusOr<uint64_t> AppendTarget(const TransactionId& transaction, uint64_t rows,
                                        uint64_t capacity) const;
  absl::Status PublishAppend(const TransactionId& transaction, uint64_t target);
  absl::StatusOr<uint64_t> CommitTarget(const TransactionId& transaction,
                                        uint64_t accepted_rows) const;
  absl::Status PublishFinalize(const TransactionId& transaction, uint64_t target);
  // Sets both lengths and ends any active transaction. INVALID_ARGUMENT past capacity.
  absl::Status Rewind(uint64_t target, uint64_t capacity);
  // Grow: the target continues the source's generation sequence (never moving backwards).
  void AdoptGeneration(uint64_t next_generation) {
    next_generation_ = next_generation > next_generation_ ? next_generation : next_generation_;
  }

  bool operator==(const TransactionState&) const = default;

 private:
  uint64_t committed_len_ = 0;
  uint64_t staged_len_ = 0;
  uint64_t next_generation_ = 1;
  std::optional<TransactionId> active_;
};

// One K/V layer's shape. `window` set => the layer is addressed through a KvRing of
// SwaRingRows(window, capacity) rows.
struct KvLayerShape {
  uint32_t layer = 0;
  uint64_t k_token_bytes = 0;
  uint64_t v_token_bytes = 0;
  std::optional<uint64_t> ring_window;  // set: a KvRing of this window addresses the layer
  bool operator==(const KvLayerShape&) const = default;
};

// Where one layer's rows of an append go.
struct LayerAppend {
  uint32_t layer = 0;
  uint64_t write_row = 0;                 // physical row of the first appended row
  std::optional<RingAppend> ring_append;  // ring layers only
  bool operator==(const LayerAppend&) const = default;
};

struct AppendPlan {
  TransactionId transaction;
  uint64_t target = 0;  // staged length after the append
  std::vector<LayerAppend> layers;  // one per K/V layer, in layer order
  bool operator==(const AppendPlan&) const = default;
};

// What a grow copies for one layer: `copy_rows` physical rows from `source_row` of the source
// planes to physical row 0 of the target planes (flat: the committed prefix; ring: the aligned
// live window, rebased to `target_base`).
struct LayerGrow {
  uint32_t layer = 0;
  uint64_t source_row = 0;
  uint64_t copy_rows = 0;
  uint64_t target_base = 0;
  uint64_t k_bytes = 0;
  uint64_t v_bytes = 0;
  uint64_t target_physical_rows = 0;
  bool operator==(const LayerGrow&) const = default;
};

struct GrowPlan {
  uint64_t rows = 0;  // committed length the target publishes
  uint64_t source_capacity = 0;
  uint64_t target_capacity = 0;
  uint64_t next_generation = 0;
  std::vector<KvLayerShape> shapes;  // the layout the target must have
  std::vector<LayerGrow> layers;
  bool operator==(const GrowPlan&) const = default;
};

class KvTransactionCache {
 public:
  // `cache_id` binds transactions to this cache (unique per session and layout version).
  // INVALID_ARGUMENT for capacity 0 or past the i32 device mirrors, zero token bytes, a zero
  // window, or duplicate layers.
  static absl::StatusOr<KvTransactionCache> Create(uint64_t cache_id, uint64_t capacity,
                                                   std::vector<KvLayerShape> layers);

  uint64_t cache_id() const { return cache_id_; }
  uint64_t capacity() const { return capacity_; }
  uint64_t committed_len() const { return state_.committed_len(); }
  uint64_t staged_len() const { return state_.staged_len(); }
  const TransactionState& state() const { return state_; }
  const std::vector<KvLayerShape>& shapes() const { return shapes_; }
  size_t layer_count() const { return shapes_.size(); }
  // nullopt for flat layers. REQUIRES: index < layer_count().
  const std::optional<KvRing>& ring(size_t index) const { return rings_[index]; }
  uint64_t physical_rows(size_t index) const;
  bool has_ring() const;

  absl::StatusOr<TransactionId> Begin();
  // Continues a generation sequence (reset and grow); never moves it backwards.
  void AdoptNextGeneration(uint64_t next_generation) {
    state_.AdoptGeneration(next_generation);
  }
  absl::Status ValidateTransaction(const TransactionId& transaction) const;
  absl::StatusOr<uint64_t> AppendTarget(const TransactionId& transaction, uint64_t rows) const;
  absl::StatusOr<AppendPlan> PrepareAppend(const TransactionId& transaction,
                                           uint64_t rows) const;
  // Read-only look at the next append of `rows` for layer `index`: (write_row, would_rebase).
  absl::StatusOr<std::pair<uint64_t, bool>> PeekAppendRing(size_t index, uint64_t rows) const;
  // What the transaction operations below change (Begin, PublishAppendRebase,
  // PublishAppendPlan, PublishAppend, PublishFinalize), saved so a compound operation can put
  // it back when a later part is refused without copying the cache: the transaction state
  // (a few words) and the rings a rebase replaced (none on most steps).
  struct Undo {
    TransactionState state;
    std::vector<std::pair<size_t, KvRing>> replaced_rings;  // (layer slot, ring before)
  };
  Undo SaveUndo() const { return Undo{state_, {}}; }
  // Puts back what was saved in `undo` (the rings in reverse, so a ring replaced twice gets its
  // first value). REQUIRES: only the operations above ran since SaveUndo, with `undo` passed to
  // every PublishAppendRebase among them.
  void Restore(Undo undo);

  // Applies every ring layer's rebase (all validated before any is applied); the rings it
  // replaces are appended to `undo` when given.
  absl::Status PublishAppendRebase(const AppendPlan& plan, Undo* undo = nullptr);
  // Publishes the staged length; refuses a plan whose rebases were not published first.
  absl::Status PublishAppendPlan(const AppendPlan& plan);
  absl::Status PublishAppend(const TransactionId& transaction, uint64_t target);
  absl::StatusOr<uint64_t> CommitTarget(const TransactionId& transaction,
                                        uint64_t accepted_rows) const;
  absl::Status PublishFinalize(const TransactionId& transaction, uint64_t target);

  // Physical rows of absolute view [start, end) of layer `index`.
  absl::StatusOr<RowRange> PhysicalRange(size_t index, uint64_t start, uint64_t end) const;
  // target <= capacity and every ring layer still holds the aligned window at `target`.
  bool CanRewindTo(uint64_t target) const;
  // OK exactly when CanRewindTo(target); otherwise FAILED_PRECONDITION saying why, for a length
  // change named `what` ("rewind target", "rollback target", ...): past the capacity ("KV
  // rewind target T is past the capacity C"), or a ring window lapped ("SWA ring rewind
  // checkpoint has been lapped; full re-prime required (rewind target T: layer L window W starts
  // at row S, below ring base B)": the first such layer).
  absl::Status CheckResident(uint64_t target, absl::string_view what) const;
  // Engine-facing rewind: target <= staged_len, CanRewindTo(target). Ends any transaction.
  absl::Status RewindTo(uint64_t target);

  absl::StatusOr<GrowPlan> PrepareGrow(uint64_t target_capacity, uint64_t rows) const;
  // REQUIRES a fresh target whose layout matches `plan`.
  absl::Status PublishGrow(const GrowPlan& plan);

  // Makes a FRESH cache hold `logical_len` rows, each ring layer resident from
  // `resident_starts[i]` (flat layers: 0). Prefix restore and grow use it.
  absl::Status PublishHydration(uint64_t logical_len, absl::Span<const uint64_t> resident_starts);

  bool operator==(const KvTransactionCache&) const = default;

 private:
  KvTransactionCache(uint64_t cache_id, uint64_t capacity, std::vector<KvLayerShape> shapes,
                     std::vector<std::optional<KvRing>> rings)
      : cache_id_(cache_id),
        capacity_(capacity),
        shapes_(std::move(shapes)),
        rings_(std::move(rings)) {}

  absl::Status SetLength(uint64_t target, absl::string_view what);

  uint64_t cache_id_;
  uint64_t capacity_;
  std::vector<KvLayerShape> shapes_;
  std::vector<std::optional<KvRing>> rings_;  // parallel to shapes_
  TransactionState state_;
};

}  // namespace memra

#endif  // MEMRA_CORE_TRANSACTION_H_
