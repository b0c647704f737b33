#ifndef MEMRA_SERVER_STEP_ENTRY_H_
#define MEMRA_SERVER_STEP_ENTRY_H_

// One Step RPC entry: decoded from its protobuf into the session operation
// (server/session/session_ops.h), run through SessionRegistry::Run (the one dispatcher), its
// outcome encoded as a pb::StepResult. The step channel (server/edge/step_channel.h) decodes its
// records into the same operations and runs them through the same dispatcher, without protobuf;
// so every rule, refusal code and message is the same on both.
//
// Thread-safety: as SessionRegistry's.

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "proto/memra/kv/v1/cache.pb.h"
#include "server/session/daemon_session.h"
#include "server/session/session_registry.h"

namespace memra {

// Runs `entry` and writes its result (code and message on a refusal, the payload otherwise).
// `slot_engine`: the engine a slot-addressed entry acts for, or why none (called only for such
// entries). A slot-addressed entry whose session a long operation (Grow, a prefix copy) holds
// waits for it: the Step RPC has its own handler thread.
void RunStepEntry(SessionRegistry& sessions, const memra::kv::v1::StepEntry& entry,
                  absl::FunctionRef<absl::StatusOr<EngineId>()> slot_engine,
                  memra::kv::v1::StepResult* result);

}  // namespace memra

#endif  // MEMRA_SERVER_STEP_ENTRY_H_
