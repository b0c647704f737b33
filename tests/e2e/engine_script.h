#ifndef MEMRA_TESTS_E2E_ENGINE_SCRIPT_H_
#define MEMRA_TESTS_E2E_ENGINE_SCRIPT_H_

// The deterministic workload the end-to-end test engine runs, and the checks any process (the
// engine itself, or the test reading the daemon's view) applies to a session afterwards. Every
// plane byte is written and read through a PlaneMemory, so the same script runs on host and
// cuda planes.
//
// Every byte an engine writes is a pure function of (layer, plane kind, absolute row, byte), so
// a checker knows what each live row must hold without being told: flat K/V and latent rows
// [0, committed), and the sliding layer's resident window (physical row = absolute - ring base).

#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/client.h"
#include "core/sizing.h"
#include "tests/e2e/plane_memory.h"

namespace memra::testing {

inline constexpr uint64_t kE2eCapacity = 6000;  // > the 4671-row SWA ring: the ring wraps

uint8_t PatternByte(uint32_t layer, PlaneKind kind, uint64_t absolute_row, uint64_t byte);

struct ScriptOptions {
  // Every fourth step also runs a speculative round: SpecSnapshot, a draft transaction that
  // overwrites the recurrent state, SpecRollback to part of it, and a check that the daemon put
  // the snapshot's recurrent bytes back. REQUIRES: the session has spec snapshot buffers.
  bool spec_rounds = false;
};

struct ScriptResult {
  uint64_t committed = 0;
  uint64_t rebases = 0;  // ring rebases the engine performed
  uint64_t rewinds = 0;
  uint64_t spec_rollbacks = 0;
  uint8_t recurrent_fill = 0;  // what the recurrent state planes hold at the end
};

// Transactions with partial commits and rewinds until the session is nearly full, writing every
// appended row (performing ring rebase copies) through the mapped planes.
absl::StatusOr<ScriptResult> RunScript(Session& session, PlaneMemory& memory,
                                       const ScriptOptions& options = {});

// One more transaction that commits and rewinds back: the session ends as it began. The
// transaction is two slot-addressed Advance steps through `client` (over the step channel when
// the daemon offers it and the session has no wait event; docs/step-channel.md).
absl::Status RunIdleRound(KvClient& client, Session& session, PlaneMemory& memory,
                          uint64_t round);

using PlaneLookup = std::function<absl::StatusOr<PlaneView>(uint32_t layer, PlaneKind kind)>;

// Checks lengths, mirrors and bytes of a quiescent session against the pattern.
absl::Status VerifySession(const SessionLayout& layout, const SessionSnapshot& state,
                           const PlaneLookup& planes, PlaneMemory& memory, uint8_t recurrent_fill);

// PlaneLookup over a layout whose arenas are mapped at `bases` (one per layout arena).
PlaneLookup LayoutPlanes(const SessionLayout& layout, std::vector<uint8_t*> bases);

}  // namespace memra::testing

#endif  // MEMRA_TESTS_E2E_ENGINE_SCRIPT_H_
