#include "server/session/session_registry.h"

#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/synchronization/notification.h"
#include "absl/synchronization/mutex.h"
#include "core/test_model_plans.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "core/sizing.h"
#include "server/session/arena_pool.h"
#include "server/base/clock.h"
#include "server/device/device_budget.h"
#include "server/session/engine_leases.h"
#include "server/testing/fault_injecting_backend.h"
#include "server/device/host_backend.h"
#include "server/session/plan_registry.h"
#include "server/testing/test_host_backend.h"
#include "server/session/state_journal.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::SizeIs;

constexpr uint64_t kBudgetBytes = uint64_t{64} << 20;
constexpr absl::Duration kTimeout = absl::Milliseconds(1000);
constexpr absl::Duration kGrace = absl::Milliseconds(500);

class SessionRegistryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    host_ = memra::testing::NewTestHostBackend(memra::testing::TestHostBackendOptions());
    ASSERT_NE(host_, nullptr);
    backend_ = std::make_unique<FaultInjectingBackend>(host_.get());
    registry_ = std::make_unique<SessionRegistry>(backend_.get(), &budget_, &leases_, &plans_,
                                                  FormatDefaults(), nullptr);
    absl::StatusOr<PlanFingerprint> plan = plans_.Register(test_plans::DenseModel(2, 64, 2));
    ASSERT_THAT(plan, IsOk());
    plan_ = *plan;
  }

  void TearDown() override {
    registry_->ReleaseAll();
    EXPECT_EQ(host_->ArenaCount(), 0u);
  }

  EngineLease Attach(const std::string& name) {
    absl::StatusOr<EngineLease> lease =
        leases_.Attach(EngineIdentity{.name = name, .peer = {}, .cache_scope = "uid:0"}, nullptr);
    EXPECT_THAT(lease, IsOk());
    return lease.ok() ? *lease : EngineLease{};
  }
  static EngineCredentials Engine(const EngineLease& lease) {
    return EngineCredentials{lease.id, lease.token};
  }
  static SessionShape Shape(uint64_t capacity) {
    SessionShape shape;
    shape.capacity = capacity;
    return shape;
  }
  std::shared_ptr<DaemonSession> Create(const EngineLease& engine, uint64_t capacity = 256) {
    absl::StatusOr<std::shared_ptr<DaemonSession>> session =
        registry_->Create(Engine(engine), plan_, Shape(capacity), std::nullopt);
    EXPECT_THAT(session, IsOk());
    return session.ok() ? *session : nullptr;
  }
  static SessionCredentials Credentials(const DaemonSession& session) {
    return SessionCredentials{session.id(), session.params().token};
  }

  FakeClock clock_;
  DeviceBudget budget_{kBudgetBytes, "test"};
  EngineLeases leases_{&clock_, &budget_, LeaseSettings{kTimeout, kGrace, kTimeout}};
  PlanRegistry plans_{FormatDefaults()};
  std::unique_ptr<HostBackend> host_;
  std::unique_ptr<FaultInjectingBackend> backend_;
  std::unique_ptr<SessionRegistry> registry_;
  PlanFingerprint plan_{};
};

TEST_F(SessionRegistryTest, CreatedSessionsAreFoundByIdAndTokenOnly) {
  const EngineLease engine = Attach("a");
  std::shared_ptr<DaemonSession> session = Create(engine);
  ASSERT_NE(session, nullptr);
  EXPECT_EQ(session->owner().value, engine.id.value);
  EXPECT_EQ(session->params().fingerprint.size(), 32u);
  EXPECT_THAT(registry_->Find(Credentials(*session)), IsOk());
  EXPECT_THAT(registry_->Find(SessionCredentials{session->id(), "not the token"}),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr(absl::StrCat("wrong session token for session ",
                                              session->id().value))));
  EXPECT_THAT(registry_->Find(SessionCredentials{SessionId{999}, ""}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("session 999 does not exist")));
  EXPECT_EQ(registry_->size(), 1u);
}

TEST_F(SessionRegistryTest, SlotsAreDenseReusedAfterReleaseAndOnlyTheirEnginesToName) {
  const EngineLease a = Attach("a");
  const EngineLease b = Attach("b");
  std::vector<std::shared_ptr<DaemonSession>> sessions;
  for (const EngineLease* engine : {&a, &b, &a}) sessions.push_back(Create(*engine));
  ASSERT_THAT(sessions, ::testing::Each(::testing::NotNull()));
  EXPECT_EQ(sessions[0]->slot(), 0u);
  EXPECT_EQ(sessions[1]->slot(), 1u);
  EXPECT_EQ(sessions[2]->slot(), 2u);
  absl::StatusOr<std::shared_ptr<DaemonSession>> found = registry_->Find(SessionSlot{a.id, 2});
  ASSERT_THAT(found, IsOk());
  EXPECT_EQ(*found, sessions[2]);

  // Engine a naming b's slot: refused exactly as an empty slot is (a learns nothing of b's
  // slots), and the session is untouched.
  const absl::Status foreign_slot = registry_->Run(SessionSlot{a.id, 1}, BeginOp{}).status();
  EXPECT_THAT(foreign_slot,
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr(absl::StrCat("slot 1 holds no session of engine ", a.id.value))));
  const absl::Status empty_slot = registry_->Run(SessionSlot{a.id, 1000}, BeginOp{}).status();
  EXPECT_EQ(empty_slot.code(), foreign_slot.code());
  EXPECT_EQ(absl::StrReplaceAll(empty_slot.message(), {{"1000", "1"}}), foreign_slot.message());
  absl::StatusOr<SessionReport> report = sessions[1]->GetState();
  ASSERT_THAT(report, IsOk());
  EXPECT_EQ(report->state.next_generation, 1u) << "the refused Begin began nothing";
  EXPECT_THAT(registry_->Find(SessionSlot{a.id, 3}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("slot 3 holds no session")));

  // Released slots are reused before a new one is added, whichever engine creates next.
  ASSERT_THAT(registry_->Release(Credentials(*sessions[1])), IsOk());
  EXPECT_THAT(registry_->Find(SessionSlot{b.id, 1}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("slot 1 holds no session")));
  std::shared_ptr<DaemonSession> reused = Create(a);
  ASSERT_NE(reused, nullptr);
  EXPECT_EQ(reused->slot(), 1u);
  EXPECT_THAT(registry_->Find(SessionSlot{b.id, 1}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("slot 1")))
      << "b's old slot is a's now";
  // A refused creation gives its reserved slot back.
  EXPECT_THAT(registry_->Create(Engine(a), plan_, Shape(0), std::nullopt), ::testing::Not(IsOk()));
  std::shared_ptr<DaemonSession> next = Create(b);
  ASSERT_NE(next, nullptr);
  EXPECT_EQ(next->slot(), 3u);
  // An engine's reclaim frees its slots.
  EXPECT_EQ(registry_->ReleaseOwnedBy(a.id).sessions, 3u);
  EXPECT_LT(Create(b)->slot(), 3u) << "a freed slot is reused before slot 4 is added";
}

// An engine's share counts its pooled arenas: a CreateSession refused for it while the engine's
// own pool holds arenas (of another size) frees that pool and is admitted on the retry.
TEST_F(SessionRegistryTest, ARefusedCreateFreesTheEnginesOwnPoolAndRetries) {
  auto bytes_of = [&](uint64_t capacity) {
    absl::StatusOr<uint64_t> bytes = SessionArenaBytes(*plans_.Find(plan_).value(),
                                                       FormatDefaults(), Shape(capacity),
                                                       registry_->rounding());
    EXPECT_THAT(bytes, IsOk());
    return bytes.value_or(0);
  };
  const uint64_t small = bytes_of(256), large = bytes_of(1024);
  ASSERT_GT(large, small);
  // 50% of the budget: room for the large session, not for it and the pooled small one.
  DeviceBudget budget(2 * large + small / 2, "test", AdmissionLimits{.owner_share_percent = 50});
  EngineLeases leases(&clock_, &budget, LeaseSettings{kTimeout, kGrace, kTimeout});
  ArenaPool pool(backend_.get(), &budget, uint64_t{1} << 30);
  SessionRegistry registry(backend_.get(), &budget, &leases, &plans_, FormatDefaults(), nullptr,
                           UINT64_MAX, &pool);
  absl::StatusOr<EngineLease> engine =
      leases.Attach(EngineIdentity{.name = "a", .peer = {}, .cache_scope = "uid:0"}, nullptr);
  ASSERT_THAT(engine, IsOk());
  absl::StatusOr<std::shared_ptr<DaemonSession>> first =
      registry.Create(Engine(*engine), plan_, Shape(256), std::nullopt);
  ASSERT_THAT(first, IsOk());
  ASSERT_THAT(registry.Release(Credentials(**first)), IsOk());
  EXPECT_EQ(pool.pooled_bytes(engine->id.value), small);
  absl::StatusOr<std::shared_ptr<DaemonSession>> second =
      registry.Create(Engine(*engine), plan_, Shape(1024), std::nullopt);
  ASSERT_THAT(second, IsOk());
  EXPECT_EQ(pool.pooled_bytes(engine->id.value), 0u);
  EXPECT_EQ(pool.TakeUnmapped(engine->id.value).size(), 1u) << "its client is told to unmap it";
  registry.ReleaseAll();
  EXPECT_EQ(budget.Snapshot().allocated(), 0u);
}

// The committed length each session's last journal record holds (what a restart restores).
class CommittedLengthJournal final : public StateJournal {
 public:
  void EngineAttached(uint64_t, absl::string_view, absl::string_view, const PeerCredentials&,
                      absl::string_view) override {}
  void EngineForgotten(uint64_t) override {}
  void ArenaCreated(ArenaId) override {}
  void ArenaFreed(ArenaId) override {}
  void SessionChanged(const JournaledSession& session) override {
    absl::MutexLock lock(&mu_);
    committed_[session.id] = session.committed.committed_len;
  }
  void SessionReleased(uint64_t id) override {
    absl::MutexLock lock(&mu_);
    committed_.erase(id);
  }
  std::optional<uint64_t> Committed(uint64_t id) {
    absl::MutexLock lock(&mu_);
    auto it = committed_.find(id);
    return it == committed_.end() ? std::nullopt : std::optional<uint64_t>(it->second);
  }

 private:
  absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, uint64_t> committed_ ABSL_GUARDED_BY(mu_);
};

// A step addressed by slot is journaled exactly as one addressed by id and token.
TEST_F(SessionRegistryTest, OperationsBySlotAreJournaledBeforeTheReply) {
  CommittedLengthJournal journal;
  SessionRegistry registry(backend_.get(), &budget_, &leases_, &plans_, FormatDefaults(), nullptr,
                           UINT64_MAX, nullptr, &journal);
  const EngineLease engine = Attach("a");
  absl::StatusOr<std::shared_ptr<DaemonSession>> session =
      registry.Create(Engine(engine), plan_, Shape(256), std::nullopt);
  ASSERT_THAT(session, IsOk());
  const SessionSlot slot{engine.id, (*session)->slot()};
  absl::StatusOr<SessionResult> begin = registry.Run(slot, BeginOp{});
  ASSERT_THAT(begin, IsOk());
  const uint64_t generation = std::get<TransactionId>(*begin).generation;
  ASSERT_THAT(registry.Run(slot, PrepareAppendOp{generation, 5}), IsOk());
  ASSERT_THAT(registry.Run(slot, PublishAppendOp{generation}), IsOk());
  const std::vector<int32_t> tokens = {1, 2, 3, 4, 5};
  absl::StatusOr<SessionResult> commit = registry.Run(slot, CommitOp{generation, 5, tokens});
  ASSERT_THAT(commit, IsOk());
  EXPECT_EQ(std::get<CommittedLength>(*commit).committed_len, 5u);
  EXPECT_EQ(journal.Committed((*session)->id().value), std::optional<uint64_t>(5));
  registry.ReleaseAll();
}

TEST_F(SessionRegistryTest, TryRunRunsNothingWhileALongOperationHoldsTheSession) {
  const EngineLease a = Attach("a");
  const EngineLease b = Attach("b");
  std::shared_ptr<DaemonSession> session = Create(a);
  ASSERT_NE(session, nullptr);
  std::shared_ptr<DaemonSession> theirs = Create(b);
  ASSERT_NE(theirs, nullptr);
  const SessionSlot slot{a.id, session->slot()};
  absl::Notification viewing;
  absl::Notification done;
  std::thread view([&] {
    EXPECT_THAT(session->ViewLocked([&](const SessionState&, const SessionLayoutVersion&,
                                        const std::optional<std::vector<int32_t>>&) {
      viewing.Notify();
      done.WaitForNotification();
      return absl::OkStatus();
    }),
                IsOk());
  });
  viewing.WaitForNotification();
  EXPECT_FALSE(registry_->TryRun(slot, BeginOp{}).has_value());
  // Refusals before the session is reached are answered as Run's.
  std::optional<absl::StatusOr<SessionResult>> foreign =
      registry_->TryRun(SessionSlot{a.id, theirs->slot()}, BeginOp{});
  ASSERT_TRUE(foreign.has_value());
  EXPECT_THAT(foreign->status(), StatusIs(absl::StatusCode::kNotFound,
                                 HasSubstr(absl::StrCat("slot ", theirs->slot(),
                                                        " holds no session of engine ",
                                                        a.id.value))));
  std::optional<absl::StatusOr<SessionResult>> grow = registry_->TryRun(slot, GrowOp{512});
  ASSERT_TRUE(grow.has_value());
  EXPECT_THAT(grow->status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("Grow is a long one")));
  done.Notify();
  view.join();
  absl::StatusOr<SessionResult> state = SessionRegistry::Apply(*session, GetStateOp{});
  ASSERT_THAT(state, IsOk());
  EXPECT_EQ(std::get<SessionReport>(*state).state.next_generation, 1u)
      << "the busy Begin began nothing";
  std::optional<absl::StatusOr<SessionResult>> ran = registry_->TryRun(slot, BeginOp{});
  ASSERT_TRUE(ran.has_value());
  ASSERT_THAT(*ran, IsOk());
  EXPECT_EQ(std::get<TransactionId>(**ran).generation, 1u);
}

TEST_F(SessionRegistryTest, CreateRefusalsAllocateNothing) {
  const EngineLease engine = Attach("a");
  PlanFingerprint unknown{};
  EXPECT_THAT(registry_->Create(Engine(engine), unknown, Shape(256), std::nullopt),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("is not registered")));
  EXPECT_THAT(registry_->Create(EngineCredentials{engine.id, "wrong"}, plan_, Shape(256),
                                std::nullopt),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("wrong engine token")));
  leases_.SetDraining(true);
  EXPECT_THAT(registry_->Create(Engine(engine), plan_, Shape(256), std::nullopt),
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstr("the daemon is draining; no new sessions")));
  leases_.SetDraining(false);
  leases_.EndStream(engine.id);
  EXPECT_THAT(registry_->Create(Engine(engine), plan_, Shape(256), std::nullopt),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("its lease has ended")));
  EXPECT_EQ(registry_->size(), 0u);
  EXPECT_EQ(host_->ArenaCount(), 0u);
  EXPECT_EQ(budget_.Snapshot().allocated(), 0u);
}

TEST_F(SessionRegistryTest, ReserveChargesExactlyWhatCreateConsumes) {
  const EngineLease engine = Attach("a");
  absl::StatusOr<ArenaReservation> reserved = registry_->Reserve(Engine(engine), plan_, Shape(512));
  ASSERT_THAT(reserved, IsOk());
  EXPECT_EQ(budget_.Snapshot().reserved(), reserved->bytes);
  absl::StatusOr<std::shared_ptr<DaemonSession>> session =
      registry_->Create(Engine(engine), plan_, Shape(512), reserved->id);
  ASSERT_THAT(session, IsOk());
  EXPECT_EQ((*session)->arena_bytes(), reserved->bytes);
  EXPECT_EQ(budget_.Snapshot().reserved(), 0u);
  EXPECT_EQ(budget_.Snapshot().allocated(), reserved->bytes);
}

TEST_F(SessionRegistryTest, TheDispatcherRunsTypedOperationsInOrderAndStopsAtARefusal) {
  const EngineLease engine = Attach("a");
  std::shared_ptr<DaemonSession> session = Create(engine);
  ASSERT_NE(session, nullptr);
  const SessionCredentials credentials = Credentials(*session);
  auto no_wait = [] { return absl::OkStatus(); };

  absl::StatusOr<SessionResult> begin = registry_->Run(credentials, BeginOp{});
  ASSERT_THAT(begin, IsOk());
  const uint64_t generation = std::get<TransactionId>(*begin).generation;
  const std::vector<int32_t> tokens = {7, 8, 9};
  absl::StatusOr<std::vector<SessionResult>> results =
      registry_->Run(credentials,
                     {PrepareAppendOp{generation, 3}, PublishAppendOp{generation},
                      CommitOp{generation, 3, tokens}, GetStateOp{}},
                     no_wait);
  ASSERT_THAT(results, IsOk());
  ASSERT_EQ(results->size(), 4u);
  EXPECT_EQ(std::get<AppendPlan>((*results)[0]).target, 3u);
  EXPECT_EQ(std::get<PublishedAppend>((*results)[1]).staged_len, 3u);
  EXPECT_EQ(std::get<CommittedLength>((*results)[2]).committed_len, 3u);
  EXPECT_EQ(std::get<SessionReport>((*results)[3]).state.committed_len, 3u);

  // A refused operation stops the sequence: the state after it is not read, and no result
  // comes back.
  EXPECT_THAT(registry_->Run(credentials, {AbortOp{generation}, GetStateOp{}}, no_wait).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("")));

  // `before` runs after authentication and before any operation; its refusal is the answer.
  bool waited = false;
  EXPECT_THAT(registry_->Run(SessionCredentials{session->id(), "wrong"}, {ResetOp{}},
                             [&] {
                               waited = true;
                               return absl::OkStatus();
                             })
                  .status(),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("wrong session token")));
  EXPECT_FALSE(waited);
  EXPECT_THAT(registry_->Run(credentials, {ResetOp{}},
                             [] { return absl::DeadlineExceededError("event never fired"); })
                  .status(),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("event never fired")));
  absl::StatusOr<SessionResult> can = registry_->Run(credentials, CanRewindOp{1});
  ASSERT_THAT(can, IsOk());
  EXPECT_TRUE(std::get<RewindPossible>(*can).possible);  // not reset: the refused wait came first
}

TEST_F(SessionRegistryTest, ReleaseFreesTheArenaOnce) {
  const EngineLease engine = Attach("a");
  std::shared_ptr<DaemonSession> session = Create(engine);
  ASSERT_NE(session, nullptr);
  const uint64_t bytes = session->arena_bytes();
  EXPECT_THAT(registry_->Release(Credentials(*session)), IsOk());
  EXPECT_EQ(backend_->CallCount(BackendOp::kFreeArena), 1u);
  EXPECT_EQ(host_->ArenaCount(), 0u);
  EXPECT_GT(bytes, 0u);
  EXPECT_THAT(registry_->Release(Credentials(*session)),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("does not exist")));
  EXPECT_EQ(backend_->CallCount(BackendOp::kFreeArena), 1u);
}

TEST_F(SessionRegistryTest, ReleaseOwnedByReleasesEachOfTheEnginesSessionsExactlyOnce) {
  const EngineLease a = Attach("a");
  const EngineLease b = Attach("b");
  std::shared_ptr<DaemonSession> a1 = Create(a);
  std::shared_ptr<DaemonSession> a2 = Create(a, 512);
  std::shared_ptr<DaemonSession> b1 = Create(b);
  ASSERT_NE(b1, nullptr);
  const uint64_t a_bytes = a1->arena_bytes() + a2->arena_bytes();
  absl::flat_hash_map<uint64_t, EngineSessionUsage> usage = registry_->UsageByEngine();
  EXPECT_EQ(usage[a.id.value].sessions, 2u);
  EXPECT_EQ(usage[a.id.value].arena_bytes, a_bytes);
  EXPECT_THAT(registry_->List(a.id), SizeIs(2));
  EXPECT_THAT(registry_->List(std::nullopt), SizeIs(3));

  const ReleasedSessions released = registry_->ReleaseOwnedBy(a.id);
  EXPECT_EQ(released.sessions, 2u);
  EXPECT_EQ(released.bytes, a_bytes);
  EXPECT_EQ(backend_->CallCount(BackendOp::kFreeArena), 2u);
  const ReleasedSessions again = registry_->ReleaseOwnedBy(a.id);
  EXPECT_EQ(again.sessions, 0u);
  EXPECT_EQ(again.bytes, 0u);
  EXPECT_EQ(backend_->CallCount(BackendOp::kFreeArena), 2u);
  EXPECT_THAT(registry_->Find(Credentials(*a1)),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("does not exist")));
  EXPECT_THAT(registry_->Find(Credentials(*b1)), IsOk());
  EXPECT_EQ(registry_->size(), 1u);
  EXPECT_EQ(registry_->UsageByEngine().count(a.id.value), 0u);
}

TEST_F(SessionRegistryTest, AwaitEmptyReturnsTheSessionsStillOpen) {
  EXPECT_EQ(registry_->AwaitEmpty(absl::Seconds(10)), 0u);  // empty: no wait
  const EngineLease engine = Attach("a");
  ASSERT_NE(Create(engine), nullptr);
  EXPECT_EQ(registry_->AwaitEmpty(absl::ZeroDuration()), 1u);
  registry_->EndWaits();
  EXPECT_EQ(registry_->AwaitEmpty(absl::Seconds(10)), 1u);  // ended: no wait
}

}  // namespace
}  // namespace memra

namespace memra {
namespace {

// Restart survival, in one process: the arena's kept descriptor and the committed record bring
// the session back under its id and token, at its committed length.
TEST_F(SessionRegistryTest, AReadoptedSessionIsFoundAtItsCommittedLength) {
  const EngineLease engine = Attach("a");
  std::shared_ptr<DaemonSession> session = Create(engine);
  ASSERT_NE(session, nullptr);
  const std::string token = session->params().token;  // outlives the session object
  const SessionCredentials credentials{session->id(), token};
  absl::StatusOr<SessionResult> begun = registry_->Run(credentials, BeginOp{});
  ASSERT_THAT(begun, IsOk());
  const uint64_t generation = std::get<TransactionId>(*begun).generation;
  ASSERT_THAT(registry_->Run(credentials, PrepareAppendOp{generation, 10}), IsOk());
  ASSERT_THAT(registry_->Run(credentials, PublishAppendOp{generation}), IsOk());
  ASSERT_THAT(registry_->Run(credentials, CommitOp{generation, 10, {}}), IsOk());
  absl::StatusOr<SessionResult> report = registry_->Run(credentials, GetStateOp{true});
  ASSERT_THAT(report, IsOk());
  ASSERT_TRUE(std::get<SessionReport>(*report).layout.has_value());
  const uint64_t arena_bytes = std::get<SessionReport>(*report).layout->arena.bytes;
  // What the previous daemon kept, and then it is gone.
  ArenaId current;
  ASSERT_THAT(session->ViewLocked([&](const SessionState&, const SessionLayoutVersion& at,
                                      const std::optional<std::vector<int32_t>>&) {
    current = at.arena;
    return absl::OkStatus();
  }),
              IsOk());
  absl::StatusOr<int> kept = backend_->DuplicateArenaFd(current);
  ASSERT_THAT(kept, IsOk());
  DaemonSession::Params params = session->params();
  ASSERT_THAT(registry_->Release(credentials), IsOk());
  session.reset();
  EXPECT_EQ(budget_.Snapshot().allocated(), 0u);

  absl::StatusOr<ArenaId> arena = backend_->AdoptArenaFd(*kept, arena_bytes, "/kept-handle");
  ASSERT_THAT(arena, IsOk());
  // A record that does not match the plan's placement is refused with both sizes.
  DaemonSession::Params wrong = params;
  EXPECT_THAT(DaemonSession::Adopt(wrong, backend_.get(), &budget_, *arena, arena_bytes + 4096, 1,
                                   CommittedRecord{10, 2, {0, 0}, false})
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr(absl::StrCat("the kept arena holds ", arena_bytes + 4096,
                                              " bytes but the session's plan places ",
                                              arena_bytes))));
  // It comes back in the slot the engine knew it by (2 here: slots 0 and 1 stay free).
  params.slot = 2;
  absl::StatusOr<std::unique_ptr<DaemonSession>> adopted = DaemonSession::Adopt(
      params, backend_.get(), &budget_, *arena, arena_bytes, 1, CommittedRecord{10, 2, {0, 0}, false});
  ASSERT_THAT(adopted, IsOk());
  ASSERT_THAT(registry_->Readopt(*std::move(adopted), /*slot_limit=*/3), IsOk());
  EXPECT_EQ(budget_.Snapshot().allocated(), arena_bytes);
  report = registry_->Run(credentials, GetStateOp{});
  ASSERT_THAT(report, IsOk());
  EXPECT_EQ(std::get<SessionReport>(*report).state.committed_len, 10u);
  EXPECT_EQ(std::get<SessionReport>(*report).state.next_generation, 2u);
  absl::StatusOr<std::shared_ptr<DaemonSession>> by_slot =
      registry_->Find(SessionSlot{engine.id, 2});
  ASSERT_THAT(by_slot, IsOk());
  EXPECT_EQ((*by_slot)->id().value, credentials.id.value);
  // New sessions get ids above it, and the free slots below it.
  std::shared_ptr<DaemonSession> next = Create(engine);
  ASSERT_NE(next, nullptr);
  EXPECT_GT(next->id().value, credentials.id.value);
  EXPECT_LT(next->slot(), 2u);
  // A record naming a slot already held is refused with both sessions.
  DaemonSession::Params clash = params;
  clash.id = SessionId{next->id().value + 10};
  clash.slot = next->slot();
  absl::StatusOr<ArenaId> other = backend_->CreateArena(arena_bytes, ArenaVisibility::kExported);
  ASSERT_THAT(other, IsOk());
  absl::StatusOr<std::unique_ptr<DaemonSession>> clashing = DaemonSession::Adopt(
      clash, backend_.get(), &budget_, *other, arena_bytes, 1, CommittedRecord{10, 2, {0, 0}, false});
  ASSERT_THAT(clashing, IsOk());
  EXPECT_THAT(registry_->Readopt(*std::move(clashing), /*slot_limit=*/3),
              StatusIs(absl::StatusCode::kAlreadyExists,
                       HasSubstr(absl::StrCat("session ", clash.id.value, ": slot ", clash.slot,
                                              " already holds session ", next->id().value))));
  // A record whose slot is past what the previous daemon could hold is corrupt: refused before
  // the slot table grows to its number.
  DaemonSession::Params far = params;
  far.id = SessionId{next->id().value + 20};
  far.slot = 4'000'000'000u;
  absl::StatusOr<ArenaId> far_arena = backend_->CreateArena(arena_bytes, ArenaVisibility::kExported);
  ASSERT_THAT(far_arena, IsOk());
  absl::StatusOr<std::unique_ptr<DaemonSession>> far_session = DaemonSession::Adopt(
      far, backend_.get(), &budget_, *far_arena, arena_bytes, 1, CommittedRecord{10, 2, {0, 0}, false});
  ASSERT_THAT(far_session, IsOk());
  EXPECT_THAT(registry_->Readopt(*std::move(far_session), /*slot_limit=*/3),
              StatusIs(absl::StatusCode::kOutOfRange,
                       HasSubstr(absl::StrCat("session ", far.id.value,
                                              ": slot 4000000000 is not below 3"))));
  EXPECT_THAT(registry_->Find(SessionSlot{engine.id, 3}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("slot 3")));
}

TEST_F(SessionRegistryTest, ASessionARestartDidNotReadoptGetsTheRestartError) {
  registry_->SetRestart(DaemonRestart{.previous_epoch = 8, .epoch = 9},
                        {{3, "a ring rebase (layer 1) was prepared and not yet published"}});
  const absl::Status refused = registry_->Find(SessionCredentials{SessionId{3}, "t"}).status();
  EXPECT_THAT(refused,
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("memra-kvd restarted (epoch 8 -> 9); session 3 was not "
                                 "re-adopted: a ring rebase (layer 1) was prepared")));
  EXPECT_EQ(GetDaemonRestart(refused), (DaemonRestart{8, 9}));
  EXPECT_THAT(registry_->Find(SessionCredentials{SessionId{4}, "t"}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("session 4 does not exist")));
}

// Issue 26: journal records no copy of which could be read name no session; an unknown id the
// previous daemon had issued may have been one of them, so it gets the restart error too.
TEST_F(SessionRegistryTest, AnUnknownSessionOfADamagedJournalGetsTheRestartError) {
  registry_->SetRestart(DaemonRestart{.previous_epoch = 8, .epoch = 9}, {},
                        /*unreadable_records=*/2, /*issued_below=*/10);
  const absl::Status refused = registry_->Find(SessionCredentials{SessionId{7}, "t"}).status();
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kFailedPrecondition,
                                HasSubstr("memra-kvd restarted (epoch 8 -> 9); session 7 was not "
                                          "re-adopted: it is not in the restart journal, 2 of "
                                          "whose records were damaged beyond reading")));
  EXPECT_EQ(GetDaemonRestart(refused), (DaemonRestart{8, 9}));
  // An id the previous daemon never issued is simply unknown.
  EXPECT_THAT(registry_->Find(SessionCredentials{SessionId{10}, "t"}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("session 10 does not exist")));
}

}  // namespace
}  // namespace memra
