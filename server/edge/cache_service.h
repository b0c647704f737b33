#ifndef MEMRA_SERVER_CACHE_SERVICE_H_
#define MEMRA_SERVER_CACHE_SERVICE_H_

// memra.kv.v1 KvCache over gRPC, the engine-facing edge: decodes each request into core values
// and typed session operations (common/codec.h for shapes and fingerprints), calls the lease
// table, the plan registry or the session registry, and encodes the answer. No rules here: a
// status becomes a gRPC status once (server/edge/rpc_reply.h), a Step entry's status its code and
// message once.
//
// Thread-safety: thread-safe (everything it calls is).

#include "common/step_channel.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/server_callback.h"
#include "proto/memra/kv/v1/cache.grpc.pb.h"
#include "server/edge/arena_handoff.h"
#include "server/device/backend.h"
#include "server/session/cache_scopes.h"
#include "server/session/engine_leases.h"
#include "server/session/plan_registry.h"
#include "server/session/session_registry.h"

namespace memra {

// Attach is served with the callback API (a reactor per stream, run on gRPC's callback
// threads): an idle lease stream costs no thread, so max_attached_engines engines do not mean as
// many daemon threads. The unary calls stay synchronous.
class CacheService final
    : public memra::kv::v1::KvCache::WithCallbackMethod_Attach<memra::kv::v1::KvCache::Service> {
 public:
  // The most entries one Step may carry (the step channel's limit too).
  static constexpr int kMaxStepEntries = step_channel::kMaxStepEntries;

  // REQUIRES: every pointer outlives the service. `backend` waits on the engines' events;
  // `handoff` redeems the attach tickets.
  // `scopes` decides each engine's prefix-cache scope from its peer credentials.
  // `epoch`: the daemon's (Attached.epoch).
  CacheService(EngineLeases* leases, PlanRegistry* plans, SessionRegistry* sessions,
               DeviceBackend* backend, ArenaHandoff* handoff, const CacheScopes* scopes,
               uint64_t epoch = 0)
      : leases_(leases),
        plans_(plans),
        sessions_(sessions),
        backend_(backend),
        handoff_(handoff),
        scopes_(scopes),
        epoch_(epoch) {}

  // The lease stream: hello -> Attached, then heartbeat -> ack until either side ends it
  // (server/session/engine_leases.h has the rules). The hello's handoff ticket is claimed first
  // (server/edge/arena_handoff.h): its peer credentials become the engine's, and its connection is
  // bound to the engine.
  grpc::ServerBidiReactor<memra::kv::v1::AttachRequest, memra::kv::v1::AttachResponse>* Attach(
      grpc::CallbackServerContext* context) override;
  grpc::Status RegisterPlan(grpc::ServerContext*, const memra::kv::v1::RegisterPlanRequest* request,
                            memra::kv::v1::RegisterPlanResponse* response) override;
  grpc::Status Reserve(grpc::ServerContext*, const memra::kv::v1::ReserveRequest* request,
                       memra::kv::v1::ReserveResponse* response) override;
  grpc::Status CancelReservation(grpc::ServerContext*,
                                 const memra::kv::v1::CancelReservationRequest* request,
                                 memra::kv::v1::CancelReservationResponse* response) override;
  grpc::Status CreateSession(grpc::ServerContext*,
                             const memra::kv::v1::CreateSessionRequest* request,
                             memra::kv::v1::CreateSessionResponse* response) override;
  grpc::Status ReleaseSession(grpc::ServerContext*, const memra::kv::v1::SessionRequest* request,
                              memra::kv::v1::ReleaseSessionResponse* response) override;
  grpc::Status ResetSession(grpc::ServerContext*, const memra::kv::v1::SessionRequest* request,
                            memra::kv::v1::SessionStateResponse* response) override;
  grpc::Status GetSessionState(grpc::ServerContext*,
                               const memra::kv::v1::GetSessionStateRequest* request,
                               memra::kv::v1::SessionStateResponse* response) override;
  grpc::Status Begin(grpc::ServerContext*, const memra::kv::v1::SessionRequest* request,
                     memra::kv::v1::BeginResponse* response) override;
  grpc::Status PrepareAppend(grpc::ServerContext*,
                             const memra::kv::v1::PrepareAppendRequest* request,
                             memra::kv::v1::PrepareAppendResponse* response) override;
  grpc::Status PublishAppend(grpc::ServerContext*, const memra::kv::v1::GenerationRequest* request,
                             memra::kv::v1::PublishAppendResponse* response) override;
  grpc::Status Commit(grpc::ServerContext*, const memra::kv::v1::CommitRequest* request,
                      memra::kv::v1::CommitResponse* response) override;
  grpc::Status Abort(grpc::ServerContext*, const memra::kv::v1::GenerationRequest* request,
                     memra::kv::v1::AbortResponse* response) override;
  grpc::Status Step(grpc::ServerContext*, const memra::kv::v1::StepRequest* request,
                    memra::kv::v1::StepResponse* response) override;
  grpc::Status Rewind(grpc::ServerContext*, const memra::kv::v1::RewindRequest* request,
                      memra::kv::v1::SessionStateResponse* response) override;
  grpc::Status Hydrate(grpc::ServerContext*, const memra::kv::v1::HydrateRequest* request,
                       memra::kv::v1::SessionStateResponse* response) override;
  grpc::Status CanRewind(grpc::ServerContext*, const memra::kv::v1::RewindRequest* request,
                         memra::kv::v1::CanRewindResponse* response) override;
  grpc::Status SpecSnapshot(grpc::ServerContext*, const memra::kv::v1::SessionRequest* request,
                            memra::kv::v1::SessionStateResponse* response) override;
  grpc::Status SpecRollback(grpc::ServerContext*,
                            const memra::kv::v1::SpecRollbackRequest* request,
                            memra::kv::v1::SessionStateResponse* response) override;
  grpc::Status Grow(grpc::ServerContext*, const memra::kv::v1::GrowRequest* request,
                    memra::kv::v1::GrowResponse* response) override;
  grpc::Status AcknowledgeGrow(grpc::ServerContext*,
                               const memra::kv::v1::AcknowledgeGrowRequest* request,
                               memra::kv::v1::SessionStateResponse* response) override;
  grpc::Status Taint(grpc::ServerContext*, const memra::kv::v1::TaintRequest* request,
                     memra::kv::v1::SessionStateResponse* response) override;

 private:
  // Runs `op` on the session once the engine's device work is complete (`ordering`), then
  // answers with the session's state.
  grpc::Status RunThenState(absl::string_view rpc, const memra::kv::v1::SessionRef& ref,
                            const memra::kv::v1::DeviceOrdering& ordering, const SessionOp& op,
                            memra::kv::v1::SessionStateResponse* response);
  // Runs `op` on the session once the engine's device work is complete (`ordering`), and
  // answers with its result (`reply` encodes it; called only when the op succeeded).
  grpc::Status RunOrdered(absl::string_view rpc, const memra::kv::v1::SessionRef& ref,
                          const memra::kv::v1::DeviceOrdering& ordering, const SessionOp& op,
                          absl::FunctionRef<void(const SessionResult&)> reply);
  // The engine's work on the memory this call touches is complete (DeviceOrdering).
  absl::Status WaitForEngine(const memra::kv::v1::DeviceOrdering& ordering);

  EngineLeases* const leases_;
  PlanRegistry* const plans_;
  SessionRegistry* const sessions_;
  DeviceBackend* const backend_;
  ArenaHandoff* const handoff_;
  const CacheScopes* const scopes_;
  const uint64_t epoch_;
};

// The credentials a ref carries (the views point into `ref`).
EngineCredentials EngineCredentialsOf(const memra::kv::v1::EngineRef& ref);
SessionCredentials SessionCredentialsOf(const memra::kv::v1::SessionRef& ref);

}  // namespace memra

#endif  // MEMRA_SERVER_CACHE_SERVICE_H_
