#include "client/client.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "client/block_store_client.h"
#include "client/connection.h"
#include "client/internal.h"
#include "client/prefix_client.h"
#include "client/step_channel_client.h"
#include "common/step_channel.h"
#include "common/codec.h"
#include "common/grpc_status.h"
#include "core/status_macros.h"
#include "google/protobuf/arena.h"

namespace memra {
namespace {

namespace pb = ::memra::kv::v1;

bool NamesArena(const SessionLayout& layout, const std::string& handle) {
  for (const SessionArena& arena : layout.arenas) {
    if (arena.handle == handle) return true;
  }
  return false;
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
  ASSIGN_OR_RETURN(std::shared_ptr<ClientConnection> connection,
                   ClientConnection::Connect(socket_path, std::move(options)));
  return std::unique_ptr<KvClient>(new KvClient(std::move(connection)));
}

KvClient::KvClient(std::shared_ptr<ClientConnection> connection)
    : connection_(std::move(connection)) {}

// Ends the lease now; a view's call still in flight keeps the channel until it returns.
KvClient::~KvClient() { Detach(); }

absl::Status KvClient::Attach(const std::string& engine_name) {
  return connection_->Attach(engine_name);
}
void KvClient::Detach() { connection_->Detach(); }
bool KvClient::lease_alive() const { return connection_->lease_alive(); }
absl::Status KvClient::lease_lost() const { return connection_->lease_lost(); }
uint64_t KvClient::reattaches() const { return connection_->reattaches(); }
uint64_t KvClient::engine_id() const { return connection_->engine_id(); }
uint64_t KvClient::epoch() const { return connection_->epoch(); }
absl::Duration KvClient::lease_timeout() const { return connection_->lease_timeout(); }
std::string KvClient::cache_scope() const { return connection_->cache_scope(); }
ArenaMapper& KvClient::mapper() { return connection_->mapper(); }
bool KvClient::step_channel_active() const { return connection_->step_channel_active(); }
absl::Status KvClient::step_channel_status() const { return connection_->step_channel_status(); }
PrefixClient KvClient::prefixes() const { return PrefixClient(connection_); }
BlockStoreClient KvClient::block_store() const { return BlockStoreClient(connection_); }

absl::StatusOr<PlanFingerprint> KvClient::RegisterPlan(const ModelPlan& plan) {
  ASSIGN_OR_RETURN(pb::EngineRef engine, connection_->AttachedEngine("RegisterPlan"));
  pb::RegisterPlanRequest request;
  *request.mutable_engine() = std::move(engine);
  *request.mutable_plan() = ModelPlanToProto(plan);
  pb::RegisterPlanResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(
      connection_->cache().RegisterPlan(connection_->NewContext().get(), request, &response)));
  return FingerprintFromBytes(response.fingerprint());
}

absl::StatusOr<SessionReservation> KvClient::Reserve(const PlanFingerprint& plan,
                                              const SessionOptions& options) {
  pb::ReserveRequest request;
  ASSIGN_OR_RETURN(pb::EngineRef engine, connection_->AttachedEngine("Reserve"));
  *request.mutable_engine() = std::move(engine);
  SetSessionShape(plan, options, request);
  pb::ReserveResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(
      connection_->cache().Reserve(connection_->NewContext().get(), request, &response)));
  return SessionReservation{response.reservation_id(), response.bytes(),
                     absl::Milliseconds(response.ttl_ms())};
}

absl::StatusOr<uint64_t> KvClient::CancelReservation(uint64_t reservation_id) {
  pb::CancelReservationRequest request;
  ASSIGN_OR_RETURN(pb::EngineRef engine, connection_->AttachedEngine("CancelReservation"));
  *request.mutable_engine() = std::move(engine);
  request.set_reservation_id(reservation_id);
  pb::CancelReservationResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(connection_->cache().CancelReservation(
      connection_->NewContext().get(), request, &response)));
  return response.freed_bytes();
}

absl::StatusOr<std::unique_ptr<Session>> KvClient::CreateSession(const PlanFingerprint& plan,
                                                                 const SessionOptions& options) {
  pb::CreateSessionRequest request;
  ASSIGN_OR_RETURN(pb::EngineRef engine, connection_->AttachedEngine("CreateSession"));
  *request.mutable_engine() = std::move(engine);
  SetSessionShape(plan, options, request);
  request.set_reservation_id(options.reservation_id);
  pb::CreateSessionResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(
      connection_->cache().CreateSession(connection_->NewContext().get(), request, &response)));
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
    ASSIGN_OR_RETURN(pb::EngineRef engine, connection_->AttachedEngine("Step by slot"));
    *batch.wire_->request.mutable_engine() = std::move(engine);
  }
  pb::StepResponse* response = batch.wire_->NewReply();
  const pb::StepRequest& request = batch.wire_->request;
  std::shared_ptr<StepChannelClient> channel;
  if (batch.ChannelEligible()) channel = connection_->step_channel();
  // nullopt: no channel, or one broken before this step could start (nothing submitted).
  std::optional<absl::Status> over_channel;
  if (channel != nullptr) {
    over_channel = channel->Run(request, response, connection_->options().deadline);
  }
  absl::Status status =
      over_channel.has_value()
          ? *std::move(over_channel)
          : FromGrpcStatus(
                connection_->cache().Step(connection_->NewContext().get(), request, response));
  if (!status.ok() && channel != nullptr) connection_->DropStepChannel(channel, status);
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
      out.status = connection_->Explain(std::move(out.status));
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

// ---- ClientInternals ----

pb::KvCache::Stub& ClientInternals::Cache(KvClient& client) { return client.connection_->cache(); }
pb::KvAdmin::Stub& ClientInternals::Admin(KvClient& client) { return client.connection_->admin(); }
pb::KvPrefixCache::Stub& ClientInternals::Prefix(KvClient& client) {
  return client.connection_->prefix();
}
pb::KvBlockStore::Stub& ClientInternals::Blocks(KvClient& client) {
  return client.connection_->blocks();
}

std::unique_ptr<grpc::ClientContext> ClientInternals::NewContext(const KvClient& client) {
  return client.connection_->NewContext();
}

absl::StatusOr<pb::EngineRef> ClientInternals::Engine(const KvClient& client) {
  return client.connection_->AttachedEngine("ClientInternals::Engine");
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
  return client.connection_->Explain(FromGrpcStatus(status));
}

absl::StatusOr<pb::GetStatusResponse> ClientInternals::GetStatus(KvClient& client) {
  return client.connection_->GetStatus();
}

absl::StatusOr<ArenaFd> ClientInternals::FetchArenaFd(KvClient& client, uint64_t session_id,
                                                      absl::string_view session_token,
                                                      absl::string_view handle) {
  return client.connection_->FetchArenaFd(session_id, session_token, handle);
}

int ClientInternals::HandoffSocket(KvClient& client) {
  std::shared_ptr<HandoffChannel> handoff = client.connection_->handoff();
  return handoff == nullptr ? -1 : handoff->socket_.get();
}

std::shared_ptr<StepChannelClient> ClientInternals::StepChannel(KvClient& client) {
  return client.connection_->step_channel();
}

absl::StatusOr<handoff::StepChannelFds> ClientInternals::OpenAnotherStepChannel(
    KvClient& client) {
  std::shared_ptr<HandoffChannel> handoff = client.connection_->handoff();
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
          return ClientInternals::FetchArenaFd(*client_, id_, token_, arena.handle);
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

}  // namespace memra
