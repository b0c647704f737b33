#include "core/sizing.h"

#include <algorithm>
#include <limits>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/checked_math.h"
#include "core/index_ring.h"
#include "core/kv_ring.h"
#include "core/status_macros.h"

namespace memra {
namespace {

constexpr uint64_t kF32Bytes = sizeof(float);
// Length and ring-base mirrors are i32[1] on the device; capacity is bounded by them.
constexpr uint64_t kMirrorBytes = sizeof(int32_t);
constexpr uint64_t kMaxCapacity = std::numeric_limits<int32_t>::max();

uint64_t SaturatingAdd(uint64_t a, uint64_t b) {
  uint64_t out;
  return __builtin_add_overflow(a, b, &out) ? std::numeric_limits<uint64_t>::max() : out;
}
uint64_t SaturatingMul(uint64_t a, uint64_t b) {
  uint64_t out;
  return __builtin_mul_overflow(a, b, &out) ? std::numeric_limits<uint64_t>::max() : out;
}

// Prefixes a refusal with the layer it came from, keeping its code.
absl::Status ForLayer(uint32_t layer, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat("layer ", layer, ": ", status.message()));
}

absl::Status ValidateRequest(const ModelPlan& plan, const SessionShape& request) {
  if (request.capacity == 0) {
    return absl::InvalidArgumentError("capacity 0 tokens: a session needs at least 1");
  }
  if (request.capacity > kMaxCapacity) {
    return absl::InvalidArgumentError(absl::StrCat("capacity ", request.capacity,
                                                   " tokens exceeds i32 device mirrors (max ",
                                                   kMaxCapacity, ")"));
  }
  const uint32_t total = plan.TotalLayers();
  const uint32_t hi = request.layer_hi.value_or(total);
  if (request.layer_lo > hi || hi > total) {
    return absl::InvalidArgumentError(absl::StrCat("layer range [", request.layer_lo, ", ", hi,
                                                   ") is out of bounds for a plan of ", total,
                                                   " layers"));
  }
  if (request.tp_ranks == 0) {
    return absl::InvalidArgumentError("tp_ranks 0: a session is at least one rank");
  }
  return absl::OkStatus();
}

// Appends one layer's planes to the session plan, in PlaneKind order, summing the total.
class PlaneWriter {
 public:
  PlaneWriter(SessionPlan& session, uint32_t layer) : session_(session), layer_(layer) {}

  // bytes = rows x row_bytes + extra_bytes (a tail pad, or the reference's one-element floor;
  // docs/rules.md#sizing).
  absl::Status Add(PlaneKind kind, uint64_t rows, uint64_t row_bytes, uint64_t extra_bytes,
                   bool scales_with_context) {
    const std::string what =
        absl::StrCat("layer ", layer_, " ", std::string(PlaneKindName(kind)), " bytes");
    ASSIGN_OR_RETURN(const uint64_t body, CheckedMul(rows, row_bytes, what));
    ASSIGN_OR_RETURN(const uint64_t bytes, CheckedAdd(body, extra_bytes, what));
    ASSIGN_OR_RETURN(session_.total_bytes,
                     CheckedAdd(session_.total_bytes, bytes, "session total bytes"));
    session_.planes.push_back(PlaneSpec{layer_, kind, rows, row_bytes, bytes, scales_with_context});
    return absl::OkStatus();
  }
  absl::Status AddMirror(PlaneKind kind) { return Add(kind, 1, kMirrorBytes, 0, false); }

  // Bytes of `elems` f32, overflow-checked and named.
  absl::StatusOr<uint64_t> F32Bytes(uint64_t elems, absl::string_view what) const {
    return CheckedMul(elems, kF32Bytes, absl::StrCat("layer ", layer_, " ", what));
  }

 private:
  SessionPlan& session_;
  const uint32_t layer_;
};

absl::Status RefuseUnshardedUnderTp(const LayerPlan& layer, uint32_t tp_ranks) {
  if (tp_ranks == 1) return absl::OkStatus();
  // One daemon per GPU serves one rank's shard; only K/V planes have a rank-local shape.
  return absl::InvalidArgumentError(
      absl::StrCat("layer ", layer.index, ": ", std::string(StateKindName(layer.kind)),
                   " state is not sharded under tensor parallelism (tp_ranks ", tp_ranks, ")"));
}

// Each Plan*Layer receives the geometry with layer, kind and attention filled in.
absl::Status PlanKvLayer(const LayerPlan& layer, const ModelPlan& plan,
                         const FormatDefaults& defaults, const SessionShape& request,
                         LayerGeometry geometry, SessionPlan& session) {
  geometry.formats = ResolveLayerFormats(layer, defaults);
  const std::string prefix = absl::StrCat("layer ", layer.index, " ");
  ASSIGN_OR_RETURN(const uint64_t kv_dim_k,
                   CheckedMul(layer.head_dim_k, layer.n_head_kv,
                              absl::StrCat(prefix, "kv_dim_k (head_dim_k x n_head_kv)")));
  ASSIGN_OR_RETURN(const uint64_t kv_dim_v,
                   CheckedMul(layer.head_dim_v, layer.n_head_kv,
                              absl::StrCat(prefix, "kv_dim_v (head_dim_v x n_head_kv)")));
  // One rank is the degenerate shard, so a single path sizes every K/V layer.
  absl::StatusOr<TpKvRankShape> shape =
      TpKvRankAllocationShape(kv_dim_k, kv_dim_v, request.tp_ranks, geometry.formats);
  if (!shape.ok()) return ForLayer(layer.index, shape.status());

  // An element-format shard is typed as (rows, heads, head_dim): it must split whole heads.
  const bool element_k = !LayoutOf(geometry.formats.k).IsBlock();
  const bool element_v = !LayoutOf(geometry.formats.v).IsBlock();
  if ((element_k || element_v) && layer.n_head_kv % request.tp_ranks != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        prefix, "K/V formats ", std::string(KFormatName(geometry.formats.k)), "/",
        std::string(VFormatName(geometry.formats.v)), " shard whole heads: n_head_kv ",
        layer.n_head_kv, " is not divisible by tp_ranks ", request.tp_ranks));
  }
  geometry.kv_dim_k = shape->kv_dim_k;
  geometry.kv_dim_v = shape->kv_dim_v;
  geometry.head_dim_k = layer.head_dim_k;
  geometry.head_dim_v = layer.head_dim_v;
  geometry.n_head_kv = layer.n_head_kv / request.tp_ranks;
  geometry.k_scale = layer.k_scale;
  geometry.v_scale = layer.v_scale;
  geometry.k_token_bytes = shape->k_token_bytes;
  geometry.v_token_bytes = shape->v_token_bytes;
  geometry.window = layer.window;
  geometry.ring = IsSwaRingLayer(plan, layer);
  // A ring's rows stop growing at its uncapped size. Below that the ring is clamped to the
  // capacity itself (the reference still addresses it with a KvRing), so its bytes DO scale.
  const bool scales = !geometry.ring || request.capacity < SwaRingRows(layer.window, UINT64_MAX);
  geometry.physical_rows = KvPlaneRows(geometry.RingWindow(), request.capacity);

  PlaneWriter out(session, layer.index);
  RETURN_IF_ERROR(out.Add(PlaneKind::kKeys, geometry.physical_rows, geometry.k_token_bytes,
                          kKvPlaneTailPadBytes, scales));
  RETURN_IF_ERROR(out.Add(PlaneKind::kValues, geometry.physical_rows, geometry.v_token_bytes,
                          kKvPlaneTailPadBytes, scales));
  RETURN_IF_ERROR(out.AddMirror(PlaneKind::kLenMirror));
  if (geometry.ring) RETURN_IF_ERROR(out.AddMirror(PlaneKind::kBaseMirror));
  session.layers.push_back(geometry);
  return absl::OkStatus();
}

absl::Status PlanRecurrentLayer(const LayerPlan& layer, const SessionShape& request,
                                LayerGeometry geometry, SessionPlan& session) {
  RETURN_IF_ERROR(RefuseUnshardedUnderTp(layer, request.tp_ranks));
  PlaneWriter out(session, layer.index);
  // conv_kernel - 1 saturates as in the reference: a kernel of 1 keeps no conv history.
  const uint64_t history = layer.conv_kernel > 0 ? layer.conv_kernel - 1 : 0;
  ASSIGN_OR_RETURN(
      geometry.conv_elems,
      CheckedMul(layer.conv_width, history, absl::StrCat("layer ", layer.index, " conv elements")));
  geometry.ssm_elems = layer.state_width;
  ASSIGN_OR_RETURN(const uint64_t conv_bytes, out.F32Bytes(geometry.conv_elems, "conv state"));
  ASSIGN_OR_RETURN(const uint64_t ssm_bytes, out.F32Bytes(geometry.ssm_elems, "ssm state"));

  RETURN_IF_ERROR(out.Add(PlaneKind::kConvState, 1, conv_bytes, 0, false));
  RETURN_IF_ERROR(out.Add(PlaneKind::kSsmState, 1, ssm_bytes, 0, false));
  RETURN_IF_ERROR(out.Add(PlaneKind::kSsmStateAlt, 1, ssm_bytes, 0, false));
  if (request.spec_snapshot) {
    RETURN_IF_ERROR(out.Add(PlaneKind::kSpecConv, 1, conv_bytes, 0, false));
    RETURN_IF_ERROR(out.Add(PlaneKind::kSpecSsm, 1, ssm_bytes, 0, false));
  }
  session.layers.push_back(geometry);
  return absl::OkStatus();
}

absl::Status PlanLatentLayer(const LayerPlan& layer, const ModelPlan& plan,
                             const SessionShape& request, LayerGeometry geometry,
                             SessionPlan& session) {
  RETURN_IF_ERROR(RefuseUnshardedUnderTp(layer, request.tp_ranks));
  geometry.latent_width = layer.latent_width;
  geometry.index_width = layer.index_width;
  geometry.index_pool = layer.index_pool;
  PlaneWriter out(session, layer.index);
  RETURN_IF_ERROR(out.AddMirror(PlaneKind::kLenMirror));
  // One row per token for the whole layer (MQA): no per-head planes, no V plane.
  geometry.latent_format = layer.latent_format;
  geometry.k_scale = layer.k_scale;
  ASSIGN_OR_RETURN(const uint64_t latent_row_bytes,
                   FormatBytes(LayoutOf(layer.latent_format), layer.latent_width,
                               absl::StrCat("layer ", layer.index, " latent row")));
  RETURN_IF_ERROR(out.Add(PlaneKind::kLatentRows, request.capacity, latent_row_bytes, 0, true));

  if (layer.index_width > 0) {
    // The indexer plane is a tail ring of fixed rows, or flat (capacity rows) when the plan
    // disables the ring or the ring would not be shorter than the context.
    const std::optional<uint64_t> ring_rows = IndexRingRowsFor(
        plan.index_ring_rows.has_value() ? std::optional<uint64_t>(*plan.index_ring_rows)
                                         : std::nullopt,
        request.capacity);
    geometry.index_ring = ring_rows.has_value();
    geometry.index_physical_rows = ring_rows.value_or(request.capacity);
    ASSIGN_OR_RETURN(const uint64_t index_row_bytes, out.F32Bytes(layer.index_width, "index row"));
    RETURN_IF_ERROR(out.Add(PlaneKind::kIndexRows, geometry.index_physical_rows, index_row_bytes, 0,
                            !geometry.index_ring));

    // One key of index_head_dim = index_width / 2 f32 per whole pool. The reference allocates
    // it lazily (restore_plane: zeros(((max_ctx / pool) * d).max(1))); the daemon knows the
    // pool, books it with the session, and so admission counts it.
    const uint64_t pools = request.capacity / layer.index_pool;
    ASSIGN_OR_RETURN(const uint64_t pool_key_bytes,
                     out.F32Bytes(layer.index_width / 2, "pool key"));
    const uint64_t one_element_floor = pools == 0 ? kF32Bytes : 0;
    RETURN_IF_ERROR(out.Add(PlaneKind::kPoolKeys, pools, pool_key_bytes, one_element_floor, true));
  }
  session.layers.push_back(geometry);
  return absl::OkStatus();
}

// Context-linear bytes one token adds to a scaling plane: a pool key row is shared by `pool`
// tokens (integer division, as the reference's coefficient).
uint64_t PerTokenBytes(const PlaneSpec& plane, const LayerGeometry& geometry) {
  if (!plane.scales_with_context) return 0;
  return plane.kind == PlaneKind::kPoolKeys ? plane.row_bytes / geometry.index_pool
                                            : plane.row_bytes;
}

}  // namespace

uint64_t TpKvRankShape::BytesPerToken() const {
  return SaturatingAdd(k_token_bytes, v_token_bytes);
}

uint64_t TpKvRankShape::AllocationBytes(uint64_t capacity) const {
  return SaturatingAdd(SaturatingMul(BytesPerToken(), capacity), fixed_bytes);
}

absl::StatusOr<TpKvRankShape> TpKvRankAllocationShape(uint64_t kv_dim_k, uint64_t kv_dim_v,
                                                      uint64_t ranks, KvFormats formats) {
  if (ranks == 0 || kv_dim_k == 0 || kv_dim_v == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("TP KV dimensions and rank count must be nonzero: k=", kv_dim_k,
                     " v=", kv_dim_v, " ranks=", ranks));
  }
  if (kv_dim_k % ranks != 0 || kv_dim_v % ranks != 0) {
    return absl::InvalidArgumentError(absl::StrCat("TP KV dimensions k=", kv_dim_k, " v=", kv_dim_v,
                                                   " are not divisible by TP=", ranks));
  }
  TpKvRankShape shape;
  shape.kv_dim_k = kv_dim_k / ranks;
  shape.kv_dim_v = kv_dim_v / ranks;
  const FormatLayout k = LayoutOf(formats.k);
  const FormatLayout v = LayoutOf(formats.v);
  if (shape.kv_dim_k % k.block_elems != 0 || shape.kv_dim_v % v.block_elems != 0) {
    return absl::InvalidArgumentError(absl::StrCat("TP KV local dimensions k=", shape.kv_dim_k,
                                                   " v=", shape.kv_dim_v, " must be 32-aligned"));
  }
  ASSIGN_OR_RETURN(shape.k_token_bytes, FormatBytes(k, shape.kv_dim_k, "TP KV K token bytes"));
  ASSIGN_OR_RETURN(shape.v_token_bytes, FormatBytes(v, shape.kv_dim_v, "TP KV V token bytes"));
  // Two byte planes keep their 8-byte tail pads, plus one i32 length mirror.
  shape.fixed_bytes = 2 * kKvPlaneTailPadBytes + kMirrorBytes;
  return shape;
}

absl::StatusOr<uint64_t> KvPlaneAllocationBytes(uint64_t rows, uint64_t token_bytes) {
  ASSIGN_OR_RETURN(const uint64_t body, CheckedMul(rows, token_bytes, "K/V plane bytes"));
  return CheckedAdd(body, kKvPlaneTailPadBytes, "K/V plane bytes");
}

std::string_view PlaneKindName(PlaneKind kind) {
  switch (kind) {
    case PlaneKind::kKeys:
      return "keys";
    case PlaneKind::kValues:
      return "values";
    case PlaneKind::kLenMirror:
      return "len_mirror";
    case PlaneKind::kBaseMirror:
      return "base_mirror";
    case PlaneKind::kConvState:
      return "conv_state";
    case PlaneKind::kSsmState:
      return "ssm_state";
    case PlaneKind::kSsmStateAlt:
      return "ssm_state_alt";
    case PlaneKind::kLatentRows:
      return "latent_rows";
    case PlaneKind::kIndexRows:
      return "index_rows";
    case PlaneKind::kPoolKeys:
      return "pool_keys";
    case PlaneKind::kSpecConv:
      return "spec_conv";
    case PlaneKind::kSpecSsm:
      return "spec_ssm";
  }
  return "unknown";
}

absl::StatusOr<SessionPlan> PlanSession(const ModelPlan& plan, const FormatDefaults& defaults,
                                        const SessionShape& request) {
  RETURN_IF_ERROR(ValidateModelPlan(plan));
  RETURN_IF_ERROR(ValidateRequest(plan, request));
  const std::vector<const LayerPlan*> all = plan.AllLayers();
  const uint32_t hi = request.layer_hi.value_or(plan.TotalLayers());
  SessionPlan session;
  for (uint32_t index = request.layer_lo; index < hi; ++index) {
    const LayerPlan& layer = *all[index];  // validated: all[i].index == i
    LayerGeometry geometry;
    geometry.layer = layer.index;
    geometry.kind = layer.kind;
    geometry.attention = layer.attention;
    switch (layer.kind) {
      case StateKind::kKv:
      case StateKind::kSlidingKv:
        RETURN_IF_ERROR(PlanKvLayer(layer, plan, defaults, request, geometry, session));
        break;
      case StateKind::kRecurrent:
        RETURN_IF_ERROR(PlanRecurrentLayer(layer, request, geometry, session));
        break;
      case StateKind::kLatent:
        RETURN_IF_ERROR(PlanLatentLayer(layer, plan, request, geometry, session));
        break;
      case StateKind::kNone:
      case StateKind::kSharedKv:
        break;  // no state of their own (Gemma's shared layers attend an earlier layer's K/V)
    }
  }
  return session;
}

absl::StatusOr<CostBreakdown> CostOfSessionPlan(const SessionPlan& session) {
  CostBreakdown cost;
  cost.total_bytes = session.total_bytes;
  auto geometry = session.layers.begin();
  for (const PlaneSpec& plane : session.planes) {
    // Both lists are in layer order and every plane's layer has a geometry entry.
    while (geometry != session.layers.end() && geometry->layer < plane.layer) ++geometry;
    if (geometry == session.layers.end() || geometry->layer != plane.layer) {
      return absl::InvalidArgumentError(
          absl::StrCat("plane ", std::string(PlaneKindName(plane.kind)), " of layer ", plane.layer,
                       " has no layer geometry"));
    }
    const uint64_t per_token = PerTokenBytes(plane, *geometry);
    ASSIGN_OR_RETURN(cost.bytes_per_token,
                     CheckedAdd(cost.bytes_per_token, per_token, "bytes per token"));
    ASSIGN_OR_RETURN(const uint64_t body, CheckedMul(plane.rows, plane.row_bytes, "plane rows"));
    if (body > plane.bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "plane ", std::string(PlaneKindName(plane.kind)), " of layer ", plane.layer, ": ",
          plane.bytes, " bytes hold less than ", plane.rows, " rows of ", plane.row_bytes));
    }
    // Tail pads and the pool-key floor are fixed even on a scaling plane.
    const uint64_t fixed_part = plane.scales_with_context ? plane.bytes - body : plane.bytes;
    ASSIGN_OR_RETURN(cost.fixed_bytes, CheckedAdd(cost.fixed_bytes, fixed_part, "fixed bytes"));
    uint64_t* bucket = nullptr;
    uint64_t bucket_bytes = per_token;
    switch (plane.kind) {
      case PlaneKind::kKeys:
      case PlaneKind::kValues:
        // Ring layers count whether or not this capacity reaches their cap (the reference's
        // cache_ring_bytes_per_token is the ring-capped share of the coefficient).
        bucket = geometry->ring ? &cost.ring_bytes_per_token : &cost.kv_bytes_per_token;
        bucket_bytes = plane.row_bytes;
        break;
      case PlaneKind::kLatentRows:
      case PlaneKind::kIndexRows:
      case PlaneKind::kPoolKeys:
        bucket = &cost.latent_bytes_per_token;
        break;
      case PlaneKind::kLenMirror:
      case PlaneKind::kBaseMirror:
      case PlaneKind::kConvState:
      case PlaneKind::kSsmState:
      case PlaneKind::kSsmStateAlt:
      case PlaneKind::kSpecConv:
      case PlaneKind::kSpecSsm:
        break;  // fixed size: only in fixed_bytes
    }
    if (bucket != nullptr) {
      ASSIGN_OR_RETURN(*bucket, CheckedAdd(*bucket, bucket_bytes, "per-class bytes per token"));
    }
  }
  for (const LayerGeometry& layer : session.layers) {
    if (layer.ring) {
      cost.ring_row_cap = std::max(cost.ring_row_cap, SwaRingRows(layer.window, UINT64_MAX));
    }
  }
  return cost;
}

absl::StatusOr<CostBreakdown> CostOfSession(const ModelPlan& plan, const FormatDefaults& defaults,
                                            const SessionShape& request) {
  ASSIGN_OR_RETURN(const SessionPlan session, PlanSession(plan, defaults, request));
  return CostOfSessionPlan(session);
}

}  // namespace memra
