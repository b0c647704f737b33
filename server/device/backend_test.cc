#include "server/device/backend.h"

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;

EngineBufferIpc Buffer(uint64_t offset, uint64_t bytes) {
  return {.ipc_handle = std::string(kCudaIpcHandleBytes, 'h'),
          .offset_in_allocation = offset,
          .bytes = bytes};
}

// The checks of a cuda engine pool's buffers that run before any driver call (no GPU needed).
TEST(CheckEngineIpcBuffersTest, RefusesWhatNoDeviceCouldMap) {
  EXPECT_THAT(CheckEngineIpcBuffers({Buffer(0, 4096), Buffer(4096, 4096)}), IsOk());
  EXPECT_THAT(CheckEngineIpcBuffers({}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("1 .. 1024", "got 0")));
  EXPECT_THAT(CheckEngineIpcBuffers(std::vector<EngineBufferIpc>(1025, Buffer(0, 1))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("got 1025")));
  std::vector<EngineBufferIpc> short_handle = {Buffer(0, 1), Buffer(0, 1)};
  short_handle[1].ipc_handle.resize(63);
  EXPECT_THAT(CheckEngineIpcBuffers(short_handle),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("buffer 1", "is 64 bytes (cudaIpcMemHandle_t); got 63")));
  EXPECT_THAT(CheckEngineIpcBuffers({Buffer(8, 0)}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("buffer 0: 0 bytes")));
  const uint64_t max = std::numeric_limits<uint64_t>::max();
  EXPECT_THAT(CheckEngineIpcBuffers({Buffer(max - 10, 11)}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("offset_in_allocation 18446744073709551605 + 11 bytes",
                                  "overflows")));
}

TEST(CheckEngineIpcBuffersTest, ABufferMustLieInsideItsAllocation) {
  EXPECT_THAT(CheckEngineIpcBufferInAllocation(0, Buffer(4096, 4096), 8192), IsOk());
  EXPECT_THAT(CheckEngineIpcBufferInAllocation(2, Buffer(4096, 4097), 8192),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("buffer 2", "offset_in_allocation 4096 + 4097 bytes = 8193",
                                  "CUDA allocation of 8192 bytes")));
}

}  // namespace
}  // namespace memra
