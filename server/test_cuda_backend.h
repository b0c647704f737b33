#ifndef MEMRA_SERVER_TEST_CUDA_BACKEND_H_
#define MEMRA_SERVER_TEST_CUDA_BACKEND_H_

// Test helper: a CudaBackend on device 0, or null after printing "SKIPPED: no CUDA device (...)"
// so logs say why the caller skipped. Any other failure to start fails the test.
// Use: `auto backend = testing::NewCudaBackendOrNull(); if (!backend) GTEST_SKIP();`

#include <iostream>
#include <memory>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/cuda_backend.h"
#include "tests/status_matchers.h"

namespace memra::testing {

inline std::unique_ptr<CudaBackend> NewCudaBackendOrNull(
    CudaBackendOptions options = {.device = 0}) {
  absl::StatusOr<std::unique_ptr<CudaBackend>> backend = CudaBackend::Create(options);
  if (backend.ok()) return *std::move(backend);
  EXPECT_THAT(backend, StatusIs(absl::StatusCode::kFailedPrecondition,
                                ::testing::HasSubstr("no usable CUDA device")));
  std::cout << "SKIPPED: no CUDA device (" << backend.status().message() << ")" << std::endl;
  return nullptr;
}

}  // namespace memra::testing

#endif  // MEMRA_SERVER_TEST_CUDA_BACKEND_H_
