#ifndef MEMRA_SERVER_PINNED_HOST_MEMORY_H_
#define MEMRA_SERVER_PINNED_HOST_MEMORY_H_

// The cuda backend's host-tier memory: page-locked host memory (cudaHostAlloc, portable to
// every context), so DeviceBackend::Read / Write between it and the GPU run as DMA. Which
// definition links is chosen in server/BUILD.bazel (toolkit present or not), as for the
// backend itself.

#include <memory>

#include "absl/status/statusor.h"
#include "server/device/host_memory.h"

namespace memra {

// FAILED_PRECONDITION in a build without the CUDA toolkit.
absl::StatusOr<std::unique_ptr<HostMemoryProvider>> NewCudaPinnedHostMemory();

}  // namespace memra

#endif  // MEMRA_SERVER_PINNED_HOST_MEMORY_H_
