#ifndef MEMRA_COMMON_DAEMON_RESTART_H_
#define MEMRA_COMMON_DAEMON_RESTART_H_

// The one error an engine gets when memra-kvd restarted and what it named did not come back
// (docs/failure-model.md#the-daemon-dies): FAILED_PRECONDITION
//   "memra-kvd restarted (epoch A -> B); <what was not re-adopted and why>"
// with both epochs attached as a payload (kDaemonRestartTypeUrl), which the wire carries as
// memra.kv.v1.StatusDetails.daemon_restart (common/grpc_status.h). Never the bare NOT_FOUND of
// an id the new daemon does not know, and never stale memory.

#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace memra {

struct DaemonRestart {
  uint64_t previous_epoch = 0;  // the daemon the engine knew (0: unknown)
  uint64_t epoch = 0;           // the daemon answering now
  bool operator==(const DaemonRestart&) const = default;
};

inline constexpr char kDaemonRestartTypeUrl[] = "type.memra.dev/memra.kv.DaemonRestart";

// FAILED_PRECONDITION "memra-kvd restarted (epoch A -> B); <what>" carrying `restart`.
absl::Status DaemonRestartedError(const DaemonRestart& restart, absl::string_view what);
// The restart `status` reports, or nullopt for any other status.
std::optional<DaemonRestart> GetDaemonRestart(const absl::Status& status);
// Attaches `restart` to `status` (the wire layer restoring what the daemon sent).
void AttachDaemonRestart(absl::Status& status, const DaemonRestart& restart);

}  // namespace memra

#endif  // MEMRA_COMMON_DAEMON_RESTART_H_
