#ifndef MEMRA_SERVER_CONNECTION_GATE_H_
#define MEMRA_SERVER_CONNECTION_GATE_H_

// The door of a gRPC Unix socket: the daemon accepts each connection itself, reads its peer's
// uid (SO_PEERCRED), and hands it to the gRPC server only while the socket holds fewer than
// `max_connections` in all and fewer than `max_connections_per_uid` of that uid; otherwise the
// connection is closed at once (the client sees UNAVAILABLE) and the refusal is logged with its
// numbers. gRPC 1.51 has no connection limit of its own, and every connection holds a
// descriptor: without this, idle HTTP/2 connections filled RLIMIT_NOFILE and every engine's next
// memfd failed EMFILE. (Idle connections are also closed by gRPC after
// connection_idle_timeout_ms: GRPC_ARG_MAX_CONNECTION_IDLE_MS, set where the server is built.)
//
// A connection is counted until it ends: the gate keeps a duplicate of each descriptor it handed
// over and polls it; gRPC shuts a connection down (shutdown(2)) before closing it, and a peer
// that goes away hangs it up, so either ends the count. Each connection therefore holds two
// descriptors (docs/security-model.md#resources counts them).
//
// When accept fails for want of descriptors (EMFILE, ENFILE), the gate backs off
// (kAcceptBackoff) instead of spinning on the readable listener.
//
// Thread-safety: thread-safe. One thread of its own accepts and watches.

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/mapped_region.h"
#include "grpcpp/server.h"

namespace memra {

class ConnectionGate {
 public:
  struct Limits {
    size_t max_connections = 512;
    size_t max_connections_per_uid = 128;
  };
  static constexpr absl::Duration kAcceptBackoff = absl::Milliseconds(100);

  // Binds `path` (server/base/unix_socket.h: a live socket is refused) with `group` and `mode`.
  // `name` names the socket in logs ("engine socket").
  static absl::StatusOr<std::unique_ptr<ConnectionGate>> Listen(const std::string& path,
                                                                const std::string& group,
                                                                uint32_t mode, std::string name,
                                                                Limits limits);
  ~ConnectionGate();

  // Starts accepting into `server`. REQUIRES: `server` outlives Stop(); called once.
  void Start(grpc::Server* server);
  // Stops accepting, closes the gate's duplicates and removes the socket file. Connections
  // already handed to gRPC are the server's to end. Idempotent.
  void Stop();

  struct Counts {
    size_t connections = 0;  // open, handed to gRPC
    uint64_t refused = 0;    // closed at the door since start
  };
  Counts counts() const;

 private:
  ConnectionGate(std::string path, std::string name, Limits limits, ScopedFd listener,
                 ScopedFd wake);
  void Serve();
  // Accepts what is waiting; false when accept ran out of descriptors (back off).
  bool AcceptAll(grpc::Server* server);
  void Wake();

  // Constant after construction.
  const std::string path_;
  const std::string name_;
  const Limits limits_;
  const ScopedFd listener_;
  const ScopedFd wake_;

  // Only the serving thread touches these.
  struct Watched {
    ScopedFd duplicate;
    uid_t uid = 0;
  };
  std::vector<Watched> watched_;
  absl::flat_hash_map<uid_t, size_t> per_uid_;
  absl::Time last_refusal_log_ = absl::InfinitePast();

  mutable absl::Mutex mu_;
  grpc::Server* server_ ABSL_GUARDED_BY(mu_) = nullptr;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  Counts counts_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace memra

#endif  // MEMRA_SERVER_CONNECTION_GATE_H_
