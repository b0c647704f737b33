#include "bench/echo_floor.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/status_macros.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"

namespace memra::bench {

absl::StatusOr<std::unique_ptr<EchoFloor>> EchoFloor::Start(const std::string& echo_binary) {
  ASSIGN_OR_RETURN(TempDir dir, TempDir::Create("memra-echo"));
  const std::string socket_path = dir.File("echo.sock");
  ASSIGN_OR_RETURN(ChildProcess process,
                   ChildProcess::Spawn({echo_binary, "--socket_path=" + socket_path},
                                       dir.File("echo.log")));
  RETURN_IF_ERROR(WaitForPath(socket_path, process, absl::Seconds(30)));
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateChannel(absl::StrCat("unix:", socket_path), grpc::InsecureChannelCredentials());
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(30))) {
    return absl::UnavailableError("echo_server is not answering on unix:" + socket_path);
  }
  return std::unique_ptr<EchoFloor>(
      new EchoFloor(std::move(dir), std::move(process), std::move(channel)));
}

EchoFloor::EchoFloor(TempDir dir, ChildProcess process, std::shared_ptr<grpc::Channel> channel)
    : dir_(std::move(dir)),
      process_(std::move(process)),
      channel_(std::move(channel)),
      stub_(memra::bench::Echo::NewStub(channel_)) {}

EchoCall EchoFloor::Shape(uint64_t request_bytes, uint64_t response_bytes) {
  EchoCall call;
  call.request.set_reply_bytes(0);
  call.request.set_payload(std::string(request_bytes, 'r'));
  call.reply_bytes = response_bytes;
  memra::bench::EchoReply reply;
  reply.set_payload(std::string(response_bytes, 'e'));
  // Shrink each payload by its framing (tag, length varint, the reply_bytes field).
  for (int i = 0; i < 3; ++i) {
    call.request.set_reply_bytes(call.reply_bytes);
    const uint64_t over =
        call.request.ByteSizeLong() - std::min(request_bytes, call.request.ByteSizeLong());
    call.request.mutable_payload()->resize(call.request.payload().size() - over);
    call.reply_bytes -= reply.ByteSizeLong() - std::min(response_bytes, reply.ByteSizeLong());
    reply.mutable_payload()->resize(call.reply_bytes);
  }
  call.request.set_reply_bytes(call.reply_bytes);
  call.payload = call.request.payload();
  call.request_size = call.request.ByteSizeLong();
  call.response_size = reply.ByteSizeLong();
  return call;
}

std::pair<uint64_t, uint64_t> EchoFloor::Size(uint64_t request_bytes, uint64_t response_bytes) {
  default_call_ = Shape(request_bytes, response_bytes);
  return {default_call_.request_size, default_call_.response_size};
}

absl::Status EchoFloor::Call(EchoCall& call) {
  call.request.set_payload(call.payload);  // an engine builds its request every call
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  memra::bench::EchoReply reply;
  const grpc::Status status = stub_->Echo(&context, call.request, &reply);
  if (!status.ok()) return absl::UnavailableError("Echo: " + status.error_message());
  if (reply.payload().size() != call.reply_bytes) {
    return absl::InternalError(absl::StrCat("Echo answered ", reply.payload().size(),
                                            " bytes for ", call.reply_bytes));
  }
  return absl::OkStatus();
}

}  // namespace memra::bench
