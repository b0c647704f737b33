#include "server/concurrency_limit.h"

#include <memory>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;

TEST(ConcurrencyLimitTest, RefusesPastTheLimitNamingBothNumbersAndFreesOnRelease) {
  ConcurrencyLimit limit(2, "config.json parses", "kMaxConcurrentModelConfigParses");
  auto first = limit.TryAcquire();
  auto second = limit.TryAcquire();
  ASSERT_THAT(first.status(), IsOk());
  ASSERT_THAT(second.status(), IsOk());
  EXPECT_EQ(limit.held(), 2u);
  EXPECT_THAT(limit.TryAcquire().status(),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstrs("config.json parses: 2 are running", "limit is 2",
                                  "kMaxConcurrentModelConfigParses")));
  first->reset();
  EXPECT_EQ(limit.held(), 1u);
  EXPECT_THAT(limit.TryAcquire().status(), IsOk());  // released at once: a temporary
  EXPECT_EQ(limit.held(), 1u);
}

TEST(ConcurrencyLimitTest, AZeroLimitIsOne) {
  ConcurrencyLimit limit(0, "streams", "cap");
  EXPECT_EQ(limit.limit(), 1u);
  auto held = limit.TryAcquire();
  EXPECT_THAT(held.status(), IsOk());
  EXPECT_THAT(limit.TryAcquire().status(), StatusIs(absl::StatusCode::kResourceExhausted,
                                                    HasSubstrs("streams: 1 are running", "limit is 1")));
}

}  // namespace
}  // namespace memra
