#include "client/connection.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/daemon_restart.h"
#include "common/grpc_status.h"
#include "core/status_macros.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace memra {

namespace pb = ::memra::kv::v1;

struct ClientConnection::LeaseStream {
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReaderWriter<pb::AttachRequest, pb::AttachResponse>> stream;
  bool finished = false;  // Finish() was called (it may be called once)
  pb::AttachRequest hello;
  pb::Attached attached;  // the daemon's answer to `hello`
};

absl::StatusOr<std::shared_ptr<ClientConnection>> ClientConnection::Connect(
    const std::string& socket_path, ClientOptions options) {
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
  return std::shared_ptr<ClientConnection>(
      new ClientConnection(std::move(options), std::move(channel)));
}

ClientConnection::ClientConnection(ClientOptions options, std::shared_ptr<grpc::Channel> channel)
    : options_(std::move(options)),
      channel_(std::move(channel)),
      cache_(pb::KvCache::NewStub(channel_)),
      admin_(pb::KvAdmin::NewStub(channel_)),
      prefix_(pb::KvPrefixCache::NewStub(channel_)),
      blocks_(pb::KvBlockStore::NewStub(channel_)) {}

ClientConnection::~ClientConnection() { Detach(); }

absl::StatusOr<std::shared_ptr<ClientConnection>> ClientConnection::Lock(
    const std::weak_ptr<ClientConnection>& connection, absl::string_view what) {
  std::shared_ptr<ClientConnection> locked = connection.lock();
  if (locked == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, " after its KvClient was destroyed: a view is valid while its KvClient lives"));
  }
  return locked;
}

std::unique_ptr<grpc::ClientContext> ClientConnection::NewContext() const {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() +
                        absl::ToChronoMilliseconds(options_.deadline));
  return context;
}

absl::StatusOr<pb::GetStatusResponse> ClientConnection::GetStatus() const {
  pb::GetStatusResponse response;
  RETURN_IF_ERROR(FromGrpcStatus(
      admin_->GetStatus(NewContext().get(), pb::GetStatusRequest(), &response)));
  return response;
}

absl::Status ClientConnection::OpenLease(LeaseStream& lease) {
  // The lease stream lives as long as the engine: no deadline (the heartbeats are its clock).
  lease.stream = cache_->Attach(&lease.context);
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

absl::Status ClientConnection::Attach(const std::string& engine_name) {
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

void ClientConnection::KeepLease() {
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

void ClientConnection::SendHeartbeats() {
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

bool ClientConnection::Reattach() {
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

absl::Status ClientConnection::lease_lost() const {
  absl::MutexLock lock(&mu_);
  return lease_lost_;
}

uint64_t ClientConnection::epoch() const {
  absl::MutexLock lock(&mu_);
  return epoch_;
}

absl::Status ClientConnection::Explain(absl::Status status) {
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
  absl::StatusOr<pb::GetStatusResponse> daemon = GetStatus();
  if (!daemon.ok() || daemon->epoch() == attached_epoch) return status;
  return DaemonRestartedError(
      DaemonRestart{attached_epoch, daemon->epoch()},
      absl::StrCat("this engine attached to epoch ", attached_epoch,
                   " and the daemon answering does not have it: ", status.message()));
}

void ClientConnection::Detach() {
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

std::pair<std::shared_ptr<StepChannelClient>, absl::Status> ClientConnection::OpenStepChannel(
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

void ClientConnection::AbandonStepChannel() {
  absl::MutexLock lock(&mu_);
  if (step_channel_ == nullptr) return;
  step_channel_->Abandon();
  step_channel_status_ = absl::UnavailableError(
      "the lease stream broke: the step channel was abandoned (a re-attach opens a new one)");
  step_channel_.reset();
}

bool ClientConnection::step_channel_active() const {
  absl::MutexLock lock(&mu_);  // broken() takes no lock: no wait for a Run in progress
  return step_channel_ != nullptr && !step_channel_->broken();
}

absl::Status ClientConnection::step_channel_status() const {
  absl::MutexLock lock(&mu_);
  return step_channel_status_;
}

absl::StatusOr<ArenaFd> ClientConnection::FetchArenaFd(uint64_t session_id,
                                                       absl::string_view session_token,
                                                       absl::string_view handle) const {
  std::shared_ptr<HandoffChannel> handoff = this->handoff();
  if (handoff == nullptr) {
    return absl::FailedPreconditionError(
        "mapping a host arena before Attach: its descriptor comes over the engine's handoff "
        "connection");
  }
  return handoff->FetchArena(handoff::ArenaRequest{.session_id = session_id,
                                                   .session_token = std::string(session_token),
                                                   .handle = std::string(handle)});
}

uint64_t ClientConnection::engine_id() const {
  absl::MutexLock lock(&mu_);
  return engine_id_;
}

std::string ClientConnection::cache_scope() const {
  absl::MutexLock lock(&mu_);
  return cache_scope_;
}

absl::Duration ClientConnection::lease_timeout() const {
  absl::MutexLock lock(&mu_);
  return lease_timeout_;
}

absl::StatusOr<pb::EngineRef> ClientConnection::AttachedEngine(absl::string_view what) const {
  absl::MutexLock lock(&mu_);
  if (lease_stream_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, " before Attach: sessions need a lease"));
  }
  pb::EngineRef ref;
  ref.set_engine_id(engine_id_);
  ref.set_engine_token(engine_token_);
  return ref;
}

std::optional<pb::EngineRef> ClientConnection::EngineIfAttached() const {
  absl::MutexLock lock(&mu_);
  if (lease_stream_ == nullptr) return std::nullopt;
  pb::EngineRef ref;
  ref.set_engine_id(engine_id_);
  ref.set_engine_token(engine_token_);
  return ref;
}

std::shared_ptr<HandoffChannel> ClientConnection::handoff() const {
  absl::MutexLock lock(&mu_);
  return handoff_;
}

std::shared_ptr<StepChannelClient> ClientConnection::step_channel() const {
  absl::MutexLock lock(&mu_);
  return step_channel_;
}

void ClientConnection::DropStepChannel(const std::shared_ptr<StepChannelClient>& channel,
                                       absl::Status status) {
  absl::MutexLock lock(&mu_);
  if (step_channel_ == channel) {
    step_channel_status_ = std::move(status);
    step_channel_.reset();
  }
}

}  // namespace memra
