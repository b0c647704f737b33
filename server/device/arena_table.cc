#include "server/device/arena_table.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace memra {

absl::StatusOr<int> ArenaRecord::DuplicateFd() const {
  return absl::FailedPreconditionError(
      "this backend's arenas are not file descriptors: engines map them from the export handle "
      "in the owning engine's reply");
}

absl::Status ArenaRecord::CheckRange(absl::string_view op, ArenaId id, uint64_t offset,
                                     uint64_t bytes) const {
  return CheckArenaRange(op, id, bytes_, offset, bytes);
}

SegmentedArenaRecord::SegmentedArenaRecord(uint8_t* data, uint64_t bytes,
                                           std::vector<Segment> segments)
    : ArenaRecord(data, bytes, ""), segments_(std::move(segments)) {}

absl::Status SegmentedArenaRecord::CheckRange(absl::string_view op, ArenaId id, uint64_t offset,
                                              uint64_t bytes) const {
  RETURN_IF_ERROR(ArenaRecord::CheckRange(op, id, offset, bytes));
  // Not overflowing: the range lies inside the arena.
  const uint64_t end = offset + bytes;
  for (const Segment& segment : segments_) {
    if (offset >= segment.offset && end <= segment.offset + segment.bytes) {
      return absl::OkStatus();
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      op, ": offset ", offset, " + ", bytes, " bytes of arena ", id.value,
      " is not inside one of its ", segments_.size(), " engine buffers"));
}

absl::StatusOr<ArenaId> ArenaTable::Create(uint64_t bytes, Allocator allocate) {
  {
    absl::MutexLock lock(&mu_);
    const uint64_t in_use = reserved_bytes_ + live_bytes_;
    if (bytes > capacity_ - in_use) {
      return absl::ResourceExhaustedError(
          absl::StrCat(backend_, ": arena of ", bytes, " bytes does not fit: ", in_use, " of ",
                       capacity_, " bytes in use, ", capacity_ - in_use, " free"));
    }
    reserved_bytes_ += bytes;
  }
  absl::StatusOr<std::shared_ptr<ArenaRecord>> arena = allocate(bytes);
  absl::MutexLock lock(&mu_);
  reserved_bytes_ -= bytes;
  if (!arena.ok()) return arena.status();
  const ArenaId id{next_id_++};
  live_bytes_ += bytes;
  arenas_.emplace(id, *std::move(arena));
  return id;
}

absl::StatusOr<std::shared_ptr<ArenaRecord>> ArenaTable::Find(absl::string_view op,
                                                              ArenaId id) const {
  absl::MutexLock lock(&mu_);
  auto it = arenas_.find(id);
  if (it == arenas_.end()) {
    return absl::NotFoundError(absl::StrCat(backend_, " ", op, ": no arena ", id.value));
  }
  return it->second;
}

absl::StatusOr<std::shared_ptr<ArenaRecord>> ArenaTable::FindRange(absl::string_view op, ArenaId id,
                                                                   uint64_t offset,
                                                                   uint64_t bytes) const {
  ASSIGN_OR_RETURN(std::shared_ptr<ArenaRecord> arena, Find(op, id));
  RETURN_IF_ERROR(arena->CheckRange(op, id, offset, bytes));
  return arena;
}

ArenaId ArenaTable::FileUncharged(std::shared_ptr<ArenaRecord> record) {
  absl::MutexLock lock(&mu_);
  const ArenaId id{next_id_++};
  arenas_.emplace(id, std::move(record));
  uncharged_.insert(id);
  return id;
}

absl::StatusOr<std::shared_ptr<ArenaRecord>> ArenaTable::Remove(ArenaId id) {
  absl::MutexLock lock(&mu_);
  auto it = arenas_.find(id);
  if (it == arenas_.end()) {
    return absl::NotFoundError(absl::StrCat(backend_, " FreeArena: no arena ", id.value));
  }
  std::shared_ptr<ArenaRecord> arena = std::move(it->second);
  arenas_.erase(it);
  if (uncharged_.erase(id) == 0) live_bytes_ -= arena->bytes();
  return arena;  // released by the caller, after the lock: freeing may be slow
}

uint64_t ArenaTable::live_bytes() const {
  absl::MutexLock lock(&mu_);
  return live_bytes_;
}

size_t ArenaTable::size() const {
  absl::MutexLock lock(&mu_);
  return arenas_.size() - uncharged_.size();
}

}  // namespace memra
