#include "core/admission.h"

#include <cstdint>
#include <limits>
#include <map>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "core/arena_layout.h"
#include "core/sizing.h"
#include "core/test_model_plans.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::IsOkAndHolds;
using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;
using ::testing::Eq;
using ::testing::Optional;

constexpr uint64_t kGiB = uint64_t{1} << 30;
constexpr uint64_t kMaxCapacity = std::numeric_limits<int32_t>::max();
const absl::Time kT0 = absl::FromUnixSeconds(1'000'000);
constexpr ArenaRounding kPages{kPlaneAlignment, 4096};
constexpr ArenaRounding kCudaGranules{kPlaneAlignment, uint64_t{2} << 20};

// --- Budget ----------------------------------------------------------------------------------

TEST(UsableBudgetTest, CudaIsFractionOfTotalMinusReserve) {
  EXPECT_EQ(UsableCudaBudget(80 * kGiB, 0.5, kGiB), 39 * kGiB);
  EXPECT_EQ(UsableCudaBudget(80 * kGiB, 1.0, 0), 80 * kGiB);
  // 0.9 x 10 GiB = 9663676416 (floored), minus 1 GiB.
  EXPECT_EQ(UsableCudaBudget(10 * kGiB, 0.9, kGiB), 9'663'676'416u - kGiB);
}

TEST(UsableBudgetTest, CudaSaturatesAndClamps) {
  EXPECT_EQ(UsableCudaBudget(kGiB, 0.5, kGiB), 0u);  // reserve above the fraction: no budget
  EXPECT_EQ(UsableCudaBudget(kGiB, 0.0, 0), 0u);
  EXPECT_EQ(UsableCudaBudget(kGiB, -1.0, 0), 0u);
  EXPECT_EQ(UsableCudaBudget(kGiB, std::numeric_limits<double>::quiet_NaN(), 0), 0u);
  EXPECT_EQ(UsableCudaBudget(kGiB, 7.0, 0), kGiB);  // clamped to 1
  const uint64_t max = std::numeric_limits<uint64_t>::max();
  EXPECT_EQ(UsableCudaBudget(max, 1.0, 5), max - 5);  // no overflow at the top
  EXPECT_EQ(UsableHostBudget(8 * kGiB), 8 * kGiB);
}

// --- Refusals ----------------------------------------------------------------------------------

TEST(AdmissionLedgerTest, ReserveRefusalCarriesTheNumbers) {
  AdmissionLedger ledger(1000);
  ASSERT_THAT(ledger.Allocate(/*owner=*/1, 600), IsOk());
  absl::StatusOr<ReservationId> refused = ledger.Reserve(2, 500, kT0, absl::Seconds(30));
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kResourceExhausted,
                                Eq("reservation needs 500 bytes, 400 free (0 evictable) of 1000 "
                                   "budget; eviction cannot make room")));
  EXPECT_THAT(GetAdmissionRefusal(refused.status()),
              Optional(AdmissionRefusal{500, 400, 0, 1000, 0}));
  // Refused: nothing changed.
  EXPECT_EQ(ledger.reserved(), 0u);
  EXPECT_EQ(ledger.allocated(), 600u);
  EXPECT_EQ(ledger.reservation_count(), 0u);
}

TEST(AdmissionLedgerTest, RefusalSaysHowMuchToEvictWhenEvictionCanMakeRoom) {
  AdmissionLedger ledger(1000);
  ASSERT_THAT(ledger.Allocate(/*owner=*/0, 700), IsOk());  // the prefix cache's storage
  ledger.SetEvictable(300);
  absl::StatusOr<AllocationId> refused = ledger.Allocate(1, 450);
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kResourceExhausted,
                                Eq("allocation needs 450 bytes, 300 free (300 evictable) of 1000 "
                                   "budget; evicting 150 bytes would make room")));
  EXPECT_THAT(GetAdmissionRefusal(refused.status()),
              Optional(AdmissionRefusal{450, 300, 300, 1000, 150}));
  // One byte more than free + evictable: eviction cannot help.
  EXPECT_THAT(GetAdmissionRefusal(ledger.Allocate(1, 601).status()),
              Optional(AdmissionRefusal{601, 300, 300, 1000, 0}));
}

TEST(AdmissionLedgerTest, GrowRefusalReportsTheExtraBytes) {
  AdmissionLedger ledger(1000);
  absl::StatusOr<AllocationId> a = ledger.Allocate(1, 400);
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(ledger.Allocate(2, 400), IsOk());
  absl::Status grow = ledger.Grow(*a, 700);
  EXPECT_THAT(grow, StatusIs(absl::StatusCode::kResourceExhausted,
                             HasSubstrs("grow needs 300 bytes, 200 free (0 evictable) of 1000")));
  EXPECT_THAT(GetAdmissionRefusal(grow), Optional(AdmissionRefusal{300, 200, 0, 1000, 0}));
  EXPECT_EQ(ledger.FindAllocation(*a)->bytes, 400u);
  EXPECT_THAT(ledger.Grow(*a, 600), IsOk());
  EXPECT_EQ(ledger.allocated(), 1000u);
  EXPECT_EQ(ledger.free(), 0u);
  EXPECT_THAT(ledger.Grow(*a, 599),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("holds 600 bytes; growing to 599 would shrink it")));
  EXPECT_THAT(ledger.Grow(*a, 600), IsOk());  // no-op
  EXPECT_THAT(ledger.Grow(AllocationId{999}, 1),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs("allocation 999 is not live")));
}

TEST(AdmissionLedgerTest, MalformedRequestsAreInvalidArgument) {
  AdmissionLedger ledger(1000);
  EXPECT_THAT(ledger.Reserve(1, 0, kT0, absl::Seconds(1)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("0 bytes")));
  EXPECT_THAT(ledger.Reserve(1, 10, kT0, absl::ZeroDuration()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("ttl 0 must be positive")));
  EXPECT_THAT(ledger.Allocate(1, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("0 bytes")));
  EXPECT_THAT(GetAdmissionRefusal(absl::InvalidArgumentError("x")), Eq(std::nullopt));
  EXPECT_THAT(GetAdmissionRefusal(absl::ResourceExhaustedError("no payload")), Eq(std::nullopt));
}

// --- Reservation lifecycle ---------------------------------------------------------------------

TEST(AdmissionLedgerTest, CommitConvertsAndReturnsTheDifference) {
  AdmissionLedger ledger(1000);
  absl::StatusOr<ReservationId> r = ledger.Reserve(7, 600, kT0, absl::Seconds(30));
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(ledger.reserved(), 600u);
  EXPECT_EQ(ledger.free(), 400u);
  EXPECT_THAT(ledger.FindReservation(*r)->expiry, Eq(kT0 + absl::Seconds(30)));

  EXPECT_THAT(ledger.Commit(*r, 601),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("holds 600 bytes; cannot create 601 bytes")));
  EXPECT_THAT(ledger.Commit(*r, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("cannot create 0 bytes")));
  absl::StatusOr<AllocationId> a = ledger.Commit(*r, 550);
  ASSERT_THAT(a, IsOk());
  EXPECT_EQ(ledger.reserved(), 0u);
  EXPECT_EQ(ledger.allocated(), 550u);
  EXPECT_EQ(ledger.free(), 450u);
  EXPECT_EQ(ledger.FindAllocation(*a)->owner, 7u);
  EXPECT_THAT(ledger.Commit(*r, 1),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs("reservation 1 is not held")));
  EXPECT_THAT(ledger.Release(*a), IsOk());
  EXPECT_THAT(ledger.Release(*a),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs("allocation 2 is not live")));
  EXPECT_EQ(ledger.used(), 0u);
}

TEST(AdmissionLedgerTest, ReservationsExpireAndCancel) {
  AdmissionLedger ledger(1000);
  ReservationId early = *ledger.Reserve(1, 100, kT0, absl::Seconds(10));
  ReservationId late = *ledger.Reserve(2, 200, kT0, absl::Seconds(20));
  ReservationId cancelled = *ledger.Reserve(3, 300, kT0, absl::Seconds(5));
  EXPECT_THAT(ledger.Cancel(cancelled), IsOk());
  EXPECT_THAT(ledger.Cancel(cancelled),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs("reservation 3 is not held")));
  EXPECT_TRUE(ledger.Expire(kT0 + absl::Seconds(9)).empty());
  std::vector<ExpiredReservation> expired = ledger.Expire(kT0 + absl::Seconds(10));
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].id, early);
  EXPECT_EQ(expired[0].reservation.bytes, 100u);
  EXPECT_EQ(ledger.reserved(), 200u);
  EXPECT_THAT(ledger.Commit(early, 100),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs("reservation 1 is not held")));
  EXPECT_THAT(ledger.Commit(late, 200), IsOk());
}

// --- Group ranks (docs/groups.md) --------------------------------------------------------------

constexpr GroupRankKey kGroupRank2{0x5eed, 2, 4};

TEST(AdmissionLedgerGroupTest, UnconfirmedLapsesAtItsDeadlineAndCannotBeCommitted) {
  AdmissionLedger ledger(1000);
  ReservationId id = *ledger.ReserveGroupRank(1, 400, kGroupRank2, kT0, absl::Seconds(5));
  EXPECT_EQ(ledger.reserved(), 400u);
  EXPECT_THAT(ledger.FindGroupRank(1, 0x5eed), Optional(Eq(id)));
  EXPECT_EQ(ledger.FindGroupRank(2, 0x5eed), std::nullopt);  // another engine's group
  EXPECT_THAT(ledger.Commit(id, 400),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("reservation 1 is group 0x5eed rank 2/4, not confirmed")));
  EXPECT_TRUE(ledger.Expire(kT0 + absl::Milliseconds(4999)).empty());
  // Past the deadline a confirm is refused and changes nothing; the sweep frees it.
  EXPECT_THAT(ledger.ConfirmGroupRank(1, 0x5eed, kT0 + absl::Milliseconds(5250)),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstrs("group 0x5eed rank 2/4", "deadline passed 250 ms ago")));
  EXPECT_EQ(ledger.reserved(), 400u);
  std::vector<ExpiredReservation> expired = ledger.Expire(kT0 + absl::Seconds(5));
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].reservation.group, kGroupRank2);
  EXPECT_EQ(ledger.used(), 0u);
  EXPECT_EQ(ledger.owner_arenas(1), 0u);
  EXPECT_THAT(ledger.ConfirmGroupRank(1, 0x5eed, kT0 + absl::Seconds(6)),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstrs("group 0x5eed: engine 1 holds no reservation")));
}

TEST(AdmissionLedgerGroupTest, ConfirmedIsHeldPastTheDeadlineUntilCommitted) {
  AdmissionLedger ledger(1000);
  ReservationId id = *ledger.ReserveGroupRank(1, 400, kGroupRank2, kT0, absl::Seconds(5));
  EXPECT_THAT(ledger.ConfirmGroupRank(1, 0x5eed, kT0 + absl::Seconds(1)), IsOkAndHolds(Eq(id)));
  EXPECT_THAT(ledger.ConfirmGroupRank(1, 0x5eed, kT0 + absl::Seconds(2)), IsOkAndHolds(Eq(id)));
  EXPECT_TRUE(ledger.Expire(kT0 + absl::Hours(1)).empty());
  EXPECT_EQ(ledger.reserved(), 400u);
  ASSERT_THAT(ledger.Commit(id, 400), IsOk());
  EXPECT_EQ(ledger.allocated(), 400u);
  EXPECT_THAT(ledger.GroupRank(1, 0x5eed),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstrs("group 0x5eed: engine 1 holds no reservation")));
  EXPECT_EQ(ledger.FindGroupRank(1, 0x5eed), std::nullopt);
}

TEST(AdmissionLedgerGroupTest, RefusalsNameTheGroupRankAndTheNumbers) {
  AdmissionLedger ledger(1000);
  absl::StatusOr<ReservationId> full =
      ledger.ReserveGroupRank(1, 1200, kGroupRank2, kT0, absl::Seconds(5));
  EXPECT_THAT(full, StatusIs(absl::StatusCode::kResourceExhausted,
                             HasSubstrs("group 0x5eed rank 2/4 needs 1200 bytes, 1000 free",
                                        "of 1000 budget")));
  EXPECT_THAT(GetAdmissionRefusal(full.status()),
              Optional(AdmissionRefusal{1200, 1000, 0, 1000, 0}));
  EXPECT_THAT(ledger.ReserveGroupRank(1, 10, {0, 0, 1}, kT0, absl::Seconds(5)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("group id 0")));
  EXPECT_THAT(ledger.ReserveGroupRank(1, 10, {7, 4, 4}, kT0, absl::Seconds(5)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("group 0x7 rank 4/4", "ranks in [1, 1024]")));
  EXPECT_THAT(ledger.ReserveGroupRank(1, 10, {7, 0, 1025}, kT0, absl::Seconds(5)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("rank 0/1025")));
  EXPECT_THAT(ledger.ReserveGroupRank(1, 10, {7, 0, 4}, kT0, absl::Minutes(11)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("deadline 660000 ms outside [1, 600000] ms")));
  EXPECT_THAT(ledger.ReserveGroupRank(1, 0, {7, 0, 4}, kT0, absl::Seconds(5)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("group 0x7 rank 0/4 of 0 bytes")));
  ASSERT_THAT(ledger.ReserveGroupRank(1, 10, {7, 0, 4}, kT0, absl::Seconds(5)), IsOk());
  EXPECT_THAT(ledger.ReserveGroupRank(1, 10, {7, 1, 4}, kT0, absl::Seconds(5)),
              StatusIs(absl::StatusCode::kAlreadyExists,
                       HasSubstrs("engine 1 already holds group 0x7 rank 0/4", "10 bytes")));
  // Another engine may hold the same group id (its own rank on this daemon).
  EXPECT_THAT(ledger.ReserveGroupRank(2, 10, {7, 1, 4}, kT0, absl::Seconds(5)), IsOk());
  EXPECT_EQ(ledger.reserved(), 20u);
  EXPECT_THAT(ledger.ReleaseGroupRank(1, 7), IsOkAndHolds(Eq(10u)));
  EXPECT_THAT(ledger.ReleaseGroupRank(1, 7),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs("group 0x7: engine 1 holds no")));
  EXPECT_EQ(ledger.reserved(), 10u);
  EXPECT_EQ(ledger.owner_arenas(1), 0u);
}

TEST(AdmissionLedgerTest, ReleaseOwnerFreesEverythingItHeld) {
  AdmissionLedger ledger(1000);
  ASSERT_THAT(ledger.Allocate(1, 100), IsOk());
  ASSERT_THAT(ledger.Reserve(1, 50, kT0, absl::Seconds(1)), IsOk());
  AllocationId other = *ledger.Allocate(2, 300);
  ASSERT_THAT(ledger.Allocate(1, 25), IsOk());
  EXPECT_EQ(ledger.ReleaseOwner(1), 175u);
  EXPECT_EQ(ledger.ReleaseOwner(1), 0u);
  EXPECT_EQ(ledger.used(), 300u);
  EXPECT_EQ(ledger.reservation_count(), 0u);
  EXPECT_EQ(ledger.allocation_count(), 1u);
  EXPECT_TRUE(ledger.FindAllocation(other).has_value());
  ASSERT_EQ(ledger.allocations().size(), 1u);
  EXPECT_EQ(ledger.allocations().begin()->first, other);
  EXPECT_TRUE(ledger.reservations().empty());
}

TEST(AdmissionLedgerTest, IdsAreNeverReused) {
  AdmissionLedger ledger(1000);
  std::vector<uint64_t> seen;
  for (int i = 0; i < 5; ++i) {
    ReservationId r = *ledger.Reserve(1, 10, kT0, absl::Seconds(1));
    AllocationId a = *ledger.Commit(r, 10);
    AllocationId b = *ledger.Allocate(1, 10);
    ASSERT_THAT(ledger.Release(a), IsOk());
    ASSERT_THAT(ledger.Release(b), IsOk());
    seen.insert(seen.end(), {r.value, a.value, b.value});
  }
  for (size_t i = 1; i < seen.size(); ++i) EXPECT_GT(seen[i], seen[i - 1]);
  EXPECT_GT(seen.front(), 0u);
}

TEST(AdmissionLedgerTest, BudgetShrinkBelowUsageAdmitsNothingUntilUsageDrops) {
  AdmissionLedger ledger(1000);
  AllocationId a = *ledger.Allocate(1, 600);
  ASSERT_THAT(ledger.Reserve(1, 200, kT0, absl::Seconds(30)), IsOk());
  BudgetChange change = ledger.SetBudget(500);
  EXPECT_EQ(change.old_budget, 1000u);
  EXPECT_EQ(change.new_budget, 500u);
  EXPECT_EQ(change.used_bytes, 800u);
  EXPECT_EQ(change.over_budget_bytes, 300u);
  EXPECT_EQ(ledger.free(), 0u);
  EXPECT_THAT(ledger.Allocate(2, 1),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstrs("needs 1 bytes, 0 free (0 evictable) of 500 budget")));
  ASSERT_THAT(ledger.Release(a), IsOk());
  EXPECT_EQ(ledger.free(), 300u);
  EXPECT_THAT(ledger.Allocate(2, 300), IsOk());
  EXPECT_EQ(ledger.SetBudget(2000).over_budget_bytes, 0u);
  EXPECT_EQ(ledger.free(), 1500u);
}

// The property test's model of ReleaseOwner, written independently of the ledger's.
template <typename Map>
uint64_t ModelEraseOwner(uint64_t owner, Map& entries) {
  uint64_t bytes = 0;
  std::vector<typename Map::key_type> doomed;
  for (const auto& [id, entry] : entries) {
    if (entry.owner == owner) {
      bytes += entry.bytes;
      doomed.push_back(id);
    }
  }
  for (const auto& id : doomed) entries.erase(id);
  return bytes;
}

// PROPERTY: random sequences of every operation never admit past the budget, every live
// reservation commits, and the ledger's sums always match an independent model of it.
TEST(AdmissionLedgerTest, PropertyRandomOperationsNeverExceedTheBudget) {
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    SCOPED_TRACE(seed);
    std::mt19937_64 rng(seed);
    auto uniform = [&](uint64_t lo, uint64_t hi) {
      return std::uniform_int_distribution<uint64_t>(lo, hi)(rng);
    };
    uint64_t budget = uniform(1000, 100'000);
    const AdmissionLimits limits{.max_arenas = uniform(3, 30),
                                 .owner_share_percent = static_cast<uint32_t>(uniform(30, 100))};
    AdmissionLedger ledger(budget, limits);
    std::map<ReservationId, Reservation> reservations;  // the model
    std::map<AllocationId, Allocation> allocations;
    absl::Time now = kT0;
    uint64_t last_id = 0;
    auto model_used = [&] {
      uint64_t used = 0;
      for (const auto& [id, r] : reservations) used += r.bytes;
      for (const auto& [id, a] : allocations) used += a.bytes;
      return used;
    };
    auto model_owner_bytes = [&](uint64_t owner) {
      uint64_t held = 0;
      for (const auto& [id, r] : reservations) held += r.owner == owner ? r.bytes : 0;
      for (const auto& [id, a] : allocations) held += a.owner == owner ? a.bytes : 0;
      return held;
    };
    auto share_cap = [&] { return budget * limits.owner_share_percent / 100; };
    // A refusal of `bytes` for `owner` is right when one of the three limits says so.
    auto refusal_is_due = [&](uint64_t owner, uint64_t bytes, uint64_t used_before,
                              bool new_arena) {
      return used_before + bytes > ledger.budget() ||
             model_owner_bytes(owner) + bytes > share_cap() ||
             (new_arena && reservations.size() + allocations.size() >= limits.max_arenas);
    };
    for (int step = 0; step < 400; ++step) {
      const uint64_t used_before = model_used();
      const uint64_t owner = uniform(1, 4);
      const uint64_t bytes = uniform(1, budget / 3);
      bool admitted = false;
      switch (uniform(0, 9)) {
        case 0:
        case 1: {
          absl::StatusOr<ReservationId> r =
              ledger.Reserve(owner, bytes, now, absl::Seconds(uniform(1, 20)));
          if (r.ok()) {
            ASSERT_GT(r->value, last_id);
            last_id = r->value;
            reservations[*r] = *ledger.FindReservation(*r);
            admitted = true;
          } else {
            ASSERT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
            ASSERT_TRUE(refusal_is_due(owner, bytes, used_before, true));
          }
          break;
        }
        case 2:
        case 3: {  // every live reservation commits
          if (reservations.empty()) break;
          auto it = std::next(reservations.begin(), uniform(0, reservations.size() - 1));
          absl::StatusOr<AllocationId> a = ledger.Commit(it->first, uniform(1, it->second.bytes));
          ASSERT_THAT(a, IsOk());
          ASSERT_GT(a->value, last_id);
          last_id = a->value;
          allocations[*a] = *ledger.FindAllocation(*a);
          reservations.erase(it);
          break;
        }
        case 4: {
          absl::StatusOr<AllocationId> a = ledger.Allocate(owner, bytes);
          if (a.ok()) {
            ASSERT_GT(a->value, last_id);
            last_id = a->value;
            allocations[*a] = Allocation{owner, bytes};
            admitted = true;
          } else {
            ASSERT_EQ(a.status().code(), absl::StatusCode::kResourceExhausted);
            ASSERT_TRUE(refusal_is_due(owner, bytes, used_before, true));
          }
          break;
        }
        case 5: {
          if (allocations.empty()) break;
          auto it = std::next(allocations.begin(), uniform(0, allocations.size() - 1));
          const uint64_t target = it->second.bytes + uniform(0, budget / 4);
          absl::Status grown = ledger.Grow(it->first, target);
          if (grown.ok()) {
            admitted = target > it->second.bytes;  // equal is a no-op, not an admission
            it->second.bytes = target;
          } else {
            ASSERT_EQ(grown.code(), absl::StatusCode::kResourceExhausted);
            ASSERT_TRUE(refusal_is_due(it->second.owner, target - it->second.bytes, used_before,
                                       false));
          }
          break;
        }
        case 6: {
          if (allocations.empty()) break;
          auto it = std::next(allocations.begin(), uniform(0, allocations.size() - 1));
          ASSERT_THAT(ledger.Release(it->first), IsOk());
          allocations.erase(it);
          break;
        }
        case 7: {
          if (reservations.empty()) break;
          auto it = std::next(reservations.begin(), uniform(0, reservations.size() - 1));
          ASSERT_THAT(ledger.Cancel(it->first), IsOk());
          reservations.erase(it);
          break;
        }
        case 8: {
          now += absl::Seconds(uniform(0, 10));
          for (const ExpiredReservation& e : ledger.Expire(now)) {
            ASSERT_LE(e.reservation.expiry, now);
            ASSERT_EQ(reservations.erase(e.id), 1u);
          }
          for (const auto& [id, r] : reservations) ASSERT_GT(r.expiry, now);
          break;
        }
        case 9: {
          if (uniform(0, 3) == 0) {  // an occasional SIGHUP reload, shrink included
            budget = uniform(500, 100'000);
            ledger.SetBudget(budget);
          } else {  // engine death
            const uint64_t expected =
                ModelEraseOwner(owner, reservations) + ModelEraseOwner(owner, allocations);
            ASSERT_EQ(ledger.ReleaseOwner(owner), expected);
          }
          break;
        }
      }
      const uint64_t used = model_used();
      ASSERT_EQ(ledger.used(), used);
      ASSERT_EQ(ledger.reservation_count(), reservations.size());
      ASSERT_EQ(ledger.allocation_count(), allocations.size());
      ASSERT_EQ(ledger.free(), used >= ledger.budget() ? 0 : ledger.budget() - used);
      for (uint64_t held_by = 1; held_by <= 4; ++held_by) {
        ASSERT_EQ(ledger.owner_bytes(held_by), model_owner_bytes(held_by));
      }
      if (admitted) {
        ASSERT_LE(used, ledger.budget());  // invariant (1)
        ASSERT_LE(reservations.size() + allocations.size(), limits.max_arenas);  // (6)
      }
    }
    // Everything returned: accounting is back to exactly zero.
    for (uint64_t owner = 1; owner <= 4; ++owner) ledger.ReleaseOwner(owner);
    EXPECT_EQ(ledger.used(), 0u);
    EXPECT_EQ(ledger.free(), ledger.budget());
  }
}

// One engine's arenas stop at max_owner_arenas while another owner (and the uncapped prefix
// storage) keeps being admitted; every way an arena ends gives the engine its room back.
TEST(AdmissionLedgerTest, OwnerArenaShareStopsOneEngineOnly) {
  AdmissionLedger ledger(10'000, AdmissionLimits{.max_arenas = 10, .max_owner_arenas = 3});
  absl::StatusOr<ReservationId> reserved = ledger.Reserve(7, 100, kT0, absl::Seconds(5));
  ASSERT_THAT(reserved, IsOk());
  absl::StatusOr<AllocationId> first = ledger.Allocate(7, 100);
  ASSERT_THAT(first, IsOk());
  ASSERT_THAT(ledger.Allocate(7, 100), IsOk());
  EXPECT_EQ(ledger.owner_arenas(7), 3u);
  const absl::Status refused = ledger.Allocate(7, 100).status();
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kResourceExhausted,
                                HasSubstrs("allocation refused: engine 7 holds 3 arenas",
                                           "limit is 3 per engine", "max_engine_arenas",
                                           "10 max_arenas")));
  EXPECT_FALSE(IsArenaRefusal(refused));  // evicting prefix storage frees none of engine 7's
  EXPECT_TRUE(IsOwnerShareRefusal(refused));  // only engine 7's own arenas make room
  EXPECT_THAT(ledger.Reserve(7, 100, kT0, absl::Seconds(5)).status(),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstrs("reservation refused: engine 7 holds 3 arenas")));
  EXPECT_EQ(ledger.used(), 300u);  // the refusals changed nothing
  EXPECT_THAT(ledger.Allocate(8, 100), IsOk());
  EXPECT_THAT(ledger.Allocate(kUncappedOwner, 100), IsOk());

  // Commit keeps the count (a reservation becomes its arena); release, cancel and expiry free one.
  ASSERT_THAT(ledger.Commit(*reserved, 50), IsOk());
  EXPECT_EQ(ledger.owner_arenas(7), 3u);
  ASSERT_THAT(ledger.Release(*first), IsOk());
  EXPECT_EQ(ledger.owner_arenas(7), 2u);
  absl::StatusOr<ReservationId> again = ledger.Reserve(7, 100, kT0, absl::Seconds(5));
  ASSERT_THAT(again, IsOk());
  ASSERT_THAT(ledger.Cancel(*again), IsOk());
  ASSERT_THAT(ledger.Reserve(7, 100, kT0, absl::Seconds(5)), IsOk());
  EXPECT_EQ(ledger.Expire(kT0 + absl::Seconds(5)).size(), 1u);
  EXPECT_EQ(ledger.owner_arenas(7), 2u);
  ledger.ReleaseOwner(7);
  EXPECT_EQ(ledger.owner_arenas(7), 0u);
  EXPECT_EQ(ledger.owner_arenas(8), 1u);
}

TEST(AdmissionLedgerTest, ArenaLimitCountsReservationsAndAllocations) {
  AdmissionLedger ledger(10'000, AdmissionLimits{.max_arenas = 2});
  ASSERT_THAT(ledger.Reserve(1, 100, kT0, absl::Seconds(5)), IsOk());
  absl::StatusOr<AllocationId> second = ledger.Allocate(2, 100);
  ASSERT_THAT(second, IsOk());
  EXPECT_EQ(ledger.arenas_left(), 0u);
  const absl::Status refused = ledger.Allocate(3, 100).status();
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kResourceExhausted,
                                HasSubstrs("allocation refused", "holds 2 arenas",
                                           "limit is 2", "max_arenas")));
  EXPECT_EQ(GetAdmissionRefusal(refused), std::nullopt);  // not a matter of bytes
  EXPECT_TRUE(IsArenaRefusal(refused));
  EXPECT_FALSE(IsOwnerShareRefusal(refused));
  EXPECT_THAT(ledger.Reserve(3, 100, kT0, absl::Seconds(5)).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstrs("reservation refused")));
  EXPECT_EQ(ledger.used(), 200u);  // the refusals changed nothing
  ASSERT_THAT(ledger.Release(*second), IsOk());
  EXPECT_THAT(ledger.Allocate(3, 100), IsOk());

  // Fit follows the arenas as well as the bytes.
  ledger.SetLimits(AdmissionLimits{.max_arenas = 5});
  absl::StatusOr<SessionFit> fit = FitSessions(ledger, 10);
  ASSERT_THAT(fit, IsOk());
  EXPECT_EQ(fit->now, 3u);
  EXPECT_EQ(fit->after_eviction, 3u);
  EXPECT_EQ(fit->when_empty, 5u);
}

TEST(AdmissionLedgerTest, OwnerShareCapsReservationsAllocationsAndGrowth) {
  AdmissionLedger ledger(1'000, AdmissionLimits{.owner_share_percent = 40});
  ASSERT_THAT(ledger.Reserve(1, 300, kT0, absl::Seconds(5)), IsOk());
  EXPECT_THAT(ledger.Reserve(1, 101, kT0, absl::Seconds(5)).status(),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstrs("reservation of 101 bytes refused", "engine 1 holds 300",
                                  "at most 400", "40% of the 1000 byte budget",
                                  "max_engine_budget_share")));
  absl::StatusOr<AllocationId> allocation = ledger.Allocate(1, 100);
  ASSERT_THAT(allocation, IsOk());
  EXPECT_EQ(ledger.owner_bytes(1), 400u);
  EXPECT_FALSE(IsArenaRefusal(ledger.Reserve(1, 101, kT0, absl::Seconds(5)).status()));
  EXPECT_TRUE(IsOwnerShareRefusal(ledger.Reserve(1, 101, kT0, absl::Seconds(5)).status()));
  EXPECT_THAT(ledger.Grow(*allocation, 101),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstrs("grow of 1 bytes refused", "engine 1 holds 400")));
  // Other engines and the daemon's own storage are not held back by engine 1's share.
  EXPECT_THAT(ledger.Allocate(2, 400), IsOk());
  EXPECT_THAT(ledger.Allocate(kUncappedOwner, 200), IsOk());
  EXPECT_EQ(ledger.owner_bytes(1), 400u);
  ledger.ReleaseOwner(1);
  EXPECT_EQ(ledger.owner_bytes(1), 0u);
}

// --- Cost queries ----------------------------------------------------------------------------

std::vector<ModelPlan> AllTestPlans() {
  return {test_plans::Llama3_8B(),
          test_plans::Llama3_70B(),
          test_plans::GemmaStyle(false),
          test_plans::GemmaStyle(true),
          test_plans::DeepSeekV3Style(),
          test_plans::GlmStyleWithIndexer(),
          test_plans::GlmStyleWithIndexer(0),
          test_plans::GlmStyleWithIndexer(64),
          test_plans::Qwen3NextStyle(),
          // The element formats on every plane kind that takes one: flat K/V, the SWA ring,
          // latent rows beside an f32 indexer, and K/V beside recurrent state.
          test_plans::InElementFormat(test_plans::Llama3_8B(), ElementFormat::kBf16),
          test_plans::InElementFormat(test_plans::GemmaStyle(true), ElementFormat::kF16),
          test_plans::InElementFormat(test_plans::GemmaStyle(false), ElementFormat::kF32),
          test_plans::InElementFormat(test_plans::DeepSeekV3Style(), ElementFormat::kBf16),
          test_plans::InElementFormat(test_plans::GlmStyleWithIndexer(), ElementFormat::kFp8E4m3),
          test_plans::InElementFormat(test_plans::Qwen3NextStyle(), ElementFormat::kFp8E5m2)};
}

SessionShape AtCapacity(uint64_t capacity) {
  SessionShape request;
  request.capacity = capacity;
  return request;
}

// LAW: the bytes admission charges are the bytes the allocation takes. The daemon allocates
// exactly LayoutArena(PlanSession(...).planes, alignment, granularity).bytes per session.
TEST(SessionCostTest, LawAdmittedCostIsTheArenaTheSessionAllocates) {
  const FormatDefaults defaults;
  const std::vector<ModelPlan> plans = AllTestPlans();
  std::mt19937_64 rng(20261130);
  for (int trial = 0; trial < 200; ++trial) {
    const ModelPlan& plan = plans[rng() % plans.size()];
    SessionShape request = AtCapacity(1 + rng() % (uint64_t{1} << 20));
    request.spec_snapshot = rng() % 2 == 0;
    const ArenaRounding rounding = rng() % 2 == 0 ? kPages : kCudaGranules;
    SCOPED_TRACE(plan.name + " capacity " + std::to_string(request.capacity));

    absl::StatusOr<CostReport> cost = SessionCost(plan, defaults, request, rounding);
    ASSERT_THAT(cost, IsOk());
    absl::StatusOr<SessionPlan> session = PlanSession(plan, defaults, request);
    ASSERT_THAT(session, IsOk());
    absl::StatusOr<ArenaLayout> layout =
        LayoutArena(session->planes, rounding.alignment, rounding.granularity);
    ASSERT_THAT(layout, IsOk());
    EXPECT_EQ(cost->arena_bytes, layout->bytes);
    EXPECT_EQ(*SessionArenaBytes(plan, defaults, request, rounding), layout->bytes);
    EXPECT_EQ(cost->breakdown.total_bytes, session->total_bytes);
    EXPECT_EQ(cost->capacity, request.capacity);
    EXPECT_EQ(cost->arena_bytes % rounding.granularity, 0u);
    EXPECT_GE(cost->arena_bytes, session->total_bytes);

    // Admitted through the ledger at that cost, the session is created from the reservation
    // with exactly those bytes and the ledger charges exactly them.
    AdmissionLedger ledger(cost->arena_bytes);
    absl::StatusOr<ReservationId> r = ledger.Reserve(1, cost->arena_bytes, kT0, absl::Seconds(1));
    ASSERT_THAT(r, IsOk());
    ASSERT_THAT(ledger.Commit(*r, layout->bytes), IsOk());
    EXPECT_EQ(ledger.allocated(), layout->bytes);
    EXPECT_EQ(ledger.free(), 0u);
  }
}

TEST(SessionCostTest, InvalidRequestsAreInvalidArgument) {
  const FormatDefaults defaults;
  EXPECT_THAT(SessionCost(test_plans::Llama3_8B(), defaults, AtCapacity(0), kPages),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("capacity 0")));
  EXPECT_THAT(SessionCost(test_plans::Llama3_8B(), defaults, AtCapacity(16), {256, 3000}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("granularity 3000")));
  EXPECT_THAT(SessionCost(test_plans::Llama3_8B(), defaults, AtCapacity(16), ArenaRounding{}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("granularity 0")));
  EXPECT_THAT(SessionsThatFit(0, 100),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("session cost of 0 bytes")));
}

// Max-context's binary search relies on this.
TEST(SessionCostTest, CostIsMonotonicInCapacity) {
  const FormatDefaults defaults;
  for (const ModelPlan& plan : AllTestPlans()) {
    SCOPED_TRACE(plan.name);
    uint64_t previous = 0;
    for (uint64_t capacity = 1; capacity <= 2200; ++capacity) {
      const uint64_t bytes = *SessionArenaBytes(plan, defaults, AtCapacity(capacity), kPages);
      ASSERT_GE(bytes, previous) << "capacity " << capacity;
      previous = bytes;
    }
    std::mt19937_64 rng(7);
    for (int i = 0; i < 50; ++i) {
      uint64_t a = 1 + rng() % kMaxCapacity;
      uint64_t b = 1 + rng() % kMaxCapacity;
      if (a > b) std::swap(a, b);
      ASSERT_LE(*SessionArenaBytes(plan, defaults, AtCapacity(a), kPages),
                *SessionArenaBytes(plan, defaults, AtCapacity(b), kPages))
          << a << " vs " << b;
    }
  }
}

TEST(MaxContextTest, IsExact) {
  const FormatDefaults defaults;
  std::mt19937_64 rng(99);
  for (const ModelPlan& plan : AllTestPlans()) {
    for (int i = 0; i < 6; ++i) {
      const uint64_t free_bytes = (uint64_t{1} << 24) + rng() % (64 * kGiB);
      SCOPED_TRACE(plan.name + " free " + std::to_string(free_bytes));
      absl::StatusOr<uint64_t> max =
          MaxContextThatFits(plan, defaults, AtCapacity(1), free_bytes, kCudaGranules);
      ASSERT_THAT(max, IsOk());
      if (*max == 0) {
        EXPECT_GT(*SessionArenaBytes(plan, defaults, AtCapacity(1), kCudaGranules), free_bytes);
        continue;
      }
      EXPECT_LE(*SessionArenaBytes(plan, defaults, AtCapacity(*max), kCudaGranules), free_bytes);
      if (*max < kMaxCapacity) {
        EXPECT_GT(*SessionArenaBytes(plan, defaults, AtCapacity(*max + 1), kCudaGranules),
                  free_bytes);
      }
    }
  }
}

TEST(MaxContextTest, EdgeCases) {
  const FormatDefaults defaults;
  const ModelPlan llama = test_plans::Llama3_8B();
  const uint64_t one = *SessionArenaBytes(llama, defaults, AtCapacity(1), kPages);
  EXPECT_THAT(MaxContextThatFits(llama, defaults, AtCapacity(1), one - 1, kPages),
              IsOkAndHolds(0u));
  EXPECT_THAT(MaxContextThatFits(llama, defaults, AtCapacity(1), one, kPages),
              IsOkAndHolds(::testing::Ge(1u)));
  EXPECT_THAT(MaxContextThatFits(llama, defaults, AtCapacity(1),
                                 std::numeric_limits<uint64_t>::max(), kPages),
              IsOkAndHolds(kMaxCapacity));
  // Llama-3-8B: 32 layers x (1024/32 x 34 + 1024/32 x 24) = 59392 bytes per token, plus pads
  // and mirrors: 8 GiB holds a little under 144631 tokens (8 GiB / 59392 = 144631.2).
  absl::StatusOr<uint64_t> max =
      MaxContextThatFits(llama, defaults, AtCapacity(1), 8 * kGiB, kPages);
  ASSERT_THAT(max, IsOk());
  EXPECT_LE(*max, 144631u);
  EXPECT_GE(*max, 144500u);
  // A plan whose request is invalid at capacity 1 is refused, not answered with 0.
  SessionShape bad_range = AtCapacity(1);
  bad_range.layer_lo = 40;
  EXPECT_THAT(MaxContextThatFits(llama, defaults, bad_range, kGiB, kPages),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("out of bounds")));
}

TEST(FitTest, SessionsThatFitNowAfterEvictionAndWhenEmpty) {
  AdmissionLedger ledger(10'000);
  ASSERT_THAT(ledger.Allocate(0, 4'000), IsOk());
  ledger.SetEvictable(2'500);
  absl::StatusOr<SessionFit> fit = FitSessions(ledger, 1'000);
  ASSERT_THAT(fit, IsOk());
  EXPECT_EQ(fit->now, 6u);
  EXPECT_EQ(fit->after_eviction, 8u);
  EXPECT_EQ(fit->when_empty, 10u);
  EXPECT_THAT(SessionsThatFit(3, 10), IsOkAndHolds(3u));
}

TEST(FitTest, TotalTokensPacksFullSessionsPlusTheRemainder) {
  const FormatDefaults defaults;
  for (const ModelPlan& plan : AllTestPlans()) {
    for (uint64_t capacity : {uint64_t{4096}, uint64_t{131072}}) {
      const uint64_t free_bytes = 40 * kGiB + 12345;
      SCOPED_TRACE(plan.name + " capacity " + std::to_string(capacity));
      absl::StatusOr<TokenFit> fit =
          TotalTokensThatFit(plan, defaults, AtCapacity(capacity), free_bytes, kCudaGranules);
      ASSERT_THAT(fit, IsOk());
      const uint64_t cost = *SessionArenaBytes(plan, defaults, AtCapacity(capacity), kCudaGranules);
      EXPECT_EQ(fit->session_bytes, cost);
      EXPECT_EQ(fit->full_sessions, free_bytes / cost);
      const uint64_t leftover = free_bytes - fit->full_sessions * cost;
      EXPECT_EQ(fit->remainder_tokens,
                *MaxContextThatFits(plan, defaults, AtCapacity(1), leftover, kCudaGranules));
      EXPECT_LT(fit->remainder_tokens, capacity);
      EXPECT_EQ(fit->total_tokens, fit->full_sessions * capacity + fit->remainder_tokens);
    }
  }
  // A capacity beyond what fits: the answer is the max context.
  const ModelPlan llama = test_plans::Llama3_8B();
  absl::StatusOr<TokenFit> big =
      TotalTokensThatFit(llama, defaults, AtCapacity(kMaxCapacity), kGiB, kPages);
  ASSERT_THAT(big, IsOk());
  EXPECT_EQ(big->full_sessions, 0u);
  EXPECT_EQ(big->total_tokens, *MaxContextThatFits(llama, defaults, AtCapacity(1), kGiB, kPages));
}

}  // namespace
}  // namespace memra
