#ifndef MEMRA_BENCH_ECHO_FLOOR_H_
#define MEMRA_BENCH_ECHO_FLOOR_H_

// The bare gRPC floor of the benchmarks: bench/echo_server in its own process on a Unix socket,
// answering unary calls shaped like the daemon's (the same serialized request and response
// sizes), so a daemon call can be read as a ratio of gRPC alone on the same transport.

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bench/echo.grpc.pb.h"
#include "bench/harness.h"
#include "grpcpp/channel.h"

namespace memra::bench {

// One call's shape: what EchoFloor::Shape built for a request and response size.
struct EchoCall {
  memra::bench::EchoRequest request;
  std::string payload;  // the request's payload, set again before every call
  uint64_t reply_bytes = 0;
  uint64_t request_size = 0;   // serialized sizes reached (a varint length may leave them a
  uint64_t response_size = 0;  // byte short of the asked ones)
};

class EchoFloor {
 public:
  // `echo_binary`: //bench:echo_server.
  static absl::StatusOr<std::unique_ptr<EchoFloor>> Start(const std::string& echo_binary);

  // A call like one of `request_bytes` answered by `response_bytes` (both serialized).
  static EchoCall Shape(uint64_t request_bytes, uint64_t response_bytes);
  // Sizes the calls of Call() (the default shape); returns the sizes reached.
  std::pair<uint64_t, uint64_t> Size(uint64_t request_bytes, uint64_t response_bytes);

  pid_t pid() const { return process_.pid(); }

  absl::Status Call() { return Call(default_call_); }
  absl::Status Call(EchoCall& call);

 private:
  EchoFloor(TempDir dir, ChildProcess process, std::shared_ptr<grpc::Channel> channel);

  TempDir dir_;
  ChildProcess process_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<memra::bench::Echo::Stub> stub_;
  EchoCall default_call_;
};

}  // namespace memra::bench

#endif  // MEMRA_BENCH_ECHO_FLOOR_H_
