#include "server/device/device_budget.h"

#include <cstdint>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;

constexpr uint64_t kEngine = 7;
constexpr uint64_t kOtherEngine = 8;
const absl::Time kNow = absl::FromUnixSeconds(1000);

TEST(DeviceBudgetTest, ReservationsBelongToTheirEngine) {
  DeviceBudget budget(1000, "host: budget_bytes");
  absl::StatusOr<ReservationId> reservation = budget.Reserve(kEngine, 400, kNow, absl::Seconds(5));
  ASSERT_THAT(reservation.status(), IsOk());
  EXPECT_THAT(budget.ReservedBytes(*reservation, kEngine), IsOk());
  EXPECT_THAT(budget.Commit(*reservation, kOtherEngine, 400).status(),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstrs("reservation", "not held by engine 8")));
  EXPECT_THAT(budget.Cancel(*reservation, kOtherEngine).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs("engine 8")));
  // The refused calls changed nothing: the owner can still use it.
  absl::StatusOr<AllocationId> allocation = budget.Commit(*reservation, kEngine, 400);
  ASSERT_THAT(allocation.status(), IsOk());
  EXPECT_EQ(budget.Snapshot().allocated(), 400u);
  EXPECT_EQ(budget.Snapshot().reserved(), 0u);
  EXPECT_THAT(budget.Commit(*reservation, kEngine, 400).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs("reservation", "engine 7")));
}

TEST(DeviceBudgetTest, CancelReturnsTheReservedBytes) {
  DeviceBudget budget(1000, "host: budget_bytes");
  absl::StatusOr<ReservationId> reservation = budget.Reserve(kEngine, 300, kNow, absl::Seconds(5));
  ASSERT_THAT(reservation.status(), IsOk());
  absl::StatusOr<uint64_t> cancelled = budget.Cancel(*reservation, kEngine);
  ASSERT_THAT(cancelled.status(), IsOk());
  EXPECT_EQ(*cancelled, 300u);
  EXPECT_EQ(budget.Snapshot().free(), 1000u);
}

// Prefix storage of 600 bytes, 500 of them evictable: an allocation of 700 is 300 short and
// eviction can make room, so the evictor runs (unlocked: it releases through the budget) and the
// retry succeeds.
TEST(DeviceBudgetTest, AdmissionEvictsPrefixStorageWhenThatMakesRoom) {
  DeviceBudget budget(1000, "host: budget_bytes");
  std::vector<AllocationId> prefix_blocks;
  for (int i = 0; i < 6; ++i) {
    absl::StatusOr<AllocationId> block = budget.AllocateWithoutEviction(kPrefixCacheOwner, 100);
    ASSERT_THAT(block.status(), IsOk());
    prefix_blocks.push_back(*block);
  }
  budget.SetEvictable(EvictableSource::kPrefixCache, 500);
  uint64_t asked = 0;
  budget.SetEvictor(EvictableSource::kPrefixCache, [&](uint64_t bytes) {
    asked = bytes;
    uint64_t freed = 0;
    while (freed < bytes && prefix_blocks.size() > 1) {
      EXPECT_THAT(budget.Release(prefix_blocks.back()), IsOk());
      prefix_blocks.pop_back();
      freed += 100;
    }
    budget.SetEvictable(EvictableSource::kPrefixCache, 500 - freed);
    return freed;
  });
  absl::StatusOr<AllocationId> session = budget.Allocate(kEngine, 700);
  ASSERT_THAT(session.status(), IsOk());
  EXPECT_EQ(asked, 300u);
  EXPECT_EQ(prefix_blocks.size(), 3u);
  EXPECT_EQ(budget.Snapshot().allocated(), 1000u);
}

TEST(DeviceBudgetTest, OutOfArenasEvictsAPrefixEntryToFreeOne) {
  DeviceBudget budget(1000, "host: budget_bytes", AdmissionLimits{.max_arenas = 3});
  std::vector<AllocationId> prefix_blocks;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<AllocationId> block = budget.AllocateWithoutEviction(kPrefixCacheOwner, 10);
    ASSERT_THAT(block.status(), IsOk());
    prefix_blocks.push_back(*block);
  }
  EXPECT_THAT(budget.Allocate(kEngine, 100).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstrs("limit is 3")))
      << "nothing evictable: refused";
  EXPECT_EQ(budget.refusals(), 1u);
  budget.SetEvictable(EvictableSource::kPrefixCache, 30);
  uint64_t asked = 0;
  budget.SetEvictor(EvictableSource::kPrefixCache, [&](uint64_t bytes) {
    asked = bytes;
    EXPECT_THAT(budget.Release(prefix_blocks.back()), IsOk());
    prefix_blocks.pop_back();
    budget.SetEvictable(EvictableSource::kPrefixCache, 20);
    return uint64_t{10};
  });
  EXPECT_THAT(budget.Allocate(kEngine, 100).status(), IsOk());
  EXPECT_EQ(asked, 1u);
  EXPECT_EQ(prefix_blocks.size(), 2u);
  EXPECT_EQ(budget.Snapshot().allocation_count(), 3u);
}

TEST(DeviceBudgetTest, NoEvictionWhenEvenEvictingEverythingCannotMakeRoom) {
  DeviceBudget budget(1000, "host: budget_bytes");
  ASSERT_THAT(budget.AllocateWithoutEviction(kPrefixCacheOwner, 600).status(), IsOk());
  budget.SetEvictable(EvictableSource::kPrefixCache, 100);
  bool called = false;
  budget.SetEvictor(EvictableSource::kPrefixCache, [&](uint64_t) {
    called = true;
    return uint64_t{0};
  });
  absl::StatusOr<AllocationId> session = budget.Allocate(kEngine, 700);
  EXPECT_THAT(session.status(),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstrs("needs 700 bytes", "400 free", "(100 evictable)", "1000")));
  EXPECT_FALSE(called);
  std::optional<AdmissionRefusal> refusal = GetAdmissionRefusal(session.status());
  ASSERT_TRUE(refusal.has_value());
  EXPECT_EQ(refusal->bytes_to_evict, 0u);
}

TEST(DeviceBudgetTest, PrefixStorageNeverEvictsForItself) {
  DeviceBudget budget(1000, "host: budget_bytes");
  ASSERT_THAT(budget.AllocateWithoutEviction(kPrefixCacheOwner, 900).status(), IsOk());
  budget.SetEvictable(EvictableSource::kPrefixCache, 900);
  bool called = false;
  budget.SetEvictor(EvictableSource::kPrefixCache, [&](uint64_t) {
    called = true;
    return uint64_t{0};
  });
  EXPECT_THAT(budget.AllocateWithoutEviction(kPrefixCacheOwner, 200).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstrs("needs 200 bytes")));
  EXPECT_FALSE(called);
}

TEST(DeviceBudgetTest, ConcurrentAdmissionsNeverExceedTheBudget) {
  DeviceBudget budget(64 * 1000, "host: budget_bytes");
  std::vector<std::thread> threads;
  for (uint64_t engine = 1; engine <= 8; ++engine) {
    threads.emplace_back([&budget, engine] {
      for (int i = 0; i < 200; ++i) {
        absl::StatusOr<AllocationId> allocation = budget.Allocate(engine, 1000);
        if (allocation.ok() && i % 3 == 0) {
          EXPECT_THAT(budget.Release(*allocation), IsOk());
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  const AdmissionLedger ledger = budget.Snapshot();
  EXPECT_LE(ledger.used(), ledger.budget());
  uint64_t released = 0;
  for (uint64_t engine = 1; engine <= 8; ++engine) released += budget.ReleaseOwner(engine);
  EXPECT_EQ(released, ledger.allocated());
  EXPECT_EQ(budget.Snapshot().used(), 0u);
}

}  // namespace
}  // namespace memra
