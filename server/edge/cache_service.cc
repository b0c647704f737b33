#include "server/edge/cache_service.h"

#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/codec.h"
#include "common/daemon_restart.h"
#include "core/status_macros.h"
#include "server/edge/rpc_reply.h"
#include "server/edge/session_wire.h"
#include "server/edge/step_entry.h"
#include "spdlog/spdlog.h"

namespace memra {
namespace {

namespace pb = ::memra::kv::v1;

}  // namespace

EngineCredentials EngineCredentialsOf(const pb::EngineRef& ref) {
  return EngineCredentials{EngineId{ref.engine_id()}, ref.engine_token()};
}

SessionCredentials SessionCredentialsOf(const pb::SessionRef& ref) {
  return SessionCredentials{SessionId{ref.session_id()}, ref.session_token()};
}

namespace {

// One engine's lease stream. At most one read or write is outstanding at any time (read the
// hello, write Attached, then read a heartbeat, write its ack, ...), so the callbacks never run
// concurrently with each other and need no lock; every failed operation ends the stream with
// Finish, called once. The lease ends (EndStream) in OnDone, after which the lease table no longer
// calls the canceller that points at this stream's context. The lease table calls that canceller
// under its lock; TryCancel only schedules this reactor's callbacks (a user reactor is not
// inlineable: gRPC runs them on its executor), so OnDone's EndStream never re-enters that lock.
class AttachReactor final
    : public grpc::ServerBidiReactor<pb::AttachRequest, pb::AttachResponse> {
 public:
  AttachReactor(grpc::CallbackServerContext* context, EngineLeases* leases,
                ArenaHandoff* handoff, const CacheScopes* scopes, std::string_view backend,
                uint64_t epoch)
      : context_(context),
        leases_(leases),
        handoff_(handoff),
        scopes_(scopes),
        backend_(backend),
        epoch_(epoch) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the engine closed its side, or the stream was cancelled
      if (engine_.has_value()) {
        End(absl::OkStatus());
      } else {
        Finish(grpc::Status::CANCELLED);  // before any hello: nothing to report
      }
      return;
    }
    absl::Status status = engine_.has_value() ? OnHeartbeat() : OnHello();
    if (!status.ok()) {
      End(status);
      return;
    }
    StartWrite(&response_);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      End(absl::OkStatus());
      return;
    }
    StartRead(&request_);
  }

  void OnDone() override {
    if (engine_.has_value()) leases_->EndStream(*engine_, stream_);
    delete this;
  }

 private:
  absl::Status OnHello() {
    if (!request_.has_hello()) {
      return absl::InvalidArgumentError("the first Attach message must be a hello");
    }
    // The ticket first: no engine exists without the peer credentials it proves. A ticket is
    // used up even when the attach is then refused (the engine reconnects for a new one).
    ASSIGN_OR_RETURN(HandoffClaim claim, handoff_->ClaimTicket(request_.hello().handoff_ticket()));
    const pb::Hello& hello = request_.hello();
    grpc::CallbackServerContext* context = context_;
    auto cancel = [context] { context->TryCancel(); };
    absl::StatusOr<EngineLease> lease;
    if (hello.has_resume()) {
      // The engine keeps the scope it attached in (Resume refuses another one).
      lease = leases_->Resume(
          EngineCredentials{EngineId{hello.resume().engine_id()}, hello.resume().engine_token()},
          claim.peer, hello.cache_scope(), cancel);
    } else {
      ASSIGN_OR_RETURN(std::string scope, scopes_->ScopeFor(claim.peer, hello.cache_scope()));
      lease = leases_->Attach(
          EngineIdentity{.name = hello.engine_name(), .peer = claim.peer, .cache_scope = scope},
          cancel);
    }
    if (!lease.ok() && hello.has_resume() && hello.resume_epoch() != 0 &&
        hello.resume_epoch() != epoch_ && !GetDaemonRestart(lease.status()).has_value()) {
      // A daemon that does not have the engine of an earlier daemon: the engine still learns
      // it was a restart, with both epochs, and why this daemon does not have it (docs/
      // failure-model.md, "The restart error").
      const std::string why =
          leases_->restart().has_value()
              ? absl::StrCat("engine ", hello.resume().engine_id(),
                             " was not in the restart journal it re-adopted (",
                             lease.status().message(), ")")
              : std::string("it kept nothing of an earlier daemon (no service manager kept its "
                            "state, or keep_kv_across_restarts = false); attach as a new engine");
      return DaemonRestartedError(
          DaemonRestart{hello.resume_epoch(), epoch_},
          absl::StrCat("this engine attached to epoch ", hello.resume_epoch(),
                       " and the daemon answering does not have it: ", why));
    }
    RETURN_IF_ERROR(lease.status());
    engine_ = lease->id;
    stream_ = lease->stream;
    handoff_->BindEngine(claim.connection, lease->id.value);
    response_.Clear();
    pb::Attached* attached = response_.mutable_attached();
    attached->mutable_engine()->set_engine_id(lease->id.value);
    attached->mutable_engine()->set_engine_token(lease->token);
    attached->set_lease_timeout_ms(absl::ToInt64Milliseconds(lease->timeout));
    attached->set_lease_grace_ms(absl::ToInt64Milliseconds(lease->grace));
    attached->set_backend(std::string(backend_));
    attached->set_cache_scope(lease->cache_scope);
    attached->set_epoch(epoch_);
    attached->set_step_channel(handoff_->offers_step_channel());
    return absl::OkStatus();
  }

  absl::Status OnHeartbeat() {
    if (!request_.has_heartbeat()) {
      return absl::InvalidArgumentError("after the hello, Attach carries only heartbeats");
    }
    RETURN_IF_ERROR(leases_->Heartbeat(*engine_));
    response_.Clear();
    response_.mutable_ack()->set_sequence(request_.heartbeat().sequence());
    return absl::OkStatus();
  }

  void End(const absl::Status& status) { Finish(Reply("Attach", status)); }

  grpc::CallbackServerContext* const context_;
  EngineLeases* const leases_;
  ArenaHandoff* const handoff_;
  const CacheScopes* const scopes_;
  const std::string_view backend_;
  const uint64_t epoch_;
  std::optional<EngineId> engine_;  // set once the hello was accepted
  uint64_t stream_ = 0;             // the lease's stream number (EngineLease::stream)
  pb::AttachRequest request_;
  pb::AttachResponse response_;
};

}  // namespace

grpc::ServerBidiReactor<pb::AttachRequest, pb::AttachResponse>* CacheService::Attach(
    grpc::CallbackServerContext* context) {
  return new AttachReactor(context, leases_, handoff_, scopes_, backend_->Name(), epoch_);
}

grpc::Status CacheService::RegisterPlan(grpc::ServerContext*,
                                        const pb::RegisterPlanRequest* request,
                                        pb::RegisterPlanResponse* response) {
  absl::Status status = [&]() -> absl::Status {
    // Only attached engines register: every plan in the table is some engine's to count.
    const EngineCredentials engine = EngineCredentialsOf(request->engine());
    RETURN_IF_ERROR(leases_->Check(engine));
    RETURN_IF_ERROR(plans_->CheckLayerCount(LayerCountOf(request->plan())));
    ASSIGN_OR_RETURN(ModelPlan plan, ModelPlanFromProto(request->plan()));
    ASSIGN_OR_RETURN(PlanFingerprint fingerprint,
                     plans_->Register(std::move(plan), engine.id.value));
    response->set_fingerprint(FingerprintToBytes(fingerprint));
    return absl::OkStatus();
  }();
  return Reply("RegisterPlan", status);
}

grpc::Status CacheService::Reserve(grpc::ServerContext*, const pb::ReserveRequest* request,
                                   pb::ReserveResponse* response) {
  absl::Status status = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(PlanFingerprint plan, FingerprintFromBytes(request->plan_fingerprint()));
    ASSIGN_OR_RETURN(ArenaReservation reserved,
                     sessions_->Reserve(EngineCredentialsOf(request->engine()), plan,
                                        SessionShapeFromProto(*request)));
    response->set_reservation_id(reserved.id.value);
    response->set_bytes(reserved.bytes);
    response->set_ttl_ms(absl::ToInt64Milliseconds(reserved.ttl));
    return absl::OkStatus();
  }();
  return Reply("Reserve", status);
}

grpc::Status CacheService::CancelReservation(grpc::ServerContext*,
                                             const pb::CancelReservationRequest* request,
                                             pb::CancelReservationResponse* response) {
  absl::StatusOr<uint64_t> freed = leases_->CancelReservation(
      EngineCredentialsOf(request->engine()), ReservationId{request->reservation_id()});
  if (freed.ok()) response->set_freed_bytes(*freed);
  return Reply("CancelReservation", freed.status());
}

grpc::Status CacheService::CreateSession(grpc::ServerContext*,
                                         const pb::CreateSessionRequest* request,
                                         pb::CreateSessionResponse* response) {
  absl::Status status = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(PlanFingerprint plan, FingerprintFromBytes(request->plan_fingerprint()));
    std::optional<ReservationId> reservation;
    if (request->reservation_id() != 0) reservation = ReservationId{request->reservation_id()};
    ASSIGN_OR_RETURN(std::shared_ptr<DaemonSession> session,
                     sessions_->Create(EngineCredentialsOf(request->engine()), plan,
                                       SessionShapeFromProto(*request), reservation));
    response->mutable_session()->set_session_id(session->id().value);
    response->mutable_session()->set_session_token(session->params().token);
    response->set_slot(session->slot());
    for (std::string& handle : sessions_->TakeUnmapped(session->owner())) {
      response->add_unmap_handles(std::move(handle));
    }
    ASSIGN_OR_RETURN(SessionResult report,
                     SessionRegistry::Apply(*session, GetStateOp{.with_layout = true}));
    SessionReportToProto(std::get<SessionReport>(report), response->mutable_state(),
                         response->mutable_layout());
    return absl::OkStatus();
  }();
  return Reply("CreateSession", status);
}

grpc::Status CacheService::ReleaseSession(grpc::ServerContext*, const pb::SessionRequest* request,
                                          pb::ReleaseSessionResponse* response) {
  const SessionCredentials session = SessionCredentialsOf(request->session());
  absl::Status status = [&]() -> absl::Status {
    // Authenticated first: nobody makes the daemon wait on an event for a session not theirs.
    RETURN_IF_ERROR(sessions_->Find(session).status());
    RETURN_IF_ERROR(WaitForEngine(request->ordering()));
    ASSIGN_OR_RETURN(SessionRelease released, sessions_->Release(session));
    response->set_freed_bytes(released.bytes);
    for (std::string& handle : released.pooled_handles) {
      response->add_pooled_handles(std::move(handle));
    }
    for (std::string& handle : released.unmap_handles) {
      response->add_unmap_handles(std::move(handle));
    }
    return absl::OkStatus();
  }();
  return Reply("ReleaseSession", status);
}

grpc::Status CacheService::ResetSession(grpc::ServerContext*, const pb::SessionRequest* request,
                                        pb::SessionStateResponse* response) {
  return RunThenState("ResetSession", request->session(), request->ordering(), ResetOp{},
                      response);
}

grpc::Status CacheService::GetSessionState(grpc::ServerContext*,
                                           const pb::GetSessionStateRequest* request,
                                           pb::SessionStateResponse* response) {
  absl::StatusOr<SessionResult> report =
      sessions_->Run(SessionCredentialsOf(request->session()),
                     GetStateOp{.with_layout = request->include_layout()});
  if (report.ok()) {
    SessionReportToProto(std::get<SessionReport>(*report), response->mutable_state(),
                         response->mutable_layout());
  }
  return Reply("GetSessionState", report.status());
}

grpc::Status CacheService::Begin(grpc::ServerContext*, const pb::SessionRequest* request,
                                 pb::BeginResponse* response) {
  return RunOrdered("Begin", request->session(), request->ordering(), BeginOp{},
                    [&](const SessionResult& result) {
                      TransactionToProto(std::get<TransactionId>(result), response);
                    });
}

grpc::Status CacheService::PrepareAppend(grpc::ServerContext*,
                                         const pb::PrepareAppendRequest* request,
                                         pb::PrepareAppendResponse* response) {
  return RunOrdered("PrepareAppend", request->session(), pb::DeviceOrdering::default_instance(),
                    PrepareAppendOp{request->generation(), request->rows()},
                    [&](const SessionResult& result) {
                      AppendPlanToProto(std::get<AppendPlan>(result), response);
                    });
}

grpc::Status CacheService::PublishAppend(grpc::ServerContext*,
                                         const pb::GenerationRequest* request,
                                         pb::PublishAppendResponse* response) {
  return RunOrdered("PublishAppend", request->session(), request->ordering(),
                    PublishAppendOp{request->generation()}, [&](const SessionResult& result) {
                      response->set_staged_len(std::get<PublishedAppend>(result).staged_len);
                    });
}

grpc::Status CacheService::Commit(grpc::ServerContext*, const pb::CommitRequest* request,
                                  pb::CommitResponse* response) {
  return RunOrdered("Commit", request->session(), request->ordering(),
                    CommitOp{request->generation(), request->accepted_rows(),
                             SpanOf(request->token_ids())},
                    [&](const SessionResult& result) {
                      response->set_committed_len(std::get<CommittedLength>(result).committed_len);
                    });
}

grpc::Status CacheService::Abort(grpc::ServerContext*, const pb::GenerationRequest* request,
                                 pb::AbortResponse* response) {
  return RunOrdered("Abort", request->session(), request->ordering(),
                    AbortOp{request->generation()}, [&](const SessionResult& result) {
                      response->set_committed_len(std::get<CommittedLength>(result).committed_len);
                    });
}

grpc::Status CacheService::Step(grpc::ServerContext*, const pb::StepRequest* request,
                                pb::StepResponse* response) {
  if (request->entries_size() > kMaxStepEntries) {
    return Reply("Step", absl::InvalidArgumentError(
                             absl::StrCat("Step carries ", request->entries_size(),
                                          " entries; the limit is ", kMaxStepEntries)));
  }
  // The engine entries naming a slot act for: authenticated once, and only if one does.
  std::optional<absl::Status> engine_checked;
  auto slot_engine = [&]() -> absl::StatusOr<EngineId> {
    if (!engine_checked.has_value()) {
      engine_checked = leases_->Check(EngineCredentialsOf(request->engine()));
    }
    RETURN_IF_ERROR(*engine_checked);
    return EngineId{request->engine().engine_id()};
  };
  if (!request->ordering().wait_event().empty()) {
    // Authenticated first, as RunOrdered and ReleaseSession are: nobody makes the daemon wait
    // on an event without naming a session of theirs (the first entry's).
    if (request->entries_size() == 0) {
      return Reply("Step", absl::InvalidArgumentError(
                               "Step with a wait event carries no entries: nothing to order"));
    }
    const pb::StepEntry& first = request->entries(0);
    absl::Status who = first.has_slot()
                           ? slot_engine().status()
                           : sessions_->Find(SessionCredentialsOf(first.session())).status();
    if (!who.ok()) return Reply("Step", who);
    if (absl::Status waited = WaitForEngine(request->ordering()); !waited.ok()) {
      return Reply("Step", waited);
    }
  }
  response->mutable_results()->Reserve(request->entries_size());
  for (const pb::StepEntry& entry : request->entries()) {
    RunStepEntry(*sessions_, entry, slot_engine, response->add_results());
  }
  return grpc::Status::OK;
}

grpc::Status CacheService::Rewind(grpc::ServerContext*, const pb::RewindRequest* request,
                                  pb::SessionStateResponse* response) {
  return RunThenState("Rewind", request->session(), request->ordering(),
                      RewindOp{request->target()}, response);
}

grpc::Status CacheService::Hydrate(grpc::ServerContext*, const pb::HydrateRequest* request,
                                   pb::SessionStateResponse* response) {
  return RunThenState("Hydrate", request->session(), request->ordering(),
                      HydrateOp{request->logical_len(), SpanOf(request->resident_starts())},
                      response);
}

grpc::Status CacheService::CanRewind(grpc::ServerContext*, const pb::RewindRequest* request,
                                     pb::CanRewindResponse* response) {
  absl::StatusOr<SessionResult> can =
      sessions_->Run(SessionCredentialsOf(request->session()), CanRewindOp{request->target()});
  if (can.ok()) response->set_can_rewind(std::get<RewindPossible>(*can).possible);
  return Reply("CanRewind", can.status());
}

grpc::Status CacheService::SpecSnapshot(grpc::ServerContext*, const pb::SessionRequest* request,
                                        pb::SessionStateResponse* response) {
  return RunThenState("SpecSnapshot", request->session(), request->ordering(), SpecSnapshotOp{},
                      response);
}

grpc::Status CacheService::SpecRollback(grpc::ServerContext*,
                                        const pb::SpecRollbackRequest* request,
                                        pb::SessionStateResponse* response) {
  return RunThenState("SpecRollback", request->session(), request->ordering(),
                      SpecRollbackOp{request->accept_len()}, response);
}

grpc::Status CacheService::Grow(grpc::ServerContext*, const pb::GrowRequest* request,
                                pb::GrowResponse* response) {
  return RunOrdered("Grow", request->session(), request->ordering(),
                    GrowOp{request->target_capacity()}, [&](const SessionResult& result) {
                      SessionReportToProto(std::get<SessionReport>(result),
                                           response->mutable_state(), response->mutable_layout());
                    });
}

grpc::Status CacheService::AcknowledgeGrow(grpc::ServerContext*,
                                           const pb::AcknowledgeGrowRequest* request,
                                           pb::SessionStateResponse* response) {
  return RunThenState("AcknowledgeGrow", request->session(),
                      pb::DeviceOrdering::default_instance(),
                      AcknowledgeGrowOp{request->layout_version()}, response);
}

grpc::Status CacheService::Taint(grpc::ServerContext*, const pb::TaintRequest* request,
                                 pb::SessionStateResponse* response) {
  return RunThenState("Taint", request->session(), pb::DeviceOrdering::default_instance(),
                      TaintOp{request->reason()}, response);
}

grpc::Status CacheService::RunThenState(absl::string_view rpc, const pb::SessionRef& ref,
                                        const pb::DeviceOrdering& ordering, const SessionOp& op,
                                        pb::SessionStateResponse* response) {
  absl::StatusOr<std::vector<SessionResult>> results =
      sessions_->Run(SessionCredentialsOf(ref), {op, GetStateOp{}},
                     [&] { return WaitForEngine(ordering); });
  if (results.ok()) {
    SessionStatusToProto(std::get<SessionReport>(results->back()).state,
                         response->mutable_state());
  }
  return Reply(rpc, results.status());
}

grpc::Status CacheService::RunOrdered(absl::string_view rpc, const pb::SessionRef& ref,
                                      const pb::DeviceOrdering& ordering, const SessionOp& op,
                                      absl::FunctionRef<void(const SessionResult&)> reply) {
  absl::StatusOr<std::vector<SessionResult>> results =
      sessions_->Run(SessionCredentialsOf(ref), {op}, [&] { return WaitForEngine(ordering); });
  if (results.ok()) reply(results->front());
  return Reply(rpc, results.status());
}

absl::Status CacheService::WaitForEngine(const pb::DeviceOrdering& ordering) {
  return backend_->WaitForEngineEvent(ordering.wait_event());
}

}  // namespace memra
