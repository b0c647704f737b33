#include "core/prefix_index.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "core/sha256.h"
#include "core/status_macros.h"

namespace memra {
namespace {

void AppendLe32(std::string& out, uint32_t value) {
  for (int shift = 0; shift < 32; shift += 8) out.push_back(static_cast<char>(value >> shift));
}

std::string_view AsBytes(const std::array<uint8_t, 32>& digest) {
  return std::string_view(reinterpret_cast<const char*>(digest.data()), digest.size());
}

absl::Status EntryNotFound(EntryId id) {
  return absl::NotFoundError(absl::StrCat("prefix entry ", id.value, " not found"));
}

}  // namespace

absl::StatusOr<std::vector<BlockKey>> ChainBlockKeys(const PlanFingerprint& fingerprint,
                                                     absl::Span<const int32_t> tokens,
                                                     uint32_t block_tokens) {
  if (block_tokens == 0) {
    return absl::InvalidArgumentError("prefix block size is 0 tokens; it must be at least 1");
  }
  const size_t blocks = tokens.size() / block_tokens;
  std::vector<BlockKey> keys;
  keys.reserve(blocks);
  std::string message;
  // Reserved only when a whole block exists: a huge block size with a short query allocates
  // nothing.
  if (blocks > 0) message.reserve(kPrefixKeyDomain.size() + 32 + 4 + size_t{block_tokens} * 4);
  for (size_t i = 0; i < blocks; ++i) {
    message.clear();
    message.append(kPrefixKeyDomain);
    message.append(AsBytes(i == 0 ? fingerprint : keys.back()));
    AppendLe32(message, block_tokens);
    for (size_t t = i * block_tokens; t < (i + 1) * block_tokens; ++t) {
      AppendLe32(message, static_cast<uint32_t>(tokens[t]));
    }
    keys.push_back(Sha256Of(message));
  }
  return keys;
}

absl::StatusOr<PrefixIndex> PrefixIndex::Create(const PrefixIndexOptions& options) {
  if (options.block_tokens == 0) {
    return absl::InvalidArgumentError("prefix block size is 0 tokens; it must be at least 1");
  }
  if (options.event_capacity == 0) {
    return absl::InvalidArgumentError(
        "prefix event buffer capacity is 0; a subscriber could never replay");
  }
  return PrefixIndex(options);
}

absl::Status PrefixIndex::ValidateTraits(const PrefixModelTraits& traits) const {
  if (traits.block_bytes == 0) {
    return absl::InvalidArgumentError(
        "prefix traits: block_bytes is 0 (a block of a model with KV rows costs bytes)");
  }
  if (traits.position_addressed_only && traits.boundary_bytes != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefix traits: a position-addressed plan has no boundary state, but boundary_bytes is ",
        traits.boundary_bytes));
  }
  if (!traits.position_addressed_only && traits.boundary_bytes == 0) {
    return absl::InvalidArgumentError(
        "prefix traits: a plan with recurrent/SWA/indexer state needs boundary_bytes > 0");
  }
  return absl::OkStatus();
}

absl::StatusOr<CapturePlan> PrefixIndex::PlanCapture(const PlanFingerprint& fingerprint,
                                                     absl::Span<const int32_t> tokens,
                                                     uint64_t boundary_tokens,
                                                     const PrefixModelTraits& traits) const {
  RETURN_IF_ERROR(ValidateTraits(traits));
  const uint64_t block = options_.block_tokens;
  if (boundary_tokens == 0) {
    return absl::InvalidArgumentError("prefix capture at boundary 0: nothing to capture");
  }
  if (boundary_tokens > tokens.size()) {
    return absl::InvalidArgumentError(absl::StrCat("prefix capture boundary ", boundary_tokens,
                                                   " is beyond the ", tokens.size(),
                                                   " tokens given"));
  }
  if (boundary_tokens % block != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefix capture boundary ", boundary_tokens, " is not a multiple of the block size ", block,
        " (nearest aligned boundaries: ", boundary_tokens / block * block, ", ",
        (boundary_tokens / block + 1) * block, ")"));
  }
  ASSIGN_OR_RETURN(std::vector<BlockKey> chain,
                   ChainBlockKeys(fingerprint, tokens.subspan(0, boundary_tokens),
                                  options_.block_tokens));
  return PlanCaptureOfChain(fingerprint, std::move(chain), traits);
}

std::optional<EntryId> PrefixIndex::EntryEndingAt(const BlockKey& key) const {
  auto it = by_boundary_.find(key);
  if (it == by_boundary_.end()) return std::nullopt;
  return it->second;
}

absl::StatusOr<CapturePlan> PrefixIndex::PlanCaptureOfChain(const PlanFingerprint& fingerprint,
                                                            std::vector<BlockKey> chain,
                                                            const PrefixModelTraits& traits) const {
  RETURN_IF_ERROR(ValidateTraits(traits));
  if (chain.empty()) return absl::InvalidArgumentError("prefix capture of no blocks");
  CapturePlan plan;
  plan.fingerprint = fingerprint;
  plan.block_tokens = options_.block_tokens;
  ASSIGN_OR_RETURN(plan.boundary_tokens,
                   CheckedMul(chain.size(), options_.block_tokens, "prefix capture boundary"));
  plan.chain = std::move(chain);
  plan.block_bytes = traits.block_bytes;
  plan.needs_boundary_state = !traits.position_addressed_only;
  plan.boundary_bytes = traits.boundary_bytes;
  plan.already_present = by_boundary_.contains(plan.chain.back());
  uint64_t newly_pinned = 0;  // shared blocks the capture itself holds while making room
  while (plan.first_new_block < plan.chain.size()) {
    auto it = blocks_.find(plan.chain[plan.first_new_block]);
    if (it == blocks_.end()) break;
    if (it->second.pinned_users == 0) newly_pinned += it->second.bytes;
    if (it->second.bytes != traits.block_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prefix traits: block ", plan.first_new_block, " is stored with ", it->second.bytes,
          " bytes but the traits say ", traits.block_bytes, " for the same model plan"));
    }
    ++plan.first_new_block;
  }
  if (plan.already_present) {
    plan.first_new_block = plan.chain.size();
    plan.needs_boundary_state = false;
    plan.boundary_bytes = 0;
    return plan;
  }
  ASSIGN_OR_RETURN(uint64_t block_total,
                   CheckedMul(plan.new_block_count(), traits.block_bytes, "prefix capture bytes"));
  ASSIGN_OR_RETURN(plan.new_bytes,
                   CheckedAdd(block_total, plan.boundary_bytes, "prefix capture bytes"));
  ASSIGN_OR_RETURN(uint64_t after, CheckedAdd(stored_bytes_, plan.new_bytes, "prefix ledger"));
  const uint64_t evictable = EvictableBytes() - newly_pinned;
  if (after > options_.budget_bytes && after - options_.budget_bytes > evictable) {
    return absl::ResourceExhaustedError(
        absl::StrCat("prefix capture needs ", plan.new_bytes, " bytes; budget ",
                     options_.budget_bytes, ", stored ", stored_bytes_, ", evictable ", evictable));
  }
  return plan;
}

absl::StatusOr<CommitResult> PrefixIndex::CommitCapture(const CapturePlan& plan,
                                                        const CaptureCommit& commit,
                                                        uint64_t now_tick) {
  // Everything is checked before the first change: a refused commit leaves the index as it was.
  if (plan.block_tokens != options_.block_tokens || plan.chain.empty() ||
      plan.first_new_block > plan.chain.size() ||
      plan.boundary_tokens != plan.chain.size() * uint64_t{plan.block_tokens}) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefix commit: the plan is not one of this index (block size ",
                     plan.block_tokens, " vs ", options_.block_tokens, ", ", plan.chain.size(),
                     " blocks for boundary ", plan.boundary_tokens, ")"));
  }
  if (commit.new_blocks.size() != plan.new_block_count()) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefix commit carries ", commit.new_blocks.size(),
                     " new blocks but the plan has ", plan.new_block_count()));
  }
  if (commit.boundary.has_value() != plan.needs_boundary_state) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefix commit ", commit.boundary.has_value() ? "carries" : "lacks",
        " a boundary state but the plan ", plan.needs_boundary_state ? "needs" : "has none"));
  }
  CommitResult result;
  auto all_handles = [&] {
    for (const StoredRef& ref : commit.new_blocks)
      result.unused_handles.push_back(ref.storage_handle);
    if (commit.boundary) result.unused_handles.push_back(commit.boundary->storage_handle);
  };
  if (auto it = by_boundary_.find(plan.chain.back()); it != by_boundary_.end()) {
    result.entry = it->second;
    result.already_present = true;
    all_handles();
    Touch(entries_.at(it->second), now_tick);
    return result;
  }
  if (plan.already_present) {
    // Planned as present, evicted since: nothing was copied, so there is nothing to adopt.
    return absl::AbortedError(absl::StrCat("prefix commit: the boundary at ", plan.boundary_tokens,
                                           " tokens was evicted since PlanCapture; plan again"));
  }
  for (uint64_t i = 0; i < plan.first_new_block; ++i) {
    if (!blocks_.contains(plan.chain[i])) {
      return absl::AbortedError(absl::StrCat("prefix commit: shared block ", i, " of ",
                                             plan.chain.size(),
                                             " was evicted since PlanCapture; plan again"));
    }
  }
  // Blocks another capture stored meanwhile are shared now; the daemon's copies go unused.
  std::vector<bool> adopt(plan.chain.size(), false);
  uint64_t added = plan.needs_boundary_state ? plan.boundary_bytes : 0;
  uint64_t newly_pinned = 0;  // existing blocks the new entry pins while making room
  for (uint64_t i = 0; i < plan.chain.size(); ++i) {
    auto it = blocks_.find(plan.chain[i]);
    if (it != blocks_.end()) {
      if (it->second.bytes != plan.block_bytes) {
        return absl::InvalidArgumentError(
            absl::StrCat("prefix commit: block ", i, " is stored with ", it->second.bytes,
                         " bytes but the plan says ", plan.block_bytes));
      }
      if (it->second.pinned_users == 0) newly_pinned += it->second.bytes;
      if (i >= plan.first_new_block) {
        result.unused_handles.push_back(commit.new_blocks[i - plan.first_new_block].storage_handle);
      }
      continue;
    }
    adopt[i] = true;
    ASSIGN_OR_RETURN(added, CheckedAdd(added, plan.block_bytes, "prefix capture bytes"));
  }
  ASSIGN_OR_RETURN(uint64_t after, CheckedAdd(stored_bytes_, added, "prefix ledger"));
  const uint64_t evictable = EvictableBytes() - newly_pinned;
  if (after > options_.budget_bytes && after - options_.budget_bytes > evictable) {
    return absl::ResourceExhaustedError(
        absl::StrCat("prefix capture needs ", added, " bytes; budget ", options_.budget_bytes,
                     ", stored ", stored_bytes_, ", evictable ", evictable));
  }

  // Insert.
  const EntryId id{next_entry_++};
  Entry& entry = entries_[id];
  entry.id = id;
  entry.fingerprint = plan.fingerprint;
  entry.chain = plan.chain;
  entry.epoch = options_.epoch;
  entry.last_use_tick = now_tick;
  // The entry keeps only what its removal event names (the engine's hashes, the engine): the
  // token ids and parent were news once, in STORED, and would hold heap for the entry's life.
  entry.origin.block_hashes = plan.origin.block_hashes;
  entry.origin.engine_id = plan.origin.engine_id;
  entry.origin.from_engine_pool = plan.origin.from_engine_pool;
  PrefixEvent stored;
  stored.kind = PrefixEventKind::kStored;
  stored.fingerprint = plan.fingerprint;
  stored.origin = plan.origin;
  for (uint64_t i = 0; i < plan.chain.size(); ++i) {
    if (adopt[i]) {
      Block& block = blocks_[plan.chain[i]];
      block.id = BlockId{next_block_++};
      block.fingerprint = plan.fingerprint;
      if (i > 0) block.parent = plan.chain[i - 1];
      block.index = i;
      block.bytes = plan.block_bytes;
      block.stored = commit.new_blocks[i - plan.first_new_block];
      stored.block_keys.push_back(plan.chain[i]);
    }
    blocks_.at(plan.chain[i]).users.insert(id);
  }
  if (plan.needs_boundary_state) {
    entry.boundary = commit.boundary;
    entry.boundary_bytes = plan.boundary_bytes;
    stored.boundary_key = plan.chain.back();
  }
  by_boundary_[plan.chain.back()] = id;
  lru_.insert({now_tick, id});
  stored_bytes_ = after;
  result.entry = id;
  result.added_bytes = added;

  // Make room with the new entry pinned, so its own blocks (shared ones included) stay.
  entry.pins = 1;
  SetPinned(entry, true);
  EvictionResult room = EvictDownTo(options_.budget_bytes);
  Entry& inserted = entries_.at(id);  // rehashing may have moved it
  inserted.pins = 0;
  SetPinned(inserted, false);
  result.evicted_handles = std::move(room.freed_handles);
  if (!stored.block_keys.empty() || stored.boundary_key.has_value()) {
    AppendEvent(std::move(stored));
  }
  return result;
}

LookupResult PrefixIndex::Lookup(const PlanFingerprint& fingerprint,
                                 absl::Span<const int32_t> tokens,
                                 const PrefixModelTraits& traits) {
  LookupResult result;
  // block_tokens > 0 (Create), so this cannot fail.
  const std::vector<BlockKey> keys =
      ChainBlockKeys(fingerprint, tokens, options_.block_tokens).value();
  uint64_t depth = 0;
  if (traits.position_addressed_only) {
    while (depth < keys.size() && blocks_.contains(keys[depth])) ++depth;
    if (depth > 0) {
      if (auto it = by_boundary_.find(keys[depth - 1]); it != by_boundary_.end()) {
        result.entry = it->second;
      } else {
        // Every user of the deepest block has a chain through it (prefix-closed chains).
        const Block& deepest = blocks_.at(keys[depth - 1]);
        result.entry = *std::min_element(deepest.users.begin(), deepest.users.end());
      }
    }
  } else {
    for (depth = keys.size(); depth > 0; --depth) {
      auto it = by_boundary_.find(keys[depth - 1]);
      if (it == by_boundary_.end()) continue;
      const Entry& entry = entries_.at(it->second);
      if (!entry.boundary.has_value()) continue;
      result.entry = entry.id;
      result.boundary = entry.boundary;
      result.boundary_bytes = entry.boundary_bytes;
      break;
    }
  }
  for (uint64_t i = 0; i < depth; ++i) {
    const Block& block = blocks_.at(keys[i]);
    result.blocks.push_back(
        LookupBlock{.key = keys[i], .id = block.id, .bytes = block.bytes, .stored = block.stored});
  }
  result.matched_tokens = depth * options_.block_tokens;
  if (depth == 0) {
    result.outcome = LookupOutcome::kMiss;
    ++lookup_misses_;
  } else if (depth == keys.size()) {
    result.outcome = LookupOutcome::kHit;
    ++lookup_hits_;
  } else {
    result.outcome = LookupOutcome::kPartial;
    ++lookup_partials_;
  }
  return result;
}

void PrefixIndex::Touch(Entry& entry, uint64_t now_tick) {
  lru_.erase({entry.last_use_tick, entry.id});
  entry.last_use_tick = now_tick;
  lru_.insert({now_tick, entry.id});
}

void PrefixIndex::SetPinned(Entry& entry, bool pinned) {
  for (const BlockKey& key : entry.chain) {
    Block& block = blocks_.at(key);
    if (pinned) {
      if (block.pinned_users++ == 0) pinned_bytes_ += block.bytes;
    } else {
      if (--block.pinned_users == 0) pinned_bytes_ -= block.bytes;
    }
  }
  if (pinned) {
    pinned_bytes_ += entry.boundary_bytes;
  } else {
    pinned_bytes_ -= entry.boundary_bytes;
  }
}

absl::Status PrefixIndex::Pin(EntryId id, uint64_t now_tick) {
  auto it = entries_.find(id);
  if (it == entries_.end()) {
    return EntryNotFound(id);
  }
  Entry& entry = it->second;
  if (entry.pins == UINT32_MAX) {
    return absl::ResourceExhaustedError(
        absl::StrCat("prefix entry ", id.value, " already has ", entry.pins, " pins"));
  }
  if (entry.pins++ == 0) SetPinned(entry, true);
  Touch(entry, now_tick);
  return absl::OkStatus();
}

absl::Status PrefixIndex::Unpin(EntryId id) {
  auto it = entries_.find(id);
  if (it == entries_.end()) {
    return EntryNotFound(id);
  }
  Entry& entry = it->second;
  if (entry.pins == 0) {
    return absl::FailedPreconditionError(absl::StrCat("prefix entry ", id.value, " is not pinned"));
  }
  if (--entry.pins == 0) SetPinned(entry, false);
  return absl::OkStatus();
}

PrefixIndex::Removal PrefixIndex::RemoveEntry(EntryId id) {
  auto it = entries_.find(id);
  Entry& entry = it->second;
  Removal removal;
  removal.fingerprint = entry.fingerprint;
  for (const BlockKey& key : entry.chain) {
    auto block = blocks_.find(key);
    block->second.users.erase(id);
    if (!block->second.users.empty()) continue;
    removal.bytes += block->second.bytes;
    removal.handles.push_back(block->second.stored.storage_handle);
    removal.block_keys.push_back(key);
    blocks_.erase(block);
  }
  if (entry.boundary.has_value()) {
    removal.bytes += entry.boundary_bytes;
    removal.handles.push_back(entry.boundary->storage_handle);
    removal.boundary_key = entry.chain.back();
  }
  // Removal events name the blocks as their engine knows them (all the entry keeps).
  removal.origin = std::move(entry.origin);
  by_boundary_.erase(entry.chain.back());
  lru_.erase({entry.last_use_tick, id});
  entries_.erase(it);
  stored_bytes_ -= removal.bytes;
  return removal;
}

std::string_view StorageMediumName(StorageMedium medium) {
  switch (medium) {
    case StorageMedium::kDevice:
      return "device";
    case StorageMedium::kPinnedHost:
      return "pinned_host";
    case StorageMedium::kDisk:
      return "disk";
    case StorageMedium::kRemote:
      return "remote";
  }
  return "unknown";
}

std::vector<EntryId> PrefixIndex::EntryIdsLeastRecentFirst() const {
  std::vector<EntryId> ids;
  ids.reserve(lru_.size());
  for (const auto& [tick, id] : lru_) ids.push_back(id);
  return ids;
}

std::optional<EntryId> PrefixIndex::LeastRecentEntry() const {
  if (lru_.empty()) return std::nullopt;
  return lru_.begin()->second;
}

absl::StatusOr<std::optional<EntryId>> PrefixIndex::EntryUsedAfter(EntryId id) const {
  auto it = entries_.find(id);
  if (it == entries_.end()) {
    return EntryNotFound(id);
  }
  auto next = lru_.upper_bound({it->second.last_use_tick, id});
  if (next == lru_.end()) return std::nullopt;
  return next->second;
}

void PrefixIndex::RecordMoved(const PlanFingerprint& fingerprint, std::vector<BlockKey> block_keys,
                              std::optional<BlockKey> boundary_key, StorageMedium medium) {
  PrefixEvent event;
  event.kind = PrefixEventKind::kMoved;
  event.fingerprint = fingerprint;
  event.block_keys = std::move(block_keys);
  event.boundary_key = boundary_key;
  event.medium = medium;
  AppendEvent(std::move(event));
}

namespace {

// The identity a router knows a stored block by: the engine's hash, else the block key.
std::string LastBlockHash(const PrefixEvent& event) {
  if (!event.origin.block_hashes.empty()) return event.origin.block_hashes.back();
  if (event.block_keys.empty()) return std::string();
  const BlockKey& key = event.block_keys.back();
  return std::string(reinterpret_cast<const char*>(key.data()), key.size());
}

// A folded event stays small (the replay buffer is bounded by its count): at most this many
// blocks and token ids, as a router's batch would be; a longer run continues in the next event.
constexpr size_t kMaxFoldedBlocks = 1024;
constexpr size_t kMaxFoldedTokenIds = 16384;

// Whether `next` continues `last`'s run of engine-pool blocks (set_coalesce_pool_stored).
bool ContinuesPoolRun(const PrefixEvent& last, const PrefixEvent& next) {
  return last.block_keys.size() + next.block_keys.size() <= kMaxFoldedBlocks &&
         last.origin.token_ids.size() + next.origin.token_ids.size() <= kMaxFoldedTokenIds &&
         last.kind == PrefixEventKind::kStored && next.kind == PrefixEventKind::kStored &&
         last.origin.from_engine_pool && next.origin.from_engine_pool &&
         last.fingerprint == next.fingerprint && last.origin.engine_id == next.origin.engine_id &&
         last.origin.block_tokens == next.origin.block_tokens && !last.boundary_key.has_value() &&
         !next.boundary_key.has_value() && last.medium == next.medium &&
         last.origin.block_hashes.empty() == next.origin.block_hashes.empty() &&
         last.origin.token_ids.empty() == next.origin.token_ids.empty() &&
         !next.origin.parent_block_hash.empty() &&
         next.origin.parent_block_hash == LastBlockHash(last);
}

}  // namespace

void PrefixIndex::AppendEvent(PrefixEvent event) {
  if (coalesce_pool_stored_ && !events_.empty() &&
      events_.back().sequence >= coalesce_from_sequence_ &&
      ContinuesPoolRun(events_.back(), event)) {
    PrefixEvent& last = events_.back();
    last.block_keys.insert(last.block_keys.end(), event.block_keys.begin(),
                           event.block_keys.end());
    last.origin.block_hashes.insert(last.origin.block_hashes.end(),
                                    event.origin.block_hashes.begin(),
                                    event.origin.block_hashes.end());
    last.origin.token_ids.insert(last.origin.token_ids.end(), event.origin.token_ids.begin(),
                                 event.origin.token_ids.end());
    return;
  }
  event.sequence = next_sequence_++;
  event.epoch = options_.epoch;
  events_.push_back(std::move(event));
  while (events_.size() > options_.event_capacity) events_.pop_front();
}

void PrefixIndex::RemoveInto(EntryId id, PrefixEventKind kind, std::string_view reason,
                             EvictionResult& result) {
  Removal removal = RemoveEntry(id);
  result.freed_bytes += removal.bytes;
  result.freed_handles.insert(result.freed_handles.end(), removal.handles.begin(),
                              removal.handles.end());
  result.entries.push_back(id);
  if (kind == PrefixEventKind::kDropped) {
    ++dropped_entries_;
  } else {
    ++evicted_entries_;
  }
  // A dropped entry is always announced (a router must stop routing to it even if it freed
  // nothing of its own); an eviction that freed no bytes changed nothing a router sees.
  if (kind == PrefixEventKind::kDropped || removal.bytes > 0) {
    PrefixEvent event;
    event.kind = kind;
    event.fingerprint = removal.fingerprint;
    event.block_keys = std::move(removal.block_keys);
    event.boundary_key = removal.boundary_key;
    event.reason = std::string(reason);
    event.origin = std::move(removal.origin);
    AppendEvent(std::move(event));
    ++result.events;
  }
}

bool PrefixIndex::FreesBytes(EntryId id, const Entry& entry) const {
  if (entry.boundary.has_value() || entry.chain.empty()) return true;
  // Block keys chain every token before them, so an entry sharing any block shares all the
  // blocks before it: the entry frees some block iff it is the only user of its last one.
  const Block& last = blocks_.at(entry.chain.back());
  return last.users.size() == 1 && last.users.contains(id);
}

void PrefixIndex::EvictLruUntil(absl::FunctionRef<bool(const EvictionResult&)> done,
                                EvictionResult& result) {
  // Entries passed over (they would free nothing), and those of them an eviction has since
  // left the only user of a block (ready, taken least recent first, before the walk goes on).
  absl::flat_hash_set<EntryId> passed_over;
  std::set<std::pair<uint64_t, EntryId>> ready;
  const auto evict = [&](EntryId id) {
    const std::vector<BlockKey> chain = entries_.at(id).chain;
    RemoveInto(id, PrefixEventKind::kEvicted, "", result);
    for (const BlockKey& key : chain) {
      auto block = blocks_.find(key);
      if (block == blocks_.end() || block->second.users.size() != 1) continue;
      const EntryId user = *block->second.users.begin();
      if (passed_over.erase(user) > 0) ready.insert({entries_.at(user).last_use_tick, user});
    }
  };
  for (auto it = lru_.begin(); it != lru_.end() && !done(result);) {
    const EntryId id = it->second;
    ++it;  // only `id` and entries passed over (all behind `it`) are removed below
    const Entry& entry = entries_.at(id);
    if (entry.pins > 0) continue;
    if (!FreesBytes(id, entry)) {
      passed_over.insert(id);
      continue;
    }
    evict(id);
    while (!ready.empty() && !done(result)) {
      const EntryId next = ready.begin()->second;
      ready.erase(ready.begin());
      evict(next);
    }
  }
}

EvictionResult PrefixIndex::EvictDownTo(uint64_t target) {
  EvictionResult result;
  EvictLruUntil([&](const EvictionResult&) { return stored_bytes_ <= target; }, result);
  return result;
}

absl::StatusOr<EvictionResult> PrefixIndex::Evict(uint64_t bytes_needed) {
  if (bytes_needed > EvictableBytes()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("prefix eviction of ", bytes_needed, " bytes refused: only ", EvictableBytes(),
                     " of ", stored_bytes_, " stored bytes are unpinned"));
  }
  EvictionResult result;
  EvictLruUntil([&](const EvictionResult& so_far) { return so_far.freed_bytes >= bytes_needed; },
                result);
  return result;
}

absl::StatusOr<const PrefixIndex::Entry*> PrefixIndex::EvictableEntry(EntryId id) const {
  auto it = entries_.find(id);
  if (it == entries_.end()) {
    return EntryNotFound(id);
  }
  if (it->second.pins > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("prefix entry ", id.value, " is pinned by ", it->second.pins, " restores"));
  }
  return &it->second;
}

absl::StatusOr<EvictionResult> PrefixIndex::EvictEntry(EntryId id) {
  RETURN_IF_ERROR(EvictableEntry(id).status());
  EvictionResult result;
  RemoveInto(id, PrefixEventKind::kEvicted, "", result);
  return result;
}

absl::StatusOr<std::vector<uint64_t>> PrefixIndex::HandlesFreedByEvicting(EntryId id) const {
  ASSIGN_OR_RETURN(const Entry* entry, EvictableEntry(id));
  // RemoveEntry frees a block once its last user leaves: here, the blocks `id` alone uses.
  std::vector<uint64_t> handles;
  for (const BlockKey& key : entry->chain) {
    const Block& block = blocks_.at(key);
    if (block.users.size() == 1) handles.push_back(block.stored.storage_handle);
  }
  if (entry->boundary.has_value()) handles.push_back(entry->boundary->storage_handle);
  return handles;
}

absl::StatusOr<EvictionResult> PrefixIndex::DropEntry(EntryId id, std::string_view reason) {
  auto it = entries_.find(id);
  if (it == entries_.end()) {
    return EntryNotFound(id);
  }
  if (it->second.pins > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("prefix entry ", id.value, " cannot be dropped: pinned by ", it->second.pins,
                     " restores still reading it (unpin first)"));
  }
  EvictionResult result;
  RemoveInto(id, PrefixEventKind::kDropped, reason, result);
  return result;
}

EvictionResult PrefixIndex::SetBudget(uint64_t budget_bytes) {
  options_.budget_bytes = budget_bytes;
  return EnforceBudget();
}

EvictionResult PrefixIndex::EnforceBudget() { return EvictDownTo(options_.budget_bytes); }

PrefixIndexStats PrefixIndex::Stats() const {
  return PrefixIndexStats{.entries = entries_.size(),
                          .blocks = blocks_.size(),
                          .stored_bytes = stored_bytes_,
                          .pinned_bytes = pinned_bytes_,
                          .lookup_hits = lookup_hits_,
                          .lookup_partials = lookup_partials_,
                          .lookup_misses = lookup_misses_,
                          .evicted_entries = evicted_entries_,
                          .dropped_entries = dropped_entries_};
}

absl::StatusOr<EntryView> PrefixIndex::GetEntry(EntryId id) const {
  auto it = entries_.find(id);
  if (it == entries_.end()) {
    return EntryNotFound(id);
  }
  const Entry& entry = it->second;
  EntryView view;
  view.id = id;
  view.fingerprint = entry.fingerprint;
  view.boundary_tokens = entry.chain.size() * uint64_t{options_.block_tokens};
  view.boundary = entry.boundary;
  view.boundary_bytes = entry.boundary_bytes;
  view.epoch = entry.epoch;
  view.last_use_tick = entry.last_use_tick;
  view.pins = entry.pins;
  view.origin = entry.origin;
  for (const BlockKey& key : entry.chain) {
    const Block& block = blocks_.at(key);
    view.blocks.push_back(
        LookupBlock{.key = key, .id = block.id, .bytes = block.bytes, .stored = block.stored});
  }
  return view;
}

std::vector<EntryId> PrefixIndex::EntryIds() const {
  std::vector<EntryId> ids;
  ids.reserve(entries_.size());
  for (const auto& [id, entry] : entries_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

EventReplay PrefixIndex::EventsSince(uint64_t epoch, uint64_t last_sequence) const {
  EventReplay replay;
  replay.last_sequence = next_sequence_ - 1;
  // last_sequence 0 is a fresh subscriber: it knows no epoch yet.
  if ((last_sequence != 0 && epoch != options_.epoch) || last_sequence > replay.last_sequence) {
    replay.gap = true;
    return replay;
  }
  const uint64_t oldest = events_.empty() ? next_sequence_ : events_.front().sequence;
  if (last_sequence + 1 < oldest) {
    replay.gap = true;
    return replay;
  }
  for (uint64_t seq = last_sequence + 1; seq < next_sequence_; ++seq) {
    replay.events.push_back(events_[seq - oldest]);
  }
  return replay;
}

absl::Status PrefixIndex::CheckInvariants() const {
  absl::flat_hash_map<BlockKey, uint64_t> users;
  absl::flat_hash_map<BlockKey, uint32_t> pinned_users;
  uint64_t stored = 0;
  uint64_t pinned = 0;
  for (const auto& [id, entry] : entries_) {
    if (entry.chain.empty()) {
      return absl::InternalError(absl::StrCat("prefix entry ", id.value, " has no blocks"));
    }
    auto b = by_boundary_.find(entry.chain.back());
    if (b == by_boundary_.end() || b->second != id) {
      return absl::InternalError(
          absl::StrCat("prefix entry ", id.value, " is not indexed by its boundary"));
    }
    if (!lru_.contains({entry.last_use_tick, id})) {
      return absl::InternalError(absl::StrCat("prefix entry ", id.value, " is not in the LRU"));
    }
    for (const BlockKey& key : entry.chain) {
      if (!blocks_.contains(key)) {
        return absl::InternalError(
            absl::StrCat("prefix entry ", id.value, " uses a block that is not stored"));
      }
      ++users[key];
      if (entry.pins > 0) ++pinned_users[key];
    }
    stored += entry.boundary_bytes;
    if (entry.pins > 0) pinned += entry.boundary_bytes;
  }
  for (const auto& [key, block] : blocks_) {
    if (block.users.size() != users[key] || block.users.empty()) {
      return absl::InternalError(absl::StrCat("prefix block ", block.id.value, " refcount ",
                                              block.users.size(), " but ", users[key],
                                              " entries use it"));
    }
    if (block.pinned_users != pinned_users[key]) {
      return absl::InternalError(absl::StrCat("prefix block ", block.id.value, " pinned users ",
                                              block.pinned_users, " but ", pinned_users[key],
                                              " pinned entries use it"));
    }
    if (block.parent.has_value() != (block.index > 0) ||
        (block.parent.has_value() && !blocks_.contains(*block.parent))) {
      return absl::InternalError(absl::StrCat("prefix block ", block.id.value, " at depth ",
                                              block.index, " has no stored parent"));
    }
    stored += block.bytes;
    if (block.pinned_users > 0) pinned += block.bytes;
  }
  if (stored != stored_bytes_ || pinned != pinned_bytes_) {
    return absl::InternalError(absl::StrCat("prefix ledger says stored ", stored_bytes_, " pinned ",
                                            pinned_bytes_, "; recomputed ", stored, " and ",
                                            pinned));
  }
  if (by_boundary_.size() != entries_.size() || lru_.size() != entries_.size()) {
    return absl::InternalError(absl::StrCat("prefix index has ", entries_.size(), " entries, ",
                                            by_boundary_.size(), " boundaries, ", lru_.size(),
                                            " LRU slots"));
  }
  return absl::OkStatus();
}

}  // namespace memra
