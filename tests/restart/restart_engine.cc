// An engine process for the restart and chaos tests (tests/restart/): attaches, creates
// --sessions sessions of a small dense plan and, until the --until file exists, runs steps on
// each: begin, prepare --rows rows, write those rows' K and V bytes through its own mapping
// (a pattern of --seed, the session and the row), publish, commit. When a call fails because the
// daemon went away it waits for its client to re-attach, reads the session's state and checks
// that the daemon kept what it was told: the committed length is the one last acknowledged (or
// that plus the rows of a commit in flight when the daemon died), and every committed row still
// holds the bytes written. At the end it checks everything once more, releases its sessions and
// writes its facts (tests/e2e/facts.h) to --out. Exit 0 only when every check held.
//
// --expect_restart_error: the daemon is expected to come back without this engine (no service
// manager kept its state): the first failure must be the restart error (client.h
// IsDaemonRestarted), whose epochs go into the facts, and the engine exits 0 then.

#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "core/status_macros.h"
#include "core/test_model_plans.h"
#include "tests/engine_exit.h"
#include "tests/e2e/facts.h"

ABSL_FLAG(std::string, socket, "", "memra-kvd's engine socket");
ABSL_FLAG(std::string, name, "restart-engine", "engine name");
ABSL_FLAG(uint64_t, seed, 1, "pattern seed");
ABSL_FLAG(int, sessions, 2, "sessions");
ABSL_FLAG(int, rows, 4, "rows per step");
ABSL_FLAG(uint64_t, capacity, 2048, "tokens per session");
ABSL_FLAG(std::string, until, "", "run until this file exists");
ABSL_FLAG(std::string, out, "", "facts file");
ABSL_FLAG(std::string, ready, "", "written once the sessions exist and hold rows");
ABSL_FLAG(bool, expect_restart_error, false, "the daemon comes back without this engine");

namespace memra::testing {
namespace {

constexpr PlaneKind kKinds[] = {PlaneKind::kKeys, PlaneKind::kValues};
constexpr uint32_t kLayers = 2;

uint8_t Pattern(uint64_t seed, int session, uint64_t row, uint32_t layer, int kind, uint64_t i) {
  return static_cast<uint8_t>(seed * 131 + session * 31 + row * 7 + layer * 5 + kind * 3 + i);
}

struct Tracked {
  std::unique_ptr<Session> session;
  uint64_t acked = 0;     // the committed length the daemon last acknowledged
  uint64_t inflight = 0;  // rows of a commit sent and not acknowledged
};

absl::Status WriteRows(Tracked& tracked, int index, uint64_t from, uint64_t rows) {
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  for (uint32_t layer = 0; layer < kLayers; ++layer) {
    for (int kind = 0; kind < 2; ++kind) {
      ASSIGN_OR_RETURN(PlaneView plane, tracked.session->Plane(layer, kKinds[kind]));
      for (uint64_t row = from; row < from + rows; ++row) {
        uint8_t* at = plane.data + row * plane.row_bytes;
        for (uint64_t i = 0; i < plane.row_bytes; ++i) {
          at[i] = Pattern(seed, index, row, layer, kind, i);
        }
      }
    }
  }
  return absl::OkStatus();
}

// Every row below `committed` holds its pattern.
absl::Status VerifyRows(const Tracked& tracked, int index, uint64_t committed) {
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  for (uint32_t layer = 0; layer < kLayers; ++layer) {
    for (int kind = 0; kind < 2; ++kind) {
      ASSIGN_OR_RETURN(PlaneView plane, tracked.session->Plane(layer, kKinds[kind]));
      for (uint64_t row = 0; row < committed; ++row) {
        const uint8_t* at = plane.data + row * plane.row_bytes;
        for (uint64_t i = 0; i < plane.row_bytes; ++i) {
          if (at[i] != Pattern(seed, index, row, layer, kind, i)) {
            return absl::DataLossError(absl::StrCat("session ", tracked.session->id(), " layer ",
                                                    layer, " kind ", kind, " row ", row,
                                                    " byte ", i, " differs"));
          }
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Step(Tracked& tracked, int index) {
  const uint64_t rows = absl::GetFlag(FLAGS_rows);
  if (tracked.acked + rows > absl::GetFlag(FLAGS_capacity)) {
    RETURN_IF_ERROR(tracked.session->Reset().status());
    tracked.acked = 0;
  }
  ASSIGN_OR_RETURN(Transaction tx, tracked.session->Begin());
  RETURN_IF_ERROR(tracked.session->PrepareAppend(tx.generation, rows).status());
  RETURN_IF_ERROR(WriteRows(tracked, index, tx.base_len, rows));
  RETURN_IF_ERROR(tracked.session->PublishAppend(tx.generation).status());
  tracked.inflight = rows;
  ASSIGN_OR_RETURN(uint64_t committed, tracked.session->Commit(tx.generation, rows));
  tracked.inflight = 0;
  tracked.acked = committed;
  return absl::OkStatus();
}

// After a failed step: the daemon's view, once it answers again, must be what it acknowledged.
absl::Status Resync(KvClient& client, Tracked& tracked, int index, const absl::Status& failure) {
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (true) {
    if (!client.lease_lost().ok()) return client.lease_lost();
    absl::StatusOr<SessionSnapshot> state = tracked.session->State();
    if (state.ok()) {
      const uint64_t committed = state->committed_len;
      if (committed != tracked.acked && committed != tracked.acked + tracked.inflight) {
        return absl::DataLossError(absl::StrCat(
            "session ", tracked.session->id(), ": the daemon has ", committed,
            " committed rows; acknowledged ", tracked.acked, " (+", tracked.inflight,
            " in flight) before: ", failure.ToString()));
      }
      tracked.acked = committed;
      tracked.inflight = 0;
      return VerifyRows(tracked, index, committed);
    }
    if (IsDaemonRestarted(state.status())) return state.status();
    if (absl::Now() > give_up) {
      return absl::DeadlineExceededError(absl::StrCat("no daemon answered for 30 s after ",
                                                      failure.ToString(), "; last ",
                                                      state.status().ToString()));
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
}

// How long an engine keeps retrying a call the daemon answered UNAVAILABLE (no daemon: it is
// restarting) before it gives up; a daemon restart takes well under a second here.
constexpr absl::Duration kRetryFor = absl::Seconds(30);
constexpr absl::Duration kRetryPeriod = absl::Milliseconds(20);

const absl::Status& StatusOf(const absl::Status& status) { return status; }
template <typename T>
const absl::Status& StatusOf(const absl::StatusOr<T>& result) {
  return result.status();
}

// Runs `call` until it answers anything but UNAVAILABLE (docs/failure-model.md: every call fails
// UNAVAILABLE until the new daemon serves, and an engine retries it), the lease is lost, or
// kRetryFor passes. `retried` counts the UNAVAILABLE answers (a create that failed so may
// still have been applied).
template <typename Call>
auto RetryUnavailable(KvClient* client, Call call, int* retried = nullptr) -> decltype(call()) {
  const absl::Time give_up = absl::Now() + kRetryFor;
  while (true) {
    auto result = call();
    if (result.ok() || StatusOf(result).code() != absl::StatusCode::kUnavailable ||
        absl::Now() > give_up) {
      return result;
    }
    if (client != nullptr && !client->lease_lost().ok()) return client->lease_lost();
    if (retried != nullptr) ++*retried;
    absl::SleepFor(kRetryPeriod);
  }
}

// One step of session `i`, or, when it fails (the daemon died, or is restarting), the resync
// that checks the daemon kept what it acknowledged. `resyncs` counts those.
absl::Status StepOrResync(KvClient& client, Tracked& tracked, int index, uint64_t* steps,
                          uint64_t* resyncs) {
  absl::Status stepped = Step(tracked, index);
  if (stepped.ok()) {
    ++*steps;
    return absl::OkStatus();
  }
  absl::Status resynced = Resync(client, tracked, index, stepped);
  if (absl::GetFlag(FLAGS_expect_restart_error)) {
    const absl::Status& error = IsDaemonRestarted(stepped) ? stepped : resynced;
    std::optional<DaemonRestart> restart = GetDaemonRestart(error);
    if (!restart.has_value()) {
      return absl::InternalError(absl::StrCat("expected the restart error, got ",
                                              stepped.ToString(), " then ", resynced.ToString()));
    }
    return absl::AbortedError(absl::StrCat(
        "restart_error=1\nprevious_epoch=", restart->previous_epoch, "\nepoch=", restart->epoch,
        "\nmessage=", error.message(), "\n"));
  }
  RETURN_IF_ERROR(resynced);
  ++*resyncs;
  return absl::OkStatus();
}

absl::Status Run() {
  ClientOptions options;
  options.deadline = absl::Seconds(5);
  // Set-up may meet a daemon restart too (the chaos test kills the daemon at any time): every
  // call answered UNAVAILABLE is retried, as the contract asks of an engine.
  ASSIGN_OR_RETURN(std::unique_ptr<KvClient> client,
                   RetryUnavailable(nullptr, [&] {
                     return KvClient::Connect(absl::GetFlag(FLAGS_socket), options);
                   }));
  RETURN_IF_ERROR(
      RetryUnavailable(nullptr, [&] { return client->Attach(absl::GetFlag(FLAGS_name)); }));
  const uint64_t first_epoch = client->epoch();
  SessionOptions shape;
  shape.capacity = absl::GetFlag(FLAGS_capacity);
  std::vector<Tracked> sessions(absl::GetFlag(FLAGS_sessions));
  // Creates answered UNAVAILABLE: each may have created a session this engine never learnt of
  // (the daemon died before the reply), which the daemon frees when the engine goes.
  int uncertain_creates = 0;
  for (Tracked& tracked : sessions) {
    while (tracked.session == nullptr) {
      // A restarted daemon keeps only the plans its re-adopted sessions use: register (again)
      // before each create; a create refused NOT_FOUND after a restart registers again.
      ASSIGN_OR_RETURN(PlanFingerprint plan, RetryUnavailable(client.get(), [&] {
                         return client->RegisterPlan(test_plans::DenseModel(kLayers, 64, 2));
                       }));
      const uint64_t registered_at = client->reattaches();
      absl::StatusOr<std::unique_ptr<Session>> created = RetryUnavailable(
          client.get(), [&] { return client->CreateSession(plan, shape); }, &uncertain_creates);
      if (created.ok()) {
        tracked.session = *std::move(created);
      } else if (created.status().code() != absl::StatusCode::kNotFound ||
                 client->reattaches() == registered_at) {
        return created.status();
      }
    }
  }
  uint64_t steps = 0;
  uint64_t resyncs = 0;
  auto ended = [first_epoch](const absl::Status& status) -> absl::Status {
    // The restart error an engine was told to expect ends it with its facts.
    if (status.code() == absl::StatusCode::kAborted && absl::GetFlag(FLAGS_expect_restart_error)) {
      return WriteFacts(absl::GetFlag(FLAGS_out),
                        absl::StrCat(status.message(), "first_epoch=", first_epoch, "\n"));
    }
    return status;
  };
  for (size_t i = 0; i < sessions.size(); ++i) {
    while (sessions[i].acked == 0) {
      if (absl::Status status = StepOrResync(*client, sessions[i], i, &steps, &resyncs);
          !status.ok()) {
        return ended(status);
      }
    }
  }
  std::string ready = absl::StrCat("epoch=", first_epoch, "\nengine_id=", client->engine_id(),
                                   "\nuncertain_creates=", uncertain_creates, "\n");
  RETURN_IF_ERROR(WriteFacts(absl::GetFlag(FLAGS_ready), ready));
  const std::string until = absl::GetFlag(FLAGS_until);
  while (until.empty() || access(until.c_str(), F_OK) != 0) {
    for (size_t i = 0; i < sessions.size(); ++i) {
      if (absl::Status status = StepOrResync(*client, sessions[i], i, &steps, &resyncs);
          !status.ok()) {
        return ended(status);
      }
    }
    absl::SleepFor(absl::Milliseconds(2));
  }
  uint64_t rows = 0;
  for (size_t i = 0; i < sessions.size(); ++i) {
    ASSIGN_OR_RETURN(SessionSnapshot state, sessions[i].session->State());
    if (state.committed_len != sessions[i].acked) {
      return absl::DataLossError(absl::StrCat("session ", sessions[i].session->id(), " has ",
                                              state.committed_len, " rows; acknowledged ",
                                              sessions[i].acked));
    }
    RETURN_IF_ERROR(VerifyRows(sessions[i], i, state.committed_len));
    rows += state.committed_len;
  }
  for (Tracked& tracked : sessions) RETURN_IF_ERROR(tracked.session->Release().status());
  return WriteFacts(absl::GetFlag(FLAGS_out),
                    absl::StrCat("ok=1\nsteps=", steps, "\nresyncs=", resyncs, "\nrows=", rows,
                                 "\nreattaches=", client->reattaches(), "\nfirst_epoch=",
                                 first_epoch, "\nepoch=", client->epoch(), "\n"));
}

}  // namespace
}  // namespace memra::testing

int main(int argc, char** argv) {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  absl::ParseCommandLine(argc, argv);
  return memra::testing::EngineExit("restart_engine", absl::GetFlag(FLAGS_name),
                                     memra::testing::Run());
}
