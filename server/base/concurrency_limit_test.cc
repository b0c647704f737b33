#include "server/base/concurrency_limit.h"

#include <memory>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;

constexpr auto kExhausted = absl::StatusCode::kResourceExhausted;

TEST(ConcurrencyLimitTest, RefusesPastTheLimitNamingBothNumbersAndFreesOnRelease) {
  ConcurrencyLimit limit("config.json parses", 2, "kMaxParses");
  auto first = limit.TryAcquire();
  auto second = limit.TryAcquire();
  ASSERT_THAT(first.status(), IsOk());
  ASSERT_THAT(second.status(), IsOk());
  EXPECT_EQ(limit.held(), 2u);
  EXPECT_THAT(limit.TryAcquire().status(),
              StatusIs(kExhausted, HasSubstrs("config.json parses: 2 are running",
                                              "limit is 2 (kMaxParses)")));
  first->reset();
  EXPECT_EQ(limit.held(), 1u);
  EXPECT_THAT(limit.TryAcquire().status(), IsOk());  // released at once: a temporary
  EXPECT_EQ(limit.held(), 1u);
}

TEST(ConcurrencyLimitTest, OneKeyTakesAtMostItsShareAndOthersKeepTheirs) {
  ConcurrencyLimit limit("streams", {.total = 3, .total_name = "max_streams", .per_key = 2,
                                     .per_key_name = "max_engine_streams"});
  auto a1 = limit.TryAcquire(7);
  auto a2 = limit.TryAcquire(7);
  ASSERT_THAT(a1.status(), IsOk());
  ASSERT_THAT(a2.status(), IsOk());
  EXPECT_THAT(limit.TryAcquire(7).status(),
              StatusIs(kExhausted, HasSubstrs("streams of engine 7: 2 are open",
                                              "limit is 2 per engine (max_engine_streams)")));
  auto b1 = limit.TryAcquire(8);
  ASSERT_THAT(b1.status(), IsOk());
  EXPECT_THAT(limit.TryAcquire(9).status(),
              StatusIs(kExhausted, HasSubstrs("streams: 3 are running", "limit is 3 (max_streams)")));
  a1->reset();
  EXPECT_THAT(limit.TryAcquire(7).status(), IsOk());
  EXPECT_THAT(limit.TryAcquire(9).status(), IsOk());
}

TEST(ConcurrencyLimitTest, AZeroLimitIsOne) {
  ConcurrencyLimit limit("streams", 0, "cap");
  EXPECT_EQ(limit.limit(), 1u);
  auto held = limit.TryAcquire();
  EXPECT_THAT(held.status(), IsOk());
  EXPECT_THAT(limit.TryAcquire().status(),
              StatusIs(kExhausted, HasSubstrs("streams: 1 are running", "limit is 1")));
}

}  // namespace
}  // namespace memra
