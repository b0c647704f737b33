#include "server/edge/session_wire.h"

#include "absl/container/flat_hash_map.h"
#include "common/codec.h"

namespace memra {

namespace pb = ::memra::kv::v1;

void TransactionToProto(const TransactionId& transaction, pb::BeginResponse* out) {
  out->set_generation(transaction.generation);
  out->set_base_len(transaction.base_len);
}

void AppendPlanToProto(const AppendPlan& plan, pb::PrepareAppendResponse* out) {
  out->set_generation(plan.transaction.generation);
  out->set_target(plan.target);
  LayerAppendsToProto(plan.layers, out->mutable_layers());
}

void AdvancedToProto(const SessionAdvanced& advanced, pb::AdvanceResponse* out) {
  out->set_committed_len(advanced.committed_len);
  out->set_published(advanced.step.published);
  if (advanced.step.prepared.has_value()) {
    AppendPlanToProto(*advanced.step.prepared, out->mutable_prepared());
  }
}

void SessionStatusToProto(const SessionStatus& status, pb::SessionState* out) {
  out->set_layout_version(status.layout_version);
  out->set_capacity(status.capacity);
  out->set_committed_len(status.committed_len);
  out->set_staged_len(status.staged_len);
  out->set_position(status.position);
  out->set_active_generation(status.active_generation);
  out->set_next_generation(status.next_generation);
  out->set_tainted(status.tainted);
  out->set_spec_snapshot_valid(status.spec_snapshot_valid);
  out->set_grow_pending(status.grow_pending);
  for (const LayerStatus& layer : status.layers) {
    pb::LayerState* entry = out->add_layers();
    entry->set_layer(layer.layer);
    entry->set_length(layer.length);
    entry->set_ring(layer.ring);
    entry->set_ring_base(layer.ring_base);
    entry->set_index_pools_ready(layer.index_pools_ready);
    entry->set_index_resident_from(layer.index_resident_from);
  }
}

void PlacedLayoutToProto(const PlacedLayout& layout, pb::SessionLayout* out) {
  out->set_layout_version(layout.layout_version);
  out->set_capacity(layout.capacity);
  pb::Arena* arena = out->add_arenas();
  arena->set_backend(layout.arena.backend);
  arena->set_handle(layout.arena.handle);
  arena->set_bytes(layout.arena.bytes);
  absl::flat_hash_map<uint32_t, pb::LayerLayout*> by_layer;
  for (const LayerGeometry& geometry : layout.plan.layers) {
    pb::LayerLayout* layer = out->add_layers();
    by_layer[geometry.layer] = layer;
    layer->set_layer(geometry.layer);
    layer->set_kind(StateKindToProto(geometry.kind));
    *layer->mutable_formats() = KvFormatsToProto(geometry.formats);
    layer->set_k_token_bytes(geometry.k_token_bytes);
    layer->set_v_token_bytes(geometry.v_token_bytes);
    layer->set_window(geometry.window);
    layer->set_physical_rows(geometry.physical_rows);
    layer->set_ring(geometry.ring);
    layer->set_latent_width(geometry.latent_width);
    layer->set_index_width(geometry.index_width);
    layer->set_index_pool(geometry.index_pool);
    layer->set_index_physical_rows(geometry.index_physical_rows);
    layer->set_index_ring(geometry.index_ring);
    layer->set_head_dim_k(geometry.head_dim_k);
    layer->set_head_dim_v(geometry.head_dim_v);
    layer->set_n_head_kv(geometry.n_head_kv);
    layer->mutable_k_scale()->Add(geometry.k_scale.begin(), geometry.k_scale.end());
    layer->mutable_v_scale()->Add(geometry.v_scale.begin(), geometry.v_scale.end());
    if (geometry.kind == StateKind::kLatent) {
      layer->set_latent_format(ElementFormatToProto(geometry.latent_format));
    }
  }
  for (size_t i = 0; i < layout.plan.planes.size() && i < layout.offsets.size(); ++i) {
    const PlaneSpec& spec = layout.plan.planes[i];
    auto it = by_layer.find(spec.layer);
    if (it == by_layer.end()) continue;  // core lists planes only for layers it lists
    pb::Plane* plane = it->second->add_planes();
    plane->set_kind(PlaneKindToProto(spec.kind));
    plane->set_arena(0);
    plane->set_offset(layout.offsets[i]);
    plane->set_bytes(spec.bytes);
    plane->set_rows(spec.rows);
    plane->set_row_bytes(spec.row_bytes);
  }
}

void SessionReportToProto(const SessionReport& report, pb::SessionState* state,
                          pb::SessionLayout* layout) {
  SessionStatusToProto(report.state, state);
  if (layout != nullptr && report.layout.has_value()) PlacedLayoutToProto(*report.layout, layout);
}

}  // namespace memra
