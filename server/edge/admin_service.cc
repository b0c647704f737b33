#include "server/edge/admin_service.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "common/codec.h"
#include "core/admission.h"
#include "core/sizing.h"
#include "core/status_macros.h"
#include "server/edge/model_config_bounds.h"
#include "server/session/model_import.h"
#include "server/edge/rpc_reply.h"

namespace memra {
namespace {

namespace pb = ::memra::kv::v1;

}  // namespace

absl::StatusOr<AdminService::Pricing> AdminService::PricingFor(
    const pb::ModelSelector& model, const pb::SessionShape& shape) const {
  ASSIGN_OR_RETURN(std::shared_ptr<const ModelPlan> plan, ResolveModel(model));
  return Pricing{std::move(plan), SessionShapeFromProto(shape),
                 parts_.sessions->format_defaults(), parts_.sessions->rounding()};
}

pb::GetStatusResponse AdminService::Status() const {
  pb::GetStatusResponse out;
  DeviceBackend& backend = *parts_.backend;
  out.set_backend(std::string(backend.Name()));
  const DeviceInfo info = backend.Info();
  out.set_device_name(info.name);
  out.set_device_uuid(info.uuid);
  out.set_device_total_bytes(info.total_bytes);
  out.set_device_free_bytes(info.free_bytes);
  out.set_allocated_bytes(backend.AllocatedBytes());
  out.set_arena_count(backend.ArenaCount());
  out.set_epoch(parts_.epoch);
  out.set_uptime_ms(absl::ToInt64Milliseconds(parts_.clock->Now() - parts_.started));
  const std::optional<bool> remote_up =
      parts_.remote_tier_up ? parts_.remote_tier_up() : std::nullopt;
  out.set_prefix_remote_tier(!remote_up.has_value() ? pb::REMOTE_TIER_NONE
                             : *remote_up           ? pb::REMOTE_TIER_UP
                                                    : pb::REMOTE_TIER_DOWN);
  const RestartSurvival survival =
      parts_.restart_survival ? parts_.restart_survival() : RestartSurvival{};
  out.set_restart_survival(survival.state == RestartSurvival::State::kOn   ? pb::RESTART_SURVIVAL_ON
                           : survival.state == RestartSurvival::State::kLost ? pb::RESTART_SURVIVAL_LOST
                                                                        : pb::RESTART_SURVIVAL_OFF);
  out.set_restart_survival_detail(survival.detail);
  const AdmissionLedger ledger = parts_.budget->Snapshot();
  pb::AdmissionStatus* admission = out.mutable_admission();
  admission->set_budget_bytes(ledger.budget());
  admission->set_reserved_bytes(ledger.reserved());
  admission->set_allocated_bytes(ledger.allocated());
  admission->set_free_bytes(ledger.free());
  admission->set_evictable_bytes(ledger.evictable());
  admission->set_reservations(ledger.reservation_count());
  admission->set_over_budget_bytes(ledger.used() > ledger.budget()
                                       ? ledger.used() - ledger.budget()
                                       : 0);
  admission->set_budget_rule(parts_.budget->rule());
  admission->set_granularity_bytes(backend.AllocationGranularity());
  absl::flat_hash_map<uint64_t, std::pair<uint64_t, uint64_t>> reserved_by_engine;
  for (const auto& [id, reservation] : ledger.reservations()) {
    auto& [count, bytes] = reserved_by_engine[reservation.owner];
    ++count;
    bytes += reservation.bytes;
  }
  out.set_plans(parts_.plans->size());
  out.set_draining(parts_.leases->draining());
  const std::vector<EngineView> engines = parts_.leases->Engines();
  out.set_engines(engines.size());
  out.set_sessions(parts_.sessions->size());
  const absl::flat_hash_map<uint64_t, EngineSessionUsage> usage =
      parts_.sessions->UsageByEngine();
  const absl::flat_hash_map<uint64_t, EngineArenaPoolStats> pools =
      parts_.sessions->PoolStatsByEngine();
  for (const EngineView& engine : engines) {
    pb::EngineStatus* status = out.add_engine_status();
    status->set_engine_id(engine.id.value);
    status->set_engine_name(engine.name);
    status->set_pid(engine.peer.pid);
    status->set_uid(engine.peer.uid);
    status->set_gid(engine.peer.gid);
    status->set_cache_scope(engine.cache_scope);
    status->set_lease_live(engine.lease_live);
    status->set_awaiting_reattach(engine.awaiting_reattach);
    status->set_last_heartbeat_age_ms(absl::ToInt64Milliseconds(engine.heartbeat_age));
    if (auto reserved = reserved_by_engine.find(engine.id.value);
        reserved != reserved_by_engine.end()) {
      status->set_reservations(reserved->second.first);
      status->set_reserved_bytes(reserved->second.second);
    }
    if (auto used = usage.find(engine.id.value); used != usage.end()) {
      status->set_sessions(used->second.sessions);
      status->set_allocated_bytes(used->second.arena_bytes);
    }
    if (auto pool = pools.find(engine.id.value); pool != pools.end()) {
      status->set_pooled_bytes(pool->second.pooled_bytes);
      status->set_pool_hits(pool->second.hits);
      status->set_new_arenas(pool->second.new_arenas);
    }
  }
  return out;
}

grpc::Status AdminService::GetStatus(grpc::ServerContext*, const pb::GetStatusRequest*,
                                     pb::GetStatusResponse* response) {
  *response = Status();
  // Engines see the totals, not who the other engines are or what they hold.
  if (!parts_.socket.for_operators()) response->clear_engine_status();
  return grpc::Status::OK;
}

grpc::Status AdminService::ListSessions(grpc::ServerContext*,
                                        const pb::ListSessionsRequest* request,
                                        pb::ListSessionsResponse* response) {
  if (absl::Status allowed = parts_.socket.AllowOperatorCall("KvAdmin.ListSessions");
      !allowed.ok()) {
    return Reply("ListSessions", allowed);
  }
  std::optional<EngineId> engine;
  if (request->engine_id() != 0) engine = EngineId{request->engine_id()};
  for (const std::shared_ptr<DaemonSession>& session : parts_.sessions->List(engine)) {
    // A session released meanwhile is simply not listed.
    absl::StatusOr<SessionReport> report = session->GetState();
    if (!report.ok()) continue;
    const SessionStatus& state = report->state;
    pb::SessionSummary* summary = response->add_sessions();
    const DaemonSession::Params& params = session->params();
    summary->set_session_id(params.id.value);
    summary->set_engine_id(params.owner.value);
    summary->set_model_name(params.model->name);
    summary->set_plan_fingerprint(params.fingerprint);
    summary->set_capacity(state.capacity);
    summary->set_logical_len(state.committed_len);
    summary->set_arena_bytes(session->arena_bytes());
    summary->set_layout_version(state.layout_version);
    summary->set_in_transaction(state.active_generation != 0);
    summary->set_tainted(state.tainted);
  }
  return grpc::Status::OK;
}

grpc::Status AdminService::ListEngines(grpc::ServerContext*, const pb::ListEnginesRequest*,
                                       pb::ListEnginesResponse* response) {
  if (absl::Status allowed = parts_.socket.AllowOperatorCall("KvAdmin.ListEngines");
      !allowed.ok()) {
    return Reply("ListEngines", allowed);
  }
  pb::GetStatusResponse status = Status();
  response->mutable_engines()->Swap(status.mutable_engine_status());
  return grpc::Status::OK;
}

grpc::Status AdminService::GetCost(grpc::ServerContext*, const pb::CostRequest* request,
                                   pb::CostResponse* response) {
  return Reply("GetCost", Cost(*request, response));
}

grpc::Status AdminService::GetFit(grpc::ServerContext*, const pb::FitRequest* request,
                                  pb::FitResponse* response) {
  return Reply("GetFit", Fit(*request, response));
}

grpc::Status AdminService::GetMaxContext(grpc::ServerContext*,
                                         const pb::MaxContextRequest* request,
                                         pb::MaxContextResponse* response) {
  return Reply("GetMaxContext", MaxContext(*request, response));
}

grpc::Status AdminService::ImportModel(grpc::ServerContext*,
                                       const pb::ImportModelRequest* request,
                                       pb::ImportModelResponse* response) {
  return Reply("ImportModel", Import(*request, response));
}

grpc::Status AdminService::Drain(grpc::ServerContext*, const pb::DrainRequest*,
                                 pb::DrainResponse* response) {
  if (absl::Status allowed = parts_.socket.AllowOperatorCall("KvAdmin.Drain"); !allowed.ok()) {
    return Reply("Drain", allowed);
  }
  response->set_sessions_open(parts_.set_draining(true));
  return grpc::Status::OK;
}

grpc::Status AdminService::Undrain(grpc::ServerContext*, const pb::UndrainRequest*,
                                   pb::UndrainResponse*) {
  if (absl::Status allowed = parts_.socket.AllowOperatorCall("KvAdmin.Undrain"); !allowed.ok()) {
    return Reply("Undrain", allowed);
  }
  parts_.set_draining(false);
  return grpc::Status::OK;
}

absl::StatusOr<std::shared_ptr<const ModelPlan>> AdminService::ResolveModel(
    const pb::ModelSelector& selector) const {
  switch (selector.model_case()) {
    case pb::ModelSelector::kPlanFingerprint: {
      ASSIGN_OR_RETURN(PlanFingerprint fingerprint,
                       FingerprintFromBytes(selector.plan_fingerprint()));
      return parts_.plans->Find(fingerprint);
    }
    case pb::ModelSelector::kPlan: {
      RETURN_IF_ERROR(parts_.plans->CheckLayerCount(LayerCountOf(selector.plan())));
      ASSIGN_OR_RETURN(ModelPlan plan, ModelPlanFromProto(selector.plan()));
      RETURN_IF_ERROR(ValidateModelPlan(plan));
      return std::make_shared<const ModelPlan>(std::move(plan));
    }
    case pb::ModelSelector::kHfConfigJson: {
      ASSIGN_OR_RETURN(std::unique_ptr<ConcurrencyLimit::Permit> parsing,
                       AdmitConfigParse(selector.hf_config_json()));
      ASSIGN_OR_RETURN(ModelPlan plan,
                       ImportHuggingFaceConfig(selector.hf_config_json(), ImportOptions{}));
      RETURN_IF_ERROR(parts_.plans->CheckLayerCount(plan.TotalLayers()));
      return std::make_shared<const ModelPlan>(std::move(plan));
    }
    case pb::ModelSelector::MODEL_NOT_SET:
      break;
  }
  return absl::InvalidArgumentError(
      "no model: give a plan_fingerprint, an inline plan or a Hugging Face config.json");
}

absl::StatusOr<std::unique_ptr<ConcurrencyLimit::Permit>> AdminService::AdmitConfigParse(
    absl::string_view json_text) const {
  RETURN_IF_ERROR(CheckModelConfigBounds(json_text));
  return config_parses_.TryAcquire();
}

absl::Status AdminService::Cost(const pb::CostRequest& request, pb::CostResponse* response) {
  ASSIGN_OR_RETURN(Pricing pricing, PricingFor(request.model(), request.shape()));
  const auto& [plan, shape, defaults, rounding] = pricing;
  ASSIGN_OR_RETURN(CostReport cost, SessionCost(*plan, defaults, shape, rounding));
  ASSIGN_OR_RETURN(PlanFingerprint fingerprint, FingerprintModelPlan(*plan, defaults));
  ASSIGN_OR_RETURN(SessionPlan planes, PlanSession(*plan, defaults, shape));
  response->set_model_name(plan->name);
  response->set_plan_fingerprint(FingerprintToBytes(fingerprint));
  response->set_capacity(cost.capacity);
  pb::CostBreakdown* breakdown = response->mutable_breakdown();
  breakdown->set_bytes_per_token(cost.breakdown.bytes_per_token);
  breakdown->set_kv_bytes_per_token(cost.breakdown.kv_bytes_per_token);
  breakdown->set_ring_bytes_per_token(cost.breakdown.ring_bytes_per_token);
  breakdown->set_latent_bytes_per_token(cost.breakdown.latent_bytes_per_token);
  breakdown->set_ring_row_cap(cost.breakdown.ring_row_cap);
  breakdown->set_fixed_bytes(cost.breakdown.fixed_bytes);
  breakdown->set_total_plane_bytes(cost.breakdown.total_bytes);
  response->set_arena_bytes(cost.arena_bytes);
  response->set_granularity_bytes(parts_.backend->AllocationGranularity());
  response->set_layers(static_cast<uint32_t>(planes.layers.size()));
  return absl::OkStatus();
}

absl::Status AdminService::Fit(const pb::FitRequest& request, pb::FitResponse* response) {
  ASSIGN_OR_RETURN(Pricing pricing, PricingFor(request.model(), request.shape()));
  const auto& [plan, shape, defaults, rounding] = pricing;
  ASSIGN_OR_RETURN(uint64_t session_bytes, SessionArenaBytes(*plan, defaults, shape, rounding));
  const AdmissionLedger ledger = parts_.budget->Snapshot();
  ASSIGN_OR_RETURN(SessionFit fit, FitSessions(ledger, session_bytes));
  ASSIGN_OR_RETURN(TokenFit tokens_now,
                   TotalTokensThatFit(*plan, defaults, shape, ledger.free(), rounding));
  ASSIGN_OR_RETURN(TokenFit tokens_empty,
                   TotalTokensThatFit(*plan, defaults, shape, ledger.budget(), rounding));
  response->set_session_bytes(session_bytes);
  response->set_sessions_now(fit.now);
  response->set_sessions_after_eviction(fit.after_eviction);
  response->set_sessions_when_empty(fit.when_empty);
  response->set_total_tokens_now(tokens_now.total_tokens);
  response->set_total_tokens_when_empty(tokens_empty.total_tokens);
  response->set_free_bytes(ledger.free());
  response->set_evictable_bytes(ledger.evictable());
  response->set_budget_bytes(ledger.budget());
  return absl::OkStatus();
}

absl::Status AdminService::MaxContext(const pb::MaxContextRequest& request,
                                      pb::MaxContextResponse* response) {
  ASSIGN_OR_RETURN(Pricing pricing, PricingFor(request.model(), request.shape()));
  auto& [plan, shape, defaults, rounding] = pricing;
  const AdmissionLedger ledger = parts_.budget->Snapshot();
  const uint64_t after_eviction =
      ledger.free() + std::min(ledger.evictable(), UINT64_MAX - ledger.free());
  auto max_context = [&](uint64_t bytes) {
    return MaxContextThatFits(*plan, defaults, shape, bytes, rounding);
  };
  // No arena left (max_arenas): no session of any size fits now, however many bytes are free.
  const bool arena_left = ledger.arenas_left() > 0;
  ASSIGN_OR_RETURN(uint64_t now, max_context(arena_left ? ledger.free() : 0));
  ASSIGN_OR_RETURN(uint64_t evicted, max_context(arena_left ? after_eviction : 0));
  ASSIGN_OR_RETURN(uint64_t empty, max_context(ledger.budget()));
  response->set_max_context_now(now);
  response->set_max_context_after_eviction(evicted);
  response->set_max_context_when_empty(empty);
  if (now > 0) {
    shape.capacity = now;
    ASSIGN_OR_RETURN(uint64_t bytes, SessionArenaBytes(*plan, defaults, shape, rounding));
    response->set_session_bytes_now(bytes);
  }
  response->set_free_bytes(ledger.free());
  response->set_evictable_bytes(ledger.evictable());
  response->set_budget_bytes(ledger.budget());
  return absl::OkStatus();
}

absl::Status AdminService::Import(const pb::ImportModelRequest& request,
                                  pb::ImportModelResponse* response) {
  // Registering fills the daemon-wide plan table: an operator's act (engines register the plans
  // they use with KvCache.RegisterPlan, attached).
  if (request.register_()) {
    RETURN_IF_ERROR(parts_.socket.AllowOperatorCall("KvAdmin.ImportModel with register = true"));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<ConcurrencyLimit::Permit> parsing,
                   AdmitConfigParse(request.hf_config_json()));
  ImportOptions options;
  options.name = request.name();
  options.swa_ring = request.swa_ring();
  if (request.has_index_ring_rows()) options.index_ring_rows = request.index_ring_rows();
  if (request.index_pool() != 0) options.index_pool = request.index_pool();
  options.kv_dtype = request.kv_dtype();
  ASSIGN_OR_RETURN(ImportedModel imported,
                   ImportHuggingFaceModel(request.hf_config_json(), options));
  ModelPlan plan = std::move(imported.plan);
  response->set_kv_dtype(imported.kv_dtype);
  response->set_kv_formats(PlanFormatsSummary(plan, parts_.sessions->format_defaults()));
  // The importer's own bound is 4096 layers; the daemon's cap may be lower.
  RETURN_IF_ERROR(parts_.plans->CheckLayerCount(plan.TotalLayers()));
  ASSIGN_OR_RETURN(std::string architecture, HuggingFaceArchitecture(request.hf_config_json()));
  response->set_architecture(architecture);
  ASSIGN_OR_RETURN(PlanFingerprint fingerprint,
                   FingerprintModelPlan(plan, parts_.sessions->format_defaults()));
  *response->mutable_plan() = ModelPlanToProto(plan);
  response->set_plan_fingerprint(FingerprintToBytes(fingerprint));
  if (request.register_()) {
    ASSIGN_OR_RETURN(PlanFingerprint registered, parts_.plans->Register(std::move(plan)));
    response->set_registered(registered == fingerprint);
  }
  return absl::OkStatus();
}

}  // namespace memra
