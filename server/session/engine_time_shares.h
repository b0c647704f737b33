#ifndef MEMRA_SERVER_ENGINE_TIME_SHARES_H_
#define MEMRA_SERVER_ENGINE_TIME_SHARES_H_

// Each engine's share of the daemon's time (docs/security-model.md#resources, issue 31): the
// time the daemon spends in an engine's session operations (every gRPC session call, every
// Step entry, every step channel round of records, CreateSession) is charged to that engine's
// TimeShareBucket (core/time_share.h), and an engine whose bucket is in debt is refused
// RESOURCE_EXHAUSTED, with the numbers and when it is admitted again, before any work. Measured
// as wall time inside the operation (the daemon's clock read twice, ~0.1 us each, where a
// thread's CPU clock costs ~3 us a read): an upper bound of its CPU time that also counts the
// operation's copies, lock waits and time spent waiting for a core, and cheap enough for every
// step. A single-threaded engine cannot keep the daemon busy for longer than it runs, so the
// default (100% of one core, 2 s banked) bites only an engine that keeps the daemon working on
// its behalf on several threads at once for seconds.
//
// Thread-safety: thread-safe; `mu_` is a leaf lock held for no work.

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/time_share.h"
#include "server/base/clock.h"
#include "server/base/ids.h"

namespace memra {

class EngineTimeShares {
 public:
  // Seconds of its share an engine may bank: a burst of work, e.g. a large Grow's copy.
  static constexpr int64_t kBurstSeconds = 2;
  // `percent` of one core with kBurstSeconds of it banked.
  static TimeShareLimits LimitsFor(uint32_t percent) {
    return {.percent = percent, .burst = absl::Seconds(kBurstSeconds) * percent / 100};
  }

  // `limits.percent`: DaemonConfig max_engine_cpu_percent (0: no bound; Admit always admits and
  // nothing is measured). REQUIRES: `clock` outlives this.
  EngineTimeShares(TimeShareLimits limits, Clock* clock);

  bool bounded() const { return limits_.percent > 0; }
  // OK, or RESOURCE_EXHAUSTED "engine 7 has used its share of the daemon's time: ..." with its
  // debt, the share, the burst and the wait. Call only for an authenticated engine.
  absl::Status Admit(EngineId engine) ABSL_LOCKS_EXCLUDED(mu_);
  // Work for `engine` that began at `started` (from Now()) ended now.
  void Charge(EngineId engine, absl::Time started) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Time Now() { return clock_->Now(); }
  // The engine was reclaimed: its bucket goes (engine ids are never reused).
  void Forget(EngineId engine) ABSL_LOCKS_EXCLUDED(mu_);
  // Refusals since start (metrics).
  uint64_t refusals() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  TimeShareBucket& BucketLocked(EngineId engine, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const TimeShareLimits limits_;
  Clock* const clock_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, TimeShareBucket> buckets_ ABSL_GUARDED_BY(mu_);
  uint64_t refusals_ ABSL_GUARDED_BY(mu_) = 0;
};

// Charges the time from its construction to its destruction to `engine`; nothing when `shares`
// is null or unbounded. Admit first.
class TimeCharge {
 public:
  TimeCharge(EngineTimeShares* shares, EngineId engine)
      : shares_(shares != nullptr && shares->bounded() ? shares : nullptr),
        engine_(engine),
        started_(shares_ != nullptr ? shares_->Now() : absl::InfinitePast()) {}
  ~TimeCharge() {
    if (shares_ != nullptr) shares_->Charge(engine_, started_);
  }
  TimeCharge(const TimeCharge&) = delete;
  TimeCharge& operator=(const TimeCharge&) = delete;

 private:
  EngineTimeShares* const shares_;
  const EngineId engine_;
  const absl::Time started_;
};

}  // namespace memra

#endif  // MEMRA_SERVER_ENGINE_TIME_SHARES_H_
