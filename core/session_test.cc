#include "core/session.h"

#include <algorithm>
#include <optional>
#include <vector>

#include "gtest/gtest.h"
#include "core/status_macros.h"
#include "tests/seeded_random.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::IsOkAndHolds;
using ::memra::testing::StatusIs;
using ::testing::Contains;

// A small hybrid model with one layer of every state kind:
//   0 flat KV (128 K/V elements per token: q8_0 4 x 34 = 136 B, q5_1 4 x 24 = 96 B),
//   1 sliding KV, window 32, ring-backed,
//   2 recurrent (conv 4 x 3 f32, ssm 8 f32),
//   3 latent (width 8, DSA indexer 8 f32 per token, pool 4, a 16-row tail ring).
ModelPlan HybridPlan() {
  ModelPlan plan;
  plan.name = "hybrid-test";
  plan.swa_ring = true;
  plan.index_ring_rows = 16;
  LayerPlan flat;
  flat.index = 0;
  flat.kind = StateKind::kKv;
  flat.head_dim_k = flat.head_dim_v = 128;
  flat.n_head_kv = 1;
  LayerPlan sliding = flat;
  sliding.index = 1;
  sliding.kind = StateKind::kSlidingKv;
  sliding.window = 32;
  LayerPlan recurrent;
  recurrent.index = 2;
  recurrent.kind = StateKind::kRecurrent;
  recurrent.conv_width = 4;
  recurrent.conv_kernel = 4;
  recurrent.state_width = 8;
  LayerPlan latent;
  latent.index = 3;
  latent.kind = StateKind::kLatent;
  latent.latent_width = 8;
  latent.index_width = 8;
  latent.index_pool = 4;
  plan.layers = {flat, sliding, recurrent, latent};
  return plan;
}

// A session of `model` at `capacity`.
SessionState SessionOf(const ModelPlan& model, uint64_t capacity, bool spec_snapshot,
                       uint64_t cache_id) {
  SessionShape shape;
  shape.capacity = capacity;
  shape.spec_snapshot = spec_snapshot;
  absl::StatusOr<SessionPlan> plan = PlanSession(model, FormatDefaults(), shape);
  EXPECT_THAT(plan, IsOk());
  absl::StatusOr<SessionState> session = SessionState::Create(cache_id, *plan, capacity);
  EXPECT_THAT(session, IsOk());
  return *std::move(session);
}

SessionState MakeSession(uint64_t capacity, bool spec_snapshot = true, uint64_t cache_id = 1) {
  return SessionOf(HybridPlan(), capacity, spec_snapshot, cache_id);
}

// One step: begin, append `rows`, publish, commit `accepted`.
uint64_t Step(SessionState& session, uint64_t rows, uint64_t accepted) {
  absl::StatusOr<TransactionId> transaction = session.Begin();
  EXPECT_THAT(transaction, IsOk());
  EXPECT_THAT(session.PrepareAppend(transaction->generation, rows), IsOk());
  EXPECT_THAT(session.PublishAppend(transaction->generation), IsOk());
  absl::StatusOr<uint64_t> committed = session.Commit(transaction->generation, accepted);
  EXPECT_THAT(committed, IsOk());
  return *committed;
}

TEST(Session, StartsEmptyWithEveryMirrorAtZero) {
  SessionState session = MakeSession(10'000);
  EXPECT_EQ(session.committed_len(), 0u);
  EXPECT_EQ(session.kv().layer_count(), 2u);
  EXPECT_EQ(session.latent().size(), 1u);
  EXPECT_EQ(session.recurrent_layers(), std::vector<uint32_t>{2});
  for (const MirrorValue& mirror : session.Mirrors()) EXPECT_EQ(mirror.value, 0);
  EXPECT_THAT(session.Mirrors(), Contains(MirrorValue{{1, PlaneKind::kBaseMirror}, 0}));
}

TEST(Session, PartialCommitMovesEveryLayerKindTogether) {
  SessionState session = MakeSession(10'000);
  EXPECT_EQ(Step(session, 10, 7), 7u);
  EXPECT_EQ(session.staged_len(), 7u);
  EXPECT_EQ(session.position(), 7u);
  EXPECT_EQ(session.latent()[0].len, 7u);
  EXPECT_EQ(session.latent()[0].index_pools_ready, 1u) << "pool keys for rows 8..9 were dropped";
  EXPECT_THAT(session.Mirrors(), Contains(MirrorValue{{0, PlaneKind::kLenMirror}, 7}));
  EXPECT_THAT(session.Mirrors(), Contains(MirrorValue{{3, PlaneKind::kLenMirror}, 7}));
}

TEST(Session, TransactionRefusalsChangeNothing) {
  SessionState session = MakeSession(64);
  absl::StatusOr<TransactionId> transaction = session.Begin();
  ASSERT_THAT(transaction, IsOk());
  EXPECT_THAT(session.PublishAppend(transaction->generation),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("no prepared append for transaction generation 1")));
  EXPECT_THAT(session.PrepareAppend(transaction->generation + 1, 1),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("stale KV transaction generation 2 (active: 1)")));
  EXPECT_THAT(session.PrepareAppend(transaction->generation, 65),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("65 > 64")));
  EXPECT_THAT(session.Commit(transaction->generation, 1),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("accepts 1 rows from a 0-row transaction")));
  EXPECT_EQ(session.staged_len(), 0u);
  ASSERT_THAT(session.Abort(transaction->generation), IsOk());
  EXPECT_THAT(session.Commit(transaction->generation, 0),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstrs("active: none")));
}

TEST(Session, RewindTruncatesLatentPoolKeysAndRefusesForward) {
  SessionState session = MakeSession(10'000);
  Step(session, 13, 13);
  EXPECT_EQ(session.latent()[0].index_pools_ready, 3u);
  ASSERT_THAT(session.Rewind(6), IsOk());
  EXPECT_EQ(session.committed_len(), 6u);
  EXPECT_EQ(session.latent()[0].len, 6u);
  EXPECT_EQ(session.latent()[0].index_pools_ready, 1u);
  EXPECT_THAT(session.Rewind(7),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("target 7 is past the staged length 6")));
  EXPECT_FALSE(session.CanRewindTo(7));
}

// The reference's CacheSnapshot covers two of four planes ("a known hole"): rolling back a
// latent-bearing cache left every MLA layer at its longer len. Ours moves all four.
TEST(Session, SpecRollbackCoversAllFourPlaneKindsClosingTheReferenceHole) {
  SessionState session = MakeSession(10'000);
  Step(session, 7, 7);
  absl::StatusOr<std::vector<PlaneCopy>> snapshot = session.SpecSnapshot();
  ASSERT_THAT(snapshot, IsOk());
  EXPECT_EQ(*snapshot, (std::vector<PlaneCopy>{
                           {{2, PlaneKind::kConvState}, 0, {2, PlaneKind::kSpecConv}, 0, 48},
                           {{2, PlaneKind::kSsmState}, 0, {2, PlaneKind::kSpecSsm}, 0, 32}}));
  // Draft + verify 5 tokens, accept all of them into the staged state, then roll back to 2.
  Step(session, 5, 5);
  absl::StatusOr<std::vector<PlaneCopy>> rollback = session.SpecRollback(2);
  ASSERT_THAT(rollback, IsOk());
  EXPECT_EQ(rollback->size(), 2u);
  EXPECT_EQ((*rollback)[0].src, (PlaneRef{2, PlaneKind::kSpecConv}));
  EXPECT_EQ(session.committed_len(), 9u);
  EXPECT_EQ(session.latent()[0].len, 9u) << "the latent plane moves with the KV planes";
  EXPECT_EQ(session.latent()[0].index_pools_ready, 2u);
  EXPECT_EQ(session.position(), 7u) << "recurrent state is at the snapshot; 2 tokens to replay";
  EXPECT_THAT(session.Mirrors(), Contains(MirrorValue{{3, PlaneKind::kLenMirror}, 9}));
}

// docs/rules.md#spec-snapshot-and-rollback: a rollback does not use the snapshot up. Every
// rollback (and a refused one, a rewind or a commit between them) leaves it valid and returns
// the same restore copies; only a new SpecSnapshot, Reset, Hydrate or Grow (the target) ends it.
TEST(Session, ASpecSnapshotStaysValidAcrossRollbacksUntilReplaced) {
  SessionState session = MakeSession(10'000);
  Step(session, 7, 7);
  ASSERT_THAT(session.SpecSnapshot(), IsOk());
  const std::vector<PlaneCopy> restore = {
      {{2, PlaneKind::kSpecConv}, 0, {2, PlaneKind::kConvState}, 0, 48},
      {{2, PlaneKind::kSpecSsm}, 0, {2, PlaneKind::kSsmState}, 0, 32}};

  Step(session, 5, 5);  // round 1: 5 drafts staged and committed, 2 accepted
  EXPECT_THAT(session.SpecRollback(2), IsOkAndHolds(restore));
  EXPECT_EQ(session.committed_len(), 9u);
  EXPECT_EQ(session.position(), 7u);
  EXPECT_TRUE(session.spec_snapshot_valid());

  Step(session, 3, 3);  // round 2 from the same snapshot: 12 rows, none accepted
  EXPECT_THAT(session.SpecRollback(0), IsOkAndHolds(restore));
  EXPECT_EQ(session.committed_len(), 7u);
  EXPECT_EQ(session.position(), 7u);
  EXPECT_TRUE(session.spec_snapshot_valid());

  // A refused rollback, a rewind and a commit leave it valid too.
  EXPECT_THAT(session.SpecRollback(2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("target 9 (snapshot 7 + accepted 2) is past the staged length 7")));
  Step(session, 4, 4);
  ASSERT_THAT(session.Rewind(10), IsOk());
  EXPECT_TRUE(session.spec_snapshot_valid());
  EXPECT_THAT(session.SpecRollback(1), IsOkAndHolds(restore));
  EXPECT_EQ(session.committed_len(), 8u);

  // A new snapshot replaces it: rollbacks now return to 8.
  ASSERT_THAT(session.SpecSnapshot(), IsOk());
  Step(session, 2, 2);
  EXPECT_THAT(session.SpecRollback(0), IsOkAndHolds(restore));
  EXPECT_EQ(session.committed_len(), 8u);

  ASSERT_THAT(session.Reset(), IsOk());
  EXPECT_FALSE(session.spec_snapshot_valid());
  EXPECT_THAT(session.SpecRollback(0),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("spec rollback: no spec snapshot was taken")));

  ASSERT_THAT(session.SpecSnapshot(), IsOk());  // at length 0, on a fresh session
  ASSERT_THAT(session.Hydrate(40, {}), IsOk());
  EXPECT_FALSE(session.spec_snapshot_valid()) << "hydration ends it";

  SessionState source = MakeSession(10'000, true, 1);
  Step(source, 6, 6);
  ASSERT_THAT(source.SpecSnapshot(), IsOk());
  SessionState target = MakeSession(20'000, true, 2);
  ASSERT_THAT(SessionState::Grow(source, target), IsOk());
  EXPECT_TRUE(source.spec_snapshot_valid()) << "the source is never changed";
  EXPECT_FALSE(target.spec_snapshot_valid()) << "the grown session starts without one";
}

TEST(Session, SpecRefusals) {
  SessionState session = MakeSession(10'000);
  EXPECT_THAT(session.SpecRollback(0),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("no spec snapshot was taken")));
  Step(session, 4, 4);
  ASSERT_THAT(session.SpecSnapshot(), IsOk());
  EXPECT_THAT(session.SpecRollback(3),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("target 7 (snapshot 4 + accepted 3) is past the staged length 4")));
  EXPECT_THAT(session.SpecRollback(UINT64_MAX),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("overflows")));
  absl::StatusOr<TransactionId> open = session.Begin();
  ASSERT_THAT(open, IsOk());
  EXPECT_THAT(session.SpecSnapshot(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("generation 2 is active at base 4")));
  ASSERT_THAT(session.Abort(open->generation), IsOk());

  SessionState without = MakeSession(10'000, /*spec_snapshot=*/false);
  EXPECT_THAT(without.SpecSnapshot(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("without spec snapshot buffers (1 recurrent layers")));
}

// docs/rules.md#spec-snapshot-and-rollback: `spec_snapshot` is optional at create. A session
// with recurrent layers created without it decodes and rewinds; only SpecSnapshot refuses (and
// so SpecRollback, having nothing to roll back to). A plan without recurrent layers needs no
// buffers to speculate: its snapshot records lengths only.
TEST(Session, SpecBuffersAreNeededOnlyToSnapshotRecurrentLayers) {
  SessionState without = MakeSession(10'000, /*spec_snapshot=*/false);
  EXPECT_FALSE(without.has_spec_buffers());
  EXPECT_EQ(Step(without, 9, 9), 9u);
  ASSERT_THAT(without.Rewind(5), IsOk());
  const std::vector<MirrorValue> before = without.Mirrors();
  EXPECT_THAT(without.SpecSnapshot(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("spec snapshot: the session was created without spec snapshot "
                                  "buffers (1 recurrent layers need them)")));
  EXPECT_FALSE(without.spec_snapshot_valid());
  EXPECT_THAT(without.SpecRollback(0),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("spec rollback: no spec snapshot was taken")));
  EXPECT_EQ(without.committed_len(), 5u);
  EXPECT_EQ(without.Mirrors(), before);

  ModelPlan attention_only = HybridPlan();
  attention_only.layers.erase(attention_only.layers.begin() + 2);  // the recurrent layer
  attention_only.layers[2].index = 2;
  SessionState plain = SessionOf(attention_only, 10'000, /*spec_snapshot=*/false, 2);
  Step(plain, 6, 6);
  absl::StatusOr<std::vector<PlaneCopy>> snapshot = plain.SpecSnapshot();
  ASSERT_THAT(snapshot, IsOk());
  EXPECT_TRUE(snapshot->empty()) << "no recurrent state to copy";
  Step(plain, 4, 4);
  EXPECT_THAT(plain.SpecRollback(1), IsOkAndHolds(::testing::IsEmpty()));
  EXPECT_EQ(plain.committed_len(), 7u);
}

TEST(Session, SpecRollbackRefusesALappedRingAndChangesNothing) {
  SessionState session = MakeSession(100'000);
  ASSERT_THAT(session.SpecSnapshot(), IsOk());
  uint64_t len = 0;
  for (int i = 0; i < 4; ++i) len = Step(session, 4096, 4096);
  const std::vector<MirrorValue> before = session.Mirrors();
  EXPECT_THAT(session.SpecRollback(0),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("SWA ring rewind checkpoint has been lapped; full re-prime "
                                  "required (rollback target 0: layer 1 window 32 starts at "
                                  "row 0, below ring base 12256)")));
  EXPECT_EQ(session.committed_len(), len);
  EXPECT_EQ(session.Mirrors(), before);
}

// docs/rules.md#rewind: a rewind into a window the ring has lapped names the lap (as a spec
// rollback does), not the capacity; the session is unchanged.
TEST(Session, RewindIntoALappedRingWindowNamesTheLapAndChangesNothing) {
  SessionState session = MakeSession(100'000);
  uint64_t len = 0;
  for (int i = 0; i < 4; ++i) len = Step(session, 4096, 4096);
  ASSERT_EQ(len, 16'384u);
  ASSERT_EQ(session.kv().ring(1)->base(), 12'256u);
  const std::vector<MirrorValue> before = session.Mirrors();
  EXPECT_FALSE(session.CanRewindTo(100));
  EXPECT_THAT(session.Rewind(100),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("SWA ring rewind checkpoint has been lapped; full re-prime "
                                  "required (rewind target 100: layer 1 window 32 starts at "
                                  "row 64, below ring base 12256)")));
  EXPECT_EQ(session.committed_len(), len);
  EXPECT_EQ(session.Mirrors(), before);
}

TEST(Session, TaintRefusesReuseSnapshotAndTransactions) {
  SessionState session = MakeSession(64);
  Step(session, 3, 3);
  session.MarkTainted();
  EXPECT_THAT(session.Begin(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                        HasSubstrs("begin transaction", "tainted")));
  EXPECT_THAT(session.SpecSnapshot(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstrs("spec snapshot")));
  EXPECT_THAT(session.Reset(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstrs("reset", "tainted")));
  EXPECT_THAT(session.Rewind(1), StatusIs(absl::StatusCode::kFailedPrecondition,
                                          HasSubstrs("rewind", "tainted")));
  EXPECT_EQ(session.committed_len(), 3u);
}

TEST(Session, ResetEmptiesTheSessionButKeepsCountingGenerations) {
  SessionState session = MakeSession(64);
  Step(session, 9, 9);
  ASSERT_THAT(session.SpecSnapshot(), IsOk());
  absl::StatusOr<TransactionId> stale = session.Begin();
  ASSERT_THAT(stale, IsOk());
  ASSERT_THAT(session.Reset(), IsOk());
  EXPECT_EQ(session.committed_len(), 0u);
  EXPECT_EQ(session.latent()[0].len, 0u);
  EXPECT_FALSE(session.spec_snapshot_valid());
  for (const MirrorValue& mirror : session.Mirrors()) EXPECT_EQ(mirror.value, 0);
  EXPECT_THAT(session.PrepareAppend(stale->generation, 1),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstrs("stale")));
  absl::StatusOr<TransactionId> next = session.Begin();
  ASSERT_THAT(next, IsOk());
  EXPECT_EQ(next->generation, stale->generation + 1);
}

TEST(Session, HydrateFreshSessionDefaultsRingsToTheAlignedLiveWindow) {
  SessionState session = MakeSession(10'000);
  ASSERT_THAT(session.Hydrate(8762, {}), IsOk());
  EXPECT_EQ(session.committed_len(), 8762u);
  EXPECT_EQ(session.position(), 8762u);
  EXPECT_EQ(session.kv().ring(1)->base(), (8762u - 31) & ~uint64_t{31});
  EXPECT_EQ(session.latent()[0].len, 8762u);
  EXPECT_EQ(session.latent()[0].index_pools_ready, 8762u / 4);
  EXPECT_THAT(session.Mirrors(), Contains(MirrorValue{{1, PlaneKind::kLenMirror}, 8762}));
  EXPECT_EQ(Step(session, 10, 10), 8772u) << "transactions continue from the hydrated length";
}

TEST(Session, HydrateRefusalsChangeNothing) {
  SessionState session = MakeSession(10'000);
  const uint64_t flat_not_at_zero[] = {1, 0};
  EXPECT_THAT(session.Hydrate(100, flat_not_at_zero),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("layer 0", "must start at absolute row zero, got 1")));
  EXPECT_THAT(session.Hydrate(10'001, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("exceeds capacity 10000")));
  const uint64_t lapped[] = {0, 0};
  EXPECT_THAT(session.Hydrate(8762, lapped),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("layer 1", "requires 8762 rows in a 4671-row ring")));
  EXPECT_EQ(session.committed_len(), 0u);
  EXPECT_EQ(session.latent()[0].len, 0u);
  Step(session, 3, 3);
  EXPECT_THAT(session.Hydrate(5, {}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstrs("must be fresh")));
  EXPECT_EQ(session.committed_len(), 3u);
}

// The plan MakeSession uses, for Recover.
SessionPlan HybridSessionPlan(uint64_t capacity) {
  SessionShape shape;
  shape.capacity = capacity;
  shape.spec_snapshot = true;
  absl::StatusOr<SessionPlan> plan = PlanSession(HybridPlan(), FormatDefaults(), shape);
  EXPECT_THAT(plan, IsOk());
  return *plan;
}

TEST(Recover, BringsBackTheCommittedLengthRingBaseAndGenerations) {
  SessionState session = MakeSession(100'000);
  for (int i = 0; i < 4; ++i) Step(session, 4096, 4096);  // the window-32 ring has rebased
  const CommittedRecord record = session.Committed();
  ASSERT_EQ(record.ring_bases.size(), 2u);
  EXPECT_EQ(record.ring_bases[0], 0u);
  EXPECT_GT(record.ring_bases[1], 0u) << "the test needs a rebased ring";
  absl::StatusOr<SessionState> recovered =
      SessionState::Recover(7, HybridSessionPlan(100'000), 100'000, record);
  ASSERT_THAT(recovered, IsOk());
  EXPECT_EQ(recovered->committed_len(), 16384u);
  EXPECT_EQ(recovered->position(), 16384u);
  EXPECT_EQ(recovered->cache_id(), 7u);
  EXPECT_EQ(recovered->Committed(), record);
  EXPECT_EQ(recovered->Mirrors(), session.Mirrors());
  absl::StatusOr<TransactionId> next = recovered->Begin();
  ASSERT_THAT(next, IsOk());
  EXPECT_EQ(next->generation, 5u) << "generations continue; none is issued twice";
}

TEST(Recover, AnOpenTransactionComesBackAtItsCommittedLength) {
  SessionState session = MakeSession(256);
  Step(session, 12, 12);
  absl::StatusOr<TransactionId> open = session.Begin();
  ASSERT_THAT(open, IsOk());
  ASSERT_THAT(session.PrepareAppend(open->generation, 5), IsOk());
  ASSERT_THAT(session.PublishAppend(open->generation), IsOk());
  const CommittedRecord record = session.Committed();
  EXPECT_EQ(record.committed_len, 12u);
  absl::StatusOr<SessionState> recovered =
      SessionState::Recover(2, HybridSessionPlan(256), 256, record);
  ASSERT_THAT(recovered, IsOk());
  EXPECT_EQ(recovered->committed_len(), 12u);
  EXPECT_EQ(recovered->staged_len(), 12u);
  EXPECT_FALSE(recovered->kv().state().active().has_value());
  EXPECT_THAT(recovered->PublishAppend(open->generation),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstrs("active: none")));
}

TEST(Recover, KeepsTaintAndAFreshSessionStaysFresh) {
  SessionState session = MakeSession(64);
  session.MarkTainted();
  absl::StatusOr<SessionState> tainted =
      SessionState::Recover(3, HybridSessionPlan(64), 64, session.Committed());
  ASSERT_THAT(tainted, IsOk());
  EXPECT_TRUE(tainted->tainted());
  absl::StatusOr<SessionState> fresh =
      SessionState::Recover(4, HybridSessionPlan(64), 64, MakeSession(64).Committed());
  ASSERT_THAT(fresh, IsOk());
  EXPECT_TRUE(fresh->kv().state().IsFresh());
}

TEST(Recover, RefusesARecordThatDoesNotFitThePlan) {
  CommittedRecord record{.committed_len = 40, .next_generation = 5, .ring_bases = {0}};
  EXPECT_THAT(SessionState::Recover(1, HybridSessionPlan(256), 256, record),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("1 ring bases for 2 K/V layers")));
  record.ring_bases = {0, 41};
  EXPECT_THAT(SessionState::Recover(1, HybridSessionPlan(256), 256, record),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("[41,40)")));
  record.ring_bases = {3, 0};
  EXPECT_THAT(SessionState::Recover(1, HybridSessionPlan(256), 256, record),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("must start at absolute row zero, got 3")));
  record.committed_len = 300;
  record.ring_bases = {0, 0};
  EXPECT_THAT(SessionState::Recover(1, HybridSessionPlan(256), 256, record),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("exceeds capacity 256")));
}

TEST(Session, GrowCarriesEveryPlaneKindAndTheGeneration) {
  SessionState source = MakeSession(10'000, true, 1);
  Step(source, 4096, 4096);
  Step(source, 4096, 4096);
  const uint64_t committed = Step(source, 58, 58);  // 8250, the reference's SWA grow length
  SessionState target = MakeSession(20'000, true, 2);
  absl::StatusOr<std::vector<PlaneCopy>> copies = SessionState::Grow(source, target);
  ASSERT_THAT(copies, IsOk());
  EXPECT_EQ(target.committed_len(), committed);
  EXPECT_EQ(target.capacity(), 20'000u);
  EXPECT_EQ(target.latent()[0].len, committed);
  EXPECT_EQ(target.latent()[0].index_pools_ready, committed / 4);
  EXPECT_EQ(target.Begin()->generation, 4u) << "three source transactions, then the target's";
  // Flat K: the committed prefix; ring K: the aligned window [8224, 8250) rebased to row 0.
  EXPECT_THAT(*copies, Contains(PlaneCopy{{0, PlaneKind::kKeys}, 0, {0, PlaneKind::kKeys}, 0,
                                          committed * 136}));
  EXPECT_EQ(target.kv().ring(1)->base(), (committed - 31) & ~uint64_t{31});
  EXPECT_THAT(*copies, Contains(PlaneCopy{{2, PlaneKind::kSsmState}, 0,
                                          {2, PlaneKind::kSsmState}, 0, 32}));
  // Latent rows whole; the live indexer tail (8250 % 4 = 2 rows) from ring row 8248 % 16 = 8
  // to the target's ring row 8.
  EXPECT_THAT(*copies, Contains(PlaneCopy{{3, PlaneKind::kLatentRows}, 0,
                                          {3, PlaneKind::kLatentRows}, 0, committed * 8 * 4}));
  EXPECT_THAT(*copies, Contains(PlaneCopy{{3, PlaneKind::kIndexRows}, 8 * 8 * 4,
                                          {3, PlaneKind::kIndexRows}, 8 * 8 * 4, 2 * 8 * 4}));
  EXPECT_EQ(source.committed_len(), committed) << "the source is never changed";
}

TEST(Session, GrowRefusals) {
  SessionState source = MakeSession(64, true, 1);
  Step(source, 5, 5);
  SessionState same = MakeSession(64, true, 2);
  EXPECT_THAT(SessionState::Grow(source, same),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("target capacity 64 must exceed source capacity 64")));
  SessionState dirty = MakeSession(128, true, 3);
  Step(dirty, 1, 1);
  EXPECT_THAT(SessionState::Grow(source, dirty),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstrs("must be fresh")));
  EXPECT_EQ(dirty.committed_len(), 1u);
  absl::StatusOr<TransactionId> open = source.Begin();
  ASSERT_THAT(open, IsOk());
  SessionState fresh = MakeSession(128, true, 4);
  EXPECT_THAT(SessionState::Grow(source, fresh),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("refuses active transaction generation 2 at base 5")));
  EXPECT_EQ(fresh.committed_len(), 0u);
}

// ---- Indexer residency (docs/rules.md, "Indexer residency") ----

// The MLA plan: one latent layer (width 4) with a DSA indexer of index_width 2, pool 3
// and a 6-row tail ring (two pools).
SessionState MakeDsaSession(uint64_t capacity, uint64_t cache_id = 1,
                            std::optional<uint32_t> index_ring_rows = 6) {
  ModelPlan model;
  model.name = "dsa-residency";
  model.index_ring_rows = index_ring_rows;
  LayerPlan latent;
  latent.index = 0;
  latent.kind = StateKind::kLatent;
  latent.latent_width = 4;
  latent.index_width = 2;
  latent.index_pool = 3;
  model.layers = {latent};
  return SessionOf(model, capacity, /*spec_snapshot=*/true, cache_id);
}

// Begin, prepare `rows` and publish them; returns the open generation.
uint64_t Staged(SessionState& session, uint64_t rows) {
  absl::StatusOr<TransactionId> transaction = session.Begin();
  EXPECT_THAT(transaction, IsOk());
  EXPECT_THAT(session.PrepareAppend(transaction->generation, rows), IsOk());
  EXPECT_THAT(session.PublishAppend(transaction->generation), IsOk());
  return transaction->generation;
}

// What a refusal must leave untouched.
struct Observable {
  uint64_t committed, staged, position;
  std::vector<LatentLayerState> latent;
  std::vector<MirrorValue> mirrors;
  bool operator==(const Observable&) const = default;
};
Observable Observe(const SessionState& session) {
  return {session.committed_len(), session.staged_len(), session.position(), session.latent(),
          session.Mirrors()};
}

TEST(IndexResidency, APrepareThatWouldLapTheBaseTailIsRefusedUpFront) {
  // Issue 26, 2b: the reference lets rows 4..9 overwrite row 3's ring slot; an abort back to 4
  // then finds its live tail [3, 4) gone and the transaction could never end. The prepare is
  // refused instead, naming the room the 6-row ring leaves beside the 1-row tail.
  SessionState session = MakeDsaSession(64);
  Step(session, 4, 4);
  EXPECT_EQ(session.latent()[0].index_pools_ready, 1u);
  absl::StatusOr<TransactionId> transaction = session.Begin();
  ASSERT_THAT(transaction, IsOk());
  const Observable before = Observe(session);
  EXPECT_THAT(session.PrepareAppend(transaction->generation, 6),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("layer 0: preparing 6 rows at row 4 would overwrite indexer "
                                  "rows [3, 4) of the live tail at length 4",
                                  "an abort returns there", "tail ring of 6 rows leaves room "
                                  "for 5 rows", "multiple of 3")));
  EXPECT_EQ(Observe(session), before);
  ASSERT_THAT(session.PrepareAppend(transaction->generation, 5), IsOk());
  ASSERT_THAT(session.PublishAppend(transaction->generation), IsOk());
  EXPECT_THAT(session.Abort(transaction->generation), IsOk());
  EXPECT_EQ(session.committed_len(), 4u);
  EXPECT_EQ(session.latent()[0].index_resident_from, 3u);
}

TEST(IndexResidency, AStagedTailIsSparedForACommitOfEveryPublishedRow) {
  SessionState session = MakeDsaSession(64);
  Step(session, 3, 3);  // a pool boundary: the base's tail is empty
  absl::StatusOr<TransactionId> transaction = session.Begin();
  ASSERT_THAT(transaction, IsOk());
  ASSERT_THAT(session.PrepareAppend(transaction->generation, 2), IsOk());
  ASSERT_THAT(session.PublishAppend(transaction->generation), IsOk());  // staged 5, tail [3, 5)
  const Observable before = Observe(session);
  EXPECT_THAT(session.PrepareAppend(transaction->generation, 5),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("preparing 5 rows at row 5 would overwrite indexer rows [3, 4) "
                                  "of the live tail at length 5",
                                  "a commit of every published row ends there",
                                  "leaves room for 4 rows")));
  EXPECT_EQ(Observe(session), before);
  EXPECT_THAT(session.Commit(transaction->generation, 2), IsOkAndHolds(5u));
}

TEST(IndexResidency, FromAPoolBoundaryOneTransactionMayAppendPastTheRing) {
  // Issue 26, 2: a prepare longer than the ring, ended without a publish, left the resident
  // start raised (1) at length 0, so the next 1-row append was refused at publish.
  SessionState session = MakeDsaSession(64);
  absl::StatusOr<TransactionId> first = session.Begin();
  ASSERT_THAT(first, IsOk());
  ASSERT_THAT(session.PrepareAppend(first->generation, 7), IsOk());  // row 6 laps row 0
  ASSERT_THAT(session.Abort(first->generation), IsOk());
  EXPECT_EQ(session.latent()[0].index_resident_from, 0u);
  Step(session, 1, 1);
  EXPECT_EQ(session.committed_len(), 1u);

  // The same through Rewind and Commit(0), and with a 2-row append after.
  for (int ending = 0; ending < 2; ++ending) {
    SessionState other = MakeDsaSession(64);
    absl::StatusOr<TransactionId> begun = other.Begin();
    ASSERT_THAT(begun, IsOk());
    ASSERT_THAT(other.PrepareAppend(begun->generation, 7), IsOk());
    ASSERT_THAT(ending == 0 ? other.Rewind(0) : other.Commit(begun->generation, 0).status(),
                IsOk());
    Step(other, 2, 2);
    EXPECT_EQ(other.committed_len(), 2u);
  }
}

TEST(IndexResidency, LappedTailRefusesAPartialCommitIntoIt) {
  SessionState session = MakeDsaSession(64);
  Step(session, 6, 6);                             // a pool boundary: nothing to spare
  const uint64_t generation = Staged(session, 8);  // rows 6..13: rows below 8 lose their slots
  EXPECT_EQ(session.latent()[0].index_resident_from, 8u);
  const Observable before = Observe(session);
  EXPECT_THAT(session.Commit(generation, 1),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("latent length 7 would make indexer rows [6, 7) live",
                                  "holds rows only from 8")));
  EXPECT_EQ(Observe(session), before);
  EXPECT_THAT(session.Commit(generation, 3), IsOkAndHolds(9u)) << "a pool boundary is legal";
  EXPECT_EQ(session.latent()[0].index_pools_ready, 3u);
}

TEST(IndexResidency, LappedTailRefusesRewindAndCanRewindAgrees) {
  SessionState session = MakeDsaSession(64);
  Step(session, 3, 3);
  Step(session, 7, 7);  // rows 3..9: rows below 4 lose their slots
  const Observable before = Observe(session);
  EXPECT_THAT(session.Rewind(4),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("latent length 4 would make indexer rows [3, 4) live")));
  EXPECT_EQ(Observe(session), before);
  for (uint64_t target = 0; target <= 10; ++target) {
    const bool legal = target % 3 == 0 || target >= 6;
    EXPECT_EQ(session.CanRewindTo(target), legal) << "target " << target;
    SessionState copy = session;
    EXPECT_EQ(copy.Rewind(target).ok(), legal) << "target " << target;
  }
  ASSERT_THAT(session.Rewind(7), IsOk());
  EXPECT_EQ(session.latent()[0].index_resident_from, 4u);
}

TEST(IndexResidency, LappedTailRefusesASpecRollbackIntoIt) {
  SessionState session = MakeDsaSession(64);
  Step(session, 3, 3);
  ASSERT_THAT(session.SpecSnapshot(), IsOk());
  Step(session, 7, 7);
  const Observable before = Observe(session);
  EXPECT_THAT(session.SpecRollback(1),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("latent length 4 would make indexer rows [3, 4) live")));
  EXPECT_EQ(Observe(session), before);
  EXPECT_THAT(session.SpecRollback(3), IsOk());
  EXPECT_EQ(session.committed_len(), 6u);
}

TEST(IndexResidency, AReplacedUnpublishedPrepareIsRewrittenByItsReplacement) {
  SessionState session = MakeDsaSession(64);
  Step(session, 6, 6);  // a pool boundary
  absl::StatusOr<TransactionId> transaction = session.Begin();
  ASSERT_THAT(transaction, IsOk());
  ASSERT_THAT(session.PrepareAppend(transaction->generation, 16), IsOk());  // laps rows below 16
  EXPECT_EQ(session.latent()[0].index_resident_from, 16u);
  ASSERT_THAT(session.PrepareAppend(transaction->generation, 1), IsOk());  // writes row 6 again
  EXPECT_EQ(session.latent()[0].index_resident_from, 6u);
  EXPECT_THAT(session.PublishAppend(transaction->generation), IsOk());
  EXPECT_THAT(session.Commit(transaction->generation, 1), IsOkAndHolds(7u));
  EXPECT_FALSE(session.CanRewindTo(5)) << "rows [3, 5) were lapped by the replaced prepare";
  EXPECT_TRUE(session.CanRewindTo(6));
}

TEST(IndexResidency, AFlatIndexPlaneOrASmallAppendNeverLaps) {
  SessionState flat = MakeDsaSession(64, 1, /*index_ring_rows=*/0);
  Step(flat, 4, 4);
  EXPECT_THAT(flat.Abort(Staged(flat, 40)), IsOk());
  EXPECT_EQ(flat.committed_len(), 4u);

  SessionState ring = MakeDsaSession(64);
  Step(ring, 4, 4);
  EXPECT_THAT(ring.Abort(Staged(ring, 2)), IsOk()) << "rows 4..5 use free slots";
  EXPECT_THAT(ring.Rewind(4), IsOk());
}

TEST(IndexResidency, HydratedSessionHoldsOnlyTheLiveTail) {
  SessionState session = MakeDsaSession(64);
  ASSERT_THAT(session.Hydrate(8, {}), IsOk());
  EXPECT_EQ(session.latent()[0].index_resident_from, 6u);
  const Observable before = Observe(session);
  EXPECT_THAT(session.Rewind(4),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("indexer rows [3, 4) live", "holds rows only from 6")));
  EXPECT_EQ(Observe(session), before);
  EXPECT_FALSE(session.CanRewindTo(4));
  EXPECT_TRUE(session.CanRewindTo(3));
  EXPECT_TRUE(session.CanRewindTo(7));
  ASSERT_THAT(session.Rewind(3), IsOk());
  Step(session, 4, 4);  // rows 3..6 written by this session
  EXPECT_THAT(session.Rewind(4), IsOk()) << "rows the session wrote again are resident";
}

TEST(IndexResidency, GrownSessionHoldsOnlyTheLiveTail) {
  SessionState source = MakeDsaSession(16, 1);
  Step(source, 8, 8);
  SessionState target = MakeDsaSession(64, 2);
  ASSERT_THAT(SessionState::Grow(source, target), IsOk());
  EXPECT_EQ(target.latent()[0].index_resident_from, 6u);
  EXPECT_THAT(target.Rewind(4),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstrs("rows [3, 4) live")));
  EXPECT_THAT(source.Rewind(4), IsOk()) << "the source wrote its own rows";
}

TEST(IndexResidency, ResetMakesEveryRowWritableAgain) {
  SessionState session = MakeDsaSession(64);
  ASSERT_THAT(session.Hydrate(8, {}), IsOk());
  ASSERT_THAT(session.Reset(), IsOk());
  EXPECT_EQ(session.latent()[0].index_resident_from, 0u);
  Step(session, 4, 4);
  EXPECT_THAT(session.Rewind(2), IsOk());
}


TEST(Session, MirrorsIntoReplacesWhatTheBufferHeldWithMirrors) {
  SessionState session = MakeSession(64);
  Step(session, 5, 3);
  std::vector<MirrorValue> buffer = {{{99, PlaneKind::kLenMirror}, 7}};
  session.MirrorsInto(buffer);
  EXPECT_EQ(buffer, session.Mirrors());
  EXPECT_FALSE(buffer.empty());
}

// ---- Advance: one operation per session per step ----

TEST(Advance, FirstStepBeginsAndPreparesAndTheNextCommitsPublishingFirst) {
  SessionState session = MakeSession(10'000);
  absl::StatusOr<AdvanceResult> first = session.Advance({0, 0, 10});
  ASSERT_THAT(first, IsOk());
  EXPECT_FALSE(first->committed.has_value());
  EXPECT_FALSE(first->published);
  ASSERT_TRUE(first->begun.has_value() && first->prepared.has_value());
  EXPECT_EQ(first->prepared->target, 10u);
  EXPECT_EQ(session.staged_len(), 0u) << "the rows are prepared, not published";

  absl::StatusOr<AdvanceResult> second = session.Advance({first->begun->generation, 7, 3});
  ASSERT_THAT(second, IsOk());
  EXPECT_TRUE(second->published);
  EXPECT_EQ(second->committed, 7u);
  EXPECT_EQ(second->begun->base_len, 7u);
  EXPECT_EQ(second->prepared->target, 10u);
  EXPECT_EQ(session.committed_len(), 7u);
  EXPECT_EQ(session.latent()[0].len, 7u);

  absl::StatusOr<AdvanceResult> last = session.Advance({second->begun->generation, 3, 0});
  ASSERT_THAT(last, IsOk());
  EXPECT_EQ(last->committed, 10u);
  EXPECT_FALSE(last->begun.has_value());
  EXPECT_FALSE(session.kv().state().active().has_value());
  EXPECT_THAT(session.Mirrors(), Contains(MirrorValue{{0, PlaneKind::kLenMirror}, 10}));
}

TEST(Advance, AnAppendTheEngineAlreadyPublishedIsNotPublishedAgain) {
  SessionState session = MakeSession(10'000);
  absl::StatusOr<AdvanceResult> first = session.Advance({0, 0, 4});
  ASSERT_THAT(first, IsOk());
  ASSERT_THAT(session.PublishAppend(first->begun->generation), IsOk());
  absl::StatusOr<AdvanceResult> second = session.Advance({first->begun->generation, 4, 0});
  ASSERT_THAT(second, IsOk());
  EXPECT_FALSE(second->published);
  EXPECT_EQ(second->committed, 4u);
}

// Every refusal: the first refused part's status, and nothing changed.
TEST(Advance, RefusalsChangeNothing) {
  SessionState session = MakeSession(64);
  const SessionState fresh = session;
  EXPECT_THAT(session.Advance({0, 0, 0}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("generation 0", "next_rows 0")));
  EXPECT_THAT(session.Advance({0, 0, 65}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("65 > 64")));
  EXPECT_THAT(session.Advance({3, 0, 1}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("stale KV transaction generation 3 (active: none)")));
  EXPECT_EQ(session, fresh);

  absl::StatusOr<AdvanceResult> first = session.Advance({0, 0, 10});
  ASSERT_THAT(first, IsOk());
  const uint64_t generation = first->begun->generation;
  const SessionState prepared = session;
  // Begin while a transaction is active (the engine lost track of its generation).
  EXPECT_THAT(session.Advance({0, 0, 1}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("generation 1 is already active at base 0")));
  EXPECT_THAT(session.Advance({generation + 1, 1, 1}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("stale KV transaction generation 2 (active: 1)")));
  EXPECT_THAT(session.Advance({generation, 11, 1}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("accepts 11 rows from a 10-row transaction")));
  // The commit alone would be accepted; the next prepare is refused, so the commit (and the
  // publish before it) is not applied either.
  EXPECT_THAT(session.Advance({generation, 10, 55}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("KV append exceeds capacity: 65 > 64")));
  EXPECT_EQ(session, prepared);

  session.MarkTainted();
  const SessionState tainted = session;
  EXPECT_THAT(session.Advance({generation, 10, 1}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("publish append: session was tainted")));
  EXPECT_THAT(session.Advance({0, 0, 1}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("begin transaction: session was tainted")));
  EXPECT_EQ(session, tainted);
}

// Advance runs its parts in place and puts back what a refused part's predecessors changed:
// here the publish moved the sliding layer's ring (a rebase), then the commit was refused.
TEST(Advance, ARefusalAfterAPublishThatRebasedARingPutsTheRingBack) {
  SessionState session = MakeSession(10'000);
  // Steps of 10 rows until the prepared one rebases the ring (the ring holds a few thousand).
  absl::StatusOr<AdvanceResult> opened = session.Advance({0, 0, 10});
  ASSERT_THAT(opened, IsOk());
  for (int step = 0; step < 900; ++step) {
    const std::optional<RingAppend>& ring = opened->prepared->layers[1].ring_append;
    ASSERT_TRUE(ring.has_value());
    if (ring->kind == RingAppend::Kind::kRebase) break;
    opened = session.Advance({opened->begun->generation, 10, 10});
    ASSERT_THAT(opened, IsOk());
  }
  ASSERT_EQ(opened->prepared->layers[1].ring_append->kind, RingAppend::Kind::kRebase);
  const uint64_t base_before = session.kv().ring(1)->base();
  const SessionState before = session;
  EXPECT_THAT(session.Advance({opened->begun->generation, 11, 1}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("accepts 11 rows from a 10-row transaction")));
  EXPECT_EQ(session.kv().ring(1)->base(), base_before);
  EXPECT_EQ(session, before);
  // Accepted, the same step publishes the rebase.
  ASSERT_THAT(session.Advance({opened->begun->generation, 10, 1}), IsOk());
  EXPECT_EQ(session.kv().ring(1)->base(), opened->prepared->layers[1].ring_append->new_base);
  EXPECT_NE(session.kv().ring(1)->base(), base_before);
}

TEST(Advance, APrepareOrCommitRefusedForIndexerResidencyChangesNothing) {
  // Prepare: the next append would lap the live tail [6, 7) an abort needs.
  SessionState session = MakeDsaSession(64);
  Step(session, 7, 7);
  absl::StatusOr<AdvanceResult> opened = session.Advance({0, 0, 1});
  ASSERT_THAT(opened, IsOk());
  const SessionState before_prepare = session;
  EXPECT_THAT(session.Advance({opened->begun->generation, 1, 16}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("preparing 16 rows at row 8 would overwrite indexer rows [6, ")));
  EXPECT_EQ(session, before_prepare);

  // Commit: a partial commit into a tail lapped from a pool boundary.
  SessionState other = MakeDsaSession(64);
  Step(other, 6, 6);
  absl::StatusOr<AdvanceResult> staged = other.Advance({0, 0, 8});
  ASSERT_THAT(staged, IsOk());
  const SessionState before_commit = other;
  EXPECT_THAT(other.Advance({staged->begun->generation, 1, 1}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("latent length 7 would make indexer rows [6, 7) live")));
  EXPECT_EQ(other, before_commit);
  EXPECT_THAT(other.Advance({staged->begun->generation, 3, 1}), IsOk());
}

// The separate operations Advance is made of, each applied as the engine would send them: the
// first refusal is the outcome, and the parts before it stay applied.
struct SeparateOutcome {
  absl::Status status;
  AdvanceResult result;
};
SeparateOutcome AdvanceSeparately(SessionState& session, const AdvanceRequest& request,
                                  bool has_unpublished_append) {
  SeparateOutcome out;
  auto run = [&]() -> absl::Status {
    if (request.generation == 0 && request.next_rows == 0) {
      return session.Advance(request).status();  // the one refusal with no separate form
    }
    if (request.generation != 0) {
      if (has_unpublished_append) {
        RETURN_IF_ERROR(session.PublishAppend(request.generation));
        out.result.published = true;
      }
      ASSIGN_OR_RETURN(out.result.committed,
                       session.Commit(request.generation, request.accepted_rows));
    }
    if (request.next_rows != 0) {
      ASSIGN_OR_RETURN(out.result.begun, session.Begin());
      ASSIGN_OR_RETURN(out.result.prepared,
                       session.PrepareAppend(out.result.begun->generation, request.next_rows));
    }
    return absl::OkStatus();
  };
  out.status = run();
  return out;
}

// A scripted random workload, once through Advance and once through the separate operations:
// every outcome and every state agree; a refused Advance leaves the state it found, and the
// separate operations' accepted prefix applied to it gives the separate side's state.
TEST(Advance, EquivalentToTheSeparateOperationsOnARandomWorkload) {
  for (uint64_t seed : {1u, 2u, 3u, 4u, 5u, 6u, 7u, 8u}) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    ::memra::testing::SeededRandom random(seed * 7919);
    SessionState advanced = seed % 2 == 0 ? MakeDsaSession(96) : MakeSession(96);
    SessionState separate = advanced;
    uint64_t open_generation = 0;  // what the engine believes is open
    bool unpublished = false;      // the open transaction's append is not published yet
    size_t refusals = 0;
    for (int step = 0; step < 400; ++step) {
      SCOPED_TRACE(::testing::Message() << "step " << step);
      // Now and then something outside the step: the engine publishes itself, rewinds,
      // resets, or the session is tainted.
      const uint64_t side = random.Below(40);
      if (side == 0 && open_generation != 0 && unpublished) {
        const absl::Status a = advanced.PublishAppend(open_generation);
        EXPECT_EQ(separate.PublishAppend(open_generation), a);
        if (a.ok()) unpublished = false;
      } else if (side == 1) {
        const uint64_t target = random.Below(advanced.staged_len() + 1);
        const absl::Status a = advanced.Rewind(target);
        EXPECT_EQ(separate.Rewind(target), a);
        if (a.ok()) open_generation = 0;
      } else if (side == 2) {
        EXPECT_EQ(separate.Reset(), advanced.Reset());
        open_generation = 0;
      } else if (side == 3 && step > 360) {  // late: a tainted session refuses the rest
        advanced.MarkTainted();
        separate.MarkTainted();
      }
      ASSERT_EQ(advanced, separate);

      AdvanceRequest request;
      // Mostly the open transaction; sometimes a stale one, or none.
      const uint64_t which = random.Below(10);
      request.generation = which < 7 ? open_generation
                           : which < 9 ? random.Below(open_generation + 3)
                                       : 0;
      const uint64_t staged_rows =
          advanced.pending_append().has_value()
              ? advanced.pending_append()->target - advanced.committed_len()
              : advanced.staged_len() - advanced.committed_len();
      request.accepted_rows = random.Below(staged_rows + 2);
      request.next_rows =
          random.Below(8) == 0 ? 0 : 1 + random.Below(random.Below(3) == 0 ? 60 : 6);
      const bool has_unpublished =
          separate.pending_append().has_value() &&
          separate.pending_append()->transaction.generation == request.generation;

      const SessionState before = advanced;
      const absl::StatusOr<AdvanceResult> got = advanced.Advance(request);
      const SeparateOutcome want = AdvanceSeparately(separate, request, has_unpublished);
      ASSERT_EQ(got.status(), want.status);
      if (got.ok()) {
        EXPECT_EQ(got->published, want.result.published);
        EXPECT_EQ(got->committed, want.result.committed);
        EXPECT_EQ(got->begun, want.result.begun);
        EXPECT_EQ(got->prepared, want.result.prepared);
        ASSERT_EQ(advanced, separate);
        ASSERT_EQ(advanced.Mirrors(), separate.Mirrors());
        open_generation = got->begun.has_value() ? got->begun->generation : 0;
        unpublished = got->prepared.has_value();
        continue;
      }
      ++refusals;
      ASSERT_EQ(advanced, before) << "a refused Advance changed the state";
      // The separate side kept the parts accepted before its refusal: the same parts, applied
      // to the Advance side one by one, reach the same state.
      if (want.result.published) {
        ASSERT_THAT(advanced.PublishAppend(request.generation), IsOk());
      }
      if (want.result.committed.has_value()) {
        ASSERT_THAT(advanced.Commit(request.generation, request.accepted_rows), IsOk());
        open_generation = 0;
      }
      if (want.result.begun.has_value()) {
        ASSERT_THAT(advanced.Begin(), IsOkAndHolds(*want.result.begun));
        open_generation = want.result.begun->generation;
        unpublished = false;
      }
      ASSERT_EQ(advanced, separate);
    }
    EXPECT_GT(refusals, 20u) << "the workload should exercise refusals";
  }
}

}  // namespace
}  // namespace memra
