#include "server/edge/model_config_bounds.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;

std::string Nested(size_t depth) {
  return std::string(depth, '[') + std::string(depth, ']');
}

TEST(ModelConfigBoundsTest, ARealConfigPasses) {
  EXPECT_THAT(CheckModelConfigBounds(R"({"architectures": ["Gemma3ForConditionalGeneration"],
      "text_config": {"rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
      "vision_config": {"hidden_size": 1152}})"),
              IsOk());
}

TEST(ModelConfigBoundsTest, SizeIsBoundedAtTheLimit) {
  std::string text(kMaxModelConfigBytes, ' ');
  EXPECT_THAT(CheckModelConfigBounds(text), IsOk());
  text.push_back(' ');
  EXPECT_THAT(CheckModelConfigBounds(text),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstrs("config.json is 1048577 bytes", "limit is 1048576",
                                  "kMaxModelConfigBytes")));
}

TEST(ModelConfigBoundsTest, DepthIsBoundedAtTheLimit) {
  EXPECT_THAT(CheckModelConfigBounds(Nested(kMaxModelConfigDepth)), IsOk());
  EXPECT_THAT(CheckModelConfigBounds(Nested(kMaxModelConfigDepth + 1)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("nests 33 deep at byte 32", "limit is 32",
                                  "kMaxModelConfigDepth")));
  // Objects count like arrays; siblings do not add up.
  EXPECT_THAT(CheckModelConfigBounds(absl::StrCat("{\"a\":", Nested(31), ",\"b\":", Nested(31),
                                                  "}")),
              IsOk());
  EXPECT_THAT(CheckModelConfigBounds(absl::StrCat("{\"a\":", Nested(32), "}")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("nests 33 deep")));
}

TEST(ModelConfigBoundsTest, BracketsInStringsDoNotCount) {
  const std::string brackets(1000, '[');
  EXPECT_THAT(CheckModelConfigBounds(absl::StrCat(R"({"name": ")", brackets, R"("})")), IsOk());
  // An escaped quote does not end the string.
  EXPECT_THAT(CheckModelConfigBounds(absl::StrCat(R"({"name": "\")", brackets, R"("})")), IsOk());
  // An escaped backslash does.
  EXPECT_THAT(CheckModelConfigBounds(absl::StrCat(R"({"name": "\\", "x": )", brackets, "}")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("nests 33 deep")));
}

TEST(ModelConfigBoundsTest, StrayClosersDoNotUnderflow) {
  EXPECT_THAT(CheckModelConfigBounds(absl::StrCat("]]]]", Nested(kMaxModelConfigDepth))), IsOk());
  EXPECT_THAT(CheckModelConfigBounds(absl::StrCat("]]]]", Nested(kMaxModelConfigDepth + 1))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("nests 33 deep")));
}

}  // namespace
}  // namespace memra
