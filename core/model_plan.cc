#include "core/model_plan.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "core/index_ring.h"
#include "core/sha256.h"
#include "core/status_macros.h"

namespace memra {
namespace {

bool HasKv(StateKind kind) { return kind == StateKind::kKv || kind == StateKind::kSlidingKv; }

std::string LayerPrefix(const LayerPlan& layer) {
  return absl::StrCat("layer ", layer.index, " (", std::string(StateKindName(layer.kind)), "): ");
}

absl::Status LayerError(const LayerPlan& layer, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(LayerPrefix(layer), what));
}

// A numeric field of LayerPlan, whether this layer's kind reads it, and whether it must then be
// positive. One table keeps "dims nonzero" and "unused fields zero" from drifting apart.
struct LayerField {
  absl::string_view name;
  uint32_t value;
  bool used;
  bool required;
};

std::array<LayerField, 11> LayerFields(const LayerPlan& layer) {
  const bool kv = HasKv(layer.kind);
  const bool recurrent = layer.kind == StateKind::kRecurrent;
  const bool latent = layer.kind == StateKind::kLatent;
  return {{
      {"head_dim_k", layer.head_dim_k, kv, kv},
      {"head_dim_v", layer.head_dim_v, kv, kv},
      {"n_head_kv", layer.n_head_kv, kv, kv},
      {"window", layer.window, layer.kind == StateKind::kSlidingKv,
       layer.kind == StateKind::kSlidingKv},
      {"conv_width", layer.conv_width, recurrent, recurrent},
      {"conv_kernel", layer.conv_kernel, recurrent, recurrent},
      {"state_width", layer.state_width, recurrent, recurrent},
      {"latent_width", layer.latent_width, latent, latent},
      {"index_width", layer.index_width, latent, false},
      {"index_pool", layer.index_pool, latent, false},
      // Layer 0 is a legal target, so "required" is checked against the index instead.
      {"shares_kv_with", layer.shares_kv_with, layer.kind == StateKind::kSharedKv, false},
  }};
}

// A block format's 32-element block never straddles a head (the reference's KVQUANT rule;
// docs/rules.md#model-plans-and-fingerprints). Unset formats resolve to the defaults, which the
// doors keep to block formats, so they are held to the rule as the reference holds them.
absl::Status CheckHeadDimHoldsBlocks(const LayerPlan& layer) {
  if (!layer.formats.has_value()) {
    if (layer.head_dim_k % 32 == 0 && layer.head_dim_v % 32 == 0) return absl::OkStatus();
    return LayerError(layer, absl::StrCat("KVQUANT requires head_dim_k%32==0 && "
                                          "head_dim_v%32==0 (k=",
                                          layer.head_dim_k, " v=", layer.head_dim_v, ")"));
  }
  const auto check = [&layer](absl::string_view side, const FormatLayout& format,
                              uint32_t head_dim) -> absl::Status {
    if (head_dim % format.block_elems == 0) return absl::OkStatus();
    return LayerError(layer, absl::StrCat(side, " format ", std::string(format.name), " stores ",
                                          format.block_elems, "-element blocks, which head_dim_",
                                          absl::AsciiStrToLower(side), " ", head_dim,
                                          " cannot hold whole (KVQUANT)"));
  };
  RETURN_IF_ERROR(check("K", LayoutOf(layer.formats->k), layer.head_dim_k));
  return check("V", LayoutOf(layer.formats->v), layer.head_dim_v);
}

// `scale` may be set only for an fp8 element format (`format` null: the kind stores no such
// side), with 1 or `heads` finite positive values.
absl::Status CheckScale(const LayerPlan& layer, absl::string_view name,
                        const std::vector<float>& scale, const std::optional<FormatLayout>& format,
                        uint32_t heads) {
  if (scale.empty()) return absl::OkStatus();
  if (!format.has_value() || !format->scaled) {
    return LayerError(layer, absl::StrCat(name, " has ", scale.size(), " values but the ",
                                          format.has_value() ? "format " : "layer",
                                          format.has_value() ? std::string(format->name) : "",
                                          " takes no scale (fp8_e4m3 | fp8_e5m2 only)"));
  }
  if (scale.size() != 1 && scale.size() != heads) {
    const std::string expected =
        heads == 1 ? "1 (per tensor)" : absl::StrCat("1 (per tensor) or ", heads, " (per head)");
    return LayerError(
        layer, absl::StrCat(name, " has ", scale.size(), " values: ", expected, " expected"));
  }
  for (size_t i = 0; i < scale.size(); ++i) {
    if (!std::isfinite(scale[i]) || scale[i] <= 0) {
      return LayerError(layer, absl::StrCat(name, "[", i, "] = ", scale[i],
                                            " must be finite and positive"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateScales(const LayerPlan& layer) {
  std::optional<FormatLayout> k;
  std::optional<FormatLayout> v;
  uint32_t k_heads = 1;
  if (HasKv(layer.kind) && layer.formats.has_value()) {
    k = LayoutOf(layer.formats->k);
    v = LayoutOf(layer.formats->v);
    k_heads = layer.n_head_kv;
  } else if (layer.kind == StateKind::kLatent) {
    k = LayoutOf(layer.latent_format);  // one MQA row: a per-tensor scale only
  }
  RETURN_IF_ERROR(CheckScale(layer, "k_scale", layer.k_scale, k, k_heads));
  return CheckScale(layer, "v_scale", layer.v_scale, v, layer.n_head_kv);
}

absl::Status ValidateKvLayer(const LayerPlan& layer) {
  RETURN_IF_ERROR(CheckHeadDimHoldsBlocks(layer));
  // The reference derives the class from the state: Gemma windowed = sliding, global = full.
  const bool class_fits_kind =
      layer.attention == AttentionClass::kOrdinary ||
      (layer.attention == AttentionClass::kGemmaWindowed) == (layer.kind == StateKind::kSlidingKv);
  if (!class_fits_kind) {
    return LayerError(
        layer, absl::StrCat("attention class ", std::string(AttentionClassName(layer.attention)),
                            " does not fit a ", std::string(StateKindName(layer.kind)),
                            " layer (gemma_windowed is sliding_kv, "
                            "gemma_global is kv)"));
  }
  return absl::OkStatus();
}

absl::Status ValidateLatentLayer(const LayerPlan& layer, const ModelPlan& plan) {
  const bool indexer = layer.index_width > 0;
  // The pool key of a pool is index_width / 2 f32 (index_head_dim); the plane row is 2x that.
  if (layer.index_width % 2 != 0) {
    return LayerError(layer, absl::StrCat("index_width ", layer.index_width,
                                          " must be even (2 x index_head_dim)"));
  }
  if (indexer != (layer.index_pool > 0)) {
    return LayerError(layer, absl::StrCat("index_pool ", layer.index_pool,
                                          " must be set exactly when there is an indexer "
                                          "(index_width ",
                                          layer.index_width, ")"));
  }
  // The ring holds whole pools; a pool larger than the ring can never be built once it engages.
  if (indexer && plan.index_ring_rows != 0) {
    const uint64_t ring_rows = plan.index_ring_rows.value_or(kIndexRingWorkingRows);
    absl::StatusOr<uint64_t> effective = EffectiveIndexRingRows(ring_rows, layer.index_pool);
    if (!effective.ok()) return LayerError(layer, effective.status().message());
  }
  return absl::OkStatus();
}

// Indices were checked contiguous before any layer: FindLayer is O(1) here.
absl::Status ValidateSharedLayer(const LayerPlan& layer, const ModelPlan& plan) {
  const LayerPlan* target =
      layer.shares_kv_with < layer.index ? plan.FindLayer(layer.shares_kv_with) : nullptr;
  if (target == nullptr || !HasKv(target->kind)) {
    return LayerError(layer, absl::StrCat("shares_kv_with ", layer.shares_kv_with,
                                          " must name an earlier kv or sliding_kv layer"));
  }
  return absl::OkStatus();
}

// Plans arrive over the wire: an enum value no name exists for is input, not a crash.
absl::Status ValidateEnums(const LayerPlan& layer) {
  const auto unknown = [&layer](absl::string_view what, uint8_t value) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer.index, ": unknown ", what, " ", static_cast<int>(value)));
  };
  if (layer.kind > StateKind::kSharedKv) {
    return unknown("state kind", static_cast<uint8_t>(layer.kind));
  }
  if (layer.attention > AttentionClass::kGemmaWindowed) {
    return unknown("attention class", static_cast<uint8_t>(layer.attention));
  }
  if (layer.formats.has_value() && layer.formats->k > kLastKFormat) {
    return unknown("K format", static_cast<uint8_t>(layer.formats->k));
  }
  if (layer.formats.has_value() && layer.formats->v > kLastVFormat) {
    return unknown("V format", static_cast<uint8_t>(layer.formats->v));
  }
  if (layer.latent_format > kLastElementFormat) {
    return unknown("latent format", static_cast<uint8_t>(layer.latent_format));
  }
  return absl::OkStatus();
}

absl::Status ValidateLayer(const LayerPlan& layer, const ModelPlan& plan) {
  RETURN_IF_ERROR(ValidateEnums(layer));
  for (const LayerField& field : LayerFields(layer)) {
    if (field.required && field.value == 0) {
      return LayerError(layer, absl::StrCat(field.name, " must be positive"));
    }
    if (!field.used && field.value != 0) {
      return LayerError(layer, absl::StrCat(field.name, "=", field.value,
                                            " is set but this kind does not use it"));
    }
  }
  if (!HasKv(layer.kind)) {
    if (layer.formats.has_value()) return LayerError(layer, "formats are set but unused");
    if (layer.attention != AttentionClass::kOrdinary) {
      return LayerError(
          layer, absl::StrCat("attention class ", std::string(AttentionClassName(layer.attention)),
                              " is set but unused"));
    }
  }
  if (layer.kind != StateKind::kLatent && layer.latent_format != ElementFormat::kF32) {
    return LayerError(layer, absl::StrCat("latent_format ",
                                          std::string(ElementFormatName(layer.latent_format)),
                                          " is set but this kind does not use it"));
  }
  RETURN_IF_ERROR(ValidateScales(layer));
  switch (layer.kind) {
    case StateKind::kKv:
    case StateKind::kSlidingKv:
      return ValidateKvLayer(layer);
    case StateKind::kLatent:
      return ValidateLatentLayer(layer, plan);
    case StateKind::kSharedKv:
      return ValidateSharedLayer(layer, plan);
    case StateKind::kNone:
    case StateKind::kRecurrent:
      break;
  }
  return absl::OkStatus();
}

// Little-endian, fixed-width: the encoding is the fingerprint's contract, not a wire format.
class CanonicalEncoder {
 public:
  void U8(uint8_t value) { bytes_.push_back(static_cast<char>(value)); }
  void U32(uint32_t value) {
    for (int i = 0; i < 4; ++i) U8(static_cast<uint8_t>(value >> (8 * i)));
  }
  void F32(float value) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    U32(bits);
  }
  void Text(absl::string_view text) {
    U32(static_cast<uint32_t>(text.size()));
    bytes_.append(text.data(), text.size());
  }
  const std::string& bytes() const { return bytes_; }

 private:
  std::string bytes_;
};

// Bump when the encoding or the meaning of a field changes: old fingerprints must not match.
constexpr absl::string_view kFingerprintVersion = "memra.kv.model_plan.v1";
// Appended only by plans that use what v1 could not say (model_plan.h): v1 plans keep their
// fingerprints.
constexpr absl::string_view kFingerprintExtension = "memra.kv.model_plan.v1.ext";
constexpr uint8_t kNoFormat = 0xff;

void EncodeLayer(const LayerPlan& layer, const FormatDefaults& defaults, CanonicalEncoder& out) {
  out.U32(layer.index);
  out.U8(static_cast<uint8_t>(layer.kind));
  out.U8(static_cast<uint8_t>(layer.attention));
  if (HasKv(layer.kind)) {
    // Resolved, so an explicit q8_0 and a defaulted q8_0 are the same layout.
    const KvFormats formats = ResolveLayerFormats(layer, defaults);
    out.U8(static_cast<uint8_t>(formats.k));
    out.U8(static_cast<uint8_t>(formats.v));
  } else {
    out.U8(kNoFormat);
    out.U8(kNoFormat);
  }
  // Every numeric field, unused ones included: validation pinned those to zero.
  for (const LayerField& field : LayerFields(layer)) out.U32(field.value);
}

}  // namespace

std::string_view StateKindName(StateKind kind) {
  switch (kind) {
    case StateKind::kNone:
      return "none";
    case StateKind::kKv:
      return "kv";
    case StateKind::kSlidingKv:
      return "sliding_kv";
    case StateKind::kRecurrent:
      return "recurrent";
    case StateKind::kLatent:
      return "latent";
    case StateKind::kSharedKv:
      return "shared_kv";
  }
  return "unknown";
}

std::string_view AttentionClassName(AttentionClass attention) {
  switch (attention) {
    case AttentionClass::kOrdinary:
      return "ordinary";
    case AttentionClass::kGemmaGlobal:
      return "gemma_global";
    case AttentionClass::kGemmaWindowed:
      return "gemma_windowed";
  }
  return "unknown";
}

std::vector<const LayerPlan*> ModelPlan::AllLayers() const {
  std::vector<const LayerPlan*> all;
  all.reserve(layers.size() + mtp_blocks.size());
  for (const LayerPlan& layer : layers) all.push_back(&layer);
  for (const LayerPlan& layer : mtp_blocks) all.push_back(&layer);
  return all;
}

const LayerPlan* ModelPlan::FindLayer(uint32_t index) const {
  // Where contiguous indices put it: O(1) for every plan that passes validation.
  const LayerPlan* placed = nullptr;
  if (index < layers.size()) {
    placed = &layers[index];
  } else if (index - layers.size() < mtp_blocks.size()) {
    placed = &mtp_blocks[index - layers.size()];
  }
  if (placed != nullptr && placed->index == index) return placed;
  // An unvalidated plan with gaps or disorder: look everywhere.
  for (const std::vector<LayerPlan>* group : {&layers, &mtp_blocks}) {
    for (const LayerPlan& layer : *group) {
      if (layer.index == index) return &layer;
    }
  }
  return nullptr;
}

uint32_t ModelPlan::TotalLayers() const {
  return static_cast<uint32_t>(layers.size() + mtp_blocks.size());
}

bool IsSwaRingLayer(const ModelPlan& plan, const LayerPlan& layer) {
  return layer.kind == StateKind::kSlidingKv && plan.swa_ring;
}

KvFormats ResolveLayerFormats(const LayerPlan& layer, const FormatDefaults& defaults) {
  if (layer.formats.has_value()) return *layer.formats;
  switch (layer.attention) {
    case AttentionClass::kGemmaGlobal:
      return defaults.gemma_global;
    case AttentionClass::kGemmaWindowed:
      return defaults.gemma_windowed;
    case AttentionClass::kOrdinary:
      break;
  }
  return defaults.ordinary;
}

absl::Status ValidateModelPlan(const ModelPlan& plan) {
  if (plan.layers.empty()) return absl::InvalidArgumentError("model plan has no layers");
  const uint64_t total = uint64_t{plan.layers.size()} + plan.mtp_blocks.size();
  if (total > UINT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("model plan has ", total, " layers; indices are 32-bit"));
  }
  const std::vector<const LayerPlan*> all = plan.AllLayers();
  for (uint32_t position = 0; position < all.size(); ++position) {
    if (all[position]->index != position) {
      const bool mtp = position >= plan.layers.size();
      return absl::InvalidArgumentError(absl::StrCat(
          mtp ? "MTP block " : "trunk layer ", mtp ? position - plan.layers.size() : position,
          " has index ", all[position]->index, ", expected ", position,
          " (trunk layers are 0..n-1 in order, MTP blocks follow)"));
    }
  }
  for (const LayerPlan* layer : all) RETURN_IF_ERROR(ValidateLayer(*layer, plan));
  return absl::OkStatus();
}

absl::StatusOr<PlanFingerprint> FingerprintModelPlan(const ModelPlan& plan,
                                                     const FormatDefaults& defaults) {
  RETURN_IF_ERROR(ValidateModelPlan(plan));
  CanonicalEncoder out;
  out.Text(kFingerprintVersion);
  // Plan switches only count where a layer reads them, and an unset ring is the default it
  // books: plans that allocate the same planes hash equal.
  bool ring = false;
  bool indexer = false;
  for (const LayerPlan* layer : plan.AllLayers()) {
    ring |= IsSwaRingLayer(plan, *layer);
    indexer |= layer->kind == StateKind::kLatent && layer->index_width > 0;
  }
  out.U8(ring ? 1 : 0);
  out.U32(indexer ? plan.index_ring_rows.value_or(kIndexRingWorkingRows) : 0);
  out.U32(static_cast<uint32_t>(plan.layers.size()));
  out.U32(static_cast<uint32_t>(plan.mtp_blocks.size()));
  const std::vector<const LayerPlan*> all = plan.AllLayers();
  for (const LayerPlan* layer : all) EncodeLayer(*layer, defaults, out);
  const bool extended = std::any_of(all.begin(), all.end(), [](const LayerPlan* layer) {
    return layer->latent_format != ElementFormat::kF32 || !layer->k_scale.empty() ||
           !layer->v_scale.empty();
  });
  if (extended) {
    out.Text(kFingerprintExtension);
    for (const LayerPlan* layer : all) {
      out.U8(static_cast<uint8_t>(layer->latent_format));
      for (const std::vector<float>* scale : {&layer->k_scale, &layer->v_scale}) {
        out.U32(static_cast<uint32_t>(scale->size()));
        for (float value : *scale) out.F32(value);
      }
    }
  }
  return Sha256Of(out.bytes());
}

std::string FingerprintHex(const PlanFingerprint& fingerprint) { return Sha256Hex(fingerprint); }

std::string PlanFormatsSummary(const ModelPlan& plan, const FormatDefaults& defaults) {
  std::vector<std::string> kv;
  std::vector<std::string> latent;
  const auto add_distinct = [](std::vector<std::string>& list, std::string name) {
    if (std::find(list.begin(), list.end(), name) == list.end()) list.push_back(std::move(name));
  };
  for (const LayerPlan* layer : plan.AllLayers()) {
    if (HasKv(layer->kind)) {
      const KvFormats formats = ResolveLayerFormats(*layer, defaults);
      add_distinct(kv, absl::StrCat(std::string(KFormatName(formats.k)), "/",
                                    std::string(VFormatName(formats.v))));
    } else if (layer->kind == StateKind::kLatent) {
      add_distinct(latent, std::string(ElementFormatName(layer->latent_format)));
    }
  }
  std::vector<std::string> parts;
  if (!kv.empty()) parts.push_back(absl::StrCat("K/V ", absl::StrJoin(kv, ", ")));
  if (!latent.empty()) parts.push_back(absl::StrCat("latent ", absl::StrJoin(latent, ", ")));
  return parts.empty() ? "no K/V or latent planes" : absl::StrJoin(parts, "; ");
}

}  // namespace memra
