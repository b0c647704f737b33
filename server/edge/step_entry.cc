#include "server/edge/step_entry.h"

#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/codec.h"
#include "common/daemon_restart.h"
#include "core/status_macros.h"
#include "spdlog/spdlog.h"

namespace memra {

namespace pb = ::memra::kv::v1;

bool RunStepEntry(SessionRegistry& sessions, const pb::StepEntry& entry,
                  absl::FunctionRef<absl::StatusOr<EngineId>()> slot_engine,
                  pb::StepResult* result, StepEntryMode mode) {
  std::optional<SessionOp> op;
  switch (entry.op_case()) {
    case pb::StepEntry::kBegin:
      op = BeginOp{result->mutable_begin()};
      break;
    case pb::StepEntry::kPrepare:
      op = PrepareAppendOp{entry.prepare().generation(), entry.prepare().rows(),
                           result->mutable_prepare()};
      break;
    case pb::StepEntry::kPublish:
      op = PublishAppendOp{entry.publish().generation(), result->mutable_publish()};
      break;
    case pb::StepEntry::kCommit:
      op = CommitOp{entry.commit().generation(), entry.commit().accepted_rows(),
                    SpanOf(entry.commit().token_ids()), result->mutable_commit()};
      break;
    case pb::StepEntry::kAbort:
      op = AbortOp{entry.abort().generation(), result->mutable_abort()};
      break;
    case pb::StepEntry::kAdvance:
      op = AdvanceOp{{entry.advance().generation(), entry.advance().accepted_rows(),
                      entry.advance().next_rows()},
                     SpanOf(entry.advance().token_ids()),
                     result->mutable_advance()};
      break;
    case pb::StepEntry::OP_NOT_SET:
      break;
  }
  bool skipped = false;
  absl::Status status = [&]() -> absl::Status {
    if (entry.has_slot()) {
      ASSIGN_OR_RETURN(EngineId engine, slot_engine());
      const SessionSlot slot{engine, entry.slot()};
      if (op.has_value() && mode.busy == BusySession::kSkip) {
        std::optional<absl::Status> ran = sessions.TryRun(slot, *op);
        skipped = !ran.has_value();
        return ran.value_or(absl::OkStatus());
      }
      if (op.has_value()) return sessions.Run(slot, *op);
      RETURN_IF_ERROR(sessions.Find(slot).status());
      return absl::InvalidArgumentError(
          absl::StrCat("Step entry for slot ", entry.slot(), " names no operation"));
    }
    const SessionCredentials session{SessionId{entry.session().session_id()},
                                     entry.session().session_token()};
    if (op.has_value()) return sessions.Run(session, *op);
    RETURN_IF_ERROR(sessions.Find(session).status());
    return absl::InvalidArgumentError(absl::StrCat(
        "Step entry for session ", entry.session().session_id(), " names no operation"));
  }();
  if (skipped) {
    result->Clear();  // an op may have pointed its reply into it; nothing ran
    return false;
  }
  if (status.ok()) return true;
  result->clear_payload();
  result->set_code(static_cast<int32_t>(status.code()));
  result->set_message(std::string(status.message()));
  if (std::optional<DaemonRestart> restart = GetDaemonRestart(status); restart.has_value()) {
    result->mutable_daemon_restart()->set_previous_epoch(restart->previous_epoch);
    result->mutable_daemon_restart()->set_epoch(restart->epoch);
  }
  if (!mode.log_refusal) return true;
  spdlog::info("Step entry for {} {} refused: {} {}", entry.has_slot() ? "slot" : "session",
               entry.has_slot() ? uint64_t{entry.slot()} : entry.session().session_id(),
               absl::StatusCodeToString(status.code()), std::string(status.message()));
  return true;
}

}  // namespace memra
