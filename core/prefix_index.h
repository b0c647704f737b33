#ifndef MEMRA_CORE_PREFIX_INDEX_H_
#define MEMRA_CORE_PREFIX_INDEX_H_

// The prefix cache's bookkeeping: which token blocks and captured boundaries the daemon holds,
// where their bytes live (opaque storage handles the daemon assigns), what they cost, who is
// restoring from them, and what a cluster router must hear about. No bytes move here: the daemon
// copies and checksums; this index decides what to copy, what to free and what may be served.
//
// Storage model. Full-attention and latent rows are position-addressed: the rows of block i do
// not depend on where the sequence stops, so they are stored once per BLOCK and shared
// (reference-counted) by every entry whose token prefix contains that block. State that only
// exists at a boundary (recurrent conv/ssm, the SWA aligned live window of KvRing::restore_plan,
// the latent indexer's live tail and final pool keys of snapshot_plane) is stored per captured
// BOUNDARY. Hence plans with such state restore only at captured boundaries; plans whose layers
// are all position-addressed restore at any block boundary inside a stored chain.
//
// Concurrency protocol with the daemon: PlanCapture (under the daemon's mutex) -> the daemon
// allocates and copies WITHOUT the mutex -> CommitCapture re-validates against whatever changed
// meanwhile. Restore: Lookup -> Pin (same critical section) -> copy + verify checksums -> Unpin.
//
// Invariants:
//  (1) a block is stored iff at least one entry's chain contains it; its refcount is the number
//      of such entries; chains are prefix-closed, so a stored block's parent is stored;
//  (2) StoredBytes() == sum of bytes of stored blocks (each once) + boundary states of entries;
//  (3) a pinned entry, its boundary state and every block of its chain are never freed (evict,
//      budget, EvictEntry and DropEntry all refuse or skip them);
//  (4) EvictableBytes() == StoredBytes() - bytes of blocks with a pinned user - boundary states
//      of pinned entries == exactly what evicting every unpinned entry would free;
//  (5) every change to the stored set (store, evict, drop) appends one event with the next
//      sequence number (starting at 1); a refused call appends nothing and changes nothing;
//  (6) StoredBytes() <= budget after CommitCapture, SetBudget and EnforceBudget, except by
//      bytes still pinned; Unpin never evicts, so the daemon calls EnforceBudget after it.
//
// Thread-safety: a value type, not thread-safe; the daemon guards it with one mutex.

#include <array>
#include <compare>
#include <cstdint>
#include <deque>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/model_plan.h"

namespace memra {

// SHA-256 of one block in its chain. 32 bytes because a collision serves another prompt's KV.
using BlockKey = std::array<uint8_t, 32>;

// Domain tag hashed first into every block key, so a key can never equal a fingerprint or any
// other SHA-256 the project computes over the same bytes. Bump the version to change the format.
inline constexpr std::string_view kPrefixKeyDomain = "memra-kv/prefix/v1";

// key_i = SHA-256(kPrefixKeyDomain || key_{i-1} (the fingerprint for i = 0) || block_tokens as
// u32 LE || tokens [i*b, (i+1)*b) as i32 LE). Chained because the KV rows of a block depend on
// EVERY token before it (attention mixes the whole prefix into each row): the same 16 tokens
// after a different prefix are different KV, and the chain makes that a different key. The
// fingerprint seed keeps two model plans from ever sharing a key. Only whole blocks get keys.
// INVALID_ARGUMENT when block_tokens == 0.
absl::StatusOr<std::vector<BlockKey>> ChainBlockKeys(const PlanFingerprint& fingerprint,
                                                     absl::Span<const int32_t> tokens,
                                                     uint32_t block_tokens);

template <typename Tag>
struct PrefixStrongId {
  uint64_t value = 0;  // 0 is never issued
  friend bool operator==(PrefixStrongId, PrefixStrongId) = default;
  friend auto operator<=>(PrefixStrongId, PrefixStrongId) = default;
  template <typename H>
  friend H AbslHashValue(H h, PrefixStrongId id) {
    return H::combine(std::move(h), id.value);
  }
};
using EntryId = PrefixStrongId<struct PrefixEntryIdTag>;
using BlockId = PrefixStrongId<struct PrefixBlockIdTag>;

// What the caller computed from core sizing for ONE model plan.
struct PrefixModelTraits {
  // No recurrent, SWA or latent-indexer layer: any block boundary of a stored chain restores.
  bool position_addressed_only = true;
  uint64_t block_bytes = 0;  // bytes of one block's position-addressed rows, all layers; > 0
  // Bytes of the per-boundary state AT THIS BOUNDARY (it varies: the SWA window's alignment slack,
  // the indexer tail len % pool and the pool keys grow with the boundary). Must be 0 when
  // position_addressed_only, > 0 otherwise. Ignored by Lookup.
  uint64_t boundary_bytes = 0;
};

// Where some stored bytes live and the checksum the daemon took when it copied them.
struct StoredRef {
  uint64_t storage_handle = 0;
  uint64_t checksum = 0;
  bool operator==(const StoredRef&) const = default;
};

// Who stored an entry, for the events routers index (prefix.proto PrefixEvent 20-25). Empty
// hashes: the block keys are the blocks' identities.
struct PrefixEventOrigin {
  std::vector<std::string> block_hashes;  // the engine's own hash per stored block
  std::string parent_block_hash;          // of the block before the first (empty at the start)
  std::vector<int32_t> token_ids;         // block_tokens per stored block, when known
  uint32_t block_tokens = 0;
  uint64_t engine_id = 0;  // 0: the daemon
  bool from_engine_pool = false;
  bool operator==(const PrefixEventOrigin&) const = default;
};

struct CapturePlan {
  PlanFingerprint fingerprint{};
  uint32_t block_tokens = 0;
  uint64_t boundary_tokens = 0;
  std::vector<BlockKey> chain;  // keys of blocks [0, boundary_tokens / block_tokens)
  // Blocks [0, first_new_block) were stored at planning time (shared, copy nothing);
  // blocks [first_new_block, chain.size()) must be copied, block_bytes each.
  uint64_t first_new_block = 0;
  uint64_t block_bytes = 0;
  bool needs_boundary_state = false;
  uint64_t boundary_bytes = 0;
  // An entry already exists at this boundary: copy nothing; CommitCapture only touches it.
  bool already_present = false;
  uint64_t new_bytes = 0;  // bytes the copies will take (new blocks + boundary state)
  // Carried by the entry into its events (STORED: all of it; EVICTED / DROPPED: the hashes,
  // engine and pool flag). The caller may fill it between PlanCapture and CommitCapture.
  PrefixEventOrigin origin;
  uint64_t new_block_count() const { return chain.size() - first_new_block; }
};

// Handles and checksums of what the daemon copied for a CapturePlan.
struct CaptureCommit {
  std::vector<StoredRef> new_blocks;  // one per block [first_new_block, chain.size()), in order
  std::optional<StoredRef> boundary;  // present iff plan.needs_boundary_state
};

// kMoved: stored bytes changed tier (the daemon demoted or promoted them; RecordMoved).
enum class PrefixEventKind : uint8_t { kStored = 0, kEvicted = 1, kDropped = 2, kMoved = 3 };

// The tier stored bytes live in, fastest first: the backend's own memory (a GPU's on cuda,
// shared memory on the host backend), pinned host memory (cuda only), a local disk file, another
// machine's store (the daemon's remote tier: a lookup may match there; a restore pulls the bytes
// into the device tier first, so no stored piece is ever kRemote).
enum class StorageMedium : uint8_t { kDevice = 0, kPinnedHost = 1, kDisk = 2, kRemote = 3 };
// "device", "pinned_host", "disk", "remote" (metrics labels, logs).
std::string_view StorageMediumName(StorageMedium medium);

// What a cluster router hears. `block_keys` are the blocks whose bytes were stored, freed or
// moved by this change (shared blocks that stay are not repeated); `boundary_key` is set when a
// boundary state was (it is the last key of that boundary's chain). `medium`: where the bytes
// are now (kStored: kDevice; kMoved: the tier they moved to; kEvicted/kDropped: kDevice, unused).
struct PrefixEvent {
  uint64_t sequence = 0;  // per index, starting at 1, no gaps
  uint64_t epoch = 0;
  PrefixEventKind kind = PrefixEventKind::kStored;
  PlanFingerprint fingerprint{};
  std::vector<BlockKey> block_keys;
  std::optional<BlockKey> boundary_key;
  std::string reason;  // kDropped only: why (e.g. the checksum mismatch the restore found)
  StorageMedium medium = StorageMedium::kDevice;
  PrefixEventOrigin origin;  // the entry's (kMoved: empty)
  bool operator==(const PrefixEvent&) const = default;
};

struct EventReplay {
  // True when the subscriber missed events that are no longer buffered (or came from another
  // epoch, or from the future): it must drop its view of this daemon and resync from a snapshot.
  bool gap = false;
  std::vector<PrefixEvent> events;  // the missed events, oldest first; empty when gap
  uint64_t last_sequence = 0;       // the newest sequence issued so far (0 = none)
};

struct CommitResult {
  EntryId entry;
  bool already_present = false;  // the boundary existed: only its LRU tick moved
  // Handles the daemon passed in that the index did NOT adopt (another capture stored the same
  // block meanwhile, or the boundary already existed): the daemon frees them.
  std::vector<uint64_t> unused_handles;
  // Handles freed by the budget eviction this commit needed: the daemon frees them.
  std::vector<uint64_t> evicted_handles;
  uint64_t added_bytes = 0;
};

struct EvictionResult {
  uint64_t freed_bytes = 0;
  std::vector<uint64_t> freed_handles;  // the daemon frees these storage handles
  std::vector<EntryId> entries;         // entries removed, in eviction order
  uint64_t events = 0;                  // events appended by this call
};

enum class LookupOutcome : uint8_t {
  kMiss = 0,     // nothing restorable
  kPartial = 1,  // some, but fewer than all whole blocks of the query
  kHit = 2,      // every whole block of the query
};

struct LookupBlock {
  BlockKey key{};
  BlockId id;
  uint64_t bytes = 0;
  StoredRef stored;
};

struct LookupResult {
  LookupOutcome outcome = LookupOutcome::kMiss;
  uint64_t matched_tokens = 0;        // a multiple of block_tokens
  std::vector<LookupBlock> blocks;    // blocks [0, matched_tokens / block_tokens)
  std::optional<StoredRef> boundary;  // the boundary state to restore (boundary-only plans)
  uint64_t boundary_bytes = 0;
  // The entry to Pin for the restore: its chain covers every matched block (and the boundary
  // state when present). Absent on a miss.
  std::optional<EntryId> entry;
};

struct EntryView {
  EntryId id;
  PlanFingerprint fingerprint{};
  uint64_t boundary_tokens = 0;
  std::vector<LookupBlock> blocks;
  std::optional<StoredRef> boundary;
  uint64_t boundary_bytes = 0;
  uint64_t epoch = 0;
  uint64_t last_use_tick = 0;
  uint32_t pins = 0;
  PrefixEventOrigin origin;
};

struct PrefixIndexOptions {
  uint32_t block_tokens = 16;      // > 0
  uint64_t budget_bytes = 0;       // the prefix cache's share of device memory
  uint64_t epoch = 0;              // the daemon's epoch, stamped on entries and events
  uint64_t event_capacity = 4096;  // events kept for replay; > 0
};

struct PrefixIndexStats {
  uint64_t entries = 0;
  uint64_t blocks = 0;
  uint64_t stored_bytes = 0;
  uint64_t pinned_bytes = 0;  // stored_bytes - pinned_bytes == EvictableBytes()
  uint64_t lookup_hits = 0;
  uint64_t lookup_partials = 0;
  uint64_t lookup_misses = 0;
  uint64_t evicted_entries = 0;
  uint64_t dropped_entries = 0;
};

class PrefixIndex {
 public:
  // INVALID_ARGUMENT for block_tokens == 0 or event_capacity == 0.
  static absl::StatusOr<PrefixIndex> Create(const PrefixIndexOptions& options);

  uint32_t block_tokens() const { return options_.block_tokens; }
  uint64_t epoch() const { return options_.epoch; }
  uint64_t budget_bytes() const { return options_.budget_bytes; }

  // What capturing `tokens[0, boundary_tokens)` would copy. Changes nothing.
  // INVALID_ARGUMENT: boundary 0, not a multiple of block_tokens, beyond tokens.size(); traits
  // inconsistent (block_bytes 0; boundary_bytes 0 for a boundary-state plan or > 0 for a
  // position-addressed one; a shared block stored with other bytes). RESOURCE_EXHAUSTED when
  // the new bytes cannot fit the budget even after evicting every unpinned entry.
  absl::StatusOr<CapturePlan> PlanCapture(const PlanFingerprint& fingerprint,
                                          absl::Span<const int32_t> tokens,
                                          uint64_t boundary_tokens,
                                          const PrefixModelTraits& traits) const;

  // PlanCapture of a chain of keys the caller derived (an engine pool's blocks: block_store.h
  // keys them by the engine's hashes, one entry per block). Same rules and refusals;
  // boundary_tokens is chain.size() x block_tokens. INVALID_ARGUMENT for an empty chain.
  absl::StatusOr<CapturePlan> PlanCaptureOfChain(const PlanFingerprint& fingerprint,
                                                 std::vector<BlockKey> chain,
                                                 const PrefixModelTraits& traits) const;

  // The entry whose chain ends at `key` (nullopt: none).
  std::optional<EntryId> EntryEndingAt(const BlockKey& key) const;

  // Inserts the entry, evicting LRU unpinned entries when the budget needs room. Idempotent for
  // an existing boundary (touches its LRU tick). On ANY error the index is unchanged and the
  // daemon frees every handle it passed in. INVALID_ARGUMENT: commit does not match the plan;
  // ABORTED: a block the plan counted as shared was evicted meanwhile (plan again);
  // RESOURCE_EXHAUSTED: no room even after evicting every unpinned entry.
  absl::StatusOr<CommitResult> CommitCapture(const CapturePlan& plan, const CaptureCommit& commit,
                                             uint64_t now_tick);

  // The longest restorable prefix of `tokens` for this plan (see the class comment); counts a
  // hit, partial or miss. Moves no LRU tick (Pin does). Pin the returned entry before
  // releasing the daemon's mutex. `traits.position_addressed_only` picks the rule.
  LookupResult Lookup(const PlanFingerprint& fingerprint, absl::Span<const int32_t> tokens,
                      const PrefixModelTraits& traits);

  // A restore in progress. Pin touches the LRU tick. NOT_FOUND for an unknown entry;
  // Unpin: FAILED_PRECONDITION when not pinned.
  absl::Status Pin(EntryId entry, uint64_t now_tick);
  absl::Status Unpin(EntryId entry);

  // Evicts LRU unpinned entries (oldest tick first, then lowest id) until at least
  // `bytes_needed` are freed. All or nothing: RESOURCE_EXHAUSTED (needed, evictable) when
  // EvictableBytes() < bytes_needed, evicting nothing. An entry whose eviction would free
  // nothing now (every block shared with a sibling, no boundary state: a prefix of a longer
  // entry) is passed over, and taken only once an eviction has made some of its bytes its own:
  // a chat's older, shorter prefixes outlive the tail of its newest, longest one, instead of
  // all going for the bytes that tail alone frees. (Budget eviction follows the same rule.)
  absl::StatusOr<EvictionResult> Evict(uint64_t bytes_needed);
  // Admin eviction of one entry: NOT_FOUND, or FAILED_PRECONDITION when pinned.
  absl::StatusOr<EvictionResult> EvictEntry(EntryId entry);
  // The storage handles EvictEntry(entry) would free now, changing nothing: its blocks no other
  // entry's chain contains (chain order), then its boundary state. Empty when every block is
  // shared with a sibling (a prefix and its extensions share their common blocks): evicting it
  // would free no bytes. EvictEntry's refusals: NOT_FOUND, FAILED_PRECONDITION when pinned.
  absl::StatusOr<std::vector<uint64_t>> HandlesFreedByEvicting(EntryId entry) const;
  // A restore found a checksum mismatch in this entry (the daemon answers DATA_LOSS): removes it
  // and frees the blocks only it used; the event is kDropped. The restoring caller Unpins first:
  // FAILED_PRECONDITION while pinned (another restore is still reading its bytes); NOT_FOUND.
  absl::StatusOr<EvictionResult> DropEntry(EntryId entry, std::string_view reason);
  // Evicts LRU unpinned entries until StoredBytes() <= budget, or nothing unpinned is left.
  EvictionResult SetBudget(uint64_t budget_bytes);
  EvictionResult EnforceBudget();

  uint64_t StoredBytes() const { return stored_bytes_; }
  uint64_t EvictableBytes() const { return stored_bytes_ - pinned_bytes_; }
  uint64_t EntryCount() const { return entries_.size(); }
  uint64_t BlockCount() const { return blocks_.size(); }
  PrefixIndexStats Stats() const;
  absl::StatusOr<EntryView> GetEntry(EntryId entry) const;
  // Every entry id, ascending (operator listings).
  std::vector<EntryId> EntryIds() const;
  // Every entry id, least recently used first (pinned ones included): the order tiers demote in.
  std::vector<EntryId> EntryIdsLeastRecentFirst() const;
  // The same order one entry at a time, copying nothing: the least recently used entry, and the
  // one used next after `entry` (nullopt: none). A walk that may evict the entry it is at reads
  // the next one first. EntryUsedAfter: NOT_FOUND for an unknown entry.
  std::optional<EntryId> LeastRecentEntry() const;
  absl::StatusOr<std::optional<EntryId>> EntryUsedAfter(EntryId entry) const;
  // Announces that the bytes of `block_keys` (and the boundary state of the chain ending at
  // `boundary_key`) of shape `fingerprint` now live in `medium`; changes no bookkeeping.
  void RecordMoved(const PlanFingerprint& fingerprint, std::vector<BlockKey> block_keys,
                   std::optional<BlockKey> boundary_key, StorageMedium medium);

  // While on, a STORED event of engine-pool blocks that continues the previous event's run
  // (same key space, engine and block size, its parent the run's last block, neither a boundary)
  // is folded into that event instead of appended: one StoreBlocks of thousands of blocks is
  // then one event (one BlockStored for a router), not thousands that would push every
  // subscriber of every scope past the replay buffer. The caller turns it on only while no
  // subscriber can read between the events it folds (one hold of its lock).
  // Only events appended since it was turned on are folded into: one a subscriber may have read
  // never changes.
  void set_coalesce_pool_stored(bool on) {
    coalesce_pool_stored_ = on;
    coalesce_from_sequence_ = next_sequence_;
  }

  // Missed events after `last_sequence` of `epoch` (0 = from the start), or a gap marker.
  EventReplay EventsSince(uint64_t epoch, uint64_t last_sequence) const;
  uint64_t LastSequence() const { return next_sequence_ - 1; }

  // Recomputes every invariant from scratch (ledger, refcounts, pins, parents); INTERNAL naming
  // the first broken one. For tests and a daemon self-check; O(entries x chain).
  absl::Status CheckInvariants() const;

 private:
  struct Block {
    BlockId id;
    PlanFingerprint fingerprint{};
    std::optional<BlockKey> parent;
    uint64_t index = 0;  // depth in the chain
    uint64_t bytes = 0;
    StoredRef stored;
    absl::flat_hash_set<EntryId> users;  // refcount == users.size()
    uint32_t pinned_users = 0;           // users with pins > 0
  };
  struct Entry {
    EntryId id;
    PlanFingerprint fingerprint{};
    std::vector<BlockKey> chain;
    std::optional<StoredRef> boundary;
    uint64_t boundary_bytes = 0;
    uint64_t epoch = 0;
    uint64_t last_use_tick = 0;
    uint32_t pins = 0;
    PrefixEventOrigin origin;  // block_hashes, engine_id, from_engine_pool only
  };
  // Freed by removing one entry (before it becomes an event or a result).
  struct Removal {
    uint64_t bytes = 0;
    std::vector<uint64_t> handles;
    std::vector<BlockKey> block_keys;
    std::optional<BlockKey> boundary_key;
    PlanFingerprint fingerprint{};
    PrefixEventOrigin origin;  // what removal events carry of it
  };

  explicit PrefixIndex(const PrefixIndexOptions& options) : options_(options) {}

  absl::Status ValidateTraits(const PrefixModelTraits& traits) const;
  // The entry EvictEntry may remove: NOT_FOUND, or FAILED_PRECONDITION when pinned.
  absl::StatusOr<const Entry*> EvictableEntry(EntryId id) const;
  void Touch(Entry& entry, uint64_t now_tick);
  void SetPinned(Entry& entry, bool pinned);
  Removal RemoveEntry(EntryId id);
  void AppendEvent(PrefixEvent event);
  // Removes an unpinned entry, folds what it freed into `result` and appends its event.
  void RemoveInto(EntryId id, PrefixEventKind kind, std::string_view reason,
                  EvictionResult& result);
  // Evicts LRU unpinned entries while StoredBytes() > target; returns what it freed.
  EvictionResult EvictDownTo(uint64_t target);
  // The eviction order both use: LRU unpinned entries that free bytes, until `done()`; an
  // entry that would free nothing is passed over and taken (in LRU order among those passed
  // over) as soon as an eviction makes it free something. Costs O(1) per entry walked plus the
  // chain of each entry evicted (and O(log n) per entry woken).
  void EvictLruUntil(absl::FunctionRef<bool(const EvictionResult&)> done, EvictionResult& result);
  // Whether removing `entry` now frees bytes: a block only it uses, or its boundary state. O(1).
  bool FreesBytes(EntryId id, const Entry& entry) const;

  // Constant after construction, except budget_bytes (SetBudget).
  PrefixIndexOptions options_;

  absl::flat_hash_map<BlockKey, Block> blocks_;
  absl::flat_hash_map<EntryId, Entry> entries_;
  absl::flat_hash_map<BlockKey, EntryId> by_boundary_;  // last chain key -> entry
  std::set<std::pair<uint64_t, EntryId>> lru_;          // (last_use_tick, id), unpinned too
  uint64_t stored_bytes_ = 0;
  uint64_t pinned_bytes_ = 0;
  uint64_t next_entry_ = 1;
  uint64_t next_block_ = 1;
  uint64_t next_sequence_ = 1;
  std::deque<PrefixEvent> events_;  // the newest event_capacity events
  bool coalesce_pool_stored_ = false;
  uint64_t coalesce_from_sequence_ = 0;  // the first sequence this batch may fold into
  uint64_t lookup_hits_ = 0;
  uint64_t lookup_partials_ = 0;
  uint64_t lookup_misses_ = 0;
  uint64_t evicted_entries_ = 0;
  uint64_t dropped_entries_ = 0;
};

}  // namespace memra

#endif  // MEMRA_CORE_PREFIX_INDEX_H_
