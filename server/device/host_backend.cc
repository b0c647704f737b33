#include "server/device/host_backend.h"


#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <memory>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/checked_math.h"
#include "core/status_macros.h"
#include "common/errors.h"
#include "common/mapped_region.h"
#include "server/base/streaming_checksum.h"

namespace memra {
namespace {

constexpr size_t kHandleRandomBytes = 16;  // 128 bits: handles cannot be guessed or collide
constexpr size_t kMaxPrefixChars = 200;    // memfd names are at most 249 bytes

absl::StatusOr<std::string> RandomHexHandle() {
  uint8_t bytes[kHandleRandomBytes];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return PosixError("getrandom for an arena handle", errno);
    }
    got += static_cast<size_t>(n);
  }
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

absl::Status ValidateOptions(const HostBackendOptions& options) {
  if (options.total_bytes == 0 ||
      options.total_bytes > static_cast<uint64_t>(std::numeric_limits<off_t>::max())) {
    return absl::InvalidArgumentError(absl::StrCat("host backend total_bytes must be in [1, ",
                                                   std::numeric_limits<off_t>::max(), "], got ",
                                                   options.total_bytes));
  }
  const std::string& prefix = options.name_prefix;
  const bool chars_ok = std::all_of(prefix.begin(), prefix.end(), [](char c) {
    return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
  });
  if (prefix.empty() || prefix.size() > kMaxPrefixChars || !chars_ok) {
    return absl::InvalidArgumentError(
        absl::StrCat("host backend name_prefix must be 1..", kMaxPrefixChars,
                     " characters of [A-Za-z0-9._-], got \"", absl::CHexEscape(prefix), "\""));
  }
  return absl::OkStatus();
}

// One allocation. Exported arenas keep their memfd open for the arena's life: it is what
// DuplicateFd() hands out (and what a restart keeps). Retire() (FreeArena) punches the memfd's
// pages out; destruction releases the daemon's mapping and descriptor (a kept arena's pages stay
// with the fd store's copy: a crashed daemon runs neither).
class HostArena final : public ArenaRecord {
 public:
  HostArena(MappedRegion region, ScopedFd memfd, std::string handle)
      : ArenaRecord(region.data(), region.size(), std::move(handle)),
        region_(std::move(region)),
        memfd_(std::move(memfd)) {}

  absl::StatusOr<int> DuplicateFd() const override {
    if (memfd_.get() < 0) return ArenaRecord::DuplicateFd();
    const int fd = fcntl(memfd_.get(), F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return PosixError("duplicating an arena's memfd", errno);
    return fd;
  }

  // An engine that keeps its mapping (or descriptor) of a freed arena would otherwise keep the
  // pages the daemon allocated (and its memory cgroup is charged for) outside the admission
  // budget: 10 release/create rounds held 447 MiB against a 64 MiB budget (issue 31 item 8).
  // KEEP_SIZE: the memfd stays its sealed size, so a stale mapping reads zeros, never SIGBUS.
  absl::Status Retire() override {
    if (memfd_.get() < 0) return absl::OkStatus();  // private: the munmap frees it
    if (fallocate(memfd_.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0,
                  static_cast<off_t>(bytes())) != 0) {
      return PosixError(absl::StrCat("punching the ", bytes(), " bytes of a freed arena's memfd"),
                        errno);
    }
    return absl::OkStatus();
  }

 private:
  MappedRegion region_;
  ScopedFd memfd_;  // -1 for a private arena
};

// An engine's pool buffers mapped back to back (page-aligned) into one reserved range of the
// daemon's address space; unmapped whole with the record.
class EngineBuffersArena final : public ArenaRecord {
 public:
  EngineBuffersArena(uint8_t* data, uint64_t bytes) : ArenaRecord(data, bytes, "") {}
  ~EngineBuffersArena() override { munmap(data(), bytes()); }
};

}  // namespace

absl::StatusOr<MappedEngineBuffers> HostBackend::MapEngineBuffers(
    absl::Span<const EngineBufferFd> buffers) {
  if (buffers.empty()) {
    return absl::InvalidArgumentError("host MapEngineBuffers: no buffers to map");
  }
  // Each buffer's mapping starts at its page-aligned file offset; the arena holds them all.
  struct Placement {
    uint64_t file_offset = 0;  // page-aligned
    uint64_t length = 0;       // page-rounded
    uint64_t at = 0;           // where the mapping starts in the arena
  };
  std::vector<Placement> placements;
  MappedEngineBuffers mapped;
  uint64_t total = 0;
  for (size_t i = 0; i < buffers.size(); ++i) {
    const EngineBufferFd& buffer = buffers[i];
    Placement place;
    place.file_offset = buffer.offset / page_size_ * page_size_;
    const uint64_t lead = buffer.offset - place.file_offset;
    ASSIGN_OR_RETURN(uint64_t span, CheckedAdd(lead, buffer.bytes, "engine buffer mapping"));
    ASSIGN_OR_RETURN(place.length, CheckedAlignUp(span, page_size_, "engine buffer mapping"));
    place.at = total;
    mapped.base.push_back(total + lead);
    ASSIGN_OR_RETURN(total, CheckedAdd(total, place.length, "engine buffer mappings"));
    placements.push_back(place);
  }
  // One reservation, then each buffer MAP_FIXED over its part: a failure unmaps the whole.
  void* reserved = mmap(nullptr, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                        -1, 0);
  if (reserved == MAP_FAILED) {
    return PosixError(absl::StrCat("reserving ", total, " bytes for engine buffers"), errno);
  }
  auto base = static_cast<uint8_t*>(reserved);
  for (size_t i = 0; i < buffers.size(); ++i) {
    const Placement& place = placements[i];
    void* at = mmap(base + place.at, place.length, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                    buffers[i].fd, static_cast<off_t>(place.file_offset));
    if (at == MAP_FAILED) {
      const int err = errno;
      munmap(reserved, total);
      return PosixError(absl::StrCat("mapping engine buffer ", i, " (", buffers[i].bytes,
                                     " bytes at offset ", buffers[i].offset, ")"),
                        err);
    }
  }
  mapped.arena = FileEngineMemory(std::make_shared<EngineBuffersArena>(base, total));
  return mapped;
}

absl::StatusOr<std::unique_ptr<HostBackend>> HostBackend::Create(HostBackendOptions options) {
  RETURN_IF_ERROR(ValidateOptions(options));
  const long page_size = sysconf(_SC_PAGESIZE);
  if (page_size <= 0) return PosixError("sysconf(_SC_PAGESIZE)", errno);
  return std::unique_ptr<HostBackend>(
      new HostBackend(std::move(options), static_cast<uint64_t>(page_size)));
}

HostBackend::HostBackend(HostBackendOptions options, uint64_t page_size)
    : CheckedArenaBackend("host", options.total_bytes),
      options_(std::move(options)),
      page_size_(page_size) {}

DeviceInfo HostBackend::Info() {
  return DeviceInfo{.name = "host shared memory",
                    .uuid = "",
                    .total_bytes = options_.total_bytes,
                    .free_bytes = options_.total_bytes - AllocatedBytes()};
}

absl::StatusOr<std::string> HostBackend::NewExportHandle() const {
  return options_.handle_for_testing ? options_.handle_for_testing() : RandomHexHandle();
}

absl::StatusOr<std::shared_ptr<ArenaRecord>> HostBackend::CreateSharedArena(uint64_t bytes) const {
  ASSIGN_OR_RETURN(std::string handle, NewExportHandle());
  // No name anywhere: only a descriptor reaches this memory, and the daemon hands one only to
  // the engine that owns the session (server/edge/arena_handoff.h).
  // Allocated now (tmpfs would otherwise accept the size and raise SIGBUS on first touch when
  // memory is short) and sealed at its size: an engine holding the descriptor cannot ftruncate
  // it (a shrink would turn the daemon's next touch past the new end into SIGBUS) nor grow it
  // past its charge.
  ASSIGN_OR_RETURN(ScopedFd fd, CreateSealedMemfd(options_.name_prefix.c_str(), bytes));
  // Not prefaulted: the engine writes most of a session's pages, and the daemon only its mirrors
  // and restored ranges. (Prefaulting each bulk copy's destination with MADV_POPULATE_WRITE
  // halved the steady-state copy rate into already-mapped pages: bench/README.md.)
  ASSIGN_OR_RETURN(MappedRegion region, MappedRegion::MapShared(fd.get(), bytes, "arena memfd"));
  return std::make_shared<HostArena>(std::move(region), std::move(fd), std::move(handle));
}

absl::StatusOr<std::shared_ptr<ArenaRecord>> HostBackend::Allocate(uint64_t bytes,
                                                                   ArenaVisibility visibility) {
  if (visibility == ArenaVisibility::kExported) return CreateSharedArena(bytes);
  // Private arenas (prefix-cache storage) are written in full as soon as they exist.
  ASSIGN_OR_RETURN(MappedRegion region, MappedRegion::MapAnonymous(bytes, Prefault::kYes));
  return std::make_shared<HostArena>(std::move(region), ScopedFd(), "");
}

absl::StatusOr<ArenaId> HostBackend::AdoptArenaFd(int raw_fd, uint64_t bytes,
                                                  std::string export_handle) {
  ScopedFd fd(raw_fd);
  if (export_handle.empty()) {
    return absl::InvalidArgumentError("host AdoptArenaFd: an exported arena needs its handle");
  }
  struct stat info {};
  if (fstat(fd.get(), &info) != 0) return PosixError("fstat of a kept host arena", errno);
  if (info.st_size < 0 || static_cast<uint64_t>(info.st_size) < bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("host AdoptArenaFd: the kept descriptor holds ", info.st_size,
                     " bytes but the arena was ", bytes));
  }
  return FileAdopted(bytes, [&](uint64_t size) -> absl::StatusOr<std::shared_ptr<ArenaRecord>> {
    ASSIGN_OR_RETURN(MappedRegion region,
                     MappedRegion::MapShared(fd.get(), size, "a kept host arena"));
    // The same handle the previous daemon handed out: the engines' mapping caches and the
    // handoff socket know the arena by it.
    return std::make_shared<HostArena>(std::move(region), std::move(fd),
                                       std::move(export_handle));
  });
}

absl::Status HostBackend::Fill(uint8_t* at, uint8_t value, uint64_t bytes) {
  std::memset(at, value, bytes);
  return absl::OkStatus();
}

absl::Status HostBackend::Move(uint8_t* to, const uint8_t* from, uint64_t bytes) {
  std::memmove(to, from, bytes);
  return absl::OkStatus();
}

absl::Status HostBackend::Upload(absl::string_view, uint8_t* to, absl::Span<const uint8_t> data) {
  std::memcpy(to, data.data(), data.size());
  return absl::OkStatus();
}

absl::Status HostBackend::Download(absl::string_view, const uint8_t* from,
                                   absl::Span<uint8_t> out) {
  std::memcpy(out.data(), from, out.size());
  return absl::OkStatus();
}

absl::Status HostBackend::StoreI32s(uint8_t* base, absl::Span<const I32Write> writes) {
  for (const I32Write& write : writes) {
    std::memcpy(base + write.offset, &write.value, sizeof(write.value));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> HostBackend::CopyHashed(uint8_t* dst, const uint8_t* src,
                                                  absl::Span<const CopyRange> ranges) {
  // Hashed and copied in cache-sized slices: the copy reads what the hash just pulled in.
  constexpr uint64_t kSliceBytes = 64 * 1024;
  ASSIGN_OR_RETURN(StreamingChecksum checksum, StreamingChecksum::Create());
  for (const CopyRange& range : ranges) {
    for (uint64_t done = 0; done < range.bytes;) {
      const uint64_t n = std::min(range.bytes - done, kSliceBytes);
      const uint8_t* from = src + range.src_offset + done;
      checksum.Update(from, n);
      std::memcpy(dst + range.dst_offset + done, from, n);  // distinct arenas never overlap
      done += n;
    }
  }
  return checksum.Digest();
}

absl::Status HostBackend::WaitForEngineEvent(absl::string_view ipc_event_handle) {
  if (ipc_event_handle.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "host backend: a ", ipc_event_handle.size(),
      "-byte interprocess event handle was sent, but host arenas are ordered by the RPC order "
      "alone; send no event (CUDA events are for the cuda backend)"));
}

}  // namespace memra
