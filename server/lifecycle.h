#ifndef MEMRA_SERVER_LIFECYCLE_H_
#define MEMRA_SERVER_LIFECYCLE_H_

// Process lifecycle for memra-kvd: signals become callbacks on one dedicated thread (no
// async-signal handlers, so callbacks may lock, log and allocate), and a thread sends systemd
// watchdog keep-alives.
//
// Use from main():
//   auto signals = SignalDispatcher::Start({.on_drain = ..., .on_reload = ...,
//                                           .on_force_exit = ...});   // before any other thread
//   ... start gRPC, bind the socket ...
//   notifier.Ready(...);
//   if (auto period = WatchdogInterval(); period && config.watchdog)
//     watchdog = WatchdogThread::Start(notifier, *period, [&] { return server_healthy(); });

#include <functional>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/base/sd_notify.h"

namespace memra {

// Any callback may be left empty (nullptr): that signal is then consumed and ignored.
struct SignalCallbacks {
  // First SIGTERM or SIGINT: start draining (refuse new work, let sessions finish).
  std::function<void()> on_drain = nullptr;
  // Each SIGHUP: re-read the configuration.
  std::function<void()> on_reload = nullptr;
  // Each SIGTERM or SIGINT after the first: stop waiting for sessions and exit now.
  std::function<void()> on_force_exit = nullptr;
};

// Thread-safe. Owns a thread that waits for SIGTERM, SIGINT and SIGHUP (via signalfd, which is
// sigwait that can also wait for a stop request) and runs the matching callback on that thread.
// Callbacks run one at a time and must return promptly (start the work, do not wait for it): while
// one runs, a second SIGTERM waits.
//
// Invariants: (1) the three signals stay blocked in the thread that called Start() for the life
// of the process, also after Stop(), so a late signal stays pending instead of killing the
// process with the default action. (2) on_drain runs at most once per dispatcher.
class SignalDispatcher {
 public:
  // Blocks the signals in the calling thread, and so in every thread it creates afterwards.
  // REQUIRES: called before any other thread exists (gRPC, logging, the watchdog). A thread
  // started earlier has the signals unblocked, and the kernel may deliver one there with the
  // default action: termination without a drain.
  static absl::StatusOr<std::unique_ptr<SignalDispatcher>> Start(SignalCallbacks callbacks);

  ~SignalDispatcher();  // Stop()
  SignalDispatcher(const SignalDispatcher&) = delete;
  SignalDispatcher& operator=(const SignalDispatcher&) = delete;

  // Stops and joins the thread; signals arriving afterwards stay pending. Idempotent.
  // REQUIRES: not called from a callback.
  void Stop();

  // Whether a SIGTERM or SIGINT has arrived.
  bool drain_requested() const;

 private:
  SignalDispatcher(SignalCallbacks callbacks, int signal_fd, int stop_fd);
  void Run();

  // Constant after construction.
  const SignalCallbacks callbacks_;
  const int signal_fd_;  // signalfd for the three signals; read only by thread_
  const int stop_fd_;    // eventfd written by Stop()

  mutable absl::Mutex mu_;
  bool drain_requested_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_ ABSL_GUARDED_BY(mu_);  // joinable until Stop()
};

// Thread-safe. Sends Notifier::Watchdog() at start and then every `period` while it runs, as long
// as `healthy` (if given) says the daemon can still serve: a wedged daemon should stop the
// keep-alives and be restarted, not be kept alive by a thread that only counts time. A failed
// send is not retried early; the next period sends again, and systemd restarts the service if
// keep-alives stay missing.
class WatchdogThread {
 public:
  // REQUIRES: `notifier` outlives the WatchdogThread; period > 0.
  static std::unique_ptr<WatchdogThread> Start(Notifier& notifier, absl::Duration period,
                                               std::function<bool()> healthy = nullptr);

  ~WatchdogThread();  // Stop()
  WatchdogThread(const WatchdogThread&) = delete;
  WatchdogThread& operator=(const WatchdogThread&) = delete;

  // Stops and joins the thread: no keep-alive is sent after the first Stop() returns. Idempotent.
  void Stop();

 private:
  WatchdogThread(Notifier& notifier, absl::Duration period, std::function<bool()> healthy);
  void Run();

  // Constant after construction.
  Notifier& notifier_;
  const absl::Duration period_;
  const std::function<bool()> healthy_;

  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_ ABSL_GUARDED_BY(mu_);  // joinable until Stop()
};

}  // namespace memra

#endif  // MEMRA_SERVER_LIFECYCLE_H_
