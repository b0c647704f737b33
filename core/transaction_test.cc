#include "core/transaction.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "tests/seeded_random.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;
using ::testing::ElementsAre;

constexpr uint64_t kCacheId = 7;

// "Reference: <name>" marks a port of the reference's test of that name, with the same numbers
// (the reference: docs/rules.md#the-reference; the rules: docs/rules.md#transactions).

// The reference's empty_tp_cache: one flat rank-local layer of 136/96 token bytes.
KvTransactionCache EmptyCache(uint64_t capacity, uint64_t k_token_bytes = 136,
                              uint64_t cache_id = kCacheId) {
  absl::StatusOr<KvTransactionCache> cache =
      KvTransactionCache::Create(cache_id, capacity, {{0, k_token_bytes, 96, std::nullopt}});
  EXPECT_TRUE(cache.ok()) << cache.status();
  return *cache;
}

// The reference's new_swa(.., capacity, window).
KvTransactionCache SwaCache(uint64_t capacity, uint64_t window) {
  absl::StatusOr<KvTransactionCache> cache =
      KvTransactionCache::Create(kCacheId, capacity, {{0, 136, 96, window}});
  EXPECT_TRUE(cache.ok()) << cache.status();
  return *cache;
}

void Hydrate(KvTransactionCache& cache, uint64_t len, uint64_t start) {
  const uint64_t starts[] = {start};
  ASSERT_THAT(cache.PublishHydration(len, starts), IsOk());
}

// Reference: partial_commit_publishes_only_the_accepted_prefix.
TEST(TransactionState, PartialCommitPublishesOnlyTheAcceptedPrefix) {
  TransactionState state;
  TransactionId transaction = *state.Begin(kCacheId);
  uint64_t staged = *state.AppendTarget(transaction, 3, 8);
  ASSERT_THAT(state.PublishAppend(transaction, staged), IsOk());
  EXPECT_EQ(state.committed_len(), 0u);
  EXPECT_EQ(state.staged_len(), 3u);

  uint64_t committed = *state.CommitTarget(transaction, 2);
  ASSERT_THAT(state.PublishFinalize(transaction, committed), IsOk());
  EXPECT_EQ(state.committed_len(), 2u);
  EXPECT_EQ(state.staged_len(), 2u);
  EXPECT_FALSE(state.active().has_value());
  EXPECT_THAT(state.Validate(transaction),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("stale KV transaction generation 1 at base 0")));
}

// Reference: rollback_restores_the_committed_boundary.
TEST(TransactionState, RollbackRestoresTheCommittedBoundary) {
  TransactionState state;
  TransactionId first = *state.Begin(kCacheId);
  ASSERT_THAT(state.PublishAppend(first, *state.AppendTarget(first, 1, 8)), IsOk());
  ASSERT_THAT(state.PublishFinalize(first, *state.CommitTarget(first, 1)), IsOk());

  TransactionId speculative = *state.Begin(kCacheId);
  ASSERT_THAT(state.PublishAppend(speculative, *state.AppendTarget(speculative, 2, 8)), IsOk());
  EXPECT_EQ(state.committed_len(), 1u);
  EXPECT_EQ(state.staged_len(), 3u);
  ASSERT_THAT(state.PublishFinalize(speculative, speculative.base_len), IsOk());
  EXPECT_EQ(state.committed_len(), 1u);
  EXPECT_EQ(state.staged_len(), 1u);
  EXPECT_THAT(state.Validate(speculative),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("stale KV transaction generation 2 at base 1")));
}

// Reference: rejects_nested_stale_and_out_of_range_actions.
TEST(TransactionState, RejectsNestedStaleAndOutOfRangeActions) {
  TransactionState state;
  TransactionId transaction = *state.Begin(kCacheId);
  EXPECT_THAT(state.Begin(kCacheId),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("generation 1 is already active at base 0")));
  EXPECT_THAT(state.AppendTarget(transaction, 0, 2),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("at least one row")));
  EXPECT_THAT(state.AppendTarget(transaction, 3, 2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("exceeds capacity: 3 > 2")));
  uint64_t staged = *state.AppendTarget(transaction, 2, 2);
  ASSERT_THAT(state.PublishAppend(transaction, staged), IsOk());
  EXPECT_THAT(state.CommitTarget(transaction, 3),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("accepts 3 rows from a 2-row transaction")));
  ASSERT_THAT(state.PublishFinalize(transaction, 0), IsOk());
  EXPECT_THAT(state.PublishAppend(transaction, 1),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstrs("stale")));
}

// Reference: rewind_resets_visibility_and_invalidates_an_active_transaction.
TEST(TransactionState, RewindResetsVisibilityAndInvalidatesAnActiveTransaction) {
  TransactionState state;
  TransactionId transaction = *state.Begin(kCacheId);
  ASSERT_THAT(state.PublishAppend(transaction, *state.AppendTarget(transaction, 3, 8)), IsOk());
  ASSERT_THAT(state.Rewind(1, 8), IsOk());
  EXPECT_EQ(state.committed_len(), 1u);
  EXPECT_EQ(state.staged_len(), 1u);
  EXPECT_FALSE(state.active().has_value());
  EXPECT_THAT(state.Validate(transaction),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("stale KV transaction generation 1 at base 0")));
  EXPECT_THAT(state.Rewind(9, 8), StatusIs(absl::StatusCode::kInvalidArgument,
                                           HasSubstrs("target 9 exceeds capacity 8")));
}

TEST(TransactionState, RefusedCallsChangeNothing) {
  TransactionState state;
  TransactionId transaction = *state.Begin(kCacheId);
  ASSERT_THAT(state.PublishAppend(transaction, 4), IsOk());
  const TransactionState before = state;
  EXPECT_THAT(state.PublishAppend(transaction, 4),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("target 4 must exceed staged length 4")));
  EXPECT_THAT(state.PublishFinalize(transaction, 5),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("target 5 outside transaction range 0..=4")));
  EXPECT_THAT(state.AppendTarget(transaction, UINT64_MAX, UINT64_MAX),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("overflows")));
  EXPECT_EQ(state, before);
  EXPECT_THAT(state.Begin(kCacheId), StatusIs(absl::StatusCode::kFailedPrecondition,
                                              HasSubstrs("already active")));
}

// Reference: grow_preserves_generation_and_publishes_only_the_checkpoint_prefix.
TEST(KvTransactionCache, GrowPreservesGenerationAndPublishesOnlyTheCheckpointPrefix) {
  KvTransactionCache source = EmptyCache(8);
  TransactionId first = *source.Begin();
  ASSERT_THAT(source.PublishAppend(first, *source.AppendTarget(first, 5)), IsOk());
  ASSERT_THAT(source.PublishFinalize(first, *source.CommitTarget(first, 5)), IsOk());

  TransactionId rolled_back = *source.Begin();
  ASSERT_THAT(source.PublishFinalize(rolled_back, rolled_back.base_len), IsOk());
  absl::StatusOr<GrowPlan> plan = source.PrepareGrow(16, 3);
  ASSERT_THAT(plan, IsOk());
  EXPECT_EQ(plan->rows, 3u);
  ASSERT_EQ(plan->layers.size(), 1u);
  EXPECT_EQ(plan->layers[0].k_bytes, 3u * 136);
  EXPECT_EQ(plan->layers[0].v_bytes, 3u * 96);

  KvTransactionCache target = EmptyCache(16, 136, kCacheId + 1);
  ASSERT_THAT(target.PublishGrow(*plan), IsOk());
  EXPECT_EQ(target.committed_len(), 3u);
  EXPECT_EQ(target.staged_len(), 3u);
  EXPECT_EQ(target.capacity(), 16u);
  TransactionId next = *target.Begin();
  EXPECT_EQ(next.generation, rolled_back.generation + 1);
  EXPECT_EQ(next.base_len, 3u);
}

// Reference: grow_refuses_active_source_and_invalid_target_state_or_layout. The reference
// sets committed lengths with a forward rewind_to; here only hydration may do that.
TEST(KvTransactionCache, GrowRefusesActiveSourceAndInvalidTargetStateOrLayout) {
  KvTransactionCache active = EmptyCache(8);
  ASSERT_THAT(active.Begin(), IsOk());
  EXPECT_THAT(active.PrepareGrow(16, 0),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("refuses active transaction generation 1 at base 0")));

  KvTransactionCache source = EmptyCache(8);
  Hydrate(source, 5, 0);
  EXPECT_THAT(source.PrepareGrow(8, 5),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("target capacity 8 must exceed source capacity 8")));
  EXPECT_THAT(source.PrepareGrow(16, 6),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("rows 6 exceed committed length 5")));
  EXPECT_THAT(source.PrepareGrow(uint64_t{1} << 31, 5),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("2147483648 exceeds i32 device mirrors")));
  GrowPlan plan = *source.PrepareGrow(16, 4);

  KvTransactionCache wrong_layout = EmptyCache(16, 144);
  EXPECT_THAT(wrong_layout.PublishGrow(plan),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("layout does not match its source plan")));
  EXPECT_EQ(wrong_layout.committed_len(), 0u);

  KvTransactionCache dirty_target = EmptyCache(16);
  Hydrate(dirty_target, 1, 0);
  EXPECT_THAT(dirty_target.PublishGrow(plan),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("must be fresh, got committed/staged=1/1")));
}

// Reference: swa_transaction_rebase_preserves_the_rollback_window (the 8762-row rebase that
// writes row 58).
TEST(KvTransactionCache, SwaTransactionRebasePreservesTheRollbackWindow) {
  KvTransactionCache cache = SwaCache(10'000, 32);
  EXPECT_EQ(cache.physical_rows(0), 32u + 4096 + 512 + 31);
  Hydrate(cache, 8762, 4096);
  EXPECT_EQ(cache.ring(0)->base(), 4096u);

  TransactionId transaction = *cache.Begin();
  absl::StatusOr<AppendPlan> plan = cache.PrepareAppend(transaction, 10);
  ASSERT_THAT(plan, IsOk());
  EXPECT_EQ(plan->target, 8772u);
  ASSERT_EQ(plan->layers.size(), 1u);
  EXPECT_EQ(plan->layers[0].write_row, 58u);
  EXPECT_EQ(plan->layers[0].ring_append, RingAppend::Rebase(4608, 58, 8704, 58));
  ASSERT_THAT(cache.PublishAppendRebase(*plan), IsOk());
  ASSERT_THAT(cache.PublishAppendPlan(*plan), IsOk());
  EXPECT_EQ(cache.ring(0)->base(), 8704u);
  EXPECT_EQ(*cache.PhysicalRange(0, 8740, 8772), (RowRange{36, 68}));

  uint64_t rollback = *cache.CommitTarget(transaction, 0);
  ASSERT_THAT(cache.PublishFinalize(transaction, rollback), IsOk());
  EXPECT_EQ(cache.committed_len(), 8762u);
  EXPECT_EQ(cache.staged_len(), 8762u);
  // A rewind into the lapped window names the lap; a length past the capacity names that.
  EXPECT_THAT(cache.RewindTo(8200),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("SWA ring rewind checkpoint has been lapped",
                                  "rewind target 8200: layer 0 window 32 starts at row 8160, "
                                  "below ring base 8704")));
  EXPECT_FALSE(cache.CanRewindTo(8200));
  EXPECT_THAT(cache.CheckResident(10'001, "rewind target"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("KV rewind target 10001 is past the capacity 10000")));
  EXPECT_THAT(cache.CheckResident(8762, "rewind target"), IsOk());
  EXPECT_EQ(cache.committed_len(), 8762u);
}

// docs/rules.md#swa-ring: the ring saves rows only when the capacity exceeds window + 4,639.
// At that capacity (window 32: 4,671) it is clamped to the capacity, never rebases and every
// length stays rewindable, as a flat plane; one row more and the same appends rebase.
TEST(KvTransactionCache, ARingNoLongerThanTheCapacityNeverRebases) {
  const uint64_t cap = SwaRingRows(32, UINT64_MAX);
  ASSERT_EQ(cap, 4671u);
  for (const uint64_t capacity : {cap, cap + 1}) {
    KvTransactionCache cache = SwaCache(capacity, 32);
    EXPECT_EQ(cache.physical_rows(0), std::min(capacity, cap));
    bool rebased = false;
    for (const uint64_t rows : {uint64_t{4096}, capacity - 4096}) {
      TransactionId transaction = *cache.Begin();
      absl::StatusOr<AppendPlan> plan = cache.PrepareAppend(transaction, rows);
      ASSERT_THAT(plan, IsOk());
      rebased |= plan->layers[0].ring_append->kind == RingAppend::Kind::kRebase;
      ASSERT_THAT(cache.PublishAppendRebase(*plan), IsOk());
      ASSERT_THAT(cache.PublishAppendPlan(*plan), IsOk());
      ASSERT_THAT(cache.PublishFinalize(transaction, plan->target), IsOk());
    }
    EXPECT_EQ(cache.committed_len(), capacity);
    if (capacity == cap) {
      EXPECT_FALSE(rebased) << "capacity " << capacity;
      EXPECT_EQ(cache.ring(0)->base(), 0u);
      EXPECT_TRUE(cache.CanRewindTo(0));
    } else {
      EXPECT_TRUE(rebased) << "capacity " << capacity;
      // The rebase keeps the window at the transaction's base 4096: (4096 - 31) & ~31.
      EXPECT_EQ(cache.ring(0)->base(), 4064u);
      EXPECT_FALSE(cache.CanRewindTo(0));
    }
  }
}

// Reference: swa_grow_normalizes_only_the_live_prefix_and_preserves_generation.
TEST(KvTransactionCache, SwaGrowNormalizesOnlyTheLivePrefixAndPreservesGeneration) {
  KvTransactionCache source = SwaCache(10'000, 32);
  Hydrate(source, 8250, 4096);
  TransactionId transaction = *source.Begin();
  ASSERT_THAT(source.PublishFinalize(transaction, transaction.base_len), IsOk());

  absl::StatusOr<GrowPlan> plan = source.PrepareGrow(20'000, 8250);
  ASSERT_THAT(plan, IsOk());
  EXPECT_EQ(plan->layers[0].source_row, 4096u);
  EXPECT_EQ(plan->layers[0].copy_rows, 58u);
  EXPECT_EQ(plan->layers[0].k_bytes, 58u * 136);
  EXPECT_EQ(plan->layers[0].v_bytes, 58u * 96);

  absl::StatusOr<KvTransactionCache> target =
      KvTransactionCache::Create(kCacheId + 1, 20'000, {{0, 136, 96, 32}});
  ASSERT_THAT(target, IsOk());
  ASSERT_THAT(target->PublishGrow(*plan), IsOk());
  EXPECT_EQ(target->ring(0)->base(), 8192u);
  EXPECT_EQ(target->committed_len(), 8250u);
  EXPECT_EQ(target->staged_len(), 8250u);
  EXPECT_EQ(*target->PhysicalRange(0, 8192, 8250), (RowRange{0, 58}));
  EXPECT_EQ(target->Begin()->generation, transaction.generation + 1);
}

// Reference: cache_reports_a_materialized_distributed_swa_ring.
TEST(KvTransactionCache, ReportsAMaterializedSwaRing) {
  EXPECT_FALSE(EmptyCache(10'000).has_ring());
  EXPECT_TRUE(SwaCache(10'000, 512).has_ring());
}

// Tighter than the reference: a reference transaction is only (generation, base length), so a
// plan from one cache validates on another that happens to agree. Ours are bound to their cache.
TEST(KvTransactionCache, TighterThanReference_PlanFromAnotherCacheIsRefused) {
  KvTransactionCache a = EmptyCache(8, 136, 1);
  KvTransactionCache b = EmptyCache(8, 136, 2);
  TransactionId from_a = *a.Begin();
  ASSERT_THAT(b.Begin(), IsOk());  // same generation 1, same base 0
  AppendPlan plan = *a.PrepareAppend(from_a, 2);
  EXPECT_THAT(b.PublishAppendPlan(plan),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("stale KV transaction generation 1 at base 0")));
  EXPECT_EQ(b.staged_len(), 0u);
}

// Tighter than the reference: a reference rewind may move forward past rows never written.
TEST(KvTransactionCache, TighterThanReference_RewindPastStagedLengthIsRefused) {
  KvTransactionCache cache = EmptyCache(8);
  EXPECT_THAT(cache.RewindTo(5), StatusIs(absl::StatusCode::kInvalidArgument,
                                          HasSubstrs("target 5 is past the staged length 0")));
  EXPECT_EQ(cache.committed_len(), 0u);
  Hydrate(cache, 5, 0);  // hydration is the one way to publish unwritten rows
  EXPECT_THAT(cache.RewindTo(2), IsOk());
  EXPECT_EQ(cache.committed_len(), 2u);
}

TEST(KvTransactionCache, RingLayersWithDifferentWindowsShareOneTransaction) {
  absl::StatusOr<KvTransactionCache> cache = KvTransactionCache::Create(
      kCacheId, 100'000, {{0, 1088, 768, std::nullopt}, {1, 136, 96, 128}, {2, 136, 96, 4096}});
  ASSERT_THAT(cache, IsOk());
  uint64_t len = 0;
  for (int step = 0; step < 6; ++step) {
    TransactionId transaction = *cache->Begin();
    AppendPlan plan = *cache->PrepareAppend(transaction, 4096);
    EXPECT_EQ(plan.layers[0].write_row, len) << "flat layers write at the absolute row";
    ASSERT_THAT(cache->PublishAppendRebase(plan), IsOk());
    ASSERT_THAT(cache->PublishAppendPlan(plan), IsOk());
    ASSERT_THAT(cache->PublishFinalize(transaction, *cache->CommitTarget(transaction, 4096)),
                IsOk());
    len += 4096;
  }
  EXPECT_EQ(cache->committed_len(), len);
  EXPECT_GT(cache->ring(1)->base(), 0u);
  EXPECT_GT(cache->ring(2)->base(), 0u);
  EXPECT_NE(cache->ring(1)->base(), cache->ring(2)->base());
  // Each ring keeps the window at the last transaction base resident (a zero-row commit must
  // stay legal); further back, the narrow window's ring has already dropped rows.
  EXPECT_TRUE(cache->CanRewindTo(len - 1));
  EXPECT_TRUE(cache->CanRewindTo(len - 4096));
  EXPECT_FALSE(cache->CanRewindTo(len - 4096 - 256));
}

TEST(KvTransactionCache, PublishRefusalsChangeNothing) {
  KvTransactionCache cache = SwaCache(10'000, 32);
  Hydrate(cache, 8762, 4096);
  TransactionId transaction = *cache.Begin();
  AppendPlan plan = *cache.PrepareAppend(transaction, 10);
  EXPECT_THAT(cache.PublishAppendPlan(plan),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("rebase 8704 was not published before its state")));
  AppendPlan mismatched = plan;
  mismatched.layers[0].ring_append.reset();
  EXPECT_THAT(cache.PublishAppendRebase(mismatched),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("does not match cache ring layout at layer 0")));
  AppendPlan lapping = plan;
  lapping.layers[0].ring_append->new_base = 8736;
  EXPECT_THAT(cache.PublishAppendRebase(lapping),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("rebase to 8736 laps transaction base 8762")));
  EXPECT_EQ(cache.ring(0)->base(), 4096u);
  EXPECT_EQ(cache.staged_len(), 8762u);
  EXPECT_THAT(cache.PublishFinalize(transaction, 20),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("has been lapped", "finalize target 20: layer 0 window 32 "
                                  "starts at row 0, below ring base 4096")));
}

TEST(KvTransactionCache, RestoreUndoesAPublishedRebaseAndTheTransactionState) {
  KvTransactionCache cache = SwaCache(10'000, 32);
  Hydrate(cache, 8762, 4096);
  const KvTransactionCache before = cache;
  KvTransactionCache::Undo undo = cache.SaveUndo();
  TransactionId transaction = *cache.Begin();
  AppendPlan plan = *cache.PrepareAppend(transaction, 10);
  ASSERT_THAT(cache.PublishAppendRebase(plan, &undo), IsOk());
  ASSERT_THAT(cache.PublishAppendPlan(plan), IsOk());
  ASSERT_THAT(cache.PublishFinalize(transaction, 8772), IsOk());
  EXPECT_EQ(cache.ring(0)->base(), 8704u);
  ASSERT_EQ(undo.replaced_rings.size(), 1u);
  cache.Restore(std::move(undo));
  EXPECT_EQ(cache.ring(0)->base(), 4096u);
  EXPECT_EQ(cache, before);
  // A contiguous append records no ring.
  KvTransactionCache::Undo quiet = cache.SaveUndo();
  TransactionId next = *cache.Begin();
  AppendPlan contiguous = *cache.PrepareAppend(next, 1);
  ASSERT_EQ(contiguous.layers[0].ring_append->kind, RingAppend::Kind::kContiguous);
  ASSERT_THAT(cache.PublishAppendRebase(contiguous, &quiet), IsOk());
  EXPECT_TRUE(quiet.replaced_rings.empty());
}

TEST(KvTransactionCache, HydrationRefusals) {
  KvTransactionCache flat = EmptyCache(8);
  const uint64_t one[] = {1};
  EXPECT_THAT(flat.PublishHydration(4, one),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("must start at absolute row zero, got 1")));
  const uint64_t zero[] = {0};
  EXPECT_THAT(flat.PublishHydration(9, zero),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("range [0,9) exceeds capacity 8")));
  EXPECT_THAT(flat.PublishHydration(4, {}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("names 0 resident starts for 1 layers")));
  KvTransactionCache ring = SwaCache(10'000, 32);
  const uint64_t far[] = {0};
  EXPECT_THAT(ring.PublishHydration(8000, far),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("requires 8000 rows in a 4671-row ring")));
  const uint64_t late[] = {7990};
  EXPECT_THAT(ring.PublishHydration(8000, late),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("base 7990 cannot expose logical length 8000")));
  EXPECT_EQ(ring.ring(0)->base(), 0u) << "a refused hydration changes nothing";
  Hydrate(ring, 8000, 7936);
  EXPECT_THAT(ring.PublishHydration(8000, late),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstrs("must be fresh")));
}

TEST(KvTransactionCache, CreateRefusals) {
  EXPECT_THAT(KvTransactionCache::Create(1, 0, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("capacity 0 outside")));
  EXPECT_THAT(KvTransactionCache::Create(1, uint64_t{1} << 31, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("2147483648")));
  EXPECT_THAT(KvTransactionCache::Create(1, 8, {{3, 1, 1, std::nullopt}, {3, 1, 1, 4}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("layer 3 listed twice")));
  EXPECT_THAT(KvTransactionCache::Create(1, 8, {{2, 0, 96, std::nullopt}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("layer 2", "k 0")));
  EXPECT_THAT(KvTransactionCache::Create(1, 8, {{4, 1, 1, 0}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("layer 4", "window 0")));
}

// Property: random operation sequences keep committed <= staged <= capacity, keep every ring
// window resident at the committed length, and refused operations change nothing.
TEST(KvTransactionCacheProperty, RandomSequencesKeepInvariants) {
  ::memra::testing::SeededRandom random(0x243f6a8885a308d3ull);
  auto next = [&random](uint64_t bound) { return random.Below(bound); };
  for (int trial = 0; trial < 100; ++trial) {
    const uint64_t capacity = 1000 + next(30'000);
    std::vector<KvLayerShape> shapes = {{0, 34, 24, std::nullopt},
                                        {1, 34, 24, 1 + next(1000)}};
    KvTransactionCache cache = *KvTransactionCache::Create(trial + 1, capacity, shapes);
    std::optional<TransactionId> open;
    for (int step = 0; step < 80; ++step) {
      const KvTransactionCache before = cache;
      absl::Status status;
      switch (next(4)) {
        case 0: {  // a full transaction with a random partial commit
          absl::StatusOr<TransactionId> transaction = cache.Begin();
          if (!transaction.ok()) break;
          absl::StatusOr<AppendPlan> plan = cache.PrepareAppend(*transaction, 1 + next(5000));
          if (!plan.ok()) {
            ASSERT_EQ(cache.committed_len(), before.committed_len());
            ASSERT_THAT(cache.PublishFinalize(*transaction, transaction->base_len), IsOk());
            break;
          }
          for (const LayerAppend& layer : plan->layers) {
            ASSERT_LE(layer.write_row + (plan->target - transaction->base_len),
                      layer.ring_append.has_value() ? cache.physical_rows(1) : capacity);
          }
          ASSERT_THAT(cache.PublishAppendRebase(*plan), IsOk());
          ASSERT_THAT(cache.PublishAppendPlan(*plan), IsOk());
          const uint64_t accepted = next(plan->target - transaction->base_len + 1);
          ASSERT_THAT(cache.PublishFinalize(*transaction,
                                            *cache.CommitTarget(*transaction, accepted)),
                      IsOk());
          break;
        }
        case 1:
          status = cache.RewindTo(cache.committed_len() - next(cache.committed_len() + 1));
          break;
        case 2:
          status = cache.RewindTo(cache.staged_len() + 1 + next(10));
          ASSERT_FALSE(status.ok());
          break;
        default: {
          absl::StatusOr<TransactionId> transaction = cache.Begin();
          if (transaction.ok()) {
            open = *transaction;
            ASSERT_THAT(cache.PublishFinalize(*open, open->base_len), IsOk());
          }
          break;
        }
      }
      if (!status.ok()) {
        ASSERT_EQ(cache.state(), before.state()) << status;
        ASSERT_EQ(cache.ring(1), before.ring(1)) << status;
      }
      ASSERT_LE(cache.committed_len(), cache.staged_len());
      ASSERT_LE(cache.staged_len(), cache.capacity());
      ASSERT_TRUE(cache.CanRewindTo(cache.committed_len()));
      const uint64_t start = AlignedWindowStart(cache.committed_len(), *shapes[1].ring_window);
      ASSERT_THAT(cache.PhysicalRange(1, start, cache.committed_len()), IsOk());
    }
  }
}

}  // namespace
}  // namespace memra
