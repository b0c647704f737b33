#include "server/store/slab_allocator.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "core/status_macros.h"
#include "spdlog/spdlog.h"

namespace memra {

namespace {

class BackendSlabs final : public SlabSource {
 public:
  explicit BackendSlabs(DeviceBackend* backend) : backend_(backend) {}
  absl::StatusOr<uint64_t> RoundedSlabBytes(uint64_t bytes) const override {
    return backend_->RoundedArenaBytes(bytes);
  }
  absl::StatusOr<ArenaId> CreateSlab(uint64_t bytes) override {
    return backend_->CreateArena(bytes, ArenaVisibility::kPrivate);
  }
  absl::Status FreeSlab(ArenaId slab) override { return backend_->FreeArena(slab); }

 private:
  DeviceBackend* const backend_;
};

absl::StatusOr<uint64_t> CheckedSlabBytes(const SlabAllocatorOptions& options,
                                          const SlabSource& source) {
  if (options.alignment == 0 || (options.alignment & (options.alignment - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("slab span alignment ", options.alignment,
                                                   " is not a power of two"));
  }
  if (options.slab_bytes == 0) return absl::InvalidArgumentError("slab size is 0 bytes");
  ASSIGN_OR_RETURN(uint64_t slab_bytes, source.RoundedSlabBytes(options.slab_bytes));
  return CheckedAlignUp(slab_bytes, options.alignment, "slab size");
}

}  // namespace

std::unique_ptr<SlabSource> BackendSlabSource(DeviceBackend* backend) {
  return std::make_unique<BackendSlabs>(backend);
}

absl::StatusOr<std::unique_ptr<SlabAllocator>> SlabAllocator::Create(
    const SlabAllocatorOptions& options, DeviceBackend* backend, DeviceBudget* budget) {
  if (backend == nullptr) return absl::InvalidArgumentError("SlabAllocator needs a backend");
  std::unique_ptr<SlabSource> source = BackendSlabSource(backend);
  ASSIGN_OR_RETURN(const uint64_t slab_bytes, CheckedSlabBytes(options, *source));
  SlabSource* const raw = source.get();
  return std::unique_ptr<SlabAllocator>(
      new SlabAllocator(options, slab_bytes, std::move(source), raw, budget));
}

absl::StatusOr<std::unique_ptr<SlabAllocator>> SlabAllocator::Create(
    const SlabAllocatorOptions& options, SlabSource* source, DeviceBudget* budget) {
  if (source == nullptr) return absl::InvalidArgumentError("SlabAllocator needs a slab source");
  ASSIGN_OR_RETURN(const uint64_t slab_bytes, CheckedSlabBytes(options, *source));
  return std::unique_ptr<SlabAllocator>(
      new SlabAllocator(options, slab_bytes, nullptr, source, budget));
}

SlabAllocator::SlabAllocator(const SlabAllocatorOptions& options, uint64_t slab_bytes,
                             std::unique_ptr<SlabSource> owned_source, SlabSource* source,
                             DeviceBudget* budget)
    : options_(options),
      slab_bytes_(slab_bytes),
      owned_source_(std::move(owned_source)),
      source_(source),
      budget_(budget) {}

SlabAllocator::~SlabAllocator() {
  absl::MutexLock lock(&mu_);
  std::vector<ArenaId> ids;
  for (const auto& [id, slab] : slabs_) ids.push_back(id);
  for (ArenaId id : ids) DestroySlab(id);
  PublishEvictable();
}

absl::StatusOr<uint64_t> SlabAllocator::RoundedBytes(uint64_t bytes) const {
  if (bytes == 0) return absl::InvalidArgumentError("slab span of 0 bytes requested");
  return CheckedAlignUp(bytes, options_.alignment, "slab span");
}

absl::StatusOr<ArenaId> SlabAllocator::CreateSlab(uint64_t bytes) {
  std::optional<AllocationId> charge;
  if (budget_ != nullptr) {
    ASSIGN_OR_RETURN(charge, budget_->AllocateWithoutEviction(kPrefixCacheOwner, bytes));
  }
  absl::StatusOr<ArenaId> arena = source_->CreateSlab(bytes);
  if (!arena.ok()) {
    if (charge.has_value()) (void)budget_->Release(*charge);
    return arena.status();
  }
  Slab& slab = slabs_[*arena];
  slab.bytes = bytes;
  slab.charge = charge;
  total_bytes_ += bytes;
  unheld_bytes_ += bytes;
  ++slabs_created_;
  AddFree(*arena, slab, 0, bytes);
  return *arena;
}

void SlabAllocator::DestroySlab(ArenaId id) {
  auto it = slabs_.find(id);
  if (it == slabs_.end()) return;
  Slab& slab = it->second;
  for (const auto& [offset, bytes] : slab.free) free_by_size_.erase({bytes, id.value, offset});
  total_bytes_ -= slab.bytes;
  if (slab.holds == 0) unheld_bytes_ -= slab.bytes;
  used_bytes_ -= slab.used_bytes;
  spans_ -= slab.used.size();
  returned_bytes_ += slab.bytes;
  ++slabs_freed_;
  if (absl::Status freed = source_->FreeSlab(id); !freed.ok()) {
    spdlog::error("prefix slab {}: freeing its arena failed: {}", id.value, freed.ToString());
  }
  if (slab.charge.has_value()) {
    if (absl::Status released = budget_->Release(*slab.charge); !released.ok()) {
      spdlog::error("prefix slab {}: releasing its budget charge failed: {}", id.value,
                    released.ToString());
    }
  }
  slabs_.erase(it);
}

void SlabAllocator::AddFree(ArenaId id, Slab& slab, uint64_t offset, uint64_t bytes) {
  slab.free[offset] = bytes;
  free_by_size_.insert({bytes, id.value, offset});
}

void SlabAllocator::RemoveFree(ArenaId id, Slab& slab,
                               std::map<uint64_t, uint64_t>::iterator range) {
  free_by_size_.erase({range->second, id.value, range->first});
  slab.free.erase(range);
}

bool SlabAllocator::KeepEmpty() const { return total_bytes_ <= options_.keep_empty_bytes; }

void SlabAllocator::PublishEvictable() {
  if (budget_ != nullptr) budget_->SetEvictable(EvictableSource::kPrefixCache, unheld_bytes_);
}

absl::StatusOr<SlabSpan> SlabAllocator::Allocate(uint64_t bytes) {
  ASSIGN_OR_RETURN(const uint64_t rounded, RoundedBytes(bytes));
  absl::MutexLock lock(&mu_);
  auto fit = free_by_size_.lower_bound({rounded, 0, 0});
  if (fit == free_by_size_.end()) {
    // No free range fits: empty slabs cannot hold it either, so they go before a new one comes.
    std::vector<ArenaId> empty;
    for (const auto& [id, slab] : slabs_) {
      if (slab.used.empty() && slab.holds == 0) empty.push_back(id);
    }
    for (ArenaId id : empty) DestroySlab(id);
    absl::StatusOr<uint64_t> slab_size = source_->RoundedSlabBytes(std::max(rounded, slab_bytes_));
    if (slab_size.ok()) slab_size = CheckedAlignUp(*slab_size, options_.alignment, "slab size");
    absl::Status created = slab_size.status();
    if (created.ok()) created = CreateSlab(*slab_size).status();
    if (!created.ok()) {
      PublishEvictable();
      return created;
    }
    fit = free_by_size_.lower_bound({rounded, 0, 0});
  }
  const auto [range_bytes, slab_id, offset] = *fit;
  const ArenaId id{slab_id};
  Slab& slab = slabs_.at(id);
  RemoveFree(id, slab, slab.free.find(offset));
  if (range_bytes > rounded) AddFree(id, slab, offset + rounded, range_bytes - rounded);
  slab.used[offset] = rounded;
  slab.used_bytes += rounded;
  used_bytes_ += rounded;
  ++spans_;
  if (slab.holds++ == 0) unheld_bytes_ -= slab.bytes;
  PublishEvictable();
  return SlabSpan{.slab = id, .offset = offset, .bytes = rounded};
}

absl::Status SlabAllocator::Free(const SlabSpan& span) {
  absl::MutexLock lock(&mu_);
  auto it = slabs_.find(span.slab);
  auto live = it == slabs_.end() ? decltype(it->second.used)::iterator()
                                 : it->second.used.find(span.offset);
  if (it == slabs_.end() || live == it->second.used.end() || live->second != span.bytes) {
    return absl::InvalidArgumentError(absl::StrCat("no live slab span of ", span.bytes,
                                                   " bytes at offset ", span.offset, " of slab ",
                                                   span.slab.value));
  }
  Slab& slab = it->second;
  slab.used.erase(live);
  slab.used_bytes -= span.bytes;
  used_bytes_ -= span.bytes;
  --spans_;
  uint64_t offset = span.offset;
  uint64_t bytes = span.bytes;
  auto next = slab.free.lower_bound(offset);
  if (next != slab.free.end() && next->first == offset + bytes) {
    bytes += next->second;
    RemoveFree(span.slab, slab, next);
  }
  auto after = slab.free.lower_bound(offset);
  if (after != slab.free.begin()) {
    auto previous = std::prev(after);
    if (previous->first + previous->second == offset) {
      offset = previous->first;
      bytes += previous->second;
      RemoveFree(span.slab, slab, previous);
    }
  }
  AddFree(span.slab, slab, offset, bytes);
  if (slab.used.empty() && slab.holds == 0 && !KeepEmpty()) DestroySlab(span.slab);
  PublishEvictable();
  return absl::OkStatus();
}

absl::Status SlabAllocator::Hold(ArenaId id) {
  absl::MutexLock lock(&mu_);
  auto it = slabs_.find(id);
  if (it == slabs_.end()) return absl::NotFoundError(absl::StrCat("no slab ", id.value));
  if (it->second.holds++ == 0) {
    unheld_bytes_ -= it->second.bytes;
    PublishEvictable();
  }
  return absl::OkStatus();
}

absl::Status SlabAllocator::Release(ArenaId id) {
  absl::MutexLock lock(&mu_);
  auto it = slabs_.find(id);
  if (it == slabs_.end()) return absl::NotFoundError(absl::StrCat("no slab ", id.value));
  Slab& slab = it->second;
  if (slab.holds == 0) {
    return absl::FailedPreconditionError(absl::StrCat("slab ", id.value, " has no hold"));
  }
  if (--slab.holds == 0) {
    unheld_bytes_ += slab.bytes;
    if (slab.used.empty() && !KeepEmpty()) DestroySlab(id);
    PublishEvictable();
  }
  return absl::OkStatus();
}

uint64_t SlabAllocator::ReleaseEmptySlabs() {
  absl::MutexLock lock(&mu_);
  std::vector<ArenaId> empty;
  uint64_t bytes = 0;
  for (const auto& [id, slab] : slabs_) {
    if (slab.used.empty() && slab.holds == 0) {
      empty.push_back(id);
      bytes += slab.bytes;
    }
  }
  for (ArenaId id : empty) DestroySlab(id);
  PublishEvictable();
  return bytes;
}

uint64_t SlabAllocator::returned_bytes() const {
  absl::MutexLock lock(&mu_);
  return returned_bytes_;
}

SlabStats SlabAllocator::Stats() const {
  absl::MutexLock lock(&mu_);
  SlabStats stats;
  stats.slabs = slabs_.size();
  stats.slab_bytes = total_bytes_;
  stats.used_bytes = used_bytes_;
  stats.spans = spans_;
  for (const auto& [id, slab] : slabs_) {
    if (slab.used.empty()) {
      ++stats.empty_slabs;
      stats.empty_bytes += slab.bytes;
    }
  }
  stats.free_bytes = total_bytes_ - used_bytes_ - stats.empty_bytes;
  if (!free_by_size_.empty()) stats.largest_free_bytes = std::get<0>(*free_by_size_.rbegin());
  stats.evictable_bytes = unheld_bytes_;
  const uint64_t occupied = total_bytes_ - stats.empty_bytes;
  if (occupied > 0) {
    stats.fragmentation_ppm = static_cast<uint64_t>(
        static_cast<unsigned __int128>(stats.free_bytes) * 1000000 / occupied);
  }
  stats.slabs_created = slabs_created_;
  stats.slabs_freed = slabs_freed_;
  return stats;
}

absl::Status SlabAllocator::CheckInvariants() const {
  absl::MutexLock lock(&mu_);
  uint64_t total = 0, used = 0, spans = 0, unheld = 0, free_ranges = 0;
  for (const auto& [id, slab] : slabs_) {
    total += slab.bytes;
    if (slab.holds == 0) unheld += slab.bytes;
    // (2): used spans and free ranges tile the slab.
    std::map<uint64_t, uint64_t> pieces(slab.free.begin(), slab.free.end());
    uint64_t slab_used = 0;
    for (const auto& [offset, bytes] : slab.used) {
      if (!pieces.emplace(offset, bytes).second) {
        return absl::InternalError(absl::StrCat("slab ", id.value, ": offset ", offset,
                                                " is both free and used"));
      }
      slab_used += bytes;
    }
    uint64_t at = 0;
    for (const auto& [offset, bytes] : pieces) {
      if (offset != at) {
        return absl::InternalError(absl::StrCat("slab ", id.value, ": a gap or overlap at ",
                                                at, " (next range at ", offset, ")"));
      }
      at += bytes;
    }
    if (at != slab.bytes || slab_used != slab.used_bytes) {
      return absl::InternalError(absl::StrCat("slab ", id.value, " of ", slab.bytes,
                                              " bytes: ranges end at ", at, ", used ", slab_used,
                                              " (counted ", slab.used_bytes, ")"));
    }
    for (const auto& [offset, bytes] : slab.free) {
      if (!free_by_size_.contains({bytes, id.value, offset})) {
        return absl::InternalError(absl::StrCat("slab ", id.value, ": free range at ", offset,
                                                " missing from the size index"));
      }
    }
    free_ranges += slab.free.size();
    used += slab_used;
    spans += slab.used.size();
  }
  if (free_ranges != free_by_size_.size() || total != total_bytes_ || used != used_bytes_ ||
      spans != spans_ || unheld != unheld_bytes_) {
    return absl::InternalError(absl::StrCat(
        "slab totals disagree: free ranges ", free_ranges, " vs ", free_by_size_.size(),
        ", bytes ", total, " vs ", total_bytes_, ", used ", used, " vs ", used_bytes_,
        ", spans ", spans, " vs ", spans_, ", unheld ", unheld, " vs ", unheld_bytes_));
  }
  return absl::OkStatus();
}

}  // namespace memra
