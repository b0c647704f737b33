#ifndef MEMRA_COMMON_CODEC_H_
#define MEMRA_COMMON_CODEC_H_

// Conversions between core's value types and their memra.kv.v1 messages: the one place either
// side of the wire (the daemon and the client library) turns one into the other. Proto enums
// are the core values plus one (0 is "unspecified" and refused), so the mapping is arithmetic,
// checked against the core enum's range. Decoding never trusts the sender: INVALID_ARGUMENT
// naming the field for anything out of range.

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "core/model_plan.h"
#include "core/sizing.h"
#include "core/transaction.h"
#include "proto/memra/kv/v1/cache.pb.h"
#include "proto/memra/kv/v1/model_plan.pb.h"

namespace memra {

memra::kv::v1::ModelPlan ModelPlanToProto(const ModelPlan& plan);
absl::StatusOr<ModelPlan> ModelPlanFromProto(const memra::kv::v1::ModelPlan& proto);

memra::kv::v1::PlaneKind PlaneKindToProto(PlaneKind kind);
absl::StatusOr<PlaneKind> PlaneKindFromProto(memra::kv::v1::PlaneKind kind);
memra::kv::v1::StateKind StateKindToProto(StateKind kind);
memra::kv::v1::KvFormats KvFormatsToProto(const KvFormats& formats);

memra::kv::v1::LayerAppendPlan LayerAppendToProto(const LayerAppend& layer);
LayerAppend LayerAppendFromProto(const memra::kv::v1::LayerAppendPlan& proto);

// A 32-byte fingerprint as it travels (bytes field); INVALID_ARGUMENT for another length.
std::string FingerprintToBytes(const PlanFingerprint& fingerprint);
absl::StatusOr<PlanFingerprint> FingerprintFromBytes(const std::string& bytes);

}  // namespace memra

#endif  // MEMRA_COMMON_CODEC_H_
