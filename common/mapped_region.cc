#include "common/mapped_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "common/errors.h"

namespace memra {
namespace {

absl::StatusOr<uint8_t*> Mmap(int fd, uint64_t bytes, int flags, absl::string_view what) {
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, flags, fd, 0);
  if (data == MAP_FAILED) {
    return PosixError(absl::StrCat("mmap ", bytes, " bytes of ", what), errno);
  }
  return static_cast<uint8_t*>(data);
}

}  // namespace

absl::StatusOr<ScopedFd> CreateSealedMemfd(const char* name, uint64_t bytes) {
  ScopedFd fd(memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (fd.get() < 0) return PosixError(absl::StrCat("memfd_create ", name), errno);
  // Fresh pages read as zero.
  if (const int err = posix_fallocate(fd.get(), 0, static_cast<off_t>(bytes)); err != 0) {
    return PosixError(absl::StrCat("posix_fallocate ", bytes, " bytes for memfd ", name), err);
  }
  if (fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return PosixError(absl::StrCat("sealing memfd ", name, " (F_SEAL_SHRINK | F_SEAL_GROW)"),
                      errno);
  }
  return fd;
}

ScopedFd& ScopedFd::operator=(ScopedFd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) close(fd_);
    fd_ = other.release();
  }
  return *this;
}

ScopedFd::~ScopedFd() {
  if (fd_ >= 0) close(fd_);
}

int ScopedFd::release() { return std::exchange(fd_, -1); }

absl::StatusOr<MappedRegion> MappedRegion::MapShared(int fd, uint64_t bytes,
                                                     absl::string_view what) {
  ASSIGN_OR_RETURN(uint8_t * data, Mmap(fd, bytes, MAP_SHARED, what));
  return MappedRegion(data, bytes);
}

absl::StatusOr<MappedRegion> MappedRegion::MapAnonymous(uint64_t bytes, Prefault prefault) {
  ASSIGN_OR_RETURN(uint8_t * data,
                   Mmap(-1, bytes, MAP_PRIVATE | MAP_ANONYMOUS, "anonymous memory"));
  if (prefault == Prefault::kYes) {
    // Transparent huge pages where the system allows them (THP "madvise" mode): 512x fewer
    // pages to fault in and to map.
    (void)madvise(data, bytes, MADV_HUGEPAGE);
    // Best effort (Linux 5.14+; an older kernel refuses and pages fault on first touch).
    (void)madvise(data, bytes, MADV_POPULATE_WRITE);
  }
  return MappedRegion(data, bytes);
}

MappedRegion::MappedRegion(MappedRegion&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

MappedRegion& MappedRegion::operator=(MappedRegion&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

MappedRegion::~MappedRegion() { Reset(); }

void MappedRegion::Reset() {
  // munmap of a range we mapped can only fail on a corrupted (data_, size_): nothing to recover.
  if (data_ != nullptr) munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

}  // namespace memra
