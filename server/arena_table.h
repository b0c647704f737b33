#ifndef MEMRA_SERVER_ARENA_TABLE_H_
#define MEMRA_SERVER_ARENA_TABLE_H_

// The bookkeeping every DeviceBackend shares: id issue, lookup with bounds checks, capacity
// reservations and the byte accounting of DeviceBackend invariant (3).

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/status_macros.h"
#include "server/backend.h"

namespace memra {

// Thread-safe. `Arena` is a backend's record of one allocation; it must provide
// `uint64_t bytes() const` and release its memory in its destructor.
//
// Records are held by shared_ptr so a data operation can use an arena's memory outside the table
// lock; a concurrent Remove() only drops the table's reference, and the memory goes with the last.
//
// Invariants: (1) reserved_bytes_ + live_bytes_ <= capacity_; (2) live_bytes_ is the sum of
// bytes() over arenas_; (3) ids are issued once, from 1 upwards.
template <typename Arena>
class ArenaTable {
 public:
  // `backend` prefixes refusal messages; `capacity` bounds reserved + live bytes.
  ArenaTable(std::string backend, uint64_t capacity)
      : backend_(std::move(backend)), capacity_(capacity) {}

  ArenaTable(const ArenaTable&) = delete;
  ArenaTable& operator=(const ArenaTable&) = delete;

  // Charges `bytes` against the capacity, then runs `allocate(bytes)` (outside the lock; it
  // returns absl::StatusOr<std::shared_ptr<Arena>> with bytes() == bytes) and files the result.
  // Charging first means concurrent creations cannot overshoot the capacity. RESOURCE_EXHAUSTED
  // with the numbers when `bytes` does not fit; a failed allocation returns its charge.
  template <typename Allocate>
  absl::StatusOr<ArenaId> Create(uint64_t bytes, Allocate allocate) ABSL_LOCKS_EXCLUDED(mu_) {
    RETURN_IF_ERROR(Reserve(bytes));
    absl::StatusOr<std::shared_ptr<Arena>> arena = allocate(bytes);
    absl::MutexLock lock(&mu_);
    reserved_bytes_ -= bytes;
    if (!arena.ok()) return arena.status();
    const ArenaId id{next_id_++};
    live_bytes_ += bytes;
    arenas_.emplace(id, *std::move(arena));
    return id;
  }

  // NOT_FOUND naming `op` and the id when the arena is unknown (or already freed).
  absl::StatusOr<std::shared_ptr<Arena>> Find(absl::string_view op, ArenaId id) const
      ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    auto it = arenas_.find(id);
    if (it == arenas_.end()) {
      return absl::NotFoundError(absl::StrCat(backend_, " ", op, ": no arena ", id.value));
    }
    return it->second;
  }

  // Find() plus CheckArenaRange(): the arena exists and [offset, offset + bytes) lies inside it.
  absl::StatusOr<std::shared_ptr<Arena>> FindRange(absl::string_view op, ArenaId id,
                                                   uint64_t offset, uint64_t bytes) const {
    ASSIGN_OR_RETURN(std::shared_ptr<Arena> arena, Find(op, id));
    RETURN_IF_ERROR(CheckArenaRange(op, id, arena->bytes(), offset, bytes));
    return arena;
  }

  // Removes the arena and its charge; its memory is released with the returned reference.
  absl::StatusOr<std::shared_ptr<Arena>> Remove(ArenaId id) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    auto it = arenas_.find(id);
    if (it == arenas_.end()) {
      return absl::NotFoundError(absl::StrCat(backend_, " FreeArena: no arena ", id.value));
    }
    std::shared_ptr<Arena> arena = std::move(it->second);
    arenas_.erase(it);
    live_bytes_ -= arena->bytes();
    return arena;
  }

  uint64_t live_bytes() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return live_bytes_;
  }

  size_t size() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return arenas_.size();
  }

 private:
  absl::Status Reserve(uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    const uint64_t in_use = reserved_bytes_ + live_bytes_;
    if (bytes > capacity_ - in_use) {
      return absl::ResourceExhaustedError(
          absl::StrCat(backend_, ": arena of ", bytes, " bytes does not fit: ", in_use, " of ",
                       capacity_, " bytes in use, ", capacity_ - in_use, " free"));
    }
    reserved_bytes_ += bytes;
    return absl::OkStatus();
  }

  // Constant after construction.
  const std::string backend_;
  const uint64_t capacity_;

  mutable absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t reserved_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // being allocated, not yet inserted
  uint64_t live_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<ArenaId, std::shared_ptr<Arena>> arenas_ ABSL_GUARDED_BY(mu_);
};

}  // namespace memra

#endif  // MEMRA_SERVER_ARENA_TABLE_H_
