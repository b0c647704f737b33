#ifndef MEMRA_TESTS_SERVICE_TEST_DAEMON_H_
#define MEMRA_TESTS_SERVICE_TEST_DAEMON_H_

// An in-process memra-kvd (Daemon over a fault-injecting host backend, FakeClock) serving on a
// real Unix socket in a fresh temporary directory, and a real KvClient attached to it.

#include <stdlib.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "client/client.h"
#include "client/handoff_channel.h"
#include "client/internal.h"
#include "common/grpc_status.h"
#include "core/model_plan.h"
#include "gtest/gtest.h"
#include "proto/memra/kv/v1/admin.grpc.pb.h"
#include "server/base/clock.h"
#include "server/daemon.h"
#include "server/testing/fault_injecting_backend.h"
#include "server/device/host_backend.h"
#include "server/store/prefix_cache.h"
#include "server/testing/test_host_backend.h"
#include "tests/service/test_plans.h"

namespace memra::testing {

// A short directory under /tmp: Unix socket paths must stay under 108 bytes, which TEST_TMPDIR
// does not promise.
inline std::string MakeSocketDir() {
  char path[] = "/tmp/memra-test-XXXXXX";
  EXPECT_NE(mkdtemp(path), nullptr);
  return path;
}

// Threads of this process: the in-process daemon's, and the test's own few.
inline size_t ProcessThreads() {
  size_t threads = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) {
    (void)entry;
    ++threads;
  }
  return threads;
}

inline SessionOptions Options(uint64_t capacity, bool spec_snapshot = true) {
  SessionOptions options;
  options.capacity = capacity;
  options.spec_snapshot = spec_snapshot;
  return options;
}

// Lowers this process's RLIMIT_NOFILE (so the in-process daemon's, which derives its descriptor
// limits from it at start) until Restore() or destruction: the descriptor budgets at scaled-down
// limits.
class LoweredOpenFileLimit {
 public:
  LoweredOpenFileLimit() = default;
  LoweredOpenFileLimit(const LoweredOpenFileLimit&) = delete;
  LoweredOpenFileLimit& operator=(const LoweredOpenFileLimit&) = delete;
  ~LoweredOpenFileLimit() { Restore(); }

  void Lower(rlim_t open_files) {
    ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved_), 0);
    rlimit lowered = saved_;
    lowered.rlim_cur = std::min<rlim_t>(open_files, saved_.rlim_max);
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &lowered), 0);
    lowered_ = true;
  }
  void Restore() {
    if (lowered_) setrlimit(RLIMIT_NOFILE, &saved_);
    lowered_ = false;
  }

 private:
  rlimit saved_{};
  bool lowered_ = false;
};

class DaemonTest : public ::testing::Test {
 protected:
  static constexpr uint64_t kBudgetBytes = uint64_t{64} << 20;
  static constexpr uint64_t kLeaseTimeoutMs = 1000;
  static constexpr uint64_t kLeaseGraceMs = 500;

  void SetUp() override {
    dir_ = MakeSocketDir();
    host_ = NewTestHostBackend(TestHostBackendOptions(kBudgetBytes));
    ASSERT_NE(host_, nullptr);
    auto faults = std::make_unique<FaultInjectingBackend>(host_.get());
    faults_ = faults.get();
    DaemonConfig config;
    config.sockets.socket_path = dir_ + "/kvd.sock";
    config.sockets.socket_mode = 0600;
    config.admission.budget_bytes = kBudgetBytes;
    config.leases.timeout = absl::Milliseconds(kLeaseTimeoutMs);
    config.leases.grace = absl::Milliseconds(kLeaseGraceMs);
    config.metrics.metrics_address = "127.0.0.1:0";  // an ephemeral port: tests run side by side
    config.metrics.rpc_metrics = true;  // off by default; the metrics tests count calls
    ConfigureDaemon(config);
    absl::StatusOr<std::unique_ptr<Daemon>> daemon =
        Daemon::Create(config, std::move(faults), &clock_);
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = *std::move(daemon);
    ASSERT_TRUE(daemon_->Start().ok());
    client_ = NewClient("engine-a");
    ASSERT_NE(client_, nullptr);
    absl::StatusOr<PlanFingerprint> plan = client_->RegisterPlan(HybridTestPlan());
    ASSERT_TRUE(plan.ok()) << plan.status();
    plan_ = *plan;
  }

  void TearDown() override {
    client_.reset();
    operator_.reset();
    if (daemon_ != nullptr) daemon_->Shutdown();
    // Nothing outlives the daemon: invariant (2) of Daemon.
    if (host_ != nullptr) {
      EXPECT_EQ(host_->ArenaCount(), 0u);
      EXPECT_EQ(host_->AllocatedBytes(), 0u);
    }
    daemon_.reset();
    rmdir(dir_.c_str());
  }

  // Evicts every prefix entry, so the cache's arenas are freed before TearDown counts what is
  // left (fixtures that configure a prefix cache call it first in their TearDown).
  void EvictAllPrefixEntries() {
    if (daemon_ == nullptr || daemon_->prefix_cache() == nullptr) return;
    PrefixCache& cache = *daemon_->prefix_cache();
    for (const ScopedEntry& entry : cache.ListEntries()) {
      EXPECT_TRUE(cache.EvictEntry(entry.view.id).ok()) << "entry " << entry.view.id.value;
    }
  }

  // A fixture's changes to the daemon's configuration, applied before it starts.
  virtual void ConfigureDaemon(DaemonConfig& /*config*/) {}

  // A client attached as `engine_name`; null (and a failure) on error.
  std::unique_ptr<KvClient> NewClient(const std::string& engine_name) {
    absl::StatusOr<std::unique_ptr<KvClient>> client = KvClient::Connect(daemon_->socket_path());
    EXPECT_TRUE(client.ok()) << client.status();
    if (!client.ok()) return nullptr;
    absl::Status attached = (*client)->Attach(engine_name);
    EXPECT_TRUE(attached.ok()) << attached;
    return attached.ok() ? *std::move(client) : nullptr;
  }

  // A connection to the handoff socket, whose ticket a hand-built Attach hello carries; null
  // (and a failure) on error.
  std::unique_ptr<HandoffChannel> NewHandoff() {
    absl::StatusOr<std::unique_ptr<HandoffChannel>> channel =
        HandoffChannel::Connect(daemon_->handoff_socket_path(), absl::Seconds(5));
    EXPECT_TRUE(channel.ok()) << channel.status();
    return channel.ok() ? *std::move(channel) : nullptr;
  }

  // A client of the admin socket (the operators' calls), not attached; null (and a failure) on
  // error. (Its handoff socket is the daemon's, so an Attach attempt reaches the admin socket.)
  std::unique_ptr<KvClient> NewOperator() {
    ClientOptions options;
    options.handoff_socket_path = daemon_->handoff_socket_path();
    absl::StatusOr<std::unique_ptr<KvClient>> client =
        KvClient::Connect(daemon_->admin_socket_path(), std::move(options));
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? *std::move(client) : nullptr;
  }

  // A KvAdmin call (e.g. &KvAdmin::Stub::Drain) as an operator, on the admin socket.
  template <typename Request, typename Response>
  absl::Status Operator(grpc::Status (memra::kv::v1::KvAdmin::Stub::*method)(
                            grpc::ClientContext*, const Request&, Response*),
                        const Request& request, Response* response) {
    if (operator_ == nullptr) operator_ = NewOperator();
    if (operator_ == nullptr) return absl::UnavailableError("no client of the admin socket");
    return FromGrpcStatus((ClientInternals::Admin(*operator_).*method)(
        ClientInternals::NewContext(*operator_).get(), request, response));
  }

  std::unique_ptr<Session> NewSession(KvClient& client, uint64_t capacity,
                                      bool spec_snapshot = true) {
    absl::StatusOr<std::unique_ptr<Session>> session =
        client.CreateSession(plan_, Options(capacity, spec_snapshot));
    EXPECT_TRUE(session.ok()) << session.status();
    return session.ok() ? *std::move(session) : nullptr;
  }

  // A fresh session of `capacity` (no spec snapshot) with `tokens` committed, one row each,
  // with their token ids (what a prefix capture keys by); null (and a failure) on error.
  std::unique_ptr<Session> CommittedSession(KvClient& client, uint64_t capacity,
                                            const std::vector<int32_t>& tokens) {
    std::unique_ptr<Session> session = NewSession(client, capacity, /*spec_snapshot=*/false);
    if (session == nullptr) return nullptr;
    absl::StatusOr<Transaction> transaction = session->Begin();
    EXPECT_TRUE(transaction.ok()) << transaction.status();
    if (!transaction.ok()) return nullptr;
    absl::Status done = session->PrepareAppend(transaction->generation, tokens.size()).status();
    if (done.ok()) done = session->PublishAppend(transaction->generation).status();
    if (done.ok()) done = session->Commit(transaction->generation, tokens.size(), tokens).status();
    EXPECT_TRUE(done.ok()) << done;
    return done.ok() ? std::move(session) : nullptr;
  }

  // Engines the daemon knows (attached, or within their grace).
  size_t EngineCount() const {
    return static_cast<size_t>(daemon_->GetStatus().engine_status_size());
  }

  // Admin calls through the client's KvAdmin stub.
  template <typename Request, typename Response, typename Method>
  absl::Status Admin(Method method, const Request& request, Response* response) {
    return FromGrpcStatus((ClientInternals::Admin(*client_).*method)(
        ClientInternals::NewContext(*client_).get(), request, response));
  }

  // Detaches `client` and waits (on the daemon's view, not the wall clock) until the daemon saw
  // the stream end, then lets the grace pass: the engine is reclaimed.
  void KillEngine(KvClient& client) {
    const uint64_t id = client.engine_id();
    client.Detach();
    auto engine_state = [&]() -> std::optional<memra::kv::v1::EngineStatus> {
      const memra::kv::v1::GetStatusResponse daemon_status = daemon_->GetStatus();
      for (const memra::kv::v1::EngineStatus& status : daemon_status.engine_status()) {
        if (status.engine_id() == id) return status;
      }
      return std::nullopt;
    };
    for (int i = 0; i < 500; ++i) {
      std::optional<memra::kv::v1::EngineStatus> state = engine_state();
      if (!state.has_value() || !state->lease_live()) break;
      absl::SleepFor(absl::Milliseconds(10));
    }
    clock_.Advance(absl::Milliseconds(kLeaseGraceMs));
    daemon_->CheckLeases();
    EXPECT_FALSE(engine_state().has_value()) << "engine " << id << " was not reclaimed";
    // The jump ate into the other engines' lease timeouts: wait until each has heartbeated
    // since, so a later jump cannot expire them.
    for (int i = 0; i < 500; ++i) {
      bool fresh = true;
      const memra::kv::v1::GetStatusResponse status = daemon_->GetStatus();
      for (const memra::kv::v1::EngineStatus& engine : status.engine_status()) {
        fresh = fresh && engine.last_heartbeat_age_ms() == 0;
      }
      if (fresh) break;
      absl::SleepFor(absl::Milliseconds(10));
    }
  }

  std::string dir_;
  FakeClock clock_;
  std::unique_ptr<HostBackend> host_;
  FaultInjectingBackend* faults_ = nullptr;  // owned by daemon_
  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<KvClient> client_;
  std::unique_ptr<KvClient> operator_;  // Operator()'s client of the admin socket
  PlanFingerprint plan_{};
};

}  // namespace memra::testing

#endif  // MEMRA_TESTS_SERVICE_TEST_DAEMON_H_
