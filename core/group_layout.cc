#include "core/group_layout.h"

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "core/status_macros.h"

namespace memra {
namespace {

std::string StageName(const StageLayout& stage) {
  return absl::StrCat("stage ", stage.stage, " (layers [", stage.layer_lo, ", ", stage.layer_hi,
                      "))");
}

absl::StatusOr<std::vector<uint32_t>> StageLayersOf(const ModelPlan& plan,
                                                    const GroupShape& group) {
  const uint32_t trunk = static_cast<uint32_t>(plan.layers.size());
  if (group.stage_layers.empty()) return DefaultStageLayers(trunk, group.pp);
  if (group.stage_layers.size() != group.pp) {
    return absl::InvalidArgumentError(absl::StrCat("stage layers list ",
                                                   group.stage_layers.size(),
                                                   " stages for pp ", group.pp));
  }
  uint64_t sum = 0;
  for (size_t stage = 0; stage < group.stage_layers.size(); ++stage) {
    if (group.stage_layers[stage] == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("stage ", stage, " holds 0 layers: every stage holds at least one"));
    }
    sum += group.stage_layers[stage];  // pp <= kMaxGroupRanks u32 values: no overflow in u64
  }
  if (sum != trunk) {
    return absl::InvalidArgumentError(absl::StrCat("stage layers sum to ", sum,
                                                   " but the plan has ", trunk,
                                                   " trunk layers"));
  }
  return group.stage_layers;
}

// The K/V sharding of one stage under tp > 1 (rules 2 and 3 of the header).
absl::Status ShardStage(const ModelPlan& plan, uint32_t tp, StageLayout& stage) {
  const LayerPlan* first_kv = nullptr;
  const LayerPlan* first_latent = nullptr;
  const LayerPlan* first_uneven = nullptr;  // first K/V layer whose heads tp does not divide
  bool heads_agree = true;
  for (uint32_t index = stage.layer_lo; index < stage.layer_hi; ++index) {
    const LayerPlan& layer = *plan.FindLayer(index);  // validated: indices contiguous
    switch (layer.kind) {
      case StateKind::kKv:
      case StateKind::kSlidingKv:
        if (first_kv == nullptr) first_kv = &layer;
        if (layer.n_head_kv != first_kv->n_head_kv) heads_agree = false;
        if (first_uneven == nullptr && layer.n_head_kv % tp != 0) first_uneven = &layer;
        break;
      case StateKind::kLatent:
        if (first_latent == nullptr) first_latent = &layer;
        break;
      case StateKind::kRecurrent:
        return absl::InvalidArgumentError(absl::StrCat(
            "layer ", layer.index, " of ", StageName(stage),
            ": recurrent state is not sharded under tensor parallelism (tp ", tp,
            "); engines split it by heads, which a memra-kv session cannot hold"));
      case StateKind::kNone:
      case StateKind::kSharedKv:
        break;
    }
  }
  if (first_kv != nullptr && first_latent != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        StageName(stage), " mixes K/V layer ", first_kv->index, " (sharded over tp ", tp,
        ") with latent layer ", first_latent->index,
        " (replicated under tp): one rank's session has one tp_ranks"));
  }
  stage.latent_replicated = first_latent != nullptr;
  if (first_kv == nullptr) return absl::OkStatus();
  if (first_uneven == nullptr) {
    stage.kv_shards = tp;
    return absl::OkStatus();
  }
  // tp exceeds the heads: one head per rank, replicated, only when every layer agrees.
  const uint32_t heads = first_uneven->n_head_kv;
  if (heads_agree && heads < tp && tp % heads == 0) {
    stage.kv_shards = heads;
    stage.kv_replicas = tp / heads;
    return absl::OkStatus();
  }
  std::string why =
      heads_agree ? absl::StrCat("tp is not a multiple of them either")
                  : absl::StrCat("and the stage's K/V layers do not all have the same heads (layer ",
                                 first_kv->index, " has ", first_kv->n_head_kv, ")");
  return absl::InvalidArgumentError(absl::StrCat(
      "layer ", first_uneven->index, " of ", StageName(stage), ": n_head_kv ", heads,
      " is not divisible by tp ", tp, ", ", why,
      " (K/V heads split evenly, or one head per rank when tp is a multiple of them)"));
}

// Rule 5: a shared-KV layer reads K/V that must live on its own GPU.
absl::Status CheckSharedKvOnStage(const ModelPlan& plan, const StageLayout& stage) {
  for (uint32_t index = stage.layer_lo; index < stage.layer_hi; ++index) {
    const LayerPlan& layer = *plan.FindLayer(index);
    if (layer.kind == StateKind::kSharedKv && layer.shares_kv_with < stage.layer_lo) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer ", layer.index, " of ", StageName(stage), " attends layer ",
          layer.shares_kv_with, "'s K/V, which an earlier stage holds"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<uint32_t>> DefaultStageLayers(uint32_t trunk_layers, uint32_t pp) {
  if (pp == 0 || pp > trunk_layers) {
    return absl::InvalidArgumentError(absl::StrCat("pp ", pp, " does not split ", trunk_layers,
                                                   " trunk layers (1 <= pp <= layers)"));
  }
  std::vector<uint32_t> layers(pp, trunk_layers / pp);
  const uint32_t remainder = trunk_layers % pp;  // < pp: stages pp-2, pp-3, ... get one more
  for (uint32_t i = 0; i < remainder; ++i) ++layers[pp - 2 - i];
  return layers;
}

absl::StatusOr<GroupLayout> PlanGroupLayout(const ModelPlan& plan, const GroupShape& group) {
  RETURN_IF_ERROR(ValidateModelPlan(plan));
  if (group.tp == 0 || group.pp == 0 ||
      uint64_t{group.tp} * group.pp > kMaxGroupRanks) {
    return absl::InvalidArgumentError(absl::StrCat("tp ", group.tp, " x pp ", group.pp,
                                                   " is not a group of 1..", kMaxGroupRanks,
                                                   " ranks"));
  }
  ASSIGN_OR_RETURN(const std::vector<uint32_t> stage_layers, StageLayersOf(plan, group));

  GroupLayout layout;
  layout.tp = group.tp;
  layout.pp = group.pp;
  uint32_t lo = 0;
  for (uint32_t s = 0; s < group.pp; ++s) {
    StageLayout stage;
    stage.stage = s;
    stage.layer_lo = lo;
    stage.layer_hi = lo + stage_layers[s];  // sums to the trunk: no overflow
    if (s + 1 == group.pp) {
      stage.mtp_blocks = static_cast<uint32_t>(plan.mtp_blocks.size());
      stage.layer_hi = plan.TotalLayers();
    }
    lo = stage.layer_hi;
    if (group.tp > 1) RETURN_IF_ERROR(ShardStage(plan, group.tp, stage));
    RETURN_IF_ERROR(CheckSharedKvOnStage(plan, stage));
    layout.stages.push_back(stage);
  }
  for (const StageLayout& stage : layout.stages) {
    for (uint32_t tp_rank = 0; tp_rank < group.tp; ++tp_rank) {
      RankLayout rank;
      rank.rank = stage.stage * group.tp + tp_rank;
      rank.stage = stage.stage;
      rank.tp_rank = tp_rank;
      rank.kv_shard = tp_rank / stage.kv_replicas;
      rank.shape.layer_lo = stage.layer_lo;
      rank.shape.layer_hi = stage.layer_hi;
      rank.shape.tp_ranks = stage.kv_shards;
      layout.ranks.push_back(rank);
    }
  }
  return layout;
}

SessionShape WithRequest(const RankLayout& rank, uint64_t capacity, bool spec_snapshot) {
  SessionShape shape = rank.shape;
  shape.capacity = capacity;
  shape.spec_snapshot = spec_snapshot;
  return shape;
}

absl::StatusOr<std::vector<CostBreakdown>> CostOfGroup(const ModelPlan& plan,
                                                       const FormatDefaults& defaults,
                                                       const GroupLayout& layout,
                                                       uint64_t capacity, bool spec_snapshot) {
  if (layout.stages.size() != layout.pp ||
      layout.ranks.size() != uint64_t{layout.tp} * layout.pp) {
    return absl::InvalidArgumentError(absl::StrCat(
        "group layout of ", layout.stages.size(), " stages and ", layout.ranks.size(),
        " ranks is not tp ", layout.tp, " x pp ", layout.pp, " (not from PlanGroupLayout)"));
  }
  std::vector<CostBreakdown> costs;
  costs.reserve(layout.ranks.size());
  for (const StageLayout& stage : layout.stages) {
    const RankLayout& first = layout.ranks[uint64_t{stage.stage} * layout.tp];
    absl::StatusOr<CostBreakdown> cost =
        CostOfSession(plan, defaults, WithRequest(first, capacity, spec_snapshot));
    if (!cost.ok()) {
      return absl::Status(cost.status().code(),
                          absl::StrCat(StageName(stage), ", ranks ", first.rank, "..",
                                       first.rank + layout.tp - 1, ": ",
                                       cost.status().message()));
    }
    for (uint32_t tp_rank = 0; tp_rank < layout.tp; ++tp_rank) costs.push_back(*cost);
  }
  return costs;
}

std::optional<uint32_t> TightestRank(const std::vector<uint64_t>& per_rank) {
  if (per_rank.empty()) return std::nullopt;
  uint32_t tightest = 0;
  for (uint32_t rank = 1; rank < per_rank.size(); ++rank) {
    if (per_rank[rank] < per_rank[tightest]) tightest = rank;
  }
  return tightest;
}

}  // namespace memra
