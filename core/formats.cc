#include "core/formats.h"

#include <array>
#include <vector>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "core/checked_math.h"

namespace memra {
namespace {

constexpr KvFormats kAllFp8{KFormat::kFp8, VFormat::kFp8};

// One table per enum, in enum order: the names, sizes and parse lists cannot drift apart.
constexpr std::array<FormatLayout, 5> kElementLayouts{{
    {"f32", 1, 4, ElementFormat::kF32, false},
    {"bf16", 1, 2, ElementFormat::kBf16, false},
    {"f16", 1, 2, ElementFormat::kF16, false},
    {"fp8_e4m3", 1, 1, ElementFormat::kFp8E4m3, true},
    {"fp8_e5m2", 1, 1, ElementFormat::kFp8E5m2, true},
}};
constexpr std::array<FormatLayout, 7> kKLayouts{{
    {"q8_0", 32, 34, std::nullopt, false},  // 32 x int8 + f16 scale
    {"fp8", 32, 32, std::nullopt, false},   // 32 x e4m3
    kElementLayouts[1], kElementLayouts[2], kElementLayouts[0], kElementLayouts[3],
    kElementLayouts[4],
}};
constexpr std::array<FormatLayout, 8> kVLayouts{{
    {"q5_1", 32, 24, std::nullopt, false},  // f16 scale + f16 min + 32 high bits + 32 x 4 bits
    {"q4_0", 32, 18, std::nullopt, false},  // f16 scale + 32 x 4 bits
    {"fp8", 32, 32, std::nullopt, false},
    kElementLayouts[1], kElementLayouts[2], kElementLayouts[0], kElementLayouts[3],
    kElementLayouts[4],
}};

template <size_t N>
FormatLayout LayoutAt(const std::array<FormatLayout, N>& table, uint8_t value) {
  // Validation refuses unknown values before any layout is asked for; "unknown" is defensive.
  return value < N ? table[value] : FormatLayout{"unknown", 1, 0, std::nullopt, false};
}

template <typename Enum, size_t N>
absl::StatusOr<Enum> ParseIn(const std::array<FormatLayout, N>& table, std::string_view name,
                             absl::string_view what) {
  for (size_t i = 0; i < N; ++i) {
    if (name == table[i].name) return static_cast<Enum>(i);
  }
  std::vector<std::string> names;
  for (const FormatLayout& layout : table) names.emplace_back(layout.name);
  return absl::InvalidArgumentError(absl::StrCat(what, " format \"", std::string(name),
                                                 "\" unsupported (", absl::StrJoin(names, " | "),
                                                 ")"));
}

// The reference (docs/rules.md#the-reference) panics on an unsupported door value; we refuse
// with the same words (docs/rules.md#formats).
absl::Status UnsupportedDoor(absl::string_view variable, std::string_view value,
                             absl::string_view accepted) {
  return absl::InvalidArgumentError(
      absl::StrCat(variable, "=", std::string(value), " unsupported (", accepted, ")"));
}

// Unset and "" both mean the default, as in kv_cache_formats.
bool UnsetOrEmpty(const std::optional<std::string_view>& value) {
  return !value.has_value() || value->empty();
}

}  // namespace

FormatLayout LayoutOf(KFormat format) {
  return LayoutAt(kKLayouts, static_cast<uint8_t>(format));
}
FormatLayout LayoutOf(VFormat format) {
  return LayoutAt(kVLayouts, static_cast<uint8_t>(format));
}
FormatLayout LayoutOf(ElementFormat format) {
  return LayoutAt(kElementLayouts, static_cast<uint8_t>(format));
}

absl::StatusOr<uint64_t> FormatBytes(const FormatLayout& layout, uint64_t elems,
                                     absl::string_view what) {
  if (elems % layout.block_elems != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": format ", std::string(layout.name), " stores ", layout.block_elems,
        "-element blocks, and ", elems, " elements are not whole blocks"));
  }
  return CheckedMul(elems / layout.block_elems, layout.block_bytes, what);
}

uint32_t KBlockBytes(KFormat format) { return LayoutOf(format).block_bytes; }
uint32_t VBlockBytes(VFormat format) { return LayoutOf(format).block_bytes; }
std::string_view KFormatName(KFormat format) { return LayoutOf(format).name; }
std::string_view VFormatName(VFormat format) { return LayoutOf(format).name; }
std::string_view ElementFormatName(ElementFormat format) { return LayoutOf(format).name; }

absl::StatusOr<KFormat> ParseKFormat(std::string_view name) {
  return ParseIn<KFormat>(kKLayouts, name, "K");
}
absl::StatusOr<VFormat> ParseVFormat(std::string_view name) {
  return ParseIn<VFormat>(kVLayouts, name, "V");
}
absl::StatusOr<ElementFormat> ParseElementFormat(std::string_view name) {
  return ParseIn<ElementFormat>(kElementLayouts, name, "element");
}

KFormat KFormatOf(ElementFormat element) {
  // Element formats follow the two block formats in KFormat, in table order.
  for (size_t i = 0; i < kKLayouts.size(); ++i) {
    if (kKLayouts[i].element == element) return static_cast<KFormat>(i);
  }
  return KFormat::kF32;
}
VFormat VFormatOf(ElementFormat element) {
  for (size_t i = 0; i < kVLayouts.size(); ++i) {
    if (kVLayouts[i].element == element) return static_cast<VFormat>(i);
  }
  return VFormat::kF32;
}

absl::StatusOr<FormatDefaults> FormatDefaultsFromEnvironment(const FormatEnvironment& env) {
  KvFormats base;
  if (!UnsetOrEmpty(env.kv_k)) {
    absl::StatusOr<KFormat> k = ParseKFormat(*env.kv_k);
    if (!k.ok() || !LayoutOf(*k).IsBlock()) {
      return UnsupportedDoor("MEMRA_KV_K", *env.kv_k, "q8_0 | fp8");
    }
    base.k = *k;
  }
  if (!UnsetOrEmpty(env.kv_v)) {
    absl::StatusOr<VFormat> v = ParseVFormat(*env.kv_v);
    if (!v.ok() || !LayoutOf(*v).IsBlock()) {
      return UnsupportedDoor("MEMRA_KV_V", *env.kv_v, "q5_1 | q4_0 | fp8");
    }
    base.v = *v;
  }

  FormatDefaults defaults;
  // kv_fp8_on: only an explicit "1" turns ordinary layers fp8 (the per-model force door is an
  // engine-load decision, expressed here as explicit per-layer formats in the plan).
  defaults.ordinary = env.kv_fp8 == "1" ? kAllFp8 : base;
  // gkv_on: default on; only "0" turns it off.
  defaults.gemma_global = env.gemma_gkv == "0" ? base : kAllFp8;
  // wkv_on: an explicit value wins; unset follows the serving mode (spec serving keeps the
  // windowed layers quantized for acceptance).
  const bool windowed_fp8 =
      env.gemma_wkv.has_value() ? *env.gemma_wkv != "0" : !env.draft.has_value();
  defaults.gemma_windowed = windowed_fp8 ? kAllFp8 : base;
  return defaults;
}

}  // namespace memra
