#include "server/edge/connection_gate.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "common/errors.h"
#include "core/status_macros.h"
#include "grpcpp/server_posix.h"
#include "server/base/unix_socket.h"
#include "spdlog/spdlog.h"

namespace memra {
namespace {

// Accepted per round at most: connections that are refused as fast as they come must not keep
// the gate from noticing the ones that ended.
constexpr int kAcceptsPerRound = 64;
// Refusals are logged at most this often (each line says how many there were since).
constexpr absl::Duration kRefusalLogPeriod = absl::Seconds(1);

bool OutOfDescriptors(int err) {
  return err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ConnectionGate>> ConnectionGate::Listen(
    const std::string& path, const std::string& group, uint32_t mode, std::string name,
    Limits limits) {
  ASSIGN_OR_RETURN(ScopedFd listener, ListenOnUnixSocket(path, group, mode, name));
  ScopedFd wake(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (wake.get() < 0) {
    const int err = errno;
    unlink(path.c_str());
    return PosixError(absl::StrCat("eventfd for the ", name), err);
  }
  return std::unique_ptr<ConnectionGate>(
      new ConnectionGate(path, std::move(name), limits, std::move(listener), std::move(wake)));
}

ConnectionGate::ConnectionGate(std::string path, std::string name, Limits limits,
                               ScopedFd listener, ScopedFd wake)
    : path_(std::move(path)),
      name_(std::move(name)),
      limits_(limits),
      listener_(std::move(listener)),
      wake_(std::move(wake)) {}

ConnectionGate::~ConnectionGate() { Stop(); }

void ConnectionGate::Start(grpc::Server* server) {
  {
    absl::MutexLock lock(&mu_);
    server_ = server;
  }
  thread_ = std::thread([this] { Serve(); });
}

void ConnectionGate::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  Wake();
  if (thread_.joinable()) thread_.join();
  watched_.clear();  // the serving thread is gone: closes the duplicates
  unlink(path_.c_str());
}

ConnectionGate::Counts ConnectionGate::counts() const {
  absl::MutexLock lock(&mu_);
  return counts_;
}

void ConnectionGate::Wake() {
  const uint64_t one = 1;
  (void)!write(wake_.get(), &one, sizeof(one));
}

void ConnectionGate::Serve() {
  grpc::Server* server;
  {
    absl::MutexLock lock(&mu_);
    server = server_;
  }
  bool backing_off = false;
  std::vector<pollfd> polled;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
    }
    polled.clear();
    for (const Watched& watched : watched_) {
      polled.push_back({.fd = watched.duplicate.get(), .events = POLLRDHUP, .revents = 0});
    }
    // While backing off, the listener is not polled (it stays readable: that was the spin).
    polled.push_back(
        {.fd = backing_off ? -1 : listener_.get(), .events = POLLIN, .revents = 0});
    polled.push_back({.fd = wake_.get(), .events = POLLIN, .revents = 0});
    const int timeout_ms =
        backing_off ? static_cast<int>(absl::ToInt64Milliseconds(kAcceptBackoff)) : -1;
    const int ready = poll(polled.data(), polled.size(), timeout_ms);
    if (ready < 0) {
      if (errno != EINTR) spdlog::error("{}: poll: {}", name_, strerror(errno));
      continue;
    }
    backing_off = false;
    if (polled.back().revents != 0) {
      uint64_t count;
      (void)!read(wake_.get(), &count, sizeof(count));
    }
    // Ended connections (shut down by gRPC, or hung up by the peer) leave the count.
    size_t ended = 0;
    for (size_t i = watched_.size(); i-- > 0;) {
      if (polled[i].revents == 0) continue;
      auto uid = per_uid_.find(watched_[i].uid);
      if (--uid->second == 0) per_uid_.erase(uid);
      watched_[i] = std::move(watched_.back());
      watched_.pop_back();
      ++ended;
    }
    if (ended > 0) {
      absl::MutexLock lock(&mu_);
      counts_.connections -= ended;
    }
    if (polled[polled.size() - 2].revents != 0 && !AcceptAll(server)) backing_off = true;
  }
}

bool ConnectionGate::AcceptAll(grpc::Server* server) {
  for (int round = 0; round < kAcceptsPerRound; ++round) {
    ScopedFd socket(accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (socket.get() < 0) {
      const int err = errno;
      if (err == EINTR || err == ECONNABORTED) continue;
      if (OutOfDescriptors(err)) {
        spdlog::warn("{}: accept: {}; waiting {} ms before the next accept", name_,
                     strerror(err), absl::ToInt64Milliseconds(kAcceptBackoff));
        return false;
      }
      return true;  // EAGAIN: nothing more waiting
    }
    ucred peer{};
    socklen_t length = sizeof(peer);
    if (getsockopt(socket.get(), SOL_SOCKET, SO_PEERCRED, &peer, &length) != 0) {
      spdlog::warn("{}: SO_PEERCRED: {}", name_, strerror(errno));
      continue;
    }
    const size_t of_uid = per_uid_.contains(peer.uid) ? per_uid_[peer.uid] : 0;
    if (watched_.size() >= limits_.max_connections ||
        of_uid >= limits_.max_connections_per_uid) {
      uint64_t refused;
      {
        absl::MutexLock lock(&mu_);
        refused = ++counts_.refused;
      }
      const absl::Time now = absl::Now();
      if (now - last_refusal_log_ >= kRefusalLogPeriod) {
        last_refusal_log_ = now;
        spdlog::warn(
            "{}: connection from uid {} (pid {}) closed: the socket holds {} connections (limit "
            "{}, max_connections), {} of uid {} (limit {}, max_connections_per_uid); {} refused "
            "since start",
            name_, peer.uid, peer.pid, watched_.size(), limits_.max_connections, of_uid,
            peer.uid, limits_.max_connections_per_uid, refused);
      }
      continue;
    }
    ScopedFd duplicate(fcntl(socket.get(), F_DUPFD_CLOEXEC, 0));
    if (duplicate.get() < 0) {
      const int err = errno;
      spdlog::warn("{}: dup of an accepted connection: {}; connection closed", name_,
                   strerror(err));
      if (OutOfDescriptors(err)) return false;
      continue;
    }
    grpc::AddInsecureChannelFromFd(server, socket.release());
    watched_.push_back({.duplicate = std::move(duplicate), .uid = peer.uid});
    ++per_uid_[peer.uid];
    absl::MutexLock lock(&mu_);
    ++counts_.connections;
  }
  return true;
}

}  // namespace memra
