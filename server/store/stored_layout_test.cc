#include "server/store/stored_layout.h"

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "core/model_plan.h"
#include "core/session.h"
#include "core/sizing.h"
#include "core/test_model_plans.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;

constexpr uint64_t kBlockRows = 16;
constexpr uint64_t kCapacity = 128;

SessionPlan Planned(const ModelPlan& model, SessionShape shape = {}) {
  shape.capacity = kCapacity;
  absl::StatusOr<SessionPlan> plan = PlanSession(model, FormatDefaults{}, shape);
  EXPECT_THAT(plan.status(), IsOk());
  return plan.ok() ? *plan : SessionPlan{};
}

SessionState Fresh(const SessionPlan& plan) {
  absl::StatusOr<SessionState> state = SessionState::Create(1, plan, kCapacity);
  EXPECT_THAT(state.status(), IsOk());
  return *std::move(state);
}

// The planes of `plan` laid out back to back from arena offset 4096.
SessionLayoutVersion LaidOut(const SessionPlan& plan) {
  SessionLayoutVersion layout;
  layout.plan = plan;
  uint64_t at = 4096;
  for (size_t i = 0; i < plan.planes.size(); ++i) {
    layout.offsets.push_back(at);
    layout.index[PlaneKey(plan.planes[i].layer, plan.planes[i].kind)] = i;
    at += plan.planes[i].bytes;
  }
  layout.arena_bytes = at;
  return layout;
}

TEST(ShapeFingerprintTest, AnUnshardedSessionOverEveryLayerIsKeyedByTheModelItself) {
  PlanFingerprint model{};
  model[0] = 7;
  EXPECT_EQ(PrefixShapeFingerprint(model, SessionShape{}), model);
  SessionShape stage;
  stage.layer_hi = 4;
  SessionShape rank;
  rank.tp_ranks = 2;
  EXPECT_NE(PrefixShapeFingerprint(model, stage), model);
  EXPECT_NE(PrefixShapeFingerprint(model, rank), model);
  EXPECT_NE(PrefixShapeFingerprint(model, stage), PrefixShapeFingerprint(model, rank));
  EXPECT_EQ(PrefixShapeFingerprint(model, stage), PrefixShapeFingerprint(model, stage));
}

TEST(ShapeFingerprintTest, ScopesAreSeparateKeySpacesAndTheScopeLengthIsPartOfTheKey) {
  PlanFingerprint shape{};
  shape[1] = 9;
  EXPECT_EQ(ScopedShapeFingerprint("uid:1", shape), ScopedShapeFingerprint("uid:1", shape));
  EXPECT_NE(ScopedShapeFingerprint("uid:1", shape), ScopedShapeFingerprint("uid:2", shape));
  EXPECT_NE(ScopedShapeFingerprint("", shape), shape);
  // "a" + shape and "" + ('a' followed by the shape) cannot collide: the length goes first.
  PlanFingerprint shifted{};
  EXPECT_NE(ScopedShapeFingerprint("a", shifted), ScopedShapeFingerprint("", shifted));
}

TEST(StoredLayoutTest, AFlatModelStoresKThenVOfEveryLayerPerBlockAndNoBoundary) {
  const SessionPlan plan = Planned(test_plans::DenseModel(2, 32, 1));
  const SessionState state = Fresh(plan);
  absl::StatusOr<StoredLayout> stored = PlanStoredLayout(plan, state, 0, kBlockRows);
  ASSERT_THAT(stored.status(), IsOk());
  EXPECT_TRUE(stored->position_addressed_only);
  EXPECT_TRUE(PositionAddressedPlan(plan));
  ASSERT_EQ(stored->block_pieces.size(), 4u);
  // K and V rows differ in size (q8_0 keys, q5_1 values by default).
  const uint64_t k = kBlockRows * plan.layers[0].k_token_bytes;
  const uint64_t v = kBlockRows * plan.layers[0].v_token_bytes;
  const PlaneKind kinds[4] = {PlaneKind::kKeys, PlaneKind::kValues, PlaneKind::kKeys,
                              PlaneKind::kValues};
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(stored->block_pieces[i].plane.layer, i / 2);
    EXPECT_EQ(stored->block_pieces[i].plane.kind, kinds[i]);
    EXPECT_EQ(stored->block_pieces[i].plane_offset, 0u);
    EXPECT_EQ(stored->block_pieces[i].bytes, i % 2 == 0 ? k : v);
  }
  EXPECT_EQ(stored->block_bytes, 2 * (k + v));
  EXPECT_TRUE(stored->boundary_pieces.empty());
  EXPECT_EQ(stored->boundary_bytes, 0u);
}

TEST(StoredLayoutTest, RecurrentStateIsRefusedAtABoundaryOtherThanTheCommittedLength) {
  const SessionPlan plan = Planned(test_plans::Qwen3NextStyle());
  EXPECT_FALSE(PositionAddressedPlan(plan));
  const SessionState state = Fresh(plan);
  EXPECT_THAT(PlanStoredLayout(plan, state, kBlockRows, kBlockRows).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("recurrent state exists only at the position 0 (committed 0)",
                                  "not at boundary 16")));
}

TEST(StoredLayoutTest, APlanWithoutPositionAddressedLayersHasNothingToStorePerBlock) {
  ModelPlan model;
  model.layers.push_back(test_plans::RecurrentLayer(0, 64, 4, 16));
  const SessionPlan plan = Planned(model);
  const SessionState state = Fresh(plan);
  EXPECT_THAT(PlanStoredLayout(plan, state, 0, kBlockRows).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("no position-addressed layer")));
}

TEST(StoredLayoutTest, PieceRangesPlaceBlockIAtItsRowsAndBackToBackInTheStoredPiece) {
  const SessionPlan plan = Planned(test_plans::DenseModel(2, 32, 1));
  const SessionLayoutVersion layout = LaidOut(plan);
  absl::StatusOr<StoredLayout> stored = PlanStoredLayout(plan, Fresh(plan), 0, kBlockRows);
  ASSERT_THAT(stored.status(), IsOk());
  absl::StatusOr<std::vector<CopyRange>> out =
      PieceRanges(layout, stored->block_pieces, 3, /*toward_storage=*/true);
  ASSERT_THAT(out.status(), IsOk());
  ASSERT_EQ(out->size(), 4u);
  uint64_t stored_at = 0;
  for (size_t i = 0; i < 4; ++i) {
    const StoredPiece& piece = stored->block_pieces[i];
    const size_t plane = layout.index.at(PlaneKey(piece.plane));
    EXPECT_EQ((*out)[i].src_offset, layout.offsets[plane] + 3 * piece.bytes) << i;
    EXPECT_EQ((*out)[i].dst_offset, stored_at) << i;
    EXPECT_EQ((*out)[i].bytes, piece.bytes) << i;
    stored_at += piece.bytes;
  }
  absl::StatusOr<std::vector<CopyRange>> back =
      PieceRanges(layout, stored->block_pieces, 3, /*toward_storage=*/false);
  ASSERT_THAT(back.status(), IsOk());
  EXPECT_EQ((*back)[1].dst_offset, (*out)[1].src_offset);
  EXPECT_EQ((*back)[1].src_offset, (*out)[1].dst_offset);
}

TEST(StoredLayoutTest, PieceRangesRefuseABlockOutsideThePlaneOrAnOverflow) {
  const SessionPlan plan = Planned(test_plans::DenseModel(2, 32, 1));
  const SessionLayoutVersion layout = LaidOut(plan);
  absl::StatusOr<StoredLayout> stored = PlanStoredLayout(plan, Fresh(plan), 0, kBlockRows);
  ASSERT_THAT(stored.status(), IsOk());
  // Block 8 of a 128-row session starts past its plane's last row.
  const uint64_t blocks = kCapacity / kBlockRows;
  const uint64_t piece = stored->block_pieces[0].bytes;
  EXPECT_THAT(PieceRanges(layout, stored->block_pieces, blocks, true).status(),
              StatusIs(absl::StatusCode::kInternal,
                       HasSubstrs(absl::StrCat("plane copy [", blocks * piece, ", ",
                                               (blocks + 1) * piece, ") exceeds the plane's ",
                                               plan.planes[0].bytes, " bytes"))));
  EXPECT_THAT(PieceRanges(layout, stored->block_pieces, uint64_t{1} << 62, true).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("block offset overflows")));
}

TEST(StoredLayoutTest, TheLayoutDigestNamesRowsPlanesAndSizes) {
  const std::vector<StoredPiece> kv = {{{0, PlaneKind::kKeys}, 0, 512},
                                       {{0, PlaneKind::kValues}, 0, 512}};
  std::vector<StoredPiece> swapped = kv;
  swapped[0].plane.kind = PlaneKind::kValues;
  swapped[1].plane.kind = PlaneKind::kKeys;
  std::vector<StoredPiece> other_layer = kv;
  other_layer[1].plane.layer = 1;
  EXPECT_EQ(LayoutDigest(kv, 16), LayoutDigest(kv, 16));
  EXPECT_NE(LayoutDigest(kv, 16), LayoutDigest(kv, 32));
  EXPECT_NE(LayoutDigest(kv, 16), LayoutDigest(swapped, 16));
  EXPECT_NE(LayoutDigest(kv, 16), LayoutDigest(other_layer, 16));
}

}  // namespace
}  // namespace memra
