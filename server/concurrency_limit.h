#ifndef MEMRA_SERVER_CONCURRENCY_LIMIT_H_
#define MEMRA_SERVER_CONCURRENCY_LIMIT_H_

// A counting semaphore that never waits: at most `limit` permits are held at once, and asking
// for one past that is RESOURCE_EXHAUSTED naming the work, the count and the limit (and which
// configuration key or constant sets it). Used for work a client can start as often as it likes
// and the daemon must not run without bound: parses of client-supplied JSON, long-lived streams.
//
// Thread-safety: thread-safe. A Permit may be released on any thread.

#include <cstddef>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace memra {

class ConcurrencyLimit {
 public:
  // `what` names one unit of the work ("config.json parses"), `limit_name` where the limit comes
  // from ("kMaxConcurrentModelConfigParses"). A limit of 0 is taken as 1.
  ConcurrencyLimit(size_t limit, std::string what, std::string limit_name);

  // Held while the work runs; the permit returns on destruction. Outlived by its limit.
  class Permit {
   public:
    explicit Permit(ConcurrencyLimit* limit) : limit_(limit) {}
    Permit(const Permit&) = delete;
    Permit& operator=(const Permit&) = delete;
    ~Permit();

   private:
    ConcurrencyLimit* limit_;
  };

  // A permit, or RESOURCE_EXHAUSTED: "<what>: 2 are running and the limit is 2 (<limit_name>)".
  absl::StatusOr<std::unique_ptr<Permit>> TryAcquire();

  size_t held() const;
  size_t limit() const { return limit_; }

 private:
  void Release();

  // Constant after construction.
  const size_t limit_;
  const std::string what_;
  const std::string limit_name_;

  mutable absl::Mutex mu_;
  size_t held_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace memra

#endif  // MEMRA_SERVER_CONCURRENCY_LIMIT_H_
