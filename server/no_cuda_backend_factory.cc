// MakeCudaBackend for builds without the CUDA toolkit.

#include "absl/status/status.h"
#include "server/backend_factory.h"

namespace memra {

absl::StatusOr<std::unique_ptr<DeviceBackend>> MakeCudaBackend(const DaemonConfig&) {
  return absl::InvalidArgumentError(
      "backend = \"cuda\": this memra-kvd was built without the CUDA toolkit; use backend = "
      "\"host\" or build where /usr/local/cuda exists");
}

}  // namespace memra
