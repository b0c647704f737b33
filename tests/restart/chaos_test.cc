// The chaos test (issue 14, "Checks that stay"): the real memra-kvd under the real
// memra-kv-supervise, several real engine processes stepping with data written through their
// mappings, engines SIGKILLed at seeded random points and the daemon SIGKILLed and restarted.
// Afterwards every surviving engine's committed rows hold exactly the bytes it wrote (each
// engine checks its own mapping against what the daemon says is committed, after every failure
// and at the end), the killed engines' memory is reclaimed, the admission ledger agrees with the
// arenas, and neither the daemon nor the supervisor's fd store holds anything once the
// survivors are done. A second test kills the daemon two and three times in quick succession
// (each kill as soon as the new daemon serves: a crash loop) under C++ and Python engines,
// which must all keep their leases (issue 26). The test waits for states (each engine's ready
// file, the daemon's counts), never for times; the engines retry what docs/failure-model.md says
// an engine retries (UNAVAILABLE while the daemon restarts). Bounded: about 20 s + 15 s.

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
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
#include "tests/seeded_random.h"
#include "tests/subprocess.h"

namespace memra::testing {
namespace {

namespace pb = ::memra::kv::v1;

constexpr int kEngines = 4;
constexpr int kSessionsPerEngine = 2;
constexpr int kRounds = 14;

struct Engine {
  std::string name;
  pid_t pid = -1;
  bool killed = false;
  bool python = false;
};

std::string Read(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Starts a C++ (tests/restart/restart_engine.cc) or Python (python/tests/restart_engine.py)
// engine process stepping `kSessionsPerEngine` sessions until the daemon's "stop" file exists.
Engine StartEngine(SupervisedDaemon& daemon, const std::string& name, uint64_t seed, bool python) {
  Engine engine;
  engine.name = name;
  engine.python = python;
  engine.pid = Spawn({Runfile(python ? "python/restart_engine" : "tests/restart/restart_engine"),
                      "--socket=" + daemon.socket(), "--name=" + name,
                      absl::StrCat("--seed=", seed), absl::StrCat("--sessions=", kSessionsPerEngine),
                      "--rows=3", "--capacity=512", "--until=" + daemon.Path("stop"),
                      "--ready=" + daemon.Path(name + ".ready"),
                      "--out=" + daemon.Path(name + ".facts")},
                     "", daemon.Path(name + ".log"));
  return engine;
}

// Waits until every live engine wrote its ready file (its sessions exist and hold rows); false
// (with the engine's log) when one exits first. Returns the creates each engine could not be
// sure of (answered UNAVAILABLE: the daemon may have created a session it never learnt of).
bool AwaitReady(SupervisedDaemon& daemon, std::vector<Engine>& engines, uint64_t* uncertain) {
  *uncertain = 0;
  for (Engine& engine : engines) {
    if (engine.killed) continue;
    const std::string ready = daemon.Path(engine.name + ".ready");
    bool exited = false;
    const bool written = PollUntil([&] {
      if (Exists(ready)) return true;
      int status = 0;
      exited = waitpid(engine.pid, &status, WNOHANG) == engine.pid;
      return exited;
    });
    if (!written || exited) {
      if (exited) engine.killed = true;  // reaped: nothing to kill later
      ADD_FAILURE() << engine.name << (exited ? " exited" : " never got ready") << ": "
                    << Read(daemon.Path(engine.name + ".log"));
      return false;
    }
    *uncertain += Number(ReadFacts(ready), "uncertain_creates");
  }
  return true;
}

// Tells the engines to stop and checks each live one's end: exit 0, every byte as written,
// `min_reattaches` re-attaches at least, attached to `epoch` at the end (0: not checked).
void StopAndCheck(SupervisedDaemon& daemon, const std::vector<Engine>& engines,
                  uint64_t min_reattaches, uint64_t epoch) {
  std::ofstream(daemon.Path("stop")) << "stop\n";
  for (const Engine& engine : engines) {
    if (engine.killed) continue;
    const std::string log = Read(daemon.Path(engine.name + ".log"));
    EXPECT_EQ(WaitExit(engine.pid), 0) << engine.name << ": " << log;
    const auto facts = ReadFacts(daemon.Path(engine.name + ".facts"));
    ASSERT_EQ(facts.count("ok"), 1u) << engine.name << ": " << log;
    EXPECT_GE(Number(facts, "reattaches"), min_reattaches) << engine.name << ": " << log;
    EXPECT_GT(Number(facts, "rows"), 0u) << engine.name;
    if (epoch != 0) {
      EXPECT_EQ(Number(facts, "epoch"), epoch) << engine.name << ": " << log;
    }
  }
}

TEST(Chaos, EnginesAndTheDaemonKilledAtRandomLeaveExactBytesAndNothingLeaked) {
  // MEMRA_CHAOS_SEED replays another sequence (bazel test --test_env=MEMRA_CHAOS_SEED=...).
  uint64_t seed = 0x5eed0c4a05ULL;
  if (const char* env = getenv("MEMRA_CHAOS_SEED"); env != nullptr) {
    if (!absl::SimpleAtoi(env, &seed) || seed == 0) seed = 0x5eed0c4a05ULL;
  }
  std::printf("chaos seed %#llx\n", static_cast<unsigned long long>(seed));
  const absl::Time started = absl::Now();
  SeededRandom random(seed);
  SupervisedDaemon daemon("chaos");
  ASSERT_TRUE(daemon.Start({"--lease_timeout_ms=1500", "--lease_grace_ms=300",
                            "--prefix_cache_budget_bytes=0"}));
  const int store_baseline = OpenFds(daemon.supervisor());
  std::vector<Engine> engines;
  auto start_engine = [&] {
    engines.push_back(StartEngine(daemon, absl::StrCat("engine-", engines.size()),
                                  100 + engines.size(), /*python=*/false));
  };
  for (int i = 0; i < kEngines; ++i) start_engine();

  int daemon_kills = 0;
  int engine_kills = 0;
  for (int round = 0; round < kRounds; ++round) {
    absl::SleepFor(absl::Milliseconds(200 + random.Below(600)));
    const uint64_t roll = random.Below(10);
    // Rounds 4 and 9 always restart the daemon, so every seed exercises it at least twice.
    if (roll < 3 || round == 4 || round == 9) {
      ASSERT_TRUE(daemon.KillDaemonAndAwaitRestart()) << Read(daemon.Path("supervise.log"));
      ++daemon_kills;
    } else if (roll < 7) {
      std::vector<size_t> alive;
      for (size_t i = 0; i < engines.size(); ++i) {
        if (!engines[i].killed) alive.push_back(i);
      }
      Engine& victim = engines[alive[random.Below(alive.size())]];
      KillAndReap(victim.pid);
      victim.killed = true;
      ++engine_kills;
      start_engine();  // the load stays
    }
  }
  std::printf("chaos: %d daemon kills, %d engine kills, %zu engines started\n", daemon_kills,
              engine_kills, engines.size());
  ASSERT_GE(daemon_kills, 2);

  // Every live engine set up its sessions (one started in the last round too); the killed
  // engines are reclaimed (their leases end: stream broken, or never re-attached after a
  // restart); the survivors still hold exactly their sessions.
  uint64_t uncertain = 0;
  ASSERT_TRUE(AwaitReady(daemon, engines, &uncertain));
  size_t survivors = 0;
  for (const Engine& engine : engines) survivors += engine.killed ? 0 : 1;
  ASSERT_TRUE(PollUntil([&] {
    absl::StatusOr<pb::GetStatusResponse> now = daemon.Status();
    return now.ok() && now->engines() == survivors;
  })) << Read(daemon.Path("supervise.log.out"));
  absl::StatusOr<pb::GetStatusResponse> mid = daemon.Status();
  ASSERT_TRUE(mid.ok());
  // A create answered UNAVAILABLE (the daemon died before replying) may have made a session
  // its engine never learnt of; it lives until the engine goes (checked below).
  EXPECT_GE(mid->sessions(), survivors * kSessionsPerEngine);
  EXPECT_LE(mid->sessions(), survivors * kSessionsPerEngine + uncertain);
  EXPECT_EQ(mid->arena_count(), mid->sessions());
  EXPECT_EQ(mid->admission().allocated_bytes(), mid->allocated_bytes());
  EXPECT_EQ(mid->admission().reserved_bytes(), 0u);
  EXPECT_EQ(mid->admission().free_bytes(),
            mid->admission().budget_bytes() - mid->admission().allocated_bytes());
  // The store holds the journal, one arena per session and the one plan they share.
  EXPECT_EQ(OpenFds(daemon.supervisor()),
            store_baseline + static_cast<int>(mid->sessions()) + (mid->sessions() > 0 ? 1 : 0));

  StopAndCheck(daemon, engines, /*min_reattaches=*/0, /*epoch=*/0);
  daemon.ExpectNothingLeft(store_baseline);
  // The daemon holds no arena mapping: none of its memory maps is a session arena.
  const std::string maps = Read(absl::StrCat("/proc/", daemon.DaemonPid(), "/maps"));
  EXPECT_EQ(maps.find("/dev/shm/memra-kv"), std::string::npos) << maps;
  std::printf("chaos: %.1f s\n", absl::ToDoubleSeconds(absl::Now() - started));
}

// Issue 26: a daemon in a crash loop. Each kill comes as soon as the new daemon serves, so an
// engine's re-attach (a ticket from daemon N+1, then Attach, which waits for the channel to
// reconnect) often reaches daemon N+2. Every engine, C++ and Python, must keep its lease
// through bursts of two and three kills and every session its bytes.
TEST(Chaos, DaemonKilledTwiceAndThriceInQuickSuccessionKeepsEveryEngine) {
  SupervisedDaemon daemon("crashloop");
  // A lease timeout well above a re-attach under load: what is tested is that no engine gives
  // up, not how fast it comes back.
  ASSERT_TRUE(daemon.Start({"--lease_timeout_ms=5000", "--lease_grace_ms=300",
                            "--prefix_cache_budget_bytes=0"}));
  const int store_baseline = OpenFds(daemon.supervisor());
  const absl::Time started = absl::Now();
  std::vector<Engine> engines;
  for (int i = 0; i < 2; ++i) {
    engines.push_back(StartEngine(daemon, absl::StrCat("cc-", i), 200 + i, /*python=*/false));
    engines.push_back(StartEngine(daemon, absl::StrCat("py-", i), 300 + i, /*python=*/true));
  }
  uint64_t uncertain = 0;
  ASSERT_TRUE(AwaitReady(daemon, engines, &uncertain));
  absl::StatusOr<pb::GetStatusResponse> first = daemon.Status();
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->engines(), engines.size());
  EXPECT_EQ(first->sessions(), engines.size() * kSessionsPerEngine);

  uint64_t kills = 0;
  for (int burst : {2, 3}) {
    for (int kill = 0; kill < burst; ++kill) {
      ASSERT_TRUE(daemon.KillDaemonAndAwaitRestart()) << Read(daemon.Path("supervise.log"));
      ++kills;
    }
    // Every engine re-attached to the daemon that serves now, none gave up (a lost lease ends
    // the engine's process), and every session came back.
    bool all_live = false;
    ASSERT_TRUE(PollUntil([&] {
      for (const Engine& engine : engines) {
        if (waitpid(engine.pid, nullptr, WNOHANG) == engine.pid) return true;  // reported below
      }
      absl::StatusOr<pb::ListEnginesResponse> known = daemon.Engines();
      if (!known.ok() || known->engines_size() != static_cast<int>(engines.size())) return false;
      for (const auto& engine : known->engines()) {
        if (!engine.lease_live() || engine.awaiting_reattach()) return false;
      }
      return all_live = true;
    })) << Read(daemon.Path("supervise.log.out"));
    ASSERT_TRUE(all_live) << "an engine exited after a burst of " << burst << " kills:\n"
                          << [&] {
                               std::string logs;
                               for (const Engine& engine : engines) {
                                 logs += engine.name + ": " +
                                         Read(daemon.Path(engine.name + ".log")) + "\n";
                               }
                               return logs;
                             }();
    absl::StatusOr<pb::GetStatusResponse> now = daemon.Status();
    ASSERT_TRUE(now.ok());
    EXPECT_EQ(now->epoch(), first->epoch() + kills) << "each restart re-adopted the last";
    EXPECT_GE(now->sessions(), engines.size() * kSessionsPerEngine);
    EXPECT_LE(now->sessions(), engines.size() * kSessionsPerEngine + uncertain);
    EXPECT_EQ(now->arena_count(), now->sessions());
  }
  std::printf("crash loop: %llu kills in 2 bursts\n", static_cast<unsigned long long>(kills));
  absl::StatusOr<pb::GetStatusResponse> last = daemon.Status();
  ASSERT_TRUE(last.ok());
  StopAndCheck(daemon, engines, /*min_reattaches=*/2, last->epoch());
  daemon.ExpectNothingLeft(store_baseline);
  std::printf("crash loop: %.1f s\n", absl::ToDoubleSeconds(absl::Now() - started));
}

}  // namespace
}  // namespace memra::testing
