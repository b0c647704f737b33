#include "core/session.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "core/sizing.h"
#include "core/status_macros.h"

namespace memra {
namespace {

constexpr uint64_t kF32 = sizeof(float);

PlaneKind LatentPlaneKind(LatentPlane plane) {
  switch (plane) {
    case LatentPlane::kRows:
      return PlaneKind::kLatentRows;
    case LatentPlane::kIndexRows:
      return PlaneKind::kIndexRows;
    case LatentPlane::kPoolKeys:
      return PlaneKind::kPoolKeys;
  }
  return PlaneKind::kLatentRows;
}

// Plane bytes by (layer, kind), indexed once: a lookup per latent layer stays O(1), so creating
// a session is linear in its layers (a scan per lookup made 16k latent layers take minutes).
class PlaneBytesIndex {
 public:
  explicit PlaneBytesIndex(const SessionPlan& plan) {
    bytes_.reserve(plan.planes.size());
    for (const PlaneSpec& spec : plan.planes) bytes_.emplace(PlaneKey(spec.layer, spec.kind), spec.bytes);
  }
  // 0 when the layer has no such plane.
  uint64_t operator()(uint32_t layer, PlaneKind kind) const {
    auto it = bytes_.find(PlaneKey(layer, kind));
    return it == bytes_.end() ? 0 : it->second;
  }

 private:
  absl::flat_hash_map<uint64_t, uint64_t> bytes_;
};

}  // namespace

SessionState::SessionState(KvTransactionCache kv, std::vector<LatentLayerState> latent,
                           std::vector<uint32_t> recurrent_layers,
                           std::vector<LayerGeometry> geometry, bool has_spec_buffers)
    : kv_(std::move(kv)),
      latent_(std::move(latent)),
      recurrent_layers_(std::move(recurrent_layers)),
      geometry_(std::move(geometry)),
      has_spec_buffers_(has_spec_buffers) {}

absl::StatusOr<SessionState> SessionState::Create(uint64_t cache_id, const SessionPlan& plan,
                                                  uint64_t capacity) {
  std::vector<KvLayerShape> shapes;
  std::vector<LatentLayerState> latent;
  std::vector<uint32_t> recurrent;
  const PlaneBytesIndex plane_bytes(plan);
  for (const LayerGeometry& layer : plan.layers) {
    switch (layer.kind) {
      case StateKind::kKv:
      case StateKind::kSlidingKv:
        shapes.push_back({layer.layer, layer.k_token_bytes, layer.v_token_bytes,
                          layer.RingWindow()});
        break;
      case StateKind::kLatent: {
        LatentLayerState state;
        state.layer = layer.layer;
        state.width = layer.latent_width;
        state.index_width = layer.index_width;
        state.index_ring_rows = layer.index_ring ? layer.index_physical_rows : 0;
        // The plan carries the pool, so it is resident from creation (the reference learns it
        // on the engine's first indexer call).
        state.index_pool = layer.index_pool;
        state.row_format = layer.latent_format;
        state.rows_elems = plane_bytes(layer.layer, PlaneKind::kLatentRows) /
                           LayoutOf(layer.latent_format).block_bytes;
        state.index_rows_elems = plane_bytes(layer.layer, PlaneKind::kIndexRows) / kF32;
        state.pool_keys_elems = plane_bytes(layer.layer, PlaneKind::kPoolKeys) / kF32;
        latent.push_back(state);
        break;
      }
      case StateKind::kRecurrent:
        recurrent.push_back(layer.layer);
        break;
      case StateKind::kNone:
      case StateKind::kSharedKv:
        break;
    }
  }
  const bool has_spec_buffers =
      std::any_of(plan.planes.begin(), plan.planes.end(),
                  [](const PlaneSpec& spec) { return spec.kind == PlaneKind::kSpecConv; });
  ASSIGN_OR_RETURN(KvTransactionCache kv,
                   KvTransactionCache::Create(cache_id, capacity, std::move(shapes)));
  return SessionState(std::move(kv), std::move(latent), std::move(recurrent), plan.layers,
                      has_spec_buffers);
}

const LayerGeometry* SessionState::Geometry(uint32_t layer) const {
  for (const LayerGeometry& geometry : geometry_) {
    if (geometry.layer == layer) return &geometry;
  }
  return nullptr;
}

std::vector<MirrorValue> SessionState::Mirrors() const {
  std::vector<MirrorValue> mirrors;
  MirrorsInto(mirrors);
  return mirrors;
}

void SessionState::MirrorsInto(std::vector<MirrorValue>& mirrors) const {
  mirrors.clear();
  // Lengths are bounded by capacity <= INT32_MAX (KvTransactionCache::Create), so the
  // narrowing below is exact.
  for (size_t i = 0; i < kv_.layer_count(); ++i) {
    const uint32_t layer = kv_.shapes()[i].layer;
    mirrors.push_back({{layer, PlaneKind::kLenMirror}, static_cast<int32_t>(staged_len())});
    if (kv_.ring(i).has_value()) {
      mirrors.push_back(
          {{layer, PlaneKind::kBaseMirror}, static_cast<int32_t>(kv_.ring(i)->base())});
    }
  }
  for (const LatentLayerState& layer : latent_) {
    mirrors.push_back({{layer.layer, PlaneKind::kLenMirror}, static_cast<int32_t>(layer.len)});
  }
}

absl::Status SessionState::EnsureUsable(std::string_view what) const {
  if (tainted_) {
    return absl::FailedPreconditionError(
        absl::StrCat(absl::string_view(what.data(), what.size()),
                     ": session was tainted by a failed operation and cannot be reused"));
  }
  return absl::OkStatus();
}

absl::StatusOr<TransactionId> SessionState::ActiveTransaction(uint64_t generation) const {
  const std::optional<TransactionId>& active = kv_.state().active();
  if (!active.has_value() || active->generation != generation) {
    return absl::FailedPreconditionError(absl::StrCat(
        "stale KV transaction generation ", generation, " (active: ",
        active.has_value() ? absl::StrCat(active->generation) : std::string("none"), ")"));
  }
  return *active;
}

absl::Status SessionState::CheckLatentTailsResident(uint64_t len) const {
  for (const LatentLayerState& layer : latent_) {
    RETURN_IF_ERROR(CheckIndexTailResident(layer, len));
  }
  return absl::OkStatus();
}

void SessionState::SetLatentLengths(uint64_t len) {
  for (LatentLayerState& layer : latent_) {
    if (layer.index_width != 0) layer.index_pools_ready = IndexPoolsReadyAt(layer, len);
    layer.len = len;
    // Rows from `len` up are rewritten by the next append before they can be live again. Also
    // when the length did not move: an unpublished prepare may have raised the resident start
    // above it (ending that prepare must not leave the raised start behind).
    layer.index_resident_from = std::min(layer.index_resident_from, len);
  }
}

absl::StatusOr<TransactionId> SessionState::Begin() {
  RETURN_IF_ERROR(EnsureUsable("begin transaction"));
  ASSIGN_OR_RETURN(TransactionId transaction, kv_.Begin());
  pending_append_.reset();
  return transaction;
}

absl::StatusOr<AppendPlan> SessionState::PrepareAppend(uint64_t generation, uint64_t rows) {
  RETURN_IF_ERROR(EnsureUsable("prepare append"));
  ASSIGN_OR_RETURN(TransactionId transaction, ActiveTransaction(generation));
  ASSIGN_OR_RETURN(AppendPlan plan, kv_.PrepareAppend(transaction, rows));
  // From here the engine may write the rows, so residency is accounted now, not at publish: an
  // abort after the writes must see the ring slots they overwrote.
  std::vector<LatentLayerState> latent = latent_;
  for (LatentLayerState& layer : latent) {
    RETURN_IF_ERROR(CheckAppendSparesLiveTails(layer, transaction.base_len, staged_len(), rows));
    RETURN_IF_ERROR(NoteIndexRowsWritable(layer, staged_len(), rows));
  }
  latent_ = std::move(latent);
  pending_append_ = plan;
  return plan;
}

absl::Status SessionState::PublishPlan(uint64_t generation, const AppendPlan* plan,
                                       KvTransactionCache::Undo& undo) {
  RETURN_IF_ERROR(EnsureUsable("publish append"));
  ASSIGN_OR_RETURN(TransactionId transaction, ActiveTransaction(generation));
  if (plan == nullptr || plan->transaction != transaction) {
    return absl::FailedPreconditionError(
        absl::StrCat("no prepared append for transaction generation ", generation));
  }
  RETURN_IF_ERROR(kv_.PublishAppendRebase(*plan, &undo));
  RETURN_IF_ERROR(kv_.PublishAppendPlan(*plan));
  // An earlier prepare of this transaction that was replaced unpublished may have lapped the
  // tail this append leaves live.
  RETURN_IF_ERROR(CheckLatentTailsResident(kv_.staged_len()));
  SetLatentLengths(staged_len());
  return absl::OkStatus();
}

absl::Status SessionState::PublishAppend(uint64_t generation) {
  KvTransactionCache::Undo undo = kv_.SaveUndo();
  absl::Status published =
      PublishPlan(generation, pending_append_.has_value() ? &*pending_append_ : nullptr, undo);
  if (!published.ok()) {
    kv_.Restore(std::move(undo));
    return published;
  }
  pending_append_.reset();
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> SessionState::Commit(uint64_t generation, uint64_t accepted_rows) {
  RETURN_IF_ERROR(EnsureUsable("commit"));
  ASSIGN_OR_RETURN(TransactionId transaction, ActiveTransaction(generation));
  ASSIGN_OR_RETURN(uint64_t target, kv_.CommitTarget(transaction, accepted_rows));
  RETURN_IF_ERROR(CheckLatentTailsResident(target));
  RETURN_IF_ERROR(kv_.PublishFinalize(transaction, target));
  pending_append_.reset();
  SetLatentLengths(target);
  position_ = target;
  return target;
}

absl::Status SessionState::Abort(uint64_t generation) {
  return Commit(generation, 0).status();
}

absl::StatusOr<AdvanceResult> SessionState::Advance(
    const AdvanceRequest& request, absl::FunctionRef<absl::Status()> check_commit) {
  if (request.generation == 0 && request.next_rows == 0) {
    return absl::InvalidArgumentError(
        "advance names neither a transaction to finish (generation 0) nor rows to prepare "
        "(next_rows 0)");
  }
  // All or nothing without copying the state (this runs per session per token): the parts run
  // in place, and when one is refused, what the earlier ones changed is put back. They change
  // only the KV cache's transaction state and the rings a rebase moved (KvTransactionCache::
  // Undo), the latent layers (empty for models without them), the pending append and the
  // position; taint, the spec checkpoint and the layer tables are never written by them.
  // The pending append moves out: a successful Advance always drops it (its Commit or its
  // Begin would), and the publish part reads it from here.
  KvTransactionCache::Undo kv_undo = kv_.SaveUndo();
  std::vector<LatentLayerState> latent_before = latent_;
  std::optional<AppendPlan> pending_before = std::move(pending_append_);
  pending_append_.reset();
  const uint64_t position_before = position_;
  absl::StatusOr<AdvanceResult> result =
      AdvanceInPlace(request, pending_before, kv_undo, check_commit);
  if (!result.ok()) {
    kv_.Restore(std::move(kv_undo));
    latent_ = std::move(latent_before);
    pending_append_ = std::move(pending_before);
    position_ = position_before;
  }
  return result;
}

absl::StatusOr<AdvanceResult> SessionState::AdvanceInPlace(
    const AdvanceRequest& request, const std::optional<AppendPlan>& pending,
    KvTransactionCache::Undo& kv_undo, absl::FunctionRef<absl::Status()> check_commit) {
  AdvanceResult result;
  if (request.generation != 0) {
    if (pending.has_value() && pending->transaction.generation == request.generation) {
      RETURN_IF_ERROR(PublishPlan(request.generation, &*pending, kv_undo));
      result.published = true;
    }
    RETURN_IF_ERROR(check_commit());
    ASSIGN_OR_RETURN(result.committed, Commit(request.generation, request.accepted_rows));
  }
  if (request.next_rows != 0) {
    ASSIGN_OR_RETURN(result.begun, Begin());
    ASSIGN_OR_RETURN(result.prepared, PrepareAppend(result.begun->generation, request.next_rows));
  }
  return result;
}

bool SessionState::CanRewindTo(uint64_t target) const {
  return target <= staged_len() && kv_.CanRewindTo(target) &&
         CheckLatentTailsResident(target).ok();
}

absl::Status SessionState::Rewind(uint64_t target) {
  RETURN_IF_ERROR(EnsureUsable("rewind"));
  KvTransactionCache rewound = kv_;
  RETURN_IF_ERROR(rewound.RewindTo(target));
  RETURN_IF_ERROR(CheckLatentTailsResident(target));
  kv_ = std::move(rewound);
  pending_append_.reset();
  SetLatentLengths(target);
  position_ = target;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<PlaneCopy>> SessionState::SpecSnapshot() {
  RETURN_IF_ERROR(EnsureUsable("spec snapshot"));
  if (!recurrent_layers_.empty() && !has_spec_buffers_) {
    return absl::FailedPreconditionError(
        absl::StrCat("spec snapshot: the session was created without spec snapshot buffers (",
                     recurrent_layers_.size(), " recurrent layers need them)"));
  }
  if (const std::optional<TransactionId>& active = kv_.state().active(); active.has_value()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "spec snapshot requires no active transaction (generation ", active->generation,
        " is active at base ", active->base_len, ")"));
  }
  std::vector<PlaneCopy> copies;
  for (uint32_t layer : recurrent_layers_) {
    const LayerGeometry* geometry = Geometry(layer);
    copies.push_back({{layer, PlaneKind::kConvState}, 0, {layer, PlaneKind::kSpecConv}, 0,
                      geometry->conv_elems * kF32});
    copies.push_back({{layer, PlaneKind::kSsmState}, 0, {layer, PlaneKind::kSpecSsm}, 0,
                      geometry->ssm_elems * kF32});
  }
  spec_ = SpecCheckpoint{committed_len(), position_};
  return copies;
}

absl::StatusOr<std::vector<PlaneCopy>> SessionState::SpecRollback(uint64_t accept_len) {
  RETURN_IF_ERROR(EnsureUsable("spec rollback"));
  if (!spec_.has_value()) {
    return absl::FailedPreconditionError("spec rollback: no spec snapshot was taken");
  }
  ASSIGN_OR_RETURN(uint64_t target,
                   CheckedAdd(spec_->committed_len, accept_len, "spec rollback target"));
  if (target > staged_len()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec rollback target ", target, " (snapshot ", spec_->committed_len, " + accepted ",
        accept_len, ") is past the staged length ", staged_len()));
  }
  RETURN_IF_ERROR(kv_.CheckResident(target, "rollback target"));
  RETURN_IF_ERROR(CheckLatentTailsResident(target));
  RETURN_IF_ERROR(kv_.RewindTo(target));
  pending_append_.reset();
  SetLatentLengths(target);
  // The reference's `pos`: recurrent state is back at the snapshot; the engine replays the
  // accepted tokens through its recurrent path to reach `target`.
  position_ = spec_->position;
  std::vector<PlaneCopy> copies;
  for (uint32_t layer : recurrent_layers_) {
    const LayerGeometry* geometry = Geometry(layer);
    copies.push_back({{layer, PlaneKind::kSpecConv}, 0, {layer, PlaneKind::kConvState}, 0,
                      geometry->conv_elems * kF32});
    copies.push_back({{layer, PlaneKind::kSpecSsm}, 0, {layer, PlaneKind::kSsmState}, 0,
                      geometry->ssm_elems * kF32});
  }
  return copies;
}

absl::Status SessionState::Hydrate(uint64_t logical_len,
                                   absl::Span<const uint64_t> resident_starts) {
  RETURN_IF_ERROR(EnsureUsable("hydrate"));
  std::vector<uint64_t> starts(resident_starts.begin(), resident_starts.end());
  if (starts.empty()) {
    for (size_t i = 0; i < kv_.layer_count(); ++i) {
      starts.push_back(kv_.ring(i).has_value()
                           ? AlignedWindowStart(logical_len, kv_.ring(i)->window())
                           : 0);
    }
  }
  KvTransactionCache hydrated = kv_;
  RETURN_IF_ERROR(hydrated.PublishHydration(logical_len, starts));
  kv_ = std::move(hydrated);
  pending_append_.reset();
  spec_.reset();
  SetLatentLengths(logical_len);
  for (LatentLayerState& layer : latent_) {
    // The engine owes only the live tail; rows below it are not known to be in the plane.
    layer.index_resident_from = LiveIndexTailStart(layer, logical_len);
  }
  position_ = logical_len;
  return absl::OkStatus();
}

absl::StatusOr<SessionState> SessionState::Recover(uint64_t cache_id, const SessionPlan& plan,
                                                   uint64_t capacity,
                                                   const CommittedRecord& record) {
  ASSIGN_OR_RETURN(SessionState state, Create(cache_id, plan, capacity));
  if (record.ring_bases.size() != state.kv_.layer_count()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "recovery record has ", record.ring_bases.size(), " ring bases for ",
        state.kv_.layer_count(), " K/V layers"));
  }
  const bool any_base = std::any_of(record.ring_bases.begin(), record.ring_bases.end(),
                                    [](uint64_t base) { return base != 0; });
  if (record.committed_len > 0 || any_base) {
    RETURN_IF_ERROR(state.Hydrate(record.committed_len, record.ring_bases));
  }
  for (size_t i = 0; i < state.kv_.layer_count(); ++i) {
    const uint64_t base = state.kv_.ring(i).has_value() ? state.kv_.ring(i)->base() : 0;
    if (base != record.ring_bases[i]) {
      return absl::FailedPreconditionError(
          absl::StrCat("layer ", state.kv_.shapes()[i].layer, ": recovered ring base ", base,
                       " differs from the recorded ", record.ring_bases[i]));
    }
  }
  state.kv_.AdoptNextGeneration(record.next_generation);
  if (record.tainted) state.MarkTainted();
  return state;
}

CommittedRecord SessionState::Committed() const {
  CommittedRecord record;
  record.committed_len = kv_.committed_len();
  record.next_generation = kv_.state().next_generation();
  record.ring_bases.reserve(kv_.layer_count());
  for (size_t i = 0; i < kv_.layer_count(); ++i) {
    record.ring_bases.push_back(kv_.ring(i).has_value() ? kv_.ring(i)->base() : 0);
  }
  record.tainted = tainted_;
  return record;
}

absl::Status SessionState::Reset() {
  RETURN_IF_ERROR(EnsureUsable("reset"));
  const uint64_t next_generation = kv_.state().next_generation();
  ASSIGN_OR_RETURN(KvTransactionCache fresh,
                   KvTransactionCache::Create(kv_.cache_id(), kv_.capacity(), kv_.shapes()));
  // Generations keep counting: a transaction from before the reset never validates again.
  fresh.AdoptNextGeneration(next_generation);
  kv_ = std::move(fresh);
  for (LatentLayerState& layer : latent_) {
    layer.len = 0;
    layer.index_pools_ready = 0;
    layer.index_resident_from = 0;
  }
  position_ = 0;
  pending_append_.reset();
  spec_.reset();
  return absl::OkStatus();
}

absl::StatusOr<std::vector<PlaneCopy>> SessionState::Grow(const SessionState& source,
                                                          SessionState& target) {
  RETURN_IF_ERROR(source.EnsureUsable("grow"));
  RETURN_IF_ERROR(target.EnsureUsable("grow target"));
  if (!target.kv_.state().IsFresh()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "grow target must be fresh, got committed/staged=", target.committed_len(), "/",
        target.staged_len()));
  }
  if (source.latent_.size() != target.latent_.size() ||
      source.recurrent_layers_ != target.recurrent_layers_) {
    return absl::InvalidArgumentError("grow target does not hold the source's layers");
  }
  const uint64_t rows = source.committed_len();
  ASSIGN_OR_RETURN(GrowPlan kv_plan, source.kv_.PrepareGrow(target.capacity(), rows));

  std::vector<PlaneCopy> copies;
  for (const LayerGrow& layer : kv_plan.layers) {
    const KvLayerShape* shape = nullptr;
    for (const KvLayerShape& candidate : kv_plan.shapes) {
      if (candidate.layer == layer.layer) shape = &candidate;
    }
    copies.push_back({{layer.layer, PlaneKind::kKeys}, layer.source_row * shape->k_token_bytes,
                      {layer.layer, PlaneKind::kKeys}, 0, layer.k_bytes});
    copies.push_back({{layer.layer, PlaneKind::kValues},
                      layer.source_row * shape->v_token_bytes,
                      {layer.layer, PlaneKind::kValues}, 0, layer.v_bytes});
  }
  // Latent layers: capture from the source and restore into the target, composed plane to
  // plane (both validated before anything changes).
  std::vector<LatentLayerState> restored = target.latent_;
  for (size_t i = 0; i < source.latent_.size(); ++i) {
    const LatentLayerState& from = source.latent_[i];
    if (from.layer != target.latent_[i].layer) {
      return absl::InvalidArgumentError(absl::StrCat("grow target latent layer ",
                                                     target.latent_[i].layer,
                                                     " does not match source layer ", from.layer));
    }
    if (from.len == 0) continue;
    ASSIGN_OR_RETURN(LatentCapturePlan capture, PlanLatentCapture(from));
    ASSIGN_OR_RETURN(LatentRestorePlan restore,
                     PlanLatentRestore(target.latent_[i], capture.snapshot, target.capacity()));
    for (const LatentCopy& out : capture.copies) {
      for (const LatentCopy& in : restore.copies) {
        if (in.plane != out.plane) continue;
        const PlaneKind kind = LatentPlaneKind(out.plane);
        const uint64_t element_bytes = LatentElementBytes(from, out.plane);
        copies.push_back({{from.layer, kind}, out.plane_offset_elems * element_bytes,
                          {from.layer, kind}, in.plane_offset_elems * element_bytes,
                          out.elems * element_bytes});
      }
    }
    restored[i] = restore.restored;
  }
  for (uint32_t layer : source.recurrent_layers_) {
    const LayerGeometry* geometry = source.Geometry(layer);
    copies.push_back({{layer, PlaneKind::kConvState}, 0, {layer, PlaneKind::kConvState}, 0,
                      geometry->conv_elems * kF32});
    copies.push_back({{layer, PlaneKind::kSsmState}, 0, {layer, PlaneKind::kSsmState}, 0,
                      geometry->ssm_elems * kF32});
  }
  KvTransactionCache grown = target.kv_;
  RETURN_IF_ERROR(grown.PublishGrow(kv_plan));
  target.kv_ = std::move(grown);
  target.latent_ = std::move(restored);
  target.position_ = rows;
  target.pending_append_.reset();
  target.spec_.reset();
  return copies;
}

}  // namespace memra
