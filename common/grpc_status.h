#ifndef MEMRA_COMMON_GRPC_STATUS_H_
#define MEMRA_COMMON_GRPC_STATUS_H_

// absl::Status <-> grpc::Status: the one place each conversion happens (the daemon's replies,
// the client library's results). The codes are the same numbers (both are google.rpc.Code). An
// admission refusal's numbers (core/admission.h) travel as memra.kv.v1.StatusDetails in the
// status's error_details and come back as the same payload.

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace memra {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace memra

#endif  // MEMRA_COMMON_GRPC_STATUS_H_
