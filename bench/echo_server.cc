// The bare gRPC floor (bench/echo.proto): a synchronous gRPC server on a Unix socket, as
// memra-kvd is, whose one call answers a payload of the requested size. Runs until SIGTERM.
//
//   echo_server --socket_path=/tmp/x/echo.sock

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "bench/echo.grpc.pb.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"

ABSL_FLAG(std::string, socket_path, "", "Unix socket to listen on (must not exist)");

namespace memra::bench {
namespace {

// Replies are capped so a bad request cannot make the server allocate without bound.
constexpr uint64_t kMaxReplyBytes = 64 << 20;

class EchoService final : public Echo::Service {
  grpc::Status Echo(grpc::ServerContext*, const EchoRequest* request, EchoReply* reply) override {
    if (request->reply_bytes() > kMaxReplyBytes) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("reply_bytes ", request->reply_bytes(), " exceeds ",
                                       kMaxReplyBytes));
    }
    reply->mutable_payload()->assign(request->reply_bytes(), 'e');
    return grpc::Status::OK;
  }
};

int Run() {
  const std::string socket_path = absl::GetFlag(FLAGS_socket_path);
  if (socket_path.empty()) {
    std::fprintf(stderr, "echo_server: --socket_path is required\n");
    return 2;
  }
  // SIGTERM ends sigwait below; block it before gRPC starts its threads so they inherit that.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  EchoService service;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::StrCat("unix:", socket_path), grpc::InsecureServerCredentials());
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    std::fprintf(stderr, "echo_server: cannot listen on unix:%s\n", socket_path.c_str());
    return 1;
  }
  int signal_number = 0;
  sigwait(&signals, &signal_number);
  server->Shutdown();
  unlink(socket_path.c_str());
  return 0;
}

}  // namespace
}  // namespace memra::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return memra::bench::Run();
}
