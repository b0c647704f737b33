#include "core/time_share.h"

#include "gtest/gtest.h"

namespace memra {
namespace {

const absl::Time kT0 = absl::FromUnixSeconds(1000);

// 25% of one core with 500 ms banked: the bank covers a burst, a charge past it is debt, and
// the debt is earned back at a quarter of elapsed time, never past the bank.
TEST(TimeShareBucketTest, BurstThenDebtThenEarnedBack) {
  TimeShareBucket bucket({.percent = 25, .burst = absl::Milliseconds(500)}, kT0);
  EXPECT_EQ(bucket.WaitBeforeWork(kT0), absl::ZeroDuration());
  bucket.Charge(absl::Milliseconds(400), kT0);
  EXPECT_EQ(bucket.tokens(), absl::Milliseconds(100));
  EXPECT_EQ(bucket.WaitBeforeWork(kT0), absl::ZeroDuration());
  bucket.Charge(absl::Milliseconds(300), kT0);  // work is charged after it ran: into debt
  EXPECT_EQ(bucket.tokens(), absl::Milliseconds(-200));
  // 200 ms of debt at 25%: 800 ms of waiting.
  EXPECT_EQ(bucket.WaitBeforeWork(kT0), absl::Milliseconds(800));
  EXPECT_EQ(bucket.WaitBeforeWork(kT0 + absl::Milliseconds(400)), absl::Milliseconds(400));
  EXPECT_EQ(bucket.WaitBeforeWork(kT0 + absl::Milliseconds(799)), absl::Milliseconds(1));
  EXPECT_EQ(bucket.WaitBeforeWork(kT0 + absl::Milliseconds(800)), absl::ZeroDuration());
  // A long idle time banks the burst, no more.
  EXPECT_EQ(bucket.WaitBeforeWork(kT0 + absl::Hours(10)), absl::ZeroDuration());
  EXPECT_EQ(bucket.tokens(), absl::Milliseconds(500));
}

// Time that runs backwards (a caller's stale reading) earns nothing and loses nothing.
TEST(TimeShareBucketTest, TimeNeverRunsBackwards) {
  TimeShareBucket bucket({.percent = 100, .burst = absl::Milliseconds(100)}, kT0);
  bucket.Charge(absl::Milliseconds(150), kT0 + absl::Seconds(1));
  EXPECT_EQ(bucket.tokens(), absl::Milliseconds(-50));
  EXPECT_EQ(bucket.WaitBeforeWork(kT0), absl::Milliseconds(50));
  EXPECT_EQ(bucket.tokens(), absl::Milliseconds(-50));
  bucket.Charge(-absl::Seconds(1), kT0 + absl::Seconds(1));  // a negative cost is no refund
  EXPECT_EQ(bucket.tokens(), absl::Milliseconds(-50));
}

}  // namespace
}  // namespace memra
