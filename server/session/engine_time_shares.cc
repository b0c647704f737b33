#include "server/session/engine_time_shares.h"

#include "absl/strings/str_cat.h"

namespace memra {

EngineTimeShares::EngineTimeShares(TimeShareLimits limits, Clock* clock)
    : limits_(limits), clock_(clock) {}

TimeShareBucket& EngineTimeShares::BucketLocked(EngineId engine, absl::Time now) {
  return buckets_.try_emplace(engine.value, limits_, now).first->second;
}

absl::Status EngineTimeShares::Admit(EngineId engine) {
  if (!bounded()) return absl::OkStatus();
  const absl::Time now = Now();
  absl::MutexLock lock(&mu_);
  TimeShareBucket& bucket = BucketLocked(engine, now);
  const absl::Duration wait = bucket.WaitBeforeWork(now);
  if (wait == absl::ZeroDuration()) return absl::OkStatus();
  ++refusals_;
  return absl::ResourceExhaustedError(absl::StrCat(
      "engine ", engine.value, " has used its share of the daemon's time: its operations took ",
      absl::ToInt64Milliseconds(-bucket.tokens()), " ms more than it has earned, at ",
      limits_.percent, "% of one core (max_engine_cpu_percent) with at most ",
      absl::ToInt64Milliseconds(limits_.burst), " ms banked; it is served again in ",
      absl::ToInt64Milliseconds(absl::Ceil(wait, absl::Milliseconds(1))), " ms"));
}

void EngineTimeShares::Charge(EngineId engine, absl::Time started) {
  const absl::Time now = Now();
  absl::MutexLock lock(&mu_);
  BucketLocked(engine, now).Charge(now - started, now);
}

void EngineTimeShares::Forget(EngineId engine) {
  absl::MutexLock lock(&mu_);
  buckets_.erase(engine.value);
}

uint64_t EngineTimeShares::refusals() const {
  absl::MutexLock lock(&mu_);
  return refusals_;
}

}  // namespace memra
