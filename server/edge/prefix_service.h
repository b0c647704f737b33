#ifndef MEMRA_SERVER_PREFIX_SERVICE_H_
#define MEMRA_SERVER_PREFIX_SERVICE_H_

// memra.kv.v1 KvPrefixCache over gRPC: decodes, resolves sessions, calls PrefixCache, encodes.
// No rules here (server/store/prefix_cache.h has them; prefix.proto documents the contract).
// One instance per socket (server/edge/served_socket.h): on the engine socket ListPrefixes,
// InspectPrefix and EvictPrefix are refused (PERMISSION_DENIED naming the admin socket).
//
// Thread-safety: thread-safe (PrefixCache and the session finder are).

#include <atomic>
#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "grpcpp/server_context.h"
#include "proto/memra/kv/v1/cache.pb.h"
#include "proto/memra/kv/v1/prefix.grpc.pb.h"
#include "proto/memra/kv/v1/prefix.pb.h"
#include "server/device/backend.h"
#include "server/base/concurrency_limit.h"
#include "server/session/daemon_session.h"
#include "server/store/prefix_cache.h"
#include "server/edge/served_socket.h"

namespace memra {

class PrefixService final : public memra::kv::v1::KvPrefixCache::Service {
 public:
  // The session a ref names: NOT_FOUND unknown id, PERMISSION_DENIED wrong token.
  using SessionFinder = std::function<absl::StatusOr<std::shared_ptr<DaemonSession>>(
      const memra::kv::v1::SessionRef&)>;
  // The cache scope of the attached engine a ref names (EngineLeases::CacheScope).
  using ScopeFinder =
      std::function<absl::StatusOr<std::string>(const memra::kv::v1::EngineRef&)>;

  // `cache` null: the daemon runs without a prefix cache (every call FAILED_PRECONDITION).
  // `cache` and `backend` (the engines' events are waited on through it) must outlive the
  // service. `socket`: the socket this instance answers on. `event_streams`: SubscribeEvents
  // streams open at once on this socket (per_key: per engine; each holds a gRPC thread).
  PrefixService(PrefixCache* cache, DeviceBackend* backend, SessionFinder find_session,
                ScopeFinder find_scope, ServedSocket socket,
                ConcurrencyLimit::Limits event_streams);

  // Ends open SubscribeEvents streams within one poll period (daemon shutdown).
  void Stop() { stopping_.store(true); }

  grpc::Status Capture(grpc::ServerContext*, const memra::kv::v1::CapturePrefixRequest* request,
                       memra::kv::v1::CapturePrefixResponse* response) override;
  grpc::Status Lookup(grpc::ServerContext*, const memra::kv::v1::LookupPrefixRequest* request,
                      memra::kv::v1::LookupPrefixResponse* response) override;
  grpc::Status Restore(grpc::ServerContext*, const memra::kv::v1::RestorePrefixRequest* request,
                       memra::kv::v1::RestorePrefixResponse* response) override;
  grpc::Status SubscribeEvents(grpc::ServerContext* context,
                               const memra::kv::v1::SubscribePrefixEventsRequest* request,
                               grpc::ServerWriter<memra::kv::v1::PrefixEvent>* writer) override;
  grpc::Status ListPrefixes(grpc::ServerContext*, const memra::kv::v1::ListPrefixesRequest*,
                            memra::kv::v1::ListPrefixesResponse* response) override;
  grpc::Status InspectPrefix(grpc::ServerContext*,
                             const memra::kv::v1::InspectPrefixRequest* request,
                             memra::kv::v1::PrefixEntry* response) override;
  grpc::Status EvictPrefix(grpc::ServerContext*, const memra::kv::v1::EvictPrefixRequest* request,
                           memra::kv::v1::EvictPrefixResponse* response) override;

 private:
  absl::Status Enabled() const;
  // The session `ref` names, once the engine's device work on it is complete (DeviceOrdering):
  // authenticated first, so nobody makes the daemon wait on an event for a session not theirs.
  absl::StatusOr<std::shared_ptr<DaemonSession>> OrderedSession(
      const memra::kv::v1::SessionRef& ref, const memra::kv::v1::DeviceOrdering& ordering);

  // The scope a Lookup or SubscribeEvents reads: on the engine socket the engine's own (a
  // different `requested` is PERMISSION_DENIED); on the admin socket `requested` (nullopt when
  // empty: every scope).
  absl::StatusOr<std::optional<std::string>> ReaderScope(const memra::kv::v1::EngineRef& engine,
                                                         const std::string& requested) const;

  // Constant after construction.
  PrefixCache* const cache_;
  DeviceBackend* const backend_;
  const SessionFinder find_session_;
  const ScopeFinder find_scope_;
  const ServedSocket socket_;

  // SubscribeEvents streams open on this socket.
  ConcurrencyLimit event_streams_;
  std::atomic<bool> stopping_{false};
};

// The stats message of prefix.proto (the lead's metrics exporter reads PrefixCache::Stats()).
memra::kv::v1::PrefixCacheStats PrefixStatsToProto(const PrefixCacheStats& stats);
memra::kv::v1::PrefixMedium MediumToProto(StorageMedium medium);

}  // namespace memra

#endif  // MEMRA_SERVER_PREFIX_SERVICE_H_
