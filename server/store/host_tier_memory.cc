#include "server/store/host_tier_memory.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "core/status_macros.h"
#include "spdlog/spdlog.h"

namespace memra {

HostTierMemory::HostTierMemory(std::unique_ptr<HostMemoryProvider> provider)
    : provider_(std::move(provider)) {}

HostTierMemory::~HostTierMemory() {
  absl::MutexLock lock(&mu_);
  for (const auto& [id, slab] : slabs_) provider_->Free(slab.memory, slab.bytes);
}

absl::StatusOr<uint64_t> HostTierMemory::RoundedSlabBytes(uint64_t bytes) const {
  if (bytes == 0) return absl::InvalidArgumentError("host tier slab of 0 bytes requested");
  return CheckedAlignUp(bytes, provider_->Granularity(), "host tier slab");
}

absl::StatusOr<ArenaId> HostTierMemory::CreateSlab(uint64_t bytes) {
  ASSIGN_OR_RETURN(const uint64_t rounded, RoundedSlabBytes(bytes));
  if (rounded != bytes) {
    return absl::InvalidArgumentError(absl::StrCat("host tier slab of ", bytes,
                                                   " bytes is not rounded (", rounded, ")"));
  }
  ASSIGN_OR_RETURN(uint8_t* memory, provider_->Allocate(bytes));
  absl::MutexLock lock(&mu_);
  const ArenaId id{next_id_++};
  slabs_[id] = Slab{.memory = memory, .bytes = bytes};
  allocated_bytes_ += bytes;
  return id;
}

absl::Status HostTierMemory::FreeSlab(ArenaId slab) {
  Slab freed;
  {
    absl::MutexLock lock(&mu_);
    auto it = slabs_.find(slab);
    if (it == slabs_.end()) {
      return absl::NotFoundError(absl::StrCat("host tier has no slab ", slab.value));
    }
    freed = it->second;
    allocated_bytes_ -= freed.bytes;
    slabs_.erase(it);
  }
  provider_->Free(freed.memory, freed.bytes);
  return absl::OkStatus();
}

absl::StatusOr<absl::Span<uint8_t>> HostTierMemory::Bytes(ArenaId slab, uint64_t offset,
                                                          uint64_t bytes) const {
  absl::MutexLock lock(&mu_);
  auto it = slabs_.find(slab);
  if (it == slabs_.end()) {
    return absl::NotFoundError(absl::StrCat("host tier has no slab ", slab.value));
  }
  ASSIGN_OR_RETURN(const uint64_t end, CheckedAdd(offset, bytes, "host tier range"));
  if (end > it->second.bytes) {
    return absl::InvalidArgumentError(absl::StrCat("host tier range [", offset, ", ", end,
                                                   ") lies outside slab ", slab.value, " of ",
                                                   it->second.bytes, " bytes"));
  }
  return absl::MakeSpan(it->second.memory + offset, bytes);
}

uint64_t HostTierMemory::allocated_bytes() const {
  absl::MutexLock lock(&mu_);
  return allocated_bytes_;
}

}  // namespace memra
