// MakeCudaBackend for builds with the CUDA toolkit.

#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/backend_factory.h"
#include "server/device/cuda_backend.h"

namespace memra {

absl::StatusOr<std::unique_ptr<DeviceBackend>> MakeCudaBackend(const DaemonConfig& config) {
  if (config.device > static_cast<uint32_t>(std::numeric_limits<int>::max())) {
    return absl::InvalidArgumentError(absl::StrCat("device = ", config.device, ": out of range"));
  }
  CudaBackendOptions options;
  options.device = static_cast<int>(config.device);
  options.vmm_exports = config.cuda_export == CudaExport::kVmm;
  absl::StatusOr<std::unique_ptr<CudaBackend>> backend = CudaBackend::Create(options);
  if (!backend.ok()) return backend.status();
  return std::unique_ptr<DeviceBackend>(*std::move(backend));
}

}  // namespace memra
