#include "server/store/stored_layout.h"

#include <algorithm>
#include <string_view>
#include <utility>

#include <xxhash.h>

#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "core/latent.h"
#include "core/sha256.h"
#include "core/status_macros.h"

namespace memra {
namespace {

constexpr std::string_view kShapeDomain = "memra-kv/prefix-shape/v1";
constexpr std::string_view kScopeDomain = "memra-kv/cache-scope/v1";
constexpr uint64_t kF32 = sizeof(float);

void HashU32(Sha256& hash, uint32_t value) {
  char bytes[4];
  for (int i = 0; i < 4; ++i) bytes[i] = static_cast<char>((value >> (8 * i)) & 0xff);
  hash.Update(std::string_view(bytes, sizeof(bytes)));
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
        ASSIGN_OR_RETURN(uint64_t row_bytes, FormatBytes(LayoutOf(layer.latent_format),
                                                         layer.latent_width, "latent row"));
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

absl::StatusOr<std::vector<CopyRange>> PieceRanges(const SessionLayoutVersion& layout,
                                                   const std::vector<StoredPiece>& pieces,
                                                   uint64_t block_index, bool toward_storage) {
  std::vector<CopyRange> ranges;
  ranges.reserve(pieces.size());
  uint64_t stored_at = 0;
  for (const StoredPiece& piece : pieces) {
    ASSIGN_OR_RETURN(uint64_t shift, CheckedMul(block_index, piece.bytes, "block offset"));
    ASSIGN_OR_RETURN(uint64_t offset, CheckedAdd(piece.plane_offset, shift, "block offset"));
    ASSIGN_OR_RETURN(uint64_t session_at,
                     PlaneRangeOffset(layout, piece.plane, offset, piece.bytes));
    ranges.push_back(toward_storage
                         ? CopyRange{.dst_offset = stored_at, .src_offset = session_at,
                                     .bytes = piece.bytes}
                         : CopyRange{.dst_offset = session_at, .src_offset = stored_at,
                                     .bytes = piece.bytes});
    stored_at += piece.bytes;
  }
  return ranges;
}


bool PositionAddressedPlan(const SessionPlan& plan) {
  return std::all_of(plan.layers.begin(), plan.layers.end(), [](const LayerGeometry& g) {
    return !(g.ring || g.kind == StateKind::kRecurrent ||
             (g.kind == StateKind::kLatent && g.index_width > 0));
  });
}

// xxHash3-64 of what a stored piece's bytes mean: the rows per block and, per piece in order, its
// layer, plane kind and bytes (the remote tier's values carry it; another plan or build that
// lays the same number of bytes out differently reads as a shape mismatch, never as KV).
uint64_t LayoutDigest(const std::vector<StoredPiece>& pieces, uint64_t block_rows) {
  std::vector<uint8_t> bytes;
  auto put = [&](uint64_t value, int size) {
    for (int i = 0; i < size; ++i) bytes.push_back(static_cast<uint8_t>(value >> (8 * i)));
  };
  put(block_rows, 8);
  for (const StoredPiece& piece : pieces) {
    put(piece.plane.layer, 4);
    put(static_cast<uint8_t>(piece.plane.kind), 1);
    put(piece.bytes, 8);
  }
  return XXH3_64bits(bytes.data(), bytes.size());
}

}  // namespace memra
