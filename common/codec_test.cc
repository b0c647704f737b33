#include "common/codec.h"

#include <cstdint>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/memra/kv/v1/admin.pb.h"
#include "proto/memra/kv/v1/prefix.pb.h"

namespace memra {
namespace {

namespace pb = ::memra::kv::v1;
using ::testing::ElementsAre;

LayerAppend Flat(uint32_t layer, uint64_t write_row) {
  return LayerAppend{.layer = layer, .write_row = write_row, .ring_append = std::nullopt};
}

LayerAppend Ring(uint32_t layer, RingAppend append) {
  return LayerAppend{.layer = layer, .write_row = append.write_row, .ring_append = append};
}

std::vector<LayerAppend> RoundTrip(const std::vector<LayerAppend>& layers,
                                   google::protobuf::RepeatedPtrField<pb::LayerAppendPlan>& wire) {
  LayerAppendsToProto(layers, &wire);
  std::vector<LayerAppend> decoded = {Flat(99, 99)};  // stale content is cleared
  LayerAppendsFromProto(wire, decoded);
  return decoded;
}

TEST(LayerAppendCodecTest, EqualPlansTravelAsOneMessage) {
  std::vector<LayerAppend> layers;
  for (uint32_t layer = 0; layer < 32; ++layer) layers.push_back(Flat(layer, 4096));
  google::protobuf::RepeatedPtrField<pb::LayerAppendPlan> wire;
  EXPECT_EQ(RoundTrip(layers, wire), layers);
  ASSERT_EQ(wire.size(), 1);
  EXPECT_EQ(wire[0].layer(), 0u);
  EXPECT_EQ(wire[0].more_layers_size(), 31);
  EXPECT_EQ(wire[0].write_row(), 4096u);
}

TEST(LayerAppendCodecTest, InterleavedRingAndFlatLayersComeBackInLayerOrder) {
  // Hybrid: sliding-window rings (one rebasing geometry, one not) between flat layers.
  const RingAppend rebase = RingAppend::Rebase(/*src_row=*/4096, /*keep_rows=*/575,
                                               /*new_base=*/4096, /*write_row=*/575);
  const RingAppend contiguous = RingAppend::Contiguous(900);
  const std::vector<LayerAppend> layers = {Ring(1, rebase), Flat(2, 5000), Ring(3, rebase),
                                           Flat(4, 5000), Ring(5, contiguous), Flat(7, 5000)};
  google::protobuf::RepeatedPtrField<pb::LayerAppendPlan> wire;
  EXPECT_EQ(RoundTrip(layers, wire), layers);
  ASSERT_EQ(wire.size(), 3);  // one per distinct plan
  EXPECT_THAT(wire[0].more_layers(), ElementsAre(3u));
  EXPECT_TRUE(wire[0].rebase());
  EXPECT_THAT(wire[1].more_layers(), ElementsAre(4u, 7u));
  EXPECT_FALSE(wire[1].ring());
  EXPECT_EQ(wire[2].layer(), 5u);
  EXPECT_TRUE(wire[2].ring());
  EXPECT_FALSE(wire[2].rebase());
}

TEST(LayerAppendCodecTest, NoLayersIsNoMessages) {
  google::protobuf::RepeatedPtrField<pb::LayerAppendPlan> wire;
  EXPECT_TRUE(RoundTrip({}, wire).empty());
  EXPECT_EQ(wire.size(), 0);
}

TEST(ModelPlanCodecTest, ElementFormatsScalesAndLatentFormatsRoundTrip) {
  ModelPlan plan;
  LayerPlan kv;
  kv.index = 0;
  kv.kind = StateKind::kKv;
  kv.head_dim_k = 80;
  kv.head_dim_v = 80;
  kv.n_head_kv = 2;
  kv.formats = KvFormats{KFormat::kFp8E4m3, VFormat::kFp8E5m2};
  kv.k_scale = {0.5f};
  kv.v_scale = {0.25f, 2.0f};
  LayerPlan latent;
  latent.index = 1;
  latent.kind = StateKind::kLatent;
  latent.latent_width = 576;
  latent.latent_format = ElementFormat::kBf16;
  plan.layers = {kv, latent};
  const pb::ModelPlan wire = ModelPlanToProto(plan);
  EXPECT_EQ(wire.layers(0).formats().k(), pb::K_FORMAT_FP8_E4M3);
  EXPECT_EQ(wire.layers(0).formats().v(), pb::V_FORMAT_FP8_E5M2);
  EXPECT_EQ(wire.layers(1).latent_format(), pb::ELEMENT_FORMAT_BF16);
  EXPECT_EQ(wire.layers(0).latent_format(), pb::ELEMENT_FORMAT_UNSPECIFIED);
  absl::StatusOr<ModelPlan> decoded = ModelPlanFromProto(wire);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->layers[0].formats, kv.formats);
  EXPECT_EQ(decoded->layers[0].k_scale, kv.k_scale);
  EXPECT_EQ(decoded->layers[0].v_scale, kv.v_scale);
  EXPECT_EQ(decoded->layers[1].latent_format, ElementFormat::kBf16);

  // A plan from before the field: an unspecified latent format is the reference's f32 row.
  pb::ModelPlan old = wire;
  old.mutable_layers(1)->clear_latent_format();
  EXPECT_EQ(ModelPlanFromProto(old)->layers[1].latent_format, ElementFormat::kF32);
  pb::ModelPlan unknown = wire;
  unknown.mutable_layers(1)->set_latent_format(static_cast<pb::ElementFormat>(9));
  EXPECT_EQ(ModelPlanFromProto(unknown).status().message(),
            "plan.layers[1].latent_format is 9: unspecified or unknown (accepted 1 to 5)");
}

TEST(SessionShapeFromProtoTest, EveryShapeMessageDecodesTheSameWayAndZeroRanksIsUnsharded) {
  pb::CreateSessionRequest create;
  create.set_capacity(4096);
  create.set_layer_lo(2);
  create.set_layer_hi(10);
  create.set_spec_snapshot(true);  // tp_ranks left 0
  pb::ReserveRequest reserve;
  reserve.set_capacity(4096);
  reserve.set_layer_lo(2);
  reserve.set_layer_hi(10);
  reserve.set_spec_snapshot(true);
  pb::SessionShape shape;
  shape.set_capacity(4096);
  shape.set_layer_lo(2);
  shape.set_layer_hi(10);
  shape.set_spec_snapshot(true);
  for (const SessionShape& decoded :
       {SessionShapeFromProto(create), SessionShapeFromProto(reserve),
        SessionShapeFromProto(shape)}) {
    EXPECT_EQ(decoded.capacity, 4096u);
    EXPECT_EQ(decoded.layer_lo, 2u);
    EXPECT_EQ(decoded.layer_hi, std::optional<uint32_t>(10));
    EXPECT_EQ(decoded.tp_ranks, 1u);
    EXPECT_TRUE(decoded.spec_snapshot);
  }
  shape.set_tp_ranks(4);
  shape.clear_layer_hi();
  EXPECT_EQ(SessionShapeFromProto(shape).tp_ranks, 4u);
  EXPECT_EQ(SessionShapeFromProto(shape).layer_hi, std::nullopt);
}

TEST(SessionShapeFromProtoTest, PrefixShapeCarriesLayersAndRanksOnly) {
  pb::PrefixShape prefix;
  prefix.set_layer_lo(1);
  const SessionShape unsharded = SessionShapeFromProto(prefix);
  EXPECT_EQ(unsharded.layer_lo, 1u);
  EXPECT_EQ(unsharded.layer_hi, std::nullopt);
  EXPECT_EQ(unsharded.tp_ranks, 1u);
  EXPECT_EQ(unsharded.capacity, 0u);
  prefix.set_tp_ranks(2);
  prefix.set_layer_hi(5);
  EXPECT_EQ(SessionShapeFromProto(prefix).tp_ranks, 2u);
  EXPECT_EQ(SessionShapeFromProto(prefix).layer_hi, std::optional<uint32_t>(5));
}

}  // namespace
}  // namespace memra
