// OpenCudaEngineDevice for builds with the CUDA toolkit.

#include "client/cuda_mapper.h"
#include "core/status_macros.h"
#include "tests/cuda/cuda_plane_memory.h"
#include "tests/e2e/engine_device.h"

namespace memra::testing {

absl::StatusOr<EngineDevice> OpenCudaEngineDevice(int device) {
  // The memory first: it is what says "no usable CUDA device" before any mapping is tried.
  ASSIGN_OR_RETURN(std::unique_ptr<CudaPlaneMemory> memory, CudaPlaneMemory::Create(device));
  return EngineDevice{std::make_shared<CudaArenaMapper>(device), std::move(memory)};
}

}  // namespace memra::testing
