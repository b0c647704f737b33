#ifndef MEMRA_SERVER_SLAB_ALLOCATOR_H_
#define MEMRA_SERVER_SLAB_ALLOCATOR_H_

// The prefix cache's storage: spans sub-allocated from slabs, one private backend arena each, so
// a stored block costs no mapping of its own (one mmap per block hit vm.max_map_count near 65k
// blocks; one cudaMalloc per block rounded each to 2 MiB) and freed storage, already faulted in,
// is written again before fresh memory is touched.
//
// Placement: best fit over every free range of every slab (ties: lowest slab id, then lowest
// offset), so a freed hole is reused before a slab is created; a new slab is slab_bytes, or the
// span's own rounded size when larger (a slab of one span). Freed neighbours coalesce.
// Empty slabs: kept, warm, while all slabs together take at most keep_empty_bytes (the prefix
// budget: a cache at its budget keeps the memory it just evicted for the next capture); any
// other empty slab goes back to the backend at once, and ReleaseEmptySlabs() returns them all
// (admission takes them back before it evicts any entry).
// Budget: each slab is one ledger allocation (one arena, as max_arenas counts mappings) of its
// whole size, so admission counts what the device holds, free space inside slabs included; a
// slab that cannot be charged is not created. The ledger's evictable bytes are the bytes of
// slabs no hold keeps (see Hold): exactly what evicting every unpinned entry would return.
//
// Thread-safety: thread-safe. Lock order: PrefixCache's mutex -> mu_ -> DeviceBudget's mutex.
//
// Invariants: (1) ArenaCount() of this allocator's arenas == Stats().slabs; (2) per slab, used
// spans and free ranges tile [0, slab bytes) exactly; (3) Stats().used_bytes is the sum of live
// span bytes; (4) evictable bytes published to the budget == bytes of slabs whose hold count
// is 0 (after every public call returns).

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <tuple>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/device/backend.h"
#include "server/device/device_budget.h"

namespace memra {

// Where a SlabAllocator's slabs come from, one arena each: a DeviceBackend's private arenas
// (the prefix cache's device tier; BackendSlabSource) or host memory (its host tier,
// server/store/host_tier_memory.h). Thread-safe.
class SlabSource {
 public:
  virtual ~SlabSource() = default;
  // The bytes CreateSlab(bytes) takes. INVALID_ARGUMENT for 0 or on overflow.
  virtual absl::StatusOr<uint64_t> RoundedSlabBytes(uint64_t bytes) const = 0;
  // A slab of exactly RoundedSlabBytes(bytes). RESOURCE_EXHAUSTED when there is no room.
  virtual absl::StatusOr<ArenaId> CreateSlab(uint64_t bytes) = 0;
  virtual absl::Status FreeSlab(ArenaId slab) = 0;
};

// Private (never exported) arenas of `backend`, which must outlive it.
std::unique_ptr<SlabSource> BackendSlabSource(DeviceBackend* backend);

struct SlabAllocatorOptions {
  uint64_t slab_bytes = uint64_t{128} << 20;  // > 0; rounded up to the backend's granularity
  uint64_t alignment = 256;                   // span offsets and sizes; a power of two
  uint64_t keep_empty_bytes = 0;              // empty slabs kept while all slabs total <= this
};

// One allocation: `bytes` (rounded to the alignment) at `offset` in slab arena `slab`.
struct SlabSpan {
  ArenaId slab;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  bool operator==(const SlabSpan&) const = default;
};

// Gauges. Identity: slab_bytes == used_bytes + free_bytes + empty_bytes.
struct SlabStats {
  uint64_t slabs = 0;        // arenas held (empty ones included)
  uint64_t slab_bytes = 0;   // their bytes: what the budget is charged
  uint64_t used_bytes = 0;   // spans live
  uint64_t spans = 0;
  uint64_t free_bytes = 0;   // free inside slabs that hold a span (stranded by fragmentation)
  uint64_t empty_slabs = 0;  // kept warm for the next capture
  uint64_t empty_bytes = 0;
  uint64_t largest_free_bytes = 0;  // the largest free range, empty slabs included
  uint64_t evictable_bytes = 0;     // bytes of slabs no hold keeps
  // free_bytes / (slab_bytes - empty_bytes), in parts per million: the share of the memory of
  // occupied slabs no span uses (0 when no slab is occupied).
  uint64_t fragmentation_ppm = 0;
  uint64_t slabs_created = 0;  // monotonic
  uint64_t slabs_freed = 0;    // monotonic
};

class SlabAllocator {
 public:
  // `backend` must outlive the allocator; `budget` may be null (no ledger). INVALID_ARGUMENT
  // for slab_bytes 0 or an alignment that is not a power of two.
  static absl::StatusOr<std::unique_ptr<SlabAllocator>> Create(const SlabAllocatorOptions& options,
                                                               DeviceBackend* backend,
                                                               DeviceBudget* budget);
  // Slabs from `source` (which must outlive the allocator) instead of a backend.
  static absl::StatusOr<std::unique_ptr<SlabAllocator>> Create(const SlabAllocatorOptions& options,
                                                               SlabSource* source,
                                                               DeviceBudget* budget);
  ~SlabAllocator();  // frees every slab and its charge
  SlabAllocator(const SlabAllocator&) = delete;
  SlabAllocator& operator=(const SlabAllocator&) = delete;

  // The bytes a span of `bytes` takes. INVALID_ARGUMENT for 0 or on overflow.
  absl::StatusOr<uint64_t> RoundedBytes(uint64_t bytes) const;
  uint64_t slab_bytes() const { return slab_bytes_; }

  // A span of RoundedBytes(bytes), held once (a capture in flight: see Hold). Existing free
  // space first; else a new slab, charged to the budget without eviction (RESOURCE_EXHAUSTED
  // from the budget or the backend; nothing changes).
  absl::StatusOr<SlabSpan> Allocate(uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // Returns a span (no hold left on it). INVALID_ARGUMENT for a span this allocator does not
  // hold live (nothing changes). An emptied slab is kept or returned as the class comment says.
  absl::Status Free(const SlabSpan& span) ABSL_LOCKS_EXCLUDED(mu_);
  // Holds keep a slab out of the evictable bytes: a capture's spans until the index adopts
  // them, a pinned entry's spans while a restore reads them. NOT_FOUND for an unknown slab;
  // Release: FAILED_PRECONDITION when the slab has no hold.
  absl::Status Hold(ArenaId slab) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Release(ArenaId slab) ABSL_LOCKS_EXCLUDED(mu_);
  // Returns every empty slab to the backend; returns their bytes.
  uint64_t ReleaseEmptySlabs() ABSL_LOCKS_EXCLUDED(mu_);
  // Bytes of slabs returned to the backend since construction (monotonic).
  uint64_t returned_bytes() const ABSL_LOCKS_EXCLUDED(mu_);

  SlabStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status CheckInvariants() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Slab {
    uint64_t bytes = 0;
    std::optional<AllocationId> charge;
    std::map<uint64_t, uint64_t> free;                // offset -> bytes, coalesced
    absl::flat_hash_map<uint64_t, uint64_t> used;    // offset -> bytes of each live span
    uint64_t used_bytes = 0;
    uint64_t holds = 0;
  };
  // (bytes, slab id, offset): best fit is the first entry not below (bytes, 0, 0).
  using FreeKey = std::tuple<uint64_t, uint64_t, uint64_t>;

  SlabAllocator(const SlabAllocatorOptions& options, uint64_t slab_bytes,
                std::unique_ptr<SlabSource> owned_source, SlabSource* source, DeviceBudget* budget);

  absl::StatusOr<ArenaId> CreateSlab(uint64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DestroySlab(ArenaId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AddFree(ArenaId id, Slab& slab, uint64_t offset, uint64_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RemoveFree(ArenaId id, Slab& slab, std::map<uint64_t, uint64_t>::iterator range)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool KeepEmpty() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PublishEvictable() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Constant after construction.
  const SlabAllocatorOptions options_;
  const uint64_t slab_bytes_;
  const std::unique_ptr<SlabSource> owned_source_;  // a backend's (null: the caller's)
  SlabSource* const source_;
  DeviceBudget* const budget_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<ArenaId, Slab> slabs_ ABSL_GUARDED_BY(mu_);
  std::set<FreeKey> free_by_size_ ABSL_GUARDED_BY(mu_);
  uint64_t total_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t used_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t spans_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t unheld_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // bytes of slabs with no hold
  uint64_t slabs_created_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t slabs_freed_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t returned_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace memra

#endif  // MEMRA_SERVER_SLAB_ALLOCATOR_H_
