#include "server/lifecycle.h"

#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/memory/memory.h"
#include "absl/status/status.h"

namespace memra {
namespace {

sigset_t LifecycleSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  return signals;
}

// Only on a broken invariant (a valid fd that poll/read refuses): crash and let systemd restart.
[[noreturn]] void DieErrno(const char* what) {
  std::fprintf(stderr, "memra-kvd lifecycle: %s: %s\n", what, std::strerror(errno));
  std::abort();
}

}  // namespace

absl::StatusOr<std::unique_ptr<SignalDispatcher>> SignalDispatcher::Start(
    SignalCallbacks callbacks) {
  sigset_t signals = LifecycleSignals();
  if (int error = pthread_sigmask(SIG_BLOCK, &signals, nullptr); error != 0) {
    return absl::ErrnoToStatus(error, "pthread_sigmask(SIG_BLOCK, {TERM, INT, HUP})");
  }
  int signal_fd = signalfd(-1, &signals, SFD_CLOEXEC);
  if (signal_fd < 0) return absl::ErrnoToStatus(errno, "signalfd({TERM, INT, HUP})");
  int stop_fd = eventfd(0, EFD_CLOEXEC);
  if (stop_fd < 0) {
    absl::Status status = absl::ErrnoToStatus(errno, "eventfd for the signal thread");
    close(signal_fd);
    return status;
  }
  auto dispatcher =
      absl::WrapUnique(new SignalDispatcher(std::move(callbacks), signal_fd, stop_fd));
  {
    absl::MutexLock lock(&dispatcher->mu_);
    dispatcher->thread_ = std::thread([d = dispatcher.get()] { d->Run(); });
  }
  return dispatcher;
}

SignalDispatcher::SignalDispatcher(SignalCallbacks callbacks, int signal_fd, int stop_fd)
    : callbacks_(std::move(callbacks)), signal_fd_(signal_fd), stop_fd_(stop_fd) {}

SignalDispatcher::~SignalDispatcher() {
  Stop();
  close(signal_fd_);
  close(stop_fd_);
}

void SignalDispatcher::Stop() {
  std::thread thread;
  {
    absl::MutexLock lock(&mu_);
    thread = std::move(thread_);
  }
  if (!thread.joinable()) return;
  uint64_t one = 1;
  if (write(stop_fd_, &one, sizeof(one)) != sizeof(one)) DieErrno("write(eventfd)");
  thread.join();
}

bool SignalDispatcher::drain_requested() const {
  absl::MutexLock lock(&mu_);
  return drain_requested_;
}

void SignalDispatcher::Run() {
  pollfd fds[2] = {{.fd = signal_fd_, .events = POLLIN, .revents = 0},
                   {.fd = stop_fd_, .events = POLLIN, .revents = 0}};
  while (true) {
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      DieErrno("poll(signalfd, eventfd)");
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    signalfd_siginfo info;
    ssize_t n = read(signal_fd_, &info, sizeof(info));
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n != sizeof(info)) DieErrno("read(signalfd)");

    const std::function<void()>* callback = &callbacks_.on_reload;
    if (info.ssi_signo != SIGHUP) {  // SIGTERM or SIGINT
      absl::MutexLock lock(&mu_);
      callback = drain_requested_ ? &callbacks_.on_force_exit : &callbacks_.on_drain;
      drain_requested_ = true;
    }
    // Outside mu_: a callback may call drain_requested().
    if (*callback) (*callback)();
  }
}

std::unique_ptr<WatchdogThread> WatchdogThread::Start(Notifier& notifier, absl::Duration period,
                                                      std::function<bool()> healthy) {
  auto watchdog = absl::WrapUnique(new WatchdogThread(notifier, period, std::move(healthy)));
  {
    absl::MutexLock lock(&watchdog->mu_);
    watchdog->thread_ = std::thread([w = watchdog.get()] { w->Run(); });
  }
  return watchdog;
}

WatchdogThread::WatchdogThread(Notifier& notifier, absl::Duration period,
                               std::function<bool()> healthy)
    : notifier_(notifier), period_(period), healthy_(std::move(healthy)) {}

WatchdogThread::~WatchdogThread() { Stop(); }

void WatchdogThread::Stop() {
  std::thread thread;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    thread = std::move(thread_);
  }
  if (thread.joinable()) thread.join();
}

void WatchdogThread::Run() {
  while (true) {
    // A failed send is not fatal: see the class comment.
    if (!healthy_ || healthy_()) notifier_.Watchdog().IgnoreError();
    absl::MutexLock lock(&mu_);
    if (mu_.AwaitWithTimeout(absl::Condition(&stop_), period_)) return;
  }
}

}  // namespace memra
