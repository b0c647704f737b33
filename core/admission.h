#ifndef MEMRA_CORE_ADMISSION_H_
#define MEMRA_CORE_ADMISSION_H_

// The GPU's single admission budget (docs/rules.md#admission): a ledger of reservations and live
// allocations against usable device bytes, and the pure cost queries the admin service and
// memra-kvctl answer from.
//
// The cost of a session is THE exact arena its allocation takes: LayoutArena(PlanSession(...)
// .planes, alignment, granularity).bytes. There is no second formula; the reference's history
// (docs/rules.md#the-reference; latent_kv_bytes_per_token_for_plan: a coefficient of 0 B/token
// admitted prompts the device could never serve) is why.

#include <cstdint>
#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/formats.h"
#include "core/group_layout.h"  // kMaxGroupRanks
#include "core/model_plan.h"
#include "core/sizing.h"

namespace memra {

// ---------------------------------------------------------------------------------------------
// Budget

// The cuda rule: floor(fraction x total_bytes) - reserve_bytes, saturating at 0 (a reserve larger
// than the fraction leaves no budget, it never wraps). `fraction` outside [0, 1] or NaN is
// clamped into it (configuration validation refuses such values before they get here).
uint64_t UsableCudaBudget(uint64_t total_bytes, double fraction, uint64_t reserve_bytes);
// The host rule: the configured bytes, as they are.
inline uint64_t UsableHostBudget(uint64_t configured_bytes) { return configured_bytes; }

// ---------------------------------------------------------------------------------------------
// Ids. Issued by the ledger from 1 upwards, never reused (0 is never issued), so a stale id is
// NOT_FOUND, never somebody else's bytes.

// Tag::kName names the id in messages ("reservation 7").
template <typename Tag>
struct LedgerId {
  uint64_t value = 0;
  friend bool operator==(LedgerId a, LedgerId b) { return a.value == b.value; }
  friend bool operator!=(LedgerId a, LedgerId b) { return a.value != b.value; }
  friend bool operator<(LedgerId a, LedgerId b) { return a.value < b.value; }
  template <typename H>
  friend H AbslHashValue(H h, LedgerId id) {
    return H::combine(std::move(h), id.value);
  }
  friend std::ostream& operator<<(std::ostream& os, LedgerId id) {
    return os << Tag::kName << " " << id.value;
  }
};
struct ReservationIdTag {
  static constexpr char kName[] = "reservation";
};
struct AllocationIdTag {
  static constexpr char kName[] = "allocation";
};
using ReservationId = LedgerId<ReservationIdTag>;
using AllocationId = LedgerId<AllocationIdTag>;

// ---------------------------------------------------------------------------------------------
// Refusals. Every "no room" is RESOURCE_EXHAUSTED with the message
//   "<what> needs N bytes, M free (E evictable) of B budget; <advice>"
// and these numbers attached as a payload (kAdmissionRefusalTypeUrl), so the gRPC layer and
// callers read them without parsing text.

struct AdmissionRefusal {
  uint64_t needed = 0;     // bytes the request asked for (for Grow: the extra bytes)
  uint64_t free = 0;       // budget - reserved - allocated (saturating) at the refusal
  uint64_t evictable = 0;  // what the prefix cache said it could free
  uint64_t budget = 0;
  // needed - free when free + evictable >= needed: evict this much and retry. 0 when eviction
  // cannot make room (the request does not fit even with every evictable byte freed).
  uint64_t bytes_to_evict = 0;
  bool operator==(const AdmissionRefusal&) const = default;
};

inline constexpr char kAdmissionRefusalTypeUrl[] = "type.memra.dev/memra.kv.AdmissionRefusal";
// Marks a refusal for max_arenas (no payload bytes): evicting any prefix entry frees arenas.
inline constexpr char kArenaRefusalTypeUrl[] = "type.memra.dev/memra.kv.ArenaRefusal";
// Whether `status` is the ledger's refusal for max_arenas.
bool IsArenaRefusal(const absl::Status& status);
// Marks a refusal for one owner's share (max_owner_arenas, owner_share_percent; no payload
// bytes): only what that owner holds can make room, e.g. its own pooled arenas.
inline constexpr char kOwnerShareRefusalTypeUrl[] = "type.memra.dev/memra.kv.OwnerShareRefusal";
bool IsOwnerShareRefusal(const absl::Status& status);

// The refusal carried by `status`, or nullopt when it carries none (any other status).
std::optional<AdmissionRefusal> GetAdmissionRefusal(const absl::Status& status);
// Attaches `refusal` to `status` (the wire layer restoring what the daemon sent).
void AttachAdmissionRefusal(absl::Status& status, const AdmissionRefusal& refusal);

// ---------------------------------------------------------------------------------------------
// The ledger

// One rank of a group admission (docs/groups.md): engines spanning GPUs reserve each rank's
// shard on that GPU's daemon under one client-chosen group id.
struct GroupRankKey {
  uint64_t group_id = 0;  // non-zero
  uint32_t rank = 0;      // < ranks
  uint32_t ranks = 0;     // 1..kMaxGroupRanks
  bool operator==(const GroupRankKey&) const = default;
};
// The longest a group reservation may stay unconfirmed.
inline constexpr absl::Duration kMaxGroupDeadline = absl::Minutes(10);
// "group 0x2a rank 2/4", as every group refusal names it.
std::string GroupRankName(const GroupRankKey& group);

struct Reservation {
  uint64_t owner = 0;  // engine id
  uint64_t bytes = 0;
  absl::Time expiry;  // Expire(now) drops it once now >= expiry
  // Set for a group rank's reservation. Unconfirmed, it lapses at `expiry` (the group's
  // deadline) and cannot be committed; confirmed, expiry is InfiniteFuture.
  std::optional<GroupRankKey> group;
  bool confirmed = false;
};

struct Allocation {
  uint64_t owner = 0;
  uint64_t bytes = 0;
};

// A reservation with its id (a listing's row; what Expire dropped).
struct HeldReservation {
  ReservationId id;
  Reservation reservation;
};
using ExpiredReservation = HeldReservation;

// What SetBudget changed. `over_budget_bytes` > 0: usage exceeds the new budget (a shrink below
// usage); nothing is admitted until releases bring usage back under it. Nothing is revoked.
struct BudgetChange {
  uint64_t old_budget = 0;
  uint64_t new_budget = 0;
  uint64_t used_bytes = 0;  // reserved + allocated
  uint64_t over_budget_bytes = 0;
};

// What the ledger admits besides bytes (DaemonConfig max_arenas, max_engine_budget_share).
struct AdmissionLimits {
  // Arenas live or promised: allocations + reservations (a reservation becomes one arena). Every
  // arena is one mapping in the daemon, and the kernel's vm.max_map_count bounds those: past it
  // every owner's allocation fails, however much budget is free.
  uint64_t max_arenas = UINT64_MAX;
  // Percent (1..100) of the budget one owner's reservations + allocations may hold. Owner
  // kUncappedOwner (0) is exempt.
  uint32_t owner_share_percent = 100;
  // Arenas one owner's reservations + allocations may be, so that no engine takes every arena.
  // Owner kUncappedOwner (0) is exempt.
  uint64_t max_owner_arenas = UINT64_MAX;
  bool operator==(const AdmissionLimits&) const = default;
};
// The owner no share applies to: the daemon's own prefix storage, bounded by its own budget.
// Engine ids start at 1.
inline constexpr uint64_t kUncappedOwner = 0;

// Thread-safety: a plain value, not synchronized; the daemon guards its one ledger with a mutex.
//
// Invariants:
//  (1) After any successful admission (Reserve, Allocate, Grow), reserved() + allocated() <=
//      budget(). Only SetBudget can make usage exceed the budget, and then no admission succeeds
//      until usage is back under it.
//  (2) Commit never fails for a live reservation (a group rank's once confirmed) and
//      actual_bytes in [1, reserved bytes]: an admitted reservation can always be created (its
//      bytes are already counted).
//  (3) Ids are never reused; a released, cancelled, committed or expired id is NOT_FOUND.
//  (4) Every operation that returns an error changes nothing.
//  (5) ReleaseOwner(o) leaves no reservation or allocation of o; accounting returns to exactly
//      what the other owners hold.
//  (6) After any successful admission, reservation_count() + allocation_count() <= max_arenas,
//      and the admitted owner (unless kUncappedOwner) holds at most owner_share_percent of the
//      budget and at most max_owner_arenas arenas. Lowering the limits revokes nothing.
//      Refusals for these are RESOURCE_EXHAUSTED without an AdmissionRefusal payload; the
//      arena refusal carries kArenaRefusalTypeUrl (evicting any prefix entry frees arenas), the
//      owner's share refusals kOwnerShareRefusalTypeUrl (only the owner's own release helps).
//
// Evictable bytes are memory already charged to this budget (the prefix cache allocates its
// storage through Allocate like any owner) that the prefix cache could free on demand. The
// ledger does not know the prefix cache: a refusal reports `bytes_to_evict`, the caller evicts
// (Release/SetEvictable) and retries.
class AdmissionLedger {
 public:
  explicit AdmissionLedger(uint64_t budget_bytes, AdmissionLimits limits = {})
      : budget_(budget_bytes), limits_(limits) {}

  // Holds `bytes` for `owner` until `now + ttl`. INVALID_ARGUMENT for 0 bytes or ttl <= 0;
  // RESOURCE_EXHAUSTED (with an AdmissionRefusal) when bytes > free(); RESOURCE_EXHAUSTED
  // (without) past max_arenas or the owner's share.
  absl::StatusOr<ReservationId> Reserve(uint64_t owner, uint64_t bytes, absl::Time now,
                                        absl::Duration ttl);
  // A group rank's reservation (docs/groups.md): as Reserve, held until `now + deadline` unless
  // confirmed. INVALID_ARGUMENT for group id 0, rank >= ranks, ranks outside
  // [1, kMaxGroupRanks], deadline outside (0, kMaxGroupDeadline]; ALREADY_EXISTS when `owner`
  // already holds a reservation for the group id.
  absl::StatusOr<ReservationId> ReserveGroupRank(uint64_t owner, uint64_t bytes,
                                                 GroupRankKey group, absl::Time now,
                                                 absl::Duration deadline);
  // `owner`'s reservation for `group_id`: confirmed, it no longer lapses (idempotent).
  // NOT_FOUND when owner holds none, or (changing nothing) when its deadline is <= now: the next
  // Expire frees it.
  absl::StatusOr<ReservationId> ConfirmGroupRank(uint64_t owner, uint64_t group_id,
                                                 absl::Time now);
  // `owner`'s reservation for `group_id`, if it holds one.
  std::optional<ReservationId> FindGroupRank(uint64_t owner, uint64_t group_id) const;
  // The same, or NOT_FOUND saying what may have become of it.
  absl::StatusOr<HeldReservation> GroupRank(uint64_t owner, uint64_t group_id) const;
  // Cancels `owner`'s reservation for `group_id`, confirmed or not; its bytes. NOT_FOUND as
  // GroupRank.
  absl::StatusOr<uint64_t> ReleaseGroupRank(uint64_t owner, uint64_t group_id);

  // Turns a live reservation into an allocation of `actual_bytes` (the difference returns to
  // free). NOT_FOUND for an unknown/expired/cancelled reservation; INVALID_ARGUMENT when
  // actual_bytes is 0 or exceeds the reserved bytes; FAILED_PRECONDITION for an unconfirmed
  // group rank's. Never RESOURCE_EXHAUSTED (invariant 2).
  absl::StatusOr<AllocationId> Commit(ReservationId reservation, uint64_t actual_bytes);
  // Admit and create in one step. INVALID_ARGUMENT for 0 bytes; RESOURCE_EXHAUSTED as Reserve.
  absl::StatusOr<AllocationId> Allocate(uint64_t owner, uint64_t bytes);
  // Charges `new_bytes` for an allocation in place (a session regrown to a larger capacity).
  // The extra (new - current) must fit in free() (RESOURCE_EXHAUSTED reports the extra as
  // `needed`) and in the owner's share. INVALID_ARGUMENT when new_bytes < current (grow never shrinks); equal is a no-op.
  // NOT_FOUND for an unknown allocation. (When old and new planes coexist until the engine
  // acknowledges, charge the new arena with Allocate and Release the old one instead.)
  absl::Status Grow(AllocationId allocation, uint64_t new_bytes);
  // NOT_FOUND for an unknown allocation / reservation.
  absl::Status Release(AllocationId allocation);
  absl::Status Cancel(ReservationId reservation);
  // Engine death: drops every reservation and allocation `owner` holds; returns the bytes
  // freed (0 for an owner holding nothing).
  uint64_t ReleaseOwner(uint64_t owner);
  // Drops every reservation with expiry <= now, in id order.
  std::vector<ExpiredReservation> Expire(absl::Time now);
  // SIGHUP reload. A shrink below usage is allowed and reported (invariant 1).
  BudgetChange SetBudget(uint64_t budget_bytes);
  void SetLimits(AdmissionLimits limits) { limits_ = limits; }
  const AdmissionLimits& limits() const { return limits_; }
  // Reported by the prefix cache: bytes it holds under this budget and could evict.
  void SetEvictable(uint64_t bytes) { evictable_ = bytes; }

  // Lookups for ownership checks and listings.
  std::optional<Reservation> FindReservation(ReservationId id) const;
  std::optional<Allocation> FindAllocation(AllocationId id) const;

  // Every live entry, in id order (for listings: the admin service, memra-kvctl).
  const std::map<ReservationId, Reservation>& reservations() const { return reservations_; }
  const std::map<AllocationId, Allocation>& allocations() const { return allocations_; }

  // Identities: free() == budget() - reserved() - allocated() while usage <= budget, else 0.
  // reserved() == sum of live reservation bytes; allocated() == sum of live allocation bytes.
  uint64_t budget() const { return budget_; }
  uint64_t reserved() const { return reserved_; }
  uint64_t allocated() const { return allocated_; }
  uint64_t used() const { return reserved_ + allocated_; }
  uint64_t free() const;
  uint64_t evictable() const { return evictable_; }
  size_t reservation_count() const { return reservations_.size(); }
  size_t allocation_count() const { return allocations_.size(); }
  // Arenas that can still be admitted under max_arenas (0 when at or past it).
  uint64_t arenas_left() const;
  // Bytes `owner` holds (reservations + allocations).
  uint64_t owner_bytes(uint64_t owner) const;
  // Arenas `owner` holds (reservations + allocations).
  uint64_t owner_arenas(uint64_t owner) const;

 private:
  // OK when `bytes` fits in free(); else RESOURCE_EXHAUSTED for `what` with the refusal payload.
  absl::Status CheckFits(uint64_t bytes, absl::string_view what) const;
  // OK when one more arena is within max_arenas.
  absl::Status CheckArenaRoom(absl::string_view what) const;
  // OK when `owner` may hold `extra` more bytes under owner_share_percent.
  absl::Status CheckOwnerShare(uint64_t owner, uint64_t extra, absl::string_view what) const;
  // OK when `owner` may hold one more arena under max_owner_arenas.
  absl::Status CheckOwnerArenas(uint64_t owner, absl::string_view what) const;
  // Reserve's checks and bookkeeping, `what` naming the reservation in refusals.
  absl::StatusOr<ReservationId> AddReservation(uint64_t owner, uint64_t bytes,
                                               Reservation reservation, absl::string_view what);
  void AddOwnerBytes(uint64_t owner, uint64_t bytes);
  void RemoveOwnerBytes(uint64_t owner, uint64_t bytes);
  void RemoveOwnerArena(uint64_t owner);

  uint64_t budget_;
  uint64_t evictable_ = 0;
  uint64_t reserved_ = 0;   // == sum of reservations_[*].bytes
  uint64_t allocated_ = 0;  // == sum of allocations_[*].bytes
  uint64_t next_id_ = 1;    // shared by both id kinds: one counter, never reused
  std::map<ReservationId, Reservation> reservations_;
  std::map<AllocationId, Allocation> allocations_;
  AdmissionLimits limits_;
  // Owner -> the bytes of its reservations + allocations; owners holding nothing are absent.
  std::map<uint64_t, uint64_t> owner_bytes_;
  // Owner -> its reservations + allocations (arenas); owners holding none are absent.
  std::map<uint64_t, uint64_t> owner_arenas_;
};

// ---------------------------------------------------------------------------------------------
// Cost queries (pure)

// Plane offsets are aligned to this in every session arena (device vector loads).
inline constexpr uint64_t kPlaneAlignment = 256;

// How the backend places and rounds a session's arena: `alignment` for plane offsets,
// `granularity` = DeviceBackend::AllocationGranularity() (host: the page size; cuda: its granule).
struct ArenaRounding {
  uint64_t alignment = kPlaneAlignment;
  // No default on purpose: a guessed granularity would charge other bytes than the backend
  // allocates. 0 (unset) is refused as INVALID_ARGUMENT by every query.
  uint64_t granularity = 0;
};

struct CostReport {
  uint64_t capacity = 0;     // the request's capacity, tokens
  CostBreakdown breakdown;   // per-class coefficients (breakdown.total_bytes: planes, unrounded)
  uint64_t arena_bytes = 0;  // THE cost: what admission charges and the daemon allocates
};

// Exact cost of one session of `plan` for `request`. INVALID_ARGUMENT from PlanSession /
// LayoutArena (plan, request or rounding invalid; overflow).
absl::StatusOr<CostReport> SessionCost(const ModelPlan& plan, const FormatDefaults& defaults,
                                       const SessionShape& request, ArenaRounding rounding);
// Just the arena bytes (SessionCost(...).arena_bytes).
absl::StatusOr<uint64_t> SessionArenaBytes(const ModelPlan& plan, const FormatDefaults& defaults,
                                           const SessionShape& request, ArenaRounding rounding);

// floor(free_bytes / session_bytes). INVALID_ARGUMENT for session_bytes 0.
absl::StatusOr<uint64_t> SessionsThatFit(uint64_t session_bytes, uint64_t free_bytes);

// How many sessions of one cost fit in the ledger's state.
struct SessionFit {
  uint64_t session_bytes = 0;
  // Each bounded by the arenas max_arenas leaves (now, after eviction) or allows (when empty).
  uint64_t now = 0;             // in free()
  uint64_t after_eviction = 0;  // in free() + evictable() (saturating)
  uint64_t when_empty = 0;      // in budget()
};
absl::StatusOr<SessionFit> FitSessions(const AdmissionLedger& ledger, uint64_t session_bytes);

// The largest capacity c in [1, INT32_MAX] with SessionArenaBytes(request at c) <= free_bytes,
// found by binary search over the exact cost (which is monotonic in capacity); 0 when not even
// capacity 1 fits. request.capacity is ignored. INVALID_ARGUMENT when the plan or request is
// invalid at capacity 1. A capacity whose bytes overflow 64 bits counts as not fitting.
absl::StatusOr<uint64_t> MaxContextThatFits(const ModelPlan& plan, const FormatDefaults& defaults,
                                            const SessionShape& request, uint64_t free_bytes,
                                            ArenaRounding rounding);

// The engine scheduler's question: how many context tokens of this model fit in `free_bytes`
// when it packs sessions of the template's capacity C. Defined as
//   full_sessions    = floor(free_bytes / cost(C))
//   remainder_tokens = MaxContextThatFits(free_bytes - full_sessions * cost(C))   (< C)
//   total_tokens     = full_sessions * C + remainder_tokens   (saturating)
// i.e. as many full sessions as fit, plus the one shorter session the leftover bytes hold. With
// C beyond what fits, it is the max-context answer (0 full sessions). Per-session fixed bytes
// (mirrors, recurrent state, rings, rounding) make many short sessions hold fewer tokens than
// one long one; this counts exactly that.
struct TokenFit {
  uint64_t capacity = 0;       // C
  uint64_t session_bytes = 0;  // cost(C)
  uint64_t full_sessions = 0;
  uint64_t remainder_tokens = 0;
  uint64_t total_tokens = 0;
};
absl::StatusOr<TokenFit> TotalTokensThatFit(const ModelPlan& plan, const FormatDefaults& defaults,
                                            const SessionShape& request, uint64_t free_bytes,
                                            ArenaRounding rounding);

}  // namespace memra

#endif  // MEMRA_CORE_ADMISSION_H_
