#include "server/instance.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <memory>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/errors.h"

namespace memra {
namespace {

// FNV-1a: stable across builds and machines (std::hash is not).
uint32_t Fnv1a(absl::string_view text) {
  uint32_t hash = 2166136261u;
  for (unsigned char c : text) {
    hash ^= c;
    hash *= 16777619u;
  }
  return hash;
}

bool IsObjectSuffix(absl::string_view suffix) {
  if (suffix.size() != 32) return false;
  for (char c : suffix) {
    if (!absl::ascii_isdigit(c) && !(c >= 'a' && c <= 'f')) return false;
  }
  return true;
}

}  // namespace

std::string ShmPrefix(const DaemonConfig& config) {
  return absl::StrFormat("memra-kv-gpu%d-%08x", config.device, Fnv1a(config.SocketPath()));
}

absl::StatusOr<InstanceLock> InstanceLock::Acquire(const std::string& socket_path) {
  const std::string path = socket_path + ".lock";
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return PosixError(absl::StrCat("open ", path), errno);
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    close(fd);
    if (err == EWOULDBLOCK) {
      return absl::FailedPreconditionError(
          absl::StrCat("another memra-kvd holds ", path, " (it serves ", socket_path, ")"));
    }
    return PosixError(absl::StrCat("flock ", path), err);
  }
  return InstanceLock(fd);
}

InstanceLock::~InstanceLock() {
  if (fd_ >= 0) close(fd_);  // releases the lock; the file stays (unlinking it would race)
}

absl::StatusOr<size_t> RemoveStaleShmObjects(absl::string_view prefix, const std::string& shm_dir) {
  std::unique_ptr<DIR, int (*)(DIR*)> dir(opendir(shm_dir.c_str()), closedir);
  if (dir == nullptr) return PosixError(absl::StrCat("opendir ", shm_dir), errno);
  const std::string lead = absl::StrCat(prefix, "-");
  size_t removed = 0;
  while (dirent* entry = readdir(dir.get())) {
    const absl::string_view name = entry->d_name;
    if (!absl::StartsWith(name, lead) || !IsObjectSuffix(name.substr(lead.size()))) continue;
    const std::string path = absl::StrCat(shm_dir, "/", name);
    if (unlink(path.c_str()) != 0 && errno != ENOENT) {
      return PosixError(absl::StrCat("unlink ", path), errno);
    }
    ++removed;
  }
  return removed;
}

}  // namespace memra
