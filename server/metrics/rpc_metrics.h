#ifndef MEMRA_SERVER_RPC_METRICS_H_
#define MEMRA_SERVER_RPC_METRICS_H_

// Per-method gRPC server metrics, recorded by a server interceptor (memra-kvd installs it only
// with rpc_metrics = true: gRPC's interceptor path costs ~25 us per call, bench/README.md):
//   memra_rpc_requests_total{method,code}   calls finished, by final status code name
//   memra_rpc_duration_seconds{method}      from the call's arrival to its status being sent
//
// Invariants:
//  (1) Every call is counted exactly once, when its status is sent; a streaming call (Attach)
//      therefore counts once, when the stream ends, however many messages it carried. A call cut
//      off before its status reached the client (cancelled, past its deadline, connection lost)
//      counts as CANCELLED whatever the handler returned.
//  (2) `method` is the full gRPC method name ("/memra.kv.v1.KvCache/Step") when it is one of the
//      served methods given at creation; any other call (gRPC hands interceptors the client's own
//      path for methods the server lacks) is counted under kUnknownMethodLabel, so a client cannot
//      grow the label set.
//  (3) The interceptor never changes a call: it only observes and proceeds.
//
// Wiring (the registry and the factories must outlive the server):
//   std::vector<std::string> methods(kHealthServiceMethods.begin(), kHealthServiceMethods.end());
//   for (const char* service : {memra::kv::v1::KvCache::service_full_name(), ...}) {
//     ASSIGN_OR_RETURN(std::vector<std::string> more, ProtoServiceMethods(service));
//     methods.insert(methods.end(), more.begin(), more.end());
//   }
//   ASSIGN_OR_RETURN(auto interceptors, MakeRpcMetricsInterceptors(&registry, methods));
//   builder.experimental().SetInterceptorCreators(std::move(interceptors));

#include <array>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "grpcpp/support/server_interceptor.h"
#include "server/metrics/metrics.h"

namespace memra::metrics {

inline constexpr std::string_view kRpcRequestsMetric = "memra_rpc_requests_total";
inline constexpr std::string_view kRpcDurationMetric = "memra_rpc_duration_seconds";
inline constexpr std::string_view kUnknownMethodLabel = "unknown";

// The standard health service's methods (grpc::EnableDefaultHealthCheckService serves them, but
// its messages are not in the protobuf descriptor pool, so ProtoServiceMethods cannot list them).
inline constexpr std::array<std::string_view, 2> kHealthServiceMethods = {
    "/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"};

// The full method names ("/pkg.Service/Method") of a protobuf service linked into the binary,
// e.g. ProtoServiceMethods(memra::kv::v1::KvCache::service_full_name()). NOT_FOUND naming the
// service when the descriptor pool does not have it.
absl::StatusOr<std::vector<std::string>> ProtoServiceMethods(std::string_view service_full_name);

// The duration buckets: 10us to 10s in 1-2.5-5 steps (a local Step takes microseconds; an Attach
// stream or an import may take seconds).
const std::vector<double>& RpcDurationBucketBounds();

// Registers the two RPC metrics in `registry` and returns the interceptor factories to hand to
// grpc::ServerBuilder::experimental().SetInterceptorCreators. `served_methods` are the full names
// to label calls with (invariant 2). Refused: a name not shaped "/service/method"
// (INVALID_ARGUMENT, naming it, before anything is registered); the metrics already registered
// (ALREADY_EXISTS). REQUIRES: `registry` outlives every server built with the interceptors.
absl::StatusOr<std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>>
MakeRpcMetricsInterceptors(Registry* registry, absl::Span<const std::string> served_methods);

}  // namespace memra::metrics

#endif  // MEMRA_SERVER_RPC_METRICS_H_
