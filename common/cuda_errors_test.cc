#include "common/cuda_errors.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::StatusIs;

// cudaGetErrorString/Name need no device, so this runs wherever the toolkit is.
TEST(CudaErrorTest, CodeSaysWhatTheCallerDoesNext) {
  EXPECT_THAT(CudaError("cudaMalloc 4194304 bytes on device 0", cudaErrorMemoryAllocation),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstrs("cudaMalloc 4194304 bytes on device 0: ",
                                  "cudaErrorMemoryAllocation", "error 2")));
  EXPECT_THAT(CudaError("cudaSetDevice 0", cudaErrorInsufficientDriver),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstrs("error 35")));
  EXPECT_THAT(CudaError("cudaSetDevice 0", cudaErrorNoDevice),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstrs("cudaErrorNoDevice")));
  EXPECT_THAT(CudaError("cudaIpcOpenMemHandle", cudaErrorInvalidValue),
              StatusIs(absl::StatusCode::kInternal,
                       HasSubstrs("cudaIpcOpenMemHandle", "cudaErrorInvalidValue", "error 1")));
}

}  // namespace
}  // namespace memra
