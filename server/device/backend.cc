#include "server/device/backend.h"

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

absl::StatusOr<MappedEngineBuffers> DeviceBackend::MapEngineIpcBuffers(
    absl::Span<const EngineBufferIpc> buffers) {
  return absl::FailedPreconditionError(absl::StrCat(
      absl::string_view(Name().data(), Name().size()), " backend: cannot map ", buffers.size(),
      " engine buffers from CUDA IPC handles (register handoff buffers: its engines' pools are "
      "shared-memory descriptors)"));
}

absl::StatusOr<std::string> DeviceBackend::RecordCompletionEvent() { return std::string(); }

absl::Status CheckEngineIpcBuffers(absl::Span<const EngineBufferIpc> buffers) {
  constexpr size_t kMaxBuffers = 1024;  // as core/block_layout.h's registration limit
  if (buffers.empty() || buffers.size() > kMaxBuffers) {
    return absl::InvalidArgumentError(absl::StrCat("an engine pool registers 1 .. ", kMaxBuffers,
                                                   " CUDA IPC buffers; got ", buffers.size()));
  }
  for (size_t i = 0; i < buffers.size(); ++i) {
    const EngineBufferIpc& buffer = buffers[i];
    if (buffer.ipc_handle.size() != kCudaIpcHandleBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "buffer ", i, ": a CUDA IPC memory handle is ", kCudaIpcHandleBytes,
          " bytes (cudaIpcMemHandle_t); got ", buffer.ipc_handle.size()));
    }
    if (buffer.bytes == 0) {
      return absl::InvalidArgumentError(absl::StrCat("buffer ", i, ": 0 bytes"));
    }
    uint64_t end;
    if (__builtin_add_overflow(buffer.offset_in_allocation, buffer.bytes, &end)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "buffer ", i, ": offset_in_allocation ", buffer.offset_in_allocation, " + ",
          buffer.bytes, " bytes overflows"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckEngineIpcBufferInAllocation(size_t index, const EngineBufferIpc& buffer,
                                              uint64_t allocation_bytes) {
  // CheckEngineIpcBuffers ran first: the sum does not overflow.
  const uint64_t end = buffer.offset_in_allocation + buffer.bytes;
  if (end > allocation_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "buffer ", index, ": offset_in_allocation ", buffer.offset_in_allocation, " + ",
        buffer.bytes, " bytes = ", end, " exceeds its CUDA allocation of ", allocation_bytes,
        " bytes"));
  }
  return absl::OkStatus();
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
