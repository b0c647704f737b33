#include "common/cuda_errors.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace memra {

absl::Status CudaError(std::string_view context, cudaError_t err) {
  const std::string message =
      absl::StrCat(absl::string_view(context.data(), context.size()), ": ", cudaGetErrorString(err),
                   " (", cudaGetErrorName(err), ", error ", static_cast<int>(err), ")");
  switch (err) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
      return absl::FailedPreconditionError(message);
    default:
      return absl::InternalError(message);
  }
}

}  // namespace memra
