#ifndef MEMRA_SERVER_EDGE_SESSION_WIRE_H_
#define MEMRA_SERVER_EDGE_SESSION_WIRE_H_

// Session results (server/session/session_ops.h) as the gRPC wire's messages: the one place a
// session's answer becomes protobuf. The step channel writes its own records instead
// (server/edge/step_channel.h) and never comes here.

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/session.h"
#include "core/transaction.h"
#include "proto/memra/kv/v1/cache.pb.h"
#include "server/session/session_ops.h"

namespace memra {

void TransactionToProto(const TransactionId& transaction, memra::kv::v1::BeginResponse* out);
void AppendPlanToProto(const AppendPlan& plan, memra::kv::v1::PrepareAppendResponse* out);
void AdvancedToProto(const SessionAdvanced& advanced, memra::kv::v1::AdvanceResponse* out);
void SessionStatusToProto(const SessionStatus& status, memra::kv::v1::SessionState* out);
void PlacedLayoutToProto(const PlacedLayout& layout, memra::kv::v1::SessionLayout* out);
// The report's state into `state`, and its layout (when it has one) into `layout` (when set).
void SessionReportToProto(const SessionReport& report, memra::kv::v1::SessionState* state,
                          memra::kv::v1::SessionLayout* layout);

}  // namespace memra

#endif  // MEMRA_SERVER_EDGE_SESSION_WIRE_H_
