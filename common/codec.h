#ifndef MEMRA_COMMON_CODEC_H_
#define MEMRA_COMMON_CODEC_H_

// Conversions between core's value types and their memra.kv.v1 messages: the one place either
// side of the wire (the daemon and the client library) turns one into the other. Proto enums
// are the core values plus one (0 is "unspecified" and refused), so the mapping is arithmetic,
// checked against the core enum's range. Decoding never trusts the sender: INVALID_ARGUMENT
// naming the field for anything out of range.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/model_plan.h"
#include "core/sizing.h"
#include "core/transaction.h"
#include "proto/memra/kv/v1/admin.pb.h"
#include "proto/memra/kv/v1/cache.pb.h"
#include "proto/memra/kv/v1/model_plan.pb.h"
#include "proto/memra/kv/v1/prefix.pb.h"

namespace memra {

memra::kv::v1::ModelPlan ModelPlanToProto(const ModelPlan& plan);
absl::StatusOr<ModelPlan> ModelPlanFromProto(const memra::kv::v1::ModelPlan& proto);
// Trunk layers + MTP blocks, without decoding (the daemon's layer cap comes before any work).
uint64_t LayerCountOf(const memra::kv::v1::ModelPlan& proto);

memra::kv::v1::PlaneKind PlaneKindToProto(PlaneKind kind);
absl::StatusOr<PlaneKind> PlaneKindFromProto(memra::kv::v1::PlaneKind kind);
memra::kv::v1::StateKind StateKindToProto(StateKind kind);
absl::StatusOr<StateKind> StateKindFromProto(memra::kv::v1::StateKind kind);
memra::kv::v1::KvFormats KvFormatsToProto(const KvFormats& formats);
// INVALID_ARGUMENT naming `field` (".k" / ".v" appended) for an unspecified or unknown value.
absl::StatusOr<KvFormats> KvFormatsFromProto(const memra::kv::v1::KvFormats& formats,
                                             absl::string_view field);
memra::kv::v1::ElementFormat ElementFormatToProto(ElementFormat format);
// UNSPECIFIED reads as f32 (the reference's latent row); an unknown value is INVALID_ARGUMENT
// naming `field`.
absl::StatusOr<ElementFormat> ElementFormatFromProto(memra::kv::v1::ElementFormat format,
                                                     absl::string_view field);

// An append plan's per-layer entries (`layers` in layer order) as LayerAppendPlan messages, one
// per distinct plan: layers whose plans are equal but for the layer id share one message
// (more_layers). A 32-layer dense model's decode step is then one message, not 32.
void LayerAppendsToProto(
    const std::vector<LayerAppend>& layers,
    google::protobuf::RepeatedPtrField<memra::kv::v1::LayerAppendPlan>* out);
// The inverse, into `out` (cleared; its capacity is reused), in layer order.
void LayerAppendsFromProto(
    const google::protobuf::RepeatedPtrField<memra::kv::v1::LayerAppendPlan>& plans,
    std::vector<LayerAppend>& out);

// The session shape a request carries: CreateSessionRequest, ReserveRequest, admin SessionShape
// or PrefixShape (the last has no capacity or spec_snapshot: left 0 / false). tp_ranks 0 reads as
// 1 (unsharded). The one place a wire shape becomes core's.
template <typename ShapeProto>
SessionShape SessionShapeFromProto(const ShapeProto& proto) {
  SessionShape shape;
  shape.layer_lo = proto.layer_lo();
  if (proto.has_layer_hi()) shape.layer_hi = proto.layer_hi();
  shape.tp_ranks = proto.tp_ranks() == 0 ? 1 : proto.tp_ranks();
  if constexpr (requires { proto.capacity(); }) shape.capacity = proto.capacity();
  if constexpr (requires { proto.spec_snapshot(); }) shape.spec_snapshot = proto.spec_snapshot();
  return shape;
}

// A 32-byte fingerprint as it travels (bytes field); INVALID_ARGUMENT for another length.
std::string FingerprintToBytes(const PlanFingerprint& fingerprint);
absl::StatusOr<PlanFingerprint> FingerprintFromBytes(const std::string& bytes);

// A repeated scalar field (token ids, resident starts) as a span over the message's storage.
template <typename T>
absl::Span<const T> SpanOf(const google::protobuf::RepeatedField<T>& field) {
  return absl::MakeConstSpan(field.data(), static_cast<size_t>(field.size()));
}

}  // namespace memra

#endif  // MEMRA_COMMON_CODEC_H_
