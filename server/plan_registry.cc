#include "server/plan_registry.h"

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

absl::StatusOr<PlanFingerprint> PlanRegistry::Register(ModelPlan plan) {
  RETURN_IF_ERROR(CheckLayerCount(uint64_t{plan.layers.size()} + plan.mtp_blocks.size()));
  RETURN_IF_ERROR(ValidateModelPlan(plan));
  ASSIGN_OR_RETURN(PlanFingerprint fingerprint, FingerprintModelPlan(plan, defaults_));
  absl::MutexLock lock(&mu_);
  if (auto it = plans_.find(fingerprint); it != plans_.end()) {
    it->second.last_used = ++use_tick_;
    return fingerprint;
  }
  if (plans_.size() >= kMaxPlans) RETURN_IF_ERROR(CollectOne());
  spdlog::info("model plan \"{}\" registered: {} layers, {} MTP blocks, fingerprint {}", plan.name,
               plan.layers.size(), plan.mtp_blocks.size(), FingerprintHex(fingerprint));
  plans_.emplace(fingerprint,
                 Entry{std::make_shared<const ModelPlan>(std::move(plan)), ++use_tick_});
  return fingerprint;
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
