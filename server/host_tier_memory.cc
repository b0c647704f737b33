#include "server/host_tier_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "core/status_macros.h"
#include "spdlog/spdlog.h"

namespace memra {
namespace {

class PlainHostMemory final : public HostMemoryProvider {
 public:
  std::string_view Name() const override { return "host"; }
  uint64_t Granularity() const override { return static_cast<uint64_t>(sysconf(_SC_PAGESIZE)); }
  absl::StatusOr<uint8_t*> Allocate(uint64_t bytes) override {
    void* memory = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (memory == MAP_FAILED) {
      const int err = errno;
      return absl::ResourceExhaustedError(absl::StrCat("host tier: mmap of ", bytes,
                                                       " bytes failed: ", std::strerror(err)));
    }
    return static_cast<uint8_t*>(memory);
  }
  void Free(uint8_t* memory, uint64_t bytes) override {
    if (munmap(memory, bytes) != 0) {
      spdlog::error("host tier: munmap of {} bytes failed: {}", bytes, std::strerror(errno));
    }
  }
};

}  // namespace

std::unique_ptr<HostMemoryProvider> NewPlainHostMemory() {
  return std::make_unique<PlainHostMemory>();
}

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
