#ifndef MEMRA_SERVER_EDGE_GRPC_SOCKET_H_
#define MEMRA_SERVER_EDGE_GRPC_SOCKET_H_

// One gRPC server on one Unix socket, behind a ConnectionGate (server/edge/connection_gate.h):
// the gate binds the socket (and applies its permissions) before any call can arrive; gRPC
// listens on no port of its own and serves only the connections the gate hands it.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/server.h"
#include "grpcpp/support/server_interceptor.h"
#include "server/edge/connection_gate.h"

namespace memra {

// Threads the synchronous gRPC handlers of one socket may use at once (grpc::ResourceQuota); a
// call past them is RESOURCE_EXHAUSTED. Long streams are capped well below it
// (max_event_streams), so short calls always find a thread.
inline constexpr int kMaxRpcThreadsPerSocket = 256;

struct GrpcSocketOptions {
  std::string path;
  std::string group;  // chown of the socket file; empty = the daemon's group
  uint32_t mode = 0600;
  // Server reflection (grpcurl): the operators' tool, so only the admin socket keeps it.
  bool reflection = false;
  ConnectionGate::Limits limits;  // connections in all and per uid
  // A connection with no call for this long is closed (GOAWAY).
  uint64_t idle_timeout_ms = 300'000;
};

// A serving socket: stop the gate (no new connections, the file removed), then the server.
struct GrpcSocket {
  std::unique_ptr<ConnectionGate> gate;
  std::unique_ptr<grpc::Server> server;
};

// Binds options.path and serves `services` there with `interceptors`. The gate's refusals
// (a live socket at the path, permissions) pass through; UNAVAILABLE when gRPC cannot start.
absl::StatusOr<GrpcSocket> ServeGrpcSocket(
    const GrpcSocketOptions& options, const std::vector<grpc::Service*>& services,
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
        interceptors);

}  // namespace memra

#endif  // MEMRA_SERVER_EDGE_GRPC_SOCKET_H_
