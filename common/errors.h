#ifndef MEMRA_COMMON_ERRORS_H_
#define MEMRA_COMMON_ERRORS_H_

// The one place an errno value becomes an absl::Status (the client's mapper uses it too).

#include <string_view>

#include "absl/status/status.h"

namespace memra {

// `context` names the operation and the object, e.g. "shm_open /memra-kv-1f..". The code says
// what the caller does next: ENOMEM/ENOSPC -> RESOURCE_EXHAUSTED (no room), EACCES/EPERM ->
// PERMISSION_DENIED, ENOENT -> NOT_FOUND, anything else -> INTERNAL.
absl::Status PosixError(std::string_view context, int err);

}  // namespace memra

#endif  // MEMRA_COMMON_ERRORS_H_
