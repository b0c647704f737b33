#ifndef MEMRA_SERVER_CLOCK_H_
#define MEMRA_SERVER_CLOCK_H_

// Time for lease decisions, injectable so tests drive leases without sleeping (Envoy's
// SimulatedTimeSystem).

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace memra {

// Thread-safe.
class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() = 0;
  // The process-wide real clock (never destroyed).
  static Clock* Real();
};

// Thread-safe. Stands still until told to move.
class FakeClock final : public Clock {
 public:
  explicit FakeClock(absl::Time start = absl::UnixEpoch() + absl::Hours(1)) : now_(start) {}
  absl::Time Now() override ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration by) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    now_ += by;
  }

 private:
  absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
};

inline Clock* Clock::Real() {
  class RealClock final : public Clock {
    absl::Time Now() override { return absl::Now(); }
  };
  static Clock* const clock = new RealClock();
  return clock;
}

}  // namespace memra

#endif  // MEMRA_SERVER_CLOCK_H_
