// Copy bandwidths of the cuda backend on a real GPU, each against the bare CUDA runtime doing the
// same copy in the same process and run (the baseline): device-to-device arena copies (what
// grow, spec rollback and prefix capture/restore run), host-to-device writes and device-to-host
// reads. Prints one "BANDWIDTH" line per measurement for tests/cuda/run_on_gpu.sh's summary.
// Asserts only that every copy moved the right bytes: timings on shared machines are reported,
// never asserted. Skips (never passes) without a device.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "server/device/cuda_backend.h"
#include "server/testing/test_cuda_backend.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::IsOk;

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr int kRounds = 5;

// Median seconds of kRounds runs of `copy` (each complete when it returns).
double MedianSeconds(const std::function<void()>& copy) {
  copy();  // warm-up: first-touch and lazy module loading out of the measurement
  std::vector<double> seconds;
  for (int i = 0; i < kRounds; ++i) {
    const absl::Time start = absl::Now();
    copy();
    seconds.push_back(absl::ToDoubleSeconds(absl::Now() - start));
  }
  std::sort(seconds.begin(), seconds.end());
  return seconds[kRounds / 2];
}

void Report(const char* what, uint64_t bytes, double backend_seconds, double raw_seconds) {
  const double gb = static_cast<double>(bytes) / 1e9;
  std::printf("BANDWIDTH %-28s %6llu MiB: backend %8.1f GB/s, bare runtime %8.1f GB/s, ratio %.2f\n",
              what, static_cast<unsigned long long>(bytes / kMiB), gb / backend_seconds,
              gb / raw_seconds, raw_seconds / backend_seconds);
}

class CudaBandwidthTest : public ::testing::TestWithParam<uint64_t> {
 protected:
  void SetUp() override {
    backend_ = testing::NewCudaBackendOrNull();
    if (backend_ == nullptr) GTEST_SKIP();
  }
  std::unique_ptr<CudaBackend> backend_;
};

TEST_P(CudaBandwidthTest, DeviceToDeviceHostToDeviceAndBack) {
  const uint64_t bytes = GetParam();
  absl::StatusOr<ArenaId> src = backend_->CreateArena(bytes, ArenaVisibility::kPrivate);
  absl::StatusOr<ArenaId> dst = backend_->CreateArena(bytes, ArenaVisibility::kPrivate);
  ASSERT_THAT(src, IsOk());
  ASSERT_THAT(dst, IsOk());
  std::vector<uint8_t> host(bytes);
  for (uint64_t i = 0; i < bytes; ++i) host[i] = static_cast<uint8_t>(i * 131 + 7);

  // Host -> device: backend Write vs cudaMemcpy into a plain allocation.
  void* raw_src = nullptr;
  void* raw_dst = nullptr;
  ASSERT_EQ(cudaMalloc(&raw_src, bytes), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&raw_dst, bytes), cudaSuccess);
  const double write_s = MedianSeconds(
      [&] { ASSERT_THAT(backend_->Write(*src, 0, absl::MakeConstSpan(host)), IsOk()); });
  const double raw_write_s = MedianSeconds([&] {
    ASSERT_EQ(cudaMemcpy(raw_src, host.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
  });
  Report("host->device write", bytes, write_s, raw_write_s);

  // Device -> device: backend Copy between arenas vs cudaMemcpy between allocations.
  const double copy_s =
      MedianSeconds([&] { ASSERT_THAT(backend_->Copy(*dst, 0, *src, 0, bytes), IsOk()); });
  const double raw_copy_s = MedianSeconds([&] {
    ASSERT_EQ(cudaMemcpy(raw_dst, raw_src, bytes, cudaMemcpyDeviceToDevice), cudaSuccess);
  });
  Report("device->device copy", bytes, copy_s, raw_copy_s);

  // Device -> host: backend Read vs cudaMemcpy, and the bytes are the ones written.
  std::vector<uint8_t> back(bytes);
  const double read_s =
      MedianSeconds([&] { ASSERT_THAT(backend_->Read(*dst, 0, absl::MakeSpan(back)), IsOk()); });
  std::vector<uint8_t> raw_back(bytes);
  const double raw_read_s = MedianSeconds([&] {
    ASSERT_EQ(cudaMemcpy(raw_back.data(), raw_dst, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  });
  Report("device->host read", bytes, read_s, raw_read_s);
  EXPECT_TRUE(back == host) << "the arena copy did not round-trip its bytes";
  EXPECT_TRUE(raw_back == host) << "the bare runtime copy did not round-trip its bytes";

  cudaFree(raw_src);
  cudaFree(raw_dst);
  EXPECT_THAT(backend_->FreeArena(*src), IsOk());
  EXPECT_THAT(backend_->FreeArena(*dst), IsOk());
}

INSTANTIATE_TEST_SUITE_P(Sizes, CudaBandwidthTest,
                         ::testing::Values(16 * kMiB, 256 * kMiB, 1024 * kMiB),
                         [](const ::testing::TestParamInfo<uint64_t>& info) {
                           return std::to_string(info.param / kMiB) + "MiB";
                         });

// A session operation's mirror stores (WriteI32s) on the cuda backend: one cudaMemcpyBatchAsync
// per call against one cudaMemcpyAsync per mirror (the backend before batching), for a decode
// step of Llama-3-8B (32 length mirrors) and of a model whose 32 layers are rings (length and
// base: 64). Prints one "MIRRORS" line per count for tests/cuda/run_on_gpu.sh (bench/README.md
// "Mirrors on the cuda backend" says what the figures decide). Asserts only the stored values.
TEST(CudaMirrorWrites, OneBatchPerCallAgainstOneCopyPerMirror) {
  std::unique_ptr<CudaBackend> batched = testing::NewCudaBackendOrNull();
  if (batched == nullptr) GTEST_SKIP();
  std::unique_ptr<CudaBackend> one_by_one =
      testing::NewCudaBackendOrNull({.device = 0, .batch_mirror_writes = false});
  ASSERT_NE(one_by_one, nullptr);
  constexpr int kCallsPerSample = 1000;
  for (int mirrors : {32, 64}) {
    double seconds[2] = {0, 0};
    CudaBackend* backends[2] = {batched.get(), one_by_one.get()};
    for (int b = 0; b < 2; ++b) {
      absl::StatusOr<ArenaId> arena = backends[b]->CreateArena(2 * kMiB, ArenaVisibility::kPrivate);
      ASSERT_THAT(arena, IsOk());
      std::vector<I32Write> writes;
      for (int i = 0; i < mirrors; ++i) writes.push_back({uint64_t(i) * 256, 0});
      int32_t step = 0;
      seconds[b] = MedianSeconds([&] {
        for (int call = 0; call < kCallsPerSample; ++call) {
          ++step;
          for (I32Write& write : writes) write.value = step;
          ASSERT_THAT(backends[b]->WriteI32s(*arena, writes), IsOk());
        }
      });
      for (const I32Write& write : writes) {
        absl::StatusOr<int32_t> value = backends[b]->ReadI32(*arena, write.offset);
        ASSERT_THAT(value, IsOk());
        EXPECT_EQ(*value, step);
      }
      EXPECT_THAT(backends[b]->FreeArena(*arena), IsOk());
    }
    const double batched_us = seconds[0] / kCallsPerSample * 1e6;
    const double one_by_one_us = seconds[1] / kCallsPerSample * 1e6;
    std::printf("MIRRORS %2d mirror stores per WriteI32s: one batch %7.2f us, one copy per mirror "
                "%7.2f us, batch/per-mirror %.2f\n",
                mirrors, batched_us, one_by_one_us, batched_us / one_by_one_us);
  }
}

}  // namespace
}  // namespace memra
