#include "server/backend_factory.h"

#include <grp.h>

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/host_backend.h"
#include "server/instance.h"

namespace memra {
namespace {

absl::StatusOr<std::unique_ptr<DeviceBackend>> MakeHostBackend(const DaemonConfig& config) {
  HostBackendOptions options;
  options.total_bytes = config.budget_bytes;
  options.mode = static_cast<mode_t>(config.shm_mode);
  options.name_prefix = ShmPrefix(config);
  if (!config.shm_group.empty()) {
    group* entry = getgrnam(config.shm_group.c_str());
    if (entry == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("shm_group = \"", config.shm_group, "\": no such group"));
    }
    options.group = entry->gr_gid;
  }
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
