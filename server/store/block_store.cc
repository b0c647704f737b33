#include "server/store/block_store.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>

#include <algorithm>
#include <cerrno>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/errors.h"
#include "core/checked_math.h"
#include "core/status_macros.h"
#include "spdlog/spdlog.h"

namespace memra {
namespace {

std::string KeyBytes(const BlockKey& key) { return std::string(key.begin(), key.end()); }

// Without F_SEAL_SHRINK the engine could truncate the file under the daemon's mapping, and the
// daemon's next copy would fault (SIGBUS) instead of refusing.
absl::Status CheckCannotShrink(int fd) {
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals >= 0 && (seals & F_SEAL_SHRINK) != 0) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrFormat(
      "the offered buffer's seals are %s; it must be sealed with F_SEAL_SHRINK (memfd_create "
      "with MFD_ALLOW_SEALING, then fcntl F_ADD_SEALS) so it cannot shrink under the daemon",
      seals < 0 ? absl::StrCat("unavailable (", strerror(errno), ")")
                : absl::StrFormat("0x%x", seals)));
}

// The size of a sealed memfd. Only tmpfs (plain memfd) is accepted: hugetlbfs pages can run out
// under a mapping (SIGBUS on first touch) and other file systems are not what an engine's pool
// lives in.
absl::StatusOr<uint64_t> MemfdBytes(int fd) {
  struct statfs filesystem {};
  if (fstatfs(fd, &filesystem) != 0) return PosixError("fstatfs of an offered buffer", errno);
  if (static_cast<uint64_t>(filesystem.f_type) != TMPFS_MAGIC) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "the offered buffer is on file system 0x%x, not tmpfs (0x%x): offer a memfd created "
        "without MFD_HUGETLB",
        static_cast<uint64_t>(filesystem.f_type), static_cast<uint64_t>(TMPFS_MAGIC)));
  }
  struct stat info {};
  if (fstat(fd, &info) != 0) return PosixError("fstat of an offered buffer", errno);
  if (!S_ISREG(info.st_mode)) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "the offered buffer is not a regular file (mode %o): offer a memfd", info.st_mode));
  }
  return static_cast<uint64_t>(std::max<off_t>(info.st_size, 0));
}

}  // namespace

BlockStore::Registration::~Registration() {
  if (absl::Status freed = backend->FreeArena(arena); !freed.ok()) {
    spdlog::error("block store: unmapping a registration: {}", freed.ToString());
  }
}

BlockStore::BlockStore(PrefixCache* cache, DeviceBackend* backend, Clock* clock,
                       BlockStoreLimits limits, ConnectionCheck connection_open, uint64_t epoch)
    : cache_(cache),
      backend_(backend),
      clock_(clock),
      limits_(std::move(limits)),
      connection_open_(std::move(connection_open)),
      next_id_(FirstIdOfEpoch(epoch)) {}

BlockStore::~BlockStore() {
  std::vector<std::vector<EntryId>> pinned;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, pin] : pins_) pinned.push_back(std::move(pin.entries));
    pins_.clear();
    registrations_.clear();
    offers_.clear();
  }
  if (cache_ == nullptr) return;
  for (const std::vector<EntryId>& entries : pinned) cache_->UnpinPoolEntries(entries);
}

absl::Status BlockStore::Enabled() const {
  if (cache_ != nullptr) return absl::OkStatus();
  return absl::FailedPreconditionError(
      "this daemon has no prefix cache (prefix_cache_budget_bytes is 0): the block store stores "
      "its blocks there");
}

template <typename Map>
size_t BlockStore::CountOf(const Map& map, uint64_t engine) {
  return static_cast<size_t>(std::count_if(map.begin(), map.end(), [&](const auto& entry) {
    if constexpr (std::is_same_v<Map, absl::flat_hash_map<uint64_t, std::shared_ptr<Registration>>>) {
      return entry.second->engine == engine;
    } else {
      return entry.second.engine == engine;
    }
  }));
}

uint64_t BlockStore::EngineBytesLocked(uint64_t engine) const {
  uint64_t bytes = 0;
  for (const auto& [id, offer] : offers_) {
    if (offer.engine == engine) bytes += offer.bytes;
  }
  for (const auto& [id, registration] : registrations_) {
    if (registration->engine == engine) bytes += registration->bytes;
  }
  return bytes;
}

absl::StatusOr<uint64_t> BlockStore::OfferBuffer(uint64_t engine, uint64_t connection,
                                                 uint64_t bytes, ScopedFd fd) {
  RETURN_IF_ERROR(Enabled());
  // The seals first: a file that cannot shrink keeps the size read after them, and anything but
  // a sealable memfd is refused before a call (fstat on FUSE) that could block this thread.
  RETURN_IF_ERROR(CheckCannotShrink(fd.get()));
  ASSIGN_OR_RETURN(const uint64_t file_bytes, MemfdBytes(fd.get()));
  if (file_bytes < bytes) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the offered buffer holds ", file_bytes, " bytes; the offer says ", bytes));
  }
  absl::MutexLock lock(&mu_);
  if (offers_.size() >= limits_.max_offers) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the daemon holds ", offers_.size(), " unregistered buffer offers of all engines; the "
        "limit is ", limits_.max_offers, " (block_store_max_offers)"));
  }
  const size_t offers = CountOf(offers_, engine);
  if (offers >= limits_.offers_per_engine) {
    return absl::ResourceExhaustedError(absl::StrCat("engine ", engine, " holds ", offers,
                                                     " unregistered buffer offers; the limit is ",
                                                     limits_.offers_per_engine,
                                                     " per engine (its share of "
                                                     "block_store_max_offers ",
                                                     limits_.max_offers, ")"));
  }
  const uint64_t held = EngineBytesLocked(engine);
  if (bytes > limits_.engine_bytes || held > limits_.engine_bytes - bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "engine ", engine, " offers ", bytes, " bytes and holds ", held,
        " offered or registered; the limit is ", limits_.engine_bytes,
        " (block_store_engine_bytes)"));
  }
  const uint64_t id = next_id_++;
  offers_[id] = Offer{.engine = engine,
                      .connection = connection,
                      .bytes = bytes,
                      .fd = std::move(fd)};
  return id;
}

absl::StatusOr<BlockStoreRegistration> BlockStore::Register(
    uint64_t engine, const std::string& scope, BlockPoolSpec spec,
    absl::Span<const EngineBufferRequest> buffers) {
  RETURN_IF_ERROR(Enabled());
  spec.buffer_bytes.clear();
  for (const EngineBufferRequest& buffer : buffers) spec.buffer_bytes.push_back(buffer.bytes);
  ASSIGN_OR_RETURN(BlockPoolLayout layout, ValidateBlockPool(spec, limits_.pool));
  // ValidateBlockPool refused an empty list: buffers[0] exists.
  const bool by_ipc_handle = !buffers[0].cuda_ipc_handle.empty();
  for (size_t i = 1; i < buffers.size(); ++i) {
    if (buffers[i].cuda_ipc_handle.empty() == by_ipc_handle) {
      return absl::InvalidArgumentError(absl::StrCat(
          "buffer 0 is ", by_ipc_handle ? "a CUDA IPC handle" : "a handoff buffer", " but buffer ",
          i, " is not: a registration's buffers are all one kind"));
    }
  }
  std::vector<EngineBufferFd> to_map;
  std::vector<EngineBufferIpc> to_open;
  uint64_t total = 0;
  {
    absl::MutexLock lock(&mu_);
    const size_t registered = CountOf(registrations_, engine);
    if (registered >= limits_.registrations_per_engine) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "engine ", engine, " holds ", registered, " registrations; the limit is ",
          limits_.registrations_per_engine));
    }
    size_t mapped_buffers = 0;
    size_t engine_mapped_buffers = 0;
    for (const auto& [id, registration] : registrations_) {
      mapped_buffers += registration->base.size();
      if (registration->engine == engine) engine_mapped_buffers += registration->base.size();
    }
    if (engine_mapped_buffers > limits_.mapped_buffers_per_engine ||
        buffers.size() > limits_.mapped_buffers_per_engine - engine_mapped_buffers) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "registering ", buffers.size(), " buffers: engine ", engine, " maps ",
          engine_mapped_buffers, "; one engine may map at most ",
          limits_.mapped_buffers_per_engine, " (its share of block_store_max_mapped_buffers ",
          limits_.max_mapped_buffers, ")"));
    }
    if (mapped_buffers > limits_.max_mapped_buffers ||
        buffers.size() > limits_.max_mapped_buffers - mapped_buffers) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "registering ", buffers.size(), " buffers: the daemon maps ", mapped_buffers,
          " of all engines; the limit is ", limits_.max_mapped_buffers,
          " (block_store_max_mapped_buffers)"));
    }
    for (size_t i = 0; i < buffers.size() && by_ipc_handle; ++i) {
      ASSIGN_OR_RETURN(total, CheckedAdd(total, buffers[i].bytes, "registered bytes"));
      to_open.push_back({.ipc_handle = buffers[i].cuda_ipc_handle,
                         .offset_in_allocation = buffers[i].offset_in_allocation,
                         .bytes = buffers[i].bytes});
    }
    for (size_t i = 0; i < buffers.size() && !by_ipc_handle; ++i) {
      const EngineBufferRequest& buffer = buffers[i];
      auto it = offers_.find(buffer.handoff_buffer_id);
      if (it == offers_.end()) {
        return absl::NotFoundError(absl::StrCat(
            "buffer ", i, ": no offered buffer ", buffer.handoff_buffer_id,
            " (offer it over the handoff socket first; an id is used up by one registration)"));
      }
      const Offer& offer = it->second;
      if (offer.engine != engine) {
        return absl::PermissionDeniedError(absl::StrCat("buffer ", i, ": offered buffer ",
                                                        buffer.handoff_buffer_id,
                                                        " is not engine ", engine, "'s"));
      }
      if (!connection_open_(offer.connection, engine)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "buffer ", i, ": offered buffer ", buffer.handoff_buffer_id, " came over handoff "
            "connection ", offer.connection, ", which is closed (an offer is valid while its "
            "connection is)"));
      }
      // Read again right before mapping: the mapping must lie inside the file as it is now.
      ASSIGN_OR_RETURN(const uint64_t file_bytes, MemfdBytes(offer.fd.get()));
      absl::StatusOr<uint64_t> end =
          CheckedAdd(buffer.offset_in_allocation, buffer.bytes, "buffer range");
      if (!end.ok() || *end > file_bytes) {
        return absl::FailedPreconditionError(absl::StrCat(
            "buffer ", i, ": ", buffer.bytes, " bytes at offset ", buffer.offset_in_allocation,
            " of offered buffer ", buffer.handoff_buffer_id, ", which holds ", file_bytes));
      }
      for (size_t j = 0; j < i; ++j) {
        if (buffers[j].handoff_buffer_id == buffer.handoff_buffer_id) {
          return absl::InvalidArgumentError(absl::StrCat(
              "buffers ", j, " and ", i, " name the same offered buffer ",
              buffer.handoff_buffer_id, " (an id is used once)"));
        }
      }
      ASSIGN_OR_RETURN(total, CheckedAdd(total, buffer.bytes, "registered bytes"));
      to_map.push_back({.fd = offer.fd.get(),
                        .offset = buffer.offset_in_allocation,
                        .bytes = buffer.bytes});
    }
    // The offers' bytes become the registration's: the cap counts them once.
    uint64_t offered = 0;
    for (const EngineBufferRequest& buffer : buffers) {
      if (!by_ipc_handle) offered += offers_.at(buffer.handoff_buffer_id).bytes;
    }
    const uint64_t held = EngineBytesLocked(engine) - offered;
    if (total > limits_.engine_bytes || held > limits_.engine_bytes - total) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "engine ", engine, " registers ", total, " bytes and holds ", held,
          "; the limit is ", limits_.engine_bytes, " (block_store_engine_bytes)"));
    }
    // Mapped under mu_ so no other registration takes these offers (or this engine's byte
    // allowance) meanwhile; mapping is a few system or driver calls per buffer.
    ASSIGN_OR_RETURN(MappedEngineBuffers mapped, by_ipc_handle
                                                     ? backend_->MapEngineIpcBuffers(to_open)
                                                     : backend_->MapEngineBuffers(to_map));
    auto registration = std::make_shared<Registration>();
    registration->engine = engine;
    registration->arena = mapped.arena;
    registration->base = std::move(mapped.base);
    registration->bytes = total;
    registration->backend = backend_;
    registration->layout = std::move(layout);
    for (const BlockGroupLayout& group : registration->layout.groups) {
      ScopedShape space;
      space.scope = scope;
      space.shape = group.fingerprint;
      space.key = ScopedShapeFingerprint(scope, group.fingerprint);
      space.engine_pool = true;
      space.block_tokens = registration->layout.tokens_per_block;
      registration->spaces.push_back(std::move(space));
    }
    if (!by_ipc_handle) {
      for (const EngineBufferRequest& buffer : buffers) offers_.erase(buffer.handoff_buffer_id);
    }
    const uint64_t id = next_id_++;
    registrations_[id] = registration;
    BlockStoreRegistration result;
    result.registration_id = id;
    result.groups = registration->layout.groups;
    return result;
  }
}

absl::Status BlockStore::Unregister(uint64_t engine, uint64_t registration_id) {
  RETURN_IF_ERROR(Enabled());
  std::shared_ptr<Registration> gone;  // unmapped after the lock
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(Owned(engine, registration_id).status());
  gone = std::move(registrations_[registration_id]);
  registrations_.erase(registration_id);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<BlockStore::Registration>> BlockStore::Owned(
    uint64_t engine, uint64_t registration_id) const {
  auto it = registrations_.find(registration_id);
  if (it == registrations_.end()) {
    return absl::NotFoundError(absl::StrCat("no registration ", registration_id,
                                            " (unregistered, or its engine's lease ended)"));
  }
  if (it->second->engine != engine) {
    return absl::PermissionDeniedError(absl::StrCat(
        "registration ", registration_id, " is not engine ", engine, "'s"));
  }
  return it->second;
}

absl::StatusOr<BlockStore::Resolved> BlockStore::Resolve(uint64_t engine,
                                                         uint64_t registration_id,
                                                         uint32_t kv_group,
                                                         const BlockKeyRequest& keys) const {
  Resolved resolved;
  {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(resolved.registration, Owned(engine, registration_id));
  }
  const Registration& registration = *resolved.registration;
  ASSIGN_OR_RETURN(resolved.group, FindBlockGroup(registration.layout, kv_group));
  resolved.space = &registration.spaces[resolved.group - registration.layout.groups.data()];
  if (!keys.hashes.empty() && !keys.token_ids.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "keys give both ", keys.hashes.size(), " block hashes and ", keys.token_ids.size(),
        " token ids; name blocks by one of them"));
  }
  const uint64_t tokens_per_block = registration.layout.tokens_per_block;
  const uint64_t count =
      keys.hashes.empty() ? keys.token_ids.size() / tokens_per_block : keys.hashes.size();
  if (count > limits_.max_keys) {
    return absl::InvalidArgumentError(absl::StrCat("keys name ", count,
                                                   " blocks; a call names at most ",
                                                   limits_.max_keys));
  }
  if (keys.hashes.empty()) {
    ASSIGN_OR_RETURN(resolved.keys,
                     ChainBlockKeys(resolved.space->key, keys.token_ids,
                                    static_cast<uint32_t>(tokens_per_block)));
  } else {
    ASSIGN_OR_RETURN(resolved.keys, EngineHashKeys(resolved.space->key, keys.hashes));
  }
  return resolved;
}

absl::StatusOr<BlockStore::Resolved> BlockStore::ResolveTransfer(uint64_t engine,
                                                                 const BlockTransfer& transfer,
                                                                 bool distinct) const {
  ASSIGN_OR_RETURN(Resolved resolved,
                   Resolve(engine, transfer.registration_id, transfer.kv_group, transfer.keys));
  ASSIGN_OR_RETURN(resolved.first,
                   CheckBlockIds(transfer.block_ids, resolved.keys.size(),
                                 transfer.keys.hashes.empty(), transfer.skip_blocks,
                                 resolved.registration->layout.num_blocks, distinct));
  return resolved;
}

absl::StatusOr<BlockStore::Pin> BlockStore::TakePinLocked(uint64_t engine, uint64_t pin_id) {
  auto it = pins_.find(pin_id);
  if (it == pins_.end()) {
    return absl::NotFoundError(
        absl::StrCat("no pin ", pin_id, " (released, expired, or never made)"));
  }
  if (it->second.engine != engine) {
    return absl::PermissionDeniedError(
        absl::StrCat("pin ", pin_id, " is not engine ", engine, "'s"));
  }
  Pin pin = std::move(it->second);
  pins_.erase(it);
  return pin;
}

PoolBlock BlockStore::PoolBlockOf(const Resolved& resolved, const BlockKey& key,
                                  uint32_t block_id, bool state) const {
  const Registration& registration = *resolved.registration;
  PoolBlock block;
  block.key = state ? BoundaryStateKey(key) : key;
  // block_id < num_blocks (CheckBlockIds): BlockRanges cannot refuse it.
  const std::vector<PoolRange> ranges =
      BlockRanges(registration.layout, *resolved.group, block_id, state).value();
  for (const PoolRange& range : ranges) {
    block.pieces.push_back({.pool_offset = registration.base[range.buffer] + range.offset,
                            .bytes = range.bytes});
    block.bytes += range.bytes;
  }
  return block;
}

absl::StatusOr<BlockLookup> BlockStore::Lookup(uint64_t engine, uint64_t registration_id,
                                               uint32_t kv_group, const BlockKeyRequest& keys,
                                               absl::Duration pin_ttl) {
  RETURN_IF_ERROR(Enabled());
  ASSIGN_OR_RETURN(Resolved resolved, Resolve(engine, registration_id, kv_group, keys));
  const bool pin = pin_ttl > absl::ZeroDuration();
  if (pin) {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckPinRoomLocked(engine, 0));
  }
  PoolLookupResult found = cache_->LookupPoolBlocks(*resolved.space, resolved.keys,
                                                    resolved.group->state_bytes > 0, pin);
  BlockLookup result;
  result.matched_blocks = found.matched_blocks;
  result.medium = found.medium;
  if (!found.pinned.empty()) {
    // matched_blocks <= max_keys and block / state bytes are bounded by the registration.
    const uint64_t bytes =
        found.matched_blocks * resolved.group->block_bytes +
        (found.pinned.size() > found.matched_blocks ? resolved.group->state_bytes : 0);
    absl::Status room;
    {
      // Checked again with the pin's own bytes, and taken in the same hold of mu_: concurrent
      // lookups of one engine cannot together pass the limits.
      absl::MutexLock lock(&mu_);
      room = CheckPinRoomLocked(engine, bytes);
      if (room.ok()) {
        result.pin_id = next_id_++;
        pins_[result.pin_id] =
            Pin{.engine = engine,
                .entries = std::move(found.pinned),
                .bytes = bytes,
                .expires = clock_->Now() + std::min(pin_ttl, limits_.max_pin_ttl)};
      }
    }
    if (!room.ok()) {
      cache_->UnpinPoolEntries(found.pinned);
      return room;
    }
  }
  return result;
}

absl::Status BlockStore::CheckPinRoomLocked(uint64_t engine, uint64_t bytes) const {
  size_t pins = 0;
  uint64_t pinned_bytes = 0;
  for (const auto& [id, held] : pins_) {
    if (held.engine != engine) continue;
    ++pins;
    pinned_bytes += held.bytes;
  }
  if (pins >= limits_.pins_per_engine) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "engine ", engine, " holds ", pins, " pins; the limit is ", limits_.pins_per_engine,
        " (load or unpin them)"));
  }
  if (bytes > limits_.pinned_bytes_per_engine ||
      pinned_bytes > limits_.pinned_bytes_per_engine - bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "engine ", engine, " holds ", pinned_bytes, " pinned bytes and this lookup would pin ",
        bytes, " more; the limit is ", limits_.pinned_bytes_per_engine,
        " (a quarter of prefix_cache_budget_bytes; load or unpin them)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<BlockTransferResult> BlockStore::Store(uint64_t engine,
                                                      const BlockTransfer& transfer) {
  RETURN_IF_ERROR(Enabled());
  ASSIGN_OR_RETURN(Resolved resolved, ResolveTransfer(engine, transfer, /*distinct=*/false));
  const bool by_tokens = transfer.keys.hashes.empty();
  const uint32_t tokens_per_block = resolved.registration->layout.tokens_per_block;
  const size_t count = transfer.block_ids.size();
  if (!by_tokens && !transfer.event_token_ids.empty() &&
      transfer.event_token_ids.size() != uint64_t{tokens_per_block} * count) {
    return absl::InvalidArgumentError(absl::StrCat(
        transfer.event_token_ids.size(), " event token ids for ", count, " blocks of ",
        tokens_per_block, " tokens (give none or ", uint64_t{tokens_per_block} * count, ")"));
  }
  if (!by_tokens && transfer.parent_hash.size() > kMaxEngineHashBytes) {
    return absl::InvalidArgumentError(absl::StrCat("parent_hash is ", transfer.parent_hash.size(),
                                                   " bytes; at most ", kMaxEngineHashBytes));
  }
  const std::vector<std::string>& routed = transfer.event_block_hashes;
  if (!routed.empty() && (by_tokens || routed.size() != count)) {
    return absl::InvalidArgumentError(absl::StrCat(
        routed.size(), " event block hashes for ", count, " blocks",
        by_tokens ? " named by token ids (give them with block hashes only)"
                  : absl::StrCat(" (give none or ", count, ")")));
  }
  for (size_t i = 0; i < routed.size(); ++i) {
    if (routed[i].empty() || routed[i].size() > kMaxEngineHashBytes) {
      return absl::InvalidArgumentError(absl::StrCat("event block hash ", i, " is ",
                                                     routed[i].size(), " bytes; 1 to ",
                                                     kMaxEngineHashBytes));
    }
  }
  std::vector<PoolBlock> blocks;
  blocks.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    const uint64_t k = resolved.first + i;
    PoolBlock block = PoolBlockOf(resolved, resolved.keys[k], transfer.block_ids[i], false);
    PrefixEventOrigin& origin = block.origin;
    origin.engine_id = engine;
    origin.from_engine_pool = true;
    origin.block_tokens = tokens_per_block;
    if (by_tokens) {
      if (k > 0) origin.parent_block_hash = KeyBytes(resolved.keys[k - 1]);
      const auto from = transfer.keys.token_ids.begin() + k * tokens_per_block;
      origin.token_ids.assign(from, from + tokens_per_block);
    } else {
      // Routers' identities: the event hashes where given, else the keys themselves.
      const std::vector<std::string>& chain = routed.empty() ? transfer.keys.hashes : routed;
      origin.block_hashes = {chain[k]};
      origin.parent_block_hash = k == 0 ? transfer.parent_hash : chain[k - 1];
      if (!transfer.event_token_ids.empty()) {
        const auto from = transfer.event_token_ids.begin() + i * tokens_per_block;
        origin.token_ids.assign(from, from + tokens_per_block);
      }
    }
    blocks.push_back(std::move(block));
  }
  std::optional<PoolBlock> state;
  if (resolved.group->state_bytes > 0 && count > 0) {
    state = PoolBlockOf(resolved, blocks.back().key, transfer.block_ids.back(), true);
    // Its own entry: its events must not name the block's hash (an evicted state is not an
    // evicted block to a router).
    state->origin.engine_id = engine;
    state->origin.from_engine_pool = true;
    state->origin.block_tokens = tokens_per_block;
  }
  BlockTransferResult result;
  result.blocks =
      cache_->StorePoolBlocks(*resolved.space, resolved.registration->arena, blocks, state);
  for (const PoolBlockResult& block : result.blocks) result.copied_bytes += block.copied_bytes;
  return result;
}

absl::StatusOr<BlockTransferResult> BlockStore::Load(uint64_t engine,
                                                     const BlockTransfer& transfer) {
  RETURN_IF_ERROR(Enabled());
  ASSIGN_OR_RETURN(Resolved resolved, ResolveTransfer(engine, transfer, /*distinct=*/true));
  std::optional<Pin> released;
  if (transfer.pin_id != 0) {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(released, TakePinLocked(engine, transfer.pin_id));
  }
  std::vector<PoolBlock> blocks;
  blocks.reserve(transfer.block_ids.size());
  for (size_t i = 0; i < transfer.block_ids.size(); ++i) {
    blocks.push_back(
        PoolBlockOf(resolved, resolved.keys[resolved.first + i], transfer.block_ids[i], false));
  }
  std::optional<PoolBlock> state;
  if (resolved.group->state_bytes > 0 && !blocks.empty()) {
    state = PoolBlockOf(resolved, blocks.back().key, transfer.block_ids.back(), true);
  }
  BlockTransferResult result;
  // The lookup's pin is released after the load holds its own, before a corrupt block drops.
  result.blocks = cache_->LoadPoolBlocks(
      *resolved.space, resolved.registration->arena, blocks, state,
      released.has_value() ? absl::Span<const EntryId>(released->entries)
                           : absl::Span<const EntryId>());
  for (const PoolBlockResult& block : result.blocks) result.copied_bytes += block.copied_bytes;
  return result;
}

absl::Status BlockStore::Unpin(uint64_t engine, uint64_t pin_id) {
  RETURN_IF_ERROR(Enabled());
  Pin released;
  {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(released, TakePinLocked(engine, pin_id));
  }
  cache_->UnpinPoolEntries(released.entries);
  return absl::OkStatus();
}

void BlockStore::ForgetEngine(uint64_t engine) {
  std::vector<std::shared_ptr<Registration>> gone;
  std::vector<EntryId> unpinned;
  {
    absl::MutexLock lock(&mu_);
    absl::erase_if(offers_, [&](const auto& entry) { return entry.second.engine == engine; });
    for (auto it = registrations_.begin(); it != registrations_.end();) {
      if (it->second->engine == engine) {
        gone.push_back(std::move(it->second));
        registrations_.erase(it++);
      } else {
        ++it;
      }
    }
    for (auto it = pins_.begin(); it != pins_.end();) {
      if (it->second.engine == engine) {
        unpinned.insert(unpinned.end(), it->second.entries.begin(), it->second.entries.end());
        pins_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  if (!unpinned.empty()) cache_->UnpinPoolEntries(unpinned);
  if (!gone.empty()) {
    spdlog::info("block store: engine {}'s {} registrations unmapped", engine, gone.size());
  }
}

void BlockStore::ExpirePins() {
  std::vector<EntryId> expired;
  {
    const absl::Time now = clock_->Now();
    absl::MutexLock lock(&mu_);
    for (auto it = pins_.begin(); it != pins_.end();) {
      if (it->second.expires <= now) {
        expired.insert(expired.end(), it->second.entries.begin(), it->second.entries.end());
        pins_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  if (!expired.empty()) cache_->UnpinPoolEntries(expired);
}

void BlockStore::ExpireOffers() {
  std::vector<ScopedFd> closed;  // closed after the lock
  absl::MutexLock lock(&mu_);
  for (auto it = offers_.begin(); it != offers_.end();) {
    if (!connection_open_(it->second.connection, it->second.engine)) {
      closed.push_back(std::move(it->second.fd));
      offers_.erase(it++);
    } else {
      ++it;
    }
  }
}

std::vector<uint64_t> BlockStore::Engines() const {
  absl::MutexLock lock(&mu_);
  std::vector<uint64_t> engines;
  for (const auto& [id, offer] : offers_) engines.push_back(offer.engine);
  for (const auto& [id, registration] : registrations_) engines.push_back(registration->engine);
  for (const auto& [id, pin] : pins_) engines.push_back(pin.engine);
  std::sort(engines.begin(), engines.end());
  engines.erase(std::unique(engines.begin(), engines.end()), engines.end());
  return engines;
}

BlockStore::Counts BlockStore::counts() const {
  absl::MutexLock lock(&mu_);
  Counts counts;
  counts.offers = offers_.size();
  counts.registrations = registrations_.size();
  counts.pins = pins_.size();
  for (const auto& [id, registration] : registrations_) {
    counts.registered_bytes += registration->bytes;
  }
  return counts;
}

}  // namespace memra
