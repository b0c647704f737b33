#ifndef MEMRA_COMMON_CUDA_ERRORS_H_
#define MEMRA_COMMON_CUDA_ERRORS_H_

// The one place a cudaError_t becomes an absl::Status (the client's CUDA mapper uses it too).

#include <cuda_runtime_api.h>

#include <string_view>

#include "absl/status/status.h"

namespace memra {

// `context` names the call and the object. cudaErrorMemoryAllocation -> RESOURCE_EXHAUSTED;
// no device / driver too old -> FAILED_PRECONDITION; anything else -> INTERNAL. The message
// carries cudaGetErrorString, the error's name and number.
absl::Status CudaError(std::string_view context, cudaError_t err);

}  // namespace memra

#endif  // MEMRA_COMMON_CUDA_ERRORS_H_
