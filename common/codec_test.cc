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

TEST(SessionShapeFromProtoTest, ReadsEveryShapeFieldAndZeroRanksAsUnsharded) {
  pb::CreateSessionRequest create;
  create.set_capacity(8192);
  create.set_layer_lo(2);
  create.set_layer_hi(10);
  create.set_tp_ranks(0);
  create.set_spec_snapshot(true);
  const SessionShape shape = SessionShapeFromProto(create);
  EXPECT_EQ(shape.capacity, 8192u);
  EXPECT_EQ(shape.layer_lo, 2u);
  EXPECT_EQ(shape.layer_hi, 10u);
  EXPECT_EQ(shape.tp_ranks, 1u);
  EXPECT_TRUE(shape.spec_snapshot);

  pb::SessionShape admin;
  admin.set_tp_ranks(4);
  const SessionShape priced = SessionShapeFromProto(admin);
  EXPECT_EQ(priced.tp_ranks, 4u);
  EXPECT_FALSE(priced.layer_hi.has_value()) << "unset layer_hi is every layer";

  pb::PrefixShape prefix;  // no capacity or spec_snapshot fields
  prefix.set_layer_lo(1);
  const SessionShape keyed = SessionShapeFromProto(prefix);
  EXPECT_EQ(keyed.layer_lo, 1u);
  EXPECT_EQ(keyed.tp_ranks, 1u);
  EXPECT_EQ(keyed.capacity, 0u);
}

}  // namespace
}  // namespace memra
