#include "server/instance.h"

#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;
using ::testing::HasSubstr;

std::string TempDir() {
  char path[] = "/tmp/memra-instance-XXXXXX";
  EXPECT_NE(mkdtemp(path), nullptr);
  return path;
}

void Touch(const std::string& path) {
  const int fd = open(path.c_str(), O_CREAT | O_WRONLY, 0600);
  ASSERT_GE(fd, 0) << path;
  close(fd);
}

bool Exists(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

TEST(ShmPrefixTest, DependsOnDeviceAndSocketOnly) {
  DaemonConfig config;
  config.sockets.socket_path = "/run/memra-kv/gpu{device}.sock";
  config.device = 3;
  const std::string prefix = ShmPrefix(config);
  EXPECT_THAT(prefix, ::testing::MatchesRegex("memra-kv-gpu3-[0-9a-f]{8}"));
  config.admission.budget_bytes = 1;
  EXPECT_EQ(ShmPrefix(config), prefix);
  config.sockets.socket_path = "/tmp/other.sock";
  EXPECT_NE(ShmPrefix(config), prefix);
}

TEST(InstanceLockTest, SecondHolderIsRefusedUntilTheFirstGoes) {
  const std::string dir = TempDir();
  const std::string socket = dir + "/kvd.sock";
  {
    absl::StatusOr<InstanceLock> first = InstanceLock::Acquire(socket);
    ASSERT_THAT(first, IsOk());
    EXPECT_THAT(InstanceLock::Acquire(socket),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("another memra-kvd")));
  }
  EXPECT_THAT(InstanceLock::Acquire(socket), IsOk());
  unlink((socket + ".lock").c_str());
  rmdir(dir.c_str());
}

TEST(RemoveStaleShmObjectsTest, RemovesOnlyThisPrefixsObjectNames) {
  const std::string dir = TempDir();
  const std::string hex = "0123456789abcdef0123456789abcdef";
  const std::string stale1 = dir + "/memra-kv-gpu0-aaaaaaaa-" + hex;
  const std::string stale2 = dir + "/memra-kv-gpu0-aaaaaaaa-" + std::string(32, 'f');
  const std::string other_prefix = dir + "/memra-kv-gpu0-bbbbbbbb-" + hex;
  const std::string longer_prefix = dir + "/memra-kv-gpu0-aaaaaaaax-" + hex;
  const std::string not_hex = dir + "/memra-kv-gpu0-aaaaaaaa-" + std::string(32, 'z');
  const std::string too_short = dir + "/memra-kv-gpu0-aaaaaaaa-abc";
  for (const std::string& path :
       {stale1, stale2, other_prefix, longer_prefix, not_hex, too_short}) {
    Touch(path);
  }
  absl::StatusOr<size_t> removed = RemoveStaleShmObjects("memra-kv-gpu0-aaaaaaaa", dir);
  ASSERT_THAT(removed, IsOk());
  EXPECT_EQ(*removed, 2u);
  EXPECT_FALSE(Exists(stale1));
  EXPECT_FALSE(Exists(stale2));
  for (const std::string& path : {other_prefix, longer_prefix, not_hex, too_short}) {
    EXPECT_TRUE(Exists(path)) << path;
    unlink(path.c_str());
  }
  rmdir(dir.c_str());
  EXPECT_THAT(RemoveStaleShmObjects("x", dir + "/gone"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("opendir")));
}

}  // namespace
}  // namespace memra
