#ifndef MEMRA_CLIENT_CUDA_MAPPER_H_
#define MEMRA_CLIENT_CUDA_MAPPER_H_

// Maps the cuda backend's exports (64-byte cudaIpcMemHandle_t) into this engine process. Built
// only where the CUDA toolkit is (HAS_CUDA).

#include "client/mapper.h"

namespace memra {

// Thread-safe (see ArenaMapper). Each handle is opened once with cudaIpcOpenMemHandle (about a
// millisecond) and closed with cudaIpcCloseMemHandle on Unmap or destruction. The runtime cannot
// report an IPC allocation's size, so `bytes` is checked only against the cached entry.
// A process cannot open its own exports: the daemon never maps through this.
class CudaArenaMapper final : public CachingArenaMapper {
 public:
  // `device`: the CUDA ordinal (as this process sees it) the arenas live on.
  explicit CudaArenaMapper(int device) : CachingArenaMapper("cuda"), device_(device) {}

 private:
  // `fetch_fd` is not used: an IPC handle opens the memory by itself.
  absl::StatusOr<std::unique_ptr<Mapping>> Open(absl::string_view handle, uint64_t bytes,
                                                ArenaFdSource fetch_fd) override;

  const int device_;  // constant after construction
};

}  // namespace memra

#endif  // MEMRA_CLIENT_CUDA_MAPPER_H_
