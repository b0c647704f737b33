#ifndef MEMRA_CORE_MODEL_PLAN_H_
#define MEMRA_CORE_MODEL_PLAN_H_

// The per-layer cache description of a model, its validation and its canonical fingerprint
// (docs/rules.md#model-plans-and-fingerprints; "the reference" below: docs/rules.md#the-reference).
// Two plans with the same fingerprint have byte-identical session layouts.
//
// Thread-safety: plain values; const methods are safe to call concurrently.

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/formats.h"

namespace memra {

// What a layer keeps in the cache (the reference's `StatePlan`).
enum class StateKind : uint8_t {
  kNone = 0,        // no cache state of its own (e.g. an MLP-only block)
  kKv = 1,          // full-attention K/V planes, `capacity` rows
  kSlidingKv = 2,   // sliding-window K/V; a ring when the plan enables `swa_ring`
  kRecurrent = 3,   // linear-attention conv + SSM state, fixed size
  kLatent = 4,      // MLA latent rows (+ optional DSA indexer plane and pool keys)
  kSharedKv = 5,    // attends an earlier layer's K/V (Gemma's trailing shared-KV layers)
};
// "none", "kv", "sliding_kv", "recurrent", "latent", "shared_kv" (used in messages).
std::string_view StateKindName(StateKind kind);

// How the reference classifies a full-attention layer when choosing its default KV format.
enum class AttentionClass : uint8_t {
  kOrdinary = 0,
  kGemmaGlobal = 1,
  kGemmaWindowed = 2,
};
std::string_view AttentionClassName(AttentionClass attention);

struct LayerPlan {
  uint32_t index = 0;  // absolute layer index; trunk layers are 0..n-1, MTP blocks follow
  StateKind kind = StateKind::kNone;

  // kKv / kSlidingKv. K/V elements per token are head_dim * n_head_kv; for block formats
  // head dims must be multiples of 32 (a 32-element block never straddles a head; unset formats
  // are block formats: the defaults are).
  AttentionClass attention = AttentionClass::kOrdinary;
  uint32_t head_dim_k = 0;
  uint32_t head_dim_v = 0;
  uint32_t n_head_kv = 0;
  std::optional<KvFormats> formats;  // unset: FormatDefaults for `attention` decide
  // Dequantization scales of the fp8 element formats (fp8_e4m3 / fp8_e5m2), as the engine
  // supplies them (vLLM's k_scale / v_scale): empty = 1.0, one value = per tensor, n_head_kv
  // values = per head. k_scale also scales an fp8 latent row (one value). Part of the
  // fingerprint: K/V written under another scale is not interchangeable.
  std::vector<float> k_scale;
  std::vector<float> v_scale;
  uint32_t window = 0;               // kSlidingKv only: attention window in tokens (> 0)

  // kRecurrent: conv state is conv_width * (conv_kernel - 1) f32, SSM state state_width f32.
  uint32_t conv_width = 0;
  uint32_t conv_kernel = 0;
  uint32_t state_width = 0;

  // kLatent: one row of `latent_width` elements of `latent_format` per token; `index_width` f32
  // per token in the DSA indexer plane (0 = no indexer); `index_pool` tokens per pool key
  // (required iff indexer). The indexer stays f32: its pool keys are built from it.
  uint32_t latent_width = 0;
  ElementFormat latent_format = ElementFormat::kF32;
  uint32_t index_width = 0;
  uint32_t index_pool = 0;

  // kSharedKv: the earlier layer whose K/V this layer attends.
  uint32_t shares_kv_with = 0;
};

struct ModelPlan {
  std::string name;                   // informational; not part of the fingerprint
  std::vector<LayerPlan> layers;      // trunk layers, index 0..n-1 in order
  std::vector<LayerPlan> mtp_blocks;  // MTP/NextN blocks, indices n.. in order
  // Sliding layers use the SWA ring (the reference's `swa_ring_on`); off keeps flat planes.
  bool swa_ring = false;
  // The reference's MEMRA_DSA_INDEX_RING: unset books INDEX_RING_WORKING_ROWS, 0 disables the
  // tail ring, n pins its physical rows.
  std::optional<uint32_t> index_ring_rows;

  // All layers, trunk then MTP, in index order.
  std::vector<const LayerPlan*> AllLayers() const;
  // The layer with `index`, or null. O(1) when indices are contiguous (every valid plan), so
  // per-layer lookups keep validation linear; a scan otherwise.
  const LayerPlan* FindLayer(uint32_t index) const;
  uint32_t TotalLayers() const;
};

// Whether `layer` of `plan` is addressed through the SWA ring (core/kv_ring.h): a sliding layer
// of a plan that sets swa_ring. The one definition sizing, the fingerprint and every ring /
// flat decision downstream read (they carry it on as LayerGeometry::RingWindow()).
bool IsSwaRingLayer(const ModelPlan& plan, const LayerPlan& layer);

// The formats a K/V layer stores: its explicit `formats`, else the default for its class.
KvFormats ResolveLayerFormats(const LayerPlan& layer, const FormatDefaults& defaults);

// Checks every structural rule: at least one layer, contiguous indices, kind-specific dims
// nonzero, head dims % 32 for block formats (unset formats count as block formats), scales only
// on fp8 element formats (1 or n_head_kv finite positive values), a latent format only on
// latent layers, window > 0, index_width even, pool > 0 iff
// indexer, an indexer pool no larger than the indexer ring (when the ring is not disabled),
// shared-KV targets earlier KV layers, Gemma classes on their own kinds (global = kKv,
// windowed = kSlidingKv, as the reference derives them), and every field the layer's kind does
// not use left at zero/unset (a stray `window` on a kKv layer is a mis-typed plan, and it would
// otherwise be silently ignored), and no enum value without a name (plans arrive over the wire).
// INVALID_ARGUMENT naming the layer and the numbers. Linear in the layers (any size; the daemon
// caps the size first: server/session/plan_registry.h CheckPlanLayers).
absl::Status ValidateModelPlan(const ModelPlan& plan);

// SHA-256 over the canonical encoding (every layout-relevant field, formats resolved with
// `defaults`, fixed field order, little-endian). Equal fingerprints <=> identical layouts.
// (Plans whose token bytes agree but whose head geometry differs hash apart on purpose: their
// K/V is not interchangeable.) Validates first (its INVALID_ARGUMENT).
// Encoding v1: u32 length + "memra.kv.model_plan.v1"; u8 swa_ring (0 without sliding layers);
// u32 index ring rows (unset resolved to kIndexRingWorkingRows; 0 without an indexer); u32 trunk
// count; u32 MTP count; per layer in index order: u32 index, u8 kind, u8 attention, u8 K and u8 V
// format (resolved; 0xff for layers without K/V), then u32 head_dim_k, head_dim_v, n_head_kv,
// window, conv_width, conv_kernel, state_width, latent_width, index_width, index_pool,
// shares_kv_with. `name` is not encoded.
// Extension (plans with an element-format scale or a non-f32 latent row; every other plan
// encodes exactly as before, so its fingerprint is unchanged): after the last layer,
// u32 length + "memra.kv.model_plan.v1.ext", then per layer in index order: u8 latent format,
// u32 count + f32 bits of k_scale, u32 count + f32 bits of v_scale.
using PlanFingerprint = std::array<uint8_t, 32>;
absl::StatusOr<PlanFingerprint> FingerprintModelPlan(const ModelPlan& plan,
                                                     const FormatDefaults& defaults);
std::string FingerprintHex(const PlanFingerprint& fingerprint);

// The formats a plan stores, for messages: distinct resolved K/V pairs and latent formats in
// layer order, e.g. "K/V bf16/bf16" or "K/V q8_0/q5_1, fp8/fp8; latent f32".
std::string PlanFormatsSummary(const ModelPlan& plan, const FormatDefaults& defaults);

}  // namespace memra

#endif  // MEMRA_CORE_MODEL_PLAN_H_
