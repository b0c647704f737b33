#include "tests/fuzz/fuzz_targets.h"

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/codec.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/stubs/logging.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "core/formats.h"
#include "core/model_plan.h"
#include "core/session.h"
#include "core/sizing.h"
#include "core/status_macros.h"
#include "core/test_model_plans.h"
#include "core/transaction.h"
#include "proto/memra/kv/v1/admin.pb.h"
#include "proto/memra/kv/v1/cache.pb.h"
#include "server/session/model_import.h"

namespace memra::fuzz {
namespace {

namespace pb = memra::kv::v1;

// The daemon's default max_plan_layers (server/config.h): it refuses larger inline plans before
// decoding them, so decoding past it is not a path an engine can reach.
constexpr uint64_t kDaemonPlanLayerCap = 4096;

absl::Status Broken(absl::string_view what) {
  return absl::InternalError(absl::StrCat("fuzz invariant broken: ", what));
}

// Deterministic serialization, so that equal messages compare equal as bytes.
std::string Serialized(const google::protobuf::Message& message) {
  std::string bytes;
  google::protobuf::io::StringOutputStream stream(&bytes);
  google::protobuf::io::CodedOutputStream coded(&stream);
  coded.SetSerializationDeterministic(true);
  message.SerializeToCodedStream(&coded);
  coded.Trim();
  return bytes;
}

// A decoded plan through everything the daemon does with it before admission.
absl::Status CheckPlan(const ModelPlan& plan, const pb::SessionShape& shape_proto) {
  if (!ValidateModelPlan(plan).ok()) return absl::OkStatus();
  const FormatDefaults defaults;
  if (!FingerprintModelPlan(plan, defaults).ok()) {
    return Broken("a validated plan does not fingerprint");
  }
  const SessionShape shape = SessionShapeFromProto(shape_proto);
  absl::StatusOr<SessionPlan> planes = PlanSession(plan, defaults, shape);
  if (!planes.ok()) return absl::OkStatus();
  absl::StatusOr<CostBreakdown> cost = CostOfSessionPlan(*planes);
  if (!cost.ok()) return Broken(absl::StrCat("PlanSession's plan has no cost: ", cost.status().message()));
  if (cost->total_bytes != planes->total_bytes) {
    return Broken(absl::StrCat("cost total ", cost->total_bytes, " != planned bytes ",
                               planes->total_bytes));
  }
  absl::StatusOr<CostBreakdown> direct = CostOfSession(plan, defaults, shape);
  if (!direct.ok() || direct->total_bytes != cost->total_bytes) {
    return Broken("CostOfSession disagrees with CostOfSessionPlan");
  }
  return absl::OkStatus();
}

absl::Status DecodeCostRequest(std::string_view bytes) {
  pb::CostRequest request;
  if (!request.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return absl::OkStatus();
  }
  const pb::ModelSelector& selector = request.model();
  switch (selector.model_case()) {
    case pb::ModelSelector::kPlanFingerprint: {
      const bool decoded = FingerprintFromBytes(selector.plan_fingerprint()).ok();
      if (decoded != (selector.plan_fingerprint().size() == 32)) {
        return Broken("FingerprintFromBytes accepts exactly 32 bytes");
      }
      return absl::OkStatus();
    }
    case pb::ModelSelector::kPlan: {
      if (LayerCountOf(selector.plan()) > kDaemonPlanLayerCap) return absl::OkStatus();
      absl::StatusOr<ModelPlan> plan = ModelPlanFromProto(selector.plan());
      if (!plan.ok()) return absl::OkStatus();
      // Encoding a decoded plan and decoding it again is the identity.
      const pb::ModelPlan encoded = ModelPlanToProto(*plan);
      absl::StatusOr<ModelPlan> again = ModelPlanFromProto(encoded);
      if (!again.ok()) return Broken("a decoded plan's encoding does not decode");
      if (Serialized(ModelPlanToProto(*again)) != Serialized(encoded)) {
        return Broken("plan decode(encode(plan)) != plan");
      }
      return CheckPlan(*plan, request.shape());
    }
    case pb::ModelSelector::kHfConfigJson: {
      absl::StatusOr<ModelPlan> plan =
          ImportHuggingFaceConfig(selector.hf_config_json(), ImportOptions{});
      if (!plan.ok()) return absl::OkStatus();
      if (!ValidateModelPlan(*plan).ok()) return Broken("an imported plan does not validate");
      return CheckPlan(*plan, request.shape());
    }
    case pb::ModelSelector::MODEL_NOT_SET:
      break;
  }
  return absl::OkStatus();
}

absl::Status DecodeLayerAppends(std::string_view bytes) {
  pb::PrepareAppendResponse response;
  if (!response.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return absl::OkStatus();
  }
  std::vector<LayerAppend> layers;
  LayerAppendsFromProto(response.layers(), layers);
  // The daemon sends one plan per K/V layer. A reply naming a layer twice is malformed (the
  // client trusts its daemon and does not check); the decoded order among duplicates is
  // unspecified (std::sort), so the round trip below holds only for replies a daemon sends.
  for (size_t i = 1; i < layers.size(); ++i) {
    if (layers[i].layer == layers[i - 1].layer) return absl::OkStatus();
  }
  google::protobuf::RepeatedPtrField<pb::LayerAppendPlan> encoded;
  LayerAppendsToProto(layers, &encoded);
  std::vector<LayerAppend> again;
  LayerAppendsFromProto(encoded, again);
  if (again != layers) return Broken("layer appends decode(encode(x)) != x");
  return absl::OkStatus();
}

// Consumes the input a byte at a time; 0 once it is used up.
class ByteReader {
 public:
  explicit ByteReader(std::string_view bytes) : bytes_(bytes) {}
  bool empty() const { return position_ >= bytes_.size(); }
  uint8_t Next() { return empty() ? 0 : static_cast<uint8_t>(bytes_[position_++]); }

 private:
  std::string_view bytes_;
  size_t position_ = 0;
};

// Small models, one per plane kind, so that rings lap and pools fill within a short input.
ModelPlan FuzzModel(uint8_t selector) {
  using namespace memra::test_plans;
  ModelPlan plan;
  switch (selector % 5) {
    case 0:
      plan = DenseModel(2, 32, 1);
      break;
    case 1:
      plan.swa_ring = true;
      plan.layers = {SlidingLayer(0, 32, 1, 4), KvLayer(1, 32, 1), SlidingLayer(2, 32, 1, 8)};
      break;
    case 2:
      plan.index_ring_rows = (selector / 5) % 2 == 0 ? std::nullopt : std::optional<uint32_t>(8);
      plan.layers = {LatentLayer(0, 8, 8, 4), LatentLayer(1, 8)};
      break;
    case 3:
      plan.layers = {RecurrentLayer(0, 4, 4, 8), KvLayer(1, 32, 1)};
      break;
    default:
      plan.swa_ring = true;
      plan.layers = {KvLayer(0, 32, 1), SlidingLayer(1, 32, 1, 4), RecurrentLayer(2, 4, 4, 8),
                     LatentLayer(3, 8, 8, 4)};
      break;
  }
  return plan;
}

absl::StatusOr<SessionState> SessionOf(const ModelPlan& model, uint64_t capacity,
                                       bool spec_snapshot, uint64_t cache_id) {
  SessionShape shape;
  shape.capacity = capacity;
  shape.spec_snapshot = spec_snapshot;
  absl::StatusOr<SessionPlan> plan = PlanSession(model, FormatDefaults(), shape);
  if (!plan.ok()) return plan.status();
  return SessionState::Create(cache_id, *plan, capacity);
}

// Everything observable about a session, to tell whether a refused op changed it.
struct Observed {
  uint64_t cache_id, capacity, committed, staged, position;
  bool tainted, spec_valid;
  TransactionState transaction;
  std::optional<AppendPlan> pending;
  std::vector<LatentLayerState> latent;
  std::vector<std::optional<KvRing>> rings;
  std::vector<MirrorValue> mirrors;
  bool operator==(const Observed&) const = default;
};

Observed Observe(const SessionState& session) {
  Observed observed{session.cache_id(),     session.capacity(),    session.committed_len(),
                    session.staged_len(),   session.position(),    session.tainted(),
                    session.spec_snapshot_valid(), session.kv().state(), session.pending_append(),
                    session.latent(),       {},                    session.Mirrors()};
  for (size_t i = 0; i < session.kv().layer_count(); ++i) {
    observed.rings.push_back(session.kv().ring(i));
  }
  return observed;
}

absl::Status CheckInvariants(const SessionState& session) {
  if (session.committed_len() > session.staged_len() ||
      session.staged_len() > session.capacity()) {
    return Broken(absl::StrCat("lengths committed ", session.committed_len(), " staged ",
                               session.staged_len(), " capacity ", session.capacity()));
  }
  if (!session.kv().state().active().has_value() &&
      session.staged_len() != session.committed_len()) {
    return Broken("staged != committed with no transaction");
  }
  for (const LatentLayerState& layer : session.latent()) {
    if (layer.len != session.staged_len()) {
      return Broken(absl::StrCat("latent layer ", layer.layer, " len ", layer.len, " != staged ",
                                 session.staged_len()));
    }
    if (layer.index_pool > 0 && layer.index_pools_ready > layer.len / layer.index_pool) {
      return Broken(absl::StrCat("latent layer ", layer.layer, " pools_ready ",
                                 layer.index_pools_ready, " > len ", layer.len, " / pool ",
                                 layer.index_pool));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status FuzzRequestDecoding(std::string_view input) {
  // Protobuf logs an ERROR line for every string field that is not UTF-8: a refused parse, and
  // here nearly every other input. Silenced so that the runs' output stays readable.
  static const bool kProtobufLogsSilenced = [] {
    google::protobuf::SetLogHandler(nullptr);
    return true;
  }();
  (void)kProtobufLogsSilenced;
  if (input.empty()) return absl::OkStatus();
  const std::string_view rest = input.substr(1);
  return input[0] % 2 == 0 ? DecodeCostRequest(rest) : DecodeLayerAppends(rest);
}

absl::Status FuzzSessionOps(std::string_view input) {
  ByteReader reader(input);
  const ModelPlan model = FuzzModel(reader.Next());
  const uint8_t shape_byte = reader.Next();
  const uint64_t capacity = 1 + shape_byte % 48;
  const bool spec_buffers = shape_byte >= 128;
  uint64_t next_cache_id = 1;
  absl::StatusOr<SessionState> created = SessionOf(model, capacity, spec_buffers, next_cache_id++);
  if (!created.ok()) return Broken(absl::StrCat("fuzz model refused: ", created.status().message()));
  SessionState session = *std::move(created);

  while (!reader.empty()) {
    const uint8_t op = reader.Next();
    const uint8_t argument = reader.Next();
    const std::optional<TransactionId>& active = session.kv().state().active();
    // Mostly the live generation; sometimes a stale or made-up one.
    const uint64_t generation =
        (op & 0x80) == 0 && active ? active->generation : uint64_t(argument % 4);
    const Observed before = Observe(session);
    absl::Status status;
    switch (op % 12) {
      case 0:
        status = session.Begin().status();
        break;
      case 1:
        status = session.PrepareAppend(generation, argument % (session.capacity() / 2 + 3)).status();
        break;
      case 2:
        status = session.PublishAppend(generation);
        break;
      case 3:
        status = session.Commit(generation, argument % 8).status();
        break;
      case 4:
        status = session.Abort(generation);
        break;
      case 5: {
        const uint64_t target = argument % (session.capacity() + 2);
        const bool predicted = session.CanRewindTo(target);
        status = session.Rewind(target);
        if (!session.tainted() && before.tainted == false && predicted != status.ok()) {
          return Broken(absl::StrCat("CanRewindTo(", target, ") = ", predicted,
                                     " but Rewind: ", status.ToString()));
        }
        break;
      }
      case 6:
        status = session.SpecSnapshot().status();
        break;
      case 7:
        status = session.SpecRollback(argument % 8).status();
        break;
      case 8: {
        std::vector<uint64_t> starts;
        if (argument & 1) {
          for (size_t i = 0; i < session.kv().layer_count(); ++i) starts.push_back(reader.Next() % 64);
        }
        status = session.Hydrate(argument % (session.capacity() + 2), starts);
        break;
      }
      case 9:
        status = session.Reset();
        break;
      case 10: {
        absl::StatusOr<SessionState> target = SessionOf(
            model, session.capacity() + argument % 16, spec_buffers, next_cache_id++);
        if (!target.ok()) return Broken("grow target refused");
        status = SessionState::Grow(session, *target).status();
        if (Observe(session) != before) return Broken("Grow changed its source");
        if (status.ok()) {
          RETURN_IF_ERROR(CheckInvariants(*target));
          session = *std::move(target);
        }
        break;
      }
      default:
        if (argument == 0xff) {
          session.MarkTainted();
          break;
        }
        // One decode step in one operation: finish `generation` (or none), prepare the next.
        status = session
                     .Advance({.generation = (argument & 0x40) != 0 ? 0 : generation,
                               .accepted_rows = argument % 8u,
                               .next_rows = (argument >> 3) % 8u})
                     .status();
        break;
    }
    if (!status.ok() && Observe(session) != before) {
      return Broken(absl::StrCat("op ", op % 12, " was refused (", status.ToString(),
                                 ") but changed the session"));
    }
    RETURN_IF_ERROR(CheckInvariants(session));
  }
  return absl::OkStatus();
}

}  // namespace memra::fuzz
