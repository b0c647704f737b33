#ifndef MEMRA_CORE_INDEX_RING_H_
#define MEMRA_CORE_INDEX_RING_H_

// The DSA k-pool indexer TAIL RING (docs/rules.md#dsa-indexer-tail-ring; the reference's
// index_ring_* and index_plane_physical_row, docs/rules.md#the-reference).
//
// A row of the indexer plane is read exactly once, by the pool-key build of the pool it belongs
// to, so only [pools_ready * pool, cur + take) must be live. The ring is a WORKING SET, not a
// bound on a call's token count: the engine drains it inside a call (append what fits, build
// the pool keys that frees, continue). Sizing it against a prefill chunk once capped usable
// context at 4630 of a configured 8192 tokens.
//
// Thread-safety: pure functions.

#include <cstdint>
#include <optional>

#include "absl/status/statusor.h"

namespace memra {

// Rows the ring books by default: one nominal 4096-token prime chunk plus slack; chosen, not
// derived, and independent of the configured context.
inline constexpr uint64_t kIndexRingWorkingRows = 5120;

// Physical rows of the indexer plane when it is a tail ring, or nullopt for the flat
// `max_ctx`-row plane. `explicit_rows`: nullopt books the default, 0 disables the ring, n pins
// it. A ring not shorter than the flat plane is pointless and collapses to nullopt.
std::optional<uint64_t> IndexRingRowsFor(std::optional<uint64_t> explicit_rows, uint64_t max_ctx);
std::optional<uint64_t> IndexRingDefaultRows(uint64_t max_ctx);

// Rows of `remaining` the indexer may append before the pool-key build must drain the ring, or
// nullopt when rows still owed to an unbuilt pool were lapped (pools_ready more than `ring`
// below `cur`: a rewind that did not clamp pools_ready, or a key-plane reallocation).
// `ring` is the EFFECTIVE ring (a whole number of pools; 0 = flat plane). A ring that is not a
// whole, nonzero number of pools cannot be addressed and is refused (nullopt), never a crash.
std::optional<uint64_t> IndexRingTake(uint64_t ring, uint64_t pool, uint64_t pools_ready,
                                      uint64_t cur, uint64_t remaining);

// The effective ring: booked rows rounded DOWN to whole pools (a pool never straddles the wrap).
// INVALID_ARGUMENT when the pool is unknown (0) or larger than the booked rows.
absl::StatusOr<uint64_t> EffectiveIndexRingRows(uint64_t ring_rows, uint64_t pool);

// Physical row of absolute row `abs` in an indexer plane; `ring_rows == 0` is the flat plane.
// Same refusals as EffectiveIndexRingRows.
absl::StatusOr<uint64_t> IndexPlanePhysicalRow(uint64_t ring_rows, uint64_t pool, uint64_t abs);

}  // namespace memra

#endif  // MEMRA_CORE_INDEX_RING_H_
