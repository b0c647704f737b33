#include "server/session/plan_registry.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "spdlog/spdlog.h"

namespace memra {

absl::Status PlanRegistry::CheckLayerCount(uint64_t layers) const {
  if (layers <= max_layers_) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("model plan has ", layers, " layers (trunk + MTP); this daemon accepts at most ",
                   max_layers_, " (max_plan_layers)"));
}

absl::StatusOr<PlanFingerprint> PlanRegistry::Register(ModelPlan plan,
                                                       std::optional<uint64_t> engine) {
  RETURN_IF_ERROR(CheckLayerCount(uint64_t{plan.layers.size()} + plan.mtp_blocks.size()));
  RETURN_IF_ERROR(ValidateModelPlan(plan));
  ASSIGN_OR_RETURN(PlanFingerprint fingerprint, FingerprintModelPlan(plan, defaults_));
  absl::MutexLock lock(&mu_);
  auto existing = plans_.find(fingerprint);
  const bool counted = existing != plans_.end() && engine.has_value() &&
                       existing->second.registrants.contains(*engine);
  if (engine.has_value() && !counted) {
    auto held = per_engine_.find(*engine);
    const size_t plans = held == per_engine_.end() ? 0 : held->second;
    if (plans >= max_plans_per_engine_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "engine ", *engine, " has registered ", plans, " model plans and the limit is ",
          max_plans_per_engine_, " per engine (max_engine_plans)"));
    }
  }
  if (existing == plans_.end()) {
    if (plans_.size() >= kMaxPlans) RETURN_IF_ERROR(CollectOne());
    spdlog::info("model plan \"{}\" registered: {} layers, {} MTP blocks, fingerprint {}",
                 plan.name, plan.layers.size(), plan.mtp_blocks.size(),
                 FingerprintHex(fingerprint));
    Entry entry;
    entry.plan = std::make_shared<const ModelPlan>(std::move(plan));
    existing = plans_.emplace(fingerprint, std::move(entry)).first;
  }
  existing->second.last_used = ++use_tick_;
  if (engine.has_value() && !counted) {
    existing->second.registrants.insert(*engine);
    ++per_engine_[*engine];
  }
  return fingerprint;
}

void PlanRegistry::ForgetEngine(uint64_t engine) {
  absl::MutexLock lock(&mu_);
  if (per_engine_.erase(engine) == 0) return;
  for (auto& [fingerprint, entry] : plans_) entry.registrants.erase(engine);
}

size_t PlanRegistry::PlansOf(uint64_t engine) const {
  absl::MutexLock lock(&mu_);
  auto it = per_engine_.find(engine);
  return it == per_engine_.end() ? 0 : it->second;
}

absl::Status PlanRegistry::CollectOne() {
  auto victim = plans_.end();
  for (auto it = plans_.begin(); it != plans_.end(); ++it) {
    // use_count() == 1: only this table holds the plan, and nobody can take it from the table
    // without mu_, so it is not in use and cannot become so meanwhile.
    if (it->second.plan.use_count() != 1) continue;
    if (victim == plans_.end() || it->second.last_used < victim->second.last_used) victim = it;
  }
  if (victim == plans_.end()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the daemon holds ", plans_.size(), " model plans (limit ", kMaxPlans,
                     ") and all ", plans_.size(),
                     " are in use by sessions; release a session of another model first"));
  }
  spdlog::info("model plan \"{}\" ({}) collected: no session uses it and the table is full",
               victim->second.plan->name, FingerprintHex(victim->first));
  for (uint64_t engine : victim->second.registrants) {
    if (auto it = per_engine_.find(engine); it != per_engine_.end() && --it->second == 0) {
      per_engine_.erase(it);
    }
  }
  plans_.erase(victim);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const ModelPlan>> PlanRegistry::Find(
    const PlanFingerprint& fingerprint) {
  absl::MutexLock lock(&mu_);
  auto it = plans_.find(fingerprint);
  if (it == plans_.end()) {
    return absl::NotFoundError(
        absl::StrCat("model plan ", FingerprintHex(fingerprint), " is not registered"));
  }
  it->second.last_used = ++use_tick_;
  return it->second.plan;
}

size_t PlanRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return plans_.size();
}

}  // namespace memra
