#include "server/edge/step_entry.h"

#include <optional>
#include <string>
#include <variant>

#include "absl/strings/str_cat.h"
#include "common/codec.h"
#include "common/daemon_restart.h"
#include "core/status_macros.h"
#include "server/edge/session_wire.h"
#include "spdlog/spdlog.h"

namespace memra {

namespace pb = ::memra::kv::v1;

namespace {

// The operation a Step entry names (nullopt: none).
std::optional<SessionOp> OpOf(const pb::StepEntry& entry) {
  switch (entry.op_case()) {
    case pb::StepEntry::kBegin:
      return BeginOp{};
    case pb::StepEntry::kPrepare:
      return PrepareAppendOp{entry.prepare().generation(), entry.prepare().rows()};
    case pb::StepEntry::kPublish:
      return PublishAppendOp{entry.publish().generation()};
    case pb::StepEntry::kCommit:
      return CommitOp{entry.commit().generation(), entry.commit().accepted_rows(),
                      SpanOf(entry.commit().token_ids())};
    case pb::StepEntry::kAbort:
      return AbortOp{entry.abort().generation()};
    case pb::StepEntry::kAdvance:
      return AdvanceOp{{entry.advance().generation(), entry.advance().accepted_rows(),
                        entry.advance().next_rows()},
                       SpanOf(entry.advance().token_ids())};
    case pb::StepEntry::OP_NOT_SET:
      break;
  }
  return std::nullopt;
}

// An applied entry's result as its StepResult payload (the entry's operation says which).
void PayloadToProto(pb::StepEntry::OpCase op, const SessionResult& result,
                    pb::StepResult* out) {
  switch (op) {
    case pb::StepEntry::kBegin:
      TransactionToProto(std::get<TransactionId>(result), out->mutable_begin());
      break;
    case pb::StepEntry::kPrepare:
      AppendPlanToProto(std::get<AppendPlan>(result), out->mutable_prepare());
      break;
    case pb::StepEntry::kPublish:
      out->mutable_publish()->set_staged_len(std::get<PublishedAppend>(result).staged_len);
      break;
    case pb::StepEntry::kCommit:
      out->mutable_commit()->set_committed_len(std::get<CommittedLength>(result).committed_len);
      break;
    case pb::StepEntry::kAbort:
      out->mutable_abort()->set_committed_len(std::get<CommittedLength>(result).committed_len);
      break;
    case pb::StepEntry::kAdvance:
      AdvancedToProto(std::get<SessionAdvanced>(result), out->mutable_advance());
      break;
    case pb::StepEntry::OP_NOT_SET:
      break;
  }
}

}  // namespace

void RunStepEntry(SessionRegistry& sessions, const pb::StepEntry& entry,
                  absl::FunctionRef<absl::StatusOr<EngineId>()> slot_engine,
                  pb::StepResult* result) {
  const std::optional<SessionOp> op = OpOf(entry);
  absl::StatusOr<SessionResult> outcome = [&]() -> absl::StatusOr<SessionResult> {
    if (entry.has_slot()) {
      ASSIGN_OR_RETURN(EngineId engine, slot_engine());
      const SessionSlot slot{engine, entry.slot()};
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
  if (outcome.ok()) {
    PayloadToProto(entry.op_case(), *outcome, result);
    return;
  }
  const absl::Status& status = outcome.status();
  result->set_code(static_cast<int32_t>(status.code()));
  result->set_message(std::string(status.message()));
  if (std::optional<DaemonRestart> restart = GetDaemonRestart(status); restart.has_value()) {
    result->mutable_daemon_restart()->set_previous_epoch(restart->previous_epoch);
    result->mutable_daemon_restart()->set_epoch(restart->epoch);
  }
  spdlog::info("Step entry for {} {} refused: {} {}", entry.has_slot() ? "slot" : "session",
               entry.has_slot() ? uint64_t{entry.slot()} : entry.session().session_id(),
               absl::StatusCodeToString(status.code()), std::string(status.message()));
}

}  // namespace memra
