#ifndef MEMRA_SERVER_HOST_MEMORY_H_
#define MEMRA_SERVER_HOST_MEMORY_H_

// Host memory the daemon allocates for itself (the prefix store's host tier): plain anonymous
// mappings here, page-locked CUDA memory in server/device/pinned_host_memory.h. A device-level
// seam, so the CUDA allocator does not depend on the tier that uses it.

#include <cstdint>
#include <memory>
#include <string_view>

#include "absl/status/statusor.h"

namespace memra {

// Where host-tier memory comes from. Thread-safe.
class HostMemoryProvider {
 public:
  virtual ~HostMemoryProvider() = default;
  // "host" (plain memory) or "cuda_pinned" (logs, stats).
  virtual std::string_view Name() const = 0;
  // Allocation sizes are multiples of this (a nonzero power of two).
  virtual uint64_t Granularity() const = 0;
  // `bytes` (a multiple of Granularity()) of zero-filled memory. RESOURCE_EXHAUSTED when the
  // system has none to give.
  virtual absl::StatusOr<uint8_t*> Allocate(uint64_t bytes) = 0;
  virtual void Free(uint8_t* memory, uint64_t bytes) = 0;
};

// Anonymous private mappings (mmap), page-granular.
std::unique_ptr<HostMemoryProvider> NewPlainHostMemory();

}  // namespace memra

#endif  // MEMRA_SERVER_HOST_MEMORY_H_
