#ifndef MEMRA_CLIENT_INTERNAL_H_
#define MEMRA_CLIENT_INTERNAL_H_

// NOT the engine API (client/client.h is): the wire underneath a KvClient, for the daemon's
// bad-input tests (requests client.h would never build), benchmarks that time the raw RPC, and
// operator tools that print the daemon's messages as they are. Everything here speaks the
// generated memra.kv.v1 types; every conversion between them and client.h's types is here too,
// so there is one of each.

#include <memory>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "client/step_channel_client.h"
#include "common/codec.h"
#include "core/prefix_index.h"
#include "grpcpp/client_context.h"
#include "proto/memra/kv/v1/admin.grpc.pb.h"
#include "proto/memra/kv/v1/block_store.grpc.pb.h"
#include "proto/memra/kv/v1/cache.grpc.pb.h"
#include "proto/memra/kv/v1/prefix.grpc.pb.h"

namespace memra {

class ClientInternals {
 public:
  static memra::kv::v1::KvCache::Stub& Cache(KvClient& client);
  static memra::kv::v1::KvAdmin::Stub& Admin(KvClient& client);
  static memra::kv::v1::KvPrefixCache::Stub& Prefix(KvClient& client);
  static memra::kv::v1::KvBlockStore::Stub& Blocks(KvClient& client);
  // A context whose deadline is the client's ClientOptions::deadline from now.
  static std::unique_ptr<grpc::ClientContext> NewContext(const KvClient& client);

  // The engine's reference (id and token) as RegisterPlan, Reserve and CreateSession carry it;
  // FAILED_PRECONDITION before Attach.
  static absl::StatusOr<memra::kv::v1::EngineRef> Engine(const KvClient& client);
  // The session's reference (id and token) as every session call carries it.
  static memra::kv::v1::SessionRef Ref(const Session& session);
  // The Step request the batch holds.
  static const memra::kv::v1::StepRequest& Request(const StepBatch& batch);
  // KvAdmin.GetStatus.
  static absl::StatusOr<memra::kv::v1::GetStatusResponse> GetStatus(KvClient& client);
  // A session call's status as the engine sees it: the restart error when the daemon answering
  // is not the one the engine attached to (KvClient::Explain).
  static absl::Status SessionCallStatus(KvClient& client, const grpc::Status& status);
  // An arena request over the client's handoff connection, with any session id, token and
  // handle (the isolation tests' forged requests).
  static absl::StatusOr<ArenaFd> FetchArenaFd(KvClient& client, uint64_t session_id,
                                              absl::string_view session_token,
                                              absl::string_view handle);
  // The descriptor of the client's handoff connection (-1 when not attached), for the tests'
  // raw frames.
  static int HandoffSocket(KvClient& client);
  // The client's step channel (null when none is open): the bad-input tests write its rings
  // themselves (after which the client must not step over it again).
  static std::shared_ptr<StepChannelClient> StepChannel(KvClient& client);
  // A further step channel request over the client's handoff connection (the daemon's
  // one-per-engine refusal).
  static absl::StatusOr<handoff::StepChannelFds> OpenAnotherStepChannel(KvClient& client);
};

// The daemon's messages as client.h's types. INVALID_ARGUMENT naming the field for an enum out
// of range or a fingerprint / key of the wrong length.
absl::StatusOr<SessionLayout> SessionLayoutFromProto(const memra::kv::v1::SessionLayout& proto);
SessionSnapshot SessionSnapshotFromProto(const memra::kv::v1::SessionState& proto);
// Where a prefix piece or a stored block is (an unknown value: the device).
StorageMedium MediumFromProto(memra::kv::v1::PrefixMedium medium);

// The session calls (Session's, PrefixClient's) all follow one shape: fill a request with the
// session (and the engine's interprocess event, for calls that order device work), call, convert.
template <typename Request>
Request ForSession(const Session& session) {
  Request request;
  *request.mutable_session() = ClientInternals::Ref(session);
  if constexpr (requires { request.mutable_ordering(); }) {
    if (!session.wait_event().empty()) {
      request.mutable_ordering()->set_wait_event(session.wait_event());
    }
  }
  return request;
}

// The shape fields CreateSession, Reserve and PrefixClient::Lookup share.
template <typename Shape>
void SetSessionShape(const PlanFingerprint& plan, const SessionOptions& options, Shape& shape) {
  shape.set_plan_fingerprint(FingerprintToBytes(plan));
  shape.set_layer_lo(options.layer_lo);
  if (options.layer_hi.has_value()) shape.set_layer_hi(*options.layer_hi);
  shape.set_tp_ranks(options.tp_ranks);
  if constexpr (requires { shape.set_capacity(0); }) shape.set_capacity(options.capacity);
  if constexpr (requires { shape.set_spec_snapshot(false); }) {
    shape.set_spec_snapshot(options.spec_snapshot);
  }
}

}  // namespace memra

#endif  // MEMRA_CLIENT_INTERNAL_H_
