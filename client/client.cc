#include "client/client.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "client/internal.h"
#include "client/step_channel_client.h"
#include "common/step_channel.h"
#include "common/codec.h"
#include "common/grpc_status.h"
#include "core/status_macros.h"
#include "google/protobuf/arena.h"
#include "grpcpp/channel.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/support/channel_arguments.h"
#include "grpcpp/security/credentials.h"

namespace memra {
namespace {

namespace pb = ::memra::kv::v1;

StorageMedium MediumFromProto(pb::PrefixMedium medium) {
  switch (medium) {
    case pb::PREFIX_MEDIUM_PINNED_HOST:
      return StorageMedium::kPinnedHost;
    case pb::PREFIX_MEDIUM_DISK:
      return StorageMedium::kDisk;
    case pb::PREFIX_MEDIUM_REMOTE:
      return StorageMedium::kRemote;
    default:
      return StorageMedium::kDevice;
  }
}

// The session calls all follow one shape: fill a request with the session (and the engine's
// interprocess event, for calls that order device work), call, convert.
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

bool NamesArena(const SessionLayout& layout, const std::string& handle) {
  for (const SessionArena& arena : layout.arenas) {
    if (arena.handle == handle) return true;
  }
  return false;
}

absl::StatusOr<BlockKey> BlockKeyFromBytes(const std::string& bytes, absl::string_view field) {
  BlockKey key;
  if (bytes.size() != key.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " is ", bytes.size(), " bytes, not ", key.size()));
  }
  std::copy(bytes.begin(), bytes.end(), key.begin());
  return key;
}

// Fills `out`, reusing its per-layer vector's capacity.
void PreparedFromProto(const pb::PrepareAppendResponse& proto, PreparedAppend& out) {
  out.generation = proto.generation();
  out.target = proto.target();
  LayerAppendsFromProto(proto.layers(), out.layers);
}

PreparedAppend PreparedFromProto(const pb::PrepareAppendResponse& proto) {
  PreparedAppend out;
  PreparedFromProto(proto, out);
  return out;
}

// Drops the mappings of pooled arenas the daemon has freed (proto unmap_handles). NOT_FOUND is
// fine: a mapping this process already dropped.
void UnmapFreedPoolArenas(ArenaMapper& mapper,
                          const google::protobuf::RepeatedPtrField<std::string>& handles) {
  for (const std::string& handle : handles) (void)mapper.Unmap(handle);
}

}  // namespace

// ---- Wire types <-> client.h types ----

absl::StatusOr<SessionLayout> SessionLayoutFromProto(const pb::SessionLayout& proto) {
  SessionLayout layout;
  layout.version = proto.layout_version();
  layout.capacity = proto.capacity();
  layout.arenas.reserve(proto.arenas_size());
  for (const pb::Arena& arena : proto.arenas()) {
    layout.arenas.push_back({arena.backend(), arena.handle(), arena.bytes()});
  }
  layout.layers.reserve(proto.layers_size());
  for (const pb::LayerLayout& entry : proto.layers()) {
    SessionLayer& layer = layout.layers.emplace_back();
    layer.layer = entry.layer();
    ASSIGN_OR_RETURN(layer.kind, StateKindFromProto(entry.kind()));
    // A layout without formats (a daemon from before element formats) keeps the block
    // default: the raw views work, a typed view is refused.
    if (entry.has_formats() &&
        (layer.kind == StateKind::kKv || layer.kind == StateKind::kSlidingKv)) {
      ASSIGN_OR_RETURN(layer.formats, KvFormatsFromProto(entry.formats(), "layout formats"));
    }
    layer.head_dim_k = entry.head_dim_k();
    layer.head_dim_v = entry.head_dim_v();
    layer.n_head_kv = entry.n_head_kv();
    layer.k_scale.assign(entry.k_scale().begin(), entry.k_scale().end());
    layer.v_scale.assign(entry.v_scale().begin(), entry.v_scale().end());
    ASSIGN_OR_RETURN(layer.latent_format,
                     ElementFormatFromProto(entry.latent_format(), "layout latent_format"));
    layer.k_token_bytes = entry.k_token_bytes();
    layer.v_token_bytes = entry.v_token_bytes();
    layer.window = entry.window();
    layer.physical_rows = entry.physical_rows();
    layer.ring = entry.ring();
    layer.latent_width = entry.latent_width();
    layer.index_width = entry.index_width();
    layer.index_pool = entry.index_pool();
    layer.index_physical_rows = entry.index_physical_rows();
    layer.index_ring = entry.index_ring();
    layer.planes.reserve(entry.planes_size());
    for (const pb::Plane& plane : entry.planes()) {
      ASSIGN_OR_RETURN(PlaneKind kind, PlaneKindFromProto(plane.kind()));
      layer.planes.push_back(
          {kind, plane.arena(), plane.offset(), plane.bytes(), plane.rows(), plane.row_bytes()});
    }
  }
  return layout;
}

SessionSnapshot SessionSnapshotFromProto(const pb::SessionState& proto) {
  SessionSnapshot state;
  state.layout_version = proto.layout_version();
  state.capacity = proto.capacity();
  state.committed_len = proto.committed_len();
  state.staged_len = proto.staged_len();
  state.position = proto.position();
  state.active_generation = proto.active_generation();
  state.next_generation = proto.next_generation();
  state.tainted = proto.tainted();
  state.spec_snapshot_valid = proto.spec_snapshot_valid();
  state.grow_pending = proto.grow_pending();
  state.layers.reserve(proto.layers_size());
  for (const pb::LayerState& layer : proto.layers()) {
    state.layers.push_back({layer.layer(), layer.length(), layer.ring_base(), layer.ring(),
                            layer.index_pools_ready()});
  }
  return state;
}

// ---- StepBatch::Wire (KvClient::Step uses it) ----

struct StepBatch::Wire {
  // The reply of KvClient::Step(batch, outcomes), parsed into `reply_arena`, whose first block
  // is `reply_block`: sized to the largest reply so far, it is reused (Arena::Reset keeps a
  // caller's initial block), so a steady decode loop allocates nothing for its replies.
  pb::StepResponse* NewReply();
  void RecycleReply();
  pb::StepEntry* Add(const Session& session) {
    if (session.layout().layers.size() > step_channel::kMaxKvLayers) fits_channel = false;
    pb::StepEntry* entry = request.add_entries();
    if (addressing == StepAddressing::kSlot) {
      entry->set_slot(session.slot());
    } else {
      *entry->mutable_session() = ClientInternals::Ref(session);
    }
    return entry;
  }

  StepAddressing addressing = StepAddressing::kSessionToken;
  pb::StepRequest request;
  // No session of the batch has more layers than a channel completion carries plans for.
  bool fits_channel = true;
  std::vector<char> reply_block;
  std::unique_ptr<google::protobuf::Arena> reply_arena;
};

pb::StepResponse* StepBatch::Wire::NewReply() {
  if (reply_arena == nullptr) {
    google::protobuf::ArenaOptions options;
    if (!reply_block.empty()) {
      options.initial_block = reply_block.data();
      options.initial_block_size = reply_block.size();
    }
    reply_arena = std::make_unique<google::protobuf::Arena>(options);
  }
  return google::protobuf::Arena::CreateMessage<pb::StepResponse>(reply_arena.get());
}

void StepBatch::Wire::RecycleReply() {
  // A reply that outgrew the block: the next arena starts with one twice its size (bounded by
  // what replies really use), and this one is freed. Otherwise Reset keeps the block.
  constexpr size_t kMaxBlockBytes = size_t{64} << 20;
  const size_t used = static_cast<size_t>(reply_arena->SpaceAllocated());
  if (used > reply_block.size() && reply_block.size() < kMaxBlockBytes) {
    reply_arena.reset();
    reply_block.assign(std::min(2 * used, kMaxBlockBytes), 0);
    return;
  }
  reply_arena->Reset();
}

// ---- KvClient ----

struct KvClient::Rpc {
  explicit Rpc(std::shared_ptr<grpc::Channel> channel_in)
      : channel(std::move(channel_in)),
        cache(pb::KvCache::NewStub(channel)),
        admin(pb::KvAdmin::NewStub(channel)),
        prefix(pb::KvPrefixCache::NewStub(channel)),
        blocks(pb::KvBlockStore::NewStub(channel)),
        group(pb::KvGroup::NewStub(channel)) {}
  const std::shared_ptr<grpc::Channel> channel;
  const std::unique_ptr<pb::KvCache::Stub> cache;
  const std::unique_ptr<pb::KvAdmin::Stub> admin;
  const std::unique_ptr<pb::KvPrefixCache::Stub> prefix;
  const std::unique_ptr<pb::KvBlockStore::Stub> blocks;
  const std::unique_ptr<pb::KvGroup::Stub> group;
};

struct KvClient::LeaseStream {
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReaderWriter<pb::AttachRequest, pb::AttachResponse>> stream;
  bool finished = false;  // Finish() was called (it may be called once)
  pb::AttachRequest hello;
  pb::Attached attached;  // the daemon's answer to `hello`
};

std::string DefaultHandoffSocketPath(absl::string_view socket_path) {
  absl::ConsumeSuffix(&socket_path, ".sock");
  return absl::StrCat(socket_path, ".handoff.sock");
}

absl::StatusOr<std::unique_ptr<KvClient>> KvClient::Connect(const std::string& socket_path,
                                                            ClientOptions options) {
  if (options.mapper == nullptr) options.mapper = std::make_shared<HostArenaMapper>();
  if (options.handoff_socket_path.empty()) {
    options.handoff_socket_path = DefaultHandoffSocketPath(socket_path);
  }
  // A local socket: reconnect within 100 ms-1 s of the daemon coming back (gRPC's default
  // backoff waits up to minutes, longer than a lease outlives a daemon restart).
  grpc::ChannelArguments arguments;
  arguments.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  // (Not GRPC_ARG_MIN_RECONNECT_BACKOFF_MS: gRPC also takes it as the connect timeout, and a
  // busy daemon's HTTP/2 handshake can take longer than a short one.)
  arguments.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  std::shared_ptr<grpc::Channel> channel = grpc::CreateCustomChannel(
      absl::StrCat("unix:", socket_path), grpc::InsecureChannelCredentials(), arguments);
  const auto deadline =
      std::chrono::system_clock::now() + absl::ToChronoMilliseconds(options.deadline);
  if (!channel->WaitForConnected(deadline)) {
    return absl::UnavailableError(absl::StrCat("memra-kvd is not answering on unix:", socket_path,
                                               " within ", absl::FormatDuration(options.deadline)));
  }
  return std::unique_ptr<KvClient>(
      new KvClient(std::move(options), std::make_unique<Rpc>(std::move(channel))));
}

KvClient::KvClient(ClientOptions options, std::unique_ptr<Rpc> rpc)
    : options_(std::move(options)), rpc_(std::move(rpc)) {}

KvClient::~KvClient() { Detach(); }

absl::Status KvClient::OpenLease(LeaseStream& lease) {
  // The lease stream lives as long as the engine: no deadline (the heartbeats are its clock).
  lease.stream = rpc_->cache->Attach(&lease.context);
  pb::AttachResponse response;
  const bool answered = lease.stream->Write(lease.hello) && lease.stream->Read(&response);
  if (!answered || !response.has_attached()) {
    // Not answered: the stream is over and Finish() has the daemon's reason. Answered wrongly:
    // end it ourselves so Finish() does not wait.
    if (answered) lease.context.TryCancel();
    absl::Status status = FromGrpcStatus(lease.stream->Finish());
    lease.finished = true;
    if (status.ok()) status = absl::InternalError("Attach ended without an answer");
    return status;
  }
  lease.attached = response.attached();
  return absl::OkStatus();
}

absl::Status KvClient::Attach(const std::string& engine_name) {
  absl::MutexLock lock(&mu_);
  if (lease_stream_ != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("already attached as engine ", engine_id_));
  }
  // The handoff connection first: its ticket proves to the daemon who this engine is.
  ASSIGN_OR_RETURN(std::unique_ptr<HandoffChannel> handoff,
                   HandoffChannel::Connect(options_.handoff_socket_path, options_.deadline));
  auto lease = std::make_unique<LeaseStream>();
  lease->hello.mutable_hello()->set_engine_name(engine_name);
  lease->hello.mutable_hello()->set_pid(getpid());
  lease->hello.mutable_hello()->set_handoff_ticket(handoff->ticket());
  lease->hello.mutable_hello()->set_cache_scope(options_.cache_scope);
  RETURN_IF_ERROR(OpenLease(*lease));
  const pb::Attached attached = lease->attached;
  std::tie(step_channel_, step_channel_status_) =
      OpenStepChannel(*handoff, attached.step_channel());
  lease_stream_ = std::move(lease);
  handoff_ = std::move(handoff);
  engine_id_ = attached.engine().engine_id();
  engine_token_ = attached.engine().engine_token();
  cache_scope_ = attached.cache_scope();
  lease_timeout_ = absl::Milliseconds(attached.lease_timeout_ms());
  epoch_ = attached.epoch();
  lease_lost_ = absl::OkStatus();
  stop_ = false;
  lease_alive_.store(true);
  lease_thread_ = std::thread([this] { KeepLease(); });
  heartbeat_thread_ = std::thread([this] { SendHeartbeats(); });
  return absl::OkStatus();
}

void KvClient::KeepLease() {
  pb::AttachResponse ack;
  while (true) {
    grpc::ClientReaderWriter<pb::AttachRequest, pb::AttachResponse>* stream;
    {
      absl::MutexLock lock(&mu_);
      if (stop_) break;
      stream = lease_stream_->stream.get();
    }
    // Only this thread reads the stream after Attach() returned; the stream stays while it
    // reads (only this thread's Reattach() and Detach(), after joining it, replace it).
    while (stream->Read(&ack)) {
    }
    lease_alive_.store(false);
    AbandonStepChannel();  // its daemon end is gone with the lease: Steps fail now, not at deadline
    if (!Reattach()) break;
  }
  lease_alive_.store(false);
}

void KvClient::SendHeartbeats() {
  pb::AttachRequest heartbeat;
  for (uint64_t sequence = 1;; ++sequence) {
    {
      absl::MutexLock lock(&mu_);
      const absl::Duration period = std::max(lease_timeout_ / 3, absl::Milliseconds(1));
      if (mu_.AwaitWithTimeout(absl::Condition(&stop_), period)) return;
    }
    absl::MutexLock write_lock(&write_mu_);
    grpc::ClientReaderWriter<pb::AttachRequest, pb::AttachResponse>* stream;
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
      if (lease_stream_->finished) continue;  // broken: the lease thread is re-attaching
      stream = lease_stream_->stream.get();
    }
    heartbeat.mutable_heartbeat()->set_sequence(sequence);
    // A failed write needs nothing here: the lease thread's Read sees the stream end.
    (void)stream->Write(heartbeat);
  }
}

bool KvClient::Reattach() {
  constexpr absl::Duration kRetry = absl::Milliseconds(100);
  pb::AttachRequest hello;
  {
    // Unblocks a heartbeat being written before waiting for it to end.
    absl::MutexLock lock(&mu_);
    lease_stream_->context.TryCancel();
  }
  {
    absl::MutexLock write_lock(&write_mu_);
    absl::MutexLock lock(&mu_);
    // The broken stream's status is not needed (the daemon is gone or ended the lease).
    if (!lease_stream_->finished) {
      (void)lease_stream_->stream->Finish();
      lease_stream_->finished = true;
    }
    hello.mutable_hello()->mutable_resume()->set_engine_id(engine_id_);
    hello.mutable_hello()->mutable_resume()->set_engine_token(engine_token_);
    hello.mutable_hello()->set_resume_epoch(epoch_);
    hello.mutable_hello()->set_pid(getpid());
    // The scope the engine attached in: a re-attach keeps it.
    hello.mutable_hello()->set_cache_scope(cache_scope_);
  }
  while (true) {
    auto lease = std::make_unique<LeaseStream>();
    lease->hello = hello;
    // Waits for the daemon to listen again instead of failing fast while the channel
    // reconnects; Detach() cancels the wait (reattaching_).
    lease->context.set_wait_for_ready(true);
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stop_), kRetry)) return false;
      reattaching_ = lease.get();
    }
    // Every Attach presents a fresh handoff ticket: the old handoff connection broke with the
    // daemon (or is another connection's), and the daemon binds this one's peer credentials
    // again, checking them against the engine's. Not answering yet: the daemon is not back.
    absl::StatusOr<std::unique_ptr<HandoffChannel>> handoff =
        HandoffChannel::Connect(options_.handoff_socket_path, options_.deadline);
    absl::Status opened = handoff.status();
    std::pair<std::shared_ptr<StepChannelClient>, absl::Status> step_channel;
    if (handoff.ok()) {
      lease->hello.mutable_hello()->set_handoff_ticket((*handoff)->ticket());
      opened = OpenLease(*lease);
      // A fresh channel with the fresh lease: the earlier one belonged to the daemon (or the
      // handoff connection) that broke, and a new one replaces it in the daemon.
      if (opened.ok()) {
        step_channel = OpenStepChannel(**handoff, lease->attached.step_channel());
      }
    }
    absl::MutexLock write_lock(&write_mu_);  // the old stream goes: no heartbeat is on it
    absl::MutexLock lock(&mu_);
    reattaching_ = nullptr;
    if (stop_) {
      if (opened.ok()) {
        lease->context.TryCancel();
        (void)lease->stream->Finish();
      }
      return false;
    }
    if (opened.ok()) {
      epoch_ = lease->attached.epoch();
      lease_timeout_ = absl::Milliseconds(lease->attached.lease_timeout_ms());
      lease_stream_ = std::move(lease);
      handoff_ = *std::move(handoff);
      std::tie(step_channel_, step_channel_status_) = std::move(step_channel);
      reattaches_.fetch_add(1);
      lease_alive_.store(true);
      return true;
    }
    const absl::StatusCode code = opened.code();
    if (IsDaemonRestarted(opened) || code == absl::StatusCode::kNotFound ||
        code == absl::StatusCode::kPermissionDenied) {
      lease_lost_ = opened;  // the daemon will never know this engine again
      return false;
    }
    // UNAVAILABLE: no daemon yet, or the ticket came from a daemon that died before this Attach
    // reached the next one (a crash loop; the daemon names both instances): try again with a
    // fresh ticket, until the daemon answering accepts the engine or says it will not.
  }
}

absl::Status KvClient::lease_lost() const {
  absl::MutexLock lock(&mu_);
  return lease_lost_;
}

uint64_t KvClient::epoch() const {
  absl::MutexLock lock(&mu_);
  return epoch_;
}

absl::Status KvClient::Explain(absl::Status status) {
  const absl::StatusCode code = status.code();
  if (status.ok() || IsDaemonRestarted(status) ||
      (code != absl::StatusCode::kNotFound && code != absl::StatusCode::kPermissionDenied)) {
    return status;
  }
  uint64_t attached_epoch;
  {
    absl::MutexLock lock(&mu_);
    attached_epoch = epoch_;
  }
  if (attached_epoch == 0) return status;
  absl::StatusOr<pb::GetStatusResponse> daemon = ClientInternals::GetStatus(*this);
  if (!daemon.ok() || daemon->epoch() == attached_epoch) return status;
  return DaemonRestartedError(
      DaemonRestart{attached_epoch, daemon->epoch()},
      absl::StrCat("this engine attached to epoch ", attached_epoch,
                   " and the daemon answering does not have it: ", status.message()));
}

void KvClient::Detach() {
  std::thread lease_thread;
  std::thread heartbeat_thread;
  {
    absl::MutexLock lock(&mu_);
    if (lease_stream_ == nullptr) return;
    stop_ = true;
    lease_stream_->context.TryCancel();  // unblocks a Read waiting for an ack, and a Write
    if (reattaching_ != nullptr) reattaching_->context.TryCancel();  // and a re-attach
    lease_thread = std::move(lease_thread_);
    heartbeat_thread = std::move(heartbeat_thread_);
  }
  if (heartbeat_thread.joinable()) heartbeat_thread.join();
  if (lease_thread.joinable()) lease_thread.join();
  absl::MutexLock lock(&mu_);
  if (!lease_stream_->finished) (void)lease_stream_->stream->Finish();
  lease_stream_.reset();
  handoff_.reset();
  if (step_channel_ != nullptr) step_channel_->Abandon();
  step_channel_.reset();
  step_channel_status_ = absl::FailedPreconditionError("detached");
  lease_alive_.store(false);
}

std::pair<std::shared_ptr<StepChannelClient>, absl::Status> KvClient::OpenStepChannel(
    HandoffChannel& handoff, bool offered) {
  if (options_.force_grpc_step) {
    return {nullptr, absl::FailedPreconditionError("ClientOptions::force_grpc_step is set")};
  }
  if (!offered) {
    return {nullptr, absl::FailedPreconditionError(
                         "the daemon offers no step channel (Attached.step_channel)")};
  }
  absl::StatusOr<handoff::StepChannelFds> fds = handoff.OpenStepChannel();
  if (!fds.ok()) return {nullptr, fds.status()};
  absl::StatusOr<std::unique_ptr<StepChannelClient>> channel =
      StepChannelClient::Map(*std::move(fds));
  if (!channel.ok()) return {nullptr, channel.status()};
  return {std::shared_ptr<StepChannelClient>(*std::move(channel)), absl::OkStatus()};
}

void KvClient::AbandonStepChannel() {
  absl::MutexLock lock(&mu_);
  if (step_channel_ == nullptr) return;
  step_channel_->Abandon();
  step_channel_status_ = absl::UnavailableError(
      "the lease stream broke: the step channel was abandoned (a re-attach opens a new one)");
  step_channel_.reset();
}

bool KvClient::step_channel_active() const {
  absl::MutexLock lock(&mu_);  // broken() takes no lock: no wait for a Run in progress
  return step_channel_ != nullptr && !step_channel_->broken();
}

absl::Status KvClient::step_channel_status() const {
  absl::MutexLock lock(&mu_);
  return step_channel_status_;
}

absl::StatusOr<ArenaFd> KvClient::FetchArenaFd(uint64_t session_id,
                                               absl::string_view session_token,
                                               absl::string_view handle) {
  std::shared_ptr<HandoffChannel> handoff;
  {
    absl::MutexLock lock(&mu_);
    handoff = handoff_;
  }
  if (handoff == nullptr) {
    return absl::FailedPreconditionError(
        "mapping a host arena before Attach: its descriptor comes over the engine's handoff "
        "connection");
  }
  return handoff->FetchArena(handoff::ArenaRequest{.session_id = session_id,
                                                   .session_token = std::string(session_token),
                                                   .handle = std::string(handle)});
}

uint64_t KvClient::engine_id() const {
  absl::MutexLock lock(&mu_);
  return engine_id_;
}

std::string KvClient::cache_scope() const {
  absl::MutexLock lock(&mu_);
  return cache_scope_;
}

absl::Duration KvClient::lease_timeout() const {
  absl::MutexLock lock(&mu_);
  return lease_timeout_;
}

absl::StatusOr<std::pair<uint64_t, std::string>> KvClient::AttachedEngine(
    absl::string_view what) const {
  absl::MutexLock lock(&mu_);
  if (lease_stream_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, " before Attach: sessions need a lease"));
  }
  return std::make_pair(engine_id_, engine_token_);
}

namespace {

// The shape fields CreateSession, Reserve and LookupPrefix share.
template <typename Shape>
void SetShape(const PlanFingerprint& plan, const SessionOptions& options, Shape& shape) {
  shape.set_plan_fingerprint(FingerprintToBytes(plan));
  shape.set_layer_lo(options.layer_lo);
  if (options.layer_hi.has_value()) shape.set_layer_hi(*options.layer_hi);
  shape.set_tp_ranks(options.tp_ranks);
  if constexpr (requires { shape.set_capacity(0); }) shape.set_capacity(options.capacity);
  if constexpr (requires { shape.set_spec_snapshot(false); }) {
    shape.set_spec_snapshot(options.spec_snapshot);
  }
}

void SetEngine(const std::pair<uint64_t, std::string>& engine, pb::EngineRef& ref) {
  ref.set_engine_id(engine.first);
  ref.set_engine_token(engine.second);
}

}  // namespace

absl::StatusOr<PlanFingerprint> KvClient::RegisterPlan(const ModelPlan& plan) {
  ASSIGN_OR_RETURN(auto engine, AttachedEngine("RegisterPlan"));
  pb::RegisterPlanRequest request;
  SetEngine(engine, *request.mutable_engine());
  *request.mutable_plan() = ModelPlanToProto(plan);
  pb::RegisterPlanResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(
      rpc_->cache->RegisterPlan(ClientInternals::NewContext(*this).get(), request, &response)));
  return FingerprintFromBytes(response.fingerprint());
}

absl::StatusOr<SessionReservation> KvClient::Reserve(const PlanFingerprint& plan,
                                              const SessionOptions& options) {
  pb::ReserveRequest request;
  ASSIGN_OR_RETURN(auto engine, AttachedEngine("Reserve"));
  SetEngine(engine, *request.mutable_engine());
  SetShape(plan, options, request);
  pb::ReserveResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(
      rpc_->cache->Reserve(ClientInternals::NewContext(*this).get(), request, &response)));
  return SessionReservation{response.reservation_id(), response.bytes(),
                     absl::Milliseconds(response.ttl_ms())};
}

absl::StatusOr<uint64_t> KvClient::CancelReservation(uint64_t reservation_id) {
  pb::CancelReservationRequest request;
  ASSIGN_OR_RETURN(auto engine, AttachedEngine("CancelReservation"));
  SetEngine(engine, *request.mutable_engine());
  request.set_reservation_id(reservation_id);
  pb::CancelReservationResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(rpc_->cache->CancelReservation(
      ClientInternals::NewContext(*this).get(), request, &response)));
  return response.freed_bytes();
}

absl::StatusOr<std::unique_ptr<Session>> KvClient::CreateSession(const PlanFingerprint& plan,
                                                                 const SessionOptions& options) {
  pb::CreateSessionRequest request;
  ASSIGN_OR_RETURN(auto engine, AttachedEngine("CreateSession"));
  SetEngine(engine, *request.mutable_engine());
  SetShape(plan, options, request);
  request.set_reservation_id(options.reservation_id);
  pb::CreateSessionResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(
      rpc_->cache->CreateSession(ClientInternals::NewContext(*this).get(), request, &response)));
  UnmapFreedPoolArenas(mapper(), response.unmap_handles());
  std::unique_ptr<Session> session(
      new Session(this, response.session().session_id(), response.session().session_token(),
                  response.slot()));
  absl::Status mapped = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(SessionLayout layout, SessionLayoutFromProto(response.layout()));
    return session->Adopt(std::move(layout));
  }();
  if (!mapped.ok()) {
    (void)session->Release();  // never leave the daemon holding a session nobody can use
    return mapped;
  }
  return session;
}

absl::Status KvClient::Step(StepBatch& batch, std::vector<StepOutcome>& outcomes) {
  if (batch.wire_->addressing == StepAddressing::kSlot) {
    ASSIGN_OR_RETURN(auto engine, AttachedEngine("Step by slot"));
    SetEngine(engine, *batch.wire_->request.mutable_engine());
  }
  pb::StepResponse* response = batch.wire_->NewReply();
  const pb::StepRequest& request = batch.wire_->request;
  std::shared_ptr<StepChannelClient> channel;
  if (batch.ChannelEligible()) {
    absl::MutexLock lock(&mu_);
    channel = step_channel_;
  }
  // nullopt: no channel, or one broken before this step could start (nothing submitted).
  std::optional<absl::Status> over_channel;
  if (channel != nullptr) over_channel = channel->Run(request, response, options_.deadline);
  absl::Status status =
      over_channel.has_value()
          ? *std::move(over_channel)
          : FromGrpcStatus(
                rpc_->cache->Step(ClientInternals::NewContext(*this).get(), request, response));
  if (!status.ok() && channel != nullptr) {
    absl::MutexLock lock(&mu_);
    if (step_channel_ == channel) {
      step_channel_status_ = status;
      step_channel_.reset();
    }
  }
  if (status.ok() && response->results_size() != request.entries_size()) {
    status = absl::InternalError(absl::StrCat("Step answered ", response->results_size(),
                                              " results for ", request.entries_size(), " entries"));
  }
  if (!status.ok()) {
    batch.wire_->RecycleReply();
    return status;
  }
  outcomes.resize(response->results_size());
  for (int i = 0; i < response->results_size(); ++i) {
    const pb::StepResult& result = response->results(i);
    StepOutcome& out = outcomes[i];
    out.status = result.code() == 0
                     ? absl::OkStatus()
                     : absl::Status(static_cast<absl::StatusCode>(result.code()), result.message());
    if (result.has_daemon_restart()) {
      AttachDaemonRestart(out.status, DaemonRestart{result.daemon_restart().previous_epoch(),
                                                    result.daemon_restart().epoch()});
    } else if (!out.status.ok()) {
      out.status = Explain(std::move(out.status));
    }
    out.begun = {};
    out.staged_len = 0;
    out.committed_len = 0;
    out.published = false;
    const pb::PrepareAppendResponse* prepared_reply =
        result.payload_case() == pb::StepResult::kPrepare ? &result.prepare()
        : result.payload_case() == pb::StepResult::kAdvance && result.advance().has_prepared()
            ? &result.advance().prepared()
            : nullptr;
    if (prepared_reply == nullptr) {
      out.prepared.reset();
    } else {
      // Reuses the previous step's per-layer vector when this slot held a plan too.
      PreparedAppend& prepared = out.prepared.has_value() ? *out.prepared : out.prepared.emplace();
      PreparedFromProto(*prepared_reply, prepared);
    }
    switch (result.payload_case()) {
      case pb::StepResult::kBegin:
        out.begun = {result.begin().generation(), result.begin().base_len()};
        break;
      case pb::StepResult::kPrepare:
        break;  // the plan is read above
      case pb::StepResult::kAdvance:
        out.committed_len = result.advance().committed_len();
        out.published = result.advance().published();
        if (out.prepared.has_value()) out.begun = {out.prepared->generation, out.committed_len};
        break;
      case pb::StepResult::kPublish:
        out.staged_len = result.publish().staged_len();
        break;
      case pb::StepResult::kCommit:
        out.committed_len = result.commit().committed_len();
        break;
      case pb::StepResult::kAbort:
        out.committed_len = result.abort().committed_len();
        break;
      case pb::StepResult::PAYLOAD_NOT_SET:
        break;
    }
  }
  batch.wire_->RecycleReply();
  return absl::OkStatus();
}

absl::StatusOr<std::vector<StepOutcome>> KvClient::Step(StepBatch& batch) {
  std::vector<StepOutcome> outcomes;
  RETURN_IF_ERROR(Step(batch, outcomes));
  return outcomes;
}

// ---- Prefix cache ----

absl::StatusOr<PrefixCaptured> KvClient::CapturePrefix(const Session& session,
                                                       absl::Span<const int32_t> token_ids,
                                                       uint64_t boundary_tokens) {
  pb::CapturePrefixRequest request = ForSession<pb::CapturePrefixRequest>(session);
  request.mutable_token_ids()->Add(token_ids.begin(), token_ids.end());
  request.set_boundary_tokens(boundary_tokens);
  pb::CapturePrefixResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(
      rpc_->prefix->Capture(ClientInternals::NewContext(*this).get(), request, &response)));
  PrefixCaptured captured{response.entry_id(),        response.boundary_tokens(),
                          response.already_present(), response.added_bytes(),
                          response.stored_bytes(),    {}};
  ASSIGN_OR_RETURN(captured.shape_fingerprint, FingerprintFromBytes(response.shape_fingerprint()));
  return captured;
}

absl::StatusOr<PrefixMatch> KvClient::LookupPrefix(const PlanFingerprint& plan,
                                                   const SessionOptions& shape,
                                                   absl::Span<const int32_t> token_ids) {
  pb::LookupPrefixRequest request;
  ASSIGN_OR_RETURN(auto engine, AttachedEngine("LookupPrefix"));  // its cache scope is read
  request.mutable_engine()->set_engine_id(engine.first);
  request.mutable_engine()->set_engine_token(engine.second);
  SetShape(plan, shape, *request.mutable_shape());
  request.mutable_token_ids()->Add(token_ids.begin(), token_ids.end());
  pb::LookupPrefixResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(
      rpc_->prefix->Lookup(ClientInternals::NewContext(*this).get(), request, &response)));
  PrefixMatch match;
  switch (response.outcome()) {
    case pb::LOOKUP_OUTCOME_HIT:
      match.outcome = LookupOutcome::kHit;
      break;
    case pb::LOOKUP_OUTCOME_PARTIAL:
      match.outcome = LookupOutcome::kPartial;
      break;
    default:
      match.outcome = LookupOutcome::kMiss;
      break;
  }
  match.entry_id = response.entry_id();
  match.matched_tokens = response.matched_tokens();
  match.block_tokens = response.block_tokens();
  match.medium = MediumFromProto(response.medium());
  return match;
}

absl::StatusOr<PrefixRestored> KvClient::RestorePrefix(const Session& session,
                                                       absl::Span<const int32_t> token_ids,
                                                       uint64_t entry_id) {
  pb::RestorePrefixRequest request = ForSession<pb::RestorePrefixRequest>(session);
  request.set_entry_id(entry_id);
  request.mutable_token_ids()->Add(token_ids.begin(), token_ids.end());
  pb::RestorePrefixResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(
      rpc_->prefix->Restore(ClientInternals::NewContext(*this).get(), request, &response)));
  return PrefixRestored{response.entry_id(), response.restored_tokens(),
                        SessionSnapshotFromProto(response.state())};
}

struct PrefixEventStream::Call {
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReader<pb::PrefixEvent>> reader;
  bool finished = false;  // Finish() was called (it may be called once)
  pb::AttachRequest hello;
  pb::Attached attached;  // the daemon's answer to `hello`
};

PrefixEventStream::PrefixEventStream(std::unique_ptr<Call> call) : call_(std::move(call)) {}

PrefixEventStream::~PrefixEventStream() {
  Cancel();
  if (!call_->finished) (void)call_->reader->Finish();
}

void PrefixEventStream::Cancel() { call_->context.TryCancel(); }

absl::StatusOr<std::optional<PrefixCacheEvent>> PrefixEventStream::Next() {
  if (call_->finished) return std::nullopt;
  pb::PrefixEvent event;
  if (!call_->reader->Read(&event)) {
    call_->finished = true;
    absl::Status ended = FromGrpcStatus(call_->reader->Finish());
    // Cancelling is how a subscriber ends the stream: not an error.
    if (ended.ok() || absl::IsCancelled(ended)) return std::nullopt;
    return ended;
  }
  PrefixCacheEvent out;
  out.gap = event.kind() == pb::PrefixEvent::GAP;
  out.sequence = event.sequence();
  out.epoch = event.epoch();
  if (out.gap) return out;
  switch (event.kind()) {
    case pb::PrefixEvent::EVICTED:
      out.kind = PrefixEventKind::kEvicted;
      break;
    case pb::PrefixEvent::DROPPED:
      out.kind = PrefixEventKind::kDropped;
      break;
    case pb::PrefixEvent::MOVED:
      out.kind = PrefixEventKind::kMoved;
      break;
    default:
      out.kind = PrefixEventKind::kStored;
      break;
  }
  ASSIGN_OR_RETURN(out.shape_fingerprint, FingerprintFromBytes(event.shape_fingerprint()));
  for (const std::string& key : event.block_keys()) {
    ASSIGN_OR_RETURN(out.block_keys.emplace_back(), BlockKeyFromBytes(key, "event block key"));
  }
  if (!event.boundary_key().empty()) {
    ASSIGN_OR_RETURN(out.boundary_key, BlockKeyFromBytes(event.boundary_key(), "boundary key"));
  }
  out.reason = event.reason();
  out.cache_scope = event.cache_scope();
  out.medium = MediumFromProto(event.medium());
  out.origin.block_hashes.assign(event.block_hashes().begin(), event.block_hashes().end());
  out.origin.parent_block_hash = event.parent_block_hash();
  out.origin.token_ids.assign(event.token_ids().begin(), event.token_ids().end());
  out.origin.block_tokens = event.block_tokens();
  out.origin.engine_id = event.engine_id();
  out.origin.from_engine_pool = event.from_engine_pool();
  return out;
}

std::unique_ptr<PrefixEventStream> KvClient::SubscribePrefixEvents(uint64_t epoch,
                                                                   uint64_t last_sequence) {
  auto call = std::make_unique<PrefixEventStream::Call>();
  pb::SubscribePrefixEventsRequest request;
  request.set_epoch(epoch);
  request.set_last_sequence(last_sequence);
  // The engine's scope's events (an unattached client is refused by the engine socket).
  {
    absl::MutexLock lock(&mu_);
    if (lease_stream_ != nullptr) {
      request.mutable_engine()->set_engine_id(engine_id_);
      request.mutable_engine()->set_engine_token(engine_token_);
    }
  }
  call->reader = rpc_->prefix->SubscribeEvents(&call->context, request);
  return std::unique_ptr<PrefixEventStream>(new PrefixEventStream(std::move(call)));
}

// ---- ClientInternals ----

pb::KvCache::Stub& ClientInternals::Cache(KvClient& client) { return *client.rpc_->cache; }
pb::KvAdmin::Stub& ClientInternals::Admin(KvClient& client) { return *client.rpc_->admin; }
pb::KvPrefixCache::Stub& ClientInternals::Prefix(KvClient& client) { return *client.rpc_->prefix; }
pb::KvGroup::Stub& ClientInternals::Group(KvClient& client) { return *client.rpc_->group; }

std::unique_ptr<grpc::ClientContext> ClientInternals::NewContext(const KvClient& client) {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() +
                        absl::ToChronoMilliseconds(client.options_.deadline));
  return context;
}

absl::StatusOr<pb::EngineRef> ClientInternals::Engine(const KvClient& client) {
  ASSIGN_OR_RETURN(auto engine, client.AttachedEngine("ClientInternals::Engine"));
  pb::EngineRef ref;
  SetEngine(engine, ref);
  return ref;
}

pb::SessionRef ClientInternals::Ref(const Session& session) {
  pb::SessionRef ref;
  ref.set_session_id(session.id_);
  ref.set_session_token(session.token_);
  return ref;
}

const pb::StepRequest& ClientInternals::Request(const StepBatch& batch) {
  return batch.wire_->request;
}

absl::Status ClientInternals::SessionCallStatus(KvClient& client, const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return client.Explain(FromGrpcStatus(status));
}

absl::StatusOr<pb::GetStatusResponse> ClientInternals::GetStatus(KvClient& client) {
  pb::GetStatusResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(
      client.rpc_->admin->GetStatus(NewContext(client).get(), pb::GetStatusRequest(), &response)));
  return response;
}

absl::StatusOr<ArenaFd> ClientInternals::FetchArenaFd(KvClient& client, uint64_t session_id,
                                                      absl::string_view session_token,
                                                      absl::string_view handle) {
  return client.FetchArenaFd(session_id, session_token, handle);
}

int ClientInternals::HandoffSocket(KvClient& client) {
  absl::MutexLock lock(&client.mu_);
  return client.handoff_ == nullptr ? -1 : client.handoff_->socket_.get();
}

std::shared_ptr<StepChannelClient> ClientInternals::StepChannel(KvClient& client) {
  absl::MutexLock lock(&client.mu_);
  return client.step_channel_;
}

absl::StatusOr<handoff::StepChannelFds> ClientInternals::OpenAnotherStepChannel(
    KvClient& client) {
  std::shared_ptr<HandoffChannel> handoff;
  {
    absl::MutexLock lock(&client.mu_);
    handoff = client.handoff_;
  }
  if (handoff == nullptr) return absl::FailedPreconditionError("no handoff connection");
  return handoff->OpenStepChannel();
}

// ---- StepBatch ----

StepBatch::StepBatch(StepAddressing addressing) : wire_(std::make_unique<Wire>()) {
  wire_->addressing = addressing;
}
StepBatch::~StepBatch() = default;

void StepBatch::SetWaitEvent(std::string ipc_event_handle) {
  wire_->request.mutable_ordering()->set_wait_event(std::move(ipc_event_handle));
}

size_t StepBatch::size() const { return static_cast<size_t>(wire_->request.entries_size()); }

void StepBatch::Clear() {
  wire_->request.Clear();
  wire_->fits_channel = true;
}

bool StepBatch::ChannelEligible() const {
  return wire_->addressing == StepAddressing::kSlot && wire_->fits_channel &&
         StepChannelClient::Carries(wire_->request);
}

void StepBatch::Begin(const Session& session) { wire_->Add(session)->mutable_begin(); }

void StepBatch::Prepare(const Session& session, uint64_t generation, uint64_t rows) {
  pb::StepPrepare* op = wire_->Add(session)->mutable_prepare();
  op->set_generation(generation);
  op->set_rows(rows);
}

void StepBatch::Publish(const Session& session, uint64_t generation) {
  wire_->Add(session)->mutable_publish()->set_generation(generation);
}

void StepBatch::Commit(const Session& session, uint64_t generation, uint64_t accepted_rows,
                       absl::Span<const int32_t> token_ids) {
  pb::StepCommit* op = wire_->Add(session)->mutable_commit();
  op->set_generation(generation);
  op->set_accepted_rows(accepted_rows);
  op->mutable_token_ids()->Add(token_ids.begin(), token_ids.end());
}

void StepBatch::Abort(const Session& session, uint64_t generation) {
  wire_->Add(session)->mutable_abort()->set_generation(generation);
}

void StepBatch::Advance(const Session& session, uint64_t generation, uint64_t accepted_rows,
                        uint64_t next_rows, absl::Span<const int32_t> token_ids) {
  pb::StepAdvance* op = wire_->Add(session)->mutable_advance();
  op->set_generation(generation);
  op->set_accepted_rows(accepted_rows);
  op->set_next_rows(next_rows);
  op->mutable_token_ids()->Add(token_ids.begin(), token_ids.end());
}

// ---- Session ----

Session::~Session() {
  if (!released_) (void)Release();
}

absl::Status Session::Adopt(SessionLayout layout) {
  std::vector<uint8_t*> bases;
  bases.reserve(layout.arenas.size());
  for (size_t i = 0; i < layout.arenas.size(); ++i) {
    const SessionArena& arena = layout.arenas[i];
    absl::StatusOr<void*> base =
        client_->mapper().Map(arena.backend, arena.handle, arena.bytes, [&] {
          return client_->FetchArenaFd(id_, token_, arena.handle);
        });
    if (!base.ok()) {
      // Leave nothing mapped that no layout names (arenas already ours stay mapped).
      for (size_t j = 0; j < i; ++j) {
        if (!NamesArena(layout_, layout.arenas[j].handle)) {
          (void)client_->mapper().Unmap(layout.arenas[j].handle);
        }
      }
      return base.status();
    }
    bases.push_back(static_cast<uint8_t*>(*base));
  }
  layout_ = std::move(layout);
  arena_bases_ = std::move(bases);
  return absl::OkStatus();
}

void Session::UnmapAll(const SessionLayout& layout) {
  for (const SessionArena& arena : layout.arenas) (void)client_->mapper().Unmap(arena.handle);
}

absl::StatusOr<PlaneView> ResolvePlane(const SessionLayout& layout,
                                       const std::vector<uint8_t*>& bases, uint32_t layer,
                                       PlaneKind kind) {
  for (const SessionLayer& entry : layout.layers) {
    if (entry.layer != layer) continue;
    for (const SessionPlane& plane : entry.planes) {
      if (plane.kind != kind) continue;
      if (plane.arena >= bases.size()) {
        return absl::InternalError(absl::StrCat("plane of layer ", layer, " names arena ",
                                                plane.arena, " of ", bases.size()));
      }
      return PlaneView{bases[plane.arena] + plane.offset, plane.bytes, plane.rows, plane.row_bytes};
    }
  }
  return absl::NotFoundError(
      absl::StrCat("layer ", layer, " has no ", std::string(PlaneKindName(kind)), " plane"));
}

namespace {

// What a typed view of `kind` in `layer` holds: its element format, heads, head dim and scale.
struct PlaneTyping {
  ElementFormat element = ElementFormat::kF32;
  uint64_t heads = 1;
  uint64_t head_dim = 0;  // 0: row_bytes / element bytes
  std::vector<float> scale;
};

absl::StatusOr<PlaneTyping> TypingOf(const SessionLayer& layer, PlaneKind kind) {
  const auto block = [&](std::string_view name) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layer ", layer.layer, " ", std::string(PlaneKindName(kind)), " are ", std::string(name),
        ", a block format: no typed view (read the bytes through Plane(); "
        "docs/rules.md#formats)"));
  };
  switch (kind) {
    case PlaneKind::kKeys: {
      const FormatLayout format = LayoutOf(layer.formats.k);
      if (!format.element.has_value()) return block(format.name);
      return PlaneTyping{*format.element, layer.n_head_kv, layer.head_dim_k, layer.k_scale};
    }
    case PlaneKind::kValues: {
      const FormatLayout format = LayoutOf(layer.formats.v);
      if (!format.element.has_value()) return block(format.name);
      return PlaneTyping{*format.element, layer.n_head_kv, layer.head_dim_v, layer.v_scale};
    }
    case PlaneKind::kLatentRows:
      return PlaneTyping{layer.latent_format, 1, layer.latent_width, layer.k_scale};
    case PlaneKind::kLenMirror:
    case PlaneKind::kBaseMirror:
      return absl::FailedPreconditionError(
          absl::StrCat("layer ", layer.layer, " ", std::string(PlaneKindName(kind)),
                       " is an i32 mirror the daemon owns: no typed view"));
    case PlaneKind::kConvState:
    case PlaneKind::kSsmState:
    case PlaneKind::kSsmStateAlt:
    case PlaneKind::kIndexRows:
    case PlaneKind::kPoolKeys:
    case PlaneKind::kSpecConv:
    case PlaneKind::kSpecSsm:
      break;
  }
  return PlaneTyping{};  // f32 rows
}

}  // namespace

absl::StatusOr<TypedPlaneView> ResolveTypedPlane(const SessionLayout& layout,
                                                 const std::vector<uint8_t*>& bases,
                                                 uint32_t layer, PlaneKind kind) {
  ASSIGN_OR_RETURN(const PlaneView plane, ResolvePlane(layout, bases, layer, kind));
  const SessionLayer* entry = nullptr;
  for (const SessionLayer& candidate : layout.layers) {
    if (candidate.layer == layer) entry = &candidate;
  }
  ASSIGN_OR_RETURN(PlaneTyping typing, TypingOf(*entry, kind));  // ResolvePlane found the layer
  const uint64_t element_bytes = LayoutOf(typing.element).block_bytes;
  const uint64_t head_dim =
      typing.head_dim != 0 ? typing.head_dim : plane.row_bytes / element_bytes;
  // The daemon's layout must agree with itself; a row that is not heads x head_dim elements
  // is a layout this client cannot type (an older daemon that sends no head geometry).
  if (typing.heads == 0 || head_dim == 0 ||
      typing.heads * head_dim * element_bytes != plane.row_bytes) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layer ", layer, " ", std::string(PlaneKindName(kind)), ": rows of ", plane.row_bytes,
        " bytes are not ", typing.heads, " heads x ", head_dim, " x ", element_bytes,
        "-byte elements (a daemon without head geometry in its layouts?)"));
  }
  TypedPlaneView view;
  view.data = plane.data;
  view.element = typing.element;
  view.element_bytes = element_bytes;
  view.shape = {plane.rows, typing.heads, head_dim};
  view.strides = {plane.row_bytes, head_dim * element_bytes, element_bytes};
  view.scale = std::move(typing.scale);
  return view;
}

absl::StatusOr<PlaneView> Session::Plane(uint32_t layer, PlaneKind kind) const {
  return ResolvePlane(layout_, arena_bases_, layer, kind);
}

absl::StatusOr<TypedPlaneView> Session::TypedPlane(uint32_t layer, PlaneKind kind) const {
  return ResolveTypedPlane(layout_, arena_bases_, layer, kind);
}

absl::StatusOr<uint8_t*> Session::PlanePointer(uint32_t layer, PlaneKind kind) const {
  ASSIGN_OR_RETURN(PlaneView view, Plane(layer, kind));
  return view.data;
}

namespace {

// Calls `method` of the KvCache stub with `request` and returns the reply's session state.
template <typename Request, typename Method>
absl::StatusOr<SessionSnapshot> StateCall(KvClient& client, Method method, const Request& request) {
  pb::SessionStateResponse response;
  RETURN_IF_ERROR(ClientInternals::SessionCallStatus(client, (ClientInternals::Cache(client).*method)(
      ClientInternals::NewContext(client).get(), request, &response)));
  return SessionSnapshotFromProto(response.state());
}

}  // namespace

absl::StatusOr<Transaction> Session::Begin() {
  pb::BeginResponse response;
  RETURN_IF_ERROR(ClientInternals::SessionCallStatus(*client_,
      ClientInternals::Cache(*client_).Begin(ClientInternals::NewContext(*client_).get(),
                                             ForSession<pb::SessionRequest>(*this), &response)));
  return Transaction{response.generation(), response.base_len()};
}

absl::StatusOr<PreparedAppend> Session::PrepareAppend(uint64_t generation, uint64_t rows) {
  pb::PrepareAppendRequest request = ForSession<pb::PrepareAppendRequest>(*this);
  request.set_generation(generation);
  request.set_rows(rows);
  pb::PrepareAppendResponse response;
  RETURN_IF_ERROR(ClientInternals::SessionCallStatus(*client_, ClientInternals::Cache(*client_).PrepareAppend(
      ClientInternals::NewContext(*client_).get(), request, &response)));
  return PreparedFromProto(response);
}

absl::StatusOr<uint64_t> Session::PublishAppend(uint64_t generation) {
  pb::GenerationRequest request = ForSession<pb::GenerationRequest>(*this);
  request.set_generation(generation);
  pb::PublishAppendResponse response;
  RETURN_IF_ERROR(ClientInternals::SessionCallStatus(*client_, ClientInternals::Cache(*client_).PublishAppend(
      ClientInternals::NewContext(*client_).get(), request, &response)));
  return response.staged_len();
}

absl::StatusOr<uint64_t> Session::Commit(uint64_t generation, uint64_t accepted_rows,
                                         absl::Span<const int32_t> token_ids) {
  pb::CommitRequest request = ForSession<pb::CommitRequest>(*this);
  request.set_generation(generation);
  request.set_accepted_rows(accepted_rows);
  request.mutable_token_ids()->Add(token_ids.begin(), token_ids.end());
  pb::CommitResponse response;
  RETURN_IF_ERROR(ClientInternals::SessionCallStatus(*client_, ClientInternals::Cache(*client_).Commit(
      ClientInternals::NewContext(*client_).get(), request, &response)));
  return response.committed_len();
}

absl::StatusOr<StepOutcome> Session::Advance(uint64_t generation, uint64_t accepted_rows,
                                             uint64_t next_rows,
                                             absl::Span<const int32_t> token_ids) {
  StepBatch batch;
  if (!wait_event_.empty()) batch.SetWaitEvent(wait_event_);
  batch.Advance(*this, generation, accepted_rows, next_rows, token_ids);
  std::vector<StepOutcome> outcomes;
  RETURN_IF_ERROR(client_->Step(batch, outcomes));
  RETURN_IF_ERROR(outcomes[0].status);
  return std::move(outcomes[0]);
}

absl::StatusOr<uint64_t> Session::Abort(uint64_t generation) {
  pb::GenerationRequest request = ForSession<pb::GenerationRequest>(*this);
  request.set_generation(generation);
  pb::AbortResponse response;
  RETURN_IF_ERROR(ClientInternals::SessionCallStatus(*client_, ClientInternals::Cache(*client_).Abort(
      ClientInternals::NewContext(*client_).get(), request, &response)));
  return response.committed_len();
}

absl::StatusOr<SessionSnapshot> Session::Rewind(uint64_t target) {
  pb::RewindRequest request = ForSession<pb::RewindRequest>(*this);
  request.set_target(target);
  return StateCall(*client_, &pb::KvCache::Stub::Rewind, request);
}

absl::StatusOr<SessionSnapshot> Session::Hydrate(uint64_t logical_len,
                                                 const std::vector<uint64_t>& resident_starts) {
  pb::HydrateRequest request = ForSession<pb::HydrateRequest>(*this);
  request.set_logical_len(logical_len);
  request.mutable_resident_starts()->Add(resident_starts.begin(), resident_starts.end());
  return StateCall(*client_, &pb::KvCache::Stub::Hydrate, request);
}

absl::StatusOr<bool> Session::CanRewind(uint64_t target) {
  pb::RewindRequest request = ForSession<pb::RewindRequest>(*this);
  request.set_target(target);
  pb::CanRewindResponse response;
  RETURN_IF_ERROR(ClientInternals::SessionCallStatus(*client_, ClientInternals::Cache(*client_).CanRewind(
      ClientInternals::NewContext(*client_).get(), request, &response)));
  return response.can_rewind();
}

absl::StatusOr<SessionSnapshot> Session::SpecSnapshot() {
  return StateCall(*client_, &pb::KvCache::Stub::SpecSnapshot,
                   ForSession<pb::SessionRequest>(*this));
}

absl::StatusOr<SessionSnapshot> Session::SpecRollback(uint64_t accept_len) {
  pb::SpecRollbackRequest request = ForSession<pb::SpecRollbackRequest>(*this);
  request.set_accept_len(accept_len);
  return StateCall(*client_, &pb::KvCache::Stub::SpecRollback, request);
}

absl::StatusOr<SessionSnapshot> Session::Reset() {
  return StateCall(*client_, &pb::KvCache::Stub::ResetSession,
                   ForSession<pb::SessionRequest>(*this));
}

absl::StatusOr<SessionSnapshot> Session::Taint(const std::string& reason) {
  pb::TaintRequest request = ForSession<pb::TaintRequest>(*this);
  request.set_reason(reason);
  return StateCall(*client_, &pb::KvCache::Stub::Taint, request);
}

absl::StatusOr<SessionSnapshot> Session::State() {
  return StateCall(*client_, &pb::KvCache::Stub::GetSessionState,
                   ForSession<pb::GetSessionStateRequest>(*this));
}

absl::StatusOr<SessionSnapshot> Session::Grow(uint64_t target_capacity) {
  pb::GrowRequest request = ForSession<pb::GrowRequest>(*this);
  request.set_target_capacity(target_capacity);
  pb::GrowResponse grown;
  RETURN_IF_ERROR(ClientInternals::SessionCallStatus(*client_, ClientInternals::Cache(*client_).Grow(
      ClientInternals::NewContext(*client_).get(), request, &grown)));
  SessionLayout old = layout_;
  ASSIGN_OR_RETURN(SessionLayout layout, SessionLayoutFromProto(grown.layout()));
  RETURN_IF_ERROR(Adopt(std::move(layout)));
  pb::AcknowledgeGrowRequest ack = ForSession<pb::AcknowledgeGrowRequest>(*this);
  ack.set_layout_version(layout_.version);
  ASSIGN_OR_RETURN(SessionSnapshot state,
                   StateCall(*client_, &pb::KvCache::Stub::AcknowledgeGrow, ack));
  UnmapAll(old);
  return state;
}

absl::StatusOr<uint64_t> Session::Release() {
  if (released_)
    return absl::FailedPreconditionError(absl::StrCat("session ", id(), " was released"));
  pb::ReleaseSessionResponse response;
  absl::Status status = ClientInternals::SessionCallStatus(*client_, ClientInternals::Cache(*client_).ReleaseSession(
      ClientInternals::NewContext(*client_).get(), ForSession<pb::SessionRequest>(*this),
      &response));
  // Whatever the daemon answered, this process stops using the memory; the mappings of arenas
  // the daemon pooled for this engine stay, for the next session that gets one back.
  released_ = true;
  for (const SessionArena& arena : layout_.arenas) {
    if (!status.ok() || std::find(response.pooled_handles().begin(),
                                  response.pooled_handles().end(),
                                  arena.handle) == response.pooled_handles().end()) {
      (void)client_->mapper().Unmap(arena.handle);
    }
  }
  arena_bases_.clear();
  RETURN_IF_ERROR(status);
  UnmapFreedPoolArenas(client_->mapper(), response.unmap_handles());
  return response.freed_bytes();
}


// ---- Block store ----

namespace {

void SetBlockKeys(const BlockStoreKeys& keys, pb::BlockKeys& out) {
  for (const std::string& hash : keys.hashes) out.add_hashes(hash);
  out.mutable_token_ids()->Add(keys.token_ids.begin(), keys.token_ids.end());
}

// The fields StoreBlocksRequest and LoadBlocksRequest share.
template <typename Request>
void SetTransfer(const std::pair<uint64_t, std::string>& engine, const BlockStoreCall& call,
                 Request& request) {
  SetEngine(engine, *request.mutable_engine());
  request.set_registration_id(call.registration_id);
  request.set_kv_group(call.kv_group);
  SetBlockKeys(call.keys, *request.mutable_keys());
  request.mutable_block_ids()->Add(call.block_ids.begin(), call.block_ids.end());
  request.set_skip_blocks(call.skip_blocks);
  if (!call.wait_event.empty()) request.mutable_ordering()->set_wait_event(call.wait_event);
}

BlockStoreTransfer TransferFromProto(const pb::TransferBlocksResponse& response) {
  BlockStoreTransfer out;
  for (const pb::BlockResult& block : response.blocks()) {
    const bool known = block.code() <= static_cast<uint32_t>(absl::StatusCode::kUnauthenticated);
    out.blocks.push_back(
        {.status = absl::Status(known ? static_cast<absl::StatusCode>(block.code())
                                      : absl::StatusCode::kUnknown,
                                block.message()),
         .already_present = block.already_present()});
  }
  out.copied_bytes = response.copied_bytes();
  out.completion_event = response.completion_event();
  return out;
}

}  // namespace

absl::StatusOr<uint64_t> KvClient::OfferPoolBuffer(int fd, uint64_t bytes) {
  std::shared_ptr<HandoffChannel> handoff;
  {
    absl::MutexLock lock(&mu_);
    handoff = handoff_;
  }
  if (handoff == nullptr) {
    return absl::FailedPreconditionError(
        "offering a pool buffer before Attach: it goes over the engine's handoff connection");
  }
  return handoff->OfferBuffer(fd, bytes);
}

absl::StatusOr<RegisteredPool> KvClient::RegisterPool(const BlockPoolSpec& spec,
                                                      absl::Span<const PoolBufferRef> buffers) {
  ASSIGN_OR_RETURN(auto engine, AttachedEngine("RegisterPool"));
  pb::RegisterEngineBuffersRequest request;
  SetEngine(engine, *request.mutable_engine());
  for (const PoolBufferRef& buffer : buffers) {
    pb::EngineBufferRef* out = request.add_buffers();
    if (buffer.cuda_ipc_handle.empty()) {
      out->set_handoff_buffer_id(buffer.handoff_buffer_id);
    } else {
      out->set_cuda_ipc_handle(buffer.cuda_ipc_handle);
    }
    out->set_bytes(buffer.bytes);
    out->set_offset_in_allocation(buffer.offset_in_allocation);
  }
  request.set_num_blocks(spec.num_blocks);
  request.set_tokens_per_block(spec.tokens_per_block);
  request.set_element_type(static_cast<pb::BlockElementType>(spec.element));
  request.set_order(static_cast<pb::BlockOrder>(spec.order));
  request.set_num_kv_heads(spec.num_kv_heads);
  request.set_head_dim(spec.head_dim);
  request.set_tp_rank(spec.tp_rank);
  request.set_tp_size(spec.tp_size);
  request.set_model(spec.model);
  for (const BlockTensorSpec& tensor : spec.tensors) {
    pb::BlockTensor* out = request.add_tensors();
    out->set_layer(tensor.layer);
    out->set_kind(static_cast<pb::BlockTensorKind>(tensor.role));
    out->set_kv_group(tensor.kv_group);
    out->set_buffer(tensor.buffer);
    out->set_offset(tensor.offset);
    out->set_block_stride(tensor.block_stride);
    out->set_block_bytes(tensor.block_bytes);
  }
  pb::RegisterEngineBuffersResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(rpc_->blocks->RegisterEngineBuffers(
      ClientInternals::NewContext(*this).get(), request, &response)));
  RegisteredPool pool;
  pool.registration_id = response.registration_id();
  for (const pb::KvGroupLayout& group : response.groups()) {
    RegisteredPoolGroup out;
    out.kv_group = group.kv_group();
    ASSIGN_OR_RETURN(out.layout_fingerprint, FingerprintFromBytes(group.layout_fingerprint()));
    out.block_bytes = group.block_bytes();
    out.state_bytes = group.state_bytes();
    pool.groups.push_back(out);
  }
  return pool;
}

absl::Status KvClient::UnregisterPool(uint64_t registration_id) {
  ASSIGN_OR_RETURN(auto engine, AttachedEngine("UnregisterPool"));
  pb::UnregisterEngineBuffersRequest request;
  SetEngine(engine, *request.mutable_engine());
  request.set_registration_id(registration_id);
  pb::UnregisterEngineBuffersResponse response;
  return FromGrpcStatus(rpc_->blocks->UnregisterEngineBuffers(
      ClientInternals::NewContext(*this).get(), request, &response));
}

absl::StatusOr<BlockStoreMatch> KvClient::LookupBlocks(const BlockStoreCall& call) {
  ASSIGN_OR_RETURN(auto engine, AttachedEngine("LookupBlocks"));
  pb::LookupBlocksRequest request;
  SetEngine(engine, *request.mutable_engine());
  request.set_registration_id(call.registration_id);
  request.set_kv_group(call.kv_group);
  SetBlockKeys(call.keys, *request.mutable_keys());
  request.set_pin_ttl_ms(call.pin_ttl_ms);
  pb::LookupBlocksResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(
      rpc_->blocks->LookupBlocks(ClientInternals::NewContext(*this).get(), request, &response)));
  return BlockStoreMatch{.matched_blocks = response.matched_blocks(),
                         .pin_id = response.pin_id(),
                         .medium = MediumFromProto(response.medium())};
}

absl::StatusOr<BlockStoreTransfer> KvClient::StoreBlocks(const BlockStoreCall& call) {
  ASSIGN_OR_RETURN(auto engine, AttachedEngine("StoreBlocks"));
  pb::StoreBlocksRequest request;
  SetTransfer(engine, call, request);
  request.set_parent_hash(call.parent_hash);
  request.mutable_event_token_ids()->Add(call.event_token_ids.begin(),
                                         call.event_token_ids.end());
  request.mutable_event_block_hashes()->Add(call.event_block_hashes.begin(),
                                            call.event_block_hashes.end());
  pb::TransferBlocksResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(
      rpc_->blocks->StoreBlocks(ClientInternals::NewContext(*this).get(), request, &response)));
  return TransferFromProto(response);
}

absl::StatusOr<BlockStoreTransfer> KvClient::LoadBlocks(const BlockStoreCall& call) {
  ASSIGN_OR_RETURN(auto engine, AttachedEngine("LoadBlocks"));
  pb::LoadBlocksRequest request;
  SetTransfer(engine, call, request);
  request.set_pin_id(call.pin_id);
  pb::TransferBlocksResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(
      rpc_->blocks->LoadBlocks(ClientInternals::NewContext(*this).get(), request, &response)));
  return TransferFromProto(response);
}

absl::Status KvClient::UnpinBlocks(uint64_t pin_id) {
  ASSIGN_OR_RETURN(auto engine, AttachedEngine("UnpinBlocks"));
  pb::UnpinBlocksRequest request;
  SetEngine(engine, *request.mutable_engine());
  request.set_pin_id(pin_id);
  pb::UnpinBlocksResponse response;
  return FromGrpcStatus(
      rpc_->blocks->UnpinBlocks(ClientInternals::NewContext(*this).get(), request, &response));
}

pb::KvBlockStore::Stub& ClientInternals::Blocks(KvClient& client) { return *client.rpc_->blocks; }

}  // namespace memra
