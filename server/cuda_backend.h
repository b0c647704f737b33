#ifndef MEMRA_SERVER_CUDA_BACKEND_H_
#define MEMRA_SERVER_CUDA_BACKEND_H_

// Arenas in one GPU's memory: cudaMalloc regions, exported with cudaIpcGetMemHandle. Built only
// where the CUDA toolkit is (HAS_CUDA); on a machine without a device Create() refuses.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/arena_table.h"
#include "server/backend.h"

namespace memra {

struct CudaBackendOptions {
  int device = 0;  // CUDA runtime ordinal
};

// Thread-safe (see DeviceBackend). All device work runs on the backend's own non-blocking stream
// and every call synchronizes that stream before returning OK, so on return the bytes are in
// device memory for any process that maps the arena. Each call selects the device first (the
// current device is per host thread).
//
// Arenas are rounded to 2 MiB so each is its own cudaMalloc allocation: an IPC handle exports a
// whole allocation, and the engine maps exactly the arena.
class CudaBackend final : public DeviceBackend {
 public:
  static constexpr uint64_t kGranularity = uint64_t{2} << 20;

  // FAILED_PRECONDITION "no usable CUDA device: ..." when the runtime finds no device;
  // INVALID_ARGUMENT for an ordinal out of range.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(CudaBackendOptions options);
  // Frees every remaining arena and the stream.
  ~CudaBackend() override;

  std::string_view Name() const override { return "cuda"; }
  // total/free from cudaMemGetInfo (0/0 if the device stopped answering).
  DeviceInfo Info() override;
  uint64_t AllocationGranularity() const override { return kGranularity; }

  absl::StatusOr<ArenaId> CreateArena(uint64_t bytes, ArenaVisibility visibility) override;
  absl::StatusOr<ArenaExport> Export(ArenaId arena) override;
  absl::Status FreeArena(ArenaId arena) override;

  absl::Status Memset(ArenaId arena, uint64_t offset, uint8_t value, uint64_t bytes) override;
  absl::Status Copy(ArenaId dst, uint64_t dst_offset, ArenaId src, uint64_t src_offset,
                    uint64_t bytes) override;
  absl::Status WriteI32(ArenaId arena, uint64_t offset, int32_t value) override;
  absl::StatusOr<int32_t> ReadI32(ArenaId arena, uint64_t offset) override;
  absl::Status Write(ArenaId arena, uint64_t offset, absl::Span<const uint8_t> data) override;
  absl::Status Read(ArenaId arena, uint64_t offset, absl::Span<uint8_t> out) override;
  absl::Status Synchronize() override;

  uint64_t AllocatedBytes() const override { return arenas_.live_bytes(); }
  size_t ArenaCount() const override { return arenas_.size(); }

 private:
  class Arena;

  CudaBackend(int device, cudaStream_t stream, std::string name, std::string uuid);

  // cudaSetDevice for the calling thread.
  absl::Status SelectDevice() const;
  // Checks `enqueued` (the status of an async call), then waits for the stream.
  absl::Status Finish(absl::string_view op, cudaError_t enqueued) const;
  absl::StatusOr<std::shared_ptr<Arena>> Allocate(uint64_t bytes, ArenaVisibility visibility);
  absl::Status CopyIn(absl::string_view op, ArenaId id, uint64_t offset,
                      absl::Span<const uint8_t> data);
  absl::Status CopyOut(absl::string_view op, ArenaId id, uint64_t offset, absl::Span<uint8_t> out);

  // Constant after construction.
  const int device_;
  const cudaStream_t stream_;  // CUDA streams are thread-safe; the calls sync it themselves
  const std::string name_;
  const std::string uuid_;

  ArenaTable<Arena> arenas_;  // thread-safe itself; capacity is the device's to enforce
};

}  // namespace memra

#endif  // MEMRA_SERVER_CUDA_BACKEND_H_
