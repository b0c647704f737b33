#ifndef MEMRA_SERVER_DISK_TIER_H_
#define MEMRA_SERVER_DISK_TIER_H_

// The prefix cache's disk tier: one file per stored piece under a directory the daemon owns,
// written and read through io_uring (Debian's liburing) with at most queue_depth requests in
// flight. Files are created 0600 with O_EXCL, removed when the piece leaves the tier, and every
// "*.piece" file found at start is removed: the tier is a cache of this process's memory and
// does not survive a restart (nothing is fsynced; the index that names the files is in memory).
// This class moves and accounts bytes only; checksums are the prefix cache's (it verifies what
// Read returns against the checksums it took at capture).
//
// Thread-safety: thread-safe. One ring, used by one transfer at a time (ring_mu_); the ledger
// (mu_) is never held across I/O. Lock order: ring_mu_ -> mu_.

#include <cstdint>
#include <memory>
#include <string>

#include <liburing.h>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"

namespace memra {

struct DiskTierOptions {
  std::string dir;            // absolute; created 0700 when missing (its parent must exist)
  uint64_t budget_bytes = 0;  // > 0; bytes of files held at once
  uint32_t queue_depth = 8;   // io_uring requests in flight per transfer, 1..256
  uint64_t request_bytes = uint64_t{1} << 20;  // bytes per request, > 0
};

// Gauges (files, stored_bytes) and monotonic counters.
struct DiskTierStats {
  uint64_t files = 0;
  uint64_t stored_bytes = 0;
  uint64_t budget_bytes = 0;
  uint64_t writes = 0;
  uint64_t reads = 0;
  uint64_t removed_at_start = 0;
};

class DiskTier {
 public:
  // INVALID_ARGUMENT: a relative or empty dir, a zero budget, queue depth or request size;
  // FAILED_PRECONDITION: dir is not a directory (or is a symlink), is owned by another user or
  // is writable by group or others; RESOURCE_EXHAUSTED: the filesystem has fewer bytes free
  // than the budget; the errno's code when dir cannot be created or read, or io_uring cannot
  // be set up.
  static absl::StatusOr<std::unique_ptr<DiskTier>> Create(const DiskTierOptions& options);
  ~DiskTier();  // removes every file it holds
  DiskTier(const DiskTier&) = delete;
  DiskTier& operator=(const DiskTier&) = delete;

  uint64_t budget_bytes() const { return options_.budget_bytes; }
  // Bytes the tier holds now (what Write checks against the budget).
  uint64_t stored_bytes() const ABSL_LOCKS_EXCLUDED(mu_);

  // Stores `bytes` as the file of `handle`. ALREADY_EXISTS: the handle has a file;
  // RESOURCE_EXHAUSTED: over the budget (stored + size > budget, numbers named) or the
  // filesystem is full (ENOSPC); nothing is kept on any failure.
  absl::Status Write(uint64_t handle, absl::Span<const uint8_t> bytes)
      ABSL_LOCKS_EXCLUDED(ring_mu_, mu_);
  // Reads the file of `handle` into `out` (its size must be the file's). NOT_FOUND: no file;
  // DATA_LOSS: the file on disk holds another number of bytes than was written.
  absl::Status Read(uint64_t handle, absl::Span<uint8_t> out) ABSL_LOCKS_EXCLUDED(ring_mu_, mu_);
  // Removes the file of `handle`; NOT_FOUND when it has none.
  absl::Status Remove(uint64_t handle) ABSL_LOCKS_EXCLUDED(mu_);
  // Where `handle`'s file is (tests corrupt it).
  std::string PathOf(uint64_t handle) const;

  DiskTierStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  DiskTier(const DiskTierOptions& options, uint64_t removed_at_start);
  // Moves `bytes` between `data` and `fd` from offset 0, queue_depth requests in flight,
  // resubmitting the rest of a short transfer; returns once nothing is in flight.
  absl::Status Transfer(int fd, bool write, uint8_t* data, uint64_t bytes,
                        const std::string& path) ABSL_EXCLUSIVE_LOCKS_REQUIRED(ring_mu_);

  const DiskTierOptions options_;
  const uint64_t removed_at_start_;

  absl::Mutex ring_mu_;
  io_uring ring_ ABSL_GUARDED_BY(ring_mu_);
  bool ring_ready_ = false;  // set once in Create

  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, uint64_t> files_ ABSL_GUARDED_BY(mu_);  // handle -> bytes
  uint64_t stored_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t writes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t reads_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace memra

#endif  // MEMRA_SERVER_DISK_TIER_H_
