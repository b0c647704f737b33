#include "core/index_ring.h"

#include <cstdint>

#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::StatusIs;

// "Reference: <name>" marks a port of the reference's test of that name, with the same numbers
// (the reference: docs/rules.md#the-reference; the rules: docs/rules.md#dsa-indexer-tail-ring).

// glm5_next's declared k-pool width and packed indexer row (2 x 128 f32 = 1 KiB per token).
constexpr uint64_t kGlm5NextPool = 4;
constexpr uint64_t kGlm5NextStateRowBytes = 2 * 128 * 4;
constexpr uint64_t kRingBytesPerLayer = kIndexRingWorkingRows * kGlm5NextStateRowBytes;

// Reference: the_derived_ring_serves_a_monolithic_prime_of_the_whole_configured_context.
// Usable context must be at least configured context (the 4630-of-8192 regression), and the
// ring must stay a ring (a fix that grows it toward max_ctx silently reverts 11.94 GiB).
TEST(IndexRing, DerivedRingServesAMonolithicPrimeOfTheWholeConfiguredContext) {
  for (uint64_t max_ctx : {uint64_t{8192}, uint64_t{262'144}, uint64_t{1} << 20}) {
    std::optional<uint64_t> rows = IndexRingDefaultRows(max_ctx);
    ASSERT_TRUE(rows.has_value()) << "the ring must engage at max_ctx " << max_ctx;
    const uint64_t ring = *rows / kGlm5NextPool * kGlm5NextPool;
    uint64_t cur = 0, pools_ready = 0, steps = 0;
    while (cur < max_ctx) {
      std::optional<uint64_t> take =
          IndexRingTake(ring, kGlm5NextPool, pools_ready, cur, max_ctx - cur);
      ASSERT_TRUE(take.has_value())
          << "MEMRA_CTX=" << max_ctx << ": the " << ring << "-row ring refused after " << cur;
      ASSERT_GT(*take, 0u) << "a zero take is an infinite loop in the engine";
      cur += *take;
      pools_ready = cur / kGlm5NextPool;
      ++steps;
      ASSERT_LE(steps, max_ctx) << "the drain did not terminate";
    }
    EXPECT_EQ(cur, max_ctx);
    const uint64_t ring_bytes = *rows * kGlm5NextStateRowBytes;
    EXPECT_EQ(ring_bytes, kRingBytesPerLayer);
    EXPECT_LT(*rows, max_ctx);
    EXPECT_LE(ring_bytes, uint64_t{16} << 20);
  }
}

// Reference: index_ring_sizing_is_pure_and_carries_no_per_call_t.
TEST(IndexRing, SizingIsPureAndCarriesNoPerCallT) {
  const uint64_t rows = kIndexRingWorkingRows;
  EXPECT_EQ(IndexRingRowsFor(std::nullopt, 1 << 20), rows);
  EXPECT_EQ(IndexRingDefaultRows(1 << 20), rows);
  EXPECT_EQ(IndexRingRowsFor(std::nullopt, 4096), std::nullopt);
  EXPECT_EQ(IndexRingRowsFor(std::nullopt, rows), std::nullopt);
  EXPECT_EQ(IndexRingRowsFor(std::nullopt, rows + 1), rows);
  for (uint64_t max_ctx : {uint64_t{8192}, uint64_t{262'144}, uint64_t{1} << 20}) {
    EXPECT_EQ(IndexRingRowsFor(std::nullopt, max_ctx), kIndexRingWorkingRows);
  }
  EXPECT_EQ(IndexRingRowsFor(0, 1 << 20), std::nullopt);
  EXPECT_EQ(IndexRingRowsFor(16, 64), 16u);
  EXPECT_EQ(IndexRingRowsFor(64, 64), std::nullopt);
}

// Reference: index_ring_take_drains_instead_of_bounding_the_call.
TEST(IndexRing, TakeDrainsInsteadOfBoundingTheCall) {
  constexpr uint64_t kPool = kGlm5NextPool;
  EXPECT_EQ(IndexRingTake(0, kPool, 0, 0, 1 << 20), uint64_t{1} << 20);
  EXPECT_EQ(IndexRingTake(64, kPool, 0, 0, 1024), 64u);
  for (uint64_t cur = 0; cur < 64; ++cur) {
    std::optional<uint64_t> take = IndexRingTake(64, kPool, cur / kPool, cur, 1024);
    ASSERT_TRUE(take.has_value()) << cur;
    EXPECT_GE(*take, 64 - kPool + 1) << cur;
    EXPECT_LE(*take, 64u) << cur;
  }
  EXPECT_EQ(IndexRingTake(64, kPool, 4, 16, 1), 1u);
  EXPECT_EQ(IndexRingTake(16, kPool, 0, 64, 1), std::nullopt);
  EXPECT_EQ(IndexRingTake(16, kPool, 0, 16, 1), std::nullopt);
  EXPECT_EQ(IndexRingTake(16, kPool, 0, 15, 1), 1u);
}

TEST(IndexRing, UnaddressableGeometryIsRefusedNotACrash) {
  EXPECT_EQ(IndexRingTake(18, 4, 0, 0, 1), std::nullopt) << "ring not a whole number of pools";
  EXPECT_EQ(IndexRingTake(16, 0, 0, 0, 1), std::nullopt) << "unknown pool";
  EXPECT_EQ(IndexRingTake(16, 4, UINT64_MAX, 0, 1), std::nullopt) << "pools_ready overflow";
  EXPECT_THAT(EffectiveIndexRingRows(5120, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("5120 rows", "got 0")));
  EXPECT_THAT(EffectiveIndexRingRows(3, 4),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("3 rows", "pool of 4")));
  EXPECT_THAT(IndexPlanePhysicalRow(10, 0, 5), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("10 rows", "got 0")));
}

TEST(IndexRing, PhysicalRowRoundsTheRingDownToWholePools) {
  EXPECT_EQ(*IndexPlanePhysicalRow(0, 4, 123'456), 123'456u) << "flat plane: absolute rows";
  EXPECT_EQ(*EffectiveIndexRingRows(5122, 4), 5120u);
  EXPECT_EQ(*IndexPlanePhysicalRow(5122, 4, 5120), 0u);
  EXPECT_EQ(*IndexPlanePhysicalRow(5122, 4, 5121), 1u);
  EXPECT_EQ(*IndexPlanePhysicalRow(16, 4, 37), 5u);
}

}  // namespace
}  // namespace memra
