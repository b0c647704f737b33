// End to end, engines spanning GPUs (docs/groups.md): four real memra-kvd processes (four
// "GPUs" on the host backend) and group_engine processes over all four, as TP=4 and as
// TP=2 x PP=2. What each test proves:
//   - a TP=4 admission is all or nothing under a full rank: the refusal names rank 2, its
//     socket and its numbers, and no daemon holds anything of the group afterwards;
//   - a client SIGKILLed between reserve and confirm leaks nothing after the deadline, while
//     its lease is still in its (long) grace: the daemons free the PENDING ranks themselves;
//   - a TP=2 x PP=2 group prefix is found only when every rank holds it and restores on all
//     four ranks byte-identically in another process; a prefix one rank lacks is a group miss;
//   - a CreateSession from an unconfirmed group reservation is refused with the group named.
// Operators' views (ListGroupRanks, ListEngines) come from each daemon's admin socket.

#include <signal.h>

#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/internal.h"
#include "common/codec.h"
#include "common/grpc_status.h"
#include "core/test_model_plans.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/memra/kv/v1/admin.grpc.pb.h"
#include "proto/memra/kv/v1/group.grpc.pb.h"
#include "tests/daemon_process.h"
#include "tests/e2e/facts.h"
#include "tests/status_matchers.h"
#include "tests/subprocess.h"

namespace memra::testing {
namespace {

namespace pb = ::memra::kv::v1;
using ::testing::HasSubstr;

constexpr int kRanks = 4;

class GroupE2eTest : public ::testing::Test {
 protected:
  // Four daemons; `grace_ms` is every daemon's lease_grace_ms.
  void StartDaemons(int64_t grace_ms) {
    for (int r = 0; r < kRanks; ++r) {
      daemons_.push_back(std::make_unique<DaemonProcess>(absl::StrCat("grp", r)));
      ASSERT_TRUE(daemons_.back()->Start(
          {"--budget_bytes=64MiB", "--prefix_cache_budget_bytes=16MiB",
           "--prefix_block_tokens=16", "--lease_timeout_ms=2000",
           absl::StrCat("--lease_grace_ms=", grace_ms)}));
      absl::StatusOr<std::unique_ptr<KvClient>> op = KvClient::Connect(daemons_[r]->admin_socket());
      ASSERT_THAT(op, IsOk());
      operators_.push_back(*std::move(op));
    }
  }

  void TearDown() override {
    operators_.clear();
    for (auto& daemon : daemons_) {
      if (daemon->Signal(SIGTERM)) {
        EXPECT_EQ(daemon->WaitExit(), 0);
      }
    }
  }

  // A group file over the four daemons, rank r on daemon r.
  std::string GroupFile(uint32_t tp, uint32_t pp) {
    const std::string path = daemons_[0]->Path(absl::StrCat("tp", tp, "pp", pp, ".group"));
    std::ofstream file(path);
    file << "group test\ntp " << tp << "\npp " << pp << "\n";
    for (int r = 0; r < kRanks; ++r) file << "rank " << r << " " << daemons_[r]->socket() << "\n";
    return path;
  }

  // Runs group_engine to its exit; its facts.
  std::map<std::string, std::string> Engine(const std::string& group, const std::string& mode,
                                            std::vector<std::string> flags = {}) {
    const std::string out = daemons_[0]->Path(absl::StrCat(mode, ++engines_, ".facts"));
    std::vector<std::string> args = {Runfile("tests/e2e/group_engine"), "--group=" + group,
                                     "--mode=" + mode, "--out=" + out};
    args.insert(args.end(), flags.begin(), flags.end());
    const std::string log = out + ".log";
    const pid_t pid = Spawn(args, log, log);
    const int exit = WaitExit(pid, kPatience);
    std::ifstream text(log);
    EXPECT_EQ(exit, 0) << mode << " engine: " << std::string(std::istreambuf_iterator<char>(text), {});
    return ReadFacts(out);
  }

  // Daemon r's group reservations, as its operator lists them.
  std::vector<pb::GroupRankState> GroupRanks(int r) {
    pb::ListGroupRanksResponse response;
    EXPECT_THAT(FromGrpcStatus(ClientInternals::Group(*operators_[r]).ListGroupRanks(
                    ClientInternals::NewContext(*operators_[r]).get(), {}, &response)),
                IsOk());
    return {response.ranks().begin(), response.ranks().end()};
  }

  // Bytes daemon r's engines hold in reservations (KvAdmin.ListEngines).
  uint64_t ReservedBytes(int r) {
    pb::ListEnginesResponse response;
    EXPECT_THAT(FromGrpcStatus(ClientInternals::Admin(*operators_[r]).ListEngines(
                    ClientInternals::NewContext(*operators_[r]).get(), {}, &response)),
                IsOk());
    uint64_t bytes = 0;
    for (const pb::EngineStatus& engine : response.engines()) bytes += engine.reserved_bytes();
    return bytes;
  }

  std::vector<std::unique_ptr<DaemonProcess>> daemons_;
  std::vector<std::unique_ptr<KvClient>> operators_;
  int engines_ = 0;
};

uint64_t Number(const std::map<std::string, std::string>& facts, const std::string& key) {
  uint64_t value = 0;
  auto it = facts.find(key);
  EXPECT_TRUE(it != facts.end() && absl::SimpleAtoi(it->second, &value)) << key;
  return value;
}

TEST_F(GroupE2eTest, Tp4AdmissionIsAllOrNothingUnderAFullRank) {
  StartDaemons(/*grace_ms=*/100);
  const std::string group = GroupFile(4, 1);
  // Each rank's shard: 8 layers x (K + V) x 1 head x 64 x 2 bytes = 2 KiB a token.
  const std::map<std::string, std::string> fits =
      Engine(group, "admit", {"--capacity=4096"});
  ASSERT_EQ(fits.at("ok"), "1");
  const uint64_t shard = Number(fits, "bytes0");
  EXPECT_GT(shard, 0u);
  for (int r = 1; r < kRanks; ++r) EXPECT_EQ(Number(fits, absl::StrCat("bytes", r)), shard);
  EXPECT_EQ(Number(fits, "released"), shard * kRanks);

  // Rank 2 is full: another engine takes sessions of the shard's own shape on daemon 2 until
  // it is refused, so less than one shard is left there.
  absl::StatusOr<std::unique_ptr<KvClient>> hog = KvClient::Connect(daemons_[2]->socket());
  ASSERT_THAT(hog, IsOk());
  ASSERT_THAT((*hog)->Attach("hog"), IsOk());
  absl::StatusOr<PlanFingerprint> hog_plan =
      (*hog)->RegisterPlan(test_plans::DenseModel(8, 64, 4));
  ASSERT_THAT(hog_plan, IsOk());
  SessionOptions shard_shape;
  shard_shape.capacity = 4096;
  shard_shape.tp_ranks = 4;
  std::vector<std::unique_ptr<Session>> held;
  absl::Status hogged;
  while (hogged.ok() && held.size() < 64) {
    absl::StatusOr<std::unique_ptr<Session>> session =
        (*hog)->CreateSession(*hog_plan, shard_shape);
    if (session.ok()) {
      held.push_back(*std::move(session));
    } else {
      hogged = session.status();
    }
  }
  ASSERT_EQ(hogged.code(), absl::StatusCode::kResourceExhausted) << hogged;

  const std::map<std::string, std::string> refused =
      Engine(group, "admit", {"--capacity=4096"});
  EXPECT_EQ(refused.at("ok"), "0");
  EXPECT_EQ(refused.at("code"), "RESOURCE_EXHAUSTED");
  EXPECT_THAT(refused.at("message"), HasSubstr("rank 2/4 (" + daemons_[2]->socket() + ")"));
  EXPECT_THAT(refused.at("message"),
              HasSubstr(absl::StrCat("memra-kvd ", daemons_[2]->socket(), ": group 0x")));
  EXPECT_THAT(refused.at("message"), HasSubstr(absl::StrCat("needs ", shard, " bytes")));
  EXPECT_EQ(Number(refused, "needed"), shard);
  EXPECT_LT(Number(refused, "free"), shard);
  EXPECT_EQ(Number(refused, "budget"), uint64_t{64} << 20);
  // One answer: no daemon holds any of it, the refusing rank's neighbours included.
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_THAT(GroupRanks(r), ::testing::IsEmpty()) << "rank " << r;
    EXPECT_EQ(ReservedBytes(r), 0u) << "rank " << r;
  }

  // Room again on rank 2: the same request is a yes.
  ASSERT_THAT(held.back()->Release(), IsOk());
  EXPECT_EQ(Engine(group, "admit", {"--capacity=4096"}).at("ok"), "1");
}

TEST_F(GroupE2eTest, AClientKilledBetweenReserveAndConfirmLeaksNothingAfterTheDeadline) {
  // A grace far beyond the test: only the deadline can free the reservations.
  StartDaemons(/*grace_ms=*/600000);
  const std::string group = GroupFile(4, 1);
  const std::string out = daemons_[0]->Path("reserve.facts");
  const pid_t engine = Spawn({Runfile("tests/e2e/group_engine"), "--group=" + group,
                              "--mode=reserve", "--deadline_ms=1500", "--out=" + out});
  ASSERT_TRUE(PollUntil([&] { return Exists(out); }, engine));
  const std::map<std::string, std::string> facts = ReadFacts(out);
  KillAndReap(engine);
  const uint64_t group_id = Number(facts, "group_id");
  for (int r = 0; r < kRanks; ++r) {
    // The engine is dead but still known (in its grace); its rank may already be freed.
    std::vector<pb::GroupRankState> ranks = GroupRanks(r);
    ASSERT_LE(ranks.size(), 1u);
    if (!ranks.empty()) {
      EXPECT_EQ(ranks[0].group().group_id(), group_id);
      EXPECT_EQ(ranks[0].group().rank(), static_cast<uint32_t>(r));
      EXPECT_EQ(ranks[0].group().ranks(), 4u);
      EXPECT_EQ(ranks[0].phase(), pb::GROUP_RANK_PHASE_PENDING);
      EXPECT_EQ(ranks[0].bytes(), Number(facts, "bytes0"));
      EXPECT_EQ(ranks[0].daemon(), daemons_[r]->socket());
    }
  }
  // The state, not a time: every daemon frees the rank at its deadline by itself.
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_TRUE(PollUntil([&] { return GroupRanks(r).empty() && ReservedBytes(r) == 0; }))
        << "rank " << r << " still holds group " << group_id;
    pb::ListEnginesResponse engines;
    ASSERT_THAT(FromGrpcStatus(ClientInternals::Admin(*operators_[r]).ListEngines(
                    ClientInternals::NewContext(*operators_[r]).get(), {}, &engines)),
                IsOk());
    ASSERT_EQ(engines.engines_size(), 1) << "the killed engine is still in its grace";
    EXPECT_FALSE(engines.engines(0).lease_live());
  }
}

TEST_F(GroupE2eTest, Tp2Pp2GroupPrefixRestoresOnAllFourRanksByteIdentically) {
  StartDaemons(/*grace_ms=*/100);
  const std::string group = GroupFile(2, 2);
  const std::map<std::string, std::string> captured =
      Engine(group, "capture", {"--tokens=64", "--token_seed=1"});
  EXPECT_EQ(Number(captured, "committed"), 64u);

  const std::map<std::string, std::string> restored =
      Engine(group, "restore", {"--tokens=64", "--token_seed=1"});
  ASSERT_EQ(restored.at("ok"), "1") << restored.at("message");
  EXPECT_EQ(Number(restored, "matched"), 64u);
  EXPECT_EQ(Number(restored, "restored"), 64u);
  for (int r = 0; r < kRanks; ++r) EXPECT_EQ(Number(restored, absl::StrCat("committed", r)), 64u);
  EXPECT_EQ(restored.at("identical"), "1") << restored.at("mismatch");

  // Other tokens: a miss on every rank.
  const std::map<std::string, std::string> other =
      Engine(group, "restore", {"--tokens=64", "--token_seed=2"});
  EXPECT_EQ(Number(other, "matched"), 0u);
  EXPECT_EQ(other.at("code"), "NOT_FOUND");
  EXPECT_THAT(other.at("message"), HasSubstr("no prefix of the 64 tokens is held by all 4 ranks"));

  // Held by rank 0 only: a group miss, and nothing restored anywhere.
  Engine(group, "capture0", {"--tokens=64", "--token_seed=3"});
  const std::map<std::string, std::string> partial =
      Engine(group, "restore", {"--tokens=64", "--token_seed=3"});
  EXPECT_EQ(Number(partial, "matched"), 0u);
  EXPECT_EQ(partial.at("code"), "NOT_FOUND");
}

TEST_F(GroupE2eTest, AnUnconfirmedGroupReservationCreatesNoSessionAndRefusalsNameTheRank) {
  StartDaemons(/*grace_ms=*/100);
  absl::StatusOr<std::unique_ptr<KvClient>> engine = KvClient::Connect(daemons_[1]->socket());
  ASSERT_THAT(engine, IsOk());
  ASSERT_THAT((*engine)->Attach("raw"), IsOk());
  absl::StatusOr<PlanFingerprint> plan = (*engine)->RegisterPlan(test_plans::DenseModel(8, 64, 4));
  ASSERT_THAT(plan, IsOk());
  absl::StatusOr<pb::EngineRef> ref = ClientInternals::Engine(**engine);
  ASSERT_THAT(ref, IsOk());
  auto reserve = [&](uint64_t group_id, uint32_t rank, uint32_t ranks, uint64_t deadline_ms,
                     uint64_t expected, pb::GroupRankState* state) {
    pb::ReserveGroupRankRequest request;
    *request.mutable_engine() = *ref;
    request.mutable_group()->set_group_id(group_id);
    request.mutable_group()->set_rank(rank);
    request.mutable_group()->set_ranks(ranks);
    request.set_plan_fingerprint(FingerprintToBytes(*plan));
    request.set_capacity(1024);
    request.set_tp_ranks(4);
    request.set_deadline_ms(deadline_ms);
    request.set_expected_bytes(expected);
    return FromGrpcStatus(ClientInternals::Group(**engine).ReserveGroupRank(
        ClientInternals::NewContext(**engine).get(), request, state));
  };
  const std::string daemon = absl::StrCat("memra-kvd ", daemons_[1]->socket(), ": ");
  pb::GroupRankState state;
  EXPECT_THAT(reserve(7, 4, 4, 1000, 0, &state),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs(daemon + "group 0x7 rank 4/4", "ranks in [1, 1024]")));
  EXPECT_THAT(reserve(7, 1, 4, 600001, 0, &state),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("deadline 600001 ms outside [1, 600000] ms")));
  EXPECT_THAT(reserve(7, 1, 4, 1000, 12345, &state),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs(daemon + "group 0x7 rank 1/4: this daemon prices the shard",
                                  "the group client expected 12345")));
  ASSERT_THAT(reserve(7, 1, 4, 600000, 0, &state), IsOk());
  EXPECT_EQ(state.phase(), pb::GROUP_RANK_PHASE_PENDING);
  EXPECT_GT(state.deadline_ms_left(), 0u);
  const uint64_t shard = state.bytes();
  EXPECT_THAT(reserve(7, 1, 4, 1000, 0, &state),
              StatusIs(absl::StatusCode::kAlreadyExists,
                       HasSubstrs(daemon, "already holds group 0x7 rank 1/4",
                                  absl::StrCat(shard, " bytes"))));

  SessionOptions options;
  options.capacity = 1024;
  options.tp_ranks = 4;
  options.reservation_id = state.reservation_id();
  EXPECT_THAT((*engine)->CreateSession(*plan, options),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs(absl::StrCat("reservation ", state.reservation_id(),
                                               " is group 0x7 rank 1/4, not confirmed"))));
  pb::GroupRankRequest rank;
  *rank.mutable_engine() = *ref;
  rank.set_group_id(7);
  ASSERT_THAT(FromGrpcStatus(ClientInternals::Group(**engine).ConfirmGroupRank(
                  ClientInternals::NewContext(**engine).get(), rank, &state)),
              IsOk());
  EXPECT_EQ(state.phase(), pb::GROUP_RANK_PHASE_CONFIRMED);
  EXPECT_EQ(state.deadline_ms_left(), 0u);
  EXPECT_THAT((*engine)->CreateSession(*plan, options), IsOk());
  EXPECT_THAT(FromGrpcStatus(ClientInternals::Group(**engine).GetGroupRank(
                  ClientInternals::NewContext(**engine).get(), rank, &state)),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstrs(daemon + "group 0x7: engine", "holds no reservation")));
  // The listing is the operators': refused on the engine socket.
  pb::ListGroupRanksResponse listing;
  EXPECT_THAT(FromGrpcStatus(ClientInternals::Group(**engine).ListGroupRanks(
                  ClientInternals::NewContext(**engine).get(), {}, &listing)),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstrs("KvGroup.ListGroupRanks", daemons_[1]->admin_socket())));
  // And the engine calls are the engine socket's: not served on the admin socket.
  EXPECT_THAT(FromGrpcStatus(ClientInternals::Group(*operators_[1]).GetGroupRank(
                  ClientInternals::NewContext(*operators_[1]).get(), rank, &state)),
              StatusIs(absl::StatusCode::kUnimplemented,
                       HasSubstrs("KvGroup.GetGroupRank is an engine call")));
}

}  // namespace
}  // namespace memra::testing
