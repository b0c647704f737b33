#include "server/store/piece_ledger.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "spdlog/spdlog.h"

namespace memra {

absl::string_view HoldKindName(HoldKind kind) {
  switch (kind) {
    case HoldKind::kRestore:
      return "restore";
    case HoldKind::kCapture:
      return "capture";
    case HoldKind::kDemotion:
      return "demotion";
    case HoldKind::kPromotion:
      return "promotion";
    case HoldKind::kRemoteWrite:
      return "remote_write";
  }
  return "unknown";
}

PieceLedger::Hold& PieceLedger::Hold::operator=(Hold&& other) noexcept {
  if (this != &other) {
    Release();
    ledger_ = std::exchange(other.ledger_, nullptr);
    kind_ = other.kind_;
    handle_ = other.handle_;
    span_ = std::exchange(other.span_, std::nullopt);
  }
  return *this;
}

void PieceLedger::Hold::Release() {
  if (ledger_ == nullptr) return;
  ledger_->Release(*this);
  ledger_ = nullptr;
  span_.reset();
}

void PieceLedger::Count(HoldKind kind, uint64_t handle, const std::optional<SlabSpan>& span) {
  const size_t k = static_cast<size_t>(kind);
  ++live_[k];
  if (handle != 0) ++pieces_[handle][k];
  if (span.has_value() && kind == HoldKind::kRemoteWrite) {
    RemoteHolds& remote = remote_[KeyOf(*span)];
    ++remote.holds;
    remote.bytes = span->bytes;
  }
}

PieceLedger::Hold PieceLedger::Counted(HoldKind kind, uint64_t handle,
                                       const std::optional<SlabSpan>& span) {
  Count(kind, handle, span);
  Hold hold;
  hold.ledger_ = this;
  hold.kind_ = kind;
  hold.handle_ = handle;
  hold.span_ = span;
  return hold;
}

absl::StatusOr<PieceLedger::Hold> PieceLedger::Take(HoldKind kind, uint64_t handle,
                                                     std::optional<SlabSpan> span) {
  absl::MutexLock lock(&mu_);
  if (span.has_value()) {
    if (absl::Status held = slabs_->Hold(span->slab); !held.ok()) return held;
  }
  return Counted(kind, handle, span);
}

PieceLedger::Hold PieceLedger::AdoptAllocation(HoldKind kind, uint64_t handle,
                                               const SlabSpan& span) {
  absl::MutexLock lock(&mu_);
  return Counted(kind, handle, span);
}

absl::Status PieceLedger::AttachSpan(Hold& hold, const SlabSpan& span) {
  if (hold.ledger_ != this || hold.span_.has_value()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "piece ledger: a ", HoldKindName(hold.kind_), " hold on piece ", hold.handle_,
        hold.ledger_ != this ? " is released" : " already holds a span", "; cannot hold slab ",
        span.slab.value, " offset ", span.offset));
  }
  absl::MutexLock lock(&mu_);
  if (absl::Status held = slabs_->Hold(span.slab); !held.ok()) return held;
  if (hold.kind_ == HoldKind::kRemoteWrite) {
    RemoteHolds& remote = remote_[KeyOf(span)];
    ++remote.holds;
    remote.bytes = span.bytes;
  }
  hold.span_ = span;
  return absl::OkStatus();
}

void PieceLedger::Release(Hold& hold) {
  absl::MutexLock lock(&mu_);
  const size_t k = static_cast<size_t>(hold.kind_);
  --live_[k];
  if (hold.handle_ != 0) {
    auto it = pieces_.find(hold.handle_);
    if (it == pieces_.end() || it->second[k] == 0) {
      spdlog::error("piece ledger: no {} hold on piece {} to release",
                    std::string(HoldKindName(hold.kind_)), hold.handle_);
    } else if (--it->second[k] == 0 && it->second == std::array<uint32_t, kHoldKinds>{}) {
      pieces_.erase(it);
    }
  }
  if (!hold.span_.has_value()) return;
  const SlabSpan span = *hold.span_;
  bool free_now = false;
  if (hold.kind_ == HoldKind::kRemoteWrite) {
    auto it = remote_.find(KeyOf(span));
    if (it == remote_.end()) {
      spdlog::error("piece ledger: no remote hold on slab {} offset {}", span.slab.value,
                    span.offset);
    } else if (--it->second.holds == 0) {
      free_now = it->second.free_deferred;
      remote_.erase(it);
    }
  }
  // The slab's hold goes first, so that an emptied slab is returned or kept as any other.
  if (absl::Status released = slabs_->Release(span.slab); !released.ok()) {
    spdlog::error("piece ledger: {}", released.ToString());
  }
  if (!free_now) return;
  --deferred_spans_;
  deferred_bytes_ -= span.bytes;
  if (absl::Status freed = slabs_->Free(span); !freed.ok()) {
    spdlog::error("piece ledger: freeing a deferred span failed: {}", freed.ToString());
  }
}

bool PieceLedger::MayGo(uint64_t handle) const {
  absl::MutexLock lock(&mu_);
  return !pieces_.contains(handle);
}

absl::Status PieceLedger::CheckMayGo(uint64_t handle) const {
  absl::MutexLock lock(&mu_);
  auto it = pieces_.find(handle);
  if (it == pieces_.end()) return absl::OkStatus();
  std::vector<std::string> held;
  for (size_t k = 0; k < kHoldKinds; ++k) {
    if (it->second[k] > 0) {
      held.push_back(absl::StrCat(it->second[k], " ", HoldKindName(static_cast<HoldKind>(k))));
    }
  }
  return absl::FailedPreconditionError(absl::StrCat("piece ", handle, " is held: ",
                                                    absl::StrJoin(held, ", ")));
}

uint32_t PieceLedger::Holds(uint64_t handle, HoldKind kind) const {
  absl::MutexLock lock(&mu_);
  auto it = pieces_.find(handle);
  return it == pieces_.end() ? 0 : it->second[static_cast<size_t>(kind)];
}

bool PieceLedger::FreeSpan(const SlabSpan& span) {
  absl::MutexLock lock(&mu_);
  if (auto it = remote_.find(KeyOf(span)); it != remote_.end()) {
    // A queued remote write still reads it: freed when the writer releases it.
    if (!it->second.free_deferred) {
      it->second.free_deferred = true;
      ++deferred_spans_;
      deferred_bytes_ += span.bytes;
    }
    return true;
  }
  if (absl::Status freed = slabs_->Free(span); !freed.ok()) {
    spdlog::error("prefix cache: freeing its storage failed: {}", freed.ToString());
  }
  return false;
}

PieceLedgerStats PieceLedger::Stats() const {
  absl::MutexLock lock(&mu_);
  PieceLedgerStats stats;
  stats.holds = live_;
  stats.deferred_spans = deferred_spans_;
  stats.deferred_bytes = deferred_bytes_;
  return stats;
}

absl::Status PieceLedger::CheckInvariants() const {
  absl::MutexLock lock(&mu_);
  std::array<uint64_t, kHoldKinds> on_pieces{};
  for (const auto& [handle, counts] : pieces_) {
    if (counts == std::array<uint32_t, kHoldKinds>{}) {
      return absl::InternalError(absl::StrCat("piece ledger: piece ", handle,
                                              " is listed with no hold"));
    }
    for (size_t k = 0; k < kHoldKinds; ++k) on_pieces[k] += counts[k];
  }
  for (size_t k = 0; k < kHoldKinds; ++k) {
    if (on_pieces[k] > live_[k]) {
      return absl::InternalError(absl::StrCat(
          "piece ledger: pieces carry ", on_pieces[k], " ", HoldKindName(static_cast<HoldKind>(k)),
          " holds; ", live_[k], " are live"));
    }
  }
  uint64_t deferred = 0;
  uint64_t deferred_bytes = 0;
  uint64_t remote_holds = 0;
  for (const auto& [key, remote] : remote_) {
    if (remote.holds == 0) {
      return absl::InternalError(absl::StrCat("piece ledger: slab ", key.first, " offset ",
                                              key.second, " is listed with no remote hold"));
    }
    remote_holds += remote.holds;
    if (remote.free_deferred) {
      ++deferred;
      deferred_bytes += remote.bytes;
    }
  }
  if (remote_holds > live_[static_cast<size_t>(HoldKind::kRemoteWrite)] ||
      deferred != deferred_spans_ || deferred_bytes != deferred_bytes_) {
    return absl::InternalError(absl::StrCat(
        "piece ledger: ", remote_holds, " remote holds on spans of ",
        live_[static_cast<size_t>(HoldKind::kRemoteWrite)], " live; ", deferred, " spans (",
        deferred_bytes, " bytes) deferred of ", deferred_spans_, " (", deferred_bytes_,
        ") counted"));
  }
  return absl::OkStatus();
}

}  // namespace memra
