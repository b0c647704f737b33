#ifndef MEMRA_CORE_ARENA_LAYOUT_H_
#define MEMRA_CORE_ARENA_LAYOUT_H_

// Places a session's planes in ONE arena: what the daemon allocates and exports per session, and
// exactly what admission charges (cost == ArenaLayout::bytes), so the estimate can never
// disagree with the allocation.
//
// Thread-safety: pure functions over values.

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "core/sizing.h"

namespace memra {

struct PlacedPlane {
  PlaneSpec spec;
  uint64_t offset = 0;  // from the arena start; a multiple of the layout's alignment
};

// Invariants: (1) planes are in the order given, offsets increasing, none overlapping;
// (2) bytes is a multiple of the granularity and >= the end of the last plane.
struct ArenaLayout {
  std::vector<PlacedPlane> planes;
  uint64_t bytes = 0;
};

// `alignment`: every plane's offset (a power of two, e.g. 256 for device vector loads).
// `granularity`: what the backend rounds an allocation to (a power of two, e.g. 4096 pages or
// 2 MiB CUDA granules). INVALID_ARGUMENT for a zero or non-power-of-two value, or when the
// layout overflows 64 bits.
absl::StatusOr<ArenaLayout> LayoutArena(const std::vector<PlaneSpec>& planes, uint64_t alignment,
                                        uint64_t granularity);

}  // namespace memra

#endif  // MEMRA_CORE_ARENA_LAYOUT_H_
