#include "server/store/slab_allocator.h"

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/device/device_budget.h"
#include "server/testing/test_host_backend.h"
#include "tests/seeded_random.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;

constexpr uint64_t kSlab = uint64_t{64} << 10;

class SlabAllocatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = testing::NewTestHostBackend(testing::TestHostBackendOptions(uint64_t{64} << 20));
    ASSERT_NE(backend_, nullptr);
  }

  std::unique_ptr<SlabAllocator> Make(uint64_t keep_empty_bytes, DeviceBudget* budget = nullptr,
                                      uint64_t slab_bytes = kSlab) {
    SlabAllocatorOptions options;
    options.slab_bytes = slab_bytes;
    options.keep_empty_bytes = keep_empty_bytes;
    absl::StatusOr<std::unique_ptr<SlabAllocator>> slabs =
        SlabAllocator::Create(options, backend_.get(), budget);
    EXPECT_THAT(slabs.status(), IsOk());
    return slabs.ok() ? *std::move(slabs) : nullptr;
  }

  // Allocates and drops the capture's hold, as an adopted piece.
  SlabSpan Adopted(SlabAllocator& slabs, uint64_t bytes) {
    absl::StatusOr<SlabSpan> span = slabs.Allocate(bytes);
    EXPECT_THAT(span.status(), IsOk());
    if (!span.ok()) return {};
    EXPECT_THAT(slabs.Release(span->slab), IsOk());
    return *span;
  }

  std::unique_ptr<HostBackend> backend_;
};

TEST_F(SlabAllocatorTest, SpansShareOneSlabAndFreedHolesAreReusedFirst) {
  auto slabs = Make(/*keep_empty_bytes=*/0);
  std::vector<SlabSpan> spans;
  for (int i = 0; i < 8; ++i) spans.push_back(Adopted(*slabs, 1000));  // 1024 each
  EXPECT_EQ(backend_->ArenaCount(), 1u);
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(spans[i].slab, spans[0].slab);
    EXPECT_EQ(spans[i].offset, 1024u * i);
    EXPECT_EQ(spans[i].bytes, 1024u);
  }
  // Two neighbouring holes coalesce; the best fit for 2 KiB is that hole, not the slab's tail.
  ASSERT_THAT(slabs->Free(spans[2]), IsOk());
  ASSERT_THAT(slabs->Free(spans[3]), IsOk());
  ASSERT_THAT(slabs->Free(spans[6]), IsOk());
  SlabStats stats = slabs->Stats();
  EXPECT_EQ(stats.used_bytes, 5u * 1024);
  EXPECT_EQ(stats.free_bytes, kSlab - 5u * 1024);
  EXPECT_EQ(stats.largest_free_bytes, kSlab - 8u * 1024);  // the tail after span 7
  EXPECT_EQ(stats.fragmentation_ppm, (kSlab - 5u * 1024) * 1000000 / kSlab);
  SlabSpan two = Adopted(*slabs, 2048);
  EXPECT_EQ(two.offset, 2u * 1024);
  SlabSpan one = Adopted(*slabs, 1);
  EXPECT_EQ(one.offset, 6u * 1024);  // the smallest free range that fits: the 1 KiB hole
  EXPECT_EQ(one.bytes, 256u);        // rounded to the alignment
  EXPECT_EQ(backend_->ArenaCount(), 1u);
  EXPECT_THAT(slabs->CheckInvariants(), IsOk());
}

TEST_F(SlabAllocatorTest, EmptySlabsAreKeptWithinTheLimitAndReturnedBeyondIt) {
  // Keeps one slab's worth: the first emptied slab stays, a second goes back at once.
  auto slabs = Make(/*keep_empty_bytes=*/kSlab);
  SlabSpan a = Adopted(*slabs, kSlab);
  SlabSpan b = Adopted(*slabs, kSlab);
  EXPECT_NE(a.slab, b.slab);
  EXPECT_EQ(backend_->ArenaCount(), 2u);
  ASSERT_THAT(slabs->Free(a), IsOk());  // 2 slabs > the limit: returned
  EXPECT_EQ(backend_->ArenaCount(), 1u);
  ASSERT_THAT(slabs->Free(b), IsOk());  // 1 slab: kept, warm
  EXPECT_EQ(backend_->ArenaCount(), 1u);
  SlabStats stats = slabs->Stats();
  EXPECT_EQ(stats.empty_slabs, 1u);
  EXPECT_EQ(stats.empty_bytes, kSlab);
  EXPECT_EQ(stats.fragmentation_ppm, 0u);
  // The next span reuses the kept slab instead of mapping a new one.
  SlabSpan c = Adopted(*slabs, 100);
  EXPECT_EQ(c.slab, b.slab);
  EXPECT_EQ(slabs->Stats().slabs_created, 2u);
  ASSERT_THAT(slabs->Free(c), IsOk());
  EXPECT_EQ(slabs->ReleaseEmptySlabs(), kSlab);
  EXPECT_EQ(backend_->ArenaCount(), 0u);
  EXPECT_EQ(slabs->returned_bytes(), 2 * kSlab);
  EXPECT_THAT(slabs->CheckInvariants(), IsOk());
}

TEST_F(SlabAllocatorTest, ASpanLargerThanASlabGetsASlabOfItsOwn) {
  auto slabs = Make(/*keep_empty_bytes=*/0);
  SlabSpan small = Adopted(*slabs, 100);
  SlabSpan large = Adopted(*slabs, 3 * kSlab + 1);
  EXPECT_NE(large.slab, small.slab);
  EXPECT_EQ(large.offset, 0u);
  EXPECT_EQ(large.bytes, 3 * kSlab + 256);
  const uint64_t page = static_cast<uint64_t>(getpagesize());
  EXPECT_EQ(slabs->Stats().slab_bytes, kSlab + (3 * kSlab + 256 + page - 1) / page * page);
  ASSERT_THAT(slabs->Free(large), IsOk());
  ASSERT_THAT(slabs->Free(small), IsOk());
  EXPECT_EQ(backend_->ArenaCount(), 0u);
}

TEST_F(SlabAllocatorTest, TheBudgetIsChargedPerSlabAndHoldsDecideWhatIsEvictable) {
  DeviceBudget budget(4 * kSlab, "test", AdmissionLimits{.max_arenas = 2});
  auto slabs = Make(/*keep_empty_bytes=*/4 * kSlab, &budget);
  absl::StatusOr<SlabSpan> in_flight = slabs->Allocate(100);
  ASSERT_THAT(in_flight.status(), IsOk());
  EXPECT_EQ(budget.Snapshot().allocated(), kSlab);
  EXPECT_EQ(budget.Snapshot().evictable(), 0u);  // a capture in flight holds it
  ASSERT_THAT(slabs->Release(in_flight->slab), IsOk());
  EXPECT_EQ(budget.Snapshot().evictable(), kSlab);
  ASSERT_THAT(slabs->Hold(in_flight->slab), IsOk());  // a restore pins it
  EXPECT_EQ(budget.Snapshot().evictable(), 0u);
  SlabSpan other = Adopted(*slabs, kSlab);  // a second slab, unheld
  EXPECT_EQ(budget.Snapshot().allocated(), 2 * kSlab);
  EXPECT_EQ(budget.Snapshot().evictable(), kSlab);
  EXPECT_EQ(slabs->Stats().evictable_bytes, kSlab);
  // max_arenas = 2: a third slab is refused by the ledger and nothing changes.
  EXPECT_THAT(slabs->Allocate(kSlab).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstrs("2")));
  EXPECT_EQ(backend_->ArenaCount(), 2u);
  EXPECT_EQ(budget.Snapshot().allocated(), 2 * kSlab);
  ASSERT_THAT(slabs->Release(in_flight->slab), IsOk());
  ASSERT_THAT(slabs->Free(*in_flight), IsOk());
  ASSERT_THAT(slabs->Free(other), IsOk());
  EXPECT_EQ(budget.Snapshot().evictable(), 2 * kSlab);  // empty, kept, evictable
  slabs.reset();
  EXPECT_EQ(budget.Snapshot().allocated(), 0u);
  EXPECT_EQ(budget.Snapshot().evictable(), 0u);
  EXPECT_EQ(backend_->ArenaCount(), 0u);
}

TEST_F(SlabAllocatorTest, RefusalsChangeNothing) {
  SlabAllocatorOptions bad;
  bad.alignment = 96;
  EXPECT_THAT(SlabAllocator::Create(bad, backend_.get(), nullptr).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("alignment 96", "not a power of two")));
  bad.alignment = 256;
  bad.slab_bytes = 0;
  EXPECT_THAT(SlabAllocator::Create(bad, backend_.get(), nullptr).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("slab size is 0")));
  auto slabs = Make(/*keep_empty_bytes=*/0);
  EXPECT_THAT(slabs->Allocate(0).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("0 bytes")));
  EXPECT_THAT(slabs->Allocate(UINT64_MAX - 3).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("slab span")));
  SlabSpan span = Adopted(*slabs, 512);
  SlabSpan wrong = span;
  wrong.bytes = 256;
  EXPECT_THAT(slabs->Free(wrong),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("no live slab span of 256 bytes at offset 0 of slab ")));
  EXPECT_THAT(slabs->Release(span.slab),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstrs("has no hold")));
  EXPECT_THAT(slabs->Hold(ArenaId{999}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs("no slab 999")));
  EXPECT_EQ(slabs->Stats().used_bytes, 512u);
  ASSERT_THAT(slabs->Free(span), IsOk());
  EXPECT_THAT(slabs->Free(span), StatusIs(absl::StatusCode::kInvalidArgument,
                                          HasSubstrs("no live slab span of 512 bytes")));
  EXPECT_THAT(slabs->CheckInvariants(), IsOk());
}

// Random allocate/free churn keeps the tiling exact and returns everything at the end.
TEST_F(SlabAllocatorTest, ChurnKeepsTheTilingExact) {
  auto slabs = Make(/*keep_empty_bytes=*/2 * kSlab);
  std::vector<SlabSpan> live;
  testing::SeededRandom random(12345);
  for (int i = 0; i < 4000; ++i) {
    if (live.empty() || random.Below(3) != 0) {
      live.push_back(Adopted(*slabs, 1 + random.Below(6000)));
    } else {
      const size_t victim = random.Below(live.size());
      ASSERT_THAT(slabs->Free(live[victim]), IsOk());
      live[victim] = live.back();
      live.pop_back();
    }
    if (i % 500 == 0) {
      ASSERT_THAT(slabs->CheckInvariants(), IsOk());
    }
  }
  EXPECT_EQ(static_cast<uint64_t>(backend_->ArenaCount()), slabs->Stats().slabs);
  for (const SlabSpan& span : live) ASSERT_THAT(slabs->Free(span), IsOk());
  slabs->ReleaseEmptySlabs();
  EXPECT_EQ(backend_->ArenaCount(), 0u);
  EXPECT_THAT(slabs->CheckInvariants(), IsOk());
}

}  // namespace
}  // namespace memra
