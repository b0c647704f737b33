#ifndef MEMRA_SERVER_BACKEND_FACTORY_H_
#define MEMRA_SERVER_BACKEND_FACTORY_H_

// The configured device backend for memra-kvd. The cuda backend exists only in builds where the
// CUDA toolkit was found (@local_cuda HAS_CUDA); which MakeCudaBackend links is chosen in
// server/BUILD.bazel, so no source carries an #ifdef.

#include <memory>

#include "absl/status/statusor.h"
#include "server/device/backend.h"
#include "server/config.h"

namespace memra {

// host: a HostBackend of budget_bytes whose memfds are named ShmPrefix(config) (what /proc shows). cuda: a CudaBackend on `device` (FAILED_PRECONDITION without a usable device).
// INVALID_ARGUMENT for a setting this build cannot honour (names the key).
absl::StatusOr<std::unique_ptr<DeviceBackend>> MakeBackend(const DaemonConfig& config);

// Defined by cuda_backend_factory.cc (toolkit present) or no_cuda_backend_factory.cc.
absl::StatusOr<std::unique_ptr<DeviceBackend>> MakeCudaBackend(const DaemonConfig& config);

}  // namespace memra

#endif  // MEMRA_SERVER_BACKEND_FACTORY_H_
