#include "server/restart/restart_state.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/codec.h"
#include "core/test_model_plans.h"
#include "gtest/gtest.h"
#include "server/session/arena_pool.h"
#include "server/base/clock.h"
#include "server/config.h"
#include "server/daemon.h"
#include "server/device/device_budget.h"
#include "server/session/engine_leases.h"
#include "server/session/plan_registry.h"
#include "server/session/session_registry.h"
#include "server/testing/test_host_backend.h"
#include "tests/http_get.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::NewTestHostBackend;
using ::memra::testing::TestHostBackendOptions;

// The service manager's side of the fd store (what systemd and memra-kv-supervise do): a
// datagram socket NOTIFY_SOCKET names, keeping received descriptors by FDNAME.
class ServiceManagerStore {
 public:
  ServiceManagerStore() {
    absl::StatusOr<std::unique_ptr<NotifySocketListener>> listener =
        NotifySocketListener::Create("/tmp/memra-restart-state-");
    EXPECT_THAT(listener, IsOk());
    listener_ = *std::move(listener);
    old_ = getenv("NOTIFY_SOCKET") ? getenv("NOTIFY_SOCKET") : "";
    setenv("NOTIFY_SOCKET", listener_->path().c_str(), 1);
  }
  ~ServiceManagerStore() {
    for (auto& [name, fd] : fds_) close(fd);
    if (old_.empty()) {
      unsetenv("NOTIFY_SOCKET");
    } else {
      setenv("NOTIFY_SOCKET", old_.c_str(), 1);
    }
  }

  // Applies every queued notification; the names stored now.
  const std::map<std::string, int>& Drain() {
    while (std::optional<Notification> received = ReceiveNotification(listener_->fd(), /*wait=*/false)) {
      const FdStoreRequest request = ParseFdStoreRequest(received->state);
      if (request.store && received->fds.size() == 1) {
        fds_[request.name] = received->fds[0];
        received->fds.clear();
      }
      if (request.remove && fds_.contains(request.name)) {
        close(fds_[request.name]);
        fds_.erase(request.name);
      }
      for (int fd : received->fds) close(fd);
    }
    return fds_;
  }

  // The service manager dies (memra-kv-supervise SIGKILLed): its socket is gone, and with it
  // what it kept.
  void Die() {
    for (auto& [name, fd] : fds_) close(fd);
    fds_.clear();
    listener_.reset();
  }

  // What a restarted daemon would be passed: duplicates of every stored descriptor.
  std::vector<ListenedFd> Passed() {
    std::vector<ListenedFd> passed;
    for (const auto& [name, fd] : Drain()) {
      passed.push_back(ListenedFd{.fd = fcntl(fd, F_DUPFD_CLOEXEC, 0), .name = name});
    }
    return passed;
  }

 private:
  std::unique_ptr<NotifySocketListener> listener_;
  std::string old_;
  std::map<std::string, int> fds_;
};

class RestartStateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<RestartState>> state =
        RestartState::Create(/*slots=*/4, /*epoch=*/77, /*generation=*/3, backend_.get());
    ASSERT_THAT(state, IsOk());
    state_ = *std::move(state);
    ASSERT_THAT(state_->Publish(), IsOk());
  }

  // A session record of the dense test plan on `arena`.
  JournaledSession Session(uint64_t id, ArenaId arena) {
    JournaledSession session;
    session.id = id;
    session.owner = 1;
    session.slot = 3;
    session.token = "session-token-16";
    session.fingerprint = fingerprint_;
    session.model = model_;
    session.shape.capacity = 256;
    session.layout_version = 2;
    session.arena = arena;
    session.arena_handle = "/memra-kv-handle";
    session.arena_bytes = 4096;
    session.committed = CommittedRecord{.committed_len = 40, .next_generation = 9,
                                        .ring_bases = {0, 0}, .tainted = false};
    return session;
  }

  ServiceManagerStore store_;  // before the state: NOTIFY_SOCKET is set first
  std::unique_ptr<HostBackend> backend_ = NewTestHostBackend(TestHostBackendOptions(1 << 24));
  std::unique_ptr<RestartState> state_;
  std::shared_ptr<const ModelPlan> model_ =
      std::make_shared<const ModelPlan>(test_plans::DenseModel(2, 64, 2));
  std::string fingerprint_ = std::string(32, '\x5a');
};

TEST_F(RestartStateTest, EverythingARestartNeedsReachesTheStoreAndReadsBack) {
  absl::StatusOr<ArenaId> arena = backend_->CreateArena(4096, ArenaVisibility::kExported);
  ASSERT_THAT(arena, IsOk());
  ASSERT_THAT(backend_->Write(*arena, 100, std::vector<uint8_t>{42}), IsOk());
  state_->EngineAttached(1, "engine-token-16b", "engine-a",
                         PeerCredentials{.uid = 1000, .gid = 1001, .pid = 1234}, "team");
  state_->ArenaCreated(*arena);
  state_->SessionChanged(Session(5, *arena));
  const std::string arena_name = absl::StrCat("arena-3-", arena->value);
  const std::string plan_name = absl::StrCat("plan-", absl::BytesToHexString(fingerprint_));
  EXPECT_EQ(store_.Drain().size(), 3u);
  EXPECT_TRUE(store_.Drain().contains("journal-3"));
  EXPECT_TRUE(store_.Drain().contains(arena_name));
  EXPECT_TRUE(store_.Drain().contains(plan_name));
  EXPECT_EQ(state_->stored_fds(), 3u);
  EXPECT_EQ(state_->failures(), 0u);

  std::optional<PreviousDaemon> previous = ReadPreviousDaemon(store_.Passed());
  ASSERT_TRUE(previous.has_value());
  EXPECT_EQ(previous->epoch, 77u);
  EXPECT_EQ(previous->generation, 3u);
  EXPECT_EQ(previous->next_engine_id, 2u);
  EXPECT_EQ(previous->next_session_id, 6u);
  EXPECT_EQ(previous->journal_name, "journal-3");
  EXPECT_EQ(previous->session_slot_limit, 4u);  // the journal's own size
  ASSERT_EQ(previous->engines.size(), 1u);
  EXPECT_EQ(previous->engines[0].token(), "engine-token-16b");
  EXPECT_EQ(previous->engines[0].name(), "engine-a");
  // Who the engine is: a re-attach must come from this uid and keeps this scope.
  EXPECT_EQ(previous->engines[0].uid(), 1000u);
  EXPECT_EQ(previous->engines[0].gid(), 1001u);
  EXPECT_EQ(previous->engines[0].pid(), 1234);
  EXPECT_EQ(previous->engines[0].cache_scope(), "team");
  ASSERT_EQ(previous->sessions.size(), 1u);
  const auto& record = previous->sessions[0];
  EXPECT_EQ(record.id(), 5u);
  EXPECT_EQ(record.slot(), 3u);
  EXPECT_EQ(record.arena_fd_name(), arena_name);
  EXPECT_EQ(record.arena_handle(), "/memra-kv-handle");
  EXPECT_EQ(record.committed_len(), 40u);
  EXPECT_EQ(record.next_generation(), 9u);
  EXPECT_EQ(record.layout_version(), 2u);
  EXPECT_EQ(record.ring_bases_size(), 2);
  EXPECT_TRUE(record.not_recoverable().empty());
  ASSERT_TRUE(previous->plans.contains(plan_name));
  EXPECT_EQ(previous->plans.at(plan_name).layers.size(), 2u);
  ASSERT_TRUE(previous->arenas.contains(arena_name));
  // The kept descriptor is the arena's memory.
  std::unique_ptr<HostBackend> next = NewTestHostBackend(TestHostBackendOptions(1 << 24));
  absl::StatusOr<ArenaId> adopted =
      next->AdoptArenaFd(previous->arenas[arena_name].release(), 4096, "/memra-kv-handle");
  ASSERT_THAT(adopted, IsOk());
  std::vector<uint8_t> byte(1);
  ASSERT_THAT(next->Read(*adopted, 100, absl::MakeSpan(byte)), IsOk());
  EXPECT_EQ(byte[0], 42);
}

// A daemon that re-adopted sessions of a larger one keeps their slots, so its journal carries
// the larger daemon's slot limit: the next restart accepts a slot past this journal's size.
TEST_F(RestartStateTest, ACarriedSessionSlotLimitReachesTheNextDaemon) {
  absl::StatusOr<ArenaId> arena = backend_->CreateArena(4096, ArenaVisibility::kExported);
  ASSERT_THAT(arena, IsOk());
  state_->CarrySessionSlotLimit(1000);
  EXPECT_EQ(state_->session_slot_limit(), 1000u);
  state_->EngineAttached(1, "engine-token-16b", "engine-a", PeerCredentials{}, "uid:0");
  state_->ArenaCreated(*arena);
  JournaledSession session = Session(5, *arena);
  session.slot = 900;  // given by the larger daemon; this journal has 4 records
  state_->SessionChanged(session);
  std::optional<PreviousDaemon> previous = ReadPreviousDaemon(store_.Passed());
  ASSERT_TRUE(previous.has_value());
  EXPECT_EQ(previous->session_slot_limit, 1000u);
  ASSERT_EQ(previous->sessions.size(), 1u);
  EXPECT_EQ(previous->sessions[0].slot(), 900u);
}

TEST_F(RestartStateTest, ReleasesRemoveWhatTheyKept) {
  absl::StatusOr<ArenaId> arena = backend_->CreateArena(4096, ArenaVisibility::kExported);
  ASSERT_THAT(arena, IsOk());
  state_->EngineAttached(1, "engine-token-16b", "engine-a",
                         PeerCredentials{.uid = 1000, .gid = 1001, .pid = 1234}, "team");
  state_->ArenaCreated(*arena);
  state_->SessionChanged(Session(5, *arena));
  state_->SessionReleased(5);
  state_->ArenaFreed(*arena);
  state_->EngineForgotten(1);
  EXPECT_EQ(store_.Drain().size(), 1u) << "only the journal stays";
  EXPECT_EQ(state_->stored_fds(), 1u);
  std::optional<PreviousDaemon> previous = ReadPreviousDaemon(store_.Passed());
  ASSERT_TRUE(previous.has_value());
  EXPECT_TRUE(previous->engines.empty());
  EXPECT_TRUE(previous->sessions.empty());
}

TEST_F(RestartStateTest, ThePoolsArenasAreNeverKept) {
  // The daemon's parts over this journal: a session's arena is kept while a session holds it;
  // released into its engine's pool it belongs to no session and leaves the store; taken back
  // by the next session it is kept again (the same handle).
  FakeClock clock;
  DeviceBudget budget(uint64_t{16} << 20, "test");
  EngineLeases leases(&clock, &budget,
                      LeaseSettings{absl::Seconds(10), absl::Seconds(1), absl::Seconds(10)},
                      state_.get());
  PlanRegistry plans{FormatDefaults()};
  ArenaPool pool(backend_.get(), &budget, uint64_t{1} << 30);
  SessionRegistry registry(backend_.get(), &budget, &leases, &plans, FormatDefaults(), nullptr,
                           UINT64_MAX, &pool, state_.get());
  absl::StatusOr<PlanFingerprint> plan = plans.Register(*model_);
  ASSERT_THAT(plan, IsOk());
  absl::StatusOr<EngineLease> engine = leases.Attach(
      EngineIdentity{.name = "a", .peer = {.uid = 1000, .gid = 1000, .pid = 7},
                     .cache_scope = "uid:1000"},
      nullptr);
  ASSERT_THAT(engine, IsOk());
  const EngineCredentials credentials{engine->id, engine->token};
  SessionShape shape;
  shape.capacity = 256;
  auto handle_of = [](DaemonSession& session) {
    absl::StatusOr<SessionReport> report = session.GetState(/*with_layout=*/true);
    EXPECT_THAT(report, IsOk());
    return report.ok() && report->layout.has_value() ? report->layout->arena.handle
                                                     : std::string();
  };
  auto arenas_kept = [&] {
    size_t count = 0;
    for (const auto& [name, fd] : store_.Drain()) count += absl::StartsWith(name, "arena-");
    return count;
  };
  absl::StatusOr<std::shared_ptr<DaemonSession>> first =
      registry.Create(credentials, *plan, shape, std::nullopt);
  ASSERT_THAT(first, IsOk());
  const std::string handle = handle_of(**first);
  ASSERT_FALSE(handle.empty());
  EXPECT_EQ(arenas_kept(), 1u);
  ASSERT_THAT(registry.Release(SessionCredentials{(*first)->id(), (*first)->params().token}),
              IsOk());
  EXPECT_EQ((*first)->pooled_handles(), std::vector<std::string>{handle});
  EXPECT_EQ(arenas_kept(), 0u) << "a pooled arena is not kept for a restart";
  {
    std::optional<PreviousDaemon> previous = ReadPreviousDaemon(store_.Passed());
    ASSERT_TRUE(previous.has_value());
    EXPECT_TRUE(previous->sessions.empty());
    EXPECT_TRUE(previous->arenas.empty());
  }
  absl::StatusOr<std::shared_ptr<DaemonSession>> second =
      registry.Create(credentials, *plan, shape, std::nullopt);
  ASSERT_THAT(second, IsOk());
  EXPECT_EQ(handle_of(**second), handle) << "served from the pool";
  EXPECT_EQ(arenas_kept(), 1u) << "held by a session again: kept again";
  std::optional<PreviousDaemon> previous = ReadPreviousDaemon(store_.Passed());
  ASSERT_TRUE(previous.has_value());
  ASSERT_EQ(previous->sessions.size(), 1u);
  EXPECT_EQ(previous->sessions[0].arena_handle(), handle);
  EXPECT_TRUE(previous->arenas.contains(previous->sessions[0].arena_fd_name()));
  registry.ReleaseAll();
  pool.DrainAll();
  EXPECT_EQ(arenas_kept(), 0u);
}

TEST_F(RestartStateTest, WhatCannotBeKeptIsRecordedAsSuch) {
  // An arena the store never got: its session is journaled as not recoverable, with why.
  state_->SessionChanged(Session(6, ArenaId{999}));
  EXPECT_EQ(state_->failures(), 0u);
  // A full journal (4 slots) loses the fifth record, counted and logged.
  for (uint64_t id = 7; id <= 10; ++id) state_->SessionChanged(Session(id, ArenaId{999}));
  EXPECT_EQ(state_->failures(), 1u);
  // A private arena has no descriptor to keep.
  absl::StatusOr<ArenaId> private_arena = backend_->CreateArena(4096, ArenaVisibility::kPrivate);
  ASSERT_THAT(private_arena, IsOk());
  state_->ArenaCreated(*private_arena);
  EXPECT_EQ(state_->failures(), 2u);
  std::optional<PreviousDaemon> previous = ReadPreviousDaemon(store_.Passed());
  ASSERT_TRUE(previous.has_value());
  ASSERT_EQ(previous->sessions.size(), 4u);
  EXPECT_EQ(previous->sessions[0].not_recoverable(),
            "its arena's memory was not kept in the fd store");
}

// Issue 26: why a session was not re-adopted is journaled, so the daemon after the next restart
// still tells its engine; the record goes when its engine is forgotten.
TEST_F(RestartStateTest, LostSessionsReachTheNextDaemonUntilTheirEngineIsForgotten) {
  state_->EngineAttached(1, "engine-token-16b", "engine-a", PeerCredentials{}, "uid:0");
  memra::kvd::journal::LostSessionRecord lost;
  lost.set_id(6);
  lost.set_owner(1);
  lost.set_reason("a transaction was open on recurrent layer 2");
  lost.set_lost_from_epoch(10);
  lost.set_lost_at_epoch(11);
  state_->SessionLost(lost);
  std::optional<PreviousDaemon> previous = ReadPreviousDaemon(store_.Passed());
  ASSERT_TRUE(previous.has_value());
  ASSERT_EQ(previous->lost_sessions.size(), 1u);
  EXPECT_EQ(previous->lost_sessions[0].id(), 6u);
  EXPECT_EQ(previous->lost_sessions[0].owner(), 1u);
  EXPECT_EQ(previous->lost_sessions[0].reason(), "a transaction was open on recurrent layer 2");
  EXPECT_EQ(previous->lost_sessions[0].lost_from_epoch(), 10u);
  EXPECT_EQ(previous->lost_sessions[0].lost_at_epoch(), 11u);
  EXPECT_TRUE(previous->sessions.empty());
  state_->EngineForgotten(1);
  previous = ReadPreviousDaemon(store_.Passed());
  ASSERT_TRUE(previous.has_value());
  EXPECT_TRUE(previous->lost_sessions.empty());
  EXPECT_TRUE(previous->engines.empty());
}

// Issue 26: a damaged newest record would bring a session back older than its engine was told
// (length 40 after it was told 41): it is not re-adopted, with why; a slot with no readable
// copy is counted, since nothing names what it held.
TEST_F(RestartStateTest, ASessionWhoseNewestRecordIsDamagedIsNotBroughtBack) {
  absl::StatusOr<ArenaId> arena = backend_->CreateArena(4096, ArenaVisibility::kExported);
  ASSERT_THAT(arena, IsOk());
  state_->EngineAttached(1, "engine-token-16b", "engine-a", PeerCredentials{}, "uid:0");  // slot 0
  state_->ArenaCreated(*arena);
  JournaledSession session = Session(5, *arena);
  state_->SessionChanged(session);  // slot 1, half 0
  session.committed.committed_len = 41;
  state_->SessionChanged(session);  // slot 1, half 1: the newest
  const int journal = store_.Drain().at("journal-3");
  const off_t slot1 = RestartJournal::kHeaderBytes + RestartJournal::kSlotBytes;
  const off_t newest = slot1 + RestartJournal::kHalfBytes + RestartJournal::kHalfHeaderBytes;
  ASSERT_EQ(pwrite(journal, "X", 1, newest), 1);
  std::optional<PreviousDaemon> previous = ReadPreviousDaemon(store_.Passed());
  ASSERT_TRUE(previous.has_value());
  ASSERT_EQ(previous->sessions.size(), 1u);
  EXPECT_EQ(previous->sessions[0].id(), 5u);
  EXPECT_EQ(previous->sessions[0].committed_len(), 40u);
  EXPECT_EQ(previous->sessions[0].not_recoverable(),
            "its newest restart journal record was damaged (it fails its checksum), so the state "
            "it was last acknowledged at is not known");
  EXPECT_EQ(previous->torn_records, 1u);
  EXPECT_EQ(previous->unreadable_records, 0u);
  // The older copy damaged too: nothing names the session any more.
  ASSERT_EQ(pwrite(journal, "X", 1, slot1 + RestartJournal::kHalfHeaderBytes), 1);
  previous = ReadPreviousDaemon(store_.Passed());
  ASSERT_TRUE(previous.has_value());
  EXPECT_TRUE(previous->sessions.empty());
  EXPECT_EQ(previous->unreadable_records, 1u);
  EXPECT_EQ(previous->engines.size(), 1u);
}

// Issue 26: with the supervisor SIGKILLed the daemon serves on without restart survival; its
// status and its metrics say so (not just "serving").
TEST_F(RestartStateTest, ADaemonWhoseServiceManagerDiedSaysRestartSurvivalIsLost) {
  char pattern[] = "/tmp/memra-survival-XXXXXX";
  ASSERT_NE(mkdtemp(pattern), nullptr);
  const std::string dir = pattern;
  DaemonConfig config;
  config.socket_path = dir + "/kvd.sock";
  config.metrics_address = "127.0.0.1:0";
  FakeClock clock;
  absl::StatusOr<std::unique_ptr<Daemon>> daemon =
      Daemon::Create(config, NewTestHostBackend(TestHostBackendOptions(1 << 24)), &clock);
  ASSERT_THAT(daemon, IsOk());
  ASSERT_THAT((*daemon)->Start(), IsOk());
  memra::kv::v1::GetStatusResponse status = (*daemon)->GetStatus();
  EXPECT_EQ(status.restart_survival(), memra::kv::v1::RESTART_SURVIVAL_ON);
  EXPECT_EQ(status.restart_survival_detail(),
            "journal-1: 1 descriptor (journal, arenas, plans) in the service manager's fd "
            "store");
  EXPECT_THAT(testing::HttpGet((*daemon)->metrics_port(), "/metrics"),
              ::testing::HasSubstr("\nmemra_restart_survival 1\n"));

  store_.Die();
  // The lease thread asks the service manager every second: wait for the state it reports.
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while ((*daemon)->GetStatus().restart_survival() != memra::kv::v1::RESTART_SURVIVAL_LOST &&
         absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  status = (*daemon)->GetStatus();
  EXPECT_EQ(status.restart_survival(), memra::kv::v1::RESTART_SURVIVAL_LOST);
  EXPECT_THAT(status.restart_survival_detail(),
              HasSubstrs("the service manager stopped answering on NOTIFY_SOCKET",
                         "KV will not survive the next restart"));
  EXPECT_THAT(testing::HttpGet((*daemon)->metrics_port(), "/metrics"),
              ::testing::HasSubstr("\nmemra_restart_survival 0\n"));
  EXPECT_FALSE(status.draining()) << "it serves on";
  (*daemon)->Shutdown();
  daemon->reset();
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
}

// Without a service manager nothing survives, and the status says why.
TEST(RestartSurvival, WithoutAServiceManagerItIsOffAndSaysWhy) {
  ASSERT_EQ(getenv("NOTIFY_SOCKET"), nullptr);
  DaemonConfig config;
  FakeClock clock;
  absl::StatusOr<std::unique_ptr<Daemon>> daemon =
      Daemon::Create(config, NewTestHostBackend(TestHostBackendOptions(1 << 24)), &clock);
  ASSERT_THAT(daemon, IsOk());
  const memra::kv::v1::GetStatusResponse status = (*daemon)->GetStatus();
  EXPECT_EQ(status.restart_survival(), memra::kv::v1::RESTART_SURVIVAL_OFF);
  EXPECT_THAT(status.restart_survival_detail(), HasSubstrs("no service manager"));
  config.keep_kv_across_restarts = false;
  absl::StatusOr<std::unique_ptr<Daemon>> off =
      Daemon::Create(config, NewTestHostBackend(TestHostBackendOptions(1 << 24)), &clock);
  ASSERT_THAT(off, IsOk());
  EXPECT_EQ((*off)->GetStatus().restart_survival_detail(), "keep_kv_across_restarts = false");
}

// A daemon that keeps no journal itself re-adopts nothing and drops what the previous one kept:
// a later restart must never bring back records over memory this daemon changed.
TEST_F(RestartStateTest, ADaemonKeepingNoJournalDropsThePreviousDaemonsState) {
  absl::StatusOr<ArenaId> arena = backend_->CreateArena(4096, ArenaVisibility::kExported);
  ASSERT_THAT(arena, IsOk());
  state_->EngineAttached(1, "engine-token-16b", "engine-a", PeerCredentials{}, "uid:0");
  state_->ArenaCreated(*arena);
  state_->SessionChanged(Session(5, *arena));
  ASSERT_EQ(store_.Drain().size(), 3u);  // journal, arena, plan
  DaemonConfig config;
  config.keep_kv_across_restarts = false;
  FakeClock clock;
  absl::StatusOr<std::unique_ptr<Daemon>> daemon =
      Daemon::Create(config, NewTestHostBackend(TestHostBackendOptions(1 << 24)), &clock,
                     store_.Passed());
  ASSERT_THAT(daemon, IsOk());
  EXPECT_EQ((*daemon)->readopted().previous_epoch, 0u);
  EXPECT_EQ((*daemon)->readopted().sessions, 0u);
  EXPECT_TRUE(store_.Drain().empty());
  (*daemon)->Shutdown();
}

// Kept arena memory passed back with no journal that opens (here: a journal of another format)
// leaves the service manager's store too: otherwise the store would pin it for good.
TEST(ReadPreviousDaemon, WithoutAJournalThatOpensThePassedNamesLeaveTheStore) {
  ServiceManagerStore store;
  for (const char* name : {"arena-1-1", "journal-7"}) {
    ScopedFd memfd(memfd_create(name, MFD_CLOEXEC));
    ASSERT_GE(memfd.get(), 0);
    ASSERT_EQ(ftruncate(memfd.get(), 4096), 0);  // a journal of 4096 zero bytes: no magic
    ASSERT_THAT(SdNotifyWithFds(absl::StrCat("FDSTORE=1\nFDNAME=", name), {memfd.get()}), IsOk());
  }
  ASSERT_EQ(store.Drain().size(), 2u);
  EXPECT_FALSE(ReadPreviousDaemon(store.Passed()).has_value());
  EXPECT_TRUE(store.Drain().empty());
}

TEST(ReadPreviousDaemon, WithoutAJournalNothingIsReadoptedAndEverythingIsALeftover) {
  const int memfd = memfd_create("stray", MFD_CLOEXEC);
  ASSERT_GE(memfd, 0);
  EXPECT_FALSE(ReadPreviousDaemon({ListenedFd{memfd, "arena-1-1"}}).has_value());
  EXPECT_FALSE(ReadPreviousDaemon({}).has_value());
}

}  // namespace
}  // namespace memra
