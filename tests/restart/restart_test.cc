// KV survives a daemon restart (docs/failure-model.md#the-daemon-dies), against the real
// memra-kvd, the real memra-kv-supervise and real engine processes (restart_engine.cc): under
// the supervisor a SIGKILLed daemon comes back with every session at its committed length and
// the engines carry on with their mappings; without one, engines get the restart error naming
// both epochs, never NOT_FOUND and never stale memory.

#include <signal.h>
#include <unistd.h>

#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/e2e/facts.h"
#include "tests/restart/supervised_daemon.h"
#include "tests/subprocess.h"

namespace memra::testing {
namespace {

namespace pb = ::memra::kv::v1;

pid_t StartEngine(const SupervisedDaemon& daemon, const std::string& name, uint64_t seed,
                  const std::vector<std::string>& extra = {}) {
  std::vector<std::string> args = {Runfile("tests/restart/restart_engine"),
                                   "--socket=" + daemon.socket(),
                                   "--name=" + name,
                                   absl::StrCat("--seed=", seed),
                                   "--until=" + daemon.Path("stop"),
                                   "--out=" + daemon.Path(name + ".facts"),
                                   "--ready=" + daemon.Path(name + ".ready")};
  args.insert(args.end(), extra.begin(), extra.end());
  return Spawn(args, "", daemon.Path(name + ".log"));
}

std::string Log(const SupervisedDaemon& daemon, const std::string& name) {
  std::ifstream in(daemon.Path(name));
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(DaemonRestart, SessionsComeBackAtTheirCommittedLengthAndEnginesCarryOn) {
  SupervisedDaemon daemon("restart");
  ASSERT_TRUE(daemon.Start({"--lease_timeout_ms=3000", "--lease_grace_ms=1000",
                            "--prefix_cache_budget_bytes=0"}));
  const int store_baseline = OpenFds(daemon.supervisor());  // the journal only
  const std::vector<std::string> names = {"engine-a", "engine-b"};
  std::vector<pid_t> engines;
  for (size_t i = 0; i < names.size(); ++i) {
    engines.push_back(StartEngine(daemon, names[i], 11 + i));
  }
  for (const std::string& name : names) {
    ASSERT_TRUE(PollUntil([&] { return Exists(daemon.Path(name + ".ready")); }))
        << Log(daemon, name + ".log");
  }
  // Ready: each engine's sessions exist and hold committed rows.
  absl::StatusOr<pb::GetStatusResponse> before = daemon.Status();
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_EQ(before->sessions(), 4u);
  EXPECT_EQ(before->engines(), 2u);
  // Four arenas and one plan are in the supervisor's store besides the journal.
  EXPECT_EQ(OpenFds(daemon.supervisor()), store_baseline + 5);

  const absl::Time killed = absl::Now();
  ASSERT_TRUE(daemon.KillDaemonAndAwaitRestart()) << Log(daemon, "supervise.log");
  const absl::Duration restart_to_serving = absl::Now() - killed;
  absl::StatusOr<pb::GetStatusResponse> after = daemon.Status();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->epoch(), before->epoch() + 1) << "a re-adopting daemon bumps the epoch";
  EXPECT_EQ(after->sessions(), 4u);
  EXPECT_EQ(after->engines(), 2u);
  EXPECT_EQ(after->arena_count(), 4u);
  EXPECT_EQ(after->allocated_bytes(), before->allocated_bytes());
  EXPECT_EQ(after->admission().allocated_bytes(), after->allocated_bytes());
  std::printf("restart-to-serving (SIGKILL to GetStatus answering): %.1f ms\n",
              absl::ToDoubleMilliseconds(restart_to_serving));

  // The engines re-attach (none awaits it any more) and step on.
  ASSERT_TRUE(PollUntil([&] {
    absl::StatusOr<pb::ListEnginesResponse> known = daemon.Engines();
    if (!known.ok() || known->engines_size() != 2) return false;
    for (const auto& engine : known->engines()) {
      if (engine.awaiting_reattach() || !engine.lease_live()) return false;
    }
    return true;
  })) << Log(daemon, "supervise.log.out");
  std::ofstream(daemon.Path("stop")) << "stop\n";
  for (size_t i = 0; i < engines.size(); ++i) {
    EXPECT_EQ(WaitExit(engines[i]), 0) << Log(daemon, names[i] + ".log");
    const auto facts = ReadFacts(daemon.Path(names[i] + ".facts"));
    EXPECT_EQ(Number(facts, "ok"), 1u);
    EXPECT_GE(Number(facts, "reattaches"), 1u) << "the engine carried on as the same engine";
    EXPECT_EQ(Number(facts, "first_epoch"), before->epoch());
    EXPECT_EQ(Number(facts, "epoch"), after->epoch());
    EXPECT_GT(Number(facts, "rows"), 0u);
  }
  // The engines released their sessions and detached: nothing is left, in the daemon or the
  // supervisor's store.
  daemon.ExpectNothingLeft(store_baseline);
  EXPECT_NE(Log(daemon, "supervise.log.out").find("re-adopted 2 engines and 4 sessions"),
            std::string::npos)
      << Log(daemon, "supervise.log.out");
}

TEST(DaemonRestart, AnIdleEngineNoticesTheBrokenLeaseStreamAtOnce) {
  // Heartbeats 20 s apart: a re-attach within seconds of the SIGKILL came from the stream's end.
  SupervisedDaemon daemon("idle");
  ASSERT_TRUE(daemon.Start({"--lease_timeout_ms=60000", "--prefix_cache_budget_bytes=0"}));
  const int store_baseline = OpenFds(daemon.supervisor());  // the journal only
  absl::StatusOr<std::unique_ptr<KvClient>> engine = KvClient::Connect(daemon.socket());
  ASSERT_TRUE(engine.ok()) << engine.status();
  ASSERT_TRUE((*engine)->Attach("idle-engine").ok());
  const uint64_t engine_id = (*engine)->engine_id();
  const uint64_t first_epoch = (*engine)->epoch();

  const absl::Time killed = absl::Now();
  ASSERT_TRUE(daemon.KillDaemonAndAwaitRestart()) << Log(daemon, "supervise.log");
  ASSERT_TRUE(PollUntil([&] { return (*engine)->reattaches() == 1; }))
      << (*engine)->lease_lost();
  const absl::Duration noticed = absl::Now() - killed;
  EXPECT_LT(noticed, absl::Seconds(10)) << "re-attached at a heartbeat, not at the stream's end";
  std::printf("idle engine: SIGKILL to re-attached: %.1f ms\n",
              absl::ToDoubleMilliseconds(noticed));
  EXPECT_TRUE((*engine)->lease_alive());
  EXPECT_EQ((*engine)->engine_id(), engine_id);
  EXPECT_EQ((*engine)->epoch(), first_epoch + 1);
  (*engine)->Detach();
  daemon.ExpectNothingLeft(store_baseline);
}

TEST(DaemonRestart, WithoutAServiceManagerEnginesGetTheRestartErrorNamingBothEpochs) {
  SupervisedDaemon daemon("norestart");
  ASSERT_TRUE(daemon.Start({"--prefix_cache_budget_bytes=0"}, /*supervised=*/false));
  const pid_t engine = StartEngine(daemon, "engine", 5, {"--expect_restart_error"});
  ASSERT_TRUE(PollUntil([&] { return Exists(daemon.Path("engine.ready")); }))
      << Log(daemon, "engine.log");
  const uint64_t first_epoch = Number(ReadFacts(daemon.Path("engine.ready")), "epoch");
  KillAndReap(daemon.DaemonPid());
  daemon.Forget();
  ASSERT_TRUE(daemon.Start({"--prefix_cache_budget_bytes=0"}, /*supervised=*/false));
  absl::StatusOr<pb::GetStatusResponse> now = daemon.Status();
  ASSERT_TRUE(now.ok());
  EXPECT_EQ(WaitExit(engine), 0) << Log(daemon, "engine.log");
  const auto facts = ReadFacts(daemon.Path("engine.facts"));
  EXPECT_EQ(Number(facts, "restart_error"), 1u);
  EXPECT_EQ(Number(facts, "previous_epoch"), first_epoch);
  EXPECT_EQ(Number(facts, "epoch"), now->epoch());
  EXPECT_NE(facts.at("message").find(absl::StrCat("memra-kvd restarted (epoch ", first_epoch,
                                                  " -> ", now->epoch(), ")")),
            std::string::npos)
      << facts.at("message");
}

}  // namespace
}  // namespace memra::testing
