#ifndef MEMRA_SERVER_STORE_PIECE_LEDGER_H_
#define MEMRA_SERVER_STORE_PIECE_LEDGER_H_

// The one ledger of why a stored piece may not be freed or moved now (as LevelDB computes
// `live = pending_outputs_ + AddLiveFiles` in one place). Every such reason is a kind of one
// scoped hold (HoldKind), taken on a piece (by its storage handle; 0 for a capture's copy the
// index has not adopted yet) and, where the piece lies in a device slab, on its span:
//   * kRestore: a restore or pool load reads the piece (its entry is pinned in the index);
//   * kCapture: a capture's fresh copy, until the index adopts it or it is freed;
//   * kDemotion: a demotion copies the piece down (its source stays put until the commit);
//   * kPromotion: a restore copies the piece up from a slower tier;
//   * kRemoteWrite: a queued remote write will read the span (a free of it waits for the write).
// The ledger alone answers "may this piece go now?" (MayGo: no hold of any kind) and "which
// slabs are evictable?" (the device slabs no hold keeps: every SlabAllocator hold of the store's
// device slabs is a ledger hold, so SlabAllocator's evictable bytes are the ledger's answer).
// The index keeps its own entry pins (its eviction rule); the block store's TTL pins are a
// policy over those.
//
// Thread-safety: thread-safe. Lock order: PrefixCache's mutex -> mu_ -> SlabAllocator's mutex.
// A hold may be released on any thread (the remote tier's writer releases kRemoteWrite holds).
//
// Invariants: (1) a piece's count of a kind is the number of live holds of that kind on it;
// (2) each live hold with a device span holds that span's slab exactly once in the allocator;
// (3) deferred spans are exactly the spans FreeSpan found under a kRemoteWrite hold, freed when
// the last such hold goes.

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/store/slab_allocator.h"

namespace memra {

enum class HoldKind : uint8_t { kRestore, kCapture, kDemotion, kPromotion, kRemoteWrite };
inline constexpr size_t kHoldKinds = 5;
// "restore", "capture", "demotion", "promotion", "remote_write".
absl::string_view HoldKindName(HoldKind kind);

struct PieceLedgerStats {
  std::array<uint64_t, kHoldKinds> holds{};  // live holds of each kind (gauges)
  uint64_t deferred_spans = 0;  // spans whose free waits for a queued remote write
  uint64_t deferred_bytes = 0;
};

class PieceLedger {
 public:
  // A scoped hold: released by Release() or its destructor, on any thread. Move-only.
  class Hold {
   public:
    Hold() = default;
    Hold(Hold&& other) noexcept { *this = std::move(other); }
    Hold& operator=(Hold&& other) noexcept;
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;
    ~Hold() { Release(); }

    void Release();
    bool held() const { return ledger_ != nullptr; }
    HoldKind kind() const { return kind_; }
    uint64_t handle() const { return handle_; }
    const std::optional<SlabSpan>& span() const { return span_; }

   private:
    friend class PieceLedger;
    PieceLedger* ledger_ = nullptr;
    HoldKind kind_ = HoldKind::kRestore;
    uint64_t handle_ = 0;
    std::optional<SlabSpan> span_;
  };

  // `device_slabs`: the store's device tier, which must outlive the ledger and every hold.
  explicit PieceLedger(SlabAllocator* device_slabs) : slabs_(device_slabs) {}
  PieceLedger(const PieceLedger&) = delete;
  PieceLedger& operator=(const PieceLedger&) = delete;

  // Holds piece `handle` for `kind` and, with `span` (a live span of the device slabs), its
  // slab. NOT_FOUND (the allocator's) when the slab is not live: nothing is held.
  absl::StatusOr<Hold> Take(HoldKind kind, uint64_t handle, std::optional<SlabSpan> span)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A span SlabAllocator::Allocate just returned (already held once by the allocation): that
  // hold becomes a ledger hold of `kind` (never fails).
  Hold AdoptAllocation(HoldKind kind, uint64_t handle, const SlabSpan& span)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Puts a device span under `hold` (a restore's piece once promoted into a slab).
  // FAILED_PRECONDITION when `hold` is released or has a span already; NOT_FOUND as Take.
  absl::Status AttachSpan(Hold& hold, const SlabSpan& span) ABSL_LOCKS_EXCLUDED(mu_);

  // May piece `handle` be freed or moved now? Only with no hold of any kind on it.
  bool MayGo(uint64_t handle) const ABSL_LOCKS_EXCLUDED(mu_);
  // MayGo as a refusal: OK, or FAILED_PRECONDITION naming each kind holding it and its count.
  absl::Status CheckMayGo(uint64_t handle) const ABSL_LOCKS_EXCLUDED(mu_);
  uint32_t Holds(uint64_t handle, HoldKind kind) const ABSL_LOCKS_EXCLUDED(mu_);
  bool HeldAs(uint64_t handle, HoldKind kind) const { return Holds(handle, kind) > 0; }

  // Frees the device `span`: now, or (returns true) once the last kRemoteWrite hold on it goes.
  bool FreeSpan(const SlabSpan& span) ABSL_LOCKS_EXCLUDED(mu_);
  // Which slabs are evictable: the bytes of device slabs no hold keeps.
  uint64_t EvictableBytes() const { return slabs_->Stats().evictable_bytes; }

  PieceLedgerStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);
  // (1) and (3) against the holds' own records: INTERNAL naming the first disagreement.
  absl::Status CheckInvariants() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  using SpanKey = std::pair<uint64_t, uint64_t>;  // (slab, offset)
  struct RemoteHolds {
    uint32_t holds = 0;
    bool free_deferred = false;
    uint64_t bytes = 0;
  };
  static SpanKey KeyOf(const SlabSpan& span) { return {span.slab.value, span.offset}; }

  void Count(HoldKind kind, uint64_t handle, const std::optional<SlabSpan>& span)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A live hold, counted (its slab hold, if any, already taken).
  Hold Counted(HoldKind kind, uint64_t handle, const std::optional<SlabSpan>& span)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Release(Hold& hold) ABSL_LOCKS_EXCLUDED(mu_);

  SlabAllocator* const slabs_;

  mutable absl::Mutex mu_;
  // handle -> live holds per kind (a handle leaves when all are 0).
  absl::flat_hash_map<uint64_t, std::array<uint32_t, kHoldKinds>> pieces_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<SpanKey, RemoteHolds> remote_ ABSL_GUARDED_BY(mu_);
  std::array<uint64_t, kHoldKinds> live_{} ABSL_GUARDED_BY(mu_);
  uint64_t deferred_spans_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t deferred_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace memra

#endif  // MEMRA_SERVER_STORE_PIECE_LEDGER_H_
