// memra-kvd: the per-GPU KV-cache daemon. The only code that is just the executable: read the
// configuration, make the backend, run a Daemon, and turn signals into drain / reload / exit.
//
//   memra-kvd [--config=/etc/memra-kv/gpu0.conf] [--<key>=<value> ...]
//
// Every configuration key is also a flag (server/config.h); flags win over the file.
// Exit status: 0 after a drain, 78 (EX_CONFIG) for a configuration error, 1 otherwise.

#include <malloc.h>
#include <sys/resource.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/backend_factory.h"
#include "server/base/clock.h"
#include "server/config.h"
#include "server/daemon.h"
#include "server/instance.h"
#include "server/lifecycle.h"
#include "server/base/sd_notify.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(std::string, config, "",
          "Configuration file (TOML). Empty: defaults; every key can also be given as a flag.");

namespace memra {
namespace {

// What the signal thread tells the main thread. Callbacks only record; main acts.
struct Events {
  absl::Mutex mu;
  bool drain ABSL_GUARDED_BY(mu) = false;
  int reloads ABSL_GUARDED_BY(mu) = 0;
  std::atomic<Daemon*> daemon{nullptr};
};

// Every exported arena holds a descriptor (kept in the fd store for a restart): a soft limit of
// 1,024 would cap sessions far below max_arenas. Raise it to the hard limit, as the unit's
// LimitNOFILE= does under systemd; the daemon uses no select().
void RaiseDescriptorLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur >= limit.rlim_max) return;
  const rlim_t before = limit.rlim_cur;
  limit.rlim_cur = limit.rlim_max;
  if (setrlimit(RLIMIT_NOFILE, &limit) == 0) {
    spdlog::info("descriptor limit raised from {} to {} (one per exported arena)", before,
                 limit.rlim_max);
  }
}

void ApplyLogLevel(LogLevel level) {
  spdlog::set_level(static_cast<spdlog::level::level_enum>(level));
}

void PrintHelp(const char* argv0) {
  std::printf("usage: %s [--config=FILE] [--<key>=<value> ...]\n\nconfiguration keys:\n", argv0);
  for (const ConfigKeyInfo& key : ConfigKeys()) {
    std::printf("  --%-28s %s (%s)%s\n", std::string(key.name).c_str(),
                std::string(key.help).c_str(), key.accepted.c_str(),
                key.reloadable ? " [reloadable]" : "");
  }
}

void Reload(const std::string& path, const std::vector<ConfigOverride>& overrides,
            DaemonConfig& running, Daemon& daemon, Notifier& notifier) {
  (void)notifier.Reloading();
  absl::StatusOr<DaemonConfig> reread = LoadDaemonConfig(path, overrides);
  if (!reread.ok()) {
    spdlog::error("SIGHUP: configuration not reloaded, keeping the running one: {}",
                  reread.status().ToString());
  } else {
    ReloadOutcome outcome = PlanReload(running, *reread);
    running = outcome.applied;
    ApplyLogLevel(running.log_level);
    daemon.ApplyReload(running);
    spdlog::info("SIGHUP: applied [{}]", absl::StrJoin(outcome.applied_keys, ", "));
    for (const std::string& key : outcome.not_reloadable_keys) {
      spdlog::warn("SIGHUP: could not change {} without a restart", key);
    }
  }
  (void)notifier.Ready("reloaded");
}

int Run(int argc, char** argv) {
  const absl::Time process_start = absl::Now();
  // What the service manager passed (a previous daemon's kept KV): before any thread exists,
  // since it unsets the LISTEN_* variables.
  absl::StatusOr<std::vector<ListenedFd>> passed = TakeListenFds();
  // Debian's Abseil checks every mutex acquisition for lock-order cycles (gRPC's own locks
  // included): measurable CPU on the hot path (bench/README.md). Tests keep the check on.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // A batched Step allocates and frees megabytes of messages per call. With glibc's default
  // thresholds that memory went back to the kernel after every step and was faulted back in
  // on the next (most of a 256-session step's CPU, bench/README.md). Keep it: freed heap is
  // trimmed only past 256 MiB, and blocks up to 32 MiB come from the heap, not fresh mmaps.
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  // Before any other thread exists (spdlog, gRPC): see SignalDispatcher::Start.
  static Events events;
  absl::StatusOr<std::unique_ptr<SignalDispatcher>> signals = SignalDispatcher::Start({
      .on_drain =
          [] {
            absl::MutexLock lock(&events.mu);
            events.drain = true;
          },
      .on_reload =
          [] {
            absl::MutexLock lock(&events.mu);
            ++events.reloads;
          },
      .on_force_exit =
          [] {
            spdlog::warn("second SIGTERM: not waiting for sessions any longer");
            if (Daemon* daemon = events.daemon.load(); daemon != nullptr) daemon->EndDrain();
          },
  });
  if (!signals.ok()) {
    std::fprintf(stderr, "memra-kvd: %s\n", signals.status().ToString().c_str());
    return 1;
  }

  absl::StatusOr<SplitFlags> split = SplitConfigFlags(argc, argv);
  if (!split.ok()) {
    std::fprintf(stderr, "memra-kvd: %s\n", split.status().ToString().c_str());
    return kConfigErrorExitCode;
  }
  for (const std::string& arg : split->rest) {
    if (arg == "--help" || arg == "-h" || arg == "-help") {
      PrintHelp(argv[0]);
      return 0;
    }
  }
  std::vector<char*> rest;
  for (std::string& arg : split->rest) rest.push_back(arg.data());
  absl::SetProgramUsageMessage("memra-kvd: the per-GPU KV-cache daemon (--help lists keys)");
  std::vector<char*> positional =
      absl::ParseCommandLine(static_cast<int>(rest.size()), rest.data());
  if (positional.size() > 1) {
    std::fprintf(stderr, "memra-kvd: unexpected argument \"%s\"\n", positional[1]);
    return kConfigErrorExitCode;
  }
  const std::string config_path = absl::GetFlag(FLAGS_config);
  absl::StatusOr<DaemonConfig> config = LoadDaemonConfig(config_path, split->overrides);
  if (!config.ok()) {
    std::fprintf(stderr, "memra-kvd: configuration error: %s\n",
                 config.status().ToString().c_str());
    return kConfigErrorExitCode;
  }
  ApplyLogLevel(config->log_level);
  RaiseDescriptorLimit();

  // One daemon per socket; holding the lock makes every object under this socket's shm prefix a
  // dead predecessor's, safe to remove before the backend creates the first new one.
  absl::StatusOr<InstanceLock> lock = InstanceLock::Acquire(config->SocketPath());
  if (!lock.ok()) {
    spdlog::critical("{}", lock.status().ToString());
    return 1;
  }
  if (config->backend == Backend::kHost) {
    absl::StatusOr<size_t> removed = RemoveStaleShmObjects(ShmPrefix(*config));
    if (!removed.ok()) {
      spdlog::warn("stale shared-memory objects not removed: {}", removed.status().ToString());
    } else if (*removed > 0) {
      spdlog::warn("removed {} shared-memory objects a previous memra-kvd left in /dev/shm/{}-*",
                   *removed, ShmPrefix(*config));
    }
  }
  absl::StatusOr<std::unique_ptr<DeviceBackend>> backend = MakeBackend(*config);
  if (!backend.ok()) {
    spdlog::critical("backend: {}", backend.status().ToString());
    return backend.status().code() == absl::StatusCode::kInvalidArgument ? kConfigErrorExitCode : 1;
  }
  if (!passed.ok()) {
    spdlog::error("passed descriptors ignored: {}", passed.status().ToString());
    passed = std::vector<ListenedFd>();
  }
  absl::StatusOr<std::unique_ptr<Daemon>> daemon =
      Daemon::Create(*config, *std::move(backend), Clock::Real(), *std::move(passed));
  if (!daemon.ok()) {
    spdlog::critical("{}", daemon.status().ToString());
    return kConfigErrorExitCode;
  }
  if (absl::Status started = (*daemon)->Start(); !started.ok()) {
    spdlog::critical("{}", started.ToString());
    return 1;
  }
  events.daemon.store(daemon->get());
  spdlog::info("serving {} ms after the process started (epoch {}; {} sessions re-adopted)",
               absl::ToInt64Milliseconds(absl::Now() - process_start), (*daemon)->epoch(),
               (*daemon)->readopted().sessions);

  Notifier notifier;
  if (absl::Status ready =
          notifier.Ready(absl::StrCat("serving on ", (*daemon)->socket_path(), ", operators on ",
                                      (*daemon)->admin_socket_path()));
      !ready.ok()) {
    spdlog::warn("sd_notify READY failed: {}", ready.ToString());
  }
  std::unique_ptr<WatchdogThread> watchdog;
  if (std::optional<absl::Duration> period = WatchdogInterval(); period && config->watchdog) {
    Daemon* raw = daemon->get();
    watchdog = WatchdogThread::Start(notifier, *period, [raw] { return raw->Healthy(); });
  }

  DaemonConfig running = *config;
  int reloads_handled = 0;
  while (true) {
    int reloads;
    {
      absl::MutexLock lock(&events.mu);
      auto wake = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(events.mu) {
        return events.drain || events.reloads != reloads_handled;
      };
      events.mu.Await(absl::Condition(&wake));
      if (events.drain) break;
      reloads = events.reloads;
    }
    for (; reloads_handled < reloads; ++reloads_handled) {
      Reload(config_path, split->overrides, running, **daemon, notifier);
    }
  }

  (void)notifier.Stopping();
  const absl::Duration grace = absl::Milliseconds(running.drain_grace_ms);
  (void)notifier.ExtendTimeout(grace + absl::Seconds(10));
  spdlog::info("SIGTERM: draining for up to {} ms", running.drain_grace_ms);
  const size_t left = (*daemon)->Drain(grace);
  if (left > 0) spdlog::warn("drain over with {} sessions still open; freeing them", left);
  if (watchdog != nullptr) watchdog->Stop();
  events.daemon.store(nullptr);
  (*signals)->Stop();  // no callback runs after this: the daemon can go
  (*daemon)->Shutdown();
  daemon->reset();
  spdlog::info("memra-kvd exited cleanly");
  return 0;
}

}  // namespace
}  // namespace memra

int main(int argc, char** argv) { return memra::Run(argc, argv); }
