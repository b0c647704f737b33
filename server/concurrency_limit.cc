#include "server/concurrency_limit.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace memra {

ConcurrencyLimit::ConcurrencyLimit(size_t limit, std::string what, std::string limit_name)
    : limit_(std::max<size_t>(limit, 1)), what_(std::move(what)),
      limit_name_(std::move(limit_name)) {}

ConcurrencyLimit::Permit::~Permit() { limit_->Release(); }

absl::StatusOr<std::unique_ptr<ConcurrencyLimit::Permit>> ConcurrencyLimit::TryAcquire() {
  {
    absl::MutexLock lock(&mu_);
    if (held_ >= limit_) {
      return absl::ResourceExhaustedError(absl::StrCat(what_, ": ", held_,
                                                       " are running and the limit is ", limit_,
                                                       " (", limit_name_, "); try again later"));
    }
    ++held_;
  }
  return std::make_unique<Permit>(this);
}

size_t ConcurrencyLimit::held() const {
  absl::MutexLock lock(&mu_);
  return held_;
}

void ConcurrencyLimit::Release() {
  absl::MutexLock lock(&mu_);
  --held_;  // > 0: this permit is one of them
}

}  // namespace memra
