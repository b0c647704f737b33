#ifndef MEMRA_SERVER_MODEL_IMPORT_H_
#define MEMRA_SERVER_MODEL_IMPORT_H_

// Hugging Face `config.json` -> memra::ModelPlan (`memra-kvctl import-model`, KvAdmin.ImportModel;
// plans: docs/rules.md#model-plans-and-fingerprints). Lives in server/, not core/, because it
// parses JSON. "The reference" below: docs/rules.md#the-reference.
//
// Supported `architectures[0]` and the fields read (every other field is ignored):
//   dense      LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM:
//              num_hidden_layers, num_attention_heads, num_key_value_heads (default
//              num_attention_heads), head_dim (default hidden_size / num_attention_heads).
//              Sliding layers: `layer_types` ("full_attention" | "sliding_attention") when
//              present; else Mistral: `sliding_window` non-null => every layer sliding; Qwen2/3:
//              `use_sliding_window` true => layers >= `max_window_layers` sliding (HF's rule).
//   Gemma      Gemma2ForCausalLM, Gemma3ForCausalLM (model_type gemma3_text),
//              Gemma3ForConditionalGeneration and Gemma3nForCausalLM /
//              Gemma3nForConditionalGeneration (their `text_config` object): num_hidden_layers,
//              num_key_value_heads, head_dim (required: HF's default differs from hidden/heads),
//              sliding_window; `layer_types` when present, else `sliding_window_pattern`
//              (layer i global iff (i + 1) % pattern == 0; HF defaults: Gemma 2 -> 2,
//              Gemma 3 -> 6). Globals are kKv/kGemmaGlobal, windowed kSlidingKv/kGemmaWindowed.
//              `num_kv_shared_layers` N: the last N layers are kSharedKv, each attending the last
//              earlier non-shared layer of its own type (Gemma 3n).
//   MLA        DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, DeepseekV32ForCausalLM:
//              num_hidden_layers, kv_lora_rank, qk_rope_head_dim (latent_width = their sum),
//              num_nextn_predict_layers (MTP blocks of the same shape). DSA indexer when
//              `index_head_dim` is present: index_width = 2 x index_head_dim (the GLM k-pool row:
//              keys + compress gate), pool = `index_kpool` (the reference's Glm5Config field),
//              else ImportOptions::index_pool, else 1 (the reference's charge: it only ever
//              over-reserves).
//   hybrid     Qwen3NextForCausalLM: `layer_types` ("full_attention" | "linear_attention") or
//              `full_attention_interval` (layer i full iff (i + 1) % interval == 0); full layers
//              as dense (head_dim, num_key_value_heads); Gated DeltaNet layers:
//              conv_width = 2 x linear_num_key_heads x linear_key_head_dim
//                           + linear_num_value_heads x linear_value_head_dim,
//              conv_kernel = linear_conv_kernel_dim,
//              state_width = linear_num_value_heads x linear_key_head_dim x linear_value_head_dim.
//              `mtp_num_hidden_layers` N adds N MTP blocks shaped as the full-attention layers.
//   Mamba      JambaForCausalLM: attention at layer i iff i % attn_layer_period ==
//              attn_layer_offset (dense geometry); the others Mamba with
//              d_inner = mamba_expand x hidden_size, conv_width = d_inner,
//              conv_kernel = mamba_d_conv, state_width = d_inner x mamba_d_state.
//
// K/V formats follow ImportOptions::kv_dtype (ParseKvDtype):
//   auto       (the default) the dtype the engine keeps its cache in: an fp8 KV cache when the
//              config's `quantization_config` declares one (compressed-tensors `kv_cache_scheme`
//              {type: float, num_bits: 8}, or ModelOpt `kv_cache_quant_algo` "FP8") -> fp8_e4m3
//              (the per-tensor / per-head scales live in the checkpoint: the engine puts them
//              in the plan's k_scale / v_scale); else `torch_dtype` (or `dtype`; the text
//              config's first): bfloat16 -> bf16, float16 -> f16, float32 -> f32. Every K/V
//              layer and every latent row takes that element format. A config that names no
//              dtype gets `reference` (below), as imports did before this option.
//   reference  formats left unset: the daemon's FormatDefaults (the reference's environment
//              doors) decide per attention class, with the reference's block formats; latent
//              rows f32.
//   ELEMENT    bf16 | f16 (fp16) | f32 | fp8_e4m3 | fp8_e5m2: every K/V layer and latent row.
//   K/V        a pair of K and V format names (q8_0/q5_1, fp8/fp8, bf16/q4_0, ...): every K/V
//              layer; latent rows f32.
// Every refusal is INVALID_ARGUMENT naming the field (dotted path, e.g. "text_config.head_dim")
// or architecture and the value. The result passes ValidateModelPlan.
//
// Thread-safety: pure functions over values.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/model_plan.h"

namespace memra {

struct ImportOptions {
  // The plan's `name`; empty: the config's `_name_or_path`, else its `model_type`, else the
  // architecture.
  std::string name;
  // ModelPlan::swa_ring for the imported plan (sliding layers use the SWA ring).
  bool swa_ring = false;
  // ModelPlan::index_ring_rows (unset: the default working rows; 0: flat indexer plane).
  std::optional<uint32_t> index_ring_rows;
  // DSA indexer pool (tokens per pool key) when the config has no `index_kpool`.
  std::optional<uint32_t> index_pool;
  // Which K/V formats the plan gets (the header comment; ParseKvDtype): "" means "auto".
  std::string kv_dtype;
};

// A parsed --kv-dtype. kAuto reads the config; kReference leaves formats unset; kExplicit sets
// `formats` on every K/V layer and `latent` (when set) on every latent row.
struct KvDtypeChoice {
  enum class Mode { kAuto, kReference, kExplicit };
  Mode mode = Mode::kAuto;
  KvFormats formats;
  std::optional<ElementFormat> latent;
};
// INVALID_ARGUMENT naming the value and the accepted forms.
absl::StatusOr<KvDtypeChoice> ParseKvDtype(absl::string_view text);

// An imported plan and what chose its K/V formats, for the operator ("bf16 from torch_dtype
// bfloat16", "fp8_e4m3 from quantization_config.kv_cache_scheme", "--kv-dtype q8_0/q5_1",
// "reference: the daemon's format defaults").
struct ImportedModel {
  ModelPlan plan;
  std::string kv_dtype;
};
absl::StatusOr<ImportedModel> ImportHuggingFaceModel(absl::string_view json_text,
                                                     const ImportOptions& options);

// The values of architectures[0] this importer accepts, for help text.
std::vector<std::string> SupportedHuggingFaceArchitectures();

// ImportHuggingFaceModel's plan.
absl::StatusOr<ModelPlan> ImportHuggingFaceConfig(absl::string_view json_text,
                                                  const ImportOptions& options);

// The supported architecture the config names (its architectures[0]); INVALID_ARGUMENT as
// ImportHuggingFaceConfig refuses it.
absl::StatusOr<std::string> HuggingFaceArchitecture(absl::string_view json_text);

}  // namespace memra

#endif  // MEMRA_SERVER_MODEL_IMPORT_H_
