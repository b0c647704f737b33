#ifndef MEMRA_TESTS_SERVICE_TEST_PLANS_H_
#define MEMRA_TESTS_SERVICE_TEST_PLANS_H_

// The model plan the service and end-to-end tests serve: one layer of every kind with state, small
// enough that a test can wrap the SWA ring (window 32 -> 4671 ring rows at capacity >= 4671).

#include "core/model_plan.h"
#include "core/test_model_plans.h"

namespace memra::testing {

inline constexpr uint32_t kFlatLayer = 0;
inline constexpr uint32_t kSlidingLayer = 1;
inline constexpr uint32_t kRecurrentLayer = 2;
inline constexpr uint32_t kLatentLayer = 3;
inline constexpr uint32_t kSlidingWindow = 32;
inline constexpr uint32_t kIndexPool = 4;  // the latent layer's DSA indexer pool

inline ModelPlan HybridTestPlan() {
  ModelPlan plan;
  plan.name = "hybrid-service-test";
  plan.swa_ring = true;
  plan.index_ring_rows = 16;
  plan.layers = {
      test_plans::KvLayer(kFlatLayer, /*head_dim=*/32, /*n_head_kv=*/2),
      test_plans::SlidingLayer(kSlidingLayer, 32, 2, kSlidingWindow),
      test_plans::RecurrentLayer(kRecurrentLayer, /*conv_width=*/4, /*conv_kernel=*/4,
                                 /*state_width=*/8),
      test_plans::LatentLayer(kLatentLayer, /*latent_width=*/8, /*index_width=*/8,
                              /*index_pool=*/kIndexPool),
  };
  return plan;
}

}  // namespace memra::testing

#endif  // MEMRA_TESTS_SERVICE_TEST_PLANS_H_
