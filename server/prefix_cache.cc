#include "server/prefix_cache.h"

#include <algorithm>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/checked_math.h"
#include "core/sha256.h"
#include "core/status_macros.h"
#include "spdlog/spdlog.h"

namespace memra {
namespace {

// The session's committed token ids [0, requested.size()) when `requested` agrees with them
// position by position (and names no position the session has not committed). FAILED_PRECONDITION when the committed ids
// are unknown (a commit without token ids, a hydration); INVALID_ARGUMENT naming the first
// differing position and both ids, or both counts.
absl::StatusOr<absl::Span<const int32_t>> CommittedTokensMatching(
    SessionId session, const SessionState& state,
    const std::optional<std::vector<int32_t>>& committed, absl::Span<const int32_t> requested) {
  if (!committed.has_value() || committed->size() != state.committed_len()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "prefix capture: session ", session.value, "'s committed token ids are unknown (",
        state.committed_len(),
        " rows committed, some without token ids); commit with token ids to capture"));
  }
  const size_t common = std::min(requested.size(), committed->size());
  for (size_t i = 0; i < common; ++i) {
    if (requested[i] != (*committed)[i]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prefix capture: token id at position ", i, " is ", requested[i],
          " in the request but session ", session.value, " committed ", (*committed)[i],
          "; a capture stores the ids the session committed"));
    }
  }
  if (requested.size() > committed->size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefix capture: the request gives ", requested.size(), " token ids but session ",
        session.value, " committed ", committed->size()));
  }
  return absl::MakeConstSpan(*committed).subspan(0, requested.size());
}

constexpr std::string_view kShapeDomain = "memra-kv/prefix-shape/v1";
constexpr std::string_view kScopeDomain = "memra-kv/cache-scope/v1";
constexpr uint64_t kF32 = sizeof(float);

void HashU32(Sha256& hash, uint32_t value) {
  char bytes[4];
  for (int i = 0; i < 4; ++i) bytes[i] = static_cast<char>((value >> (8 * i)) & 0xff);
  hash.Update(std::string_view(bytes, sizeof(bytes)));
}

enum class Toward { kStorage, kSession };

// The copy ranges of `pieces` of block `block_index`: each piece's range in the session's arena
// and, back to back from offset 0, in the stored piece; `toward` says which side is written.
// Every range is checked (overflow, plane bounds) before any copy is issued.
absl::StatusOr<std::vector<CopyRange>> PieceRanges(const SessionLayoutVersion& layout,
                                                   const std::vector<StoredPiece>& pieces,
                                                   uint64_t block_index, Toward toward) {
  std::vector<CopyRange> ranges;
  ranges.reserve(pieces.size());
  uint64_t stored_at = 0;
  for (const StoredPiece& piece : pieces) {
    ASSIGN_OR_RETURN(uint64_t shift, CheckedMul(block_index, piece.bytes, "block offset"));
    ASSIGN_OR_RETURN(uint64_t offset, CheckedAdd(piece.plane_offset, shift, "block offset"));
    ASSIGN_OR_RETURN(uint64_t session_at,
                     PlaneRangeOffset(layout, piece.plane, offset, piece.bytes));
    ranges.push_back(toward == Toward::kStorage
                         ? CopyRange{.dst_offset = stored_at, .src_offset = session_at,
                                     .bytes = piece.bytes}
                         : CopyRange{.dst_offset = session_at, .src_offset = stored_at,
                                     .bytes = piece.bytes});
    stored_at += piece.bytes;
  }
  return ranges;
}

// Appends a piece, adding its bytes to `total` (overflow-checked).
absl::Status AddPiece(std::vector<StoredPiece>& pieces, uint64_t& total, PlaneRef plane,
                      uint64_t plane_offset, uint64_t bytes) {
  ASSIGN_OR_RETURN(total, CheckedAdd(total, bytes, "prefix stored bytes"));
  pieces.push_back({plane, plane_offset, bytes});
  return absl::OkStatus();
}

absl::StatusOr<size_t> KvLayerIndex(const SessionState& state, uint32_t layer) {
  for (size_t i = 0; i < state.kv().layer_count(); ++i) {
    if (state.kv().shapes()[i].layer == layer) return i;
  }
  return absl::InternalError(absl::StrCat("layer ", layer, " has no K/V state"));
}

absl::StatusOr<const LatentLayerState*> LatentLayer(const SessionState& state, uint32_t layer) {
  for (const LatentLayerState& latent : state.latent()) {
    if (latent.layer == layer) return &latent;
  }
  return absl::InternalError(absl::StrCat("layer ", layer, " has no latent state"));
}

// The session's shape in its owner's cache scope.
absl::StatusOr<ScopedShape> ShapeOf(const DaemonSession& session) {
  const DaemonSession::Params& params = session.params();
  ASSIGN_OR_RETURN(PlanFingerprint model, FingerprintModelPlan(*params.model, params.defaults));
  ScopedShape out;
  out.scope = params.cache_scope;
  out.shape = PrefixShapeFingerprint(model, params.shape);
  out.key = ScopedShapeFingerprint(out.scope, out.shape);
  return out;
}

bool IsFresh(const SessionState& state) {
  if (!state.kv().state().IsFresh() || state.position() != 0) return false;
  return std::all_of(state.latent().begin(), state.latent().end(),
                     [](const LatentLayerState& latent) { return latent.len == 0; });
}

}  // namespace

PlanFingerprint ScopedShapeFingerprint(absl::string_view scope, const PlanFingerprint& shape) {
  Sha256 hash;
  hash.Update(kScopeDomain);
  HashU32(hash, static_cast<uint32_t>(scope.size()));
  hash.Update(std::string_view(scope.data(), scope.size()));
  hash.Update(std::string_view(reinterpret_cast<const char*>(shape.data()), shape.size()));
  return hash.Finish();
}

PlanFingerprint PrefixShapeFingerprint(const PlanFingerprint& model, const SessionShape& shape) {
  if (shape.layer_lo == 0 && !shape.layer_hi.has_value() && shape.tp_ranks == 1) return model;
  Sha256 hash;
  hash.Update(kShapeDomain);
  hash.Update(std::string_view(reinterpret_cast<const char*>(model.data()), model.size()));
  HashU32(hash, shape.layer_lo);
  HashU32(hash, shape.layer_hi.value_or(0xffffffffu));
  HashU32(hash, shape.tp_ranks);
  return hash.Finish();
}

absl::StatusOr<StoredLayout> PlanStoredLayout(const SessionPlan& plan, const SessionState& state,
                                              uint64_t boundary, uint64_t block_rows) {
  StoredLayout out;
  out.block_rows = block_rows;
  for (const LayerGeometry& layer : plan.layers) {
    const uint32_t il = layer.layer;
    switch (layer.kind) {
      case StateKind::kKv:
      case StateKind::kSlidingKv: {
        if (!layer.ring) {
          ASSIGN_OR_RETURN(uint64_t k, CheckedMul(block_rows, layer.k_token_bytes, "block K"));
          ASSIGN_OR_RETURN(uint64_t v, CheckedMul(block_rows, layer.v_token_bytes, "block V"));
          RETURN_IF_ERROR(AddPiece(out.block_pieces, out.block_bytes, {il, PlaneKind::kKeys}, 0, k));
          RETURN_IF_ERROR(
              AddPiece(out.block_pieces, out.block_bytes, {il, PlaneKind::kValues}, 0, v));
          break;
        }
        out.position_addressed_only = false;
        ASSIGN_OR_RETURN(size_t index, KvLayerIndex(state, il));
        absl::StatusOr<std::pair<uint64_t, RowRange>> window =
            state.kv().ring(index)->RestorePlan(boundary);
        if (!window.ok()) {
          return absl::FailedPreconditionError(absl::StrCat(
              "layer ", il, ": the SWA window ending at ", boundary,
              " is no longer resident (ring base ", state.kv().ring(index)->base(), ", ",
              state.kv().ring(index)->rows(), " rows; lapped): ", window.status().message()));
        }
        const RowRange rows = window->second;
        RETURN_IF_ERROR(AddPiece(out.boundary_pieces, out.boundary_bytes, {il, PlaneKind::kKeys},
                                 rows.start * layer.k_token_bytes,
                                 rows.size() * layer.k_token_bytes));
        RETURN_IF_ERROR(AddPiece(out.boundary_pieces, out.boundary_bytes,
                                 {il, PlaneKind::kValues}, rows.start * layer.v_token_bytes,
                                 rows.size() * layer.v_token_bytes));
        break;
      }
      case StateKind::kLatent: {
        ASSIGN_OR_RETURN(uint64_t row_bytes, CheckedMul(layer.latent_width, kF32, "latent row"));
        ASSIGN_OR_RETURN(uint64_t bytes, CheckedMul(block_rows, row_bytes, "block latent rows"));
        RETURN_IF_ERROR(
            AddPiece(out.block_pieces, out.block_bytes, {il, PlaneKind::kLatentRows}, 0, bytes));
        if (layer.index_width == 0) break;
        out.position_addressed_only = false;
        ASSIGN_OR_RETURN(const LatentLayerState* latent, LatentLayer(state, il));
        if (latent->len != boundary) {
          return absl::FailedPreconditionError(absl::StrCat(
              "layer ", il, ": the indexer's tail and pool keys exist only at the latent length ",
              latent->len, ", not at boundary ", boundary));
        }
        // snapshot_plane's rules: a drained boundary (index_pools_ready == len / pool).
        ASSIGN_OR_RETURN(LatentCapturePlan capture, PlanLatentCapture(*latent));
        for (const LatentCopy& copy : capture.copies) {
          if (copy.plane == LatentPlane::kRows) continue;  // stored per block
          const PlaneKind kind =
              copy.plane == LatentPlane::kPoolKeys ? PlaneKind::kPoolKeys : PlaneKind::kIndexRows;
          RETURN_IF_ERROR(AddPiece(out.boundary_pieces, out.boundary_bytes, {il, kind},
                                   copy.plane_offset_elems * kF32, copy.elems * kF32));
        }
        break;
      }
      case StateKind::kRecurrent:
        out.position_addressed_only = false;
        if (boundary != state.committed_len() || state.position() != state.committed_len()) {
          return absl::FailedPreconditionError(absl::StrCat(
              "layer ", il, ": recurrent state exists only at the position ", state.position(),
              " (committed ", state.committed_len(), "), not at boundary ", boundary));
        }
        RETURN_IF_ERROR(AddPiece(out.boundary_pieces, out.boundary_bytes,
                                 {il, PlaneKind::kConvState}, 0, layer.conv_elems * kF32));
        RETURN_IF_ERROR(AddPiece(out.boundary_pieces, out.boundary_bytes,
                                 {il, PlaneKind::kSsmState}, 0, layer.ssm_elems * kF32));
        break;
      case StateKind::kNone:
      case StateKind::kSharedKv:
        break;
    }
  }
  if (out.block_bytes == 0) {
    return absl::InvalidArgumentError(
        "prefix cache: the session has no position-addressed layer (flat K/V or latent rows) "
        "to store blocks of");
  }
  return out;
}

absl::StatusOr<std::unique_ptr<PrefixCache>> PrefixCache::Create(const PrefixCacheOptions& options,
                                                                 DeviceBackend* backend,
                                                                 DeviceBudget* budget) {
  if (backend == nullptr) return absl::InvalidArgumentError("PrefixCache needs a backend");
  if (options.budget_bytes == 0) {
    return absl::InvalidArgumentError("prefix cache budget is 0 bytes (0 disables the cache)");
  }
  if (options.copy_threads == 0 || options.parallel_copy_bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefix copy_threads (", options.copy_threads, ") and parallel_copy_bytes (",
        options.parallel_copy_bytes, ") must both be at least 1"));
  }
  PrefixIndexOptions index_options;
  index_options.block_tokens = options.block_tokens;
  index_options.budget_bytes = options.budget_bytes;
  index_options.epoch = options.epoch;
  index_options.event_capacity = options.event_capacity;
  ASSIGN_OR_RETURN(PrefixIndex index, PrefixIndex::Create(index_options));
  return std::unique_ptr<PrefixCache>(new PrefixCache(options, std::move(index), backend, budget));
}

PrefixCache::PrefixCache(const PrefixCacheOptions& options, PrefixIndex index,
                         DeviceBackend* backend, DeviceBudget* budget)
    : options_(options), backend_(backend), budget_(budget), index_(std::move(index)) {}

PrefixCache::~PrefixCache() {
  absl::MutexLock lock(&mu_);
  for (const auto& [handle, storage] : storage_) FreeStorage(storage);
  storage_.clear();
  if (budget_ != nullptr) budget_->SetEvictable(EvictableSource::kPrefixCache, 0);
}

void PrefixCache::FreeStorage(const Storage& storage) {
  if (absl::Status freed = backend_->FreeArena(storage.arena); !freed.ok()) {
    spdlog::error("prefix cache: freeing {} failed: {}", storage.arena.value, freed.ToString());
  }
  if (storage.charge.has_value()) {
    if (absl::Status released = budget_->Release(*storage.charge); !released.ok()) {
      spdlog::error("prefix cache: releasing its budget charge failed: {}", released.ToString());
    }
  }
}

void PrefixCache::FreeHandles(const std::vector<uint64_t>& handles) {
  for (uint64_t handle : handles) {
    auto it = storage_.find(handle);
    if (it == storage_.end()) continue;
    FreeStorage(it->second);
    storage_.erase(it);
  }
}

void PrefixCache::PublishEvictable() {
  if (budget_ != nullptr) {
    budget_->SetEvictable(EvictableSource::kPrefixCache, index_.EvictableBytes());
  }
}

absl::StatusOr<PrefixCache::Stored> PrefixCache::StorePieces(
    const SessionLayoutVersion& layout, const std::vector<StoredPiece>& pieces,
    uint64_t block_index, uint64_t bytes) {
  // Every source range first, so a bad one allocates nothing. The pieces are stored back to
  // back, so the stored arena's checksum is that of the gathered source bytes in order.
  ASSIGN_OR_RETURN(std::vector<CopyRange> ranges,
                   PieceRanges(layout, pieces, block_index, Toward::kStorage));
  Stored stored;
  ASSIGN_OR_RETURN(uint64_t rounded, backend_->RoundedArenaBytes(bytes));
  if (budget_ != nullptr) {
    ASSIGN_OR_RETURN(stored.storage.charge,
                     budget_->AllocateWithoutEviction(kPrefixCacheOwner, rounded));
  }
  // Gathered device-side and checksummed in the same pass: no host staging buffer.
  absl::StatusOr<ArenaId> arena = backend_->CreateArena(bytes, ArenaVisibility::kPrivate);
  absl::Status status = arena.status();
  if (status.ok()) {
    stored.storage.arena = *arena;
    absl::StatusOr<uint64_t> checksum =
        backend_->CopyRangesChecksummed(*arena, layout.arena, ranges);
    status = checksum.status();
    if (status.ok()) stored.ref.checksum = *checksum;
    if (!status.ok()) (void)backend_->FreeArena(*arena);
  }
  if (!status.ok()) {
    if (stored.storage.charge.has_value()) (void)budget_->Release(*stored.storage.charge);
    return status;
  }
  stored.ref.storage_handle = arena->value;
  return stored;
}

absl::StatusOr<PrefixCaptureResult> PrefixCache::CaptureLocked(
    const ScopedShape& shape, const SessionState& state, const SessionLayoutVersion& layout,
    absl::Span<const int32_t> tokens, uint64_t boundary_tokens, bool allow_open_transaction) {
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
  ASSIGN_OR_RETURN(traits.block_bytes, backend_->RoundedArenaBytes(stored.block_bytes));
  if (!stored.position_addressed_only) {
    ASSIGN_OR_RETURN(traits.boundary_bytes, backend_->RoundedArenaBytes(stored.boundary_bytes));
  }
  CapturePlan plan;
  {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(plan, index_.PlanCapture(shape.key, tokens, boundary_tokens, traits));
  }
  // Copies without mu_ (the session's own mutex keeps its state still).
  std::vector<Stored> copies;
  auto free_copies = [&] {
    for (const Stored& copy : copies) FreeStorage(copy.storage);
  };
  CaptureCommit commit;
  if (!plan.already_present) {
    // Blocks are independent: a large capture stores them over several threads.
    const uint64_t first = plan.first_new_block;
    std::vector<std::optional<Stored>> blocks(plan.chain.size() - first);
    const absl::Status stored_blocks =
        ForEachBlock(blocks.size(), stored.block_bytes, [&](uint64_t i) -> absl::Status {
          ASSIGN_OR_RETURN(blocks[i], StorePieces(layout, stored.block_pieces, first + i,
                                                  stored.block_bytes));
          return absl::OkStatus();
        });
    for (std::optional<Stored>& block : blocks) {
      if (!block.has_value()) continue;
      commit.new_blocks.push_back(block->ref);
      copies.push_back(*std::move(block));
    }
    if (!stored_blocks.ok()) {
      free_copies();
      return stored_blocks;
    }
    if (plan.needs_boundary_state) {
      absl::StatusOr<Stored> copy =
          StorePieces(layout, stored.boundary_pieces, 0, stored.boundary_bytes);
      if (!copy.ok()) {
        free_copies();
        return copy.status();
      }
      commit.boundary = copy->ref;
      copies.push_back(*std::move(copy));
    }
  }
  absl::MutexLock lock(&mu_);
  absl::StatusOr<CommitResult> committed =
      index_.CommitCapture(plan, commit, tick_.fetch_add(1) + 1);
  if (!committed.ok()) {
    free_copies();
    return committed.status();
  }
  for (const Stored& copy : copies) storage_[copy.ref.storage_handle] = copy.storage;
  FreeHandles(committed->unused_handles);
  FreeHandles(committed->evicted_handles);
  position_addressed_[shape.key] = stored.position_addressed_only;
  scoped_shapes_[shape.key] = shape;
  if (!committed->already_present) ++captures_;
  PublishEvictable();
  PrefixCaptureResult result;
  result.entry = committed->entry;
  result.boundary_tokens = boundary_tokens;
  result.already_present = committed->already_present;
  result.added_bytes = committed->added_bytes;
  result.stored_bytes = index_.StoredBytes();
  result.shape = shape.shape;
  return result;
}

absl::StatusOr<PrefixCaptureResult> PrefixCache::Capture(DaemonSession& session,
                                                         absl::Span<const int32_t> tokens,
                                                         uint64_t boundary_tokens) {
  ASSIGN_OR_RETURN(ScopedShape shape, ShapeOf(session));
  absl::StatusOr<PrefixCaptureResult> result = absl::InternalError("capture did not run");
  RETURN_IF_ERROR(session.ViewLocked(
      [&](const SessionState& state, const SessionLayoutVersion& layout,
          const std::optional<std::vector<int32_t>>& committed) {
        absl::StatusOr<absl::Span<const int32_t>> committed_tokens =
            CommittedTokensMatching(session.params().id, state, committed, tokens);
        if (!committed_tokens.ok()) return committed_tokens.status();
        // Stored under what the session committed, never under the caller's word.
        result = CaptureLocked(shape, state, layout, *committed_tokens, boundary_tokens,
                               /*allow_open_transaction=*/false);
        return result.status();
      }));
  return result;
}

absl::StatusOr<std::optional<PrefixCaptureResult>> PrefixCache::CaptureCommitted(
    DaemonSession& session) {
  ASSIGN_OR_RETURN(ScopedShape shape, ShapeOf(session));
  std::optional<PrefixCaptureResult> result;
  RETURN_IF_ERROR(session.ViewLocked(
      [&](const SessionState& state, const SessionLayoutVersion& layout,
          const std::optional<std::vector<int32_t>>& tokens) -> absl::Status {
        if (!tokens.has_value() || tokens->size() != state.committed_len()) return absl::OkStatus();
        const uint64_t block = options_.block_tokens;
        const uint64_t committed = state.committed_len();
        // Whether the plan keeps state per boundary (the layout at any boundary says so).
        const bool position_addressed = std::all_of(
            layout.plan.layers.begin(), layout.plan.layers.end(), [](const LayerGeometry& g) {
              return !(g.ring || g.kind == StateKind::kRecurrent ||
                       (g.kind == StateKind::kLatent && g.index_width > 0));
            });
        uint64_t boundary = committed / block * block;
        if (!position_addressed) {
          // Boundary state is only what the committed length left, and only when no staged
          // append has moved it (rings rebased, recurrent state advanced).
          if (committed % block != 0 || state.kv().state().active().has_value()) {
            return absl::OkStatus();
          }
        }
        if (boundary == 0) return absl::OkStatus();
        ASSIGN_OR_RETURN(PrefixCaptureResult captured,
                         CaptureLocked(shape, state, layout, *tokens, boundary,
                                       /*allow_open_transaction=*/position_addressed));
        result = captured;
        return absl::OkStatus();
      }));
  if (result.has_value() && !result->already_present) {
    absl::MutexLock lock(&mu_);
    ++death_captures_;
  }
  return result;
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
  absl::MutexLock lock(&mu_);
  const LookupResult found = LookupLocked(key, tokens);
  PrefixLookupResult result;
  result.outcome = found.outcome;
  result.entry = found.entry;
  result.matched_tokens = found.matched_tokens;
  return result;
}

absl::StatusOr<PrefixRestoreResult> PrefixCache::Restore(DaemonSession& session,
                                                         std::optional<EntryId> requested,
                                                         absl::Span<const int32_t> tokens) {
  ASSIGN_OR_RETURN(ScopedShape shape, ShapeOf(session));
  const uint64_t block = options_.block_tokens;
  PrefixRestoreResult result;
  RETURN_IF_ERROR(session.RestoreLocked(
      [&](const SessionState& state,
          const SessionLayoutVersion& layout) -> absl::StatusOr<SessionState> {
        RETURN_IF_ERROR(state.EnsureUsable("prefix restore"));
        if (!IsFresh(state)) {
          return absl::FailedPreconditionError(absl::StrCat(
              "prefix restore needs a fresh destination: session ",
              session.params().id.value, " has committed ", state.committed_len(), ", staged ",
              state.staged_len(), " rows"));
        }
        ASSIGN_OR_RETURN(std::vector<BlockKey> keys, ChainBlockKeys(shape.key, tokens, block));
        EntryView entry;
        uint64_t matched = 0;
        {
          absl::MutexLock lock(&mu_);
          std::optional<EntryId> id = requested;
          if (!id.has_value()) {
            id = LookupLocked(shape.key, tokens).entry;
            if (!id.has_value()) {
              return absl::NotFoundError(absl::StrCat("no stored prefix matches the ",
                                                      tokens.size(), " token ids (",
                                                      keys.size(), " whole blocks)"));
            }
          }
          ASSIGN_OR_RETURN(entry, index_.GetEntry(*id));
          if (entry.fingerprint != shape.key) {
            const ScopedEntry stored = Unscoped(entry);
            if (stored.cache_scope != shape.scope) {
              // Another scope's entry is not there for this session (as an unknown one).
              return absl::NotFoundError(absl::StrCat("prefix entry ", id->value,
                                                      " is not in cache scope ", shape.scope));
            }
            return absl::InvalidArgumentError(absl::StrCat(
                "prefix entry ", id->value, " was captured for shape ",
                FingerprintHex(stored.view.fingerprint), "; session ",
                session.params().id.value, " has shape ", FingerprintHex(shape.shape)));
          }
          while (matched < entry.blocks.size() && matched < keys.size() &&
                 entry.blocks[matched].key == keys[matched]) {
            ++matched;
          }
          if (matched == 0) {
            return absl::InvalidArgumentError(
                absl::StrCat("the ", tokens.size(), " token ids match none of prefix entry ",
                             id->value, "'s ", entry.blocks.size(), " blocks"));
          }
          if (entry.boundary.has_value() && matched < entry.blocks.size()) {
            return absl::FailedPreconditionError(absl::StrCat(
                "prefix entry ", id->value, " holds recurrent/SWA/indexer state only at its ",
                entry.boundary_tokens, "-token boundary; the token ids match ", matched * block,
                " of them"));
          }
          RETURN_IF_ERROR(index_.Pin(*id, tick_.fetch_add(1) + 1));
          PublishEvictable();
        }
        // Pinned: nothing below can free the entry's bytes. Every path unpins.
        auto unpin = [&] {
          absl::MutexLock lock(&mu_);
          (void)index_.Unpin(entry.id);
          FreeHandles(index_.EnforceBudget().freed_handles);
          PublishEvictable();
        };
        absl::StatusOr<SessionState> restored =
            RestorePinned(session.params().id, state, layout, entry, matched);
        unpin();
        if (restored.ok()) {
          absl::MutexLock lock(&mu_);
          ++restores_;
          tokens_restored_ += matched * block;
          result.entry = entry.id;
          result.restored_tokens = matched * block;
        } else if (restored.status().code() == absl::StatusCode::kDataLoss) {
          absl::MutexLock lock(&mu_);
          absl::StatusOr<EvictionResult> dropped =
              index_.DropEntry(entry.id, std::string(restored.status().message()));
          if (dropped.ok()) FreeHandles(dropped->freed_handles);
          PublishEvictable();
          spdlog::error("{}", restored.status().ToString());
        }
        return restored;
      },
      tokens));
  return result;
}

absl::StatusOr<SessionState> PrefixCache::RestorePinned(SessionId session,
                                                        const SessionState& state,
                                                        const SessionLayoutVersion& layout,
                                                        const EntryView& entry,
                                                        uint64_t matched_blocks) {
  const uint64_t block = options_.block_tokens;
  const uint64_t rows = matched_blocks * block;
  // 1. Validate every layer; nothing moves yet.
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
  ASSIGN_OR_RETURN(uint64_t block_bytes, backend_->RoundedArenaBytes(target.block_bytes));
  for (uint64_t i = 0; i < matched_blocks; ++i) {
    if (entry.blocks[i].bytes != block_bytes) {
      return absl::DataLossError(absl::StrCat(
          "prefix entry ", entry.id.value, ": stored block ", i, " holds ", entry.blocks[i].bytes,
          " bytes but the destination layout needs ", block_bytes, " (truncated entry)"));
    }
  }
  if (entry.boundary.has_value()) {
    ASSIGN_OR_RETURN(uint64_t boundary_bytes, backend_->RoundedArenaBytes(target.boundary_bytes));
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
  // 2. Copy, verifying in the same pass: each stored piece's xxHash3 is taken from the bytes as
  // they are copied and compared with the one taken at capture (a separate verification pass
  // cost as much as the copy). A mismatch or device failure leaves the session's state fresh
  // (it adopts `hydrated` only on success); the bytes already copied are unspecified content of
  // a fresh session, as any fresh session's bytes are.
  auto copy_pieces = [&](const StoredRef& from, const std::vector<StoredPiece>& pieces,
                         uint64_t block_index) -> absl::Status {
    ASSIGN_OR_RETURN(std::vector<CopyRange> ranges,
                     PieceRanges(layout, pieces, block_index, Toward::kSession));
    const ArenaId stored{from.storage_handle};
    if (!options_.verify_checksums) {
      for (const CopyRange& range : ranges) {
        RETURN_IF_ERROR(
            backend_->Copy(layout.arena, range.dst_offset, stored, range.src_offset, range.bytes));
      }
      return absl::OkStatus();
    }
    ASSIGN_OR_RETURN(const uint64_t checksum,
                     backend_->CopyRangesChecksummed(layout.arena, stored, ranges));
    if (checksum != from.checksum) {
      uint64_t stored_bytes = 0;
      for (const CopyRange& range : ranges) stored_bytes += range.bytes;
      return absl::DataLossError(absl::StrFormat(
          "prefix entry %d: stored piece (arena %d, %d bytes) has xxHash3 %016x, captured as "
          "%016x; the entry is dropped, never served",
          entry.id.value, from.storage_handle, stored_bytes, checksum, from.checksum));
    }
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(ForEachBlock(matched_blocks, target.block_bytes, [&](uint64_t i) {
    return copy_pieces(entry.blocks[i].stored, target.block_pieces, i);
  }));
  if (entry.boundary.has_value()) {
    // Unbuilt pool-key slots must read zero (PlanLatentRestore's zero_pool_keys).
    for (const LatentLayerState& latent : hydrated.latent()) {
      if (latent.index_width == 0) continue;
      const PlaneRef keys{latent.layer, PlaneKind::kPoolKeys};
      const uint64_t bytes = PlaneBytes(layout, keys);
      ASSIGN_OR_RETURN(uint64_t at, PlaneRangeOffset(layout, keys, 0, bytes));
      RETURN_IF_ERROR(backend_->Memset(layout.arena, at, 0, bytes));
    }
    RETURN_IF_ERROR(copy_pieces(*entry.boundary, target.boundary_pieces, 0));
  }
  return hydrated;
}

absl::Status PrefixCache::ForEachBlock(uint64_t blocks, uint64_t block_bytes,
                                       absl::FunctionRef<absl::Status(uint64_t)> copy) const {
  // Blocks are independent ranges of the destination, so they can be copied concurrently
  // (DeviceBackend is thread-safe). Each worker takes a contiguous run.
  uint64_t workers = 1;
  if (blocks > 1 && block_bytes > 0 && blocks >= options_.parallel_copy_bytes / block_bytes) {
    workers = std::min<uint64_t>({options_.copy_threads, blocks,
                                  std::max(1u, std::thread::hardware_concurrency())});
  }
  std::vector<absl::Status> statuses(workers);
  auto run = [&](uint64_t worker) {
    const uint64_t begin = blocks * worker / workers;
    const uint64_t end = blocks * (worker + 1) / workers;
    for (uint64_t i = begin; i < end && statuses[worker].ok(); ++i) statuses[worker] = copy(i);
  };
  std::vector<std::thread> threads;
  threads.reserve(workers - 1);
  for (uint64_t worker = 1; worker < workers; ++worker) {
    try {
      threads.emplace_back(run, worker);
    } catch (const std::system_error&) {
      run(worker);  // no thread to be had: this one does the run itself
    }
  }
  run(0);
  for (std::thread& thread : threads) thread.join();
  for (const absl::Status& status : statuses) RETURN_IF_ERROR(status);
  return absl::OkStatus();
}

ScopedEntry PrefixCache::Unscoped(EntryView view) const {
  ScopedEntry out;
  if (auto it = scoped_shapes_.find(view.fingerprint); it != scoped_shapes_.end()) {
    out.cache_scope = it->second.scope;
    view.fingerprint = it->second.shape;
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
  PublishEvictable();
  return evicted.freed_bytes;
}

uint64_t PrefixCache::EvictForAdmission(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  const uint64_t want = std::min(bytes, index_.EvictableBytes());
  if (want == 0) return 0;
  absl::StatusOr<EvictionResult> evicted = index_.Evict(want);
  if (!evicted.ok()) return 0;  // cannot happen: want <= EvictableBytes()
  FreeHandles(evicted->freed_handles);
  PublishEvictable();
  spdlog::info("prefix cache: evicted {} entries ({} bytes) for an admission {} bytes short",
               evicted->entries.size(), evicted->freed_bytes, bytes);
  return evicted->freed_bytes;
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

absl::StatusOr<ArenaId> PrefixCache::StorageArena(uint64_t storage_handle) const {
  absl::MutexLock lock(&mu_);
  auto it = storage_.find(storage_handle);
  if (it == storage_.end()) {
    return absl::NotFoundError(absl::StrCat("no prefix storage handle ", storage_handle));
  }
  return it->second.arena;
}

absl::Status PrefixCache::CheckInvariants() const {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(index_.CheckInvariants());
  // (1): the handles the index references are exactly the arenas held (no capture in flight
  // when tests call this).
  absl::flat_hash_set<uint64_t> referenced;
  for (EntryId id : index_.EntryIds()) {
    ASSIGN_OR_RETURN(EntryView view, index_.GetEntry(id));
    for (const LookupBlock& block : view.blocks) referenced.insert(block.stored.storage_handle);
    if (view.boundary.has_value()) referenced.insert(view.boundary->storage_handle);
  }
  for (uint64_t handle : referenced) {
    if (!storage_.contains(handle)) {
      return absl::InternalError(absl::StrCat("prefix storage handle ", handle, " has no arena"));
    }
  }
  if (referenced.size() != storage_.size()) {
    return absl::InternalError(absl::StrCat("prefix cache holds ", storage_.size(),
                                            " arenas for ", referenced.size(), " stored pieces"));
  }
  return absl::OkStatus();
}

}  // namespace memra
