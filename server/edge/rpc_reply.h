#ifndef MEMRA_SERVER_RPC_REPLY_H_
#define MEMRA_SERVER_RPC_REPLY_H_

// The one place a service of the daemon turns an absl::Status into its gRPC reply
// (common/grpc_status.h converts), logging every refusal once: INTERNAL and DATA_LOSS as errors
// (a bug or corrupted storage), anything else as a refusal of that client.

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/status.h"

namespace memra {

grpc::Status Reply(absl::string_view rpc, const absl::Status& status);

}  // namespace memra

#endif  // MEMRA_SERVER_RPC_REPLY_H_
