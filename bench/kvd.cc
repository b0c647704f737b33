#include "bench/kvd.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/internal.h"
#include "common/grpc_status.h"
#include "core/status_macros.h"

namespace memra::bench {

namespace pb = ::memra::kv::v1;

absl::StatusOr<DaemonConfig> BenchDaemonConfig(const std::vector<std::string>& extra_flags) {
  DaemonConfig config;
  for (const std::string& flag : extra_flags) {
    const size_t equals = flag.find('=');
    if (!absl::StartsWith(flag, "--") || equals == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("bench daemon flag \"", flag, "\" is not --key=value"));
    }
    RETURN_IF_ERROR(ApplyOverride(config, flag.substr(2, equals - 2), flag.substr(equals + 1)));
  }
  return config;
}

absl::StatusOr<std::unique_ptr<Kvd>> Kvd::Start(const BenchOptions& options,
                                                uint64_t budget_bytes,
                                                const std::vector<std::string>& extra_flags) {
  ASSIGN_OR_RETURN(TempDir dir, TempDir::Create("memra-bench"));
  const std::string socket_path = dir.File("kvd.sock");
  const std::string admin_socket_path = dir.File("kvd.admin.sock");
  std::vector<std::string> argv = {options.kvd_binary,
                                   "--backend=host",
                                   "--socket_path=" + socket_path,
                                   "--admin_socket_path=" + admin_socket_path,
                                   absl::StrCat("--budget_bytes=", budget_bytes),
                                   "--socket_mode=0600",
                                   "--watchdog=false",
                                   "--metrics_address=",
                                   "--drain_grace_ms=1000"};
  argv.insert(argv.end(), extra_flags.begin(), extra_flags.end());
  ASSIGN_OR_RETURN(ChildProcess process, ChildProcess::Spawn(argv, dir.File("daemon.log")));
  for (const std::string& path : {socket_path, admin_socket_path}) {
    if (absl::Status up = WaitForPath(path, process, absl::Seconds(30)); !up.ok()) {
      return absl::UnavailableError(absl::StrCat("memra-kvd did not start (", up.message(),
                                                 "); see ", dir.File("daemon.log")));
    }
  }
  return std::unique_ptr<Kvd>(
      new Kvd(std::move(dir), socket_path, admin_socket_path, std::move(process)));
}

absl::StatusOr<std::unique_ptr<KvClient>> Kvd::Attach(const std::string& engine_name) const {
  ASSIGN_OR_RETURN(std::unique_ptr<KvClient> client, KvClient::Connect(socket_path_));
  RETURN_IF_ERROR(client->Attach(engine_name));
  return client;
}

int Kvd::Stop() { return process_.Stop(absl::Seconds(30)); }

absl::StatusOr<std::vector<std::unique_ptr<Session>>> CreateSessions(
    KvClient& client, const PlanFingerprint& plan, const SessionOptions& options, size_t count) {
  std::vector<std::unique_ptr<Session>> sessions;
  sessions.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    ASSIGN_OR_RETURN(std::unique_ptr<Session> session, client.CreateSession(plan, options));
    sessions.push_back(std::move(session));
  }
  return sessions;
}

absl::StatusOr<std::unique_ptr<DecodeStepper>> DecodeStepper::Create(
    KvClient& client, std::vector<Session*> sessions, uint64_t accepted_rows, StepForm form,
    StepAddressing addressing) {
  std::unique_ptr<DecodeStepper> stepper(
      new DecodeStepper(client, std::move(sessions), accepted_rows, form, addressing));
  for (size_t i = 0; i < stepper->sessions_.size(); ++i) {
    ASSIGN_OR_RETURN(SessionSnapshot state, stepper->sessions_[i]->State());
    if (state.active_generation != 0) {
      return absl::FailedPreconditionError(absl::StrCat("session ", stepper->sessions_[i]->id(),
                                                        " has transaction ",
                                                        state.active_generation, " open"));
    }
    stepper->next_generation_[i] = state.next_generation;
    stepper->committed_[i] = state.committed_len;
  }
  return stepper;
}

DecodeStepper::DecodeStepper(KvClient& client, std::vector<Session*> sessions,
                             uint64_t accepted_rows, StepForm form, StepAddressing addressing)
    : client_(client),
      sessions_(std::move(sessions)),
      accepted_rows_(accepted_rows),
      form_(form),
      next_generation_(sessions_.size(), 1),
      open_generation_(sessions_.size(), 0),
      committed_(sessions_.size(), 0),
      batch_(addressing) {}

void DecodeStepper::Build() {
  batch_.Clear();
  for (size_t i = 0; i < sessions_.size(); ++i) {
    const Session& session = *sessions_[i];
    if (form_ == StepForm::kAdvance) {
      const uint64_t open = open_generation_[i];
      batch_.Advance(session, open, open == 0 ? 0 : accepted_rows_, 1);
      continue;
    }
    const uint64_t generation = next_generation_[i];
    batch_.Begin(session);
    batch_.Prepare(session, generation, 1);
    batch_.Publish(session, generation);
    batch_.Commit(session, generation, accepted_rows_);
  }
}

absl::Status DecodeStepper::CheckAdvance(const std::vector<StepOutcome>& outcomes) {
  if (outcomes.size() != sessions_.size()) {
    return absl::InternalError(
        absl::StrCat("Step answered ", outcomes.size(), " of ", sessions_.size()));
  }
  for (size_t i = 0; i < sessions_.size(); ++i) {
    const StepOutcome& outcome = outcomes[i];
    const uint64_t committed = committed_[i] + (open_generation_[i] == 0 ? 0 : accepted_rows_);
    if (!outcome.status.ok() || outcome.committed_len != committed ||
        !outcome.prepared.has_value() || outcome.prepared->target != committed + 1 ||
        outcome.begun.generation != next_generation_[i]) {
      return absl::InternalError(absl::StrCat(
          "session ", sessions_[i]->id(), ": advance answered ", outcome.status.ToString(),
          ", committed ", outcome.committed_len, ", generation ", outcome.begun.generation,
          "; expected committed ", committed, ", generation ", next_generation_[i]));
    }
    open_generation_[i] = next_generation_[i]++;
    committed_[i] = committed;
  }
  return absl::OkStatus();
}

absl::Status DecodeStepper::Check(const std::vector<StepOutcome>& outcomes) {
  if (form_ == StepForm::kAdvance) return CheckAdvance(outcomes);
  if (outcomes.size() != 4 * sessions_.size()) {
    return absl::InternalError(
        absl::StrCat("Step answered ", outcomes.size(), " of ", 4 * sessions_.size()));
  }
  for (size_t i = 0; i < sessions_.size(); ++i) {
    const StepOutcome* entry = &outcomes[4 * i];
    for (int op = 0; op < 4; ++op) {
      if (!entry[op].status.ok()) {
        return absl::InternalError(absl::StrCat("session ", sessions_[i]->id(), " op ", op,
                                                ": ", entry[op].status.ToString()));
      }
    }
    const uint64_t staged = committed_[i] + 1;
    const uint64_t committed = committed_[i] + accepted_rows_;
    if (entry[0].begun.generation != next_generation_[i] || !entry[1].prepared.has_value() ||
        entry[1].prepared->target != staged || entry[2].staged_len != staged ||
        entry[3].committed_len != committed) {
      return absl::InternalError(absl::StrCat(
          "session ", sessions_[i]->id(), ": step answered generation ", entry[0].begun.generation,
          ", staged ", entry[2].staged_len, ", committed ", entry[3].committed_len, "; expected ",
          next_generation_[i], ", ", staged, ", ", committed));
    }
    ++next_generation_[i];
    committed_[i] = committed;
  }
  return absl::OkStatus();
}

absl::Status DecodeStepper::Step() {
  Build();
  RETURN_IF_ERROR(client_.Step(batch_, outcomes_));
  return Check(outcomes_);
}

absl::Status DecodeStepper::StepMeasuringSizes(uint64_t* request_bytes,
                                               uint64_t* response_bytes) {
  Build();
  pb::StepRequest request = ClientInternals::Request(batch_);
  ASSIGN_OR_RETURN(*request.mutable_engine(), ClientInternals::Engine(client_));
  pb::StepResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(ClientInternals::Cache(client_).Step(
      ClientInternals::NewContext(client_).get(), request, &response)));
  *request_bytes = request.ByteSizeLong();
  *response_bytes = response.ByteSizeLong();
  if (form_ == StepForm::kAdvance) {
    if (static_cast<size_t>(response.results_size()) != sessions_.size()) {
      return absl::InternalError(
          absl::StrCat("Step answered ", response.results_size(), " of ", sessions_.size()));
    }
    for (size_t i = 0; i < sessions_.size(); ++i) {
      const pb::StepResult& advance = response.results(static_cast<int>(i));
      if (advance.code() != 0) {
        return absl::InternalError(absl::StrCat("session ", sessions_[i]->id(),
                                                ": size-probe step failed: ", advance.message()));
      }
      committed_[i] = advance.advance().committed_len();
      open_generation_[i] = next_generation_[i]++;
    }
    return absl::OkStatus();
  }
  if (static_cast<size_t>(response.results_size()) != 4 * sessions_.size()) {
    return absl::InternalError(
        absl::StrCat("Step answered ", response.results_size(), " of ", 4 * sessions_.size()));
  }
  // The sizes came from the raw call; the checks run on the step the client itself sends.
  for (size_t i = 0; i < sessions_.size(); ++i) {
    const pb::StepResult& commit = response.results(static_cast<int>(4 * i + 3));
    if (commit.code() != 0 || commit.commit().committed_len() != committed_[i] + accepted_rows_) {
      return absl::InternalError(absl::StrCat("session ", sessions_[i]->id(),
                                              ": size-probe step failed: ", commit.message()));
    }
    ++next_generation_[i];
    committed_[i] += accepted_rows_;
  }
  return absl::OkStatus();
}

absl::Status DecodeStepper::ResetAll() {
  for (size_t i = 0; i < sessions_.size(); ++i) {
    ASSIGN_OR_RETURN(SessionSnapshot reset, sessions_[i]->Reset());
    // Another stepper may have used the session since: the daemon's count is the truth.
    next_generation_[i] = reset.next_generation;
    open_generation_[i] = 0;
    committed_[i] = 0;
  }
  return absl::OkStatus();
}

}  // namespace memra::bench
