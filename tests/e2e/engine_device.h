#ifndef MEMRA_TESTS_E2E_ENGINE_DEVICE_H_
#define MEMRA_TESTS_E2E_ENGINE_DEVICE_H_

// What a test engine (or a test checking bytes as a third process) needs for one backend: the
// mapper its KvClient opens arenas with, and the PlaneMemory its script reaches planes through.
// The cuda pair exists only in builds where the CUDA toolkit was found; which
// OpenCudaEngineDevice links is chosen in tests/e2e/BUILD.bazel, so no source carries an #ifdef.

#include <memory>
#include <string_view>

#include "absl/status/statusor.h"
#include "client/mapper.h"
#include "tests/e2e/plane_memory.h"

namespace memra::testing {

struct EngineDevice {
  std::shared_ptr<ArenaMapper> mapper;
  std::unique_ptr<PlaneMemory> memory;
};

// "host": HostArenaMapper + HostPlaneMemory (`device` unused). "cuda": CudaArenaMapper +
// CudaPlaneMemory on CUDA ordinal `device` (FAILED_PRECONDITION "no usable CUDA device" without
// one; INVALID_ARGUMENT in a build without the toolkit). INVALID_ARGUMENT for any other name.
absl::StatusOr<EngineDevice> OpenEngineDevice(std::string_view backend, int device);

// Defined by cuda_engine_device.cc (toolkit present) or no_cuda_engine_device.cc.
absl::StatusOr<EngineDevice> OpenCudaEngineDevice(int device);

}  // namespace memra::testing

#endif  // MEMRA_TESTS_E2E_ENGINE_DEVICE_H_
