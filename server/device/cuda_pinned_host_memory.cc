// NewCudaPinnedHostMemory for builds with the CUDA toolkit.

#include <cuda_runtime_api.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/cuda_errors.h"
#include "server/device/pinned_host_memory.h"
#include "spdlog/spdlog.h"

namespace memra {
namespace {

class CudaPinnedHostMemory final : public HostMemoryProvider {
 public:
  std::string_view Name() const override { return "cuda_pinned"; }
  // cudaHostAlloc pins whole pages.
  uint64_t Granularity() const override { return 4096; }
  absl::StatusOr<uint8_t*> Allocate(uint64_t bytes) override {
    void* memory = nullptr;
    if (const cudaError_t err = cudaHostAlloc(&memory, bytes, cudaHostAllocPortable);
        err != cudaSuccess) {
      return CudaError(absl::StrCat("cudaHostAlloc of ", bytes, " bytes for the host tier"), err);
    }
    // Zero-filled as HostMemoryProvider promises (cudaHostAlloc does not clear).
    std::memset(memory, 0, bytes);
    return static_cast<uint8_t*>(memory);
  }
  void Free(uint8_t* memory, uint64_t bytes) override {
    if (const cudaError_t err = cudaFreeHost(memory); err != cudaSuccess) {
      spdlog::error("host tier: cudaFreeHost of {} bytes failed: {}", bytes,
                    CudaError("cudaFreeHost", err).ToString());
    }
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<HostMemoryProvider>> NewCudaPinnedHostMemory() {
  return std::make_unique<CudaPinnedHostMemory>();
}

}  // namespace memra
