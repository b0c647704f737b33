#include "server/session/engine_leases.h"

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/base/clock.h"
#include "server/device/device_budget.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;
using ::testing::_;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;

constexpr absl::Duration kTimeout = absl::Milliseconds(1000);
constexpr absl::Duration kGrace = absl::Milliseconds(500);
constexpr absl::Duration kReservationTtl = absl::Milliseconds(2000);

class EngineLeasesTest : public ::testing::Test {
 protected:
  // Attaches an engine whose stream cancellations are counted in `cancels`.
  EngineLease AttachCounting(const std::string& name, int* cancels) {
    absl::StatusOr<EngineLease> lease = leases_.Attach(
        EngineIdentity{.name = name,
                       .peer = {.uid = 1000, .gid = 100, .pid = 42},
                       .cache_scope = "uid:1000"},
        [cancels] { ++*cancels; });
    EXPECT_THAT(lease, IsOk());
    return lease.ok() ? *lease : EngineLease{};
  }
  static EngineCredentials Credentials(const EngineLease& lease) {
    return EngineCredentials{lease.id, lease.token};
  }
  // The handoff connection a re-attach of AttachCounting's user comes with (a new pid).
  static constexpr PeerCredentials kSameUser{.uid = 1000, .gid = 100, .pid = 43};
  static EngineIdentity Kept(const std::string& name) {
    return EngineIdentity{.name = name,
                          .peer = {.uid = 1000, .gid = 100, .pid = 42},
                          .cache_scope = "uid:1000"};
  }

  FakeClock clock_;
  DeviceBudget budget_{uint64_t{1} << 20, "test"};
  EngineLeases leases_{&clock_, &budget_, LeaseSettings{kTimeout, kGrace, kReservationTtl}};
};

TEST_F(EngineLeasesTest, AttachHandsOutDistinctIdsAndSecretTokens) {
  int cancels = 0;
  const EngineLease a = AttachCounting("a", &cancels);
  const EngineLease b = AttachCounting("b", &cancels);
  EXPECT_NE(a.id.value, b.id.value);
  EXPECT_EQ(a.token.size(), 16u);
  EXPECT_NE(a.token, b.token);
  EXPECT_EQ(a.timeout, kTimeout);
  EXPECT_EQ(a.grace, kGrace);
  EXPECT_THAT(leases_.Check(Credentials(a)), IsOk());
  EXPECT_EQ(leases_.size(), 2u);
}

TEST_F(EngineLeasesTest, CheckRefusesUnknownEnginesAndWrongTokens) {
  int cancels = 0;
  const EngineLease a = AttachCounting("a", &cancels);
  EXPECT_THAT(leases_.Check(EngineCredentials{EngineId{99}, a.token}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("engine 99 is not attached")));
  const std::string wrong(16, 'x');
  EXPECT_THAT(leases_.Check(EngineCredentials{a.id, wrong}),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr(absl::StrCat("wrong engine token for engine ", a.id.value))));
}

TEST_F(EngineLeasesTest, DrainingRefusesNewEnginesReservationsAndAdmissions) {
  int cancels = 0;
  const EngineLease a = AttachCounting("a", &cancels);
  leases_.SetDraining(true);
  EXPECT_TRUE(leases_.draining());
  EXPECT_THAT(
      leases_.Attach(EngineIdentity{.name = "b", .peer = {}, .cache_scope = "uid:0"}, nullptr),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("draining")));
  EXPECT_THAT(leases_.Admit(Credentials(a), "no new sessions"),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("no new sessions")));
  EXPECT_THAT(leases_.Reserve(Credentials(a), 4096),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("no new reservations")));
  EXPECT_THAT(leases_.Check(Credentials(a)), IsOk());  // existing engines keep working
  leases_.SetDraining(false);
  EXPECT_THAT(leases_.Admit(Credentials(a), "no new sessions"), IsOk());
}

TEST_F(EngineLeasesTest, SilentEngineExpiresThenIsReclaimedExactlyOnceWithItsReservations) {
  int cancels = 0;
  const EngineLease a = AttachCounting("a", &cancels);
  absl::StatusOr<EngineReservation> reserved = leases_.Reserve(Credentials(a), 8192);
  ASSERT_THAT(reserved, IsOk());
  EXPECT_EQ(reserved->ttl, kReservationTtl);
  EXPECT_EQ(budget_.Snapshot().reserved(), 8192u);

  clock_.Advance(kTimeout + absl::Milliseconds(1));
  EXPECT_THAT(leases_.CollectReclaimable(), IsEmpty());  // the grace has not passed
  EXPECT_EQ(cancels, 1);                                   // its stream was cancelled
  EXPECT_EQ(leases_.lease_expiries(), 1u);
  EXPECT_THAT(leases_.Check(Credentials(a)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("its lease has ended")));
  EXPECT_THAT(leases_.Heartbeat(a.id),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("lease expired")));

  clock_.Advance(kGrace);
  const std::vector<ReclaimedEngine> reclaimed = leases_.CollectReclaimable();
  ASSERT_THAT(reclaimed, SizeIs(1));
  EXPECT_EQ(reclaimed[0].id.value, a.id.value);
  EXPECT_EQ(reclaimed[0].name, "a");
  EXPECT_EQ(reclaimed[0].peer.pid, 42);
  EXPECT_EQ(reclaimed[0].peer.uid, 1000u);
  EXPECT_EQ(budget_.Snapshot().reserved(), 8192u);  // until the sessions are released
  EXPECT_EQ(leases_.ReturnReservations(a.id), 8192u);
  EXPECT_EQ(budget_.Snapshot().reserved(), 0u);
  EXPECT_EQ(leases_.engines_reclaimed(), 1u);
  EXPECT_THAT(leases_.CollectReclaimable(), IsEmpty());  // once
  EXPECT_EQ(leases_.engines_reclaimed(), 1u);
  EXPECT_EQ(leases_.size(), 0u);
  EXPECT_THAT(leases_.Heartbeat(a.id),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("was reclaimed")));
}

TEST_F(EngineLeasesTest, HeartbeatsKeepTheLeaseAndAnEndedStreamStartsTheGrace) {
  int cancels = 0;
  const EngineLease a = AttachCounting("a", &cancels);
  for (int i = 0; i < 5; ++i) {
    clock_.Advance(kTimeout - absl::Milliseconds(1));
    ASSERT_THAT(leases_.Heartbeat(a.id), IsOk());
    EXPECT_THAT(leases_.CollectReclaimable(), IsEmpty());
  }
  EXPECT_EQ(leases_.lease_expiries(), 0u);
  leases_.EndStream(a.id);
  EXPECT_THAT(leases_.Check(Credentials(a)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("its lease has ended")));
  clock_.Advance(kGrace - absl::Milliseconds(1));
  EXPECT_THAT(leases_.CollectReclaimable(), IsEmpty());
  clock_.Advance(absl::Milliseconds(1));
  EXPECT_THAT(leases_.CollectReclaimable(), SizeIs(1));
  EXPECT_EQ(cancels, 0);  // an ended stream is never cancelled
  EXPECT_EQ(leases_.lease_expiries(), 0u);
}

TEST_F(EngineLeasesTest, ReservationsLapseAfterTheirTtlAndCancelNeedsTheOwner) {
  int cancels = 0;
  const EngineLease a = AttachCounting("a", &cancels);
  const EngineLease b = AttachCounting("b", &cancels);
  absl::StatusOr<EngineReservation> kept = leases_.Reserve(Credentials(a), 1024);
  absl::StatusOr<EngineReservation> lapsing = leases_.Reserve(Credentials(a), 2048);
  ASSERT_THAT(kept, IsOk());
  ASSERT_THAT(lapsing, IsOk());
  EXPECT_THAT(leases_.CancelReservation(Credentials(b), kept->id),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("")));
  EXPECT_THAT(leases_.CancelReservation(Credentials(a), kept->id), IsOk());
  clock_.Advance(kReservationTtl + absl::Milliseconds(1));
  ASSERT_THAT(leases_.Heartbeat(a.id), IsOk());
  leases_.ExpireReservations();
  EXPECT_EQ(leases_.reservations_expired(), 1u);
  EXPECT_EQ(budget_.Snapshot().reserved(), 0u);
}

TEST_F(EngineLeasesTest, SettingsApplyToLaterDecisions) {
  int cancels = 0;
  const EngineLease a = AttachCounting("a", &cancels);
  leases_.ApplySettings(LeaseSettings{absl::Milliseconds(100), absl::ZeroDuration(), kReservationTtl});
  clock_.Advance(absl::Milliseconds(101));
  EXPECT_THAT(leases_.CollectReclaimable(), SizeIs(1));
  EXPECT_EQ(leases_.settings().timeout, absl::Milliseconds(100));
  EXPECT_EQ(cancels, 1);
  (void)a;
}

TEST_F(EngineLeasesTest, EnginesReportLivenessAndHeartbeatAge) {
  int cancels = 0;
  const EngineLease a = AttachCounting("a", &cancels);
  clock_.Advance(absl::Milliseconds(300));
  std::vector<EngineView> views = leases_.Engines();
  ASSERT_THAT(views, SizeIs(1));
  EXPECT_EQ(views[0].id.value, a.id.value);
  EXPECT_TRUE(views[0].lease_live);
  EXPECT_EQ(views[0].heartbeat_age, absl::Milliseconds(300));
  leases_.EndStream(a.id);
  clock_.Advance(absl::Milliseconds(100));
  views = leases_.Engines();
  EXPECT_FALSE(views[0].lease_live);
  EXPECT_EQ(views[0].heartbeat_age, absl::Milliseconds(100));
}

}  // namespace
}  // namespace memra

namespace memra {
namespace {

TEST_F(EngineLeasesTest, AnEngineWhoseStreamEndedResumesWithItsIdAndToken) {
  int cancels = 0;
  const EngineLease a = AttachCounting("a", &cancels);
  // Its own stream still holds the lease: a second stream is refused.
  EXPECT_THAT(leases_.Resume(Credentials(a), kSameUser, "", [] {}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("engine 1 holds its lease on another Attach stream")));
  leases_.EndStream(a.id, a.stream);
  EXPECT_THAT(leases_.Check(Credentials(a)), StatusIs(absl::StatusCode::kFailedPrecondition, _));
  absl::StatusOr<EngineLease> resumed = leases_.Resume(Credentials(a), kSameUser, "", [] {});
  ASSERT_THAT(resumed, IsOk());
  EXPECT_EQ(resumed->id.value, a.id.value);
  EXPECT_EQ(resumed->token, a.token);
  EXPECT_NE(resumed->stream, a.stream);
  EXPECT_THAT(leases_.Check(Credentials(a)), IsOk());
  // The replaced stream's end (its handler finishing late) ends nothing.
  leases_.EndStream(a.id, a.stream);
  EXPECT_THAT(leases_.Check(Credentials(a)), IsOk());
}

TEST_F(EngineLeasesTest, ResumeRefusals) {
  int cancels = 0;
  const EngineLease a = AttachCounting("a", &cancels);
  leases_.EndStream(a.id);
  EXPECT_THAT(leases_.Resume(EngineCredentials{a.id, "not the token"}, kSameUser, "", [] {}),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("engine 1")));
  EXPECT_THAT(leases_.Resume(EngineCredentials{EngineId{9}, a.token}, kSameUser, "", [] {}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("engine 9 was reclaimed")));
  // The re-attach's handoff connection must be the engine's user; the scope stays.
  EXPECT_THAT(leases_.Resume(Credentials(a), PeerCredentials{.uid = 1001, .gid = 100, .pid = 44},
                             "", [] {}),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("engine 1 belongs to uid 1000; the re-attach's handoff "
                                 "connection is uid 1001 (pid 44)")));
  EXPECT_THAT(leases_.Resume(Credentials(a), kSameUser, "team", [] {}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("engine 1 is in cache scope \"uid:1000\"; a re-attach keeps it "
                                 "and cannot name \"team\"")));
  EXPECT_THAT(leases_.Check(Credentials(a)), StatusIs(absl::StatusCode::kFailedPrecondition, _))
      << "a refused re-attach leaves the lease ended";
  leases_.SetDraining(true);
  EXPECT_THAT(leases_.Resume(Credentials(a), kSameUser, "", [] {}),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("draining")));
  leases_.SetDraining(false);
  clock_.Advance(kGrace);
  ASSERT_THAT(leases_.CollectReclaimable(), SizeIs(1));
  EXPECT_THAT(leases_.Resume(Credentials(a), kSameUser, "", [] {}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("engine 1 was reclaimed")));
}

TEST_F(EngineLeasesTest, AReadoptedEngineMustResumeWithinTheLeaseTimeout) {
  leases_.Readopt(EngineId{7}, "sixteen-byte-tok", Kept("kept"));
  leases_.RaiseNextEngineId(12);
  EXPECT_THAT(leases_.Check(EngineCredentials{EngineId{7}, "sixteen-byte-tok"}), IsOk());
  int cancels = 0;
  EXPECT_EQ(AttachCounting("new", &cancels).id.value, 12u) << "ids continue above the journal's";
  absl::StatusOr<EngineLease> resumed =
      leases_.Resume(EngineCredentials{EngineId{7}, "sixteen-byte-tok"}, kSameUser, "uid:1000",
                     [] {});
  ASSERT_THAT(resumed, IsOk());
  EXPECT_EQ(resumed->id.value, 7u);
  EXPECT_EQ(resumed->cache_scope, "uid:1000");
  // One that never comes back is reclaimed like a silent engine.
  leases_.Readopt(EngineId{8}, "another-16-bytes", Kept("gone"));
  clock_.Advance(kTimeout + absl::Milliseconds(1));
  // No engine heartbeat: all three leases expire now and are reclaimed after the grace.
  EXPECT_THAT(leases_.CollectReclaimable(), IsEmpty());
  EXPECT_THAT(leases_.Heartbeat(EngineId{8}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("lease expired")));
  clock_.Advance(kGrace);
  EXPECT_THAT(leases_.CollectReclaimable(), SizeIs(3));
}

TEST_F(EngineLeasesTest, AnEngineARestartDidNotReadoptGetsTheRestartError) {
  leases_.SetRestart(DaemonRestart{.previous_epoch = 5, .epoch = 6},
                     {{3, "its journal record was torn"}});
  const absl::Status refused = leases_.Resume(EngineCredentials{EngineId{3}, "token"}, kSameUser, "", [] {})
                                   .status();
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kFailedPrecondition,
                                HasSubstr("memra-kvd restarted (epoch 5 -> 6); engine 3 was not "
                                          "re-adopted: its journal record was torn")));
  EXPECT_EQ(GetDaemonRestart(refused), (DaemonRestart{5, 6}));
  EXPECT_THAT(leases_.Check(EngineCredentials{EngineId{3}, "token"}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("epoch 5 -> 6")));
  EXPECT_THAT(leases_.Check(EngineCredentials{EngineId{4}, "token"}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("engine 4 is not attached")));
}

}  // namespace
}  // namespace memra
