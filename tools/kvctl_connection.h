#ifndef MEMRA_TOOLS_KVCTL_CONNECTION_H_
#define MEMRA_TOOLS_KVCTL_CONNECTION_H_

// memra-kvctl's connection to one memra-kvd: a plain probe of the socket, then a gRPC channel
// with the KvAdmin and KvPrefixCache stubs, all within the invocation's --timeout.

#include <chrono>
#include <memory>
#include <string>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/client_context.h"
#include "proto/memra/kv/v1/admin.grpc.pb.h"
#include "proto/memra/kv/v1/group.grpc.pb.h"
#include "proto/memra/kv/v1/prefix.grpc.pb.h"
#include "tools/kvctl_flags.h"

namespace memra::kvctl {

// What to check when the daemon cannot be reached: the unit of the socket's GPU, or the group
// that may use the socket.
std::string UnreachableHint(const std::string& socket_path, absl::StatusCode code);

struct Connection {
  std::unique_ptr<kv::v1::KvAdmin::Stub> stub;
  std::unique_ptr<kv::v1::KvPrefixCache::Stub> prefix_stub;
  std::unique_ptr<kv::v1::KvGroup::Stub> group_stub;
  std::chrono::system_clock::time_point deadline;
};

// Probes invocation.socket_path with a plain connect(2) first (a missing socket, a permission
// problem or a stale socket file is named at once, where gRPC would retry quietly until the
// deadline), then connects; the deadline of every call is set here.
absl::StatusOr<Connection> Connect(const Invocation& invocation);

template <typename Stub, typename Request, typename Response>
using StubCall = grpc::Status (Stub::*)(grpc::ClientContext*, const Request&, Response*);

// The connection's stub of the service `Stub` belongs to.
template <typename Stub>
Stub& StubOf(Connection& connection) {
  if constexpr (std::is_same_v<Stub, kv::v1::KvPrefixCache::Stub>) {
    return *connection.prefix_stub;
  } else if constexpr (std::is_same_v<Stub, kv::v1::KvGroup::Stub>) {
    return *connection.group_stub;
  } else {
    return *connection.stub;
  }
}

}  // namespace memra::kvctl

#endif  // MEMRA_TOOLS_KVCTL_CONNECTION_H_
