#ifndef MEMRA_SERVER_STEP_ENTRY_H_
#define MEMRA_SERVER_STEP_ENTRY_H_

// One Step entry, whichever path carried it: the Step RPC decodes its protobuf into a
// pb::StepEntry, the step channel (server/edge/step_channel.h) decodes a shared-memory record into
// one; both run it here, through SessionRegistry::Run (the one dispatcher), and encode its
// outcome as a pb::StepResult. So every rule, refusal code and message is the same on both.
//
// Thread-safety: as SessionRegistry's.

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "proto/memra/kv/v1/cache.pb.h"
#include "server/session/daemon_session.h"
#include "server/session/session_registry.h"

namespace memra {

// What a slot-addressed entry does when a long operation (Grow, a prefix copy) holds its
// session: wait for it (the Step RPC: its own handler thread), or run nothing and say so (the
// step channel: one thread serves every engine).
enum class BusySession { kWait, kSkip };

struct StepEntryMode {
  BusySession busy = BusySession::kWait;
  // Whether a refusal is logged here (info); the step channel logs its own, rate-limited per
  // engine, since one thread serves them all.
  bool log_refusal = true;
};

// Runs `entry` and writes its result (code and message on a refusal, the payload otherwise).
// `slot_engine`: the engine a slot-addressed entry acts for, or why none (called only for such
// entries). Returns false only with BusySession::kSkip, when the entry's session was busy:
// nothing ran and `result` is left clear.
bool RunStepEntry(SessionRegistry& sessions, const memra::kv::v1::StepEntry& entry,
                  absl::FunctionRef<absl::StatusOr<EngineId>()> slot_engine,
                  memra::kv::v1::StepResult* result, StepEntryMode mode = {});

}  // namespace memra

#endif  // MEMRA_SERVER_STEP_ENTRY_H_
