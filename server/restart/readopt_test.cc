#include "server/restart/readopt.h"

#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <map>
#include <optional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/daemon_restart.h"
#include "core/test_model_plans.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/base/clock.h"
#include "server/base/sd_notify.h"
#include "server/device/device_budget.h"
#include "server/device/host_backend.h"
#include "server/restart/restart_state.h"
#include "server/session/engine_leases.h"
#include "server/session/plan_registry.h"
#include "server/session/session_registry.h"
#include "server/testing/test_host_backend.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr uint64_t kBudgetBytes = uint64_t{64} << 20;
constexpr absl::Duration kLease = absl::Seconds(10);

// A service manager's fd store, in process: what the journal stores, by name.
class FdStore {
 public:
  ~FdStore() {
    for (auto& [name, fd] : fds_) close(fd);
  }
  FdStoreSender Sender() {
    return [this](std::string_view state, const std::vector<int>& fds) {
      const FdStoreRequest request = ParseFdStoreRequest(state);
      if (request.remove && fds_.contains(request.name)) {
        close(fds_[request.name]);
        fds_.erase(request.name);
      }
      if (request.store && fds.size() == 1) {
        if (fds_.contains(request.name)) close(fds_[request.name]);
        fds_[request.name] = fcntl(fds[0], F_DUPFD_CLOEXEC, 0);
      }
      return absl::OkStatus();
    };
  }
  // What a restarted daemon is passed: duplicates of every stored descriptor.
  std::vector<ListenedFd> Passed() const {
    std::vector<ListenedFd> passed;
    for (const auto& [name, fd] : fds_) {
      passed.push_back({.fd = fcntl(fd, F_DUPFD_CLOEXEC, 0), .name = name});
    }
    return passed;
  }
  bool contains(const std::string& name) const { return fds_.contains(name); }

 private:
  std::map<std::string, int> fds_;
};

// One daemon's parts over its own host backend, journaling into `store`.
struct Parts {
  Parts(FdStore& store, uint64_t epoch, uint64_t generation) : epoch(epoch) {
    absl::StatusOr<std::unique_ptr<RestartState>> created =
        RestartState::Create(/*slots=*/16, epoch, generation, backend.get(), store.Sender());
    EXPECT_THAT(created, IsOk());
    state = *std::move(created);
    leases = std::make_unique<EngineLeases>(&clock, &budget, LeaseSettings{kLease, kLease, kLease},
                                            state.get());
    sessions = std::make_unique<SessionRegistry>(backend.get(), &budget, leases.get(), &plans,
                                                 FormatDefaults(), nullptr, UINT64_MAX, nullptr,
                                                 state.get());
  }
  ~Parts() { sessions->ReleaseAll(); }

  ReadoptParts ForReadopt() {
    return ReadoptParts{.plans = &plans,
                        .leases = leases.get(),
                        .sessions = sessions.get(),
                        .backend = backend.get(),
                        .budget = &budget,
                        .restart_state = state.get(),
                        .epoch = epoch};
  }

  const uint64_t epoch;
  FakeClock clock;
  std::unique_ptr<HostBackend> backend =
      memra::testing::NewTestHostBackend(memra::testing::TestHostBackendOptions());
  DeviceBudget budget{kBudgetBytes, "test"};
  PlanRegistry plans{FormatDefaults()};
  std::unique_ptr<RestartState> state;
  std::unique_ptr<EngineLeases> leases;
  std::unique_ptr<SessionRegistry> sessions;
};

class ReadoptTest : public ::testing::Test {
 protected:
  // The previous daemon: one engine with two sessions, journaled and published.
  void SetUp() override {
    ASSERT_THAT(previous_.state->Publish(), IsOk());
    absl::StatusOr<EngineLease> engine = previous_.leases->Attach(
        EngineIdentity{.name = "engine-a", .peer = {.uid = 1000}, .cache_scope = "team"},
        nullptr);
    ASSERT_THAT(engine, IsOk());
    engine_ = *engine;
    absl::StatusOr<PlanFingerprint> plan =
        previous_.plans.Register(test_plans::DenseModel(2, 64, 2), engine_.id.value);
    ASSERT_THAT(plan, IsOk());
    for (int i = 0; i < 2; ++i) {
      SessionShape shape;
      shape.capacity = 256;
      absl::StatusOr<std::shared_ptr<DaemonSession>> session = previous_.sessions->Create(
          EngineCredentials{engine_.id, engine_.token}, *plan, shape, std::nullopt);
      ASSERT_THAT(session, IsOk());
      sessions_.push_back(*session);
    }
  }

  // The name the previous daemon stored `session`'s arena under.
  static std::string ArenaName(const PreviousDaemon& kept, const DaemonSession& session) {
    for (const auto& record : kept.sessions) {
      if (record.id() == session.id().value) return record.arena_fd_name();
    }
    return "";
  }
  static SessionCredentials Credentials(const DaemonSession& session) {
    return SessionCredentials{session.id(), session.params().token};
  }

  static constexpr uint64_t kPreviousEpoch = 41;
  static constexpr uint64_t kPreviousGeneration = 6;
  FdStore previous_store_;
  Parts previous_{previous_store_, kPreviousEpoch, kPreviousGeneration};
  EngineLease engine_;
  std::vector<std::shared_ptr<DaemonSession>> sessions_;
  FdStore next_store_;
};

TEST_F(ReadoptTest, EnginesAndSessionsComeBackWithTheirTokensAndMemory) {
  std::optional<PreviousDaemon> kept = ReadPreviousDaemon(previous_store_.Passed());
  ASSERT_TRUE(kept.has_value());
  Parts next(next_store_, kPreviousEpoch + 1, kPreviousGeneration + 1);

  const Readopted readopted = Readopt(*std::move(kept), next.ForReadopt());

  EXPECT_EQ(readopted.previous_epoch, kPreviousEpoch);
  EXPECT_EQ(readopted.engines, 1u);
  EXPECT_EQ(readopted.sessions, 2u);
  EXPECT_EQ(readopted.bytes, sessions_[0]->arena_bytes() + sessions_[1]->arena_bytes());
  EXPECT_EQ(readopted.not_readopted, 0u);
  EXPECT_EQ(next.backend->ArenaCount(), 2u);
  for (const auto& before : sessions_) {
    absl::StatusOr<std::shared_ptr<DaemonSession>> found =
        next.sessions->Find(Credentials(*before));
    ASSERT_THAT(found, IsOk());
    EXPECT_EQ((*found)->owner().value, engine_.id.value);
    EXPECT_EQ((*found)->arena_bytes(), before->arena_bytes());
    EXPECT_EQ((*found)->params().cache_scope, "team");
  }
  // The engine is known again under its token and scope.
  EXPECT_THAT(next.leases->CacheScope(EngineCredentials{engine_.id, engine_.token}), IsOk());
  // This daemon's journal is published and the previous one's is gone from the store.
  EXPECT_TRUE(next_store_.contains(absl::StrCat("journal-", kPreviousGeneration + 1)));
  EXPECT_FALSE(next_store_.contains(absl::StrCat("journal-", kPreviousGeneration)));
}

TEST_F(ReadoptTest, ASessionWhoseArenaWasNotKeptAnswersTheRestartErrorAndIsJournaledAsLost) {
  std::optional<PreviousDaemon> kept = ReadPreviousDaemon(previous_store_.Passed());
  ASSERT_TRUE(kept.has_value());
  const std::string lost_arena = ArenaName(*kept, *sessions_[1]);
  ASSERT_EQ(kept->arenas.erase(lost_arena), 1u);  // its memory was not kept
  constexpr uint64_t kNextEpoch = kPreviousEpoch + 1;
  Parts next(next_store_, kNextEpoch, kPreviousGeneration + 1);

  const Readopted readopted = Readopt(*std::move(kept), next.ForReadopt());

  EXPECT_EQ(readopted.engines, 1u);
  EXPECT_EQ(readopted.sessions, 1u);
  EXPECT_EQ(readopted.bytes, sessions_[0]->arena_bytes());
  EXPECT_EQ(readopted.not_readopted, 1u);
  EXPECT_THAT(next.sessions->Find(Credentials(*sessions_[0])), IsOk());
  const absl::Status lost = next.sessions->Find(Credentials(*sessions_[1])).status();
  EXPECT_THAT(lost, StatusIs(absl::StatusCode::kFailedPrecondition,
                             AllOf(HasSubstr(absl::StrCat("epoch ", kPreviousEpoch, " -> ",
                                                          kNextEpoch)),
                                   HasSubstr(absl::StrCat("session ", sessions_[1]->id().value,
                                                          " was not re-adopted")),
                                   HasSubstr(absl::StrCat("its arena's memory (", lost_arena,
                                                          ") was not kept")))));
  ASSERT_TRUE(GetDaemonRestart(lost).has_value());

  // The next restart still tells its engine why, naming the restart it was lost in.
  std::optional<PreviousDaemon> after = ReadPreviousDaemon(next_store_.Passed());
  ASSERT_TRUE(after.has_value());
  ASSERT_EQ(after->lost_sessions.size(), 1u);
  EXPECT_EQ(after->lost_sessions[0].id(), sessions_[1]->id().value);
  EXPECT_EQ(after->lost_sessions[0].owner(), engine_.id.value);
  EXPECT_EQ(after->lost_sessions[0].lost_from_epoch(), kPreviousEpoch);
  EXPECT_EQ(after->lost_sessions[0].lost_at_epoch(), kNextEpoch);
  EXPECT_THAT(after->lost_sessions[0].reason(), HasSubstr("was not kept"));
}

TEST_F(ReadoptTest, ASessionOfAnEngineMissingFromTheJournalIsNotReadopted) {
  std::optional<PreviousDaemon> kept = ReadPreviousDaemon(previous_store_.Passed());
  ASSERT_TRUE(kept.has_value());
  kept->engines.clear();
  Parts next(next_store_, kPreviousEpoch + 1, kPreviousGeneration + 1);

  const Readopted readopted = Readopt(*std::move(kept), next.ForReadopt());

  EXPECT_EQ(readopted.engines, 0u);
  EXPECT_EQ(readopted.sessions, 0u);
  EXPECT_EQ(readopted.not_readopted, 2u);
  EXPECT_EQ(next.backend->ArenaCount(), 0u);
  EXPECT_THAT(next.sessions->Find(Credentials(*sessions_[0])),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr(absl::StrCat("its engine ", engine_.id.value,
                                              " was not in the journal"))));
}

// NOTIFY_SOCKET as a test sets it, restored after.
class ScopedNotifySocket {
 public:
  explicit ScopedNotifySocket(const char* value) {
    if (const char* old = getenv("NOTIFY_SOCKET")) old_ = old;
    if (value == nullptr) {
      unsetenv("NOTIFY_SOCKET");
    } else {
      setenv("NOTIFY_SOCKET", value, 1);
    }
  }
  ~ScopedNotifySocket() {
    if (old_.has_value()) {
      setenv("NOTIFY_SOCKET", old_->c_str(), 1);
    } else {
      unsetenv("NOTIFY_SOCKET");
    }
  }

 private:
  std::optional<std::string> old_;
};

TEST_F(ReadoptTest, ADaemonThatKeepsNothingSaysWhyAndDropsWhatThePreviousOneKept) {
  Parts next(next_store_, kPreviousEpoch + 1, kPreviousGeneration + 1);
  struct Case {
    const char* notify_socket;
    RestartKeepingOptions options;
    std::string off;
  };
  const Case cases[] = {
      {"/run/memra-kv-test/notify", {.keep = false, .memory_dies = "", .slots = 16, .epoch = 9},
       "keep_kv_across_restarts = false"},
      {nullptr, {.keep = true, .memory_dies = "", .slots = 16, .epoch = 9},
       "no service manager ($NOTIFY_SOCKET unset)"},
      {"/run/memra-kv-test/notify",
       {.keep = true, .memory_dies = "cuda_export = ipc: that memory dies", .slots = 16,
        .epoch = 9},
       "cuda_export = ipc: that memory dies"},
  };
  for (const Case& c : cases) {
    ScopedNotifySocket notify(c.notify_socket);
    std::optional<PreviousDaemon> kept = ReadPreviousDaemon(previous_store_.Passed());
    ASSERT_TRUE(kept.has_value());
    const RestartKeeping keeping = KeepForRestart(c.options, kept, next.backend.get());
    EXPECT_EQ(keeping.state, nullptr) << c.off;
    EXPECT_THAT(keeping.off, HasSubstr(c.off));
    // Nothing would journal re-adopted sessions from now on: the kept state is not re-adopted.
    EXPECT_FALSE(kept.has_value()) << c.off;
  }
}

}  // namespace
}  // namespace memra
