// End to end: the real memra-kvd binary (host backend) and two separate test_engine processes.
// Engine A runs the script (partial commits, rewinds, spec rollbacks, SWA ring wrap; K/V, latent
// and recurrent planes written through its mappings, its bytes verified there) and holds; this
// test, as a third process, checks A's lengths as the daemon reports them and that A's arena is
// refused to it (host arenas go to their owning engine only), SIGKILLs A and waits for the daemon
// to free all of A's memory (its memfd closed, accounting back to B's share alone) while B keeps
// working.
// Finally SIGTERM drains the daemon, which exits 0 having freed everything.

#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/internal.h"
#include "common/grpc_status.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "server/config.h"
#include "server/instance.h"
#include "tests/daemon_process.h"
#include "tests/e2e/engine_checks.h"
#include "tests/e2e/engine_device.h"
#include "tests/e2e/facts.h"
#include "tests/status_matchers.h"
#include "tests/subprocess.h"

namespace memra::testing {
namespace {

namespace pb = ::memra::kv::v1;

constexpr uint64_t kLeaseTimeoutMs = 2000;               // roomy: a loaded CI box must not expire B
constexpr uint64_t kLeaseGraceMs = 200;

// Arena memfds the process `pid` holds open, per /proc/<pid>/fd: the daemon holds one per live
// host arena (0 once it exited).
size_t ArenaMemfds(pid_t pid) {
  size_t count = 0;
  std::error_code error;
  for (const auto& entry :
       std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/fd"), error)) {
    const std::string target = std::filesystem::read_symlink(entry.path(), error).string();
    if (!error && target.rfind("/memfd:memra-kv", 0) == 0) ++count;
  }
  return count;
}

// /dev/shm entries whose name holds the engine's arena handle: never any (memfds have no name).
size_t DevShmEntriesNaming(const Facts& facts) {
  const std::string handle = absl::HexStringToBytes(facts.at("arena_handle_hex"));
  size_t count = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    if (entry.path().filename().string().find(handle) != std::string::npos) ++count;
  }
  return count;
}

class E2eTest : public ::testing::Test {
 protected:
  // Starts memra-kvd on socket_ with the test's budget, then `extra` flags, and connects the
  // checker (the engine socket) and the operator (the admin socket: the per-engine status).
  void StartDaemon(const std::vector<std::string>& extra = {}) {
    std::vector<std::string> flags = {"--budget_bytes=256MiB"};
    flags.insert(flags.end(), extra.begin(), extra.end());
    ASSERT_TRUE(daemon_.Start(flags));
    absl::StatusOr<std::unique_ptr<KvClient>> checker = KvClient::Connect(socket_);
    ASSERT_THAT(checker, IsOk());
    checker_ = *std::move(checker);
    absl::StatusOr<std::unique_ptr<KvClient>> operator_client =
        KvClient::Connect(daemon_.admin_socket());
    ASSERT_THAT(operator_client, IsOk());
    operator_ = *std::move(operator_client);
  }

  static std::vector<std::string> LeaseFlags() {
    return {absl::StrCat("--lease_timeout_ms=", kLeaseTimeoutMs),
            absl::StrCat("--lease_grace_ms=", kLeaseGraceMs)};
  }

  void TearDown() override {
    checker_.reset();
    operator_.reset();
    KillAndReap(engine_a_);
    KillAndReap(engine_b_);
  }

  pb::GetStatusResponse Status() {
    absl::StatusOr<pb::GetStatusResponse> status = ClientInternals::GetStatus(*operator_);
    EXPECT_THAT(status, IsOk());
    return status.ok() ? *status : pb::GetStatusResponse();
  }

  pid_t SpawnEngine(const std::string& name, const std::vector<std::string>& extra) {
    std::vector<std::string> args = {Runfile("tests/e2e/test_engine"), "--socket=" + socket_,
                                     "--name=" + name,
                                     "--out=" + dir_ + "/" + name.substr(7) + ".facts"};
    args.insert(args.end(), extra.begin(), extra.end());
    return Spawn(args);
  }

  DaemonProcess daemon_{"e2e"};  // stopped, its directory removed, after TearDown
  const std::string& dir_ = daemon_.dir();
  const std::string& socket_ = daemon_.socket();
  pid_t engine_a_ = -1;
  pid_t engine_b_ = -1;
  std::unique_ptr<KvClient> checker_;
  std::unique_ptr<KvClient> operator_;
};

TEST_F(E2eTest, TwoEnginesBytesLeasesAndDrain) {
  StartDaemon(LeaseFlags());
  engine_a_ = SpawnEngine("engine-a", {"--spec"});
  engine_b_ = SpawnEngine("engine-b", {"--until=" + dir_ + "/b.stop", "--work"});
  ASSERT_TRUE(PollUntil([&] { return Exists(dir_ + "/a.facts"); }, engine_a_));
  ASSERT_TRUE(PollUntil([&] { return Exists(dir_ + "/b.facts"); }, engine_b_));

  // A's script wrapped the ring, rewound, committed partially and rolled speculation back; the
  // daemon's lengths, as this process sees them, and A's arena refused to this process (the
  // engine verified its bytes and mirrors through its own mapping before publishing facts).
  const Facts facts = ReadFacts(dir_ + "/a.facts");
  {
    absl::StatusOr<EngineDevice> host = OpenEngineDevice("host", 0);
    ASSERT_THAT(host, IsOk());
    ExpectScriptedSession(*checker_, facts, *host);
  }
  pb::GetStatusResponse before = Status();
  EXPECT_EQ(before.sessions(), 2u);
  ASSERT_NE(FindEngine(before, "engine-a"), nullptr);
  ASSERT_NE(FindEngine(before, "engine-b"), nullptr);
  const uint64_t b_bytes = FindEngine(before, "engine-b")->allocated_bytes();

  // SIGKILL A: the stream breaks, and after the grace period everything of A is gone.
  EXPECT_EQ(DevShmEntriesNaming(facts), 0u);
  ASSERT_EQ(ArenaMemfds(daemon_.pid()), 2u);
  const absl::Time killed = absl::Now();
  ASSERT_EQ(kill(engine_a_, SIGKILL), 0);
  EXPECT_EQ(WaitExit(engine_a_), 128 + SIGKILL);
  engine_a_ = -1;
  ASSERT_TRUE(PollUntil([&] {
    pb::GetStatusResponse now = Status();
    return ArenaMemfds(daemon_.pid()) == 1 && FindEngine(now, "engine-a") == nullptr &&
           now.sessions() == 1;
  }));
  std::printf("engine A reclaimed %s after SIGKILL (lease timeout %llu ms)\n",
              absl::FormatDuration(absl::Now() - killed).c_str(),
              static_cast<unsigned long long>(kLeaseTimeoutMs));
  pb::GetStatusResponse after = Status();
  EXPECT_EQ(after.allocated_bytes(), b_bytes);
  EXPECT_EQ(after.arena_count(), 1u);

  // B kept working all along and still verifies; it releases its session and exits 0.
  std::ofstream(dir_ + "/b.stop").put('\n');
  EXPECT_EQ(WaitExit(engine_b_), 0);
  engine_b_ = -1;
  // B's released arena waited in its pool; its lease ended with its process, so the pool goes.
  EXPECT_TRUE(PollUntil([&] { return ArenaMemfds(daemon_.pid()) == 0; }));
  pb::GetStatusResponse empty = Status();
  EXPECT_EQ(empty.sessions(), 0u);
  EXPECT_EQ(empty.allocated_bytes(), 0u);
  EXPECT_EQ(empty.arena_count(), 0u);

  // SIGTERM: drain (nothing left to wait for), free everything, exit 0, socket removed.
  checker_.reset();
  ASSERT_TRUE(daemon_.Signal(SIGTERM));
  EXPECT_EQ(daemon_.WaitExit(), 0);
  EXPECT_FALSE(Exists(socket_));
}

TEST_F(E2eTest, SigtermDrainsLiveSessionsThenFreesThem) {
  StartDaemon(LeaseFlags());
  engine_b_ = SpawnEngine("engine-b", {"--until=" + dir_ + "/b.stop", "--work"});
  ASSERT_TRUE(PollUntil([&] { return Exists(dir_ + "/b.facts"); }, engine_b_));
  ASSERT_EQ(ArenaMemfds(daemon_.pid()), 1u);
  ASSERT_TRUE(daemon_.Signal(SIGTERM));
  // Draining: new engines are refused, the live session keeps working.
  ASSERT_TRUE(PollUntil([&] {
    absl::StatusOr<pb::GetStatusResponse> status = ClientInternals::GetStatus(*checker_);
    return status.ok() && status->draining();
  }));
  absl::StatusOr<std::unique_ptr<KvClient>> late = KvClient::Connect(socket_);
  ASSERT_THAT(late, IsOk());
  EXPECT_THAT((*late)->Attach("late"), StatusIs(absl::StatusCode::kUnavailable,
                                                ::testing::HasSubstr("the daemon is draining")));
  late->reset();
  // The engine finishes and releases; the drain ends and the daemon exits 0.
  std::ofstream(dir_ + "/b.stop").put('\n');
  EXPECT_EQ(WaitExit(engine_b_), 0);
  engine_b_ = -1;
  ASSERT_TRUE(PollUntil([&] { return ArenaMemfds(daemon_.pid()) == 0; }));  // freed
  checker_.reset();
  EXPECT_EQ(daemon_.WaitExit(), 0);
  EXPECT_FALSE(Exists(socket_));
}

// A drain that live sessions would hold open ends by itself after drain_grace_ms, or at once on
// a second SIGTERM; either way every arena is freed and the daemon exits 0.
TEST_F(E2eTest, DrainEndsAtTheGraceOrASecondSigterm) {
  for (const bool second_sigterm : {false, true}) {
    SCOPED_TRACE(second_sigterm ? "second SIGTERM" : "drain grace");
    StartDaemon({second_sigterm ? "--drain_grace_ms=600000" : "--drain_grace_ms=300"});
    engine_b_ = SpawnEngine("engine-b", {"--work"});  // never releases on its own
    ASSERT_TRUE(PollUntil([&] { return Exists(dir_ + "/b.facts"); }, engine_b_));
    ASSERT_EQ(ArenaMemfds(daemon_.pid()), 1u);
    unlink((dir_ + "/b.facts").c_str());
    checker_.reset();
    ASSERT_TRUE(daemon_.Signal(SIGTERM));
    if (second_sigterm) {
      // Only once the first one has been taken: two queued signals may merge into one.
      ASSERT_TRUE(PollUntil(
          [&] {
            absl::StatusOr<std::unique_ptr<KvClient>> probe = KvClient::Connect(socket_);
            return probe.ok() && (*probe)->Attach("probe").code() == absl::StatusCode::kUnavailable;
          },
          daemon_.pid()));
      ASSERT_TRUE(daemon_.Signal(SIGTERM));
    }
    EXPECT_EQ(daemon_.WaitExit(), 0);
    EXPECT_FALSE(Exists(socket_));
    // The engine's next call fails (its lease and the daemon are gone): it exits 1.
    EXPECT_EQ(WaitExit(engine_b_), 1);
    engine_b_ = -1;
  }
}

TEST_F(E2eTest, FrozenEngineLosesItsLeaseWhenHeartbeatsStop) {
  StartDaemon(LeaseFlags());
  engine_a_ = SpawnEngine("engine-a", {});
  ASSERT_TRUE(PollUntil([&] { return Exists(dir_ + "/a.facts"); }, engine_a_));
  ASSERT_EQ(ArenaMemfds(daemon_.pid()), 1u);
  // SIGSTOP keeps the connection open but stops the heartbeats: only the lease timeout can
  // tell the daemon that this engine is gone.
  ASSERT_EQ(kill(engine_a_, SIGSTOP), 0);
  ASSERT_TRUE(PollUntil([&] {
    pb::GetStatusResponse now = Status();
    return ArenaMemfds(daemon_.pid()) == 0 && now.sessions() == 0 && now.engines() == 0;
  }));
  EXPECT_EQ(Status().allocated_bytes(), 0u);
  // Thawed, the engine finds its lease gone and says so.
  ASSERT_EQ(kill(engine_a_, SIGCONT), 0);
  EXPECT_EQ(WaitExit(engine_a_), 1);
  engine_a_ = -1;
}

TEST_F(E2eTest, StartRemovesAPredecessorsStaleObjectsAndRefusesASecondDaemon) {
  DaemonConfig config;
  config.sockets.socket_path = socket_;
  const std::string stale = absl::StrCat("/dev/shm/", ShmPrefix(config), "-", std::string(32, 'a'));
  std::ofstream(stale).put('\n');  // what a crashed memra-kvd on this socket leaves behind
  ASSERT_TRUE(Exists(stale));
  StartDaemon(LeaseFlags());
  EXPECT_FALSE(Exists(stale));
  // A second daemon on the same socket stops at the instance lock, touching nothing.
  EXPECT_EQ(WaitExit(Spawn({Runfile("server/memra-kvd"), "--socket_path=" + socket_})), 1);
  EXPECT_THAT(ClientInternals::GetStatus(*checker_), IsOk());
  checker_.reset();
  ASSERT_TRUE(daemon_.Signal(SIGTERM));
  EXPECT_EQ(daemon_.WaitExit(), 0);
}

TEST_F(E2eTest, ConfigErrorsExitWith78) {
  EXPECT_EQ(WaitExit(Spawn({Runfile("server/memra-kvd"), "--socket_path=" + socket_,
                            "--lease_timeout_ms=soon"})),
            78);
  std::ofstream(dir_ + "/kvd.conf") << "no_such_key = 1\n";
  EXPECT_EQ(WaitExit(Spawn({Runfile("server/memra-kvd"), "--config=" + dir_ + "/kvd.conf",
                            "--socket_path=" + socket_})),
            78);
  EXPECT_FALSE(Exists(socket_));
}

TEST_F(E2eTest, SighupAppliesReloadableKeysLive) {
  const std::string config = dir_ + "/kvd.conf";
  std::ofstream(config) << "lease_timeout_ms = 3000\nlog_level = \"info\"\n";
  StartDaemon({"--config=" + config});
  absl::StatusOr<std::unique_ptr<KvClient>> first = KvClient::Connect(socket_);
  ASSERT_THAT(first, IsOk());
  ASSERT_THAT((*first)->Attach("before-reload"), IsOk());
  EXPECT_EQ((*first)->lease_timeout(), absl::Milliseconds(3000));
  // lease_timeout_ms applies live; device needs a restart and is reported, not applied.
  std::ofstream(config) << "lease_timeout_ms = 4500\nlog_level = \"debug\"\ndevice = 3\n";
  ASSERT_TRUE(daemon_.Signal(SIGHUP));
  ASSERT_TRUE(PollUntil(
      [&] {
        absl::StatusOr<std::unique_ptr<KvClient>> next = KvClient::Connect(socket_);
        return next.ok() && (*next)->Attach("after-reload").ok() &&
               (*next)->lease_timeout() == absl::Milliseconds(4500);
      },
      daemon_.pid()));
  // A reload that fails to parse keeps the running configuration.
  std::ofstream(config) << "lease_timeout_ms = \"later\"\n";
  ASSERT_TRUE(daemon_.Signal(SIGHUP));
  absl::SleepFor(absl::Milliseconds(100));
  absl::StatusOr<std::unique_ptr<KvClient>> last = KvClient::Connect(socket_);
  ASSERT_THAT(last, IsOk());
  ASSERT_THAT((*last)->Attach("after-bad-reload"), IsOk());
  EXPECT_EQ((*last)->lease_timeout(), absl::Milliseconds(4500));
  first->reset();
  last->reset();
  checker_.reset();
  ASSERT_TRUE(daemon_.Signal(SIGTERM));
  EXPECT_EQ(daemon_.WaitExit(), 0);
}

}  // namespace
}  // namespace memra::testing
