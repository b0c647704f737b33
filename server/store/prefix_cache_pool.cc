// PrefixCache's engine-pool block API (the block store; prefix_cache.h "Engine-pool blocks"):
// kept apart from the session capture and restore paths it shares the storage with.

#include <algorithm>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "core/block_layout.h"
#include "server/store/prefix_cache.h"
#include "spdlog/spdlog.h"

namespace memra {
namespace {

// The first 8 bytes of a key in hex, for messages.
std::string KeyPrefix(const BlockKey& key) {
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(key.data()), 8));
}

// A pool block's copy ranges: stored bytes back to back from 0, the pool side at its pieces.
std::vector<CopyRange> PoolRanges(const PoolBlock& block, bool toward_storage) {
  std::vector<CopyRange> ranges;
  ranges.reserve(block.pieces.size());
  uint64_t stored_at = 0;
  for (const PoolPiece& piece : block.pieces) {
    ranges.push_back(toward_storage ? CopyRange{.dst_offset = stored_at,
                                                .src_offset = piece.pool_offset,
                                                .bytes = piece.bytes}
                                    : CopyRange{.dst_offset = piece.pool_offset,
                                                .src_offset = stored_at,
                                                .bytes = piece.bytes});
    stored_at += piece.bytes;
  }
  return ranges;
}

// The blocks of a call, then its state (when it has blocks to go with).
std::vector<const PoolBlock*> WithState(const std::vector<PoolBlock>& blocks,
                                        const std::optional<PoolBlock>& state) {
  std::vector<const PoolBlock*> all;
  all.reserve(blocks.size() + 1);
  for (const PoolBlock& block : blocks) all.push_back(&block);
  if (state.has_value() && !blocks.empty()) all.push_back(&*state);
  return all;
}

// A state's result (the last of `results` when `with_state`) is the last block's.
void FoldStateResult(bool with_state, std::vector<PoolBlockResult>& results) {
  if (!with_state) return;
  PoolBlockResult state_result = std::move(results.back());
  results.pop_back();
  PoolBlockResult& last = results.back();
  if (last.status.ok() && !state_result.status.ok()) {
    last.status = absl::Status(state_result.status.code(),
                               absl::StrCat("the boundary state of the last block: ",
                                            state_result.status.message()));
  }
  last.copied_bytes += state_result.copied_bytes;
}

ScopedShape StateSpace(const ScopedShape& space) {
  ScopedShape state = space;
  state.key = BoundaryStateFingerprint(space.key);
  return state;
}

}  // namespace

std::optional<EntryId> PrefixCache::PoolEntry(const BlockKey& key) const {
  absl::MutexLock lock(&mu_);
  return index_.EntryEndingAt(key);
}

std::vector<PoolBlockResult> PrefixCache::StorePoolBlocks(const ScopedShape& space, ArenaId pool,
                                                          const std::vector<PoolBlock>& blocks,
                                                          const std::optional<PoolBlock>& state) {
  // The state is one more piece, in its own key space; its result folds into the last block's.
  const std::vector<const PoolBlock*> all = WithState(blocks, state);
  const ScopedShape state_space = StateSpace(space);
  std::vector<PoolBlockResult> results(all.size());
  std::vector<CapturePlan> plans(all.size());
  std::vector<size_t> to_copy;  // indices into `all` whose bytes must be copied
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < all.size(); ++i) {
      const bool is_state = i == blocks.size();
      PrefixModelTraits traits;
      absl::StatusOr<uint64_t> rounded = slabs_->RoundedBytes(all[i]->bytes);
      if (!rounded.ok()) {
        results[i].status = rounded.status();
        continue;
      }
      traits.block_bytes = *rounded;
      absl::StatusOr<CapturePlan> plan = index_.PlanCaptureOfChain(
          is_state ? state_space.key : space.key, {all[i]->key}, traits);
      if (!plan.ok()) {
        results[i].status = plan.status();
        continue;
      }
      plans[i] = *std::move(plan);
      plans[i].origin = all[i]->origin;
      if (plans[i].already_present) {
        results[i].already_present = true;
      } else {
        to_copy.push_back(i);
      }
    }
    // Room first: the copies take slabs before they are committed (and the commit evicts only
    // then), so a store into a full cache would otherwise need its size twice over.
    uint64_t incoming = 0;
    for (size_t i : to_copy) incoming += plans[i].new_bytes;
    const uint64_t target = options_.budget_bytes > incoming ? options_.budget_bytes - incoming : 0;
    if (tiers_.Below(StorageMedium::kDevice).has_value()) {
      DemoteDownTo(StorageMedium::kDevice, target);
    } else if (index_.StoredBytes() > target) {
      const uint64_t excess = std::min(index_.StoredBytes() - target, index_.EvictableBytes());
      if (excess > 0) {
        absl::StatusOr<EvictionResult> room = index_.Evict(excess);
        if (room.ok()) FreeHandles(room->freed_handles);
      }
    }
    // The emptied slabs stay (the slab allocator keeps them for the copies about to come).
  }
  // Copied without mu_, each piece sealed as it is read from the engine's pool; a piece whose
  // span cannot be had fails alone.
  std::vector<PieceCopy> pieces;
  std::vector<size_t> copied;
  for (size_t i : to_copy) {
    PieceCopy piece;
    piece.ranges = PoolRanges(*all[i], /*toward_storage=*/true);
    piece.bytes = all[i]->bytes;
    pieces.push_back(std::move(piece));
    copied.push_back(i);
  }
  absl::StatusOr<std::vector<Stored>> copies = SealCopies(pool, pieces);
  if (!copies.ok()) {
    // One span or copy failed: retry one at a time so the others still get in.
    copies = std::vector<Stored>();
    std::vector<size_t> kept;
    for (size_t k = 0; k < pieces.size(); ++k) {
      std::vector<PieceCopy> one = {pieces[k]};
      absl::StatusOr<std::vector<Stored>> single = SealCopies(pool, one);
      if (!single.ok()) {
        results[copied[k]].status = single.status();
        continue;
      }
      copies->push_back(std::move(single->front()));
      kept.push_back(copied[k]);
    }
    copied = std::move(kept);
  }
  absl::MutexLock lock(&mu_);
  // One STORED event per run of this call's blocks (PrefixIndex::set_coalesce_pool_stored): no
  // subscriber reads between them, as mu_ is held throughout.
  index_.set_coalesce_pool_stored(true);
  std::vector<size_t> copy_of(all.size(), copied.size());  // all[i]'s copy, if any
  for (size_t k = 0; k < copied.size(); ++k) copy_of[copied[k]] = k;
  for (size_t i = 0; i < all.size(); ++i) {
    if (!results[i].status.ok()) continue;
    std::vector<Stored> mine;
    if (copy_of[i] < copied.size()) mine.push_back(std::move((*copies)[copy_of[i]]));
    const bool is_state = i == blocks.size();
    absl::StatusOr<CommitResult> committed =
        AdoptLocked(is_state ? state_space : space, plans[i], std::move(mine),
                    /*position_addressed=*/true);
    if (!committed.ok()) {
      results[i].status = committed.status();
      continue;
    }
    results[i].already_present = committed->already_present;
    if (!committed->already_present) {
      results[i].copied_bytes = all[i]->bytes;
      ++captures_;
    }
  }
  index_.set_coalesce_pool_stored(false);
  Rebalance();
  FoldStateResult(all.size() > blocks.size(), results);
  return results;
}

PoolLookupResult PrefixCache::LookupPoolBlocks(const ScopedShape& space,
                                               absl::Span<const BlockKey> keys, bool needs_state,
                                               bool pin) {
  absl::MutexLock lock(&mu_);
  PoolLookupResult result;
  std::vector<EntryId> entries;
  for (const BlockKey& key : keys) {
    std::optional<EntryId> entry = index_.EntryEndingAt(key);
    if (!entry.has_value()) break;
    entries.push_back(*entry);
  }
  std::optional<EntryId> state;
  if (needs_state) {
    // A state is valid at one boundary: count up to the last matched block that has one.
    while (!entries.empty()) {
      state = index_.EntryEndingAt(BoundaryStateKey(keys[entries.size() - 1]));
      if (state.has_value()) break;
      entries.pop_back();
    }
  }
  result.matched_blocks = entries.size();
  if (state.has_value()) entries.push_back(*state);
  for (EntryId id : entries) {
    absl::StatusOr<EntryView> view = index_.GetEntry(id);
    if (!view.ok()) continue;
    result.medium = std::max(result.medium, MediumLocked(view->blocks, view->boundary));
    if (!pin) continue;
    if (index_.Pin(id, tick_.fetch_add(1) + 1).ok()) {
      pool_pins_[id].push_back(HoldPieces(*view));
      result.pinned.push_back(id);
    }
  }
  (void)space;  // the keys carry the key space (block_layout.h)
  return result;
}

void PrefixCache::UnpinPoolEntriesLocked(absl::Span<const EntryId> entries) {
  for (EntryId id : entries) {
    absl::StatusOr<EntryView> view = index_.GetEntry(id);
    if (!view.ok() || view->pins == 0) continue;
    if (auto pins = pool_pins_.find(id); pins != pool_pins_.end()) {
      pins->second.pop_back();  // one lookup's holds
      if (pins->second.empty()) pool_pins_.erase(pins);
    }
    (void)index_.Unpin(id);
  }
}

void PrefixCache::UnpinPoolEntries(absl::Span<const EntryId> entries) {
  absl::MutexLock lock(&mu_);
  UnpinPoolEntriesLocked(entries);
  FreeHandles(index_.EnforceBudget().freed_handles);
  Rebalance();
}

std::vector<PoolBlockResult> PrefixCache::LoadPoolBlocks(const ScopedShape& space, ArenaId pool,
                                                         const std::vector<PoolBlock>& blocks,
                                                         const std::optional<PoolBlock>& state,
                                                         absl::Span<const EntryId> release_pins) {
  const std::vector<const PoolBlock*> all = WithState(blocks, state);
  std::vector<PoolBlockResult> results(all.size());
  std::vector<std::optional<EntryView>> pinned(all.size());
  std::vector<std::vector<PieceLedger::Hold>> pieces_held(all.size());  // pinned[i]'s pieces
  // 1. Pin what is stored: nothing below can free or demote it.
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < all.size(); ++i) {
      const bool is_state = i == blocks.size();  // its message goes after FoldStateResult's
      std::optional<EntryId> id = index_.EntryEndingAt(all[i]->key);
      absl::StatusOr<EntryView> view =
          id.has_value() ? index_.GetEntry(*id)
                         : absl::StatusOr<EntryView>(absl::NotFoundError(absl::StrCat(
                               is_state ? "it" : absl::StrCat("block ", i), " (key ",
                               KeyPrefix(all[i]->key),
                               "...) is not stored (never stored, or evicted)")));
      if (view.ok() && (view->blocks.size() != 1 ||
                        view->blocks[0].bytes != slabs_->RoundedBytes(all[i]->bytes).value_or(0))) {
        view = absl::InvalidArgumentError(absl::StrCat(
            "block ", i, " is stored with ", view->blocks.empty() ? 0 : view->blocks[0].bytes,
            " bytes; the destination layout holds ", all[i]->bytes));
      }
      if (!view.ok()) {
        results[i].status = view.status();
        continue;
      }
      if (absl::Status pinned_now = index_.Pin(view->id, tick_.fetch_add(1) + 1);
          !pinned_now.ok()) {
        results[i].status = pinned_now;
        continue;
      }
      pieces_held[i] = HoldPieces(*view);
      pinned[i] = *std::move(view);
    }
  }
  // 2. Disk pieces back into slabs (verified), then hold the slabs and gather the sources.
  std::vector<PieceCopy> pieces;
  std::vector<size_t> piece_of;  // pieces[k] loads all[piece_of[k]]
  for (size_t i = 0; i < all.size(); ++i) {
    if (!pinned[i].has_value()) continue;
    if (absl::Status promoted = PromotePinned(*pinned[i]); !promoted.ok()) {
      results[i].status = promoted;
    }
  }
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < all.size(); ++i) {
      if (!pinned[i].has_value() || !results[i].status.ok()) continue;
      const StoredRef& ref = pinned[i]->blocks[0].stored;
      auto it = storage_.find(ref.storage_handle);
      if (it == storage_.end() || it->second.medium != StorageMedium::kDevice) {
        results[i].status = absl::InternalError(absl::StrCat(
            "prefix entry ", pinned[i]->id.value, ": pinned storage handle ", ref.storage_handle,
            " is not in a slab"));
        continue;
      }
      HoldSlabs(pieces_held[i]);
      PieceCopy piece;
      piece.ranges = PoolRanges(*all[i], /*toward_storage=*/false);
      piece.bytes = all[i]->bytes;
      piece.span = it->second.span;
      piece.slice_checksums = it->second.slice_checksums;
      piece.checksum = ref.checksum;
      piece.entry = pinned[i]->id;
      pieces.push_back(std::move(piece));
      piece_of.push_back(i);
    }
  }
  // 3. Copy and verify in one pass; each piece fails alone.
  std::vector<absl::Status> failures;
  absl::Status copied = copier_
                            .Copy(CopyDirection::kFromStorage, pool, pieces,
                                  options_.verify_checksums, EntryId{}, &failures)
                            .status();
  for (size_t k = 0; k < pieces.size(); ++k) {
    absl::Status& status = results[piece_of[k]].status;
    status = !copied.ok() ? copied : failures[k];
    if (status.ok()) results[piece_of[k]].copied_bytes = pieces[k].bytes;
  }
  // 4. Unpin (the lookup's pin too, first); a corrupt entry is dropped (never served again).
  {
    absl::MutexLock lock(&mu_);
    UnpinPoolEntriesLocked(release_pins);
    for (size_t i = 0; i < all.size(); ++i) {
      if (!pinned[i].has_value()) continue;
      pieces_held[i].clear();  // the slabs, then the pieces
      (void)index_.Unpin(pinned[i]->id);
      if (results[i].status.code() == absl::StatusCode::kDataLoss) {
        absl::StatusOr<EvictionResult> dropped =
            index_.DropEntry(pinned[i]->id, std::string(results[i].status.message()));
        if (dropped.ok()) FreeHandles(dropped->freed_handles);
        spdlog::error("block store: {}", results[i].status.ToString());
      } else if (results[i].status.ok() && i < blocks.size()) {
        ++restores_;
        tokens_restored_ += space.block_tokens;
      }
    }
    FreeHandles(index_.EnforceBudget().freed_handles);
    Rebalance();
  }
  FoldStateResult(all.size() > blocks.size(), results);
  return results;
}

}  // namespace memra
