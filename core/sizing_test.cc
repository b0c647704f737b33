#include "core/sizing.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <tuple>

#include "absl/status/status.h"
#include "core/kv_ring.h"
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
constexpr KvFormats kQ8Q5{KFormat::kQ8_0, VFormat::kQ5_1};
constexpr uint64_t kMaxCapacity = std::numeric_limits<int32_t>::max();

SessionShape Capacity(uint64_t capacity) {
  SessionShape request;
  request.capacity = capacity;
  return request;
}

const PlaneSpec* FindPlane(const SessionPlan& session, uint32_t layer, PlaneKind kind) {
  for (const PlaneSpec& plane : session.planes) {
    if (plane.layer == layer && plane.kind == kind) return &plane;
  }
  return nullptr;
}

const LayerGeometry* FindGeometry(const SessionPlan& session, uint32_t layer) {
  for (const LayerGeometry& geometry : session.layers) {
    if (geometry.layer == layer) return &geometry;
  }
  return nullptr;
}

// What the sizing contract promises of every plan, checked independently of the cost code:
// planes in (layer, kind) order, each plane's bytes its rows plus only a known extra, totals
// that add up, and the cost breakdown's identity.
void ExpectConsistent(const SessionPlan& session, const CostBreakdown& cost) {
  uint64_t sum = 0;
  uint64_t scaling_body = 0;
  for (size_t i = 0; i < session.planes.size(); ++i) {
    const PlaneSpec& plane = session.planes[i];
    if (i > 0) {
      const PlaneSpec& before = session.planes[i - 1];
      EXPECT_LT(std::tie(before.layer, before.kind), std::tie(plane.layer, plane.kind));
    }
    const uint64_t body = plane.rows * plane.row_bytes;
    const uint64_t extra = plane.bytes - body;
    const bool kv = plane.kind == PlaneKind::kKeys || plane.kind == PlaneKind::kValues;
    const bool empty_pool_keys = plane.kind == PlaneKind::kPoolKeys && plane.rows == 0;
    EXPECT_EQ(extra, kv ? 8u : empty_pool_keys ? 4u : 0u) << "layer " << plane.layer;
    sum += plane.bytes;
    if (plane.scales_with_context) scaling_body += body;
  }
  EXPECT_EQ(session.total_bytes, sum);
  EXPECT_EQ(cost.total_bytes, session.total_bytes);
  EXPECT_EQ(cost.total_bytes, cost.fixed_bytes + scaling_body);
}

struct Sized {
  SessionPlan session;
  CostBreakdown cost;
};

Sized Size(const ModelPlan& plan, const SessionShape& request,
           const FormatDefaults& defaults = {}) {
  absl::StatusOr<SessionPlan> session = PlanSession(plan, defaults, request);
  EXPECT_TRUE(session.ok()) << session.status();
  if (!session.ok()) return {};
  absl::StatusOr<CostBreakdown> cost = CostOfSession(plan, defaults, request);
  EXPECT_TRUE(cost.ok()) << cost.status();
  if (!cost.ok()) return {};
  ExpectConsistent(*session, *cost);
  return {*std::move(session), *cost};
}

// ---------------------------------------------------------------- reference twins
// Tests ported from the reference with its numbers (docs/rules.md#the-reference; the rules:
// docs/rules.md#sizing).

TEST(TpKvRankShapeTest, StepTp8RankAllocationMatchesTheOfficialKvGeometry) {
  absl::StatusOr<TpKvRankShape> shape = TpKvRankAllocationShape(8 * 128, 8 * 128, 8, kQ8Q5);
  ASSERT_THAT(shape.status(), IsOk());
  EXPECT_EQ(shape->kv_dim_k, 128u);
  EXPECT_EQ(shape->kv_dim_v, 128u);
  EXPECT_EQ(shape->k_token_bytes, 136u);  // 128 / 32 x 34
  EXPECT_EQ(shape->v_token_bytes, 96u);   // 128 / 32 x 24
  EXPECT_EQ(shape->BytesPerToken(), 232u);
  EXPECT_EQ(shape->fixed_bytes, 20u);  // two 8-byte tail pads + one i32 length mirror
  EXPECT_EQ(shape->AllocationBytes(262'144), 232u * 262'144 + 20);
}

TEST(TpKvRankShapeTest, TpRankAllocationRefusesNonDivisibleAndNonBlockAlignedShards) {
  EXPECT_THAT(TpKvRankAllocationShape(1024, 1024, 3, kQ8Q5),
              StatusIs(kInvalid, ::testing::Eq("TP KV dimensions k=1024 v=1024 are not "
                                               "divisible by TP=3")));
  EXPECT_THAT(TpKvRankAllocationShape(1024, 1024, 64, kQ8Q5),
              StatusIs(kInvalid, ::testing::Eq("TP KV local dimensions k=16 v=16 must be "
                                               "32-aligned")));
  EXPECT_THAT(TpKvRankAllocationShape(0, 1024, 8, kQ8Q5),
              StatusIs(kInvalid, ::testing::Eq("TP KV dimensions and rank count must be "
                                               "nonzero: k=0 v=1024 ranks=8")));
  EXPECT_THAT(TpKvRankAllocationShape(1024, 1024, 0, kQ8Q5),
              StatusIs(kInvalid, HasSubstr("ranks=0")));
}

TEST(TpKvRankShapeTest, TokenBytesFollowTheFormats) {
  absl::StatusOr<TpKvRankShape> fp8 =
      TpKvRankAllocationShape(1024, 1024, 8, {KFormat::kFp8, VFormat::kFp8});
  ASSERT_THAT(fp8.status(), IsOk());
  EXPECT_EQ(fp8->BytesPerToken(), 256u);  // 4 blocks x 32 + 4 blocks x 32
  absl::StatusOr<TpKvRankShape> q4 =
      TpKvRankAllocationShape(1024, 1024, 8, {KFormat::kQ8_0, VFormat::kQ4_0});
  ASSERT_THAT(q4.status(), IsOk());
  EXPECT_EQ(q4->BytesPerToken(), 136u + 72u);  // V: 4 blocks x 18
}

TEST(TpKvRankShapeTest, ElementFormatsHaveNoBlockAlignment) {
  // 1024 / 64 = 16 local elements: no q8_0 block fits, 16 bf16 values do (32 B).
  const absl::StatusOr<TpKvRankShape> shape =
      TpKvRankAllocationShape(1024, 1024, 64, {KFormat::kBf16, VFormat::kFp8E4m3});
  ASSERT_THAT(shape, IsOk());
  EXPECT_EQ(shape->k_token_bytes, 32u);
  EXPECT_EQ(shape->v_token_bytes, 16u);
  EXPECT_EQ(shape->fixed_bytes, 20u);
}

TEST(TpKvRankShapeTest, PerTokenAndAllocationSaturateLikeTheReference) {
  TpKvRankShape shape;
  shape.k_token_bytes = std::numeric_limits<uint64_t>::max();
  shape.v_token_bytes = 1;
  shape.fixed_bytes = 20;
  EXPECT_EQ(shape.BytesPerToken(), std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(shape.AllocationBytes(2), std::numeric_limits<uint64_t>::max());
  // (2^64 - 32) / 32 blocks x 34 bytes does not fit in 64 bits.
  const uint64_t widest = std::numeric_limits<uint64_t>::max() - 31;
  EXPECT_THAT(TpKvRankAllocationShape(widest, widest, 1, kQ8Q5),
              StatusIs(kInvalid, HasSubstrs("TP KV K token bytes overflows")));
}

TEST(KvPlaneTest, AllocationRowsCoverWindowMaxPrimeAndAlignmentSlack) {
  // The Step35 session plane: ring rows for window 512 at 262144, plus the existing tail pad.
  EXPECT_EQ(SwaRingRows(512, 262'144), 5151u);
  EXPECT_EQ(*KvPlaneAllocationBytes(5151, 1088), 5151u * 1088 + 8);
  EXPECT_THAT(KvPlaneAllocationBytes(std::numeric_limits<uint64_t>::max() / 2, 4),
              StatusIs(kInvalid, HasSubstr("K/V plane bytes overflows")));
}

// ---------------------------------------------------------------- (1) dense: Llama-3-8B

TEST(SizingTest, Llama3_8BDenseIsFlatKvOnly) {
  // Per layer: kv_dim 8 x 128 = 1024. K q8_0: 1024 / 32 x 34 = 1088 B/token; V q5_1:
  // 1024 / 32 x 24 = 768 -> 1856 B/token/layer, x 32 layers = 59392 B/token.
  // Fixed per layer: K pad 8 + V pad 8 + len mirror 4 = 20 -> 640.
  // At 8192: 59392 x 8192 + 640 = 486,539,904 bytes (~464 MiB).
  const Sized sized = Size(Llama3_8B(), Capacity(8192));
  EXPECT_EQ(sized.session.total_bytes, 486'539'904u);
  EXPECT_EQ(sized.cost.bytes_per_token, 59'392u);
  EXPECT_EQ(sized.cost.kv_bytes_per_token, 59'392u);
  EXPECT_EQ(sized.cost.ring_bytes_per_token, 0u);
  EXPECT_EQ(sized.cost.latent_bytes_per_token, 0u);
  EXPECT_EQ(sized.cost.ring_row_cap, 0u);
  EXPECT_EQ(sized.cost.fixed_bytes, 640u);
  EXPECT_EQ(sized.session.planes.size(), 32u * 3);

  const PlaneSpec* keys = FindPlane(sized.session, 0, PlaneKind::kKeys);
  ASSERT_NE(keys, nullptr);
  EXPECT_EQ(keys->rows, 8192u);
  EXPECT_EQ(keys->row_bytes, 1088u);
  EXPECT_EQ(keys->bytes, 8192u * 1088 + 8);
  EXPECT_TRUE(keys->scales_with_context);
  const PlaneSpec* values = FindPlane(sized.session, 31, PlaneKind::kValues);
  ASSERT_NE(values, nullptr);
  EXPECT_EQ(values->bytes, 8192u * 768 + 8);
  const PlaneSpec* len = FindPlane(sized.session, 31, PlaneKind::kLenMirror);
  ASSERT_NE(len, nullptr);
  EXPECT_EQ(len->bytes, 4u);
  EXPECT_FALSE(len->scales_with_context);
  EXPECT_EQ(FindPlane(sized.session, 0, PlaneKind::kBaseMirror), nullptr);

  const LayerGeometry* geometry = FindGeometry(sized.session, 17);
  ASSERT_NE(geometry, nullptr);
  EXPECT_EQ(geometry->kind, StateKind::kKv);
  EXPECT_EQ(geometry->formats, kQ8Q5);
  EXPECT_EQ(geometry->kv_dim_k, 1024u);
  EXPECT_EQ(geometry->kv_dim_v, 1024u);
  EXPECT_EQ(geometry->k_token_bytes, 1088u);
  EXPECT_EQ(geometry->v_token_bytes, 768u);
  EXPECT_EQ(geometry->physical_rows, 8192u);
  EXPECT_FALSE(geometry->ring);

  // At 128k: 59392 x 131072 + 640 = 7,784,628,864 (~7.25 GiB).
  EXPECT_EQ(Size(Llama3_8B(), Capacity(131'072)).cost.total_bytes, 7'784'628'864u);
}

TEST(SizingTest, Llama3_8BInElementFormatsIsElementsTimesTheirBytes) {
  // bf16: kv_dim 1024 x 2 B = 2048 for K and for V -> 4096 B/token/layer, x 32 = 131072.
  // At 8192: 131072 x 8192 + 640 = 1,073,742,464 (exactly 1 GiB + the fixed 640).
  const Sized bf16 = Size(InElementFormat(Llama3_8B(), ElementFormat::kBf16), Capacity(8192));
  EXPECT_EQ(bf16.cost.bytes_per_token, 131'072u);
  EXPECT_EQ(bf16.cost.kv_bytes_per_token, 131'072u);
  EXPECT_EQ(bf16.cost.fixed_bytes, 640u);
  EXPECT_EQ(bf16.session.total_bytes, 1'073'742'464u);
  const LayerGeometry* geometry = FindGeometry(bf16.session, 3);
  ASSERT_NE(geometry, nullptr);
  EXPECT_EQ(geometry->formats, (KvFormats{KFormat::kBf16, VFormat::kBf16}));
  EXPECT_EQ(geometry->k_token_bytes, 2048u);
  EXPECT_EQ(geometry->head_dim_k, 128u);
  EXPECT_EQ(geometry->head_dim_v, 128u);
  EXPECT_EQ(geometry->n_head_kv, 8u);
  const PlaneSpec* keys = FindPlane(bf16.session, 3, PlaneKind::kKeys);
  ASSERT_NE(keys, nullptr);
  EXPECT_EQ(keys->bytes, 8192u * 2048 + 8);  // the reference's tail pad stays

  // f16 costs what bf16 does; f32 twice; fp8 e4m3 / e5m2 half: 1024 + 1024 = 2048 x 32 = 65536.
  EXPECT_EQ(Size(InElementFormat(Llama3_8B(), ElementFormat::kF16), Capacity(8192))
                .cost.bytes_per_token,
            131'072u);
  EXPECT_EQ(Size(InElementFormat(Llama3_8B(), ElementFormat::kF32), Capacity(8192))
                .cost.bytes_per_token,
            262'144u);
  const Sized fp8 = Size(InElementFormat(Llama3_8B(), ElementFormat::kFp8E4m3), Capacity(8192));
  EXPECT_EQ(fp8.cost.bytes_per_token, 65'536u);
  EXPECT_EQ(fp8.session.total_bytes, 65'536u * 8192 + 640);
  EXPECT_EQ(Size(InElementFormat(Llama3_8B(), ElementFormat::kFp8E5m2), Capacity(8192))
                .cost.bytes_per_token,
            65'536u);
}

TEST(SizingTest, KAndVTakeTheirFormatsIndependently) {
  // K bf16: 1024 x 2 = 2048; V q4_0: 1024 / 32 x 18 = 576 -> 2624 B/token/layer.
  ModelPlan plan = Llama3_8B();
  for (LayerPlan& layer : plan.layers) layer.formats = KvFormats{KFormat::kBf16, VFormat::kQ4_0};
  EXPECT_EQ(Size(plan, Capacity(1024)).cost.bytes_per_token, 32u * 2624);
}

TEST(SizingTest, ElementFormatsHoldHeadDimsNoBlockCould) {
  // head_dim 80 (Phi-style): 640 elements per token; bf16 = 1280 B for K and for V.
  const Sized sized = Size(InElementFormat(DenseModel(2, 80, 8), ElementFormat::kBf16),
                           Capacity(100));
  EXPECT_EQ(sized.cost.bytes_per_token, 2u * 2560);
  EXPECT_EQ(sized.session.total_bytes, 2u * (2 * (100 * 1280 + 8) + 4));
}

TEST(SizingTest, ElementFormatShardsSplitWholeHeads) {
  // TP-2 of Llama-3-8B in bf16: 4 local heads of 128 -> 1024 B for K per token per layer.
  SessionShape two = Capacity(4096);
  two.tp_ranks = 2;
  const Sized sized = Size(InElementFormat(Llama3_8B(), ElementFormat::kBf16), two);
  const LayerGeometry* geometry = FindGeometry(sized.session, 0);
  ASSERT_NE(geometry, nullptr);
  EXPECT_EQ(geometry->n_head_kv, 4u);
  EXPECT_EQ(geometry->kv_dim_k, 512u);
  EXPECT_EQ(geometry->k_token_bytes, 1024u);
  // TP-16 would split each of the 8 heads in two: refused, naming the formats and numbers (the
  // reference's block rule alone would accept its 64-element shards).
  SessionShape sixteen = Capacity(4096);
  sixteen.tp_ranks = 16;
  EXPECT_THAT(PlanSession(InElementFormat(Llama3_8B(), ElementFormat::kBf16), {}, sixteen),
              StatusIs(kInvalid, ::testing::Eq("layer 0 K/V formats bf16/bf16 shard whole heads: "
                                               "n_head_kv 8 is not divisible by tp_ranks 16")));
  EXPECT_THAT(PlanSession(Llama3_8B(), {}, sixteen), IsOk());
}

TEST(SizingTest, DeepSeekV3LatentRowsInBf16AreHalfTheF32Rows) {
  // 576 bf16 = 1152 B/token per layer x 62 = 71,424 B/token; at 163840:
  // 71,424 x 163,840 + 248 = 11,702,108,408.
  const Sized sized =
      Size(InElementFormat(DeepSeekV3Style(), ElementFormat::kBf16), Capacity(163'840));
  EXPECT_EQ(sized.cost.latent_bytes_per_token, 71'424u);
  EXPECT_EQ(sized.cost.total_bytes, 11'702'108'408u);
  const PlaneSpec* rows = FindPlane(sized.session, 61, PlaneKind::kLatentRows);
  ASSERT_NE(rows, nullptr);
  EXPECT_EQ(rows->row_bytes, 1152u);
  EXPECT_EQ(FindGeometry(sized.session, 61)->latent_format, ElementFormat::kBf16);
  // fp8 e4m3 rows: 576 x 62 = 35,712 B/token.
  EXPECT_EQ(Size(InElementFormat(DeepSeekV3Style(), ElementFormat::kFp8E4m3), Capacity(1024))
                .cost.latent_bytes_per_token,
            35'712u);
  // The indexer stays f32 beside bf16 rows: 1152 + 256 x 4 + (128 x 4) / 4 = 2304 per layer.
  SessionShape flat = Capacity(4096);
  EXPECT_EQ(Size(InElementFormat(GlmStyleWithIndexer(0), ElementFormat::kBf16), flat)
                .cost.latent_bytes_per_token,
            12u * (1152 + 1024 + 128));
}

TEST(SizingTest, LayerRangeHoldsOnlyItsLayers) {
  // A pipeline stage [8, 16): 8 layers x 1856 = 14848 B/token, 8 x 20 = 160 fixed.
  SessionShape request = Capacity(8192);
  request.layer_lo = 8;
  request.layer_hi = 16;
  const Sized sized = Size(Llama3_8B(), request);
  EXPECT_EQ(sized.cost.bytes_per_token, 14'848u);
  EXPECT_EQ(sized.cost.fixed_bytes, 160u);
  EXPECT_EQ(sized.session.layers.size(), 8u);
  EXPECT_EQ(sized.session.layers.front().layer, 8u);
  EXPECT_EQ(sized.session.planes.back().layer, 15u);

  request.layer_lo = 5;  // an empty range is legal, as in the reference
  request.layer_hi = 5;
  const Sized empty = Size(Llama3_8B(), request);
  EXPECT_TRUE(empty.session.planes.empty());
  EXPECT_EQ(empty.cost.total_bytes, 0u);
}

TEST(SizingTest, OrdinaryFp8DoorChangesTheDenseCoefficient) {
  // MEMRA_KV_FP8=1: 1024 / 32 x 32 = 1024 per plane -> 2048 B/token/layer, 65536 over 32.
  FormatDefaults fp8;
  fp8.ordinary = {KFormat::kFp8, VFormat::kFp8};
  EXPECT_EQ(Size(Llama3_8B(), Capacity(8192), fp8).cost.bytes_per_token, 65'536u);
}

// ---------------------------------------------------------------- (2) Gemma SWA + global

TEST(SizingTest, GemmaWithoutRingIsFlatAndSharedLayersOwnNothing) {
  // fp8 defaults for both Gemma classes (plain serving): token bytes = kv_dim.
  // Sliding: K 512 + V 512 = 1024 B/token, seven layers (0-4, 6, 7) = 7168.
  // Global (5): K 1024 + V 1024 = 2048. Shared 8-11: nothing. Total 9216 B/token.
  // Fixed: 8 owning layers x 20 = 160. At 32768: 9216 x 32768 + 160 = 301,990,048.
  const Sized sized = Size(GemmaStyle(false), Capacity(32'768));
  EXPECT_EQ(sized.cost.bytes_per_token, 9216u);
  EXPECT_EQ(sized.cost.kv_bytes_per_token, 9216u);
  EXPECT_EQ(sized.cost.ring_bytes_per_token, 0u);
  EXPECT_EQ(sized.cost.ring_row_cap, 0u);
  EXPECT_EQ(sized.cost.fixed_bytes, 160u);
  EXPECT_EQ(sized.cost.total_bytes, 301'990'048u);
  EXPECT_EQ(sized.session.layers.size(), 8u);
  for (uint32_t shared = 8; shared < 12; ++shared) {
    EXPECT_EQ(FindGeometry(sized.session, shared), nullptr) << shared;
    EXPECT_EQ(FindPlane(sized.session, shared, PlaneKind::kLenMirror), nullptr) << shared;
  }
  const LayerGeometry* windowed = FindGeometry(sized.session, 0);
  ASSERT_NE(windowed, nullptr);
  EXPECT_EQ(windowed->attention, AttentionClass::kGemmaWindowed);
  EXPECT_EQ(windowed->kv_dim_k, 512u);
  EXPECT_EQ(windowed->window, 1024u);
  EXPECT_FALSE(windowed->ring);
  const LayerGeometry* global = FindGeometry(sized.session, 5);
  ASSERT_NE(global, nullptr);
  EXPECT_EQ(global->kv_dim_k, 1024u);
  EXPECT_EQ(global->formats, (KvFormats{KFormat::kFp8, VFormat::kFp8}));
}

TEST(SizingTest, GemmaRingCapsSlidingLayersAtWindowPlusPrimePlusSlack) {
  // Ring rows: 1024 + 4096 + 512 + 31 = 5663. Each sliding plane: 5663 x 512 + 8 = 2,899,464;
  // per sliding layer 2 x 2,899,464 + len 4 + base 4 = 5,798,936; seven: 40,592,552.
  // Global stays flat: 2048 x 32768 + 20 = 67,108,884. Total 107,701,436 (vs 301,990,048).
  const Sized sized = Size(GemmaStyle(true), Capacity(32'768));
  EXPECT_EQ(sized.cost.total_bytes, 107'701'436u);
  EXPECT_EQ(sized.cost.bytes_per_token, 2048u);
  EXPECT_EQ(sized.cost.kv_bytes_per_token, 2048u);
  EXPECT_EQ(sized.cost.ring_bytes_per_token, 7168u);  // reference cache_ring_bytes_per_token
  EXPECT_EQ(sized.cost.ring_row_cap, 5663u);
  EXPECT_EQ(sized.cost.fixed_bytes, 40'592'552u + 20);

  const PlaneSpec* keys = FindPlane(sized.session, 0, PlaneKind::kKeys);
  ASSERT_NE(keys, nullptr);
  EXPECT_EQ(keys->rows, 5663u);
  EXPECT_EQ(keys->bytes, 2'899'464u);
  EXPECT_FALSE(keys->scales_with_context);
  ASSERT_NE(FindPlane(sized.session, 0, PlaneKind::kBaseMirror), nullptr);
  EXPECT_EQ(FindPlane(sized.session, 5, PlaneKind::kBaseMirror), nullptr);  // global: flat
  const LayerGeometry* windowed = FindGeometry(sized.session, 7);
  ASSERT_NE(windowed, nullptr);
  EXPECT_TRUE(windowed->ring);
  EXPECT_EQ(windowed->physical_rows, 5663u);
}

TEST(SizingTest, GemmaRingBelowItsCapIsClampedToCapacityAndScales) {
  // 4096 < 5663: SwaRingRows returns the capacity; the layer is still ring-addressed (KvRing
  // with rows == capacity, base mirror booked) but its bytes grow with the capacity.
  // 9216 x 4096 + 8 x 20 + 7 base mirrors x 4 = 37,748,924.
  const Sized sized = Size(GemmaStyle(true), Capacity(4096));
  EXPECT_EQ(sized.cost.total_bytes, 37'748'924u);
  EXPECT_EQ(sized.cost.bytes_per_token, 9216u);
  EXPECT_EQ(sized.cost.kv_bytes_per_token, 2048u);
  EXPECT_EQ(sized.cost.ring_bytes_per_token, 7168u);
  EXPECT_EQ(sized.cost.fixed_bytes, 188u);
  const PlaneSpec* keys = FindPlane(sized.session, 0, PlaneKind::kKeys);
  ASSERT_NE(keys, nullptr);
  EXPECT_EQ(keys->rows, 4096u);
  EXPECT_TRUE(keys->scales_with_context);
  EXPECT_TRUE(FindGeometry(sized.session, 0)->ring);
  ASSERT_NE(FindPlane(sized.session, 0, PlaneKind::kBaseMirror), nullptr);

  // At exactly the cap the rows no longer grow with a larger capacity: fixed.
  const Sized at_cap = Size(GemmaStyle(true), Capacity(5663));
  EXPECT_FALSE(FindPlane(at_cap.session, 0, PlaneKind::kKeys)->scales_with_context);
  EXPECT_EQ(at_cap.cost.bytes_per_token, 2048u);
}

TEST(SizingTest, GemmaSpecServingKeepsWindowedLayersQuantized) {
  // MEMRA_DRAFT set: windowed default q8_0/q5_1 -> 512 / 32 x 34 + 512 / 32 x 24 = 544 + 384
  // = 928 B/token; globals stay fp8. 7 x 928 + 2048 = 8544 B/token.
  FormatEnvironment env;
  env.draft = "drafter";
  absl::StatusOr<FormatDefaults> defaults = FormatDefaultsFromEnvironment(env);
  ASSERT_THAT(defaults.status(), IsOk());
  const Sized sized = Size(GemmaStyle(false), Capacity(32'768), *defaults);
  EXPECT_EQ(sized.cost.bytes_per_token, 8544u);
  EXPECT_EQ(FindGeometry(sized.session, 0)->k_token_bytes, 544u);
  EXPECT_EQ(FindGeometry(sized.session, 5)->k_token_bytes, 1024u);
}

// ---------------------------------------------------------------- (3) MLA latent

TEST(SizingTest, DeepSeekV3LatentRowsScaleAndMtpIsIncluded) {
  // 576 f32 = 2304 B/token per layer, 61 trunk + 1 MTP = 62 layers -> 142,848 B/token;
  // fixed = 62 len mirrors x 4 = 248. At 163840 (160k): 142,848 x 163,840 + 248
  // = 23,404,216,568 bytes (~21.8 GiB).
  const Sized sized = Size(DeepSeekV3Style(), Capacity(163'840));
  EXPECT_EQ(sized.cost.total_bytes, 23'404'216'568u);
  EXPECT_EQ(sized.cost.bytes_per_token, 142'848u);
  EXPECT_EQ(sized.cost.latent_bytes_per_token, 142'848u);
  EXPECT_EQ(sized.cost.kv_bytes_per_token, 0u);
  EXPECT_EQ(sized.cost.fixed_bytes, 248u);
  EXPECT_EQ(FindPlane(sized.session, 0, PlaneKind::kIndexRows), nullptr);
  EXPECT_EQ(FindPlane(sized.session, 0, PlaneKind::kPoolKeys), nullptr);
  const PlaneSpec* rows = FindPlane(sized.session, 61, PlaneKind::kLatentRows);
  ASSERT_NE(rows, nullptr);
  EXPECT_EQ(rows->bytes, 163'840u * 2304);

  // The trunk alone (what the reference's latent coefficient sums over plan.layers).
  SessionShape trunk = Capacity(163'840);
  trunk.layer_hi = 61;
  EXPECT_EQ(Size(DeepSeekV3Style(), trunk).cost.latent_bytes_per_token, 61u * 2304);
}

TEST(SizingTest, GlmIndexerRingIsFiveMiBPerLayerAtOneMillion) {
  // Per layer at 1M (1,048,576): latent rows 1M x 2304 = 2,415,919,104; the indexer is a
  // 5120-row tail ring of 1 KiB rows = 5,242,880 (5 MiB, fixed); pool keys 1M / 4 = 262,144
  // pools x 128 f32 = 134,217,728; len mirror 4 -> 2,555,379,716; x 12 = 30,664,556,592.
  // Reference coefficient: 2304 + (256 / 2) x 4 / 4 = 2432 B/token/layer -> 29,184.
  const Sized sized = Size(GlmStyleWithIndexer(), Capacity(1'048'576));
  EXPECT_EQ(sized.cost.total_bytes, 30'664'556'592u);
  EXPECT_EQ(sized.cost.latent_bytes_per_token, 29'184u);
  EXPECT_EQ(sized.cost.bytes_per_token, 29'184u);
  EXPECT_EQ(sized.cost.fixed_bytes, 12u * (4 + 5'242'880));
  EXPECT_EQ(sized.cost.total_bytes, sized.cost.fixed_bytes + uint64_t{1'048'576} * 29'184);

  const PlaneSpec* index = FindPlane(sized.session, 0, PlaneKind::kIndexRows);
  ASSERT_NE(index, nullptr);
  EXPECT_EQ(index->rows, 5120u);
  EXPECT_EQ(index->row_bytes, 1024u);  // 2 x 128 f32: the reference's GLM5_NEXT_STATE_ROW_BYTES
  EXPECT_EQ(index->bytes, 5u << 20);   // RING_BYTES_PER_LAYER
  EXPECT_FALSE(index->scales_with_context);
  const PlaneSpec* keys = FindPlane(sized.session, 11, PlaneKind::kPoolKeys);
  ASSERT_NE(keys, nullptr);
  EXPECT_EQ(keys->rows, 262'144u);
  EXPECT_EQ(keys->row_bytes, 512u);
  EXPECT_TRUE(keys->scales_with_context);
  const LayerGeometry* geometry = FindGeometry(sized.session, 3);
  ASSERT_NE(geometry, nullptr);
  EXPECT_TRUE(geometry->index_ring);
  EXPECT_EQ(geometry->index_physical_rows, 5120u);
  EXPECT_EQ(geometry->index_pool, 4u);
}

TEST(SizingTest, GlmIndexerRingDisabledBooksTheOneGiBFlatPlane) {
  // MEMRA_DSA_INDEX_RING=0: the indexer plane is flat, 1M x 1024 = 1 GiB per layer, and the
  // reference coefficient gains index_width x 4: 2304 + 128 + 1024 = 3456 B/token/layer.
  const Sized sized = Size(GlmStyleWithIndexer(0), Capacity(1'048'576));
  const PlaneSpec* index = FindPlane(sized.session, 0, PlaneKind::kIndexRows);
  ASSERT_NE(index, nullptr);
  EXPECT_EQ(index->bytes, 1u << 30);
  EXPECT_TRUE(index->scales_with_context);
  EXPECT_EQ(sized.cost.latent_bytes_per_token, 12u * 3456);
  EXPECT_FALSE(FindGeometry(sized.session, 0)->index_ring);

  // A pinned ring books exactly its rows.
  const Sized pinned = Size(GlmStyleWithIndexer(2048), Capacity(1'048'576));
  EXPECT_EQ(FindPlane(pinned.session, 0, PlaneKind::kIndexRows)->rows, 2048u);
}

TEST(SizingTest, GlmShortContextCountsTheCollapsedRingPlaneUnlikeTheReference) {
  // At 4096 the 5120-row ring is not shorter than the context and collapses to the flat plane
  // (4096 x 1024 = 4 MiB per layer). That plane scales, so we charge it per token:
  // 2304 + 1024 + 128 = 3456 B/token/layer -> 41,472; fixed = 12 len mirrors = 48;
  // 41,472 x 4096 + 48 = 169,869,360. The reference coefficient leaves it to its fixed
  // residual (2432/layer = 29,184), which its own comment calls a bounded under-count.
  const Sized sized = Size(GlmStyleWithIndexer(), Capacity(4096));
  EXPECT_EQ(sized.cost.total_bytes, 169'869'360u);
  EXPECT_EQ(sized.cost.latent_bytes_per_token, 41'472u);
  EXPECT_NE(sized.cost.latent_bytes_per_token, 12u * 2432);  // the reference's value
  EXPECT_EQ(sized.cost.fixed_bytes, 48u);
  const LayerGeometry* geometry = FindGeometry(sized.session, 0);
  EXPECT_FALSE(geometry->index_ring);
  EXPECT_EQ(geometry->index_physical_rows, 4096u);
}

TEST(SizingTest, PoolKeysAreBookedEagerlyWithTheReferencesOneElementFloor) {
  // Below one pool there are no keys, but the reference still allocates max(1, 0) f32.
  const Sized tiny = Size(GlmStyleWithIndexer(), Capacity(3));
  const PlaneSpec* keys = FindPlane(tiny.session, 0, PlaneKind::kPoolKeys);
  ASSERT_NE(keys, nullptr);
  EXPECT_EQ(keys->rows, 0u);
  EXPECT_EQ(keys->bytes, 4u);
  // A capacity that is not a whole number of pools books only whole pools: 4099 / 4 = 1024.
  const Sized ragged = Size(GlmStyleWithIndexer(), Capacity(4099));
  EXPECT_EQ(FindPlane(ragged.session, 0, PlaneKind::kPoolKeys)->bytes, 1024u * 512);
  EXPECT_LE(ragged.cost.total_bytes, ragged.cost.fixed_bytes + 4099 * ragged.cost.bytes_per_token);
}

// ---------------------------------------------------------------- (4) hybrid linear attention

TEST(SizingTest, Qwen3NextHybridRecurrentStateIsFixedAndAttentionScales) {
  // 36 Gated DeltaNet layers: conv 8192 x (4 - 1) f32 = 98,304 B; ssm and ssm_alt
  // 524,288 f32 = 2 MiB each -> 4,292,608 per layer, 154,533,888 in all.
  // 12 attention layers: kv_dim 2 x 256 = 512 -> 544 + 384 = 928 B/token, 11,136 in all;
  // fixed 12 x 20 = 240. At 262144: 11,136 x 262,144 + 240 + 154,533,888 = 3,073,769,712.
  const Sized sized = Size(Qwen3NextStyle(), Capacity(262'144));
  EXPECT_EQ(sized.cost.total_bytes, 3'073'769'712u);
  EXPECT_EQ(sized.cost.bytes_per_token, 11'136u);
  EXPECT_EQ(sized.cost.kv_bytes_per_token, 11'136u);
  EXPECT_EQ(sized.cost.fixed_bytes, 154'533'888u + 240);
  const PlaneSpec* conv = FindPlane(sized.session, 0, PlaneKind::kConvState);
  ASSERT_NE(conv, nullptr);
  EXPECT_EQ(conv->bytes, 98'304u);
  EXPECT_FALSE(conv->scales_with_context);
  EXPECT_EQ(FindPlane(sized.session, 0, PlaneKind::kSsmStateAlt)->bytes, 2u << 20);
  EXPECT_EQ(FindPlane(sized.session, 0, PlaneKind::kSpecConv), nullptr);
  const LayerGeometry* recurrent = FindGeometry(sized.session, 0);
  ASSERT_NE(recurrent, nullptr);
  EXPECT_EQ(recurrent->conv_elems, 24'576u);
  EXPECT_EQ(recurrent->ssm_elems, 524'288u);
  EXPECT_EQ(FindGeometry(sized.session, 3)->k_token_bytes, 544u);
}

TEST(SizingTest, Qwen3NextSpecSnapshotAddsPersistentConvAndSsmCopies) {
  // + 98,304 + 2 MiB per recurrent layer: 36 x 6,488,064 = 233,570,304 fixed recurrent bytes.
  // Total 11,136 x 262,144 + 240 + 233,570,304 = 3,152,806,128.
  SessionShape request = Capacity(262'144);
  request.spec_snapshot = true;
  const Sized sized = Size(Qwen3NextStyle(), request);
  EXPECT_EQ(sized.cost.total_bytes, 3'152'806'128u);
  EXPECT_EQ(sized.cost.fixed_bytes, 233'570'304u + 240);
  EXPECT_EQ(FindPlane(sized.session, 46, PlaneKind::kSpecConv)->bytes, 98'304u);
  EXPECT_EQ(FindPlane(sized.session, 46, PlaneKind::kSpecSsm)->bytes, 2u << 20);
  EXPECT_EQ(FindPlane(sized.session, 47, PlaneKind::kSpecSsm), nullptr);  // attention layer
}

TEST(SizingTest, ConvKernelOfOneKeepsNoConvHistory) {
  ModelPlan plan;
  plan.layers.push_back(RecurrentLayer(0, 8192, 1, 4096));
  const Sized sized = Size(plan, Capacity(16));
  EXPECT_EQ(FindPlane(sized.session, 0, PlaneKind::kConvState)->bytes, 0u);
  EXPECT_EQ(sized.cost.total_bytes, 2u * 4096 * 4);
}

// ---------------------------------------------------------------- (5) TP shard

TEST(SizingTest, Tp8ShardOfADenseModelIsTheReferenceRankShapePerLayer) {
  // Llama-3-70B, rank-local kv_dim 1024 / 8 = 128: 136 + 96 = 232 B/token + 20 fixed per
  // layer; x 80: 18,560 B/token, 1600 fixed. At 262144: 80 x 60,817,428 = 4,865,394,240.
  SessionShape request = Capacity(262'144);
  request.tp_ranks = 8;
  const Sized sized = Size(Llama3_70B(), request);
  EXPECT_EQ(sized.cost.bytes_per_token, 18'560u);
  EXPECT_EQ(sized.cost.fixed_bytes, 1600u);
  EXPECT_EQ(sized.cost.total_bytes, 4'865'394'240u);
  const TpKvRankShape shape = *TpKvRankAllocationShape(1024, 1024, 8, kQ8Q5);
  uint64_t layer_bytes = 0;
  for (const PlaneSpec& plane : sized.session.planes) {
    if (plane.layer == 42) layer_bytes += plane.bytes;
  }
  EXPECT_EQ(layer_bytes, shape.AllocationBytes(262'144));
  const LayerGeometry* geometry = FindGeometry(sized.session, 0);
  EXPECT_EQ(geometry->kv_dim_k, 128u);
  EXPECT_EQ(geometry->k_token_bytes, 136u);
  EXPECT_EQ(geometry->v_token_bytes, 96u);
}

TEST(SizingTest, TpRefusesShardsTheRankShapeRefusesNamingTheLayer) {
  SessionShape request = Capacity(8192);
  request.tp_ranks = 3;
  EXPECT_THAT(PlanSession(Llama3_8B(), {}, request),
              StatusIs(kInvalid, ::testing::Eq("layer 0: TP KV dimensions k=1024 v=1024 are "
                                               "not divisible by TP=3")));
  request.tp_ranks = 64;
  EXPECT_THAT(PlanSession(Llama3_8B(), {}, request),
              StatusIs(kInvalid, ::testing::Eq("layer 0: TP KV local dimensions k=16 v=16 "
                                               "must be 32-aligned")));
}

TEST(SizingTest, TpRefusesRecurrentAndLatentStateItCannotShard) {
  SessionShape request = Capacity(8192);
  request.tp_ranks = 2;
  EXPECT_THAT(PlanSession(Qwen3NextStyle(), {}, request),
              StatusIs(kInvalid, ::testing::Eq("layer 0: recurrent state is not sharded under "
                                               "tensor parallelism (tp_ranks 2)")));
  request.tp_ranks = 8;
  EXPECT_THAT(
      PlanSession(DeepSeekV3Style(), {}, request),
      StatusIs(kInvalid, HasSubstrs("layer 0: latent state is not sharded", "(tp_ranks 8)")));
  // A range holding only the hybrid's attention layer shards: 2 x 256 / 2 = 256 local,
  // 8 blocks x 34 + 8 x 24 = 272 + 192 = 464 B/token.
  request.tp_ranks = 2;
  request.layer_lo = 3;
  request.layer_hi = 4;
  EXPECT_EQ(Size(Qwen3NextStyle(), request).cost.bytes_per_token, 464u);
}

// ---------------------------------------------------------------- request refusals

TEST(SizingTest, RefusesCapacityOutsideTheI32Mirrors) {
  EXPECT_THAT(PlanSession(Llama3_8B(), {}, Capacity(0)),
              StatusIs(kInvalid, HasSubstr("capacity 0 tokens")));
  EXPECT_THAT(PlanSession(Llama3_8B(), {}, Capacity(kMaxCapacity + 1)),
              StatusIs(kInvalid, ::testing::Eq("capacity 2147483648 tokens exceeds i32 device "
                                               "mirrors (max 2147483647)")));
  // The largest legal capacity sizes exactly: 59392 x (2^31 - 1) + 640.
  EXPECT_EQ(Size(Llama3_8B(), Capacity(kMaxCapacity)).cost.total_bytes,
            59'392u * kMaxCapacity + 640);
}

TEST(SizingTest, RefusesLayerRangesOutsideThePlan) {
  SessionShape reversed = Capacity(8192);
  reversed.layer_lo = 5;
  reversed.layer_hi = 4;
  EXPECT_THAT(PlanSession(Llama3_8B(), {}, reversed),
              StatusIs(kInvalid, ::testing::Eq("layer range [5, 4) is out of bounds for a "
                                               "plan of 32 layers")));
  SessionShape past_end = Capacity(8192);
  past_end.layer_hi = 33;
  EXPECT_THAT(PlanSession(Llama3_8B(), {}, past_end),
              StatusIs(kInvalid, HasSubstr("[0, 33) is out of bounds for a plan of 32")));
  SessionShape start_past_end = Capacity(8192);
  start_past_end.layer_lo = 40;
  EXPECT_THAT(PlanSession(Llama3_8B(), {}, start_past_end),
              StatusIs(kInvalid, HasSubstr("[40, 32)")));
  // The default range reaches the MTP blocks.
  SessionShape with_mtp = Capacity(16);
  with_mtp.layer_hi = 62;
  EXPECT_THAT(PlanSession(DeepSeekV3Style(), {}, with_mtp).status(), IsOk());
}

TEST(SizingTest, RefusesZeroRanksAndInvalidPlans) {
  SessionShape request = Capacity(8192);
  request.tp_ranks = 0;
  EXPECT_THAT(PlanSession(Llama3_8B(), {}, request), StatusIs(kInvalid, HasSubstr("tp_ranks 0")));
  ModelPlan bad = Llama3_8B();
  bad.layers[2].head_dim_k = 96 + 8;
  EXPECT_THAT(CostOfSession(bad, {}, Capacity(8192)),
              StatusIs(kInvalid, HasSubstrs("layer 2", "k=104 v=128")));
}

TEST(SizingTest, OverflowIsRefusedNamingWhatOverflowed) {
  // Latent: (2^32 - 1) x 4 bytes a row x (2^31 - 1) rows > 2^64.
  ModelPlan wide_latent;
  wide_latent.layers.push_back(LatentLayer(0, std::numeric_limits<uint32_t>::max()));
  EXPECT_THAT(PlanSession(wide_latent, {}, Capacity(kMaxCapacity)),
              StatusIs(kInvalid, HasSubstrs("layer 0 latent_rows bytes overflows",
                                            "2147483647 x 17179869180")));

  // K/V: kv_dim (2^32 - 32) x (2^32 - 1) fits, its token bytes (kv_dim / 32 x 34) do not.
  ModelPlan wide_kv = DenseModel(1, std::numeric_limits<uint32_t>::max() - 31,
                                 std::numeric_limits<uint32_t>::max());
  EXPECT_THAT(PlanSession(wide_kv, {}, Capacity(1)),
              StatusIs(kInvalid, HasSubstrs("layer 0: TP KV K token bytes overflows")));

  // Recurrent: (2^32 - 1) x (2^32 - 2) conv elements fit, their f32 bytes do not.
  ModelPlan wide_conv;
  wide_conv.layers.push_back(RecurrentLayer(0, std::numeric_limits<uint32_t>::max(),
                                            std::numeric_limits<uint32_t>::max(), 1));
  EXPECT_THAT(PlanSession(wide_conv, {}, Capacity(1)),
              StatusIs(kInvalid, HasSubstr("layer 0 conv state overflows")));

  // Session total: each 2^30-wide latent plane is 4 x 2^30 x (2^31 - 1) = 2^63 - 2^32 bytes;
  // two fit in 64 bits, the third does not.
  ModelPlan three_wide;
  for (uint32_t i = 0; i < 3; ++i) three_wide.layers.push_back(LatentLayer(i, 1u << 30));
  EXPECT_THAT(PlanSession(three_wide, {}, Capacity(kMaxCapacity)),
              StatusIs(kInvalid, HasSubstr("session total bytes overflows")));
}

// ---------------------------------------------------------------- one source

TEST(SizingTest, CostIsDerivedFromThePlanItself) {
  SessionShape request = Capacity(65'536);
  request.spec_snapshot = true;
  for (const ModelPlan& plan : {Llama3_8B(), GemmaStyle(true), DeepSeekV3Style(),
                                GlmStyleWithIndexer(), Qwen3NextStyle()}) {
    absl::StatusOr<SessionPlan> session = PlanSession(plan, {}, request);
    ASSERT_THAT(session.status(), IsOk()) << plan.name;
    absl::StatusOr<CostBreakdown> from_plan = CostOfSessionPlan(*session);
    absl::StatusOr<CostBreakdown> direct = CostOfSession(plan, {}, request);
    ASSERT_THAT(from_plan.status(), IsOk());
    ASSERT_THAT(direct.status(), IsOk());
    EXPECT_EQ(from_plan->total_bytes, direct->total_bytes) << plan.name;
    EXPECT_EQ(from_plan->bytes_per_token, direct->bytes_per_token) << plan.name;
    EXPECT_EQ(from_plan->fixed_bytes, direct->fixed_bytes) << plan.name;
    // 65536 is a whole number of pools, so the linear identity is exact here.
    EXPECT_EQ(direct->total_bytes, direct->fixed_bytes + 65'536 * direct->bytes_per_token)
        << plan.name;
    ExpectConsistent(*session, *direct);
  }
}

TEST(SizingTest, CostRefusesAPlaneWhoseBytesCannotHoldItsRows) {
  SessionPlan session = *PlanSession(Llama3_8B(), {}, Capacity(16));
  session.planes[0].bytes = 7;
  EXPECT_THAT(CostOfSessionPlan(session),
              StatusIs(kInvalid, HasSubstrs("keys of layer 0", "7 bytes", "16 rows of 1088")));
  SessionPlan orphan = *PlanSession(Llama3_8B(), {}, Capacity(16));
  orphan.layers.erase(orphan.layers.begin() + 4);
  EXPECT_THAT(CostOfSessionPlan(orphan),
              StatusIs(kInvalid, HasSubstr("plane keys of layer 4 has no layer geometry")));
}

}  // namespace
}  // namespace memra
