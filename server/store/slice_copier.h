#ifndef MEMRA_SERVER_STORE_SLICE_COPIER_H_
#define MEMRA_SERVER_STORE_SLICE_COPIER_H_

// The store's copy engine: moves stored pieces between an arena (a session's, an engine pool's)
// and their slab spans, checksumming each slice of a piece (xxHash3-64, StreamingChecksum's) in
// the same pass as the copy, so every byte is read from memory once. A copy is split over as
// many threads as its size pays for (hashing and copying on one core runs at a third to a half
// of memcpy, bench/README.md): every slice of every piece is an independent job.
//
// Helper threads are kept (started at the first copy that wants them, joined at destruction),
// so a copy wakes sleeping helpers instead of creating threads; a copy too small to pay for a
// helper runs on the calling thread alone and wakes none.
//
// Thread-safety: thread-safe (options constant after construction; DeviceBackend is
// thread-safe; the helper pool guarded by pool_mu_). Copy takes no lock of its caller's:
// callers copy without their own mutex held. Concurrent copies share the helpers; each caller
// works on its own copy too, so a copy never waits for a helper to become free.

#include <cstdint>
#include <deque>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
#include "core/prefix_index.h"
#include "server/device/backend.h"
#include "server/store/slab_allocator.h"

namespace memra {

struct SliceCopierOptions {
  // A copy of B bytes runs on min(copy_threads, B / parallel_copy_bytes, its job count, the
  // CPUs) threads, at least 1 (the calling one included): every `parallel_copy_bytes` of it pays
  // for one more thread. Both >= 1. The default is measured (bench/README.md, "Small entries"):
  // a pooled hand-off costs 12 us on an idle core, but on a loaded machine a woken helper that
  // takes a slice and is then preempted holds the copy up for milliseconds, so a helper must
  // have at least ~3 ms of hashing and copying to share (a 1k-token, 15 MB entry has 1.6 ms).
  uint32_t copy_threads = 4;
  uint64_t parallel_copy_bytes = uint64_t{32} << 20;
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
  ~SliceCopier();  // stops and joins the helpers (no copy may be running)
  SliceCopier(const SliceCopier&) = delete;
  SliceCopier& operator=(const SliceCopier&) = delete;

  uint64_t slice_bytes() const { return options_.slice_bytes; }

  // How many threads (the caller's included) a copy of `bytes` in `jobs` slices runs on.
  uint64_t ThreadsFor(uint64_t bytes, uint64_t jobs) const;

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
  // One copy's work as helpers see it: `run(slot)` takes jobs until none is left. Lives on the
  // calling thread's stack; the caller takes it off pending_ and waits for active == 0 before
  // returning, so no helper touches it afterwards.
  struct SharedWork {
    absl::FunctionRef<void(uint64_t slot)> run;
    uint64_t wanted = 0;  // helpers still to join (slots 1..wanted)
    uint64_t joined = 0;
    uint64_t active = 0;  // helpers inside run()
  };

  // Runs `run(0)` here and `run(1..helpers)` on up to `helpers` pool threads (fewer when not
  // all join before the caller's own run ends: the jobs are shared, so none is left undone).
  void RunShared(uint64_t helpers, absl::FunctionRef<void(uint64_t slot)> run) const
      ABSL_LOCKS_EXCLUDED(pool_mu_);
  void HelperLoop() const ABSL_LOCKS_EXCLUDED(pool_mu_);

  // Constant after construction.
  DeviceBackend* const backend_;
  const SliceCopierOptions options_;

  // The helper pool (copy_threads - 1 threads at most, started on demand).
  mutable absl::Mutex pool_mu_;
  mutable std::vector<std::thread> helpers_ ABSL_GUARDED_BY(pool_mu_);
  mutable std::deque<SharedWork*> pending_ ABSL_GUARDED_BY(pool_mu_);
  mutable bool stopping_ ABSL_GUARDED_BY(pool_mu_) = false;
};

}  // namespace memra

#endif  // MEMRA_SERVER_STORE_SLICE_COPIER_H_
