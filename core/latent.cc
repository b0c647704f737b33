#include "core/latent.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "core/index_ring.h"
#include "core/status_macros.h"

namespace memra {

uint64_t LatentSnapshot::Bytes() const {
  return rows_elems * LayoutOf(row_format).block_bytes +
         (tail_elems.value_or(0) + keys_elems.value_or(0)) * sizeof(float);
}

uint64_t LatentElementBytes(const LatentLayerState& layer, LatentPlane plane) {
  return plane == LatentPlane::kRows ? LayoutOf(layer.row_format).block_bytes : sizeof(float);
}

absl::StatusOr<LatentCapturePlan> PlanLatentCapture(const LatentLayerState& layer) {
  const uint64_t len = layer.len;
  const uint64_t width = layer.width;
  if (len == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layer ", layer.layer, ": latent snapshot at len 0 (record the layer as absent instead)"));
  }
  ASSIGN_OR_RETURN(uint64_t row_elems, CheckedMul(len, width, "latent snapshot rows"));
  if (layer.rows_elems < row_elems) {
    return absl::InternalError(absl::StrCat("layer ", layer.layer, ": latent plane holds ",
                                            layer.rows_elems, " elements but len ", len,
                                            " x width ",
                                            width, " requires ", row_elems));
  }
  LatentCapturePlan plan;
  plan.snapshot.width = width;
  plan.snapshot.row_format = layer.row_format;
  plan.snapshot.len = len;
  plan.snapshot.rows_elems = row_elems;
  plan.copies.push_back({LatentPlane::kRows, 0, 0, row_elems});
  if (layer.index_width == 0) return plan;

  const uint64_t pool = layer.index_pool;
  if (pool == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layer ", layer.layer, ": latent snapshot: index plane (width ", layer.index_width,
        ") has an unresolved pool; no indexer call ran against this layer"));
  }
  const uint64_t d = layer.index_width / 2;
  const uint64_t pools_ready = layer.index_pools_ready;
  if (pools_ready != len / pool) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layer ", layer.layer, ": latent snapshot: index_pools_ready ", pools_ready,
        " != len/pool ", len / pool, " (len ", len, ", pool ", pool,
        "); a capture must sit at a drained call boundary"));
  }
  plan.snapshot.index_width = layer.index_width;
  plan.snapshot.index_pool = pool;
  plan.snapshot.index_pools_ready = pools_ready;
  if (pools_ready > 0) {
    const uint64_t keys = pools_ready * d;
    if (layer.pool_keys_elems < keys) {
      return absl::InternalError(absl::StrCat("layer ", layer.layer,
                                              ": latent snapshot: resident key plane holds ",
                                              layer.pool_keys_elems, " f32 but ", pools_ready,
                                              " pools x d ", d, " require ", keys));
    }
    plan.snapshot.keys_elems = keys;
    plan.copies.push_back({LatentPlane::kPoolKeys, 0, 0, keys});
  }
  const uint64_t tail_rows = len - pools_ready * pool;
  if (tail_rows > 0) {
    // The tail starts pool-aligned and is shorter than one pool, and the effective ring is a
    // whole number of pools, so the window is contiguous in ring and flat layouts alike.
    ASSIGN_OR_RETURN(uint64_t phys,
                     IndexPlanePhysicalRow(layer.index_ring_rows, pool, pools_ready * pool));
    const uint64_t want = (phys + tail_rows) * layer.index_width;
    if (layer.index_rows_elems < want) {
      return absl::InternalError(absl::StrCat("layer ", layer.layer,
                                              ": latent snapshot: index plane holds ",
                                              layer.index_rows_elems,
                                              " f32 but the live tail window requires ", want));
    }
    plan.snapshot.tail_elems = tail_rows * layer.index_width;
    plan.copies.push_back(
        {LatentPlane::kIndexRows, phys * layer.index_width, 0, tail_rows * layer.index_width});
  }
  return plan;
}

absl::Status ValidateLatentRestore(const LatentLayerState& destination,
                                   const LatentSnapshot& snapshot, uint64_t max_ctx) {
  const uint32_t il = destination.layer;
  if (destination.len != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layer ", il, ": restore destination latent plane is not fresh (len ", destination.len,
        ")"));
  }
  if (destination.width != snapshot.width) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", il, ": snapshot width ",
                                                   snapshot.width, " != destination width ",
                                                   destination.width));
  }
  if (destination.row_format != snapshot.row_format) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer ", il, ": snapshot latent rows are ",
        std::string(ElementFormatName(snapshot.row_format)), ", destination latent rows are ",
        std::string(ElementFormatName(destination.row_format))));
  }
  if (snapshot.len == 0 || snapshot.len > max_ctx) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", il, ": snapshot len ", snapshot.len,
                                                   " outside [1,", max_ctx, "]"));
  }
  ASSIGN_OR_RETURN(uint64_t need, CheckedMul(snapshot.len, snapshot.width, "snapshot rows"));
  if (snapshot.rows_elems < need) {
    return absl::DataLossError(absl::StrCat(
        "layer ", il, ": snapshot rows plane holds ", snapshot.rows_elems, " elements but len ",
        snapshot.len, " x width ", snapshot.width, " requires ", need, " (truncated capture)"));
  }
  if (destination.rows_elems < need) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", il, ": destination latent plane holds ",
                                                   destination.rows_elems,
                                                   " elements but the restore requires ", need));
  }
  if (destination.index_width != snapshot.index_width) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", il, ": snapshot index width ",
                                                   snapshot.index_width, " != destination ",
                                                   destination.index_width));
  }
  if (snapshot.index_width == 0) return absl::OkStatus();

  const uint64_t pool = snapshot.index_pool;
  if (pool == 0) {
    return absl::DataLossError(absl::StrCat(
        "layer ", il, ": snapshot carries an index plane with an unresolved pool"));
  }
  if (destination.index_pool != 0 && destination.index_pool != pool) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", il, ": snapshot pool ", pool,
                                                   " != destination resident pool ",
                                                   destination.index_pool));
  }
  const uint64_t d = snapshot.index_width / 2;
  const uint64_t ready = snapshot.index_pools_ready;
  if (ready != snapshot.len / pool) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layer ", il, ": snapshot index_pools_ready ", ready, " != len/pool ",
        snapshot.len / pool, " (len ", snapshot.len, ", pool ", pool,
        "): the append-only finality invariant does not hold, so its keys are stale"));
  }
  if (snapshot.keys_elems.has_value() && ready > 0) {
    if (*snapshot.keys_elems < ready * d) {
      return absl::DataLossError(absl::StrCat("layer ", il, ": snapshot key plane holds ",
                                              *snapshot.keys_elems, " f32 but ", ready,
                                              " pools x d ", d, " require ", ready * d));
    }
  } else if (snapshot.keys_elems.has_value()) {
    return absl::DataLossError(
        absl::StrCat("layer ", il, ": snapshot carries keys for zero ready pools"));
  } else if (ready > 0) {
    return absl::DataLossError(absl::StrCat("layer ", il, ": snapshot claims ", ready,
                                            " ready pools but carries no keys"));
  }
  if (destination.pool_keys_elems < ready * d) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", il, ": destination key plane holds ",
                                                   destination.pool_keys_elems, " f32 but ",
                                                   ready, " pools x d ", d, " require ",
                                                   ready * d));
  }
  const uint64_t tail_rows = snapshot.len - ready * pool;
  if (snapshot.tail_elems.has_value() && tail_rows > 0) {
    if (*snapshot.tail_elems < tail_rows * snapshot.index_width) {
      return absl::DataLossError(absl::StrCat(
          "layer ", il, ": snapshot tail holds ", *snapshot.tail_elems, " f32 but ", tail_rows,
          " rows x index width ", snapshot.index_width, " require ",
          tail_rows * snapshot.index_width));
    }
  } else if (snapshot.tail_elems.has_value()) {
    return absl::DataLossError(
        absl::StrCat("layer ", il, ": snapshot carries a tail at a pool-aligned boundary"));
  } else if (tail_rows > 0) {
    return absl::DataLossError(absl::StrCat("layer ", il, ": snapshot owes ", tail_rows,
                                            " live tail rows but carries none"));
  }
  if (destination.index_rows_elems == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer ", il, ": destination declares an index plane but allocated none"));
  }
  if (tail_rows > 0) {
    absl::StatusOr<uint64_t> phys =
        IndexPlanePhysicalRow(destination.index_ring_rows, pool, ready * pool);
    if (!phys.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", il, ": ", phys.status().message()));
    }
    const uint64_t want = (*phys + tail_rows) * destination.index_width;
    if (destination.index_rows_elems < want) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer ", il, ": destination index plane holds ", destination.index_rows_elems,
          " f32 but the tail window requires ", want));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<LatentRestorePlan> PlanLatentRestore(const LatentLayerState& destination,
                                                    const LatentSnapshot& snapshot,
                                                    uint64_t max_ctx) {
  RETURN_IF_ERROR(ValidateLatentRestore(destination, snapshot, max_ctx));
  LatentRestorePlan plan;
  plan.restored = destination;
  plan.copies.push_back({LatentPlane::kRows, 0, 0, snapshot.len * snapshot.width});
  if (snapshot.index_width > 0) {
    const uint64_t pool = snapshot.index_pool;
    const uint64_t d = snapshot.index_width / 2;
    plan.zero_pool_keys = true;
    if (snapshot.keys_elems.has_value()) {
      plan.copies.push_back(
          {LatentPlane::kPoolKeys, 0, 0, snapshot.index_pools_ready * d});
    }
    if (snapshot.tail_elems.has_value()) {
      const uint64_t tail_rows = snapshot.len - snapshot.index_pools_ready * pool;
      ASSIGN_OR_RETURN(uint64_t phys,
                       IndexPlanePhysicalRow(destination.index_ring_rows, pool,
                                             snapshot.index_pools_ready * pool));
      plan.copies.push_back({LatentPlane::kIndexRows, phys * destination.index_width, 0,
                             tail_rows * destination.index_width});
    }
    plan.restored.index_pools_ready = snapshot.index_pools_ready;
    plan.restored.index_pool = pool;
    // Only the live tail is carried: rows below it were never written into this plane.
    plan.restored.index_resident_from = snapshot.index_pools_ready * pool;
  }
  plan.restored.len = snapshot.len;
  return plan;
}

uint64_t IndexPoolsReadyAt(const LatentLayerState& layer, uint64_t len) {
  if (layer.index_pool == 0) return layer.index_pools_ready;
  // Growing: the call boundary is drained. Shrinking: pools at or above len / pool were built
  // over rows being dropped.
  return len > layer.len ? len / layer.index_pool
                         : std::min(layer.index_pools_ready, len / layer.index_pool);
}

uint64_t LiveIndexTailStart(const LatentLayerState& layer, uint64_t len) {
  if (layer.index_pool == 0) return len;
  return IndexPoolsReadyAt(layer, len) * layer.index_pool;
}

absl::Status CheckIndexTailResident(const LatentLayerState& layer, uint64_t len) {
  if (layer.index_width == 0 || layer.index_pool == 0) return absl::OkStatus();
  const uint64_t tail_start = LiveIndexTailStart(layer, len);
  if (tail_start == len || layer.index_resident_from <= tail_start) return absl::OkStatus();
  const uint64_t first_missing = tail_start;
  const uint64_t last_missing = std::min(layer.index_resident_from, len);
  return absl::FailedPreconditionError(absl::StrCat(
      "layer ", layer.layer, ": latent length ", len, " would make indexer rows [",
      first_missing, ", ", last_missing, ") live, but the index plane holds rows only from ",
      layer.index_resident_from, " (the tail ring wrapped over them, or they were never carried "
      "into this session); legal lengths are pool boundaries (multiples of ",
      layer.index_pool, ") and lengths whose pool starts at or above row ",
      layer.index_resident_from));
}

absl::Status CheckAppendSparesLiveTails(const LatentLayerState& layer, uint64_t base_len,
                                        uint64_t first_row, uint64_t rows) {
  if (layer.index_width == 0 || layer.index_ring_rows == 0 || rows == 0) return absl::OkStatus();
  ASSIGN_OR_RETURN(uint64_t ring, EffectiveIndexRingRows(layer.index_ring_rows, layer.index_pool));
  ASSIGN_OR_RETURN(uint64_t end, CheckedAdd(first_row, rows, "indexer append end"));
  if (end <= ring) return absl::OkStatus();
  const uint64_t lapped_below = end - ring;  // rows under this lose their ring slots
  // The base's tail starts at or below the staged length's, so it is checked first.
  for (const uint64_t kept_len : {base_len, first_row}) {
    const uint64_t tail_start = LiveIndexTailStart(layer, kept_len);
    if (tail_start >= kept_len || lapped_below <= tail_start) continue;
    const uint64_t room = tail_start + ring > first_row ? tail_start + ring - first_row : 0;
    return absl::FailedPreconditionError(absl::StrCat(
        "layer ", layer.layer, ": preparing ", rows, " rows at row ", first_row,
        " would overwrite indexer rows [", tail_start, ", ", std::min(kept_len, lapped_below),
        ") of the live tail at length ", kept_len,
        kept_len == base_len ? " (the transaction's base: an abort returns there)"
                             : " (the staged length: a commit of every published row ends there)",
        "; the tail ring of ", ring, " rows leaves room for ", room,
        " rows in this transaction: prepare at most that, or commit at a pool boundary (a "
        "multiple of ",
        layer.index_pool, ") and append the rest in the next transaction"));
  }
  return absl::OkStatus();
}

absl::Status NoteIndexRowsWritable(LatentLayerState& layer, uint64_t first_row, uint64_t rows) {
  if (layer.index_width == 0 || layer.index_ring_rows == 0 || rows == 0) return absl::OkStatus();
  ASSIGN_OR_RETURN(uint64_t ring, EffectiveIndexRingRows(layer.index_ring_rows, layer.index_pool));
  ASSIGN_OR_RETURN(uint64_t end, CheckedAdd(first_row, rows, "indexer append end"));
  uint64_t resident_from = std::min(layer.index_resident_from, first_row);
  if (end > ring) resident_from = std::max(resident_from, end - ring);
  layer.index_resident_from = resident_from;
  return absl::OkStatus();
}

}  // namespace memra
