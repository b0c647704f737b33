#ifndef MEMRA_CORE_LATENT_H_
#define MEMRA_CORE_LATENT_H_

// MLA latent-plane rules (the reference's LatentKvLayer snapshot_plane / validate_restore /
// restore_plane / truncate_index_pool_keys), expressed over plane descriptors so every rule is
// testable without memory. Copies are described, not performed: the backend executes them.
//
// The three asymmetries against an ordinary K/V plane: (1) rows are unquantized elements of
// one element format (f32 as in the reference, or the plan's latent_format);
// (2) the indexer plane is a TAIL RING whose rows below pools_ready * pool are overwritten by
// design, so a capture carries the DERIVED pool keys plus the < pool live tail rows, never the
// plane; (3) pool keys are final once their pool's last row lands (append-only), so a capture
// must sit at a drained boundary: pools_ready == len / pool.
//
// Thread-safety: pure functions over values.

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/formats.h"

namespace memra {

// A live latent layer. Element counts are elements of the planes actually allocated: latent rows
// in `row_format`, indexer rows and pool keys f32.
struct LatentLayerState {
  uint32_t layer = 0;
  uint64_t width = 0;              // elements per latent row
  ElementFormat row_format = ElementFormat::kF32;
  uint64_t len = 0;                // rows [0, len) are valid in both planes
  uint64_t index_width = 0;        // 0 = no indexer
  uint64_t index_ring_rows = 0;    // booked physical indexer rows when a tail ring; 0 = flat
  uint64_t index_pool = 0;         // resident pool (0 = unknown)
  uint64_t index_pools_ready = 0;  // pools [0, ready) of the key plane hold FINAL keys
  // Indexer residency: rows [index_resident_from, len) of the index plane hold their own bytes.
  // Raised when an append may overwrite ring slots of older rows; set to the live tail's start
  // by restore, grow and hydrate, which carry only the tail. See IndexTailResident.
  uint64_t index_resident_from = 0;
  uint64_t rows_elems = 0;         // latent plane size
  uint64_t index_rows_elems = 0;   // indexer plane size (0 = not allocated)
  uint64_t pool_keys_elems = 0;    // pool-key plane size (0 = not allocated)
  bool operator==(const LatentLayerState&) const = default;
};

// What a captured latent layer holds (the reference's LatentPlaneSnapshot, sizes only).
struct LatentSnapshot {
  uint64_t width = 0;
  ElementFormat row_format = ElementFormat::kF32;
  uint64_t len = 0;
  uint64_t index_width = 0;
  uint64_t index_pool = 0;          // 0 iff no indexer
  uint64_t index_pools_ready = 0;
  uint64_t rows_elems = 0;          // carried latent rows
  std::optional<uint64_t> tail_elems;  // carried live tail rows; nullopt at a pool boundary
  std::optional<uint64_t> keys_elems;  // carried final keys; nullopt when no pool completed
  bool operator==(const LatentSnapshot&) const = default;
  uint64_t Bytes() const;  // the prefix-cache ledger's honest bill
};

enum class LatentPlane : uint8_t { kRows = 0, kIndexRows = 1, kPoolKeys = 2 };

// One element range copy (elements of the plane's own format) between a live plane and a
// snapshot buffer of the same kind.
struct LatentCopy {
  LatentPlane plane = LatentPlane::kRows;
  uint64_t plane_offset_elems = 0;  // offset in the live layer's plane
  uint64_t buffer_offset_elems = 0;  // offset in the snapshot's buffer of that kind
  uint64_t elems = 0;
  bool operator==(const LatentCopy&) const = default;
};

// Bytes of one element of `plane`: the row format's for latent rows, 4 (f32) for the indexer.
uint64_t LatentElementBytes(const LatentLayerState& layer, LatentPlane plane);

struct LatentCapturePlan {
  LatentSnapshot snapshot;
  std::vector<LatentCopy> copies;  // live plane -> snapshot buffers
};

// Capture preconditions of snapshot_plane: len > 0, a resolved pool, pools_ready == len/pool,
// planes large enough. FAILED_PRECONDITION with the numbers.
absl::StatusOr<LatentCapturePlan> PlanLatentCapture(const LatentLayerState& layer);

// Every shape/identity/bounds check of restore, no copies: callers validate EVERY layer before
// the first byte moves. `max_ctx` is the destination's capacity.
absl::Status ValidateLatentRestore(const LatentLayerState& destination,
                                   const LatentSnapshot& snapshot, uint64_t max_ctx);

struct LatentRestorePlan {
  std::vector<LatentCopy> copies;  // snapshot buffers -> live planes
  // The pool-key plane is zeroed before keys land: unbuilt slots never carry garbage.
  bool zero_pool_keys = false;
  LatentLayerState restored;  // the destination's state after the copies
};
absl::StatusOr<LatentRestorePlan> PlanLatentRestore(const LatentLayerState& destination,
                                                    const LatentSnapshot& snapshot,
                                                    uint64_t max_ctx);

// Indexer residency (docs/rules.md, "Indexer residency"). The live tail of an indexer at length
// `len` is [LiveIndexTailStart, len): rows of the pool not yet built into a final key, which the
// next pool-key build (and any capture) reads from the index plane. An operation that sets a
// latent length is refused, changing nothing, unless that whole tail is resident: a tail ring
// lapped by a large append (the "lapped" case) or rows never carried into this session by a
// restore, grow or hydrate (the "never carried" case) would otherwise be read as live.
//
// The pools whose keys are final once the layer's length is set to `len`: len / pool when it
// grows (every call boundary leaves the drain there), else pools_ready clamped to len / pool.
uint64_t IndexPoolsReadyAt(const LatentLayerState& layer, uint64_t len);
// The absolute row where the live tail at `len` starts: IndexPoolsReadyAt(len) * pool.
uint64_t LiveIndexTailStart(const LatentLayerState& layer, uint64_t len);
// OK when the layer has no indexer, when the live tail at `len` is empty, or when every row of
// it is resident; FAILED_PRECONDITION naming the rows, the resident start and what is legal.
absl::Status CheckIndexTailResident(const LatentLayerState& layer, uint64_t len);
// A prepared append of indexer rows [first_row, first_row + rows) in a transaction based at
// `base_len` must leave the way out open: an abort (back to `base_len`) and a commit of every
// published row (at `first_row`, the staged length) must stay legal, so the append may not lap
// the live tail at either length. OK without an indexer tail ring, or when those tails are empty
// or out of the append's reach; FAILED_PRECONDITION naming the rows it would overwrite, the
// length that needs them and the most rows the ring leaves room for (ring minus the tail still
// owed, the reference's index_ring_take). A pool-boundary base has an empty tail: from there
// one transaction may append any number of rows.
absl::Status CheckAppendSparesLiveTails(const LatentLayerState& layer, uint64_t base_len,
                                        uint64_t first_row, uint64_t rows);
// Records that the engine may now write indexer rows [first_row, first_row + rows) (a prepared
// append): on a tail ring those writes land in the slots of rows one effective ring below, so
// rows under first_row + rows - ring stop being resident. Rows from first_row up are rewritten by
// this append before they can be live, so an earlier, replaced prepare's laps above first_row
// no longer count. Nothing changes on a refusal.
absl::Status NoteIndexRowsWritable(LatentLayerState& layer, uint64_t first_row, uint64_t rows);


}  // namespace memra

#endif  // MEMRA_CORE_LATENT_H_
