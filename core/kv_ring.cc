#include "core/kv_ring.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace memra {
namespace {

uint64_t SaturatingSub(uint64_t a, uint64_t b) { return a > b ? a - b : 0; }
uint64_t AlignDown(uint64_t value) { return value & ~(kSwaViewAlignmentRows - 1); }

}  // namespace

uint64_t SwaRingRows(uint64_t window, uint64_t max_ctx) {
  // keep_rows is window + slack, and a full prime chunk must still fit beside it.
  const uint64_t wanted =
      window + kPrimeChunkMaxTokens + kSwaRewindSlackRows + (kSwaViewAlignmentRows - 1);
  return std::min(max_ctx, wanted);
}

uint64_t KvPlaneRows(std::optional<uint64_t> ring_window, uint64_t capacity) {
  return ring_window.has_value() ? SwaRingRows(*ring_window, capacity) : capacity;
}

uint64_t AlignedWindowStart(uint64_t len, uint64_t window) {
  return AlignDown(SaturatingSub(len, SaturatingSub(window, 1)));
}

uint64_t SwaRetainFrom(uint64_t first_row, uint64_t window, uint64_t base) {
  const uint64_t ideal = AlignDown(
      SaturatingSub(SaturatingSub(first_row, SaturatingSub(window, 1)), kSwaRewindSlackRows));
  return std::max(ideal, base);
}

RingAppend RingAppend::Contiguous(uint64_t write_row) {
  RingAppend append;
  append.kind = Kind::kContiguous;
  append.write_row = write_row;
  return append;
}

RingAppend RingAppend::Rebase(uint64_t src_row, uint64_t keep_rows, uint64_t new_base,
                              uint64_t write_row) {
  return RingAppend{Kind::kRebase, src_row, keep_rows, new_base, write_row};
}

absl::StatusOr<KvRing> KvRing::Create(uint64_t rows, uint64_t window) {
  if (rows == 0 || window == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid SWA ring geometry: rows ", rows, ", window ", window));
  }
  return KvRing(rows, window);
}

absl::StatusOr<RingAppend> KvRing::AppendPlan(uint64_t len, uint64_t retain_from,
                                              uint64_t append_rows) const {
  if (len < base_ || retain_from < base_ || retain_from > len) {
    return absl::FailedPreconditionError(absl::StrCat("SWA ring lapped required rows (base ",
                                                      base_, ", retain ", retain_from,
                                                      ", len ", len, ")"));
  }
  const uint64_t used = len - base_;
  if (used > rows_) {
    return absl::FailedPreconditionError(
        absl::StrCat("SWA ring state exceeds capacity (", used, " > ", rows_, ")"));
  }
  if (append_rows <= rows_ - used) {
    return RingAppend::Contiguous(used % rows_);
  }
  const uint64_t keep_rows = len - retain_from;
  if (keep_rows > rows_ || append_rows > rows_ - keep_rows) {
    return absl::InvalidArgumentError(absl::StrCat("SWA ring append does not fit (keep ",
                                                   keep_rows, " + append ", append_rows,
                                                   " > ", rows_, ")"));
  }
  return RingAppend::Rebase(retain_from - base_, keep_rows, retain_from, keep_rows);
}

absl::Status KvRing::ApplyRebase(uint64_t new_base) {
  if (new_base < base_) {
    return absl::FailedPreconditionError(
        absl::StrCat("SWA ring rebase to ", new_base, " would move base ", base_, " backwards"));
  }
  base_ = new_base;
  return absl::OkStatus();
}

absl::StatusOr<RowRange> KvRing::PhysicalRange(uint64_t start, uint64_t end) const {
  if (end < start) {
    return absl::InvalidArgumentError(
        absl::StrCat("SWA ring view [", start, ",", end, ") is reversed"));
  }
  if (start < base_ || end - base_ > rows_) {
    return absl::FailedPreconditionError(absl::StrCat("SWA ring view [", start, ",", end,
                                                      ") is outside resident [", base_, ",",
                                                      base_ + rows_, ")"));
  }
  const uint64_t start_row = (start - base_) % rows_;
  return RowRange{start_row, start_row + (end - start)};
}

bool KvRing::CanRewindTo(uint64_t len) const {
  return AlignedWindowStart(len, window_) >= base_;
}

absl::StatusOr<std::pair<uint64_t, RowRange>> KvRing::RestorePlan(uint64_t len) const {
  const uint64_t new_base = AlignedWindowStart(len, window_);
  absl::StatusOr<RowRange> physical = PhysicalRange(new_base, len);
  if (!physical.ok()) return physical.status();
  return std::make_pair(new_base, *physical);
}

}  // namespace memra
