#ifndef MEMRA_CORE_BLOCK_LAYOUT_H_
#define MEMRA_CORE_BLOCK_LAYOUT_H_

// The rules of an engine's own paged KV pool as the block store serves it
// (proto/memra/kv/v1/block_store.proto, docs/block-store.md): which registrations are valid,
// what one stored block of a KV group is (its tensors' block bytes back to back, in (layer,
// kind) order, so two engines that list their tensors differently store the same bytes), the
// layout fingerprint that namespaces the keys, and the keys themselves. Pure: the daemon maps
// the memory and moves the bytes.
//
// Invariants of a BlockPoolLayout that ValidateBlockPool returned: every block b < num_blocks
// of every tensor lies inside its buffer (offset + b * block_stride + block_bytes <= buffer
// bytes, no overflow); blocks of one tensor never overlap (block_stride >= block_bytes); every
// group has at least one non-STATE tensor (block_bytes > 0); groups ascend by kv_group.

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/prefix_index.h"

namespace memra {

// The wire's enum numbers (block_store.proto); 0 and unknown numbers are refused.
enum class BlockElement : uint32_t {
  kBf16 = 1,
  kFp16 = 2,
  kFp32 = 3,
  kFp8E4M3 = 4,
  kFp8E5M2 = 5,
  kInt8 = 6,
  kQ8_0 = 7,
  kQ5_1 = 8,
  kQ4_0 = 9,
};
enum class BlockOrder : uint32_t { kNhd = 1, kHnd = 2 };
enum class BlockTensorRole : uint32_t { kK = 1, kV = 2, kKv = 3, kState = 4 };

struct BlockTensorSpec {
  uint32_t layer = 0;
  uint32_t role = 0;  // BlockTensorRole's number as the engine sent it
  uint32_t kv_group = 0;
  uint32_t buffer = 0;
  uint64_t offset = 0;
  uint64_t block_stride = 0;
  uint64_t block_bytes = 0;
};

// A registration as the engine described it (the wire's numbers, not yet trusted).
struct BlockPoolSpec {
  std::vector<uint64_t> buffer_bytes;
  uint64_t num_blocks = 0;
  uint32_t tokens_per_block = 0;
  uint32_t element = 0;
  uint32_t order = 0;
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  uint32_t tp_rank = 0;
  uint32_t tp_size = 0;  // 0 or 1: unsharded
  std::string model;
  std::vector<BlockTensorSpec> tensors;
};

struct BlockPoolLimits {
  // Buffers of one registration, each a mapping: per-layer K and V of the largest models fit.
  size_t max_buffers = 256;
  size_t max_tensors = 4096;
  size_t max_model_bytes = 256;
  uint64_t max_num_blocks = uint64_t{1} << 32;  // block ids are u32 on the wire
  // A stored block's STORED event carries its token ids: this bounds them per block.
  uint32_t max_tokens_per_block = 4096;
};

// One contiguous range of one block (or boundary state) in the engine's pool.
struct PoolRange {
  uint32_t buffer = 0;
  uint64_t offset = 0;  // bytes into the buffer
  uint64_t bytes = 0;
};

struct BlockGroupLayout {
  uint32_t kv_group = 0;
  PlanFingerprint fingerprint{};  // the layout fingerprint (before the cache scope)
  uint64_t block_bytes = 0;       // sum of the group's non-STATE tensors' block_bytes
  uint64_t state_bytes = 0;       // sum of its STATE tensors' block_bytes (0: none)
  std::vector<BlockTensorSpec> block_tensors;  // non-STATE, by (layer, role)
  std::vector<BlockTensorSpec> state_tensors;  // STATE, by (layer, role)
};

struct BlockPoolLayout {
  uint64_t num_blocks = 0;
  uint32_t tokens_per_block = 0;
  std::vector<BlockGroupLayout> groups;  // ascending kv_group
};

// Bytes of `elements` elements of `element`: quantized formats per whole 32-element block
// (Q8_0 34, Q5_1 24, Q4_0 18). INVALID_ARGUMENT for an unknown element type, a quantized count
// that is not a multiple of 32, or overflow.
absl::StatusOr<uint64_t> BlockElementBytes(uint32_t element, uint64_t elements);

// Every rule of the class comment and block_store.proto; INVALID_ARGUMENT naming the field,
// the tensor index and the numbers. Nothing is trusted before this returns.
absl::StatusOr<BlockPoolLayout> ValidateBlockPool(const BlockPoolSpec& spec,
                                                  const BlockPoolLimits& limits);

// The group `kv_group` of `layout`; INVALID_ARGUMENT naming the groups there are.
absl::StatusOr<const BlockGroupLayout*> FindBlockGroup(const BlockPoolLayout& layout,
                                                       uint32_t kv_group);

// Where block `block_id` of `group` lies in the pool: its tensors' ranges in stored order
// (`state`: the STATE tensors' slot `block_id` instead). INVALID_ARGUMENT for block_id >=
// num_blocks. The ranges are inside their buffers (ValidateBlockPool's invariant).
absl::StatusOr<std::vector<PoolRange>> BlockRanges(const BlockPoolLayout& layout,
                                                   const BlockGroupLayout& group,
                                                   uint64_t block_id, bool state);

// Keys (block_store.proto "Keys"). `scoped_layout` is the layout fingerprint in the engine's
// cache scope. An engine hash is 1..kMaxEngineHashBytes bytes.
inline constexpr size_t kMaxEngineHashBytes = 64;
inline constexpr std::string_view kEngineBlockKeyDomain = "memra-kv/engine-block/v1";
// SHA-256(kEngineBlockKeyDomain || scoped_layout || u32 LE len || hash) for each hash;
// INVALID_ARGUMENT naming the index and length of an empty or too long one.
absl::StatusOr<std::vector<BlockKey>> EngineHashKeys(const PlanFingerprint& scoped_layout,
                                                     absl::Span<const std::string> hashes);
// The key a block's boundary state (STATE tensors) is stored under: a different domain, so a
// state is never read as a block.
BlockKey BoundaryStateKey(const BlockKey& block);
// The fingerprint state entries are stored under (their bytes differ from the blocks').
PlanFingerprint BoundaryStateFingerprint(const PlanFingerprint& scoped_layout);

// The block ids of a StoreBlocks / LoadBlocks call against `key_count` keys: with hashes,
// exactly one id per key; with token ids (`by_tokens`), one per whole block after
// `skip_blocks`. Every id < num_blocks; for a load (`distinct`), no id twice. INVALID_ARGUMENT
// naming the index and the numbers. Returns the index of the first key the ids cover.
absl::StatusOr<uint64_t> CheckBlockIds(absl::Span<const uint32_t> block_ids, uint64_t key_count,
                                       bool by_tokens, uint64_t skip_blocks, uint64_t num_blocks,
                                       bool distinct);

}  // namespace memra

#endif  // MEMRA_CORE_BLOCK_LAYOUT_H_
