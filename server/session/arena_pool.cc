#include "server/session/arena_pool.h"

#include <algorithm>
#include <utility>

#include "spdlog/spdlog.h"

namespace memra {

ArenaPool::ArenaPool(DeviceBackend* backend, DeviceBudget* budget, uint64_t max_engine_bytes)
    : backend_(backend), budget_(budget), max_engine_bytes_(max_engine_bytes) {}

ArenaPool::~ArenaPool() { DrainAll(); }

std::optional<PooledArena> ArenaPool::Take(uint64_t engine, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  auto pool = engines_.find(engine);
  if (pool == engines_.end()) return std::nullopt;
  auto size_class = pool->second.by_bytes.find(bytes);
  if (size_class == pool->second.by_bytes.end()) return std::nullopt;
  // The most recently pooled: its memory is the likeliest still in the engine's caches.
  PooledArena taken = std::move(size_class->second.back().arena);
  size_class->second.pop_back();
  if (size_class->second.empty()) pool->second.by_bytes.erase(size_class);
  EngineArenaPoolStats& stats = pool->second.stats;
  stats.pooled_bytes -= bytes;
  --stats.pooled_arenas;
  ++stats.hits;
  pooled_bytes_ -= bytes;
  PublishEvictableLocked();
  return taken;
}

void ArenaPool::NoteNewArena(uint64_t engine) {
  absl::MutexLock lock(&mu_);
  ++engines_[engine].stats.new_arenas;
}

bool ArenaPool::Put(uint64_t engine, PooledArena arena) {
  const uint64_t bytes = arena.exported.bytes;
  absl::MutexLock lock(&mu_);
  EnginePool& pool = engines_[engine];
  if (bytes > max_engine_bytes_ || pool.stats.pooled_bytes > max_engine_bytes_ - bytes) {
    return false;
  }
  pool.by_bytes[bytes].push_back(Pooled{std::move(arena), engine, next_sequence_++});
  pool.stats.pooled_bytes += bytes;
  ++pool.stats.pooled_arenas;
  pooled_bytes_ += bytes;
  PublishEvictableLocked();
  return true;
}

void ArenaPool::Return(uint64_t engine, PooledArena arena) {
  if (Put(engine, arena)) return;
  (void)Free({Pooled{std::move(arena), engine, 0}});
}

std::vector<std::string> ArenaPool::TakeUnmapped(uint64_t engine) {
  absl::MutexLock lock(&mu_);
  auto pool = engines_.find(engine);
  if (pool == engines_.end()) return {};
  return std::exchange(pool->second.unmapped, {});
}

template <typename Pick>
std::vector<ArenaPool::Pooled> ArenaPool::RemoveLocked(Pick pick) {
  std::vector<Pooled> removed;
  for (auto& [engine, pool] : engines_) {
    for (auto size_class = pool.by_bytes.begin(); size_class != pool.by_bytes.end();) {
      std::deque<Pooled>& arenas = size_class->second;
      for (auto it = arenas.begin(); it != arenas.end();) {
        if (!pick(*it)) {
          ++it;
          continue;
        }
        const uint64_t bytes = it->arena.exported.bytes;
        pool.stats.pooled_bytes -= bytes;
        --pool.stats.pooled_arenas;
        pooled_bytes_ -= bytes;
        pool.unmapped.push_back(it->arena.exported.handle);
        removed.push_back(std::move(*it));
        it = arenas.erase(it);
      }
      if (arenas.empty()) {
        pool.by_bytes.erase(size_class++);
      } else {
        ++size_class;
      }
    }
  }
  PublishEvictableLocked();
  return removed;
}

uint64_t ArenaPool::Free(const std::vector<Pooled>& removed) {
  uint64_t freed = 0;
  for (const Pooled& pooled : removed) {
    if (absl::Status status = backend_->FreeArena(pooled.arena.arena); !status.ok()) {
      // As DaemonSession::FreeLayout: the charge stays, so admission never hands out bytes
      // the device may not have; the backend frees everything at shutdown.
      spdlog::error("arena pool: freeing {} of engine {} failed: {}",
                    pooled.arena.arena.value, pooled.engine, status.ToString());
      continue;
    }
    if (absl::Status status = budget_->Release(pooled.arena.charge); !status.ok()) {
      spdlog::error("arena pool: releasing the charge of {} failed: {}",
                    pooled.arena.arena.value, status.ToString());
    }
    freed += pooled.arena.exported.bytes;
  }
  return freed;
}

uint64_t ArenaPool::DrainEngine(uint64_t engine, bool forget) {
  std::vector<Pooled> removed;
  {
    absl::MutexLock lock(&mu_);
    removed = RemoveLocked([engine](const Pooled& pooled) { return pooled.engine == engine; });
    if (forget) engines_.erase(engine);
  }
  return Free(removed);
}

uint64_t ArenaPool::DrainAll() {
  std::vector<Pooled> removed;
  {
    absl::MutexLock lock(&mu_);
    removed = RemoveLocked([](const Pooled&) { return true; });
    engines_.clear();
  }
  return Free(removed);
}

uint64_t ArenaPool::Evict(uint64_t bytes) {
  std::vector<Pooled> removed;
  {
    absl::MutexLock lock(&mu_);
    // The oldest arenas worth `bytes`: the sequence below which they lie.
    std::vector<std::pair<uint64_t, uint64_t>> ages;  // (sequence, bytes)
    for (const auto& [engine, pool] : engines_) {
      for (const auto& [size, arenas] : pool.by_bytes) {
        for (const Pooled& pooled : arenas) ages.emplace_back(pooled.sequence, size);
      }
    }
    std::sort(ages.begin(), ages.end());
    uint64_t chosen = 0;
    uint64_t below = 0;
    for (const auto& [sequence, size] : ages) {
      if (chosen >= bytes) break;
      chosen += size;
      below = sequence + 1;
    }
    removed = RemoveLocked([below](const Pooled& pooled) { return pooled.sequence < below; });
  }
  const uint64_t freed = Free(removed);
  if (freed > 0) {
    spdlog::info("arena pool: evicted {} arenas ({} bytes) for admission", removed.size(), freed);
  }
  return freed;
}

void ArenaPool::InstallEvictor(DeviceBudget& budget) {
  budget.SetEvictor(EvictableSource::kArenaPool, [this](uint64_t bytes) { return Evict(bytes); });
  budget.SetOwnerEvictor(
      [this](uint64_t engine) { return DrainEngine(engine, /*forget=*/false); });
}

void ArenaPool::PublishEvictableLocked() {
  budget_->SetEvictable(EvictableSource::kArenaPool, pooled_bytes_);
}

uint64_t ArenaPool::pooled_bytes() const {
  absl::MutexLock lock(&mu_);
  return pooled_bytes_;
}

uint64_t ArenaPool::pooled_bytes(uint64_t engine) const {
  absl::MutexLock lock(&mu_);
  auto pool = engines_.find(engine);
  return pool == engines_.end() ? 0 : pool->second.stats.pooled_bytes;
}

absl::flat_hash_map<uint64_t, EngineArenaPoolStats> ArenaPool::Stats() const {
  absl::flat_hash_map<uint64_t, EngineArenaPoolStats> stats;
  absl::MutexLock lock(&mu_);
  for (const auto& [engine, pool] : engines_) stats[engine] = pool.stats;
  return stats;
}

}  // namespace memra
