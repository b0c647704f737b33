#include "server/session/model_import.h"

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/admission.h"
#include "core/arena_layout.h"
#include "core/formats.h"
#include "core/model_plan.h"
#include "core/sizing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;

std::string ReadConfig(const std::string& file) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const std::string path =
      absl::StrCat(srcdir == nullptr ? "." : srcdir, "/memra_kv/tests/data/hf_configs/", file);
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The reference's formats: FormatDefaults decide (what the geometry tests below work out).
ImportOptions Reference() {
  ImportOptions options;
  options.kv_dtype = "reference";
  return options;
}

ModelPlan Import(const std::string& file, const ImportOptions& options = Reference()) {
  absl::StatusOr<ModelPlan> plan = ImportHuggingFaceConfig(ReadConfig(file), options);
  EXPECT_THAT(plan, IsOk()) << file;
  return plan.ok() ? *std::move(plan) : ModelPlan{};
}

// Costs at 8192 tokens (a multiple of every pool, so total == fixed + 8192 x bytes_per_token).
CostBreakdown Cost(const ModelPlan& plan) {
  SessionShape request;
  request.capacity = 8192;
  absl::StatusOr<CostBreakdown> cost = CostOfSession(plan, FormatDefaults{}, request);
  EXPECT_THAT(cost, IsOk()) << plan.name;
  return cost.ok() ? *cost : CostBreakdown{};
}

// bytes_per_token of layers [0, layer_hi): the trunk without its MTP blocks.
uint64_t TrunkBytesPerToken(const ModelPlan& plan, uint32_t layer_hi) {
  SessionShape request;
  request.capacity = 8192;
  request.layer_hi = layer_hi;
  absl::StatusOr<CostBreakdown> cost = CostOfSession(plan, FormatDefaults{}, request);
  EXPECT_THAT(cost, IsOk()) << plan.name;
  return cost.ok() ? cost->bytes_per_token : 0;
}

size_t CountKind(const ModelPlan& plan, StateKind kind) {
  size_t count = 0;
  for (const LayerPlan* layer : plan.AllLayers()) count += layer->kind == kind ? 1 : 0;
  return count;
}

// What each published config imports to, with its bytes per token worked out by hand. Default
// formats: ordinary K q8_0 (34 B / 32 elements) and V q5_1 (24 B / 32), so a K/V layer with
// kv_dim D = n_head_kv x head_dim costs D x 58 / 32 B/token; Gemma classes are fp8/fp8, 2 x D.
// Latent rows are f32: 4 x width. Ring off (the import default).
struct PublishedConfig {
  const char* file;
  size_t trunk_layers;
  size_t mtp_blocks;
  size_t kv;  // layers of each kind, MTP blocks included
  size_t sliding;
  size_t shared;
  size_t recurrent;
  size_t latent;
  uint64_t bytes_per_token;  // CostOfSession at capacity 8192 (a multiple of every pool)
};

const PublishedConfig kPublished[] = {
    // 32 x (8 KV heads x 128: D = 1024 -> 1856) = 59392.
    {"llama-3.1-8b.json", 32, 0, 32, 0, 0, 0, 0, 59392},
    // head_dim 3584 / 28 = 128, 4 KV heads: D = 512 -> 928; x 28 = 25984. sliding_window is
    // written but use_sliding_window is false: every layer is full attention.
    {"qwen2.5-7b.json", 28, 0, 28, 0, 0, 0, 0, 25984},
    // 32 sliding layers (window 4096), D = 1024, flat while the ring is off: 59392.
    {"mistral-7b-v0.1.json", 32, 0, 0, 32, 0, 0, 0, 59392},
    // text_config: 62 layers, 16 KV heads x 128 (D = 2048), pattern 6: globals at 5, 11, ...,
    // 59 (10), 52 windowed; fp8/fp8 4096 per layer: 62 x 4096 = 253952.
    {"gemma-3-27b-it.json", 62, 0, 10, 52, 0, 0, 0, 253952},
    // E4B: 35 layers, 4 sliding : 1 full, last 15 share K/V; 20 owners x (2 x 256: D = 512)
    // x fp8 (1024) = 20480.
    {"gemma-3n-e4b-it.json", 35, 0, 4, 16, 15, 0, 0, 20480},
    // 61 MLA layers + 1 NextN block, latent 512 + 64 = 576 f32 = 2304: 62 x 2304 = 142848.
    {"deepseek-v3.json", 61, 1, 0, 0, 0, 0, 62, 142848},
    // index_head_dim 128 -> index_width 256 (a fixed tail ring by default); no index_kpool:
    // pool 1, pool keys 128 f32 = 512 per token: 62 x (2304 + 512) = 174592.
    {"deepseek-v3.2-exp.json", 61, 1, 0, 0, 0, 0, 62, 174592},
    // Full attention at 3, 7, ..., 47 (12) + 1 MTP block, 2 KV heads x 256 (D = 512 -> 928):
    // 13 x 928 = 12064. 36 Gated DeltaNet layers are fixed state, 0 per token.
    {"qwen3-next-80b-a3b.json", 48, 1, 13, 0, 0, 36, 0, 12064},
    // Attention at 4, 12, 20, 28 (period 8, offset 4), D = 1024: 4 x 1856 = 7424; 28 Mamba
    // layers are fixed state.
    {"jamba-v0.1.json", 32, 0, 4, 0, 0, 28, 0, 7424},
};

TEST(ImportHuggingFaceConfigTest, PublishedConfigsImportWithTheirWorkedBytesPerToken) {
  for (const PublishedConfig& expected : kPublished) {
    SCOPED_TRACE(expected.file);
    const ModelPlan plan = Import(expected.file);
    EXPECT_EQ(plan.layers.size(), expected.trunk_layers);
    EXPECT_EQ(plan.mtp_blocks.size(), expected.mtp_blocks);
    EXPECT_EQ(CountKind(plan, StateKind::kKv), expected.kv);
    EXPECT_EQ(CountKind(plan, StateKind::kSlidingKv), expected.sliding);
    EXPECT_EQ(CountKind(plan, StateKind::kSharedKv), expected.shared);
    EXPECT_EQ(CountKind(plan, StateKind::kRecurrent), expected.recurrent);
    EXPECT_EQ(CountKind(plan, StateKind::kLatent), expected.latent);
    for (const LayerPlan* layer : plan.AllLayers()) {
      EXPECT_FALSE(layer->formats.has_value());  // FormatDefaults decide
    }
    EXPECT_EQ(Cost(plan).bytes_per_token, expected.bytes_per_token);
  }
}

// Admission at capacity 8192 in the dtype an engine keeps its cache in, worked out by hand, for
// the four families of docs/rules.md#formats: plane bytes, the per-token coefficient, and the
// arena admission charges (planes 256-aligned in layer order, the arena rounded to 4 KiB pages):
// cost == charge == allocation.
struct DtypeAdmission {
  const char* file;
  const char* kv_dtype;
  uint64_t bytes_per_token;
  uint64_t total_bytes;  // planes, unrounded
  uint64_t arena_bytes;  // what admission charges and the daemon allocates
};

const DtypeAdmission kDtypeAdmissions[] = {
    // Llama-3.1-8B, 32 x 8 KV heads x 128 = 1024 elements for K and for V.
    // bf16: 2048 + 2048 = 4096 B/token/layer, x 32 = 131072. Planes: K and V 8192 x 2048 + 8
    // (tail pad) = 16,777,224 each, len mirror 4: 131072 x 8192 + 32 x 20 = 1,073,742,464.
    // Arena: per layer 2 x 16,777,472 (next 256) + 256 = 33,555,200, x 32 = 1,073,766,400,
    // minus the last mirror's 252 unused bytes = 1,073,766,148, up to 4096: 1,073,766,400.
    {"llama-3.1-8b.json", "auto", 131'072, 1'073'742'464, 1'073'766'400},
    // fp8_e4m3: 1024 + 1024 = 2048 x 32 = 65536; planes 8,388,616 (-> 8,388,864):
    // 65536 x 8192 + 640 = 536,871,552; arena 32 x 16,777,984 = 536,895,488.
    {"llama-3.1-8b.json", "fp8_e4m3", 65'536, 536'871'552, 536'895'488},
    // Qwen2.5-7B, 28 x 4 KV heads x 128 = 512 elements. bf16: 2048 x 28 = 57344;
    // 57344 x 8192 + 28 x 20 = 469,762,608; arena 28 x 16,777,984 = 469,783,552 - 252, up to
    // 4096: 469,786,624.
    {"qwen2.5-7b.json", "bf16", 57'344, 469'762'608, 469'786'624},
    // fp8: 1024 x 28 = 28672; 234,881,024 + 560 = 234,881,584; arena 28 x 8,389,120 =
    // 234,895,360 - 252, up to 4096: 234,905,600.
    {"qwen2.5-7b.json", "fp8_e4m3", 28'672, 234'881'584, 234'905'600},
    // Qwen3-Next-80B-A3B: 12 full-attention layers + 1 MTP block of 2 KV heads x 256 = 512
    // elements: bf16 2048 x 13 = 26624 B/token. Fixed: 13 x 20 + 36 Gated DeltaNet layers of
    // conv 8192 x 3 f32 (98,304) + 2 SSM 32 x 128 x 128 f32 (2 x 2,097,152) = 154,534,148.
    // 26624 x 8192 + 154,534,148 = 372,637,956; arena (every plane but the mirrors and the
    // K/V tail pads already 256-multiples): 372,649,984.
    {"qwen3-next-80b-a3b.json", "auto", 26'624, 372'637'956, 372'649'984},
    // fp8: 1024 x 13 = 13312; 109,051,904 + 154,534,148 = 263,586,052; arena 263,598,080.
    {"qwen3-next-80b-a3b.json", "fp8_e4m3", 13'312, 263'586'052, 263'598'080},
    // DeepSeek-V3: 61 MLA layers + 1 NextN block, one latent row of 512 + 64 = 576 elements.
    // bf16: 1152 x 62 = 71424; 71424 x 8192 + 62 x 4 = 585,105,656; arena per layer 256
    // (mirror) + 8192 x 1152 = 9,437,440, x 62 = 585,121,280, up to 4096: 585,121,792.
    {"deepseek-v3.json", "auto", 71'424, 585'105'656, 585'121'792},
    // fp8: 576 x 62 = 35712; 292,552,704 + 248 = 292,552,952; arena 62 x 4,718,848 =
    // 292,568,576, up to 4096: 292,569,088.
    {"deepseek-v3.json", "fp8_e4m3", 35'712, 292'552'952, 292'569'088},
};

TEST(ImportHuggingFaceConfigTest, AdmissionInTheEnginesDtypeIsWorkedOutByHand) {
  constexpr ArenaRounding kPages{kPlaneAlignment, 4096};
  for (const DtypeAdmission& expected : kDtypeAdmissions) {
    SCOPED_TRACE(absl::StrCat(expected.file, " ", expected.kv_dtype));
    ImportOptions options;
    options.kv_dtype = expected.kv_dtype;
    const ModelPlan plan = Import(expected.file, options);
    SessionShape request;
    request.capacity = 8192;
    absl::StatusOr<CostReport> cost = SessionCost(plan, FormatDefaults{}, request, kPages);
    ASSERT_THAT(cost, IsOk());
    EXPECT_EQ(cost->breakdown.bytes_per_token, expected.bytes_per_token);
    EXPECT_EQ(cost->breakdown.total_bytes, expected.total_bytes);
    EXPECT_EQ(cost->arena_bytes, expected.arena_bytes);
    // The allocation is that arena, and the ledger admits exactly it.
    absl::StatusOr<SessionPlan> session = PlanSession(plan, FormatDefaults{}, request);
    ASSERT_THAT(session, IsOk());
    absl::StatusOr<ArenaLayout> layout =
        LayoutArena(session->planes, kPages.alignment, kPages.granularity);
    ASSERT_THAT(layout, IsOk());
    EXPECT_EQ(layout->bytes, expected.arena_bytes);
    AdmissionLedger ledger(expected.arena_bytes);
    absl::StatusOr<ReservationId> reservation =
        ledger.Reserve(1, cost->arena_bytes, absl::UnixEpoch(), absl::Seconds(1));
    ASSERT_THAT(reservation, IsOk());
    ASSERT_THAT(ledger.Commit(*reservation, layout->bytes), IsOk());
    EXPECT_EQ(ledger.free(), 0u);
  }
}

TEST(ImportHuggingFaceConfigTest, AutoTakesTorchDtypeForEveryKvLayerAndLatentRow) {
  absl::StatusOr<ImportedModel> llama =
      ImportHuggingFaceModel(ReadConfig("llama-3.1-8b.json"), ImportOptions{});
  ASSERT_THAT(llama, IsOk());
  EXPECT_EQ(llama->kv_dtype, "bf16 from torch_dtype bfloat16");
  for (const LayerPlan* layer : llama->plan.AllLayers()) {
    EXPECT_EQ(layer->formats, (KvFormats{KFormat::kBf16, VFormat::kBf16}));
  }
  // Gemma's classes are bypassed: every owner of K/V is bf16, globals and windowed alike.
  const ModelPlan gemma = Import("gemma-3-27b-it.json", ImportOptions{});
  EXPECT_EQ(PlanFormatsSummary(gemma, FormatDefaults{}), "K/V bf16/bf16");
  const ModelPlan deepseek = Import("deepseek-v3.2-exp.json", ImportOptions{});
  EXPECT_EQ(PlanFormatsSummary(deepseek, FormatDefaults{}), "latent bf16");
  // The indexer stays f32: 62 x (1152 + 512 pool-key bytes per token; the tail ring is fixed).
  EXPECT_EQ(Cost(deepseek).bytes_per_token, 62u * (1152 + 512));
}

TEST(ImportHuggingFaceConfigTest, KvDtypeOverridesAndPairs) {
  const auto imported = [](const std::string& kv_dtype) {
    ImportOptions options;
    options.kv_dtype = kv_dtype;
    return Import("llama-3.1-8b.json", options);
  };
  EXPECT_EQ(imported("fp16").layers[0].formats, (KvFormats{KFormat::kF16, VFormat::kF16}));
  EXPECT_EQ(imported("float32").layers[0].formats, (KvFormats{KFormat::kF32, VFormat::kF32}));
  EXPECT_EQ(imported("fp8_e5m2").layers[0].formats,
            (KvFormats{KFormat::kFp8E5m2, VFormat::kFp8E5m2}));
  EXPECT_EQ(imported("q8_0/q4_0").layers[0].formats, (KvFormats{KFormat::kQ8_0, VFormat::kQ4_0}));
  EXPECT_EQ(imported("bf16/q5_1").layers[0].formats, (KvFormats{KFormat::kBf16, VFormat::kQ5_1}));
  EXPECT_FALSE(imported("reference").layers[0].formats.has_value());
  // A pair leaves latent rows at the reference's f32.
  ImportOptions pair;
  pair.kv_dtype = "fp8/fp8";
  EXPECT_EQ(PlanFormatsSummary(Import("deepseek-v3.json", pair), FormatDefaults{}),
            "latent f32");
}

TEST(ImportHuggingFaceConfigTest, Fp8KvCacheInTheQuantizationConfigWinsOverTorchDtype) {
  for (const char* quantization :
       {R"("quantization_config": {"quant_method": "compressed-tensors",
            "kv_cache_scheme": {"type": "float", "num_bits": 8, "strategy": "tensor"}})",
        R"("quantization_config": {"quant_method": "modelopt", "kv_cache_quant_algo": "FP8"})"}) {
    SCOPED_TRACE(quantization);
    const std::string config = absl::StrCat(R"({"architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 8,
        "hidden_size": 4096, "torch_dtype": "bfloat16", )",
                                            quantization, "}");
    absl::StatusOr<ImportedModel> model = ImportHuggingFaceModel(config, ImportOptions{});
    ASSERT_THAT(model, IsOk());
    EXPECT_THAT(model->kv_dtype, ::testing::StartsWith("fp8_e4m3 from quantization_config."));
    EXPECT_EQ(model->plan.layers[1].formats, (KvFormats{KFormat::kFp8E4m3, VFormat::kFp8E4m3}));
    EXPECT_TRUE(model->plan.layers[1].k_scale.empty());  // the engine supplies its scales
  }
  // Weight-only quantization (DeepSeek's fp8 weights) says nothing about the KV cache.
  absl::StatusOr<ImportedModel> weights = ImportHuggingFaceModel(R"({
      "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": 32,
      "hidden_size": 4096, "torch_dtype": "float16",
      "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})",
                                                                 ImportOptions{});
  ASSERT_THAT(weights, IsOk());
  EXPECT_EQ(weights->kv_dtype, "f16 from torch_dtype float16");
}

TEST(ImportHuggingFaceConfigTest, KvDtypeRefusalsNameTheValue) {
  const std::string llama = ReadConfig("llama-3.1-8b.json");
  ImportOptions unknown;
  unknown.kv_dtype = "int4";
  EXPECT_THAT(ImportHuggingFaceModel(llama, unknown),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("--kv-dtype int4 unsupported (auto | reference | bf16 | fp16")));
  ImportOptions bad_pair;
  bad_pair.kv_dtype = "q8_0/q8_0";
  EXPECT_THAT(ImportHuggingFaceModel(llama, bad_pair),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("--kv-dtype q8_0/q8_0: V format \"q8_0\" unsupported")));
  ImportOptions block_head;  // Phi-2's head dim 80 cannot hold q4_0 blocks
  block_head.kv_dtype = "bf16/q4_0";
  EXPECT_THAT(ImportHuggingFaceModel(R"({"architectures": ["LlamaForCausalLM"],
      "num_hidden_layers": 2, "num_attention_heads": 32, "hidden_size": 2560})",
                                     block_head),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("LlamaForCausalLM: the imported plan is not valid: layer 0 (kv): "
                                  "V format q4_0 stores 32-element blocks, which head_dim_v 80 "
                                  "cannot hold whole")));
  EXPECT_THAT(ImportHuggingFaceModel(R"({"architectures": ["LlamaForCausalLM"],
      "num_hidden_layers": 2, "num_attention_heads": 32, "hidden_size": 4096,
      "torch_dtype": "int8"})",
                                     ImportOptions{}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("field torch_dtype: \"int8\" is not a KV cache dtype")));
  EXPECT_THAT(ImportHuggingFaceModel(R"({"architectures": ["LlamaForCausalLM"],
      "num_hidden_layers": 2, "num_attention_heads": 32, "hidden_size": 4096,
      "quantization_config": {"kv_cache_scheme": {"type": "int", "num_bits": 8}}})",
                                     ImportOptions{}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("field quantization_config.kv_cache_scheme: type int with "
                                  "num_bits 8 is not an fp8 KV cache")));
  // No dtype at all: the daemon's defaults, as before --kv-dtype existed.
  absl::StatusOr<ImportedModel> bare = ImportHuggingFaceModel(R"({
      "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": 32,
      "hidden_size": 4096})",
                                                              ImportOptions{});
  ASSERT_THAT(bare, IsOk());
  EXPECT_EQ(bare->kv_dtype, "reference: the config names no torch_dtype");
  EXPECT_FALSE(bare->plan.layers[0].formats.has_value());
}

TEST(ImportHuggingFaceConfigTest, DenseGeometry) {
  const ModelPlan llama = Import("llama-3.1-8b.json");
  EXPECT_EQ(llama.name, "llama");  // no _name_or_path: model_type
  EXPECT_EQ(llama.layers[0].head_dim_k, 128u);
  EXPECT_EQ(llama.layers[0].n_head_kv, 8u);
  EXPECT_EQ(Cost(llama).kv_bytes_per_token, 59392u);
  EXPECT_EQ(Import("qwen2.5-7b.json").layers[0].head_dim_k, 128u);  // hidden / heads
}

TEST(ImportHuggingFaceConfigTest, SwaRingOptionMovesSlidingBytesToTheRing) {
  EXPECT_EQ(Import("mistral-7b-v0.1.json").layers[31].window, 4096u);
  ImportOptions ring = Reference();
  ring.swa_ring = true;
  const ModelPlan mistral = Import("mistral-7b-v0.1.json", ring);
  EXPECT_TRUE(mistral.swa_ring);
  EXPECT_EQ(Cost(mistral).ring_bytes_per_token, 59392u);
  EXPECT_EQ(Cost(mistral).kv_bytes_per_token, 0u);
  // Gemma 3 27B: 10 globals stay per-token (40960), 52 windowed are ring-capped (212992).
  const CostBreakdown gemma = Cost(Import("gemma-3-27b-it.json", ring));
  EXPECT_EQ(gemma.kv_bytes_per_token, 40960u);
  EXPECT_EQ(gemma.ring_bytes_per_token, 212992u);
}

TEST(ImportHuggingFaceConfigTest, GemmaClassesAndWindows) {
  const ModelPlan plan = Import("gemma-3-27b-it.json");
  EXPECT_EQ(plan.layers[5].attention, AttentionClass::kGemmaGlobal);
  EXPECT_EQ(plan.layers[59].kind, StateKind::kKv);
  EXPECT_EQ(plan.layers[60].attention, AttentionClass::kGemmaWindowed);
  EXPECT_EQ(plan.layers[60].window, 1024u);
}

TEST(ImportHuggingFaceConfigTest, Gemma3nSharedLayersAttendTheLastOwnerOfTheirType) {
  // Owners 0..19 (full at 4, 9, 14, 19): shared sliding layers attend 18, shared full ones 19.
  const ModelPlan plan = Import("gemma-3n-e4b-it.json");
  EXPECT_EQ(plan.layers[20].shares_kv_with, 18u);
  EXPECT_EQ(plan.layers[24].shares_kv_with, 19u);
  EXPECT_EQ(plan.layers[33].shares_kv_with, 18u);
  EXPECT_EQ(plan.layers[34].shares_kv_with, 19u);
  EXPECT_EQ(plan.layers[19].attention, AttentionClass::kGemmaGlobal);
  EXPECT_EQ(plan.layers[0].window, 512u);
}

TEST(ImportHuggingFaceConfigTest, DeepSeekLatentAndMtp) {
  const ModelPlan plan = Import("deepseek-v3.json");
  EXPECT_EQ(plan.mtp_blocks[0].index, 61u);
  EXPECT_EQ(plan.layers[0].latent_width, 576u);
  EXPECT_EQ(plan.layers[0].index_width, 0u);
  EXPECT_EQ(Cost(plan).latent_bytes_per_token, 142848u);
  EXPECT_EQ(TrunkBytesPerToken(plan, 61), 140544u);  // without the MTP block: 61 x 2304
}

TEST(ImportHuggingFaceConfigTest, DsaIndexerPoolAndRingOptions) {
  const ModelPlan plan = Import("deepseek-v3.2-exp.json");
  EXPECT_EQ(plan.layers[0].index_width, 256u);
  EXPECT_EQ(plan.layers[0].index_pool, 1u);
  // GLM's k-pool of 4 (given as an option here; `index_kpool` in the file wins): pool keys
  // 512 / 4 = 128 B -> (2304 + 128) x 62 = 150784 B/token.
  ImportOptions pooled = Reference();
  pooled.index_pool = 4;
  const ModelPlan glm_style = Import("deepseek-v3.2-exp.json", pooled);
  EXPECT_EQ(glm_style.layers[0].index_pool, 4u);
  EXPECT_EQ(Cost(glm_style).bytes_per_token, 150784u);
  // The ring disabled: the flat indexer plane adds 256 f32 = 1024 B/token/layer.
  pooled.index_ring_rows = 0;
  const ModelPlan flat = Import("deepseek-v3.2-exp.json", pooled);
  EXPECT_EQ(flat.index_ring_rows, std::optional<uint32_t>(0));
  EXPECT_EQ(Cost(flat).bytes_per_token, 150784u + 62 * 1024u);
}

TEST(ImportHuggingFaceConfigTest, IndexKpoolInTheFileWinsOverTheOption) {
  constexpr char kGlmStyle[] = R"({"architectures": ["DeepseekV32ForCausalLM"],
      "num_hidden_layers": 2, "kv_lora_rank": 512, "qk_rope_head_dim": 0,
      "index_head_dim": 128, "index_kpool": 4})";
  ImportOptions options = Reference();
  options.index_pool = 8;
  absl::StatusOr<ModelPlan> plan = ImportHuggingFaceConfig(kGlmStyle, options);
  ASSERT_THAT(plan, IsOk());
  EXPECT_EQ(plan->layers[1].latent_width, 512u);  // NoPE: no rope tail
  EXPECT_EQ(plan->layers[1].index_pool, 4u);
  options.index_pool = 0;
  EXPECT_THAT(ImportHuggingFaceConfig(R"({"architectures": ["DeepseekV3ForCausalLM"],
      "num_hidden_layers": 2, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
      "index_head_dim": 128})",
                                      options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("index_pool: 0 (tokens per DSA pool key)")));
}

TEST(ImportHuggingFaceConfigTest, Qwen3NextHybridGeometry) {
  // Gated DeltaNet: conv 2 x 16 x 128 + 32 x 128 = 8192 channels, kernel 4, state
  // 32 x 128 x 128 = 524288 f32.
  const ModelPlan plan = Import("qwen3-next-80b-a3b.json");
  EXPECT_EQ(plan.layers[3].kind, StateKind::kKv);
  EXPECT_EQ(plan.layers[3].head_dim_k, 256u);
  EXPECT_EQ(plan.layers[0].conv_width, 8192u);
  EXPECT_EQ(plan.layers[0].conv_kernel, 4u);
  EXPECT_EQ(plan.layers[0].state_width, 524288u);
  EXPECT_EQ(plan.mtp_blocks[0].index, 48u);
  EXPECT_EQ(TrunkBytesPerToken(plan, 48), 11136u);  // without the MTP block: 12 x 928
}

TEST(ImportHuggingFaceConfigTest, JambaMambaGeometry) {
  // d_inner = 2 x 4096 = 8192 conv channels, kernel 4, state 8192 x 16 = 131072 f32.
  const ModelPlan plan = Import("jamba-v0.1.json");
  EXPECT_EQ(plan.layers[12].kind, StateKind::kKv);
  EXPECT_EQ(plan.layers[0].conv_width, 8192u);
  EXPECT_EQ(plan.layers[0].conv_kernel, 4u);
  EXPECT_EQ(plan.layers[0].state_width, 131072u);
}

TEST(ImportHuggingFaceConfigTest, NameOptionDoesNotChangeTheFingerprint) {
  ImportOptions named = Reference();
  named.name = "my-llama";
  const ModelPlan plan = Import("llama-3.1-8b.json", named);
  EXPECT_EQ(plan.name, "my-llama");
  EXPECT_EQ(FingerprintModelPlan(plan, FormatDefaults{}).value(),
            FingerprintModelPlan(Import("llama-3.1-8b.json"), FormatDefaults{}).value());
}

TEST(ImportHuggingFaceConfigTest, QwenUseSlidingWindowSlidesFromMaxWindowLayers) {
  absl::StatusOr<ModelPlan> plan = ImportHuggingFaceConfig(R"({
      "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 4, "hidden_size": 512,
      "num_attention_heads": 4, "num_key_value_heads": 2, "use_sliding_window": true,
      "max_window_layers": 2, "sliding_window": 4096})",
                                                           {});
  ASSERT_THAT(plan, IsOk());
  EXPECT_EQ(plan->layers[1].kind, StateKind::kKv);
  EXPECT_EQ(plan->layers[2].kind, StateKind::kSlidingKv);
  EXPECT_EQ(plan->layers[3].window, 4096u);
}

TEST(ImportHuggingFaceConfigTest, MistralNullWindowIsFullAttention) {
  absl::StatusOr<ModelPlan> plan = ImportHuggingFaceConfig(R"({
      "architectures": ["MistralForCausalLM"], "num_hidden_layers": 2, "hidden_size": 4096,
      "num_attention_heads": 32, "num_key_value_heads": 8, "sliding_window": null})",
                                                           {});
  ASSERT_THAT(plan, IsOk());
  EXPECT_EQ(CountKind(*plan, StateKind::kKv), 2u);
}

// --- Refusals: INVALID_ARGUMENT naming the field or architecture and the value ---------------

absl::Status ImportText(const std::string& text) {
  return ImportHuggingFaceConfig(text, {}).status();
}

TEST(ImportHuggingFaceConfigTest, MalformedJson) {
  EXPECT_THAT(ImportText("{\"architectures\": ["),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("not valid JSON")));
  EXPECT_THAT(ImportText("[1, 2]"), StatusIs(absl::StatusCode::kInvalidArgument,
                                             HasSubstrs("must be a JSON object, got array")));
  EXPECT_THAT(ImportText("{}"), StatusIs(absl::StatusCode::kInvalidArgument,
                                         HasSubstrs("missing required field architectures")));
}

// Every truncation of a real config is refused cleanly (no exception escapes, no crash).
TEST(ImportHuggingFaceConfigTest, TruncatedConfigsAreRefused) {
  const std::string text = ReadConfig("gemma-3-27b-it.json");
  ASSERT_GT(text.size(), 100u);
  for (size_t length = 0; length + 2 < text.size(); ++length) {
    EXPECT_THAT(ImportText(text.substr(0, length)),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("not valid JSON")))
        << length;
  }
}

TEST(ImportHuggingFaceConfigTest, UnsupportedArchitectureIsNamed) {
  EXPECT_THAT(ImportText(R"({"architectures": ["Llama4ForConditionalGeneration"]})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("architecture Llama4ForConditionalGeneration", "is not supported",
                                  "LlamaForCausalLM", "JambaForCausalLM")));
  EXPECT_THAT(ImportText(R"({"architectures": "LlamaForCausalLM"})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("field architectures: expected a list of strings")));
}

TEST(ImportHuggingFaceConfigTest, MissingAndMistypedFieldsAreNamed) {
  EXPECT_THAT(ImportText(R"({"architectures": ["LlamaForCausalLM"]})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("LlamaForCausalLM: missing required field num_hidden_layers")));
  EXPECT_THAT(ImportText(R"({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": "32"})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("field num_hidden_layers: expected a non-negative integer, "
                                  "got \"32\"")));
  EXPECT_THAT(ImportText(R"({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": -1})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("num_hidden_layers: expected a non-negative integer, got -1")));
  EXPECT_THAT(
      ImportText(R"({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 5000000000})"),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstrs("num_hidden_layers: 5000000000 does not fit in 32 bits")));
  EXPECT_THAT(ImportText(R"({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 5000})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("num_hidden_layers: 5000 layers exceeds 4096")));
  EXPECT_THAT(ImportText(R"({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2,
                             "hidden_size": 4100, "num_attention_heads": 32})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("hidden_size: 4100 is not divisible by num_attention_heads 32")));
  EXPECT_THAT(ImportText(R"({"architectures": ["Gemma3ForConditionalGeneration"]})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("missing required field text_config")));
  EXPECT_THAT(ImportText(R"({"architectures": ["Gemma3ForConditionalGeneration"], "text_config": {
                     "num_hidden_layers": 6, "num_key_value_heads": 2, "sliding_window": 512}})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("missing required field text_config.head_dim")));
  EXPECT_THAT(ImportText(R"({"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 2,
                             "qk_rope_head_dim": 64})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("missing required field kv_lora_rank")));
  EXPECT_THAT(ImportText(R"({"architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 4,
                             "full_attention_interval": 4, "head_dim": 256,
                             "num_key_value_heads": 2})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("missing required field linear_num_key_heads")));
}

TEST(ImportHuggingFaceConfigTest, InconsistentValuesAreNamed) {
  EXPECT_THAT(ImportText(R"({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2,
                             "head_dim": 128, "num_key_value_heads": 8,
                             "layer_types": ["full_attention"]})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("layer_types: 1 entries for 2 layers")));
  EXPECT_THAT(ImportText(R"({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2,
                             "head_dim": 128, "num_key_value_heads": 8,
                             "layer_types": ["full_attention", "chunked_attention"]})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("layer_types[1]: \"chunked_attention\" is not supported")));
  EXPECT_THAT(ImportText(R"({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2,
                             "head_dim": 128, "num_key_value_heads": 8,
                             "layer_types": ["full_attention", "sliding_attention"]})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("missing required field sliding_window")));
  EXPECT_THAT(ImportText(R"({"architectures": ["JambaForCausalLM"], "num_hidden_layers": 8,
                             "attn_layer_period": 4, "attn_layer_offset": 4})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("attn_layer_offset: 4 is not below attn_layer_period 4")));
  EXPECT_THAT(ImportText(R"({"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 4,
                             "head_dim": 256, "num_key_value_heads": 2, "sliding_window": 512,
                             "num_kv_shared_layers": 4})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("num_kv_shared_layers: 4 of 4 layers leaves none")));
  // Pattern 3 over 3 layers: 0, 1 sliding, 2 full; sharing layer 2 leaves no full owner.
  EXPECT_THAT(ImportText(R"({"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 3,
                             "head_dim": 256, "num_key_value_heads": 2, "sliding_window": 512,
                             "sliding_window_pattern": 3, "num_kv_shared_layers": 1})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("shared layer 2 (full) has no earlier layer of its type")));
  // Structural rules of the plan (quantized head dims % 32) come back naming the layer.
  EXPECT_THAT(ImportText(R"({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1,
                             "head_dim": 80, "num_key_value_heads": 8})"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("LlamaForCausalLM: the imported plan is not valid", "80")));
}

TEST(ImportHuggingFaceConfigTest, ListsSupportedArchitectures) {
  EXPECT_THAT(
      SupportedHuggingFaceArchitectures(),
      ::testing::IsSupersetOf({"LlamaForCausalLM", "Qwen3NextForCausalLM", "DeepseekV3ForCausalLM",
                               "Gemma3ForConditionalGeneration", "JambaForCausalLM"}));
}

}  // namespace
}  // namespace memra
