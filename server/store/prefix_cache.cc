#include "server/store/prefix_cache.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/checked_math.h"
#include "core/status_macros.h"
#include "server/store/remote/read_through.h"
#include "spdlog/spdlog.h"

namespace memra {
namespace {

// What routers index (prefix.proto PrefixEvent 20-25) of the blocks `plan` adds, whether a
// capture or a remote pull adds them: their token ids, parent and the engine that stored them;
// their hashes are the block keys themselves. `tokens` covers at least plan.boundary_tokens.
void FillOrigin(CapturePlan& plan, absl::Span<const int32_t> tokens, uint64_t block,
                uint64_t engine_id) {
  plan.origin.block_tokens = static_cast<uint32_t>(block);
  plan.origin.engine_id = engine_id;
  if (plan.already_present) return;
  plan.origin.token_ids.assign(tokens.begin() + plan.first_new_block * block,
                               tokens.begin() + plan.boundary_tokens);
  if (plan.first_new_block > 0) {
    const BlockKey& parent = plan.chain[plan.first_new_block - 1];
    plan.origin.parent_block_hash.assign(parent.begin(), parent.end());
  }
}

// The store's local tiers: the device's slabs, then the host tier and the disk where there are.
TierChain ChainOf(const PrefixCacheOptions& options, DeviceBackend* backend, SlabAllocator* slabs,
                  SlabAllocator* host_slabs, HostTierMemory* host_memory, DiskTier* disk,
                  std::function<void(const SlabSpan&)> free_device_span) {
  TierChain chain;
  chain.Add(DeviceStoreTier(backend, slabs, options.budget_bytes, std::move(free_device_span)));
  if (host_slabs != nullptr) {
    chain.Add(HostStoreTier(host_slabs, host_memory, options.host_tier_bytes));
  }
  if (disk != nullptr) chain.Add(DiskStoreTier(disk));
  return chain;
}

bool IsFresh(const SessionState& state) {
  if (!state.kv().state().IsFresh() || state.position() != 0) return false;
  return std::all_of(state.latent().begin(), state.latent().end(),
                     [](const LatentLayerState& latent) { return latent.len == 0; });
}

}  // namespace

absl::StatusOr<std::unique_ptr<PrefixCache>> PrefixCache::Create(
    const PrefixCacheOptions& options, DeviceBackend* backend, DeviceBudget* budget,
    std::unique_ptr<HostMemoryProvider> host_memory) {
  if (backend == nullptr) return absl::InvalidArgumentError("PrefixCache needs a backend");
  if ((options.host_tier_bytes > 0) != (host_memory != nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefix host tier of ", options.host_tier_bytes, " bytes ",
        host_memory == nullptr ? "has no memory provider" : "is off but was given memory"));
  }
  if (options.budget_bytes == 0) {
    return absl::InvalidArgumentError("prefix cache budget is 0 bytes (0 disables the cache)");
  }
  if (options.copy_threads == 0 || options.parallel_copy_bytes == 0 ||
      options.checksum_slice_bytes == 0 || options.demotion_chunk_bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefix copy_threads (", options.copy_threads, "), parallel_copy_bytes (",
        options.parallel_copy_bytes, "), checksum_slice_bytes (", options.checksum_slice_bytes,
        ") and demotion_chunk_bytes (", options.demotion_chunk_bytes,
        ") must all be at least 1"));
  }
  SlabAllocatorOptions slab_options;
  // A slab larger than the whole budget would charge the device for memory the cache may
  // never use; at the budget, emptied slabs are kept for the next capture (warm storage).
  slab_options.slab_bytes = std::min(options.slab_bytes, options.budget_bytes);
  // Kept up to the budget in whole slabs plus one: spans fragment, so the slabs of a cache at
  // its budget can total one slab more, and a slab emptied by an eviction must stay for the
  // next copy instead of going back to the kernel (a new one is zeroed page by page). Empty
  // slabs are still the first thing an admission takes back (EvictForAdmission).
  const uint64_t slab = slab_options.slab_bytes;
  const uint64_t kept_slabs = options.budget_bytes / slab + (options.budget_bytes % slab != 0) + 1;
  ASSIGN_OR_RETURN(slab_options.keep_empty_bytes, CheckedMul(kept_slabs, slab, "prefix slabs kept"));
  ASSIGN_OR_RETURN(std::unique_ptr<SlabAllocator> slabs,
                   SlabAllocator::Create(slab_options, backend, budget));
  std::unique_ptr<DiskTier> disk;
  PrefixIndexOptions index_options;
  // The index holds what every tier holds; each tier's own budget is kept by demotion.
  index_options.budget_bytes = options.budget_bytes;
  std::unique_ptr<HostTierMemory> host_tier_memory;
  std::unique_ptr<SlabAllocator> host_slabs;
  if (options.host_tier_bytes > 0) {
    host_tier_memory = std::make_unique<HostTierMemory>(std::move(host_memory));
    SlabAllocatorOptions host_options;
    host_options.slab_bytes = std::min(options.slab_bytes, options.host_tier_bytes);
    host_options.alignment = slab_options.alignment;  // a piece's span is as large in both
    host_options.keep_empty_bytes = options.host_tier_bytes;
    ASSIGN_OR_RETURN(host_slabs,
                     SlabAllocator::Create(host_options, host_tier_memory.get(), nullptr));
    ASSIGN_OR_RETURN(index_options.budget_bytes,
                     CheckedAdd(index_options.budget_bytes, options.host_tier_bytes,
                                "prefix tier budgets"));
  }
  if (!options.disk_dir.empty()) {
    DiskTierOptions disk_options;
    disk_options.dir = options.disk_dir;
    disk_options.budget_bytes = options.disk_bytes;
    disk_options.queue_depth = options.disk_queue_depth;
    ASSIGN_OR_RETURN(disk, DiskTier::Create(disk_options));
    ASSIGN_OR_RETURN(index_options.budget_bytes,
                     CheckedAdd(index_options.budget_bytes, options.disk_bytes,
                                "prefix tier budgets"));
  }
  index_options.block_tokens = options.block_tokens;
  index_options.epoch = options.epoch;
  index_options.event_capacity = options.event_capacity;
  ASSIGN_OR_RETURN(PrefixIndex index, PrefixIndex::Create(index_options));
  std::unique_ptr<RemoteTier> remote;
  if (options.remote.has_value()) {
    if (options.remote_lookup_timeout <= absl::ZeroDuration() ||
        options.remote_fetch_timeout <= absl::ZeroDuration()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prefix remote lookup timeout (", absl::FormatDuration(options.remote_lookup_timeout),
          ") and fetch timeout (", absl::FormatDuration(options.remote_fetch_timeout),
          ") must be positive"));
    }
    ASSIGN_OR_RETURN(remote, RemoteTier::Create(*options.remote));
  }
  return std::unique_ptr<PrefixCache>(new PrefixCache(
      options, std::move(index), backend, budget, std::move(slabs), std::move(disk),
      std::move(host_tier_memory), std::move(host_slabs), std::move(remote)));
}

PrefixCache::PrefixCache(const PrefixCacheOptions& options, PrefixIndex index,
                         DeviceBackend* backend, DeviceBudget* budget,
                         std::unique_ptr<SlabAllocator> slabs, std::unique_ptr<DiskTier> disk,
                         std::unique_ptr<HostTierMemory> host_memory,
                         std::unique_ptr<SlabAllocator> host_slabs,
                         std::unique_ptr<RemoteTier> remote)
    : options_(options),
      backend_(backend),
      budget_(budget),
      copier_(backend, SliceCopierOptions{.copy_threads = options.copy_threads,
                                          .parallel_copy_bytes = options.parallel_copy_bytes,
                                          .slice_bytes = options.checksum_slice_bytes}),
      slabs_(std::move(slabs)),
      disk_(std::move(disk)),
      host_memory_(std::move(host_memory)),
      host_slabs_(std::move(host_slabs)),
      tiers_(ChainOf(options, backend, slabs_.get(), host_slabs_.get(), host_memory_.get(),
                     disk_.get(), [this](const SlabSpan& span) { ledger_.FreeSpan(span); })),
      ledger_(slabs_.get()),
      remote_(std::move(remote)),
      index_(std::move(index)) {}

// slabs_ frees every slab, its charge and the budget's evictable bytes; disk_ every file;
// host_slabs_ every host-tier slab (before host_memory_ goes).
PrefixCache::~PrefixCache() = default;

void PrefixCache::FreeInTier(uint64_t handle, const Storage& storage) {
  StoreTier* tier = tiers_.tier(storage.medium);
  if (tier == nullptr) {  // kRemote: never a stored piece's medium (pulled into DEVICE first)
    spdlog::error("prefix cache: piece {} claims the {} tier, which this store has not", handle,
                  StorageMediumName(storage.medium));
    return;
  }
  tier->Erase(handle, storage);
}

void PrefixCache::FreeHandles(const std::vector<uint64_t>& handles) {
  for (uint64_t handle : handles) {
    auto it = storage_.find(handle);
    if (it == storage_.end()) continue;
    const Storage& storage = it->second;
    const size_t tier = static_cast<size_t>(storage.medium);
    tier_stored_bytes_[tier] -= storage.span.bytes;
    if (auto moving = moving_.find(handle); moving != moving_.end()) {
      // A demotion is copying these bytes: it frees them when it commits.
      moving->second.released = true;
      tier_leaving_bytes_[tier] -= storage.span.bytes;
      tier_incoming_bytes_[static_cast<size_t>(moving->second.to)] -=
          IncomingBytes(moving->second);
    } else {
      FreeInTier(handle, storage);
    }
    storage_.erase(it);
  }
}

namespace {

// Every piece handle of `entry`: its blocks in chain order, then its boundary state.
std::vector<uint64_t> EntryHandles(const EntryView& entry) {
  std::vector<uint64_t> handles;
  handles.reserve(entry.blocks.size() + 1);
  for (const LookupBlock& block : entry.blocks) handles.push_back(block.stored.storage_handle);
  if (entry.boundary.has_value()) handles.push_back(entry.boundary->storage_handle);
  return handles;
}

}  // namespace

std::vector<PieceLedger::Hold> PrefixCache::HoldPieces(const EntryView& entry) {
  std::vector<PieceLedger::Hold> holds;
  for (uint64_t handle : EntryHandles(entry)) {
    absl::StatusOr<PieceLedger::Hold> hold =
        ledger_.Take(HoldKind::kRestore, handle, std::nullopt);  // a handle-only hold never fails
    if (hold.ok()) holds.push_back(*std::move(hold));
  }
  return holds;
}

void PrefixCache::HoldSlabs(std::vector<PieceLedger::Hold>& holds) {
  for (PieceLedger::Hold& hold : holds) {
    auto it = storage_.find(hold.handle());
    if (it == storage_.end() || it->second.medium != StorageMedium::kDevice ||
        hold.span().has_value()) {
      continue;
    }
    if (absl::Status status = ledger_.AttachSpan(hold, it->second.span); !status.ok()) {
      spdlog::error("prefix cache: {}", status.ToString());
    }
  }
}

uint64_t PrefixCache::IncomingBytes(const Move& move) const {
  return tiers_.tier(move.to)->IncomingBytes(move.source);
}

void PrefixCache::RebalanceTiers() {
  absl::MutexLock lock(&mu_);
  Rebalance();
}

void PrefixCache::Rebalance() {
  // Top down: what the device tier pushes out lands in the tier below, which makes room first
  // (the host tier demotes its own LRU pieces, the disk tier evicts LRU entries); then the
  // host tier is brought within its budget in case room could not be made before.
  DemoteDownTo(StorageMedium::kDevice, tiers_.Budget(StorageMedium::kDevice));
  if (host_slabs_ != nullptr) {
    DemoteDownTo(StorageMedium::kPinnedHost, tiers_.Budget(StorageMedium::kPinnedHost));
  }
}

void PrefixCache::MakeHostRoom() {
  constexpr size_t kHost = static_cast<size_t>(StorageMedium::kPinnedHost);
  const uint64_t budget = options_.host_tier_bytes;
  const uint64_t incoming = tier_incoming_bytes_[kHost];
  DemoteDownTo(StorageMedium::kPinnedHost, budget > incoming ? budget - incoming : 0);
}

size_t PrefixCache::EvictForRoomIn(StorageMedium medium, absl::FunctionRef<bool()> has_room) {
  const auto in_medium = [&](uint64_t handle) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = storage_.find(handle);
    return it != storage_.end() && it->second.medium == medium &&
           !ledger_.HeldAs(handle, HoldKind::kDemotion);
  };
  // A piece there that evictions can free: not one a pinned entry uses (nor being promoted
  // for one), whose holders would be evicted for nothing.
  const auto freeable_in_medium = [&](uint64_t handle) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return in_medium(handle) && ledger_.MayGo(handle);
  };
  // One pass over the LRU order, evicting the entries `qualifies` accepts.
  const auto pass = [&](auto qualifies) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    size_t evicted = 0;
    std::optional<EntryId> next = index_.LeastRecentEntry();
    while (next.has_value() && !has_room()) {
      const EntryId id = *next;
      // Read before `id` may leave the index (evicting it removes no other entry).
      next = index_.EntryUsedAfter(id).value_or(std::nullopt);
      if (!qualifies(id)) continue;
      absl::StatusOr<EvictionResult> eviction = index_.EvictEntry(id);
      if (!eviction.ok()) continue;  // pinned
      FreeHandles(eviction->freed_handles);
      ++evicted;
    }
    return evicted;
  };
  // First: only entries whose eviction frees a piece there (HandlesFreedByEvicting refuses a
  // pinned entry).
  size_t evicted = pass([&](EntryId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    absl::StatusOr<std::vector<uint64_t>> freed = index_.HandlesFreedByEvicting(id);
    return freed.ok() && std::any_of(freed->begin(), freed->end(), in_medium);
  });
  if (has_room()) return evicted;
  // Then entries holding a piece there: a prefix and its extension go in LRU order until the
  // pieces they share are freed.
  evicted += pass([&](EntryId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    absl::StatusOr<EntryView> view = index_.GetEntry(id);
    if (!view.ok() || view->pins > 0) return false;
    const std::vector<uint64_t> handles = EntryHandles(*view);
    return std::any_of(handles.begin(), handles.end(), freeable_in_medium);
  });
  return evicted;
}

bool PrefixCache::MakeDiskRoom() {
  const uint64_t budget = disk_->budget_bytes();
  auto has_room = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return disk_->stored_bytes() +
               tier_incoming_bytes_[static_cast<size_t>(StorageMedium::kDisk)] <=
           budget;
  };
  // The least recently used entries whose eviction frees a piece on disk leave the cache.
  EvictForRoomIn(StorageMedium::kDisk, has_room);
  return has_room();
}

std::vector<uint64_t> PrefixCache::PlanMoves(StorageMedium from, StorageMedium to,
                                             uint64_t bytes) {
  std::vector<uint64_t> planned;
  uint64_t planned_bytes = 0;
  // The LRU order walked in place (a copy of it would cost every entry per plan).
  for (std::optional<EntryId> id = index_.LeastRecentEntry();
       id.has_value() && planned_bytes < bytes;
       id = index_.EntryUsedAfter(*id).value_or(std::nullopt)) {
    absl::StatusOr<EntryView> view = index_.GetEntry(*id);
    if (!view.ok() || view->pins > 0) continue;
    const std::vector<uint64_t> handles = EntryHandles(*view);
    for (size_t i = 0; i < handles.size() && planned_bytes < bytes; ++i) {
      const uint64_t handle = handles[i];
      auto it = storage_.find(handle);
      if (it == storage_.end() || it->second.medium != from || !ledger_.MayGo(handle)) {
        continue;
      }
      Move move;
      move.handle = handle;
      move.to = to;
      move.source = it->second;
      move.fingerprint = view->fingerprint;
      move.boundary = i >= view->blocks.size();
      move.key = move.boundary ? view->blocks.back().key : view->blocks[i].key;
      // Held while it is read (a device span as a capture's: not evictable device memory).
      absl::StatusOr<PieceLedger::Hold> hold = ledger_.Take(
          HoldKind::kDemotion, handle,
          from == StorageMedium::kDevice ? std::optional<SlabSpan>(move.source.span) : std::nullopt);
      if (!hold.ok()) {
        spdlog::error("prefix cache: {}", hold.status().ToString());
        continue;
      }
      move.hold = *std::move(hold);
      tier_leaving_bytes_[static_cast<size_t>(from)] += move.source.span.bytes;
      tier_incoming_bytes_[static_cast<size_t>(to)] += IncomingBytes(move);
      planned_bytes += move.source.span.bytes;
      moving_.emplace(handle, std::move(move));
      planned.push_back(handle);
    }
  }
  return planned;
}

absl::StatusOr<PrefixCache::Storage> PrefixCache::CopyDown(uint64_t handle, const Storage& source,
                                                           StorageMedium to) {
  if (options_.before_demotion_copy) options_.before_demotion_copy(handle, to);
  const StoreTier& from = *tiers_.tier(source.medium);
  // The host tier's memory is read in place; a device piece is read into the tier below's memory
  // (host) or a buffer (disk).
  ASSIGN_OR_RETURN(std::optional<absl::Span<const uint8_t>> view, from.View(handle, source));
  return tiers_.tier(to)->Insert(
      handle, source,
      PieceSource{.view = view, .read_into = [&](absl::Span<uint8_t> out) {
                    return from.ReadInto(handle, source, out);
                  }});
}

size_t PrefixCache::RunMoves(const std::vector<uint64_t>& handles) {
  // Committed a chunk at a time: a restore waiting for a moving piece (PromotePinned) waits
  // for that piece's chunk, about demotion_chunk_bytes of copying, not the whole batch.
  size_t committed = 0;
  std::vector<uint64_t> chunk;
  uint64_t chunk_bytes = 0;
  for (size_t i = 0; i < handles.size(); ++i) {
    chunk_bytes += moving_.at(handles[i]).source.piece_bytes;
    chunk.push_back(handles[i]);
    if (chunk_bytes >= options_.demotion_chunk_bytes || i + 1 == handles.size()) {
      committed += MoveChunk(chunk);
      chunk.clear();
      chunk_bytes = 0;
    }
  }
  return committed;
}

size_t PrefixCache::MoveChunk(const std::vector<uint64_t>& handles) {
  // The bytes move without mu_: lookups, captures and restores of other pieces go on. The
  // sources stay put meanwhile: FreeHandles leaves a moving piece to us, a restore that pins
  // one waits for us (PromotePinned) or reads it where it is, and no other demotion plans it.
  // The chunk commits, and its kMoved events are recorded, in one hold of mu_: no reader sees
  // a committed piece before its event.
  // A piece evicted since it was planned (FreeHandles marked it released) is not copied: the
  // commit below frees its source either way.
  struct Planned {
    Storage source;
    StorageMedium to;
    bool released;
  };
  std::vector<Planned> planned;
  planned.reserve(handles.size());
  for (uint64_t handle : handles) {
    const Move& move = moving_.at(handle);
    planned.push_back({move.source, move.to, move.released});
  }
  std::vector<absl::StatusOr<Storage>> copies;
  mu_.Unlock();
  for (size_t i = 0; i < planned.size(); ++i) {
    copies.push_back(planned[i].released
                         ? absl::StatusOr<Storage>(absl::CancelledError("evicted before its copy"))
                         : CopyDown(handles[i], planned[i].source, planned[i].to));
  }
  mu_.Lock();
  size_t committed = 0;
  // Per entry fingerprint: the keys that moved (one kMoved event each).
  std::vector<std::tuple<PlanFingerprint, std::vector<BlockKey>, std::optional<BlockKey>>> events;
  for (size_t i = 0; i < planned.size(); ++i) {
    const uint64_t handle = handles[i];
    auto node = moving_.extract(handle);
    Move& move = node.mapped();
    const size_t from = static_cast<size_t>(move.source.medium);
    const size_t to = static_cast<size_t>(move.to);
    move.hold.Release();  // before its source may be freed below
    const absl::StatusOr<Storage>& copy = copies[i];
    if (move.released) {
      // Evicted or dropped while it moved: gone from the index, so from both tiers.
      if (copy.ok()) FreeInTier(handle, *copy);
      FreeInTier(handle, move.source);
      continue;
    }
    tier_leaving_bytes_[from] -= move.source.span.bytes;
    tier_incoming_bytes_[to] -= IncomingBytes(move);
    if (!copy.ok()) {
      spdlog::error("prefix cache: demoting a piece to {} failed: {}",
                    StorageMediumName(move.to), copy.status().ToString());
      continue;
    }
    if (ledger_.HeldAs(handle, HoldKind::kRestore)) {
      // A restore pinned it meanwhile (and may be reading it): it stays where it was.
      FreeInTier(handle, *copy);
      continue;
    }
    storage_[handle] = *copy;
    FreeInTier(handle, move.source);
    tier_stored_bytes_[from] -= move.source.span.bytes;
    tier_stored_bytes_[to] += copy->span.bytes;
    ++tier_demotions_[to];
    ++committed;
    auto event = std::find_if(events.begin(), events.end(),
                              [&](const auto& e) { return std::get<0>(e) == move.fingerprint; });
    if (event == events.end()) {
      events.emplace_back(move.fingerprint, std::vector<BlockKey>{}, std::nullopt);
      event = events.end() - 1;
    }
    if (move.boundary) {
      std::get<2>(*event) = move.key;
    } else {
      std::get<1>(*event).push_back(move.key);
    }
  }
  for (auto& [fingerprint, blocks, boundary] : events) {
    index_.RecordMoved(fingerprint, std::move(blocks), boundary, planned.front().to);
  }
  return committed;
}

size_t PrefixCache::DemoteDownTo(StorageMedium from, uint64_t target) {
  const size_t tier = static_cast<size_t>(from);
  const std::optional<StorageMedium> to = tiers_.Below(from);
  size_t moved = 0;
  // Each round demotes or evicts something, else it stops.
  while (tier_stored_bytes_[tier] - tier_leaving_bytes_[tier] > target) {
    const uint64_t excess = tier_stored_bytes_[tier] - tier_leaving_bytes_[tier] - target;
    if (!to.has_value()) {
      // The last tier: its least recently used entries leave the cache.
      return moved + EvictForRoomIn(from, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
               return tier_stored_bytes_[tier] - tier_leaving_bytes_[tier] <= target;
             });
    }
    std::vector<uint64_t> planned = PlanMoves(from, *to, excess);
    if (planned.empty()) return moved;  // nothing demotable (pinned, promoting or moving)
    if (*to == StorageMedium::kPinnedHost) MakeHostRoom();
    if (*to == StorageMedium::kDisk && !MakeDiskRoom()) {
      // Room for this batch (counted as incoming) cannot be made: some of its writes fail.
      spdlog::warn("prefix cache: the disk tier ({} of {} bytes, {} incoming) is full and no "
                   "entry on it is evictable", disk_->stored_bytes(), disk_->budget_bytes(),
                   tier_incoming_bytes_[static_cast<size_t>(StorageMedium::kDisk)]);
    }
    const size_t committed = RunMoves(planned);
    if (committed == 0) return moved;
    moved += committed;
  }
  return moved;
}

absl::Status PrefixCache::PromotePinned(const EntryView& entry) {
  const std::vector<uint64_t> handles = EntryHandles(entry);
  std::vector<std::pair<uint64_t, Storage>> claimed;
  // Released under mu_ (as demotions release theirs), which wakes the restores waiting below.
  std::vector<PieceLedger::Hold> promoting;
  {
    absl::MutexLock lock(&mu_);
    auto none_moving = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return std::none_of(handles.begin(), handles.end(), [&](uint64_t handle) {
        return ledger_.HeldAs(handle, HoldKind::kPromotion) ||
               ledger_.HeldAs(handle, HoldKind::kDemotion);
      });
    };
    mu_.Await(absl::Condition(&none_moving));
    for (uint64_t handle : handles) {
      auto it = storage_.find(handle);
      if (it == storage_.end() || it->second.medium == StorageMedium::kDevice) continue;
      absl::StatusOr<PieceLedger::Hold> hold =
          ledger_.Take(HoldKind::kPromotion, handle, std::nullopt);  // handle-only: never fails
      if (!hold.ok()) continue;
      promoting.push_back(*std::move(hold));
      claimed.emplace_back(handle, it->second);
    }
  }
  if (claimed.empty()) return absl::OkStatus();
  absl::Status status = absl::OkStatus();
  // Each new span under Allocate's hold, adopted by the ledger until the piece is recorded.
  std::vector<std::pair<uint64_t, PieceLedger::Hold>> promoted;
  for (const auto& [handle, storage] : claimed) {
    // The piece's bytes: the host tier's memory as it is (claimed: nothing frees it), or the
    // disk file read back.
    const StoreTier& from = *tiers_.tier(storage.medium);
    std::vector<uint8_t> buffer;
    absl::StatusOr<absl::Span<const uint8_t>> read = from.Read(handle, storage, buffer);
    status = read.status();
    if (!status.ok()) break;
    const absl::Span<const uint8_t> bytes = *read;
    const std::string where = from.Describe(handle, storage);
    const std::vector<uint64_t> slices = SliceChecksums(bytes, options_.checksum_slice_bytes);
    const std::vector<uint64_t>& sealed =
        storage.slice_checksums.empty() ? std::vector<uint64_t>{storage.checksum}
                                        : storage.slice_checksums;
    if (slices != sealed || PieceChecksum(slices) != storage.checksum) {
      size_t slice = 0;
      while (slice < slices.size() && slice < sealed.size() && slices[slice] == sealed[slice]) {
        ++slice;
      }
      status = absl::DataLossError(absl::StrFormat(
          "prefix entry %d: %s (%d bytes) differs from the captured checksums at slice %d of "
          "%d (xxHash3 %016x, captured as %016x); the entry is dropped, never served",
          entry.id.value, where, bytes.size(), slice, sealed.size(),
          slice < slices.size() ? slices[slice] : 0, slice < sealed.size() ? sealed[slice] : 0));
      break;
    }
    const auto read_again = [&](absl::Span<uint8_t> out) {
      return from.ReadInto(handle, storage, out);
    };
    absl::StatusOr<Storage> home = tiers_.tier(StorageMedium::kDevice)
                                       ->Insert(handle, storage,
                                                PieceSource{.view = bytes, .read_into = read_again});
    if (!home.ok()) {
      status = home.status();
      break;
    }
    promoted.emplace_back(handle,
                          ledger_.AdoptAllocation(HoldKind::kPromotion, handle, home->span));
  }
  absl::MutexLock lock(&mu_);
  std::vector<BlockKey> moved_blocks;
  std::optional<BlockKey> moved_boundary;
  for (auto& [handle, fresh] : promoted) {
    const SlabSpan span = *fresh.span();
    Storage& storage = storage_[handle];  // pinned: still referenced
    const size_t from = static_cast<size_t>(storage.medium);
    FreeInTier(handle, storage);
    tier_stored_bytes_[from] -= storage.span.bytes;
    storage.medium = StorageMedium::kDevice;
    storage.span = span;
    tier_stored_bytes_[static_cast<size_t>(StorageMedium::kDevice)] += span.bytes;
    fresh.Release();  // Allocate's hold; the restore holds the slab again (HoldSlabs)
    ++tier_promotions_[from];
    const auto at = std::find(handles.begin(), handles.end(), handle) - handles.begin();
    if (static_cast<size_t>(at) < entry.blocks.size()) {
      moved_blocks.push_back(entry.blocks[at].key);
    } else {
      moved_boundary = entry.blocks.back().key;
    }
  }
  promoting.clear();
  if (!promoted.empty()) {
    index_.RecordMoved(entry.fingerprint, std::move(moved_blocks), moved_boundary,
                       StorageMedium::kDevice);
  }
  return status;
}

StorageMedium PrefixCache::MediumLocked(const std::vector<LookupBlock>& blocks,
                                        const std::optional<StoredRef>& boundary) const {
  StorageMedium slowest = StorageMedium::kDevice;
  auto consider = [&](uint64_t handle) {
    auto it = storage_.find(handle);
    if (it != storage_.end() && it->second.medium > slowest) slowest = it->second.medium;
  };
  for (const LookupBlock& block : blocks) consider(block.stored.storage_handle);
  if (boundary.has_value()) consider(boundary->storage_handle);
  return slowest;
}

StorageMedium PrefixCache::MediumOf(const EntryView& entry) const {
  absl::MutexLock lock(&mu_);
  return MediumLocked(entry.blocks, entry.boundary);
}

absl::StatusOr<std::vector<PrefixCache::Stored>> PrefixCache::SealCopies(
    ArenaId source, std::vector<PieceCopy>& pieces) {
  std::vector<PieceLedger::Hold> holds;  // each span's, a capture hold until adopted
  auto free_copies = [&] {
    for (size_t i = 0; i < holds.size(); ++i) {
      holds[i].Release();
      ledger_.FreeSpan(pieces[i].span);
    }
  };
  for (PieceCopy& piece : pieces) {
    absl::StatusOr<SlabSpan> span = slabs_->Allocate(piece.bytes);
    if (!span.ok()) {
      free_copies();
      return span.status();
    }
    piece.span = *span;
    holds.push_back(ledger_.AdoptAllocation(HoldKind::kCapture, 0, *span));
  }
  // Sealed as they are copied: the checksums come from the bytes the copy read.
  absl::StatusOr<std::vector<std::vector<uint64_t>>> slices =
      copier_.Copy(CopyDirection::kToStorage, source, pieces, /*checksum=*/true, EntryId{});
  if (!slices.ok()) {
    free_copies();
    return slices.status();
  }
  std::vector<Stored> copies(pieces.size());
  for (size_t i = 0; i < pieces.size(); ++i) {
    copies[i].ref.checksum = PieceChecksum((*slices)[i]);
    copies[i].storage.span = pieces[i].span;
    copies[i].storage.piece_bytes = pieces[i].bytes;
    copies[i].storage.checksum = copies[i].ref.checksum;
    if ((*slices)[i].size() > 1) copies[i].storage.slice_checksums = std::move((*slices)[i]);
    copies[i].hold = std::move(holds[i]);
  }
  return copies;
}

absl::StatusOr<PrefixCaptureResult> PrefixCache::CaptureLocked(
    const ScopedShape& shape, const SessionState& state, const SessionLayoutVersion& layout,
    absl::Span<const int32_t> tokens, uint64_t boundary_tokens, bool allow_open_transaction,
    uint64_t engine_id) {
  RETURN_IF_ERROR(state.EnsureUsable("prefix capture"));
  const std::optional<TransactionId>& active = state.kv().state().active();
  if (active.has_value() && !allow_open_transaction) {
    return absl::FailedPreconditionError(absl::StrCat(
        "prefix capture needs a drained session: transaction generation ", active->generation,
        " is open (committed ", state.committed_len(), ", staged ", state.staged_len(), ")"));
  }
  const uint64_t block = options_.block_tokens;
  if (boundary_tokens == 0 || boundary_tokens % block != 0) {
    return absl::InvalidArgumentError(absl::StrCat("prefix capture boundary ", boundary_tokens,
                                                   " is not a positive multiple of the ", block,
                                                   "-token block"));
  }
  if (boundary_tokens > state.committed_len()) {
    return absl::InvalidArgumentError(absl::StrCat("prefix capture boundary ", boundary_tokens,
                                                   " exceeds the committed length ",
                                                   state.committed_len()));
  }
  ASSIGN_OR_RETURN(StoredLayout stored, PlanStoredLayout(layout.plan, state, boundary_tokens, block));
  PrefixModelTraits traits;
  traits.position_addressed_only = stored.position_addressed_only;
  ASSIGN_OR_RETURN(traits.block_bytes, slabs_->RoundedBytes(stored.block_bytes));
  if (!stored.position_addressed_only) {
    ASSIGN_OR_RETURN(traits.boundary_bytes, slabs_->RoundedBytes(stored.boundary_bytes));
  }
  CapturePlan plan;
  {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(plan, index_.PlanCapture(shape.key, tokens, boundary_tokens, traits));
  }
  // Copies without mu_ (the session's own mutex keeps its state still). Every source range is
  // checked before anything is allocated; each span is held until the index adopts it.
  std::vector<PieceCopy> pieces;
  if (!plan.already_present) {
    for (uint64_t i = plan.first_new_block; i < plan.chain.size(); ++i) {
      ASSIGN_OR_RETURN(pieces.emplace_back().ranges,
                       PieceRanges(layout, stored.block_pieces, i, /*toward_storage=*/true));
      pieces.back().bytes = stored.block_bytes;
    }
    if (plan.needs_boundary_state) {
      ASSIGN_OR_RETURN(pieces.emplace_back().ranges,
                       PieceRanges(layout, stored.boundary_pieces, 0, /*toward_storage=*/true));
      pieces.back().bytes = stored.boundary_bytes;
    }
  }
  ASSIGN_OR_RETURN(std::vector<Stored> copies, SealCopies(layout.arena, pieces));
  FillOrigin(plan, tokens, block, engine_id);
  // Held before the index adopts the spans, so that whatever frees one from here on (an
  // eviction, a concurrent capture's dedup) leaves it readable until its write is read.
  std::vector<RemoteWrite> remote_writes = RemoteWritesOf(shape, plan, stored, copies);
  for (RemoteWrite& write : remote_writes) {
    // The capture holds the slab already (its kCapture hold), so this cannot fail.
    absl::StatusOr<PieceLedger::Hold> hold =
        ledger_.Take(HoldKind::kRemoteWrite, 0, write.span);
    if (hold.ok()) {
      write.hold = *std::move(hold);
    } else {
      spdlog::error("prefix cache: {}", hold.status().ToString());
    }
  }
  PrefixCaptureResult result;
  {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<CommitResult> committed =
        AdoptLocked(shape, plan, std::move(copies), stored.position_addressed_only);
    if (!committed.ok() || committed->already_present) {
      remote_writes.clear();  // their holds released
    }
    RETURN_IF_ERROR(committed.status());
    if (!committed->already_present) ++captures_;
    result.entry = committed->entry;
    result.already_present = committed->already_present;
    result.added_bytes = committed->added_bytes;
    result.stored_bytes = index_.StoredBytes();
  }
  QueueRemoteWrites(std::move(remote_writes));
  result.boundary_tokens = boundary_tokens;
  result.shape = shape.shape;
  return result;
}

absl::StatusOr<CommitResult> PrefixCache::AdoptLocked(const ScopedShape& shape,
                                                      const CapturePlan& plan,
                                                      std::vector<Stored> copies,
                                                      bool position_addressed) {
  CaptureCommit commit;
  for (Stored& copy : copies) copy.ref.storage_handle = next_handle_++;
  const size_t new_blocks = plan.already_present ? 0 : plan.new_block_count();
  for (size_t i = 0; i < new_blocks; ++i) commit.new_blocks.push_back(copies[i].ref);
  if (copies.size() > new_blocks) commit.boundary = copies.back().ref;
  absl::StatusOr<CommitResult> committed =
      index_.CommitCapture(plan, commit, tick_.fetch_add(1) + 1);
  for (Stored& copy : copies) {
    copy.hold.Release();
    if (committed.ok()) {
      storage_[copy.ref.storage_handle] = copy.storage;
      tier_stored_bytes_[static_cast<size_t>(StorageMedium::kDevice)] += copy.storage.span.bytes;
    } else {
      ledger_.FreeSpan(copy.storage.span);
    }
  }
  if (!committed.ok()) return committed.status();
  FreeHandles(committed->unused_handles);
  FreeHandles(committed->evicted_handles);
  position_addressed_[shape.key] = position_addressed;
  scoped_shapes_[shape.key] = shape;
  return committed;
}

// Reads a held piece for the remote tier's writer: the header, then the span's bytes (a D2H
// copy on cuda), without the cache's lock: the hold keeps the span live and unchanged.
class PrefixCache::RemotePieceSource : public RemoteValueSource {
 public:
  RemotePieceSource(PrefixCache* cache, RemoteWrite write)
      : cache_(cache), write_(std::move(write)) {}
  // Destroyed by the tier once the write left the queue: write_.hold goes with it.
  uint64_t bytes() const override { return kRemoteHeaderBytes + write_.payload_bytes; }
  absl::Status Read(absl::Span<char> value) override {
    std::memcpy(value.data(), write_.header.data(), kRemoteHeaderBytes);
    return cache_->backend_->Read(
        write_.span.slab, write_.span.offset,
        absl::MakeSpan(reinterpret_cast<uint8_t*>(value.data()) + kRemoteHeaderBytes,
                       write_.payload_bytes));
  }

 private:
  PrefixCache* const cache_;
  const RemoteWrite write_;
};

std::vector<PrefixCache::RemoteWrite> PrefixCache::RemoteWritesOf(
    const ScopedShape& shape, const CapturePlan& plan, const StoredLayout& stored,
    const std::vector<Stored>& copies) const {
  std::vector<RemoteWrite> writes;
  if (remote_ == nullptr || copies.empty()) return writes;
  uint64_t total = 0;
  for (const Stored& copy : copies) total += kRemoteHeaderBytes + copy.storage.piece_bytes;
  if (!remote_->AdmitWrite(total)) return writes;
  const size_t new_blocks = plan.already_present ? 0 : plan.new_block_count();
  for (size_t i = 0; i < copies.size(); ++i) {
    const bool block = i < new_blocks;
    RemoteValueHeader header;
    header.kind = block ? RemoteValueKind::kBlock : RemoteValueKind::kBoundary;
    header.payload_bytes = copies[i].storage.piece_bytes;
    header.shape_prefix = ShapePrefix(shape.key);
    header.block_tokens = options_.block_tokens;
    header.slice_bytes = static_cast<uint32_t>(options_.checksum_slice_bytes);
    header.boundary_tokens = block ? 0 : plan.boundary_tokens;
    header.checksum = copies[i].ref.checksum;
    header.layout_digest = block ? LayoutDigest(stored.block_pieces, stored.block_rows)
                                 : LayoutDigest(stored.boundary_pieces, stored.block_rows);
    RemoteWrite& write = writes.emplace_back();
    write.key = block ? RemoteBlockKey(shape.scope, plan.chain[plan.first_new_block + i])
                      : RemoteBoundaryKey(shape.scope, plan.chain.back());
    write.header = EncodeRemoteHeader(write.key, header);
    write.span = copies[i].storage.span;
    write.payload_bytes = header.payload_bytes;
  }
  return writes;
}

void PrefixCache::QueueRemoteWrites(std::vector<RemoteWrite> writes) {
  for (RemoteWrite& write : writes) {
    std::string key = write.key;
    remote_->Enqueue(std::move(key), std::make_unique<RemotePieceSource>(this, std::move(write)));
  }
}

void PrefixCache::PullFromRemote(const ScopedShape& shape, const SessionState& state,
                                 const SessionLayoutVersion& layout,
                                 absl::Span<const int32_t> tokens,
                                 const std::vector<BlockKey>& keys, uint64_t engine_id) {
  const uint64_t block = options_.block_tokens;
  const bool position_addressed = PositionAddressedPlan(layout.plan);
  // What this daemon's plan stores when `blocks` blocks are restored, and the index's plan for
  // storing them (which blocks it holds already).
  auto layout_at = [&](uint64_t blocks) -> absl::StatusOr<StoredLayout> {
    SessionState hydrated = state;
    RETURN_IF_ERROR(hydrated.Hydrate(blocks * block, {}));
    return PlanStoredLayout(layout.plan, hydrated, blocks * block, block);
  };
  auto plan_at = [&](uint64_t blocks, const StoredLayout& stored) -> absl::StatusOr<CapturePlan> {
    PrefixModelTraits traits;
    traits.position_addressed_only = stored.position_addressed_only;
    ASSIGN_OR_RETURN(traits.block_bytes, slabs_->RoundedBytes(stored.block_bytes));
    if (!stored.position_addressed_only) {
      ASSIGN_OR_RETURN(traits.boundary_bytes, slabs_->RoundedBytes(stored.boundary_bytes));
    }
    absl::MutexLock lock(&mu_);
    return index_.PlanCapture(shape.key, tokens.subspan(0, blocks * block), blocks * block,
                              traits);
  };
  auto skip = [&](const absl::Status& status) {
    spdlog::debug("prefix remote tier: no pull for shape {}: {}", FingerprintHex(shape.shape),
                  status.ToString());
  };
  // 1. How far the remote tier reaches (one ExistsEach round trip per node), asked only when
  // the local tiers lack some of the match. A pull stores what it fetches in the device tier:
  // never more blocks than its budget holds (the index refuses a plan beyond it, whose pieces
  // would all be fetched first).
  uint64_t limit = std::min<uint64_t>(keys.size(), state.capacity() / block);
  if (limit == 0) return;
  std::vector<std::string> names;
  uint64_t first = 0;
  {
    absl::StatusOr<StoredLayout> stored = layout_at(limit);
    if (!stored.ok()) return skip(stored.status());
    if (position_addressed) {
      absl::StatusOr<uint64_t> block_bytes = slabs_->RoundedBytes(stored->block_bytes);
      if (!block_bytes.ok()) return skip(block_bytes.status());
      if (*block_bytes != 0) {
        limit = std::min(limit, tiers_.Budget(StorageMedium::kDevice) / *block_bytes);
      }
      if (limit == 0) return;
    }
    absl::StatusOr<CapturePlan> plan = plan_at(limit, *stored);
    if (plan.ok()) {
      if (plan->already_present) return;  // every block and the boundary state are here
      first = plan->first_new_block;
      if (position_addressed && first >= limit) return;  // every block is here
    } else if (position_addressed || !absl::IsResourceExhausted(plan.status())) {
      return skip(plan.status());
    }  // else a boundary plan whose whole match is over budget: a shorter one may fit
  }
  if (position_addressed) {
    for (uint64_t i = first; i < limit; ++i) names.push_back(RemoteBlockKey(shape.scope, keys[i]));
  } else {
    for (uint64_t i = 0; i < limit; ++i) names.push_back(RemoteBlockKey(shape.scope, keys[i]));
    for (uint64_t i = 0; i < limit; ++i) names.push_back(RemoteBoundaryKey(shape.scope, keys[i]));
  }
  absl::StatusOr<std::vector<bool>> exists =
      remote_->ExistsEach(names, options_.remote_lookup_timeout);
  if (!exists.ok()) return skip(exists.status());
  uint64_t reach = 0;  // blocks the pull will store
  std::optional<StoredLayout> stored;
  std::optional<CapturePlan> plan;
  if (position_addressed) {
    reach = first;
    while (reach < limit && (*exists)[reach - first]) ++reach;
    if (reach == first) return;
    absl::StatusOr<StoredLayout> at = layout_at(reach);
    if (!at.ok()) return skip(at.status());
    stored = *std::move(at);
    absl::StatusOr<CapturePlan> planned = plan_at(reach, *stored);
    if (!planned.ok()) return skip(planned.status());
    plan = *std::move(planned);
  } else {
    for (uint64_t m = limit; m > 0 && !plan.has_value(); --m) {
      if (!(*exists)[limit + m - 1]) continue;
      absl::StatusOr<StoredLayout> at = layout_at(m);
      if (!at.ok()) continue;
      absl::StatusOr<CapturePlan> planned = plan_at(m, *at);
      if (!planned.ok()) continue;
      if (planned->already_present) return;  // the local tiers hold this boundary or longer
      bool all = true;
      for (uint64_t i = planned->first_new_block; i < m && all; ++i) all = (*exists)[i];
      if (!all) continue;
      reach = m;
      stored = *std::move(at);
      plan = *std::move(planned);
    }
    if (!plan.has_value()) return;
  }
  // 2. Fetch, verify and copy into slabs (held until adopted) a window of values at a time,
  // each value dropped once copied: what is in flight stays bounded. A piece that is absent,
  // corrupt (DATA_LOSS: deleted) or of another shape ends the pull there; a boundary plan then
  // pulls nothing.
  std::vector<std::string> fetch;
  for (uint64_t i = plan->first_new_block; i < plan->chain.size(); ++i) {
    fetch.push_back(RemoteBlockKey(shape.scope, plan->chain[i]));
  }
  if (plan->needs_boundary_state) {
    fetch.push_back(RemoteBoundaryKey(shape.scope, plan->chain.back()));
  }
  std::vector<Stored> copies;
  auto free_copies = [&] {
    for (Stored& copy : copies) {
      copy.hold.Release();
      ledger_.FreeSpan(copy.storage.span);
    }
    copies.clear();
  };
  auto expected = [&](size_t i) {
    const bool is_block = !plan->needs_boundary_state || i + 1 < fetch.size();
    RemoteValueHeader header;
    header.kind = is_block ? RemoteValueKind::kBlock : RemoteValueKind::kBoundary;
    header.payload_bytes = is_block ? stored->block_bytes : stored->boundary_bytes;
    header.shape_prefix = ShapePrefix(shape.key);
    header.block_tokens = options_.block_tokens;
    header.boundary_tokens = is_block ? 0 : plan->boundary_tokens;
    header.layout_digest = is_block ? LayoutDigest(stored->block_pieces, stored->block_rows)
                                    : LayoutDigest(stored->boundary_pieces, stored->block_rows);
    return header;
  };
  // Copies one verified payload into a new slab span, checksummed as this daemon slices.
  auto copy_in = [&](size_t, VerifiedRemoteValue& value) -> absl::Status {
    const absl::Span<const uint8_t> payload(
        reinterpret_cast<const uint8_t*>(value.payload.data()), value.payload.size());
    ASSIGN_OR_RETURN(SlabSpan span, slabs_->Allocate(payload.size()));
    Stored& copy = copies.emplace_back();
    copy.storage.span = span;
    copy.hold = ledger_.AdoptAllocation(HoldKind::kCapture, 0, span);
    RETURN_IF_ERROR(backend_->Write(span.slab, span.offset, payload));
    std::vector<uint64_t> slices = value.slice_bytes == options_.checksum_slice_bytes
                                       ? std::move(value.slice_checksums)
                                       : SliceChecksums(payload, options_.checksum_slice_bytes);
    copy.ref.checksum = PieceChecksum(slices);
    copy.storage.piece_bytes = payload.size();
    copy.storage.checksum = copy.ref.checksum;
    if (slices.size() > 1) copy.storage.slice_checksums = std::move(slices);
    return absl::OkStatus();
  };
  ReadThroughResult pulled =
      ReadThrough(*remote_, fetch, expected, options_.remote_fetch_timeout, copy_in);
  RemoteTier::PullCounts& counts = pulled.counts;
  if (!pulled.adopt_failure.ok()) {
    free_copies();
    remote_->RecordPull(counts);
    return skip(pulled.adopt_failure);
  }
  if (copies.size() < fetch.size()) {
    const uint64_t good_blocks = plan->first_new_block + copies.size();
    absl::StatusOr<CapturePlan> shorter = absl::FailedPreconditionError("no shorter chain");
    if (position_addressed && good_blocks > plan->first_new_block) {
      // A shorter chain: the blocks before the bad one.
      shorter = plan_at(good_blocks, *stored);
    }
    if (!shorter.ok() || shorter->first_new_block != plan->first_new_block) {
      free_copies();
      counts.pieces = 0;
      counts.bytes = 0;
      remote_->RecordPull(counts);
      return;
    }
    plan = *std::move(shorter);
  }
  FillOrigin(*plan, tokens, block, engine_id);
  // Tiers are rebalanced by the caller, outside the destination session's mutex.
  absl::MutexLock lock(&mu_);
  absl::StatusOr<CommitResult> committed =
      AdoptLocked(shape, *plan, std::move(copies), position_addressed);
  if (!committed.ok()) {
    counts.pieces = 0;
    counts.bytes = 0;
    spdlog::warn("prefix remote tier: storing the pulled prefix failed: {}",
                 committed.status().ToString());
  }
  remote_->RecordPull(counts);
}

absl::StatusOr<PrefixCaptureResult> PrefixCache::CaptureState(
    const ScopedShape& shape, const SessionState& state, const SessionLayoutVersion& layout,
    absl::Span<const int32_t> committed_tokens, uint64_t boundary_tokens, uint64_t engine_id) {
  return CaptureLocked(shape, state, layout, committed_tokens, boundary_tokens,
                       /*allow_open_transaction=*/false, engine_id);
}

absl::StatusOr<std::optional<PrefixCaptureResult>> PrefixCache::CaptureCommittedState(
    const ScopedShape& shape, const SessionState& state, const SessionLayoutVersion& layout,
    const std::optional<std::vector<int32_t>>& committed_tokens) {
  if (!committed_tokens.has_value() || committed_tokens->size() != state.committed_len()) {
    return std::nullopt;
  }
  const uint64_t block = options_.block_tokens;
  const uint64_t committed = state.committed_len();
  const bool position_addressed = PositionAddressedPlan(layout.plan);
  uint64_t boundary = committed / block * block;
  if (!position_addressed) {
    // Boundary state is only what the committed length left, and only when no staged
    // append has moved it (rings rebased, recurrent state advanced).
    if (committed % block != 0 || state.kv().state().active().has_value()) return std::nullopt;
  }
  if (boundary == 0) return std::nullopt;
  ASSIGN_OR_RETURN(PrefixCaptureResult captured,
                   CaptureLocked(shape, state, layout, *committed_tokens, boundary,
                                 /*allow_open_transaction=*/position_addressed,
                                 /*engine_id=*/0));
  if (!captured.already_present) {
    absl::MutexLock lock(&mu_);
    ++death_captures_;
  }
  return captured;
}

LookupResult PrefixCache::LookupLocked(const PlanFingerprint& shape,
                                       absl::Span<const int32_t> tokens) {
  // A shape never captured has no entries: either rule finds nothing.
  PrefixModelTraits traits;
  auto it = position_addressed_.find(shape);
  traits.position_addressed_only = it == position_addressed_.end() || it->second;
  return index_.Lookup(shape, tokens, traits);
}

PrefixLookupResult PrefixCache::Lookup(absl::string_view scope, const PlanFingerprint& shape,
                                       absl::Span<const int32_t> tokens) {
  const PlanFingerprint key = ScopedShapeFingerprint(scope, shape);
  absl::ReleasableMutexLock lock(&mu_);
  const LookupResult found = LookupLocked(key, tokens);
  PrefixLookupResult result;
  result.outcome = found.outcome;
  result.entry = found.entry;
  result.matched_tokens = found.matched_tokens;
  result.medium = MediumLocked(found.blocks, found.boundary);
  if (remote_ == nullptr || found.outcome == LookupOutcome::kHit) return result;
  std::optional<bool> position_addressed;
  if (auto it = position_addressed_.find(key); it != position_addressed_.end()) {
    position_addressed = it->second;
  }
  lock.Release();
  // Read-through: how far the remote tier reaches past the local match (a restore by tokens
  // pulls it). A shape this daemon never stored is told apart by the boundary keys: only plans
  // with per-boundary state write them.
  const uint64_t block = options_.block_tokens;
  absl::StatusOr<std::vector<BlockKey>> keys = ChainBlockKeys(key, tokens, block);
  if (!keys.ok()) return result;
  const uint64_t local = found.matched_tokens / block;
  const uint64_t count = keys->size() - local;
  std::vector<std::string> names;
  for (uint64_t i = local; i < keys->size(); ++i) {
    names.push_back(RemoteBlockKey(scope, (*keys)[i]));
  }
  if (position_addressed != true) {
    for (uint64_t i = local; i < keys->size(); ++i) {
      names.push_back(RemoteBoundaryKey(scope, (*keys)[i]));
    }
  }
  absl::StatusOr<std::vector<bool>> exists =
      remote_->ExistsEach(std::move(names), options_.remote_lookup_timeout);
  if (!exists.ok()) return result;
  uint64_t blocks = 0;  // remote blocks contiguous after the local match
  while (blocks < count && (*exists)[blocks]) ++blocks;
  uint64_t reach = local + blocks;
  if (position_addressed != true) {
    std::optional<uint64_t> boundary;
    for (uint64_t i = count; i > 0 && !boundary.has_value(); --i) {
      if ((*exists)[count + i - 1] && i <= blocks) boundary = local + i;
    }
    const bool boundary_plan =
        position_addressed == false ||
        std::any_of(exists->begin() + count, exists->end(), [](bool b) { return b; });
    if (boundary_plan) reach = boundary.value_or(0);
  }
  if (reach <= local) return result;
  result.matched_tokens = reach * block;
  result.outcome = reach == keys->size() ? LookupOutcome::kHit : LookupOutcome::kPartial;
  result.entry = std::nullopt;  // a restore by tokens pulls the remote part first
  result.medium = StorageMedium::kRemote;
  return result;
}

absl::StatusOr<PrefixRestoreOutcome> PrefixCache::RestoreInto(
    const ScopedShape& shape, SessionId session, uint64_t engine_id, const SessionState& state,
    const SessionLayoutVersion& layout, std::optional<EntryId> requested,
    absl::Span<const int32_t> tokens) {
  const uint64_t block = options_.block_tokens;
  RETURN_IF_ERROR(state.EnsureUsable("prefix restore"));
  if (!IsFresh(state)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "prefix restore needs a fresh destination: session ", session.value, " has committed ",
        state.committed_len(), ", staged ", state.staged_len(), " rows"));
  }
  ASSIGN_OR_RETURN(std::vector<BlockKey> keys, ChainBlockKeys(shape.key, tokens, block));
  if (!requested.has_value() && remote_ != nullptr) {
    PullFromRemote(shape, state, layout, tokens, keys, engine_id);
  }
  EntryView entry;
  std::vector<PieceLedger::Hold> pieces_held;  // the entry's pieces, while it is pinned
  uint64_t matched = 0;
  StorageMedium served_from = StorageMedium::kDevice;
  {
    absl::MutexLock lock(&mu_);
    std::optional<EntryId> id = requested;
    if (!id.has_value()) {
      id = LookupLocked(shape.key, tokens).entry;
      if (!id.has_value()) {
        return absl::NotFoundError(absl::StrCat("no stored prefix matches the ", tokens.size(),
                                                " token ids (", keys.size(), " whole blocks)"));
      }
    }
    ASSIGN_OR_RETURN(entry, index_.GetEntry(*id));
    if (entry.fingerprint != shape.key) {
      const ScopedEntry stored = Unscoped(entry);
      if (stored.cache_scope != shape.scope) {
        // Another scope's entry is not there for this session (as an unknown one).
        return absl::NotFoundError(
            absl::StrCat("prefix entry ", id->value, " is not in cache scope ", shape.scope));
      }
      // A shape differs by its formats as by any layout field; name them, since a
      // format mismatch is the one an engine most often makes.
      const auto known = scoped_shapes_.find(entry.fingerprint);
      const std::string stored_formats =
          known == scoped_shapes_.end() || known->second.formats.empty() ? "formats unknown"
                                                                         : known->second.formats;
      return absl::InvalidArgumentError(absl::StrCat(
          "prefix entry ", id->value, " was captured for shape ",
          FingerprintHex(stored.view.fingerprint), " (", stored_formats, "); session ",
          session.value, " has shape ", FingerprintHex(shape.shape), " (", shape.formats, ")"));
    }
    while (matched < entry.blocks.size() && matched < keys.size() &&
           entry.blocks[matched].key == keys[matched]) {
      ++matched;
    }
    if (matched == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("the ", tokens.size(), " token ids match none of prefix entry ", id->value,
                       "'s ", entry.blocks.size(), " blocks"));
    }
    if (entry.boundary.has_value() && matched < entry.blocks.size()) {
      return absl::FailedPreconditionError(
          absl::StrCat("prefix entry ", id->value,
                       " holds recurrent/SWA/indexer state only at its ", entry.boundary_tokens,
                       "-token boundary; the token ids match ", matched * block, " of them"));
    }
    RETURN_IF_ERROR(index_.Pin(*id, tick_.fetch_add(1) + 1));
    pieces_held = HoldPieces(entry);
    served_from = MediumLocked(entry.blocks, entry.boundary);
  }
  // Pinned: nothing below can free or demote the entry's pieces. Every path unpins. A
  // restore that cannot go refuses before any piece is promoted.
  absl::StatusOr<RestoreTarget> target = PlanRestore(session, state, layout, entry, matched);
  absl::Status promoted = target.ok() ? PromotePinned(entry) : target.status();
  if (promoted.ok()) {
    absl::MutexLock lock(&mu_);
    HoldSlabs(pieces_held);
  }
  auto unpin = [&] {
    absl::MutexLock lock(&mu_);
    pieces_held.clear();  // the slabs, then the pieces
    (void)index_.Unpin(entry.id);
    FreeHandles(index_.EnforceBudget().freed_handles);
  };
  absl::StatusOr<SessionState> restored =
      promoted.ok() ? RestorePinned(layout, entry, matched, *std::move(target))
                    : absl::StatusOr<SessionState>(promoted);
  unpin();
  if (restored.ok()) {
    absl::MutexLock lock(&mu_);
    ++restores_;
    ++tier_hits_[static_cast<size_t>(served_from)];
    tokens_restored_ += matched * block;
  } else if (restored.status().code() == absl::StatusCode::kDataLoss) {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<EvictionResult> dropped =
        index_.DropEntry(entry.id, std::string(restored.status().message()));
    if (dropped.ok()) FreeHandles(dropped->freed_handles);
    spdlog::error("{}", restored.status().ToString());
  }
  RETURN_IF_ERROR(restored.status());
  return PrefixRestoreOutcome{
      .state = *std::move(restored),
      .result = {.entry = entry.id, .restored_tokens = matched * block}};
}

absl::StatusOr<PrefixCache::RestoreTarget> PrefixCache::PlanRestore(
    SessionId session, const SessionState& state, const SessionLayoutVersion& layout,
    const EntryView& entry, uint64_t matched_blocks) const {
  const uint64_t block = options_.block_tokens;
  const uint64_t rows = matched_blocks * block;
  if (rows > state.capacity()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "restoring ", rows, " tokens of prefix entry ", entry.id.value, " needs capacity ", rows,
        "; session ", session.value, " has ", state.capacity()));
  }
  SessionState hydrated = state;
  RETURN_IF_ERROR(hydrated.Hydrate(rows, {}));  // lengths, ring bases, latent pools
  ASSIGN_OR_RETURN(StoredLayout target, PlanStoredLayout(layout.plan, hydrated, rows, block));
  for (size_t i = 0; i < state.latent().size(); ++i) {
    if (hydrated.latent()[i].index_width == 0) continue;
    ASSIGN_OR_RETURN(LatentCapturePlan snapshot, PlanLatentCapture(hydrated.latent()[i]));
    RETURN_IF_ERROR(ValidateLatentRestore(state.latent()[i], snapshot.snapshot, state.capacity()));
  }
  ASSIGN_OR_RETURN(uint64_t block_bytes, slabs_->RoundedBytes(target.block_bytes));
  for (uint64_t i = 0; i < matched_blocks; ++i) {
    if (entry.blocks[i].bytes != block_bytes) {
      return absl::DataLossError(absl::StrCat(
          "prefix entry ", entry.id.value, ": stored block ", i, " holds ", entry.blocks[i].bytes,
          " bytes but the destination layout needs ", block_bytes, " (truncated entry)"));
    }
  }
  if (entry.boundary.has_value()) {
    ASSIGN_OR_RETURN(uint64_t boundary_bytes, slabs_->RoundedBytes(target.boundary_bytes));
    if (entry.boundary_bytes != boundary_bytes) {
      return absl::DataLossError(absl::StrCat(
          "prefix entry ", entry.id.value, ": stored boundary state holds ",
          entry.boundary_bytes, " bytes but the destination layout needs ", boundary_bytes,
          " (truncated entry)"));
    }
  } else if (!target.position_addressed_only) {
    return absl::DataLossError(absl::StrCat("prefix entry ", entry.id.value,
                                            " carries no boundary state but the session's "
                                            "plan needs ", target.boundary_bytes, " bytes of it"));
  }
  return RestoreTarget{std::move(hydrated), std::move(target)};
}

absl::StatusOr<SessionState> PrefixCache::RestorePinned(const SessionLayoutVersion& layout,
                                                        const EntryView& entry,
                                                        uint64_t matched_blocks,
                                                        RestoreTarget restore) {
  // 1. Validated by PlanRestore; nothing has moved yet.
  const StoredLayout& target = restore.layout;
  SessionState& hydrated = restore.hydrated;
  // Every destination range, then where each piece is stored (pinned: it stays there).
  std::vector<PieceCopy> pieces;
  std::vector<const StoredRef*> refs;
  for (uint64_t i = 0; i < matched_blocks; ++i) {
    ASSIGN_OR_RETURN(pieces.emplace_back().ranges,
                     PieceRanges(layout, target.block_pieces, i, /*toward_storage=*/false));
    pieces.back().bytes = target.block_bytes;
    refs.push_back(&entry.blocks[i].stored);
  }
  if (entry.boundary.has_value()) {
    ASSIGN_OR_RETURN(pieces.emplace_back().ranges,
                     PieceRanges(layout, target.boundary_pieces, 0, /*toward_storage=*/false));
    pieces.back().bytes = target.boundary_bytes;
    refs.push_back(&*entry.boundary);
  }
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < pieces.size(); ++i) {
      auto it = storage_.find(refs[i]->storage_handle);
      if (it == storage_.end()) {
        return absl::InternalError(absl::StrCat("prefix entry ", entry.id.value,
                                                ": pinned storage handle ",
                                                refs[i]->storage_handle, " has no span"));
      }
      if (it->second.medium != StorageMedium::kDevice) {
        return absl::InternalError(absl::StrCat("prefix entry ", entry.id.value,
                                                ": pinned storage handle ",
                                                refs[i]->storage_handle, " is not in a slab"));
      }
      pieces[i].span = it->second.span;
      pieces[i].slice_checksums = it->second.slice_checksums;
      pieces[i].checksum = refs[i]->checksum;
    }
  }
  for (size_t i = 0; i < pieces.size(); ++i) {
    // The slice checksums must be the ones the piece was sealed with.
    const std::vector<uint64_t>& slices = pieces[i].slice_checksums;
    if (!slices.empty() && PieceChecksum(slices) != pieces[i].checksum) {
      return absl::DataLossError(absl::StrFormat(
          "prefix entry %d: the %d slice checksums of stored piece %d hash to %016x, sealed as "
          "%016x; the entry is dropped, never served",
          entry.id.value, slices.size(), i, PieceChecksum(slices), pieces[i].checksum));
    }
  }
  if (entry.boundary.has_value()) {
    // Unbuilt pool-key slots must read zero (PlanLatentRestore's zero_pool_keys); zeroed before
    // any copy, since the boundary's pool keys land in the same plane.
    for (const LatentLayerState& latent : hydrated.latent()) {
      if (latent.index_width == 0) continue;
      const PlaneRef keys{latent.layer, PlaneKind::kPoolKeys};
      const uint64_t bytes = PlaneBytes(layout, keys);
      ASSIGN_OR_RETURN(uint64_t at, PlaneRangeOffset(layout, keys, 0, bytes));
      RETURN_IF_ERROR(backend_->Memset(layout.arena, at, 0, bytes));
    }
  }
  // 2. Copy, verifying in the same pass: each slice's xxHash3 is taken from the bytes as they
  // are copied and compared with the one taken at capture (a separate verification pass cost as
  // much as the copy). A mismatch or device failure leaves the session's state fresh (it adopts
  // `hydrated` only on success); the bytes already copied are unspecified content of a fresh
  // session, as any fresh session's bytes are.
  RETURN_IF_ERROR(copier_
                      .Copy(CopyDirection::kFromStorage, layout.arena, pieces,
                            options_.verify_checksums, entry.id)
                      .status());
  return std::move(hydrated);
}

ScopedEntry PrefixCache::Unscoped(EntryView view) const {
  ScopedEntry out;
  if (auto it = scoped_shapes_.find(view.fingerprint); it != scoped_shapes_.end()) {
    out.cache_scope = it->second.scope;
    view.fingerprint = it->second.shape;
    if (it->second.engine_pool) {
      out.from_engine_pool = true;
      view.boundary_tokens = view.blocks.size() * uint64_t{it->second.block_tokens};
    }
  }
  out.view = std::move(view);
  return out;
}

std::vector<ScopedEntry> PrefixCache::ListEntries() const {
  absl::MutexLock lock(&mu_);
  std::vector<ScopedEntry> entries;
  for (EntryId id : index_.EntryIds()) {
    absl::StatusOr<EntryView> view = index_.GetEntry(id);
    if (view.ok()) entries.push_back(Unscoped(*std::move(view)));
  }
  return entries;
}

absl::StatusOr<ScopedEntry> PrefixCache::Inspect(EntryId entry) const {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(EntryView view, index_.GetEntry(entry));
  return Unscoped(std::move(view));
}

absl::StatusOr<uint64_t> PrefixCache::EvictEntry(EntryId entry) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(EvictionResult evicted, index_.EvictEntry(entry));
  FreeHandles(evicted.freed_handles);
  return evicted.freed_bytes;
}

uint64_t PrefixCache::EvictForAdmission(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  // The budget is charged per slab: only whole slabs returned make room. Empty (kept) slabs go
  // first, then LRU entries until their slabs empty out, or nothing unpinned is left.
  const uint64_t returned_before = slabs_->returned_bytes();
  auto returned = [&] { return slabs_->returned_bytes() - returned_before; };
  slabs_->ReleaseEmptySlabs();
  // With a tier below, LRU pieces move down before any entry leaves the cache (the copies run
  // without mu_; the admission waits for them).
  constexpr size_t kDevice = static_cast<size_t>(StorageMedium::kDevice);
  while (tiers_.Below(StorageMedium::kDevice).has_value() && returned() < bytes) {
    const uint64_t staying = tier_stored_bytes_[kDevice] - tier_leaving_bytes_[kDevice];
    if (staying == 0) break;
    const uint64_t short_by = bytes - returned();
    const size_t moved =
        DemoteDownTo(StorageMedium::kDevice, staying > short_by ? staying - short_by : 0);
    slabs_->ReleaseEmptySlabs();
    if (moved == 0) break;
  }
  uint64_t entries = 0;
  uint64_t held_bytes = 0;
  while (returned() < bytes && index_.EvictableBytes() > 0) {
    const uint64_t want = std::min(bytes - returned(), index_.EvictableBytes());
    absl::StatusOr<EvictionResult> evicted = index_.Evict(want);
    if (!evicted.ok()) break;  // cannot happen: want <= EvictableBytes()
    entries += evicted->entries.size();
    held_bytes += evicted->freed_bytes;
    FreeHandles(evicted->freed_handles);
    slabs_->ReleaseEmptySlabs();
  }
  spdlog::info(
      "prefix cache: returned {} bytes of slabs ({} entries, {} stored bytes evicted) for an "
      "admission {} bytes short",
      returned(), entries, held_bytes, bytes);
  return returned();
}

uint64_t PrefixCache::ReleaseEmptySlabs() {
  if (host_slabs_ != nullptr) host_slabs_->ReleaseEmptySlabs();
  return slabs_->ReleaseEmptySlabs();
}

void PrefixCache::InstallEvictor(DeviceBudget& budget) {
  budget.SetEvictor(EvictableSource::kPrefixCache,
                   [this](uint64_t bytes) { return EvictForAdmission(bytes); });
}

PrefixCacheStats PrefixCache::Stats() const {
  absl::MutexLock lock(&mu_);
  const PrefixIndexStats index = index_.Stats();
  PrefixCacheStats stats;
  stats.entries = index.entries;
  stats.blocks = index.blocks;
  stats.stored_bytes = index.stored_bytes;
  stats.pinned_bytes = index.pinned_bytes;
  stats.evictable_bytes = index_.EvictableBytes();
  stats.budget_bytes = index_.budget_bytes();
  stats.lookup_hits = index.lookup_hits;
  stats.lookup_partials = index.lookup_partials;
  stats.lookup_misses = index.lookup_misses;
  stats.captures = captures_;
  stats.restores = restores_;
  stats.tokens_restored = tokens_restored_;
  stats.evicted_entries = index.evicted_entries;
  stats.dropped_entries = index.dropped_entries;
  stats.death_captures = death_captures_;
  stats.epoch = index_.epoch();
  stats.last_sequence = index_.LastSequence();
  stats.block_tokens = index_.block_tokens();
  stats.slabs = slabs_->Stats();
  for (std::optional<StorageMedium> medium = StorageMedium::kDevice; medium.has_value();
       medium = tiers_.Below(*medium)) {
    const size_t tier = static_cast<size_t>(*medium);
    stats.tiers.push_back({.medium = *medium,
                           .stored_bytes = tier_stored_bytes_[tier],
                           .budget_bytes = tiers_.Budget(*medium),
                           .hits = tier_hits_[tier],
                           .promotions = tier_promotions_[tier],
                           .demotions = tier_demotions_[tier]});
  }
  if (remote_ != nullptr) {
    stats.remote = remote_->Stats();
    stats.tiers.push_back({.medium = StorageMedium::kRemote,
                           .stored_bytes = 0,
                           .budget_bytes = 0,
                           .hits = stats.remote->hits,
                           .promotions = stats.remote->pulled_pieces,
                           .demotions = stats.remote->writes});
  }
  return stats;
}

ScopedEventReplay PrefixCache::EventsSince(uint64_t epoch, uint64_t last_sequence,
                                           const std::optional<std::string>& scope) const {
  absl::MutexLock lock(&mu_);
  EventReplay replay = index_.EventsSince(epoch, last_sequence);
  ScopedEventReplay out;
  out.gap = replay.gap;
  out.last_sequence = replay.last_sequence;
  for (PrefixEvent& event : replay.events) {
    ScopedPrefixEvent scoped;
    if (auto it = scoped_shapes_.find(event.fingerprint); it != scoped_shapes_.end()) {
      scoped.cache_scope = it->second.scope;
      event.fingerprint = it->second.shape;
    }
    if (scope.has_value() && scoped.cache_scope != *scope) continue;
    scoped.event = std::move(event);
    out.events.push_back(std::move(scoped));
  }
  return out;
}

uint64_t PrefixCache::AwaitEvent(uint64_t last_sequence, absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto newer = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return index_.LastSequence() > last_sequence;
  };
  mu_.AwaitWithTimeout(absl::Condition(&newer), timeout);
  return index_.LastSequence();
}

absl::StatusOr<PrefixCache::Storage> PrefixCache::StorageIn(uint64_t storage_handle,
                                                            std::optional<StorageMedium> medium)
    const {
  auto it = storage_.find(storage_handle);
  if (it == storage_.end()) {
    return absl::NotFoundError(absl::StrCat("no prefix storage handle ", storage_handle));
  }
  if (medium.has_value() && it->second.medium != *medium) {
    return absl::FailedPreconditionError(absl::StrCat(
        "prefix storage handle ", storage_handle, " is in the ",
        std::string(StorageMediumName(it->second.medium)), " tier, not the ",
        std::string(StorageMediumName(*medium)), " tier"));
  }
  return it->second;
}

absl::StatusOr<StorageMedium> PrefixCache::StorageMediumOf(uint64_t storage_handle) const {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Storage storage, StorageIn(storage_handle, std::nullopt));
  return storage.medium;
}

absl::StatusOr<SlabSpan> PrefixCache::StorageSpan(uint64_t storage_handle) const {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Storage storage, StorageIn(storage_handle, StorageMedium::kDevice));
  return storage.span;
}

absl::StatusOr<absl::Span<uint8_t>> PrefixCache::StorageHostBytes(uint64_t storage_handle) const {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Storage storage, StorageIn(storage_handle, StorageMedium::kPinnedHost));
  return host_memory_->Bytes(storage.span.slab, storage.span.offset, storage.piece_bytes);
}

absl::StatusOr<std::string> PrefixCache::StorageFile(uint64_t storage_handle) const {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(StorageIn(storage_handle, StorageMedium::kDisk).status());
  return disk_->PathOf(storage_handle);
}

absl::Status PrefixCache::CheckInvariants() const {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(index_.CheckInvariants());
  RETURN_IF_ERROR(ledger_.CheckInvariants());
  RETURN_IF_ERROR(slabs_->CheckInvariants());
  // (1): the handles the index references are exactly the spans held (no capture in flight
  // when tests call this).
  absl::flat_hash_set<uint64_t> referenced;
  for (EntryId id : index_.EntryIds()) {
    ASSIGN_OR_RETURN(EntryView view, index_.GetEntry(id));
    for (const LookupBlock& block : view.blocks) referenced.insert(block.stored.storage_handle);
    if (view.boundary.has_value()) referenced.insert(view.boundary->storage_handle);
  }
  for (uint64_t handle : referenced) {
    if (!storage_.contains(handle)) {
      return absl::InternalError(absl::StrCat("prefix storage handle ", handle, " has no span"));
    }
  }
  if (referenced.size() != storage_.size()) {
    return absl::InternalError(absl::StrCat("prefix cache holds ", storage_.size(),
                                            " spans for ", referenced.size(), " stored pieces"));
  }
  // (2): what the index counts is what the tiers hold.
  std::array<uint64_t, kMedia> pieces = {};
  std::array<uint64_t, kMedia> bytes = {};
  uint64_t disk_file_bytes = 0;
  for (const auto& [handle, storage] : storage_) {
    const size_t tier = static_cast<size_t>(storage.medium);
    ++pieces[tier];
    bytes[tier] += storage.span.bytes;
    if (storage.medium == StorageMedium::kDisk) disk_file_bytes += storage.piece_bytes;
  }
  std::array<uint64_t, kMedia> leaving = {};
  for (const auto& [handle, move] : moving_) {
    if (!move.released) leaving[static_cast<size_t>(move.source.medium)] += move.source.span.bytes;
  }
  for (size_t tier = 0; tier < kMedia; ++tier) {
    if (bytes[tier] != tier_stored_bytes_[tier] || leaving[tier] != tier_leaving_bytes_[tier]) {
      return absl::InternalError(absl::StrCat(
          "prefix tier ", std::string(StorageMediumName(static_cast<StorageMedium>(tier))), ": ",
          pieces[tier],
          " pieces hold ", bytes[tier], " bytes (counted ", tier_stored_bytes_[tier], "), ",
          leaving[tier], " of them leaving (counted ", tier_leaving_bytes_[tier], ")"));
    }
  }
  const uint64_t stored = bytes[0] + bytes[1] + bytes[2];
  if (index_.StoredBytes() != stored) {
    return absl::InternalError(absl::StrCat("prefix index stores ", index_.StoredBytes(),
                                            " bytes; the tiers hold ", stored));
  }
  if (!moving_.empty()) return absl::OkStatus();  // the rest holds once no demotion is in flight
  constexpr size_t kDevice = static_cast<size_t>(StorageMedium::kDevice);
  const SlabStats slabs = slabs_->Stats();
  // Spans the index let go of while a remote write was queued are freed when it is read.
  const PieceLedgerStats held = ledger_.Stats();
  const uint64_t deferred_spans = held.deferred_spans;
  const uint64_t deferred_bytes = held.deferred_bytes;
  if (slabs.used_bytes != bytes[kDevice] + deferred_bytes ||
      slabs.spans != pieces[kDevice] + deferred_spans) {
    return absl::InternalError(absl::StrCat(
        "prefix device tier: ", pieces[kDevice], " pieces hold ", bytes[kDevice], " bytes (",
        deferred_spans, " spans of ", deferred_bytes,
        " bytes more wait for the remote writer); the slabs hold ", slabs.used_bytes,
        " bytes in ", slabs.spans, " spans"));
  }
  if (tier_incoming_bytes_ != std::array<uint64_t, kMedia>{}) {
    return absl::InternalError(absl::StrCat(
        "prefix tiers count ", tier_incoming_bytes_[1], " host and ", tier_incoming_bytes_[2],
        " disk bytes incoming with no demotion in flight"));
  }
  if (host_slabs_ != nullptr) {
    constexpr size_t kHost = static_cast<size_t>(StorageMedium::kPinnedHost);
    RETURN_IF_ERROR(host_slabs_->CheckInvariants());
    const SlabStats host = host_slabs_->Stats();
    if (host.used_bytes != bytes[kHost] || host.spans != pieces[kHost] ||
        host.slab_bytes != host_memory_->allocated_bytes()) {
      return absl::InternalError(absl::StrCat(
          "prefix host tier: ", pieces[kHost], " pieces hold ", bytes[kHost],
          " bytes; its slabs hold ", host.used_bytes, " bytes in ", host.spans, " spans, ",
          host.slab_bytes, " slab bytes of ", host_memory_->allocated_bytes(), " allocated"));
    }
  }
  if (disk_ != nullptr && disk_->stored_bytes() != disk_file_bytes) {
    return absl::InternalError(absl::StrCat("prefix pieces on disk hold ", disk_file_bytes,
                                            " bytes; the disk tier holds ",
                                            disk_->stored_bytes()));
  }
  return absl::OkStatus();
}

}  // namespace memra
