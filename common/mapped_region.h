#ifndef MEMRA_COMMON_MAPPED_REGION_H_
#define MEMRA_COMMON_MAPPED_REGION_H_

// Owners of the two POSIX resources an arena mapping needs (shared by the host backend and the
// client's host mapper): a file descriptor and an mmap'd range.

#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"

namespace memra {

// Closes the descriptor on destruction. Move-only.
class ScopedFd {
 public:
  explicit ScopedFd(int fd = -1) : fd_(fd) {}
  ScopedFd(ScopedFd&& other) noexcept : fd_(other.release()) {}
  ScopedFd& operator=(ScopedFd&& other) noexcept;
  ~ScopedFd();

  int get() const { return fd_; }
  int release();

 private:
  int fd_;
};

// A descriptor of an arena's memory and the arena's bytes, as the daemon hands it to an engine
// over the handoff socket (common/handoff_wire.h).
struct ArenaFd {
  ScopedFd fd;
  uint64_t bytes = 0;
};

// A memfd of `bytes` (allocated now: posix_fallocate, so a short tmpfs fails here, not with
// SIGBUS at first touch) sealed at its size (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL): whoever
// is handed the descriptor can neither shrink it under another process's mapping nor grow it.
// No name in any file system reaches it. `name` shows in /proc/<pid>/fd only.
absl::StatusOr<ScopedFd> CreateSealedMemfd(const char* name, uint64_t bytes);

// Whether the page tables are filled, writable, when the region is mapped (MADV_POPULATE_WRITE):
// one kernel pass at map time instead of a page fault per page on first write, which on a VM
// costs more than copying the page itself. For memory written in full right away.
enum class Prefault { kNo, kYes };

// An mmap'd read-write range, unmapped on destruction. Move-only; empty after a move.
class MappedRegion {
 public:
  // MAP_SHARED mapping of the first `bytes` of `fd`. REQUIRES: the object holds >= `bytes`
  // (touching a page past its end raises SIGBUS). `what` names the object in errors.
  static absl::StatusOr<MappedRegion> MapShared(int fd, uint64_t bytes, absl::string_view what);
  // Zero-filled private anonymous memory.
  static absl::StatusOr<MappedRegion> MapAnonymous(uint64_t bytes,
                                                   Prefault prefault = Prefault::kNo);

  MappedRegion(MappedRegion&& other) noexcept;
  MappedRegion& operator=(MappedRegion&& other) noexcept;
  ~MappedRegion();

  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  MappedRegion(uint8_t* data, uint64_t size) : data_(data), size_(size) {}
  void Reset();

  uint8_t* data_;
  uint64_t size_;
};

}  // namespace memra

#endif  // MEMRA_COMMON_MAPPED_REGION_H_
