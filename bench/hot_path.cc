// Section 1: the transaction hot path. One decode step for N sessions (Begin, PrepareAppend of
// one row, PublishAppend, Commit of it) as one batched Step RPC to the real memra-kvd, against
// two baselines measured in the same rounds:
//   floor:   gRPC alone: a unary call with the Step's serialized request and response sizes to
//            a synchronous gRPC server in another process on a Unix socket (bench/echo.proto);
//   core:    the same four operations on core's SessionState in this process.
// The three run interleaved round by round (daemon, floor, core), so a neighbour's load on this
// shared machine falls on all three alike; ratios are the result.

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "bench/echo_floor.h"
#include "bench/harness.h"
#include "bench/kvd.h"
#include "bench/sections.h"
#include "core/admission.h"
#include "core/session.h"
#include "core/sizing.h"
#include "core/status_macros.h"
#include "core/test_model_plans.h"

namespace memra::bench {
namespace {

// Llama-3-8B's 32 K/V layers: each Prepare answers one write plan per layer, as a real engine's.
// A small capacity keeps 256 sessions' shared memory small; rounds reset the sessions.
constexpr uint64_t kCapacity = 128;
constexpr int kStepsPerRound = 100;  // < kCapacity: one row committed per step
constexpr size_t kMaxSessions = 256;

struct Shape {
  size_t sessions;
  int rounds;  // timed rounds; one warm-up round more runs first
};
constexpr Shape kShapes[] = {{1, 20}, {8, 15}, {64, 6}, {256, 3}};

// The in-process baseline: what DaemonSession runs under its lock, minus the daemon.
class CoreSessions {
 public:
  static absl::StatusOr<CoreSessions> Create(const SessionPlan& plan, size_t count) {
    CoreSessions core;
    for (size_t i = 0; i < count; ++i) {
      ASSIGN_OR_RETURN(SessionState state, SessionState::Create(i + 1, plan, kCapacity));
      core.states_.push_back(std::move(state));
    }
    core.open_.assign(count, 0);
    return core;
  }

  absl::Status Step(size_t count) {
    for (size_t i = 0; i < count; ++i) {
      SessionState& state = states_[i];
      ASSIGN_OR_RETURN(TransactionId transaction, state.Begin());
      ASSIGN_OR_RETURN(AppendPlan plan, state.PrepareAppend(transaction.generation, 1));
      KeepAlive(plan.layers.data());
      RETURN_IF_ERROR(state.PublishAppend(transaction.generation));
      ASSIGN_OR_RETURN(uint64_t committed, state.Commit(transaction.generation, 1));
      KeepAlive(committed);
    }
    return absl::OkStatus();
  }

  // The same step as one Advance per session (commit 1 row, prepare the next).
  absl::Status Advance(size_t count) {
    for (size_t i = 0; i < count; ++i) {
      ASSIGN_OR_RETURN(AdvanceResult result,
                       states_[i].Advance({open_[i], open_[i] == 0 ? 0u : 1u, 1}));
      KeepAlive(result.prepared->layers.data());
      open_[i] = result.begun->generation;
    }
    return absl::OkStatus();
  }

  absl::Status ResetAll(size_t count) {
    for (size_t i = 0; i < count; ++i) {
      RETURN_IF_ERROR(states_[i].Reset());
      open_[i] = 0;
    }
    return absl::OkStatus();
  }

 private:
  std::vector<SessionState> states_;
  std::vector<uint64_t> open_;  // per session: the generation its Advance left open (0: none)
};

// Runs `body` `steps` times, adding each call's time to `samples` when `record`.
template <typename Body>
absl::Status Time(int steps, bool record, Samples& samples, Body body) {
  for (int k = 0; k < steps; ++k) {
    const int64_t start = NowNs();
    RETURN_IF_ERROR(body());
    if (record) samples.Add(static_cast<double>(NowNs() - start));
  }
  return absl::OkStatus();
}

// CPU time of the server process over the timed steps (clock-tick accounting: meaningful summed
// over many rounds).
// The calling thread's CPU time is exact (it builds, serializes, sends and parses each call).
struct CpuTime {
  uint64_t server_ns = 0;
  uint64_t client_thread_ns = 0;
  uint64_t steps = 0;
  double ServerNsPerStep() const { return steps ? static_cast<double>(server_ns) / steps : 0; }
  double ClientNsPerStep() const {
    return steps ? static_cast<double>(client_thread_ns) / steps : 0;
  }
};

// Time() of `steps` calls, also charging the server's CPU time to `cpu` when `record`.
template <typename Body>
absl::Status TimeWithCpu(pid_t server, int steps, bool record, Samples& samples, CpuTime& cpu,
                         Body body) {
  ASSIGN_OR_RETURN(uint64_t before, ProcessCpuNs(server));
  const int64_t thread_before = ThreadCpuNs();
  RETURN_IF_ERROR(Time(steps, record, samples, body));
  const int64_t thread_after = ThreadCpuNs();
  ASSIGN_OR_RETURN(uint64_t after, ProcessCpuNs(server));
  if (record) {
    cpu.server_ns += after - before;
    cpu.client_thread_ns += thread_after - thread_before;
    cpu.steps += steps;
  }
  return absl::OkStatus();
}

struct Measured {
  size_t sessions = 0;
  // advance: the daemon, one Advance entry per session; core_advance: Advance in process
  Samples daemon, advance, floor, core, core_advance;
  CpuTime daemon_cpu, advance_cpu, floor_cpu;
  uint64_t request_bytes = 0, response_bytes = 0;
  uint64_t floor_request_bytes = 0, floor_response_bytes = 0;
};

// The bytes the host backend charges one bench session of `model`.
absl::StatusOr<uint64_t> BenchSessionBytes(const ModelPlan& model) {
  SessionShape request;
  request.capacity = kCapacity;
  return SessionArenaBytes(model, FormatDefaults(), request,
                           {.granularity = static_cast<uint64_t>(getpagesize())});
}

}  // namespace

absl::StatusOr<Json> RunHotPath(const BenchOptions& options) {
  const ModelPlan model = test_plans::Llama3_8B();
  SessionShape request;
  request.capacity = kCapacity;
  ASSIGN_OR_RETURN(SessionPlan session_plan, PlanSession(model, FormatDefaults(), request));
  ASSIGN_OR_RETURN(uint64_t session_bytes, BenchSessionBytes(model));

  ASSIGN_OR_RETURN(std::unique_ptr<Kvd> kvd,
                   Kvd::Start(options, kMaxSessions * session_bytes + (64 << 20)));
  ASSIGN_OR_RETURN(std::unique_ptr<KvClient> client, kvd->Attach("bench-hot-path"));
  ASSIGN_OR_RETURN(PlanFingerprint fingerprint, client->RegisterPlan(model));
  SessionOptions session_options;
  session_options.capacity = kCapacity;
  ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Session>> sessions,
                   CreateSessions(*client, fingerprint, session_options, kMaxSessions));
  ASSIGN_OR_RETURN(std::unique_ptr<EchoFloor> floor, EchoFloor::Start(options.echo_binary));
  ASSIGN_OR_RETURN(CoreSessions core, CoreSessions::Create(session_plan, kMaxSessions));

  const int steps = options.quick ? 3 : kStepsPerRound;
  std::vector<Measured> results;
  for (const Shape& shape : kShapes) {
    Measured m;
    m.sessions = shape.sessions;
    std::vector<Session*> batch;
    for (size_t i = 0; i < shape.sessions; ++i) batch.push_back(sessions[i].get());
    ASSIGN_OR_RETURN(std::unique_ptr<DecodeStepper> stepper,
                     DecodeStepper::Create(*client, batch, /*accepted_rows=*/1));
    ASSIGN_OR_RETURN(std::unique_ptr<DecodeStepper> advancer,
                     DecodeStepper::Create(*client, batch, /*accepted_rows=*/1,
                                           StepForm::kAdvance));
    const int rounds = options.quick ? 1 : shape.rounds;
    for (int round = 0; round <= rounds; ++round) {
      const bool record = round > 0;  // round 0 warms up
      RETURN_IF_ERROR(stepper->ResetAll());
      RETURN_IF_ERROR(core.ResetAll(shape.sessions));
      if (round == 0) {
        RETURN_IF_ERROR(stepper->StepMeasuringSizes(&m.request_bytes, &m.response_bytes));
        std::tie(m.floor_request_bytes, m.floor_response_bytes) =
            floor->Size(m.request_bytes, m.response_bytes);
      }
      RETURN_IF_ERROR(TimeWithCpu(kvd->pid(), steps, record, m.daemon, m.daemon_cpu,
                                  [&] { return stepper->Step(); }));
      RETURN_IF_ERROR(advancer->ResetAll());
      RETURN_IF_ERROR(TimeWithCpu(kvd->pid(), steps, record, m.advance, m.advance_cpu,
                                  [&] { return advancer->Step(); }));
      RETURN_IF_ERROR(TimeWithCpu(floor->pid(), steps, record, m.floor, m.floor_cpu,
                                  [&] { return floor->Call(); }));
      RETURN_IF_ERROR(Time(steps, record, m.core, [&] { return core.Step(shape.sessions); }));
      RETURN_IF_ERROR(core.ResetAll(shape.sessions));
      RETURN_IF_ERROR(
          Time(steps, record, m.core_advance, [&] { return core.Advance(shape.sessions); }));
    }
    RETURN_IF_ERROR(advancer->ResetAll());  // no transaction left open for the next shape
    results.push_back(std::move(m));
  }
  // Detach before the daemon drains: it then has no live session to wait for.
  sessions.clear();
  client.reset();

  Json json;
  json["model"] = "llama-3-8b (32 K/V layers)";
  json["capacity_tokens"] = kCapacity;
  json["operations_per_session"] = "Begin, PrepareAppend(1 row), PublishAppend, Commit(1 row)";
  json["steps_per_round"] = steps;
  Table table({"N", "daemon p50", "p99", "floor p50", "p99", "core p50", "daemon/floor",
               "daemon/core", "per-session p50", "kvd cpu", "client cpu", "echo cpu",
               "echo client cpu", "req B", "resp B"});
  Json rows = Json::array();
  for (const Measured& m : results) {
    const double n = static_cast<double>(m.sessions);
    rows.push_back(Json{
        {"sessions", m.sessions},
        {"daemon_step", m.daemon.ToJson()},
        {"advance_step", m.advance.ToJson()},
        {"advance_cpu_us_per_step", m.advance_cpu.ServerNsPerStep() / 1e3},
        {"ratio_advance_separate_p50", m.advance.P50() / m.daemon.P50()},
        {"ratio_advance_floor_p50", m.advance.P50() / m.floor.P50()},
        {"core_advance_step", m.core_advance.ToJson()},
        {"ratio_core_advance_core_p50", m.core_advance.P50() / m.core.P50()},
        {"daemon_per_session", m.daemon.ToJson(n)},
        {"floor_step", m.floor.ToJson()},
        {"daemon_cpu_us_per_step", m.daemon_cpu.ServerNsPerStep() / 1e3},
        {"daemon_client_thread_cpu_us_per_step", m.daemon_cpu.ClientNsPerStep() / 1e3},
        {"floor_server_cpu_us_per_step", m.floor_cpu.ServerNsPerStep() / 1e3},
        {"floor_client_thread_cpu_us_per_step", m.floor_cpu.ClientNsPerStep() / 1e3},
        {"core_step", m.core.ToJson()},
        {"core_per_session", m.core.ToJson(n)},
        {"ratio_daemon_floor_p50", m.daemon.P50() / m.floor.P50()},
        {"ratio_daemon_floor_p99", m.daemon.P99() / m.floor.P99()},
        {"ratio_daemon_core_p50", m.daemon.P50() / m.core.P50()},
        {"overhead_over_floor_p50_us", (m.daemon.P50() - m.floor.P50()) / 1e3},
        {"step_request_bytes", m.request_bytes},
        {"step_response_bytes", m.response_bytes},
        {"floor_request_bytes", m.floor_request_bytes},
        {"floor_response_bytes", m.floor_response_bytes},
    });
    table.Add({absl::StrCat(m.sessions), Us(m.daemon.P50()), Us(m.daemon.P99()),
               Us(m.floor.P50()), Us(m.floor.P99()), Us(m.core.P50()),
               Ratio(m.daemon.P50() / m.floor.P50()), Ratio(m.daemon.P50() / m.core.P50()),
               Us(m.daemon.P50() / n),
               Us(m.daemon_cpu.ServerNsPerStep()), Us(m.daemon_cpu.ClientNsPerStep()),
               Us(m.floor_cpu.ServerNsPerStep()), Us(m.floor_cpu.ClientNsPerStep()),
               absl::StrCat(m.request_bytes),
               absl::StrCat(m.response_bytes)});
  }
  json["by_sessions"] = rows;
  Table advance_table({"N", "advance p50", "p99", "4 entries p50", "advance/4 entries",
                       "advance/floor", "per-session p50", "kvd cpu", "core advance p50",
                       "core advance/core 4 ops"});
  for (const Measured& m : results) {
    advance_table.Add({absl::StrCat(m.sessions), Us(m.advance.P50()), Us(m.advance.P99()),
                       Us(m.daemon.P50()), Ratio(m.advance.P50() / m.daemon.P50()),
                       Ratio(m.advance.P50() / m.floor.P50()),
                       Us(m.advance.P50() / static_cast<double>(m.sessions)),
                       Us(m.advance_cpu.ServerNsPerStep()), Us(m.core_advance.P50()),
                       Ratio(m.core_advance.P50() / m.core.P50())});
  }

  // Marginal cost of one more session in the batch, from the ends of the sweep.
  const Measured& one = results.front();
  const Measured& most = results.back();
  const double extra = static_cast<double>(most.sessions - one.sessions);
  auto marginal = [&](const Samples Measured::*field) {
    return ((most.*field).P50() - (one.*field).P50()) / extra;
  };
  const double daemon_marginal = marginal(&Measured::daemon);
  const double ratio_at_one = one.daemon.P50() / one.floor.P50();
  json["marginal_per_session_p50_us"] = Json{{"daemon", daemon_marginal / 1e3},
                                             {"floor", marginal(&Measured::floor) / 1e3},
                                             {"core", marginal(&Measured::core) / 1e3}};
  json["targets"] = Json{
      {"step_within_1_5x_floor_at_n1", Json{{"ratio", ratio_at_one}, {"met", ratio_at_one <= 1.5}}},
      {"marginal_under_2us_at_n256",
       Json{{"us", daemon_marginal / 1e3}, {"met", daemon_marginal <= 2000}}}};

  table.Print("1. decode step: Begin+Prepare+Publish+Commit per session, one Step RPC "
              "(times in us)");
  std::printf("marginal per extra session (p50, N=%zu..%zu): daemon %s us, floor %s us, core %s us\n",
              one.sessions, most.sessions, Us(daemon_marginal).c_str(),
              Us(marginal(&Measured::floor)).c_str(), Us(marginal(&Measured::core)).c_str());
  advance_table.Print("1b. the same decode step as ONE Advance entry per session, one Step RPC "
                      "(times in us)");
  const double advance_marginal = marginal(&Measured::advance);
  json["marginal_per_session_p50_us"]["advance"] = advance_marginal / 1e3;
  json["marginal_per_session_p50_us"]["core_advance"] = marginal(&Measured::core_advance) / 1e3;
  std::printf("marginal per extra session with Advance (p50): %s us (core in process: %s us)\n",
              Us(advance_marginal).c_str(), Us(marginal(&Measured::core_advance)).c_str());
  std::printf("target: daemon/floor at N=1 <= 1.5x: %s (%s); marginal < 2 us: %s (%s us)\n",
              ratio_at_one <= 1.5 ? "MET" : "MISSED", Ratio(ratio_at_one).c_str(),
              daemon_marginal <= 2000 ? "MET" : "MISSED", Us(daemon_marginal).c_str());
  return json;
}

absl::StatusOr<Json> RunStepChannel(const BenchOptions& options) {
  const ModelPlan model = test_plans::Llama3_8B();
  ASSIGN_OR_RETURN(uint64_t session_bytes, BenchSessionBytes(model));
  ASSIGN_OR_RETURN(std::unique_ptr<Kvd> kvd,
                   Kvd::Start(options, 2 * kMaxSessions * session_bytes + (64 << 20)));
  // Two engines of one daemon: one steps over its channel, one over gRPC (forced).
  ASSIGN_OR_RETURN(std::unique_ptr<KvClient> channel_client, kvd->Attach("bench-channel"));
  if (!channel_client->step_channel_active()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the daemon offered no step channel: ", channel_client->step_channel_status().ToString()));
  }
  ClientOptions grpc_options;
  grpc_options.force_grpc_step = true;
  ASSIGN_OR_RETURN(std::unique_ptr<KvClient> grpc_client,
                   KvClient::Connect(kvd->socket_path(), grpc_options));
  RETURN_IF_ERROR(grpc_client->Attach("bench-grpc"));
  SessionOptions session_options;
  session_options.capacity = kCapacity;
  ASSIGN_OR_RETURN(PlanFingerprint channel_plan, channel_client->RegisterPlan(model));
  ASSIGN_OR_RETURN(PlanFingerprint grpc_plan, grpc_client->RegisterPlan(model));
  ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Session>> channel_sessions,
                   CreateSessions(*channel_client, channel_plan, session_options, kMaxSessions));
  ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Session>> grpc_sessions,
                   CreateSessions(*grpc_client, grpc_plan, session_options, kMaxSessions));
  ASSIGN_OR_RETURN(std::unique_ptr<EchoFloor> floor, EchoFloor::Start(options.echo_binary));
  // The in-process baseline of the same step: core's Advance on each session, in this process.
  SessionShape request;
  request.capacity = kCapacity;
  ASSIGN_OR_RETURN(SessionPlan session_plan, PlanSession(model, FormatDefaults(), request));
  ASSIGN_OR_RETURN(CoreSessions core, CoreSessions::Create(session_plan, kMaxSessions));

  struct ChannelMeasured {
    size_t sessions = 0;
    Samples channel, grpc, floor, core_advance;
    CpuTime channel_cpu, grpc_cpu, floor_cpu;
    uint64_t request_bytes = 0, response_bytes = 0;
  };
  const int steps = options.quick ? 3 : kStepsPerRound;
  std::vector<ChannelMeasured> results;
  for (const Shape& shape : kShapes) {
    ChannelMeasured m;
    m.sessions = shape.sessions;
    std::vector<Session*> over_channel;
    std::vector<Session*> over_grpc;
    for (size_t i = 0; i < shape.sessions; ++i) {
      over_channel.push_back(channel_sessions[i].get());
      over_grpc.push_back(grpc_sessions[i].get());
    }
    ASSIGN_OR_RETURN(std::unique_ptr<DecodeStepper> channel_stepper,
                     DecodeStepper::Create(*channel_client, over_channel, 1, StepForm::kAdvance,
                                           StepAddressing::kSlot));
    ASSIGN_OR_RETURN(std::unique_ptr<DecodeStepper> grpc_stepper,
                     DecodeStepper::Create(*grpc_client, over_grpc, 1, StepForm::kAdvance,
                                           StepAddressing::kSlot));
    const int rounds = options.quick ? 1 : shape.rounds;
    for (int round = 0; round <= rounds; ++round) {
      const bool record = round > 0;  // round 0 warms up
      RETURN_IF_ERROR(channel_stepper->ResetAll());
      RETURN_IF_ERROR(grpc_stepper->ResetAll());
      if (round == 0) {
        // The floor carries what the gRPC Advance step carries.
        RETURN_IF_ERROR(grpc_stepper->StepMeasuringSizes(&m.request_bytes, &m.response_bytes));
        (void)floor->Size(m.request_bytes, m.response_bytes);
      }
      RETURN_IF_ERROR(TimeWithCpu(kvd->pid(), steps, record, m.channel, m.channel_cpu,
                                  [&] { return channel_stepper->Step(); }));
      RETURN_IF_ERROR(TimeWithCpu(kvd->pid(), steps, record, m.grpc, m.grpc_cpu,
                                  [&] { return grpc_stepper->Step(); }));
      RETURN_IF_ERROR(TimeWithCpu(floor->pid(), steps, record, m.floor, m.floor_cpu,
                                  [&] { return floor->Call(); }));
      RETURN_IF_ERROR(core.ResetAll(shape.sessions));
      RETURN_IF_ERROR(
          Time(steps, record, m.core_advance, [&] { return core.Advance(shape.sessions); }));
    }
    RETURN_IF_ERROR(channel_stepper->ResetAll());
    RETURN_IF_ERROR(grpc_stepper->ResetAll());
    results.push_back(std::move(m));
  }
  channel_sessions.clear();
  grpc_sessions.clear();
  channel_client.reset();
  grpc_client.reset();

  Json json;
  json["model"] = "llama-3-8b (32 K/V layers)";
  json["step"] = "one Advance entry per session, addressed by slot";
  json["steps_per_round"] = steps;
  Table table({"N", "channel p50", "p99", "gRPC p50", "floor p50", "core advance p50",
               "channel/floor", "channel/gRPC", "per-session p50", "kvd cpu/session",
               "gRPC kvd cpu/session"});
  Json rows = Json::array();
  for (const ChannelMeasured& m : results) {
    const double n = static_cast<double>(m.sessions);
    rows.push_back(Json{
        {"sessions", m.sessions},
        {"channel_step", m.channel.ToJson()},
        {"grpc_step", m.grpc.ToJson()},
        {"floor_step", m.floor.ToJson()},
        {"core_advance_step", m.core_advance.ToJson()},
        {"ratio_channel_floor_p50", m.channel.P50() / m.floor.P50()},
        {"ratio_channel_grpc_p50", m.channel.P50() / m.grpc.P50()},
        {"channel_per_session", m.channel.ToJson(n)},
        {"channel_daemon_cpu_us_per_session", m.channel_cpu.ServerNsPerStep() / n / 1e3},
        {"grpc_daemon_cpu_us_per_session", m.grpc_cpu.ServerNsPerStep() / n / 1e3},
        {"channel_client_thread_cpu_us_per_step", m.channel_cpu.ClientNsPerStep() / 1e3},
        {"step_request_bytes", m.request_bytes},
        {"step_response_bytes", m.response_bytes},
    });
    table.Add({absl::StrCat(m.sessions), Us(m.channel.P50()), Us(m.channel.P99()),
               Us(m.grpc.P50()), Us(m.floor.P50()), Us(m.core_advance.P50()),
               Ratio(m.channel.P50() / m.floor.P50()),
               Ratio(m.channel.P50() / m.grpc.P50()), Us(m.channel.P50() / n),
               Us(m.channel_cpu.ServerNsPerStep() / n), Us(m.grpc_cpu.ServerNsPerStep() / n)});
  }
  json["by_sessions"] = rows;
  const ChannelMeasured& one = results.front();
  const ChannelMeasured& most = results.back();
  const double extra = static_cast<double>(most.sessions - one.sessions);
  const double channel_marginal = (most.channel.P50() - one.channel.P50()) / extra;
  const double grpc_marginal = (most.grpc.P50() - one.grpc.P50()) / extra;
  const double core_marginal = (most.core_advance.P50() - one.core_advance.P50()) / extra;
  const double ratio_at_one = one.channel.P50() / one.floor.P50();
  const double marginal_over_core = channel_marginal / core_marginal;
  // The daemon's CPU per session per step at the largest N (its spin between steps weighs
  // least there).
  const double cpu_per_session =
      most.channel_cpu.ServerNsPerStep() / static_cast<double>(most.sessions);
  json["marginal_per_session_p50_us"] = Json{{"channel", channel_marginal / 1e3},
                                             {"grpc", grpc_marginal / 1e3},
                                             {"core_advance", core_marginal / 1e3}};
  json["targets"] = Json{
      {"channel_within_0_3x_floor_at_n1",
       Json{{"ratio", ratio_at_one}, {"met", ratio_at_one <= 0.3}}},
      {"marginal_under_1us_at_n256",
       Json{{"us", channel_marginal / 1e3}, {"met", channel_marginal <= 1000}}},
      {"marginal_within_3x_core_advance",
       Json{{"ratio", marginal_over_core}, {"met", marginal_over_core <= 3.0}}},
      {"daemon_cpu_per_session_under_1us_at_n256",
       Json{{"us", cpu_per_session / 1e3}, {"met", cpu_per_session <= 1000}}}};
  table.Print("1c. decode step (one Advance per session) over the step channel vs over gRPC, and "
              "the bare gRPC floor (times in us; kvd cpu = the daemon's CPU per session per step)");
  std::printf(
      "marginal per extra session (p50, N=%zu..%zu): channel %s us, gRPC %s us, core Advance in "
      "process %s us\n",
      one.sessions, most.sessions, Us(channel_marginal).c_str(), Us(grpc_marginal).c_str(),
      Us(core_marginal).c_str());
  std::printf("target: channel/floor at N=1 <= 0.3x: %s (%s); marginal <= 1 us: %s (%s us)\n",
              ratio_at_one <= 0.3 ? "MET" : "MISSED", Ratio(ratio_at_one).c_str(),
              channel_marginal <= 1000 ? "MET" : "MISSED", Us(channel_marginal).c_str());
  std::printf("target: marginal <= 3x core Advance: %s (%s); daemon CPU per session per step "
              "at N=%zu <= 1 us: %s (%s us)\n",
              marginal_over_core <= 3.0 ? "MET" : "MISSED", Ratio(marginal_over_core).c_str(),
              most.sessions, cpu_per_session <= 1000 ? "MET" : "MISSED",
              Us(cpu_per_session).c_str());
  return json;
}

}  // namespace memra::bench
