#ifndef MEMRA_SERVER_TEST_CUDA_BACKEND_H_
#define MEMRA_SERVER_TEST_CUDA_BACKEND_H_

// Test helper: a CudaBackend on device 0, or null after printing "SKIPPED: no CUDA device (...)"
// so logs say why the caller skipped. Any other failure to start fails the test.
// Use: `auto backend = testing::NewCudaBackendOrNull(); if (!backend) GTEST_SKIP();`

#include <spawn.h>
#include <sys/types.h>

#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/device/cuda_backend.h"
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

// Runs this test binary again as a child process (a CUDA process cannot open its own IPC
// exports), filtered to `gtest_filter`, with only `env` and CUDA_VISIBLE_DEVICES (no Bazel XML
// output file for it to overwrite). `actions`: the child's descriptors, or null. The child's
// pid, or -1 after a failed expectation.
inline pid_t SpawnFilteredSelf(const std::string& gtest_filter, std::vector<std::string> env,
                               const posix_spawn_file_actions_t* actions = nullptr) {
  if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES")) {
    env.push_back(std::string("CUDA_VISIBLE_DEVICES=") + visible);
  }
  std::string exe = "/proc/self/exe";
  std::string filter = "--gtest_filter=" + gtest_filter;
  std::vector<char*> argv = {exe.data(), filter.data(), nullptr};
  std::vector<char*> envp;
  for (std::string& entry : env) envp.push_back(entry.data());
  envp.push_back(nullptr);
  pid_t child = 0;
  const int spawned = posix_spawn(&child, exe.c_str(), actions, nullptr, argv.data(), envp.data());
  EXPECT_EQ(spawned, 0) << "posix_spawn of " << exe;
  return spawned == 0 ? child : -1;
}

}  // namespace memra::testing

#endif  // MEMRA_SERVER_TEST_CUDA_BACKEND_H_
