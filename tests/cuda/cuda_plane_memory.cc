#include "tests/cuda/cuda_plane_memory.h"

#include <cstdint>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/cuda_errors.h"
#include "common/cuda_memmove.h"
#include "core/status_macros.h"

namespace memra::testing {
absl::StatusOr<std::unique_ptr<CudaPlaneMemory>> CudaPlaneMemory::Create(int device) {
  int count = 0;
  if (const cudaError_t err = cudaGetDeviceCount(&count); err != cudaSuccess) {
    return absl::FailedPreconditionError(absl::StrCat("no usable CUDA device: ",
                                                      cudaGetErrorString(err), " (error ",
                                                      static_cast<int>(err), ")"));
  }
  if (device < 0 || device >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("no usable CUDA device: ordinal ", device, " of ", count, " devices"));
  }
  if (const cudaError_t err = cudaSetDevice(device); err != cudaSuccess) {
    return CudaError(absl::StrCat("cudaSetDevice ", device), err);
  }
  cudaStream_t stream = nullptr;
  if (const cudaError_t err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
      err != cudaSuccess) {
    return CudaError(absl::StrCat("engine stream on device ", device), err);
  }
  cudaEvent_t event = nullptr;
  cudaIpcEventHandle_t handle;
  cudaError_t err =
      cudaEventCreateWithFlags(&event, cudaEventInterprocess | cudaEventDisableTiming);
  if (err == cudaSuccess) err = cudaIpcGetEventHandle(&handle, event);
  if (err != cudaSuccess) {
    if (event != nullptr) cudaEventDestroy(event);
    cudaStreamDestroy(stream);
    return CudaError(absl::StrCat("interprocess event on device ", device), err);
  }
  return std::unique_ptr<CudaPlaneMemory>(new CudaPlaneMemory(
      device, stream, event, std::string(reinterpret_cast<const char*>(&handle), sizeof(handle))));
}

CudaPlaneMemory::~CudaPlaneMemory() {
  // Failures leave nothing to recover: the process is done with the device.
  cudaSetDevice(device_);
  cudaStreamSynchronize(stream_);
  cudaEventDestroy(event_);
  cudaStreamDestroy(stream_);
}

absl::Status CudaPlaneMemory::SelectDevice() const {
  if (const cudaError_t err = cudaSetDevice(device_); err != cudaSuccess) {
    return CudaError(absl::StrCat("cudaSetDevice ", device_), err);
  }
  return absl::OkStatus();
}

absl::Status CudaPlaneMemory::Enqueued(const char* op, cudaError_t enqueued) {
  if (enqueued != cudaSuccess) {
    return CudaError(absl::StrCat(op, " on the engine stream of device ", device_), enqueued);
  }
  if (const cudaError_t err = cudaEventRecord(event_, stream_); err != cudaSuccess) {
    return CudaError(absl::StrCat("recording the engine event after ", op), err);
  }
  return absl::OkStatus();
}

// From pageable memory cudaMemcpyAsync returns once `data` is staged (the caller may free it),
// while the copy into the plane may still be in flight: that is what the event orders.
absl::Status CudaPlaneMemory::DoWrite(uint8_t* to, absl::Span<const uint8_t> data) {
  RETURN_IF_ERROR(SelectDevice());
  return Enqueued("plane write",
                  cudaMemcpyAsync(to, data.data(), data.size(), cudaMemcpyHostToDevice, stream_));
}

absl::Status CudaPlaneMemory::DoRead(const uint8_t* from, absl::Span<uint8_t> out) {
  RETURN_IF_ERROR(SelectDevice());
  if (const cudaError_t err =
          cudaMemcpyAsync(out.data(), from, out.size(), cudaMemcpyDeviceToHost, stream_);
      err != cudaSuccess) {
    return CudaError(absl::StrCat("plane read of ", out.size(), " bytes"), err);
  }
  if (const cudaError_t err = cudaStreamSynchronize(stream_); err != cudaSuccess) {
    return CudaError("plane read: cudaStreamSynchronize", err);
  }
  return absl::OkStatus();
}

absl::Status CudaPlaneMemory::DoMove(uint8_t* to, const uint8_t* from, uint64_t bytes) {
  RETURN_IF_ERROR(SelectDevice());
  return Enqueued("plane move", MemmoveDeviceAsync(to, from, bytes, stream_));
}

absl::Status CudaPlaneMemory::DoFill(uint8_t* at, uint8_t value, uint64_t bytes) {
  RETURN_IF_ERROR(SelectDevice());
  return Enqueued("plane fill", cudaMemsetAsync(at, value, bytes, stream_));
}

}  // namespace memra::testing
