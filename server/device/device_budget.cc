#include "server/device/device_budget.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "spdlog/spdlog.h"

namespace memra {
namespace {

absl::Status NoSuchReservation(ReservationId reservation, uint64_t owner) {
  return absl::NotFoundError(absl::StrCat(reservation.value == 0 ? "no reservation"
                                                                 : "reservation ",
                                          reservation.value, " is not held by engine ", owner,
                                          " (never issued, expired, cancelled or used)"));
}

}  // namespace

DeviceBudget::DeviceBudget(uint64_t budget_bytes, std::string rule, AdmissionLimits limits)
    : ledger_(budget_bytes, limits), rule_(std::move(rule)) {}

void DeviceBudget::SetEvictor(EvictableSource source, Evictor evictor) {
  absl::MutexLock lock(&mu_);
  evictors_[static_cast<size_t>(source)] = std::move(evictor);
}

void DeviceBudget::SetOwnerEvictor(OwnerEvictor evictor) {
  absl::MutexLock lock(&mu_);
  owner_evictor_ = std::move(evictor);
}

template <typename T, typename Admit>
absl::StatusOr<T> DeviceBudget::AdmitEvicting(uint64_t owner, Admit admit) {
  absl::StatusOr<T> admitted = AdmitOnce<T>(admit);
  if (admitted.ok()) return admitted;
  // The owner's own evictable storage first: it counts toward the owner's share and the budget,
  // and freeing it costs no one else anything.
  OwnerEvictor owner_evictor;
  {
    absl::MutexLock lock(&mu_);
    std::optional<AdmissionRefusal> refusal = GetAdmissionRefusal(admitted.status());
    const bool own_storage_helps = IsOwnerShareRefusal(admitted.status()) ||
                                   IsArenaRefusal(admitted.status()) ||
                                   (refusal.has_value() && refusal->bytes_to_evict > 0);
    if (owner != kUncappedOwner && own_storage_helps) owner_evictor = owner_evictor_;
  }
  if (owner_evictor) {
    if (const uint64_t freed = owner_evictor(owner); freed > 0) {
      spdlog::info("admission freed {} bytes of engine {}'s own pooled arenas for it", freed,
                   owner);
      admitted = AdmitOnce<T>(admit);
      if (admitted.ok()) return admitted;
    }
  }
  std::vector<Evictor> evictors;  // those of the sources holding evictable bytes, in order
  uint64_t short_bytes = 0;
  {
    absl::MutexLock lock(&mu_);
    std::optional<AdmissionRefusal> refusal = GetAdmissionRefusal(admitted.status());
    if (refusal.has_value() && refusal->bytes_to_evict > 0) {
      short_bytes = refusal->bytes_to_evict;
    } else if (IsArenaRefusal(admitted.status()) && ledger_.evictable() > 0) {
      // Out of arenas, not bytes: evicting anything evictable (it is all arenas) makes room.
      short_bytes = 1;
    }
    for (size_t i = 0; short_bytes > 0 && i < kEvictableSources; ++i) {
      if (evictors_[i] && evictable_[i] > 0) evictors.push_back(evictors_[i]);
    }
  }
  if (evictors.empty()) {
    CountRefusal(admitted.status());
    return admitted;
  }
  // Unlocked: the evictors release their allocations through this budget.
  uint64_t freed = 0;
  for (const Evictor& evictor : evictors) {
    if (freed >= short_bytes) break;
    freed += evictor(short_bytes - freed);
  }
  spdlog::info("admission evicted {} bytes of pooled arenas and prefix-cache entries ({} bytes "
               "short{})",
               freed, short_bytes, IsArenaRefusal(admitted.status()) ? ", out of arenas" : "");
  admitted = AdmitOnce<T>(admit);
  if (!admitted.ok()) CountRefusal(admitted.status());
  return admitted;
}

template <typename T, typename Admit>
absl::StatusOr<T> DeviceBudget::AdmitOnce(Admit& admit) {
  absl::MutexLock lock(&mu_);
  return admit(ledger_);
}

void DeviceBudget::CountRefusal(const absl::Status& status) {
  if (GetAdmissionRefusal(status).has_value() || IsArenaRefusal(status)) {
    refusals_.fetch_add(1, std::memory_order_relaxed);
  }
}

absl::StatusOr<ReservationId> DeviceBudget::Reserve(uint64_t owner, uint64_t bytes,
                                                    absl::Time now, absl::Duration ttl) {
  return AdmitEvicting<ReservationId>(
      owner, [&](AdmissionLedger& ledger) { return ledger.Reserve(owner, bytes, now, ttl); });
}

absl::StatusOr<ReservationId> DeviceBudget::ReserveGroupRank(uint64_t owner, uint64_t bytes,
                                                             GroupRankKey group, absl::Time now,
                                                             absl::Duration deadline) {
  return AdmitEvicting<ReservationId>(owner, [&](AdmissionLedger& ledger) {
    return ledger.ReserveGroupRank(owner, bytes, group, now, deadline);
  });
}

absl::StatusOr<HeldReservation> DeviceBudget::ConfirmGroupRank(uint64_t owner,
                                                               uint64_t group_id,
                                                               absl::Time now) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(ledger_.ConfirmGroupRank(owner, group_id, now).status());
  return ledger_.GroupRank(owner, group_id);
}

absl::StatusOr<HeldReservation> DeviceBudget::GroupRank(uint64_t owner, uint64_t group_id) const {
  absl::MutexLock lock(&mu_);
  return ledger_.GroupRank(owner, group_id);
}

absl::StatusOr<uint64_t> DeviceBudget::ReleaseGroupRank(uint64_t owner, uint64_t group_id) {
  absl::MutexLock lock(&mu_);
  return ledger_.ReleaseGroupRank(owner, group_id);
}

absl::StatusOr<AllocationId> DeviceBudget::Commit(ReservationId reservation, uint64_t owner,
                                                  uint64_t actual_bytes) {
  absl::MutexLock lock(&mu_);
  std::optional<Reservation> held = ledger_.FindReservation(reservation);
  if (!held.has_value() || held->owner != owner) return NoSuchReservation(reservation, owner);
  return ledger_.Commit(reservation, actual_bytes);
}

absl::StatusOr<uint64_t> DeviceBudget::ReservedBytes(ReservationId reservation,
                                                     uint64_t owner) const {
  absl::MutexLock lock(&mu_);
  std::optional<Reservation> held = ledger_.FindReservation(reservation);
  if (!held.has_value() || held->owner != owner) return NoSuchReservation(reservation, owner);
  return held->bytes;
}

absl::StatusOr<AllocationId> DeviceBudget::Allocate(uint64_t owner, uint64_t bytes) {
  return AdmitEvicting<AllocationId>(
      owner, [&](AdmissionLedger& ledger) { return ledger.Allocate(owner, bytes); });
}

absl::StatusOr<AllocationId> DeviceBudget::AllocateWithoutEviction(uint64_t owner,
                                                                   uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  return ledger_.Allocate(owner, bytes);  // the prefix cache's own storage: not an admission
}

absl::Status DeviceBudget::Release(AllocationId allocation) {
  absl::MutexLock lock(&mu_);
  return ledger_.Release(allocation);
}

absl::StatusOr<uint64_t> DeviceBudget::Cancel(ReservationId reservation, uint64_t owner) {
  absl::MutexLock lock(&mu_);
  std::optional<Reservation> held = ledger_.FindReservation(reservation);
  if (!held.has_value() || held->owner != owner) return NoSuchReservation(reservation, owner);
  if (absl::Status cancelled = ledger_.Cancel(reservation); !cancelled.ok()) return cancelled;
  return held->bytes;
}

uint64_t DeviceBudget::ReleaseOwner(uint64_t owner) {
  absl::MutexLock lock(&mu_);
  return ledger_.ReleaseOwner(owner);
}

std::vector<ExpiredReservation> DeviceBudget::Expire(absl::Time now) {
  absl::MutexLock lock(&mu_);
  return ledger_.Expire(now);
}

BudgetChange DeviceBudget::SetBudget(uint64_t budget_bytes, std::string rule) {
  absl::MutexLock lock(&mu_);
  rule_ = std::move(rule);
  return ledger_.SetBudget(budget_bytes);
}

void DeviceBudget::SetEvictable(EvictableSource source, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  evictable_[static_cast<size_t>(source)] = bytes;
  uint64_t total = 0;
  for (uint64_t held : evictable_) total += std::min(held, UINT64_MAX - total);
  ledger_.SetEvictable(total);
}

AdmissionLedger DeviceBudget::Snapshot() const {
  absl::MutexLock lock(&mu_);
  return ledger_;
}

std::string DeviceBudget::rule() const {
  absl::MutexLock lock(&mu_);
  return rule_;
}

}  // namespace memra
