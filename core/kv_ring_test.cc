#include "core/kv_ring.h"

#include <cstdint>
#include <numeric>
#include <vector>

#include "gtest/gtest.h"
#include "tests/seeded_random.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

// "Reference: <name>" marks a port of the reference's test of that name, with the same numbers
// (the reference: docs/rules.md#the-reference; the rules: docs/rules.md#swa-ring).

using ::memra::testing::HasSubstrs;
using ::memra::testing::StatusIs;

KvRing MakeRing(uint64_t rows, uint64_t window) {
  absl::StatusOr<KvRing> ring = KvRing::Create(rows, window);
  EXPECT_TRUE(ring.ok()) << ring.status();
  return *ring;
}

// Reference: allocation_rows_cover_window_max_prime_and_alignment_slack (ring-rows half; the
// allocation-bytes half lives in sizing_test).
TEST(SwaRingRows, CoverWindowMaxPrimeAndAlignmentSlack) {
  EXPECT_EQ(SwaRingRows(512, 262'144), 512u + 4096 + 512 + 31);
  EXPECT_EQ(SwaRingRows(512, 4096), 4096u);
}

// Reference: retain_grants_rewind_slack_but_never_asks_below_base.
TEST(SwaRetainFrom, GrantsRewindSlackButNeverAsksBelowBase) {
  constexpr uint64_t kWindow = 512;
  const uint64_t rows = SwaRingRows(kWindow, 262'144);
  const uint64_t len = rows;
  auto aligned = [](uint64_t pos) { return (pos - (kWindow - 1)) & ~uint64_t{31}; };

  const uint64_t retain = SwaRetainFrom(len, kWindow, 0);
  EXPECT_LE(retain, aligned(len) - kSwaRewindSlackRows);
  KvRing ring = MakeRing(rows, kWindow);
  ASSERT_TRUE(ring.ApplyRebase(retain).ok());
  EXPECT_TRUE(ring.CanRewindTo(len - 1)) << "a one-token rewind must survive the rebase";
  EXPECT_TRUE(ring.CanRewindTo(len - kSwaRewindSlackRows));
  EXPECT_LE(len - retain + kPrimeChunkMaxTokens, rows);

  for (uint64_t depth : {uint64_t{1}, uint64_t{32}, uint64_t{256}, kSwaRewindSlackRows}) {
    EXPECT_TRUE(ring.CanRewindTo(len - depth)) << depth;
  }
  const uint64_t base = ring.base();
  for (uint64_t depth : {uint64_t{1}, uint64_t{32}, uint64_t{256}, kSwaRewindSlackRows}) {
    const uint64_t window_start = (len - depth - (kWindow - 1)) & ~uint64_t{31};
    EXPECT_GE(window_start, base) << depth;
    EXPECT_GE(SwaRetainFrom(len - depth, kWindow, base), base);
  }
  const uint64_t past = len - (kSwaRewindSlackRows + kWindow);
  const uint64_t past_start = (past - (kWindow - 1)) & ~uint64_t{31};
  EXPECT_LT(past_start, base);
  EXPECT_FALSE(ring.CanRewindTo(past));
}

// Reference: ring_matches_flat_bytes_before_wrap.
TEST(KvRing, MatchesFlatBytesBeforeWrap) {
  KvRing ring = MakeRing(SwaRingRows(512, 262'144), 512);
  std::vector<uint32_t> flat(1024);
  std::iota(flat.begin(), flat.end(), 0u);
  std::vector<uint32_t> physical(ring.rows(), UINT32_MAX);
  absl::StatusOr<RingAppend> append = ring.AppendPlan(0, 0, flat.size());
  ASSERT_TRUE(append.ok());
  ASSERT_EQ(append->kind, RingAppend::Kind::kContiguous);
  std::copy(flat.begin(), flat.end(), physical.begin() + append->write_row);
  absl::StatusOr<RowRange> view = ring.PhysicalRange(0, flat.size());
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(std::vector<uint32_t>(physical.begin() + view->start, physical.begin() + view->end),
            flat);
}

// Reference: wrap_rebases_the_exact_aligned_prime_view.
TEST(KvRing, WrapRebasesTheExactAlignedPrimeView) {
  KvRing ring = MakeRing(SwaRingRows(512, 262'144), 512);
  std::vector<uint32_t> flat(8192);
  std::iota(flat.begin(), flat.end(), 0u);
  std::vector<uint32_t> physical(ring.rows(), UINT32_MAX);
  absl::StatusOr<RingAppend> first = ring.AppendPlan(0, 0, 4096);
  ASSERT_TRUE(first.ok());
  ASSERT_EQ(first->kind, RingAppend::Kind::kContiguous);
  std::copy(flat.begin(), flat.begin() + 4096, physical.begin() + first->write_row);

  const uint64_t off = (4096 - (512 - 1)) & ~uint64_t{31};
  absl::StatusOr<RingAppend> second = ring.AppendPlan(4096, off, 4096);
  ASSERT_TRUE(second.ok());
  ASSERT_EQ(second->kind, RingAppend::Kind::kRebase);
  std::vector<uint32_t> retained(physical.begin() + second->src_row,
                                 physical.begin() + second->src_row + second->keep_rows);
  std::copy(retained.begin(), retained.end(), physical.begin());
  ASSERT_TRUE(ring.ApplyRebase(second->new_base).ok());
  std::copy(flat.begin() + 4096, flat.end(), physical.begin() + second->write_row);

  absl::StatusOr<RowRange> view = ring.PhysicalRange(off, 8192);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(std::vector<uint32_t>(physical.begin() + view->start, physical.begin() + view->end),
            std::vector<uint32_t>(flat.begin() + off, flat.end()));
  EXPECT_EQ(ring.base(), off);
}

// Reference: rewind_declines_once_the_required_window_was_lapped.
TEST(KvRing, RewindDeclinesOnceTheRequiredWindowWasLapped) {
  KvRing ring = MakeRing(SwaRingRows(512, 262'144), 512);
  absl::StatusOr<RingAppend> append = ring.AppendPlan(4096, 3584, 4096);
  ASSERT_TRUE(append.ok());
  ASSERT_EQ(append->kind, RingAppend::Kind::kRebase);
  ASSERT_TRUE(ring.ApplyRebase(append->new_base).ok());
  EXPECT_TRUE(ring.CanRewindTo(4095));
  EXPECT_FALSE(ring.CanRewindTo(4094));
  EXPECT_FALSE(ring.CanRewindTo(0));
}

// Reference: restore_plan_copies_the_window_not_the_absolute_length.
TEST(KvRing, RestorePlanCopiesTheWindowNotTheAbsoluteLength) {
  KvRing ring = MakeRing(SwaRingRows(512, 262'144), 512);
  absl::StatusOr<std::pair<uint64_t, RowRange>> early = ring.RestorePlan(400);
  ASSERT_TRUE(early.ok());
  EXPECT_EQ(early->first, 0u);
  EXPECT_EQ(early->second, (RowRange{0, 400}));

  uint64_t live = 0;
  while (live < 40'960) {
    const uint64_t retain = SwaRetainFrom(live, 512, ring.base());
    absl::StatusOr<RingAppend> append = ring.AppendPlan(live, retain, 4096);
    ASSERT_TRUE(append.ok()) << append.status();
    if (append->kind == RingAppend::Kind::kRebase) {
      ASSERT_TRUE(ring.ApplyRebase(append->new_base).ok());
    }
    live += 4096;
  }
  ASSERT_GT(ring.base(), 0u) << "a 40k walk must have lapped the ring";
  absl::StatusOr<std::pair<uint64_t, RowRange>> plan = ring.RestorePlan(live);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->first, (live - (512 - 1)) & ~uint64_t{31});
  EXPECT_GE(plan->first, ring.base());
  EXPECT_EQ(plan->second.size(), live - plan->first);
  EXPECT_LE(plan->second.end, ring.rows());

  EXPECT_THAT(ring.RestorePlan(400),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("view [0,400)", "outside resident")));
}

TEST(KvRing, RefusalsNameTheirNumbers) {
  EXPECT_THAT(KvRing::Create(0, 512), StatusIs(absl::StatusCode::kInvalidArgument,
                                               HasSubstrs("rows 0", "window 512")));
  EXPECT_THAT(KvRing::Create(64, 0), StatusIs(absl::StatusCode::kInvalidArgument,
                                              HasSubstrs("rows 64", "window 0")));
  KvRing ring = MakeRing(64, 16);
  ASSERT_TRUE(ring.ApplyRebase(32).ok());
  EXPECT_THAT(ring.AppendPlan(40, 16, 1),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("lapped required rows (base 32, retain 16, len 40)")));
  EXPECT_THAT(ring.AppendPlan(20, 32, 1), StatusIs(absl::StatusCode::kFailedPrecondition,
                                                   HasSubstrs("base 32", "len 20")));
  EXPECT_THAT(ring.AppendPlan(40, 48, 1), StatusIs(absl::StatusCode::kFailedPrecondition,
                                                   HasSubstrs("retain 48", "len 40")));
  EXPECT_THAT(ring.AppendPlan(100, 40, 1), StatusIs(absl::StatusCode::kFailedPrecondition,
                                                    HasSubstrs("exceeds capacity (68 > 64)")));
  EXPECT_THAT(ring.AppendPlan(90, 40, 20),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("does not fit (keep 50 + append 20 > 64)")));
  EXPECT_THAT(ring.ApplyRebase(31), StatusIs(absl::StatusCode::kFailedPrecondition,
                                             HasSubstrs("rebase to 31", "base 32")));
  EXPECT_EQ(ring.base(), 32u) << "a refused rebase changes nothing";
  EXPECT_THAT(ring.PhysicalRange(40, 39),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("[40,39)")));
  EXPECT_THAT(ring.PhysicalRange(40, 97),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("[40,97) is outside resident [32,96)")));
  // An append that exactly fills the ring is contiguous; one more row rebases.
  EXPECT_EQ(*ring.AppendPlan(90, 90, 6), RingAppend::Contiguous(58));
  EXPECT_EQ(*ring.AppendPlan(90, 80, 7), RingAppend::Rebase(48, 10, 80, 10));
}

// Property: for random legal append/rebase/rewind sequences every resident view is
// contiguous and in bounds, the window is resident after every legal rewind, and a refused
// operation leaves the ring unchanged.
TEST(KvRingProperty, RandomWalksKeepViewsContiguousAndRefusalsInert) {
  ::memra::testing::SeededRandom random(0x9e3779b97f4a7c15ull);
  auto next = [&random](uint64_t bound) { return random.Below(bound); };
  for (int trial = 0; trial < 200; ++trial) {
    const uint64_t window = 1 + next(600);
    const uint64_t rows = SwaRingRows(window, 1 << 20);
    KvRing ring = MakeRing(rows, window);
    uint64_t len = 0;
    for (int step = 0; step < 60; ++step) {
      const KvRing before = ring;
      if (next(4) == 0 && len > 0) {
        const uint64_t target = len - next(std::min<uint64_t>(len, 700) + 1);
        if (ring.CanRewindTo(target)) {
          len = target;
          const uint64_t start = AlignedWindowStart(len, window);
          ASSERT_GE(start, ring.base());
          ASSERT_TRUE(ring.PhysicalRange(start, len).ok());
        }
        continue;
      }
      const uint64_t append_rows = 1 + next(kPrimeChunkMaxTokens);
      const uint64_t retain = SwaRetainFrom(len, window, ring.base());
      absl::StatusOr<RingAppend> plan = ring.AppendPlan(len, retain, append_rows);
      if (!plan.ok()) {
        ASSERT_EQ(ring, before) << "a refused append changes nothing";
        continue;
      }
      if (plan->kind == RingAppend::Kind::kRebase) {
        ASSERT_LE(plan->src_row + plan->keep_rows, rows);
        ASSERT_TRUE(ring.ApplyRebase(plan->new_base).ok());
      }
      ASSERT_LE(plan->write_row + append_rows, rows);
      len += append_rows;
      absl::StatusOr<RowRange> view = ring.PhysicalRange(AlignedWindowStart(len, window), len);
      ASSERT_TRUE(view.ok()) << view.status();
      ASSERT_LE(view->end, rows);
    }
  }
}

}  // namespace
}  // namespace memra
