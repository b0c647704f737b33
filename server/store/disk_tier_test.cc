#include "server/store/disk_tier.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;

std::string FreshDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", name);
  std::system(absl::StrCat("rm -rf '", dir, "'").c_str());
  return dir;
}

std::vector<uint8_t> Bytes(uint64_t n, uint8_t seed) {
  std::vector<uint8_t> out(n);
  for (uint64_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(i * 7 + seed + (i >> 9));
  return out;
}

TEST(DiskTierTest, WritesAndReadsBackBitExactlyThroughSmallRequests) {
  DiskTierOptions options;
  options.dir = FreshDir("roundtrip");
  options.budget_bytes = 1 << 20;
  options.queue_depth = 3;
  options.request_bytes = 4096;  // 100,003 bytes: 25 requests, 3 in flight, a partial last one
  auto tier = DiskTier::Create(options);
  ASSERT_THAT(tier.status(), IsOk());
  const std::vector<uint8_t> written = Bytes(100003, 5);
  ASSERT_THAT((*tier)->Write(7, written), IsOk());
  struct stat st;
  ASSERT_EQ(stat((*tier)->PathOf(7).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), written.size());
  ASSERT_EQ(stat(options.dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  std::vector<uint8_t> read(written.size());
  ASSERT_THAT((*tier)->Read(7, absl::MakeSpan(read)), IsOk());
  EXPECT_EQ(read, written);
  EXPECT_EQ((*tier)->Stats().stored_bytes, written.size());
  EXPECT_THAT((*tier)->Write(7, written), StatusIs(absl::StatusCode::kAlreadyExists, ::testing::_));
  ASSERT_THAT((*tier)->Remove(7), IsOk());
  EXPECT_NE(access((*tier)->PathOf(7).c_str(), F_OK), 0);
  EXPECT_EQ((*tier)->Stats().stored_bytes, 0u);
  EXPECT_THAT((*tier)->Read(7, absl::MakeSpan(read)), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  EXPECT_THAT((*tier)->Remove(7), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
}

TEST(DiskTierTest, BudgetRefusesAWriteAndKeepsNothing) {
  DiskTierOptions options;
  options.dir = FreshDir("budget");
  options.budget_bytes = 10000;
  auto tier = DiskTier::Create(options);
  ASSERT_THAT(tier.status(), IsOk());
  ASSERT_THAT((*tier)->Write(1, Bytes(6000, 1)), IsOk());
  EXPECT_THAT((*tier)->Write(2, Bytes(4001, 2)),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstrs("4001 bytes", "4000 bytes left", "10000-byte budget",
                                   "6000 held")));
  EXPECT_NE(access((*tier)->PathOf(2).c_str(), F_OK), 0);
  EXPECT_THAT((*tier)->Write(2, Bytes(4000, 2)), IsOk());
  EXPECT_EQ((*tier)->Stats().files, 2u);
}

TEST(DiskTierTest, ATruncatedFileIsDataLoss) {
  DiskTierOptions options;
  options.dir = FreshDir("truncated");
  options.budget_bytes = 1 << 20;
  auto tier = DiskTier::Create(options);
  ASSERT_THAT(tier.status(), IsOk());
  ASSERT_THAT((*tier)->Write(3, Bytes(5000, 3)), IsOk());
  ASSERT_EQ(truncate((*tier)->PathOf(3).c_str(), 4000), 0);
  std::vector<uint8_t> read(5000);
  EXPECT_THAT((*tier)->Read(3, absl::MakeSpan(read)),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstrs("holds 4000 bytes", "5000")));
}

TEST(DiskTierTest, StalePiecesAreRemovedAtStartAndFilesAtDestruction) {
  const std::string dir = FreshDir("stale");
  ASSERT_EQ(mkdir(dir.c_str(), 0700), 0);
  std::ofstream(dir + "/12.piece") << "left by a previous run";
  std::ofstream(dir + "/notes.txt") << "not ours";
  DiskTierOptions options;
  options.dir = dir;
  options.budget_bytes = 1 << 20;
  std::string path;
  {
    auto tier = DiskTier::Create(options);
    ASSERT_THAT(tier.status(), IsOk());
    EXPECT_EQ((*tier)->Stats().removed_at_start, 1u);
    EXPECT_NE(access((dir + "/12.piece").c_str(), F_OK), 0);
    EXPECT_EQ(access((dir + "/notes.txt").c_str(), F_OK), 0);
    ASSERT_THAT((*tier)->Write(4, Bytes(100, 4)), IsOk());
    path = (*tier)->PathOf(4);
  }
  EXPECT_NE(access(path.c_str(), F_OK), 0);
}

TEST(DiskTierTest, RefusesBadDirectoriesAndOptions) {
  DiskTierOptions options;
  options.budget_bytes = 1 << 20;
  options.dir = "relative/dir";
  EXPECT_THAT(DiskTier::Create(options).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("relative/dir", "not an absolute path")));
  options.dir = FreshDir("file");
  std::ofstream(options.dir) << "a file";
  EXPECT_THAT(DiskTier::Create(options).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstrs("not a directory")));
  options.dir = FreshDir("open");
  ASSERT_EQ(mkdir(options.dir.c_str(), 0700), 0);
  ASSERT_EQ(chmod(options.dir.c_str(), 0777), 0);
  EXPECT_THAT(DiskTier::Create(options).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("mode 0777", "not writable by group or others")));
  options.dir = FreshDir("missing-parent") + "/child";
  EXPECT_THAT(DiskTier::Create(options).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs("mkdir", "child")));
  options.dir = FreshDir("zero");
  options.budget_bytes = 0;
  EXPECT_THAT(DiskTier::Create(options).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("budget (0 bytes)")));
  options.budget_bytes = 1 << 20;
  options.queue_depth = 257;
  EXPECT_THAT(DiskTier::Create(options).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("(257)", "1 to 256")));
}

TEST(DiskTierTest, ABudgetBeyondTheFreeSpaceIsRefused) {
  DiskTierOptions options;
  options.dir = FreshDir("nospace");
  options.budget_bytes = uint64_t{1} << 62;  // 4 EiB: no test machine has that free
  EXPECT_THAT(DiskTier::Create(options).status(),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstrs("prefix_disk_bytes is 4611686018427387904 bytes",
                                   "bytes free")));
}

}  // namespace
}  // namespace memra
