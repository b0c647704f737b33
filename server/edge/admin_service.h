#ifndef MEMRA_SERVER_ADMIN_SERVICE_H_
#define MEMRA_SERVER_ADMIN_SERVICE_H_

// memra.kv.v1 KvAdmin over gRPC, the operator-facing edge: the daemon's status, its sessions and
// engines, the pricing queries (cost, fit, max context: the same sizing function and backend
// rounding admission charges with), model import, drain and undrain.
//
// One instance per socket (server/edge/served_socket.h). On the engine socket: ListSessions,
// ListEngines, Drain, Undrain and ImportModel with register are refused (PERMISSION_DENIED naming
// the admin socket); GetStatus answers the daemon's totals without the per-engine list (names,
// pids, usage of other engines); the pricing queries and unregistered imports are served.
//
// Thread-safety: thread-safe (everything it reads is).

#include <cstdint>
#include <functional>
#include <optional>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/admission.h"
#include "core/formats.h"
#include "core/model_plan.h"
#include "core/sizing.h"
#include "grpcpp/server_context.h"
#include "proto/memra/kv/v1/admin.grpc.pb.h"
#include "server/device/backend.h"
#include "server/base/clock.h"
#include "server/base/concurrency_limit.h"
#include "server/device/device_budget.h"
#include "server/session/engine_leases.h"
#include "server/edge/model_config_bounds.h"
#include "server/session/plan_registry.h"
#include "server/edge/served_socket.h"
#include "server/session/session_registry.h"

namespace memra {

class AdminService final : public memra::kv::v1::KvAdmin::Service {
 public:
  struct Parts {
    EngineLeases* leases;
    PlanRegistry* plans;
    SessionRegistry* sessions;
    DeviceBudget* budget;
    DeviceBackend* backend;
    Clock* clock;
    uint64_t epoch = 0;  // random per start
    absl::Time started;
    // Drain (true) / Undrain (false): the daemon's switch (it also flips the health service);
    // returns the sessions open.
    std::function<size_t(bool)> set_draining;
    // The socket this instance answers on.
    ServedSocket socket;
    // Whether KV survives the daemon's crash (no function: reported OFF).
    std::function<RestartSurvival()> restart_survival;
    // Whether the prefix cache's remote tier answers; nullopt (or no function): no remote tier.
    std::function<std::optional<bool>()> remote_tier_up;
  };
  // REQUIRES: every pointer outlives the service.
  explicit AdminService(Parts parts) : parts_(std::move(parts)) {}

  // What GetStatus answers on the admin socket (everything, the per-engine list included).
  memra::kv::v1::GetStatusResponse Status() const;

  grpc::Status GetStatus(grpc::ServerContext*, const memra::kv::v1::GetStatusRequest*,
                         memra::kv::v1::GetStatusResponse* response) override;
  grpc::Status ListSessions(grpc::ServerContext*,
                            const memra::kv::v1::ListSessionsRequest* request,
                            memra::kv::v1::ListSessionsResponse* response) override;
  grpc::Status ListEngines(grpc::ServerContext*, const memra::kv::v1::ListEnginesRequest*,
                           memra::kv::v1::ListEnginesResponse* response) override;
  grpc::Status GetCost(grpc::ServerContext*, const memra::kv::v1::CostRequest* request,
                       memra::kv::v1::CostResponse* response) override;
  grpc::Status GetFit(grpc::ServerContext*, const memra::kv::v1::FitRequest* request,
                      memra::kv::v1::FitResponse* response) override;
  grpc::Status GetMaxContext(grpc::ServerContext*, const memra::kv::v1::MaxContextRequest* request,
                             memra::kv::v1::MaxContextResponse* response) override;
  grpc::Status ImportModel(grpc::ServerContext*, const memra::kv::v1::ImportModelRequest* request,
                           memra::kv::v1::ImportModelResponse* response) override;
  grpc::Status Drain(grpc::ServerContext*, const memra::kv::v1::DrainRequest*,
                     memra::kv::v1::DrainResponse* response) override;
  grpc::Status Undrain(grpc::ServerContext*, const memra::kv::v1::UndrainRequest*,
                       memra::kv::v1::UndrainResponse*) override;

 private:
  absl::Status Cost(const memra::kv::v1::CostRequest& request,
                    memra::kv::v1::CostResponse* response);
  absl::Status Fit(const memra::kv::v1::FitRequest& request, memra::kv::v1::FitResponse* response);
  absl::Status MaxContext(const memra::kv::v1::MaxContextRequest& request,
                          memra::kv::v1::MaxContextResponse* response);
  absl::Status Import(const memra::kv::v1::ImportModelRequest& request,
                      memra::kv::v1::ImportModelResponse* response);
  // What a pricing query prices: its model, its shape, and what admission prices with.
  struct Pricing {
    std::shared_ptr<const ModelPlan> plan;
    SessionShape shape;
    FormatDefaults defaults;
    ArenaRounding rounding;
  };
  absl::StatusOr<Pricing> PricingFor(const memra::kv::v1::ModelSelector& model,
                                     const memra::kv::v1::SessionShape& shape) const;
  // A client's config.json may be parsed: its size and depth are within bounds
  // (server/edge/model_config_bounds.h) and a parse slot of this socket's is free; the permit holds
  // the slot until the parse is done.
  absl::StatusOr<std::unique_ptr<ConcurrencyLimit::Permit>> AdmitConfigParse(
      absl::string_view json_text) const;
  // A query's model: a registered plan, an inline plan or a HF config.json.
  absl::StatusOr<std::shared_ptr<const ModelPlan>> ResolveModel(
      const memra::kv::v1::ModelSelector& selector) const;

  const Parts parts_;
  // Parses of client-supplied config.json running on this socket.
  mutable ConcurrencyLimit config_parses_{"config.json parses", kMaxConcurrentModelConfigParses,
                                          "kMaxConcurrentModelConfigParses per socket"};
};

}  // namespace memra

#endif  // MEMRA_SERVER_ADMIN_SERVICE_H_
