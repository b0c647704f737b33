// A daemon SIGKILLed mid-group (docs/groups.md#daemon-restart): four real memra-kvd, each under
// the real memra-kv-supervise, and TP=4 group_engine processes over them. Rank 2's daemon is
// SIGKILLed while one engine holds a PENDING group reservation on every rank and another a
// group session with committed rows. The supervisor restarts it and it re-adopts the engines
// and the session (not the reservation: group reservations are not journaled). Then:
//   - the reserving engine's Confirm is refused naming rank 2 (its reservation was lost in the
//     restart), the group client releases every other rank, and no daemon holds any of it;
//   - the session engine carries on: it commits more rows on all four ranks, every rank's
//     length agrees and every rank's bytes are what it wrote, rank 2's through the restart.

#include <signal.h>

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/internal.h"
#include "common/grpc_status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/memra/kv/v1/group.grpc.pb.h"
#include "tests/e2e/facts.h"
#include "tests/restart/supervised_daemon.h"
#include "tests/subprocess.h"

namespace memra::testing {
namespace {

namespace pb = ::memra::kv::v1;
using ::testing::HasSubstr;

constexpr int kRanks = 4;
constexpr int kKilledRank = 2;

std::string Log(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Daemon `daemon`'s group reservations (ListGroupRanks on its admin socket); nullopt when it
// does not answer.
std::optional<int> GroupRankCount(SupervisedDaemon& daemon) {
  ClientOptions options;
  options.deadline = absl::Milliseconds(500);
  absl::StatusOr<std::unique_ptr<KvClient>> admin = KvClient::Connect(daemon.admin_socket(), options);
  if (!admin.ok()) return std::nullopt;
  pb::ListGroupRanksResponse response;
  if (!FromGrpcStatus(ClientInternals::Group(**admin).ListGroupRanks(
                          ClientInternals::NewContext(**admin).get(), {}, &response))
           .ok()) {
    return std::nullopt;
  }
  return response.ranks_size();
}

TEST(GroupRestart, ADaemonKilledMidGroupLosesTheReservationButNotTheGroupSession) {
  std::vector<std::unique_ptr<SupervisedDaemon>> daemons;
  for (int r = 0; r < kRanks; ++r) {
    daemons.push_back(std::make_unique<SupervisedDaemon>(absl::StrCat("grs", r)));
    ASSERT_TRUE(daemons.back()->Start({"--lease_timeout_ms=5000", "--lease_grace_ms=2000",
                                       "--prefix_cache_budget_bytes=0", "--budget_bytes=64MiB"}));
  }
  const std::string group = daemons[0]->Path("tp4.group");
  {
    std::ofstream file(group);
    file << "group restart\ntp 4\npp 1\n";
    for (int r = 0; r < kRanks; ++r) file << "rank " << r << " " << daemons[r]->socket() << "\n";
  }
  auto engine = [&](const std::string& mode) {
    return Spawn({Runfile("tests/e2e/group_engine"), "--group=" + group, "--mode=" + mode,
                  "--tokens=32", "--deadline_ms=600000",
                  "--ready=" + daemons[0]->Path(mode + ".ready"),
                  "--until=" + daemons[0]->Path("go"), "--out=" + daemons[0]->Path(mode + ".facts")},
                 "", daemons[0]->Path(mode + ".log"));
  };
  const std::vector<std::string> modes = {"restart-reserve", "restart-session"};
  std::vector<pid_t> engines;
  for (const std::string& mode : modes) engines.push_back(engine(mode));
  for (size_t i = 0; i < modes.size(); ++i) {
    ASSERT_TRUE(PollUntil([&] { return Exists(daemons[0]->Path(modes[i] + ".ready")); },
                          engines[i]))
        << Log(daemons[0]->Path(modes[i] + ".log"));
  }
  for (int r = 0; r < kRanks; ++r) EXPECT_EQ(GroupRankCount(*daemons[r]), 1) << "rank " << r;

  ASSERT_TRUE(daemons[kKilledRank]->KillDaemonAndAwaitRestart())
      << Log(daemons[kKilledRank]->Path("supervise.log"));
  // Re-adopted: both engines and the session; not the group reservation.
  EXPECT_EQ(GroupRankCount(*daemons[kKilledRank]), 0);
  absl::StatusOr<pb::GetStatusResponse> after = daemons[kKilledRank]->Status();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->sessions(), 1u);
  // Both engines re-attach to the restarted daemon (the state the engines go on from).
  ASSERT_TRUE(PollUntil([&] {
    absl::StatusOr<pb::ListEnginesResponse> known = daemons[kKilledRank]->Engines();
    if (!known.ok() || known->engines_size() != 2) return false;
    for (const auto& engine : known->engines()) {
      if (engine.awaiting_reattach() || !engine.lease_live()) return false;
    }
    return true;
  })) << Log(daemons[kKilledRank]->Path("supervise.log.out"));
  std::ofstream(daemons[0]->Path("go")) << "go\n";

  for (size_t i = 0; i < modes.size(); ++i) {
    EXPECT_EQ(WaitExit(engines[i]), 0) << Log(daemons[0]->Path(modes[i] + ".log"));
  }
  const auto refused = ReadFacts(daemons[0]->Path("restart-reserve.facts"));
  EXPECT_EQ(refused.at("ok"), "0");
  EXPECT_EQ(refused.at("code"), "NOT_FOUND");
  EXPECT_THAT(refused.at("message"),
              HasSubstr(absl::StrCat("rank 2/4 (", daemons[kKilledRank]->socket(), ")")));
  EXPECT_THAT(refused.at("message"), HasSubstr("lost in a daemon restart"));
  // One answer: the confirmed ranks 0 and 1 and the pending rank 3 were released.
  for (int r = 0; r < kRanks; ++r) EXPECT_EQ(GroupRankCount(*daemons[r]), 0) << "rank " << r;

  const auto carried_on = ReadFacts(daemons[0]->Path("restart-session.facts"));
  EXPECT_EQ(Number(carried_on, "ok"), 1u);
  EXPECT_EQ(Number(carried_on, "committed"), 64u);
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(Number(carried_on, absl::StrCat("committed", r)), 64u) << "rank " << r;
  }
  EXPECT_GE(Number(carried_on, "reattaches2"), 1u);
  EXPECT_EQ(Number(carried_on, "reattaches0"), 0u);
  EXPECT_EQ(carried_on.at("identical"), "1") << carried_on.at("mismatch");
}

}  // namespace
}  // namespace memra::testing
