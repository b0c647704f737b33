#ifndef MEMRA_CORE_KV_RING_H_
#define MEMRA_CORE_KV_RING_H_

// The sliding-window (SWA) ring (docs/rules.md#swa-ring): physical-row addressing for a
// sliding-attention K/V plane that holds fewer rows than the session's context (the reference's
// KvRing, swa_ring_rows, swa_retain_from; docs/rules.md#the-reference). Lengths are ABSOLUTE token
// counts; `base` is the absolute row stored at physical row 0 after the last rebase.
//
// Invariants: (1) rows > 0 and window > 0; (2) base only moves forward (ApplyRebase);
// (3) every resident view [start, end) maps to ONE contiguous physical range, because a rebase
// copies the retained rows to physical row 0 instead of wrapping.
//
// Thread-safety: a value type; callers synchronise.

#include <cstdint>
#include <optional>
#include <utility>

#include "absl/status/statusor.h"

namespace memra {

// One whole maximum-size prime chunk fits in the ring besides the window.
inline constexpr uint64_t kPrimeChunkMaxTokens = 4096;
// The reader's window view starts on a 32-row boundary: at most 31 masked rows precede it.
inline constexpr uint64_t kSwaViewAlignmentRows = 32;
// Rows kept BELOW the aligned window start so a backward rewind stays legal. The ring is SIZED
// for this headroom: the 32-row version clamped deep rewinds into a window below resident rows
// and served NaN logits instead of an error.
inline constexpr uint64_t kSwaRewindSlackRows = 512;

// Physical rows of a ring-backed plane: window + one prime chunk + rewind slack + alignment,
// never more than the context itself.
uint64_t SwaRingRows(uint64_t window, uint64_t max_ctx);

// Physical rows of a K/V plane holding `capacity` tokens: SwaRingRows for a ring layer (the
// ring's window set), the capacity itself for a flat one. Sizing and grow both read this.
uint64_t KvPlaneRows(std::optional<uint64_t> ring_window, uint64_t capacity);

// The aligned start of the attention window that ends at absolute length `len`.
uint64_t AlignedWindowStart(uint64_t len, uint64_t window);

// The retain an append must request: aligned window start minus the rewind slack, clamped UP
// to `base` (rows below base are gone and, being older than the window, not needed; demanding
// them breaks the first append after a rewind).
uint64_t SwaRetainFrom(uint64_t first_row, uint64_t window, uint64_t base);

struct RowRange {
  uint64_t start = 0;
  uint64_t end = 0;
  uint64_t size() const { return end - start; }
  bool operator==(const RowRange&) const = default;
};

// Where the next rows of an append go. A rebase first copies `keep_rows` physical rows from
// `src_row` to physical row 0 (the new base), then the append writes at `write_row`.
struct RingAppend {
  enum class Kind : uint8_t { kContiguous = 0, kRebase = 1 };
  Kind kind = Kind::kContiguous;
  uint64_t src_row = 0;    // kRebase only
  uint64_t keep_rows = 0;  // kRebase only
  uint64_t new_base = 0;   // kRebase only
  uint64_t write_row = 0;
  bool operator==(const RingAppend&) const = default;

  static RingAppend Contiguous(uint64_t write_row);
  static RingAppend Rebase(uint64_t src_row, uint64_t keep_rows, uint64_t new_base,
                           uint64_t write_row);
};

class KvRing {
 public:
  // INVALID_ARGUMENT when rows or window is zero.
  static absl::StatusOr<KvRing> Create(uint64_t rows, uint64_t window);

  uint64_t rows() const { return rows_; }
  uint64_t base() const { return base_; }
  uint64_t window() const { return window_; }

  // Plans a contiguous physical append of `append_rows` at absolute length `len`, retaining
  // [retain_from, len) when the tail would wrap. FAILED_PRECONDITION when the required rows
  // were lapped or the state exceeds the ring; INVALID_ARGUMENT when keep + append > rows.
  absl::StatusOr<RingAppend> AppendPlan(uint64_t len, uint64_t retain_from,
                                        uint64_t append_rows) const;

  // REQUIRES: new_base >= base() (FAILED_PRECONDITION otherwise; the ring is unchanged).
  absl::Status ApplyRebase(uint64_t new_base);

  // Physical rows of the resident absolute view [start, end).
  absl::StatusOr<RowRange> PhysicalRange(uint64_t start, uint64_t end) const;

  // Whether the aligned window view at length `len` is still resident.
  bool CanRewindTo(uint64_t len) const;

  // Plans restoring the aligned live window ending at absolute `len` into a FRESH ring:
  // (new base, source physical rows). Never the absolute length: on a lapped ring that is an
  // out-of-bounds slice (the warm-turn-at-40k panic). FAILED_PRECONDITION once lapped.
  absl::StatusOr<std::pair<uint64_t, RowRange>> RestorePlan(uint64_t len) const;

  bool operator==(const KvRing&) const = default;

 private:
  KvRing(uint64_t rows, uint64_t window) : rows_(rows), window_(window) {}

  uint64_t rows_;
  uint64_t window_;
  uint64_t base_ = 0;
};

}  // namespace memra

#endif  // MEMRA_CORE_KV_RING_H_
