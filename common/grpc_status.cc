#include "common/grpc_status.h"

#include <optional>
#include <string>

#include "common/daemon_restart.h"
#include "core/admission.h"
#include "proto/memra/kv/v1/cache.pb.h"

namespace memra {

namespace pb = ::memra::kv::v1;

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const auto code = static_cast<grpc::StatusCode>(status.code());
  std::optional<AdmissionRefusal> refusal = GetAdmissionRefusal(status);
  std::optional<DaemonRestart> restart = GetDaemonRestart(status);
  if (!refusal.has_value() && !restart.has_value()) {
    return grpc::Status(code, std::string(status.message()));
  }
  pb::StatusDetails details;
  if (refusal.has_value()) {
    pb::AdmissionRefusal* wire = details.mutable_admission_refusal();
    wire->set_needed_bytes(refusal->needed);
    wire->set_free_bytes(refusal->free);
    wire->set_evictable_bytes(refusal->evictable);
    wire->set_budget_bytes(refusal->budget);
    wire->set_bytes_to_evict(refusal->bytes_to_evict);
  }
  if (restart.has_value()) {
    details.mutable_daemon_restart()->set_previous_epoch(restart->previous_epoch);
    details.mutable_daemon_restart()->set_epoch(restart->epoch);
  }
  return grpc::Status(code, std::string(status.message()), details.SerializeAsString());
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  absl::Status result(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  pb::StatusDetails details;
  // Details another server might send in another format are ignored, not trusted.
  if (status.error_details().empty() || !details.ParseFromString(status.error_details())) {
    return result;
  }
  if (details.has_admission_refusal()) {
    const pb::AdmissionRefusal& wire = details.admission_refusal();
    AttachAdmissionRefusal(result, AdmissionRefusal{wire.needed_bytes(), wire.free_bytes(),
                                                    wire.evictable_bytes(), wire.budget_bytes(),
                                                    wire.bytes_to_evict()});
  }
  if (details.has_daemon_restart()) {
    AttachDaemonRestart(result, DaemonRestart{details.daemon_restart().previous_epoch(),
                                              details.daemon_restart().epoch()});
  }
  return result;
}

}  // namespace memra
