#include "server/store/store_tier.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "spdlog/spdlog.h"

namespace memra {

absl::StatusOr<absl::Span<const uint8_t>> StoreTier::Read(uint64_t handle, const PieceStorage& at,
                                                          std::vector<uint8_t>& buffer) const {
  ASSIGN_OR_RETURN(std::optional<absl::Span<const uint8_t>> view, View(handle, at));
  if (view.has_value()) return *view;
  buffer.resize(at.piece_bytes);
  RETURN_IF_ERROR(ReadInto(handle, at, absl::MakeSpan(buffer)));
  return absl::Span<const uint8_t>(buffer);
}

namespace {

// The piece `source` describes, now at `span` in `medium`.
PieceStorage MovedTo(const PieceStorage& source, StorageMedium medium, const SlabSpan& span) {
  PieceStorage moved = source;
  moved.medium = medium;
  moved.span = span;
  return moved;
}

class DeviceTierImpl final : public StoreTier {
 public:
  DeviceTierImpl(DeviceBackend* backend, SlabAllocator* slabs, uint64_t budget_bytes,
                 std::function<void(const SlabSpan&)> free_span)
      : backend_(backend), slabs_(slabs), budget_bytes_(budget_bytes),
        free_span_(std::move(free_span)) {}

  StorageMedium medium() const override { return StorageMedium::kDevice; }
  uint64_t budget_bytes() const override { return budget_bytes_; }
  uint64_t IncomingBytes(const PieceStorage& source) const override { return source.span.bytes; }

  absl::StatusOr<std::optional<absl::Span<const uint8_t>>> View(
      uint64_t, const PieceStorage&) const override {
    return std::nullopt;  // device memory: read through the backend
  }
  absl::Status ReadInto(uint64_t, const PieceStorage& at, absl::Span<uint8_t> out) const override {
    return backend_->Read(at.span.slab, at.span.offset, out);
  }
  absl::StatusOr<PieceStorage> Insert(uint64_t, const PieceStorage& source,
                                      const PieceSource& bytes) override {
    ASSIGN_OR_RETURN(SlabSpan span, slabs_->Allocate(source.piece_bytes));
    absl::Status written = [&]() -> absl::Status {
      if (bytes.view.has_value()) return backend_->Write(span.slab, span.offset, *bytes.view);
      std::vector<uint8_t> buffer(source.piece_bytes);
      RETURN_IF_ERROR(bytes.read_into(absl::MakeSpan(buffer)));
      return backend_->Write(span.slab, span.offset, buffer);
    }();
    if (!written.ok()) {
      (void)slabs_->Release(span.slab);
      free_span_(span);
      return written;
    }
    return MovedTo(source, StorageMedium::kDevice, span);
  }
  void Erase(uint64_t, const PieceStorage& at) override { free_span_(at.span); }
  std::string Describe(uint64_t, const PieceStorage& at) const override {
    return absl::StrFormat("device piece (slab %d, offset %d)", at.span.slab.value,
                           at.span.offset);
  }

 private:
  DeviceBackend* const backend_;
  SlabAllocator* const slabs_;
  const uint64_t budget_bytes_;
  const std::function<void(const SlabSpan&)> free_span_;
};

class HostTierImpl final : public StoreTier {
 public:
  HostTierImpl(SlabAllocator* slabs, HostTierMemory* memory, uint64_t budget_bytes)
      : slabs_(slabs), memory_(memory), budget_bytes_(budget_bytes) {}

  StorageMedium medium() const override { return StorageMedium::kPinnedHost; }
  uint64_t budget_bytes() const override { return budget_bytes_; }
  uint64_t IncomingBytes(const PieceStorage& source) const override { return source.span.bytes; }

  absl::StatusOr<std::optional<absl::Span<const uint8_t>>> View(
      uint64_t, const PieceStorage& at) const override {
    ASSIGN_OR_RETURN(absl::Span<uint8_t> bytes,
                     memory_->Bytes(at.span.slab, at.span.offset, at.piece_bytes));
    return absl::Span<const uint8_t>(bytes);
  }
  absl::Status ReadInto(uint64_t handle, const PieceStorage& at,
                        absl::Span<uint8_t> out) const override {
    ASSIGN_OR_RETURN(std::optional<absl::Span<const uint8_t>> bytes, View(handle, at));
    std::memcpy(out.data(), bytes->data(), std::min(out.size(), bytes->size()));
    return absl::OkStatus();
  }
  // Straight into the host span (on cuda a DMA copy into pinned memory).
  absl::StatusOr<PieceStorage> Insert(uint64_t handle, const PieceStorage& source,
                                      const PieceSource& bytes) override {
    ASSIGN_OR_RETURN(SlabSpan span, slabs_->Allocate(source.piece_bytes));
    (void)slabs_->Release(span.slab);  // holds mean nothing without a budget
    PieceStorage moved = MovedTo(source, StorageMedium::kPinnedHost, span);
    absl::Status copied = [&]() -> absl::Status {
      ASSIGN_OR_RETURN(absl::Span<uint8_t> host,
                       memory_->Bytes(span.slab, span.offset, source.piece_bytes));
      if (bytes.view.has_value()) {
        std::memcpy(host.data(), bytes.view->data(), host.size());
        return absl::OkStatus();
      }
      return bytes.read_into(host);
    }();
    if (!copied.ok()) {
      Erase(handle, moved);
      return copied;
    }
    return moved;
  }
  void Erase(uint64_t, const PieceStorage& at) override {
    if (absl::Status freed = slabs_->Free(at.span); !freed.ok()) {
      spdlog::error("prefix cache: freeing host-tier storage failed: {}", freed.ToString());
    }
  }
  std::string Describe(uint64_t, const PieceStorage& at) const override {
    return absl::StrFormat("host-tier piece (%s memory, slab %d, offset %d)",
                           memory_->provider_name(), at.span.slab.value, at.span.offset);
  }

 private:
  SlabAllocator* const slabs_;
  HostTierMemory* const memory_;
  const uint64_t budget_bytes_;
};

class DiskTierImpl final : public StoreTier {
 public:
  explicit DiskTierImpl(DiskTier* disk) : disk_(disk) {}

  StorageMedium medium() const override { return StorageMedium::kDisk; }
  uint64_t budget_bytes() const override { return disk_->budget_bytes(); }
  uint64_t IncomingBytes(const PieceStorage& source) const override { return source.piece_bytes; }

  absl::StatusOr<std::optional<absl::Span<const uint8_t>>> View(
      uint64_t, const PieceStorage&) const override {
    return std::nullopt;
  }
  absl::Status ReadInto(uint64_t handle, const PieceStorage&,
                        absl::Span<uint8_t> out) const override {
    return disk_->Read(handle, out);
  }
  // From the host tier's memory as it is, or read out of the device first.
  absl::StatusOr<PieceStorage> Insert(uint64_t handle, const PieceStorage& source,
                                      const PieceSource& bytes) override {
    if (bytes.view.has_value()) {
      RETURN_IF_ERROR(disk_->Write(handle, *bytes.view));
    } else {
      std::vector<uint8_t> buffer(source.piece_bytes);
      RETURN_IF_ERROR(bytes.read_into(absl::MakeSpan(buffer)));
      RETURN_IF_ERROR(disk_->Write(handle, buffer));
    }
    // span.bytes stays: the rounded size the index counts.
    return MovedTo(source, StorageMedium::kDisk,
                   SlabSpan{.slab = ArenaId{}, .offset = 0, .bytes = source.span.bytes});
  }
  void Erase(uint64_t handle, const PieceStorage&) override {
    if (absl::Status removed = disk_->Remove(handle); !removed.ok()) {
      spdlog::error("prefix cache: {}", removed.ToString());
    }
  }
  std::string Describe(uint64_t handle, const PieceStorage&) const override {
    return absl::StrCat("disk file ", disk_->PathOf(handle));
  }

 private:
  DiskTier* const disk_;
};

}  // namespace

std::unique_ptr<StoreTier> DeviceStoreTier(DeviceBackend* backend, SlabAllocator* slabs,
                                           uint64_t budget_bytes,
                                           std::function<void(const SlabSpan&)> free_span) {
  return std::make_unique<DeviceTierImpl>(backend, slabs, budget_bytes, std::move(free_span));
}

std::unique_ptr<StoreTier> HostStoreTier(SlabAllocator* slabs, HostTierMemory* memory,
                                         uint64_t budget_bytes) {
  return std::make_unique<HostTierImpl>(slabs, memory, budget_bytes);
}

std::unique_ptr<StoreTier> DiskStoreTier(DiskTier* disk) {
  return std::make_unique<DiskTierImpl>(disk);
}

void TierChain::Add(std::unique_ptr<StoreTier> tier) { tiers_.push_back(std::move(tier)); }

StoreTier* TierChain::tier(StorageMedium medium) const {
  for (const std::unique_ptr<StoreTier>& tier : tiers_) {
    if (tier->medium() == medium) return tier.get();
  }
  return nullptr;
}

std::optional<StorageMedium> TierChain::Below(StorageMedium medium) const {
  for (size_t i = 0; i + 1 < tiers_.size(); ++i) {
    if (tiers_[i]->medium() == medium) return tiers_[i + 1]->medium();
  }
  return std::nullopt;
}

uint64_t TierChain::Budget(StorageMedium medium) const {
  const StoreTier* found = tier(medium);
  return found == nullptr ? 0 : found->budget_bytes();
}

}  // namespace memra
