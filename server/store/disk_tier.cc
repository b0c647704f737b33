#include "server/store/disk_tier.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string_view>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/checked_math.h"
#include "core/status_macros.h"
#include "spdlog/spdlog.h"

namespace memra {
namespace {

constexpr char kSuffix[] = ".piece";
constexpr uint32_t kMaxQueueDepth = 256;

absl::Status ErrnoStatus(int error, absl::string_view what) {
  return absl::ErrnoToStatus(error, absl::StrCat("disk tier: ", what));
}

// Removes every "*.piece" regular file directly under `dir` (a previous run's); returns how many.
absl::StatusOr<uint64_t> RemoveStalePieces(const std::string& dir) {
  DIR* listing = opendir(dir.c_str());
  if (listing == nullptr) return ErrnoStatus(errno, absl::StrCat("opendir ", dir));
  uint64_t removed = 0;
  while (dirent* entry = readdir(listing)) {
    const absl::string_view name = entry->d_name;
    if (!absl::EndsWith(name, kSuffix)) continue;
    const std::string path = absl::StrCat(dir, "/", name);
    struct stat st;
    if (lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    if (unlink(path.c_str()) == 0) ++removed;
  }
  closedir(listing);
  return removed;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DiskTier>> DiskTier::Create(const DiskTierOptions& options) {
  if (options.dir.empty() || options.dir.front() != '/') {
    return absl::InvalidArgumentError(absl::StrCat(
        "disk tier: prefix_disk_dir \"", options.dir, "\" is not an absolute path"));
  }
  if (options.budget_bytes == 0 || options.request_bytes == 0 || options.queue_depth == 0 ||
      options.queue_depth > kMaxQueueDepth) {
    return absl::InvalidArgumentError(absl::StrCat(
        "disk tier: budget (", options.budget_bytes, " bytes) and request size (",
        options.request_bytes, " bytes) must be at least 1, queue depth (", options.queue_depth,
        ") from 1 to ", kMaxQueueDepth));
  }
  if (mkdir(options.dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return ErrnoStatus(errno, absl::StrCat("mkdir ", options.dir));
  }
  struct stat st;
  if (lstat(options.dir.c_str(), &st) != 0) {
    return ErrnoStatus(errno, absl::StrCat("lstat ", options.dir));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "disk tier: ", options.dir, " is not a directory (a symlink is refused too)"));
  }
  if (st.st_uid != geteuid() || (st.st_mode & 022) != 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "disk tier: %s is owned by uid %d with mode %04o; it must be owned by this daemon's uid "
        "%d and not writable by group or others",
        options.dir, st.st_uid, st.st_mode & 07777, geteuid()));
  }
  struct statvfs fs;
  if (statvfs(options.dir.c_str(), &fs) != 0) {
    return ErrnoStatus(errno, absl::StrCat("statvfs ", options.dir));
  }
  ASSIGN_OR_RETURN(uint64_t free_bytes,
                   CheckedMul(fs.f_bavail, fs.f_frsize, "disk tier free bytes"));
  ASSIGN_OR_RETURN(uint64_t removed, RemoveStalePieces(options.dir));
  if (removed > 0) {
    spdlog::info("disk tier: removed {} piece files a previous run left in {}", removed,
                 options.dir);
    if (statvfs(options.dir.c_str(), &fs) == 0) free_bytes = fs.f_bavail * fs.f_frsize;
  }
  if (free_bytes < options.budget_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "disk tier: prefix_disk_bytes is ", options.budget_bytes, " bytes but ", options.dir,
        " has ", free_bytes, " bytes free"));
  }
  std::unique_ptr<DiskTier> tier(new DiskTier(options, removed));
  {
    absl::MutexLock lock(&tier->ring_mu_);
    const int error = io_uring_queue_init(options.queue_depth, &tier->ring_, 0);
    if (error < 0) return ErrnoStatus(-error, "io_uring_queue_init");
    tier->ring_ready_ = true;
  }
  return tier;
}

DiskTier::DiskTier(const DiskTierOptions& options, uint64_t removed_at_start)
    : options_(options), removed_at_start_(removed_at_start) {}

DiskTier::~DiskTier() {
  absl::MutexLock ring_lock(&ring_mu_);
  absl::MutexLock lock(&mu_);
  for (const auto& [handle, bytes] : files_) unlink(PathOf(handle).c_str());
  if (ring_ready_) io_uring_queue_exit(&ring_);
}

std::string DiskTier::PathOf(uint64_t handle) const {
  return absl::StrCat(options_.dir, "/", handle, kSuffix);
}

uint64_t DiskTier::stored_bytes() const {
  absl::MutexLock lock(&mu_);
  return stored_bytes_;
}

absl::Status DiskTier::Transfer(int fd, bool write, uint8_t* data, uint64_t bytes,
                                const std::string& path) {
  // Requests in flight, by slot (the slot is the request's user data).
  struct Request {
    uint64_t offset = 0;
    uint64_t bytes = 0;
    bool busy = false;
  };
  std::vector<Request> slots(options_.queue_depth);
  std::vector<std::pair<uint64_t, uint64_t>> todo;  // (offset, bytes) not yet submitted
  for (uint64_t at = 0; at < bytes; at += options_.request_bytes) {
    todo.push_back({at, std::min(options_.request_bytes, bytes - at)});
  }
  std::reverse(todo.begin(), todo.end());  // taken from the back, lowest offset first
  uint32_t in_flight = 0;
  absl::Status failure = absl::OkStatus();
  while (in_flight > 0 || (failure.ok() && !todo.empty())) {
    // Fill every free slot (nothing new once a request failed: only drain).
    uint32_t queued = 0;
    for (uint32_t slot = 0; failure.ok() && slot < slots.size() && !todo.empty(); ++slot) {
      if (slots[slot].busy) continue;
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (sqe == nullptr) break;
      const auto [offset, length] = todo.back();
      todo.pop_back();
      slots[slot] = {offset, length, true};
      if (write) {
        io_uring_prep_write(sqe, fd, data + offset, static_cast<unsigned>(length), offset);
      } else {
        io_uring_prep_read(sqe, fd, data + offset, static_cast<unsigned>(length), offset);
      }
      io_uring_sqe_set_data(sqe, reinterpret_cast<void*>(static_cast<uintptr_t>(slot)));
      ++queued;
    }
    in_flight += queued;
    // Submits everything queued (a short submit leaves the rest for the next call) and waits.
    const int submitted = io_uring_submit_and_wait(&ring_, 1);
    if (submitted < 0 && submitted != -EINTR && submitted != -EAGAIN) {
      // The ring is unusable while requests may still own `data`: returning would let the
      // kernel write into freed memory later.
      spdlog::critical("disk tier: io_uring_submit_and_wait failed: {}",
                       std::strerror(-submitted));
      std::abort();
    }
    io_uring_cqe* cqe = nullptr;
    if (io_uring_peek_cqe(&ring_, &cqe) != 0 || cqe == nullptr) continue;
    const uint64_t slot = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(
        io_uring_cqe_get_data(cqe)));
    const int result = cqe->res;
    io_uring_cqe_seen(&ring_, cqe);
    Request request = slots[slot];
    slots[slot].busy = false;
    --in_flight;
    if (!failure.ok()) continue;
    if (result < 0) {
      failure = -result == ENOSPC
                    ? absl::ResourceExhaustedError(absl::StrCat(
                          "disk tier: the filesystem of ", path, " is full (ENOSPC) writing ",
                          bytes, " bytes"))
                    : ErrnoStatus(-result, absl::StrCat(write ? "write " : "read ", path,
                                                        " at offset ", request.offset));
    } else if (result == 0) {
      failure = absl::DataLossError(absl::StrCat(
          "disk tier: ", path, " ends at offset ", request.offset, "; ", bytes,
          " bytes were written to it"));
    } else if (static_cast<uint64_t>(result) < request.bytes) {
      todo.push_back({request.offset + result, request.bytes - result});  // short: the rest
    }
  }
  return failure;
}

absl::Status DiskTier::Write(uint64_t handle, absl::Span<const uint8_t> bytes) {
  const std::string path = PathOf(handle);
  {
    absl::MutexLock lock(&mu_);
    if (files_.contains(handle)) {
      return absl::AlreadyExistsError(absl::StrCat("disk tier: ", path, " already exists"));
    }
    if (bytes.size() > options_.budget_bytes - stored_bytes_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "disk tier: storing ", bytes.size(), " bytes needs more than the ",
          options_.budget_bytes - stored_bytes_, " bytes left of its ", options_.budget_bytes,
          "-byte budget (", stored_bytes_, " held)"));
    }
    files_[handle] = bytes.size();  // reserved: a concurrent write sees it
    stored_bytes_ += bytes.size();
  }
  auto unreserve = [&] {
    absl::MutexLock lock(&mu_);
    files_.erase(handle);
    stored_bytes_ -= bytes.size();
  };
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    const int error = errno;
    unreserve();
    if (error == ENOSPC) {
      return absl::ResourceExhaustedError(
          absl::StrCat("disk tier: the filesystem of ", path, " is full (ENOSPC)"));
    }
    return ErrnoStatus(error, absl::StrCat("create ", path));
  }
  absl::Status written;
  {
    absl::MutexLock ring_lock(&ring_mu_);
    written = Transfer(fd, /*write=*/true, const_cast<uint8_t*>(bytes.data()), bytes.size(), path);
  }
  close(fd);
  if (!written.ok()) {
    unlink(path.c_str());
    unreserve();
    return written;
  }
  absl::MutexLock lock(&mu_);
  ++writes_;
  return absl::OkStatus();
}

absl::Status DiskTier::Read(uint64_t handle, absl::Span<uint8_t> out) {
  const std::string path = PathOf(handle);
  {
    absl::MutexLock lock(&mu_);
    auto it = files_.find(handle);
    if (it == files_.end()) {
      return absl::NotFoundError(absl::StrCat("disk tier: no file for stored piece ", handle));
    }
    if (it->second != out.size()) {
      return absl::InvalidArgumentError(absl::StrCat("disk tier: ", path, " holds ", it->second,
                                                     " bytes; the read asks for ", out.size()));
    }
  }
  const int fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    const int error = errno;
    if (error == ENOENT) {
      return absl::DataLossError(absl::StrCat("disk tier: ", path, " is gone"));
    }
    return ErrnoStatus(error, absl::StrCat("open ", path));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) != out.size()) {
    close(fd);
    return absl::DataLossError(absl::StrCat("disk tier: ", path, " holds ", st.st_size,
                                            " bytes; ", out.size(), " were written to it"));
  }
  absl::Status read;
  {
    absl::MutexLock ring_lock(&ring_mu_);
    read = Transfer(fd, /*write=*/false, out.data(), out.size(), path);
  }
  close(fd);
  RETURN_IF_ERROR(read);
  absl::MutexLock lock(&mu_);
  ++reads_;
  return absl::OkStatus();
}

absl::Status DiskTier::Remove(uint64_t handle) {
  absl::MutexLock lock(&mu_);
  auto it = files_.find(handle);
  if (it == files_.end()) {
    return absl::NotFoundError(absl::StrCat("disk tier: no file for stored piece ", handle));
  }
  stored_bytes_ -= it->second;
  files_.erase(it);
  if (unlink(PathOf(handle).c_str()) != 0 && errno != ENOENT) {
    spdlog::warn("disk tier: unlink {}: {}", PathOf(handle), std::strerror(errno));
  }
  return absl::OkStatus();
}

DiskTierStats DiskTier::Stats() const {
  absl::MutexLock lock(&mu_);
  DiskTierStats stats;
  stats.files = files_.size();
  stats.stored_bytes = stored_bytes_;
  stats.budget_bytes = options_.budget_bytes;
  stats.writes = writes_;
  stats.reads = reads_;
  stats.removed_at_start = removed_at_start_;
  return stats;
}

}  // namespace memra
