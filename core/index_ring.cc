#include "core/index_ring.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace memra {

std::optional<uint64_t> IndexRingRowsFor(std::optional<uint64_t> explicit_rows,
                                         uint64_t max_ctx) {
  uint64_t rows = kIndexRingWorkingRows;
  if (explicit_rows.has_value()) {
    if (*explicit_rows == 0) return std::nullopt;
    rows = *explicit_rows;
  }
  if (rows > 0 && rows < max_ctx) return rows;
  return std::nullopt;
}

std::optional<uint64_t> IndexRingDefaultRows(uint64_t max_ctx) {
  return IndexRingRowsFor(std::nullopt, max_ctx);
}

std::optional<uint64_t> IndexRingTake(uint64_t ring, uint64_t pool, uint64_t pools_ready,
                                      uint64_t cur, uint64_t remaining) {
  if (ring == 0) return remaining;
  if (pool == 0 || ring % pool != 0) return std::nullopt;
  uint64_t drained;
  if (__builtin_mul_overflow(pools_ready, pool, &drained) || drained > cur) {
    return std::nullopt;
  }
  const uint64_t live = cur - drained;
  if (ring <= live) return std::nullopt;
  return std::min(ring - live, remaining);
}

absl::StatusOr<uint64_t> EffectiveIndexRingRows(uint64_t ring_rows, uint64_t pool) {
  if (pool == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("indexer ring of ", ring_rows, " rows needs a known pool (got 0)"));
  }
  const uint64_t effective = ring_rows / pool * pool;
  if (effective == 0) {
    return absl::InvalidArgumentError(absl::StrCat("indexer ring of ", ring_rows,
                                                   " rows holds no whole pool of ", pool));
  }
  return effective;
}

absl::StatusOr<uint64_t> IndexPlanePhysicalRow(uint64_t ring_rows, uint64_t pool, uint64_t abs) {
  if (ring_rows == 0) return abs;
  absl::StatusOr<uint64_t> effective = EffectiveIndexRingRows(ring_rows, pool);
  if (!effective.ok()) return effective.status();
  return abs % *effective;
}

}  // namespace memra
