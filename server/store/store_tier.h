#ifndef MEMRA_SERVER_STORE_STORE_TIER_H_
#define MEMRA_SERVER_STORE_STORE_TIER_H_

// The prefix store's local tiers behind one interface, one implementation per medium (as
// RocksDB's SecondaryCache): the device's slabs, the host tier's slabs, the disk tier's files.
// A tier knows where a piece's bytes lie in it, how to read them, how to give a piece a new
// home there (insert), how to free one (erase) and what its budget counts. Which piece goes
// where and when (demotion, promotion, eviction for room) is the store's decision
// (PrefixCache's tier chain), taken under its lock; the tiers only move bytes, without it.
//
// Thread-safety: thread-safe (the allocators and the disk tier below are).

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/prefix_index.h"
#include "server/device/backend.h"
#include "server/store/disk_tier.h"
#include "server/store/host_tier_memory.h"
#include "server/store/slab_allocator.h"

namespace memra {

// Where a stored piece's bytes are, and the checksums they were sealed with.
struct PieceStorage {
  StorageMedium medium = StorageMedium::kDevice;
  // kDevice: a span of the device's slabs; kPinnedHost: of the host tier's; kDisk: only `bytes`
  // (the rounded size the index counts; the file holds piece_bytes).
  SlabSpan span;
  uint64_t piece_bytes = 0;  // the piece's own bytes (a disk file's size)
  uint64_t checksum = 0;     // the StoredRef's (verified when a slower tier's copy is read back)
  // One xxHash3 per checksum slice of a piece of several slices (`checksum` is then the
  // xxHash3 of these); empty for a piece of one slice.
  std::vector<uint64_t> slice_checksums;
};

// A piece's bytes as one tier hands them to another: a view where they are in host memory
// (no copy), and a reader that copies them into memory the receiver gives.
struct PieceSource {
  std::optional<absl::Span<const uint8_t>> view;
  absl::FunctionRef<absl::Status(absl::Span<uint8_t> out)> read_into;
};

class StoreTier {
 public:
  virtual ~StoreTier() = default;

  virtual StorageMedium medium() const = 0;
  // The bytes of pieces it may hold, in the unit IncomingBytes counts.
  virtual uint64_t budget_bytes() const = 0;
  // What a piece stored as `source` adds to this tier's budget when it moves in: a disk file
  // its own bytes, a span in a memory tier its rounded bytes.
  virtual uint64_t IncomingBytes(const PieceStorage& source) const = 0;

  // The piece's bytes in place, where this tier keeps them in host memory (nullopt: ReadInto).
  virtual absl::StatusOr<std::optional<absl::Span<const uint8_t>>> View(
      uint64_t handle, const PieceStorage& at) const = 0;
  // Copies the piece into `out` (exactly piece_bytes long).
  virtual absl::Status ReadInto(uint64_t handle, const PieceStorage& at,
                                absl::Span<uint8_t> out) const = 0;
  // The piece's bytes: View's, else read into `buffer`.
  absl::StatusOr<absl::Span<const uint8_t>> Read(uint64_t handle, const PieceStorage& at,
                                                 std::vector<uint8_t>& buffer) const;

  // A new home here for the piece `source` describes (its piece_bytes and checksums are kept),
  // filled from `bytes`. A device span comes back held once (SlabAllocator::Allocate's hold):
  // the caller releases it once the piece is recorded. Nothing stays allocated on failure.
  virtual absl::StatusOr<PieceStorage> Insert(uint64_t handle, const PieceStorage& source,
                                              const PieceSource& bytes) = 0;
  // Frees the piece's home here (errors are logged: the piece is gone from the ledger either way).
  virtual void Erase(uint64_t handle, const PieceStorage& at) = 0;
  // Where the piece is, for messages ("disk file /x/y", "host-tier piece (...)").
  virtual std::string Describe(uint64_t handle, const PieceStorage& at) const = 0;
};

// The device tier: spans of `slabs` (device arenas of `backend`). Erase goes through `free_span`,
// the store's free (which may defer it while a queued remote write still reads the span).
std::unique_ptr<StoreTier> DeviceStoreTier(DeviceBackend* backend, SlabAllocator* slabs,
                                           uint64_t budget_bytes,
                                           std::function<void(const SlabSpan&)> free_span);
// The host tier: spans of `slabs`, whose slabs are `memory`'s.
std::unique_ptr<StoreTier> HostStoreTier(SlabAllocator* slabs, HostTierMemory* memory,
                                         uint64_t budget_bytes);
// The disk tier: one file per piece.
std::unique_ptr<StoreTier> DiskStoreTier(DiskTier* disk);

// The local tiers, fastest first: the device, then the host tier and the disk tier where the
// store has them. Not thread-safe to build; constant after.
class TierChain {
 public:
  void Add(std::unique_ptr<StoreTier> tier);
  // The tier of `medium`, or null when the store has none (kRemote: never a local tier).
  StoreTier* tier(StorageMedium medium) const;
  // The tier pieces of `medium` are demoted to (nullopt: the last tier, which evicts instead).
  std::optional<StorageMedium> Below(StorageMedium medium) const;
  // The budget of `medium`'s tier (0: none; the remote tier's is the cluster's, not ours).
  uint64_t Budget(StorageMedium medium) const;

 private:
  std::vector<std::unique_ptr<StoreTier>> tiers_;  // fastest first
};

}  // namespace memra

#endif  // MEMRA_SERVER_STORE_STORE_TIER_H_
