#include "server/device/arena_table.h"

#include <cstdint>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;

TEST(ArenaRecordTest, AWholeArenaIsItsBytes) {
  const ArenaRecord record(nullptr, 100, "");
  EXPECT_THAT(record.CheckRange("Read", ArenaId{3}, 0, 100), IsOk());
  EXPECT_THAT(record.CheckRange("Read", ArenaId{3}, 50, 51),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("Read", "offset 50 + 51 bytes = 101", "arena 3 of 100")));
}

// A cuda engine pool: regions at [0, 100) and [1000, 1100) of a 1100-byte span; the gap between
// them is someone else's memory.
TEST(SegmentedArenaRecordTest, OnlyRangesInsideOneSegmentAreMemory) {
  const SegmentedArenaRecord record(nullptr, 1100, {{.offset = 1000, .bytes = 100},
                                                    {.offset = 0, .bytes = 100}});
  EXPECT_THAT(record.CheckRange("Copy", ArenaId{7}, 0, 100), IsOk());
  EXPECT_THAT(record.CheckRange("Copy", ArenaId{7}, 1050, 50), IsOk());
  EXPECT_THAT(record.CheckRange("Copy", ArenaId{7}, 500, 10),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("offset 500 + 10 bytes of arena 7",
                                  "not inside one of its 2 engine buffers")));
  EXPECT_THAT(record.CheckRange("Copy", ArenaId{7}, 99, 2),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("offset 99 + 2 bytes")));
  EXPECT_THAT(record.CheckRange("Copy", ArenaId{7}, 1050, 51),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("exceeds arena 7")));
}

}  // namespace
}  // namespace memra
