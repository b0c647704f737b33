#include "server/lifecycle.h"

#include <signal.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::IsOk;
using ::testing::Each;
using ::testing::SizeIs;

// Records callback invocations and notifications; tests wait on the count, never on time.
class Recorder {
 public:
  void Record(std::string_view what) {
    absl::MutexLock lock(&mu_);
    log_.emplace_back(what);
  }
  // A callback recording `name`.
  std::function<void()> Callback(std::string name) {
    return [this, name] { Record(name); };
  }
  // A Notifier sender recording each state.
  Notifier::Sender Sender() {
    return [this](std::string_view state) {
      Record(state);
      return absl::OkStatus();
    };
  }
  // Waits until `n` entries were recorded and returns all of them.
  std::vector<std::string> AwaitCount(size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return log_.size() >= n; };
    mu_.Await(absl::Condition(&enough));
    return log_;
  }
  std::vector<std::string> log() {
    absl::MutexLock lock(&mu_);
    return log_;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> log_ ABSL_GUARDED_BY(mu_);
};

// kill(getpid()), not raise(): raise() targets the calling thread, where the signal is blocked
// and stays pending for that thread only; the dispatcher thread reads process-directed signals.
void SendToProcess(int signo) { ASSERT_EQ(kill(getpid(), signo), 0); }

TEST(SignalDispatcherTest, DrainReloadThenForceExit) {
  Recorder events;
  absl::StatusOr<std::unique_ptr<SignalDispatcher>> dispatcher =
      SignalDispatcher::Start({.on_drain = events.Callback("drain"),
                               .on_reload = events.Callback("reload"),
                               .on_force_exit = events.Callback("force_exit")});
  ASSERT_THAT(dispatcher, IsOk());
  EXPECT_FALSE((*dispatcher)->drain_requested());

  // One signal at a time: standard signals do not queue, two pending SIGTERMs would be one.
  SendToProcess(SIGHUP);
  events.AwaitCount(1);
  EXPECT_FALSE((*dispatcher)->drain_requested()) << "SIGHUP is not a drain";
  SendToProcess(SIGTERM);
  events.AwaitCount(2);
  EXPECT_TRUE((*dispatcher)->drain_requested());
  SendToProcess(SIGHUP);
  events.AwaitCount(3);
  SendToProcess(SIGINT);
  events.AwaitCount(4);
  SendToProcess(SIGTERM);
  EXPECT_THAT(events.AwaitCount(5),
              ::testing::ElementsAre("reload", "drain", "reload", "force_exit", "force_exit"));
  (*dispatcher)->Stop();
  (*dispatcher)->Stop();  // idempotent
}

TEST(SignalDispatcherTest, SigintAloneStartsTheDrain) {
  Recorder events;
  auto dispatcher = SignalDispatcher::Start(
      {.on_drain = events.Callback("drain"), .on_force_exit = events.Callback("force_exit")});
  ASSERT_THAT(dispatcher, IsOk());
  SendToProcess(SIGINT);
  EXPECT_THAT(events.AwaitCount(1), ::testing::ElementsAre("drain"));
}

TEST(SignalDispatcherTest, MissingCallbacksAreSkipped) {
  Recorder events;
  auto dispatcher = SignalDispatcher::Start({.on_drain = events.Callback("drain")});
  ASSERT_THAT(dispatcher, IsOk());
  // Both may be pending at once; signalfd returns the lower-numbered SIGHUP (1) before SIGTERM
  // (15), so when "drain" is recorded the SIGHUP has been consumed and nothing is left pending.
  SendToProcess(SIGHUP);
  SendToProcess(SIGTERM);
  EXPECT_THAT(events.AwaitCount(1), ::testing::ElementsAre("drain"));
  EXPECT_TRUE((*dispatcher)->drain_requested());
}

TEST(SignalDispatcherTest, StopsWithoutAnySignal) {
  auto dispatcher = SignalDispatcher::Start({});
  ASSERT_THAT(dispatcher, IsOk());
  dispatcher->reset();  // the destructor stops and joins; a hang here fails by test timeout
  sigset_t blocked;
  ASSERT_EQ(pthread_sigmask(SIG_BLOCK, nullptr, &blocked), 0);
  EXPECT_TRUE(sigismember(&blocked, SIGTERM)) << "signals stay blocked after Stop()";
  EXPECT_TRUE(sigismember(&blocked, SIGHUP));
}

TEST(WatchdogThreadTest, SendsKeepAlivesUntilStopped) {
  Recorder recorder;
  Notifier notifier(recorder.Sender());
  auto watchdog = WatchdogThread::Start(notifier, absl::Milliseconds(1));
  EXPECT_THAT(recorder.AwaitCount(3), Each(std::string("WATCHDOG=1")));
  watchdog->Stop();
  size_t after_stop = recorder.log().size();
  watchdog.reset();
  EXPECT_THAT(recorder.log(), SizeIs(after_stop)) << "nothing is sent after Stop() returns";
}

TEST(WatchdogThreadTest, FirstKeepAliveAtStartAndStopDoesNotWaitForThePeriod) {
  Recorder recorder;
  Notifier notifier(recorder.Sender());
  auto watchdog = WatchdogThread::Start(notifier, absl::Hours(1));
  EXPECT_THAT(recorder.AwaitCount(1), ::testing::ElementsAre("WATCHDOG=1"));
  watchdog->Stop();  // wakes the hour-long wait; a hang here fails by test timeout
  EXPECT_THAT(recorder.log(), SizeIs(1));
}

TEST(WatchdogThreadTest, NoKeepAliveWhileUnhealthy) {
  Recorder recorder;
  Notifier notifier(recorder.Sender());
  absl::Mutex mu;
  int health_checks = 0;
  int checks_at_first_send = -1;
  auto healthy = [&] {
    absl::MutexLock lock(&mu);
    ++health_checks;
    bool ok = health_checks > 3;  // unhealthy for the first three periods
    if (ok && checks_at_first_send < 0) checks_at_first_send = health_checks;
    return ok;
  };
  auto watchdog = WatchdogThread::Start(notifier, absl::Milliseconds(1), healthy);
  recorder.AwaitCount(1);
  watchdog->Stop();
  absl::MutexLock lock(&mu);
  EXPECT_EQ(checks_at_first_send, 4);
  EXPECT_THAT(recorder.log(), SizeIs(health_checks - 3));
}

}  // namespace
}  // namespace memra
