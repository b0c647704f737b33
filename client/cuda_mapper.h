#ifndef MEMRA_CLIENT_CUDA_MAPPER_H_
#define MEMRA_CLIENT_CUDA_MAPPER_H_

// Maps the cuda backend's exports into this engine process: 64-byte cudaIpcMemHandle_t
// (cuda_export = "ipc"), or VMM allocations shared as POSIX file descriptors (cuda_export =
// "vmm": handles "vmm-<32 hex>", common/cuda_vmm.h). Built only where the CUDA toolkit is
// (HAS_CUDA).

#include "client/mapper.h"

namespace memra {

// Thread-safe (see ArenaMapper). Each handle is opened once with cudaIpcOpenMemHandle (about a
// millisecond) and closed with cudaIpcCloseMemHandle on Unmap or destruction. The runtime cannot
// report an IPC allocation's size, so `bytes` is checked only against the cached entry.
// A process cannot open its own exports: the daemon never maps through this.
// A VMM arena's memory from the descriptor the daemon handed over, mapped read-write on
// `device` (imported with cuMemImportFromShareableHandle + cuMemMap + cuMemSetAccess); the caller
// keeps `fd`. CudaArenaMapper opens "vmm-" handles with it once their descriptor comes over the
// daemon's handoff socket (the ArenaFdSource, as for host arenas' memfds).
absl::StatusOr<std::unique_ptr<CachingArenaMapper::Mapping>> MapVmmDescriptor(int device, int fd,
                                                                              uint64_t bytes);

// True for a VMM export's handle ("vmm-..."), which only a descriptor opens.
bool IsVmmHandle(absl::string_view handle);

class CudaArenaMapper final : public CachingArenaMapper {
 public:
  // `device`: the CUDA ordinal (as this process sees it) the arenas live on.
  explicit CudaArenaMapper(int device) : CachingArenaMapper("cuda"), device_(device) {}

 private:
  // `fetch_fd` is called only for a VMM handle: an IPC handle opens the memory by itself.
  absl::StatusOr<std::unique_ptr<Mapping>> Open(absl::string_view handle, uint64_t bytes,
                                                ArenaFdSource fetch_fd) override;

  const int device_;  // constant after construction
};

}  // namespace memra

#endif  // MEMRA_CLIENT_CUDA_MAPPER_H_
