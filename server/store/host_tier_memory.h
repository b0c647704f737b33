#ifndef MEMRA_SERVER_HOST_TIER_MEMORY_H_
#define MEMRA_SERVER_HOST_TIER_MEMORY_H_

// The memory of the prefix cache's host tier (the middle tier: device -> host -> disk). The
// tier logic is the prefix cache's and knows nothing of CUDA; only where the memory comes from
// differs: on cuda, page-locked ("pinned") host memory (cudaHostAlloc, server/
// pinned_host_memory.h), so the device copies in and out of it (DeviceBackend::Read / Write,
// cudaMemcpy) run as DMA at full PCIe speed; elsewhere plain anonymous host memory (tests, and
// the host backend when an operator asks for it: there the device tier already is host memory,
// so the middle tier only adds a copy and is off by default).
//
// HostTierMemory is a SlabSource: a SlabAllocator carves the tier's pieces out of its slabs,
// and Bytes() gives the prefix cache the memory of a span to copy to and from.
//
// Thread-safety: thread-safe. Invariant: allocated_bytes() == the sum of the live slabs' bytes.

#include <cstdint>
#include <memory>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "server/device/backend.h"
#include "server/device/host_memory.h"
#include "server/store/slab_allocator.h"

namespace memra {

class HostTierMemory final : public SlabSource {
 public:
  explicit HostTierMemory(std::unique_ptr<HostMemoryProvider> provider);
  ~HostTierMemory() override;  // frees every slab still held
  HostTierMemory(const HostTierMemory&) = delete;
  HostTierMemory& operator=(const HostTierMemory&) = delete;

  std::string_view provider_name() const { return provider_->Name(); }

  absl::StatusOr<uint64_t> RoundedSlabBytes(uint64_t bytes) const override;
  absl::StatusOr<ArenaId> CreateSlab(uint64_t bytes) override ABSL_LOCKS_EXCLUDED(mu_);
  // NOT_FOUND for a slab this memory does not hold.
  absl::Status FreeSlab(ArenaId slab) override ABSL_LOCKS_EXCLUDED(mu_);

  // The memory of [offset, offset + bytes) of `slab`: NOT_FOUND for an unknown slab,
  // INVALID_ARGUMENT (with the numbers) for a range outside it. Valid until the slab is freed.
  absl::StatusOr<absl::Span<uint8_t>> Bytes(ArenaId slab, uint64_t offset, uint64_t bytes) const
      ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t allocated_bytes() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Slab {
    uint8_t* memory = nullptr;
    uint64_t bytes = 0;
  };

  const std::unique_ptr<HostMemoryProvider> provider_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<ArenaId, Slab> slabs_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;  // ids are never reused
  uint64_t allocated_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace memra

#endif  // MEMRA_SERVER_HOST_TIER_MEMORY_H_
