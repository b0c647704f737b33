#ifndef MEMRA_SERVER_ARENA_POOL_H_
#define MEMRA_SERVER_ARENA_POOL_H_

// Released session arenas kept for the same engine's next CreateSession of the same size, so an
// engine that creates a session per request neither pays for a new arena (host: a new shm
// object zeroed by posix_fallocate; cuda: cudaMalloc) nor for a new mapping in its own process
// (the client keeps the mapping of a pooled arena: its export handle is unchanged).
//
// Rules (docs/architecture.md#arena-pool):
//  * Pools are per engine and keyed by the arena's exact bytes (its size class: admission
//    charges exactly an arena's bytes, so only an arena of exactly the new session's bytes can
//    serve it). An arena never moves to another engine: that engine may still have it mapped.
//  * A pooled arena keeps its admission charge (it still holds device memory, under its
//    engine's name: it counts toward that engine's max_engine_arenas and budget share); the
//    pool's bytes are evictable in the admission ledger, so an admission short of room frees
//    the asking engine's own pooled arenas first, then any engine's (oldest first), before
//    refusing (DeviceBudget's eviction protocol).
//  * Freed (evicted, drained, over the bound) pooled arenas are remembered per engine until
//    the engine is told (TakeUnmapped) so its client can drop their mappings.
//  * An engine's pool is freed when its lease ends or it is reclaimed, and at shutdown.
//
// Thread-safety: thread-safe. Lock order: a DaemonSession's mutex before `mu_` (Put is called
// from Release); `mu_` before DeviceBudget's (SetEvictable); the backend and the budget's
// Release are called with `mu_` NOT held.
//
// Invariants: (1) pooled_bytes_ == the sum of the bytes of every pooled arena and the budget's
// arena-pool evictable bytes equal it after every public call; (2) every pooled arena holds
// exactly one live admission charge of its bytes; (3) an engine's pooled bytes stay within
// max_engine_bytes.

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "core/admission.h"
#include "server/device/backend.h"
#include "server/device/device_budget.h"

namespace memra {

// One arena held by the pool: the memory, its export (what the engine mapped) and its charge.
struct PooledArena {
  ArenaId arena;
  ArenaExport exported;
  AllocationId charge;
};

// One engine's pool figures (metrics, KvAdmin's engine status).
struct EngineArenaPoolStats {
  uint64_t pooled_bytes = 0;
  uint64_t pooled_arenas = 0;
  uint64_t hits = 0;        // CreateSessions served from the pool
  uint64_t new_arenas = 0;  // session arenas created for it (each a new mapping in the engine)
};

class ArenaPool {
 public:
  // `max_engine_bytes`: DaemonConfig arena_pool_engine_bytes (0: nothing is pooled).
  // REQUIRES: backend and budget outlive the pool.
  ArenaPool(DeviceBackend* backend, DeviceBudget* budget, uint64_t max_engine_bytes);
  ~ArenaPool();  // DrainAll()

  // A pooled arena of exactly `bytes` that `engine` released, counted as a hit; nullopt when
  // there is none.
  std::optional<PooledArena> Take(uint64_t engine, uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // Counts a session arena created for `engine` (a new mapping there).
  void NoteNewArena(uint64_t engine) ABSL_LOCKS_EXCLUDED(mu_);
  // Keeps `arena` for `engine`'s next session of its size; false when that would pass the
  // engine's bound (the caller frees it then). Never fails otherwise.
  bool Put(uint64_t engine, PooledArena arena) ABSL_LOCKS_EXCLUDED(mu_);
  // Put, or frees `arena` when the pool cannot keep it (a Take the caller could not use).
  void Return(uint64_t engine, PooledArena arena) ABSL_LOCKS_EXCLUDED(mu_);
  // The handles of `engine`'s pooled arenas freed since it was last told (its client unmaps
  // them), emptied.
  std::vector<std::string> TakeUnmapped(uint64_t engine) ABSL_LOCKS_EXCLUDED(mu_);

  // Frees every pooled arena of `engine` (lease ended, reclaim, or its own admission needs the
  // room); `forget`: also drop its counters and unmapped handles (the engine is gone). Returns
  // the bytes freed.
  uint64_t DrainEngine(uint64_t engine, bool forget) ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t DrainAll() ABSL_LOCKS_EXCLUDED(mu_);
  // DeviceBudget evictor: frees pooled arenas, oldest first, until `bytes` are freed or none is
  // left. Returns the bytes freed.
  uint64_t Evict(uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // Installs Evict as `budget`'s arena-pool evictor and DrainEngine as its owner evictor (the
  // budget must not outlive this pool).
  void InstallEvictor(DeviceBudget& budget);

  uint64_t pooled_bytes() const ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t pooled_bytes(uint64_t engine) const ABSL_LOCKS_EXCLUDED(mu_);
  // Engine id -> its figures (engines with any).
  absl::flat_hash_map<uint64_t, EngineArenaPoolStats> Stats() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Pooled {
    PooledArena arena;
    uint64_t engine = 0;
    uint64_t sequence = 0;  // age, for eviction
  };
  struct EnginePool {
    absl::flat_hash_map<uint64_t, std::deque<Pooled>> by_bytes;  // size class -> arenas
    EngineArenaPoolStats stats;
    std::vector<std::string> unmapped;  // handles freed since the engine was last told
  };

  // Removes the pooled arenas `pick` chooses (engine, its pool) and returns them to be freed.
  template <typename Pick>
  std::vector<Pooled> RemoveLocked(Pick pick) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees arenas removed from the pool (mu_ not held); the bytes freed.
  uint64_t Free(const std::vector<Pooled>& removed) ABSL_LOCKS_EXCLUDED(mu_);
  void PublishEvictableLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  DeviceBackend* const backend_;
  DeviceBudget* const budget_;
  const uint64_t max_engine_bytes_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, EnginePool> engines_ ABSL_GUARDED_BY(mu_);
  uint64_t pooled_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_sequence_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace memra

#endif  // MEMRA_SERVER_ARENA_POOL_H_
