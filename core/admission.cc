#include "core/admission.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "core/arena_layout.h"
#include "core/status_macros.h"

namespace memra {
namespace {

constexpr uint64_t kMaxCapacity = std::numeric_limits<int32_t>::max();
constexpr size_t kRefusalFields = 5;

uint64_t SaturatingAdd(uint64_t a, uint64_t b) {
  uint64_t out;
  return __builtin_add_overflow(a, b, &out) ? std::numeric_limits<uint64_t>::max() : out;
}

// Payload: the five fields as little-endian u64 in declaration order (40 bytes). Fixed-size and
// versioned by its type URL, so a reader never guesses at a layout.
absl::Cord EncodeRefusal(const AdmissionRefusal& refusal) {
  const uint64_t fields[kRefusalFields] = {refusal.needed, refusal.free, refusal.evictable,
                                           refusal.budget, refusal.bytes_to_evict};
  std::string bytes;
  bytes.reserve(sizeof(fields));
  for (uint64_t field : fields) {
    for (int shift = 0; shift < 64; shift += 8) {
      bytes.push_back(static_cast<char>((field >> shift) & 0xff));
    }
  }
  return absl::Cord(std::move(bytes));
}

absl::Status Exhausted(absl::string_view what, const AdmissionRefusal& refusal) {
  std::string advice =
      refusal.bytes_to_evict > 0
          ? absl::StrCat("evicting ", refusal.bytes_to_evict, " bytes would make room")
          : "eviction cannot make room";
  absl::Status status = absl::ResourceExhaustedError(
      absl::StrCat(what, " needs ", refusal.needed, " bytes, ", refusal.free, " free (",
                   refusal.evictable, " evictable) of ", refusal.budget, " budget; ", advice));
  AttachAdmissionRefusal(status, refusal);
  return status;
}

// SessionArenaBytes at `capacity`, with the request's other fields.
absl::StatusOr<uint64_t> ArenaBytesAt(const ModelPlan& plan, const FormatDefaults& defaults,
                                      SessionShape request, uint64_t capacity,
                                      ArenaRounding rounding) {
  request.capacity = capacity;
  return SessionArenaBytes(plan, defaults, request, rounding);
}

// Erases every entry of `owner` from a reservation or allocation map; returns their bytes.
template <typename Map>
uint64_t EraseOwnedBy(uint64_t owner, Map& entries) {
  uint64_t bytes = 0;
  for (auto it = entries.begin(); it != entries.end();) {
    if (it->second.owner == owner) {
      bytes += it->second.bytes;
      it = entries.erase(it);
    } else {
      ++it;
    }
  }
  return bytes;
}

}  // namespace

uint64_t UsableCudaBudget(uint64_t total_bytes, double fraction, uint64_t reserve_bytes) {
  if (!(fraction > 0.0)) return 0;  // also NaN
  if (fraction > 1.0) fraction = 1.0;
  // long double keeps 64-bit totals exact enough; the product never exceeds total_bytes.
  const long double scaled = static_cast<long double>(total_bytes) * fraction;
  uint64_t usable = scaled >= static_cast<long double>(total_bytes)
                        ? total_bytes
                        : static_cast<uint64_t>(std::floor(scaled));
  return usable > reserve_bytes ? usable - reserve_bytes : 0;
}

void AttachAdmissionRefusal(absl::Status& status, const AdmissionRefusal& refusal) {
  status.SetPayload(kAdmissionRefusalTypeUrl, EncodeRefusal(refusal));
}

bool IsArenaRefusal(const absl::Status& status) {
  return status.code() == absl::StatusCode::kResourceExhausted &&
         status.GetPayload(kArenaRefusalTypeUrl).has_value();
}

bool IsOwnerShareRefusal(const absl::Status& status) {
  return status.code() == absl::StatusCode::kResourceExhausted &&
         status.GetPayload(kOwnerShareRefusalTypeUrl).has_value();
}

std::optional<AdmissionRefusal> GetAdmissionRefusal(const absl::Status& status) {
  if (status.code() != absl::StatusCode::kResourceExhausted) return std::nullopt;
  auto payload = status.GetPayload(kAdmissionRefusalTypeUrl);
  if (!payload.has_value() || payload->size() != kRefusalFields * 8) return std::nullopt;
  const std::string bytes(*payload);
  uint64_t fields[kRefusalFields] = {};
  for (size_t i = 0; i < kRefusalFields; ++i) {
    for (int b = 0; b < 8; ++b) {
      fields[i] |= uint64_t{static_cast<uint8_t>(bytes[i * 8 + b])} << (8 * b);
    }
  }
  return AdmissionRefusal{fields[0], fields[1], fields[2], fields[3], fields[4]};
}

// --- AdmissionLedger ---------------------------------------------------------------------------

uint64_t AdmissionLedger::free() const {
  const uint64_t used = reserved_ + allocated_;  // <= max(budget ever held): cannot wrap
  return used >= budget_ ? 0 : budget_ - used;
}

absl::Status AdmissionLedger::CheckFits(uint64_t bytes, absl::string_view what) const {
  const uint64_t available = free();
  if (bytes <= available) return absl::OkStatus();
  AdmissionRefusal refusal;
  refusal.needed = bytes;
  refusal.free = available;
  refusal.evictable = evictable_;
  refusal.budget = budget_;
  if (SaturatingAdd(available, evictable_) >= bytes) refusal.bytes_to_evict = bytes - available;
  return Exhausted(what, refusal);
}

uint64_t AdmissionLedger::arenas_left() const {
  const uint64_t arenas = uint64_t{reservations_.size()} + allocations_.size();
  return arenas >= limits_.max_arenas ? 0 : limits_.max_arenas - arenas;
}

uint64_t AdmissionLedger::owner_bytes(uint64_t owner) const {
  auto it = owner_bytes_.find(owner);
  return it == owner_bytes_.end() ? 0 : it->second;
}

uint64_t AdmissionLedger::owner_arenas(uint64_t owner) const {
  auto it = owner_arenas_.find(owner);
  return it == owner_arenas_.end() ? 0 : it->second;
}

absl::Status AdmissionLedger::CheckOwnerArenas(uint64_t owner, absl::string_view what) const {
  if (owner == kUncappedOwner) return absl::OkStatus();
  const uint64_t held = owner_arenas(owner);
  if (held < limits_.max_owner_arenas) return absl::OkStatus();
  // No arena-refusal payload: evicting prefix storage frees none of this engine's arenas.
  absl::Status status = absl::ResourceExhaustedError(absl::StrCat(
      what, " refused: engine ", owner, " holds ", held, " arenas and the limit is ",
      limits_.max_owner_arenas, " per engine (max_engine_arenas, a share of the ",
      limits_.max_arenas, " max_arenas); release one first"));
  status.SetPayload(kOwnerShareRefusalTypeUrl, absl::Cord());
  return status;
}

void AdmissionLedger::RemoveOwnerArena(uint64_t owner) {
  auto it = owner_arenas_.find(owner);
  if (it == owner_arenas_.end()) return;
  if (--it->second == 0) owner_arenas_.erase(it);
}

absl::Status AdmissionLedger::CheckArenaRoom(absl::string_view what) const {
  if (arenas_left() > 0) return absl::OkStatus();
  absl::Status status = absl::ResourceExhaustedError(absl::StrCat(
      what, " refused: the daemon holds ", reservations_.size() + allocations_.size(),
      " arenas (sessions, reservations and prefix storage) and the limit is ",
      limits_.max_arenas, " (max_arenas; each is a mapping under vm.max_map_count and a descriptor under "
                          "RLIMIT_NOFILE)"));
  status.SetPayload(kArenaRefusalTypeUrl, absl::Cord());
  return status;
}

absl::Status AdmissionLedger::CheckOwnerShare(uint64_t owner, uint64_t extra,
                                              absl::string_view what) const {
  if (owner == kUncappedOwner || limits_.owner_share_percent >= 100) return absl::OkStatus();
  // budget <= 2^64 / 100 is not guaranteed: split so the product cannot overflow.
  const uint64_t percent = limits_.owner_share_percent;
  const uint64_t cap = budget_ / 100 * percent + budget_ % 100 * percent / 100;
  const uint64_t held = owner_bytes(owner);
  if (extra <= cap && held <= cap - extra) return absl::OkStatus();
  absl::Status status = absl::ResourceExhaustedError(absl::StrCat(
      what, " of ", extra, " bytes refused: engine ", owner, " holds ", held,
      " bytes and may hold at most ", cap, " (", percent, "% of the ", budget_,
      " byte budget, max_engine_budget_share)"));
  status.SetPayload(kOwnerShareRefusalTypeUrl, absl::Cord());
  return status;
}

void AdmissionLedger::AddOwnerBytes(uint64_t owner, uint64_t bytes) {
  owner_bytes_[owner] += bytes;
}

void AdmissionLedger::RemoveOwnerBytes(uint64_t owner, uint64_t bytes) {
  auto it = owner_bytes_.find(owner);
  if (it == owner_bytes_.end()) return;
  it->second -= std::min(it->second, bytes);
  if (it->second == 0) owner_bytes_.erase(it);
}

std::string GroupRankName(const GroupRankKey& group) {
  return absl::StrCat("group 0x", absl::Hex(group.group_id), " rank ", group.rank, "/",
                      group.ranks);
}

absl::StatusOr<ReservationId> AdmissionLedger::Reserve(uint64_t owner, uint64_t bytes,
                                                       absl::Time now, absl::Duration ttl) {
  if (ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("reservation ttl ", absl::FormatDuration(ttl), " must be positive"));
  }
  Reservation reservation;
  reservation.owner = owner;
  reservation.bytes = bytes;
  reservation.expiry = now + ttl;
  return AddReservation(owner, bytes, std::move(reservation), "reservation");
}

absl::StatusOr<ReservationId> AdmissionLedger::ReserveGroupRank(uint64_t owner, uint64_t bytes,
                                                                GroupRankKey group,
                                                                absl::Time now,
                                                                absl::Duration deadline) {
  const std::string what = GroupRankName(group);
  if (group.group_id == 0) {
    return absl::InvalidArgumentError("group id 0: a group id is non-zero");
  }
  if (group.ranks == 0 || group.ranks > kMaxGroupRanks || group.rank >= group.ranks) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": rank must be below ranks and ranks in [1, ",
                                                   kMaxGroupRanks, "]"));
  }
  if (deadline <= absl::ZeroDuration() || deadline > kMaxGroupDeadline) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": deadline ", absl::ToInt64Milliseconds(deadline), " ms outside [1, ",
        absl::ToInt64Milliseconds(kMaxGroupDeadline), "] ms"));
  }
  if (std::optional<ReservationId> held = FindGroupRank(owner, group.group_id)) {
    const Reservation& other = reservations_.at(*held);
    return absl::AlreadyExistsError(absl::StrCat(
        what, ": engine ", owner, " already holds ", GroupRankName(*other.group), " (reservation ",
        held->value, ", ", other.bytes, " bytes); a new admission takes a new group id"));
  }
  Reservation reservation;
  reservation.owner = owner;
  reservation.bytes = bytes;
  reservation.expiry = now + deadline;
  reservation.group = group;
  return AddReservation(owner, bytes, std::move(reservation), what);
}

absl::StatusOr<ReservationId> AdmissionLedger::AddReservation(uint64_t owner, uint64_t bytes,
                                                              Reservation reservation,
                                                              absl::string_view what) {
  if (bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " of 0 bytes: a session costs at least 1"));
  }
  RETURN_IF_ERROR(CheckArenaRoom(what));
  RETURN_IF_ERROR(CheckOwnerArenas(owner, what));
  RETURN_IF_ERROR(CheckOwnerShare(owner, bytes, what));
  RETURN_IF_ERROR(CheckFits(bytes, what));
  const ReservationId id{next_id_++};
  reservations_.emplace(id, std::move(reservation));
  reserved_ += bytes;
  AddOwnerBytes(owner, bytes);
  ++owner_arenas_[owner];
  return id;
}

std::optional<ReservationId> AdmissionLedger::FindGroupRank(uint64_t owner,
                                                            uint64_t group_id) const {
  // Linear: reservations are bounded by max_arenas and a group call is once per request.
  for (const auto& [id, reservation] : reservations_) {
    if (reservation.owner == owner && reservation.group.has_value() &&
        reservation.group->group_id == group_id) {
      return id;
    }
  }
  return std::nullopt;
}

absl::StatusOr<HeldReservation> AdmissionLedger::GroupRank(uint64_t owner,
                                                              uint64_t group_id) const {
  std::optional<ReservationId> id = FindGroupRank(owner, group_id);
  if (!id.has_value()) {
    return absl::NotFoundError(absl::StrCat(
        "group 0x", absl::Hex(group_id), ": engine ", owner,
        " holds no reservation for it (never made, released, used, freed at its deadline, or "
        "lost in a daemon restart)"));
  }
  return HeldReservation{*id, reservations_.at(*id)};
}

absl::StatusOr<ReservationId> AdmissionLedger::ConfirmGroupRank(uint64_t owner,
                                                                uint64_t group_id,
                                                                absl::Time now) {
  ASSIGN_OR_RETURN(HeldReservation held, GroupRank(owner, group_id));
  Reservation& reservation = reservations_.at(held.id);
  if (reservation.confirmed) return held.id;
  if (reservation.expiry <= now) {
    return absl::NotFoundError(absl::StrCat(
        GroupRankName(*reservation.group), ": its deadline passed ",
        absl::ToInt64Milliseconds(now - reservation.expiry),
        " ms ago; its bytes are freed, not held"));
  }
  reservation.confirmed = true;
  reservation.expiry = absl::InfiniteFuture();
  return held.id;
}

absl::StatusOr<uint64_t> AdmissionLedger::ReleaseGroupRank(uint64_t owner, uint64_t group_id) {
  ASSIGN_OR_RETURN(HeldReservation held, GroupRank(owner, group_id));
  RETURN_IF_ERROR(Cancel(held.id));
  return held.reservation.bytes;
}

absl::StatusOr<AllocationId> AdmissionLedger::Commit(ReservationId reservation,
                                                     uint64_t actual_bytes) {
  auto it = reservations_.find(reservation);
  if (it == reservations_.end()) {
    return absl::NotFoundError(absl::StrCat("reservation ", reservation.value,
                                            " is not held (never issued, used, or expired)"));
  }
  if (it->second.group.has_value() && !it->second.confirmed) {
    return absl::FailedPreconditionError(absl::StrCat(
        "reservation ", reservation.value, " is ", GroupRankName(*it->second.group),
        ", not confirmed: a session is created only from a group's confirmed reservation"));
  }
  if (actual_bytes == 0 || actual_bytes > it->second.bytes) {
    return absl::InvalidArgumentError(absl::StrCat("reservation ", reservation.value, " holds ",
                                                   it->second.bytes, " bytes; cannot create ",
                                                   actual_bytes, " bytes from it"));
  }
  const AllocationId id{next_id_++};
  allocations_.emplace(id, Allocation{it->second.owner, actual_bytes});
  reserved_ -= it->second.bytes;
  allocated_ += actual_bytes;
  RemoveOwnerBytes(it->second.owner, it->second.bytes - actual_bytes);
  reservations_.erase(it);
  return id;
}

absl::StatusOr<AllocationId> AdmissionLedger::Allocate(uint64_t owner, uint64_t bytes) {
  if (bytes == 0) {
    return absl::InvalidArgumentError("allocation of 0 bytes: a session costs at least 1");
  }
  RETURN_IF_ERROR(CheckArenaRoom("allocation"));
  RETURN_IF_ERROR(CheckOwnerArenas(owner, "allocation"));
  RETURN_IF_ERROR(CheckOwnerShare(owner, bytes, "allocation"));
  RETURN_IF_ERROR(CheckFits(bytes, "allocation"));
  const AllocationId id{next_id_++};
  allocations_.emplace(id, Allocation{owner, bytes});
  allocated_ += bytes;
  AddOwnerBytes(owner, bytes);
  ++owner_arenas_[owner];
  return id;
}

absl::Status AdmissionLedger::Grow(AllocationId allocation, uint64_t new_bytes) {
  auto it = allocations_.find(allocation);
  if (it == allocations_.end()) {
    return absl::NotFoundError(absl::StrCat("allocation ", allocation.value, " is not live"));
  }
  const uint64_t current = it->second.bytes;
  if (new_bytes < current) {
    return absl::InvalidArgumentError(absl::StrCat("allocation ", allocation.value, " holds ",
                                                   current, " bytes; growing to ", new_bytes,
                                                   " would shrink it"));
  }
  if (new_bytes == current) return absl::OkStatus();
  RETURN_IF_ERROR(CheckOwnerShare(it->second.owner, new_bytes - current, "grow"));
  RETURN_IF_ERROR(CheckFits(new_bytes - current, "grow"));
  it->second.bytes = new_bytes;
  allocated_ += new_bytes - current;
  AddOwnerBytes(it->second.owner, new_bytes - current);
  return absl::OkStatus();
}

absl::Status AdmissionLedger::Release(AllocationId allocation) {
  auto it = allocations_.find(allocation);
  if (it == allocations_.end()) {
    return absl::NotFoundError(absl::StrCat("allocation ", allocation.value, " is not live"));
  }
  allocated_ -= it->second.bytes;
  RemoveOwnerBytes(it->second.owner, it->second.bytes);
  RemoveOwnerArena(it->second.owner);
  allocations_.erase(it);
  return absl::OkStatus();
}

absl::Status AdmissionLedger::Cancel(ReservationId reservation) {
  auto it = reservations_.find(reservation);
  if (it == reservations_.end()) {
    return absl::NotFoundError(absl::StrCat("reservation ", reservation.value,
                                            " is not held (never issued, used, or expired)"));
  }
  reserved_ -= it->second.bytes;
  RemoveOwnerBytes(it->second.owner, it->second.bytes);
  RemoveOwnerArena(it->second.owner);
  reservations_.erase(it);
  return absl::OkStatus();
}

uint64_t AdmissionLedger::ReleaseOwner(uint64_t owner) {
  const uint64_t from_reservations = EraseOwnedBy(owner, reservations_);
  const uint64_t from_allocations = EraseOwnedBy(owner, allocations_);
  reserved_ -= from_reservations;
  allocated_ -= from_allocations;
  owner_bytes_.erase(owner);
  owner_arenas_.erase(owner);
  return from_reservations + from_allocations;
}

std::vector<ExpiredReservation> AdmissionLedger::Expire(absl::Time now) {
  std::vector<ExpiredReservation> expired;
  for (auto it = reservations_.begin(); it != reservations_.end();) {
    if (it->second.expiry > now) {
      ++it;
      continue;
    }
    expired.push_back(ExpiredReservation{it->first, it->second});
    reserved_ -= it->second.bytes;
    RemoveOwnerBytes(it->second.owner, it->second.bytes);
    RemoveOwnerArena(it->second.owner);
    it = reservations_.erase(it);
  }
  return expired;
}

BudgetChange AdmissionLedger::SetBudget(uint64_t budget_bytes) {
  BudgetChange change;
  change.old_budget = budget_;
  change.new_budget = budget_bytes;
  change.used_bytes = used();
  change.over_budget_bytes =
      change.used_bytes > budget_bytes ? change.used_bytes - budget_bytes : 0;
  budget_ = budget_bytes;
  return change;
}

std::optional<Reservation> AdmissionLedger::FindReservation(ReservationId id) const {
  auto it = reservations_.find(id);
  if (it == reservations_.end()) return std::nullopt;
  return it->second;
}

std::optional<Allocation> AdmissionLedger::FindAllocation(AllocationId id) const {
  auto it = allocations_.find(id);
  if (it == allocations_.end()) return std::nullopt;
  return it->second;
}

// --- Cost queries ------------------------------------------------------------------------------

absl::StatusOr<CostReport> SessionCost(const ModelPlan& plan, const FormatDefaults& defaults,
                                       const SessionShape& request, ArenaRounding rounding) {
  ASSIGN_OR_RETURN(const SessionPlan session, PlanSession(plan, defaults, request));
  CostReport report;
  report.capacity = request.capacity;
  ASSIGN_OR_RETURN(report.breakdown, CostOfSessionPlan(session));
  ASSIGN_OR_RETURN(const ArenaLayout layout,
                   LayoutArena(session.planes, rounding.alignment, rounding.granularity));
  report.arena_bytes = layout.bytes;
  return report;
}

absl::StatusOr<uint64_t> SessionArenaBytes(const ModelPlan& plan, const FormatDefaults& defaults,
                                           const SessionShape& request, ArenaRounding rounding) {
  ASSIGN_OR_RETURN(const SessionPlan session, PlanSession(plan, defaults, request));
  ASSIGN_OR_RETURN(const ArenaLayout layout,
                   LayoutArena(session.planes, rounding.alignment, rounding.granularity));
  return layout.bytes;
}

absl::StatusOr<uint64_t> SessionsThatFit(uint64_t session_bytes, uint64_t free_bytes) {
  if (session_bytes == 0) {
    return absl::InvalidArgumentError(
        "session cost of 0 bytes: every session fits, the question has no answer");
  }
  return free_bytes / session_bytes;
}

absl::StatusOr<SessionFit> FitSessions(const AdmissionLedger& ledger, uint64_t session_bytes) {
  SessionFit fit;
  fit.session_bytes = session_bytes;
  ASSIGN_OR_RETURN(fit.now, SessionsThatFit(session_bytes, ledger.free()));
  fit.now = std::min<uint64_t>(fit.now, ledger.arenas_left());
  ASSIGN_OR_RETURN(
      fit.after_eviction,
      SessionsThatFit(session_bytes, SaturatingAdd(ledger.free(), ledger.evictable())));
  ASSIGN_OR_RETURN(fit.when_empty, SessionsThatFit(session_bytes, ledger.budget()));
  fit.after_eviction = std::min<uint64_t>(fit.after_eviction, ledger.arenas_left());
  fit.when_empty = std::min<uint64_t>(fit.when_empty, ledger.limits().max_arenas);
  return fit;
}

absl::StatusOr<uint64_t> MaxContextThatFits(const ModelPlan& plan, const FormatDefaults& defaults,
                                            const SessionShape& request, uint64_t free_bytes,
                                            ArenaRounding rounding) {
  // Capacity 1 validates everything but the capacity-dependent overflow; its errors are real.
  ASSIGN_OR_RETURN(const uint64_t smallest, ArenaBytesAt(plan, defaults, request, 1, rounding));
  if (smallest > free_bytes) return 0;
  // Past capacity 1 the only failure left is a byte count that overflows 64 bits, which no
  // free_bytes can hold: treat it as "does not fit".
  auto fits = [&](uint64_t capacity) {
    absl::StatusOr<uint64_t> bytes = ArenaBytesAt(plan, defaults, request, capacity, rounding);
    return bytes.ok() && *bytes <= free_bytes;
  };
  if (fits(kMaxCapacity)) return kMaxCapacity;
  // Invariant: fits(lo) && !fits(hi).
  uint64_t lo = 1;
  uint64_t hi = kMaxCapacity;
  while (hi - lo > 1) {
    const uint64_t mid = lo + (hi - lo) / 2;
    if (fits(mid)) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

absl::StatusOr<TokenFit> TotalTokensThatFit(const ModelPlan& plan, const FormatDefaults& defaults,
                                            const SessionShape& request, uint64_t free_bytes,
                                            ArenaRounding rounding) {
  TokenFit fit;
  fit.capacity = request.capacity;
  ASSIGN_OR_RETURN(fit.session_bytes, SessionArenaBytes(plan, defaults, request, rounding));
  // SessionArenaBytes never returns 0 for a request with state; a plan range without any state
  // costs nothing and holds no tokens of its own.
  if (fit.session_bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layers [", request.layer_lo, ", ", request.layer_hi.value_or(plan.TotalLayers()), ") of ",
        plan.name, " keep no cache state: tokens that fit are unbounded"));
  }
  fit.full_sessions = free_bytes / fit.session_bytes;
  const uint64_t leftover = free_bytes - fit.full_sessions * fit.session_bytes;
  ASSIGN_OR_RETURN(fit.remainder_tokens,
                   MaxContextThatFits(plan, defaults, request, leftover, rounding));
  uint64_t packed;
  if (__builtin_mul_overflow(fit.full_sessions, fit.capacity, &packed)) {
    packed = std::numeric_limits<uint64_t>::max();
  }
  fit.total_tokens = SaturatingAdd(packed, fit.remainder_tokens);
  return fit;
}

}  // namespace memra
