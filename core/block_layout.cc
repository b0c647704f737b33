#include "core/block_layout.h"

#include <algorithm>
#include <tuple>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "core/sha256.h"
#include "core/status_macros.h"

namespace memra {
namespace {

constexpr std::string_view kLayoutDomain = "memra-kv/block-layout/v1";
constexpr std::string_view kStateKeyDomain = "memra-kv/engine-block-state/v1";
constexpr uint64_t kQuantBlockElements = 32;

void HashU32(Sha256& hash, uint32_t value) {
  char bytes[4];
  for (int i = 0; i < 4; ++i) bytes[i] = static_cast<char>((value >> (8 * i)) & 0xff);
  hash.Update(std::string_view(bytes, sizeof(bytes)));
}

void HashU64(Sha256& hash, uint64_t value) {
  char bytes[8];
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((value >> (8 * i)) & 0xff);
  hash.Update(std::string_view(bytes, sizeof(bytes)));
}

std::string_view AsBytes(const std::array<uint8_t, 32>& digest) {
  return std::string_view(reinterpret_cast<const char*>(digest.data()), digest.size());
}

bool KnownRole(uint32_t role) {
  return role >= static_cast<uint32_t>(BlockTensorRole::kK) &&
         role <= static_cast<uint32_t>(BlockTensorRole::kState);
}

absl::Status Refuse(size_t tensor, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("RegisterEngineBuffers: tensor ", tensor, ": ", what));
}

PlanFingerprint GroupFingerprint(const BlockPoolSpec& spec, uint32_t tp_size,
                                 const BlockGroupLayout& group) {
  Sha256 hash;
  hash.Update(kLayoutDomain);
  HashU32(hash, static_cast<uint32_t>(spec.model.size()));
  hash.Update(spec.model);
  HashU32(hash, spec.element);
  HashU32(hash, spec.order);
  HashU32(hash, spec.tokens_per_block);
  HashU32(hash, spec.num_kv_heads);
  HashU32(hash, spec.head_dim);
  HashU32(hash, spec.tp_rank);
  HashU32(hash, tp_size);
  HashU32(hash, group.kv_group);
  for (const auto* tensors : {&group.block_tensors, &group.state_tensors}) {
    HashU32(hash, static_cast<uint32_t>(tensors->size()));
    for (const BlockTensorSpec& tensor : *tensors) {
      HashU32(hash, tensor.layer);
      HashU32(hash, tensor.role);
      HashU64(hash, tensor.block_bytes);
    }
  }
  return hash.Finish();
}

}  // namespace

absl::StatusOr<uint64_t> BlockElementBytes(uint32_t element, uint64_t elements) {
  uint64_t per_element = 0;
  uint64_t per_quant_block = 0;
  switch (static_cast<BlockElement>(element)) {
    case BlockElement::kBf16:
    case BlockElement::kFp16:
      per_element = 2;
      break;
    case BlockElement::kFp32:
      per_element = 4;
      break;
    case BlockElement::kFp8E4M3:
    case BlockElement::kFp8E5M2:
    case BlockElement::kInt8:
      per_element = 1;
      break;
    case BlockElement::kQ8_0:
      per_quant_block = 34;
      break;
    case BlockElement::kQ5_1:
      per_quant_block = 24;
      break;
    case BlockElement::kQ4_0:
      per_quant_block = 18;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown block element type ", element, " (1 to 9)"));
  }
  if (per_element != 0) return CheckedMul(elements, per_element, "block element bytes");
  if (elements % kQuantBlockElements != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a quantized block element type stores whole ", kQuantBlockElements,
        "-element blocks; ", elements, " elements is not a multiple"));
  }
  return CheckedMul(elements / kQuantBlockElements, per_quant_block, "block element bytes");
}

absl::StatusOr<BlockPoolLayout> ValidateBlockPool(const BlockPoolSpec& spec,
                                                  const BlockPoolLimits& limits) {
  auto refuse = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("RegisterEngineBuffers: ", parts...));
  };
  if (spec.buffer_bytes.empty() || spec.buffer_bytes.size() > limits.max_buffers) {
    return refuse(spec.buffer_bytes.size(), " buffers; 1 to ", limits.max_buffers);
  }
  for (size_t i = 0; i < spec.buffer_bytes.size(); ++i) {
    if (spec.buffer_bytes[i] == 0) return refuse("buffer ", i, " is 0 bytes");
  }
  if (spec.num_blocks == 0 || spec.num_blocks > limits.max_num_blocks) {
    return refuse("num_blocks ", spec.num_blocks, "; 1 to ", limits.max_num_blocks);
  }
  if (spec.tokens_per_block == 0 || spec.tokens_per_block > limits.max_tokens_per_block) {
    return refuse("tokens_per_block ", spec.tokens_per_block, "; 1 to ",
                  limits.max_tokens_per_block);
  }
  if (spec.num_kv_heads == 0 || spec.head_dim == 0) {
    return refuse("num_kv_heads ", spec.num_kv_heads, " and head_dim ", spec.head_dim,
                  " must both be at least 1");
  }
  if (spec.order != static_cast<uint32_t>(BlockOrder::kNhd) &&
      spec.order != static_cast<uint32_t>(BlockOrder::kHnd)) {
    return refuse("unknown block order ", spec.order, " (1 NHD, 2 HND)");
  }
  const uint32_t tp_size = std::max<uint32_t>(spec.tp_size, 1);
  if (spec.tp_rank >= tp_size) {
    return refuse("tp_rank ", spec.tp_rank, " is not below tp_size ", tp_size);
  }
  if (spec.model.empty() || spec.model.size() > limits.max_model_bytes) {
    return refuse("a model identity of ", spec.model.size(), " bytes; 1 to ",
                  limits.max_model_bytes);
  }
  if (spec.tensors.empty() || spec.tensors.size() > limits.max_tensors) {
    return refuse(spec.tensors.size(), " tensors; 1 to ", limits.max_tensors);
  }
  // The bytes of one K or V block: tokens x heads x head_dim elements.
  ASSIGN_OR_RETURN(uint64_t rows, CheckedMul(spec.tokens_per_block, spec.num_kv_heads,
                                             "tokens_per_block x num_kv_heads"));
  ASSIGN_OR_RETURN(uint64_t elements, CheckedMul(rows, spec.head_dim, "block elements"));
  absl::StatusOr<uint64_t> kv_block_bytes = BlockElementBytes(spec.element, elements);
  if (!kv_block_bytes.ok()) return refuse(kv_block_bytes.status().message());

  absl::flat_hash_set<std::tuple<uint32_t, uint32_t, uint32_t>> seen;
  std::vector<BlockGroupLayout> groups;
  for (size_t i = 0; i < spec.tensors.size(); ++i) {
    const BlockTensorSpec& tensor = spec.tensors[i];
    if (!KnownRole(tensor.role)) {
      return Refuse(i, absl::StrCat("unknown kind ", tensor.role, " (1 K, 2 V, 3 KV, 4 STATE)"));
    }
    if (!seen.insert({tensor.layer, tensor.role, tensor.kv_group}).second) {
      return Refuse(i, absl::StrCat("layer ", tensor.layer, " kind ", tensor.role,
                                    " of kv_group ", tensor.kv_group, " is listed twice"));
    }
    if (tensor.buffer >= spec.buffer_bytes.size()) {
      return Refuse(i, absl::StrCat("buffer ", tensor.buffer, " of ", spec.buffer_bytes.size()));
    }
    const auto role = static_cast<BlockTensorRole>(tensor.role);
    if (tensor.block_bytes == 0) return Refuse(i, "block_bytes is 0");
    if ((role == BlockTensorRole::kK || role == BlockTensorRole::kV) &&
        tensor.block_bytes != *kv_block_bytes) {
      return Refuse(i, absl::StrCat("a K/V block of ", tensor.block_bytes, " bytes; ",
                                    spec.tokens_per_block, " tokens x ", spec.num_kv_heads,
                                    " heads x ", spec.head_dim, " dims of element type ",
                                    spec.element, " is ", *kv_block_bytes));
    }
    if (role == BlockTensorRole::kKv && tensor.block_bytes % spec.tokens_per_block != 0) {
      return Refuse(i, absl::StrCat("a KV block of ", tensor.block_bytes,
                                    " bytes is not whole rows of ", spec.tokens_per_block,
                                    " tokens"));
    }
    if (tensor.block_stride < tensor.block_bytes) {
      return Refuse(i, absl::StrCat("block_stride ", tensor.block_stride,
                                    " is below block_bytes ", tensor.block_bytes,
                                    ": its blocks would overlap"));
    }
    // The last block's end: offset + (num_blocks - 1) x stride + block_bytes.
    absl::StatusOr<uint64_t> end = CheckedMul(spec.num_blocks - 1, tensor.block_stride, "blocks");
    if (end.ok()) end = CheckedAdd(*end, tensor.offset, "blocks");
    if (end.ok()) end = CheckedAdd(*end, tensor.block_bytes, "blocks");
    const uint64_t buffer_bytes = spec.buffer_bytes[tensor.buffer];
    if (!end.ok() || *end > buffer_bytes) {
      return Refuse(i, absl::StrCat(
                           spec.num_blocks, " blocks at offset ", tensor.offset, ", stride ",
                           tensor.block_stride, ", ", tensor.block_bytes, " bytes each end at ",
                           end.ok() ? absl::StrCat(*end) : std::string("an overflow"),
                           "; buffer ", tensor.buffer, " holds ", buffer_bytes, " bytes"));
    }
    auto group = std::find_if(groups.begin(), groups.end(), [&](const BlockGroupLayout& g) {
      return g.kv_group == tensor.kv_group;
    });
    if (group == groups.end()) {
      groups.emplace_back().kv_group = tensor.kv_group;
      group = groups.end() - 1;
    }
    if (role == BlockTensorRole::kState) {
      group->state_tensors.push_back(tensor);
      ASSIGN_OR_RETURN(group->state_bytes,
                       CheckedAdd(group->state_bytes, tensor.block_bytes, "state bytes"));
    } else {
      group->block_tensors.push_back(tensor);
      ASSIGN_OR_RETURN(group->block_bytes,
                       CheckedAdd(group->block_bytes, tensor.block_bytes, "block bytes"));
    }
  }
  auto by_layer_role = [](const BlockTensorSpec& a, const BlockTensorSpec& b) {
    return std::tie(a.layer, a.role) < std::tie(b.layer, b.role);
  };
  std::sort(groups.begin(), groups.end(),
            [](const auto& a, const auto& b) { return a.kv_group < b.kv_group; });
  for (BlockGroupLayout& group : groups) {
    if (group.block_tensors.empty()) {
      return refuse("kv_group ", group.kv_group, " has only STATE tensors (", group.state_bytes,
                    " bytes); a group needs a K, V or KV tensor to have blocks");
    }
    std::sort(group.block_tensors.begin(), group.block_tensors.end(), by_layer_role);
    std::sort(group.state_tensors.begin(), group.state_tensors.end(), by_layer_role);
    group.fingerprint = GroupFingerprint(spec, tp_size, group);
  }
  BlockPoolLayout layout;
  layout.num_blocks = spec.num_blocks;
  layout.tokens_per_block = spec.tokens_per_block;
  layout.groups = std::move(groups);
  return layout;
}

absl::StatusOr<const BlockGroupLayout*> FindBlockGroup(const BlockPoolLayout& layout,
                                                       uint32_t kv_group) {
  for (const BlockGroupLayout& group : layout.groups) {
    if (group.kv_group == kv_group) return &group;
  }
  std::string groups;
  for (const BlockGroupLayout& group : layout.groups) {
    absl::StrAppend(&groups, groups.empty() ? "" : ", ", group.kv_group);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "kv_group ", kv_group, " is not registered (the registration has groups ", groups, ")"));
}

absl::StatusOr<std::vector<PoolRange>> BlockRanges(const BlockPoolLayout& layout,
                                                   const BlockGroupLayout& group,
                                                   uint64_t block_id, bool state) {
  if (block_id >= layout.num_blocks) {
    return absl::InvalidArgumentError(absl::StrCat("block id ", block_id, " of a pool of ",
                                                   layout.num_blocks, " blocks"));
  }
  const std::vector<BlockTensorSpec>& tensors = state ? group.state_tensors : group.block_tensors;
  std::vector<PoolRange> ranges;
  ranges.reserve(tensors.size());
  for (const BlockTensorSpec& tensor : tensors) {
    // Inside the buffer for every block id < num_blocks (ValidateBlockPool).
    ranges.push_back({.buffer = tensor.buffer,
                      .offset = tensor.offset + block_id * tensor.block_stride,
                      .bytes = tensor.block_bytes});
  }
  return ranges;
}

absl::StatusOr<std::vector<BlockKey>> EngineHashKeys(const PlanFingerprint& scoped_layout,
                                                     absl::Span<const std::string> hashes) {
  std::vector<BlockKey> keys;
  keys.reserve(hashes.size());
  for (size_t i = 0; i < hashes.size(); ++i) {
    const std::string& hash_bytes = hashes[i];
    if (hash_bytes.empty() || hash_bytes.size() > kMaxEngineHashBytes) {
      return absl::InvalidArgumentError(absl::StrCat("block hash ", i, " is ", hash_bytes.size(),
                                                     " bytes; 1 to ", kMaxEngineHashBytes));
    }
    Sha256 hash;
    hash.Update(kEngineBlockKeyDomain);
    hash.Update(AsBytes(scoped_layout));
    HashU32(hash, static_cast<uint32_t>(hash_bytes.size()));
    hash.Update(hash_bytes);
    keys.push_back(hash.Finish());
  }
  return keys;
}

BlockKey BoundaryStateKey(const BlockKey& block) {
  Sha256 hash;
  hash.Update(kStateKeyDomain);
  hash.Update(AsBytes(block));
  return hash.Finish();
}

PlanFingerprint BoundaryStateFingerprint(const PlanFingerprint& scoped_layout) {
  return BoundaryStateKey(scoped_layout);
}

absl::StatusOr<uint64_t> CheckBlockIds(absl::Span<const uint32_t> block_ids, uint64_t key_count,
                                       bool by_tokens, uint64_t skip_blocks, uint64_t num_blocks,
                                       bool distinct) {
  uint64_t first = 0;
  if (by_tokens) {
    if (skip_blocks > key_count) {
      return absl::InvalidArgumentError(absl::StrCat("skip_blocks ", skip_blocks, " exceeds the ",
                                                     key_count, " whole blocks of the token ids"));
    }
    first = skip_blocks;
  } else if (skip_blocks != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "skip_blocks ", skip_blocks, " with block hashes; it applies to token ids only"));
  }
  if (block_ids.size() != key_count - first) {
    return absl::InvalidArgumentError(absl::StrCat(
        block_ids.size(), " block ids for ", key_count - first, " blocks (", key_count,
        by_tokens ? " whole token blocks" : " hashes", ", ", first, " skipped)"));
  }
  absl::flat_hash_set<uint32_t> seen;
  for (size_t i = 0; i < block_ids.size(); ++i) {
    if (block_ids[i] >= num_blocks) {
      return absl::InvalidArgumentError(absl::StrCat("block id ", block_ids[i], " (index ", i,
                                                     ") of a pool of ", num_blocks, " blocks"));
    }
    if (distinct && !seen.insert(block_ids[i]).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("block id ", block_ids[i], " (index ", i, ") appears twice in one load"));
    }
  }
  return first;
}

}  // namespace memra
