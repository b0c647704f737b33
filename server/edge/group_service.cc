#include "server/edge/group_service.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/codec.h"
#include "core/status_macros.h"
#include "server/edge/cache_service.h"
#include "server/edge/rpc_reply.h"

namespace memra {
namespace {

namespace pb = ::memra::kv::v1;

}  // namespace

GroupService::GroupService(EngineLeases* leases, SessionRegistry* sessions, ServedSocket socket,
                           std::string daemon)
    : leases_(leases), sessions_(sessions), socket_(std::move(socket)), daemon_(std::move(daemon)) {}

absl::Status GroupService::AllowEngineCall(absl::string_view rpc) const {
  if (!socket_.for_operators()) return absl::OkStatus();
  return absl::UnimplementedError(absl::StrCat(
      "KvGroup.", rpc, " is an engine call: served on the engine socket only (an operator cannot "
      "attach on the admin socket)"));
}

grpc::Status GroupService::Answer(const char* rpc, const absl::Status& status) const {
  if (status.ok()) return Reply(rpc, status);
  absl::Status named(status.code(), absl::StrCat("memra-kvd ", daemon_, ": ", status.message()));
  status.ForEachPayload([&](absl::string_view type_url, const absl::Cord& payload) {
    named.SetPayload(type_url, payload);
  });
  return Reply(rpc, named);
}

void GroupService::FillState(const HeldReservation& held, absl::Time now,
                             pb::GroupRankState* state) const {
  const Reservation& reservation = held.reservation;
  if (reservation.group.has_value()) {
    state->mutable_group()->set_group_id(reservation.group->group_id);
    state->mutable_group()->set_rank(reservation.group->rank);
    state->mutable_group()->set_ranks(reservation.group->ranks);
  }
  state->set_engine_id(reservation.owner);
  state->set_reservation_id(held.id.value);
  state->set_bytes(reservation.bytes);
  state->set_phase(reservation.confirmed ? pb::GROUP_RANK_PHASE_CONFIRMED
                                         : pb::GROUP_RANK_PHASE_PENDING);
  state->set_deadline_ms_left(
      reservation.confirmed || reservation.expiry <= now
          ? 0
          : static_cast<uint64_t>(absl::ToInt64Milliseconds(reservation.expiry - now)));
  state->set_daemon(daemon_);
}

grpc::Status GroupService::ReserveGroupRank(grpc::ServerContext*,
                                            const pb::ReserveGroupRankRequest* request,
                                            pb::GroupRankState* response) {
  absl::Status status = [&]() -> absl::Status {
    RETURN_IF_ERROR(AllowEngineCall("ReserveGroupRank"));
    const GroupRankKey group{request->group().group_id(), request->group().rank(),
                             request->group().ranks()};
    // Bounded here as well as in the ledger: a huge value must not overflow the Duration.
    if (request->deadline_ms() == 0 ||
        request->deadline_ms() >
            static_cast<uint64_t>(absl::ToInt64Milliseconds(kMaxGroupDeadline))) {
      return absl::InvalidArgumentError(absl::StrCat(
          GroupRankName(group), ": deadline ", request->deadline_ms(), " ms outside [1, ",
          absl::ToInt64Milliseconds(kMaxGroupDeadline), "] ms"));
    }
    ASSIGN_OR_RETURN(PlanFingerprint plan, FingerprintFromBytes(request->plan_fingerprint()));
    const EngineCredentials engine = EngineCredentialsOf(request->engine());
    RETURN_IF_ERROR(sessions_
                        ->ReserveGroupRank(engine, plan, SessionShapeFromProto(*request), group,
                                           absl::Milliseconds(request->deadline_ms()),
                                           request->expected_bytes())
                        .status());
    ASSIGN_OR_RETURN(HeldReservation held, leases_->GroupRank(engine, group.group_id));
    FillState(held, leases_->Now(), response);
    return absl::OkStatus();
  }();
  return Answer("ReserveGroupRank", status);
}

grpc::Status GroupService::ConfirmGroupRank(grpc::ServerContext*,
                                            const pb::GroupRankRequest* request,
                                            pb::GroupRankState* response) {
  if (absl::Status allowed = AllowEngineCall("ConfirmGroupRank"); !allowed.ok()) {
    return Answer("ConfirmGroupRank", allowed);
  }
  absl::StatusOr<HeldReservation> held =
      leases_->ConfirmGroupRank(EngineCredentialsOf(request->engine()), request->group_id());
  if (held.ok()) FillState(*held, leases_->Now(), response);
  return Answer("ConfirmGroupRank", held.status());
}

grpc::Status GroupService::ReleaseGroupRank(grpc::ServerContext*,
                                            const pb::GroupRankRequest* request,
                                            pb::ReleaseGroupRankResponse* response) {
  if (absl::Status allowed = AllowEngineCall("ReleaseGroupRank"); !allowed.ok()) {
    return Answer("ReleaseGroupRank", allowed);
  }
  absl::StatusOr<uint64_t> freed =
      leases_->ReleaseGroupRank(EngineCredentialsOf(request->engine()), request->group_id());
  if (freed.ok()) response->set_freed_bytes(*freed);
  return Answer("ReleaseGroupRank", freed.status());
}

grpc::Status GroupService::GetGroupRank(grpc::ServerContext*, const pb::GroupRankRequest* request,
                                        pb::GroupRankState* response) {
  if (absl::Status allowed = AllowEngineCall("GetGroupRank"); !allowed.ok()) {
    return Answer("GetGroupRank", allowed);
  }
  absl::StatusOr<HeldReservation> held =
      leases_->GroupRank(EngineCredentialsOf(request->engine()), request->group_id());
  if (held.ok()) FillState(*held, leases_->Now(), response);
  return Answer("GetGroupRank", held.status());
}

grpc::Status GroupService::ListGroupRanks(grpc::ServerContext*, const pb::ListGroupRanksRequest*,
                                          pb::ListGroupRanksResponse* response) {
  if (absl::Status allowed = socket_.AllowOperatorCall("KvGroup.ListGroupRanks");
      !allowed.ok()) {
    return Answer("ListGroupRanks", allowed);
  }
  const absl::Time now = leases_->Now();
  for (const HeldReservation& held : leases_->GroupRanks()) {
    FillState(held, now, response->add_ranks());
  }
  return Answer("ListGroupRanks", absl::OkStatus());
}

}  // namespace memra
