#include "common/codec.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace memra {
namespace {

namespace pb = ::memra::kv::v1;

// Proto value = core value + 1; `last` is the largest core value.
template <typename Core, typename Proto>
absl::StatusOr<Core> EnumFromProto(Proto value, Core last, absl::string_view field) {
  const int raw = static_cast<int>(value);
  if (raw < 1 || raw > static_cast<int>(last) + 1) {
    return absl::InvalidArgumentError(absl::StrCat(field, " is ", raw,
                                                   ": unspecified or unknown (accepted 1 to ",
                                                   static_cast<int>(last) + 1, ")"));
  }
  return static_cast<Core>(raw - 1);
}

template <typename Proto, typename Core>
Proto EnumToProto(Core value) {
  return static_cast<Proto>(static_cast<int>(value) + 1);
}

pb::LayerPlan LayerToProto(const LayerPlan& layer) {
  pb::LayerPlan out;
  out.set_index(layer.index);
  out.set_kind(StateKindToProto(layer.kind));
  out.set_attention(EnumToProto<pb::AttentionClass>(layer.attention));
  out.set_head_dim_k(layer.head_dim_k);
  out.set_head_dim_v(layer.head_dim_v);
  out.set_n_head_kv(layer.n_head_kv);
  if (layer.formats.has_value()) *out.mutable_formats() = KvFormatsToProto(*layer.formats);
  out.set_window(layer.window);
  out.set_conv_width(layer.conv_width);
  out.set_conv_kernel(layer.conv_kernel);
  out.set_state_width(layer.state_width);
  out.set_latent_width(layer.latent_width);
  out.set_index_width(layer.index_width);
  out.set_index_pool(layer.index_pool);
  out.set_shares_kv_with(layer.shares_kv_with);
  out.mutable_k_scale()->Add(layer.k_scale.begin(), layer.k_scale.end());
  out.mutable_v_scale()->Add(layer.v_scale.begin(), layer.v_scale.end());
  if (layer.kind == StateKind::kLatent) {
    out.set_latent_format(ElementFormatToProto(layer.latent_format));
  }
  return out;
}

absl::StatusOr<LayerPlan> LayerFromProto(const pb::LayerPlan& proto, absl::string_view where) {
  LayerPlan layer;
  layer.index = proto.index();
  ASSIGN_OR_RETURN(layer.kind,
                   EnumFromProto(proto.kind(), StateKind::kSharedKv, absl::StrCat(where, ".kind")));
  // Attention class only matters for K/V layers; unspecified means ordinary.
  if (proto.attention() != pb::ATTENTION_CLASS_UNSPECIFIED) {
    ASSIGN_OR_RETURN(layer.attention,
                     EnumFromProto(proto.attention(), AttentionClass::kGemmaWindowed,
                                   absl::StrCat(where, ".attention")));
  }
  layer.head_dim_k = proto.head_dim_k();
  layer.head_dim_v = proto.head_dim_v();
  layer.n_head_kv = proto.n_head_kv();
  if (proto.has_formats()) {
    ASSIGN_OR_RETURN(layer.formats,
                     KvFormatsFromProto(proto.formats(), absl::StrCat(where, ".formats")));
  }
  layer.window = proto.window();
  layer.conv_width = proto.conv_width();
  layer.conv_kernel = proto.conv_kernel();
  layer.state_width = proto.state_width();
  layer.latent_width = proto.latent_width();
  layer.index_width = proto.index_width();
  layer.index_pool = proto.index_pool();
  layer.shares_kv_with = proto.shares_kv_with();
  layer.k_scale.assign(proto.k_scale().begin(), proto.k_scale().end());
  layer.v_scale.assign(proto.v_scale().begin(), proto.v_scale().end());
  ASSIGN_OR_RETURN(layer.latent_format,
                   ElementFormatFromProto(proto.latent_format(),
                                          absl::StrCat(where, ".latent_format")));
  return layer;
}

}  // namespace

pb::StateKind StateKindToProto(StateKind kind) { return EnumToProto<pb::StateKind>(kind); }

absl::StatusOr<StateKind> StateKindFromProto(pb::StateKind kind) {
  return EnumFromProto(kind, StateKind::kSharedKv, "state kind");
}

absl::StatusOr<KvFormats> KvFormatsFromProto(const pb::KvFormats& formats,
                                             absl::string_view field) {
  KvFormats out;
  ASSIGN_OR_RETURN(out.k, EnumFromProto(formats.k(), kLastKFormat, absl::StrCat(field, ".k")));
  ASSIGN_OR_RETURN(out.v, EnumFromProto(formats.v(), kLastVFormat, absl::StrCat(field, ".v")));
  return out;
}

pb::ElementFormat ElementFormatToProto(ElementFormat format) {
  return EnumToProto<pb::ElementFormat>(format);
}

absl::StatusOr<ElementFormat> ElementFormatFromProto(pb::ElementFormat format,
                                                     absl::string_view field) {
  // Unspecified is the reference's f32 row: plans from before the field keep their meaning.
  if (format == pb::ELEMENT_FORMAT_UNSPECIFIED) return ElementFormat::kF32;
  return EnumFromProto(format, kLastElementFormat, field);
}

pb::KvFormats KvFormatsToProto(const KvFormats& formats) {
  pb::KvFormats out;
  out.set_k(EnumToProto<pb::KFormat>(formats.k));
  out.set_v(EnumToProto<pb::VFormat>(formats.v));
  return out;
}

pb::ModelPlan ModelPlanToProto(const ModelPlan& plan) {
  pb::ModelPlan out;
  out.set_name(plan.name);
  for (const LayerPlan& layer : plan.layers) *out.add_layers() = LayerToProto(layer);
  for (const LayerPlan& layer : plan.mtp_blocks) *out.add_mtp_blocks() = LayerToProto(layer);
  out.set_swa_ring(plan.swa_ring);
  if (plan.index_ring_rows.has_value()) out.set_index_ring_rows(*plan.index_ring_rows);
  return out;
}

uint64_t LayerCountOf(const pb::ModelPlan& proto) {
  return uint64_t(proto.layers_size()) + uint64_t(proto.mtp_blocks_size());
}

absl::StatusOr<ModelPlan> ModelPlanFromProto(const pb::ModelPlan& proto) {
  ModelPlan plan;
  plan.name = proto.name();
  plan.layers.reserve(proto.layers_size());
  for (int i = 0; i < proto.layers_size(); ++i) {
    ASSIGN_OR_RETURN(LayerPlan layer,
                     LayerFromProto(proto.layers(i), absl::StrCat("plan.layers[", i, "]")));
    plan.layers.push_back(layer);
  }
  for (int i = 0; i < proto.mtp_blocks_size(); ++i) {
    ASSIGN_OR_RETURN(LayerPlan layer,
                     LayerFromProto(proto.mtp_blocks(i), absl::StrCat("plan.mtp_blocks[", i, "]")));
    plan.mtp_blocks.push_back(layer);
  }
  plan.swa_ring = proto.swa_ring();
  if (proto.has_index_ring_rows()) plan.index_ring_rows = proto.index_ring_rows();
  return plan;
}

pb::PlaneKind PlaneKindToProto(PlaneKind kind) { return EnumToProto<pb::PlaneKind>(kind); }

absl::StatusOr<PlaneKind> PlaneKindFromProto(pb::PlaneKind kind) {
  return EnumFromProto(kind, PlaneKind::kSpecSsm, "plane kind");
}

namespace {

// Equal append plans apart from the layer id.
bool SamePlan(const LayerAppend& a, const LayerAppend& b) {
  return a.write_row == b.write_row && a.ring_append == b.ring_append;
}

void SetPlan(const LayerAppend& layer, pb::LayerAppendPlan* out) {
  out->set_layer(layer.layer);
  out->set_write_row(layer.write_row);
  if (layer.ring_append.has_value()) {
    const RingAppend& ring = *layer.ring_append;
    out->set_ring(true);
    out->set_rebase(ring.kind == RingAppend::Kind::kRebase);
    out->set_src_row(ring.src_row);
    out->set_keep_rows(ring.keep_rows);
    out->set_new_base(ring.new_base);
  }
}

LayerAppend PlanFromProto(const pb::LayerAppendPlan& proto, uint32_t layer) {
  LayerAppend out;
  out.layer = layer;
  out.write_row = proto.write_row();
  if (proto.ring()) {
    out.ring_append = proto.rebase() ? RingAppend::Rebase(proto.src_row(), proto.keep_rows(),
                                                          proto.new_base(), proto.write_row())
                                     : RingAppend::Contiguous(proto.write_row());
  }
  return out;
}

}  // namespace

void LayerAppendsToProto(const std::vector<LayerAppend>& layers,
                         google::protobuf::RepeatedPtrField<pb::LayerAppendPlan>* out) {
  // A model has few distinct plans per step (flat layers, each ring geometry), so a linear
  // search over the groups so far is the cheap way.
  std::vector<const LayerAppend*> groups;
  for (const LayerAppend& layer : layers) {
    size_t group = 0;
    while (group < groups.size() && !SamePlan(*groups[group], layer)) ++group;
    if (group == groups.size()) {
      groups.push_back(&layer);
      SetPlan(layer, out->Add());
    } else {
      out->Mutable(static_cast<int>(group))->add_more_layers(layer.layer);
    }
  }
}

void LayerAppendsFromProto(const google::protobuf::RepeatedPtrField<pb::LayerAppendPlan>& plans,
                           std::vector<LayerAppend>& out) {
  out.clear();
  for (const pb::LayerAppendPlan& plan : plans) {
    out.push_back(PlanFromProto(plan, plan.layer()));
    for (uint32_t layer : plan.more_layers()) out.push_back(PlanFromProto(plan, layer));
  }
  auto by_layer = [](const LayerAppend& a, const LayerAppend& b) { return a.layer < b.layer; };
  if (!std::is_sorted(out.begin(), out.end(), by_layer)) {
    std::sort(out.begin(), out.end(), by_layer);
  }
}

std::string FingerprintToBytes(const PlanFingerprint& fingerprint) {
  return std::string(reinterpret_cast<const char*>(fingerprint.data()), fingerprint.size());
}

absl::StatusOr<PlanFingerprint> FingerprintFromBytes(const std::string& bytes) {
  PlanFingerprint fingerprint;
  if (bytes.size() != fingerprint.size()) {
    return absl::InvalidArgumentError(absl::StrCat("plan fingerprint is ", bytes.size(),
                                                   " bytes; expected ", fingerprint.size()));
  }
  std::memcpy(fingerprint.data(), bytes.data(), fingerprint.size());
  return fingerprint;
}

}  // namespace memra
