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

// The element formats are blocks of one element: docs/rules.md#formats's per-row table.
TEST(FormatsTest, ElementFormatsAreOneElementPerValue) {
  const struct {
    KFormat k;
    VFormat v;
    uint32_t bytes;
    bool scaled;
  } cases[] = {{KFormat::kBf16, VFormat::kBf16, 2, false},
               {KFormat::kF16, VFormat::kF16, 2, false},
               {KFormat::kF32, VFormat::kF32, 4, false},
               {KFormat::kFp8E4m3, VFormat::kFp8E4m3, 1, true},
               {KFormat::kFp8E5m2, VFormat::kFp8E5m2, 1, true}};
  for (const auto& c : cases) {
    for (const FormatLayout& layout : {LayoutOf(c.k), LayoutOf(c.v)}) {
      EXPECT_FALSE(layout.IsBlock()) << layout.name;
      EXPECT_EQ(layout.block_elems, 1u) << layout.name;
      EXPECT_EQ(layout.block_bytes, c.bytes) << layout.name;
      EXPECT_EQ(layout.scaled, c.scaled) << layout.name;
      ASSERT_TRUE(layout.element.has_value()) << layout.name;
      EXPECT_EQ(LayoutOf(*layout.element).block_bytes, c.bytes);
    }
  }
  for (KFormat k : {KFormat::kQ8_0, KFormat::kFp8}) {
    EXPECT_TRUE(LayoutOf(k).IsBlock());
    EXPECT_FALSE(LayoutOf(k).element.has_value());
  }
  // 128 elements: a Llama head.
  EXPECT_EQ(*FormatBytes(LayoutOf(KFormat::kBf16), 128, "head"), 256u);
  EXPECT_EQ(*FormatBytes(LayoutOf(KFormat::kQ8_0), 128, "head"), 136u);
  EXPECT_EQ(*FormatBytes(LayoutOf(VFormat::kQ5_1), 128, "head"), 96u);
  EXPECT_EQ(*FormatBytes(LayoutOf(VFormat::kFp8E5m2), 80, "head"), 80u);
  EXPECT_THAT(FormatBytes(LayoutOf(VFormat::kQ4_0), 80, "layer 3 V head"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("layer 3 V head: format q4_0 stores 32-element blocks, and 80 "
                                  "elements are not whole blocks")));
}

// The doors keep the reference's meaning: element formats are not door values.
TEST(FormatsTest, DoorsRefuseElementFormats) {
  FormatEnvironment k_env;
  k_env.kv_k = "bf16";
  EXPECT_THAT(FormatDefaultsFromEnvironment(k_env),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("MEMRA_KV_K=bf16 unsupported (q8_0 | fp8)")));
  FormatEnvironment v_env;
  v_env.kv_v = "fp8_e4m3";
  EXPECT_THAT(FormatDefaultsFromEnvironment(v_env),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("MEMRA_KV_V=fp8_e4m3 unsupported (q5_1 | q4_0 | fp8)")));
}

TEST(FormatsTest, NamesRoundTripThroughParse) {
  for (uint8_t value = 0; value <= static_cast<uint8_t>(kLastKFormat); ++value) {
    const KFormat format = static_cast<KFormat>(value);
    EXPECT_EQ(*ParseKFormat(KFormatName(format)), format);
  }
  for (uint8_t value = 0; value <= static_cast<uint8_t>(kLastVFormat); ++value) {
    const VFormat format = static_cast<VFormat>(value);
    EXPECT_EQ(*ParseVFormat(VFormatName(format)), format);
  }
  for (uint8_t value = 0; value <= static_cast<uint8_t>(kLastElementFormat); ++value) {
    const ElementFormat format = static_cast<ElementFormat>(value);
    EXPECT_EQ(*ParseElementFormat(ElementFormatName(format)), format);
    // K and V name an element format by the same word, one element per value.
    EXPECT_EQ(KFormatName(KFormatOf(format)), ElementFormatName(format));
    EXPECT_EQ(VFormatName(VFormatOf(format)), ElementFormatName(format));
  }
  EXPECT_THAT(ParseKFormat("q4_0"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("K format \"q4_0\" unsupported (q8_0 | fp8 | bf16 | f16 | f32 | "
                                  "fp8_e4m3 | fp8_e5m2)")));
  EXPECT_THAT(ParseVFormat("q8_0"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("V format \"q8_0\" unsupported (q5_1 | q4_0 | fp8 | bf16 | f16 "
                                  "| f32 | fp8_e4m3 | fp8_e5m2)")));
  EXPECT_THAT(ParseElementFormat("fp16"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("element format \"fp16\" unsupported (f32 | bf16 | f16 | "
                                  "fp8_e4m3 | fp8_e5m2)")));
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
