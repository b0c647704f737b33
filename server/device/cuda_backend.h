#ifndef MEMRA_SERVER_CUDA_BACKEND_H_
#define MEMRA_SERVER_CUDA_BACKEND_H_

// Arenas in one GPU's memory: cudaMalloc regions, exported with cudaIpcGetMemHandle. Built only
// where the CUDA toolkit is (HAS_CUDA); on a machine without a device Create() refuses.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/device/arena_table.h"
#include "server/device/backend.h"
#include "server/device/checked_arena_backend.h"

namespace memra {

struct CudaBackendOptions {
  int device = 0;  // CUDA runtime ordinal
  // DaemonConfig cuda_export = "vmm": exported arenas are CUDA VMM allocations shared as POSIX
  // file descriptors (common/cuda_vmm.h) instead of cudaMalloc + cudaIpcGetMemHandle. Their
  // export handle is "vmm-" + 32 random hex characters, traded for the descriptor over the fd
  // side channel; DuplicateArenaFd and AdoptArenaFd work, so they survive a daemon restart.
  bool vmm_exports = false;
  // WriteI32s of several mirrors as one cudaMemcpyBatchAsync (CUDA 12.8+) instead of one
  // cudaMemcpyAsync per mirror; false only to measure the per-mirror copies against it
  // (tests/cuda/cuda_bandwidth_test). Toolkits before 12.8 always copy per mirror.
  bool batch_mirror_writes = true;
};

// Thread-safe (see DeviceBackend). All device work runs on the backend's own non-blocking stream
// and every call synchronizes that stream before returning OK, so on return the bytes are in
// device memory for any process that maps the arena. Each call selects the device first (the
// current device is per host thread).
//
// Arenas are rounded to 2 MiB so each is its own cudaMalloc allocation: an IPC handle exports a
// whole allocation, and the engine maps exactly the arena. In VMM mode 2 MiB must be a multiple
// of the device's VMM granularity (Create checks).
class CudaBackend final : public CheckedArenaBackend {
 public:
  static constexpr uint64_t kGranularity = uint64_t{2} << 20;

  // FAILED_PRECONDITION "no usable CUDA device: ..." when the runtime finds no device, or in
  // VMM mode when the device's VMM granularity does not divide kGranularity; INVALID_ARGUMENT
  // for an ordinal out of range.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(CudaBackendOptions options);
  // Destroys the stream; the remaining arenas are freed after it (their records cudaFree).
  ~CudaBackend() override;

  std::string_view Name() const override { return "cuda"; }
  // total/free from cudaMemGetInfo (0/0 if the device stopped answering).
  DeviceInfo Info() override;
  uint64_t AllocationGranularity() const override { return kGranularity; }
  absl::Status Synchronize() override;
  // cudaIpcOpenEventHandle (opened once per distinct handle and cached: engines re-record the
  // same event) + cudaEventSynchronize on the calling thread, so the daemon's shared stream is
  // never held up by one engine's work.
  absl::Status WaitForEngineEvent(absl::string_view ipc_event_handle) override
      ABSL_LOCKS_EXCLUDED(events_mu_);
  // A cuda engine's pool (block store): cudaIpcOpenMemHandle once per distinct handle of the
  // call (cudaIpcMemLazyEnablePeerAccess), each allocation's size from the driver, every buffer
  // checked inside its allocation; one SegmentedArenaRecord over the opened regions, which
  // closes them when the arena is freed (unregistration, lease end). A failure closes what it
  // opened. The handles per engine are bounded by the block store's registrations and buffers.
  absl::StatusOr<MappedEngineBuffers> MapEngineIpcBuffers(
      absl::Span<const EngineBufferIpc> buffers) override;
  // Records the backend's one interprocess event on its stream (after a transfer's copies, which
  // every call has already synchronized) and returns its cudaIpcEventHandle_t.
  absl::StatusOr<std::string> RecordCompletionEvent() override;
  // VMM mode only (FAILED_PRECONDITION otherwise: IPC memory dies with its exporter).
  absl::StatusOr<ArenaId> AdoptArenaFd(int fd, uint64_t bytes,
                                       std::string export_handle) override;

 private:
  CudaBackend(const CudaBackendOptions& options, cudaStream_t stream, cudaEvent_t completion,
              std::string completion_handle, std::string name, std::string uuid);

  absl::StatusOr<std::shared_ptr<ArenaRecord>> Allocate(uint64_t bytes,
                                                        ArenaVisibility visibility) override;
  absl::Status Fill(uint8_t* at, uint8_t value, uint64_t bytes) override;
  absl::Status Move(uint8_t* to, const uint8_t* from, uint64_t bytes) override;
  absl::Status Upload(absl::string_view op, uint8_t* to, absl::Span<const uint8_t> data) override;
  absl::Status Download(absl::string_view op, const uint8_t* from,
                        absl::Span<uint8_t> out) override;
  absl::Status StoreI32s(uint8_t* base, absl::Span<const I32Write> writes) override;
  absl::StatusOr<uint64_t> CopyHashed(uint8_t* dst, const uint8_t* src,
                                      absl::Span<const CopyRange> ranges) override;

  // cudaSetDevice for the calling thread.
  absl::Status SelectDevice() const;
  // Checks `enqueued` (the status of an async call), then waits for the stream.
  absl::Status Finish(absl::string_view op, cudaError_t enqueued) const;
  // StoreI32s' two ways of enqueuing the stores (the caller syncs).
  cudaError_t EnqueueI32sOneByOne(uint8_t* base, absl::Span<const I32Write> writes,
                                  uint64_t* failed_offset) const;
  cudaError_t EnqueueI32sBatched(uint8_t* base, absl::Span<const I32Write> writes) const;

  // Constant after construction.
  const int device_;
  const bool vmm_exports_;
  const bool batch_mirror_writes_;
  const cudaStream_t stream_;  // CUDA streams are thread-safe; every call syncs it itself
  // Interprocess (cudaEventInterprocess | cudaEventDisableTiming) event the block store's
  // transfers record; engines open its handle once and wait on it after each reply.
  const cudaEvent_t completion_event_;
  const std::string completion_handle_;  // its cudaIpcEventHandle_t bytes
  const std::string name_;
  const std::string uuid_;

  // Engines' interprocess events, by handle bytes. Bounded: past kMaxOpenEvents the cache is
  // emptied and refilled on demand. Shared so an event being waited on outlives its eviction
  // (the last holder destroys it).
  static constexpr size_t kMaxOpenEvents = 4096;
  absl::Mutex events_mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<CUevent_st>> open_events_
      ABSL_GUARDED_BY(events_mu_);
};

}  // namespace memra

#endif  // MEMRA_SERVER_CUDA_BACKEND_H_
