#include "core/time_share.h"

#include <algorithm>

namespace memra {

TimeShareBucket::TimeShareBucket(TimeShareLimits limits, absl::Time now)
    : limits_(limits), tokens_(limits.burst), earned_until_(now) {}

void TimeShareBucket::Earn(absl::Time now) {
  if (now <= earned_until_) return;
  // Duration arithmetic saturates at infinity, so a long idle time cannot overflow.
  const absl::Duration earned = (now - earned_until_) * limits_.percent / 100;
  tokens_ = std::min(limits_.burst, tokens_ + earned);
  earned_until_ = now;
}

absl::Duration TimeShareBucket::WaitBeforeWork(absl::Time now) {
  Earn(now);
  if (tokens_ >= absl::ZeroDuration()) return absl::ZeroDuration();
  return -tokens_ * 100 / std::max<uint32_t>(limits_.percent, 1);
}

void TimeShareBucket::Charge(absl::Duration used, absl::Time now) {
  Earn(now);
  if (used > absl::ZeroDuration()) tokens_ -= used;
}

}  // namespace memra
