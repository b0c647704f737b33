// OpenCudaEngineDevice for builds without the CUDA toolkit.

#include "absl/status/status.h"
#include "tests/e2e/engine_device.h"

namespace memra::testing {

absl::StatusOr<EngineDevice> OpenCudaEngineDevice(int) {
  return absl::InvalidArgumentError(
      "--backend=cuda: this test engine was built without the CUDA toolkit");
}

}  // namespace memra::testing
