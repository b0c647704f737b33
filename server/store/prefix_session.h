#ifndef MEMRA_SERVER_PREFIX_SESSION_H_
#define MEMRA_SERVER_PREFIX_SESSION_H_

// What the prefix store needs of a live session to capture from it or restore into it: who it is,
// what shape and cache scope its planes have, and its state under the session's own lock. The
// session layer implements it (DaemonSession), so the store never includes the session: the
// dependency runs session -> store only.

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/formats.h"
#include "core/model_plan.h"
#include "core/session.h"
#include "core/sizing.h"
#include "server/base/ids.h"
#include "server/device/placement.h"

namespace memra {

// Thread-safety: the accessors are constant for the session's life; ViewLocked and
// RestoreLocked take the session's own mutex (lock order: the session's mutex before the
// store's).
class PrefixSession {
 public:
  virtual ~PrefixSession() = default;

  virtual SessionId id() const = 0;
  virtual EngineId owner() const = 0;
  // The owner's prefix-cache scope (server/session/cache_scopes.h): where its captures are
  // stored, also after the owner is gone (a capture on engine death).
  virtual absl::string_view cache_scope() const = 0;
  virtual const ModelPlan& model_plan() const = 0;
  virtual const FormatDefaults& format_defaults() const = 0;
  virtual const SessionShape& session_shape() const = 0;

  // `committed_tokens`: the token ids of rows [0, committed_len) as commits reported them, or
  // nullopt when unknown (a commit without token ids, a hydration).
  using LockedView = absl::FunctionRef<absl::Status(
      const SessionState& state, const SessionLayoutVersion& layout,
      const std::optional<std::vector<int32_t>>& committed_tokens)>;
  // Runs `view` under the session's mutex (no state change interleaves with its reads).
  virtual absl::Status ViewLocked(LockedView view) = 0;
  // `restore` validates against the state, performs the device copies and returns the state the
  // session adopts; then the mirrors are written and the committed tokens become
  // token_ids[0, committed_len). Refused while a grow awaits acknowledgement; a refusal of
  // `restore` changes nothing.
  using Restorer = absl::FunctionRef<absl::StatusOr<SessionState>(
      const SessionState& state, const SessionLayoutVersion& layout)>;
  virtual absl::Status RestoreLocked(Restorer restore, absl::Span<const int32_t> token_ids) = 0;
};

}  // namespace memra

#endif  // MEMRA_SERVER_PREFIX_SESSION_H_
