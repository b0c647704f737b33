#ifndef MEMRA_CORE_GROUP_LAYOUT_H_
#define MEMRA_CORE_GROUP_LAYOUT_H_

// How a tensor- x pipeline-parallel group splits one model's cache over its ranks, one rank per
// GPU and so per daemon (docs/groups.md#the-tp-x-pp-layout). Each rank's shard is an ordinary
// SessionShape (layer range + tp_ranks), so every byte a rank costs comes from core/sizing and
// nothing else. Rank numbering is vLLM's and Megatron's: rank = stage * tp + tp_rank.
//
// Rules (each refusal is INVALID_ARGUMENT naming the layer, stage and numbers):
//   1. PP: stage s holds a contiguous range of trunk layers; the last stage also holds every
//      MTP/NextN block (the reference's new_ppn: blocks past the fence run on the last stage).
//      Without explicit stage sizes the trunk splits as vLLM's get_pp_indices does.
//   2. TP, K/V layers: heads split evenly (n_head_kv % tp == 0). Where tp exceeds the heads,
//      tp must be a multiple of them and each rank holds one head, replicated tp / n_head_kv
//      times (vLLM's rule); every K/V layer of the stage must then agree on n_head_kv.
//   3. TP, MLA latent layers: replicated, every TP rank holding the whole latent rows (vLLM's
//      MLA cache, the reference's glm5 latent peer replicas). A stage cannot mix them with
//      sharded K/V layers (one session has one tp_ranks).
//   4. TP, recurrent layers: refused (engines shard their state by heads; core/sizing sizes
//      only the whole state).
//   5. A shared-KV layer must be on the stage of the layer whose K/V it attends.
//
// Thread-safety: pure functions over values.

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "core/formats.h"
#include "core/model_plan.h"
#include "core/sizing.h"

namespace memra {

// One daemon serves one rank; a group larger than this is a mistyped file (the protocol's
// bound too: group.proto, core/admission.h).
inline constexpr uint32_t kMaxGroupRanks = 1024;

struct GroupShape {
  uint32_t tp = 1;
  uint32_t pp = 1;
  // Trunk layers per stage (pp entries, each >= 1, summing to the trunk); empty = the
  // default split (DefaultStageLayers).
  std::vector<uint32_t> stage_layers;
};

// vLLM's get_pp_indices: trunk / pp layers each, the remainder one each to the stages before
// the last (the last stage also runs the head). INVALID_ARGUMENT for pp 0 or pp > trunk.
absl::StatusOr<std::vector<uint32_t>> DefaultStageLayers(uint32_t trunk_layers, uint32_t pp);

struct StageLayout {
  uint32_t stage = 0;
  uint32_t layer_lo = 0;    // first layer of the stage
  uint32_t layer_hi = 0;    // one past its last; the last stage's includes the MTP blocks
  uint32_t mtp_blocks = 0;  // MTP/NextN blocks on this stage (only the last has any)
  // K/V head shards of the stage (its sessions' tp_ranks): tp, or n_head_kv when tp exceeds
  // the heads (rule 2), or 1 when the stage has no K/V layer to shard.
  uint32_t kv_shards = 1;
  // TP ranks holding the same K/V bytes: tp / kv_shards when the stage has K/V layers, else 1.
  uint32_t kv_replicas = 1;
  bool latent_replicated = false;  // latent layers under TP > 1 (rule 3)
  bool operator==(const StageLayout&) const = default;
};

struct RankLayout {
  uint32_t rank = 0;     // stage * tp + tp_rank
  uint32_t stage = 0;
  uint32_t tp_rank = 0;
  uint32_t kv_shard = 0;  // which of its stage's kv_shards it holds: tp_rank / kv_replicas
  // The rank's session shape: layer_lo / layer_hi of its stage, tp_ranks = kv_shards.
  // capacity and spec_snapshot are the request's (WithRequest).
  SessionShape shape;
};

struct GroupLayout {
  uint32_t tp = 1;
  uint32_t pp = 1;
  std::vector<StageLayout> stages;  // by stage
  std::vector<RankLayout> ranks;    // by rank: tp * pp of them
};

// Validates the plan (ValidateModelPlan) and the shape, then applies the rules above.
absl::StatusOr<GroupLayout> PlanGroupLayout(const ModelPlan& plan, const GroupShape& group);

// A rank's session shape for a request of `capacity` tokens.
SessionShape WithRequest(const RankLayout& rank, uint64_t capacity, bool spec_snapshot);

// Every rank's exact cost (CostOfSession of its shape), by rank. Ranks of one stage cost the
// same bytes. Sizing's refusals come back prefixed with the stage, its layers and its ranks.
absl::StatusOr<std::vector<CostBreakdown>> CostOfGroup(const ModelPlan& plan,
                                                       const FormatDefaults& defaults,
                                                       const GroupLayout& layout,
                                                       uint64_t capacity, bool spec_snapshot);

// The rank that decides a group answer: the one with the least of `per_rank` (each rank's max
// context, or sessions that fit); the lowest rank on ties; nullopt for an empty list.
std::optional<uint32_t> TightestRank(const std::vector<uint64_t>& per_rank);

}  // namespace memra

#endif  // MEMRA_CORE_GROUP_LAYOUT_H_
