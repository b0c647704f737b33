#include "server/session/model_import.h"

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/checked_math.h"
#include "core/status_macros.h"
#include "nlohmann/json.hpp"

namespace memra {
namespace {

using Json = nlohmann::json;

// More layers than any published model by far; a bound so a hostile config cannot make us build
// millions of layer plans.
constexpr uint64_t kMaxLayers = 4096;

enum class Family { kDense, kGemma, kMla, kQwen3Next, kJamba };

struct Architecture {
  const char* name;
  Family family;
  bool text_config = false;  // the text model's fields live under "text_config"
};

constexpr Architecture kArchitectures[] = {
    {"LlamaForCausalLM", Family::kDense},
    {"MistralForCausalLM", Family::kDense},
    {"Qwen2ForCausalLM", Family::kDense},
    {"Qwen3ForCausalLM", Family::kDense},
    {"Gemma2ForCausalLM", Family::kGemma},
    {"Gemma3ForCausalLM", Family::kGemma},
    {"Gemma3ForConditionalGeneration", Family::kGemma, true},
    {"Gemma3nForCausalLM", Family::kGemma},
    {"Gemma3nForConditionalGeneration", Family::kGemma, true},
    {"DeepseekV2ForCausalLM", Family::kMla},
    {"DeepseekV3ForCausalLM", Family::kMla},
    {"DeepseekV32ForCausalLM", Family::kMla},
    {"Qwen3NextForCausalLM", Family::kQwen3Next},
    {"JambaForCausalLM", Family::kJamba},
};

// A value as it appears in config.json, cut short for messages (never throws: strings the
// parser accepted are valid UTF-8, and replace guards the rest).
std::string Shown(const Json& value) {
  std::string text = value.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (text.size() > 64) text = absl::StrCat(text.substr(0, 61), "...");
  return text;
}

// One JSON object and the dotted path it sits at, so every message names the field exactly as
// the operator would find it in config.json. Never throws: every access checks type first.
class Fields {
 public:
  Fields(const Json* object, std::string prefix) : object_(object), prefix_(std::move(prefix)) {}

  std::string Path(absl::string_view key) const { return absl::StrCat(prefix_, key); }

  // Present and not null (HF writes null for "off", e.g. Mistral's sliding_window).
  bool Has(absl::string_view key) const {
    const Json* value = Find(key);
    return value != nullptr && !value->is_null();
  }

  absl::StatusOr<std::optional<uint32_t>> OptionalUint(absl::string_view key) const {
    if (!Has(key)) return std::nullopt;
    const Json& value = *Find(key);
    if (!value.is_number_unsigned()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "field ", Path(key), ": expected a non-negative integer, got ", Shown(value)));
    }
    const uint64_t number = value.get<uint64_t>();
    if (number > std::numeric_limits<uint32_t>::max()) {
      return absl::InvalidArgumentError(
          absl::StrCat("field ", Path(key), ": ", number, " does not fit in 32 bits"));
    }
    return static_cast<uint32_t>(number);
  }

  absl::StatusOr<uint32_t> Uint(absl::string_view key, absl::string_view why) const {
    ASSIGN_OR_RETURN(std::optional<uint32_t> value, OptionalUint(key));
    if (!value.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("missing required field ", Path(key), " (", why, ")"));
    }
    return *value;
  }

  // Required and > 0.
  absl::StatusOr<uint32_t> PositiveUint(absl::string_view key, absl::string_view why) const {
    ASSIGN_OR_RETURN(uint32_t value, Uint(key, why));
    if (value == 0) {
      return absl::InvalidArgumentError(absl::StrCat("field ", Path(key), ": 0 (", why, ")"));
    }
    return value;
  }

  absl::StatusOr<std::optional<bool>> OptionalBool(absl::string_view key) const {
    if (!Has(key)) return std::nullopt;
    const Json& value = *Find(key);
    if (!value.is_boolean()) {
      return absl::InvalidArgumentError(
          absl::StrCat("field ", Path(key), ": expected true or false, got ", Shown(value)));
    }
    return value.get<bool>();
  }

  absl::StatusOr<std::optional<std::string>> OptionalString(absl::string_view key) const {
    if (!Has(key)) return std::nullopt;
    const Json& value = *Find(key);
    if (!value.is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat("field ", Path(key), ": expected a string, got ", Shown(value)));
    }
    return value.get<std::string>();
  }

  absl::StatusOr<std::optional<std::vector<std::string>>> OptionalStrings(
      absl::string_view key) const {
    if (!Has(key)) return std::nullopt;
    const Json& value = *Find(key);
    if (!value.is_array()) {
      return absl::InvalidArgumentError(
          absl::StrCat("field ", Path(key), ": expected a list of strings, got ", Shown(value)));
    }
    std::vector<std::string> out;
    for (size_t i = 0; i < value.size(); ++i) {
      if (!value[i].is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "field ", Path(key), "[", i, "]: expected a string, got ", Shown(value[i])));
      }
      out.push_back(value[i].get<std::string>());
    }
    return out;
  }

  absl::StatusOr<Fields> Object(absl::string_view key) const {
    if (!Has(key)) {
      return absl::InvalidArgumentError(absl::StrCat("missing required field ", Path(key)));
    }
    const Json* value = Find(key);
    if (!value->is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat("field ", Path(key), ": expected an object, got ", value->type_name()));
    }
    return Fields(value, absl::StrCat(Path(key), "."));
  }

 private:
  const Json* Find(absl::string_view key) const {
    auto it = object_->find(std::string(key));
    return it == object_->end() ? nullptr : &*it;
  }

  const Json* object_;  // an object; outlives this view
  std::string prefix_;
};

absl::StatusOr<uint32_t> ToU32(uint64_t value, absl::string_view what) {
  if (value > std::numeric_limits<uint32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " = ", value, " does not fit in 32 bits"));
  }
  return static_cast<uint32_t>(value);
}

absl::StatusOr<uint32_t> LayerCount(const Fields& fields) {
  ASSIGN_OR_RETURN(uint32_t layers, fields.PositiveUint("num_hidden_layers", "trunk layers"));
  if (layers > kMaxLayers) {
    return absl::InvalidArgumentError(absl::StrCat("field ", fields.Path("num_hidden_layers"), ": ",
                                                   layers, " layers exceeds ", kMaxLayers));
  }
  return layers;
}

absl::StatusOr<uint32_t> MtpCount(const Fields& fields, absl::string_view key,
                                  uint32_t trunk_layers) {
  ASSIGN_OR_RETURN(std::optional<uint32_t> blocks, fields.OptionalUint(key));
  if (blocks.value_or(0) > kMaxLayers - trunk_layers) {
    return absl::InvalidArgumentError(absl::StrCat("field ", fields.Path(key), ": ", *blocks,
                                                   " blocks on top of ", trunk_layers,
                                                   " layers exceeds ", kMaxLayers));
  }
  return blocks.value_or(0);
}

// K/V head geometry of a full-attention layer.
struct AttentionGeometry {
  uint32_t head_dim = 0;
  uint32_t n_head_kv = 0;
};

// num_key_value_heads defaults to num_attention_heads (no GQA) as in every HF config class;
// head_dim defaults to hidden_size / num_attention_heads unless `head_dim_required` (Gemma's
// config classes default head_dim to 256, not the quotient, so a missing one is an error).
absl::StatusOr<AttentionGeometry> ReadAttention(const Fields& fields, bool head_dim_required) {
  AttentionGeometry geometry;
  ASSIGN_OR_RETURN(std::optional<uint32_t> head_dim, fields.OptionalUint("head_dim"));
  if (head_dim_required && !head_dim.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("missing required field ", fields.Path("head_dim"), " (per-head dimension)"));
  }
  ASSIGN_OR_RETURN(std::optional<uint32_t> kv_heads, fields.OptionalUint("num_key_value_heads"));
  std::optional<uint32_t> q_heads;
  if (!kv_heads.has_value() || !head_dim.has_value()) {
    ASSIGN_OR_RETURN(q_heads, fields.PositiveUint("num_attention_heads", "query heads"));
  }
  geometry.n_head_kv = kv_heads.has_value() ? *kv_heads : *q_heads;
  if (geometry.n_head_kv == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("field ", fields.Path("num_key_value_heads"), ": 0 (K/V heads)"));
  }
  if (head_dim.has_value()) {
    if (*head_dim == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("field ", fields.Path("head_dim"), ": 0 (per-head dimension)"));
    }
    geometry.head_dim = *head_dim;
    return geometry;
  }
  ASSIGN_OR_RETURN(const uint32_t hidden, fields.PositiveUint("hidden_size", "model width"));
  if (hidden % *q_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "field ", fields.Path("hidden_size"), ": ", hidden, " is not divisible by ",
        fields.Path("num_attention_heads"), " ", *q_heads, " and there is no head_dim"));
  }
  geometry.head_dim = hidden / *q_heads;
  return geometry;
}

enum class LayerType { kFull, kSliding, kLinear };

// Parses `layer_types` (HF's per-layer list) when present; nullopt otherwise. Only the names in
// `accepted` are allowed; anything else (e.g. Llama 4's "chunked_attention") is refused by name.
absl::StatusOr<std::optional<std::vector<LayerType>>> ReadLayerTypes(
    const Fields& fields, uint32_t layers,
    const std::vector<std::pair<std::string, LayerType>>& accepted) {
  ASSIGN_OR_RETURN(std::optional<std::vector<std::string>> names,
                   fields.OptionalStrings("layer_types"));
  if (!names.has_value()) return std::nullopt;
  if (names->size() != layers) {
    return absl::InvalidArgumentError(absl::StrCat("field ", fields.Path("layer_types"), ": ",
                                                   names->size(), " entries for ", layers,
                                                   " layers (num_hidden_layers)"));
  }
  std::vector<LayerType> types;
  for (size_t i = 0; i < names->size(); ++i) {
    bool found = false;
    for (const auto& [name, type] : accepted) {
      if ((*names)[i] == name) {
        types.push_back(type);
        found = true;
        break;
      }
    }
    if (!found) {
      std::vector<std::string> names_accepted;
      for (const auto& entry : accepted) names_accepted.push_back(entry.first);
      return absl::InvalidArgumentError(absl::StrCat(
          "field ", fields.Path("layer_types"), "[", i, "]: \"", (*names)[i],
          "\" is not supported (accepted: ", absl::StrJoin(names_accepted, ", "), ")"));
    }
  }
  return types;
}

// Layer i is `every_nth` iff (i + 1) % period == 0, else `other` (HF's Gemma 3 / Qwen3-Next
// rule).
std::vector<LayerType> Periodic(uint32_t layers, uint32_t period, LayerType every_nth,
                                LayerType other) {
  std::vector<LayerType> types(layers, other);
  for (uint32_t i = 0; i < layers; ++i) {
    if ((i + 1) % period == 0) types[i] = every_nth;
  }
  return types;
}

bool AnyOf(const std::vector<LayerType>& types, LayerType type) {
  for (LayerType t : types) {
    if (t == type) return true;
  }
  return false;
}

LayerPlan KvLayer(uint32_t index, AttentionGeometry geometry, AttentionClass attention) {
  LayerPlan layer;
  layer.index = index;
  layer.kind = StateKind::kKv;
  layer.attention = attention;
  layer.head_dim_k = geometry.head_dim;
  layer.head_dim_v = geometry.head_dim;
  layer.n_head_kv = geometry.n_head_kv;
  return layer;
}

LayerPlan AttentionLayer(uint32_t index, LayerType type, AttentionGeometry geometry,
                         uint32_t window, AttentionClass full, AttentionClass sliding) {
  if (type != LayerType::kSliding) return KvLayer(index, geometry, full);
  LayerPlan layer = KvLayer(index, geometry, sliding);
  layer.kind = StateKind::kSlidingKv;
  layer.window = window;
  return layer;
}

// `sliding_window` is required (and > 0) once any layer slides.
absl::StatusOr<uint32_t> WindowFor(const Fields& fields, const std::vector<LayerType>& types) {
  if (!AnyOf(types, LayerType::kSliding)) return 0;
  return fields.PositiveUint("sliding_window", "sliding layers need their window");
}

const std::vector<std::pair<std::string, LayerType>>& AttentionTypeNames() {
  static const auto* names = new std::vector<std::pair<std::string, LayerType>>{
      {"full_attention", LayerType::kFull}, {"sliding_attention", LayerType::kSliding}};
  return *names;
}

absl::StatusOr<ModelPlan> ImportDense(const Fields& fields, absl::string_view architecture) {
  ASSIGN_OR_RETURN(const uint32_t layers, LayerCount(fields));
  ASSIGN_OR_RETURN(const AttentionGeometry geometry, ReadAttention(fields, false));
  ASSIGN_OR_RETURN(std::optional<std::vector<LayerType>> listed,
                   ReadLayerTypes(fields, layers, AttentionTypeNames()));
  std::vector<LayerType> types(layers, LayerType::kFull);
  if (listed.has_value()) {
    types = *std::move(listed);
  } else if (architecture == "MistralForCausalLM") {
    // Mistral 7B v0.1 slides every layer; later versions write sliding_window: null.
    if (fields.Has("sliding_window")) types.assign(layers, LayerType::kSliding);
  } else if (architecture == "Qwen2ForCausalLM" || architecture == "Qwen3ForCausalLM") {
    // Qwen writes sliding_window even when it is off; use_sliding_window decides, and then only
    // layers from max_window_layers on slide.
    ASSIGN_OR_RETURN(std::optional<bool> use_sliding, fields.OptionalBool("use_sliding_window"));
    if (use_sliding.value_or(false)) {
      ASSIGN_OR_RETURN(const uint32_t first,
                       fields.Uint("max_window_layers", "use_sliding_window is true"));
      for (uint32_t i = first; i < layers; ++i) types[i] = LayerType::kSliding;
    }
  }
  ASSIGN_OR_RETURN(const uint32_t window, WindowFor(fields, types));
  ModelPlan plan;
  for (uint32_t i = 0; i < layers; ++i) {
    plan.layers.push_back(AttentionLayer(i, types[i], geometry, window, AttentionClass::kOrdinary,
                                         AttentionClass::kOrdinary));
  }
  return plan;
}

absl::StatusOr<ModelPlan> ImportGemma(const Fields& fields, absl::string_view architecture) {
  ASSIGN_OR_RETURN(const uint32_t layers, LayerCount(fields));
  ASSIGN_OR_RETURN(const AttentionGeometry geometry, ReadAttention(fields, true));
  ASSIGN_OR_RETURN(std::optional<std::vector<LayerType>> listed,
                   ReadLayerTypes(fields, layers, AttentionTypeNames()));
  std::vector<LayerType> types;
  if (listed.has_value()) {
    types = *std::move(listed);
  } else {
    ASSIGN_OR_RETURN(std::optional<uint32_t> pattern,
                     fields.OptionalUint("sliding_window_pattern"));
    // HF's defaults: Gemma 2 alternates (layer 0 local); Gemma 3 has 5 local : 1 global.
    const uint32_t period = pattern.value_or(architecture == "Gemma2ForCausalLM" ? 2 : 6);
    if (period == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "field ", fields.Path("sliding_window_pattern"), ": 0 (every Nth layer is global)"));
    }
    types = Periodic(layers, period, LayerType::kFull, LayerType::kSliding);
  }
  ASSIGN_OR_RETURN(const uint32_t window, WindowFor(fields, types));
  ASSIGN_OR_RETURN(std::optional<uint32_t> shared, fields.OptionalUint("num_kv_shared_layers"));
  const uint32_t first_shared = layers - std::min(shared.value_or(0), layers);
  if (shared.value_or(0) >= layers) {
    return absl::InvalidArgumentError(absl::StrCat("field ", fields.Path("num_kv_shared_layers"),
                                                   ": ", *shared, " of ", layers,
                                                   " layers leaves none owning K/V"));
  }
  ModelPlan plan;
  for (uint32_t i = 0; i < layers; ++i) {
    if (i < first_shared) {
      plan.layers.push_back(AttentionLayer(i, types[i], geometry, window,
                                           AttentionClass::kGemmaGlobal,
                                           AttentionClass::kGemmaWindowed));
      continue;
    }
    // Gemma 3n: a shared layer attends the last K/V-owning layer of its own type.
    std::optional<uint32_t> target;
    for (uint32_t j = first_shared; j-- > 0;) {
      if (types[j] == types[i]) {
        target = j;
        break;
      }
    }
    if (!target.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("field ", fields.Path("num_kv_shared_layers"), ": shared layer ", i, " (",
                       types[i] == LayerType::kSliding ? "sliding" : "full",
                       ") has no earlier layer of its type to share K/V with"));
    }
    LayerPlan layer;
    layer.index = i;
    layer.kind = StateKind::kSharedKv;
    layer.shares_kv_with = *target;
    plan.layers.push_back(layer);
  }
  return plan;
}

absl::StatusOr<ModelPlan> ImportMla(const Fields& fields, const ImportOptions& options) {
  ASSIGN_OR_RETURN(const uint32_t layers, LayerCount(fields));
  ASSIGN_OR_RETURN(const uint32_t kv_rank,
                   fields.PositiveUint("kv_lora_rank", "the MLA latent width"));
  ASSIGN_OR_RETURN(const uint32_t rope,
                   fields.Uint("qk_rope_head_dim", "the latent row's rope tail; 0 for NoPE"));
  ASSIGN_OR_RETURN(const uint64_t width_wide, CheckedAdd(kv_rank, rope, "latent width"));
  ASSIGN_OR_RETURN(const uint32_t width,
                   ToU32(width_wide, "latent width (kv_lora_rank + qk_rope_head_dim)"));
  LayerPlan shape;
  shape.kind = StateKind::kLatent;
  shape.latent_width = width;
  ASSIGN_OR_RETURN(std::optional<uint32_t> index_head_dim, fields.OptionalUint("index_head_dim"));
  if (index_head_dim.has_value()) {
    if (*index_head_dim == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("field ", fields.Path("index_head_dim"), ": 0 (DSA indexer width)"));
    }
    ASSIGN_OR_RETURN(const uint64_t index_width, CheckedMul(2, *index_head_dim, "index width"));
    ASSIGN_OR_RETURN(shape.index_width, ToU32(index_width, "index width (2 x index_head_dim)"));
    ASSIGN_OR_RETURN(std::optional<uint32_t> pool, fields.OptionalUint("index_kpool"));
    shape.index_pool = pool.has_value() ? *pool : options.index_pool.value_or(1);
    if (shape.index_pool == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          pool.has_value() ? absl::StrCat("field ", fields.Path("index_kpool")) : "index_pool",
          ": 0 (tokens per DSA pool key)"));
    }
  }
  ASSIGN_OR_RETURN(const uint32_t mtp, MtpCount(fields, "num_nextn_predict_layers", layers));
  ModelPlan plan;
  for (uint32_t i = 0; i < layers + mtp; ++i) {
    LayerPlan layer = shape;
    layer.index = i;
    (i < layers ? plan.layers : plan.mtp_blocks).push_back(layer);
  }
  return plan;
}

absl::StatusOr<ModelPlan> ImportQwen3Next(const Fields& fields) {
  ASSIGN_OR_RETURN(const uint32_t layers, LayerCount(fields));
  ASSIGN_OR_RETURN(std::optional<std::vector<LayerType>> listed,
                   ReadLayerTypes(fields, layers,
                                  {{"full_attention", LayerType::kFull},
                                   {"linear_attention", LayerType::kLinear}}));
  std::vector<LayerType> types;
  if (listed.has_value()) {
    types = *std::move(listed);
  } else {
    ASSIGN_OR_RETURN(
        const uint32_t interval,
        fields.PositiveUint("full_attention_interval", "every Nth layer is full attention"));
    types = Periodic(layers, interval, LayerType::kFull, LayerType::kLinear);
  }
  ASSIGN_OR_RETURN(const uint32_t mtp, MtpCount(fields, "mtp_num_hidden_layers", layers));
  AttentionGeometry geometry;
  if (AnyOf(types, LayerType::kFull) || mtp > 0) {
    ASSIGN_OR_RETURN(geometry, ReadAttention(fields, false));
  }
  LayerPlan linear;
  linear.kind = StateKind::kRecurrent;
  if (AnyOf(types, LayerType::kLinear)) {
    constexpr absl::string_view kWhy = "Gated DeltaNet state";
    ASSIGN_OR_RETURN(const uint32_t k_heads, fields.PositiveUint("linear_num_key_heads", kWhy));
    ASSIGN_OR_RETURN(const uint32_t v_heads, fields.PositiveUint("linear_num_value_heads", kWhy));
    ASSIGN_OR_RETURN(const uint32_t k_dim, fields.PositiveUint("linear_key_head_dim", kWhy));
    ASSIGN_OR_RETURN(const uint32_t v_dim, fields.PositiveUint("linear_value_head_dim", kWhy));
    ASSIGN_OR_RETURN(linear.conv_kernel, fields.PositiveUint("linear_conv_kernel_dim", kWhy));
    // Conv runs over the q, k and v channels: 2 x keys + values.
    ASSIGN_OR_RETURN(const uint64_t key_dim, CheckedMul(k_heads, k_dim, "linear key dim"));
    ASSIGN_OR_RETURN(const uint64_t value_dim, CheckedMul(v_heads, v_dim, "linear value dim"));
    ASSIGN_OR_RETURN(const uint64_t qk_dim, CheckedMul(2, key_dim, "linear conv width"));
    ASSIGN_OR_RETURN(const uint64_t conv, CheckedAdd(qk_dim, value_dim, "linear conv width"));
    ASSIGN_OR_RETURN(linear.conv_width, ToU32(conv, "linear conv width"));
    ASSIGN_OR_RETURN(const uint64_t per_head, CheckedMul(k_dim, v_dim, "linear state width"));
    ASSIGN_OR_RETURN(const uint64_t state, CheckedMul(v_heads, per_head, "linear state width"));
    ASSIGN_OR_RETURN(linear.state_width, ToU32(state, "linear state width"));
  }
  ModelPlan plan;
  for (uint32_t i = 0; i < layers; ++i) {
    if (types[i] == LayerType::kFull) {
      plan.layers.push_back(KvLayer(i, geometry, AttentionClass::kOrdinary));
    } else {
      LayerPlan layer = linear;
      layer.index = i;
      plan.layers.push_back(layer);
    }
  }
  for (uint32_t i = layers; i < layers + mtp; ++i) {
    plan.mtp_blocks.push_back(KvLayer(i, geometry, AttentionClass::kOrdinary));
  }
  return plan;
}

absl::StatusOr<ModelPlan> ImportJamba(const Fields& fields) {
  ASSIGN_OR_RETURN(const uint32_t layers, LayerCount(fields));
  ASSIGN_OR_RETURN(const uint32_t period,
                   fields.PositiveUint("attn_layer_period", "attention every N layers"));
  ASSIGN_OR_RETURN(const uint32_t offset,
                   fields.Uint("attn_layer_offset", "first attention layer"));
  if (offset >= period) {
    return absl::InvalidArgumentError(absl::StrCat(
        "field ", fields.Path("attn_layer_offset"), ": ", offset, " is not below ",
        fields.Path("attn_layer_period"), " ", period, " (no layer would be attention)"));
  }
  ASSIGN_OR_RETURN(const AttentionGeometry geometry, ReadAttention(fields, false));
  constexpr absl::string_view kWhy = "Mamba state";
  ASSIGN_OR_RETURN(const uint32_t hidden, fields.PositiveUint("hidden_size", kWhy));
  ASSIGN_OR_RETURN(const uint32_t expand, fields.PositiveUint("mamba_expand", kWhy));
  ASSIGN_OR_RETURN(const uint32_t d_state, fields.PositiveUint("mamba_d_state", kWhy));
  LayerPlan mamba;
  mamba.kind = StateKind::kRecurrent;
  ASSIGN_OR_RETURN(mamba.conv_kernel, fields.PositiveUint("mamba_d_conv", kWhy));
  ASSIGN_OR_RETURN(const uint64_t d_inner, CheckedMul(expand, hidden, "mamba d_inner"));
  ASSIGN_OR_RETURN(mamba.conv_width, ToU32(d_inner, "mamba d_inner (mamba_expand x hidden_size)"));
  ASSIGN_OR_RETURN(const uint64_t state, CheckedMul(d_inner, d_state, "mamba state width"));
  ASSIGN_OR_RETURN(mamba.state_width, ToU32(state, "mamba state width (d_inner x d_state)"));
  ModelPlan plan;
  for (uint32_t i = 0; i < layers; ++i) {
    if (i % period == offset) {
      plan.layers.push_back(KvLayer(i, geometry, AttentionClass::kOrdinary));
    } else {
      LayerPlan layer = mamba;
      layer.index = i;
      plan.layers.push_back(layer);
    }
  }
  return plan;
}

absl::StatusOr<const Architecture*> FindArchitecture(const Fields& top) {
  ASSIGN_OR_RETURN(std::optional<std::vector<std::string>> architectures,
                   top.OptionalStrings("architectures"));
  if (!architectures.has_value() || architectures->empty()) {
    return absl::InvalidArgumentError(
        "missing required field architectures (the model class, e.g. LlamaForCausalLM)");
  }
  const std::string& name = architectures->front();
  for (const Architecture& architecture : kArchitectures) {
    if (name == architecture.name) return &architecture;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("architecture ", name, " (field architectures[0]) is not supported; supported: ",
                   absl::StrJoin(SupportedHuggingFaceArchitectures(), ", ")));
}

// The config.json text as a JSON object; INVALID_ARGUMENT otherwise.
absl::StatusOr<Json> ParseConfigObject(absl::string_view json_text) {
  Json root = Json::parse(json_text.begin(), json_text.end(), nullptr,
                          /*allow_exceptions=*/false);
  if (root.is_discarded()) {
    return absl::InvalidArgumentError("config.json is not valid JSON");
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json must be a JSON object, got ", root.type_name()));
  }
  return root;
}

// An element format by any name an engine or a config uses for it.
std::optional<ElementFormat> ElementFormatByAlias(absl::string_view name) {
  static const std::pair<absl::string_view, ElementFormat> kAliases[] = {
      {"bf16", ElementFormat::kBf16},         {"bfloat16", ElementFormat::kBf16},
      {"f16", ElementFormat::kF16},           {"fp16", ElementFormat::kF16},
      {"float16", ElementFormat::kF16},       {"half", ElementFormat::kF16},
      {"f32", ElementFormat::kF32},           {"fp32", ElementFormat::kF32},
      {"float32", ElementFormat::kF32},       {"float", ElementFormat::kF32},
      {"fp8_e4m3", ElementFormat::kFp8E4m3},  {"fp8_e5m2", ElementFormat::kFp8E5m2},
  };
  for (const auto& [alias, format] : kAliases) {
    if (name == alias) return format;
  }
  return std::nullopt;
}

KvDtypeChoice AllIn(ElementFormat element) {
  return {KvDtypeChoice::Mode::kExplicit, {KFormatOf(element), VFormatOf(element)}, element};
}

// What --kv-dtype=auto means for this config, and the words that say why.
absl::StatusOr<std::pair<KvDtypeChoice, std::string>> AutoKvDtype(const Fields& top,
                                                                  const Fields& text) {
  if (top.Has("quantization_config")) {
    ASSIGN_OR_RETURN(const Fields quantization, top.Object("quantization_config"));
    if (quantization.Has("kv_cache_scheme")) {
      ASSIGN_OR_RETURN(const Fields scheme, quantization.Object("kv_cache_scheme"));
      ASSIGN_OR_RETURN(std::optional<std::string> type, scheme.OptionalString("type"));
      ASSIGN_OR_RETURN(std::optional<uint32_t> bits, scheme.OptionalUint("num_bits"));
      if (type != "float" || bits != 8) {
        return absl::InvalidArgumentError(absl::StrCat(
            "field ", quantization.Path("kv_cache_scheme"), ": type ", type.value_or("(unset)"),
            " with num_bits ", bits.has_value() ? absl::StrCat(*bits) : "(unset)",
            " is not an fp8 KV cache (float, 8 bits); say --kv-dtype"));
      }
      return std::make_pair(AllIn(ElementFormat::kFp8E4m3),
                            absl::StrCat("fp8_e4m3 from ", quantization.Path("kv_cache_scheme")));
    }
    ASSIGN_OR_RETURN(std::optional<std::string> algo,
                     quantization.OptionalString("kv_cache_quant_algo"));
    if (algo.has_value()) {
      if (*algo != "FP8") {
        return absl::InvalidArgumentError(absl::StrCat(
            "field ", quantization.Path("kv_cache_quant_algo"), ": \"", *algo,
            "\" is not an fp8 KV cache (FP8); say --kv-dtype"));
      }
      return std::make_pair(AllIn(ElementFormat::kFp8E4m3),
                            absl::StrCat("fp8_e4m3 from ",
                                         quantization.Path("kv_cache_quant_algo")));
    }
  }
  // The text model's dtype first (a multimodal config's text_config), then the top level's.
  for (const Fields* fields : {&text, &top}) {
    for (absl::string_view key : {"torch_dtype", "dtype"}) {
      ASSIGN_OR_RETURN(std::optional<std::string> dtype, fields->OptionalString(key));
      if (!dtype.has_value()) continue;
      const std::optional<ElementFormat> element = ElementFormatByAlias(*dtype);
      if (!element.has_value() || LayoutOf(*element).scaled) {
        return absl::InvalidArgumentError(absl::StrCat(
            "field ", fields->Path(key), ": \"", *dtype,
            "\" is not a KV cache dtype (bfloat16 | float16 | float32); say --kv-dtype"));
      }
      return std::make_pair(AllIn(*element),
                            absl::StrCat(std::string(ElementFormatName(*element)), " from ",
                                         fields->Path(key), " ", *dtype));
    }
  }
  // Nothing to go by: the daemon's defaults decide, as before this option existed.
  return std::make_pair(KvDtypeChoice{KvDtypeChoice::Mode::kReference, {}, {}},
                        std::string("reference: the config names no torch_dtype"));
}

void ApplyKvDtype(const KvDtypeChoice& choice, ModelPlan& plan) {
  if (choice.mode != KvDtypeChoice::Mode::kExplicit) return;
  for (std::vector<LayerPlan>* group : {&plan.layers, &plan.mtp_blocks}) {
    for (LayerPlan& layer : *group) {
      if (layer.kind == StateKind::kKv || layer.kind == StateKind::kSlidingKv) {
        layer.formats = choice.formats;
      } else if (layer.kind == StateKind::kLatent && choice.latent.has_value()) {
        layer.latent_format = *choice.latent;
      }
    }
  }
}

}  // namespace

absl::StatusOr<KvDtypeChoice> ParseKvDtype(absl::string_view text) {
  if (text.empty() || text == "auto") return KvDtypeChoice{};
  if (text == "reference") return KvDtypeChoice{KvDtypeChoice::Mode::kReference, {}, {}};
  if (const std::optional<ElementFormat> element = ElementFormatByAlias(text)) {
    return AllIn(*element);
  }
  const size_t slash = text.find('/');
  if (slash != absl::string_view::npos) {
    absl::StatusOr<KFormat> k = ParseKFormat(std::string(text.substr(0, slash)));
    absl::StatusOr<VFormat> v = ParseVFormat(std::string(text.substr(slash + 1)));
    if (k.ok() && v.ok()) {
      return KvDtypeChoice{KvDtypeChoice::Mode::kExplicit, {*k, *v}, std::nullopt};
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv-dtype ", std::string(text), ": ", (k.ok() ? v.status() : k.status()).message()));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--kv-dtype ", std::string(text),
      " unsupported (auto | reference | bf16 | fp16 | f32 | fp8_e4m3 | fp8_e5m2 | a K/V pair "
      "such as q8_0/q5_1)"));
}

std::vector<std::string> SupportedHuggingFaceArchitectures() {
  std::vector<std::string> names;
  for (const Architecture& architecture : kArchitectures) names.push_back(architecture.name);
  return names;
}

absl::StatusOr<std::string> HuggingFaceArchitecture(absl::string_view json_text) {
  ASSIGN_OR_RETURN(const Json root, ParseConfigObject(json_text));
  ASSIGN_OR_RETURN(const Architecture* architecture, FindArchitecture(Fields(&root, "")));
  return std::string(architecture->name);
}

absl::StatusOr<ModelPlan> ImportHuggingFaceConfig(absl::string_view json_text,
                                                  const ImportOptions& options) {
  ASSIGN_OR_RETURN(ImportedModel imported, ImportHuggingFaceModel(json_text, options));
  return std::move(imported.plan);
}

absl::StatusOr<ImportedModel> ImportHuggingFaceModel(absl::string_view json_text,
                                                     const ImportOptions& options) {
  ASSIGN_OR_RETURN(const KvDtypeChoice asked, ParseKvDtype(options.kv_dtype));
  ASSIGN_OR_RETURN(const Json root, ParseConfigObject(json_text));
  const Fields top(&root, "");
  ASSIGN_OR_RETURN(const Architecture* architecture, FindArchitecture(top));
  Fields fields = top;
  if (architecture->text_config) {
    ASSIGN_OR_RETURN(fields, top.Object("text_config"));
  }

  absl::StatusOr<ModelPlan> plan;
  switch (architecture->family) {
    case Family::kDense:
      plan = ImportDense(fields, architecture->name);
      break;
    case Family::kGemma:
      plan = ImportGemma(fields, architecture->name);
      break;
    case Family::kMla:
      plan = ImportMla(fields, options);
      break;
    case Family::kQwen3Next:
      plan = ImportQwen3Next(fields);
      break;
    case Family::kJamba:
      plan = ImportJamba(fields);
      break;
  }
  if (!plan.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(architecture->name, ": ", plan.status().message()));
  }

  ASSIGN_OR_RETURN(std::optional<std::string> path, top.OptionalString("_name_or_path"));
  ASSIGN_OR_RETURN(std::optional<std::string> model_type, fields.OptionalString("model_type"));
  if (!options.name.empty()) {
    plan->name = options.name;
  } else if (path.has_value() && !path->empty()) {
    plan->name = *path;
  } else {
    plan->name = model_type.value_or(architecture->name);
  }
  plan->swa_ring = options.swa_ring;
  plan->index_ring_rows = options.index_ring_rows;

  ImportedModel imported;
  KvDtypeChoice choice = asked;
  switch (asked.mode) {
    case KvDtypeChoice::Mode::kAuto: {
      absl::StatusOr<std::pair<KvDtypeChoice, std::string>> automatic = AutoKvDtype(top, fields);
      if (!automatic.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat(architecture->name, ": ", automatic.status().message()));
      }
      choice = automatic->first;
      imported.kv_dtype = automatic->second;
      break;
    }
    case KvDtypeChoice::Mode::kReference:
      imported.kv_dtype = "reference: the daemon's format defaults per attention class";
      break;
    case KvDtypeChoice::Mode::kExplicit:
      imported.kv_dtype = absl::StrCat("--kv-dtype ", options.kv_dtype);
      break;
  }
  ApplyKvDtype(choice, *plan);

  // The geometry came from a file: a plan that breaks a structural rule (e.g. head_dim not a
  // multiple of 32 for a block format) is the config's problem, reported as such.
  absl::Status valid = ValidateModelPlan(*plan);
  if (!valid.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(architecture->name, ": the imported plan is not valid: ", valid.message()));
  }
  imported.plan = *std::move(plan);
  return imported;
}

}  // namespace memra
