#include "server/base/unix_socket.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;
using ::testing::HasSubstr;

// A socket bound at `path`; listening when `listen_too` (a live daemon), else bound and closed
// (the stale file a killed daemon leaves).
int BindAt(const std::string& path, bool listen_too) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  EXPECT_GE(fd, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  if (listen_too) {
    EXPECT_EQ(listen(fd, 1), 0);
  }
  return fd;
}

class UnixSocketTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/memra-sock-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
    path_ = dir_ + "/kvd.sock";
  }
  void TearDown() override {
    unlink(path_.c_str());
    rmdir(dir_.c_str());
  }
  std::string dir_;
  std::string path_;
};

TEST_F(UnixSocketTest, AbsentPathIsFree) { EXPECT_THAT(PrepareSocketPath(path_), IsOk()); }

TEST_F(UnixSocketTest, MissingDirectoryIsRefused) {
  EXPECT_THAT(PrepareSocketPath(dir_ + "/nope/kvd.sock"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("the socket's directory " + dir_ + "/nope is not there")));
}

TEST_F(UnixSocketTest, StaleSocketIsRemoved) {
  close(BindAt(path_, /*listen_too=*/false));
  struct stat st;
  ASSERT_EQ(lstat(path_.c_str(), &st), 0);
  EXPECT_THAT(PrepareSocketPath(path_), IsOk());
  EXPECT_NE(lstat(path_.c_str(), &st), 0);
}

TEST_F(UnixSocketTest, LiveSocketIsRefusedAndKept) {
  const int fd = BindAt(path_, /*listen_too=*/true);
  EXPECT_THAT(PrepareSocketPath(path_),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("another daemon is serving on " + path_)));
  struct stat st;
  EXPECT_EQ(lstat(path_.c_str(), &st), 0);
  close(fd);
}

TEST_F(UnixSocketTest, RegularFileIsRefused) {
  const int fd = open(path_.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0);
  close(fd);
  EXPECT_THAT(PrepareSocketPath(path_),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("is not a socket")));
}

TEST_F(UnixSocketTest, PermissionsAreAppliedAndAnUnknownGroupRefused) {
  close(BindAt(path_, /*listen_too=*/false));
  ASSERT_THAT(ApplySocketPermissions(path_, "", 0640), IsOk());
  struct stat st;
  ASSERT_EQ(lstat(path_.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0640u);
  EXPECT_THAT(ApplySocketPermissions(path_, "memra-no-such-group", 0600),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("socket_group memra-no-such-group does not exist")));
}

}  // namespace
}  // namespace memra
