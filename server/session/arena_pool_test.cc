#include "server/session/arena_pool.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/device/device_budget.h"
#include "server/device/host_backend.h"
#include "server/testing/test_host_backend.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;

constexpr uint64_t kPage = 4096;
constexpr uint64_t kEngineA = 1;
constexpr uint64_t kEngineB = 2;

class ArenaPoolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = memra::testing::NewTestHostBackend(memra::testing::TestHostBackendOptions());
    ASSERT_NE(backend_, nullptr);
  }

  // A new exported arena of `bytes`, charged to `engine` in `budget` (the fixture's by
  // default), as a released session leaves it.
  PooledArena NewArena(uint64_t engine, uint64_t bytes, DeviceBudget* budget = nullptr) {
    absl::StatusOr<AllocationId> charge =
        (budget == nullptr ? budget_ : *budget).Allocate(engine, bytes);
    EXPECT_THAT(charge, IsOk());
    absl::StatusOr<ArenaId> arena = backend_->CreateArena(bytes, ArenaVisibility::kExported);
    EXPECT_THAT(arena, IsOk());
    absl::StatusOr<ArenaExport> exported = backend_->Export(*arena);
    EXPECT_THAT(exported, IsOk());
    return PooledArena{*arena, *exported, *charge};
  }

  std::unique_ptr<HostBackend> backend_;
  DeviceBudget budget_{uint64_t{64} << 20, "test"};
};

TEST_F(ArenaPoolTest, AnEnginesArenaServesOnlyThatEngineAndOnlyItsExactSize) {
  ArenaPool pool(backend_.get(), &budget_, 16 * kPage);
  pool.InstallEvictor(budget_);
  const PooledArena arena = NewArena(kEngineA, 2 * kPage);
  ASSERT_TRUE(pool.Put(kEngineA, arena));
  EXPECT_EQ(pool.pooled_bytes(), 2 * kPage);
  EXPECT_EQ(budget_.Snapshot().evictable(), 2 * kPage);
  EXPECT_EQ(budget_.Snapshot().allocated(), 2 * kPage) << "a pooled arena keeps its charge";

  EXPECT_EQ(pool.Take(kEngineB, 2 * kPage), std::nullopt) << "never another engine's";
  EXPECT_EQ(pool.Take(kEngineA, 3 * kPage), std::nullopt) << "never another size";
  std::optional<PooledArena> taken = pool.Take(kEngineA, 2 * kPage);
  ASSERT_TRUE(taken.has_value());
  EXPECT_EQ(taken->arena, arena.arena);
  EXPECT_EQ(taken->exported.handle, arena.exported.handle) << "the engine's mapping still fits";
  EXPECT_EQ(pool.pooled_bytes(), 0u);
  EXPECT_EQ(budget_.Snapshot().evictable(), 0u);
  EXPECT_EQ(pool.Stats()[kEngineA].hits, 1u);
  pool.Return(kEngineA, *taken);
  EXPECT_EQ(pool.DrainAll(), 2 * kPage);
  EXPECT_EQ(backend_->ArenaCount(), 0u);
  EXPECT_EQ(budget_.Snapshot().allocated(), 0u);
}

TEST_F(ArenaPoolTest, AnEnginesPoolStaysWithinItsBound) {
  ArenaPool pool(backend_.get(), &budget_, 3 * kPage);
  ASSERT_TRUE(pool.Put(kEngineA, NewArena(kEngineA, 2 * kPage)));
  PooledArena over = NewArena(kEngineA, 2 * kPage);
  EXPECT_FALSE(pool.Put(kEngineA, over)) << "4 pages would pass the 3-page bound";
  EXPECT_TRUE(pool.Put(kEngineB, NewArena(kEngineB, 2 * kPage))) << "the bound is per engine";
  pool.Return(kEngineA, over);  // refused again: freed
  EXPECT_EQ(backend_->ArenaCount(), 2u);
  EXPECT_EQ(budget_.Snapshot().allocated(), 4 * kPage);

  ArenaPool disabled(backend_.get(), &budget_, 0);
  PooledArena arena = NewArena(kEngineA, kPage);
  EXPECT_FALSE(disabled.Put(kEngineA, arena));
  disabled.Return(kEngineA, arena);
}

TEST_F(ArenaPoolTest, DrainingAnEngineFreesItsArenasAndNamesThemForUnmapping) {
  ArenaPool pool(backend_.get(), &budget_, 16 * kPage);
  const PooledArena a = NewArena(kEngineA, kPage);
  const PooledArena b = NewArena(kEngineB, kPage);
  ASSERT_TRUE(pool.Put(kEngineA, a));
  ASSERT_TRUE(pool.Put(kEngineB, b));
  EXPECT_EQ(pool.DrainEngine(kEngineA, /*forget=*/false), kPage);
  EXPECT_EQ(pool.TakeUnmapped(kEngineA), std::vector<std::string>{a.exported.handle});
  EXPECT_TRUE(pool.TakeUnmapped(kEngineA).empty()) << "told once";
  EXPECT_TRUE(pool.TakeUnmapped(kEngineB).empty());
  EXPECT_EQ(pool.pooled_bytes(kEngineB), kPage);
  EXPECT_EQ(backend_->ArenaCount(), 1u);
  EXPECT_EQ(pool.DrainEngine(kEngineB, /*forget=*/true), kPage);
  EXPECT_FALSE(pool.Stats().contains(kEngineB)) << "a forgotten engine leaves nothing";
  EXPECT_EQ(budget_.Snapshot().allocated(), 0u);
}

// Pooled bytes are evictable: an admission short of room frees the oldest pooled arenas (any
// engine's) first and then succeeds.
TEST_F(ArenaPoolTest, AdmissionEvictsTheOldestPooledArenasBeforeRefusing) {
  DeviceBudget budget(8 * kPage, "test");
  ArenaPool pool(backend_.get(), &budget, 16 * kPage);
  pool.InstallEvictor(budget);
  const PooledArena oldest = NewArena(kEngineA, 3 * kPage, &budget);
  const PooledArena middle = NewArena(kEngineB, 3 * kPage, &budget);
  const PooledArena newest = NewArena(kEngineA, 2 * kPage, &budget);
  ASSERT_TRUE(pool.Put(kEngineA, oldest));
  ASSERT_TRUE(pool.Put(kEngineB, middle));
  ASSERT_TRUE(pool.Put(kEngineA, newest));
  EXPECT_EQ(budget.Snapshot().free(), 0u);
  // 5 pages: the two oldest (6 pages) go, the newest stays.
  absl::StatusOr<AllocationId> admitted = budget.Allocate(kEngineB, 5 * kPage);
  ASSERT_THAT(admitted, IsOk());
  EXPECT_EQ(pool.pooled_bytes(), 2 * kPage);
  EXPECT_EQ(budget.Snapshot().evictable(), 2 * kPage);
  EXPECT_EQ(pool.TakeUnmapped(kEngineA), std::vector<std::string>{oldest.exported.handle});
  EXPECT_EQ(pool.TakeUnmapped(kEngineB), std::vector<std::string>{middle.exported.handle});
  ASSERT_THAT(budget.Release(*admitted), IsOk());
  pool.DrainAll();
  EXPECT_EQ(budget.Snapshot().allocated(), 0u);
  EXPECT_EQ(backend_->ArenaCount(), 0u);
}

// An engine's pooled arenas count toward its share of the arenas (they keep their charge), and
// a refusal for that share frees the engine's own pooled arenas and admits it: an engine is
// never refused because of its own idle pool. Another engine's pool is not touched for it, and
// an engine with no pool of its own is refused with its numbers.
TEST_F(ArenaPoolTest, AShareRefusalFreesTheEnginesOwnPoolFirst) {
  DeviceBudget budget(64 * kPage, "test", AdmissionLimits{.max_arenas = 6, .max_owner_arenas = 3});
  ArenaPool pool(backend_.get(), &budget, 16 * kPage);
  pool.InstallEvictor(budget);
  const PooledArena other = NewArena(kEngineB, kPage, &budget);
  ASSERT_TRUE(pool.Put(kEngineB, other));
  absl::StatusOr<AllocationId> live = budget.Allocate(kEngineA, kPage);
  ASSERT_THAT(live, IsOk());
  const PooledArena idle_small = NewArena(kEngineA, kPage, &budget);
  const PooledArena idle_large = NewArena(kEngineA, 2 * kPage, &budget);
  ASSERT_TRUE(pool.Put(kEngineA, idle_small));
  ASSERT_TRUE(pool.Put(kEngineA, idle_large));
  EXPECT_EQ(budget.Snapshot().owner_arenas(kEngineA), 3u) << "pooled arenas count";

  // A reservation and an allocation of other sizes: the engine's own pool makes the room.
  absl::StatusOr<ReservationId> reserved =
      budget.Reserve(kEngineA, 4 * kPage, absl::UnixEpoch(), absl::Seconds(5));
  ASSERT_THAT(reserved, IsOk());
  EXPECT_EQ(pool.pooled_bytes(kEngineA), 0u);
  EXPECT_EQ(pool.pooled_bytes(kEngineB), kPage) << "another engine's pool is not evicted for it";
  std::vector<std::string> unmapped = pool.TakeUnmapped(kEngineA);
  EXPECT_EQ(unmapped.size(), 2u);
  absl::StatusOr<AllocationId> second = budget.Allocate(kEngineA, 5 * kPage);
  ASSERT_THAT(second, IsOk());
  EXPECT_EQ(budget.Snapshot().owner_arenas(kEngineA), 3u);

  // At its share with nothing pooled: refused, naming the numbers; engine B is still served.
  EXPECT_THAT(budget.Allocate(kEngineA, kPage).status(),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstrs("engine 1 holds 3 arenas", "limit is 3 per engine")));
  EXPECT_EQ(pool.pooled_bytes(kEngineB), kPage);
  absl::StatusOr<AllocationId> served = budget.Allocate(kEngineB, kPage);
  ASSERT_THAT(served, IsOk());

  ASSERT_THAT(budget.Release(*live), IsOk());
  ASSERT_THAT(budget.Release(*second), IsOk());
  ASSERT_THAT(budget.Release(*served), IsOk());
  ASSERT_THAT(budget.Cancel(*reserved, kEngineA).status(), IsOk());
  pool.DrainAll();
  EXPECT_EQ(budget.Snapshot().used(), 0u);
  EXPECT_EQ(backend_->ArenaCount(), 0u);
}

}  // namespace
}  // namespace memra
