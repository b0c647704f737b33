#ifndef MEMRA_CORE_FORMATS_H_
#define MEMRA_CORE_FORMATS_H_

// KV plane formats (docs/rules.md#formats; the reference's kv_cache_formats / kv_blk_bytes and
// its fp8 doors, docs/rules.md#the-reference).
// Two families: the reference's BLOCK formats (32 elements per block, a head dim must hold whole
// blocks) and ELEMENT formats, one plain element per K/V value as GPU engines keep their caches
// (bf16, f16, f32, fp8 e4m3 / e5m2 with an engine-supplied scale). Formats are explicit per
// layer in a model plan; FormatDefaults only fills layers that leave theirs unset, and the
// reference's environment doors choose among the block formats only. Parsing env values is pure:
// the caller passes the strings it read.

#include <cstdint>
#include <optional>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace memra {

// Values are stable: they are the fingerprint's bytes and (plus one) the wire's.
enum class KFormat : uint8_t {
  kQ8_0 = 0,
  kFp8 = 1,  // the reference's block fp8: 32 x e4m3, no scale
  kBf16 = 2,
  kF16 = 3,
  kF32 = 4,
  kFp8E4m3 = 5,  // element fp8 (scale: LayerPlan::k_scale)
  kFp8E5m2 = 6,
};
enum class VFormat : uint8_t {
  kQ5_1 = 0,
  kQ4_0 = 1,
  kFp8 = 2,
  kBf16 = 3,
  kF16 = 4,
  kF32 = 5,
  kFp8E4m3 = 6,
  kFp8E5m2 = 7,
};
inline constexpr KFormat kLastKFormat = KFormat::kFp8E5m2;
inline constexpr VFormat kLastVFormat = VFormat::kFp8E5m2;

// The element type of an element format, and the format of an MLA latent row (f32 by default,
// as the reference keeps it).
enum class ElementFormat : uint8_t { kF32 = 0, kBf16 = 1, kF16 = 2, kFp8E4m3 = 3, kFp8E5m2 = 4 };
inline constexpr ElementFormat kLastElementFormat = ElementFormat::kFp8E5m2;

struct KvFormats {
  KFormat k = KFormat::kQ8_0;
  VFormat v = VFormat::kQ5_1;
  bool operator==(const KvFormats&) const = default;
};

// How a format lays elements out: `block_elems` elements in `block_bytes` bytes. An element
// format is a block of one element; `element` names its type (typed plane views), and `scaled`
// says the plan may carry a scale for it (fp8 e4m3 / e5m2).
struct FormatLayout {
  std::string_view name;
  uint32_t block_elems = 1;
  uint32_t block_bytes = 0;
  std::optional<ElementFormat> element;
  bool scaled = false;
  bool IsBlock() const { return block_elems > 1; }
};
FormatLayout LayoutOf(KFormat format);
FormatLayout LayoutOf(VFormat format);
FormatLayout LayoutOf(ElementFormat format);

// Bytes of `elems` elements of `layout`; INVALID_ARGUMENT naming `what`, the format and the
// numbers when `elems` is not whole blocks, or on overflow.
absl::StatusOr<uint64_t> FormatBytes(const FormatLayout& layout, uint64_t elems,
                                     absl::string_view what);

// Bytes of one block (one element for element formats): q8_0 34, fp8 32; q5_1 24, q4_0 18,
// fp8 32; bf16 / f16 2, f32 4, fp8_e4m3 / fp8_e5m2 1.
uint32_t KBlockBytes(KFormat format);
uint32_t VBlockBytes(VFormat format);
std::string_view KFormatName(KFormat format);
std::string_view VFormatName(VFormat format);
std::string_view ElementFormatName(ElementFormat format);
// Canonical names only ("q8_0", "bf16", "fp8_e4m3", ...); INVALID_ARGUMENT listing them.
absl::StatusOr<KFormat> ParseKFormat(std::string_view name);
absl::StatusOr<VFormat> ParseVFormat(std::string_view name);
absl::StatusOr<ElementFormat> ParseElementFormat(std::string_view name);
// The K / V format that stores `element` one per value.
KFormat KFormatOf(ElementFormat element);
VFormat VFormatOf(ElementFormat element);

// Default formats per attention class (see model_plan.h AttentionClass).
struct FormatDefaults {
  KvFormats ordinary;                                  // q8_0 / q5_1
  KvFormats gemma_global{KFormat::kFp8, VFormat::kFp8};    // MEMRA_GEMMA_GKV default on
  KvFormats gemma_windowed{KFormat::kFp8, VFormat::kFp8};  // MEMRA_GEMMA_WKV default on
};

// The reference's environment doors, as values (nullopt = variable unset). An unsupported value
// is INVALID_ARGUMENT naming the variable and the accepted values, never a panic. The doors keep
// the reference's meaning: they choose among the block formats only (an element format is a
// per-layer plan choice, e.g. import-model --kv-dtype).
struct FormatEnvironment {
  std::optional<std::string_view> kv_k;        // MEMRA_KV_K
  std::optional<std::string_view> kv_v;        // MEMRA_KV_V
  std::optional<std::string_view> kv_fp8;      // MEMRA_KV_FP8 ("1" = ordinary layers fp8)
  std::optional<std::string_view> gemma_gkv;   // MEMRA_GEMMA_GKV ("0" = off)
  std::optional<std::string_view> gemma_wkv;   // MEMRA_GEMMA_WKV ("0" = off)
  std::optional<std::string_view> draft;       // MEMRA_DRAFT (set: windowed default off)
};
absl::StatusOr<FormatDefaults> FormatDefaultsFromEnvironment(const FormatEnvironment& env);

}  // namespace memra

#endif  // MEMRA_CORE_FORMATS_H_
