#include "server/session/session_prefix.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/model_plan.h"
#include "core/status_macros.h"
#include "server/store/stored_layout.h"

namespace memra {
namespace {

// The session's committed token ids [0, requested.size()) when `requested` agrees with them
// position by position (and names no position the session has not committed).
// FAILED_PRECONDITION when the committed ids are unknown (a commit without token ids, a
// hydration); INVALID_ARGUMENT naming the first differing position and both ids, or both counts.
absl::StatusOr<absl::Span<const int32_t>> CommittedTokensMatching(
    SessionId session, const SessionState& state,
    const std::optional<std::vector<int32_t>>& committed, absl::Span<const int32_t> requested) {
  if (!committed.has_value() || committed->size() != state.committed_len()) {
    return absl::FailedPreconditionError(
        absl::StrCat("prefix capture: session ", session.value,
                     "'s committed token ids are unknown (", state.committed_len(),
                     " rows committed, some without token ids); commit with token ids to capture"));
  }
  const size_t common = std::min(requested.size(), committed->size());
  for (size_t i = 0; i < common; ++i) {
    if (requested[i] != (*committed)[i]) {
      return absl::InvalidArgumentError(
          absl::StrCat("prefix capture: token id at position ", i, " is ", requested[i],
                       " in the request but session ", session.value, " committed ",
                       (*committed)[i], "; a capture stores the ids the session committed"));
    }
  }
  if (requested.size() > committed->size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefix capture: the request gives ", requested.size(),
                     " token ids but session ", session.value, " committed ", committed->size()));
  }
  return absl::MakeConstSpan(*committed).subspan(0, requested.size());
}

}  // namespace

absl::StatusOr<ScopedShape> PrefixShapeOf(const DaemonSession& session) {
  ASSIGN_OR_RETURN(PlanFingerprint model,
                   FingerprintModelPlan(session.model_plan(), session.format_defaults()));
  ScopedShape out;
  out.scope = std::string(session.cache_scope());
  out.shape = PrefixShapeFingerprint(model, session.session_shape());
  out.key = ScopedShapeFingerprint(out.scope, out.shape);
  out.formats = PlanFormatsSummary(session.model_plan(), session.format_defaults());
  return out;
}

absl::StatusOr<PrefixCaptureResult> CaptureSessionPrefix(PrefixCache& cache, DaemonSession& session,
                                                         absl::Span<const int32_t> tokens,
                                                         uint64_t boundary_tokens) {
  ASSIGN_OR_RETURN(ScopedShape shape, PrefixShapeOf(session));
  absl::StatusOr<PrefixCaptureResult> result = absl::InternalError("capture did not run");
  RETURN_IF_ERROR(
      session.ViewLocked([&](const SessionState& state, const SessionLayoutVersion& layout,
                             const std::optional<std::vector<int32_t>>& committed) {
        absl::StatusOr<absl::Span<const int32_t>> committed_tokens =
            CommittedTokensMatching(session.id(), state, committed, tokens);
        if (!committed_tokens.ok()) return committed_tokens.status();
        // Stored under what the session committed, never under the caller's word.
        result = cache.CaptureState(shape, state, layout, *committed_tokens, boundary_tokens,
                                    session.owner().value);
        return result.status();
      }));
  cache.RebalanceTiers();
  return result;
}

absl::StatusOr<std::optional<PrefixCaptureResult>> CaptureCommittedPrefix(PrefixCache& cache,
                                                                          DaemonSession& session) {
  ASSIGN_OR_RETURN(ScopedShape shape, PrefixShapeOf(session));
  std::optional<PrefixCaptureResult> result;
  RETURN_IF_ERROR(
      session.ViewLocked([&](const SessionState& state, const SessionLayoutVersion& layout,
                             const std::optional<std::vector<int32_t>>& committed) -> absl::Status {
        ASSIGN_OR_RETURN(result, cache.CaptureCommittedState(shape, state, layout, committed));
        return absl::OkStatus();
      }));
  cache.RebalanceTiers();
  return result;
}

absl::StatusOr<PrefixRestoreResult> RestoreSessionPrefix(PrefixCache& cache, DaemonSession& session,
                                                         std::optional<EntryId> entry,
                                                         absl::Span<const int32_t> tokens) {
  ASSIGN_OR_RETURN(ScopedShape shape, PrefixShapeOf(session));
  PrefixRestoreResult result;
  const absl::Status status = session.RestoreLocked(
      [&](const SessionState& state,
          const SessionLayoutVersion& layout) -> absl::StatusOr<SessionState> {
        ASSIGN_OR_RETURN(PrefixRestoreOutcome restored,
                         cache.RestoreInto(shape, session.id(), session.owner().value, state,
                                           layout, entry, tokens));
        result = restored.result;
        return std::move(restored.state);
      },
      tokens);
  // Promoted pieces may have pushed the device tier over its budget, on failure too.
  cache.RebalanceTiers();
  RETURN_IF_ERROR(status);
  return result;
}

}  // namespace memra
