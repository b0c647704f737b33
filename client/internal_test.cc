// client/internal.h's conversions of the daemon's messages into client.h's types: every field
// carried, and an enum out of range refused naming the field (never trusted).

#include "client/internal.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

namespace pb = ::memra::kv::v1;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;
using ::testing::HasSubstr;

pb::SessionLayout RingLayout() {
  pb::SessionLayout proto;
  proto.set_layout_version(2);
  proto.set_capacity(6000);
  pb::Arena* arena = proto.add_arenas();
  arena->set_backend("host");
  arena->set_handle("/memra-test");
  arena->set_bytes(1 << 20);
  pb::LayerLayout* layer = proto.add_layers();
  layer->set_layer(3);
  layer->set_kind(pb::STATE_KIND_SLIDING_KV);
  layer->set_k_token_bytes(256);
  layer->set_v_token_bytes(128);
  layer->set_window(64);
  layer->set_physical_rows(4703);
  layer->set_ring(true);
  layer->mutable_formats()->set_k(pb::K_FORMAT_BF16);
  layer->mutable_formats()->set_v(pb::V_FORMAT_FP8_E4M3);
  layer->set_head_dim_k(64);
  layer->set_head_dim_v(64);
  layer->set_n_head_kv(2);
  layer->add_v_scale(0.5f);
  pb::Plane* plane = layer->add_planes();
  plane->set_kind(pb::PLANE_KIND_BASE_MIRROR);
  plane->set_arena(0);
  plane->set_offset(4096);
  plane->set_bytes(4);
  plane->set_rows(1);
  plane->set_row_bytes(4);
  return proto;
}

TEST(SessionLayoutFromProtoTest, CarriesEveryField) {
  absl::StatusOr<SessionLayout> layout = SessionLayoutFromProto(RingLayout());
  ASSERT_THAT(layout, IsOk());
  EXPECT_EQ(layout->version, 2u);
  EXPECT_EQ(layout->capacity, 6000u);
  ASSERT_EQ(layout->arenas.size(), 1u);
  EXPECT_EQ(layout->arenas[0].backend, "host");
  EXPECT_EQ(layout->arenas[0].handle, "/memra-test");
  EXPECT_EQ(layout->arenas[0].bytes, uint64_t{1} << 20);
  ASSERT_EQ(layout->layers.size(), 1u);
  const SessionLayer& layer = layout->layers[0];
  EXPECT_EQ(layer.layer, 3u);
  EXPECT_EQ(layer.kind, StateKind::kSlidingKv);
  EXPECT_EQ(layer.k_token_bytes, 256u);
  EXPECT_EQ(layer.v_token_bytes, 128u);
  EXPECT_EQ(layer.window, 64u);
  EXPECT_EQ(layer.physical_rows, 4703u);
  EXPECT_TRUE(layer.ring);
  EXPECT_EQ(layer.formats, (KvFormats{KFormat::kBf16, VFormat::kFp8E4m3}));
  EXPECT_EQ(layer.head_dim_k, 64u);
  EXPECT_EQ(layer.head_dim_v, 64u);
  EXPECT_EQ(layer.n_head_kv, 2u);
  EXPECT_TRUE(layer.k_scale.empty());
  EXPECT_EQ(layer.v_scale, std::vector<float>{0.5f});
  EXPECT_EQ(layer.latent_format, ElementFormat::kF32);
  ASSERT_EQ(layer.planes.size(), 1u);
  EXPECT_EQ(layer.planes[0],
            (SessionPlane{PlaneKind::kBaseMirror, 0, 4096, 4, /*rows=*/1, /*row_bytes=*/4}));
}

TEST(SessionLayoutFromProtoTest, RefusesKindsOutOfRange) {
  pb::SessionLayout unspecified_layer = RingLayout();
  unspecified_layer.mutable_layers(0)->set_kind(pb::STATE_KIND_UNSPECIFIED);
  EXPECT_THAT(SessionLayoutFromProto(unspecified_layer),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("state kind is 0: unspecified or unknown (accepted 1 to 6)")));
  pb::SessionLayout unknown_plane = RingLayout();
  unknown_plane.mutable_layers(0)->mutable_planes(0)->set_kind(static_cast<pb::PlaneKind>(99));
  EXPECT_THAT(SessionLayoutFromProto(unknown_plane),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("plane kind is 99: unspecified or unknown (accepted 1 to 12)")));
  pb::SessionLayout unknown_format = RingLayout();
  unknown_format.mutable_layers(0)->mutable_formats()->set_v(static_cast<pb::VFormat>(9));
  EXPECT_THAT(SessionLayoutFromProto(unknown_format),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("layout formats.v is 9: unspecified or unknown (accepted 1 "
                                 "to 8)")));
  // A layout from before element formats carries none: the block default, raw views only.
  pb::SessionLayout no_formats = RingLayout();
  no_formats.mutable_layers(0)->clear_formats();
  ASSERT_THAT(SessionLayoutFromProto(no_formats), IsOk());
  EXPECT_EQ(SessionLayoutFromProto(no_formats)->layers[0].formats, KvFormats{});
}

TEST(SessionSnapshotFromProtoTest, CarriesEveryField) {
  pb::SessionState proto;
  proto.set_layout_version(1);
  proto.set_capacity(256);
  proto.set_committed_len(10);
  proto.set_staged_len(14);
  proto.set_position(9);
  proto.set_active_generation(3);
  proto.set_next_generation(4);
  proto.set_tainted(true);
  proto.set_spec_snapshot_valid(true);
  proto.set_grow_pending(true);
  pb::LayerState* layer = proto.add_layers();
  layer->set_layer(1);
  layer->set_length(14);
  layer->set_ring_base(32);
  layer->set_ring(true);
  layer->set_index_pools_ready(2);
  const SessionSnapshot state = SessionSnapshotFromProto(proto);
  EXPECT_EQ(state,
            (SessionSnapshot{
                1, 256, 10, 14, 9, 3, 4, true, true, true, {LayerSnapshot{1, 14, 32, true, 2}}}));
}

}  // namespace
}  // namespace memra
