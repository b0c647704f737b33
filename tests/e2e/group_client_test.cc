// The group client's per-operation guarantees (client/group.h, docs/groups.md#group-sessions)
// against two real memra-kvd processes (a TP=2 group on the host backend): a rank's refusal
// leaves the group as it was where the table says so, and names the rank, its socket and the
// ranks left moved. A refusal on one rank only is made by tainting that rank's session, the
// divergence the table is about.

#include <signal.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/group.h"
#include "client/group_file.h"
#include "core/admission.h"
#include "core/test_model_plans.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/daemon_process.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::DaemonProcess;
using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::IsEmpty;

class GroupClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int r = 0; r < 2; ++r) {
      daemons_.push_back(std::make_unique<DaemonProcess>(absl::StrCat("gc", r)));
      ASSERT_TRUE(daemons_.back()->Start({"--budget_bytes=32MiB", "--lease_grace_ms=100"}));
    }
    GroupShape shape;
    shape.tp = 2;
    absl::StatusOr<GroupFile> file = GroupFromSockets(
        "tp2", shape, {daemons_[0]->socket(), daemons_[1]->socket()}, "--socket");
    ASSERT_THAT(file, IsOk());
    absl::StatusOr<std::unique_ptr<GroupClient>> group = GroupClient::Connect(*file);
    ASSERT_THAT(group, IsOk());
    group_ = *std::move(group);
    absl::StatusOr<GroupPlan> plan = group_->RegisterPlan(test_plans::DenseModel(4, 64, 4));
    ASSERT_THAT(plan, IsOk());
    plan_ = *plan;
  }

  void TearDown() override {
    group_.reset();
    for (auto& daemon : daemons_) {
      if (daemon->Signal(SIGTERM)) {
        EXPECT_EQ(daemon->WaitExit(), 0);
      }
    }
  }

  // A group session with `rows` rows committed on both ranks.
  std::unique_ptr<GroupSession> SessionWith(uint64_t rows) {
    absl::StatusOr<std::unique_ptr<GroupSession>> session = group_->CreateSession(plan_, 256);
    EXPECT_THAT(session, IsOk());
    if (!session.ok()) return nullptr;
    if (rows > 0) {
      absl::StatusOr<GroupTransaction> transaction = (*session)->Begin();
      EXPECT_THAT(transaction, IsOk());
      EXPECT_THAT((*session)->PrepareAppend(*transaction, rows), IsOk());
      EXPECT_THAT((*session)->PublishAppend(*transaction), IsOk());
      EXPECT_THAT((*session)->Commit(*transaction, rows), IsOk());
    }
    return *std::move(session);
  }

  std::string RankOne() const {
    return absl::StrCat("rank 1/2 (", daemons_[1]->socket(), "): ");
  }

  std::vector<std::unique_ptr<DaemonProcess>> daemons_;
  std::unique_ptr<GroupClient> group_;
  GroupPlan plan_;
};

TEST_F(GroupClientTest, ACommitRefusedOnRankOneRewindsRankZeroToTheBase) {
  std::unique_ptr<GroupSession> session = SessionWith(8);
  ASSERT_NE(session, nullptr);
  absl::StatusOr<GroupTransaction> transaction = session->Begin();
  ASSERT_THAT(transaction, IsOk());
  EXPECT_EQ(transaction->base_len, 8u);
  ASSERT_THAT(session->PrepareAppend(*transaction, 4), IsOk());
  ASSERT_THAT(session->PublishAppend(*transaction), IsOk());
  ASSERT_THAT(session->rank(1).Taint("test: rank 1 diverges"), IsOk());
  EXPECT_THAT(session->Commit(*transaction, 4),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs(RankOne(), "[ranks left moved: none]")));
  EXPECT_THAT(session->moved_ranks(), IsEmpty());
  // Rank 0 committed, then was rewound: back at the base, no transaction open.
  absl::StatusOr<SessionSnapshot> rank0 = session->rank(0).State();
  ASSERT_THAT(rank0, IsOk());
  EXPECT_EQ(rank0->committed_len, 8u);
  EXPECT_EQ(rank0->active_generation, 0u);
}

TEST_F(GroupClientTest, ABeginRefusedOnRankOneAbortsRankZeroAgain) {
  std::unique_ptr<GroupSession> session = SessionWith(8);
  ASSERT_NE(session, nullptr);
  ASSERT_THAT(session->rank(1).Taint("test: rank 1 diverges"), IsOk());
  EXPECT_THAT(session->Begin(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                         HasSubstrs(RankOne(), "[ranks left moved: none]")));
  absl::StatusOr<SessionSnapshot> rank0 = session->rank(0).State();
  ASSERT_THAT(rank0, IsOk());
  EXPECT_EQ(rank0->active_generation, 0u);
  EXPECT_EQ(rank0->committed_len, 8u);
}

TEST_F(GroupClientTest, ARewindNoRankCanReachMovesNothingAndASpecRollbackNamesTheMovedRanks) {
  std::unique_ptr<GroupSession> session = SessionWith(8);
  ASSERT_NE(session, nullptr);
  // Past the committed rows: no rank can rewind there, so none is asked to.
  EXPECT_THAT(session->Rewind(9), StatusIs(absl::StatusCode::kFailedPrecondition,
                                           HasSubstrs("rank 0/2", "cannot rewind to 9 rows")));
  EXPECT_THAT(session->Rewind(4), ::memra::testing::IsOkAndHolds(4u));
  ASSERT_THAT(session->rank(1).Taint("test: rank 1 diverges"), IsOk());
  // Rank 0 rewinds, rank 1 refuses: rank 0 is named as moved.
  EXPECT_THAT(session->Rewind(2), StatusIs(absl::StatusCode::kFailedPrecondition,
                                           HasSubstrs(RankOne(), "[ranks left moved: 0]")));
  EXPECT_THAT(session->moved_ranks(), ElementsAre(0u));
}

TEST_F(GroupClientTest, AnAdmissionRefusedOnRankOneHoldsNothingAndKeepsItsNumbers) {
  // Rank 1 full: another engine takes sessions of the shard's own shape there until refused.
  absl::StatusOr<std::unique_ptr<KvClient>> hog = KvClient::Connect(daemons_[1]->socket());
  ASSERT_THAT(hog, IsOk());
  ASSERT_THAT((*hog)->Attach("hog"), IsOk());
  absl::StatusOr<PlanFingerprint> hog_plan = (*hog)->RegisterPlan(test_plans::DenseModel(4, 64, 4));
  ASSERT_THAT(hog_plan, IsOk());
  std::vector<std::unique_ptr<Session>> held;
  SessionOptions chunk;
  chunk.capacity = 1024;
  chunk.tp_ranks = 2;
  while (held.size() < 256) {
    absl::StatusOr<std::unique_ptr<Session>> session = (*hog)->CreateSession(*hog_plan, chunk);
    if (!session.ok()) break;
    held.push_back(*std::move(session));
  }
  absl::StatusOr<std::vector<uint64_t>> prices = group_->Price(plan_, 1024);
  ASSERT_THAT(prices, IsOk());
  absl::StatusOr<GroupAdmission> refused = group_->Admit(plan_, 1024);
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kResourceExhausted,
                                HasSubstrs(RankOne(), absl::StrCat("memra-kvd ",
                                                                   daemons_[1]->socket(), ": group 0x"),
                                           absl::StrCat("needs ", (*prices)[1], " bytes"))));
  std::optional<AdmissionRefusal> numbers = GetAdmissionRefusal(refused.status());
  ASSERT_TRUE(numbers.has_value());
  EXPECT_EQ(numbers->needed, (*prices)[1]);
  EXPECT_LT(numbers->free, numbers->needed);
  EXPECT_EQ(numbers->budget, uint64_t{32} << 20);
  // Rank 0 reserved first and was released: it holds its whole budget free again (the shard
  // fits there, so a second admission of rank 0 alone would succeed).
  absl::StatusOr<SessionReservation> alone =
      group_->rank(0).Reserve(plan_.fingerprint, [&] {
        SessionOptions options;
        options.capacity = 1024;
        options.tp_ranks = 2;
        return options;
      }());
  ASSERT_THAT(alone, IsOk());
  EXPECT_EQ(alone->bytes, (*prices)[0]);
}

}  // namespace
}  // namespace memra
