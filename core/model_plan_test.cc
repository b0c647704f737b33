#include "core/model_plan.h"

#include <limits>
#include <set>
#include <string>
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
using ::testing::HasSubstr;
using namespace ::memra::test_plans;  // NOLINT: the plan builders read as a vocabulary

constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;

std::string Fingerprint(const ModelPlan& plan, const FormatDefaults& defaults = {}) {
  absl::StatusOr<PlanFingerprint> fingerprint = FingerprintModelPlan(plan, defaults);
  EXPECT_TRUE(fingerprint.ok()) << fingerprint.status();
  return fingerprint.ok() ? FingerprintHex(*fingerprint) : "";
}

TEST(ModelPlanTest, AllLayersIsTrunkThenMtpInIndexOrder) {
  const ModelPlan plan = DeepSeekV3Style();
  EXPECT_EQ(plan.TotalLayers(), 62u);
  const std::vector<const LayerPlan*> all = plan.AllLayers();
  ASSERT_EQ(all.size(), 62u);
  for (uint32_t i = 0; i < all.size(); ++i) EXPECT_EQ(all[i]->index, i);
  EXPECT_EQ(all[61], &plan.mtp_blocks[0]);
  EXPECT_EQ(plan.FindLayer(61), &plan.mtp_blocks[0]);
  EXPECT_EQ(plan.FindLayer(7), &plan.layers[7]);
  EXPECT_EQ(plan.FindLayer(62), nullptr);
}

TEST(ModelPlanTest, RealisticPlansValidate) {
  for (const ModelPlan& plan :
       {Llama3_8B(), Llama3_70B(), GemmaStyle(false), GemmaStyle(true), DeepSeekV3Style(),
        GlmStyleWithIndexer(), GlmStyleWithIndexer(0), Qwen3NextStyle()}) {
    EXPECT_THAT(ValidateModelPlan(plan), IsOk()) << plan.name;
  }
}

TEST(ModelPlanTest, RefusesAnEmptyPlan) {
  EXPECT_THAT(ValidateModelPlan(ModelPlan{}),
              StatusIs(kInvalid, HasSubstr("model plan has no layers")));
}

TEST(ModelPlanTest, RefusesNonContiguousIndices) {
  ModelPlan trunk_gap = Llama3_8B();
  trunk_gap.layers[1].index = 2;
  EXPECT_THAT(ValidateModelPlan(trunk_gap),
              StatusIs(kInvalid, HasSubstrs("trunk layer 1 has index 2, expected 1")));

  ModelPlan mtp_gap = DeepSeekV3Style();
  mtp_gap.mtp_blocks[0].index = 62;
  EXPECT_THAT(ValidateModelPlan(mtp_gap),
              StatusIs(kInvalid, HasSubstrs("MTP block 0 has index 62, expected 61")));
}

TEST(ModelPlanTest, RefusesZeroDimsNamingLayerAndField) {
  ModelPlan plan = Llama3_8B();
  plan.layers[3].n_head_kv = 0;
  EXPECT_THAT(ValidateModelPlan(plan),
              StatusIs(kInvalid, HasSubstrs("layer 3 (kv)", "n_head_kv must be positive")));

  ModelPlan sliding = GemmaStyle(true);
  sliding.layers[2].window = 0;
  EXPECT_THAT(ValidateModelPlan(sliding),
              StatusIs(kInvalid, HasSubstrs("layer 2 (sliding_kv)", "window must be positive")));

  ModelPlan recurrent = Qwen3NextStyle();
  recurrent.layers[0].conv_kernel = 0;
  EXPECT_THAT(
      ValidateModelPlan(recurrent),
      StatusIs(kInvalid, HasSubstrs("layer 0 (recurrent)", "conv_kernel must be positive")));

  ModelPlan latent = DeepSeekV3Style();
  latent.mtp_blocks[0].latent_width = 0;
  EXPECT_THAT(ValidateModelPlan(latent),
              StatusIs(kInvalid, HasSubstrs("layer 61 (latent)", "latent_width must be positive")));
}

TEST(ModelPlanTest, RefusesHeadDimsThatSplitA32ElementBlock) {
  ModelPlan plan = DenseModel(2, 80, 8);  // kv_dim 640 is 32-aligned, but a block straddles heads
  EXPECT_THAT(ValidateModelPlan(plan),
              StatusIs(kInvalid, HasSubstrs("layer 0 (kv)", "KVQUANT", "k=80 v=80")));
  ModelPlan v_only = Llama3_8B();
  v_only.layers[5].head_dim_v = 112;
  EXPECT_THAT(ValidateModelPlan(v_only),
              StatusIs(kInvalid, HasSubstrs("layer 5 (kv)", "k=128 v=112")));
}

TEST(ModelPlanTest, LatentLayersAreExemptFromTheBlockRule) {
  // glm-dsa's latent row (kv_lora + rope) is not a multiple of 32 in every family; MLA layers
  // own no quantized plane.
  ModelPlan plan;
  plan.layers.push_back(LatentLayer(0, 530));
  EXPECT_THAT(ValidateModelPlan(plan), IsOk());
}

TEST(ModelPlanTest, RefusesFieldsTheKindDoesNotUse) {
  ModelPlan windowed_full = Llama3_8B();
  windowed_full.layers[4].window = 4096;
  EXPECT_THAT(ValidateModelPlan(windowed_full),
              StatusIs(kInvalid, HasSubstrs("layer 4 (kv)",
                                            "window=4096 is set but this kind "
                                            "does not use it")));

  ModelPlan formatted_recurrent = Qwen3NextStyle();
  formatted_recurrent.layers[0].formats = KvFormats{};
  EXPECT_THAT(ValidateModelPlan(formatted_recurrent),
              StatusIs(kInvalid, HasSubstrs("layer 0 (recurrent)", "formats are set but unused")));

  ModelPlan classed_latent = DeepSeekV3Style();
  classed_latent.layers[1].attention = AttentionClass::kGemmaGlobal;
  EXPECT_THAT(ValidateModelPlan(classed_latent),
              StatusIs(kInvalid, HasSubstrs("layer 1 (latent)", "gemma_global is set but unused")));

  ModelPlan shared_with_dims = GemmaStyle(false);
  shared_with_dims.layers[9].head_dim_k = 256;
  EXPECT_THAT(ValidateModelPlan(shared_with_dims),
              StatusIs(kInvalid, HasSubstrs("layer 9 (shared_kv)", "head_dim_k=256")));
}

// The reference (docs/rules.md#the-reference) derives Gemma's attention classes from the kind.
TEST(ModelPlanTest, GemmaClassesSitOnTheKindsTheReferenceDerivesThemFrom) {
  ModelPlan global_sliding = GemmaStyle(false);
  global_sliding.layers[0].attention = AttentionClass::kGemmaGlobal;
  EXPECT_THAT(ValidateModelPlan(global_sliding),
              StatusIs(kInvalid, HasSubstrs("layer 0 (sliding_kv)",
                                            "gemma_global does not fit a sliding_kv layer")));
  ModelPlan windowed_full = GemmaStyle(false);
  windowed_full.layers[5].attention = AttentionClass::kGemmaWindowed;
  EXPECT_THAT(
      ValidateModelPlan(windowed_full),
      StatusIs(kInvalid, HasSubstrs("layer 5 (kv)", "gemma_windowed does not fit a kv layer")));
}

TEST(ModelPlanTest, RefusesMalformedIndexers) {
  ModelPlan odd = GlmStyleWithIndexer();
  odd.layers[2].index_width = 255;
  EXPECT_THAT(ValidateModelPlan(odd),
              StatusIs(kInvalid, HasSubstrs("layer 2 (latent)", "index_width 255 must be even")));

  ModelPlan no_pool = GlmStyleWithIndexer();
  no_pool.layers[0].index_pool = 0;
  EXPECT_THAT(ValidateModelPlan(no_pool),
              StatusIs(kInvalid, HasSubstrs("index_pool 0", "(index_width 256)")));

  ModelPlan pool_without_indexer = DeepSeekV3Style();
  pool_without_indexer.layers[0].index_pool = 4;
  EXPECT_THAT(ValidateModelPlan(pool_without_indexer),
              StatusIs(kInvalid, HasSubstrs("index_pool 4", "(index_width 0)")));
}

TEST(ModelPlanTest, RefusesAPoolTheIndexerRingCannotHold) {
  // The ring holds whole pools: a 3-row ring has none of 4 rows, and the engine's drain would
  // make no progress.
  EXPECT_THAT(ValidateModelPlan(GlmStyleWithIndexer(3)),
              StatusIs(kInvalid, HasSubstrs("layer 0 (latent)", "3 rows", "pool of 4")));
  ModelPlan huge_pool = GlmStyleWithIndexer();
  huge_pool.layers[0].index_pool = 8192;  // over the default 5120-row ring
  EXPECT_THAT(ValidateModelPlan(huge_pool),
              StatusIs(kInvalid, HasSubstrs("5120 rows", "pool of 8192")));
  huge_pool.index_ring_rows = 0;  // flat plane: any pool is addressable
  EXPECT_THAT(ValidateModelPlan(huge_pool), IsOk());
}

TEST(ModelPlanTest, SharedKvMustTargetAnEarlierKvLayer) {
  ModelPlan forward = GemmaStyle(false);
  forward.layers[8].shares_kv_with = 9;
  EXPECT_THAT(ValidateModelPlan(forward),
              StatusIs(kInvalid, HasSubstrs("layer 8 (shared_kv)", "shares_kv_with 9",
                                            "earlier kv or sliding_kv layer")));
  ModelPlan itself = GemmaStyle(false);
  itself.layers[8].shares_kv_with = 8;
  EXPECT_THAT(ValidateModelPlan(itself), StatusIs(kInvalid, HasSubstr("shares_kv_with 8")));
  ModelPlan chained = GemmaStyle(false);
  chained.layers[9].shares_kv_with = 8;  // a shared layer has no K/V of its own to share
  EXPECT_THAT(ValidateModelPlan(chained), StatusIs(kInvalid, HasSubstr("shares_kv_with 8")));

  ModelPlan hybrid = Qwen3NextStyle();
  hybrid.layers[5] = SharedLayer(5, 4);  // layer 4 is recurrent
  EXPECT_THAT(ValidateModelPlan(hybrid), StatusIs(kInvalid, HasSubstr("shares_kv_with 4")));
  hybrid.layers[5] = SharedLayer(5, 3);  // layer 3 is full attention
  EXPECT_THAT(ValidateModelPlan(hybrid), IsOk());
}

// 100k shared layers after one K/V layer: validation finds each target in O(1), so this runs in
// milliseconds (a scan per layer made it ~5e9 steps, minutes).
TEST(ModelPlanTest, ValidationIsLinearInSharedLayers) {
  constexpr uint32_t kLayers = 100'000;
  ModelPlan plan;
  plan.layers.reserve(kLayers);
  plan.layers.push_back(KvLayer(0, 128, 8));
  for (uint32_t i = 1; i < kLayers; ++i) plan.layers.push_back(SharedLayer(i, 0));
  EXPECT_THAT(ValidateModelPlan(plan), IsOk());
  EXPECT_THAT(FingerprintModelPlan(plan, {}).status(), IsOk());
  plan.layers.back().shares_kv_with = kLayers - 2;  // a shared layer: no K/V of its own
  EXPECT_THAT(ValidateModelPlan(plan),
              StatusIs(kInvalid, HasSubstrs("layer 99999 (shared_kv)", "shares_kv_with 99998")));
}

TEST(ModelPlanTest, FindLayerAnswersForPlansWithGaps) {
  ModelPlan plan = Llama3_8B();
  plan.layers.erase(plan.layers.begin() + 3);  // indices 0,1,2,4,...: not valid, still findable
  ASSERT_NE(plan.FindLayer(4), nullptr);
  EXPECT_EQ(plan.FindLayer(4)->index, 4u);
  EXPECT_EQ(plan.FindLayer(3), nullptr);
  EXPECT_EQ(plan.FindLayer(1'000), nullptr);
}

TEST(ModelPlanTest, RefusesEnumValuesWithoutAName) {
  ModelPlan kind = Llama3_8B();
  kind.layers[0].kind = static_cast<StateKind>(9);
  EXPECT_THAT(ValidateModelPlan(kind),
              StatusIs(kInvalid, HasSubstrs("layer 0", "unknown state kind 9")));
  ModelPlan attention = Llama3_8B();
  attention.layers[1].attention = static_cast<AttentionClass>(3);
  EXPECT_THAT(ValidateModelPlan(attention),
              StatusIs(kInvalid, HasSubstrs("layer 1", "unknown attention class 3")));
  ModelPlan k_format = Llama3_8B();
  k_format.layers[2].formats = KvFormats{static_cast<KFormat>(7), VFormat::kQ5_1};
  EXPECT_THAT(ValidateModelPlan(k_format),
              StatusIs(kInvalid, HasSubstrs("layer 2", "unknown K format 7")));
  ModelPlan v_format = Llama3_8B();
  v_format.layers[3].formats = KvFormats{KFormat::kQ8_0, static_cast<VFormat>(8)};
  EXPECT_THAT(ValidateModelPlan(v_format),
              StatusIs(kInvalid, HasSubstrs("layer 3", "unknown V format 8")));
  ModelPlan latent_format = DeepSeekV3Style();
  latent_format.layers[0].latent_format = static_cast<ElementFormat>(5);
  EXPECT_THAT(ValidateModelPlan(latent_format),
              StatusIs(kInvalid, HasSubstrs("layer 0", "unknown latent format 5")));
}

TEST(ModelPlanTest, ExplicitFormatsWinOverClassDefaults) {
  FormatDefaults defaults;
  defaults.ordinary = {KFormat::kQ8_0, VFormat::kQ4_0};
  LayerPlan ordinary = KvLayer(0, 128, 8);
  LayerPlan global = KvLayer(0, 512, 2, AttentionClass::kGemmaGlobal);
  LayerPlan windowed = SlidingLayer(0, 256, 2, 1024, AttentionClass::kGemmaWindowed);
  EXPECT_EQ(ResolveLayerFormats(ordinary, defaults), defaults.ordinary);
  EXPECT_EQ(ResolveLayerFormats(global, defaults), defaults.gemma_global);
  EXPECT_EQ(ResolveLayerFormats(windowed, defaults), defaults.gemma_windowed);
  global.formats = KvFormats{KFormat::kQ8_0, VFormat::kQ5_1};
  EXPECT_EQ(ResolveLayerFormats(global, defaults), *global.formats);
}

TEST(ModelPlanTest, FingerprintIsPinnedSoEncodingChangesMustBumpTheVersion) {
  // Independently recomputed from the documented encoding (version text, switches, counts,
  // per-layer fields little-endian) with Python's hashlib.
  EXPECT_EQ(Fingerprint(Llama3_8B()),
            "e36a62053ac54b52cb17a4f866f528ca3e76c3efafeb014fc6cc219e5b7c5417");
}

TEST(ModelPlanTest, ElementFormatFingerprintIsPinnedToTheDocumentedExtension) {
  // One fp8_e4m3 layer with a per-tensor k_scale of 0.5, recomputed with Python's hashlib from
  // model_plan.h's encoding (v1 bytes, then the extension).
  ModelPlan plan = DenseModel(1, 128, 8);
  plan.layers[0].formats = KvFormats{KFormat::kFp8E4m3, VFormat::kFp8E4m3};
  plan.layers[0].k_scale = {0.5f};
  EXPECT_EQ(Fingerprint(plan), "77bc5aaa4e16fe3bfd2e1e269bbcfa6ae1a2be2cb3c26ee7562e70192d004e9e");
}

TEST(ModelPlanTest, FingerprintTellsEveryFormatScaleAndLatentFormatApart) {
  std::set<std::string> seen;
  for (uint8_t k = 0; k <= static_cast<uint8_t>(kLastKFormat); ++k) {
    for (uint8_t v = 0; v <= static_cast<uint8_t>(kLastVFormat); ++v) {
      ModelPlan plan = Llama3_8B();
      plan.layers[0].formats = KvFormats{static_cast<KFormat>(k), static_cast<VFormat>(v)};
      EXPECT_TRUE(seen.insert(Fingerprint(plan)).second) << int(k) << "/" << int(v);
    }
  }
  ModelPlan scaled = InElementFormat(Llama3_8B(), ElementFormat::kFp8E4m3);
  const std::string unscaled = Fingerprint(scaled);
  scaled.layers[4].v_scale = {0.25f};
  const std::string per_tensor = Fingerprint(scaled);
  scaled.layers[4].v_scale = std::vector<float>(8, 0.25f);
  const std::string per_head = Fingerprint(scaled);
  scaled.layers[4].v_scale[7] = 0.125f;
  EXPECT_EQ((std::set<std::string>{unscaled, per_tensor, per_head, Fingerprint(scaled)}).size(),
            4u);
  std::set<std::string> latent;
  for (uint8_t e = 0; e <= static_cast<uint8_t>(kLastElementFormat); ++e) {
    latent.insert(Fingerprint(InElementFormat(DeepSeekV3Style(), static_cast<ElementFormat>(e))));
  }
  EXPECT_EQ(latent.size(), 5u);
  // f32 latent rows are the v1 plan: its fingerprint does not move.
  EXPECT_EQ(Fingerprint(InElementFormat(DeepSeekV3Style(), ElementFormat::kF32)),
            Fingerprint(DeepSeekV3Style()));
}

TEST(ModelPlanTest, ElementFormatsHoldAnyHeadDimBlockFormatsRefuseWithTheirNames) {
  EXPECT_THAT(ValidateModelPlan(InElementFormat(DenseModel(2, 80, 8), ElementFormat::kBf16)),
              IsOk());
  ModelPlan v_block = InElementFormat(DenseModel(2, 80, 8), ElementFormat::kBf16);
  v_block.layers[1].formats->v = VFormat::kQ4_0;
  EXPECT_THAT(ValidateModelPlan(v_block),
              StatusIs(kInvalid, HasSubstrs("layer 1 (kv): V format q4_0 stores 32-element "
                                            "blocks, which head_dim_v 80 cannot hold whole")));
  ModelPlan k_block = InElementFormat(DenseModel(2, 80, 8), ElementFormat::kF16);
  k_block.layers[0].formats->k = KFormat::kFp8;
  EXPECT_THAT(ValidateModelPlan(k_block),
              StatusIs(kInvalid, HasSubstrs("layer 0 (kv): K format fp8 stores 32-element "
                                            "blocks, which head_dim_k 80 cannot hold whole")));
}

TEST(ModelPlanTest, ScalesBelongToFp8ElementFormatsOnly) {
  ModelPlan plan = InElementFormat(Llama3_8B(), ElementFormat::kFp8E5m2);
  plan.layers[0].k_scale = {0.5f};
  plan.layers[1].v_scale = std::vector<float>(8, 2.0f);
  EXPECT_THAT(ValidateModelPlan(plan), IsOk());

  ModelPlan bf16 = InElementFormat(Llama3_8B(), ElementFormat::kBf16);
  bf16.layers[2].k_scale = {0.5f};
  EXPECT_THAT(ValidateModelPlan(bf16),
              StatusIs(kInvalid, HasSubstrs("layer 2 (kv): k_scale has 1 values but the format "
                                            "bf16 takes no scale (fp8_e4m3 | fp8_e5m2 only)")));
  ModelPlan defaulted = Llama3_8B();  // formats unset: the block defaults take no scale
  defaulted.layers[0].v_scale = {0.5f};
  EXPECT_THAT(ValidateModelPlan(defaulted),
              StatusIs(kInvalid, HasSubstrs("layer 0 (kv): v_scale has 1 values but the layer "
                                            "takes no scale")));
  ModelPlan wrong_count = plan;
  wrong_count.layers[3].k_scale = {1.0f, 2.0f, 3.0f};
  EXPECT_THAT(ValidateModelPlan(wrong_count),
              StatusIs(kInvalid, HasSubstrs("layer 3 (kv): k_scale has 3 values: 1 (per tensor) "
                                            "or 8 (per head) expected")));
  ModelPlan negative = plan;
  negative.layers[3].v_scale = {-1.0f};
  EXPECT_THAT(ValidateModelPlan(negative),
              StatusIs(kInvalid, HasSubstrs("layer 3 (kv): v_scale[0] = -1 must be finite and "
                                            "positive")));
  ModelPlan infinite = plan;
  infinite.layers[3].k_scale = {std::numeric_limits<float>::infinity()};
  EXPECT_THAT(ValidateModelPlan(infinite),
              StatusIs(kInvalid, HasSubstrs("layer 3 (kv): k_scale[0] = inf must be finite")));

  // A latent row takes one per-tensor k_scale in fp8, never a v_scale.
  ModelPlan latent = InElementFormat(DeepSeekV3Style(), ElementFormat::kFp8E4m3);
  latent.layers[0].k_scale = {0.5f};
  EXPECT_THAT(ValidateModelPlan(latent), IsOk());
  latent.layers[0].k_scale = {0.5f, 0.5f};
  EXPECT_THAT(ValidateModelPlan(latent),
              StatusIs(kInvalid, HasSubstrs("layer 0 (latent): k_scale has 2 values: 1 (per "
                                            "tensor) expected")));
  latent.layers[0].k_scale = {};
  latent.layers[0].v_scale = {0.5f};
  EXPECT_THAT(ValidateModelPlan(latent),
              StatusIs(kInvalid, HasSubstrs("layer 0 (latent): v_scale has 1 values but the "
                                            "layer takes no scale")));
  ModelPlan recurrent = Qwen3NextStyle();
  recurrent.layers[0].k_scale = {1.0f};
  EXPECT_THAT(ValidateModelPlan(recurrent),
              StatusIs(kInvalid, HasSubstrs("layer 0 (recurrent): k_scale has 1 values")));
}

TEST(ModelPlanTest, LatentFormatOnlyOnLatentLayers) {
  ModelPlan plan = Llama3_8B();
  plan.layers[6].latent_format = ElementFormat::kBf16;
  EXPECT_THAT(ValidateModelPlan(plan),
              StatusIs(kInvalid, HasSubstrs("layer 6 (kv): latent_format bf16 is set but this "
                                            "kind does not use it")));
}

TEST(ModelPlanTest, FormatsSummaryNamesDistinctFormatsInLayerOrder) {
  const FormatDefaults defaults;
  EXPECT_EQ(PlanFormatsSummary(InElementFormat(Llama3_8B(), ElementFormat::kBf16), defaults),
            "K/V bf16/bf16");
  EXPECT_EQ(PlanFormatsSummary(GemmaStyle(false), defaults), "K/V fp8/fp8");
  ModelPlan mixed = Llama3_8B();
  mixed.layers[1].formats = KvFormats{KFormat::kFp8E4m3, VFormat::kFp8E4m3};
  EXPECT_EQ(PlanFormatsSummary(mixed, defaults), "K/V q8_0/q5_1, fp8_e4m3/fp8_e4m3");
  EXPECT_EQ(PlanFormatsSummary(DeepSeekV3Style(), defaults), "latent f32");
  EXPECT_EQ(PlanFormatsSummary(Qwen3NextStyle(), defaults), "K/V q8_0/q5_1");
}

TEST(ModelPlanTest, FingerprintIgnoresTheName) {
  ModelPlan renamed = Llama3_8B();
  renamed.name = "my-finetune";
  EXPECT_EQ(Fingerprint(renamed), Fingerprint(Llama3_8B()));
}

TEST(ModelPlanTest, FingerprintResolvesFormatsSoExplicitDefaultsHashEqual) {
  ModelPlan explicit_formats = Llama3_8B();
  for (LayerPlan& layer : explicit_formats.layers) {
    layer.formats = KvFormats{KFormat::kQ8_0, VFormat::kQ5_1};
  }
  EXPECT_EQ(Fingerprint(explicit_formats), Fingerprint(Llama3_8B()));

  // The same plan under other defaults is another layout.
  FormatDefaults fp8;
  fp8.ordinary = {KFormat::kFp8, VFormat::kFp8};
  EXPECT_NE(Fingerprint(Llama3_8B(), fp8), Fingerprint(Llama3_8B()));
  EXPECT_EQ(Fingerprint(explicit_formats, fp8), Fingerprint(Llama3_8B()));  // explicit wins

  // Spec serving moves Gemma's windowed default to q8_0/q5_1.
  FormatDefaults spec_serving;
  spec_serving.gemma_windowed = {KFormat::kQ8_0, VFormat::kQ5_1};
  EXPECT_NE(Fingerprint(GemmaStyle(true), spec_serving), Fingerprint(GemmaStyle(true)));
}

TEST(ModelPlanTest, FingerprintChangesWithEveryLayoutField) {
  const std::string base = Fingerprint(GemmaStyle(false));
  std::vector<ModelPlan> variants(7, GemmaStyle(false));
  variants[0].layers[0].head_dim_k = 512;
  variants[1].layers[0].n_head_kv = 4;
  variants[2].layers[0].window = 512;
  variants[3].swa_ring = true;
  variants[4].layers[8].shares_kv_with = 6;
  variants[5].layers[0].formats = KvFormats{KFormat::kFp8, VFormat::kQ4_0};
  variants[6].layers[11] = SharedLayer(11, 7);
  for (size_t i = 0; i < variants.size(); ++i) {
    EXPECT_NE(Fingerprint(variants[i]), base) << "variant " << i;
  }

  EXPECT_NE(Fingerprint(GlmStyleWithIndexer(0)), Fingerprint(GlmStyleWithIndexer()));
  EXPECT_NE(Fingerprint(GlmStyleWithIndexer(4096)), Fingerprint(GlmStyleWithIndexer()));
  ModelPlan pool8 = GlmStyleWithIndexer();
  pool8.layers[3].index_pool = 8;
  EXPECT_NE(Fingerprint(pool8), Fingerprint(GlmStyleWithIndexer()));
  ModelPlan state = Qwen3NextStyle();
  state.layers[0].state_width /= 2;
  EXPECT_NE(Fingerprint(state), Fingerprint(Qwen3NextStyle()));

  // The same layers split differently between trunk and MTP are different models.
  ModelPlan all_trunk = DeepSeekV3Style();
  all_trunk.layers.push_back(all_trunk.mtp_blocks[0]);
  all_trunk.mtp_blocks.clear();
  EXPECT_NE(Fingerprint(all_trunk), Fingerprint(DeepSeekV3Style()));
}

TEST(ModelPlanTest, FingerprintIgnoresSwitchesNoLayerReads) {
  ModelPlan ring_on_dense = Llama3_8B();
  ring_on_dense.swa_ring = true;
  ring_on_dense.index_ring_rows = 0;
  EXPECT_EQ(Fingerprint(ring_on_dense), Fingerprint(Llama3_8B()));
  // Unset books the working-set default, so naming it is the same layout.
  EXPECT_EQ(Fingerprint(GlmStyleWithIndexer(5120)), Fingerprint(GlmStyleWithIndexer()));
}

TEST(ModelPlanTest, FingerprintRefusesAnInvalidPlan) {
  ModelPlan plan = Llama3_8B();
  plan.layers[0].head_dim_k = 0;
  EXPECT_THAT(FingerprintModelPlan(plan, FormatDefaults{}),
              StatusIs(kInvalid, HasSubstr("head_dim_k must be positive")));
}

}  // namespace
}  // namespace memra
