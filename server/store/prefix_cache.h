#ifndef MEMRA_SERVER_PREFIX_CACHE_H_
#define MEMRA_SERVER_PREFIX_CACHE_H_

// The daemon's prefix cache: core's PrefixIndex (every bookkeeping rule: keys, sharing, LRU,
// pins, events) plus the bytes. Each stored block and boundary state is a span of a slab
// (server/store/slab_allocator.h: daemon-private arenas, ArenaVisibility::kPrivate, never exported,
// each charged to the device budget as kPrefixCacheOwner) and carries xxHash3-64 checksums of its
// bytes taken at capture: one for a piece of one slice, else one per checksum_slice_bytes slice
// (so one large piece, such as a hybrid model's recurrent state, is copied and verified by
// several threads) and, as the index's checksum, the xxHash3 of those slice checksums.
//
// Budgets: the device tier's budget (prefix_cache_budget_bytes) bounds the bytes of the spans it
// holds (rounded to the slab alignment); the device budget is charged per slab, whole, so
// admission counts what the device holds, slab free space included (reported as fragmentation).
//
// Tiers, fastest first (StorageMedium; server/store/store_tier.h: one StoreTier per medium, in a
// TierChain; this class decides what moves where and when): the device's slabs; the host tier (host_tier_bytes:
// spans of host_slabs_, a SlabAllocator over HostTierMemory, whose memory a HostMemoryProvider
// gives: pinned memory on cuda, plain memory in tests and on request on the host backend, where
// the device tier already is host memory and the tier is off by default); the disk tier
// (server/store/disk_tier.h: disk_dir, disk_bytes). Each stored piece lives in exactly one of them.
// After a capture or restore, and when an admission needs device memory, the least recently
// used pieces no pinned entry uses are demoted one tier down until each tier is within its own
// budget: the tier below makes room first (the host tier demotes to disk, a full disk tier
// evicts LRU entries with pieces there) and the last tier evicts LRU entries (the index's
// budget is the tiers' sum); room in a tier is made only by evicting entries whose eviction
// frees a piece there (EvictForRoomIn). A restore first promotes the entry's host and disk
// pieces back into slabs, verifying each against the checksums taken at capture (DATA_LOSS
// drops the entry as any corruption does). Only slabs are charged to the device budget.
//
// Remote tier (server/store/remote/remote_tier.h, docs/remote-tier.md; optional): a Redis Cluster
// other daemons share. Write-behind: a capture queues a reference to each new piece under its
// chained block key and scope; the tier's writer thread reads it from its device span, held until
// then (its free deferred: RemoteWritesOf); a full queue or a down tier drops the write, never the
// capture. Read-through: a Lookup that matches short locally asks the cluster which of the next
// keys exist (within remote_lookup_timeout; medium kRemote when it reaches further), and a Restore
// by tokens first pulls the pieces the cluster holds beyond the local match (within
// remote_fetch_timeout), verifies each value (header, shape, checksum: a corrupt one is refused and
// deleted, a mismatched one skipped) and stores them as a local entry (DEVICE, a kStored event)
// before the normal restore. Any remote failure leaves the local answer.
//
// What is stored, per block and per boundary: server/store/stored_layout.h. Restore replays the
// same layout into a fresh session: core decides (SessionState::Hydrate sets lengths, ring bases
// and latent pools; ValidateLatentRestore / PlanLatentRestore place the indexer state), this
// class only moves bytes.
//
// Holds: every reason a stored piece may not be freed or moved now is a scoped hold in ledger_
// (server/store/piece_ledger.h: restore, capture, demotion, promotion, remote write), which
// alone answers "may this piece go now?"; the index keeps its own entry pins (its eviction rule).
//
// Thread-safety: thread-safe. Lock order: a session's own mutex (held by whoever calls
// CaptureState, CaptureCommittedState or RestoreInto) -> mu_ ->
// PieceLedger's mutex -> SlabAllocator's mutex -> DeviceBudget's mutex. mu_ is never held while a
// session mutex is taken, nor across any copy: a capture or restore (PlanCapture / Pin under mu_;
// spans allocated and copied without it; CommitCapture / Unpin under mu_ again), a promotion
// (PromotePinned) or a demotion (planned under mu_, its pieces held in moving_; copied down
// without mu_; committed under mu_, where a piece pinned meanwhile stays put and one the index
// let go of meanwhile is freed in both tiers). Demotions run after a capture or restore has
// left the session's mutex, and in EvictForAdmission, the DeviceBudget evictor (the budget
// calls it without its own lock).
//
// Invariants: (1) storage_ holds exactly the handles the index references (a capture in flight
// holds its spans itself until CommitCapture); (2) tier_stored_bytes_[m] is the sum of the
// rounded sizes of storage_'s pieces in tier m, and index_.StoredBytes() their sum over the
// tiers; the device pieces are live spans of slabs_ (so slabs_'s used bytes equal the device
// tier's when no capture, promotion or demotion is in flight), the disk pieces files of disk_;
// tier_leaving_bytes_[m] is the bytes of moving_'s unreleased pieces from tier m; (3) the slabs
// of a restoring entry's spans, of a capture in flight, of a piece being demoted and of a piece
// a queued remote write will read are held by ledger_ holds (the only SlabAllocator holds on
// slabs_), so the budget's evictable bytes (the slabs no hold keeps) are exactly what evicting
// every unpinned entry returns; (4) slabs_'s used bytes beyond the device tier's (2) are the
// spans ledger_ deferred the free of (PieceLedger::FreeSpan).

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/prefix_index.h"
#include "core/session.h"
#include "core/sizing.h"
#include "server/base/ids.h"
#include "server/device/backend.h"
#include "server/device/device_budget.h"
#include "server/store/disk_tier.h"
#include "server/store/host_tier_memory.h"
#include "server/device/placement.h"
#include "server/store/piece_ledger.h"
#include "server/store/remote/remote_tier.h"
#include "server/store/slab_allocator.h"
#include "server/store/slice_copier.h"
#include "server/store/store_tier.h"
#include "server/store/stored_layout.h"
#include "server/base/streaming_checksum.h"

namespace memra {

struct PrefixCacheOptions {
  uint64_t budget_bytes = 0;     // > 0 (0 means the daemon has no prefix cache at all)
  uint32_t block_tokens = 256;   // > 0
  bool verify_checksums = true;  // xxHash3 check of each stored piece as a restore copies it
  // A capture or restore (and a pool load or store) runs on one more copy thread for every
  // `parallel_copy_bytes` it moves, up to `copy_threads` (the calling one included; hashing and
  // copying on one core runs at a third to a half of memcpy): SliceCopierOptions. Both >= 1.
  uint32_t copy_threads = SliceCopierOptions{}.copy_threads;
  uint64_t parallel_copy_bytes = SliceCopierOptions{}.parallel_copy_bytes;
  // A stored piece is checksummed (and so copied) in slices of this many bytes; > 0.
  uint64_t checksum_slice_bytes = uint64_t{8} << 20;
  // A demotion batch commits a chunk of pieces at a time, each chunk once about this many
  // bytes (at least one piece) have been copied down: a restore that needs a moving piece
  // waits for its chunk, not for the whole batch. > 0.
  uint64_t demotion_chunk_bytes = uint64_t{8} << 20;
  // Storage slabs (SlabAllocatorOptions::slab_bytes); capped at the budget. > 0.
  uint64_t slab_bytes = uint64_t{128} << 20;
  uint64_t epoch = 0;            // this daemon's epoch, on entries and events
  uint64_t event_capacity = 4096;
  // The host tier, between the device and the disk (StorageMedium::kPinnedHost): none when 0;
  // else the bytes of host memory it may hold (spans rounded as the device tier's), its memory
  // from the HostMemoryProvider Create is given. Not charged to the device budget.
  uint64_t host_tier_bytes = 0;
  // The disk tier (DiskTierOptions): none when disk_dir is empty; else disk_bytes > 0.
  std::string disk_dir;
  uint64_t disk_bytes = 0;
  uint32_t disk_queue_depth = 8;
  // The remote tier: none when absent. A cluster down at start-up is not an error (the tier
  // starts down and reconnects); options that cannot work are (RemoteTier::Create).
  std::optional<RemoteTierOptions> remote;
  absl::Duration remote_lookup_timeout = absl::Milliseconds(20);  // > 0
  absl::Duration remote_fetch_timeout = absl::Seconds(2);         // > 0
  // Fault-injection seam for tests (empty in production): called without the cache's lock
  // before a demotion copies piece `handle` down to tier `to`, so a test can hold a demotion
  // in the middle of its I/O.
  std::function<void(uint64_t handle, StorageMedium to)> before_demotion_copy;
};

// A shape in a scope, and the key its entries are stored under.
struct ScopedShape {
  std::string scope;
  PlanFingerprint shape{};
  PlanFingerprint key{};  // ScopedShapeFingerprint(scope, shape)
  // The formats its sessions store (PlanFormatsSummary), for refusals that name them; empty
  // where not known (engine pools, shapes known only from the journal or a remote tier).
  std::string formats;
  // An engine pool's layout (block store), not a session shape; `shape` is then the layout
  // fingerprint (block_layout.h) and entries are single blocks of block_tokens tokens.
  bool engine_pool = false;
  uint32_t block_tokens = 0;
};

// An entry or an event with its scope; `fingerprint` is the plain shape (the scope apart).
struct ScopedEntry {
  std::string cache_scope;
  EntryView view;
  bool from_engine_pool = false;  // a block store entry (view.origin says whose)
};
struct ScopedPrefixEvent {
  std::string cache_scope;
  PrefixEvent event;
};
struct ScopedEventReplay {
  bool gap = false;  // as EventReplay
  std::vector<ScopedPrefixEvent> events;
  uint64_t last_sequence = 0;
};

struct PrefixCaptureResult {
  EntryId entry;
  uint64_t boundary_tokens = 0;
  bool already_present = false;
  uint64_t added_bytes = 0;
  uint64_t stored_bytes = 0;
  PlanFingerprint shape{};  // the plain shape (ScopedShape::shape)
};

struct PrefixLookupResult {
  LookupOutcome outcome = LookupOutcome::kMiss;
  std::optional<EntryId> entry;
  uint64_t matched_tokens = 0;
  // The slowest tier any matched piece is in (a restore promotes them first).
  StorageMedium medium = StorageMedium::kDevice;
};

// One tier's gauges (stored_bytes, budget_bytes) and monotonic counters. hits: restores whose
// slowest piece was in this tier; promotions / demotions: pieces moved out of / into it.
struct PrefixTierStats {
  StorageMedium medium = StorageMedium::kDevice;
  uint64_t stored_bytes = 0;
  uint64_t budget_bytes = 0;
  uint64_t hits = 0;
  uint64_t promotions = 0;
  uint64_t demotions = 0;
};

struct PrefixRestoreResult {
  EntryId entry;
  uint64_t restored_tokens = 0;
};

// A restore's outcome for the session: the state it adopts, and what was restored.
struct PrefixRestoreOutcome {
  SessionState state;
  PrefixRestoreResult result;
};

// Counters for metrics (monotonic unless said otherwise) and gauges of the ledger.
// Identity: stored_bytes == pinned_bytes + evictable_bytes.
struct PrefixCacheStats {
  uint64_t entries = 0;
  uint64_t blocks = 0;
  uint64_t stored_bytes = 0;
  uint64_t pinned_bytes = 0;
  uint64_t evictable_bytes = 0;
  uint64_t budget_bytes = 0;
  uint64_t lookup_hits = 0;
  uint64_t lookup_partials = 0;
  uint64_t lookup_misses = 0;
  uint64_t captures = 0;  // entries stored (an already-present boundary is not counted)
  uint64_t restores = 0;
  uint64_t tokens_restored = 0;
  uint64_t evicted_entries = 0;
  uint64_t dropped_entries = 0;
  uint64_t death_captures = 0;
  uint64_t epoch = 0;
  uint64_t last_sequence = 0;
  uint32_t block_tokens = 0;
  SlabStats slabs;  // the device tier's storage (gauges)
  // The device tier, then the host tier and the disk tier when there are, then the remote tier
  // when there is one. stored_bytes == the local tiers' sum (each counts its pieces' rounded span
  // sizes, a disk file's too; the remote tier's is 0: what the cluster holds is the cluster's, not
  // this daemon's; its hits are restores that pulled pieces, promotions the pieces pulled,
  // demotions the pieces written).
  std::vector<PrefixTierStats> tiers;
  std::optional<RemoteTierStats> remote;  // present iff the daemon has a remote tier
};


// ---- Engine-pool blocks: the block store's narrow API (server/store/block_store.h) ----
// An engine's registered pool is one arena (DeviceBackend::MapEngineBuffers). Each stored pool
// block is its own prefix entry (a chain of one key, block_layout.h keys) in the key space of
// the group's scoped layout, so blocks evict, pin and expire independently, and share the one
// budget, LRU, slabs, tiers, checksums and events with session captures. A group's STATE
// tensors for a boundary are an entry of their own under BoundaryStateKey(the block's key) in
// BoundaryStateFingerprint(the key space).

// One contiguous range of a pool block in the pool's arena.
struct PoolPiece {
  uint64_t pool_offset = 0;
  uint64_t bytes = 0;
};
struct PoolBlock {
  BlockKey key{};
  std::vector<PoolPiece> pieces;  // in stored order
  uint64_t bytes = 0;             // their sum
  PrefixEventOrigin origin;       // StorePoolBlocks: this block's STORED event
};
struct PoolBlockResult {
  absl::Status status;  // OK, NOT_FOUND, DATA_LOSS, RESOURCE_EXHAUSTED...
  bool already_present = false;
  uint64_t copied_bytes = 0;  // the block's (and its state's) bytes that moved
};
struct PoolLookupResult {
  uint64_t matched_blocks = 0;
  StorageMedium medium = StorageMedium::kDevice;
  std::vector<EntryId> pinned;  // with pin: the matched entries (and the state's)
};

class PrefixCache {
 public:
  // `backend` must outlive the cache; `budget` may be null (no shared admission ledger);
  // `host_memory` is the host tier's memory, given iff options.host_tier_bytes > 0.
  // INVALID_ARGUMENT for a zero budget or block size, a host tier without memory or memory
  // without a host tier.
  static absl::StatusOr<std::unique_ptr<PrefixCache>> Create(
      const PrefixCacheOptions& options, DeviceBackend* backend, DeviceBudget* budget,
      std::unique_ptr<HostMemoryProvider> host_memory = nullptr);
  ~PrefixCache();  // frees every slab and its budget charge
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  uint32_t block_tokens() const { return options_.block_tokens; }
  uint64_t epoch() const { return options_.epoch; }

  // ---- Live sessions (server/session/session_prefix.h holds the session side) ----
  // A live session's state is read and replaced only under the session's own mutex, which the
  // caller holds across these calls (lock order: the session's mutex -> mu_); `shape` is the
  // session's shape in its owner's cache scope. Tiers are not rebalanced inside: the caller runs
  // RebalanceTiers once it has left the session's mutex (the session is not held up by the
  // demotion's I/O), after a restore's refusal too (its promotions may have filled the device).

  // Captures rows [0, boundary_tokens) of the session's committed `state`, keyed by
  // `committed_tokens` (the token ids the session's commits carried, at least boundary_tokens
  // of them); its events name `engine_id`. REQUIRES (else refused, nothing stored): state usable
  // (not tainted), no open transaction, recurrent position == committed length;
  // boundary_tokens > 0, a multiple of block_tokens, <= committed length and <=
  // committed_tokens.size(); plans with recurrent or indexer layers: boundary == committed
  // length.
  absl::StatusOr<PrefixCaptureResult> CaptureState(const ScopedShape& shape,
                                                   const SessionState& state,
                                                   const SessionLayoutVersion& layout,
                                                   absl::Span<const int32_t> committed_tokens,
                                                   uint64_t boundary_tokens, uint64_t engine_id)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Engine death: captures the COMMITTED `state` from `committed_tokens` (the ids its commits
  // carried; nullopt when unknown): the largest block boundary <= committed length for
  // position-addressed plans (even with a transaction open: staged rows lie above it and are
  // never read); exactly the committed length, with no transaction open, otherwise. nullopt
  // when there is nothing to capture (tokens unknown, under one block, not at a capturable
  // boundary). Counted as a death capture when stored.
  absl::StatusOr<std::optional<PrefixCaptureResult>> CaptureCommittedState(
      const ScopedShape& shape, const SessionState& state, const SessionLayoutVersion& layout,
      const std::optional<std::vector<int32_t>>& committed_tokens) ABSL_LOCKS_EXCLUDED(mu_);

  // Restores entry `requested` (nullopt: the longest match for `tokens`) from `shape`'s cache
  // scope into the FRESH `state` of session `session` (named in refusals; `engine_id` names the
  // restoring engine in a remote pull's events); returns the state the session adopts. Refusals
  // change nothing: NOT_FOUND unknown entry, an entry of another scope (told apart from an
  // unknown one by nothing) / no match; INVALID_ARGUMENT another shape, tokens that match none of
  // the entry's blocks, a capacity below the restored length (or a ring too small for the window);
  // FAILED_PRECONDITION non-fresh or tainted destination, an entry of a boundary-state plan
  // whose boundary the tokens do not reach. DATA_LOSS: a stored checksum mismatch; the entry
  // is dropped (unless another restore still pins it) and the destination stays fresh.
  absl::StatusOr<PrefixRestoreOutcome> RestoreInto(const ScopedShape& shape, SessionId session,
                                                   uint64_t engine_id, const SessionState& state,
                                                   const SessionLayoutVersion& layout,
                                                   std::optional<EntryId> requested,
                                                   absl::Span<const int32_t> tokens)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Every tier within its budget: each tier's LRU pieces move down (the last one's entries are
  // evicted). Run after a capture or restore, outside the session's mutex.
  void RebalanceTiers() ABSL_LOCKS_EXCLUDED(mu_);

  // Longest restorable prefix in cache scope `scope` for sessions of `shape`
  // (PrefixShapeFingerprint).
  PrefixLookupResult Lookup(absl::string_view scope, const PlanFingerprint& shape,
                            absl::Span<const int32_t> tokens) ABSL_LOCKS_EXCLUDED(mu_);

  // ---- Engine-pool blocks (the block-store API above) ----
  // Copies `blocks` from the pool arena `pool` into the store under `space` (`space.key` is
  // the scoped layout; engine_pool and block_tokens set); `state` (its key set to the last
  // block's) goes with the last block. One result per block (the state's failure is the last
  // block's): already stored blocks are touched, not copied; RESOURCE_EXHAUSTED when no room is
  // left even after eviction.
  std::vector<PoolBlockResult> StorePoolBlocks(const ScopedShape& space, ArenaId pool,
                                               const std::vector<PoolBlock>& blocks,
                                               const std::optional<PoolBlock>& state)
      ABSL_LOCKS_EXCLUDED(mu_);
  // How many leading `keys` are stored (with `needs_state`: up to the last one whose boundary
  // state is stored too); with `pin`, pins them (UnpinPoolEntries releases). Touches nothing.
  PoolLookupResult LookupPoolBlocks(const ScopedShape& space, absl::Span<const BlockKey> keys,
                                    bool needs_state, bool pin) ABSL_LOCKS_EXCLUDED(mu_);
  void UnpinPoolEntries(absl::Span<const EntryId> entries) ABSL_LOCKS_EXCLUDED(mu_);
  // Copies stored blocks into `pool` (each PoolBlock's pieces are its destination), verifying
  // the checksums as it copies: one result per block, NOT_FOUND for one not stored (or whose
  // `state` is not), DATA_LOSS for a corrupt one (its entry is dropped; its destination bytes
  // are unspecified). Loaded entries move up the LRU. `release_pins`: a LookupPoolBlocks pin
  // this load ends, released once the load holds its own and before a corrupt entry is dropped
  // (an entry still pinned could not be).
  std::vector<PoolBlockResult> LoadPoolBlocks(const ScopedShape& space, ArenaId pool,
                                              const std::vector<PoolBlock>& blocks,
                                              const std::optional<PoolBlock>& state,
                                              absl::Span<const EntryId> release_pins = {})
      ABSL_LOCKS_EXCLUDED(mu_);
  // Test seam: the entry a pool block (or state) key is stored as.
  std::optional<EntryId> PoolEntry(const BlockKey& key) const ABSL_LOCKS_EXCLUDED(mu_);

  // Operator calls: every scope.
  std::vector<ScopedEntry> ListEntries() const ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<ScopedEntry> Inspect(EntryId entry) const ABSL_LOCKS_EXCLUDED(mu_);
  // The slowest tier any of `entry`'s pieces is in now.
  StorageMedium MediumOf(const EntryView& entry) const ABSL_LOCKS_EXCLUDED(mu_);
  // NOT_FOUND; FAILED_PRECONDITION while pinned. Returns the bytes freed.
  absl::StatusOr<uint64_t> EvictEntry(EntryId entry) ABSL_LOCKS_EXCLUDED(mu_);
  // DeviceBudget::Evictor: evicts LRU unpinned entries worth up to `bytes` (everything evictable
  // when less is); returns the bytes freed.
  uint64_t EvictForAdmission(uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // Installs EvictForAdmission as `budget`'s evictor (the budget must not outlive this cache).
  void InstallEvictor(DeviceBudget& budget);

  // The remote tier, or null (tests and benches flush its writes).
  RemoteTier* remote_tier() const { return remote_.get(); }

  // Returns the emptied slabs kept for reuse to the backend (shutdown); returns their bytes.
  uint64_t ReleaseEmptySlabs() ABSL_LOCKS_EXCLUDED(mu_);

  PrefixCacheStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);
  // Events after (epoch, last_sequence) of cache scope `scope` (nullopt: every scope, the
  // operators' view). Sequences are the daemon's: a scope's subscriber sees them skip over
  // other scopes' events (not a gap).
  ScopedEventReplay EventsSince(uint64_t epoch, uint64_t last_sequence,
                                const std::optional<std::string>& scope) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Blocks until an event after `last_sequence` exists or `timeout` passes; returns the newest
  // sequence.
  uint64_t AwaitEvent(uint64_t last_sequence, absl::Duration timeout) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // Test seams (corruption tests): where an entry's block or boundary is stored: its tier, its
  // device span, its host-tier memory, its file (NOT_FOUND for an unknown handle;
  // FAILED_PRECONDITION when the piece is in another tier).
  absl::StatusOr<StorageMedium> StorageMediumOf(uint64_t storage_handle) const
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<SlabSpan> StorageSpan(uint64_t storage_handle) const ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<absl::Span<uint8_t>> StorageHostBytes(uint64_t storage_handle) const
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<std::string> StorageFile(uint64_t storage_handle) const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status CheckInvariants() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  using Storage = PieceStorage;
  // A capture's fresh copy, its span held until the index adopts it or it is freed.
  struct Stored {
    StoredRef ref;
    Storage storage;
    PieceLedger::Hold hold;  // kCapture on its span (SlabAllocator::Allocate's, adopted)
  };
  PrefixCache(const PrefixCacheOptions& options, PrefixIndex index, DeviceBackend* backend,
              DeviceBudget* budget, std::unique_ptr<SlabAllocator> slabs,
              std::unique_ptr<DiskTier> disk, std::unique_ptr<HostTierMemory> host_memory,
              std::unique_ptr<SlabAllocator> host_slabs, std::unique_ptr<RemoteTier> remote);

  // CaptureState, and CaptureCommittedState's capture (`allow_open_transaction`: staged rows
  // lie above the boundary). REQUIRES the session's mutex.
  absl::StatusOr<PrefixCaptureResult> CaptureLocked(const ScopedShape& shape,
                                                    const SessionState& state,
                                                    const SessionLayoutVersion& layout,
                                                    absl::Span<const int32_t> tokens,
                                                    uint64_t boundary_tokens,
                                                    bool allow_open_transaction,
                                                    uint64_t engine_id)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Allocates a held span for each piece and copies it from `source`, sealing its checksums;
  // on failure nothing stays allocated.
  absl::StatusOr<std::vector<Stored>> SealCopies(ArenaId source, std::vector<PieceCopy>& pieces)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Hands a capture's or a pull's `copies` (spans held) to the index for `plan`: each is adopted
  // or freed, its hold released either way; records the shape.
  absl::StatusOr<CommitResult> AdoptLocked(const ScopedShape& shape, const CapturePlan& plan,
                                           std::vector<Stored> copies, bool position_addressed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Write-behind (docs/remote-tier.md): a queued write reads its piece from the capture's
  // device span on the remote tier's writer thread. The span is held from before the index
  // adopts it until the writer has read it or dropped the write: a kRemoteWrite hold in ledger_
  // (its slab is not evictable device memory, as a capture's spans), by which
  // PieceLedger::FreeSpan defers the span's free (an eviction, a drop, a demotion's commit) to
  // the release. So a piece evicted or demoted while its write is queued is still written, from
  // the bytes the capture sealed, and its device memory returns once they are read. What is
  // held is bounded by the tier's queue (bytes and entries), as the copies were.
  class RemotePieceSource;
  struct RemoteWrite {
    std::string key;
    std::string header;  // EncodeRemoteHeader of the piece
    SlabSpan span;
    uint64_t payload_bytes = 0;
    PieceLedger::Hold hold;  // kRemoteWrite on `span`, released with the write's source
  };
  // The remote tier's writes for each of a capture's `copies` (spans held by the capture);
  // empty without a remote tier or when its queue would not take them all (one drop counted).
  std::vector<RemoteWrite> RemoteWritesOf(const ScopedShape& shape, const CapturePlan& plan,
                                          const StoredLayout& stored,
                                          const std::vector<Stored>& copies) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Queues `writes` (each under its kRemoteWrite hold): each hold passes to its source, which the tier
  // destroys, releasing it, once the write leaves the queue.
  void QueueRemoteWrites(std::vector<RemoteWrite> writes) ABSL_LOCKS_EXCLUDED(mu_);
  // Read-through before a restore by tokens (REQUIRES the fresh destination's mutex, not mu_):
  // pulls what the remote tier holds beyond the local match of `keys` into a local entry.
  // Failures are logged and counted, never returned: the restore then serves the local match.
  // Bounded: it pulls at most what the device tier's budget holds, fetching values a window at a
  // time (server/store/remote/read_through.h); the new entry's events name `engine_id` (the restoring engine).
  void PullFromRemote(const ScopedShape& shape, const SessionState& state,
                      const SessionLayoutVersion& layout, absl::Span<const int32_t> tokens,
                      const std::vector<BlockKey>& keys, uint64_t engine_id)
      ABSL_LOCKS_EXCLUDED(mu_);
  // What restoring an entry's first `matched_blocks` blocks makes of a fresh session: the state
  // it adopts and the layout its pieces land in.
  struct RestoreTarget {
    SessionState hydrated;
    StoredLayout layout;
  };
  // Validates such a restore before any piece moves (so a refusal changes nothing, promotions
  // included): capacity, every layer, the entry's piece sizes against the destination's
  // (DATA_LOSS: a truncated entry). Reads only the session and the entry view.
  absl::StatusOr<RestoreTarget> PlanRestore(SessionId session, const SessionState& state,
                                            const SessionLayoutVersion& layout,
                                            const EntryView& entry,
                                            uint64_t matched_blocks) const;
  // Verifies and copies a pinned, promoted entry's first `matched_blocks` blocks (and its
  // boundary state) into the fresh session as `target` (PlanRestore's) says; returns the state
  // it must adopt. REQUIRES the destination's mutex (held by RestoreInto's caller).
  absl::StatusOr<SessionState> RestorePinned(const SessionLayoutVersion& layout,
                                             const EntryView& entry, uint64_t matched_blocks,
                                             RestoreTarget target) ABSL_LOCKS_EXCLUDED(mu_);
  LookupResult LookupLocked(const PlanFingerprint& shape, absl::Span<const int32_t> tokens)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees handles the index let go of (eviction, drop, unused), in whichever tier they are.
  void FreeHandles(const std::vector<uint64_t>& handles) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `view` with its scope and plain shape.
  ScopedEntry Unscoped(EntryView view) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A restore's (or pool load's, or pool lookup's) holds on every piece of the pinned `entry`,
  // released (with the index's pin) when the pin ends.
  std::vector<PieceLedger::Hold> HoldPieces(const EntryView& entry)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Once the entry is promoted: each hold of a piece now in a slab holds that slab too.
  void HoldSlabs(std::vector<PieceLedger::Hold>& holds) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // UnpinPoolEntries' unpinning without its budget enforcement.
  void UnpinPoolEntriesLocked(absl::Span<const EntryId> entries)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // --- The tier chain (device -> disk). Demotion plans under mu_, copies without it, commits
  // under mu_ again; these functions are entered and left with mu_ held but release it while
  // bytes move, so a demotion never stalls a lookup, capture or restore of other pieces.
  //
  // A piece on its way down: planned (its source still serves restores), copied, committed.
  struct Move {
    uint64_t handle = 0;
    StorageMedium to = StorageMedium::kDisk;
    Storage source;  // where the bytes are (the same as storage_'s until the commit)
    // The index let go of the piece while it moved (an eviction, a drop): FreeHandles left
    // `source` to the mover, which frees it at the commit.
    bool released = false;
    // For the kMoved event: the entry it was planned from, and its key there.
    PlanFingerprint fingerprint{};
    BlockKey key{};
    bool boundary = false;
    PieceLedger::Hold hold;  // kDemotion (a device source's slab too) until the commit
  };
  // What `move` adds to its destination tier's budget (StoreTier::IncomingBytes).
  uint64_t IncomingBytes(const Move& move) const;
  // Demotes LRU host-tier pieces until the bytes on their way into it fit its budget too.
  void MakeHostRoom() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RebalanceTiers under mu_ (held).
  void Rebalance() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Demotes LRU pieces of tier `from` (of unpinned entries, none being promoted or moved) until
  // it holds at most `target` bytes not already leaving, or nothing is left to demote; the last
  // tier evicts LRU entries instead. A full disk tier evicts LRU entries for room first.
  // Returns the pieces moved.
  size_t DemoteDownTo(StorageMedium from, uint64_t target) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // LRU pieces of `from` worth at least `bytes`, marked moving (in moving_); empty when none.
  std::vector<uint64_t> PlanMoves(StorageMedium from, StorageMedium to, uint64_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Evicts least recently used unpinned entries whose eviction frees a piece stored in `medium`
  // (and not being moved down) until `has_room()`, in one pass over the LRU order: an entry
  // whose pieces there are all shared with a sibling (a prefix and its extension) would leave
  // the cache for no room, so it stays. Each entry is judged when visited (evicting an earlier
  // one may have left it sole user of a shared piece). When that pass leaves no room (the
  // shared pieces there belong to a prefix and an extension whose own pieces lie elsewhere:
  // neither alone frees them), a second pass evicts LRU entries holding a piece there, so the
  // tier never stays full for good. Returns how many entries it evicted.
  size_t EvictForRoomIn(StorageMedium medium, absl::FunctionRef<bool()> has_room)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Evicts LRU entries whose eviction frees a piece on disk until the disk tier has room for
  // the bytes on their way to it (tier_incoming_bytes_); false when that cannot be done.
  bool MakeDiskRoom() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Copies the planned pieces down without mu_ and commits them under mu_, a chunk of about
  // options_.demotion_chunk_bytes at a time (a piece pinned meanwhile stays where it was; one
  // released meanwhile is freed in both tiers). Returns how many moved.
  size_t RunMoves(const std::vector<uint64_t>& handles) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One chunk of RunMoves: the moving_ pieces `handles`, copied without mu_, then committed
  // with their kMoved events in one hold of mu_.
  size_t MoveChunk(const std::vector<uint64_t>& handles) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The copy itself (no lock held): `source`'s bytes into a new home in tier `to`
  // (StoreTier::Insert). Returns the new storage.
  absl::StatusOr<Storage> CopyDown(uint64_t handle, const Storage& source, StorageMedium to)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Frees `storage` in its tier (StoreTier::Erase) without touching the ledger.
  void FreeInTier(uint64_t handle, const Storage& storage);
  // Moves the disk pieces of the PINNED `entry` into slabs, reading and verifying them without
  // mu_ (a piece another restore is promoting, or a demotion is moving, is waited for).
  // DATA_LOSS: a file whose bytes do not match the capture's checksums; RESOURCE_EXHAUSTED: no
  // device memory for it. Pieces promoted before a failure stay promoted.
  absl::Status PromotePinned(const EntryView& entry) ABSL_LOCKS_EXCLUDED(mu_);
  // `storage_handle`'s storage, when it is in `medium` (nullopt: any tier); the seams' errors.
  absl::StatusOr<Storage> StorageIn(uint64_t storage_handle,
                                    std::optional<StorageMedium> medium) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  StorageMedium MediumLocked(const std::vector<LookupBlock>& blocks,
                             const std::optional<StoredRef>& boundary) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Constant after construction.
  const PrefixCacheOptions options_;
  DeviceBackend* const backend_;
  DeviceBudget* const budget_;
  const SliceCopier copier_;
  const std::unique_ptr<SlabAllocator> slabs_;  // thread-safe itself
  const std::unique_ptr<DiskTier> disk_;         // null: no disk tier; thread-safe itself
  // The host tier (null: none): its memory, and the allocator over it (destroyed first).
  const std::unique_ptr<HostTierMemory> host_memory_;
  const std::unique_ptr<SlabAllocator> host_slabs_;
  // The local tiers over the above, fastest first (the device tier frees through ledger_).
  const TierChain tiers_;
  // Every hold on a stored piece (PieceLedger's kinds); thread-safe itself. Declared before
  // remote_, whose queued sources release their holds into it, and before mu_'s members
  // (moving_, pool_pins_), which hold holds.
  PieceLedger ledger_;
  // null: no remote tier; thread-safe itself. Members are destroyed in reverse order: this one
  // (its threads joined, its queued sources released) after mu_ and the index below, before
  // ledger_ and the tiers' memory above, which those sources release their holds into.
  const std::unique_ptr<RemoteTier> remote_;

  std::atomic<uint64_t> tick_{0};  // LRU clock

  mutable absl::Mutex mu_;
  PrefixIndex index_ ABSL_GUARDED_BY(mu_);
  // storage handle -> where its bytes are and their slice checksums.
  absl::flat_hash_map<uint64_t, Storage> storage_ ABSL_GUARDED_BY(mu_);
  uint64_t next_handle_ ABSL_GUARDED_BY(mu_) = 1;
  // Per key (ScopedShape::key): whether every layer is position-addressed (what Lookup must
  // know), and the scope and plain shape it stands for (filled at capture: every entry's key
  // is here).
  absl::flat_hash_map<PlanFingerprint, bool> position_addressed_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<PlanFingerprint, ScopedShape> scoped_shapes_ ABSL_GUARDED_BY(mu_);
  uint64_t captures_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t restores_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t tokens_restored_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t death_captures_ ABSL_GUARDED_BY(mu_) = 0;
  // Tiers, indexed by StorageMedium: the bytes of storage_'s pieces in each (rounded spans; a
  // disk piece counts its span's size too), and of those the bytes planned to move down
  // (moving_, not released).
  static constexpr size_t kMedia = 3;
  std::array<uint64_t, kMedia> tier_stored_bytes_ ABSL_GUARDED_BY(mu_) = {};
  std::array<uint64_t, kMedia> tier_leaving_bytes_ ABSL_GUARDED_BY(mu_) = {};
  // Pieces a demotion is moving down (by handle; each under its kDemotion hold), the holds of
  // the pieces of entries LookupPoolBlocks pinned (per pin, released by UnpinPoolEntries), and
  // per tier the bytes on their way into it, in the unit its budget counts (IncomingBytes).
  absl::flat_hash_map<uint64_t, Move> moving_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<EntryId, std::vector<std::vector<PieceLedger::Hold>>> pool_pins_
      ABSL_GUARDED_BY(mu_);
  std::array<uint64_t, kMedia> tier_incoming_bytes_ ABSL_GUARDED_BY(mu_) = {};
  std::array<uint64_t, kMedia> tier_hits_ ABSL_GUARDED_BY(mu_) = {};
  std::array<uint64_t, kMedia> tier_promotions_ ABSL_GUARDED_BY(mu_) = {};
  std::array<uint64_t, kMedia> tier_demotions_ ABSL_GUARDED_BY(mu_) = {};
};

}  // namespace memra

#endif  // MEMRA_SERVER_PREFIX_CACHE_H_
