// NewCudaPinnedHostMemory for builds without the CUDA toolkit.

#include "absl/status/status.h"
#include "server/device/pinned_host_memory.h"

namespace memra {

absl::StatusOr<std::unique_ptr<HostMemoryProvider>> NewCudaPinnedHostMemory() {
  return absl::FailedPreconditionError(
      "the pinned host tier needs the CUDA toolkit; this memra-kvd was built without it");
}

}  // namespace memra
