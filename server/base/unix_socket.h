#ifndef MEMRA_SERVER_UNIX_SOCKET_H_
#define MEMRA_SERVER_UNIX_SOCKET_H_

// The daemon's Unix socket file before and after gRPC binds it: a stale file (no daemon answers
// on it) is removed, a live one is refused (two daemons never share a GPU's socket), and the
// bound file gets the configured group and mode.

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/mapped_region.h"

namespace memra {

// OK when `path` is free to bind: it does not exist, or it is a socket nobody answers on (then
// it is removed). FAILED_PRECONDITION when its directory is missing, it is not a socket, or a
// daemon answers on it; INVALID_ARGUMENT when it is longer than sun_path allows (the numbers).
absl::Status PrepareSocketPath(const std::string& path);

// chown to `group` (unless empty; FAILED_PRECONDITION when no such group) and chmod to `mode`.
absl::Status ApplySocketPermissions(const std::string& path, const std::string& group,
                                    uint32_t mode);

// A non-blocking, close-on-exec listening socket bound at `path` (PrepareSocketPath first) with
// `group` and `mode` applied; the file is removed again on failure. `what` names the socket in
// errors ("handoff socket").
absl::StatusOr<ScopedFd> ListenOnUnixSocket(const std::string& path, const std::string& group,
                                            uint32_t mode, const std::string& what);

}  // namespace memra

#endif  // MEMRA_SERVER_UNIX_SOCKET_H_
