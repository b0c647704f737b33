#ifndef MEMRA_SERVER_STORE_SLICE_COPIER_H_
#define MEMRA_SERVER_STORE_SLICE_COPIER_H_

// The store's copy engine: moves stored pieces between an arena (a session's, an engine pool's)
// and their slab spans, checksumming each slice of a piece (xxHash3-64, StreamingChecksum's) in
// the same pass as the copy, so every byte is read from memory once. A large copy is split over
// several threads (hashing and copying on one core runs at a third to a half of memcpy,
// bench/README.md): every slice of every piece is an independent job.
//
// Thread-safety: thread-safe (constant after construction; DeviceBackend is thread-safe). Copy
// takes no lock of its caller's: callers copy without their own mutex held.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/prefix_index.h"
#include "server/device/backend.h"
#include "server/store/slab_allocator.h"

namespace memra {

struct SliceCopierOptions {
  // A copy of at least `parallel_copy_bytes` splits its slices over up to `copy_threads`
  // threads (the calling one included). Both >= 1.
  uint32_t copy_threads = 4;
  uint64_t parallel_copy_bytes = uint64_t{64} << 20;
  // A stored piece is checksummed (and so copied) in slices of this many bytes; > 0.
  uint64_t slice_bytes = uint64_t{8} << 20;
};

// One stored piece a copy moves: `ranges` in piece order, the stored side at offsets from 0
// (the copier moves them into `span`).
struct PieceCopy {
  std::vector<CopyRange> ranges;
  uint64_t bytes = 0;  // sum of the ranges' bytes
  SlabSpan span;       // where the piece is stored
  // Restore: what the capture sealed: the piece's checksum and, for a piece of several slices,
  // one per slice (empty for a piece of one slice).
  uint64_t checksum = 0;
  std::vector<uint64_t> slice_checksums;
  EntryId entry;  // pool loads: the piece's own entry (messages)
};

// Which way the bytes go: into storage (a capture, sealing) or out of it (a restore, verifying).
enum class CopyDirection { kToStorage, kFromStorage };

// How many `slice_bytes` slices a piece of `bytes` is sealed in (one for an empty piece).
uint64_t SliceCount(uint64_t bytes, uint64_t slice_bytes);

class SliceCopier {
 public:
  // `backend` must outlive the copier; options as SliceCopierOptions says (the caller validates).
  SliceCopier(DeviceBackend* backend, const SliceCopierOptions& options)
      : backend_(backend), options_(options) {}

  uint64_t slice_bytes() const { return options_.slice_bytes; }

  // Copies every slice of every piece between `arena` and the pieces' spans, checksumming each
  // slice as it goes unless `checksum` is false. Returns each piece's slice checksums (all 0
  // unchecksummed). kToStorage fills nothing else; kFromStorage compares each slice with the
  // piece's sealed checksums (DATA_LOSS for the first mismatch in job order, naming the piece's
  // entry or else `entry`, and a piece whose slice checksum count does not fit its size, before
  // anything is copied). A worker stops at its first failure; with `piece_failures`, each
  // piece's first failure goes there instead and the other pieces are still copied (the block
  // store's per-block results).
  absl::StatusOr<std::vector<std::vector<uint64_t>>> Copy(
      CopyDirection direction, ArenaId arena, const std::vector<PieceCopy>& pieces,
      bool checksum, EntryId entry, std::vector<absl::Status>* piece_failures = nullptr) const;

 private:
  DeviceBackend* const backend_;
  const SliceCopierOptions options_;
};

}  // namespace memra

#endif  // MEMRA_SERVER_STORE_SLICE_COPIER_H_
