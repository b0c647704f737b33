// memra-kvctl over a group of daemons, end to end: four real memra-kvd processes (host backend,
// four "GPUs" with different budgets) and the real memra-kvctl binary. Every rank's numbers are
// checked against what that daemon answers on its own for the rank's shard (memra-kvctl's
// single-daemon query with --layers and --tp), never against figures worked out here.

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "client/group.h"
#include "client/group_file.h"
#include "core/group_layout.h"
#include "core/test_model_plans.h"
#include "proto/memra/kv/v1/admin.pb.h"
#include "tests/daemon_process.h"
#include "tests/status_matchers.h"
#include "tests/subprocess.h"
#include "tools/kvctl_process.h"

namespace memra::kvctl {
namespace {

namespace pb = ::memra::kv::v1;
using ::memra::testing::HasSubstrs;
using ::memra::testing::Runfile;
using ::testing::ContainsRegex;
using ::testing::HasSubstr;

constexpr char kLlamaConfig[] = "tests/data/hf_configs/llama-3.1-8b.json";
constexpr int kRanks = 4;
// Rank r's budget: 256 MiB + r x 64 MiB, so rank 0 is always the tightest.
uint64_t BudgetOf(int rank) { return (uint64_t{256} + 64 * rank) << 20; }

using Outcome = ::memra::testing::KvctlOutcome;

class KvctlGroupE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int rank = 0; rank < kRanks; ++rank) {
      daemons_.push_back(std::make_unique<testing::DaemonProcess>(absl::StrCat("kvctl-g", rank)));
      ASSERT_TRUE(daemons_.back()->Start(
          {absl::StrCat("--budget_bytes=", BudgetOf(rank)), "--backend=host"}));
    }
  }

  Outcome Kvctl(std::vector<std::string> args) {
    return ::memra::testing::RunKvctlBinary(std::move(args), daemons_[0]->dir());
  }

  // One daemon's own answer, parsed from --json.
  template <typename Response>
  Response Single(int rank, std::vector<std::string> args) {
    args.push_back("--socket=" + daemons_[rank]->admin_socket());
    args.push_back("--json");
    const Outcome outcome = Kvctl(args);
    Response response;
    EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(outcome.out, &response).ok())
        << absl::StrJoin(args, " ") << ": " << outcome.out << outcome.err;
    return response;
  }

  // The rank answers of a group --json, each as the daemon's response type.
  template <typename Response>
  std::vector<Response> GroupAnswers(const Outcome& outcome) {
    google::protobuf::Struct group;
    EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(outcome.out, &group).ok())
        << outcome.out << outcome.err;
    std::vector<Response> answers;
    for (const google::protobuf::Value& rank : group.fields().at("ranks").list_value().values()) {
      std::string json;
      EXPECT_TRUE(google::protobuf::util::MessageToJsonString(
                      rank.struct_value().fields().at("answer"), &json)
                      .ok());
      Response response;
      EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(json, &response).ok()) << json;
      answers.push_back(response);
    }
    return answers;
  }

  // A TP 2 x PP 2 group file over the four daemons (rank 0 names its admin socket too).
  std::string GroupFile(const std::string& last_socket = "") {
    std::string text = "# kvctl group e2e\ngroup e2e\ntp 2\npp 2\n";
    for (int rank = 0; rank < kRanks; ++rank) {
      const std::string socket = rank == kRanks - 1 && !last_socket.empty()
                                     ? last_socket
                                     : daemons_[rank]->socket();
      absl::StrAppend(&text, "rank ", rank, " ", socket,
                      rank == 0 ? " " + daemons_[0]->admin_socket() : "", "\n");
    }
    const std::string path = daemons_[0]->dir() + "/e2e.group";
    std::ofstream(path) << text;
    return path;
  }

  std::vector<std::unique_ptr<testing::DaemonProcess>> daemons_;
};

TEST_F(KvctlGroupE2eTest, StatusShowsEveryRankAndTheLeastFree) {
  std::vector<std::string> admin_sockets;
  for (const auto& daemon : daemons_) admin_sockets.push_back(daemon->admin_socket());
  const std::string sockets = "--socket=" + absl::StrJoin(admin_sockets, ",");
  const Outcome human = Kvctl({"status", sockets});
  EXPECT_EQ(human.exit_code, 0) << human.err;
  EXPECT_THAT(human.out,
              HasSubstrs("group cli: tp 4 x pp 1 = 4 ranks\n",
                         absl::StrCat("least free       ", BudgetOf(0), " (rank 0) B"),
                         admin_sockets[3]));
  const Outcome json = Kvctl({"status", sockets, "--json"});
  EXPECT_EQ(json.exit_code, 0) << json.err;
  const std::vector<pb::GetStatusResponse> ranks = GroupAnswers<pb::GetStatusResponse>(json);
  ASSERT_EQ(ranks.size(), 4u);
  for (int rank = 0; rank < kRanks; ++rank) {
    EXPECT_EQ(ranks[rank].admission().budget_bytes(), BudgetOf(rank)) << rank;
    EXPECT_EQ(ranks[rank].backend(), "host");
  }
}

TEST_F(KvctlGroupE2eTest, StatusShowsAGroupReservationOnEveryRank) {
  std::vector<std::string> sockets;
  std::vector<std::string> admin_sockets;
  for (const auto& daemon : daemons_) {
    sockets.push_back(daemon->socket());
    admin_sockets.push_back(daemon->admin_socket());
  }
  GroupShape shape;
  shape.tp = 2;
  shape.pp = 2;
  absl::StatusOr<::memra::GroupFile> file = GroupFromSockets("held", shape, sockets, "test");
  ASSERT_TRUE(file.ok()) << file.status();
  absl::StatusOr<std::unique_ptr<GroupClient>> group = GroupClient::Connect(*file);
  ASSERT_TRUE(group.ok()) << group.status();
  absl::StatusOr<GroupPlan> plan = (*group)->RegisterPlan(test_plans::DenseModel(4, 128, 8));
  ASSERT_TRUE(plan.ok()) << plan.status();
  absl::StatusOr<GroupAdmission> admission = (*group)->Reserve(*plan, 1024);
  ASSERT_TRUE(admission.ok()) << admission.status();

  const Outcome human = Kvctl({"status", "--socket=" + absl::StrJoin(admin_sockets, ",")});
  EXPECT_EQ(human.exit_code, 0) << human.err;
  for (int rank = 0; rank < kRanks; ++rank) {
    EXPECT_THAT(human.out, HasSubstr(absl::StrCat("1 pending (", admission->bytes[rank], " B)  ",
                                                  admin_sockets[rank], "\n")))
        << rank;
  }
  // The engine sockets do not list group reservations (the operators' call): "-".
  const Outcome engine_side = Kvctl({"status", "--socket=" + absl::StrJoin(sockets, ",")});
  EXPECT_EQ(engine_side.exit_code, 0) << engine_side.err;
  EXPECT_THAT(engine_side.out, ContainsRegex(absl::StrCat("  -  +", sockets[0], "\n")));

  ASSERT_TRUE((*group)->Confirm(*admission).ok());
  const Outcome confirmed = Kvctl({"status", "--socket=" + absl::StrJoin(admin_sockets, ",")});
  EXPECT_THAT(confirmed.out,
              HasSubstr(absl::StrCat("1 confirmed (", admission->bytes[3], " B)  ",
                                     admin_sockets[3], "\n")));
  ASSERT_TRUE((*group)->Release(*admission).ok());
}

TEST_F(KvctlGroupE2eTest, FitAndMaxContextPriceEachRanksShardOnItsOwnDaemon) {
  const std::string model = "--hf-config=" + Runfile(kLlamaConfig);
  const std::string group = "--group=" + GroupFile();
  const Outcome fit = Kvctl({"fit", group, model, "--context=4k", "--json"});
  EXPECT_EQ(fit.exit_code, 0) << fit.err;
  const std::vector<pb::FitResponse> fits = GroupAnswers<pb::FitResponse>(fit);
  ASSERT_EQ(fits.size(), 4u);
  const std::vector<std::string> layers = {"--layers=0:16", "--layers=0:16", "--layers=16:32",
                                           "--layers=16:32"};
  for (int rank = 0; rank < kRanks; ++rank) {
    // What this daemon says alone about stage rank / 2's layers and half the heads.
    const auto own = Single<pb::FitResponse>(rank, {"fit", model, "--context=4k", layers[rank],
                                                    "--tp=2"});
    EXPECT_EQ(fits[rank].session_bytes(), own.session_bytes()) << rank;
    EXPECT_EQ(fits[rank].sessions_now(), own.sessions_now()) << rank;
    EXPECT_EQ(fits[rank].budget_bytes(), BudgetOf(rank)) << rank;
  }
  // Half the heads of half the layers: a quarter of the whole model's K/V per rank.
  const auto whole = Single<pb::CostResponse>(0, {"cost", model, "--context=4k"});
  const auto shard = Single<pb::CostResponse>(0, {"cost", model, "--context=4k",
                                                  "--layers=0:16", "--tp=2"});
  EXPECT_EQ(shard.breakdown().kv_bytes_per_token() * 4, whole.breakdown().kv_bytes_per_token());
  EXPECT_EQ(fits[0].session_bytes(), shard.arena_bytes());

  const Outcome human = Kvctl({"fit", group, model, "--context=4k"});
  EXPECT_EQ(human.exit_code, 0) << human.err;
  EXPECT_THAT(human.out, HasSubstrs("group e2e: tp 2 x pp 2 = 4 ranks\n", "LAYERS  HEADS",
                                    "   2      1   0  16-31   1/2"));
  EXPECT_THAT(human.out,
              ContainsRegex(absl::StrCat("\nsessions +", fits[0].sessions_now(), " \\(rank 0\\)")));

  const Outcome max = Kvctl({"max-context", group, model, "--json"});
  EXPECT_EQ(max.exit_code, 0) << max.err;
  const std::vector<pb::MaxContextResponse> maxes = GroupAnswers<pb::MaxContextResponse>(max);
  ASSERT_EQ(maxes.size(), 4u);
  for (int rank = 0; rank < kRanks; ++rank) {
    const auto own = Single<pb::MaxContextResponse>(rank, {"max-context", model, layers[rank],
                                                           "--tp=2"});
    EXPECT_EQ(maxes[rank].max_context_now(), own.max_context_now()) << rank;
  }
  EXPECT_LT(maxes[0].max_context_now(), maxes[1].max_context_now());
  const Outcome max_human = Kvctl({"max-context", group, model});
  EXPECT_THAT(max_human.out, ContainsRegex(absl::StrCat("\nmax context +",
                                                       maxes[0].max_context_now(),
                                                       " \\(rank 0\\)")));

  // A context that fits on every rank but rank 0: the group fits nothing (exit 5).
  const std::string past_rank0 = absl::StrCat("--context=", maxes[0].max_context_now() + 1);
  const Outcome tight = Kvctl({"fit", group, model, past_rank0, "--json"});
  EXPECT_EQ(tight.exit_code, 5) << tight.err;
  const std::vector<pb::FitResponse> tight_fits = GroupAnswers<pb::FitResponse>(tight);
  ASSERT_EQ(tight_fits.size(), 4u);
  EXPECT_EQ(tight_fits[0].sessions_now(), 0u);
  EXPECT_GE(tight_fits[1].sessions_now(), 1u);
}

TEST_F(KvctlGroupE2eTest, ALayoutTheModelCannotTakeIsAUsageError) {
  std::vector<std::string> sockets;
  for (int rank = 0; rank < 3; ++rank) sockets.push_back(daemons_[rank]->socket());
  const Outcome outcome = Kvctl({"max-context", "--socket=" + absl::StrJoin(sockets, ","),
                                 "--hf-config=" + Runfile(kLlamaConfig)});
  EXPECT_EQ(outcome.exit_code, 2) << outcome.err;
  EXPECT_THAT(outcome.err,
              HasSubstrs("memra-kvctl: group cli (tp 3 x pp 1) cannot hold ",
                         "layer 0 of stage 0 (layers [0, 32)): n_head_kv 8 is not divisible by "
                         "tp 3"));
}

TEST_F(KvctlGroupE2eTest, AnUnreachableRankIsNamedAndTheGroupHasNoAnswer) {
  const std::string missing = daemons_[0]->dir() + "/no-such.sock";
  const Outcome outcome = Kvctl({"fit", "--group=" + GroupFile(missing),
                                 "--hf-config=" + Runfile(kLlamaConfig), "--context=1k"});
  EXPECT_EQ(outcome.exit_code, 3) << outcome.err;
  EXPECT_THAT(outcome.err, HasSubstrs(absl::StrCat("cannot reach memra-kvd at unix:", missing),
                                      "(rank 3 of group e2e: the group has no answer)"));
  EXPECT_EQ(outcome.out, "");
}

}  // namespace
}  // namespace memra::kvctl
