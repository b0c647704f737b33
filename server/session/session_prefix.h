#ifndef MEMRA_SERVER_SESSION_PREFIX_H_
#define MEMRA_SERVER_SESSION_PREFIX_H_

// A live session's side of the prefix cache: capture from a session and restore into one, each
// under the session's own mutex (DaemonSession::ViewLocked / RestoreLocked), over the store's
// session-free calls (PrefixCache::CaptureState, CaptureCommittedState, RestoreInto; the rules
// are theirs, server/store/prefix_cache.h). The dependency runs session -> store only.
//
// Thread-safety: as PrefixCache and DaemonSession; lock order: the session's mutex -> the
// cache's. Tiers are rebalanced after the session's mutex is left (a restore's refusals too:
// its promotions may have filled the device tier).

#include <cstdint>
#include <optional>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/prefix_index.h"
#include "server/session/daemon_session.h"
#include "server/store/prefix_cache.h"

namespace memra {

// `session`'s shape in its owner's cache scope (the key its entries are stored under).
absl::StatusOr<ScopedShape> PrefixShapeOf(const DaemonSession& session);

// Captures tokens[0, boundary_tokens) of `session`'s committed state in its cache scope, keyed
// by the token ids its commits carried (never by `tokens`, which must agree with them).
// Refused, nothing stored: FAILED_PRECONDITION when the committed ids are unknown (a commit
// without token ids, a hydration); INVALID_ARGUMENT naming the first position where `tokens`
// differs (and both ids) or both counts when `tokens` is longer; else as CaptureState.
absl::StatusOr<PrefixCaptureResult> CaptureSessionPrefix(PrefixCache& cache, DaemonSession& session,
                                                         absl::Span<const int32_t> tokens,
                                                         uint64_t boundary_tokens);

// Engine death: keeps `session`'s committed state (CaptureCommittedState); nullopt when there
// is nothing to capture.
absl::StatusOr<std::optional<PrefixCaptureResult>> CaptureCommittedPrefix(PrefixCache& cache,
                                                                          DaemonSession& session);

// Restores `entry` (nullopt: the longest match for `tokens`) into the FRESH `session`, which
// adopts the restored state and token_ids[0, restored length) as its committed ids. Refused
// while a grow awaits acknowledgement; else as RestoreInto (a refusal changes nothing).
absl::StatusOr<PrefixRestoreResult> RestoreSessionPrefix(PrefixCache& cache, DaemonSession& session,
                                                         std::optional<EntryId> entry,
                                                         absl::Span<const int32_t> tokens);

}  // namespace memra

#endif  // MEMRA_SERVER_SESSION_PREFIX_H_
