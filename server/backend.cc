#include "server/backend.h"

#include <unistd.h>

#include "absl/strings/str_cat.h"

namespace memra {

absl::StatusOr<uint64_t> DeviceBackend::RoundedArenaBytes(uint64_t bytes) const {
  const absl::string_view backend(Name().data(), Name().size());
  const uint64_t granularity = AllocationGranularity();
  if (bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat(backend, ": arena of 0 bytes requested"));
  }
  // The same rounding as core/checked_math.h's CheckedAlignUp (granularity is a power of two).
  uint64_t bumped;
  if (__builtin_add_overflow(bytes, granularity - 1, &bumped)) {
    return absl::InvalidArgumentError(absl::StrCat(
        backend, ": arena of ", bytes, " bytes overflows when rounded up to ", granularity));
  }
  return bumped & ~(granularity - 1);
}

absl::StatusOr<ArenaId> DeviceBackend::AdoptArenaFd(int fd, uint64_t bytes, std::string) {
  if (fd >= 0) close(fd);
  return absl::FailedPreconditionError(
      absl::StrCat(absl::string_view(Name().data(), Name().size()), " backend: cannot adopt a ",
                   bytes, "-byte arena from a file descriptor (its arenas are not descriptors)"));
}

absl::StatusOr<MappedEngineBuffers> DeviceBackend::MapEngineBuffers(
    absl::Span<const EngineBufferFd> buffers) {
  return absl::FailedPreconditionError(absl::StrCat(
      absl::string_view(Name().data(), Name().size()), " backend: cannot map ", buffers.size(),
      " engine buffers from file descriptors (its engines' pools are not descriptors)"));
}

absl::Status CheckArenaRange(absl::string_view op, ArenaId arena, uint64_t arena_bytes,
                             uint64_t offset, uint64_t bytes) {
  uint64_t end;
  if (__builtin_add_overflow(offset, bytes, &end)) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": offset ", offset, " + ", bytes,
                                                   " bytes overflows (arena ", arena.value, " of ",
                                                   arena_bytes, " bytes)"));
  }
  if (end > arena_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": offset ", offset, " + ", bytes,
                                                   " bytes = ", end, " exceeds arena ", arena.value,
                                                   " of ", arena_bytes, " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace memra
