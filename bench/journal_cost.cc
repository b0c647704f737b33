// What keeping KV across a restart costs per step (docs/failure-model.md#the-daemon-dies): one
// decode step for N sessions (Begin, PrepareAppend of one row, PublishAppend, Commit) through the
// daemon's one dispatcher (SessionRegistry::Run, as every Step entry reaches it), with the
// restart journal (server/restart/restart_state.h: a slot rewritten in place after each operation
// that changed the committed state) and without it, in the same process, interleaved round by round
// so the machine's load falls on both alike. The fd store is a real datagram socket drained by a
// thread (what systemd or memra-kv-supervise is); only session creation talks to it.
//
//   bazel run -c opt //bench:journal_cost -- [sessions=64] [rounds=30]

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "bench/harness.h"
#include "core/test_model_plans.h"
#include "server/base/clock.h"
#include "server/device/device_budget.h"
#include "server/session/engine_leases.h"
#include "server/device/host_backend.h"
#include "server/session/plan_registry.h"
#include "server/restart/restart_state.h"
#include "server/base/sd_notify.h"
#include "server/session/session_registry.h"

namespace memra::bench {
namespace {


constexpr uint64_t kCapacity = 128;
constexpr int kStepsPerRound = 100;

// The service manager's end of NOTIFY_SOCKET, drained (descriptors closed) on a thread.
class DrainedNotifySocket {
 public:
  DrainedNotifySocket() : listener_(*NotifySocketListener::Create("/tmp/memra-journal-cost-")) {
    setenv("NOTIFY_SOCKET", listener_->path().c_str(), 1);
    thread_ = std::thread([this] {
      timeval timeout{.tv_sec = 0, .tv_usec = 100000};
      setsockopt(listener_->fd(), SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
      while (!stop_.load()) {
        std::optional<Notification> received =
            ReceiveNotification(listener_->fd(), /*wait=*/true);
        if (received.has_value()) {
          for (int fd : received->fds) close(fd);
        }
      }
    });
  }
  ~DrainedNotifySocket() {
    stop_.store(true);
    thread_.join();
  }

 private:
  const std::unique_ptr<NotifySocketListener> listener_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// One daemon's session machinery, with or without the journal.
struct Daemon {
  explicit Daemon(bool journal) {
    HostBackendOptions options;
    options.total_bytes = uint64_t{4} << 30;
    options.name_prefix = absl::StrCat("memra-journal-cost-", getpid(), journal ? "-j" : "-n");
    backend = *HostBackend::Create(options);
    if (journal) state = *RestartState::Create(4096, 1, 1, backend.get());
    leases = std::make_unique<EngineLeases>(
        &clock, &budget, LeaseSettings{absl::Hours(1), absl::Hours(1), absl::Hours(1)},
        state.get());
    registry = std::make_unique<SessionRegistry>(backend.get(), &budget, leases.get(), &plans,
                                                 FormatDefaults(), nullptr, UINT64_MAX,
                                                 /*pool=*/nullptr, state.get());
    lease = *leases->Attach(
        EngineIdentity{.name = "bench",
                       .peer = {.uid = getuid(), .gid = getgid(), .pid = getpid()},
                       .cache_scope = absl::StrCat("uid:", getuid())},
        nullptr);
    plan = *plans.Register(test_plans::Llama3_8B());
  }

  void CreateSessions(size_t count) {
    SessionShape shape;
    shape.capacity = kCapacity;
    for (size_t i = 0; i < count; ++i) {
      sessions.push_back(*registry->Create(EngineCredentials{lease.id, lease.token}, plan, shape,
                                           std::nullopt));
    }
  }

  // kStepsPerRound steps of every session; ns per step (all sessions).
  double Round() {
    for (const auto& session : sessions) {
      (void)registry->Run({session->id(), session->params().token}, ResetOp{});
    }
    const int64_t start = NowNs();
    for (int step = 0; step < kStepsPerRound; ++step) {
      for (const auto& session : sessions) {
        const SessionCredentials credentials{session->id(), session->params().token};
        absl::StatusOr<SessionResult> begun = registry->Run(credentials, BeginOp{});
        const uint64_t generation =
            begun.ok() ? std::get<TransactionId>(*begun).generation : 0;
        const SessionOp ops[] = {PrepareAppendOp{generation, 1}, PublishAppendOp{generation},
                                 CommitOp{generation, 1, {}}};
        (void)registry->Run(credentials, ops, [] { return absl::OkStatus(); });
      }
    }
    return static_cast<double>(NowNs() - start) / kStepsPerRound;
  }

  FakeClock clock;
  DeviceBudget budget{uint64_t{4} << 30, "bench"};
  PlanRegistry plans{FormatDefaults()};
  std::unique_ptr<HostBackend> backend;
  std::unique_ptr<RestartState> state;
  std::unique_ptr<EngineLeases> leases;
  std::unique_ptr<SessionRegistry> registry;
  EngineLease lease;
  PlanFingerprint plan{};
  std::vector<std::shared_ptr<DaemonSession>> sessions;
};

int Run(int argc, char** argv) {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  const size_t sessions = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 64;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 30;
  DrainedNotifySocket store;
  Daemon without(false);
  Daemon with(true);
  without.CreateSessions(sessions);
  with.CreateSessions(sessions);
  std::vector<double> plain, journaled;
  for (int round = 0; round < rounds; ++round) {
    plain.push_back(without.Round());
    journaled.push_back(with.Round());
  }
  std::sort(plain.begin(), plain.end());
  std::sort(journaled.begin(), journaled.end());
  const double p = plain[plain.size() / 2];
  const double j = journaled[journaled.size() / 2];
  std::printf("%zu sessions of Llama-3-8B (32 K/V layers), one row per step, %d rounds of %d "
              "steps, medians:\n",
              sessions, rounds, kStepsPerRound);
  std::printf("  without journal: %s per step (%s per session-step)\n", Us(p).c_str(),
              Us(p / sessions).c_str());
  std::printf("  with journal:    %s per step (%s per session-step)\n", Us(j).c_str(),
              Us(j / sessions).c_str());
  std::printf("  ratio with/without: %s; journal failures: %llu\n", Ratio(j / p).c_str(),
              static_cast<unsigned long long>(with.state->failures()));
  return 0;
}

}  // namespace
}  // namespace memra::bench

int main(int argc, char** argv) { return memra::bench::Run(argc, argv); }
