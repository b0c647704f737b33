// A small engine process for the end-to-end test: attaches to memra-kvd with the client
// library, creates one session of the hybrid test plan, runs the deterministic script
// (tests/e2e/engine_script.h) writing every row through its mapped planes, verifies itself,
// publishes what a checker needs to --out, then holds its lease:
//   --until=FILE   hold until FILE exists, then release the session and exit 0
//   (no --until)   hold until killed
//   --work         while holding, keep running transactions (slot-addressed Advance steps,
//                  over the step channel when offered) and re-verifying
//   --spec         the session has spec snapshot buffers and the script runs speculative rounds
//   --backend=cuda map with CudaArenaMapper and write through CUDA copies on an engine stream
//                  (--device: the ordinal), recording an interprocess event the daemon waits on
//                  before each call (Session::SetWaitEvent); default host
// Exit status 0 = every call and every check succeeded.

#include <unistd.h>

#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/internal.h"
#include "core/status_macros.h"
#include "tests/engine_exit.h"
#include "tests/e2e/engine_device.h"
#include "tests/e2e/engine_script.h"
#include "tests/e2e/facts.h"
#include "tests/e2e/plane_memory.h"
#include "tests/service/test_plans.h"

ABSL_FLAG(std::string, socket, "", "memra-kvd's Unix socket path");
ABSL_FLAG(std::string, name, "test-engine", "engine name shown by the daemon");
ABSL_FLAG(std::string, out, "", "where to write the session facts (key=value lines)");
ABSL_FLAG(std::string, until, "", "hold until this file exists (empty: until killed)");
ABSL_FLAG(bool, work, false, "run transactions and re-verify while holding");
ABSL_FLAG(bool, spec, false, "spec snapshot buffers and speculative rounds");
ABSL_FLAG(std::string, backend, "host", "host or cuda: how arenas are mapped and written");
ABSL_FLAG(int, device, 0, "CUDA ordinal (--backend=cuda)");

namespace memra::testing {
namespace {

absl::Status Verify(Session& session, PlaneMemory& memory, uint8_t recurrent_fill) {
  ASSIGN_OR_RETURN(SessionSnapshot state, session.State());
  return VerifySession(
      session.layout(), state,
      [&](uint32_t layer, PlaneKind kind) { return session.Plane(layer, kind); }, memory,
      recurrent_fill);
}

// The handle is hex: a cuda handle is 64 raw bytes.
absl::Status WriteEngineFacts(const std::string& path, const Session& session,
                              const ScriptResult& result) {
  const std::string token = ClientInternals::Ref(session).session_token();
  return WriteFacts(
      path,
      absl::StrCat("session_id=", session.id(), "\n",
                   "session_token=", absl::BytesToHexString(token), "\n",
                   "committed=", result.committed, "\n",
                   "rebases=", result.rebases, "\n",
                   "rewinds=", result.rewinds, "\n",
                   "spec_rollbacks=", result.spec_rollbacks, "\n",
                   "recurrent_fill=", static_cast<int>(result.recurrent_fill), "\n",
                   "arena_handle_hex=",
                   absl::BytesToHexString(session.layout().arenas[0].handle), "\n"));
}

absl::Status Run() {
  ASSIGN_OR_RETURN(EngineDevice device,
                   OpenEngineDevice(absl::GetFlag(FLAGS_backend), absl::GetFlag(FLAGS_device)));
  PlaneMemory& memory = *device.memory;
  ClientOptions client_options;
  client_options.mapper = device.mapper;
  ASSIGN_OR_RETURN(std::unique_ptr<KvClient> client,
                   KvClient::Connect(absl::GetFlag(FLAGS_socket), client_options));
  RETURN_IF_ERROR(client->Attach(absl::GetFlag(FLAGS_name)));
  ASSIGN_OR_RETURN(PlanFingerprint plan, client->RegisterPlan(HybridTestPlan()));
  SessionOptions options;
  options.capacity = kE2eCapacity;
  options.spec_snapshot = absl::GetFlag(FLAGS_spec);
  ASSIGN_OR_RETURN(std::unique_ptr<Session> session, client->CreateSession(plan, options));
  session->SetWaitEvent(memory.WaitEvent());
  ASSIGN_OR_RETURN(ScriptResult result,
                   RunScript(*session, memory, {.spec_rounds = absl::GetFlag(FLAGS_spec)}));
  RETURN_IF_ERROR(Verify(*session, memory, result.recurrent_fill));
  RETURN_IF_ERROR(WriteEngineFacts(absl::GetFlag(FLAGS_out), *session, result));
  const std::string until = absl::GetFlag(FLAGS_until);
  for (uint64_t round = 0; until.empty() || access(until.c_str(), F_OK) != 0; ++round) {
    if (!client->lease_alive()) return absl::UnavailableError("the daemon ended the lease");
    if (absl::GetFlag(FLAGS_work)) {
      RETURN_IF_ERROR(RunIdleRound(*client, *session, memory, round));
      if (round % 10 == 0) RETURN_IF_ERROR(Verify(*session, memory, result.recurrent_fill));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  RETURN_IF_ERROR(Verify(*session, memory, result.recurrent_fill));
  RETURN_IF_ERROR(session->Release().status());
  return absl::OkStatus();
}

}  // namespace
}  // namespace memra::testing

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return memra::testing::EngineExit("test_engine", absl::GetFlag(FLAGS_name),
                                     memra::testing::Run());
}
