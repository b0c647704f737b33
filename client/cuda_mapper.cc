#include "client/cuda_mapper.h"

#include <cuda_runtime_api.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/cuda_errors.h"

namespace memra {
namespace {

class IpcMapping final : public CachingArenaMapper::Mapping {
 public:
  IpcMapping(int device, void* data) : device_(device), data_(data) {}
  IpcMapping(const IpcMapping&) = delete;
  IpcMapping& operator=(const IpcMapping&) = delete;
  ~IpcMapping() override {
    // Failure leaves nothing to recover; the daemon still owns the memory.
    cudaSetDevice(device_);
    cudaIpcCloseMemHandle(data_);
  }
  void* data() const override { return data_; }

 private:
  const int device_;
  void* const data_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CachingArenaMapper::Mapping>> CudaArenaMapper::Open(
    absl::string_view handle, uint64_t bytes, ArenaFdSource) {
  cudaIpcMemHandle_t ipc_handle;
  if (handle.size() != sizeof(ipc_handle)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a cuda arena handle is ", sizeof(ipc_handle), " bytes, got ", handle.size()));
  }
  std::memcpy(&ipc_handle, handle.data(), sizeof(ipc_handle));
  if (const cudaError_t err = cudaSetDevice(device_); err != cudaSuccess) {
    return CudaError(absl::StrCat("cudaSetDevice ", device_), err);
  }
  void* data = nullptr;
  if (const cudaError_t err =
          cudaIpcOpenMemHandle(&data, ipc_handle, cudaIpcMemLazyEnablePeerAccess);
      err != cudaSuccess) {
    return CudaError(absl::StrCat("cudaIpcOpenMemHandle for ", bytes, " bytes on device ", device_),
                     err);
  }
  return std::make_unique<IpcMapping>(device_, data);
}

}  // namespace memra
