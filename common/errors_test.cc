#include "common/errors.h"

#include <cerrno>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::StatusIs;

TEST(PosixErrorTest, CodeSaysWhatTheCallerDoesNext) {
  EXPECT_THAT(PosixError("mmap 4096 bytes of /x", ENOMEM),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstrs("mmap 4096 bytes of /x: ", "(errno 12)")));
  EXPECT_THAT(
      PosixError("posix_fallocate", ENOSPC),
      StatusIs(absl::StatusCode::kResourceExhausted, HasSubstrs("posix_fallocate", "(errno 28)")));
  EXPECT_THAT(PosixError("shm_open /x", EACCES), StatusIs(absl::StatusCode::kPermissionDenied,
                                                          HasSubstrs("shm_open /x", "(errno 13)")));
  EXPECT_THAT(PosixError("fchown /x to group 5", EPERM),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstrs("group 5", "(errno 1)")));
  EXPECT_THAT(PosixError("shm_open /gone", ENOENT),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstrs("shm_open /gone", "No such file or directory", "(errno 2)")));
  EXPECT_THAT(PosixError("fstat /x", EIO),
              StatusIs(absl::StatusCode::kInternal, HasSubstrs("fstat /x", "(errno 5)")));
  EXPECT_THAT(PosixError("op", 99999),
              StatusIs(absl::StatusCode::kInternal, HasSubstrs("unknown error", "(errno 99999)")));
}

}  // namespace
}  // namespace memra
