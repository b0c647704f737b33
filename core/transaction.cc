#include "core/transaction.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "core/status_macros.h"

namespace memra {
namespace {

constexpr uint64_t kMaxMirroredLength = std::numeric_limits<int32_t>::max();

uint64_t StagedRetain(uint64_t target, uint64_t window) {
  return (target > window ? target - window : 0) & ~(kSwaViewAlignmentRows - 1);
}

}  // namespace

// ---------------------------------------------------------------- TransactionState

absl::StatusOr<TransactionId> TransactionState::Begin(uint64_t cache_id) {
  if (active_.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat("KV transaction generation ", active_->generation,
                     " is already active at base ", active_->base_len));
  }
  if (staged_len_ != committed_len_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "KV cache is half-committed: staged ", staged_len_, " != committed ", committed_len_));
  }
  if (next_generation_ == std::numeric_limits<uint64_t>::max()) {
    return absl::FailedPreconditionError("KV transaction generation overflow");
  }
  TransactionId transaction{cache_id, next_generation_, committed_len_};
  ++next_generation_;
  active_ = transaction;
  return transaction;
}

absl::Status TransactionState::Validate(const TransactionId& transaction) const {
  if (active_ != transaction) {
    return absl::FailedPreconditionError(
        absl::StrCat("stale KV transaction generation ", transaction.generation, " at base ",
                     transaction.base_len));
  }
  if (transaction.base_len != committed_len_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "KV transaction base ", transaction.base_len, " != committed length ", committed_len_));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> TransactionState::AppendTarget(const TransactionId& transaction,
                                                        uint64_t rows, uint64_t capacity) const {
  RETURN_IF_ERROR(Validate(transaction));
  if (rows == 0) {
    return absl::InvalidArgumentError("KV append must contain at least one row");
  }
  ASSIGN_OR_RETURN(uint64_t target, CheckedAdd(staged_len_, rows, "KV staged length"));
  if (target > capacity) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV append exceeds capacity: ", target, " > ", capacity));
  }
  return target;
}

absl::Status TransactionState::PublishAppend(const TransactionId& transaction, uint64_t target) {
  RETURN_IF_ERROR(Validate(transaction));
  if (target <= staged_len_) {
    return absl::InvalidArgumentError(absl::StrCat("KV append target ", target,
                                                   " must exceed staged length ", staged_len_));
  }
  staged_len_ = target;
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> TransactionState::CommitTarget(const TransactionId& transaction,
                                                        uint64_t accepted_rows) const {
  RETURN_IF_ERROR(Validate(transaction));
  // Validate() pinned base_len == committed_len <= staged_len, so this cannot underflow.
  const uint64_t staged_rows = staged_len_ - transaction.base_len;
  if (accepted_rows > staged_rows) {
    return absl::InvalidArgumentError(absl::StrCat("KV commit accepts ", accepted_rows,
                                                   " rows from a ", staged_rows,
                                                   "-row transaction"));
  }
  return transaction.base_len + accepted_rows;
}

absl::Status TransactionState::PublishFinalize(const TransactionId& transaction,
                                               uint64_t target) {
  RETURN_IF_ERROR(Validate(transaction));
  if (target < transaction.base_len || target > staged_len_) {
    return absl::InvalidArgumentError(absl::StrCat("KV finalize target ", target,
                                                   " outside transaction range ",
                                                   transaction.base_len, "..=", staged_len_));
  }
  committed_len_ = target;
  staged_len_ = target;
  active_.reset();
  return absl::OkStatus();
}

absl::Status TransactionState::Rewind(uint64_t target, uint64_t capacity) {
  if (target > capacity) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV rewind target ", target, " exceeds capacity ", capacity));
  }
  committed_len_ = target;
  staged_len_ = target;
  active_.reset();
  return absl::OkStatus();
}

// ---------------------------------------------------------------- KvTransactionCache

absl::StatusOr<KvTransactionCache> KvTransactionCache::Create(uint64_t cache_id,
                                                              uint64_t capacity,
                                                              std::vector<KvLayerShape> layers) {
  if (capacity == 0 || capacity > kMaxMirroredLength) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV cache capacity ", capacity, " outside [1,", kMaxMirroredLength, "] (i32 mirrors)"));
  }
  absl::flat_hash_set<uint32_t> seen;
  std::vector<std::optional<KvRing>> rings;
  rings.reserve(layers.size());
  for (const KvLayerShape& shape : layers) {
    if (!seen.insert(shape.layer).second) {
      return absl::InvalidArgumentError(absl::StrCat("KV layer ", shape.layer, " listed twice"));
    }
    if (shape.k_token_bytes == 0 || shape.v_token_bytes == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("KV layer ", shape.layer, " has zero token bytes (k ",
                       shape.k_token_bytes, ", v ", shape.v_token_bytes, ")"));
    }
    if (!shape.ring_window.has_value()) {
      rings.emplace_back(std::nullopt);
      continue;
    }
    absl::StatusOr<KvRing> ring =
        KvRing::Create(KvPlaneRows(shape.ring_window, capacity), *shape.ring_window);
    if (!ring.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("KV layer ", shape.layer, ": ", ring.status().message()));
    }
    rings.emplace_back(*ring);
  }
  return KvTransactionCache(cache_id, capacity, std::move(layers), std::move(rings));
}

uint64_t KvTransactionCache::physical_rows(size_t index) const {
  return rings_[index].has_value() ? rings_[index]->rows() : capacity_;
}

bool KvTransactionCache::has_ring() const {
  return std::any_of(rings_.begin(), rings_.end(),
                     [](const std::optional<KvRing>& ring) { return ring.has_value(); });
}

absl::StatusOr<TransactionId> KvTransactionCache::Begin() { return state_.Begin(cache_id_); }

absl::Status KvTransactionCache::ValidateTransaction(const TransactionId& transaction) const {
  return state_.Validate(transaction);
}

absl::StatusOr<uint64_t> KvTransactionCache::AppendTarget(const TransactionId& transaction,
                                                          uint64_t rows) const {
  return state_.AppendTarget(transaction, rows, capacity_);
}

absl::StatusOr<AppendPlan> KvTransactionCache::PrepareAppend(const TransactionId& transaction,
                                                             uint64_t rows) const {
  ASSIGN_OR_RETURN(uint64_t target, state_.AppendTarget(transaction, rows, capacity_));
  AppendPlan plan{transaction, target, {}};
  plan.layers.reserve(shapes_.size());
  for (size_t i = 0; i < shapes_.size(); ++i) {
    LayerAppend layer{shapes_[i].layer, state_.staged_len(), std::nullopt};
    if (rings_[i].has_value()) {
      const KvRing& ring = *rings_[i];
      // Retain the staged window AND the window at the transaction base, so a commit of zero
      // rows (a full spec rejection) is still resident after the rebase.
      const uint64_t retain = std::min(StagedRetain(target, ring.window()),
                                       AlignedWindowStart(transaction.base_len, ring.window()));
      absl::StatusOr<RingAppend> append = ring.AppendPlan(state_.staged_len(), retain, rows);
      if (!append.ok()) {
        return absl::Status(append.status().code(), absl::StrCat("layer ", shapes_[i].layer,
                                                                 ": ", append.status().message()));
      }
      layer.write_row = append->write_row;
      layer.ring_append = *append;
    }
    plan.layers.push_back(layer);
  }
  return plan;
}

absl::StatusOr<std::pair<uint64_t, bool>> KvTransactionCache::PeekAppendRing(
    size_t index, uint64_t rows) const {
  if (index >= shapes_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV layer slot ", index, " outside ", shapes_.size(), " layers"));
  }
  ASSIGN_OR_RETURN(uint64_t target, CheckedAdd(state_.staged_len(), rows, "KV staged length"));
  if (!rings_[index].has_value()) return std::make_pair(state_.staged_len(), false);
  const KvRing& ring = *rings_[index];
  const uint64_t retain = std::min(StagedRetain(target, ring.window()),
                                   AlignedWindowStart(state_.staged_len(), ring.window()));
  ASSIGN_OR_RETURN(RingAppend append, ring.AppendPlan(state_.staged_len(), retain, rows));
  return std::make_pair(append.write_row, append.kind == RingAppend::Kind::kRebase);
}

void KvTransactionCache::Restore(Undo undo) {
  state_ = undo.state;
  for (auto it = undo.replaced_rings.rbegin(); it != undo.replaced_rings.rend(); ++it) {
    rings_[it->first] = it->second;
  }
}

absl::Status KvTransactionCache::PublishAppendRebase(const AppendPlan& plan, Undo* undo) {
  RETURN_IF_ERROR(state_.Validate(plan.transaction));
  if (plan.layers.size() != shapes_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("KV append plan covers ", plan.layers.size(),
                                                   " layers, cache has ", shapes_.size()));
  }
  // Validated in full first, then applied: only the rebased rings are copied (most appends
  // rebase none), never the whole ring table.
  std::vector<std::pair<size_t, KvRing>> rebased;
  for (size_t i = 0; i < shapes_.size(); ++i) {
    const std::optional<RingAppend>& append = plan.layers[i].ring_append;
    const bool matches = plan.layers[i].layer == shapes_[i].layer &&
                         rings_[i].has_value() == append.has_value();
    if (!matches) {
      return absl::InvalidArgumentError(absl::StrCat("KV append plan does not match cache ",
                                                     "ring layout at layer ", shapes_[i].layer));
    }
    if (!append.has_value() || append->kind == RingAppend::Kind::kContiguous) continue;
    KvRing ring = *rings_[i];
    if (append->keep_rows > ring.rows()) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", shapes_[i].layer,
                                                     ": KV ring rebase keeps ", append->keep_rows,
                                                     " rows in ", ring.rows(), " physical rows"));
    }
    RETURN_IF_ERROR(ring.ApplyRebase(append->new_base));
    if (!ring.CanRewindTo(plan.transaction.base_len)) {
      return absl::FailedPreconditionError(
          absl::StrCat("layer ", shapes_[i].layer, ": KV ring rebase to ", append->new_base,
                       " laps transaction base ", plan.transaction.base_len));
    }
    rebased.emplace_back(i, ring);
  }
  for (auto& [index, ring] : rebased) {
    if (undo != nullptr) undo->replaced_rings.emplace_back(index, *rings_[index]);
    rings_[index] = ring;
  }
  return absl::OkStatus();
}

absl::Status KvTransactionCache::PublishAppendPlan(const AppendPlan& plan) {
  RETURN_IF_ERROR(state_.Validate(plan.transaction));
  if (plan.layers.size() != shapes_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("KV append plan covers ", plan.layers.size(),
                                                   " layers, cache has ", shapes_.size()));
  }
  for (size_t i = 0; i < shapes_.size(); ++i) {
    const std::optional<RingAppend>& append = plan.layers[i].ring_append;
    if (!append.has_value() || append->kind != RingAppend::Kind::kRebase) continue;
    if (!rings_[i].has_value() || rings_[i]->base() != append->new_base) {
      return absl::FailedPreconditionError(
          absl::StrCat("layer ", shapes_[i].layer, ": KV append rebase ", append->new_base,
                       " was not published before its state"));
    }
  }
  return state_.PublishAppend(plan.transaction, plan.target);
}

absl::Status KvTransactionCache::PublishAppend(const TransactionId& transaction,
                                               uint64_t target) {
  return state_.PublishAppend(transaction, target);
}

absl::StatusOr<uint64_t> KvTransactionCache::CommitTarget(const TransactionId& transaction,
                                                          uint64_t accepted_rows) const {
  return state_.CommitTarget(transaction, accepted_rows);
}

absl::Status KvTransactionCache::PublishFinalize(const TransactionId& transaction,
                                                 uint64_t target) {
  RETURN_IF_ERROR(state_.Validate(transaction));
  RETURN_IF_ERROR(CheckResident(target, "finalize target"));
  return state_.PublishFinalize(transaction, target);
}

absl::StatusOr<RowRange> KvTransactionCache::PhysicalRange(size_t index, uint64_t start,
                                                           uint64_t end) const {
  if (index >= shapes_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV layer slot ", index, " outside ", shapes_.size(), " layers"));
  }
  if (rings_[index].has_value()) return rings_[index]->PhysicalRange(start, end);
  if (end < start || end > capacity_) {
    return absl::InvalidArgumentError(absl::StrCat("KV linear view [", start, ",", end,
                                                   ") exceeds capacity ", capacity_));
  }
  return RowRange{start, end};
}

bool KvTransactionCache::CanRewindTo(uint64_t target) const {
  if (target > capacity_) return false;
  return std::all_of(rings_.begin(), rings_.end(), [target](const std::optional<KvRing>& ring) {
    return !ring.has_value() || ring->CanRewindTo(target);
  });
}

absl::Status KvTransactionCache::RewindTo(uint64_t target) {
  if (target > state_.staged_len()) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV rewind target ", target, " is past the staged length ",
                     state_.staged_len(), " (only hydration may set unwritten rows)"));
  }
  return SetLength(target, "rewind target");
}

absl::Status KvTransactionCache::CheckResident(uint64_t target, absl::string_view what) const {
  if (CanRewindTo(target)) return absl::OkStatus();
  if (target > capacity_) {
    return absl::FailedPreconditionError(
        absl::StrCat("KV ", what, " ", target, " is past the capacity ", capacity_));
  }
  for (size_t i = 0; i < rings_.size(); ++i) {
    if (!rings_[i].has_value() || rings_[i]->CanRewindTo(target)) continue;
    const KvRing& ring = *rings_[i];
    return absl::FailedPreconditionError(absl::StrCat(
        "SWA ring rewind checkpoint has been lapped; full re-prime required (", what, " ",
        target, ": layer ", shapes_[i].layer, " window ", ring.window(), " starts at row ",
        AlignedWindowStart(target, ring.window()), ", below ring base ", ring.base(), ")"));
  }
  return absl::InternalError(
      absl::StrCat("KV ", what, " ", target, " refused with no lapped ring and no capacity"));
}

absl::Status KvTransactionCache::SetLength(uint64_t target, absl::string_view what) {
  RETURN_IF_ERROR(CheckResident(target, what));
  return state_.Rewind(target, capacity_);
}

absl::StatusOr<GrowPlan> KvTransactionCache::PrepareGrow(uint64_t target_capacity,
                                                         uint64_t rows) const {
  if (const std::optional<TransactionId>& active = state_.active(); active.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat("KV grow refuses active transaction generation ", active->generation,
                     " at base ", active->base_len));
  }
  if (state_.staged_len() != state_.committed_len()) {
    return absl::FailedPreconditionError(
        absl::StrCat("KV grow requires quiescent state, got committed/staged=",
                     state_.committed_len(), "/", state_.staged_len()));
  }
  if (target_capacity <= capacity_) {
    return absl::InvalidArgumentError(absl::StrCat("KV grow target capacity ", target_capacity,
                                                   " must exceed source capacity ", capacity_));
  }
  if (target_capacity > kMaxMirroredLength) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV grow target capacity ", target_capacity, " exceeds i32 device mirrors"));
  }
  if (rows > state_.committed_len()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV grow rows ", rows, " exceed committed length ", state_.committed_len()));
  }
  GrowPlan plan{rows, capacity_, target_capacity, state_.next_generation(), shapes_, {}};
  for (size_t i = 0; i < shapes_.size(); ++i) {
    LayerGrow grow{shapes_[i].layer, 0, rows, 0, 0, 0,
                   KvPlaneRows(shapes_[i].ring_window, target_capacity)};
    if (rings_[i].has_value()) {
      const KvRing& ring = *rings_[i];
      grow.target_base = AlignedWindowStart(rows, ring.window());
      ASSIGN_OR_RETURN(RowRange physical, ring.PhysicalRange(grow.target_base, rows));
      grow.source_row = physical.start;
      grow.copy_rows = physical.size();
    }
    ASSIGN_OR_RETURN(grow.k_bytes,
                     CheckedMul(grow.copy_rows, shapes_[i].k_token_bytes, "KV grow K bytes"));
    ASSIGN_OR_RETURN(grow.v_bytes,
                     CheckedMul(grow.copy_rows, shapes_[i].v_token_bytes, "KV grow V bytes"));
    plan.layers.push_back(grow);
  }
  return plan;
}

absl::Status KvTransactionCache::PublishGrow(const GrowPlan& plan) {
  if (!state_.IsFresh()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "KV grow target must be fresh, got committed/staged=", state_.committed_len(), "/",
        state_.staged_len(), " active=", state_.active().has_value()));
  }
  bool layout_matches = capacity_ == plan.target_capacity &&
                        capacity_ > plan.source_capacity && shapes_ == plan.shapes &&
                        plan.layers.size() == shapes_.size();
  for (size_t i = 0; layout_matches && i < shapes_.size(); ++i) {
    layout_matches = physical_rows(i) == plan.layers[i].target_physical_rows;
  }
  if (!layout_matches) {
    return absl::FailedPreconditionError("KV grow target layout does not match its source plan");
  }
  if (plan.rows > capacity_) {
    return absl::InvalidArgumentError(absl::StrCat("KV grow rows ", plan.rows,
                                                   " exceed target capacity ", capacity_));
  }
  std::vector<std::optional<KvRing>> rebased = rings_;
  for (size_t i = 0; i < shapes_.size(); ++i) {
    if (!rebased[i].has_value()) continue;
    RETURN_IF_ERROR(rebased[i]->ApplyRebase(plan.layers[i].target_base));
    if (!rebased[i]->CanRewindTo(plan.rows)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "layer ", shapes_[i].layer, ": KV grow target ring base ", rebased[i]->base(),
          " cannot expose committed length ", plan.rows));
    }
  }
  rings_ = std::move(rebased);
  RETURN_IF_ERROR(state_.Rewind(plan.rows, capacity_));
  state_.AdoptGeneration(plan.next_generation);
  return absl::OkStatus();
}

absl::Status KvTransactionCache::PublishHydration(uint64_t logical_len,
                                                  absl::Span<const uint64_t> resident_starts) {
  if (!state_.IsFresh()) {
    return absl::FailedPreconditionError("KV hydration target must be fresh");
  }
  if (resident_starts.size() != shapes_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("KV hydration names ", resident_starts.size(),
                                                   " resident starts for ", shapes_.size(),
                                                   " layers"));
  }
  std::vector<std::optional<KvRing>> hydrated = rings_;
  for (size_t i = 0; i < shapes_.size(); ++i) {
    const uint64_t start = resident_starts[i];
    if (start > logical_len || logical_len > capacity_) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", shapes_[i].layer,
                                                     ": KV hydration range [", start, ",",
                                                     logical_len, ") exceeds capacity ",
                                                     capacity_));
    }
    if (!hydrated[i].has_value()) {
      if (start != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("layer ", shapes_[i].layer,
                         ": linear KV hydration must start at absolute row zero, got ", start));
      }
      continue;
    }
    KvRing& ring = *hydrated[i];
    if (logical_len - start > ring.rows()) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", shapes_[i].layer, ": KV hydration requires ",
                       logical_len - start, " rows in a ", ring.rows(), "-row ring"));
    }
    RETURN_IF_ERROR(ring.ApplyRebase(start));
    if (!ring.CanRewindTo(logical_len)) {
      return absl::FailedPreconditionError(
          absl::StrCat("layer ", shapes_[i].layer, ": KV hydration base ", start,
                       " cannot expose logical length ", logical_len));
    }
  }
  const std::vector<std::optional<KvRing>> previous = std::exchange(rings_, std::move(hydrated));
  absl::Status status = SetLength(logical_len, "hydration length");
  if (!status.ok()) rings_ = previous;  // a refused hydration changes nothing
  return status;
}

}  // namespace memra
