#include "server/device/placement.h"

#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "core/status_macros.h"

namespace memra {

absl::StatusOr<PlaneAt> FindPlane(const SessionLayoutVersion& layout, const PlaneRef& ref) {
  auto it = layout.index.find(PlaneKey(ref));
  if (it == layout.index.end()) {
    return absl::InternalError(absl::StrCat("layout version ", layout.version, " has no ",
                                            PlaneKindName(ref.kind).data(), " plane for layer ",
                                            ref.layer));
  }
  return PlaneAt{layout.offsets[it->second], layout.plan.planes[it->second].bytes};
}

absl::StatusOr<uint64_t> RangeInPlane(const PlaneAt& plane, uint64_t offset, uint64_t bytes) {
  ASSIGN_OR_RETURN(uint64_t end, CheckedAdd(offset, bytes, "plane copy range"));
  if (end > plane.bytes) {
    return absl::InternalError(absl::StrCat("plane copy [", offset, ", ", end,
                                            ") exceeds the plane's ", plane.bytes, " bytes"));
  }
  return plane.offset + offset;
}

absl::StatusOr<uint64_t> PlaneRangeOffset(const SessionLayoutVersion& layout,
                                          const PlaneRef& plane, uint64_t offset, uint64_t bytes) {
  ASSIGN_OR_RETURN(PlaneAt at, FindPlane(layout, plane));
  return RangeInPlane(at, offset, bytes);
}

uint64_t PlaneBytes(const SessionLayoutVersion& layout, const PlaneRef& plane) {
  absl::StatusOr<PlaneAt> at = FindPlane(layout, plane);
  return at.ok() ? at->bytes : 0;
}

}  // namespace memra
