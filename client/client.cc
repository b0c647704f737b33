#include "client/client.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/status_macros.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "common/codec.h"
#include "common/grpc_status.h"

namespace memra {
namespace {

namespace pb = ::memra::kv::v1;

// The session calls all follow one shape: fill a request with the session (and the engine's
// interprocess event, for calls that order device work), call, convert.
template <typename Request>
Request ForSession(const pb::SessionRef& ref, const std::string& wait_event) {
  Request request;
  *request.mutable_session() = ref;
  if constexpr (requires { request.mutable_ordering(); }) {
    if (!wait_event.empty()) request.mutable_ordering()->set_wait_event(wait_event);
  }
  return request;
}

bool NamesArena(const pb::SessionLayout& layout, const std::string& handle) {
  for (const pb::Arena& arena : layout.arenas()) {
    if (arena.handle() == handle) return true;
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

}  // namespace

// ---- KvClient ----

absl::StatusOr<std::unique_ptr<KvClient>> KvClient::Connect(const std::string& socket_path,
                                                            ClientOptions options) {
  if (options.mapper == nullptr) options.mapper = std::make_shared<HostArenaMapper>();
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateChannel(absl::StrCat("unix:", socket_path), grpc::InsecureChannelCredentials());
  const auto deadline =
      std::chrono::system_clock::now() + absl::ToChronoMilliseconds(options.deadline);
  if (!channel->WaitForConnected(deadline)) {
    return absl::UnavailableError(absl::StrCat("memra-kvd is not answering on unix:", socket_path,
                                               " within ", absl::FormatDuration(options.deadline)));
  }
  return std::unique_ptr<KvClient>(new KvClient(std::move(options), std::move(channel)));
}

KvClient::KvClient(ClientOptions options, std::shared_ptr<grpc::Channel> channel)
    : options_(std::move(options)),
      channel_(std::move(channel)),
      cache_(pb::KvCache::NewStub(channel_)),
      admin_(pb::KvAdmin::NewStub(channel_)) {}

KvClient::~KvClient() { Detach(); }

std::unique_ptr<grpc::ClientContext> KvClient::NewContext() const {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() +
                        absl::ToChronoMilliseconds(options_.deadline));
  return context;
}

absl::Status KvClient::Attach(const std::string& engine_name) {
  absl::MutexLock lock(&mu_);
  if (attach_stream_ != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("already attached as engine ", engine_.engine_id()));
  }
  // The lease stream lives as long as the engine: no deadline (the heartbeats are its clock).
  attach_context_ = std::make_unique<grpc::ClientContext>();
  attach_stream_ = cache_->Attach(attach_context_.get());
  pb::AttachRequest hello;
  hello.mutable_hello()->set_engine_name(engine_name);
  hello.mutable_hello()->set_pid(getpid());
  pb::AttachResponse response;
  const bool answered = attach_stream_->Write(hello) && attach_stream_->Read(&response);
  if (!answered || !response.has_attached()) {
    // Not answered: the stream is over and Finish() has the daemon's reason. Answered wrongly:
    // end it ourselves so Finish() does not wait.
    if (answered) attach_context_->TryCancel();
    absl::Status status = FromGrpcStatus(attach_stream_->Finish());
    attach_stream_.reset();
    attach_context_.reset();
    if (status.ok()) status = absl::InternalError("Attach ended without an answer");
    return status;
  }
  engine_ = response.attached().engine();
  lease_timeout_ = absl::Milliseconds(response.attached().lease_timeout_ms());
  stop_ = false;
  lease_alive_.store(true);
  const absl::Duration period = std::max(lease_timeout_ / 3, absl::Milliseconds(1));
  lease_thread_ = std::thread([this, period] { KeepLease(period); });
  return absl::OkStatus();
}

void KvClient::KeepLease(absl::Duration period) {
  grpc::ClientReaderWriter<pb::AttachRequest, pb::AttachResponse>* stream;
  {
    absl::MutexLock lock(&mu_);
    stream = attach_stream_.get();
  }
  pb::AttachRequest heartbeat;
  pb::AttachResponse ack;
  for (uint64_t sequence = 1;; ++sequence) {
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stop_), period)) break;
    }
    heartbeat.mutable_heartbeat()->set_sequence(sequence);
    // Only this thread reads and writes the stream after Attach() returned.
    if (!stream->Write(heartbeat) || !stream->Read(&ack)) break;
  }
  lease_alive_.store(false);
}

void KvClient::Detach() {
  std::thread thread;
  {
    absl::MutexLock lock(&mu_);
    if (attach_stream_ == nullptr) return;
    stop_ = true;
    attach_context_->TryCancel();  // unblocks a Read waiting for an ack
    thread = std::move(lease_thread_);
  }
  if (thread.joinable()) thread.join();
  absl::MutexLock lock(&mu_);
  (void)attach_stream_->Finish();
  attach_stream_.reset();
  attach_context_.reset();
  lease_alive_.store(false);
}

uint64_t KvClient::engine_id() const {
  absl::MutexLock lock(&mu_);
  return engine_.engine_id();
}

absl::Duration KvClient::lease_timeout() const {
  absl::MutexLock lock(&mu_);
  return lease_timeout_;
}

absl::StatusOr<PlanFingerprint> KvClient::RegisterPlan(const ModelPlan& plan) {
  pb::RegisterPlanRequest request;
  *request.mutable_plan() = ModelPlanToProto(plan);
  pb::RegisterPlanResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(cache_->RegisterPlan(NewContext().get(), request, &response)));
  return FingerprintFromBytes(response.fingerprint());
}

absl::StatusOr<pb::EngineRef> KvClient::AttachedEngine(absl::string_view what) const {
  absl::MutexLock lock(&mu_);
  if (attach_stream_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, " before Attach: sessions need a lease"));
  }
  return engine_;
}

namespace {

// The shape fields CreateSession and Reserve share.
template <typename Request>
void SetShape(const PlanFingerprint& plan, const SessionOptions& options, Request& request) {
  request.set_plan_fingerprint(FingerprintToBytes(plan));
  request.set_capacity(options.capacity);
  request.set_layer_lo(options.layer_lo);
  if (options.layer_hi.has_value()) request.set_layer_hi(*options.layer_hi);
  request.set_tp_ranks(options.tp_ranks);
  request.set_spec_snapshot(options.spec_snapshot);
}

}  // namespace

absl::StatusOr<SessionReservation> KvClient::Reserve(const PlanFingerprint& plan,
                                              const SessionOptions& options) {
  pb::ReserveRequest request;
  ASSIGN_OR_RETURN(*request.mutable_engine(), AttachedEngine("Reserve"));
  SetShape(plan, options, request);
  pb::ReserveResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(cache_->Reserve(NewContext().get(), request, &response)));
  return SessionReservation{response.reservation_id(), response.bytes(),
                     absl::Milliseconds(response.ttl_ms())};
}

absl::StatusOr<uint64_t> KvClient::CancelReservation(uint64_t reservation_id) {
  pb::CancelReservationRequest request;
  ASSIGN_OR_RETURN(*request.mutable_engine(), AttachedEngine("CancelReservation"));
  request.set_reservation_id(reservation_id);
  pb::CancelReservationResponse response;
  RETURN_IF_ERROR(
      FromGrpcStatus(cache_->CancelReservation(NewContext().get(), request, &response)));
  return response.freed_bytes();
}

absl::StatusOr<std::unique_ptr<Session>> KvClient::CreateSession(const PlanFingerprint& plan,
                                                                 const SessionOptions& options) {
  pb::CreateSessionRequest request;
  ASSIGN_OR_RETURN(*request.mutable_engine(), AttachedEngine("CreateSession"));
  SetShape(plan, options, request);
  request.set_reservation_id(options.reservation_id);
  pb::CreateSessionResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(cache_->CreateSession(NewContext().get(), request, &response)));
  std::unique_ptr<Session> session(new Session(this, response.session()));
  absl::Status mapped = session->Adopt(std::move(*response.mutable_layout()));
  if (!mapped.ok()) {
    (void)session->Release();  // never leave the daemon holding a session nobody can use
    return mapped;
  }
  return session;
}

absl::Status KvClient::Step(StepBatch& batch, std::vector<StepOutcome>& outcomes) {
  pb::StepResponse* response = batch.NewReply();
  absl::Status status = FromGrpcStatus(cache_->Step(NewContext().get(), batch.request(), response));
  if (status.ok() && response->results_size() != batch.request().entries_size()) {
    status = absl::InternalError(absl::StrCat("Step answered ", response->results_size(),
                                              " results for ", batch.request().entries_size(),
                                              " entries"));
  }
  if (!status.ok()) {
    batch.RecycleReply();
    return status;
  }
  outcomes.resize(response->results_size());
  for (int i = 0; i < response->results_size(); ++i) {
    const pb::StepResult& result = response->results(i);
    StepOutcome& out = outcomes[i];
    out.status = result.code() == 0
                     ? absl::OkStatus()
                     : absl::Status(static_cast<absl::StatusCode>(result.code()), result.message());
    out.begun = {};
    out.staged_len = 0;
    out.committed_len = 0;
    if (result.payload_case() != pb::StepResult::kPrepare) out.prepared.reset();
    switch (result.payload_case()) {
      case pb::StepResult::kBegin:
        out.begun = {result.begin().generation(), result.begin().base_len()};
        break;
      case pb::StepResult::kPrepare: {
        // Reuses the previous step's per-layer vector when this slot held a Prepare too.
        PreparedAppend& prepared = out.prepared.has_value() ? *out.prepared : out.prepared.emplace();
        PreparedFromProto(result.prepare(), prepared);
        break;
      }
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
  batch.RecycleReply();
  return absl::OkStatus();
}

absl::StatusOr<std::vector<StepOutcome>> KvClient::Step(StepBatch& batch) {
  std::vector<StepOutcome> outcomes;
  RETURN_IF_ERROR(Step(batch, outcomes));
  return outcomes;
}

absl::StatusOr<pb::GetStatusResponse> KvClient::GetStatus() {
  pb::GetStatusResponse response;
  RETURN_IF_ERROR(
      FromGrpcStatus(admin_->GetStatus(NewContext().get(), pb::GetStatusRequest(), &response)));
  return response;
}

// ---- StepBatch ----

pb::StepResponse* StepBatch::NewReply() {
  if (reply_arena_ == nullptr) {
    google::protobuf::ArenaOptions options;
    if (!reply_block_.empty()) {
      options.initial_block = reply_block_.data();
      options.initial_block_size = reply_block_.size();
    }
    reply_arena_ = std::make_unique<google::protobuf::Arena>(options);
  }
  return google::protobuf::Arena::CreateMessage<pb::StepResponse>(reply_arena_.get());
}

void StepBatch::RecycleReply() {
  // A reply that outgrew the block: the next arena starts with one twice its size (bounded by
  // what replies really use), and this one is freed. Otherwise Reset keeps the block.
  constexpr size_t kMaxBlockBytes = size_t{64} << 20;
  const size_t used = static_cast<size_t>(reply_arena_->SpaceAllocated());
  if (used > reply_block_.size() && reply_block_.size() < kMaxBlockBytes) {
    reply_arena_.reset();
    reply_block_.assign(std::min(2 * used, kMaxBlockBytes), 0);
    return;
  }
  reply_arena_->Reset();
}

pb::StepEntry* StepBatch::Add(const Session& session) {
  pb::StepEntry* entry = request_.add_entries();
  *entry->mutable_session() = session.ref();
  return entry;
}

void StepBatch::Begin(const Session& session) { Add(session)->mutable_begin(); }

void StepBatch::Prepare(const Session& session, uint64_t generation, uint64_t rows) {
  pb::StepPrepare* op = Add(session)->mutable_prepare();
  op->set_generation(generation);
  op->set_rows(rows);
}

void StepBatch::Publish(const Session& session, uint64_t generation) {
  Add(session)->mutable_publish()->set_generation(generation);
}

void StepBatch::Commit(const Session& session, uint64_t generation, uint64_t accepted_rows,
                       absl::Span<const int32_t> token_ids) {
  pb::StepCommit* op = Add(session)->mutable_commit();
  op->set_generation(generation);
  op->set_accepted_rows(accepted_rows);
  op->mutable_token_ids()->Add(token_ids.begin(), token_ids.end());
}

void StepBatch::Abort(const Session& session, uint64_t generation) {
  Add(session)->mutable_abort()->set_generation(generation);
}

// ---- Session ----

Session::~Session() {
  if (!released_) (void)Release();
}

absl::Status Session::Adopt(pb::SessionLayout layout) {
  std::vector<uint8_t*> bases;
  bases.reserve(layout.arenas_size());
  for (int i = 0; i < layout.arenas_size(); ++i) {
    const pb::Arena& arena = layout.arenas(i);
    absl::StatusOr<void*> base =
        client_->mapper().Map(arena.backend(), arena.handle(), arena.bytes());
    if (!base.ok()) {
      // Leave nothing mapped that no layout names (arenas already ours stay mapped).
      for (int j = 0; j < i; ++j) {
        if (!NamesArena(layout_, layout.arenas(j).handle())) {
          (void)client_->mapper().Unmap(layout.arenas(j).handle());
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

void Session::UnmapAll(const pb::SessionLayout& layout) {
  for (const pb::Arena& arena : layout.arenas()) (void)client_->mapper().Unmap(arena.handle());
}

absl::StatusOr<PlaneView> ResolvePlane(const pb::SessionLayout& layout,
                                       const std::vector<uint8_t*>& bases, uint32_t layer,
                                       PlaneKind kind) {
  const pb::PlaneKind wanted = PlaneKindToProto(kind);
  for (const pb::LayerLayout& entry : layout.layers()) {
    if (entry.layer() != layer) continue;
    for (const pb::Plane& plane : entry.planes()) {
      if (plane.kind() != wanted) continue;
      if (plane.arena() >= bases.size()) {
        return absl::InternalError(absl::StrCat("plane of layer ", layer, " names arena ",
                                                plane.arena(), " of ", bases.size()));
      }
      return PlaneView{bases[plane.arena()] + plane.offset(), plane.bytes(), plane.rows(),
                       plane.row_bytes()};
    }
  }
  return absl::NotFoundError(
      absl::StrCat("layer ", layer, " has no ", std::string(PlaneKindName(kind)), " plane"));
}

absl::StatusOr<PlaneView> Session::Plane(uint32_t layer, PlaneKind kind) const {
  return ResolvePlane(layout_, arena_bases_, layer, kind);
}

absl::StatusOr<uint8_t*> Session::PlanePointer(uint32_t layer, PlaneKind kind) const {
  ASSIGN_OR_RETURN(PlaneView view, Plane(layer, kind));
  return view.data;
}

absl::StatusOr<Transaction> Session::Begin() {
  pb::BeginResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(client_->cache_->Begin(
      client_->NewContext().get(), ForSession<pb::SessionRequest>(ref_, wait_event_), &response)));
  return Transaction{response.generation(), response.base_len()};
}

absl::StatusOr<PreparedAppend> Session::PrepareAppend(uint64_t generation, uint64_t rows) {
  pb::PrepareAppendRequest request = ForSession<pb::PrepareAppendRequest>(ref_, wait_event_);
  request.set_generation(generation);
  request.set_rows(rows);
  pb::PrepareAppendResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(
      client_->cache_->PrepareAppend(client_->NewContext().get(), request, &response)));
  return PreparedFromProto(response);
}

absl::StatusOr<uint64_t> Session::PublishAppend(uint64_t generation) {
  pb::GenerationRequest request = ForSession<pb::GenerationRequest>(ref_, wait_event_);
  request.set_generation(generation);
  pb::PublishAppendResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(
      client_->cache_->PublishAppend(client_->NewContext().get(), request, &response)));
  return response.staged_len();
}

absl::StatusOr<uint64_t> Session::Commit(uint64_t generation, uint64_t accepted_rows,
                                         absl::Span<const int32_t> token_ids) {
  pb::CommitRequest request = ForSession<pb::CommitRequest>(ref_, wait_event_);
  request.set_generation(generation);
  request.set_accepted_rows(accepted_rows);
  request.mutable_token_ids()->Add(token_ids.begin(), token_ids.end());
  pb::CommitResponse response;
  RETURN_IF_ERROR(
      FromGrpcStatus(client_->cache_->Commit(client_->NewContext().get(), request, &response)));
  return response.committed_len();
}

absl::StatusOr<uint64_t> Session::Abort(uint64_t generation) {
  pb::GenerationRequest request = ForSession<pb::GenerationRequest>(ref_, wait_event_);
  request.set_generation(generation);
  pb::AbortResponse response;
  RETURN_IF_ERROR(
      FromGrpcStatus(client_->cache_->Abort(client_->NewContext().get(), request, &response)));
  return response.committed_len();
}

absl::StatusOr<pb::SessionState> Session::Rewind(uint64_t target) {
  pb::RewindRequest request = ForSession<pb::RewindRequest>(ref_, wait_event_);
  request.set_target(target);
  pb::SessionStateResponse response;
  RETURN_IF_ERROR(
      FromGrpcStatus(client_->cache_->Rewind(client_->NewContext().get(), request, &response)));
  return response.state();
}

absl::StatusOr<pb::SessionState> Session::Hydrate(uint64_t logical_len,
                                                  const std::vector<uint64_t>& resident_starts) {
  pb::HydrateRequest request = ForSession<pb::HydrateRequest>(ref_, wait_event_);
  request.set_logical_len(logical_len);
  request.mutable_resident_starts()->Add(resident_starts.begin(), resident_starts.end());
  pb::SessionStateResponse response;
  RETURN_IF_ERROR(
      FromGrpcStatus(client_->cache_->Hydrate(client_->NewContext().get(), request, &response)));
  return response.state();
}

absl::StatusOr<bool> Session::CanRewind(uint64_t target) {
  pb::RewindRequest request = ForSession<pb::RewindRequest>(ref_, wait_event_);
  request.set_target(target);
  pb::CanRewindResponse response;
  RETURN_IF_ERROR(
      FromGrpcStatus(client_->cache_->CanRewind(client_->NewContext().get(), request, &response)));
  return response.can_rewind();
}

absl::StatusOr<pb::SessionState> Session::SpecSnapshot() {
  pb::SessionStateResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(client_->cache_->SpecSnapshot(
      client_->NewContext().get(), ForSession<pb::SessionRequest>(ref_, wait_event_), &response)));
  return response.state();
}

absl::StatusOr<pb::SessionState> Session::SpecRollback(uint64_t accept_len) {
  pb::SpecRollbackRequest request = ForSession<pb::SpecRollbackRequest>(ref_, wait_event_);
  request.set_accept_len(accept_len);
  pb::SessionStateResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(
      client_->cache_->SpecRollback(client_->NewContext().get(), request, &response)));
  return response.state();
}

absl::StatusOr<pb::SessionState> Session::Reset() {
  pb::SessionStateResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(client_->cache_->ResetSession(
      client_->NewContext().get(), ForSession<pb::SessionRequest>(ref_, wait_event_), &response)));
  return response.state();
}

absl::StatusOr<pb::SessionState> Session::Taint(const std::string& reason) {
  pb::TaintRequest request = ForSession<pb::TaintRequest>(ref_, wait_event_);
  request.set_reason(reason);
  pb::SessionStateResponse response;
  RETURN_IF_ERROR(
      FromGrpcStatus(client_->cache_->Taint(client_->NewContext().get(), request, &response)));
  return response.state();
}

absl::StatusOr<pb::SessionState> Session::State() {
  pb::SessionStateResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(client_->cache_->GetSessionState(
      client_->NewContext().get(), ForSession<pb::GetSessionStateRequest>(ref_, wait_event_), &response)));
  return response.state();
}

absl::StatusOr<pb::SessionState> Session::Grow(uint64_t target_capacity) {
  pb::GrowRequest request = ForSession<pb::GrowRequest>(ref_, wait_event_);
  request.set_target_capacity(target_capacity);
  pb::GrowResponse grown;
  RETURN_IF_ERROR(
      FromGrpcStatus(client_->cache_->Grow(client_->NewContext().get(), request, &grown)));
  pb::SessionLayout old = layout_;
  RETURN_IF_ERROR(Adopt(std::move(*grown.mutable_layout())));
  pb::AcknowledgeGrowRequest ack = ForSession<pb::AcknowledgeGrowRequest>(ref_, wait_event_);
  ack.set_layout_version(layout_.layout_version());
  pb::SessionStateResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(
      client_->cache_->AcknowledgeGrow(client_->NewContext().get(), ack, &response)));
  UnmapAll(old);
  return response.state();
}

absl::StatusOr<uint64_t> Session::Release() {
  if (released_)
    return absl::FailedPreconditionError(absl::StrCat("session ", id(), " was released"));
  pb::ReleaseSessionResponse response;
  absl::Status status = FromGrpcStatus(client_->cache_->ReleaseSession(
      client_->NewContext().get(), ForSession<pb::SessionRequest>(ref_, wait_event_), &response));
  // Whatever the daemon answered, this process stops using the memory.
  released_ = true;
  UnmapAll(layout_);
  arena_bases_.clear();
  RETURN_IF_ERROR(status);
  return response.freed_bytes();
}

}  // namespace memra
