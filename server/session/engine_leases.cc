#include "server/session/engine_leases.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "server/base/secret_token.h"
#include "spdlog/spdlog.h"

namespace memra {

EngineLeases::EngineLeases(Clock* clock, DeviceBudget* budget, LeaseSettings settings,
                           StateJournal* journal)
    : clock_(clock), budget_(budget), journal_(journal), settings_(settings) {}

void EngineLeases::ApplySettings(LeaseSettings settings) {
  absl::MutexLock lock(&mu_);
  settings_ = settings;
}

LeaseSettings EngineLeases::settings() const {
  absl::MutexLock lock(&mu_);
  return settings_;
}

absl::StatusOr<EngineLease> EngineLeases::Attach(EngineIdentity identity,
                                                 std::function<void()> cancel_stream) {
  if (identity.name.size() > 256) identity.name.resize(256);
  const std::string& name = identity.name;
  ASSIGN_OR_RETURN(std::string token, RandomSecretToken());
  absl::MutexLock lock(&mu_);
  if (draining_) return absl::UnavailableError("the daemon is draining; attach to another");
  if (engines_.size() >= settings_.max_engines) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "engine \"", name, "\" refused: ", engines_.size(),
        " engines are attached or in their grace period and the limit is ",
        settings_.max_engines, " (max_attached_engines)"));
  }
  const EngineId id{next_engine_id_++};
  Engine& engine = engines_[id.value];
  engine.id = id;
  engine.identity = std::move(identity);
  engine.token = token;
  engine.last_heartbeat = clock_->Now();
  engine.cancel_stream = std::move(cancel_stream);
  engine.stream = next_stream_++;
  spdlog::info("engine {} attached: name \"{}\", pid {}, uid {}, gid {}, cache scope {}",
               id.value, engine.identity.name, engine.identity.peer.pid,
               engine.identity.peer.uid, engine.identity.peer.gid, engine.identity.cache_scope);
  // Recorded under the lock so a concurrent reclaim's EngineForgotten cannot come first.
  JournalEngineLocked(engine);
  return EngineLease{id, std::move(token), settings_.timeout, settings_.grace, engine.stream,
                     engine.identity.cache_scope};
}

absl::Status EngineLeases::UnknownEngineLocked(EngineId engine, absl::string_view what) const {
  if (restart_.has_value()) {
    if (auto lost = not_readopted_.find(engine.value); lost != not_readopted_.end()) {
      return DaemonRestartedError(*restart_, absl::StrCat("engine ", engine.value,
                                                          " was not re-adopted: ", lost->second));
    }
  }
  return absl::NotFoundError(absl::StrCat("engine ", engine.value, " ", what));
}

absl::StatusOr<EngineLease> EngineLeases::Resume(const EngineCredentials& credentials,
                                                 const PeerCredentials& peer,
                                                 absl::string_view cache_scope,
                                                 std::function<void()> cancel_stream) {
  absl::MutexLock lock(&mu_);
  if (draining_) return absl::UnavailableError("the daemon is draining; attach to another");
  auto it = engines_.find(credentials.id.value);
  if (it == engines_.end()) {
    return UnknownEngineLocked(credentials.id, "was reclaimed; attach as a new engine");
  }
  Engine& engine = it->second;
  if (!TokensEqual(credentials.token, engine.token)) {
    return absl::PermissionDeniedError(
        absl::StrCat("wrong engine token for engine ", credentials.id.value));
  }
  if (engine.cancel_stream) {
    return absl::FailedPreconditionError(
        absl::StrCat("engine ", credentials.id.value,
                     " holds its lease on another Attach stream; end that one first"));
  }
  // The handoff connection the re-attach came with proves the user: the engine's memory is
  // handed to that user only.
  if (peer.uid != engine.identity.peer.uid) {
    return absl::PermissionDeniedError(absl::StrCat(
        "engine ", credentials.id.value, " belongs to uid ", engine.identity.peer.uid,
        "; the re-attach's handoff connection is uid ", peer.uid, " (pid ", peer.pid, ")"));
  }
  if (!cache_scope.empty() && cache_scope != engine.identity.cache_scope) {
    return absl::FailedPreconditionError(absl::StrCat(
        "engine ", credentials.id.value, " is in cache scope \"", engine.identity.cache_scope,
        "\"; a re-attach keeps it and cannot name \"", cache_scope, "\""));
  }
  engine.lease_ended.reset();
  engine.last_heartbeat = clock_->Now();
  engine.cancel_stream = std::move(cancel_stream);
  engine.stream = next_stream_++;
  engine.identity.peer = peer;
  spdlog::info("engine {} (\"{}\", pid {}, uid {}) re-attached", engine.id.value,
               engine.identity.name, engine.identity.peer.pid, engine.identity.peer.uid);
  // The pid may have changed (a re-attach from the same uid): the journal follows.
  JournalEngineLocked(engine);
  return EngineLease{engine.id, engine.token, settings_.timeout, settings_.grace, engine.stream,
                     engine.identity.cache_scope};
}

void EngineLeases::JournalEngineLocked(const Engine& engine) {
  if (journal_ == nullptr) return;
  journal_->EngineAttached(engine.id.value, engine.token, engine.identity.name,
                           engine.identity.peer, engine.identity.cache_scope);
}

void EngineLeases::Readopt(EngineId id, std::string token, EngineIdentity identity) {
  absl::MutexLock lock(&mu_);
  Engine& engine = engines_[id.value];
  engine.id = id;
  engine.identity = std::move(identity);
  engine.token = std::move(token);
  engine.last_heartbeat = clock_->Now();
  engine.stream = 0;
  next_engine_id_ = std::max(next_engine_id_, id.value + 1);
  JournalEngineLocked(engine);
}

void EngineLeases::RaiseNextEngineId(uint64_t next) {
  absl::MutexLock lock(&mu_);
  next_engine_id_ = std::max(next_engine_id_, next);
}

void EngineLeases::SetRestart(DaemonRestart restart,
                              absl::flat_hash_map<uint64_t, std::string> not_readopted) {
  absl::MutexLock lock(&mu_);
  restart_ = restart;
  not_readopted_ = std::move(not_readopted);
}

std::optional<DaemonRestart> EngineLeases::restart() const {
  absl::MutexLock lock(&mu_);
  return restart_;
}

absl::Status EngineLeases::Heartbeat(EngineId id) {
  absl::MutexLock lock(&mu_);
  auto it = engines_.find(id.value);
  if (it == engines_.end()) {
    return absl::NotFoundError(absl::StrCat("engine ", id.value, " was reclaimed"));
  }
  if (it->second.lease_ended.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat("engine ", id.value, ": the lease expired; its sessions will be freed"));
  }
  it->second.last_heartbeat = clock_->Now();
  return absl::OkStatus();
}

void EngineLeases::EndStream(EngineId id, uint64_t stream) {
  absl::MutexLock lock(&mu_);
  auto it = engines_.find(id.value);
  if (it == engines_.end()) return;
  if (stream != 0 && it->second.stream != stream) return;  // replaced by a re-attach
  it->second.cancel_stream = nullptr;
  it->second.stream = 0;
  if (!it->second.lease_ended.has_value()) {
    it->second.lease_ended = clock_->Now();
    spdlog::info("engine {} (\"{}\"): Attach stream ended; its sessions are freed in {} ms",
                 id.value, it->second.identity.name, absl::ToInt64Milliseconds(settings_.grace));
  }
}

absl::Status EngineLeases::CheckLocked(EngineId engine, const absl::string_view* token) const {
  auto it = engines_.find(engine.value);
  if (it == engines_.end()) return UnknownEngineLocked(engine, "is not attached");
  if (token != nullptr && !TokensEqual(*token, it->second.token)) {
    return absl::PermissionDeniedError(
        absl::StrCat("wrong engine token for engine ", engine.value));
  }
  if (it->second.lease_ended.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat("engine ", engine.value, ": its lease has ended"));
  }
  return absl::OkStatus();
}

absl::Status EngineLeases::CheckLocked(const EngineCredentials& engine) const {
  return CheckLocked(engine.id, &engine.token);
}

absl::Status EngineLeases::CheckBound(EngineId engine) const {
  absl::MutexLock lock(&mu_);
  return CheckLocked(engine, nullptr);
}

absl::Status EngineLeases::Check(const EngineCredentials& engine) const {
  absl::MutexLock lock(&mu_);
  return CheckLocked(engine);
}

absl::StatusOr<std::string> EngineLeases::CacheScope(const EngineCredentials& engine) const {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckLocked(engine));
  return engines_.at(engine.id.value).identity.cache_scope;
}

absl::Status EngineLeases::Admit(const EngineCredentials& engine,
                                 absl::string_view draining_message) const {
  absl::MutexLock lock(&mu_);
  if (draining_) return absl::UnavailableError(draining_message);
  return CheckLocked(engine);
}

absl::StatusOr<EngineReservation> EngineLeases::Reserve(const EngineCredentials& engine,
                                                        uint64_t bytes) {
  absl::Duration ttl;
  {
    absl::MutexLock lock(&mu_);
    if (draining_) return absl::UnavailableError("the daemon is draining; no new reservations");
    RETURN_IF_ERROR(CheckLocked(engine));
    ttl = settings_.reservation_ttl;
  }
  ASSIGN_OR_RETURN(ReservationId id, budget_->Reserve(engine.id.value, bytes, clock_->Now(), ttl));
  return EngineReservation{id, ttl};
}

absl::StatusOr<uint64_t> EngineLeases::CancelReservation(const EngineCredentials& engine,
                                                         ReservationId reservation) {
  RETURN_IF_ERROR(Check(engine));
  return budget_->Cancel(reservation, engine.id.value);
}

absl::StatusOr<ReservationId> EngineLeases::ReserveGroupRank(const EngineCredentials& engine,
                                                             uint64_t bytes, GroupRankKey group,
                                                             absl::Duration deadline) {
  RETURN_IF_ERROR(Admit(engine, "the daemon is draining; no new group reservations"));
  return budget_->ReserveGroupRank(engine.id.value, bytes, group, clock_->Now(), deadline);
}

absl::StatusOr<HeldReservation> EngineLeases::ConfirmGroupRank(const EngineCredentials& engine,
                                                               uint64_t group_id) {
  RETURN_IF_ERROR(Check(engine));
  return budget_->ConfirmGroupRank(engine.id.value, group_id, clock_->Now());
}

absl::StatusOr<HeldReservation> EngineLeases::GroupRank(const EngineCredentials& engine,
                                                        uint64_t group_id) const {
  RETURN_IF_ERROR(Check(engine));
  return budget_->GroupRank(engine.id.value, group_id);
}

absl::StatusOr<uint64_t> EngineLeases::ReleaseGroupRank(const EngineCredentials& engine,
                                                        uint64_t group_id) {
  RETURN_IF_ERROR(Check(engine));
  return budget_->ReleaseGroupRank(engine.id.value, group_id);
}

std::vector<HeldReservation> EngineLeases::GroupRanks() const {
  std::vector<HeldReservation> ranks;
  const AdmissionLedger ledger = budget_->Snapshot();  // outlives the loop (not a temporary)
  for (const auto& [id, reservation] : ledger.reservations()) {
    if (reservation.group.has_value()) ranks.push_back(HeldReservation{id, reservation});
  }
  return ranks;
}

void EngineLeases::ExpireReservations() {
  for (const ExpiredReservation& expired : budget_->Expire(clock_->Now())) {
    reservations_expired_.fetch_add(1, std::memory_order_relaxed);
    spdlog::info("reservation {}{} of engine {} expired unused: {} bytes returned",
                 expired.id.value,
                 expired.reservation.group.has_value()
                     ? absl::StrCat(" (", GroupRankName(*expired.reservation.group),
                                    ", not confirmed by its deadline)")
                     : "",
                 expired.reservation.owner, expired.reservation.bytes);
  }
}

std::vector<ReclaimedEngine> EngineLeases::CollectReclaimable() {
  std::vector<ReclaimedEngine> reclaimed;
  const absl::Time now = clock_->Now();
  {
    absl::MutexLock lock(&mu_);
    for (auto it = engines_.begin(); it != engines_.end();) {
      Engine& engine = it->second;
      if (!engine.lease_ended.has_value() && now - engine.last_heartbeat > settings_.timeout) {
        engine.lease_ended = now;
        lease_expiries_.fetch_add(1, std::memory_order_relaxed);
        spdlog::warn("engine {} (\"{}\", pid {}): no heartbeat for {} ms (lease timeout {} ms)",
                     engine.id.value, engine.identity.name, engine.identity.peer.pid,
                     absl::ToInt64Milliseconds(now - engine.last_heartbeat),
                     absl::ToInt64Milliseconds(settings_.timeout));
        if (engine.cancel_stream) engine.cancel_stream();
        engine.cancel_stream = nullptr;  // cancelled once; its handler's EndStream follows
      }
      if (engine.lease_ended.has_value() && now - *engine.lease_ended >= settings_.grace) {
        reclaimed.push_back(
            ReclaimedEngine{engine.id, std::move(engine.identity.name), engine.identity.peer});
        if (journal_ != nullptr) journal_->EngineForgotten(engine.id.value);
        engines_.erase(it++);
        continue;
      }
      ++it;
    }
  }
  engines_reclaimed_.fetch_add(reclaimed.size(), std::memory_order_relaxed);
  return reclaimed;
}

uint64_t EngineLeases::ReturnReservations(EngineId engine) {
  return budget_->ReleaseOwner(engine.value);
}

void EngineLeases::SetDraining(bool draining) {
  absl::MutexLock lock(&mu_);
  if (draining_ != draining) {
    spdlog::info(draining ? "draining: new engines and sessions are refused"
                          : "undrained: new engines and sessions are accepted again");
  }
  draining_ = draining;
}

bool EngineLeases::draining() const {
  absl::MutexLock lock(&mu_);
  return draining_;
}

void EngineLeases::CancelStreams() {
  absl::MutexLock lock(&mu_);
  for (auto& [id, engine] : engines_) {
    if (engine.cancel_stream) engine.cancel_stream();
  }
}

void EngineLeases::ForgetAll() {
  absl::MutexLock lock(&mu_);
  if (journal_ != nullptr) {
    for (const auto& [id, engine] : engines_) journal_->EngineForgotten(id);
  }
  engines_.clear();
}

std::vector<EngineView> EngineLeases::Engines() const {
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  std::vector<EngineView> views;
  views.reserve(engines_.size());
  for (const auto& [id, engine] : engines_) {
    views.push_back(EngineView{
        engine.id, engine.identity.name, engine.identity.peer, engine.identity.cache_scope,
        !engine.lease_ended.has_value() && now - engine.last_heartbeat <= settings_.timeout,
        !engine.lease_ended.has_value() && engine.stream == 0,
        now - (engine.lease_ended.has_value() ? *engine.lease_ended : engine.last_heartbeat)});
  }
  return views;
}

size_t EngineLeases::size() const {
  absl::MutexLock lock(&mu_);
  return engines_.size();
}

}  // namespace memra
