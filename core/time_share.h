#ifndef MEMRA_CORE_TIME_SHARE_H_
#define MEMRA_CORE_TIME_SHARE_H_

// A share of the daemon's time for one client (docs/security-model.md#resources): a token
// bucket whose tokens are time. It earns `percent` of every elapsed second, banks at most
// `burst`, and is charged after the work with what the work took (its cost is known only then),
// so it may go into debt by one operation; while it is in debt (below zero) its client's next
// work is refused until the bucket has earned its way back to zero.
//
// Thread-safety: a plain value, not synchronized. Time is passed in (pure, deterministic).
// Invariant: tokens() <= burst after every call; a call with `now` earlier than an earlier
// call's earns nothing (time never runs backwards for the bucket).

#include <cstdint>

#include "absl/time/time.h"

namespace memra {

struct TimeShareLimits {
  uint32_t percent = 100;                        // of one core's time, 1..
  absl::Duration burst = absl::Seconds(2);       // tokens banked at most (> 0)
};

class TimeShareBucket {
 public:
  // Starts full (`burst` banked) at `now`.
  TimeShareBucket(TimeShareLimits limits, absl::Time now);

  // Zero when work may start now; else how long until the bucket is out of debt.
  absl::Duration WaitBeforeWork(absl::Time now);
  // Work that took `used` ended at `now`.
  void Charge(absl::Duration used, absl::Time now);

  absl::Duration tokens() const { return tokens_; }
  const TimeShareLimits& limits() const { return limits_; }

 private:
  void Earn(absl::Time now);

  TimeShareLimits limits_;
  absl::Duration tokens_;
  absl::Time earned_until_;
};

}  // namespace memra

#endif  // MEMRA_CORE_TIME_SHARE_H_
