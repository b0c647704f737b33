#ifndef MEMRA_SERVER_PLACEMENT_H_
#define MEMRA_SERVER_PLACEMENT_H_

// Where a session's planes lie in device memory: one exported arena per layout version, and the
// checked arithmetic that turns a plane range into an arena offset. Below the session and the
// prefix store, which both address planes through it.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "core/session.h"
#include "core/sizing.h"
#include "server/device/backend.h"
#include "server/device/device_budget.h"

namespace memra {

// Where a session's planes are: one exported arena per layout version.
struct SessionLayoutVersion {
  uint64_t version = 0;
  SessionPlan plan;
  std::vector<uint64_t> offsets;                // byte offset of plan.planes[i] in the arena
  absl::flat_hash_map<uint64_t, size_t> index;  // PlaneKey(layer, kind) -> plan.planes index
  uint64_t arena_bytes = 0;  // the arena's exact bytes: what admission charged
  AllocationId charge;       // this arena's entry in the admission budget
  ArenaId arena;
  ArenaExport exported;
};

// The key of `ref` in SessionLayoutVersion::index.
inline uint64_t PlaneKey(const PlaneRef& ref) { return PlaneKey(ref.layer, ref.kind); }

// One plane of a layout: its arena offset and size.
struct PlaneAt {
  uint64_t offset;
  uint64_t bytes;
};

// INTERNAL when `layout` has no such plane.
absl::StatusOr<PlaneAt> FindPlane(const SessionLayoutVersion& layout, const PlaneRef& ref);
// Offset of [offset, offset + bytes) of `plane` in its arena; INTERNAL when core asked for a
// range outside the plane (a broken invariant, but never a stray write).
absl::StatusOr<uint64_t> RangeInPlane(const PlaneAt& plane, uint64_t offset, uint64_t bytes);
// Arena offset of [offset, offset + bytes) of `plane` in `layout`: INTERNAL when the layout has
// no such plane or the range leaves it (never a stray access).
absl::StatusOr<uint64_t> PlaneRangeOffset(const SessionLayoutVersion& layout,
                                          const PlaneRef& plane, uint64_t offset, uint64_t bytes);
// Bytes of `plane` in `layout` (0 when absent).
uint64_t PlaneBytes(const SessionLayoutVersion& layout, const PlaneRef& plane);

}  // namespace memra

#endif  // MEMRA_SERVER_PLACEMENT_H_
