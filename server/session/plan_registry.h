#ifndef MEMRA_SERVER_PLAN_REGISTRY_H_
#define MEMRA_SERVER_PLAN_REGISTRY_H_

// The model plans engines registered, by fingerprint (RegisterPlan, ImportModel --register).
//
// Bounded: at most kMaxPlans plans, so no client can make the daemon hold plans without end.
// A plan is in use while anyone outside the registry holds it (every session holds its plan for
// its whole life; a query holds it while it runs); in-use plans are never dropped. The others
// are collectable: when the table is full, registering a new plan collects the least recently
// used collectable plan (registering or finding a plan uses it). RESOURCE_EXHAUSTED, with the
// numbers, only when all kMaxPlans plans are in use.
//
// Per engine: an engine's registrations count against `max_plans_per_engine` (DaemonConfig
// max_engine_plans) while the plan stays in the table, so one engine cannot churn everyone's
// registered-but-unused plans out of it; a registration by an operator (ImportModel --register)
// counts against no engine. A collected plan, or ForgetEngine when the engine is reclaimed, ends
// the count.
//
// Thread-safety: thread-safe (one mutex; nothing else is called while it is held).

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/formats.h"
#include "core/model_plan.h"

namespace memra {

class PlanRegistry {
 public:
  static constexpr size_t kMaxPlans = 1024;

  // Fingerprints under `defaults` (the daemon's format defaults); plans of more than
  // `max_layers` layers (DaemonConfig max_plan_layers) are refused.
  explicit PlanRegistry(FormatDefaults defaults, uint32_t max_layers = UINT32_MAX,
                        size_t max_plans_per_engine = kMaxPlans)
      : defaults_(defaults), max_layers_(max_layers), max_plans_per_engine_(max_plans_per_engine) {}

  // The layer cap, checked by every path a plan arrives on (RegisterPlan, the inline plans of
  // GetCost / GetFit / GetMaxContext, ImportModel) before any other work on it: a plan of
  // `layers` layers (trunk + MTP) is INVALID_ARGUMENT naming both numbers when over the cap.
  absl::Status CheckLayerCount(uint64_t layers) const;

  // Checks the layer cap, validates and fingerprints `plan` and registers it for `engine`
  // (nullopt: an operator). Idempotent: a plan already registered is only marked used (and
  // counted for `engine` if it was not yet). RESOURCE_EXHAUSTED naming the engine, its count and
  // the limit when the engine already has max_plans_per_engine other plans here. Returns the
  // fingerprint.
  absl::StatusOr<PlanFingerprint> Register(ModelPlan plan,
                                           std::optional<uint64_t> engine = std::nullopt)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The engine was reclaimed: its registrations count no more (the plans stay).
  void ForgetEngine(uint64_t engine) ABSL_LOCKS_EXCLUDED(mu_);
  // Plans in the table `engine` registered.
  size_t PlansOf(uint64_t engine) const ABSL_LOCKS_EXCLUDED(mu_);

  // The registered plan with this fingerprint (NOT_FOUND naming it in hex); marks it used.
  absl::StatusOr<std::shared_ptr<const ModelPlan>> Find(const PlanFingerprint& fingerprint)
      ABSL_LOCKS_EXCLUDED(mu_);

  size_t size() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry {
    std::shared_ptr<const ModelPlan> plan;
    uint64_t last_used = 0;  // use_tick_ when last registered or found
    absl::flat_hash_set<uint64_t> registrants;  // engines that registered it
  };

  // Frees one slot by collecting the least recently used plan nobody else holds;
  // RESOURCE_EXHAUSTED when every plan is held.
  absl::Status CollectOne() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const FormatDefaults defaults_;
  const uint32_t max_layers_;
  const size_t max_plans_per_engine_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<PlanFingerprint, Entry> plans_ ABSL_GUARDED_BY(mu_);
  uint64_t use_tick_ ABSL_GUARDED_BY(mu_) = 0;
  // Engine -> the plans in plans_ it registered (== entries listing it; absent when 0).
  absl::flat_hash_map<uint64_t, size_t> per_engine_ ABSL_GUARDED_BY(mu_);
};

}  // namespace memra

#endif  // MEMRA_SERVER_PLAN_REGISTRY_H_
