#include "core/arena_layout.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/checked_math.h"
#include "core/status_macros.h"

namespace memra {
namespace {

absl::Status RequirePowerOfTwo(uint64_t value, absl::string_view what) {
  if (value == 0 || (value & (value - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("arena ", what, " ", value, " must be a nonzero power of two"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ArenaLayout> LayoutArena(const std::vector<PlaneSpec>& planes, uint64_t alignment,
                                        uint64_t granularity) {
  RETURN_IF_ERROR(RequirePowerOfTwo(alignment, "alignment"));
  RETURN_IF_ERROR(RequirePowerOfTwo(granularity, "granularity"));
  ArenaLayout layout;
  layout.planes.reserve(planes.size());
  uint64_t end = 0;
  for (const PlaneSpec& plane : planes) {
    ASSIGN_OR_RETURN(const uint64_t offset, CheckedAlignUp(end, alignment, "arena offset"));
    ASSIGN_OR_RETURN(end, CheckedAdd(offset, plane.bytes, "arena end"));
    layout.planes.push_back(PlacedPlane{plane, offset});
  }
  ASSIGN_OR_RETURN(layout.bytes, CheckedAlignUp(end, granularity, "arena bytes"));
  return layout;
}

}  // namespace memra
