#include "tests/e2e/engine_device.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace memra::testing {

absl::StatusOr<EngineDevice> OpenEngineDevice(std::string_view backend, int device) {
  if (backend == "host") {
    return EngineDevice{std::make_shared<HostArenaMapper>(), std::make_unique<HostPlaneMemory>()};
  }
  if (backend == "cuda") return OpenCudaEngineDevice(device);
  return absl::InvalidArgumentError(
      absl::StrCat("unknown backend \"", std::string(backend), "\" (host or cuda)"));
}

}  // namespace memra::testing
