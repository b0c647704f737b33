// The step channel (docs/step-channel.md) end to end, with the real memra-kvd binary:
//   * one scripted random workload (Advance, Begin / Prepare / Publish / Commit / Abort, and
//     refusals: an empty slot, another engine's slot, bad token-id counts, commits beyond what
//     was prepared, stale generations) runs against a fresh daemon over gRPC and against another
//     fresh daemon over the channel: every outcome (code, message, payload) and every session
//     state after every step is the same;
//   * an engine process killed (SIGKILL) with a full ring of records in flight is reclaimed as
//     any other: sessions released, the ledger back to 0;
//   * an engine process writing random bytes into its rings leaves another engine's sessions,
//     stepped over its channel and over gRPC meanwhile, exactly as expected.

#include <signal.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/client.h"
#include "client/internal.h"
#include "gtest/gtest.h"
#include "tests/daemon_process.h"
#include "tests/seeded_random.h"
#include "tests/service/test_plans.h"
#include "tests/status_matchers.h"
#include "tests/subprocess.h"

namespace memra::testing {
namespace {

namespace pb = ::memra::kv::v1;

constexpr uint64_t kCapacity = 256;

// CPU time (user + system) the process has used, from /proc/<pid>/stat; -1 when unreadable.
int64_t CpuMilliseconds(pid_t pid) {
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(stat, line)) return -1;
  // Fields after the command (which may hold spaces) start after the last ')'.
  const std::vector<std::string> fields =
      absl::StrSplit(line.substr(line.rfind(')') + 2), ' ', absl::SkipEmpty());
  if (fields.size() < 13) return -1;
  const int64_t ticks = std::stoll(fields[11]) + std::stoll(fields[12]);  // utime, stime
  return ticks * 1000 / sysconf(_SC_CLK_TCK);
}

std::vector<std::string> DaemonFlags() {
  return {"--budget_bytes=256MiB", "--lease_timeout_ms=2000", "--lease_grace_ms=200"};
}

std::unique_ptr<KvClient> Attach(const DaemonProcess& daemon, const std::string& name,
                                 bool force_grpc) {
  ClientOptions options;
  options.force_grpc_step = force_grpc;
  absl::StatusOr<std::unique_ptr<KvClient>> client = KvClient::Connect(daemon.socket(), options);
  EXPECT_THAT(client, IsOk());
  if (!client.ok()) return nullptr;
  EXPECT_THAT((*client)->Attach(name), IsOk());
  return *std::move(client);
}

std::string Describe(const StepOutcome& outcome) {
  std::string text = absl::StrCat(static_cast<int>(outcome.status.code()), " '",
                                  outcome.status.message(), "' begun ", outcome.begun.generation,
                                  "/", outcome.begun.base_len, " staged ", outcome.staged_len,
                                  " committed ", outcome.committed_len, " published ",
                                  outcome.published);
  if (outcome.prepared.has_value()) {
    absl::StrAppend(&text, " prepared ", outcome.prepared->generation, "/",
                    outcome.prepared->target, " layers");
    for (const LayerAppend& layer : outcome.prepared->layers) {
      absl::StrAppend(&text, " ", layer.layer, "@", layer.write_row,
                      layer.ring_append.has_value() ? "r" : "");
    }
  }
  return text;
}

std::string Describe(const SessionSnapshot& state) {
  std::string text = absl::StrCat(state.committed_len, " ", state.staged_len, " ",
                                  state.position, " ", state.active_generation, " ",
                                  state.next_generation, " ", state.tainted);
  for (const LayerSnapshot& layer : state.layers) {
    absl::StrAppend(&text, " [", layer.layer, " ", layer.length, " ", layer.ring_base, "]");
  }
  return text;
}

// The scripted workload against a fresh daemon: engine "subject" (over the channel unless
// `force_grpc`) steps its sessions at random; engine "neighbour" owns a session the subject
// names by slot. Every outcome and every subject session's state after each step, as text.
std::vector<std::string> RunWorkload(bool force_grpc) {
  DaemonProcess daemon("chan-eq");
  if (!daemon.Start(DaemonFlags())) return {};
  std::unique_ptr<KvClient> subject = Attach(daemon, "subject", force_grpc);
  std::unique_ptr<KvClient> neighbour = Attach(daemon, "neighbour", /*force_grpc=*/true);
  if (subject == nullptr || neighbour == nullptr) return {};
  EXPECT_EQ(subject->step_channel_active(), !force_grpc) << subject->step_channel_status();
  absl::StatusOr<PlanFingerprint> plan = subject->RegisterPlan(HybridTestPlan());
  absl::StatusOr<PlanFingerprint> neighbour_plan = neighbour->RegisterPlan(HybridTestPlan());
  EXPECT_THAT(plan, IsOk());
  EXPECT_THAT(neighbour_plan, IsOk());
  if (!plan.ok() || !neighbour_plan.ok()) return {};
  SessionOptions options;
  options.capacity = kCapacity;
  std::vector<std::unique_ptr<Session>> sessions;
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<std::unique_ptr<Session>> session = subject->CreateSession(*plan, options);
    EXPECT_THAT(session, IsOk());
    if (!session.ok()) return {};
    sessions.push_back(*std::move(session));
  }
  absl::StatusOr<std::unique_ptr<Session>> foreign =
      neighbour->CreateSession(*neighbour_plan, options);
  EXPECT_THAT(foreign, IsOk());
  if (!foreign.ok()) return {};
  // Released: its slot stays empty (no session is created after it).
  absl::StatusOr<std::unique_ptr<Session>> released = subject->CreateSession(*plan, options);
  EXPECT_THAT(released, IsOk());
  if (!released.ok()) return {};
  std::unique_ptr<Session> gone = *std::move(released);
  EXPECT_THAT(gone->Release(), IsOk());

  SeededRandom random(0x5ca1ab1e);
  std::vector<uint64_t> generation(sessions.size(), 0);  // the last one each session began
  std::vector<std::string> log;
  StepBatch batch(StepAddressing::kSlot);
  std::vector<StepOutcome> outcomes;
  std::vector<size_t> targets;  // which session each entry named (sessions.size(): none)
  for (int step = 0; step < 250; ++step) {
    batch.Clear();
    targets.clear();
    const int entries = 1 + static_cast<int>(random.Below(4));
    for (int e = 0; e < entries; ++e) {
      const size_t which = random.Below(sessions.size());
      Session& session = *sessions[which];
      // Mostly the live transaction's generation; sometimes a stale or future one.
      const uint64_t gen = random.Below(5) == 0 ? random.Below(6) : generation[which];
      const uint64_t rows = random.Below(4);
      std::vector<int32_t> tokens(random.Below(4) == 0 ? random.Below(3) : rows);
      for (int32_t& token : tokens) token = static_cast<int32_t>(random.Below(50000));
      targets.push_back(which);
      switch (random.Below(10)) {
        case 0:
          batch.Begin(session);
          break;
        case 1:
          batch.Prepare(session, gen, 1 + random.Below(3));
          break;
        case 2:
          batch.Publish(session, gen);
          break;
        case 3:
          batch.Commit(session, gen, random.Below(5), tokens);  // often beyond what is staged
          break;
        case 4:
          batch.Abort(session, gen);
          break;
        case 5:
          batch.Advance(**foreign, gen, rows, 1);  // another engine's slot
          targets.back() = sessions.size();
          break;
        case 6:
          batch.Advance(*gone, gen, rows, 1);  // a slot nobody holds
          targets.back() = sessions.size();
          break;
        case 7:
          batch.Advance(session, gen, rows, kCapacity * 2, tokens);  // beyond the capacity
          break;
        default:
          batch.Advance(session, gen, rows, 1 + random.Below(2), tokens);
          break;
      }
    }
    const absl::Status stepped = subject->Step(batch, outcomes);
    EXPECT_THAT(stepped, IsOk()) << "step " << step;
    if (!stepped.ok()) return log;
    for (size_t e = 0; e < outcomes.size(); ++e) {
      log.push_back(absl::StrCat("step ", step, " entry ", e, ": ", Describe(outcomes[e])));
      if (outcomes[e].status.ok() && targets[e] < sessions.size() &&
          outcomes[e].begun.generation != 0) {
        generation[targets[e]] = outcomes[e].begun.generation;
      }
    }
    for (size_t i = 0; i < sessions.size(); ++i) {
      absl::StatusOr<SessionSnapshot> state = sessions[i]->State();
      EXPECT_THAT(state, IsOk());
      log.push_back(absl::StrCat("step ", step, " session ", i, ": ",
                                 state.ok() ? Describe(*state) : state.status().ToString()));
      // A session that filled up starts over (Reset over gRPC, the same on both runs).
      if (state.ok() && state->committed_len + 8 > kCapacity) {
        EXPECT_THAT(sessions[i]->Reset(), IsOk());
        generation[i] = 0;
      }
    }
  }
  batch.Clear();
  batch.Begin(*sessions[0]);
  EXPECT_THAT(subject->Step(batch, outcomes), IsOk());
  log.push_back(absl::StrCat("final: ", Describe(outcomes[0])));
  return log;
}

TEST(StepChannelE2eTest, TheScriptedWorkloadHasTheSameOutcomesOverGrpcAndOverTheChannel) {
  const std::vector<std::string> over_grpc = RunWorkload(/*force_grpc=*/true);
  const std::vector<std::string> over_channel = RunWorkload(/*force_grpc=*/false);
  ASSERT_FALSE(over_grpc.empty());
  ASSERT_EQ(over_grpc.size(), over_channel.size());
  size_t refusals = 0;
  for (size_t i = 0; i < over_grpc.size(); ++i) {
    ASSERT_EQ(over_grpc[i], over_channel[i]) << "line " << i;
    if (over_grpc[i].find("entry") != std::string::npos &&
        over_grpc[i].find(": 0 ''") == std::string::npos) {
      ++refusals;
    }
  }
  // The workload exercised both sides: refusals of several kinds and successful steps.
  EXPECT_GT(refusals, 100u);
  EXPECT_LT(refusals, over_grpc.size() / 2);
  const std::string all = absl::StrJoin(over_grpc, "\n");
  for (const char* refusal : {"holds no session of engine", "stale KV transaction",
                              "token ids", "holds no session", "capacity"}) {
    EXPECT_NE(all.find(refusal), std::string::npos) << refusal;
  }
}

class StepChannelProcessTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(daemon_.Start(DaemonFlags())); }
  void TearDown() override { KillAndReap(engine_); }

  pb::GetStatusResponse Status() {
    if (operator_ == nullptr) {
      absl::StatusOr<std::unique_ptr<KvClient>> client = KvClient::Connect(daemon_.admin_socket());
      EXPECT_THAT(client, IsOk());
      if (!client.ok()) return {};
      operator_ = *std::move(client);
    }
    absl::StatusOr<pb::GetStatusResponse> status = ClientInternals::GetStatus(*operator_);
    EXPECT_THAT(status, IsOk());
    return status.ok() ? *status : pb::GetStatusResponse();
  }

  pid_t SpawnChannelEngine(const std::vector<std::string>& extra) {
    std::vector<std::string> args = {Runfile("tests/e2e/channel_engine"),
                                      "--socket=" + daemon_.socket(),
                                      "--ready=" + daemon_.dir() + "/ready"};
    args.insert(args.end(), extra.begin(), extra.end());
    return Spawn(args);
  }

  DaemonProcess daemon_{"chan-e2e"};
  std::unique_ptr<KvClient> operator_;
  pid_t engine_ = -1;
};

// A daemon that dies leaves no Step waiting for the channel's 10 s deadline: the client's
// lease stream breaks, the channel is abandoned, and Steps fail fast (over gRPC, to no daemon).
TEST_F(StepChannelProcessTest, AKilledDaemonAbandonsTheChannelAndStepsFailFast) {
  std::unique_ptr<KvClient> client = Attach(daemon_, "survivor", /*force_grpc=*/false);
  ASSERT_NE(client, nullptr);
  absl::StatusOr<PlanFingerprint> plan = client->RegisterPlan(HybridTestPlan());
  ASSERT_THAT(plan, IsOk());
  SessionOptions options;
  options.capacity = kCapacity;
  absl::StatusOr<std::unique_ptr<Session>> session = client->CreateSession(*plan, options);
  ASSERT_THAT(session, IsOk());
  ASSERT_TRUE(client->step_channel_active()) << client->step_channel_status();
  ASSERT_TRUE(daemon_.Signal(SIGKILL));
  EXPECT_EQ(daemon_.WaitExit(), 128 + SIGKILL);
  const absl::Time killed = absl::Now();
  while (client->step_channel_active() && absl::Now() - killed < absl::Seconds(5)) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_FALSE(client->step_channel_active());
  EXPECT_THAT(client->step_channel_status(),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstrs("lease stream broke")));
  StepBatch batch(StepAddressing::kSlot);
  batch.Advance(**session, 0, 0, 1);
  const absl::Time start = absl::Now();
  EXPECT_FALSE(client->Step(batch).ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST_F(StepChannelProcessTest, AnEngineKilledWithRecordsInFlightIsReclaimed) {
  engine_ = SpawnChannelEngine({"--mode=inflight", "--sessions=8"});
  ASSERT_TRUE(PollUntil([&] { return Exists(daemon_.dir() + "/ready"); }, engine_));
  const pb::GetStatusResponse during = Status();
  EXPECT_EQ(during.sessions(), 8u);
  EXPECT_GT(during.admission().allocated_bytes(), 0u);
  // The engine reads no completion: the daemon filled the completion ring and sleeps (no busy
  // core while records wait for room).
  absl::SleepFor(absl::Milliseconds(200));
  const int64_t cpu_before = CpuMilliseconds(daemon_.pid());
  absl::SleepFor(absl::Seconds(1));
  const int64_t cpu_used = CpuMilliseconds(daemon_.pid()) - cpu_before;
  EXPECT_LT(cpu_used, 200) << "the daemon used " << cpu_used << " ms of CPU in 1 s while idle";
  ASSERT_EQ(kill(engine_, SIGKILL), 0);
  EXPECT_EQ(WaitExit(engine_), 128 + SIGKILL);
  engine_ = -1;
  // Reclaim ends the lease, then the sessions, then the engine's pooled arenas: wait for the
  // last of them, not only for the counts that fall first.
  ASSERT_TRUE(PollUntil([&] {
    const pb::GetStatusResponse status = Status();
    return status.engines() == 0 && status.sessions() == 0 && status.arena_count() == 0;
  }));
  const pb::GetStatusResponse after = Status();
  EXPECT_EQ(after.admission().allocated_bytes(), 0u);
  EXPECT_EQ(after.admission().reserved_bytes(), 0u);
  EXPECT_EQ(after.arena_count(), 0u);
  // The daemon serves the next engine, over its channel.
  std::unique_ptr<KvClient> next = Attach(daemon_, "next", /*force_grpc=*/false);
  ASSERT_NE(next, nullptr);
  EXPECT_TRUE(next->step_channel_active());
}

TEST_F(StepChannelProcessTest, AnEngineWritingRandomBytesLeavesAnotherEnginesSessionsExact) {
  std::unique_ptr<KvClient> victim = Attach(daemon_, "victim", /*force_grpc=*/false);
  ASSERT_NE(victim, nullptr);
  ASSERT_TRUE(victim->step_channel_active());
  absl::StatusOr<PlanFingerprint> plan = victim->RegisterPlan(HybridTestPlan());
  ASSERT_THAT(plan, IsOk());
  SessionOptions options;
  options.capacity = 4096;
  absl::StatusOr<std::unique_ptr<Session>> over_channel = victim->CreateSession(*plan, options);
  absl::StatusOr<std::unique_ptr<Session>> over_rpc = victim->CreateSession(*plan, options);
  ASSERT_THAT(over_channel, IsOk());
  ASSERT_THAT(over_rpc, IsOk());
  engine_ = SpawnChannelEngine({"--mode=fuzz", "--seconds=3"});
  ASSERT_TRUE(PollUntil([&] { return Exists(daemon_.dir() + "/ready"); }, engine_));
  StepBatch batch(StepAddressing::kSlot);
  std::vector<StepOutcome> outcomes;
  uint64_t generation = 0;
  uint64_t committed = 0;
  uint64_t rpc_committed = 0;
  int steps = 0;
  for (; steps < 3000 && ::memra::testing::WaitExit(engine_, absl::ZeroDuration()) < 0; ++steps) {
    batch.Clear();
    batch.Advance(**over_channel, generation, generation == 0 ? 0 : 1, 1);
    ASSERT_THAT(victim->Step(batch, outcomes), IsOk()) << "step " << steps;
    ASSERT_THAT(outcomes[0].status, IsOk()) << "step " << steps;
    if (generation != 0) ++committed;
    ASSERT_EQ(outcomes[0].committed_len, committed);
    generation = outcomes[0].begun.generation;
    if (steps % 10 == 0) {
      absl::StatusOr<Transaction> tx = (*over_rpc)->Begin();
      ASSERT_THAT(tx, IsOk());
      ASSERT_THAT((*over_rpc)->PrepareAppend(tx->generation, 2), IsOk());
      ASSERT_THAT((*over_rpc)->PublishAppend(tx->generation), IsOk());
      rpc_committed += 2;
      ASSERT_THAT((*over_rpc)->Commit(tx->generation, 2), IsOkAndHolds(rpc_committed));
    }
  }
  EXPECT_TRUE(victim->step_channel_active());
  const int exit_status = WaitExit(engine_);
  engine_ = -1;
  EXPECT_EQ(exit_status, 0) << "the fuzzing engine failed (its stderr is in the test log)";
  EXPECT_GT(steps, 10);
  absl::StatusOr<SessionSnapshot> state = (*over_channel)->State();
  ASSERT_THAT(state, IsOk());
  EXPECT_EQ(state->committed_len, committed);
  EXPECT_EQ(state->active_generation, generation);
  absl::StatusOr<SessionSnapshot> rpc_state = (*over_rpc)->State();
  ASSERT_THAT(rpc_state, IsOk());
  EXPECT_EQ(rpc_state->committed_len, rpc_committed);
  // Only the victim's sessions remain once the fuzzer's engines are reclaimed.
  EXPECT_TRUE(PollUntil([&] { return Status().sessions() == 2; }));
}

}  // namespace
}  // namespace memra::testing
