// Sessions in the element formats (bf16, f16, f32, fp8 e4m3 / e5m2) against a real in-process
// daemon: rows written through the typed plane view, captured into the prefix cache and restored
// by another engine; a prefix restores only into a session of the same formats.

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/prefix_client.h"
#include "core/model_plan.h"
#include "core/test_model_plans.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/store/prefix_cache.h"
#include "tests/service/test_daemon.h"
#include "tests/status_matchers.h"

namespace memra::testing {
namespace {

using ::testing::ElementsAre;

constexpr uint32_t kBlockTokens = 4;
constexpr uint64_t kCapacity = 32;
constexpr uint32_t kHeadDim = 80;  // no 32-element block fits a head: only element formats hold it
constexpr uint32_t kHeads = 2;

// Two dense layers (2 KV heads of 80) in `element`, and an MLA layer whose latent row is too.
ModelPlan ElementPlan(ElementFormat element) {
  ModelPlan plan;
  plan.name = "element-formats";
  plan.layers = {test_plans::KvLayer(0, kHeadDim, kHeads), test_plans::KvLayer(1, kHeadDim, kHeads),
                 test_plans::LatentLayer(2, /*latent_width=*/24)};
  return test_plans::InElementFormat(std::move(plan), element);
}

// A deterministic 16-bit pattern per (layer, plane, row, head, i): bf16 bits the test can
// check after the bytes have travelled.
uint16_t Pattern(uint32_t layer, PlaneKind kind, uint64_t row, uint64_t head, uint64_t i) {
  return static_cast<uint16_t>(0x3f80 + layer * 1000 + static_cast<int>(kind) * 300 + row * 37 +
                               head * 11 + i);
}

uint16_t* At(const TypedPlaneView& view, uint64_t row, uint64_t head, uint64_t i) {
  return reinterpret_cast<uint16_t*>(view.data + row * view.strides[0] +
                                     head * view.strides[1] + i * view.strides[2]);
}

class ElementFormatsTest : public DaemonTest {
 protected:
  void ConfigureDaemon(DaemonConfig& config) override {
    config.prefix_cache_budget_bytes = uint64_t{8} << 20;
    config.prefix_block_tokens = kBlockTokens;
  }

  void TearDown() override {
    EvictAllPrefixEntries();
    DaemonTest::TearDown();
  }

  PlanFingerprint Register(KvClient& client, const ModelPlan& plan) {
    absl::StatusOr<PlanFingerprint> fingerprint = client.RegisterPlan(plan);
    EXPECT_THAT(fingerprint.status(), IsOk());
    return fingerprint.ok() ? *fingerprint : PlanFingerprint{};
  }

  std::unique_ptr<Session> Create(KvClient& client, const PlanFingerprint& plan) {
    absl::StatusOr<std::unique_ptr<Session>> session =
        client.CreateSession(plan, Options(kCapacity, /*spec_snapshot=*/false));
    EXPECT_THAT(session.status(), IsOk());
    return session.ok() ? *std::move(session) : nullptr;
  }
};

TEST_F(ElementFormatsTest, TypedViewsAreRowsByHeadsByHeadDimInTheElementType) {
  const PlanFingerprint plan = Register(*client_, ElementPlan(ElementFormat::kBf16));
  std::unique_ptr<Session> session = Create(*client_, plan);
  ASSERT_NE(session, nullptr);
  absl::StatusOr<TypedPlaneView> keys = session->TypedPlane(1, PlaneKind::kKeys);
  ASSERT_THAT(keys.status(), IsOk());
  EXPECT_EQ(keys->element, ElementFormat::kBf16);
  EXPECT_EQ(keys->element_bytes, 2u);
  EXPECT_THAT(keys->shape, ElementsAre(kCapacity, kHeads, kHeadDim));
  EXPECT_THAT(keys->strides, ElementsAre(kHeads * kHeadDim * 2, kHeadDim * 2, 2));
  absl::StatusOr<PlaneView> raw = session->Plane(1, PlaneKind::kKeys);
  ASSERT_THAT(raw.status(), IsOk());
  EXPECT_EQ(keys->data, raw->data);  // the raw byte view stays, over the same bytes
  EXPECT_EQ(raw->row_bytes, kHeads * kHeadDim * 2);
  absl::StatusOr<TypedPlaneView> latent = session->TypedPlane(2, PlaneKind::kLatentRows);
  ASSERT_THAT(latent.status(), IsOk());
  EXPECT_EQ(latent->element, ElementFormat::kBf16);
  EXPECT_THAT(latent->shape, ElementsAre(kCapacity, 1u, 24u));

  // fp8 carries the plan's scale with it.
  ModelPlan fp8 = ElementPlan(ElementFormat::kFp8E4m3);
  fp8.layers[0].k_scale = {0.5f, 0.25f};
  std::unique_ptr<Session> scaled = Create(*client_, Register(*client_, fp8));
  ASSERT_NE(scaled, nullptr);
  absl::StatusOr<TypedPlaneView> fp8_keys = scaled->TypedPlane(0, PlaneKind::kKeys);
  ASSERT_THAT(fp8_keys.status(), IsOk());
  EXPECT_EQ(fp8_keys->element, ElementFormat::kFp8E4m3);
  EXPECT_THAT(fp8_keys->strides, ElementsAre(kHeads * kHeadDim, kHeadDim, 1u));
  EXPECT_THAT(fp8_keys->scale, ElementsAre(0.5f, 0.25f));
}

TEST_F(ElementFormatsTest, SwaRingLayersTypeTheirPhysicalRows) {
  ModelPlan plan;
  plan.swa_ring = true;
  plan.layers = {test_plans::SlidingLayer(0, kHeadDim, kHeads, /*window=*/4)};
  const PlanFingerprint ring =
      Register(*client_, test_plans::InElementFormat(plan, ElementFormat::kF16));
  absl::StatusOr<std::unique_ptr<Session>> session =
      client_->CreateSession(ring, Options(/*capacity=*/16384, /*spec_snapshot=*/false));
  ASSERT_THAT(session.status(), IsOk());
  absl::StatusOr<PlaneView> raw = (*session)->Plane(0, PlaneKind::kValues);
  absl::StatusOr<TypedPlaneView> typed = (*session)->TypedPlane(0, PlaneKind::kValues);
  ASSERT_THAT(raw.status(), IsOk());
  ASSERT_THAT(typed.status(), IsOk());
  // The ring's rows, not the capacity: physical row = absolute row - ring base.
  EXPECT_LT(raw->rows, 16384u);
  EXPECT_THAT(typed->shape, ElementsAre(raw->rows, kHeads, kHeadDim));
  EXPECT_EQ(typed->element, ElementFormat::kF16);
}

TEST_F(ElementFormatsTest, BlockFormatsAndMirrorsHaveNoTypedView) {
  std::unique_ptr<Session> session = NewSession(*client_, 64);  // the fixture's q8_0/q5_1 plan
  ASSERT_NE(session, nullptr);
  EXPECT_THAT(session->TypedPlane(kFlatLayer, PlaneKind::kKeys).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs(absl::StrCat("layer ", kFlatLayer,
                                               " keys are q8_0, a block format: no typed view"))));
  EXPECT_THAT(session->TypedPlane(kFlatLayer, PlaneKind::kValues).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstrs("values are q5_1")));
  EXPECT_THAT(session->TypedPlane(kFlatLayer, PlaneKind::kLenMirror).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("len_mirror is an i32 mirror")));
  // f32 state planes type as f32 rows.
  absl::StatusOr<TypedPlaneView> ssm = session->TypedPlane(kRecurrentLayer, PlaneKind::kSsmState);
  ASSERT_THAT(ssm.status(), IsOk());
  EXPECT_EQ(ssm->element, ElementFormat::kF32);
  EXPECT_THAT(ssm->shape, ElementsAre(1u, 1u, 8u));
  EXPECT_THAT(session->TypedPlane(kFlatLayer + 100, PlaneKind::kKeys).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs("has no keys plane")));
}

TEST_F(ElementFormatsTest, Bf16RowsCaptureAndRestoreIntoAnotherEnginesSession) {
  const ModelPlan bf16 = ElementPlan(ElementFormat::kBf16);
  const PlanFingerprint plan = Register(*client_, bf16);
  std::unique_ptr<Session> writer = Create(*client_, plan);
  ASSERT_NE(writer, nullptr);
  const std::vector<int32_t> tokens = {5, 6, 7, 8, 9, 10, 11, 12};
  absl::StatusOr<Transaction> transaction = writer->Begin();
  ASSERT_THAT(transaction.status(), IsOk());
  ASSERT_THAT(writer->PrepareAppend(transaction->generation, tokens.size()).status(), IsOk());
  const std::vector<std::pair<uint32_t, PlaneKind>> planes = {
      {0, PlaneKind::kKeys}, {0, PlaneKind::kValues}, {1, PlaneKind::kKeys},
      {1, PlaneKind::kValues}, {2, PlaneKind::kLatentRows}};
  for (const auto& [layer, kind] : planes) {
    absl::StatusOr<TypedPlaneView> view = writer->TypedPlane(layer, kind);
    ASSERT_THAT(view.status(), IsOk());
    for (uint64_t row = 0; row < tokens.size(); ++row) {
      for (uint64_t head = 0; head < view->shape[1]; ++head) {
        for (uint64_t i = 0; i < view->shape[2]; ++i) {
          *At(*view, row, head, i) = Pattern(layer, kind, row, head, i);
        }
      }
    }
  }
  ASSERT_THAT(writer->PublishAppend(transaction->generation).status(), IsOk());
  ASSERT_THAT(writer->Commit(transaction->generation, tokens.size(), tokens).status(), IsOk());
  absl::StatusOr<PrefixCaptured> captured = client_->prefixes().Capture(*writer, tokens, 8);
  ASSERT_THAT(captured.status(), IsOk());

  std::unique_ptr<KvClient> reader_engine = NewClient("engine-b");
  ASSERT_NE(reader_engine, nullptr);
  const PlanFingerprint same = Register(*reader_engine, bf16);
  EXPECT_EQ(same, plan);
  std::unique_ptr<Session> reader = Create(*reader_engine, same);
  ASSERT_NE(reader, nullptr);
  absl::StatusOr<PrefixMatch> match =
      reader_engine->prefixes().Lookup(same, Options(kCapacity, false), tokens);
  ASSERT_THAT(match.status(), IsOk());
  EXPECT_EQ(match->matched_tokens, 8u);
  absl::StatusOr<PrefixRestored> restored =
      reader_engine->prefixes().Restore(*reader, tokens, match->entry_id);
  ASSERT_THAT(restored.status(), IsOk());
  EXPECT_EQ(restored->restored_tokens, 8u);
  for (const auto& [layer, kind] : planes) {
    absl::StatusOr<TypedPlaneView> view = reader->TypedPlane(layer, kind);
    ASSERT_THAT(view.status(), IsOk());
    for (uint64_t row = 0; row < tokens.size(); ++row) {
      for (uint64_t head = 0; head < view->shape[1]; ++head) {
        for (uint64_t i = 0; i < view->shape[2]; ++i) {
          ASSERT_EQ(*At(*view, row, head, i), Pattern(layer, kind, row, head, i))
              << "layer " << layer << " " << PlaneKindName(kind) << " row " << row;
        }
      }
    }
  }

  // The same geometry in fp8: another shape, so a lookup misses and a restore of the bf16
  // entry by its id is refused naming both formats.
  const PlanFingerprint fp8 = Register(*reader_engine, ElementPlan(ElementFormat::kFp8E4m3));
  std::unique_ptr<Session> other = Create(*reader_engine, fp8);
  ASSERT_NE(other, nullptr);
  absl::StatusOr<PrefixMatch> miss =
      reader_engine->prefixes().Lookup(fp8, Options(kCapacity, false), tokens);
  ASSERT_THAT(miss.status(), IsOk());
  EXPECT_EQ(miss->outcome, LookupOutcome::kMiss);
  EXPECT_THAT(reader_engine->prefixes().Restore(*other, tokens, captured->entry_id).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs(absl::StrCat("prefix entry ", captured->entry_id,
                                               " was captured for shape"),
                                  "(K/V bf16/bf16; latent bf16); session",
                                  "(K/V fp8_e4m3/fp8_e4m3; latent fp8_e4m3)")));
}

}  // namespace
}  // namespace memra::testing
