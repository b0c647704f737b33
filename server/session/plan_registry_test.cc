#include "server/session/plan_registry.h"

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "core/test_model_plans.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

// Distinct layouts (n_head_kv differs), so distinct fingerprints.
ModelPlan NumberedPlan(uint32_t n) { return test_plans::DenseModel(1, 64, n + 1); }

class PlanRegistryTest : public ::testing::Test {
 protected:
  // Registers plans 0..count-1 and returns their fingerprints in order.
  std::vector<PlanFingerprint> Fill(uint32_t count) {
    std::vector<PlanFingerprint> fingerprints;
    for (uint32_t n = 0; n < count; ++n) {
      absl::StatusOr<PlanFingerprint> fingerprint = plans_.Register(NumberedPlan(n));
      EXPECT_THAT(fingerprint, IsOk());
      if (fingerprint.ok()) fingerprints.push_back(*fingerprint);
    }
    return fingerprints;
  }

  PlanRegistry plans_{FormatDefaults{}};
};

TEST_F(PlanRegistryTest, RegisterIsIdempotentAndFindReturnsThePlan) {
  absl::StatusOr<PlanFingerprint> first = plans_.Register(NumberedPlan(3));
  absl::StatusOr<PlanFingerprint> again = plans_.Register(NumberedPlan(3));
  ASSERT_THAT(first, IsOk());
  ASSERT_THAT(again, IsOk());
  EXPECT_EQ(*first, *again);
  EXPECT_EQ(plans_.size(), 1u);
  absl::StatusOr<std::shared_ptr<const ModelPlan>> found = plans_.Find(*first);
  ASSERT_THAT(found, IsOk());
  EXPECT_EQ((*found)->layers.at(0).n_head_kv, 4u);
}

TEST_F(PlanRegistryTest, UnknownFingerprintIsNotFoundInHex) {
  PlanFingerprint unknown{};
  unknown[0] = 0xab;
  EXPECT_THAT(plans_.Find(unknown),
              StatusIs(absl::StatusCode::kNotFound,
                       AllOf(HasSubstr(FingerprintHex(unknown)), HasSubstr("not registered"))));
}

TEST_F(PlanRegistryTest, InvalidPlanIsRefusedAndNothingRegistered) {
  ModelPlan empty;
  empty.name = "no layers";
  EXPECT_THAT(plans_.Register(empty), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("")));
  EXPECT_EQ(plans_.size(), 0u);
}

TEST_F(PlanRegistryTest, FullTableCollectsTheLeastRecentlyUsedPlanNobodyHolds) {
  const std::vector<PlanFingerprint> fingerprints = Fill(PlanRegistry::kMaxPlans);
  ASSERT_EQ(plans_.size(), PlanRegistry::kMaxPlans);
  // Plan 0 is the oldest but used again; plan 1 is held (a session's plan): neither goes.
  ASSERT_THAT(plans_.Find(fingerprints[0]), IsOk());
  absl::StatusOr<std::shared_ptr<const ModelPlan>> held = plans_.Find(fingerprints[1]);
  ASSERT_THAT(held, IsOk());

  absl::StatusOr<PlanFingerprint> added = plans_.Register(NumberedPlan(PlanRegistry::kMaxPlans));
  ASSERT_THAT(added, IsOk());
  EXPECT_EQ(plans_.size(), PlanRegistry::kMaxPlans);
  EXPECT_THAT(plans_.Find(*added), IsOk());
  EXPECT_THAT(plans_.Find(fingerprints[0]), IsOk());
  EXPECT_THAT(plans_.Find(fingerprints[1]), IsOk());
  // Plan 2 was the least recently used plan nobody held.
  EXPECT_THAT(plans_.Find(fingerprints[2]), StatusIs(absl::StatusCode::kNotFound, HasSubstr("")));
  EXPECT_THAT(plans_.Find(fingerprints[3]), IsOk());
}

TEST_F(PlanRegistryTest, RefusesWithTheNumbersOnlyWhenEveryPlanIsInUse) {
  const std::vector<PlanFingerprint> fingerprints = Fill(PlanRegistry::kMaxPlans);
  std::vector<std::shared_ptr<const ModelPlan>> held;
  for (const PlanFingerprint& fingerprint : fingerprints) {
    absl::StatusOr<std::shared_ptr<const ModelPlan>> plan = plans_.Find(fingerprint);
    ASSERT_THAT(plan, IsOk());
    held.push_back(*plan);
  }
  EXPECT_THAT(plans_.Register(NumberedPlan(PlanRegistry::kMaxPlans)),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("holds 1024 model plans"), HasSubstr("limit 1024"),
                             HasSubstr("all 1024 are in use"))));
  EXPECT_EQ(plans_.size(), PlanRegistry::kMaxPlans);
  // A plan already registered is still accepted: it needs no slot.
  EXPECT_THAT(plans_.Register(NumberedPlan(7)), IsOk());

  // The session holding plan 500 ends: that plan, and only it, becomes collectable.
  held[500].reset();
  absl::StatusOr<PlanFingerprint> added = plans_.Register(NumberedPlan(PlanRegistry::kMaxPlans));
  ASSERT_THAT(added, IsOk());
  EXPECT_THAT(plans_.Find(fingerprints[500]),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("not registered")));
  for (size_t i = 0; i < fingerprints.size(); ++i) {
    if (i == 500) continue;
    EXPECT_THAT(plans_.Find(fingerprints[i]), IsOk()) << "plan " << i;
  }
}

TEST(PlanRegistryLimitsTest, LayerCapRefusesNamingBothNumbers) {
  PlanRegistry plans(FormatDefaults{}, /*max_layers=*/8);
  EXPECT_THAT(plans.CheckLayerCount(8), IsOk());
  EXPECT_THAT(plans.Register(test_plans::DenseModel(9, 64, 2)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("model plan has 9 layers"), HasSubstr("at most 8"),
                             HasSubstr("max_plan_layers"))));
  EXPECT_EQ(plans.size(), 0u);
  EXPECT_THAT(plans.Register(test_plans::DenseModel(8, 64, 2)), IsOk());
}

TEST(PlanRegistryLimitsTest, EachEngineHasAtMostItsQuotaOfPlansInTheTable) {
  PlanRegistry plans(FormatDefaults{}, UINT32_MAX, /*max_plans_per_engine=*/2);
  constexpr uint64_t kEngine = 7, kOther = 8;
  ASSERT_THAT(plans.Register(NumberedPlan(0), kEngine), IsOk());
  ASSERT_THAT(plans.Register(NumberedPlan(1), kEngine), IsOk());
  EXPECT_THAT(plans.Register(NumberedPlan(0), kEngine), IsOk()) << "its own again: no new count";
  EXPECT_THAT(plans.Register(NumberedPlan(2), kEngine),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("engine 7 has registered 2 model plans"),
                             HasSubstr("limit is 2 per engine"), HasSubstr("max_engine_plans"))));
  // Registering a plan another engine registered counts for that engine too.
  EXPECT_THAT(plans.Register(NumberedPlan(2), kOther), IsOk());
  EXPECT_THAT(plans.Register(NumberedPlan(2), kEngine),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("engine 7")));
  // Operators (ImportModel --register) count against no engine.
  EXPECT_THAT(plans.Register(NumberedPlan(3)), IsOk());
  EXPECT_EQ(plans.PlansOf(kEngine), 2u);
  EXPECT_EQ(plans.PlansOf(kOther), 1u);
  EXPECT_EQ(plans.size(), 4u);
  // A reclaimed engine's registrations count no more; its plans stay until collected.
  plans.ForgetEngine(kEngine);
  EXPECT_EQ(plans.PlansOf(kEngine), 0u);
  EXPECT_EQ(plans.size(), 4u);
  EXPECT_THAT(plans.Register(NumberedPlan(4), kEngine), IsOk());
}

TEST(PlanRegistryLimitsTest, ACollectedPlanNoLongerCountsForItsEngines) {
  PlanRegistry plans(FormatDefaults{}, UINT32_MAX, PlanRegistry::kMaxPlans);
  constexpr uint64_t kEngine = 3;
  ASSERT_THAT(plans.Register(NumberedPlan(0), kEngine), IsOk());  // the oldest: collected first
  for (uint32_t n = 1; n < PlanRegistry::kMaxPlans; ++n) {
    ASSERT_THAT(plans.Register(NumberedPlan(n)), IsOk());
  }
  EXPECT_EQ(plans.PlansOf(kEngine), 1u);
  ASSERT_THAT(plans.Register(NumberedPlan(PlanRegistry::kMaxPlans)), IsOk());
  EXPECT_EQ(plans.PlansOf(kEngine), 0u);
}

}  // namespace
}  // namespace memra
