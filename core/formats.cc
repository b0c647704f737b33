#include "core/formats.h"

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace memra {
namespace {

constexpr KvFormats kAllFp8{KFormat::kFp8, VFormat::kFp8};

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

uint32_t KBlockBytes(KFormat format) {
  switch (format) {
    case KFormat::kQ8_0:
      return 34;  // 32 x int8 + f16 scale
    case KFormat::kFp8:
      return 32;  // 32 x e4m3
  }
  return 34;
}

uint32_t VBlockBytes(VFormat format) {
  switch (format) {
    case VFormat::kQ5_1:
      return 24;  // 32 x 5 bits + f16 scale + f16 min
    case VFormat::kQ4_0:
      return 18;  // 32 x 4 bits + f16 scale
    case VFormat::kFp8:
      return 32;
  }
  return 24;
}

std::string_view KFormatName(KFormat format) {
  switch (format) {
    case KFormat::kQ8_0:
      return "q8_0";
    case KFormat::kFp8:
      return "fp8";
  }
  return "unknown";
}

std::string_view VFormatName(VFormat format) {
  switch (format) {
    case VFormat::kQ5_1:
      return "q5_1";
    case VFormat::kQ4_0:
      return "q4_0";
    case VFormat::kFp8:
      return "fp8";
  }
  return "unknown";
}

absl::StatusOr<KFormat> ParseKFormat(std::string_view name) {
  for (KFormat format : {KFormat::kQ8_0, KFormat::kFp8}) {
    if (name == KFormatName(format)) return format;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("K format \"", std::string(name), "\" unsupported (q8_0 | fp8)"));
}

absl::StatusOr<VFormat> ParseVFormat(std::string_view name) {
  for (VFormat format : {VFormat::kQ5_1, VFormat::kQ4_0, VFormat::kFp8}) {
    if (name == VFormatName(format)) return format;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("V format \"", std::string(name), "\" unsupported (q5_1 | q4_0 | fp8)"));
}

absl::StatusOr<FormatDefaults> FormatDefaultsFromEnvironment(const FormatEnvironment& env) {
  KvFormats base;
  if (!UnsetOrEmpty(env.kv_k)) {
    absl::StatusOr<KFormat> k = ParseKFormat(*env.kv_k);
    if (!k.ok()) return UnsupportedDoor("MEMRA_KV_K", *env.kv_k, "q8_0 | fp8");
    base.k = *k;
  }
  if (!UnsetOrEmpty(env.kv_v)) {
    absl::StatusOr<VFormat> v = ParseVFormat(*env.kv_v);
    if (!v.ok()) return UnsupportedDoor("MEMRA_KV_V", *env.kv_v, "q5_1 | q4_0 | fp8");
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
