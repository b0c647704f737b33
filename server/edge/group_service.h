#ifndef MEMRA_SERVER_GROUP_SERVICE_H_
#define MEMRA_SERVER_GROUP_SERVICE_H_

// memra.kv.v1.KvGroup (proto/memra/kv/v1/group.proto, docs/groups.md): one rank's side of a
// group admission. The daemon knows nothing of the other ranks; it holds this rank's bytes as
// a group reservation in its one ledger (core/admission.h), frees an unconfirmed one at its
// deadline (the lease sweep's ExpireReservations), and names itself (its engine socket) in
// every refusal so a group client reports which GPU said no.
//
// Thread-safety: thread-safe (the parts it calls are).

#include <string>

#include "absl/status/status.h"
#include "grpcpp/server_context.h"
#include "proto/memra/kv/v1/group.grpc.pb.h"
#include "server/edge/served_socket.h"
#include "server/session/engine_leases.h"
#include "server/session/session_registry.h"

namespace memra {

class GroupService final : public memra::kv::v1::KvGroup::Service {
 public:
  // REQUIRES: `leases` and `sessions` outlive this. `daemon` names this daemon in refusals and
  // states (its engine socket path).
  GroupService(EngineLeases* leases, SessionRegistry* sessions, ServedSocket socket,
               std::string daemon);

  grpc::Status ReserveGroupRank(grpc::ServerContext*,
                                const memra::kv::v1::ReserveGroupRankRequest* request,
                                memra::kv::v1::GroupRankState* response) override;
  grpc::Status ConfirmGroupRank(grpc::ServerContext*,
                                const memra::kv::v1::GroupRankRequest* request,
                                memra::kv::v1::GroupRankState* response) override;
  grpc::Status ReleaseGroupRank(grpc::ServerContext*,
                                const memra::kv::v1::GroupRankRequest* request,
                                memra::kv::v1::ReleaseGroupRankResponse* response) override;
  grpc::Status GetGroupRank(grpc::ServerContext*, const memra::kv::v1::GroupRankRequest* request,
                            memra::kv::v1::GroupRankState* response) override;
  grpc::Status ListGroupRanks(grpc::ServerContext*,
                              const memra::kv::v1::ListGroupRanksRequest* request,
                              memra::kv::v1::ListGroupRanksResponse* response) override;

 private:
  // `held` as the wire states it, its deadline counted from `now`.
  void FillState(const HeldReservation& held, absl::Time now,
                 memra::kv::v1::GroupRankState* state) const;
  // UNIMPLEMENTED on the admin socket for the engine calls (as KvCache is not served there).
  absl::Status AllowEngineCall(absl::string_view rpc) const;
  // Replies `status` for `rpc`, its message prefixed with this daemon's name (payloads kept).
  grpc::Status Answer(const char* rpc, const absl::Status& status) const;

  // Constant after construction.
  EngineLeases* const leases_;
  SessionRegistry* const sessions_;
  const ServedSocket socket_;
  const std::string daemon_;
};

}  // namespace memra

#endif  // MEMRA_SERVER_GROUP_SERVICE_H_
