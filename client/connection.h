#ifndef MEMRA_CLIENT_CONNECTION_H_
#define MEMRA_CLIENT_CONNECTION_H_

// The one connection behind a KvClient and its views (client.h, prefix_client.h,
// block_store_client.h): the gRPC channel and its stubs, the lease (its stream and the threads
// that keep it and re-attach), the handoff connection and the step channel. Not the engine API:
// only client/ includes it.
//
// Ownership: the KvClient owns it (a shared_ptr); each view holds a weak_ptr and locks it for
// the length of one call (Lock). So a view used after its KvClient is gone is refused with
// FAILED_PRECONDITION instead of touching freed memory, and a call in flight when the KvClient
// goes keeps the channel alive until it returns (the lease is ended by ~KvClient either way).
//
// Thread-safe. Lock order: write_mu_ before mu_.

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/handoff_channel.h"
#include "client/step_channel_client.h"
#include "common/grpc_status.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "proto/memra/kv/v1/admin.grpc.pb.h"
#include "proto/memra/kv/v1/block_store.grpc.pb.h"
#include "proto/memra/kv/v1/cache.grpc.pb.h"
#include "proto/memra/kv/v1/prefix.grpc.pb.h"

namespace memra {

class ClientConnection {
 public:
  // Connects to the daemon's Unix socket, waiting up to options.deadline (UNAVAILABLE).
  // `options` must have its mapper and handoff socket path filled in (KvClient::Connect does).
  static absl::StatusOr<std::shared_ptr<ClientConnection>> Connect(const std::string& socket_path,
                                                                   ClientOptions options);
  ~ClientConnection();  // Detach()
  ClientConnection(const ClientConnection&) = delete;
  ClientConnection& operator=(const ClientConnection&) = delete;

  // The connection a view's weak reference names, for one call; FAILED_PRECONDITION naming
  // `what` (the view's call) once the KvClient that owned it is gone.
  static absl::StatusOr<std::shared_ptr<ClientConnection>> Lock(
      const std::weak_ptr<ClientConnection>& connection, absl::string_view what);

  // One unary call of a view (PrefixClient, BlockStoreClient) on the stub of its service:
  // FAILED_PRECONDITION naming `view_call` once the view's KvClient is gone; with `as_engine`
  // set, the engine's reference goes into request.engine (FAILED_PRECONDITION naming
  // `as_engine` before Attach). A refusal sends nothing.
  template <typename Stub, typename Request, typename Response>
  static absl::Status ViewCall(const std::weak_ptr<ClientConnection>& view,
                               absl::string_view view_call,
                               std::optional<absl::string_view> as_engine,
                               grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&,
                                                            Response*),
                               Request& request, Response& response);

  // The stubs of the one channel: constant after construction.
  memra::kv::v1::KvCache::Stub& cache() const { return *cache_; }
  memra::kv::v1::KvAdmin::Stub& admin() const { return *admin_; }
  memra::kv::v1::KvPrefixCache::Stub& prefix() const { return *prefix_; }
  memra::kv::v1::KvBlockStore::Stub& blocks() const { return *blocks_; }
  const ClientOptions& options() const { return options_; }
  ArenaMapper& mapper() const { return *options_.mapper; }
  // A context whose deadline is options().deadline from now.
  std::unique_ptr<grpc::ClientContext> NewContext() const;

  // KvClient's lease calls (client.h documents them).
  absl::Status Attach(const std::string& engine_name) ABSL_LOCKS_EXCLUDED(mu_);
  void Detach() ABSL_LOCKS_EXCLUDED(mu_);
  bool lease_alive() const { return lease_alive_.load(); }
  absl::Status lease_lost() const ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t reattaches() const { return reattaches_.load(); }
  uint64_t engine_id() const ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t epoch() const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Duration lease_timeout() const ABSL_LOCKS_EXCLUDED(mu_);
  std::string cache_scope() const ABSL_LOCKS_EXCLUDED(mu_);

  // The engine's reference (id and token); FAILED_PRECONDITION before Attach (`what` names the
  // call).
  absl::StatusOr<memra::kv::v1::EngineRef> AttachedEngine(absl::string_view what) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // The same, or nullopt when not attached (calls an operator may make too).
  std::optional<memra::kv::v1::EngineRef> EngineIfAttached() const ABSL_LOCKS_EXCLUDED(mu_);

  // A session call's refusal, made the restart error when the daemon answering is not the one
  // this engine attached to (a NOT_FOUND / PERMISSION_DENIED for a session the new daemon never
  // had), so the engine never mistakes it for its own mistake.
  absl::Status Explain(absl::Status status) ABSL_LOCKS_EXCLUDED(mu_);
  // KvAdmin.GetStatus.
  absl::StatusOr<memra::kv::v1::GetStatusResponse> GetStatus() const;

  // The handoff connection Attach opened (null when not attached); shared so a request in
  // flight outlives a Detach or a re-attach that replaces it.
  std::shared_ptr<HandoffChannel> handoff() const ABSL_LOCKS_EXCLUDED(mu_);
  // The descriptor of arena `handle` of a session of this engine, over the handoff connection
  // (FAILED_PRECONDITION before Attach; the daemon's refusal as it sent it).
  absl::StatusOr<ArenaFd> FetchArenaFd(uint64_t session_id, absl::string_view session_token,
                                       absl::string_view handle) const ABSL_LOCKS_EXCLUDED(mu_);

  // The step channel now (null when none is open); shared so a Step in flight outlives a
  // re-attach that replaces it.
  std::shared_ptr<StepChannelClient> step_channel() const ABSL_LOCKS_EXCLUDED(mu_);
  // A Step over `channel` failed with `status`: Steps go over gRPC from now on (unless a
  // re-attach already replaced it).
  void DropStepChannel(const std::shared_ptr<StepChannelClient>& channel, absl::Status status)
      ABSL_LOCKS_EXCLUDED(mu_);
  bool step_channel_active() const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status step_channel_status() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // The lease's Attach stream.
  struct LeaseStream;
  ClientConnection(ClientOptions options, std::shared_ptr<grpc::Channel> channel);
  // The lease thread: reads the daemon's acks as they come, so a broken stream is noticed when
  // it breaks (not at the next heartbeat), and re-attaches.
  void KeepLease() ABSL_LOCKS_EXCLUDED(mu_, write_mu_);
  // The heartbeat thread: a heartbeat every third of the lease timeout on the current stream.
  void SendHeartbeats() ABSL_LOCKS_EXCLUDED(mu_, write_mu_);
  // Opens `lease`'s Attach stream and sends its hello; OK with the daemon's answer in `lease`,
  // or the daemon's refusal (the stream is finished then).
  absl::Status OpenLease(LeaseStream& lease);
  // After a broken lease stream: re-attaches as the same engine until it works (true), the
  // daemon refuses for good (false, lease_lost_ set) or Detach() (false).
  bool Reattach() ABSL_LOCKS_EXCLUDED(mu_, write_mu_);
  // The lease stream broke: the step channel is abandoned (StepChannelClient::Abandon) and
  // dropped; Steps go over gRPC until a re-attach opens a new one.
  void AbandonStepChannel() ABSL_LOCKS_EXCLUDED(mu_);
  // The step channel over `handoff` when the daemon `offered` it and the options allow it, or
  // null and why not. Takes no lock of this class.
  std::pair<std::shared_ptr<StepChannelClient>, absl::Status> OpenStepChannel(
      HandoffChannel& handoff, bool offered);

  // Constant after construction.
  const ClientOptions options_;
  const std::shared_ptr<grpc::Channel> channel_;
  const std::unique_ptr<memra::kv::v1::KvCache::Stub> cache_;
  const std::unique_ptr<memra::kv::v1::KvAdmin::Stub> admin_;
  const std::unique_ptr<memra::kv::v1::KvPrefixCache::Stub> prefix_;
  const std::unique_ptr<memra::kv::v1::KvBlockStore::Stub> blocks_;

  std::atomic<bool> lease_alive_{false};
  std::atomic<uint64_t> reattaches_{0};

  // Held while a heartbeat is written, and while the stream is finished or replaced, so neither
  // happens under a write (gRPC allows one Read and one Write at a time, nothing with Finish).
  // Never held while waiting on the daemon otherwise; taken before mu_.
  absl::Mutex write_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  mutable absl::Mutex mu_;
  uint64_t engine_id_ ABSL_GUARDED_BY(mu_) = 0;
  std::string engine_token_ ABSL_GUARDED_BY(mu_);
  std::string cache_scope_ ABSL_GUARDED_BY(mu_);
  absl::Duration lease_timeout_ ABSL_GUARDED_BY(mu_);
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status lease_lost_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::unique_ptr<LeaseStream> lease_stream_ ABSL_GUARDED_BY(mu_);
  // The stream a re-attach is opening (Detach cancels it); null otherwise.
  LeaseStream* reattaching_ ABSL_GUARDED_BY(mu_) = nullptr;
  // Opened by Attach (and by each re-attach), closed by Detach.
  std::shared_ptr<HandoffChannel> handoff_ ABSL_GUARDED_BY(mu_);
  // Opened with each attach when offered (null otherwise).
  std::shared_ptr<StepChannelClient> step_channel_ ABSL_GUARDED_BY(mu_);
  absl::Status step_channel_status_ ABSL_GUARDED_BY(mu_);
  std::thread lease_thread_ ABSL_GUARDED_BY(mu_);
  std::thread heartbeat_thread_ ABSL_GUARDED_BY(mu_);
};

template <typename Stub, typename Request, typename Response>
absl::Status ClientConnection::ViewCall(
    const std::weak_ptr<ClientConnection>& view, absl::string_view view_call,
    std::optional<absl::string_view> as_engine,
    grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&, Response*),
    Request& request, Response& response) {
  absl::StatusOr<std::shared_ptr<ClientConnection>> connection = Lock(view, view_call);
  if (!connection.ok()) return connection.status();
  if constexpr (requires { request.mutable_engine(); }) {
    if (as_engine.has_value()) {
      absl::StatusOr<memra::kv::v1::EngineRef> engine = (*connection)->AttachedEngine(*as_engine);
      if (!engine.ok()) return engine.status();
      *request.mutable_engine() = *std::move(engine);
    }
  }
  Stub* stub;
  if constexpr (std::is_same_v<Stub, memra::kv::v1::KvPrefixCache::Stub>) {
    stub = &(*connection)->prefix();
  } else {
    static_assert(std::is_same_v<Stub, memra::kv::v1::KvBlockStore::Stub>);
    stub = &(*connection)->blocks();
  }
  return FromGrpcStatus((stub->*method)((*connection)->NewContext().get(), request, &response));
}

}  // namespace memra

#endif  // MEMRA_CLIENT_CONNECTION_H_
