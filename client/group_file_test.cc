#include "client/group_file.h"

#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr absl::string_view kTp2Pp2 = R"(# two stages of two ranks
group llama-70b
tp 2
pp 2   # stages
stage_layers 40,40
rank 0 /run/memra-kv/gpu0.sock /run/memra-kv/gpu0.admin.sock
rank 1	/run/memra-kv/gpu1.sock
rank 3 /run/memra-kv/gpu3.sock
rank 2 /run/memra-kv/gpu2.sock
)";

absl::Status ParseError(absl::string_view text) {
  return ParseGroupFile(text, "g.txt").status();
}

TEST(GroupFileTest, ParsesEveryKeyAndOrdersRanks) {
  absl::StatusOr<GroupFile> group = ParseGroupFile(kTp2Pp2, "g.txt");
  ASSERT_TRUE(group.ok()) << group.status();
  EXPECT_EQ(group->name, "llama-70b");
  EXPECT_EQ(group->shape.tp, 2u);
  EXPECT_EQ(group->shape.pp, 2u);
  EXPECT_THAT(group->shape.stage_layers, ElementsAre(40, 40));
  EXPECT_THAT(group->ranks,
              ElementsAre(GroupRankEndpoint{0, "/run/memra-kv/gpu0.sock",
                                            "/run/memra-kv/gpu0.admin.sock"},
                          GroupRankEndpoint{1, "/run/memra-kv/gpu1.sock", ""},
                          GroupRankEndpoint{2, "/run/memra-kv/gpu2.sock", ""},
                          GroupRankEndpoint{3, "/run/memra-kv/gpu3.sock", ""}));
}

TEST(GroupFileTest, StageLayersAreOptional) {
  absl::StatusOr<GroupFile> group =
      ParseGroupFile("group g\ntp 1\npp 1\nrank 0 /s0\n", "g.txt");
  ASSERT_TRUE(group.ok()) << group.status();
  EXPECT_TRUE(group->shape.stage_layers.empty());
  EXPECT_EQ(group->ranks.size(), 1u);
}

TEST(GroupFileTest, RefusesMissingKeys) {
  EXPECT_THAT(ParseError("tp 1\npp 1\nrank 0 /s0\n"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("group file g.txt: no `group` line")));
  EXPECT_THAT(ParseError("group g\npp 1\nrank 0 /s0\n"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no `tp` line")));
  EXPECT_THAT(ParseError("group g\ntp 1\nrank 0 /s0\n"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no `pp` line")));
}

TEST(GroupFileTest, RefusesBadLinesNamingTheLine) {
  EXPECT_THAT(ParseError("group g\ntp 2\nsize 4\n"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("group file g.txt line 3: unknown key \"size\"")));
  EXPECT_THAT(ParseError("group g\ntp 2\ntp 4\n"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("line 3: `tp` given twice (line 2 and here)")));
  EXPECT_THAT(ParseError("group g\ntp -2\n"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("line 2: tp \"-2\" is not a whole number of at most 4294967295")));
  EXPECT_THAT(ParseError("group g\npp 4294967296\n"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("pp \"4294967296\"")));
  EXPECT_THAT(ParseError("group g h\n"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("line 1: `group` takes one name, got 2 value(s)")));
  EXPECT_THAT(ParseError("group g/h\n"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("line 1: group name \"g/h\" is not 1..64 of [A-Za-z0-9._-]")));
  EXPECT_THAT(ParseError("group g\nrank 0\n"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("line 2: `rank` takes a rank, a socket and optionally an admin "
                                 "socket, got 1 value(s)")));
  EXPECT_THAT(ParseError("group g\nstage_layers 3,,4\n"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("line 2: stage_layers entry 1 \"\" is not a whole number")));
  EXPECT_THAT(ParseError("group g\nstage_layers 3,0\n"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("line 2: stage_layers entry 1 is 0")));
}

TEST(GroupFileTest, RefusesGroupSizesOutOfRange) {
  EXPECT_THAT(ParseError("group g\ntp 0\npp 1\n"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("line 2: tp 0 x pp 1 is not a group of 1..1024 ranks")));
  EXPECT_THAT(ParseError("group g\npp 64\ntp 64\n"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("line 3: tp 64 x pp 64 is not a group of 1..1024 ranks")));
  EXPECT_THAT(ParseError("group g\ntp 2\npp 2\nstage_layers 10,10,10\n"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("line 4: stage_layers lists 3 stages for pp 2")));
}

TEST(GroupFileTest, RefusesRanksOutsideTwiceOrMissing) {
  EXPECT_THAT(ParseError("group g\ntp 2\npp 2\nrank 4 /s4\n"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("line 4: rank 4 is outside tp 2 x pp 2 = 4 ranks")));
  EXPECT_THAT(ParseError("group g\ntp 2\npp 1\nrank 1 /s1\nrank 1 /s2\n"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("line 5: rank 1 given twice (line 4 and here)")));
  EXPECT_THAT(ParseError("group g\ntp 4\npp 1\nrank 1 /s1\n"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("group file g.txt: 3 of tp 4 x pp 1 = 4 ranks have no `rank` "
                                 "line: 0, 2, 3")));
}

TEST(GroupFileTest, RefusesBadAndSharedSockets) {
  EXPECT_THAT(ParseError("group g\ntp 1\npp 1\nrank 0 run/gpu0.sock\n"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("line 4: rank 0's socket \"run/gpu0.sock\" is not an absolute "
                                 "path")));
  const std::string long_path = "/" + std::string(107, 'a');
  EXPECT_THAT(ParseError(absl::StrCat("group g\ntp 1\npp 1\nrank 0 /s ", long_path, "\n")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("line 4: rank 0's admin socket is 108 bytes; a Unix socket "
                                 "path holds at most 107")));
  EXPECT_THAT(ParseError("group g\ntp 2\npp 1\nrank 0 /s0\nrank 1 /s0\n"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("line 5: socket /s0 of rank 1 is rank 0's too (line 4): one "
                                 "daemon serves one rank")));
  EXPECT_THAT(ParseError("group g\ntp 2\npp 1\nrank 0 /s0 /a\nrank 1 /s1 /a\n"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("line 5: socket /a of rank 1 is rank 0's too")));
}

TEST(GroupFileTest, RefusesAnOversizedText) {
  const std::string text(kMaxGroupFileBytes + 1, '#');
  EXPECT_THAT(ParseError(text), StatusIs(absl::StatusCode::kInvalidArgument,
                                         HasSubstr("1048577 bytes is over the limit of 1048576")));
}

TEST(GroupFileTest, ReadsAFileAndNamesAMissingOne) {
  const std::string path = absl::StrCat(::testing::TempDir(), "/group-", getpid(), ".txt");
  FILE* file = std::fopen(path.c_str(), "wb");
  ASSERT_NE(file, nullptr);
  ASSERT_EQ(std::fwrite(kTp2Pp2.data(), 1, kTp2Pp2.size(), file), kTp2Pp2.size());
  ASSERT_EQ(std::fclose(file), 0);
  absl::StatusOr<GroupFile> group = ReadGroupFile(path);
  ASSERT_TRUE(group.ok()) << group.status();
  EXPECT_EQ(group->ranks.size(), 4u);
  std::remove(path.c_str());
  EXPECT_THAT(ReadGroupFile(path),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr(absl::StrCat("group file ", path))));
}

TEST(GroupFromSocketsTest, AppliesTheFileRules) {
  GroupShape shape;
  shape.tp = 2;
  shape.pp = 1;
  absl::StatusOr<GroupFile> group = GroupFromSockets("cli", shape, {"/a", "/b"}, "--socket");
  ASSERT_TRUE(group.ok()) << group.status();
  EXPECT_THAT(group->ranks, ElementsAre(GroupRankEndpoint{0, "/a", ""},
                                        GroupRankEndpoint{1, "/b", ""}));
  EXPECT_THAT(GroupFromSockets("cli", shape, {"/a"}, "--socket").status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--socket: 1 sockets for tp 2 x pp 1 = 2 ranks")));
  EXPECT_THAT(GroupFromSockets("cli", shape, {"/a", "/a"}, "--socket").status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--socket entry 1: socket /a of rank 1 is rank 0's too")));
}

}  // namespace
}  // namespace memra
