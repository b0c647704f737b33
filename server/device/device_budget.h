#ifndef MEMRA_SERVER_DEVICE_BUDGET_H_
#define MEMRA_SERVER_DEVICE_BUDGET_H_

// The GPU's one admission budget as the daemon shares it between threads: core's AdmissionLedger
// (every rule) behind a mutex, plus admission-driven eviction of the prefix cache.
//
// Eviction protocol: when an engine's admission is refused for anything its own pooled arenas
// could fix (its share of arenas or bytes, the daemon's arenas, or bytes eviction can free), the
// owner evictor frees that engine's pooled arenas first, unlocked, and the admission is retried
// once: an engine is never refused because of its own idle pool, and its pool goes before any
// other engine's. Then, when the refusal says eviction could make room
// (AdmissionRefusal::bytes_to_evict > 0, or an arena refusal while anything is evictable: every
// evictable byte is in arenas), the budget calls the evictors WITHOUT its own lock held, in
// EvictableSource order until the shortfall is freed, then retries once. Each evictor releases
// its allocations (which re-enter this budget through Release) and updates its evictable bytes
// (SetEvictable); the ledger's evictable bytes are the sources' sum. The prefix cache charges its
// own storage with AllocateWithoutEviction: it must never trigger its own eviction while it holds
// its own lock.
//
// Thread-safety: thread-safe.

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/admission.h"

namespace memra {

// The ledger owner of the prefix cache's storage. Engine ids start at 1, so it is nobody's id.
// It is the ledger's uncapped owner: no engine's budget share applies to it.
inline constexpr uint64_t kPrefixCacheOwner = kUncappedOwner;

// What holds evictable bytes, in the order admission evicts them: pooled session arenas first
// (nothing is lost but a reuse), then prefix-cache entries.
enum class EvictableSource { kArenaPool = 0, kPrefixCache = 1 };
inline constexpr size_t kEvictableSources = 2;

class DeviceBudget {
 public:
  // Frees evictable storage for an admission that is `bytes` short; returns the bytes freed.
  using Evictor = std::function<uint64_t(uint64_t bytes)>;
  // Frees what `owner` keeps evictable (its pooled arenas); returns the bytes freed.
  using OwnerEvictor = std::function<uint64_t(uint64_t owner)>;

  // `rule` says how the budget was derived, for status and logs; `limits` are the ledger's
  // arena and per-engine share limits (core/admission.h AdmissionLimits).
  DeviceBudget(uint64_t budget_bytes, std::string rule, AdmissionLimits limits = {});

  // Set once per source, before serving. Without any, refusals are returned as they are.
  void SetEvictor(EvictableSource source, Evictor evictor) ABSL_LOCKS_EXCLUDED(mu_);
  // Set once, before serving (the arena pool's DrainEngine). Without it no owner's own storage
  // is freed first.
  void SetOwnerEvictor(OwnerEvictor evictor) ABSL_LOCKS_EXCLUDED(mu_);

  // AdmissionLedger::Reserve, evicting for room first when that helps.
  absl::StatusOr<ReservationId> Reserve(uint64_t owner, uint64_t bytes, absl::Time now,
                                        absl::Duration ttl) ABSL_LOCKS_EXCLUDED(mu_);
  // AdmissionLedger::ReserveGroupRank, evicting for room first when that helps.
  absl::StatusOr<ReservationId> ReserveGroupRank(uint64_t owner, uint64_t bytes,
                                                 GroupRankKey group, absl::Time now,
                                                 absl::Duration deadline) ABSL_LOCKS_EXCLUDED(mu_);
  // AdmissionLedger::ConfirmGroupRank; the confirmed reservation.
  absl::StatusOr<HeldReservation> ConfirmGroupRank(uint64_t owner, uint64_t group_id,
                                                   absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);
  // AdmissionLedger::GroupRank and ReleaseGroupRank.
  absl::StatusOr<HeldReservation> GroupRank(uint64_t owner, uint64_t group_id) const
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<uint64_t> ReleaseGroupRank(uint64_t owner, uint64_t group_id)
      ABSL_LOCKS_EXCLUDED(mu_);
  // AdmissionLedger::Commit for a reservation `owner` holds (NOT_FOUND otherwise: an engine can
  // neither see nor use another engine's reservation). `actual_bytes` must equal the reserved
  // bytes' session cost; the ledger refuses more.
  absl::StatusOr<AllocationId> Commit(ReservationId reservation, uint64_t owner,
                                      uint64_t actual_bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // The reserved bytes of `owner`'s reservation (NOT_FOUND as Commit).
  absl::StatusOr<uint64_t> ReservedBytes(ReservationId reservation, uint64_t owner) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // AdmissionLedger::Allocate, evicting for room first when that helps.
  absl::StatusOr<AllocationId> Allocate(uint64_t owner, uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // For the prefix cache's own storage: never calls the evictor.
  absl::StatusOr<AllocationId> AllocateWithoutEviction(uint64_t owner, uint64_t bytes)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Release(AllocationId allocation) ABSL_LOCKS_EXCLUDED(mu_);
  // Cancels `owner`'s reservation; returns its bytes.
  absl::StatusOr<uint64_t> Cancel(ReservationId reservation, uint64_t owner)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Engine death: everything `owner` holds; returns the bytes freed.
  uint64_t ReleaseOwner(uint64_t owner) ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<ExpiredReservation> Expire(absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);
  BudgetChange SetBudget(uint64_t budget_bytes, std::string rule) ABSL_LOCKS_EXCLUDED(mu_);
  // The bytes `source` holds under this budget and could free on demand.
  void SetEvictable(EvictableSource source, uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);

  // A consistent copy of the ledger, for queries and listings.
  AdmissionLedger Snapshot() const ABSL_LOCKS_EXCLUDED(mu_);
  // Admissions refused for room, bytes or arenas (after any eviction), since construction.
  uint64_t refusals() const { return refusals_.load(std::memory_order_relaxed); }
  std::string rule() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // Runs `admit` (for `owner`) under the lock; on a refusal eviction could fix, evicts
  // (unlocked: the owner's own storage first, then the sources) and retries.
  template <typename T, typename Admit>
  absl::StatusOr<T> AdmitEvicting(uint64_t owner, Admit admit) ABSL_LOCKS_EXCLUDED(mu_);
  template <typename T, typename Admit>
  absl::StatusOr<T> AdmitOnce(Admit& admit) ABSL_LOCKS_EXCLUDED(mu_);
  // Counts `status` when it is an admission refusal.
  void CountRefusal(const absl::Status& status);

  std::atomic<uint64_t> refusals_{0};
  mutable absl::Mutex mu_;
  AdmissionLedger ledger_ ABSL_GUARDED_BY(mu_);
  std::string rule_ ABSL_GUARDED_BY(mu_);
  Evictor evictors_[kEvictableSources] ABSL_GUARDED_BY(mu_);
  OwnerEvictor owner_evictor_ ABSL_GUARDED_BY(mu_);
  uint64_t evictable_[kEvictableSources] ABSL_GUARDED_BY(mu_) = {};
};

}  // namespace memra

#endif  // MEMRA_SERVER_DEVICE_BUDGET_H_
