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
