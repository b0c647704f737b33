#include "server/host_backend.h"


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
#include <optional>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "core/status_macros.h"
#include "common/errors.h"
#include "common/mapped_region.h"
#include "server/streaming_checksum.h"

namespace memra {
namespace {

constexpr size_t kNameRandomBytes = 16;  // 128 bits: names cannot be guessed or collide
constexpr size_t kMaxPrefixChars = 200;  // "/" + prefix + "-" + 32 hex stays under NAME_MAX
constexpr int kMaxCreateAttempts = 4;    // EEXIST retries (only a broken random source repeats)

absl::StatusOr<std::string> RandomHexSuffix() {
  uint8_t bytes[kNameRandomBytes];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return PosixError("getrandom for an shm object name", errno);
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
  if ((options.mode & ~mode_t{0770}) != 0 || (options.mode & 0600) != 0600) {
    return absl::InvalidArgumentError(
        absl::StrCat("host backend mode must grant the owner rw and others nothing (within 0770 "
                     "and including 0600), got ",
                     absl::StrFormat("%#o", options.mode)));
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

// Owns an shm object's name: unlinks it on destruction, so a half-built arena leaks nothing.
class ShmName {
 public:
  explicit ShmName(std::string name) : name_(std::move(name)) {}
  ShmName(ShmName&& other) noexcept : name_(std::exchange(other.name_, "")) {}
  ShmName& operator=(ShmName&&) = delete;
  ~ShmName() {
    if (!name_.empty()) shm_unlink(name_.c_str());
  }

  const std::string& get() const { return name_; }

 private:
  std::string name_;
};

// One allocation. Releases its mapping (and unlinks its shm name, when exported) on destruction.
// An exported arena owns its descriptor (`fd_`): the daemon keeps a duplicate in the fd store so
// the memory survives a restart (server/restart_state.h).
class HostArena final : public ArenaRecord {
 public:
  HostArena(MappedRegion region, std::optional<ShmName> shm_name, ScopedFd fd,
            std::string export_handle)
      : ArenaRecord(region.data(), region.size(), std::move(export_handle)),
        region_(std::move(region)),
        shm_name_(std::move(shm_name)),
        fd_(std::move(fd)) {}

  absl::StatusOr<int> DuplicateFd() const override {
    if (fd_.get() < 0) return ArenaRecord::DuplicateFd();
    const int copy = fcntl(fd_.get(), F_DUPFD_CLOEXEC, 0);
    if (copy < 0) return PosixError("fcntl(F_DUPFD_CLOEXEC) of a host arena", errno);
    return copy;
  }

 private:
  MappedRegion region_;
  std::optional<ShmName> shm_name_;
  ScopedFd fd_;  // -1 for private arenas
};

}  // namespace

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

absl::StatusOr<std::string> HostBackend::NewObjectName() const {
  ASSIGN_OR_RETURN(std::string suffix, options_.name_suffix_for_testing
                                           ? options_.name_suffix_for_testing()
                                           : RandomHexSuffix());
  return absl::StrCat("/", options_.name_prefix, "-", suffix);
}

absl::StatusOr<std::shared_ptr<ArenaRecord>> HostBackend::CreateSharedArena(uint64_t bytes) const {
  // O_EXCL: never adopt an object someone else created (it could be pre-sized or pre-mapped).
  ScopedFd fd;
  std::optional<ShmName> name;
  for (int attempt = 1; !name.has_value(); ++attempt) {
    ASSIGN_OR_RETURN(std::string candidate, NewObjectName());
    const int raw_fd =
        shm_open(candidate.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, options_.mode);
    const int err = errno;
    if (raw_fd >= 0) {
      fd = ScopedFd(raw_fd);
      name.emplace(std::move(candidate));
    } else if (err != EEXIST || attempt == kMaxCreateAttempts) {
      return PosixError(absl::StrCat("shm_open ", candidate, " (attempt ", attempt, ")"), err);
    }
  }
  const std::string& object = name->get();
  if (options_.group.has_value() &&
      fchown(fd.get(), static_cast<uid_t>(-1), *options_.group) != 0) {
    return PosixError(absl::StrCat("fchown ", object, " to group ", *options_.group), errno);
  }
  // shm_open's mode is filtered by the umask; the configured mode is the contract.
  if (fchmod(fd.get(), options_.mode) != 0) {
    return PosixError(
        absl::StrCat("fchmod ", object, " to ", absl::StrFormat("%#o", options_.mode)), errno);
  }
  // Allocate the pages now: tmpfs would otherwise accept the size and raise SIGBUS on first
  // touch when /dev/shm is full. Fresh pages read as zero.
  if (const int err = posix_fallocate(fd.get(), 0, static_cast<off_t>(bytes)); err != 0) {
    return PosixError(absl::StrCat("posix_fallocate ", bytes, " bytes for ", object), err);
  }
  // Not prefaulted: the engine writes most of a session's pages, and the daemon only its mirrors
  // and restored ranges. (Prefaulting each bulk copy's destination with MADV_POPULATE_WRITE
  // halved the steady-state copy rate into already-mapped pages: bench/README.md.)
  ASSIGN_OR_RETURN(MappedRegion region, MappedRegion::MapShared(fd.get(), bytes, object));
  std::string handle = name->get();
  return std::make_shared<HostArena>(std::move(region), std::move(name), std::move(fd),
                                     std::move(handle));
}

absl::StatusOr<std::shared_ptr<ArenaRecord>> HostBackend::Allocate(uint64_t bytes,
                                                                   ArenaVisibility visibility) {
  if (visibility == ArenaVisibility::kExported) return CreateSharedArena(bytes);
  // Private arenas (prefix-cache storage) are written in full as soon as they exist.
  ASSIGN_OR_RETURN(MappedRegion region, MappedRegion::MapAnonymous(bytes, Prefault::kYes));
  return std::make_shared<HostArena>(std::move(region), std::nullopt, ScopedFd(), "");
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
    // The name (if any) belongs to the dead daemon and was removed at start: nothing to unlink.
    return std::make_shared<HostArena>(std::move(region), std::nullopt, std::move(fd),
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
