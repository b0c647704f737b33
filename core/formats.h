#ifndef MEMRA_CORE_FORMATS_H_
#define MEMRA_CORE_FORMATS_H_

// KV block formats (docs/rules.md#formats; the reference's kv_cache_formats / kv_blk_bytes and
// its fp8 doors, docs/rules.md#the-reference).
// Formats are explicit per layer in a model plan; FormatDefaults only fills layers that leave
// theirs unset. Parsing env values is pure: the caller passes the strings it read.

#include <cstdint>
#include <optional>
#include <string_view>

#include "absl/status/statusor.h"

namespace memra {

enum class KFormat : uint8_t { kQ8_0 = 0, kFp8 = 1 };
enum class VFormat : uint8_t { kQ5_1 = 0, kQ4_0 = 1, kFp8 = 2 };

struct KvFormats {
  KFormat k = KFormat::kQ8_0;
  VFormat v = VFormat::kQ5_1;
  bool operator==(const KvFormats&) const = default;
};

// Bytes of one 32-element block: q8_0 34, fp8 32; q5_1 24, q4_0 18, fp8 32.
uint32_t KBlockBytes(KFormat format);
uint32_t VBlockBytes(VFormat format);
std::string_view KFormatName(KFormat format);
std::string_view VFormatName(VFormat format);
absl::StatusOr<KFormat> ParseKFormat(std::string_view name);  // "q8_0" | "fp8"
absl::StatusOr<VFormat> ParseVFormat(std::string_view name);  // "q5_1" | "q4_0" | "fp8"

// Default formats per attention class (see model_plan.h AttentionClass).
struct FormatDefaults {
  KvFormats ordinary;                                  // q8_0 / q5_1
  KvFormats gemma_global{KFormat::kFp8, VFormat::kFp8};    // MEMRA_GEMMA_GKV default on
  KvFormats gemma_windowed{KFormat::kFp8, VFormat::kFp8};  // MEMRA_GEMMA_WKV default on
};

// The reference's environment doors, as values (nullopt = variable unset). An unsupported value
// is INVALID_ARGUMENT naming the variable and the accepted values, never a panic.
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
