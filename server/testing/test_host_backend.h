#ifndef MEMRA_SERVER_TEST_HOST_BACKEND_H_
#define MEMRA_SERVER_TEST_HOST_BACKEND_H_

// Test helpers: hermetic HostBackends whose shm names cannot collide with another test, another
// run, or a daemon on the same machine.

#include <unistd.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/device/host_backend.h"

namespace memra::testing {

// "memra-test-<pid>-<current test name>".
inline std::string UniqueShmPrefix() {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return absl::StrCat("memra-test-", getpid(), "-", info != nullptr ? info->name() : "none");
}

inline HostBackendOptions TestHostBackendOptions(uint64_t total_bytes = uint64_t{64} << 20) {
  HostBackendOptions options;
  options.total_bytes = total_bytes;
  options.name_prefix = UniqueShmPrefix();
  return options;
}

// Null (and a test failure) when creation fails.
inline std::unique_ptr<HostBackend> NewTestHostBackend(HostBackendOptions options) {
  absl::StatusOr<std::unique_ptr<HostBackend>> backend = HostBackend::Create(std::move(options));
  EXPECT_TRUE(backend.ok()) << backend.status();
  return backend.ok() ? *std::move(backend) : nullptr;
}

}  // namespace memra::testing

#endif  // MEMRA_SERVER_TEST_HOST_BACKEND_H_
