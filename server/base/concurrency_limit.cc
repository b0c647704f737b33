#include "server/base/concurrency_limit.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace memra {
namespace {

ConcurrencyLimit::Limits AtLeastOne(ConcurrencyLimit::Limits limits) {
  limits.total = std::max<size_t>(limits.total, 1);
  return limits;
}

}  // namespace

ConcurrencyLimit::ConcurrencyLimit(std::string what, Limits limits)
    : what_(std::move(what)), limits_(AtLeastOne(std::move(limits))) {}

ConcurrencyLimit::Permit::~Permit() { limit_->Release(key_); }

absl::StatusOr<std::unique_ptr<ConcurrencyLimit::Permit>> ConcurrencyLimit::TryAcquire(
    std::optional<uint64_t> key) {
  {
    absl::MutexLock lock(&mu_);
    if (key.has_value() && limits_.per_key > 0) {
      auto it = held_by_key_.find(*key);
      const size_t held = it == held_by_key_.end() ? 0 : it->second;
      if (held >= limits_.per_key) {
        return absl::ResourceExhaustedError(
            absl::StrCat(what_, " of engine ", *key, ": ", held, " are open and the limit is ",
                         limits_.per_key, " per engine (", limits_.per_key_name, ")"));
      }
    }
    if (held_ >= limits_.total) {
      return absl::ResourceExhaustedError(absl::StrCat(what_, ": ", held_,
                                                       " are running and the limit is ",
                                                       limits_.total, " (", limits_.total_name,
                                                       "); try again later"));
    }
    ++held_;
    if (key.has_value()) ++held_by_key_[*key];
  }
  return std::make_unique<Permit>(this, key);
}

size_t ConcurrencyLimit::held() const {
  absl::MutexLock lock(&mu_);
  return held_;
}

void ConcurrencyLimit::Release(std::optional<uint64_t> key) {
  absl::MutexLock lock(&mu_);
  --held_;  // > 0: the releasing permit is one of them
  if (key.has_value()) {
    auto it = held_by_key_.find(*key);
    if (--it->second == 0) held_by_key_.erase(it);
  }
}

}  // namespace memra
