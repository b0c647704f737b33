#ifndef MEMRA_CORE_SIZING_H_
#define MEMRA_CORE_SIZING_H_

// THE sizing source (docs/rules.md#sizing). PlanSession() lists every plane a session needs, with
// exact bytes; admission, allocation, the cost queries and the reference's per-token coefficients
// (docs/rules.md#the-reference) are all derived from that one list. There is no second formula
// anywhere in the project.
//
// Thread-safety: pure functions over values.

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "core/formats.h"
#include "core/model_plan.h"

namespace memra {

// Exact geometry for one rank of a tensor-parallel KV shard (the reference's
// TpKvRankAllocationShape). fixed_bytes = two 8-byte tail pads + one i32 length mirror.
struct TpKvRankShape {
  uint64_t kv_dim_k = 0;  // rank-local K elements per token
  uint64_t kv_dim_v = 0;
  uint64_t k_token_bytes = 0;
  uint64_t v_token_bytes = 0;
  uint64_t fixed_bytes = 0;
  uint64_t BytesPerToken() const;                  // saturating, as the reference
  uint64_t AllocationBytes(uint64_t capacity) const;  // saturating, as the reference
};
// INVALID_ARGUMENT when a dim or `ranks` is zero, a dim is not divisible by `ranks`, or a local
// dim is not whole blocks of a block format (32-aligned; message carries k, v, ranks / local dims
// like the reference's).
absl::StatusOr<TpKvRankShape> TpKvRankAllocationShape(uint64_t kv_dim_k, uint64_t kv_dim_v,
                                                      uint64_t ranks, KvFormats formats);

// Bytes of a K or V byte plane: rows * token_bytes + the reference's 8-byte tail pad.
inline constexpr uint64_t kKvPlaneTailPadBytes = 8;
absl::StatusOr<uint64_t> KvPlaneAllocationBytes(uint64_t rows, uint64_t token_bytes);

enum class PlaneKind : uint8_t {
  kKeys = 0,          // K byte plane (quantized), rows x k_token_bytes + 8
  kValues = 1,        // V byte plane, rows x v_token_bytes + 8
  kLenMirror = 2,     // i32[1] device mirror of the layer's length
  kBaseMirror = 3,    // i32[1] device mirror of the ring base (ring layers only)
  kConvState = 4,     // f32 conv_width * (conv_kernel - 1)
  kSsmState = 5,      // f32 state_width
  kSsmStateAlt = 6,   // f32 state_width (the ping-pong partner)
  kLatentRows = 7,    // capacity x latent_width of the layer's latent format (f32 default)
  kIndexRows = 8,     // f32 (index ring rows or capacity) x index_width
  kPoolKeys = 9,      // f32 max(1, capacity / pool * index_width / 2); rows = whole pools
  kSpecConv = 10,     // spec-decode snapshot copy of kConvState
  kSpecSsm = 11,      // spec-decode snapshot copy of kSsmState
};

// One map key per (layer, plane kind): the layer above the kind's 8 bits, no layer lost.
inline uint64_t PlaneKey(uint32_t layer, PlaneKind kind) {
  return (uint64_t{layer} << 8) | static_cast<uint8_t>(kind);
}
std::string_view PlaneKindName(PlaneKind kind);

// Invariant: bytes == rows * row_bytes + extra, where extra is the K/V 8-byte tail pad, or 4 for
// a pool-key plane with no whole pool (the reference's one-element floor), else 0.
struct PlaneSpec {
  uint32_t layer = 0;
  PlaneKind kind = PlaneKind::kKeys;
  uint64_t rows = 0;       // rows of `row_bytes` (1 for mirrors and recurrent state; pools for
                           // kPoolKeys, which may be 0 below one pool)
  uint64_t row_bytes = 0;  // bytes of one row (token bytes for K/V, 4 x width for f32 planes)
  uint64_t bytes = 0;      // exact allocation, tail pad included
  // Whether `bytes` grows with the session's capacity (what admission multiplies by context):
  // flat K/V, latent rows, a flat indexer plane, pool keys. A ring K/V plane scales only while
  // the capacity is below its uncapped ring rows (then it is clamped to the capacity); at or
  // above that it is fixed. A tail-ring indexer plane is fixed.
  bool scales_with_context = false;
};

// Per-layer geometry the session state machine needs (one entry per layer in [lo, hi) that has
// state of its own; kNone and kSharedKv layers are absent).
struct LayerGeometry {
  uint32_t layer = 0;
  StateKind kind = StateKind::kNone;
  AttentionClass attention = AttentionClass::kOrdinary;
  KvFormats formats;              // resolved
  uint64_t kv_dim_k = 0;          // rank-local
  uint64_t kv_dim_v = 0;
  uint64_t k_token_bytes = 0;
  uint64_t v_token_bytes = 0;
  // K/V head geometry (typed plane views: rows x heads x head_dim): rank-local heads, so
  // kv_dim_k == n_head_kv x head_dim_k.
  uint64_t head_dim_k = 0;
  uint64_t head_dim_v = 0;
  uint64_t n_head_kv = 0;
  std::vector<float> k_scale;     // the plan's fp8 element scales (model_plan.h)
  std::vector<float> v_scale;
  uint64_t window = 0;            // sliding layers
  uint64_t physical_rows = 0;     // K/V rows allocated: ring rows, or capacity
  bool ring = false;              // a KvRing addresses this layer (IsSwaRingLayer)
  uint64_t latent_width = 0;
  ElementFormat latent_format = ElementFormat::kF32;
  uint64_t index_width = 0;
  uint64_t index_pool = 0;
  uint64_t index_physical_rows = 0;  // indexer rows allocated (0 = no indexer)
  bool index_ring = false;           // indexer plane is a tail ring (else flat, capacity rows)
  uint64_t conv_elems = 0;           // recurrent: f32 elements of conv state
  uint64_t ssm_elems = 0;            // recurrent: f32 elements of ssm state

  // The ring's window for a ring layer, nullopt for a flat one: how KvLayerShape and
  // KvPlaneRows take "is this layer a ring".
  std::optional<uint64_t> RingWindow() const {
    return ring ? std::optional<uint64_t>(window) : std::nullopt;
  }
  bool operator==(const LayerGeometry&) const = default;
};

// What a session is sized from: its layer range, sharding, capacity and options (the wire's
// CreateSession / Reserve fields and admin SessionShape; common/codec.h SessionShapeFromProto).
struct SessionShape {
  uint32_t layer_lo = 0;        // first layer this session holds
  std::optional<uint32_t> layer_hi;  // one past the last; unset = all layers (trunk + MTP)
  uint32_t tp_ranks = 1;        // > 1: K/V planes are this rank's shard (recurrent/latent refuse)
  uint64_t capacity = 0;        // context capacity in tokens, 1..INT32_MAX
  bool spec_snapshot = false;   // allocate persistent spec-decode snapshot buffers
};

struct SessionPlan {
  std::vector<LayerGeometry> layers;  // in layer order
  std::vector<PlaneSpec> planes;      // in layer order, kinds in enum order within a layer
  uint64_t total_bytes = 0;           // sum of planes[i].bytes (before arena rounding)
};

// Validates the plan and the request (INVALID_ARGUMENT with the numbers), then lists planes.
absl::StatusOr<SessionPlan> PlanSession(const ModelPlan& plan, const FormatDefaults& defaults,
                                        const SessionShape& request);

// Coefficients derived from PlanSession (never from a second formula). Identity:
//   total_bytes == fixed_bytes + sum over scaling planes of rows * row_bytes
// and, when capacity is a multiple of every indexer pool (and 2 x index_width is too),
//   total_bytes == fixed_bytes + capacity * bytes_per_token.
// The per-class coefficients follow the reference: kv + ring == reference cache_bytes_per_token
// minus its latent term (ring == 0 unless the plan sets swa_ring).
struct CostBreakdown {
  uint64_t bytes_per_token = 0;        // context-linear bytes of the planes that scale at this
                                       // capacity, all classes (pool keys: row_bytes / pool)
  uint64_t kv_bytes_per_token = 0;     // flat full-attention K/V (reference cache_bytes_per_token
                                       // minus the latent term, when the ring is off)
  uint64_t ring_bytes_per_token = 0;   // sliding K/V whose rows the ring caps, whether or not
                                       // this capacity reaches the cap
                                       // (reference cache_ring_bytes_per_token)
  // Reference latent_kv_bytes_per_token_for_plan: width*4 + (index_width/2)*4/pool, plus
  // index_width*4 while the indexer plane is flat. Deliberately tighter than the reference in
  // one case: where the default ring collapses to a flat plane (capacity <= ring rows) the
  // reference leaves that plane to its fixed residual; we count it, since it does scale.
  uint64_t latent_bytes_per_token = 0;
  uint64_t ring_row_cap = 0;           // reference cache_ring_row_cap (0 = no ring); over the
                                       // session's layers
  uint64_t fixed_bytes = 0;            // everything that does not scale with context, tail pads
                                       // included
  uint64_t total_bytes = 0;            // exact bytes at the request's capacity (before arena
                                       // alignment; see arena_layout.h for what is allocated)
};
absl::StatusOr<CostBreakdown> CostOfSession(const ModelPlan& plan, const FormatDefaults& defaults,
                                            const SessionShape& request);
// The same, from a plan already computed (the server keeps its SessionPlan). INVALID_ARGUMENT
// for a plan PlanSession could not have produced (a plane without its layer's geometry, or
// bytes that cannot hold its rows).
absl::StatusOr<CostBreakdown> CostOfSessionPlan(const SessionPlan& session);

}  // namespace memra

#endif  // MEMRA_CORE_SIZING_H_
