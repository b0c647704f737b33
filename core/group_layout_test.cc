#include "core/group_layout.h"

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "core/sizing.h"
#include "core/test_model_plans.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::IsOkAndHolds;
using ::memra::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Optional;

constexpr uint64_t kContext = 32768;

GroupShape Group(uint32_t tp, uint32_t pp, std::vector<uint32_t> stage_layers = {}) {
  GroupShape shape;
  shape.tp = tp;
  shape.pp = pp;
  shape.stage_layers = std::move(stage_layers);
  return shape;
}

SessionShape Shard(uint32_t layer_lo, uint32_t layer_hi, uint32_t tp_ranks) {
  SessionShape shape;
  shape.layer_lo = layer_lo;
  shape.layer_hi = layer_hi;
  shape.tp_ranks = tp_ranks;
  return shape;
}

CostBreakdown Cost(const ModelPlan& plan, SessionShape shape) {
  shape.capacity = kContext;
  absl::StatusOr<CostBreakdown> cost = CostOfSession(plan, FormatDefaults{}, shape);
  EXPECT_TRUE(cost.ok()) << cost.status();
  return cost.value_or(CostBreakdown{});
}

TEST(DefaultStageLayersTest, SplitsAsVllmDoes) {
  EXPECT_THAT(DefaultStageLayers(32, 2), IsOkAndHolds(ElementsAre(16, 16)));
  // The remainder goes one each to the stages before the last: 10 = 2 + 3 + 3 + 2.
  EXPECT_THAT(DefaultStageLayers(10, 4), IsOkAndHolds(ElementsAre(2, 3, 3, 2)));
  EXPECT_THAT(DefaultStageLayers(61, 2), IsOkAndHolds(ElementsAre(31, 30)));
  EXPECT_THAT(DefaultStageLayers(7, 1), IsOkAndHolds(ElementsAre(7)));
  EXPECT_THAT(DefaultStageLayers(5, 5), IsOkAndHolds(ElementsAre(1, 1, 1, 1, 1)));
}

TEST(DefaultStageLayersTest, RefusesMoreStagesThanLayersAndZero) {
  EXPECT_THAT(DefaultStageLayers(3, 4),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("pp 4 does not split 3 trunk layers")));
  EXPECT_THAT(DefaultStageLayers(3, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("pp 0")));
}

TEST(GroupLayoutTest, Tp4SplitsEveryKvHeadFourWays) {
  const ModelPlan plan = test_plans::Llama3_8B();
  absl::StatusOr<GroupLayout> layout = PlanGroupLayout(plan, Group(4, 1));
  ASSERT_TRUE(layout.ok()) << layout.status();
  ASSERT_EQ(layout->stages.size(), 1u);
  EXPECT_EQ(layout->stages[0].layer_lo, 0u);
  EXPECT_EQ(layout->stages[0].layer_hi, 32u);
  EXPECT_EQ(layout->stages[0].kv_shards, 4u);
  EXPECT_EQ(layout->stages[0].kv_replicas, 1u);
  ASSERT_EQ(layout->ranks.size(), 4u);
  for (uint32_t r = 0; r < 4; ++r) {
    EXPECT_EQ(layout->ranks[r].rank, r);
    EXPECT_EQ(layout->ranks[r].stage, 0u);
    EXPECT_EQ(layout->ranks[r].tp_rank, r);
    EXPECT_EQ(layout->ranks[r].kv_shard, r);
    EXPECT_EQ(layout->ranks[r].shape.tp_ranks, 4u);
    EXPECT_EQ(layout->ranks[r].shape.layer_lo, 0u);
    EXPECT_EQ(layout->ranks[r].shape.layer_hi, 32u);
  }

  absl::StatusOr<std::vector<CostBreakdown>> costs =
      CostOfGroup(plan, FormatDefaults{}, *layout, kContext, false);
  ASSERT_TRUE(costs.ok()) << costs.status();
  ASSERT_EQ(costs->size(), 4u);
  const CostBreakdown whole = Cost(plan, SessionShape{});
  // Whole heads per rank: the four shards' K/V bytes add up to the unsharded model's.
  EXPECT_EQ((*costs)[0].kv_bytes_per_token * 4, whole.kv_bytes_per_token);
  EXPECT_EQ((*costs)[0].kv_bytes_per_token, 59392u / 4);
  for (const CostBreakdown& cost : *costs) {
    EXPECT_EQ(cost.total_bytes, (*costs)[0].total_bytes);
  }
  EXPECT_EQ((*costs)[0].total_bytes, Cost(plan, Shard(0, 32, 4)).total_bytes);
}

TEST(GroupLayoutTest, Tp2Pp2GivesEachStageHalfTheLayersAndEachRankHalfTheHeads) {
  const ModelPlan plan = test_plans::Llama3_8B();
  absl::StatusOr<GroupLayout> layout = PlanGroupLayout(plan, Group(2, 2));
  ASSERT_TRUE(layout.ok()) << layout.status();
  ASSERT_EQ(layout->ranks.size(), 4u);
  // rank = stage * tp + tp_rank.
  const std::vector<std::pair<uint32_t, uint32_t>> stage_and_tp_rank = {
      {0, 0}, {0, 1}, {1, 0}, {1, 1}};
  for (uint32_t r = 0; r < 4; ++r) {
    EXPECT_EQ(layout->ranks[r].stage, stage_and_tp_rank[r].first) << r;
    EXPECT_EQ(layout->ranks[r].tp_rank, stage_and_tp_rank[r].second) << r;
    EXPECT_EQ(layout->ranks[r].shape.tp_ranks, 2u);
  }
  EXPECT_EQ(layout->ranks[1].shape.layer_lo, 0u);
  EXPECT_EQ(layout->ranks[1].shape.layer_hi, 16u);
  EXPECT_EQ(layout->ranks[2].shape.layer_lo, 16u);
  EXPECT_EQ(layout->ranks[2].shape.layer_hi, 32u);

  absl::StatusOr<std::vector<CostBreakdown>> costs =
      CostOfGroup(plan, FormatDefaults{}, *layout, kContext, false);
  ASSERT_TRUE(costs.ok()) << costs.status();
  uint64_t kv_per_token = 0;
  for (const CostBreakdown& cost : *costs) kv_per_token += cost.kv_bytes_per_token;
  EXPECT_EQ(kv_per_token, Cost(plan, SessionShape{}).kv_bytes_per_token);
  EXPECT_EQ((*costs)[3].total_bytes,
            Cost(plan, Shard(16, 32, 2)).total_bytes);
}

TEST(GroupLayoutTest, ExplicitStageLayersAreKept) {
  absl::StatusOr<GroupLayout> layout = PlanGroupLayout(
      test_plans::Llama3_8B(), Group(1, 3, {10, 12, 10}));
  ASSERT_TRUE(layout.ok()) << layout.status();
  ASSERT_EQ(layout->stages.size(), 3u);
  EXPECT_EQ(layout->stages[1].layer_lo, 10u);
  EXPECT_EQ(layout->stages[1].layer_hi, 22u);
  EXPECT_EQ(layout->stages[2].layer_hi, 32u);
  EXPECT_EQ(layout->ranks[2].shape.tp_ranks, 1u);
}

TEST(GroupLayoutTest, RefusesStageLayersThatDoNotCoverTheTrunk) {
  const ModelPlan plan = test_plans::Llama3_8B();
  EXPECT_THAT(PlanGroupLayout(plan, Group(1, 2, {32})),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("stage layers list 1 stages for pp 2")));
  EXPECT_THAT(PlanGroupLayout(plan, Group(1, 2, {32, 0})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("stage 1 holds 0 layers")));
  EXPECT_THAT(PlanGroupLayout(plan, Group(1, 2, {16, 15})),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("stage layers sum to 31 but the plan has 32 trunk layers")));
  EXPECT_THAT(PlanGroupLayout(plan, Group(1, 33)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("pp 33 does not split 32 trunk layers")));
}

TEST(GroupLayoutTest, RefusesEmptyAndOversizedGroups) {
  const ModelPlan plan = test_plans::Llama3_8B();
  EXPECT_THAT(PlanGroupLayout(plan, Group(0, 1)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tp 0 x pp 1 is not a group of 1..1024 ranks")));
  EXPECT_THAT(PlanGroupLayout(plan, Group(128, 16)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tp 128 x pp 16 is not a group of 1..1024 ranks")));
  EXPECT_THAT(PlanGroupLayout(plan, Group(0xffffffffu, 0xffffffffu)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("x pp 4294967295")));
}

TEST(GroupLayoutTest, TpBeyondTheHeadsReplicatesOneHeadPerRank) {
  // 8 K/V heads over 16 ranks: ranks 2k and 2k+1 both hold head k.
  const ModelPlan plan = test_plans::Llama3_70B();
  absl::StatusOr<GroupLayout> layout = PlanGroupLayout(plan, Group(16, 1));
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->stages[0].kv_shards, 8u);
  EXPECT_EQ(layout->stages[0].kv_replicas, 2u);
  EXPECT_EQ(layout->ranks[0].kv_shard, 0u);
  EXPECT_EQ(layout->ranks[1].kv_shard, 0u);
  EXPECT_EQ(layout->ranks[15].kv_shard, 7u);
  EXPECT_EQ(layout->ranks[15].shape.tp_ranks, 8u);
  absl::StatusOr<std::vector<CostBreakdown>> costs =
      CostOfGroup(plan, FormatDefaults{}, *layout, kContext, false);
  ASSERT_TRUE(costs.ok()) << costs.status();
  EXPECT_EQ((*costs)[15].kv_bytes_per_token * 8,
            Cost(plan, SessionShape{}).kv_bytes_per_token);
}

TEST(GroupLayoutTest, RefusesHeadsThatTpNeitherDividesNorMultiplies) {
  EXPECT_THAT(
      PlanGroupLayout(test_plans::Llama3_8B(), Group(3, 1)),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("layer 0 of stage 0 (layers [0, 32))"),
                     HasSubstr("n_head_kv 8 is not divisible by tp 3"))));
  ModelPlan uneven = test_plans::DenseModel(4, 128, 8);
  uneven.layers[2].n_head_kv = 2;
  EXPECT_THAT(PlanGroupLayout(uneven, Group(4, 1)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("layer 2 of stage 0"),
                             HasSubstr("n_head_kv 2 is not divisible by tp 4"),
                             HasSubstr("layer 0 has 8"))));
  // Split by stages, each stage agrees with itself: layers 0-1 over 4, 2-3 one head per rank.
  uneven.layers[3].n_head_kv = 2;
  absl::StatusOr<GroupLayout> staged =
      PlanGroupLayout(uneven, Group(4, 2));
  ASSERT_TRUE(staged.ok()) << staged.status();
  EXPECT_EQ(staged->stages[0].kv_shards, 4u);
  EXPECT_EQ(staged->stages[1].kv_shards, 2u);
  EXPECT_EQ(staged->stages[1].kv_replicas, 2u);
}

TEST(GroupLayoutTest, LatentRowsAreReplicatedAndMtpRunsOnTheLastStage) {
  const ModelPlan plan = test_plans::DeepSeekV3Style();
  absl::StatusOr<GroupLayout> layout = PlanGroupLayout(plan, Group(8, 2));
  ASSERT_TRUE(layout.ok()) << layout.status();
  ASSERT_EQ(layout->stages.size(), 2u);
  EXPECT_EQ(layout->stages[0].layer_hi, 31u);
  EXPECT_EQ(layout->stages[0].mtp_blocks, 0u);
  EXPECT_EQ(layout->stages[1].layer_lo, 31u);
  EXPECT_EQ(layout->stages[1].layer_hi, 62u);  // trunk 31..60 + MTP block 61
  EXPECT_EQ(layout->stages[1].mtp_blocks, 1u);
  EXPECT_TRUE(layout->stages[1].latent_replicated);
  EXPECT_EQ(layout->ranks[15].shape.tp_ranks, 1u);

  absl::StatusOr<std::vector<CostBreakdown>> costs =
      CostOfGroup(plan, FormatDefaults{}, *layout, kContext, false);
  ASSERT_TRUE(costs.ok()) << costs.status();
  // Every TP rank holds the whole 576-wide f32 row of each of its stage's layers.
  EXPECT_EQ((*costs)[0].latent_bytes_per_token, 31u * 576 * 4);
  EXPECT_EQ((*costs)[15].latent_bytes_per_token, 31u * 576 * 4);
}

TEST(GroupLayoutTest, RefusesRecurrentStateUnderTpButSplitsItByStages) {
  const ModelPlan plan = test_plans::Qwen3NextStyle();
  EXPECT_THAT(PlanGroupLayout(plan, Group(2, 1)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("layer 0 of stage 0 (layers [0, 48))"),
                             HasSubstr("recurrent state is not sharded"),
                             HasSubstr("(tp 2)"))));
  absl::StatusOr<GroupLayout> layout = PlanGroupLayout(plan, Group(1, 4));
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->ranks[3].shape.layer_lo, 36u);
  EXPECT_THAT(CostOfGroup(plan, FormatDefaults{}, *layout, kContext, true), IsOkAndHolds(
      ::testing::SizeIs(4)));
}

TEST(GroupLayoutTest, RefusesAStageMixingShardedKvAndReplicatedLatent) {
  ModelPlan plan;
  plan.layers = {test_plans::KvLayer(0, 128, 8), test_plans::LatentLayer(1, 576)};
  EXPECT_THAT(PlanGroupLayout(plan, Group(2, 1)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("stage 0 (layers [0, 2)) mixes K/V layer 0"),
                             HasSubstr("latent layer 1"))));
  absl::StatusOr<GroupLayout> staged = PlanGroupLayout(plan, Group(2, 2));
  ASSERT_TRUE(staged.ok()) << staged.status();
  EXPECT_EQ(staged->stages[0].kv_shards, 2u);
  EXPECT_TRUE(staged->stages[1].latent_replicated);
  EXPECT_EQ(staged->stages[1].kv_shards, 1u);
}

TEST(GroupLayoutTest, SharedKvMustStayOnTheStageOfItsTarget) {
  // Layers 8-10 attend 7, layer 11 attends 5.
  const ModelPlan plan = test_plans::GemmaStyle(/*swa_ring=*/false);
  EXPECT_THAT(PlanGroupLayout(plan, Group(1, 2)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("layer 11 of stage 1 (layers [6, 12)) attends layer 5's K/V, "
                                 "which an earlier stage holds")));
  EXPECT_THAT(PlanGroupLayout(plan, Group(1, 2, {8, 4})),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("layer 8 of stage 1 (layers [8, 12)) attends layer 7's K/V")));
  absl::StatusOr<GroupLayout> layout =
      PlanGroupLayout(plan, Group(4, 2, {5, 7}));
  ASSERT_TRUE(layout.ok()) << layout.status();
  // Two K/V heads over four ranks: one each, replicated twice.
  EXPECT_EQ(layout->stages[1].kv_shards, 2u);
  EXPECT_EQ(layout->stages[1].kv_replicas, 2u);
  EXPECT_TRUE(CostOfGroup(plan, FormatDefaults{}, *layout, kContext, false).ok());
}

TEST(GroupLayoutTest, CostRefusalsNameTheStageAndItsRanks) {
  absl::StatusOr<GroupLayout> layout =
      PlanGroupLayout(test_plans::Llama3_8B(), Group(2, 2));
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_THAT(CostOfGroup(test_plans::Llama3_8B(), FormatDefaults{}, *layout, 0, false),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("stage 0 (layers [0, 16)), ranks 0..1: capacity 0 tokens")));
  GroupLayout truncated = *layout;
  truncated.ranks.pop_back();
  EXPECT_THAT(CostOfGroup(test_plans::Llama3_8B(), FormatDefaults{}, truncated, kContext, false),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("group layout of 2 stages and 3 ranks is not tp 2 x pp 2")));
}

TEST(GroupLayoutTest, RefusesAnInvalidPlanFirst) {
  ModelPlan plan = test_plans::Llama3_8B();
  plan.layers[3].index = 9;
  EXPECT_THAT(PlanGroupLayout(plan, Group(2, 1)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer")));
}

TEST(TightestRankTest, TheLeastDecidesLowestRankOnTies) {
  EXPECT_THAT(TightestRank({5, 3, 3, 9}), Optional(1u));
  EXPECT_THAT(TightestRank({7}), Optional(0u));
  EXPECT_EQ(TightestRank({}), std::nullopt);
}

}  // namespace
}  // namespace memra
