#ifndef MEMRA_CORE_STATUS_MACROS_H_
#define MEMRA_CORE_STATUS_MACROS_H_

// Debian's Abseil (20220623) ships neither status_macros.h nor status_matchers.h; these are the
// project's one copy. Test matchers live in tests/status_matchers.h.

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define MEMRA_STATUS_CONCAT_INNER_(a, b) a##b
#define MEMRA_STATUS_CONCAT_(a, b) MEMRA_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function when `expr` (an absl::Status) is not OK.
#define RETURN_IF_ERROR(expr)                                  \
  do {                                                         \
    ::absl::Status memra_status_ = (expr);                     \
    if (!memra_status_.ok()) return memra_status_;             \
  } while (0)

// `ASSIGN_OR_RETURN(auto x, StatusOrExpr())`: binds the value or returns the error.
#define ASSIGN_OR_RETURN(lhs, expr) \
  MEMRA_ASSIGN_OR_RETURN_IMPL_(MEMRA_STATUS_CONCAT_(memra_statusor_, __LINE__), lhs, expr)

#define MEMRA_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                 \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

#endif  // MEMRA_CORE_STATUS_MACROS_H_
