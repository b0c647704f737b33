#ifndef MEMRA_TESTS_CUDA_CUDA_PLANE_MEMORY_H_
#define MEMRA_TESTS_CUDA_CUDA_PLANE_MEMORY_H_

// PlaneMemory over planes mapped from the cuda backend (CudaArenaMapper): what a real engine's
// kernels would do to them, done with CUDA copies on the engine's own stream. Built only where
// the CUDA toolkit is (HAS_CUDA).

#include <cuda_runtime_api.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "tests/e2e/plane_memory.h"

namespace memra::testing {

// Thread-compatible (see PlaneMemory). Writes, moves and fills are enqueued on a non-blocking
// stream and return before the device has run them, as an engine's kernels would; after each one
// the interprocess event is re-recorded on the stream, so WaitEvent() always covers every write
// so far and the daemon really has to wait for it (DeviceOrdering). Reads are stream-ordered
// after those writes and complete on return.
class CudaPlaneMemory final : public PlaneMemory {
 public:
  // A stream and an event (cudaEventInterprocess | cudaEventDisableTiming) on `device`.
  // FAILED_PRECONDITION without a usable device.
  static absl::StatusOr<std::unique_ptr<CudaPlaneMemory>> Create(int device);
  // Waits for the stream, then destroys the event and the stream.
  ~CudaPlaneMemory() override;
  CudaPlaneMemory(const CudaPlaneMemory&) = delete;
  CudaPlaneMemory& operator=(const CudaPlaneMemory&) = delete;

  // cudaIpcGetEventHandle of the event: 64 bytes.
  const std::string& WaitEvent() const override { return event_handle_; }

 private:
  CudaPlaneMemory(int device, cudaStream_t stream, cudaEvent_t event, std::string event_handle)
      : device_(device), stream_(stream), event_(event), event_handle_(std::move(event_handle)) {}

  absl::Status DoWrite(uint8_t* to, absl::Span<const uint8_t> data) override;
  absl::Status DoRead(const uint8_t* from, absl::Span<uint8_t> out) override;
  absl::Status DoMove(uint8_t* to, const uint8_t* from, uint64_t bytes) override;
  absl::Status DoFill(uint8_t* at, uint8_t value, uint64_t bytes) override;

  // cudaSetDevice for the calling thread (the current device is per host thread).
  absl::Status SelectDevice() const;
  // Checks `enqueued` (an async call's status) and records the event after it.
  absl::Status Enqueued(const char* op, cudaError_t enqueued);

  // Constant after construction.
  const int device_;
  const cudaStream_t stream_;
  const cudaEvent_t event_;
  const std::string event_handle_;
};

}  // namespace memra::testing

#endif  // MEMRA_TESTS_CUDA_CUDA_PLANE_MEMORY_H_
