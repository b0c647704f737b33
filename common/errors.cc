#include "common/errors.h"

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace memra {

absl::Status PosixError(std::string_view context, int err) {
  // strerror() may share a static buffer between threads; the glibc description table is constant.
  const char* description = strerrordesc_np(err);
  const std::string message =
      absl::StrCat(absl::string_view(context.data(), context.size()), ": ",
                   description != nullptr ? description : "unknown error", " (errno ", err, ")");
  switch (err) {
    case ENOMEM:
    case ENOSPC:
    case EMFILE:  // the process's descriptors (RLIMIT_NOFILE)
    case ENFILE:  // the system's
    case ETOOMANYREFS:  // descriptors in flight (SCM_RIGHTS)
      return absl::ResourceExhaustedError(message);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(message);
    case ENOENT:
      return absl::NotFoundError(message);
    default:
      return absl::InternalError(message);
  }
}

}  // namespace memra
