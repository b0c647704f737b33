// End to end on a GPU: the host e2e scenario (tests/e2e/e2e_test.cc, prefix_e2e_test.cc) against
// the real memra-kvd with --backend=cuda and real engine processes (tests/e2e test_engine and
// prefix_engine with --backend=cuda). The engines map their arenas with CudaArenaMapper and write
// every plane with CUDA copies on their own stream that are still in flight when they call the
// daemon: each call carries the engine's interprocess event (Session::SetWaitEvent, prefix
// requests' ordering), so the daemon must wait for it (DeviceOrdering) for the bytes to check.
//
//  - TwoEngines...: engine A runs the script (partial commits, rewinds, SWA ring wrap with
//    rebase copies, spec snapshot / rollback of recurrent state checked by A), B keeps working;
//    this test, as a third process, maps A's arena and checks A's bytes and the daemon's mirrors;
//    SIGKILL of A and the daemon reclaiming its device memory while B keeps working; SIGTERM
//    drains with B still live, B finishes and the daemon exits 0 having freed everything.
//  - Prefix...: for each model kind one process captures and another restores and checks every
//    byte (Capture and Restore carry the engine's event too).
//  - AKilledEngine...: a SIGKILLed engine's committed conversation restores in a new process.
//
// Without a usable device (no driver: cudaGetDeviceCount fails with error 35) every test skips
// before spawning anything, saying why.

#include <cuda_runtime_api.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/internal.h"
#include "common/grpc_status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/memra/kv/v1/prefix.grpc.pb.h"
#include "tests/daemon_process.h"
#include "tests/e2e/engine_checks.h"
#include "tests/e2e/engine_device.h"
#include "tests/e2e/facts.h"
#include "tests/status_matchers.h"
#include "tests/subprocess.h"

namespace memra::testing {
namespace {

namespace pb = ::memra::kv::v1;

constexpr int kDevice = 0;
constexpr char kBackend[] = "cuda";
constexpr uint64_t kLeaseTimeoutMs = 2000;

// Why there is no usable device, or empty when there is one.
std::string NoDeviceReason() {
  int count = 0;
  if (const cudaError_t err = cudaGetDeviceCount(&count); err != cudaSuccess) {
    return absl::StrCat(cudaGetErrorString(err), " (error ", static_cast<int>(err), ")");
  }
  if (count <= kDevice) return absl::StrCat("the runtime found ", count, " devices");
  return "";
}

class CudaE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string reason = NoDeviceReason(); !reason.empty()) {
      std::cout << "SKIPPED: no CUDA device (" << reason << ")" << std::endl;
      GTEST_SKIP() << "no usable CUDA device: " << reason;
    }
    ASSERT_TRUE(daemon_.Start(
        {absl::StrCat("--backend=", kBackend), absl::StrCat("--device=", kDevice),
         "--prefix_cache_budget_bytes=1GiB", "--prefix_block_tokens=16",
         absl::StrCat("--lease_timeout_ms=", kLeaseTimeoutMs), "--lease_grace_ms=200"}));
    absl::StatusOr<std::unique_ptr<KvClient>> checker = KvClient::Connect(socket_);
    ASSERT_THAT(checker, IsOk());
    checker_ = *std::move(checker);
    // The operators' view (per-engine status, the prefix listing): the admin socket.
    absl::StatusOr<std::unique_ptr<KvClient>> operator_client =
        KvClient::Connect(daemon_.admin_socket());
    ASSERT_THAT(operator_client, IsOk());
    operator_ = *std::move(operator_client);
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

  // A tests/e2e engine binary on this test's daemon and device.
  pid_t SpawnEngine(const std::string& binary, const std::vector<std::string>& extra) {
    std::vector<std::string> args = {Runfile("tests/e2e/" + binary), "--socket=" + socket_,
                                     absl::StrCat("--backend=", kBackend),
                                     absl::StrCat("--device=", kDevice)};
    args.insert(args.end(), extra.begin(), extra.end());
    return Spawn(args);
  }

  pid_t PrefixEngine(const std::string& mode, const std::string& plan, uint64_t tokens,
                     const std::string& out) {
    return SpawnEngine("prefix_engine", {"--mode=" + mode, "--plan=" + plan,
                                         absl::StrCat("--tokens=", tokens), "--out=" + out});
  }

  pb::ListPrefixesResponse List() {
    pb::ListPrefixesResponse response;
    EXPECT_THAT(FromGrpcStatus(ClientInternals::Prefix(*operator_).ListPrefixes(
                    ClientInternals::NewContext(*operator_).get(), {}, &response)),
                IsOk());
    return response;
  }

  DaemonProcess daemon_{"cuda"};  // stopped, its directory removed, after TearDown
  const std::string& dir_ = daemon_.dir();
  const std::string& socket_ = daemon_.socket();
  pid_t engine_a_ = -1;
  pid_t engine_b_ = -1;
  std::unique_ptr<KvClient> checker_;
  std::unique_ptr<KvClient> operator_;
};

TEST_F(CudaE2eTest, TwoEnginesBytesSpecRollbackReclaimAndDrain) {
  engine_a_ = SpawnEngine("test_engine", {"--name=engine-a", "--spec", "--out=" + dir_ + "/a"});
  engine_b_ = SpawnEngine("test_engine", {"--name=engine-b", "--work", "--out=" + dir_ + "/b",
                                          "--until=" + dir_ + "/b.stop"});
  ASSERT_TRUE(PollUntil([&] { return Exists(dir_ + "/a"); }, engine_a_));
  ASSERT_TRUE(PollUntil([&] { return Exists(dir_ + "/b"); }, engine_b_));

  // A's script (which checked itself, rollbacks included) wrapped the ring with rebase copies,
  // rewound, committed partially and rolled speculation back. This process maps A's arena over
  // IPC itself and checks A's bytes and the mirrors the daemon wrote.
  const Facts facts = ReadFacts(dir_ + "/a");
  {
    absl::StatusOr<EngineDevice> device = OpenEngineDevice(kBackend, kDevice);
    ASSERT_THAT(device, IsOk());
    ExpectScriptedSession(*checker_, facts, *device);
  }
  const pb::GetStatusResponse before = Status();
  EXPECT_EQ(before.backend(), kBackend);
  EXPECT_EQ(before.sessions(), 2u);
  ASSERT_NE(FindEngine(before, "engine-a"), nullptr);
  ASSERT_NE(FindEngine(before, "engine-b"), nullptr);
  const uint64_t b_bytes = FindEngine(before, "engine-b")->allocated_bytes();
  EXPECT_GT(b_bytes, 0u);

  // SIGKILL A: the stream breaks, and after the grace the daemon frees A's device memory.
  const absl::Time killed = absl::Now();
  ASSERT_EQ(kill(engine_a_, SIGKILL), 0);
  EXPECT_EQ(WaitExit(engine_a_), 128 + SIGKILL);
  engine_a_ = -1;
  ASSERT_TRUE(PollUntil([&] {
    const pb::GetStatusResponse now = Status();
    return FindEngine(now, "engine-a") == nullptr && now.sessions() == 1 && now.arena_count() == 1;
  }));
  std::printf("engine A reclaimed %s after SIGKILL (lease timeout %llu ms)\n",
              absl::FormatDuration(absl::Now() - killed).c_str(),
              static_cast<unsigned long long>(kLeaseTimeoutMs));
  EXPECT_EQ(Status().allocated_bytes(), b_bytes);

  // SIGTERM with B live: draining refuses new engines while B keeps working; B finishes (it
  // verifies its session once more and releases it), then the daemon exits 0, everything freed.
  ASSERT_TRUE(daemon_.Signal(SIGTERM));
  ASSERT_TRUE(PollUntil([&] {
    absl::StatusOr<pb::GetStatusResponse> status = ClientInternals::GetStatus(*checker_);
    return status.ok() && status->draining();
  }));
  absl::StatusOr<std::unique_ptr<KvClient>> late = KvClient::Connect(socket_);
  ASSERT_THAT(late, IsOk());
  EXPECT_THAT((*late)->Attach("late"), StatusIs(absl::StatusCode::kUnavailable,
                                                ::testing::HasSubstr("the daemon is draining")));
  late->reset();
  absl::SleepFor(absl::Milliseconds(200));  // B keeps running transactions while draining
  std::ofstream(dir_ + "/b.stop").put('\n');
  EXPECT_EQ(WaitExit(engine_b_), 0);
  engine_b_ = -1;
  checker_.reset();
  operator_.reset();
  EXPECT_EQ(daemon_.WaitExit(), 0);
  EXPECT_FALSE(Exists(socket_));
}

TEST_F(CudaE2eTest, PrefixCapturedInOneProcessRestoresInAnotherForEveryModelKind) {
  struct Kind {
    std::string plan;
    uint64_t tokens;
  };
  // swa: 4800 rows wrap the 4703-row ring before the capture.
  const std::vector<Kind> kinds = {{"flat", 96}, {"hybrid", 64}, {"swa", 4800}, {"latent", 80}};
  for (const Kind& kind : kinds) {
    SCOPED_TRACE(kind.plan);
    const std::string captured = absl::StrCat(dir_, "/", kind.plan, ".captured");
    EXPECT_EQ(WaitExit(PrefixEngine("capture", kind.plan, kind.tokens, captured)), 0);
    ASSERT_TRUE(Exists(captured));
    const std::string restored = absl::StrCat(dir_, "/", kind.plan, ".restored");
    EXPECT_EQ(WaitExit(PrefixEngine("restore", kind.plan, kind.tokens, restored)), 0);
    ASSERT_TRUE(Exists(restored));
  }
  const pb::ListPrefixesResponse listed = List();
  EXPECT_EQ(static_cast<uint64_t>(listed.entries_size()), kinds.size());
  EXPECT_EQ(listed.stats().restores(), kinds.size());
  EXPECT_EQ(listed.stats().tokens_restored(), 96u + 64u + 4800u + 80u);
  EXPECT_EQ(listed.stats().dropped_entries(), 0u);
}

// A holder with committed rows (and staged rows it overwrote) is SIGKILLed; the daemon captures
// the committed rows when it reclaims the session, and a new process restores them.
TEST_F(CudaE2eTest, AKilledEnginesCommittedConversationRestoresInANewProcess) {
  const std::string ready = dir_ + "/hold.ready";
  engine_a_ = PrefixEngine("hold", "flat", 64, ready);
  ASSERT_TRUE(PollUntil([&] { return Exists(ready); }, engine_a_)) << "the holder never got ready";
  EXPECT_EQ(List().entries_size(), 0);  // nothing captured while it lived
  ASSERT_EQ(kill(engine_a_, SIGKILL), 0);
  EXPECT_EQ(WaitExit(engine_a_), 128 + SIGKILL);
  engine_a_ = -1;
  ASSERT_TRUE(PollUntil([&] { return List().entries_size() == 1; }, daemon_.pid()));
  const pb::ListPrefixesResponse listed = List();
  EXPECT_EQ(listed.entries(0).boundary_tokens(), 64u);  // never the 16 staged rows
  EXPECT_EQ(listed.stats().death_captures(), 1u);
  const std::string restored = dir_ + "/death.restored";
  EXPECT_EQ(WaitExit(PrefixEngine("restore", "flat", 64, restored)), 0);
  EXPECT_TRUE(Exists(restored));
  EXPECT_EQ(Status().sessions(), 0u);
}

}  // namespace
}  // namespace memra::testing
