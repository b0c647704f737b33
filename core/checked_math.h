#ifndef MEMRA_CORE_CHECKED_MATH_H_
#define MEMRA_CORE_CHECKED_MATH_H_

// Overflow-checked size arithmetic. Every byte or row count that a client can influence goes
// through these: a wrapped size is a wrong allocation, never a crash we can afford.

#include <cstdint>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace memra {

inline absl::StatusOr<uint64_t> CheckedAdd(uint64_t a, uint64_t b, absl::string_view what) {
  uint64_t out;
  if (__builtin_add_overflow(a, b, &out)) {
    return absl::InvalidArgumentError(absl::StrCat(what, " overflows: ", a, " + ", b));
  }
  return out;
}

inline absl::StatusOr<uint64_t> CheckedMul(uint64_t a, uint64_t b, absl::string_view what) {
  uint64_t out;
  if (__builtin_mul_overflow(a, b, &out)) {
    return absl::InvalidArgumentError(absl::StrCat(what, " overflows: ", a, " x ", b));
  }
  return out;
}

// Rounds `value` up to a multiple of `alignment` (a nonzero power of two).
inline absl::StatusOr<uint64_t> CheckedAlignUp(uint64_t value, uint64_t alignment,
                                               absl::string_view what) {
  uint64_t bumped;
  if (__builtin_add_overflow(value, alignment - 1, &bumped)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " overflows when aligned to ", alignment, ": ", value));
  }
  return bumped & ~(alignment - 1);
}

}  // namespace memra

#endif  // MEMRA_CORE_CHECKED_MATH_H_
