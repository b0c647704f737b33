#ifndef MEMRA_SERVER_STORE_STORED_LAYOUT_H_
#define MEMRA_SERVER_STORE_STORED_LAYOUT_H_

// How a session's planes map to what the store keeps: the key its entries are stored under (the
// shape and scope fingerprints) and, per block and per boundary, which ranges of which planes a
// stored piece is made of, in order. Pure functions of the plan and core's state; capture and
// restore use the same layout, so a restore replays exactly what a capture stored.
//
// What is stored (StoredLayout):
//  * per BLOCK of block_tokens rows, shared between entries: for every position-addressed layer
//    in layer order, flat K rows then V rows, latent rows;
//  * per BOUNDARY: for every layer in layer order, the SWA ring's aligned live window (K then V;
//    KvRing::RestorePlan), recurrent conv then ssm state, the latent indexer's final pool keys
//    then its live tail rows (PlanLatentCapture).

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/model_plan.h"
#include "core/session.h"
#include "core/sizing.h"
#include "server/device/backend.h"
#include "server/device/placement.h"

namespace memra {

// The shape a session's entries are keyed by: the model fingerprint for an unsharded session
// over every layer, else SHA-256 of the domain, the fingerprint, layer_lo, layer_hi (0xffffffff
// = all) and tp_ranks (prefix.proto documents the encoding). `shape` as decoded by
// SessionShapeFromProto (common/codec.h): tp_ranks >= 1, the wire's 0 already made 1.
PlanFingerprint PrefixShapeFingerprint(const PlanFingerprint& model, const SessionShape& shape);

// Cache scopes (server/session/cache_scopes.h) are part of the key namespace: an entry of `shape`
// captured in `scope` is stored under SHA-256("memra-kv/cache-scope/v1" || u32 scope bytes ||
// scope || shape) (little-endian), and its block keys chain from that. So there is one store,
// one LRU and one budget, and an entry of another scope never matches.
PlanFingerprint ScopedShapeFingerprint(absl::string_view scope, const PlanFingerprint& shape);

// One contiguous range of one plane, in the order it sits in a stored buffer.
struct StoredPiece {
  PlaneRef plane;
  uint64_t plane_offset = 0;  // bytes into the plane
  uint64_t bytes = 0;
};

// What a session stores for one block and at one boundary (StoredLayout in the file comment).
struct StoredLayout {
  bool position_addressed_only = true;
  uint64_t block_rows = 0;
  // Block i's pieces are block_pieces with plane_offset += i * piece.bytes (rows are
  // position-addressed: block i's rows start at i * block_rows).
  std::vector<StoredPiece> block_pieces;
  uint64_t block_bytes = 0;
  std::vector<StoredPiece> boundary_pieces;  // source ranges at the capture boundary
  uint64_t boundary_bytes = 0;
};

// The capture side: what `state` (quiescent at `boundary` rows, see Capture) stores.
// INVALID_ARGUMENT: no position-addressed layer; FAILED_PRECONDITION: a lapped SWA window, an
// undrained latent boundary (PlanLatentCapture's message), recurrent or indexer state asked
// for at a boundary other than the committed length.
absl::StatusOr<StoredLayout> PlanStoredLayout(const SessionPlan& plan, const SessionState& state,
                                              uint64_t boundary, uint64_t block_rows);

// The copy ranges of `pieces` of block `block_index`: each piece's range in the session's arena
// and, back to back from offset 0, in the stored piece; `toward_storage` says which side is
// written. Every range is checked (overflow, plane bounds) before any copy is issued.
absl::StatusOr<std::vector<CopyRange>> PieceRanges(const SessionLayoutVersion& layout,
                                                   const std::vector<StoredPiece>& pieces,
                                                   uint64_t block_index, bool toward_storage);

// Whether every layer of `plan` is position-addressed (no per-boundary state: SWA ring,
// recurrent state, latent indexer), so any block boundary of a stored chain restores.
bool PositionAddressedPlan(const SessionPlan& plan);

// xxHash3-64 of what a stored piece's bytes mean: the rows per block and, per piece in order, its
// layer, plane kind and bytes (the remote tier's values carry it; another plan or build that
// lays the same number of bytes out differently reads as a shape mismatch, never as KV).
uint64_t LayoutDigest(const std::vector<StoredPiece>& pieces, uint64_t block_rows);

}  // namespace memra

#endif  // MEMRA_SERVER_STORE_STORED_LAYOUT_H_
