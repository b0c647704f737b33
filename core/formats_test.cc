#include "core/formats.h"

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::StatusIs;

constexpr KvFormats kQ8Q5{KFormat::kQ8_0, VFormat::kQ5_1};
constexpr KvFormats kFp8{KFormat::kFp8, VFormat::kFp8};

TEST(FormatsTest, BlockBytesMatchKvBlkBytes) {
  EXPECT_EQ(KBlockBytes(KFormat::kQ8_0), 34u);
  EXPECT_EQ(KBlockBytes(KFormat::kFp8), 32u);
  EXPECT_EQ(VBlockBytes(VFormat::kQ5_1), 24u);
  EXPECT_EQ(VBlockBytes(VFormat::kQ4_0), 18u);
  EXPECT_EQ(VBlockBytes(VFormat::kFp8), 32u);
}

TEST(FormatsTest, NamesRoundTripThroughParse) {
  for (KFormat format : {KFormat::kQ8_0, KFormat::kFp8}) {
    EXPECT_EQ(*ParseKFormat(KFormatName(format)), format);
  }
  for (VFormat format : {VFormat::kQ5_1, VFormat::kQ4_0, VFormat::kFp8}) {
    EXPECT_EQ(*ParseVFormat(VFormatName(format)), format);
  }
  EXPECT_THAT(ParseKFormat("q4_0"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("q4_0", "q8_0 | fp8")));
  EXPECT_THAT(ParseVFormat("f16"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("f16", "q5_1 | q4_0 | fp8")));
}

TEST(FormatsTest, EmptyEnvironmentIsTheShippedDefault) {
  absl::StatusOr<FormatDefaults> defaults = FormatDefaultsFromEnvironment({});
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  EXPECT_EQ(defaults->ordinary, kQ8Q5);
  EXPECT_EQ(defaults->gemma_global, kFp8);    // gkv default on
  EXPECT_EQ(defaults->gemma_windowed, kFp8);  // wkv on when not spec serving
  // The struct's own defaults agree with the environment's.
  const FormatDefaults plain;
  EXPECT_EQ(plain.ordinary, defaults->ordinary);
  EXPECT_EQ(plain.gemma_global, defaults->gemma_global);
  EXPECT_EQ(plain.gemma_windowed, defaults->gemma_windowed);
}

TEST(FormatsTest, BaseFormatsFollowKvKAndKvV) {
  FormatEnvironment env;
  env.kv_k = "fp8";
  env.kv_v = "q4_0";
  env.gemma_gkv = "0";
  env.gemma_wkv = "0";
  absl::StatusOr<FormatDefaults> defaults = FormatDefaultsFromEnvironment(env);
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  const KvFormats base{KFormat::kFp8, VFormat::kQ4_0};
  EXPECT_EQ(defaults->ordinary, base);
  EXPECT_EQ(defaults->gemma_global, base);
  EXPECT_EQ(defaults->gemma_windowed, base);
}

TEST(FormatsTest, EmptyAndExplicitDefaultValuesMeanTheDefault) {
  for (std::string_view k : {"", "q8_0"}) {
    for (std::string_view v : {"", "q5_1"}) {
      FormatEnvironment env;
      env.kv_k = k;
      env.kv_v = v;
      EXPECT_EQ(FormatDefaultsFromEnvironment(env)->ordinary, kQ8Q5) << k << "/" << v;
    }
  }
}

TEST(FormatsTest, UnsupportedDoorValuesAreRefusedWithTheVariableNamed) {
  FormatEnvironment bad_k;
  bad_k.kv_k = "q4_0";
  EXPECT_THAT(FormatDefaultsFromEnvironment(bad_k),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::Eq("MEMRA_KV_K=q4_0 unsupported (q8_0 | fp8)")));
  FormatEnvironment bad_v;
  bad_v.kv_v = "q8_0";
  EXPECT_THAT(FormatDefaultsFromEnvironment(bad_v),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::Eq("MEMRA_KV_V=q8_0 unsupported (q5_1 | q4_0 | fp8)")));
}

TEST(FormatsTest, KvFp8DoorOnlyOpensOnExactlyOne) {
  for (std::string_view value : {"0", "true", "", "2"}) {
    FormatEnvironment env;
    env.kv_fp8 = value;
    EXPECT_EQ(FormatDefaultsFromEnvironment(env)->ordinary, kQ8Q5) << value;
  }
  FormatEnvironment on;
  on.kv_fp8 = "1";
  on.kv_v = "q4_0";  // the door overrides the base formats for ordinary layers
  absl::StatusOr<FormatDefaults> defaults = FormatDefaultsFromEnvironment(on);
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  EXPECT_EQ(defaults->ordinary, kFp8);
}

TEST(FormatsTest, GemmaGlobalDoorClosesOnlyOnZero) {
  for (std::string_view value : {"1", "", "off"}) {
    FormatEnvironment env;
    env.gemma_gkv = value;
    EXPECT_EQ(FormatDefaultsFromEnvironment(env)->gemma_global, kFp8) << value;
  }
  FormatEnvironment off;
  off.gemma_gkv = "0";
  EXPECT_EQ(FormatDefaultsFromEnvironment(off)->gemma_global, kQ8Q5);
}

TEST(FormatsTest, GemmaWindowedDoorFollowsServingModeUnlessExplicit) {
  FormatEnvironment spec;
  spec.draft = "/models/drafter.gguf";
  EXPECT_EQ(FormatDefaultsFromEnvironment(spec)->gemma_windowed, kQ8Q5);
  EXPECT_EQ(FormatDefaultsFromEnvironment(spec)->gemma_global, kFp8);  // only windowed moves

  FormatEnvironment spec_forced_on = spec;
  spec_forced_on.gemma_wkv = "1";
  EXPECT_EQ(FormatDefaultsFromEnvironment(spec_forced_on)->gemma_windowed, kFp8);

  FormatEnvironment plain_forced_off;
  plain_forced_off.gemma_wkv = "0";
  EXPECT_EQ(FormatDefaultsFromEnvironment(plain_forced_off)->gemma_windowed, kQ8Q5);

  // An empty MEMRA_DRAFT is still set (std::env::var is Ok("")).
  FormatEnvironment empty_draft;
  empty_draft.draft = "";
  EXPECT_EQ(FormatDefaultsFromEnvironment(empty_draft)->gemma_windowed, kQ8Q5);
}

}  // namespace
}  // namespace memra
