#include "client/cuda_mapper.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/cuda_errors.h"
#include "common/cuda_vmm.h"
#include "core/status_macros.h"

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

class VmmImport final : public CachingArenaMapper::Mapping {
 public:
  explicit VmmImport(VmmMapping mapping) : mapping_(std::move(mapping)) {}
  void* data() const override { return mapping_.data(); }

 private:
  VmmMapping mapping_;  // unmapped and released on destruction
};

}  // namespace

bool IsVmmHandle(absl::string_view handle) { return absl::StartsWith(handle, kVmmHandlePrefix); }

absl::StatusOr<std::unique_ptr<CachingArenaMapper::Mapping>> MapVmmDescriptor(int device, int fd,
                                                                              uint64_t bytes) {
  if (const cudaError_t err = cudaSetDevice(device); err != cudaSuccess) {
    return CudaError(absl::StrCat("cudaSetDevice ", device), err);
  }
  absl::StatusOr<VmmMapping> mapping = VmmMapping::Import(device, fd, bytes);
  if (!mapping.ok()) return mapping.status();
  return std::make_unique<VmmImport>(*std::move(mapping));
}

absl::StatusOr<std::unique_ptr<CachingArenaMapper::Mapping>> CudaArenaMapper::Open(
    absl::string_view handle, uint64_t bytes, ArenaFdSource fetch_fd) {
  if (IsVmmHandle(handle)) {
    // The memory comes only as a descriptor: over the daemon's handoff socket, like a host
    // arena's memfd.
    ASSIGN_OR_RETURN(ArenaFd arena, fetch_fd());
    if (arena.bytes != bytes) {
      return absl::FailedPreconditionError(absl::StrCat(
          "Map cuda arena ", handle, ": the daemon handed a descriptor of ", arena.bytes,
          " bytes, asked for ", bytes));
    }
    return MapVmmDescriptor(device_, arena.fd.get(), bytes);
  }
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
