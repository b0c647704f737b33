#ifndef MEMRA_CORE_TEST_MODEL_PLANS_H_
#define MEMRA_CORE_TEST_MODEL_PLANS_H_

// Realistic model plans shared by the core tests. Geometry follows the public configs of the
// named families; the byte expectations are worked out by hand where the tests use them.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/model_plan.h"

namespace memra::test_plans {

inline LayerPlan KvLayer(uint32_t index, uint32_t head_dim, uint32_t n_head_kv,
                         AttentionClass attention = AttentionClass::kOrdinary) {
  LayerPlan layer;
  layer.index = index;
  layer.kind = StateKind::kKv;
  layer.attention = attention;
  layer.head_dim_k = head_dim;
  layer.head_dim_v = head_dim;
  layer.n_head_kv = n_head_kv;
  return layer;
}

inline LayerPlan SlidingLayer(uint32_t index, uint32_t head_dim, uint32_t n_head_kv,
                              uint32_t window,
                              AttentionClass attention = AttentionClass::kOrdinary) {
  LayerPlan layer = KvLayer(index, head_dim, n_head_kv, attention);
  layer.kind = StateKind::kSlidingKv;
  layer.window = window;
  return layer;
}

inline LayerPlan RecurrentLayer(uint32_t index, uint32_t conv_width, uint32_t conv_kernel,
                                uint32_t state_width) {
  LayerPlan layer;
  layer.index = index;
  layer.kind = StateKind::kRecurrent;
  layer.conv_width = conv_width;
  layer.conv_kernel = conv_kernel;
  layer.state_width = state_width;
  return layer;
}

inline LayerPlan LatentLayer(uint32_t index, uint32_t latent_width, uint32_t index_width = 0,
                             uint32_t index_pool = 0) {
  LayerPlan layer;
  layer.index = index;
  layer.kind = StateKind::kLatent;
  layer.latent_width = latent_width;
  layer.index_width = index_width;
  layer.index_pool = index_pool;
  return layer;
}

inline LayerPlan SharedLayer(uint32_t index, uint32_t target) {
  LayerPlan layer;
  layer.index = index;
  layer.kind = StateKind::kSharedKv;
  layer.shares_kv_with = target;
  return layer;
}

// A dense GQA model: `layers` x (n_head_kv heads of head_dim), ordinary formats.
inline ModelPlan DenseModel(uint32_t layers, uint32_t head_dim, uint32_t n_head_kv) {
  ModelPlan plan;
  for (uint32_t i = 0; i < layers; ++i) plan.layers.push_back(KvLayer(i, head_dim, n_head_kv));
  return plan;
}

// Llama-3-8B: 32 layers, 8 KV heads of 128.
inline ModelPlan Llama3_8B() {
  ModelPlan plan = DenseModel(32, 128, 8);
  plan.name = "llama-3-8b";
  return plan;
}

// Llama-3-70B: 80 layers, 8 KV heads of 128 (the TP-8 shard case).
inline ModelPlan Llama3_70B() {
  ModelPlan plan = DenseModel(80, 128, 8);
  plan.name = "llama-3-70b";
  return plan;
}

// Gemma-style SWA + global, 12 layers, 5 local : 1 global (globals at 5 and 11), window 1024,
// per-layer head geometry as E4B's (windowed 2 x 256 = 512, global 2 x 512 = 1024), and the
// last 4 layers sharing KV: 8, 9, 10 attend sliding layer 7, 11 attends global layer 5.
// Owners of K/V: sliding 0-4, 6, 7 (seven layers) and global 5 (one layer).
inline ModelPlan GemmaStyle(bool swa_ring) {
  ModelPlan plan;
  plan.name = "gemma-swa";
  plan.swa_ring = swa_ring;
  for (uint32_t i = 0; i < 12; ++i) {
    if (i >= 8) {
      plan.layers.push_back(SharedLayer(i, i == 11 ? 5 : 7));
    } else if (i % 6 == 5) {
      plan.layers.push_back(KvLayer(i, 512, 2, AttentionClass::kGemmaGlobal));
    } else {
      plan.layers.push_back(SlidingLayer(i, 256, 2, 1024, AttentionClass::kGemmaWindowed));
    }
  }
  return plan;
}

// DeepSeek-V3: 61 MLA layers with a 576-wide latent row (kv_lora 512 + rope 64), no indexer,
// and one MTP block (index 61) of the same shape.
inline ModelPlan DeepSeekV3Style() {
  ModelPlan plan;
  plan.name = "deepseek-v3";
  for (uint32_t i = 0; i < 61; ++i) plan.layers.push_back(LatentLayer(i, 576));
  plan.mtp_blocks.push_back(LatentLayer(61, 576));
  return plan;
}

// GLM-style DSA: 12 MLA layers (latent 576) with a k-pool indexer of index_width 256
// (2 x index_head_dim 128: 1 KiB per token per layer) and pool 4, glm5_next's KpoolPlan.
inline ModelPlan GlmStyleWithIndexer(std::optional<uint32_t> index_ring_rows = std::nullopt) {
  ModelPlan plan;
  plan.name = "glm-dsa";
  plan.index_ring_rows = index_ring_rows;
  for (uint32_t i = 0; i < 12; ++i) plan.layers.push_back(LatentLayer(i, 576, 256, 4));
  return plan;
}

// Qwen3-Next-style hybrid: 48 layers, every 4th (3, 7, ..., 47) full attention with 2 KV heads
// of 256; the other 36 Gated DeltaNet: conv over 8192 channels (q 2048 + k 2048 + v 4096),
// kernel 4, SSM state 32 heads x 128 x 128.
inline ModelPlan Qwen3NextStyle() {
  ModelPlan plan;
  plan.name = "qwen3-next";
  for (uint32_t i = 0; i < 48; ++i) {
    plan.layers.push_back(i % 4 == 3 ? KvLayer(i, 256, 2)
                                     : RecurrentLayer(i, 8192, 4, 128 * 128 * 32));
  }
  return plan;
}

// `plan` with every K/V layer stored in `element` (one value per element, K and V alike) and
// every latent row in `element`: how an engine that keeps its cache in the model dtype plans.
inline ModelPlan InElementFormat(ModelPlan plan, ElementFormat element) {
  for (std::vector<LayerPlan>* group : {&plan.layers, &plan.mtp_blocks}) {
    for (LayerPlan& layer : *group) {
      if (layer.kind == StateKind::kKv || layer.kind == StateKind::kSlidingKv) {
        layer.formats = KvFormats{KFormatOf(element), VFormatOf(element)};
      } else if (layer.kind == StateKind::kLatent) {
        layer.latent_format = element;
      }
    }
  }
  plan.name += std::string(".") + std::string(ElementFormatName(element));
  return plan;
}

}  // namespace memra::test_plans

#endif  // MEMRA_CORE_TEST_MODEL_PLANS_H_
