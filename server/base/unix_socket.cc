#include "server/base/unix_socket.h"

#include <grp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/errors.h"
#include "core/status_macros.h"
#include "spdlog/spdlog.h"

namespace memra {

absl::Status PrepareSocketPath(const std::string& path) {
  struct stat st;
  const std::string directory = path.substr(0, path.find_last_of('/'));
  if (!directory.empty() && stat(directory.c_str(), &st) != 0) {
    return absl::FailedPreconditionError(absl::StrCat("the socket's directory ", directory,
                                                      " is not there (", strerror(errno),
                                                      "); create it or pass --socket_path"));
  }
  if (lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return PosixError(absl::StrCat("stat ", path), errno);
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("socket_path ", path, " exists and is not a socket"));
  }
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (path.size() >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("socket_path ", path, " is ", path.size(),
                                                   " bytes; the limit is ",
                                                   sizeof(address.sun_path) - 1));
  }
  std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return PosixError("socket", errno);
  const int connected = connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
  const int connect_errno = errno;
  close(fd);
  if (connected == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("another daemon is serving on ", path, "; refusing to take its socket"));
  }
  if (connect_errno != ECONNREFUSED) {
    return PosixError(absl::StrCat("probing the existing socket ", path), connect_errno);
  }
  spdlog::warn("removing stale socket {}", path);
  if (unlink(path.c_str()) != 0) return PosixError(absl::StrCat("unlink ", path), errno);
  return absl::OkStatus();
}

absl::Status ApplySocketPermissions(const std::string& path, const std::string& group,
                                    uint32_t mode) {
  if (!group.empty()) {
    struct group* entry = getgrnam(group.c_str());
    if (entry == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("socket_group ", group, " does not exist"));
    }
    if (chown(path.c_str(), static_cast<uid_t>(-1), entry->gr_gid) != 0) {
      return PosixError(absl::StrCat("chown ", path, " to group ", group), errno);
    }
  }
  if (chmod(path.c_str(), static_cast<mode_t>(mode)) != 0) {
    return PosixError(absl::StrCat("chmod ", path), errno);
  }
  return absl::OkStatus();
}

absl::StatusOr<ScopedFd> ListenOnUnixSocket(const std::string& path, const std::string& group,
                                            uint32_t mode, const std::string& what) {
  RETURN_IF_ERROR(PrepareSocketPath(path));
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (path.size() >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(what, " ", path, " is ", path.size(),
                                                   " bytes; the limit is ",
                                                   sizeof(address.sun_path) - 1));
  }
  std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
  ScopedFd listener(socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (listener.get() < 0) return PosixError(absl::StrCat("socket for the ", what), errno);
  if (bind(listener.get(), reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    return PosixError(absl::StrCat("bind ", path), errno);
  }
  if (listen(listener.get(), SOMAXCONN) != 0) {
    const int err = errno;
    unlink(path.c_str());
    return PosixError(absl::StrCat("listen ", path), err);
  }
  if (absl::Status permissions = ApplySocketPermissions(path, group, mode); !permissions.ok()) {
    unlink(path.c_str());
    return permissions;
  }
  return listener;
}

}  // namespace memra
