#include "core/arena_layout.h"

#include <cstdint>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "core/test_model_plans.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;

constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
constexpr uint64_t kTwoMiB = 2 << 20;

std::vector<PlaneSpec> PlanesOfBytes(const std::vector<uint64_t>& sizes) {
  std::vector<PlaneSpec> planes;
  for (uint64_t bytes : sizes) {
    PlaneSpec plane;
    plane.layer = static_cast<uint32_t>(planes.size());
    plane.bytes = bytes;
    planes.push_back(plane);
  }
  return planes;
}

// Invariants of every layout: order kept, offsets aligned, no overlap, bytes rounded and
// covering the last plane.
void ExpectWellFormed(const ArenaLayout& layout, const std::vector<PlaneSpec>& planes,
                      uint64_t alignment, uint64_t granularity) {
  ASSERT_EQ(layout.planes.size(), planes.size());
  uint64_t end = 0;
  for (size_t i = 0; i < planes.size(); ++i) {
    const PlacedPlane& placed = layout.planes[i];
    EXPECT_EQ(placed.spec.layer, planes[i].layer);
    EXPECT_EQ(placed.spec.kind, planes[i].kind);
    EXPECT_EQ(placed.spec.bytes, planes[i].bytes);
    EXPECT_EQ(placed.offset % alignment, 0u);
    EXPECT_GE(placed.offset, end);
    EXPECT_LT(placed.offset - end, alignment);  // no gap beyond the alignment
    end = placed.offset + placed.spec.bytes;
  }
  EXPECT_EQ(layout.bytes % granularity, 0u);
  EXPECT_GE(layout.bytes, end);
  EXPECT_LT(layout.bytes - end, granularity);
}

TEST(ArenaLayoutTest, PlacesPlanesInOrderAtAlignedOffsets) {
  // 10 at 0; 300 at 256 (ends 556); 0 at 768; 5 at 768 (ends 773); 773 -> one 4 KiB page.
  const std::vector<PlaneSpec> planes = PlanesOfBytes({10, 300, 0, 5});
  absl::StatusOr<ArenaLayout> layout = LayoutArena(planes, 256, 4096);
  ASSERT_THAT(layout.status(), IsOk());
  ASSERT_EQ(layout->planes.size(), 4u);
  EXPECT_EQ(layout->planes[0].offset, 0u);
  EXPECT_EQ(layout->planes[1].offset, 256u);
  EXPECT_EQ(layout->planes[2].offset, 768u);
  EXPECT_EQ(layout->planes[3].offset, 768u);
  EXPECT_EQ(layout->bytes, 4096u);
  ExpectWellFormed(*layout, planes, 256, 4096);
}

TEST(ArenaLayoutTest, ExactFitNeedsNoRounding) {
  absl::StatusOr<ArenaLayout> layout = LayoutArena(PlanesOfBytes({256, 256, 3584}), 256, 4096);
  ASSERT_THAT(layout.status(), IsOk());
  EXPECT_EQ(layout->planes[2].offset, 512u);
  EXPECT_EQ(layout->bytes, 4096u);
  absl::StatusOr<ArenaLayout> empty = LayoutArena({}, 256, 4096);
  ASSERT_THAT(empty.status(), IsOk());
  EXPECT_EQ(empty->bytes, 0u);
}

TEST(ArenaLayoutTest, Llama3_8BSessionArenaIsWhatAdmissionCharges) {
  // Per layer: K 8192 x 1088 + 8 = 8,912,904 at 0 (next 256-aligned offset 8,913,152);
  // V 8192 x 768 + 8 = 6,291,464 at 8,913,152 (ends 15,204,616 -> next 15,204,864); len 4 at
  // 15,204,864. Stride per layer 15,205,120; the last len mirror ends at
  // 31 x 15,205,120 + 15,204,868 = 486,563,588, which 2 MiB granules round to 233 x 2 MiB
  // = 488,636,416 (vs 486,539,904 unaligned plane bytes).
  SessionShape request;
  request.capacity = 8192;
  absl::StatusOr<SessionPlan> session =
      PlanSession(test_plans::Llama3_8B(), FormatDefaults{}, request);
  ASSERT_THAT(session.status(), IsOk());
  absl::StatusOr<ArenaLayout> layout = LayoutArena(session->planes, 256, kTwoMiB);
  ASSERT_THAT(layout.status(), IsOk());
  EXPECT_EQ(layout->planes[1].offset, 8'913'152u);
  EXPECT_EQ(layout->planes[2].offset, 15'204'864u);
  EXPECT_EQ(layout->planes[3].offset, 15'205'120u);
  EXPECT_EQ(layout->bytes, 488'636'416u);
  EXPECT_GE(layout->bytes, session->total_bytes);
  ExpectWellFormed(*layout, session->planes, 256, kTwoMiB);

  // Page granularity: 486,563,588 -> 486,563,840.
  EXPECT_EQ(LayoutArena(session->planes, 256, 4096)->bytes, 486'563'840u);
}

TEST(ArenaLayoutTest, EveryRealisticSessionLaysOutWellFormed) {
  SessionShape request;
  request.capacity = 40'000;
  request.spec_snapshot = true;
  for (const ModelPlan& plan : {test_plans::GemmaStyle(true), test_plans::DeepSeekV3Style(),
                                test_plans::GlmStyleWithIndexer(), test_plans::Qwen3NextStyle()}) {
    absl::StatusOr<SessionPlan> session = PlanSession(plan, FormatDefaults{}, request);
    ASSERT_THAT(session.status(), IsOk()) << plan.name;
    absl::StatusOr<ArenaLayout> layout = LayoutArena(session->planes, 256, kTwoMiB);
    ASSERT_THAT(layout.status(), IsOk()) << plan.name;
    ExpectWellFormed(*layout, session->planes, 256, kTwoMiB);
    EXPECT_GE(layout->bytes, session->total_bytes) << plan.name;
  }
}

TEST(ArenaLayoutTest, RefusesAlignmentsThatAreNotPowersOfTwo) {
  const std::vector<PlaneSpec> planes = PlanesOfBytes({10});
  EXPECT_THAT(LayoutArena(planes, 0, 4096),
              StatusIs(kInvalid, HasSubstrs("arena alignment 0", "power of two")));
  EXPECT_THAT(LayoutArena(planes, 384, 4096),
              StatusIs(kInvalid, HasSubstrs("arena alignment 384", "power of two")));
  EXPECT_THAT(LayoutArena(planes, 256, 0),
              StatusIs(kInvalid, HasSubstrs("arena granularity 0", "power of two")));
  EXPECT_THAT(LayoutArena(planes, 256, 3000),
              StatusIs(kInvalid, HasSubstrs("arena granularity 3000", "power of two")));
}

TEST(ArenaLayoutTest, RefusesLayoutsThatOverflow) {
  const uint64_t huge = std::numeric_limits<uint64_t>::max() - 100;
  // The second plane's offset aligns past 2^64.
  EXPECT_THAT(LayoutArena(PlanesOfBytes({huge, 1}), 256, 4096),
              StatusIs(kInvalid, HasSubstrs("arena offset overflows")));
  // The end itself wraps.
  EXPECT_THAT(LayoutArena(PlanesOfBytes({256, huge}), 256, 4096),
              StatusIs(kInvalid, HasSubstrs("arena end overflows")));
  // The planes fit but the granule rounding does not.
  EXPECT_THAT(LayoutArena(PlanesOfBytes({huge}), 256, 4096),
              StatusIs(kInvalid, HasSubstrs("arena bytes overflows")));
}

}  // namespace
}  // namespace memra
