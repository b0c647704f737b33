#include "server/edge/rpc_reply.h"

#include <string>

#include "common/grpc_status.h"
#include "spdlog/spdlog.h"

namespace memra {

grpc::Status Reply(absl::string_view rpc, const absl::Status& status) {
  if (!status.ok()) {
    if (status.code() == absl::StatusCode::kInternal ||
        status.code() == absl::StatusCode::kDataLoss) {
      spdlog::error("{} failed: {}", std::string(rpc), status.ToString());
    } else {
      spdlog::info("{} refused: {}", std::string(rpc), status.ToString());
    }
  }
  return ToGrpcStatus(status);
}

}  // namespace memra
