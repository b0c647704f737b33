#include "server/backend_factory.h"

#include <string>
#include <utility>

#include "server/device/host_backend.h"
#include "server/instance.h"

namespace memra {
namespace {

absl::StatusOr<std::unique_ptr<DeviceBackend>> MakeHostBackend(const DaemonConfig& config) {
  HostBackendOptions options;
  options.total_bytes = config.admission.budget_bytes;
  options.name_prefix = ShmPrefix(config);
  absl::StatusOr<std::unique_ptr<HostBackend>> backend = HostBackend::Create(std::move(options));
  if (!backend.ok()) return backend.status();
  return std::unique_ptr<DeviceBackend>(*std::move(backend));
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceBackend>> MakeBackend(const DaemonConfig& config) {
  switch (config.backend) {
    case Backend::kHost:
      return MakeHostBackend(config);
    case Backend::kCuda:
      return MakeCudaBackend(config);
  }
  return absl::InvalidArgumentError("unknown backend");
}

}  // namespace memra
