#include "server/session/session_registry.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/codec.h"  // FingerprintToBytes
#include "core/status_macros.h"
#include "server/base/secret_token.h"
#include "server/session/session_prefix.h"
#include "spdlog/spdlog.h"

namespace memra {
namespace {

// std::visit over a set of lambdas.
template <typename... Fs>
struct Overloaded : Fs... {
  using Fs::operator()...;
};
template <typename... Fs>
Overloaded(Fs...) -> Overloaded<Fs...>;

}  // namespace

SessionRegistry::SessionRegistry(DeviceBackend* backend, DeviceBudget* budget,
                                 EngineLeases* leases, PlanRegistry* plans,
                                 FormatDefaults defaults, PrefixCache* capture_on_reclaim,
                                 uint64_t max_sessions_per_engine, ArenaPool* pool,
                                 StateJournal* journal, EngineTimeShares* time_shares)
    : backend_(backend),
      budget_(budget),
      leases_(leases),
      plans_(plans),
      defaults_(defaults),
      capture_on_reclaim_(capture_on_reclaim),
      max_sessions_per_engine_(max_sessions_per_engine),
      pool_(pool),
      journal_(journal),
      time_shares_(time_shares) {}

DaemonSession::Params SessionRegistry::BaseParams() const {
  DaemonSession::Params params;
  params.defaults = defaults_;
  params.journal = journal_;
  return params;
}

absl::Status SessionRegistry::Readopt(std::shared_ptr<DaemonSession> session,
                                      uint64_t slot_limit) {
  const uint64_t id = session->id().value;
  if (session->slot() >= slot_limit) {
    return absl::OutOfRangeError(absl::StrCat(
        "session ", id, ": slot ", session->slot(), " is not below ", slot_limit,
        ", the previous journal's limit on session slots (a corrupt record)"));
  }
  RaiseNextSessionId(id + 1);
  {
    absl::MutexLock lock(&mu_);
    if (sessions_.contains(id)) {
      return absl::AlreadyExistsError(absl::StrCat("session ", id, " is already filed"));
    }
    const uint32_t slot = session->slot();
    if (slot < slots_.size() && slots_[slot] != nullptr) {
      return absl::AlreadyExistsError(absl::StrCat("session ", id, ": slot ", slot,
                                                   " already holds session ",
                                                   slots_[slot]->id().value));
    }
    // The slots below it stay free for new sessions (last freed first, like released ones).
    while (slots_.size() <= slot) {
      free_slots_.push_back(static_cast<uint32_t>(slots_.size()));
      slots_.push_back(nullptr);
    }
    free_slots_.erase(std::remove(free_slots_.begin(), free_slots_.end(), slot),
                      free_slots_.end());
    slots_[slot] = session;
    by_engine_[session->owner().value].insert(id);
    sessions_[id] = session;
  }
  session->JournalNow();
  return absl::OkStatus();
}

void SessionRegistry::RaiseNextSessionId(uint64_t next) {
  uint64_t now = next_session_id_.load();
  while (now < next && !next_session_id_.compare_exchange_weak(now, next)) {
  }
}

void SessionRegistry::SetRestart(DaemonRestart restart,
                                 absl::flat_hash_map<uint64_t, std::string> not_readopted,
                                 uint64_t unreadable_records, uint64_t issued_below) {
  absl::MutexLock lock(&mu_);
  restart_ = restart;
  not_readopted_ = std::move(not_readopted);
  unreadable_records_ = unreadable_records;
  issued_below_ = issued_below;
}

absl::StatusOr<uint32_t> SessionRegistry::BeginCreating(EngineId engine) {
  absl::MutexLock lock(&mu_);
  auto held = by_engine_.find(engine.value);
  const uint64_t sessions =
      (held == by_engine_.end() ? 0 : held->second.size()) + creating_[engine.value];
  if (sessions >= max_sessions_per_engine_) {
    if (creating_[engine.value] == 0) creating_.erase(engine.value);
    return absl::ResourceExhaustedError(absl::StrCat(
        "engine ", engine.value, " holds ", sessions, " sessions and the limit is ",
        max_sessions_per_engine_, " per engine (max_engine_sessions); release one first"));
  }
  uint32_t slot;
  if (!free_slots_.empty()) {
    slot = free_slots_.back();
    free_slots_.pop_back();
  } else if (slots_.size() < UINT32_MAX) {
    slot = static_cast<uint32_t>(slots_.size());
    slots_.push_back(nullptr);
  } else {
    return absl::ResourceExhaustedError(
        absl::StrCat("every one of ", slots_.size(), " session slots is in use"));
  }
  ++creating_[engine.value];
  return slot;
}

void SessionRegistry::FreeSlotLocked(uint32_t slot) {
  slots_[slot] = nullptr;
  free_slots_.push_back(slot);
}

void SessionRegistry::EndCreating(EngineId engine) {
  auto it = creating_.find(engine.value);
  if (it == creating_.end()) return;
  if (--it->second == 0) creating_.erase(it);
}

ArenaRounding SessionRegistry::rounding() const {
  return ArenaRounding{kPlaneAlignment, backend_->AllocationGranularity()};
}

absl::StatusOr<std::shared_ptr<DaemonSession>> SessionRegistry::Create(
    const EngineCredentials& engine, const PlanFingerprint& plan, const SessionShape& shape,
    std::optional<ReservationId> reservation) {
  RETURN_IF_ERROR(leases_->Admit(engine, "the daemon is draining; no new sessions"));
  RETURN_IF_ERROR(AdmitWork(engine.id));
  TimeCharge charge(time_shares_, engine.id);
  ASSIGN_OR_RETURN(const uint32_t slot, BeginCreating(engine.id));
  absl::StatusOr<std::shared_ptr<DaemonSession>> session =
      AllocateSession(engine, slot, plan, shape, reservation);
  {
    absl::MutexLock lock(&mu_);
    EndCreating(engine.id);  // from here the session counts in by_engine_, or not at all
    if (!session.ok()) {
      FreeSlotLocked(slot);
      return session.status();
    }
    // The engine may have lost its lease (or the daemon started draining) while the arena was
    // allocated: the session never becomes visible then.
    if (absl::Status still = leases_->Admit(engine, "the daemon is draining"); !still.ok()) {
      FreeSlotLocked(slot);
      (*session)->Release();
      return still;
    }
    by_engine_[engine.id.value].insert((*session)->id().value);
    sessions_[(*session)->id().value] = *session;
    slots_[slot] = *session;
  }
  (*session)->JournalNow();
  spdlog::info("session {} created for engine {}: capacity {} tokens, {} bytes{}",
               (*session)->id().value, engine.id.value, shape.capacity,
               (*session)->arena_bytes(),
               reservation.has_value() ? absl::StrCat(" (reservation ", reservation->value, ")")
                                       : std::string());
  return session;
}

absl::StatusOr<std::shared_ptr<DaemonSession>> SessionRegistry::AllocateSession(
    const EngineCredentials& engine, uint32_t slot, const PlanFingerprint& plan,
    const SessionShape& shape, std::optional<ReservationId> reservation) {
  DaemonSession::Params params = BaseParams();
  params.slot = slot;
  ASSIGN_OR_RETURN(params.model, plans_->Find(plan));
  params.id = SessionId{next_session_id_.fetch_add(1)};
  params.owner = engine.id;
  ASSIGN_OR_RETURN(params.cache_scope, leases_->CacheScope(engine));
  ASSIGN_OR_RETURN(params.token, RandomSecretToken());
  params.fingerprint = FingerprintToBytes(plan);
  params.shape = shape;
  absl::StatusOr<std::unique_ptr<DaemonSession>> session =
      DaemonSession::Create(params, backend_, budget_, reservation, pool_);
  // Admission already frees the engine's own pooled arenas before refusing it (DeviceBudget);
  // this covers the backend's own refusal (no memory for the new arena) while the engine's pool
  // holds arenas of other sizes: those go, then one retry.
  if (session.status().code() == absl::StatusCode::kResourceExhausted && pool_ != nullptr &&
      pool_->pooled_bytes(engine.id.value) > 0) {
    const uint64_t drained = pool_->DrainEngine(engine.id.value, /*forget=*/false);
    spdlog::info("engine {}: freed its {} pooled bytes to admit a session", engine.id.value,
                 drained);
    session = DaemonSession::Create(std::move(params), backend_, budget_, reservation, pool_);
  }
  if (!session.ok()) return session.status();
  return std::shared_ptr<DaemonSession>(*std::move(session));
}

absl::StatusOr<ArenaReservation> SessionRegistry::Reserve(const EngineCredentials& engine,
                                                            const PlanFingerprint& plan,
                                                            const SessionShape& shape) {
  // Refusals of the engine come before those of its request.
  RETURN_IF_ERROR(leases_->Admit(engine, "the daemon is draining; no new reservations"));
  ASSIGN_OR_RETURN(std::shared_ptr<const ModelPlan> model, plans_->Find(plan));
  ASSIGN_OR_RETURN(uint64_t bytes, SessionArenaBytes(*model, defaults_, shape, rounding()));
  ASSIGN_OR_RETURN(EngineReservation reserved, leases_->Reserve(engine, bytes));
  spdlog::info("reservation {} for engine {}: {} bytes (capacity {} tokens) for {} ms",
               reserved.id.value, engine.id.value, bytes, shape.capacity,
               absl::ToInt64Milliseconds(reserved.ttl));
  return ArenaReservation{reserved.id, bytes, reserved.ttl};
}

absl::StatusOr<ArenaReservation> SessionRegistry::ReserveGroupRank(
    const EngineCredentials& engine, const PlanFingerprint& plan, const SessionShape& shape,
    GroupRankKey group, absl::Duration deadline, uint64_t expected_bytes) {
  RETURN_IF_ERROR(leases_->Admit(engine, "the daemon is draining; no new group reservations"));
  ASSIGN_OR_RETURN(std::shared_ptr<const ModelPlan> model, plans_->Find(plan));
  ASSIGN_OR_RETURN(uint64_t bytes, SessionArenaBytes(*model, defaults_, shape, rounding()));
  if (expected_bytes != 0 && expected_bytes != bytes) {
    return absl::FailedPreconditionError(absl::StrCat(
        GroupRankName(group), ": this daemon prices the shard (capacity ", shape.capacity,
        " tokens) at ", bytes, " bytes, the group client expected ", expected_bytes,
        " (another plan or shape than it priced)"));
  }
  ASSIGN_OR_RETURN(ReservationId id, leases_->ReserveGroupRank(engine, bytes, group, deadline));
  spdlog::info("{} reserved for engine {}: {} bytes (capacity {} tokens), reservation {}, {} ms "
               "to confirm",
               GroupRankName(group), engine.id.value, bytes, shape.capacity, id.value,
               absl::ToInt64Milliseconds(deadline));
  return ArenaReservation{id, bytes, deadline};
}

absl::StatusOr<std::shared_ptr<DaemonSession>> SessionRegistry::Find(
    const SessionCredentials& credentials) const {
  std::shared_ptr<DaemonSession> session;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(credentials.id.value);
    if (it == sessions_.end()) {
      if (restart_.has_value()) {
        if (auto lost = not_readopted_.find(credentials.id.value); lost != not_readopted_.end()) {
          return DaemonRestartedError(*restart_, absl::StrCat("session ", credentials.id.value,
                                                              " was not re-adopted: ",
                                                              lost->second));
        }
        if (unreadable_records_ > 0 && credentials.id.value < issued_below_) {
          return DaemonRestartedError(
              *restart_, absl::StrCat("session ", credentials.id.value,
                                      " was not re-adopted: it is not in the restart journal, ",
                                      unreadable_records_,
                                      " of whose records were damaged beyond reading (it may "
                                      "have been one of them)"));
        }
      }
      return absl::NotFoundError(
          absl::StrCat("session ", credentials.id.value, " does not exist"));
    }
    session = it->second;
  }
  if (!session->TokenMatches(credentials.token)) {
    return absl::PermissionDeniedError(
        absl::StrCat("wrong session token for session ", credentials.id.value));
  }
  return session;
}

absl::StatusOr<std::shared_ptr<DaemonSession>> SessionRegistry::Find(
    const SessionSlot& slot) const {
  absl::MutexLock lock(&mu_);
  // An empty slot and another engine's are one refusal, word for word: an engine must not
  // learn which slots other engines' sessions hold.
  if (slot.slot >= slots_.size() || slots_[slot.slot] == nullptr ||
      !(slots_[slot.slot]->owner() == slot.engine)) {
    return SlotRefusal(slot);
  }
  return slots_[slot.slot];
}

absl::Status SessionRegistry::SlotRefusal(const SessionSlot& slot) {
  return absl::NotFoundError(
      absl::StrCat("slot ", slot.slot, " holds no session of engine ", slot.engine.value));
}

void SessionRegistry::FindSlots(EngineId engine, absl::Span<const uint32_t> slots,
                                absl::Span<std::shared_ptr<DaemonSession>> out) const {
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < slots.size() && i < out.size(); ++i) {
    const uint32_t slot = slots[i];
    const bool owned = slot < slots_.size() && slots_[slot] != nullptr &&
                       slots_[slot]->owner() == engine;
    out[i] = owned ? slots_[slot] : nullptr;
  }
}

absl::StatusOr<SessionRelease> SessionRegistry::Release(const SessionCredentials& credentials) {
  ASSIGN_OR_RETURN(std::shared_ptr<DaemonSession> session, Find(credentials));
  {
    absl::MutexLock lock(&mu_);
    if (RemoveLocked({credentials.id.value}).empty()) {
      return absl::NotFoundError(
          absl::StrCat("session ", credentials.id.value, " does not exist"));
    }
  }
  SessionRelease released;
  released.bytes = session->Release();
  released.pooled_handles = session->pooled_handles();
  released.unmap_handles = TakeUnmapped(session->owner());
  spdlog::info("session {} released: {} bytes ({} arenas pooled)", credentials.id.value,
               released.bytes, released.pooled_handles.size());
  return released;
}

std::vector<std::string> SessionRegistry::TakeUnmapped(EngineId engine) {
  return pool_ == nullptr ? std::vector<std::string>() : pool_->TakeUnmapped(engine.value);
}

std::vector<std::shared_ptr<DaemonSession>> SessionRegistry::RemoveLocked(
    const std::vector<uint64_t>& ids) {
  std::vector<std::shared_ptr<DaemonSession>> removed;
  removed.reserve(ids.size());
  for (uint64_t id : ids) {
    auto it = sessions_.find(id);
    if (it == sessions_.end()) continue;
    std::shared_ptr<DaemonSession> session = std::move(it->second);
    sessions_.erase(it);
    FreeSlotLocked(session->slot());
    auto owned = by_engine_.find(session->owner().value);
    if (owned != by_engine_.end()) {
      owned->second.erase(id);
      if (owned->second.empty()) by_engine_.erase(owned);
    }
    removed.push_back(std::move(session));
  }
  return removed;
}

absl::StatusOr<SessionResult> SessionRegistry::Apply(DaemonSession& session,
                                                     const SessionOp& op) {
  // Each operation's result as the variant; operations without one answer std::monostate.
  auto none = [](absl::Status status) -> absl::StatusOr<SessionResult> {
    if (!status.ok()) return status;
    return SessionResult();
  };
  auto result = [](auto value) -> absl::StatusOr<SessionResult> {
    if (!value.ok()) return value.status();
    return SessionResult(*std::move(value));
  };
  return std::visit(
      Overloaded{
          [&](const BeginOp&) { return result(session.Begin()); },
          [&](const PrepareAppendOp& prepare) {
            return result(session.PrepareAppend(prepare.generation, prepare.rows));
          },
          [&](const PublishAppendOp& publish) {
            return result(session.PublishAppend(publish.generation));
          },
          [&](const CommitOp& commit) {
            return result(session.Commit(commit.generation, commit.accepted_rows,
                                         commit.token_ids));
          },
          [&](const AbortOp& abort) { return result(session.Abort(abort.generation)); },
          [&](const AdvanceOp& advance) {
            return result(session.Advance(advance.request, advance.token_ids));
          },
          [&](const ResetOp&) { return none(session.Reset()); },
          [&](const RewindOp& rewind) { return none(session.Rewind(rewind.target)); },
          [&](const CanRewindOp& can) -> absl::StatusOr<SessionResult> {
            ASSIGN_OR_RETURN(bool possible, session.CanRewind(can.target));
            return RewindPossible{.possible = possible};
          },
          [&](const HydrateOp& hydrate) {
            return none(session.Hydrate(hydrate.logical_len, hydrate.resident_starts));
          },
          [&](const SpecSnapshotOp&) { return none(session.SpecSnapshot()); },
          [&](const SpecRollbackOp& rollback) {
            return none(session.SpecRollback(rollback.accept_len));
          },
          [&](const GrowOp& grow) { return result(session.Grow(grow.target_capacity)); },
          [&](const AcknowledgeGrowOp& acknowledge) {
            return none(session.AcknowledgeGrow(acknowledge.layout_version));
          },
          [&](const TaintOp& taint) { return none(session.Taint(taint.reason)); },
          [&](const GetStateOp& get) { return result(session.GetState(get.with_layout)); },
      },
      op);
}

absl::StatusOr<std::vector<SessionResult>> SessionRegistry::Run(
    const SessionCredentials& credentials, absl::Span<const SessionOp> ops,
    absl::FunctionRef<absl::Status()> before) {
  ASSIGN_OR_RETURN(std::shared_ptr<DaemonSession> session, Find(credentials));
  if (!ops.empty()) RETURN_IF_ERROR(AdmitWork(session->owner(), ops.front()));
  RETURN_IF_ERROR(before());  // waiting for the engine's device event is not the daemon's work
  TimeCharge charge(time_shares_, session->owner());
  std::vector<SessionResult> results;
  results.reserve(ops.size());
  absl::Status status;
  for (const SessionOp& op : ops) {
    absl::StatusOr<SessionResult> result = Apply(*session, op);
    if (!result.ok()) {
      status = result.status();
      break;
    }
    results.push_back(*std::move(result));
  }
  // Before the reply: what the engine is told happened is what a restart brings back.
  session->JournalNow();
  if (!status.ok()) return status;
  return results;
}

absl::StatusOr<SessionResult> SessionRegistry::Run(const SessionCredentials& credentials,
                                                   const SessionOp& op) {
  ASSIGN_OR_RETURN(std::shared_ptr<DaemonSession> session, Find(credentials));
  return ApplyAndJournal(*session, op);
}

absl::StatusOr<SessionResult> SessionRegistry::Run(const SessionSlot& slot,
                                                   const SessionOp& op) {
  ASSIGN_OR_RETURN(std::shared_ptr<DaemonSession> session, Find(slot));
  return ApplyAndJournal(*session, op);
}

std::optional<absl::StatusOr<SessionResult>> SessionRegistry::TryRun(const SessionSlot& slot,
                                                                     const SessionOp& op) {
  absl::StatusOr<std::shared_ptr<DaemonSession>> session = Find(slot);
  if (!session.ok()) return absl::StatusOr<SessionResult>(session.status());
  return TryApply(**session, op);
}

std::optional<absl::StatusOr<SessionResult>> SessionRegistry::TryApply(DaemonSession& session,
                                                                       const SessionOp& op,
                                                                       bool charged_by_caller) {
  if (std::holds_alternative<GrowOp>(op)) {
    // Grow takes the lock RunUnlessBusy holds: refused, never a self-deadlock.
    return absl::StatusOr<SessionResult>(
        absl::InvalidArgumentError("TryRun runs short operations only; Grow is a long one"));
  }
  std::optional<absl::StatusOr<SessionResult>> ran;
  if (!session.RunUnlessBusy([&] {
        ran = charged_by_caller ? ApplyAndJournalUncharged(session, op)
                                : ApplyAndJournal(session, op);
      })) {
    return std::nullopt;
  }
  return ran;
}

absl::Status SessionRegistry::AdmitWork(EngineId engine) {
  return time_shares_ == nullptr ? absl::OkStatus() : time_shares_->Admit(engine);
}

absl::Status SessionRegistry::AdmitWork(EngineId engine, const SessionOp& op) {
  // An engine can always end what it started: an abort, and the acknowledgement that frees a
  // grown session's old arena, are charged but never refused.
  if (std::holds_alternative<AbortOp>(op) || std::holds_alternative<AcknowledgeGrowOp>(op)) {
    return absl::OkStatus();
  }
  return AdmitWork(engine);
}

absl::StatusOr<SessionResult> SessionRegistry::ApplyAndJournal(DaemonSession& session,
                                                               const SessionOp& op) {
  RETURN_IF_ERROR(AdmitWork(session.owner(), op));
  TimeCharge charge(time_shares_, session.owner());
  return ApplyAndJournalUncharged(session, op);
}

absl::StatusOr<SessionResult> SessionRegistry::ApplyAndJournalUncharged(DaemonSession& session,
                                                                        const SessionOp& op) {
  absl::StatusOr<SessionResult> result = Apply(session, op);
  // Before the reply: what the engine is told happened is what a restart brings back.
  session.JournalNow();
  return result;
}

void SessionRegistry::CaptureBeforeRelease(DaemonSession& session) {
  if (capture_on_reclaim_ == nullptr) return;
  absl::StatusOr<std::optional<PrefixCaptureResult>> captured =
      CaptureCommittedPrefix(*capture_on_reclaim_, session);
  if (!captured.ok()) {
    spdlog::info("session {}: committed state not kept in the prefix cache: {}",
                 session.id().value, captured.status().ToString());
  } else if (captured->has_value()) {
    spdlog::info("session {}: {} committed tokens kept as prefix entry {}", session.id().value,
                 (*captured)->boundary_tokens, (*captured)->entry.value);
  }
}

ReleasedSessions SessionRegistry::ReleaseOwnedBy(EngineId engine) {
  std::vector<std::shared_ptr<DaemonSession>> removed;
  {
    absl::MutexLock lock(&mu_);
    auto owned = by_engine_.find(engine.value);
    if (owned != by_engine_.end()) {
      removed = RemoveLocked(std::vector<uint64_t>(owned->second.begin(), owned->second.end()));
    }
  }
  ReleasedSessions released{removed.size(), 0};
  for (const std::shared_ptr<DaemonSession>& session : removed) {
    CaptureBeforeRelease(*session);
    released.bytes += session->Release();
  }
  // After the sessions: their arenas went to the pool, which now goes back to the device.
  if (pool_ != nullptr) pool_->DrainEngine(engine.value, /*forget=*/true);
  if (time_shares_ != nullptr) time_shares_->Forget(engine);
  return released;
}

ReleasedSessions SessionRegistry::ReleaseAll() {
  absl::flat_hash_map<uint64_t, std::shared_ptr<DaemonSession>> sessions;
  {
    absl::MutexLock lock(&mu_);
    sessions.swap(sessions_);
    by_engine_.clear();
    for (auto& [id, session] : sessions) FreeSlotLocked(session->slot());
  }
  ReleasedSessions released{sessions.size(), 0};
  for (auto& [id, session] : sessions) released.bytes += session->Release();
  if (pool_ != nullptr) pool_->DrainAll();
  return released;
}

size_t SessionRegistry::AwaitEmpty(absl::Duration grace) {
  absl::MutexLock lock(&mu_);
  auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return sessions_.empty() || waits_ended_;
  };
  mu_.AwaitWithTimeout(absl::Condition(&done), grace);
  return sessions_.size();
}

void SessionRegistry::EndWaits() {
  absl::MutexLock lock(&mu_);
  waits_ended_ = true;
}

size_t SessionRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return sessions_.size();
}

std::vector<std::shared_ptr<DaemonSession>> SessionRegistry::List(
    std::optional<EngineId> engine) const {
  std::vector<std::shared_ptr<DaemonSession>> sessions;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, session] : sessions_) {
      if (!engine.has_value() || session->owner() == *engine) sessions.push_back(session);
    }
  }
  std::sort(sessions.begin(), sessions.end(),
            [](const auto& a, const auto& b) { return a->id().value < b->id().value; });
  return sessions;
}

absl::flat_hash_map<uint64_t, EngineArenaPoolStats> SessionRegistry::PoolStatsByEngine() const {
  if (pool_ == nullptr) return {};
  return pool_->Stats();
}

absl::flat_hash_map<uint64_t, EngineSessionUsage> SessionRegistry::UsageByEngine() const {
  absl::flat_hash_map<uint64_t, EngineSessionUsage> usage;
  absl::MutexLock lock(&mu_);
  for (const auto& [engine, ids] : by_engine_) {
    EngineSessionUsage& entry = usage[engine];
    entry.sessions = ids.size();
    for (uint64_t id : ids) {
      auto it = sessions_.find(id);
      if (it != sessions_.end()) entry.arena_bytes += it->second->arena_bytes();
    }
  }
  return usage;
}

}  // namespace memra
