#ifndef MEMRA_SERVER_ARENA_TABLE_H_
#define MEMRA_SERVER_ARENA_TABLE_H_

// The bookkeeping every DeviceBackend shares: id issue, lookup with bounds checks, capacity
// reservations and the byte accounting of DeviceBackend invariant (3).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/device/backend.h"

namespace memra {

// One allocation of some backend. Immutable; a backend's subclass owns the memory and releases
// it in its destructor.
class ArenaRecord {
 public:
  // `data`: the arena's base address in the daemon (a device pointer for cuda).
  // `export_handle`: what Export() hands out; empty for a private arena.
  ArenaRecord(uint8_t* data, uint64_t bytes, std::string export_handle)
      : data_(data), bytes_(bytes), export_handle_(std::move(export_handle)) {}
  ArenaRecord(const ArenaRecord&) = delete;
  ArenaRecord& operator=(const ArenaRecord&) = delete;
  virtual ~ArenaRecord() = default;

  uint8_t* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }
  const std::string& export_handle() const { return export_handle_; }
  bool exported() const { return !export_handle_.empty(); }
  // A new O_CLOEXEC descriptor of the memory, owned by the caller (DeviceBackend::
  // DuplicateArenaFd). FAILED_PRECONDITION unless the backend's exports are descriptors.
  virtual absl::StatusOr<int> DuplicateFd() const;
  // OK when [offset, offset + bytes) is memory of this arena (every data operation checks its
  // ranges here first): CheckArenaRange against bytes(); SegmentedArenaRecord narrows it.
  virtual absl::Status CheckRange(absl::string_view op, ArenaId id, uint64_t offset,
                                  uint64_t bytes) const;
  // Called once when FreeArena forgets the arena (never when a backend is destroyed with arenas
  // left, nor for one a crashed daemon left in the fd store): memory an engine may still reach
  // through its own mapping stops being the daemon's (host: the memfd's pages are punched out;
  // docs/security-model.md#resources). Default: nothing.
  virtual absl::Status Retire() { return absl::OkStatus(); }

 private:
  uint8_t* const data_;
  const uint64_t bytes_;
  const std::string export_handle_;
};

// An arena whose memory is several separate regions at fixed addresses (a cuda engine's pool:
// each CUDA IPC allocation opens wherever the driver maps it). data() is the lowest region's
// start and an offset is an address difference from it, so data() + offset is the address as for
// any arena; but only the segments are memory: a range in a gap between them, or across two, is
// INVALID_ARGUMENT, never another allocation's bytes.
class SegmentedArenaRecord : public ArenaRecord {
 public:
  struct Segment {
    uint64_t offset = 0;  // from data()
    uint64_t bytes = 0;
  };
  // `segments`: inside [0, bytes), in any order; overlapping ones are allowed (two buffers of
  // one allocation).
  SegmentedArenaRecord(uint8_t* data, uint64_t bytes, std::vector<Segment> segments);
  absl::Status CheckRange(absl::string_view op, ArenaId id, uint64_t offset,
                          uint64_t bytes) const override;

 private:
  const std::vector<Segment> segments_;
};

// Thread-safe. Records are held by shared_ptr so a data operation can use an arena's memory
// outside the table lock; a concurrent Remove() only drops the table's reference, and the memory
// goes with the last one.
//
// Invariants: (1) reserved_bytes_ + live_bytes_ <= capacity_; (2) live_bytes_ is the sum of
// bytes() over arenas_; (3) ids are issued once, from 1 upwards.
class ArenaTable {
 public:
  using Allocator = absl::FunctionRef<absl::StatusOr<std::shared_ptr<ArenaRecord>>(uint64_t)>;

  // `backend` prefixes messages; `capacity` bounds reserved + live bytes.
  ArenaTable(std::string backend, uint64_t capacity)
      : backend_(std::move(backend)), capacity_(capacity) {}
  ArenaTable(const ArenaTable&) = delete;
  ArenaTable& operator=(const ArenaTable&) = delete;

  // Charges `bytes` against the capacity, runs `allocate(bytes)` outside the lock (it returns a
  // record of exactly `bytes`) and files the result. Charging first means concurrent creations
  // cannot overshoot. RESOURCE_EXHAUSTED with the numbers when `bytes` does not fit; a failed
  // allocation returns its charge.
  absl::StatusOr<ArenaId> Create(uint64_t bytes, Allocator allocate) ABSL_LOCKS_EXCLUDED(mu_);

  // NOT_FOUND naming `op` and the id when the arena is unknown (or already freed).
  absl::StatusOr<std::shared_ptr<ArenaRecord>> Find(absl::string_view op, ArenaId id) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Find() plus CheckArenaRange(): the arena exists and [offset, offset + bytes) lies inside it.
  absl::StatusOr<std::shared_ptr<ArenaRecord>> FindRange(absl::string_view op, ArenaId id,
                                                         uint64_t offset, uint64_t bytes) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Files memory the daemon does not own (an engine's pool, mapped for the block store): no
  // charge against the capacity, not in live_bytes() or size().
  ArenaId FileUncharged(std::shared_ptr<ArenaRecord> record) ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets the arena and its charge and returns its record (the caller retires it); its memory
  // is released with the last reference.
  absl::StatusOr<std::shared_ptr<ArenaRecord>> Remove(ArenaId id) ABSL_LOCKS_EXCLUDED(mu_);

  uint64_t live_bytes() const ABSL_LOCKS_EXCLUDED(mu_);
  size_t size() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // Constant after construction.
  const std::string backend_;
  const uint64_t capacity_;

  mutable absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t reserved_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // being allocated, not yet filed
  uint64_t live_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<ArenaId, std::shared_ptr<ArenaRecord>> arenas_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<ArenaId> uncharged_ ABSL_GUARDED_BY(mu_);  // FileUncharged's, in arenas_
};

}  // namespace memra

#endif  // MEMRA_SERVER_ARENA_TABLE_H_
