#ifndef MEMRA_TESTS_STATUS_MATCHERS_H_
#define MEMRA_TESTS_STATUS_MATCHERS_H_

// StatusIs(code, message_matcher) for absl::Status and absl::StatusOr<T>; the project's one copy.

#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"

namespace memra::testing {

inline const absl::Status& GetStatus(const absl::Status& status) { return status; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}

MATCHER_P2(StatusIs, code, message_matcher,
           std::string("has status code ") + absl::StatusCodeToString(code)) {
  const absl::Status& status = ::memra::testing::GetStatus(arg);
  *result_listener << "status is " << status;
  return status.code() == code &&
         ::testing::ExplainMatchResult(message_matcher, std::string(status.message()),
                                       result_listener);
}

// For absl::StatusOr<T>: OK and the value matches `matcher` (a matcher or a plain value).
MATCHER_P(IsOkAndHolds, matcher, "is OK and holds a matching value") {
  if (!arg.ok()) {
    *result_listener << "status is " << arg.status();
    return false;
  }
  return ::testing::ExplainMatchResult(matcher, *arg, result_listener);
}

MATCHER(IsOk, "is OK") {
  const absl::Status& status = ::memra::testing::GetStatus(arg);
  *result_listener << "status is " << status;
  return status.ok();
}

// Shorthand for a message that must contain every one of the given substrings.
template <typename... Parts>
auto HasSubstrs(const Parts&... parts) {
  return ::testing::AllOf(::testing::HasSubstr(parts)...);
}

}  // namespace memra::testing

#endif  // MEMRA_TESTS_STATUS_MATCHERS_H_
