#include "server/session/daemon_session.h"

#include <algorithm>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "core/arena_layout.h"
#include "core/checked_math.h"
#include "core/status_macros.h"
#include "spdlog/spdlog.h"

namespace memra {
namespace {

// cache_id binds core transactions to one session and layout version, daemon-wide.
uint64_t NextCacheId() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

// Where a plan's planes go in one arena, and the arena's exact bytes (what admission charges).
absl::StatusOr<SessionLayoutVersion> PlaceLayout(const DeviceBackend& backend, SessionPlan plan,
                                                 uint64_t version) {
  SessionLayoutVersion layout;
  layout.version = version;
  ASSIGN_OR_RETURN(ArenaLayout placed,
                   LayoutArena(plan.planes, kPlaneAlignment, backend.AllocationGranularity()));
  if (placed.planes.size() != plan.planes.size()) {
    return absl::InternalError(absl::StrCat("LayoutArena placed ", placed.planes.size(), " of ",
                                            plan.planes.size(), " planes"));
  }
  layout.offsets.reserve(placed.planes.size());
  for (const PlacedPlane& plane : placed.planes) layout.offsets.push_back(plane.offset);
  for (size_t i = 0; i < plan.planes.size(); ++i) {
    layout.index[PlaneKey(plan.planes[i].layer, plan.planes[i].kind)] = i;
  }
  layout.plan = std::move(plan);
  layout.arena_bytes = placed.bytes;
  return layout;
}

// Allocates and exports the arena of a placed layout whose bytes `charge` already holds in the
// budget. On failure nothing stays allocated and the charge is released.
absl::Status AllocateLayout(DeviceBackend* backend, DeviceBudget* budget, StateJournal* journal,
                            AllocationId charge, SessionLayoutVersion& layout) {
  layout.charge = charge;
  absl::StatusOr<ArenaId> arena =
      backend->CreateArena(layout.arena_bytes, ArenaVisibility::kExported);
  absl::StatusOr<ArenaExport> exported =
      arena.ok() ? backend->Export(*arena) : absl::StatusOr<ArenaExport>(arena.status());
  if (exported.ok() && exported->bytes != layout.arena_bytes) {
    exported = absl::InternalError(
        absl::StrCat("the backend allocated ", exported->bytes, " bytes for an arena charged ",
                     layout.arena_bytes, " bytes (the admission law is broken)"));
  }
  if (!exported.ok()) {
    if (arena.ok()) (void)backend->FreeArena(*arena);
    (void)budget->Release(charge);
    return exported.status();
  }
  layout.arena = *arena;
  layout.exported = *std::move(exported);
  if (journal != nullptr) journal->ArenaCreated(layout.arena);
  return absl::OkStatus();
}

// Generations are journaled as a reserve a block ahead of the next one, so a Begin rewrites the
// record once per kGenerationBlock: a restarted session continues from the reserve, above every
// generation issued before (they strictly increase; skipping some is harmless).
constexpr uint64_t kGenerationBlock = 1024;
uint64_t GenerationReserve(uint64_t next_generation) {
  return (next_generation / kGenerationBlock + 1) * kGenerationBlock;
}

// Why `state` cannot come back at its committed length after a restart ("" when it can): what
// the engine may already have written past the committed state in place.
std::string NotRecoverableReason(const SessionState& state) {
  if (const std::optional<AppendPlan>& pending = state.pending_append(); pending.has_value()) {
    for (const LayerAppend& layer : pending->layers) {
      if (layer.ring_append.has_value() &&
          layer.ring_append->kind == RingAppend::Kind::kRebase) {
        return absl::StrCat("a ring rebase (layer ", layer.layer,
                            ") was prepared and not yet published");
      }
    }
  }
  const bool open = state.kv().state().active().has_value() || state.pending_append().has_value();
  if (open && !state.recurrent_layers().empty()) {
    return absl::StrCat("a transaction was open on recurrent layer ", state.recurrent_layers()[0],
                        ", whose state the engine updates in place");
  }
  if (state.position() != state.committed_len()) {
    return absl::StrCat("its position ", state.position(), " differed from its committed length ",
                        state.committed_len(), " (a spec rollback awaited its replay)");
  }
  return "";
}

}  // namespace

absl::StatusOr<std::unique_ptr<DaemonSession>> DaemonSession::Create(
    Params params, DeviceBackend* backend, DeviceBudget* budget,
    std::optional<ReservationId> reservation, ArenaPool* pool) {
  ASSIGN_OR_RETURN(SessionPlan plan, PlanSession(*params.model, params.defaults, params.shape));
  ASSIGN_OR_RETURN(SessionState state,
                   SessionState::Create(NextCacheId(), plan, params.shape.capacity));
  ASSIGN_OR_RETURN(SessionLayoutVersion layout, PlaceLayout(*backend, std::move(plan), 1));
  // Admission: the charge is exactly the arena's bytes.
  const uint64_t owner = params.owner.value;
  if (reservation.has_value()) {
    ASSIGN_OR_RETURN(uint64_t reserved, budget->ReservedBytes(*reservation, owner));
    if (reserved != layout.arena_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "reservation ", reservation->value, " holds ", reserved,
          " bytes but this session needs ", layout.arena_bytes,
          " (create the shape that was reserved)"));
    }
  }
  std::optional<PooledArena> pooled =
      pool == nullptr ? std::nullopt : pool->Take(owner, layout.arena_bytes);
  absl::StatusOr<AllocationId> charge = reservation.has_value()
                                            ? budget->Commit(*reservation, owner,
                                                             layout.arena_bytes)
                                        : pooled.has_value()
                                            ? absl::StatusOr<AllocationId>(pooled->charge)
                                            : budget->Allocate(owner, layout.arena_bytes);
  if (!charge.ok()) {
    if (pooled.has_value()) pool->Return(owner, *std::move(pooled));
    return charge.status();
  }
  if (pooled.has_value()) {
    // The pooled arena brings its own charge: a reservation's is not needed.
    if (reservation.has_value()) (void)budget->Release(*charge);
    layout.charge = pooled->charge;
    layout.arena = pooled->arena;
    layout.exported = std::move(pooled->exported);
    // The journal keeps only arenas a session holds (a pooled one is never re-adopted): it
    // keeps this one again from now on.
    if (params.journal != nullptr) params.journal->ArenaCreated(layout.arena);
  } else {
    RETURN_IF_ERROR(AllocateLayout(backend, budget, params.journal, *charge, layout));
    if (pool != nullptr) pool->NoteNewArena(owner);
  }
  std::unique_ptr<DaemonSession> session(new DaemonSession(
      std::move(params), backend, budget, pool, std::move(state), std::move(layout)));
  // A fresh arena is zero-filled; the mirrors still get their values written once, so the
  // invariant does not depend on what the initial values happen to be. On failure the
  // destructor frees the arena and its charge (a tainted session's arena is never pooled).
  absl::Status ready;
  {
    absl::MutexLock lock(&session->mu_);
    ready = pooled.has_value() ? session->ClearReusedArena() : absl::OkStatus();
    if (ready.ok()) ready = session->SyncMirrors();
    if (!ready.ok()) session->state_.MarkTainted();
  }
  RETURN_IF_ERROR(ready);
  return session;
}

absl::StatusOr<std::unique_ptr<DaemonSession>> DaemonSession::Adopt(
    Params params, DeviceBackend* backend, DeviceBudget* budget, ArenaId arena,
    uint64_t arena_bytes, uint64_t layout_version, const CommittedRecord& record) {
  ASSIGN_OR_RETURN(SessionPlan plan, PlanSession(*params.model, params.defaults, params.shape));
  ASSIGN_OR_RETURN(SessionState state, SessionState::Recover(NextCacheId(), plan,
                                                             params.shape.capacity, record));
  ASSIGN_OR_RETURN(SessionLayoutVersion layout,
                   PlaceLayout(*backend, std::move(plan), layout_version));
  if (layout.arena_bytes != arena_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("the kept arena holds ", arena_bytes, " bytes but the session's plan places ",
                     layout.arena_bytes));
  }
  ASSIGN_OR_RETURN(layout.exported, backend->Export(arena));
  ASSIGN_OR_RETURN(layout.charge, budget->Allocate(params.owner.value, layout.arena_bytes));
  layout.arena = arena;
  // No pool: a re-adopted session's arena is freed at its release (the engine unmaps it).
  std::unique_ptr<DaemonSession> session(new DaemonSession(
      std::move(params), backend, budget, /*pool=*/nullptr, std::move(state), std::move(layout)));
  absl::MutexLock lock(&session->mu_);
  // The engine's prefix ids were not journaled: capture needs new commits (or a reset).
  session->committed_tokens_.reset();
  // The mirrors may show a staged length the restart dropped: write the committed ones.
  if (absl::Status mirrors = session->SyncMirrors(); !mirrors.ok()) {
    session->released_ = true;  // the caller frees the arena; only the charge goes here
    (void)budget->Release(session->current_.charge);
    session->UpdateArenaBytes();
    return mirrors;
  }
  return session;
}

void DaemonSession::JournalNow() {
  absl::MutexLock lock(&mu_);
  JournalLocked();
}

void DaemonSession::JournalLocked() {
  if (params_.journal == nullptr || released_) return;
  std::string reason = NotRecoverableReason(state_);
  const uint64_t generations = GenerationReserve(state_.kv().state().next_generation());
  // The common case (a Begin, a Prepare, a Publish without a rebase) changes nothing journaled:
  // compared in place, without building a record.
  if (journaled_.has_value() && journaled_->layout_version == current_.version &&
      journaled_->committed.committed_len == state_.committed_len() &&
      journaled_->committed.next_generation == generations &&
      journaled_->committed.tainted == state_.tainted() &&
      journaled_->not_recoverable == reason) {
    const std::vector<uint64_t>& bases = journaled_->committed.ring_bases;
    const KvTransactionCache& kv = state_.kv();
    bool same = bases.size() == kv.layer_count();
    for (size_t i = 0; same && i < kv.layer_count(); ++i) {
      same = bases[i] == (kv.ring(i).has_value() ? kv.ring(i)->base() : 0);
    }
    if (same) return;
  }
  Journaled now{.layout_version = current_.version,
                .committed = state_.Committed(),
                .not_recoverable = std::move(reason)};
  now.committed.next_generation = generations;
  JournaledSession record;
  record.id = params_.id.value;
  record.owner = params_.owner.value;
  record.slot = params_.slot;
  record.token = params_.token;
  record.fingerprint = params_.fingerprint;
  record.model = params_.model;
  record.shape = params_.shape;
  record.shape.capacity = state_.capacity();
  record.layout_version = current_.version;
  record.arena = current_.arena;
  record.arena_handle = current_.exported.handle;
  record.arena_bytes = current_.exported.bytes;
  record.committed = now.committed;
  record.not_recoverable = now.not_recoverable;
  params_.journal->SessionChanged(record);
  journaled_ = std::move(now);
}

absl::Status DaemonSession::ClearReusedArena() {
  for (size_t i = 0; i < current_.plan.planes.size(); ++i) {
    const PlaneSpec& plane = current_.plan.planes[i];
    switch (plane.kind) {
      case PlaneKind::kConvState:
      case PlaneKind::kSsmState:
      case PlaneKind::kSsmStateAlt:
      case PlaneKind::kSpecConv:
      case PlaneKind::kSpecSsm:
      case PlaneKind::kPoolKeys:
        RETURN_IF_ERROR(backend_->Memset(current_.arena, current_.offsets[i], 0, plane.bytes));
        break;
      case PlaneKind::kKeys:
      case PlaneKind::kValues:
      case PlaneKind::kLenMirror:
      case PlaneKind::kBaseMirror:
      case PlaneKind::kLatentRows:
      case PlaneKind::kIndexRows:
        break;
    }
  }
  return absl::OkStatus();
}

DaemonSession::DaemonSession(Params params, DeviceBackend* backend, DeviceBudget* budget,
                             ArenaPool* pool, SessionState state, SessionLayoutVersion layout)
    : params_(std::move(params)),
      backend_(backend),
      budget_(budget),
      pool_(pool),
      state_(std::move(state)),
      current_(std::move(layout)) {
  absl::MutexLock lock(&mu_);
  UpdateArenaBytes();
}

DaemonSession::~DaemonSession() { Release(); }

bool DaemonSession::TokenMatches(absl::string_view token) const {
  return TokensEqual(token, params_.token);
}
void DaemonSession::UpdateArenaBytes() {
  uint64_t bytes = 0;
  if (!released_) {
    bytes += current_.exported.bytes;
    if (previous_.has_value()) bytes += previous_->exported.bytes;
  }
  arena_bytes_.store(bytes, std::memory_order_relaxed);
  absl::MutexLock exports(&exports_mu_);
  exports_.clear();
  exports_released_ = released_;
  exports_version_ = current_.version;
  if (released_) return;
  for (const SessionLayoutVersion* layout : {&current_, previous_ ? &*previous_ : nullptr}) {
    if (layout == nullptr) continue;
    exports_.push_back({.handle = layout->exported.handle,
                        .arena = layout->arena,
                        .bytes = layout->exported.bytes});
  }
}

absl::StatusOr<ArenaFd> DaemonSession::DuplicateArenaFd(absl::string_view handle) {
  ExportedArena found;
  {
    absl::MutexLock lock(&exports_mu_);
    if (exports_released_) {
      return absl::NotFoundError(absl::StrCat("session ", params_.id.value, " was released"));
    }
    auto it = std::find_if(exports_.begin(), exports_.end(),
                           [&](const ExportedArena& exported) { return exported.handle == handle; });
    if (it == exports_.end()) {
      return absl::NotFoundError(absl::StrCat("session ", params_.id.value,
                                              " has no arena with handle \"",
                                              absl::CHexEscape(handle), "\" (layout version ",
                                              exports_version_, ")"));
    }
    found = *it;
  }
  ASSIGN_OR_RETURN(const int fd, backend_->DuplicateArenaFd(found.arena));
  return ArenaFd{.fd = ScopedFd(fd), .bytes = found.bytes};
}

absl::Status DaemonSession::CheckLive() const {
  if (released_) {
    return absl::NotFoundError(absl::StrCat("session ", params_.id.value, " was released"));
  }
  return absl::OkStatus();
}

absl::Status DaemonSession::SyncMirrors() {
  state_.MirrorsInto(mirror_values_);
  const std::vector<MirrorValue>& mirrors = mirror_values_;
  bool slots_match = mirror_slots_.size() == mirrors.size();
  for (size_t i = 0; slots_match && i < mirrors.size(); ++i) {
    slots_match = mirror_slots_[i].plane == mirrors[i].plane;
  }
  if (!slots_match) {
    mirror_slots_.clear();
    for (const MirrorValue& mirror : mirrors) {
      ASSIGN_OR_RETURN(PlaneAt plane, FindPlane(current_, mirror.plane));
      mirror_slots_.push_back({mirror.plane, plane.offset, std::nullopt});
    }
  }
  // Only the mirrors whose value changed, in one backend call.
  std::vector<I32Write>& writes = mirror_writes_;
  writes.clear();
  for (size_t i = 0; i < mirrors.size(); ++i) {
    if (mirror_slots_[i].written != mirrors[i].value) {
      writes.push_back({mirror_slots_[i].offset, mirrors[i].value});
    }
  }
  if (writes.empty()) return absl::OkStatus();
  RETURN_IF_ERROR(backend_->WriteI32s(current_.arena, writes));
  for (size_t i = 0; i < mirrors.size(); ++i) mirror_slots_[i].written = mirrors[i].value;
  return absl::OkStatus();
}

absl::Status DaemonSession::RunCopies(const SessionLayoutVersion& src,
                                      const SessionLayoutVersion& dst,
                                      const std::vector<PlaneCopy>& copies) {
  for (const PlaneCopy& copy : copies) {
    ASSIGN_OR_RETURN(PlaneAt from, FindPlane(src, copy.src));
    ASSIGN_OR_RETURN(PlaneAt to, FindPlane(dst, copy.dst));
    ASSIGN_OR_RETURN(uint64_t src_offset, RangeInPlane(from, copy.src_offset, copy.bytes));
    ASSIGN_OR_RETURN(uint64_t dst_offset, RangeInPlane(to, copy.dst_offset, copy.bytes));
    RETURN_IF_ERROR(backend_->Copy(dst.arena, dst_offset, src.arena, src_offset, copy.bytes));
  }
  return absl::OkStatus();
}

absl::Status DaemonSession::TaintAfter(absl::string_view op, absl::Status status) {
  if (status.ok()) return status;
  state_.MarkTainted();
  spdlog::error("session {}: {} changed state but its device work failed ({}); session tainted",
                params_.id.value, std::string(op), status.ToString());
  return status;
}

absl::StatusOr<TransactionId> DaemonSession::Begin() {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckLive());
  return state_.Begin();
}

absl::StatusOr<AppendPlan> DaemonSession::PrepareAppend(uint64_t generation, uint64_t rows) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckLive());
  return state_.PrepareAppend(generation, rows);
}

absl::StatusOr<PublishedAppend> DaemonSession::PublishAppend(uint64_t generation) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckLive());
  RETURN_IF_ERROR(state_.PublishAppend(generation));
  RETURN_IF_ERROR(TaintAfter("PublishAppend", SyncMirrors()));
  return PublishedAppend{.staged_len = state_.staged_len()};
}

absl::StatusOr<CommittedLength> DaemonSession::Commit(uint64_t generation,
                                                      uint64_t accepted_rows,
                                                      absl::Span<const int32_t> token_ids) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckLive());
  RETURN_IF_ERROR(CheckCommitTokenIds(accepted_rows, token_ids));
  const uint64_t base = state_.committed_len();
  ASSIGN_OR_RETURN(uint64_t committed, state_.Commit(generation, accepted_rows));
  RecordCommittedTokens(base, committed, token_ids);
  RETURN_IF_ERROR(TaintAfter("Commit", SyncMirrors()));
  return CommittedLength{.committed_len = committed};
}

absl::Status DaemonSession::CheckCommitTokenIds(uint64_t accepted_rows,
                                                absl::Span<const int32_t> token_ids) const {
  if (!token_ids.empty() && token_ids.size() != accepted_rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("session ", params_.id.value, ": commit carries ", token_ids.size(),
                     " token ids for ", accepted_rows, " accepted rows (send all or none)"));
  }
  return absl::OkStatus();
}

void DaemonSession::RecordCommittedTokens(uint64_t base, uint64_t committed,
                                          absl::Span<const int32_t> token_ids) {
  if (committed_tokens_.has_value() && committed_tokens_->size() == base &&
      token_ids.size() == committed - base) {
    committed_tokens_->insert(committed_tokens_->end(), token_ids.begin(), token_ids.end());
  } else {
    committed_tokens_.reset();
  }
}

absl::StatusOr<SessionAdvanced> DaemonSession::Advance(const AdvanceRequest& request,
                                                       absl::Span<const int32_t> token_ids) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckLive());
  if (request.generation == 0 && !token_ids.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "session ", params_.id.value, ": advance carries ", token_ids.size(),
        " token ids but finishes no transaction (generation 0)"));
  }
  const uint64_t base = state_.committed_len();
  ASSIGN_OR_RETURN(AdvanceResult result, state_.Advance(request, [&] {
                     return CheckCommitTokenIds(request.accepted_rows, token_ids);
                   }));
  if (result.committed.has_value()) RecordCommittedTokens(base, *result.committed, token_ids);
  RETURN_IF_ERROR(TaintAfter("Advance", SyncMirrors()));
  return SessionAdvanced{.committed_len = state_.committed_len(), .step = std::move(result)};
}

absl::StatusOr<CommittedLength> DaemonSession::Abort(uint64_t generation) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckLive());
  RETURN_IF_ERROR(state_.Abort(generation));
  RETURN_IF_ERROR(TaintAfter("Abort", SyncMirrors()));
  return CommittedLength{.committed_len = state_.committed_len()};
}

absl::Status DaemonSession::Rewind(uint64_t target) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckLive());
  RETURN_IF_ERROR(state_.Rewind(target));
  TruncateCommittedTokens();
  return TaintAfter("Rewind", SyncMirrors());
}

absl::Status DaemonSession::Hydrate(uint64_t logical_len,
                                    absl::Span<const uint64_t> resident_starts) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckLive());
  RETURN_IF_ERROR(state_.Hydrate(logical_len, resident_starts));
  committed_tokens_.reset();  // the engine wrote rows the daemon never saw committed
  return TaintAfter("Hydrate", SyncMirrors());
}

absl::StatusOr<bool> DaemonSession::CanRewind(uint64_t target) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckLive());
  return state_.CanRewindTo(target);
}

absl::Status DaemonSession::SpecSnapshot() {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckLive());
  ASSIGN_OR_RETURN(std::vector<PlaneCopy> copies, state_.SpecSnapshot());
  return TaintAfter("SpecSnapshot", RunCopies(current_, current_, copies));
}

absl::Status DaemonSession::SpecRollback(uint64_t accept_len) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckLive());
  ASSIGN_OR_RETURN(std::vector<PlaneCopy> copies, state_.SpecRollback(accept_len));
  TruncateCommittedTokens();
  RETURN_IF_ERROR(TaintAfter("SpecRollback", RunCopies(current_, current_, copies)));
  return TaintAfter("SpecRollback", SyncMirrors());
}

absl::Status DaemonSession::Reset() {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckLive());
  if (previous_.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", params_.id.value, ": grow to layout version ", current_.version,
                     " is not acknowledged yet; acknowledge it before Reset"));
  }
  RETURN_IF_ERROR(state_.Reset());
  committed_tokens_ = std::vector<int32_t>();
  return TaintAfter("Reset", SyncMirrors());
}

absl::Status DaemonSession::Taint(absl::string_view reason) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckLive());
  state_.MarkTainted();
  spdlog::warn("session {} tainted by its engine: {}", params_.id.value, std::string(reason));
  return absl::OkStatus();
}

absl::StatusOr<SessionReport> DaemonSession::Grow(uint64_t target_capacity) {
  absl::MutexLock long_op(&long_op_mu_);
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckLive());
  if (previous_.has_value()) {
    return absl::FailedPreconditionError(absl::StrCat("session ", params_.id.value,
                                                      ": grow to layout version ", current_.version,
                                                      " is not acknowledged yet"));
  }
  RETURN_IF_ERROR(state_.EnsureUsable("grow"));
  if (target_capacity <= state_.capacity()) {
    return absl::InvalidArgumentError(
        absl::StrCat("session ", params_.id.value, ": grow target capacity ", target_capacity,
                     " is not above the current capacity ", state_.capacity()));
  }
  SessionShape grown = params_.shape;
  grown.capacity = target_capacity;
  ASSIGN_OR_RETURN(SessionPlan plan, PlanSession(*params_.model, params_.defaults, grown));
  ASSIGN_OR_RETURN(SessionState target, SessionState::Create(NextCacheId(), plan, target_capacity));
  ASSIGN_OR_RETURN(SessionLayoutVersion layout,
                   PlaceLayout(*backend_, std::move(plan), current_.version + 1));
  // Old and new arenas coexist until the engine acknowledges: the new one is charged in full.
  ASSIGN_OR_RETURN(AllocationId charge, budget_->Allocate(params_.owner.value, layout.arena_bytes));
  RETURN_IF_ERROR(AllocateLayout(backend_, budget_, params_.journal, charge, layout));
  if (pool_ != nullptr) pool_->NoteNewArena(params_.owner.value);  // the engine maps it
  // Until the swap below the source is untouched: a failure frees the new arena and leaves the
  // session exactly as it was. Core validates everything before it changes `target`.
  absl::StatusOr<std::vector<PlaneCopy>> copies = SessionState::Grow(state_, target);
  absl::Status status = copies.ok() ? RunCopies(current_, layout, *copies) : copies.status();
  if (!status.ok()) {
    (void)FreeLayout(layout);
    return status;
  }
  const uint64_t rows = state_.committed_len();
  previous_ = std::move(current_);
  current_ = std::move(layout);
  state_ = std::move(target);
  mirror_slots_.clear();
  UpdateArenaBytes();
  RETURN_IF_ERROR(TaintAfter("Grow", SyncMirrors()));
  spdlog::info("session {}: grown to capacity {} (layout version {}, {} rows copied)",
               params_.id.value, target_capacity, current_.version, rows);
  return SessionReport{.state = StatusLocked(), .layout = PlacedLocked(current_)};
}

absl::Status DaemonSession::AcknowledgeGrow(uint64_t layout_version) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckLive());
  if (!previous_.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", params_.id.value,
                     ": no grow awaits acknowledgement (layout version ", current_.version, ")"));
  }
  if (layout_version != current_.version) {
    return absl::InvalidArgumentError(
        absl::StrCat("session ", params_.id.value, ": acknowledged layout version ", layout_version,
                     " but the grow produced version ", current_.version));
  }
  RETURN_IF_ERROR(FreeLayout(*previous_));
  previous_.reset();
  UpdateArenaBytes();
  return absl::OkStatus();
}

absl::StatusOr<SessionReport> DaemonSession::GetState(bool with_layout) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckLive());
  SessionReport report;
  report.state = StatusLocked();
  if (with_layout) report.layout = PlacedLocked(current_);
  return report;
}

bool DaemonSession::RunUnlessBusy(absl::FunctionRef<void()> run) {
  if (!long_op_mu_.TryLock()) return false;
  run();
  long_op_mu_.Unlock();
  return true;
}

absl::Status DaemonSession::FreeLayout(const SessionLayoutVersion& layout) {
  // The journal stops keeping the arena first: a restart never adopts freed memory.
  if (params_.journal != nullptr) params_.journal->ArenaFreed(layout.arena);
  absl::Status status = backend_->FreeArena(layout.arena);
  if (!status.ok()) {
    // The backend still frees everything at shutdown; accounting shows the leak meanwhile, and
    // the charge stays so admission never hands out bytes the device may not have.
    spdlog::error("session {}: freeing arena {} failed: {}", params_.id.value,
                  layout.arena.value, status.ToString());
    return status;
  }
  return budget_->Release(layout.charge);
}

uint64_t DaemonSession::Release() {
  absl::MutexLock long_op(&long_op_mu_);
  absl::MutexLock lock(&mu_);
  if (released_) return 0;
  // The record goes before the arenas it names.
  if (params_.journal != nullptr) params_.journal->SessionReleased(params_.id.value);
  uint64_t freed = 0;
  for (SessionLayoutVersion* layout : {&current_, previous_ ? &*previous_ : nullptr}) {
    if (layout == nullptr) continue;
    // A tainted session's device work failed: its arena is not trusted for reuse.
    if (pool_ != nullptr && !state_.tainted() &&
        pool_->Put(params_.owner.value,
                   PooledArena{layout->arena, layout->exported, layout->charge})) {
      // Pooled arenas belong to no session: the journal stops keeping them (a restart frees
      // them with the pool) until a session takes one again.
      if (params_.journal != nullptr) params_.journal->ArenaFreed(layout->arena);
      pooled_handles_.push_back(layout->exported.handle);
      freed += layout->exported.bytes;
    } else if (FreeLayout(*layout).ok()) {
      freed += layout->exported.bytes;
    }
  }
  previous_.reset();
  released_ = true;
  UpdateArenaBytes();
  return freed;
}

std::vector<std::string> DaemonSession::pooled_handles() const {
  absl::MutexLock lock(&mu_);
  return pooled_handles_;
}

void DaemonSession::TruncateCommittedTokens() {
  if (!committed_tokens_.has_value()) return;
  if (committed_tokens_->size() < state_.committed_len()) {
    committed_tokens_.reset();  // rows whose tokens no commit reported
  } else {
    committed_tokens_->resize(state_.committed_len());
  }
}

absl::Status DaemonSession::ViewLocked(LockedView view) {
  absl::MutexLock long_op(&long_op_mu_);
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckLive());
  return view(state_, current_, committed_tokens_);
}

absl::Status DaemonSession::RestoreLocked(Restorer restore, absl::Span<const int32_t> token_ids) {
  absl::MutexLock long_op(&long_op_mu_);
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckLive());
  if (previous_.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", params_.id.value, ": grow to layout version ", current_.version,
                     " is not acknowledged yet; acknowledge it before a restore"));
  }
  ASSIGN_OR_RETURN(SessionState restored, restore(state_, current_));
  state_ = std::move(restored);
  const uint64_t rows = std::min<uint64_t>(state_.committed_len(), token_ids.size());
  committed_tokens_ = std::vector<int32_t>(token_ids.begin(), token_ids.begin() + rows);
  if (rows != state_.committed_len()) committed_tokens_.reset();
  absl::Status mirrors = TaintAfter("prefix restore", SyncMirrors());
  JournalLocked();
  return mirrors;
}

SessionStatus DaemonSession::StatusLocked() const {
  SessionStatus out{.layout_version = current_.version,
                    .capacity = state_.capacity(),
                    .committed_len = state_.committed_len(),
                    .staged_len = state_.staged_len(),
                    .position = state_.position(),
                    .next_generation = state_.kv().state().next_generation(),
                    .tainted = state_.tainted(),
                    .spec_snapshot_valid = state_.spec_snapshot_valid(),
                    .grow_pending = previous_.has_value(),
                    .layers = {}};
  const auto& active = state_.kv().state().active();
  out.active_generation = active.has_value() ? active->generation : 0;
  // Layer -> its index in out.layers: each layer once, where it first appears.
  absl::flat_hash_map<uint32_t, size_t> by_layer;
  auto layer_status = [&](uint32_t layer) -> LayerStatus& {
    auto [it, added] = by_layer.try_emplace(layer, out.layers.size());
    if (added) out.layers.push_back(LayerStatus{.layer = layer});
    return out.layers[it->second];
  };
  for (const MirrorValue& mirror : state_.Mirrors()) {
    LayerStatus& entry = layer_status(mirror.plane.layer);
    if (mirror.plane.kind == PlaneKind::kBaseMirror) {
      entry.ring = true;
      entry.ring_base = static_cast<uint64_t>(mirror.value);
    } else {
      entry.length = mirror.value;
    }
  }
  for (const LatentLayerState& latent : state_.latent()) {
    LayerStatus& entry = layer_status(latent.layer);
    entry.index_pools_ready = latent.index_pools_ready;
    entry.index_resident_from = latent.index_resident_from;
  }
  return out;
}

PlacedLayout DaemonSession::PlacedLocked(const SessionLayoutVersion& layout) const {
  return PlacedLayout{.layout_version = layout.version,
                      .capacity = state_.capacity(),
                      .arena = layout.exported,
                      .plan = layout.plan,
                      .offsets = layout.offsets};
}

}  // namespace memra
