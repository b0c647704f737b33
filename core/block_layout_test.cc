#include "core/block_layout.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::memra::testing::IsOk;
using ::memra::testing::IsOkAndHolds;
using ::memra::testing::StatusIs;

constexpr uint64_t kBlocks = 8;
// 16 tokens x 2 heads x 4 dims of fp16 = 256 bytes per K or V block.
constexpr uint64_t kKvBlock = 256;

BlockTensorSpec Tensor(uint32_t layer, BlockTensorRole role, uint64_t offset,
                       uint64_t bytes = kKvBlock, uint32_t group = 0) {
  return BlockTensorSpec{.layer = layer,
                         .role = static_cast<uint32_t>(role),
                         .kv_group = group,
                         .buffer = 0,
                         .offset = offset,
                         .block_stride = bytes,
                         .block_bytes = bytes};
}

// Two layers, K and V each, one tensor after another in one buffer.
BlockPoolSpec TwoLayerPool() {
  BlockPoolSpec spec;
  spec.buffer_bytes = {4 * kBlocks * kKvBlock};
  spec.num_blocks = kBlocks;
  spec.tokens_per_block = 16;
  spec.element = static_cast<uint32_t>(BlockElement::kFp16);
  spec.order = static_cast<uint32_t>(BlockOrder::kNhd);
  spec.num_kv_heads = 2;
  spec.head_dim = 4;
  spec.tp_size = 1;
  spec.model = "test-model@1";
  for (uint32_t i = 0; i < 4; ++i) {
    spec.tensors.push_back(Tensor(i / 2, i % 2 == 0 ? BlockTensorRole::kK : BlockTensorRole::kV,
                                  i * kBlocks * kKvBlock));
  }
  return spec;
}

absl::Status Validate(const BlockPoolSpec& spec) {
  return ValidateBlockPool(spec, BlockPoolLimits{}).status();
}

TEST(BlockLayoutTest, AValidPoolHasOneGroupOfItsTensorsBlockBytes) {
  absl::StatusOr<BlockPoolLayout> layout = ValidateBlockPool(TwoLayerPool(), BlockPoolLimits{});
  ASSERT_THAT(layout, IsOk());
  ASSERT_EQ(layout->groups.size(), 1u);
  EXPECT_EQ(layout->groups[0].block_bytes, 4 * kKvBlock);
  EXPECT_EQ(layout->groups[0].state_bytes, 0u);
  absl::StatusOr<std::vector<PoolRange>> ranges = BlockRanges(*layout, layout->groups[0], 3, false);
  ASSERT_THAT(ranges, IsOk());
  ASSERT_EQ(ranges->size(), 4u);
  EXPECT_EQ((*ranges)[1].offset, kBlocks * kKvBlock + 3 * kKvBlock);  // layer 0 V, block 3
  EXPECT_THAT(BlockRanges(*layout, layout->groups[0], kBlocks, false),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("block id 8 of a pool of 8")));
}

TEST(BlockLayoutTest, TheFingerprintIgnoresOffsetsAndTensorOrderButNotWhatTheBytesMean) {
  BlockPoolSpec a = TwoLayerPool();
  BlockPoolSpec b = a;
  std::swap(b.tensors[0], b.tensors[3]);
  std::swap(b.tensors[0].offset, b.tensors[3].offset);
  BlockPoolSpec c = a;
  c.model = "other-model";
  BlockPoolSpec d = a;
  d.tp_size = 2;
  d.tp_rank = 1;
  BlockPoolSpec e = a;
  e.order = static_cast<uint32_t>(BlockOrder::kHnd);
  auto fingerprint = [](const BlockPoolSpec& spec) {
    return ValidateBlockPool(spec, BlockPoolLimits{}).value().groups[0].fingerprint;
  };
  EXPECT_EQ(fingerprint(a), fingerprint(b));
  EXPECT_NE(fingerprint(a), fingerprint(c));
  EXPECT_NE(fingerprint(a), fingerprint(d));
  EXPECT_NE(fingerprint(a), fingerprint(e));
}

TEST(BlockLayoutTest, HybridGroupsCarryTheirStateBytesApart) {
  BlockPoolSpec spec = TwoLayerPool();
  spec.buffer_bytes.push_back(kBlocks * 100);
  spec.tensors[2].kv_group = 1;
  spec.tensors[3].kv_group = 1;
  BlockTensorSpec state = Tensor(5, BlockTensorRole::kState, 0, 100, 1);
  state.buffer = 1;
  spec.tensors.push_back(state);
  absl::StatusOr<BlockPoolLayout> layout = ValidateBlockPool(spec, BlockPoolLimits{});
  ASSERT_THAT(layout, IsOk());
  ASSERT_EQ(layout->groups.size(), 2u);
  EXPECT_EQ(layout->groups[1].kv_group, 1u);
  EXPECT_EQ(layout->groups[1].state_bytes, 100u);
  EXPECT_NE(layout->groups[0].fingerprint, layout->groups[1].fingerprint);
  EXPECT_THAT(FindBlockGroup(*layout, 7),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("kv_group 7"), HasSubstr("groups 0, 1"))));
}

TEST(BlockLayoutTest, AGroupOfOnlyStateIsRefused) {
  BlockPoolSpec spec = TwoLayerPool();
  spec.tensors.push_back(Tensor(9, BlockTensorRole::kState, 0, 64, 3));
  EXPECT_THAT(Validate(spec), StatusIs(absl::StatusCode::kInvalidArgument,
                                       AllOf(HasSubstr("kv_group 3"), HasSubstr("64 bytes"))));
}

TEST(BlockLayoutTest, EveryRefusalNamesItsNumbers) {
  struct Case {
    std::string name;
    void (*mutate)(BlockPoolSpec&);
    std::vector<std::string> words;
  };
  const std::vector<Case> cases = {
      {"no buffers", [](BlockPoolSpec& s) { s.buffer_bytes.clear(); }, {"0 buffers", "1 to 256"}},
      {"empty buffer", [](BlockPoolSpec& s) { s.buffer_bytes[0] = 0; }, {"buffer 0 is 0 bytes"}},
      {"no blocks", [](BlockPoolSpec& s) { s.num_blocks = 0; }, {"num_blocks 0"}},
      {"no tokens", [](BlockPoolSpec& s) { s.tokens_per_block = 0; }, {"tokens_per_block 0", "1 to 4096"}},
      {"too many tokens", [](BlockPoolSpec& s) { s.tokens_per_block = 4097; },
       {"tokens_per_block 4097", "1 to 4096"}},
      {"no heads", [](BlockPoolSpec& s) { s.num_kv_heads = 0; }, {"num_kv_heads 0", "head_dim 4"}},
      {"order", [](BlockPoolSpec& s) { s.order = 3; }, {"unknown block order 3"}},
      {"element", [](BlockPoolSpec& s) { s.element = 0; }, {"unknown block element type 0"}},
      {"tp", [](BlockPoolSpec& s) { s.tp_rank = 2, s.tp_size = 2; }, {"tp_rank 2", "tp_size 2"}},
      {"model", [](BlockPoolSpec& s) { s.model.clear(); }, {"model identity of 0 bytes"}},
      {"long model", [](BlockPoolSpec& s) { s.model = std::string(257, 'm'); }, {"257 bytes"}},
      {"no tensors", [](BlockPoolSpec& s) { s.tensors.clear(); }, {"0 tensors", "1 to 4096"}},
      {"kind", [](BlockPoolSpec& s) { s.tensors[1].role = 0; }, {"tensor 1", "unknown kind 0"}},
      {"twice", [](BlockPoolSpec& s) { s.tensors[1] = s.tensors[0]; },
       {"tensor 1", "layer 0 kind 1", "listed twice"}},
      {"buffer", [](BlockPoolSpec& s) { s.tensors[2].buffer = 1; }, {"tensor 2", "buffer 1 of 1"}},
      {"kv bytes", [](BlockPoolSpec& s) { s.tensors[0].block_bytes = 200; },
       {"tensor 0", "K/V block of 200 bytes", "is 256"}},
      {"kv rows", [](BlockPoolSpec& s) {
         s.tensors[0].role = static_cast<uint32_t>(BlockTensorRole::kKv);
         s.tensors[0].block_bytes = 250;
       }, {"tensor 0", "KV block of 250 bytes", "16 tokens"}},
      {"overlap", [](BlockPoolSpec& s) { s.tensors[3].block_stride = 255; },
       {"tensor 3", "block_stride 255", "block_bytes 256"}},
      {"outside", [](BlockPoolSpec& s) { s.tensors[3].offset += 1; },
       {"tensor 3", "end at 8193", "holds 8192 bytes"}},
      {"overflow", [](BlockPoolSpec& s) { s.tensors[3].block_stride = uint64_t{1} << 62; },
       {"tensor 3", "an overflow"}},
      {"quantized", [](BlockPoolSpec& s) {
         s.element = static_cast<uint32_t>(BlockElement::kQ8_0);
         s.num_kv_heads = 1;
         s.head_dim = 3;
       }, {"32-element blocks", "48 elements is not a multiple"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    BlockPoolSpec spec = TwoLayerPool();
    c.mutate(spec);
    const absl::Status status = Validate(spec);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    for (const std::string& word : c.words) EXPECT_THAT(status.message(), HasSubstr(word));
  }
}

TEST(BlockLayoutTest, QuantizedElementsCountPer32ElementBlock) {
  EXPECT_THAT(BlockElementBytes(static_cast<uint32_t>(BlockElement::kQ8_0), 64), IsOkAndHolds(68u));
  EXPECT_THAT(BlockElementBytes(static_cast<uint32_t>(BlockElement::kQ5_1), 32), IsOkAndHolds(24u));
  EXPECT_THAT(BlockElementBytes(static_cast<uint32_t>(BlockElement::kQ4_0), 96), IsOkAndHolds(54u));
  EXPECT_THAT(BlockElementBytes(static_cast<uint32_t>(BlockElement::kBf16), 10), IsOkAndHolds(20u));
  EXPECT_THAT(BlockElementBytes(static_cast<uint32_t>(BlockElement::kFp32), uint64_t{1} << 63),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overflows")));
}

TEST(BlockLayoutTest, EngineHashKeysAreScopedAndBounded) {
  const PlanFingerprint a{1};
  const PlanFingerprint b{2};
  const std::vector<std::string> hashes = {"h0", "h1"};
  std::vector<BlockKey> in_a = EngineHashKeys(a, hashes).value();
  std::vector<BlockKey> in_b = EngineHashKeys(b, hashes).value();
  EXPECT_NE(in_a[0], in_a[1]);
  EXPECT_NE(in_a[0], in_b[0]);
  EXPECT_NE(BoundaryStateKey(in_a[0]), in_a[0]);
  EXPECT_THAT(EngineHashKeys(a, std::vector<std::string>{"x", ""}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("block hash 1 is 0 bytes")));
  EXPECT_THAT(EngineHashKeys(a, std::vector<std::string>{std::string(65, 'x')}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("65 bytes; 1 to 64")));
}

TEST(BlockLayoutTest, BlockIdsAreCheckedAgainstKeysAndPool) {
  const std::vector<uint32_t> ids = {3, 1};
  EXPECT_THAT(CheckBlockIds(ids, 2, false, 0, 8, true), IsOkAndHolds(0u));
  EXPECT_THAT(CheckBlockIds(ids, 3, true, 1, 8, true), IsOkAndHolds(1u));
  EXPECT_THAT(CheckBlockIds(ids, 3, false, 0, 8, true),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2 block ids for 3 blocks")));
  EXPECT_THAT(CheckBlockIds(ids, 2, false, 1, 8, true),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("skip_blocks 1 with block hashes")));
  EXPECT_THAT(CheckBlockIds(ids, 1, true, 2, 8, true),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("skip_blocks 2 exceeds the 1")));
  EXPECT_THAT(CheckBlockIds(ids, 2, false, 0, 3, true),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("block id 3 (index 0) of a pool of 3 blocks")));
  const std::vector<uint32_t> twice = {2, 2};
  EXPECT_THAT(CheckBlockIds(twice, 2, false, 0, 8, true),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("block id 2 (index 1) appears twice")));
  EXPECT_THAT(CheckBlockIds(twice, 2, false, 0, 8, false), IsOkAndHolds(0u));
}

}  // namespace
}  // namespace memra
