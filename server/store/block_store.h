#ifndef MEMRA_SERVER_BLOCK_STORE_H_
#define MEMRA_SERVER_BLOCK_STORE_H_

// The block store (proto/memra/kv/v1/block_store.proto, docs/block-store.md): engines that run
// attention on their OWN paged KV pool register it and store and load whole pool blocks by
// content key. This class keeps what the daemon holds for them: buffer offers (descriptors that
// came over the handoff socket, checked), registrations (the pool mapped into one arena of the
// backend and its validated layout, core/block_layout.h), and pins from LookupBlocks. The bytes
// are prefix-cache entries (PrefixCache's engine-pool API): one budget, LRU, tiers, checksums
// and events with the sessions' captures.
//
// Every engine is untrusted: an offer, registration or pin is bound to the engine that made it
// and any other engine naming it is PERMISSION_DENIED; every count and byte total per engine is
// capped (BlockStoreLimits); a refused call changes nothing. Offers are single use and valid
// while their handoff connection serves the engine; registrations and pins die with the
// engine's lease (ForgetEngine) and pins after their TTL (ExpirePins).
//
// Thread-safety: thread-safe. `mu_` guards the maps and is never held across a copy or a call
// into the prefix cache (lock order: mu_ is taken alone). A registration in use by a call while
// it is unregistered stays mapped until that call ends (shared ownership).

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/mapped_region.h"
#include "core/block_layout.h"
#include "server/device/backend.h"
#include "server/base/clock.h"
#include "server/store/prefix_cache.h"

namespace memra {

// An engine's share of block_store_max_mapped_buffers: 1 / this (at least one buffer).
inline constexpr size_t kBlockStoreEngineShareDivisor = 4;

struct BlockStoreLimits {
  // Bytes an engine may have offered and registered at once (block_store_engine_bytes).
  uint64_t engine_bytes = uint64_t{64} << 30;
  // One registration's worth (BlockPoolLimits::max_buffers): each offer holds a descriptor.
  size_t offers_per_engine = 256;
  size_t registrations_per_engine = 16;
  // Daemon-wide, all engines together: offers (descriptors) and registered buffers (mappings).
  size_t max_offers = 512;
  size_t max_mapped_buffers = 4096;
  // One engine's share of max_mapped_buffers (the daemon sets a quarter of it, at least 1), so
  // no single engine can take the whole daemon-wide cap.
  size_t mapped_buffers_per_engine = 1024;
  size_t pins_per_engine = 1024;
  // Bytes one engine may hold pinned at once (a pin keeps its entries from eviction and
  // demotion, so without a bound one engine could hold the whole cache for everyone): the daemon
  // sets a quarter of prefix_cache_budget_bytes. 0: no pins at all.
  uint64_t pinned_bytes_per_engine = uint64_t{1} << 40;
  absl::Duration max_pin_ttl = absl::Seconds(60);
  size_t max_keys = 65536;  // per call
  BlockPoolLimits pool;
};

// One buffer of a registration as the engine names it (EngineBufferRef): an offered handoff
// buffer (host), or, when `cuda_ipc_handle` is set, an allocation of the engine's GPU memory.
struct EngineBufferRequest {
  uint64_t handoff_buffer_id = 0;
  // cudaIpcMemHandle_t bytes (DeviceBackend::MapEngineIpcBuffers).
  std::string cuda_ipc_handle = {};
  uint64_t bytes = 0;
  uint64_t offset_in_allocation = 0;
};

// What a call names blocks by (BlockKeys): the engine's hashes or token ids from position 0.
struct BlockKeyRequest {
  std::vector<std::string> hashes;
  std::vector<int32_t> token_ids;
};

struct BlockStoreRegistration {
  uint64_t registration_id = 0;
  std::vector<BlockGroupLayout> groups;
};

struct BlockLookup {
  uint64_t matched_blocks = 0;
  uint64_t pin_id = 0;
  StorageMedium medium = StorageMedium::kDevice;
};

// A StoreBlocks or LoadBlocks call after authentication.
struct BlockTransfer {
  uint64_t registration_id = 0;
  uint32_t kv_group = 0;
  BlockKeyRequest keys;
  std::vector<uint32_t> block_ids;
  uint32_t skip_blocks = 0;
  // Store: routers' event fields (never keys).
  std::string parent_hash;
  std::vector<int32_t> event_token_ids;
  std::vector<std::string> event_block_hashes;  // none, or one per block (else keys.hashes)
  // Load: the LookupBlocks pin this call releases (0: none).
  uint64_t pin_id = 0;
};

struct BlockTransferResult {
  std::vector<PoolBlockResult> blocks;  // one per block id, in order
  uint64_t copied_bytes = 0;
};

class BlockStore {
 public:
  // Whether handoff connection `connection` is open and serves engine `engine`
  // (ArenaHandoff::ServesEngine).
  using ConnectionCheck = std::function<bool(uint64_t connection, uint64_t engine)>;

  // `cache` null: every call but OfferBuffer is FAILED_PRECONDITION (no prefix cache). `cache`,
  // `backend` and `clock` outlive this. Offer, registration and pin ids count up from
  // FirstIdOfEpoch(epoch).
  BlockStore(PrefixCache* cache, DeviceBackend* backend, Clock* clock, BlockStoreLimits limits,
             ConnectionCheck connection_open, uint64_t epoch = 0);

  // The first id a daemon of `epoch` issues. Consecutive epochs' ids lie 2^40 apart, so an id a
  // client kept from the previous daemon (a supervised restart keeps the engine and bumps the
  // epoch) names nothing here, never a new registration, offer or pin of the same engine.
  static uint64_t FirstIdOfEpoch(uint64_t epoch) {
    return ((epoch % (uint64_t{1} << 23)) << 40) + 1;
  }
  ~BlockStore();  // unmaps every registration
  BlockStore(const BlockStore&) = delete;
  BlockStore& operator=(const BlockStore&) = delete;

  // The handoff socket's intake (ArenaHandoff::BufferIntake). FAILED_PRECONDITION, checked in
  // this order: not sealed with F_SEAL_SHRINK (naming the seals), not on tmpfs (hugetlbfs and
  // others), not a regular file, smaller than `bytes`; no block store. RESOURCE_EXHAUSTED past
  // offers_per_engine, max_offers or engine_bytes.
  absl::StatusOr<uint64_t> OfferBuffer(uint64_t engine, uint64_t connection, uint64_t bytes,
                                       ScopedFd fd) ABSL_LOCKS_EXCLUDED(mu_);

  // RegisterEngineBuffers for engine `engine` of cache scope `scope`: `spec.buffer_bytes` are
  // the buffers' bytes. Refusals (nothing changes, no offer is used up): the layout's
  // (INVALID_ARGUMENT, core/block_layout.h); INVALID_ARGUMENT handoff buffers and CUDA IPC
  // handles mixed, or MapEngineIpcBuffers' refusals (FAILED_PRECONDITION on the host backend);
  // NOT_FOUND an unknown or used buffer id;
  // PERMISSION_DENIED another engine's; FAILED_PRECONDITION its connection closed or its file
  // smaller than offset_in_allocation + bytes; RESOURCE_EXHAUSTED past the per-engine limits or
  // max_mapped_buffers.
  absl::StatusOr<BlockStoreRegistration> Register(uint64_t engine, const std::string& scope,
                                                  BlockPoolSpec spec,
                                                  absl::Span<const EngineBufferRequest> buffers)
      ABSL_LOCKS_EXCLUDED(mu_);
  // NOT_FOUND unknown, PERMISSION_DENIED another engine's.
  absl::Status Unregister(uint64_t engine, uint64_t registration_id) ABSL_LOCKS_EXCLUDED(mu_);

  // LookupBlocks: `pin_ttl` zero = no pin; capped at max_pin_ttl.
  absl::StatusOr<BlockLookup> Lookup(uint64_t engine, uint64_t registration_id, uint32_t kv_group,
                                     const BlockKeyRequest& keys, absl::Duration pin_ttl)
      ABSL_LOCKS_EXCLUDED(mu_);
  // StoreBlocks / LoadBlocks (block_store.proto): a malformed call (bad block ids, key counts,
  // an unknown group) is refused whole with the numbers and nothing copied.
  absl::StatusOr<BlockTransferResult> Store(uint64_t engine, const BlockTransfer& transfer)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<BlockTransferResult> Load(uint64_t engine, const BlockTransfer& transfer)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Unpin(uint64_t engine, uint64_t pin_id) ABSL_LOCKS_EXCLUDED(mu_);

  // The engine's lease ended or it was reclaimed: its offers, registrations and pins go.
  void ForgetEngine(uint64_t engine) ABSL_LOCKS_EXCLUDED(mu_);
  // Releases pins whose TTL passed (the daemon's lease thread).
  void ExpirePins() ABSL_LOCKS_EXCLUDED(mu_);
  // Closes offers whose handoff connection no longer serves their engine (it closed, or a
  // re-attach replaced it): they could never register (the daemon's lease thread).
  void ExpireOffers() ABSL_LOCKS_EXCLUDED(mu_);
  // Engines holding anything here (the daemon checks their leases).
  std::vector<uint64_t> Engines() const ABSL_LOCKS_EXCLUDED(mu_);

  struct Counts {
    size_t offers = 0;
    size_t registrations = 0;
    size_t pins = 0;
    uint64_t registered_bytes = 0;
  };
  Counts counts() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Offer {
    uint64_t engine = 0;
    uint64_t connection = 0;
    uint64_t bytes = 0;
    ScopedFd fd;  // sealed against shrinking (OfferBuffer)
  };
  struct Registration {
    uint64_t engine = 0;
    ArenaId arena;
    std::vector<uint64_t> base;  // each buffer's start in `arena`
    uint64_t bytes = 0;          // the buffers' bytes (charged to engine_bytes)
    BlockPoolLayout layout;
    std::vector<ScopedShape> spaces;  // per group of layout.groups: the scoped key space
    DeviceBackend* backend = nullptr;
    ~Registration();  // unmaps
  };
  // A policy over the cache's pins (PrefixCache::LookupPoolBlocks with pin: the index's entry
  // pins and the pieces' kRestore holds in its PieceLedger): who may hold them, how many bytes,
  // and for how long (expires).
  struct Pin {
    uint64_t engine = 0;
    std::vector<EntryId> entries;
    uint64_t bytes = 0;  // the pinned blocks' (and state's) stored bytes
    absl::Time expires;
  };
  // A transfer resolved against its registration: keys, the blocks' pool pieces.
  struct Resolved {
    std::shared_ptr<Registration> registration;
    const BlockGroupLayout* group = nullptr;
    const ScopedShape* space = nullptr;
    std::vector<BlockKey> keys;
    uint64_t first = 0;  // keys[first] is block_ids[0]'s
  };

  absl::Status Enabled() const;
  // NOT_FOUND unknown, PERMISSION_DENIED another engine's.
  absl::StatusOr<std::shared_ptr<Registration>> Owned(uint64_t engine, uint64_t registration_id)
      const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Resolved> Resolve(uint64_t engine, uint64_t registration_id, uint32_t kv_group,
                                   const BlockKeyRequest& keys) const ABSL_LOCKS_EXCLUDED(mu_);
  // Resolve() and the call's block ids checked (CheckBlockIds; `distinct` for a load).
  absl::StatusOr<Resolved> ResolveTransfer(uint64_t engine, const BlockTransfer& transfer,
                                           bool distinct) const ABSL_LOCKS_EXCLUDED(mu_);
  // Removes and returns pin `pin_id` of `engine`: NOT_FOUND, PERMISSION_DENIED another's.
  // RESOURCE_EXHAUSTED when `engine` holds pins_per_engine pins, or pinning `bytes` more would
  // pass pinned_bytes_per_engine (both numbers named).
  absl::Status CheckPinRoomLocked(uint64_t engine, uint64_t bytes) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Pin> TakePinLocked(uint64_t engine, uint64_t pin_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The pool pieces of block `block_id` (or its state slot) of the resolved group.
  PoolBlock PoolBlockOf(const Resolved& resolved, const BlockKey& key, uint32_t block_id,
                        bool state) const;
  uint64_t EngineBytesLocked(uint64_t engine) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  template <typename Map>
  static size_t CountOf(const Map& map, uint64_t engine);

  // Constant after construction.
  PrefixCache* const cache_;
  DeviceBackend* const backend_;
  Clock* const clock_;
  const BlockStoreLimits limits_;
  const ConnectionCheck connection_open_;

  mutable absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_);  // offers, registrations and pins
  absl::flat_hash_map<uint64_t, Offer> offers_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, std::shared_ptr<Registration>> registrations_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, Pin> pins_ ABSL_GUARDED_BY(mu_);
};

}  // namespace memra

#endif  // MEMRA_SERVER_BLOCK_STORE_H_
