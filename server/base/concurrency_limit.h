#ifndef MEMRA_SERVER_CONCURRENCY_LIMIT_H_
#define MEMRA_SERVER_CONCURRENCY_LIMIT_H_

// A counting semaphore that never waits: at most `total` permits are held at once, and at most
// `per_key` by one key (an engine); asking past either is RESOURCE_EXHAUSTED naming the work, the
// count, the limit and where the limit comes from. Used for work a client can start as often as
// it likes and the daemon must not run without bound: parses of client-supplied JSON, long-lived
// streams.
//
// Thread-safety: thread-safe. A Permit may be released on any thread.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace memra {

class ConcurrencyLimit {
 public:
  struct Limits {
    size_t total = 1;        // 0 is taken as 1
    std::string total_name;  // e.g. "kMaxConcurrentModelConfigParses", "max_event_streams"
    size_t per_key = 0;      // 0: no limit per key
    std::string per_key_name;
  };
  // `what` names the work in the plural ("config.json parses", "SubscribeEvents streams").
  ConcurrencyLimit(std::string what, Limits limits);
  // No limit per key.
  ConcurrencyLimit(std::string what, size_t total, std::string total_name)
      : ConcurrencyLimit(std::move(what), Limits{.total = total,
                                                 .total_name = std::move(total_name),
                                                 .per_key = 0,
                                                 .per_key_name = ""}) {}

  // Held while the work runs; the permit returns on destruction. Outlived by its limit.
  class Permit {
   public:
    Permit(ConcurrencyLimit* limit, std::optional<uint64_t> key) : limit_(limit), key_(key) {}
    Permit(const Permit&) = delete;
    Permit& operator=(const Permit&) = delete;
    ~Permit();

   private:
    ConcurrencyLimit* const limit_;
    const std::optional<uint64_t> key_;
  };

  // A permit, or RESOURCE_EXHAUSTED: "SubscribeEvents streams of engine 7: 4 are open and the
  // limit is 4 per engine (max_engine_event_streams)", "config.json parses: 2 are running and
  // the limit is 2 (kMaxConcurrentModelConfigParses)". `key` (an engine id) counts against
  // per_key as well.
  absl::StatusOr<std::unique_ptr<Permit>> TryAcquire(std::optional<uint64_t> key = std::nullopt);

  size_t held() const;
  size_t limit() const { return limits_.total; }

 private:
  void Release(std::optional<uint64_t> key);

  // Constant after construction.
  const std::string what_;
  const Limits limits_;

  mutable absl::Mutex mu_;
  size_t held_ ABSL_GUARDED_BY(mu_) = 0;
  // Permits held per key; keys holding none are absent.
  absl::flat_hash_map<uint64_t, size_t> held_by_key_ ABSL_GUARDED_BY(mu_);
};

}  // namespace memra

#endif  // MEMRA_SERVER_CONCURRENCY_LIMIT_H_
