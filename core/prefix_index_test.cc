#include "core/prefix_index.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "core/sha256.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::IsOkAndHolds;
using ::memra::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;

PlanFingerprint Fingerprint(uint8_t seed) {
  PlanFingerprint fp;
  for (size_t i = 0; i < fp.size(); ++i) fp[i] = static_cast<uint8_t>(seed + i);
  return fp;
}

std::vector<int32_t> Tokens(std::initializer_list<std::vector<int32_t>> parts) {
  std::vector<int32_t> out;
  for (const auto& part : parts) out.insert(out.end(), part.begin(), part.end());
  return out;
}

std::vector<int32_t> Seq(int32_t first, size_t n) {
  std::vector<int32_t> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = first + static_cast<int32_t>(i);
  return out;
}

constexpr PrefixModelTraits kFlat{
    .position_addressed_only = true, .block_bytes = 100, .boundary_bytes = 0};
PrefixModelTraits Hybrid(uint64_t boundary_bytes) {
  return PrefixModelTraits{
      .position_addressed_only = false, .block_bytes = 100, .boundary_bytes = boundary_bytes};
}

// Hands out fresh storage handles (checksum = handle * 7) the way the daemon would.
class PrefixIndexTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Reset(PrefixIndexOptions{
        .block_tokens = 4, .budget_bytes = 1 << 20, .epoch = 9, .event_capacity = 64});
  }
  void Reset(const PrefixIndexOptions& options) {
    auto index = PrefixIndex::Create(options);
    ASSERT_THAT(index, IsOk());
    index_.emplace(*std::move(index));
  }
  StoredRef Fresh() {
    ++next_handle_;
    return StoredRef{.storage_handle = next_handle_, .checksum = next_handle_ * 7};
  }
  CaptureCommit CommitFor(const CapturePlan& plan) {
    CaptureCommit commit;
    for (uint64_t i = 0; i < plan.new_block_count(); ++i) commit.new_blocks.push_back(Fresh());
    if (plan.needs_boundary_state) commit.boundary = Fresh();
    return commit;
  }
  absl::StatusOr<CommitResult> Capture(const std::vector<int32_t>& tokens, uint64_t boundary,
                                       const PrefixModelTraits& traits, uint64_t tick,
                                       uint8_t fp = 1) {
    auto plan = index_->PlanCapture(Fingerprint(fp), tokens, boundary, traits);
    if (!plan.ok()) return plan.status();
    return index_->CommitCapture(*plan, CommitFor(*plan), tick);
  }
  EntryId MustCapture(const std::vector<int32_t>& tokens, uint64_t boundary,
                      const PrefixModelTraits& traits, uint64_t tick, uint8_t fp = 1) {
    auto result = Capture(tokens, boundary, traits, tick, fp);
    EXPECT_THAT(result, IsOk());
    EXPECT_THAT(index_->CheckInvariants(), IsOk());
    return result.ok() ? result->entry : EntryId{};
  }

  std::optional<PrefixIndex> index_;
  uint64_t next_handle_ = 0;
};

TEST(ChainBlockKeysTest, FormatIsDomainParentBlockSizeTokensLittleEndian) {
  const PlanFingerprint fp = Fingerprint(3);
  auto keys = ChainBlockKeys(fp, {1, 2, 258, -1, 5}, 2);
  ASSERT_THAT(keys, IsOk());
  ASSERT_EQ(keys->size(), 2u);  // the trailing partial block gets no key
  Sha256 first;
  first.Update("memra-kv/prefix/v1");
  first.Update(std::string_view(reinterpret_cast<const char*>(fp.data()), fp.size()));
  first.Update(
      std::string_view("\x02\0\0\0"
                       "\x01\0\0\0"
                       "\x02\0\0\0",
                       12));
  EXPECT_EQ((*keys)[0], first.Finish());
  Sha256 second;
  second.Update("memra-kv/prefix/v1");
  second.Update(std::string_view(reinterpret_cast<const char*>((*keys)[0].data()), 32));
  second.Update(
      std::string_view("\x02\0\0\0"
                       "\x02\x01\0\0"
                       "\xff\xff\xff\xff",
                       12));
  EXPECT_EQ((*keys)[1], second.Finish());
}

TEST(ChainBlockKeysTest, SameBlockAfterDifferentPrefixesHasDifferentKeys) {
  const std::vector<int32_t> block = {7, 7, 7, 7};
  auto a = ChainBlockKeys(Fingerprint(1), Tokens({{1, 2, 3, 4}, block}), 4);
  auto b = ChainBlockKeys(Fingerprint(1), Tokens({{1, 2, 3, 5}, block}), 4);
  auto again = ChainBlockKeys(Fingerprint(1), Tokens({{1, 2, 3, 4}, block}), 4);
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  EXPECT_NE((*a)[1], (*b)[1]);
  EXPECT_EQ(*a, *again);
}

TEST(ChainBlockKeysTest, DifferentFingerprintsNeverShareKeys) {
  const std::vector<int32_t> tokens = Seq(0, 64);
  auto a = ChainBlockKeys(Fingerprint(1), tokens, 4);
  auto b = ChainBlockKeys(Fingerprint(2), tokens, 4);
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  std::set<BlockKey> seen(a->begin(), a->end());
  for (const BlockKey& key : *b) EXPECT_FALSE(seen.contains(key));
  // The block size is hashed too: 8 tokens as 2x4 and as 1x8 never collide.
  auto wide = ChainBlockKeys(Fingerprint(1), tokens, 8);
  ASSERT_THAT(wide, IsOk());
  for (const BlockKey& key : *wide) EXPECT_FALSE(seen.contains(key));
}

TEST(ChainBlockKeysTest, HugeBlockSizeWithAShortQueryYieldsNoKeys) {
  auto keys = ChainBlockKeys(Fingerprint(1), Seq(0, 8), UINT32_MAX);
  ASSERT_THAT(keys, IsOk());
  EXPECT_THAT(*keys, IsEmpty());
}

TEST(ChainBlockKeysTest, RefusesZeroBlockSize) {
  EXPECT_THAT(ChainBlockKeys(Fingerprint(1), Seq(0, 8), 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("block size is 0")));
  EXPECT_THAT(PrefixIndex::Create(PrefixIndexOptions{.block_tokens = 0}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("block size is 0")));
  EXPECT_THAT(PrefixIndex::Create(PrefixIndexOptions{.block_tokens = 4, .event_capacity = 0}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("capacity is 0")));
}

TEST_F(PrefixIndexTest, SharedSystemPromptIsStoredOnce) {
  const std::vector<int32_t> system = Seq(1000, 8);  // 2 blocks
  const auto a = Tokens({system, Seq(1, 4)});
  const auto b = Tokens({system, Seq(50, 4)});
  const EntryId ea = MustCapture(a, 12, kFlat, 1);
  EXPECT_EQ(index_->StoredBytes(), 300u);
  auto plan_b = index_->PlanCapture(Fingerprint(1), b, 12, kFlat);
  ASSERT_THAT(plan_b, IsOk());
  EXPECT_EQ(plan_b->first_new_block, 2u);
  EXPECT_EQ(plan_b->new_block_count(), 1u);
  EXPECT_EQ(plan_b->new_bytes, 100u);
  auto commit_b = index_->CommitCapture(*plan_b, CommitFor(*plan_b), 2);
  ASSERT_THAT(commit_b, IsOk());
  EXPECT_EQ(commit_b->added_bytes, 100u);
  EXPECT_EQ(index_->StoredBytes(), 400u);  // not 600: the system prompt counts once
  EXPECT_EQ(index_->BlockCount(), 4u);
  EXPECT_THAT(index_->CheckInvariants(), IsOk());

  // Evicting A frees exactly A's own block and reports its handle (handles 1..3 were A's).
  auto evicted = index_->EvictEntry(ea);
  ASSERT_THAT(evicted, IsOk());
  EXPECT_EQ(evicted->freed_bytes, 100u);
  EXPECT_THAT(evicted->freed_handles, ElementsAre(3u));
  EXPECT_EQ(index_->StoredBytes(), 300u);
  EXPECT_THAT(index_->CheckInvariants(), IsOk());
  // B still restores in full.
  EXPECT_EQ(index_->Lookup(Fingerprint(1), b, kFlat).matched_tokens, 12u);
}

TEST_F(PrefixIndexTest, PositionAddressedPlansStopAtAnyStoredBlock) {
  const auto stored = Seq(0, 16);  // 4 blocks
  const EntryId e = MustCapture(stored, 16, kFlat, 1);

  auto exact = index_->Lookup(Fingerprint(1), stored, kFlat);
  EXPECT_EQ(exact.outcome, LookupOutcome::kHit);
  EXPECT_EQ(exact.matched_tokens, 16u);
  EXPECT_EQ(exact.entry, e);
  EXPECT_FALSE(exact.boundary.has_value());
  ASSERT_EQ(exact.blocks.size(), 4u);
  EXPECT_EQ(exact.blocks[0].stored, (StoredRef{.storage_handle = 1, .checksum = 7}));

  // Diverging in block 3: blocks 0..2 restore although nobody captured at 12.
  auto diverged = Tokens({Seq(0, 12), Seq(90, 4)});
  auto partial = index_->Lookup(Fingerprint(1), diverged, kFlat);
  EXPECT_EQ(partial.outcome, LookupOutcome::kPartial);
  EXPECT_EQ(partial.matched_tokens, 12u);
  EXPECT_EQ(partial.entry, e);  // pinning it protects the matched blocks

  // 18 tokens: 4 whole blocks, all matched; the trailing 2 tokens are the engine's to compute.
  EXPECT_EQ(index_->Lookup(Fingerprint(1), Seq(0, 18), kFlat).outcome, LookupOutcome::kHit);
  EXPECT_EQ(index_->Lookup(Fingerprint(1), Seq(0, 20), kFlat).outcome, LookupOutcome::kPartial);
  EXPECT_EQ(index_->Lookup(Fingerprint(1), Seq(5, 16), kFlat).outcome, LookupOutcome::kMiss);
  EXPECT_EQ(index_->Lookup(Fingerprint(2), stored, kFlat).outcome, LookupOutcome::kMiss);
  EXPECT_EQ(index_->Lookup(Fingerprint(1), Seq(0, 3), kFlat).outcome, LookupOutcome::kMiss);
  const PrefixIndexStats stats = index_->Stats();
  EXPECT_EQ(stats.lookup_hits, 2u);
  EXPECT_EQ(stats.lookup_partials, 2u);
  EXPECT_EQ(stats.lookup_misses, 3u);
}

TEST_F(PrefixIndexTest, BoundaryStatePlansRestoreOnlyAtCapturedBoundaries) {
  const auto tokens = Seq(0, 16);
  const EntryId at8 = MustCapture(tokens, 8, Hybrid(40), 1);
  const EntryId at16 = MustCapture(tokens, 16, Hybrid(50), 2);
  EXPECT_EQ(index_->StoredBytes(), 4 * 100u + 40 + 50);

  // Blocks exist up to 12, but recurrent/SWA state exists only at 8 and 16.
  auto twelve = index_->Lookup(Fingerprint(1), Seq(0, 12), Hybrid(1));
  EXPECT_EQ(twelve.outcome, LookupOutcome::kPartial);
  EXPECT_EQ(twelve.matched_tokens, 8u);
  EXPECT_EQ(twelve.entry, at8);
  ASSERT_TRUE(twelve.boundary.has_value());
  EXPECT_EQ(twelve.boundary_bytes, 40u);
  EXPECT_EQ(twelve.blocks.size(), 2u);

  auto full = index_->Lookup(Fingerprint(1), tokens, Hybrid(1));
  EXPECT_EQ(full.outcome, LookupOutcome::kHit);
  EXPECT_EQ(full.entry, at16);
  EXPECT_EQ(full.boundary_bytes, 50u);

  auto diverged = index_->Lookup(Fingerprint(1), Tokens({Seq(0, 12), Seq(99, 4)}), Hybrid(1));
  EXPECT_EQ(diverged.matched_tokens, 8u);

  // Evict the boundary at 8: its blocks stay (16 uses them), but 12 no longer restores at all.
  auto evicted = index_->EvictEntry(at8);
  ASSERT_THAT(evicted, IsOk());
  EXPECT_EQ(evicted->freed_bytes, 40u);
  EXPECT_EQ(index_->Lookup(Fingerprint(1), Seq(0, 12), Hybrid(1)).outcome, LookupOutcome::kMiss);
  EXPECT_THAT(index_->CheckInvariants(), IsOk());
}

TEST_F(PrefixIndexTest, RefusalsCarryCodeAndNumbers) {
  const auto tokens = Seq(0, 16);
  EXPECT_THAT(index_->PlanCapture(Fingerprint(1), tokens, 10, kFlat),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("boundary 10", "block size 4", "8, 12")));
  EXPECT_THAT(index_->PlanCapture(Fingerprint(1), tokens, 20, kFlat),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("20", "16 tokens")));
  EXPECT_THAT(index_->PlanCapture(Fingerprint(1), tokens, 0, kFlat),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("boundary 0")));
  EXPECT_THAT(index_->PlanCapture(
                  Fingerprint(1), tokens, 8,
                  PrefixModelTraits{
                      .position_addressed_only = true, .block_bytes = 100, .boundary_bytes = 7}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("boundary_bytes is 7")));
  EXPECT_THAT(index_->PlanCapture(Fingerprint(1), tokens, 8, Hybrid(0)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("boundary_bytes > 0")));
  EXPECT_THAT(index_->PlanCapture(
                  Fingerprint(1), tokens, 8,
                  PrefixModelTraits{
                      .position_addressed_only = true, .block_bytes = 0, .boundary_bytes = 0}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("block_bytes is 0")));

  MustCapture(tokens, 8, kFlat, 1);
  EXPECT_THAT(
      index_->PlanCapture(
          Fingerprint(1), tokens, 16,
          PrefixModelTraits{
              .position_addressed_only = true, .block_bytes = 64, .boundary_bytes = 0}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("block 0", "100 bytes", "say 64")));

  auto plan = index_->PlanCapture(Fingerprint(1), tokens, 16, kFlat);
  ASSERT_THAT(plan, IsOk());
  CaptureCommit short_commit;
  short_commit.new_blocks.push_back(Fresh());
  EXPECT_THAT(index_->CommitCapture(*plan, short_commit, 2),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("carries 1", "has 2")));
  CaptureCommit with_state = CommitFor(*plan);
  with_state.boundary = Fresh();
  EXPECT_THAT(index_->CommitCapture(*plan, with_state, 2),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("carries a boundary")));

  EXPECT_THAT(index_->Pin(EntryId{77}, 1),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs("entry 77")));
  EXPECT_THAT(index_->Unpin(EntryId{1}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstrs("entry 1 is not pinned")));
  EXPECT_THAT(index_->Evict(201), StatusIs(absl::StatusCode::kResourceExhausted,
                                           HasSubstrs("201", "only 200", "200 stored")));
  EXPECT_EQ(index_->StoredBytes(), 200u);  // refusals changed nothing
  EXPECT_EQ(index_->LastSequence(), 1u);
  EXPECT_THAT(index_->CheckInvariants(), IsOk());
}

TEST_F(PrefixIndexTest, CommitIsIdempotentAndSurvivesConcurrentChanges) {
  const auto tokens = Seq(0, 8);
  const EntryId e = MustCapture(tokens, 8, kFlat, 1);
  auto again = Capture(tokens, 8, kFlat, 5);
  ASSERT_THAT(again, IsOk());
  EXPECT_TRUE(again->already_present);
  EXPECT_EQ(again->entry, e);
  EXPECT_EQ(index_->GetEntry(e)->last_use_tick, 5u);
  EXPECT_EQ(index_->StoredBytes(), 200u);

  // Two captures of the same new block race: the second commit adopts the stored block and
  // returns its own copy's handle to free.
  const auto longer = Seq(0, 12);
  auto plan_x = index_->PlanCapture(Fingerprint(1), longer, 12, kFlat);
  auto plan_y = index_->PlanCapture(Fingerprint(1), Tokens({longer, Seq(70, 4)}), 16, kFlat);
  ASSERT_THAT(plan_x, IsOk());
  ASSERT_THAT(plan_y, IsOk());
  ASSERT_EQ(plan_y->new_block_count(), 2u);
  ASSERT_THAT(index_->CommitCapture(*plan_x, CommitFor(*plan_x), 6), IsOk());
  CaptureCommit commit_y = CommitFor(*plan_y);
  auto y = index_->CommitCapture(*plan_y, commit_y, 7);
  ASSERT_THAT(y, IsOk());
  EXPECT_THAT(y->unused_handles, ElementsAre(commit_y.new_blocks[0].storage_handle));
  EXPECT_EQ(y->added_bytes, 100u);
  EXPECT_EQ(index_->StoredBytes(), 400u);
  EXPECT_THAT(index_->CheckInvariants(), IsOk());

  // A block the plan counted as shared is evicted before the commit: ABORTED, nothing changes.
  Reset(PrefixIndexOptions{.block_tokens = 4, .budget_bytes = 1000, .epoch = 9});
  const EntryId base = MustCapture(tokens, 8, kFlat, 1);
  auto plan = index_->PlanCapture(Fingerprint(1), longer, 12, kFlat);
  ASSERT_THAT(plan, IsOk());
  ASSERT_THAT(index_->EvictEntry(base), IsOk());
  EXPECT_THAT(index_->CommitCapture(*plan, CommitFor(*plan), 3),
              StatusIs(absl::StatusCode::kAborted, HasSubstrs("shared block 0 of 3", "again")));
  EXPECT_EQ(index_->StoredBytes(), 0u);
  EXPECT_EQ(index_->EntryCount(), 0u);
}

TEST_F(PrefixIndexTest, LruEvictsOldestTickFirstAndPinTouches) {
  const EntryId e1 = MustCapture(Seq(100, 4), 4, kFlat, 10);
  const EntryId e2 = MustCapture(Seq(200, 4), 4, kFlat, 20);
  const EntryId e3 = MustCapture(Seq(300, 4), 4, kFlat, 30);
  ASSERT_THAT(index_->Pin(e1, 40), IsOk());  // a restore uses e1: it becomes the newest
  ASSERT_THAT(index_->Unpin(e1), IsOk());
  auto first = index_->Evict(1);
  ASSERT_THAT(first, IsOk());
  EXPECT_THAT(first->entries, ElementsAre(e2));
  auto rest = index_->Evict(200);
  ASSERT_THAT(rest, IsOk());
  EXPECT_THAT(rest->entries, ElementsAre(e3, e1));
  EXPECT_EQ(index_->StoredBytes(), 0u);
  EXPECT_EQ(index_->Stats().evicted_entries, 3u);
}

// A chat's captures nest: each turn's entry is a prefix of the next one's. Eviction for a few
// blocks takes the newest, longest entry's tail (the only bytes anything frees) and keeps the
// older prefixes, which the LRU order alone would have thrown away first for nothing.
TEST_F(PrefixIndexTest, EvictionPassesOverEntriesThatWouldFreeNothing) {
  const EntryId turn1 = MustCapture(Seq(0, 8), 8, kFlat, 1);    // blocks 1, 2
  const EntryId turn2 = MustCapture(Seq(0, 12), 12, kFlat, 2);  // + block 3
  const EntryId turn3 = MustCapture(Seq(0, 16), 16, kFlat, 3);  // + block 4
  absl::StatusOr<EvictionResult> trimmed = index_->Evict(100);  // one block's bytes
  ASSERT_THAT(trimmed, IsOk());
  EXPECT_THAT(trimmed->entries, ElementsAre(turn3));
  EXPECT_THAT(trimmed->freed_handles, ElementsAre(4u));
  EXPECT_TRUE(index_->GetEntry(turn1).ok());
  EXPECT_TRUE(index_->GetEntry(turn2).ok());
  // More than the tail: each eviction leaves the next prefix its own blocks, taken in turn.
  absl::StatusOr<EvictionResult> rest = index_->Evict(300);
  ASSERT_THAT(rest, IsOk());
  EXPECT_THAT(rest->entries, ElementsAre(turn2, turn1));
  EXPECT_THAT(rest->freed_handles, ElementsAre(3u, 1u, 2u));
  EXPECT_EQ(index_->StoredBytes(), 0u);
  // A budget squeeze follows the same rule.
  const EntryId short_again = MustCapture(Seq(0, 8), 8, kFlat, 4);
  const EntryId long_again = MustCapture(Seq(0, 16), 16, kFlat, 5);
  EvictionResult squeezed = index_->SetBudget(200);
  EXPECT_THAT(squeezed.entries, ElementsAre(long_again));
  EXPECT_TRUE(index_->GetEntry(short_again).ok());
  EXPECT_THAT(index_->CheckInvariants(), IsOk());
}

TEST_F(PrefixIndexTest, PinnedEntriesAndTheirSharedBlocksSurviveEvictionPressure) {
  const std::vector<int32_t> system = Seq(1000, 8);
  const EntryId a = MustCapture(Tokens({system, Seq(1, 4)}), 12, kFlat, 1);
  const EntryId b = MustCapture(Tokens({system, Seq(50, 4)}), 12, kFlat, 2);
  ASSERT_THAT(index_->Pin(a, 3), IsOk());
  ASSERT_THAT(index_->Pin(a, 4), IsOk());     // two concurrent restores
  EXPECT_EQ(index_->EvictableBytes(), 100u);  // only B's own block
  EXPECT_THAT(index_->Evict(101),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstrs("101", "only 100")));
  EXPECT_THAT(index_->EvictEntry(a),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstrs("pinned by 2")));
  EvictionResult squeezed = index_->SetBudget(0);
  EXPECT_THAT(squeezed.entries, ElementsAre(b));
  EXPECT_EQ(squeezed.freed_bytes, 100u);
  EXPECT_EQ(index_->StoredBytes(), 300u);  // over budget only by pinned bytes (invariant 6)
  EXPECT_EQ(index_->Stats().pinned_bytes, 300u);
  ASSERT_THAT(index_->Unpin(a), IsOk());
  EXPECT_EQ(index_->EnforceBudget().freed_bytes, 0u);  // still one pin
  ASSERT_THAT(index_->Unpin(a), IsOk());
  EXPECT_EQ(index_->EnforceBudget().freed_bytes, 300u);
  EXPECT_EQ(index_->StoredBytes(), 0u);
  EXPECT_EQ(index_->BlockCount(), 0u);
  EXPECT_THAT(index_->CheckInvariants(), IsOk());
}

TEST_F(PrefixIndexTest, BudgetIsEnforcedOnCommitByEvictingLru) {
  Reset(PrefixIndexOptions{.block_tokens = 4, .budget_bytes = 300, .epoch = 9});
  const EntryId first = MustCapture(Seq(0, 8), 8, kFlat, 1);
  auto second = Capture(Seq(100, 8), 8, kFlat, 2);
  ASSERT_THAT(second, IsOk());
  EXPECT_THAT(second->evicted_handles, UnorderedElementsAre(1u, 2u));
  EXPECT_FALSE(index_->GetEntry(first).ok());
  EXPECT_EQ(index_->StoredBytes(), 200u);

  EXPECT_THAT(index_->PlanCapture(Fingerprint(1), Seq(500, 16), 16, kFlat),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstrs("needs 400", "budget 300", "evictable 200")));
  // A capture that extends a pinned chain: its shared blocks count as pinned, not evictable.
  ASSERT_THAT(index_->Pin(second->entry, 3), IsOk());
  EXPECT_THAT(
      index_->PlanCapture(Fingerprint(1), Seq(100, 16), 16, kFlat),
      StatusIs(absl::StatusCode::kResourceExhausted, HasSubstrs("needs 200", "evictable 0")));
  EXPECT_EQ(index_->StoredBytes(), 200u);
  EXPECT_THAT(index_->CheckInvariants(), IsOk());
}

TEST_F(PrefixIndexTest, DropEntryRemovesItAndBlocksOnlyItUsed) {
  const std::vector<int32_t> system = Seq(1000, 8);
  const EntryId a = MustCapture(Tokens({system, Seq(1, 4)}), 12, Hybrid(30), 1);
  const EntryId b = MustCapture(Tokens({system, Seq(50, 4)}), 12, Hybrid(30), 2);
  ASSERT_THAT(index_->Pin(a, 3), IsOk());
  EXPECT_THAT(index_->DropEntry(a, "checksum mismatch"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstrs("pinned by 1")));
  ASSERT_THAT(index_->Unpin(a), IsOk());
  auto dropped = index_->DropEntry(a, "block 2 checksum mismatch");
  ASSERT_THAT(dropped, IsOk());
  EXPECT_EQ(dropped->freed_bytes, 130u);  // A's own block + A's boundary state
  EXPECT_THAT(dropped->freed_handles, UnorderedElementsAre(3u, 4u));
  EXPECT_EQ(index_->Stats().dropped_entries, 1u);
  auto replay = index_->EventsSince(9, 2);
  ASSERT_EQ(replay.events.size(), 1u);
  EXPECT_EQ(replay.events[0].kind, PrefixEventKind::kDropped);
  EXPECT_EQ(replay.events[0].reason, "block 2 checksum mismatch");
  EXPECT_TRUE(replay.events[0].boundary_key.has_value());
  EXPECT_EQ(index_->Lookup(Fingerprint(1), Tokens({system, Seq(1, 4)}), Hybrid(1)).outcome,
            LookupOutcome::kMiss);
  EXPECT_EQ(index_->Lookup(Fingerprint(1), Tokens({system, Seq(50, 4)}), Hybrid(1)).entry, b);
  EXPECT_THAT(index_->DropEntry(a, "again"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs("entry 1 not found")));
  EXPECT_THAT(index_->CheckInvariants(), IsOk());
}

TEST_F(PrefixIndexTest, GivenChainsAreFoundByTheirLastKeyAndCarryTheirOriginIntoEvents) {
  const BlockKey key = Sha256Of("engine block 0");
  EXPECT_THAT(index_->PlanCaptureOfChain(Fingerprint(3), {}, kFlat),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("no blocks")));
  auto plan = index_->PlanCaptureOfChain(Fingerprint(3), {key}, kFlat);
  ASSERT_THAT(plan, IsOk());
  EXPECT_EQ(plan->boundary_tokens, 4u);
  EXPECT_FALSE(index_->EntryEndingAt(key).has_value());
  plan->origin = PrefixEventOrigin{.block_hashes = {"h0"},
                                   .parent_block_hash = "p",
                                   .token_ids = {1, 2, 3, 4},
                                   .block_tokens = 4,
                                   .engine_id = 12,
                                   .from_engine_pool = true};
  auto committed = index_->CommitCapture(*plan, CommitFor(*plan), 1);
  ASSERT_THAT(committed, IsOk());
  EXPECT_EQ(index_->EntryEndingAt(key), committed->entry);
  // The entry keeps what its removal will name, not the tokens and parent (heap for its life).
  PrefixEventOrigin kept;
  kept.block_hashes = {"h0"};
  kept.engine_id = 12;
  kept.from_engine_pool = true;
  EXPECT_EQ(index_->GetEntry(committed->entry)->origin, kept);
  ASSERT_THAT(index_->EvictEntry(committed->entry), IsOk());
  const EventReplay replay = index_->EventsSince(9, 0);
  ASSERT_EQ(replay.events.size(), 2u);
  EXPECT_EQ(replay.events[0].origin, plan->origin);
  // Removal events name the blocks and the engine; the store's parent and tokens were news once.
  EXPECT_EQ(replay.events[1].kind, PrefixEventKind::kEvicted);
  EXPECT_THAT(replay.events[1].origin.block_hashes, ElementsAre("h0"));
  EXPECT_EQ(replay.events[1].origin.engine_id, 12u);
  EXPECT_TRUE(replay.events[1].origin.from_engine_pool);
  EXPECT_THAT(replay.events[1].origin.token_ids, IsEmpty());
  EXPECT_THAT(index_->CheckInvariants(), IsOk());
}

// While coalescing, engine-pool blocks that continue a run fold into one STORED event; a block
// whose parent is not the run's last, and any event from before the batch, are not folded into.
TEST_F(PrefixIndexTest, CoalescedPoolBlocksAreOneStoredEventPerRunWithinABatch) {
  auto store = [&](const std::string& hash, const std::string& parent, int32_t token,
                   uint64_t tick) {
    auto plan = index_->PlanCaptureOfChain(Fingerprint(3), {Sha256Of(hash)}, kFlat);
    ASSERT_THAT(plan, IsOk());
    plan->origin = PrefixEventOrigin{.block_hashes = {hash},
                                     .parent_block_hash = parent,
                                     .token_ids = {token, token, token, token},
                                     .block_tokens = 4,
                                     .engine_id = 12,
                                     .from_engine_pool = true};
    ASSERT_THAT(index_->CommitCapture(*plan, CommitFor(*plan), tick), IsOk());
  };
  store("h0", "", 0, 1);  // before the batch: never folded into
  index_->set_coalesce_pool_stored(true);
  store("h1", "h0", 1, 2);
  store("h2", "h1", 2, 3);
  store("x0", "elsewhere", 9, 4);  // not the run's next block: its own event
  index_->set_coalesce_pool_stored(false);
  store("x1", "x0", 10, 5);  // after the batch: its own event
  const EventReplay replay = index_->EventsSince(9, 0);
  ASSERT_EQ(replay.events.size(), 4u);
  EXPECT_THAT(replay.events[0].origin.block_hashes, ElementsAre("h0"));
  EXPECT_THAT(replay.events[1].origin.block_hashes, ElementsAre("h1", "h2"));
  EXPECT_EQ(replay.events[1].block_keys.size(), 2u);
  EXPECT_EQ(replay.events[1].origin.parent_block_hash, "h0");
  EXPECT_THAT(replay.events[1].origin.token_ids, ElementsAre(1, 1, 1, 1, 2, 2, 2, 2));
  EXPECT_THAT(replay.events[2].origin.block_hashes, ElementsAre("x0"));
  EXPECT_THAT(replay.events[3].origin.block_hashes, ElementsAre("x1"));
  // Sequences stay dense: a folded block takes none.
  EXPECT_EQ(replay.events[3].sequence, replay.events[0].sequence + 3);
}

// A folded event stays bounded (the replay buffer bounds events by count): a run longer than
// 1,024 blocks continues in a second event.
TEST_F(PrefixIndexTest, AFoldedRunIsCutAt1024Blocks) {
  Reset(PrefixIndexOptions{
      .block_tokens = 4, .budget_bytes = uint64_t{1} << 30, .epoch = 9, .event_capacity = 64});
  index_->set_coalesce_pool_stored(true);
  std::string parent;
  for (int i = 0; i < 1025; ++i) {
    const std::string hash = absl::StrCat("run-", i);
    auto plan = index_->PlanCaptureOfChain(Fingerprint(3), {Sha256Of(hash)}, kFlat);
    ASSERT_THAT(plan, IsOk());
    plan->origin = PrefixEventOrigin{.block_hashes = {hash},
                                     .parent_block_hash = parent,
                                     .token_ids = {},
                                     .block_tokens = 4,
                                     .engine_id = 12,
                                     .from_engine_pool = true};
    ASSERT_THAT(index_->CommitCapture(*plan, CommitFor(*plan), i + 1), IsOk());
    parent = hash;
  }
  index_->set_coalesce_pool_stored(false);
  const EventReplay replay = index_->EventsSince(9, 0);
  ASSERT_EQ(replay.events.size(), 2u);
  EXPECT_EQ(replay.events[0].origin.block_hashes.size(), 1024u);
  EXPECT_THAT(replay.events[1].origin.block_hashes, ElementsAre("run-1024"));
  EXPECT_EQ(replay.events[1].origin.parent_block_hash, "run-1023");
}

TEST_F(PrefixIndexTest, EventsAreSequencedReplayedAndGapped) {
  Reset(PrefixIndexOptions{
      .block_tokens = 4, .budget_bytes = 1 << 20, .epoch = 9, .event_capacity = 3});
  const std::vector<int32_t> system = Seq(1000, 8);
  MustCapture(Tokens({system, Seq(1, 4)}), 12, kFlat, 1);                     // seq 1: 3 blocks
  const EntryId b = MustCapture(Tokens({system, Seq(50, 4)}), 12, kFlat, 2);  // seq 2: 1 block
  auto fresh = index_->EventsSince(9, 0);
  EXPECT_FALSE(fresh.gap);
  ASSERT_EQ(fresh.events.size(), 2u);
  EXPECT_EQ(fresh.events[0].sequence, 1u);
  EXPECT_EQ(fresh.events[0].epoch, 9u);
  EXPECT_EQ(fresh.events[0].fingerprint, Fingerprint(1));
  EXPECT_EQ(fresh.events[0].block_keys.size(), 3u);
  EXPECT_EQ(fresh.events[1].sequence, 2u);
  auto b_keys = ChainBlockKeys(Fingerprint(1), Tokens({system, Seq(50, 4)}), 4);
  EXPECT_THAT(fresh.events[1].block_keys,
              ElementsAre((*b_keys)[2]));  // the shared 2 are not repeated

  ASSERT_THAT(index_->EvictEntry(b), IsOk());  // seq 3
  MustCapture(Seq(0, 4), 4, kFlat, 3);         // seq 4
  MustCapture(Seq(10, 4), 4, kFlat, 4);        // seq 5; the buffer holds 3..5
  EXPECT_EQ(index_->LastSequence(), 5u);
  auto missed = index_->EventsSince(9, 2);
  EXPECT_FALSE(missed.gap);
  ASSERT_EQ(missed.events.size(), 3u);
  EXPECT_EQ(missed.events[0].sequence, 3u);
  EXPECT_EQ(missed.events[0].kind, PrefixEventKind::kEvicted);
  EXPECT_THAT(missed.events[0].block_keys, ElementsAre((*b_keys)[2]));
  EXPECT_EQ(missed.events[2].sequence, 5u);

  EXPECT_TRUE(index_->EventsSince(9, 1).gap);  // event 2 fell off: resync
  EXPECT_TRUE(index_->EventsSince(9, 0).gap);  // a fresh subscriber after the buffer wrapped
  EXPECT_TRUE(index_->EventsSince(8, 4).gap);  // another epoch: the daemon restarted
  EXPECT_TRUE(index_->EventsSince(9, 6).gap);  // from the future
  auto current = index_->EventsSince(9, 5);
  EXPECT_FALSE(current.gap);
  EXPECT_THAT(current.events, IsEmpty());
  EXPECT_EQ(current.last_sequence, 5u);
}

TEST_F(PrefixIndexTest, LeastRecentFirstOrderAndMovedEventsChangeNoBookkeeping) {
  const EntryId e1 = MustCapture(Seq(100, 4), 4, kFlat, 10);
  const EntryId e2 = MustCapture(Seq(200, 4), 4, kFlat, 20);
  const EntryId e3 = MustCapture(Seq(300, 4), 4, kFlat, 30);
  ASSERT_THAT(index_->Pin(e1, 40), IsOk());
  EXPECT_THAT(index_->EntryIdsLeastRecentFirst(), ElementsAre(e2, e3, e1));  // pinned included
  ASSERT_THAT(index_->Unpin(e1), IsOk());
  const uint64_t stored = index_->StoredBytes();
  const uint64_t before = index_->LastSequence();
  auto keys = ChainBlockKeys(Fingerprint(1), Seq(200, 4), 4);
  ASSERT_THAT(keys, IsOk());
  index_->RecordMoved(Fingerprint(1), {(*keys)[0]}, std::nullopt, StorageMedium::kDisk);
  auto replay = index_->EventsSince(index_->epoch(), before);
  ASSERT_FALSE(replay.gap);
  ASSERT_EQ(replay.events.size(), 1u);
  EXPECT_EQ(replay.events[0].kind, PrefixEventKind::kMoved);
  EXPECT_EQ(replay.events[0].medium, StorageMedium::kDisk);
  EXPECT_EQ(StorageMediumName(replay.events[0].medium), "disk");
  EXPECT_THAT(replay.events[0].block_keys, ElementsAre((*keys)[0]));
  EXPECT_EQ(index_->StoredBytes(), stored);
  EXPECT_THAT(index_->EntryIdsLeastRecentFirst(), ElementsAre(e2, e3, e1));
  EXPECT_THAT(index_->CheckInvariants(), IsOk());
}

// A walk of the LRU order one entry at a time visits EntryIdsLeastRecentFirst's order, and
// survives evicting the entry it is at when it reads the next one first.
TEST_F(PrefixIndexTest, TheLruOrderWalkedOneEntryAtATimeSurvivesEvictingAsItGoes) {
  EXPECT_EQ(index_->LeastRecentEntry(), std::nullopt);
  const EntryId e1 = MustCapture(Seq(100, 4), 4, kFlat, 10);
  const EntryId e2 = MustCapture(Seq(200, 4), 4, kFlat, 20);
  const EntryId e3 = MustCapture(Seq(300, 4), 4, kFlat, 20);  // the same tick: by id
  ASSERT_THAT(index_->Pin(e1, 40), IsOk());
  std::vector<EntryId> walked;
  for (std::optional<EntryId> at = index_->LeastRecentEntry(); at.has_value();) {
    walked.push_back(*at);
    absl::StatusOr<std::optional<EntryId>> next = index_->EntryUsedAfter(*at);
    ASSERT_THAT(next, IsOk());
    if (*at == e2) {
      ASSERT_THAT(index_->EvictEntry(e2), IsOk());
    }
    at = *next;
  }
  EXPECT_THAT(walked, ElementsAre(e2, e3, e1));  // pinned included
  EXPECT_THAT(index_->EntryIdsLeastRecentFirst(), ElementsAre(e3, e1));
  EXPECT_THAT(index_->EntryUsedAfter(e1), IsOkAndHolds(std::nullopt));
  EXPECT_THAT(index_->EntryUsedAfter(e2),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs("prefix entry 2 not found")));
  EXPECT_THAT(index_->CheckInvariants(), IsOk());
}

// What evicting an entry would free: only the blocks no sibling shares, and its boundary state.
TEST_F(PrefixIndexTest, HandlesFreedByEvictingAreWhatOnlyThatEntryHolds) {
  // A prefix (handles 1, 2) and its extension (shares them, adds 3, 4).
  const EntryId shorter = MustCapture(Seq(0, 8), 8, kFlat, 1);
  const EntryId longer = MustCapture(Seq(0, 16), 16, kFlat, 2);
  // A boundary-state plan: a prefix (blocks 5, 6, boundary 7) and its extension (8, boundary 9).
  const EntryId hybrid_shorter = MustCapture(Seq(500, 8), 8, Hybrid(30), 3, 2);
  const EntryId hybrid_longer = MustCapture(Seq(500, 12), 12, Hybrid(30), 4, 2);
  const uint64_t stored = index_->StoredBytes();
  const uint64_t sequence = index_->LastSequence();
  EXPECT_THAT(index_->HandlesFreedByEvicting(shorter), IsOkAndHolds(IsEmpty()));
  EXPECT_THAT(index_->HandlesFreedByEvicting(longer), IsOkAndHolds(ElementsAre(3u, 4u)));
  EXPECT_THAT(index_->HandlesFreedByEvicting(hybrid_shorter), IsOkAndHolds(ElementsAre(7u)));
  EXPECT_THAT(index_->HandlesFreedByEvicting(hybrid_longer), IsOkAndHolds(ElementsAre(8u, 9u)));
  // A pure query: nothing changed, no event.
  EXPECT_EQ(index_->StoredBytes(), stored);
  EXPECT_EQ(index_->LastSequence(), sequence);
  EXPECT_EQ(index_->EntryCount(), 4u);

  // Once the extension is gone the prefix's blocks are its own; eviction frees exactly them.
  absl::StatusOr<EvictionResult> evicted = index_->EvictEntry(longer);
  ASSERT_THAT(evicted, IsOk());
  EXPECT_THAT(evicted->freed_handles, ElementsAre(3u, 4u));
  EXPECT_THAT(index_->HandlesFreedByEvicting(shorter), IsOkAndHolds(ElementsAre(1u, 2u)));
  evicted = index_->EvictEntry(shorter);
  ASSERT_THAT(evicted, IsOk());
  EXPECT_THAT(evicted->freed_handles, ElementsAre(1u, 2u));

  // EvictEntry's refusals, with the entry's id (and its pins).
  ASSERT_THAT(index_->Pin(hybrid_shorter, 5), IsOk());
  ASSERT_THAT(index_->Pin(hybrid_shorter, 6), IsOk());
  EXPECT_THAT(index_->HandlesFreedByEvicting(hybrid_shorter),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("prefix entry 3 is pinned by 2 restores")));
  EXPECT_THAT(index_->HandlesFreedByEvicting(longer),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs("prefix entry 2 not found")));
  EXPECT_THAT(index_->HandlesFreedByEvicting(EntryId{99}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs("prefix entry 99 not found")));
  EXPECT_THAT(index_->CheckInvariants(), IsOk());
}

// Seeded random sequences of capture / lookup / pin / unpin / evict / budget / drop over a
// small vocabulary (so chains share), checked against an independent model of live handles.
TEST_F(PrefixIndexTest, RandomOperationsKeepTheLedgerAndNeverFreePinnedBytes) {
  for (uint32_t seed : {1u, 2u, 3u, 4u, 5u}) {
    std::mt19937_64 rng(seed);
    Reset(PrefixIndexOptions{
        .block_tokens = 2, .budget_bytes = 3000, .epoch = 9, .event_capacity = 1 << 16});
    std::map<uint64_t, uint64_t> live;  // storage handle -> bytes
    std::map<EntryId, uint32_t> pins;   // pins the test holds
    uint64_t max_pinned = 0;
    std::vector<std::vector<int32_t>> history;  // captured prompts
    auto free_handles = [&](const std::vector<uint64_t>& handles) {
      for (uint64_t h : handles) {
        ASSERT_TRUE(live.contains(h)) << "freed a handle that is not live: " << h;
        live.erase(h);
      }
    };
    auto pinned_handles = [&] {
      std::set<uint64_t> out;
      for (const auto& [id, n] : pins) {
        auto view = index_->GetEntry(id);
        EXPECT_THAT(view, IsOk());
        if (!view.ok()) continue;
        for (const LookupBlock& block : view->blocks) out.insert(block.stored.storage_handle);
        if (view->boundary) out.insert(view->boundary->storage_handle);
      }
      return out;
    };
    auto check_not_pinned = [&](const std::set<uint64_t>& before,
                                const std::vector<uint64_t>& freed) {
      for (uint64_t h : freed) EXPECT_FALSE(before.contains(h)) << "freed pinned handle " << h;
    };
    for (int step = 0; step < 600; ++step) {
      const uint8_t fp = static_cast<uint8_t>(1 + rng() % 2);
      const bool flat = fp == 1;  // fingerprint 1 is position-addressed, 2 has boundary state
      std::vector<int32_t> tokens(2 * (1 + rng() % 6));
      for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % 3);
      PrefixModelTraits traits = flat ? PrefixModelTraits{.position_addressed_only = true,
                                                          .block_bytes = 100,
                                                          .boundary_bytes = 0}
                                      : PrefixModelTraits{.position_addressed_only = false,
                                                          .block_bytes = 100,
                                                          .boundary_bytes = 10 + rng() % 90};
      const std::set<uint64_t> pinned_before = pinned_handles();
      // Weights: capture 4, lookup (+ pin) 3, unpin 1, evict 1, budget or drop 1.
      constexpr int kOp[10] = {0, 0, 0, 0, 2, 2, 2, 3, 4, 5};
      switch (kOp[rng() % 10]) {
        case 0: {
          const uint64_t boundary = 2 * (1 + rng() % (tokens.size() / 2));
          auto plan = index_->PlanCapture(Fingerprint(fp), tokens, boundary, traits);
          if (!plan.ok()) {
            EXPECT_EQ(plan.status().code(), absl::StatusCode::kResourceExhausted);
            break;
          }
          history.push_back(tokens);
          CaptureCommit commit = CommitFor(*plan);
          for (uint64_t i = 0; i < commit.new_blocks.size(); ++i) {
            live[commit.new_blocks[i].storage_handle] = 100;
          }
          if (commit.boundary) live[commit.boundary->storage_handle] = plan->boundary_bytes;
          auto result = index_->CommitCapture(*plan, commit, step);
          ASSERT_THAT(result, IsOk());
          free_handles(result->unused_handles);
          check_not_pinned(pinned_before, result->evicted_handles);
          free_handles(result->evicted_handles);
          break;
        }
        case 2: {
          // Half the lookups replay a captured prompt (possibly under the other plan).
          if (!history.empty() && rng() % 2 == 0) tokens = history[rng() % history.size()];
          LookupResult hit = index_->Lookup(Fingerprint(fp), tokens, traits);
          if (hit.entry && rng() % 2 == 0) {
            ASSERT_THAT(index_->Pin(*hit.entry, step), IsOk());
            ++pins[*hit.entry];
            // Every matched block belongs to the pinned entry's chain.
            auto view = index_->GetEntry(*hit.entry);
            ASSERT_THAT(view, IsOk());
            ASSERT_GE(view->blocks.size(), hit.blocks.size());
            for (size_t i = 0; i < hit.blocks.size(); ++i) {
              EXPECT_EQ(view->blocks[i].key, hit.blocks[i].key);
            }
            if (!flat) {
              EXPECT_EQ(view->boundary, hit.boundary);
            }
          }
          break;
        }
        case 3: {
          if (pins.empty()) break;
          auto it = std::next(pins.begin(), rng() % pins.size());
          ASSERT_THAT(index_->Unpin(it->first), IsOk());
          if (--it->second == 0) pins.erase(it);
          // The daemon enforces the budget after a restore ends (invariant 6).
          EvictionResult after = index_->EnforceBudget();
          check_not_pinned(pinned_handles(), after.freed_handles);
          free_handles(after.freed_handles);
          break;
        }
        case 4: {
          const uint64_t need = rng() % 250;
          const uint64_t evictable = index_->EvictableBytes();
          auto evicted = index_->Evict(need);
          if (need > evictable) {
            EXPECT_THAT(evicted, StatusIs(absl::StatusCode::kResourceExhausted,
                                          HasSubstrs(std::to_string(need))));
            break;
          }
          ASSERT_THAT(evicted, IsOk());
          EXPECT_GE(evicted->freed_bytes, need);
          check_not_pinned(pinned_before, evicted->freed_handles);
          free_handles(evicted->freed_handles);
          break;
        }
        case 5: {
          if (rng() % 2 == 0) {
            EvictionResult squeezed = index_->SetBudget(1000 + rng() % 3000);
            check_not_pinned(pinned_before, squeezed.freed_handles);
            free_handles(squeezed.freed_handles);
          } else {
            const std::vector<EntryId> ids = index_->EntryIds();
            if (ids.empty()) break;
            const EntryId victim = ids[rng() % ids.size()];
            // The query agrees with what removing the entry then frees.
            auto would_free = index_->HandlesFreedByEvicting(victim);
            auto dropped = index_->DropEntry(victim, "random");
            if (pins.contains(victim)) {
              EXPECT_THAT(dropped,
                          StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstrs("pinned by")));
              EXPECT_THAT(would_free,
                          StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstrs("pinned by")));
              break;
            }
            ASSERT_THAT(dropped, IsOk());
            EXPECT_THAT(would_free, IsOkAndHolds(dropped->freed_handles));
            free_handles(dropped->freed_handles);
          }
          break;
        }
      }
      ASSERT_THAT(index_->CheckInvariants(), IsOk()) << "seed " << seed << " step " << step;
      uint64_t live_bytes = 0;
      for (const auto& [h, bytes] : live) live_bytes += bytes;
      ASSERT_EQ(index_->StoredBytes(), live_bytes) << "seed " << seed << " step " << step;
      // Invariant 6: over budget only by pinned bytes.
      if (index_->StoredBytes() > index_->budget_bytes()) {
        ASSERT_EQ(index_->EvictableBytes(), 0u) << "seed " << seed << " step " << step;
      }
      for (const auto& [id, n] : pins) ASSERT_EQ(index_->GetEntry(id)->pins, n);
      max_pinned = std::max(max_pinned, index_->Stats().pinned_bytes);
    }
    // The sequence really exercised sharing, eviction, drops and hits.
    const PrefixIndexStats stats = index_->Stats();
    EXPECT_GT(stats.evicted_entries, 10u) << "seed " << seed;
    EXPECT_GT(stats.dropped_entries, 0u) << "seed " << seed;
    EXPECT_GT(stats.lookup_hits + stats.lookup_partials, 20u) << "seed " << seed;
    EXPECT_GT(max_pinned, 0u) << "seed " << seed;
    // Events are gapless.
    auto replay = index_->EventsSince(9, 0);
    ASSERT_FALSE(replay.gap);
    for (size_t i = 0; i < replay.events.size(); ++i) {
      ASSERT_EQ(replay.events[i].sequence, i + 1);
    }
  }
}

}  // namespace
}  // namespace memra
