#include "server/daemon.h"

#include <grp.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "proto/memra/kv/v1/admin.grpc.pb.h"
#include "proto/memra/kv/v1/cache.grpc.pb.h"
#include "common/codec.h"
#include "common/errors.h"
#include "common/grpc_status.h"
#include "spdlog/spdlog.h"

namespace memra {
namespace {

namespace pb = ::memra::kv::v1;

constexpr size_t kTokenBytes = 16;
// Bounds on what one client can make the daemon hold or do in one call.
constexpr size_t kMaxPlans = 1024;
constexpr int kMaxStepEntries = 65536;

absl::StatusOr<std::string> RandomToken() {
  std::string token(kTokenBytes, '\0');
  size_t filled = 0;
  while (filled < token.size()) {
    ssize_t got = getrandom(token.data() + filled, token.size() - filled, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      return PosixError("getrandom", errno);
    }
    filled += static_cast<size_t>(got);
  }
  return token;
}

// The one place the daemon turns an absl::Status into its reply, logging every refusal once.
grpc::Status Reply(absl::string_view rpc, const absl::Status& status) {
  if (!status.ok()) {
    if (status.code() == absl::StatusCode::kInternal) {
      spdlog::error("{} failed: {}", std::string(rpc), status.ToString());
    } else {
      spdlog::info("{} refused: {}", std::string(rpc), status.ToString());
    }
  }
  return ToGrpcStatus(status);
}

// A stale socket file (no daemon answers on it) is removed; a live one is refused.
absl::Status PrepareSocketPath(const std::string& path) {
  struct stat st;
  const std::string directory = path.substr(0, path.find_last_of('/'));
  if (!directory.empty() && stat(directory.c_str(), &st) != 0) {
    return absl::FailedPreconditionError(absl::StrCat("the socket's directory ", directory,
                                                      " is not there (", strerror(errno),
                                                      "); create it or pass --socket_path"));
  }
  if (lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return PosixError(absl::StrCat("stat ", path), errno);
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("socket_path ", path, " exists and is not a socket"));
  }
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (path.size() >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("socket_path ", path, " is ", path.size(),
                                                   " bytes; the limit is ",
                                                   sizeof(address.sun_path) - 1));
  }
  std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return PosixError("socket", errno);
  const int connected = connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
  const int connect_errno = errno;
  close(fd);
  if (connected == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("another daemon is serving on ", path, "; refusing to take its socket"));
  }
  if (connect_errno != ECONNREFUSED) {
    return PosixError(absl::StrCat("probing the existing socket ", path), connect_errno);
  }
  spdlog::warn("removing stale socket {}", path);
  if (unlink(path.c_str()) != 0) return PosixError(absl::StrCat("unlink ", path), errno);
  return absl::OkStatus();
}

absl::Status ApplySocketPermissions(const DaemonConfig& config, const std::string& path) {
  if (!config.socket_group.empty()) {
    group* entry = getgrnam(config.socket_group.c_str());
    if (entry == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("socket_group ", config.socket_group, " does not exist"));
    }
    if (chown(path.c_str(), static_cast<uid_t>(-1), entry->gr_gid) != 0) {
      return PosixError(absl::StrCat("chown ", path, " to group ", config.socket_group), errno);
    }
  }
  if (chmod(path.c_str(), static_cast<mode_t>(config.socket_mode)) != 0) {
    return PosixError(absl::StrCat("chmod ", path), errno);
  }
  return absl::OkStatus();
}

void SetResultStatus(const absl::Status& status, pb::StepResult* result) {
  result->set_code(static_cast<int32_t>(status.code()));
  result->set_message(std::string(status.message()));
}

}  // namespace

// ---- gRPC services: decode, call the daemon, encode. No rules here. ----

class Daemon::CacheService final : public pb::KvCache::Service {
 public:
  explicit CacheService(Daemon* daemon) : daemon_(daemon) {}

  grpc::Status Attach(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<pb::AttachResponse, pb::AttachRequest>* stream) override {
    pb::AttachRequest request;
    if (!stream->Read(&request)) return grpc::Status::CANCELLED;
    if (!request.has_hello()) {
      return Reply("Attach",
                   absl::InvalidArgumentError("the first Attach message must be a hello"));
    }
    absl::StatusOr<pb::Attached> attached = daemon_->BeginLease(request.hello(), context);
    if (!attached.ok()) return Reply("Attach", attached.status());
    const EngineId engine{attached->engine().engine_id()};
    pb::AttachResponse response;
    *response.mutable_attached() = *attached;
    bool open = stream->Write(response);
    absl::Status status;
    while (open && stream->Read(&request)) {
      if (!request.has_heartbeat()) {
        status = absl::InvalidArgumentError("after the hello, Attach carries only heartbeats");
        break;
      }
      status = daemon_->Heartbeat(engine);
      if (!status.ok()) break;
      response.Clear();
      response.mutable_ack()->set_sequence(request.heartbeat().sequence());
      open = stream->Write(response);
    }
    daemon_->EndStream(engine);
    return Reply("Attach", status);
  }

  grpc::Status RegisterPlan(grpc::ServerContext*, const pb::RegisterPlanRequest* request,
                            pb::RegisterPlanResponse* response) override {
    absl::StatusOr<std::string> fingerprint = daemon_->RegisterPlan(request->plan());
    if (fingerprint.ok()) response->set_fingerprint(*fingerprint);
    return Reply("RegisterPlan", fingerprint.status());
  }

  grpc::Status CreateSession(grpc::ServerContext*, const pb::CreateSessionRequest* request,
                             pb::CreateSessionResponse* response) override {
    return Reply("CreateSession", daemon_->CreateSession(*request, response));
  }

  grpc::Status ReleaseSession(grpc::ServerContext*, const pb::SessionRequest* request,
                              pb::ReleaseSessionResponse* response) override {
    absl::StatusOr<uint64_t> freed = daemon_->ReleaseSession(request->session());
    if (freed.ok()) response->set_freed_bytes(*freed);
    return Reply("ReleaseSession", freed.status());
  }

  grpc::Status ResetSession(grpc::ServerContext*, const pb::SessionRequest* request,
                            pb::SessionStateResponse* response) override {
    return OnSession("ResetSession", request->session(), response,
                     [](DaemonSession& session) { return session.Reset(); });
  }

  grpc::Status GetSessionState(grpc::ServerContext*, const pb::GetSessionStateRequest* request,
                               pb::SessionStateResponse* response) override {
    absl::StatusOr<std::shared_ptr<DaemonSession>> session =
        daemon_->FindSession(request->session());
    if (!session.ok()) return Reply("GetSessionState", session.status());
    return Reply(
        "GetSessionState",
        (*session)->GetState(response->mutable_state(),
                             request->include_layout() ? response->mutable_layout() : nullptr));
  }

  grpc::Status Begin(grpc::ServerContext*, const pb::SessionRequest* request,
                     pb::BeginResponse* response) override {
    pb::StepEntry entry;
    *entry.mutable_session() = request->session();
    entry.mutable_begin();
    return RunOne("Begin", entry, [&](pb::StepResult& r) { *response = r.begin(); });
  }

  grpc::Status PrepareAppend(grpc::ServerContext*, const pb::PrepareAppendRequest* request,
                             pb::PrepareAppendResponse* response) override {
    pb::StepEntry entry;
    *entry.mutable_session() = request->session();
    entry.mutable_prepare()->set_generation(request->generation());
    entry.mutable_prepare()->set_rows(request->rows());
    return RunOne("PrepareAppend", entry,
                  [&](pb::StepResult& r) { response->Swap(r.mutable_prepare()); });
  }

  grpc::Status PublishAppend(grpc::ServerContext*, const pb::GenerationRequest* request,
                             pb::PublishAppendResponse* response) override {
    pb::StepEntry entry;
    *entry.mutable_session() = request->session();
    entry.mutable_publish()->set_generation(request->generation());
    return RunOne("PublishAppend", entry, [&](pb::StepResult& r) { *response = r.publish(); });
  }

  grpc::Status Commit(grpc::ServerContext*, const pb::CommitRequest* request,
                      pb::CommitResponse* response) override {
    pb::StepEntry entry;
    *entry.mutable_session() = request->session();
    entry.mutable_commit()->set_generation(request->generation());
    entry.mutable_commit()->set_accepted_rows(request->accepted_rows());
    *entry.mutable_commit()->mutable_token_ids() = request->token_ids();
    return RunOne("Commit", entry, [&](pb::StepResult& r) { *response = r.commit(); });
  }

  grpc::Status Abort(grpc::ServerContext*, const pb::GenerationRequest* request,
                     pb::AbortResponse* response) override {
    pb::StepEntry entry;
    *entry.mutable_session() = request->session();
    entry.mutable_abort()->set_generation(request->generation());
    return RunOne("Abort", entry, [&](pb::StepResult& r) { *response = r.abort(); });
  }

  grpc::Status Step(grpc::ServerContext*, const pb::StepRequest* request,
                    pb::StepResponse* response) override {
    if (request->entries_size() > kMaxStepEntries) {
      return Reply("Step", absl::InvalidArgumentError(
                               absl::StrCat("Step carries ", request->entries_size(),
                                            " entries; the limit is ", kMaxStepEntries)));
    }
    response->mutable_results()->Reserve(request->entries_size());
    for (const pb::StepEntry& entry : request->entries()) {
      pb::StepResult* result = response->add_results();
      daemon_->RunStepEntry(entry, result);
      if (result->code() != 0) {
        spdlog::info("Step entry for session {} refused: {} {}", entry.session().session_id(),
                     absl::StatusCodeToString(static_cast<absl::StatusCode>(result->code())),
                     result->message());
      }
    }
    return grpc::Status::OK;
  }

  grpc::Status Rewind(grpc::ServerContext*, const pb::RewindRequest* request,
                      pb::SessionStateResponse* response) override {
    return OnSession("Rewind", request->session(), response,
                     [&](DaemonSession& session) { return session.Rewind(request->target()); });
  }

  grpc::Status Hydrate(grpc::ServerContext*, const pb::HydrateRequest* request,
                       pb::SessionStateResponse* response) override {
    return OnSession("Hydrate", request->session(), response, [&](DaemonSession& session) {
      return session.Hydrate(request->logical_len(),
                             absl::Span<const uint64_t>(request->resident_starts().data(),
                                                        request->resident_starts().size()));
    });
  }

  grpc::Status CanRewind(grpc::ServerContext*, const pb::RewindRequest* request,
                         pb::CanRewindResponse* response) override {
    absl::StatusOr<std::shared_ptr<DaemonSession>> session =
        daemon_->FindSession(request->session());
    if (!session.ok()) return Reply("CanRewind", session.status());
    absl::StatusOr<bool> can = (*session)->CanRewind(request->target());
    if (can.ok()) response->set_can_rewind(*can);
    return Reply("CanRewind", can.status());
  }

  grpc::Status SpecSnapshot(grpc::ServerContext*, const pb::SessionRequest* request,
                            pb::SessionStateResponse* response) override {
    return OnSession("SpecSnapshot", request->session(), response,
                     [](DaemonSession& session) { return session.SpecSnapshot(); });
  }

  grpc::Status SpecRollback(grpc::ServerContext*, const pb::SpecRollbackRequest* request,
                            pb::SessionStateResponse* response) override {
    return OnSession("SpecRollback", request->session(), response, [&](DaemonSession& session) {
      return session.SpecRollback(request->accept_len());
    });
  }

  grpc::Status Grow(grpc::ServerContext*, const pb::GrowRequest* request,
                    pb::GrowResponse* response) override {
    absl::StatusOr<std::shared_ptr<DaemonSession>> session =
        daemon_->FindSession(request->session());
    if (!session.ok()) return Reply("Grow", session.status());
    return Reply("Grow", (*session)->Grow(request->target_capacity(), response));
  }

  grpc::Status AcknowledgeGrow(grpc::ServerContext*, const pb::AcknowledgeGrowRequest* request,
                               pb::SessionStateResponse* response) override {
    return OnSession("AcknowledgeGrow", request->session(), response, [&](DaemonSession& session) {
      return session.AcknowledgeGrow(request->layout_version());
    });
  }

  grpc::Status Taint(grpc::ServerContext*, const pb::TaintRequest* request,
                     pb::SessionStateResponse* response) override {
    return OnSession("Taint", request->session(), response,
                     [&](DaemonSession& session) { return session.Taint(request->reason()); });
  }

 private:
  // Runs `op` on the session and answers with its state afterwards.
  template <typename Op>
  grpc::Status OnSession(absl::string_view rpc, const pb::SessionRef& ref,
                         pb::SessionStateResponse* response, Op op) {
    absl::StatusOr<std::shared_ptr<DaemonSession>> session = daemon_->FindSession(ref);
    if (!session.ok()) return Reply(rpc, session.status());
    absl::Status status = op(**session);
    if (status.ok()) status = (*session)->GetState(response->mutable_state(), nullptr);
    return Reply(rpc, status);
  }

  // The single-session transaction RPCs run exactly what a one-entry Step runs.
  template <typename Take>
  grpc::Status RunOne(absl::string_view rpc, const pb::StepEntry& entry, Take take) {
    pb::StepResult result;
    daemon_->RunStepEntry(entry, &result);
    const absl::Status status(static_cast<absl::StatusCode>(result.code()), result.message());
    if (status.ok()) take(result);
    return Reply(rpc, status);
  }

  Daemon* const daemon_;
};

class Daemon::AdminService final : public pb::KvAdmin::Service {
 public:
  explicit AdminService(Daemon* daemon) : daemon_(daemon) {}

  grpc::Status GetStatus(grpc::ServerContext*, const pb::GetStatusRequest*,
                         pb::GetStatusResponse* response) override {
    *response = daemon_->GetStatus();
    return grpc::Status::OK;
  }

 private:
  Daemon* const daemon_;
};

// ---- Daemon ----

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Create(DaemonConfig config,
                                                       std::unique_ptr<DeviceBackend> backend,
                                                       Clock* clock) {
  if (backend == nullptr || clock == nullptr) {
    return absl::InvalidArgumentError("Daemon::Create needs a backend and a clock");
  }
  RETURN_IF_ERROR(ValidateConfig(config));
  return std::unique_ptr<Daemon>(new Daemon(std::move(config), std::move(backend), clock));
}

Daemon::Daemon(DaemonConfig config, std::unique_ptr<DeviceBackend> backend, Clock* clock)
    : backend_(std::move(backend)),
      clock_(clock),
      socket_path_(config.SocketPath()),
      start_config_(std::move(config)),
      format_defaults_(),
      cache_service_(std::make_unique<CacheService>(this)),
      admin_service_(std::make_unique<AdminService>(this)) {
  absl::MutexLock lock(&mu_);
  lease_timeout_ = absl::Milliseconds(start_config_.lease_timeout_ms);
  lease_grace_ = absl::Milliseconds(start_config_.lease_grace_ms);
  if (start_config_.prefix_cache_budget_bytes > 0) {
    PrefixCacheOptions options;
    options.budget_bytes = start_config_.prefix_cache_budget_bytes;
    options.block_tokens = start_config_.prefix_block_tokens;
    options.verify_checksums = start_config_.prefix_verify_checksums;
    // A random epoch per start: a router can tell a restarted daemon from a reconnect.
    absl::StatusOr<std::string> random = RandomToken();
    if (random.ok()) std::memcpy(&options.epoch, random->data(), sizeof(options.epoch));
    options.epoch |= 1;  // 0 means "any epoch" to a subscriber
    // TODO(lead): pass the daemon's DeviceBudget and call InstallEvictor on it.
    absl::StatusOr<std::unique_ptr<PrefixCache>> cache =
        PrefixCache::Create(options, backend_.get(), /*budget=*/nullptr);
    if (cache.ok()) {
      prefix_cache_ = *std::move(cache);
    } else {  // ValidateConfig accepted it, so this is our bug; serve without the cache
      spdlog::error("prefix cache disabled: {}", cache.status().ToString());
    }
  }
  prefix_service_ = std::make_unique<PrefixService>(
      prefix_cache_.get(), [this](const pb::SessionRef& ref) { return FindSession(ref); });
}

Daemon::~Daemon() { Shutdown(); }

absl::Status Daemon::Start() {
  {
    absl::MutexLock lock(&mu_);
    if (server_ != nullptr || shut_down_.load()) {
      return absl::FailedPreconditionError("the daemon was already started");
    }
  }
  RETURN_IF_ERROR(PrepareSocketPath(socket_path_));
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::StrCat("unix:", socket_path_), grpc::InsecureServerCredentials());
  builder.RegisterService(cache_service_.get());
  builder.RegisterService(admin_service_.get());
  builder.RegisterService(prefix_service_.get());
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    return absl::UnavailableError(absl::StrCat("could not listen on unix:", socket_path_,
                                               " (does the directory exist and is it writable?)"));
  }
  // Calls may already be arriving: no lock is held while the server could wait for them.
  if (absl::Status permissions = ApplySocketPermissions(start_config_, socket_path_);
      !permissions.ok()) {
    server->Shutdown();
    unlink(socket_path_.c_str());
    return permissions;
  }
  absl::Duration lease_timeout;
  absl::Duration lease_grace;
  {
    absl::MutexLock lock(&mu_);
    server_ = std::move(server);
    lease_timeout = lease_timeout_;
    lease_grace = lease_grace_;
  }
  lease_thread_ = std::thread([this] { LeaseLoop(); });
  spdlog::info("memra-kvd serving on unix:{} (backend {}, lease timeout {} ms, grace {} ms)",
               socket_path_, std::string(backend_->Name()),
               absl::ToInt64Milliseconds(lease_timeout), absl::ToInt64Milliseconds(lease_grace));
  return absl::OkStatus();
}

void Daemon::LeaseLoop() {
  while (true) {
    absl::Duration period;
    {
      absl::MutexLock lock(&mu_);
      period = std::clamp(std::min(lease_timeout_, lease_grace_ + absl::Milliseconds(1)) / 5,
                          absl::Milliseconds(5), absl::Milliseconds(200));
    }
    {
      absl::MutexLock lock(&stop_mu_);
      if (stop_mu_.AwaitWithTimeout(absl::Condition(&stop_lease_thread_), period)) return;
    }
    CheckLeases();
  }
}

size_t Daemon::Drain(absl::Duration grace) {
  {
    absl::MutexLock lock(&mu_);
    draining_ = true;
    if (server_ != nullptr) server_->GetHealthCheckService()->SetServingStatus(false);
  }
  absl::MutexLock lock(&sessions_mu_);
  spdlog::info("draining: refusing new engines and sessions; {} sessions open, waiting up to {} ms",
               sessions_.size(), absl::ToInt64Milliseconds(grace));
  auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(sessions_mu_) {
    return sessions_.empty() || drain_ended_;
  };
  sessions_mu_.AwaitWithTimeout(absl::Condition(&done), grace);
  return sessions_.size();
}

void Daemon::EndDrain() {
  absl::MutexLock lock(&sessions_mu_);
  drain_ended_ = true;
}

void Daemon::Shutdown() {
  if (shut_down_.exchange(true)) return;
  {
    absl::MutexLock lock(&stop_mu_);
    stop_lease_thread_ = true;
  }
  if (lease_thread_.joinable()) lease_thread_.join();
  prefix_service_->Stop();
  std::unique_ptr<grpc::Server> server;
  {
    absl::MutexLock lock(&mu_);
    draining_ = true;
    for (auto& [id, engine] : engines_) {
      if (engine.context != nullptr) engine.context->TryCancel();
    }
    server = std::move(server_);
  }
  if (server != nullptr) {
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
    server->Wait();
  }
  absl::flat_hash_map<uint64_t, std::shared_ptr<DaemonSession>> sessions;
  {
    absl::MutexLock lock(&mu_);
    engines_.clear();
    absl::MutexLock sessions_lock(&sessions_mu_);
    sessions.swap(sessions_);
  }
  uint64_t freed = 0;
  for (auto& [id, session] : sessions) freed += session->Release();
  if (server != nullptr) unlink(socket_path_.c_str());
  spdlog::info("shut down: released {} sessions ({} bytes); backend holds {} arenas, {} bytes",
               sessions.size(), freed, backend_->ArenaCount(), backend_->AllocatedBytes());
}

void Daemon::ApplyReload(const DaemonConfig& config) {
  absl::MutexLock lock(&mu_);
  lease_timeout_ = absl::Milliseconds(config.lease_timeout_ms);
  lease_grace_ = absl::Milliseconds(config.lease_grace_ms);
}

absl::StatusOr<pb::Attached> Daemon::BeginLease(const pb::Hello& hello,
                                                grpc::ServerContext* context) {
  ASSIGN_OR_RETURN(std::string token, RandomToken());
  absl::MutexLock lock(&mu_);
  if (draining_) return absl::UnavailableError("the daemon is draining; attach to another");
  const EngineId id{next_engine_id_++};
  Engine& engine = engines_[id.value];
  engine.id = id;
  engine.name = hello.engine_name().substr(0, 256);
  engine.pid = hello.pid();
  engine.token = token;
  engine.last_heartbeat = clock_->Now();
  engine.context = context;
  pb::Attached attached;
  attached.mutable_engine()->set_engine_id(id.value);
  attached.mutable_engine()->set_engine_token(token);
  attached.set_lease_timeout_ms(absl::ToInt64Milliseconds(lease_timeout_));
  attached.set_lease_grace_ms(absl::ToInt64Milliseconds(lease_grace_));
  attached.set_backend(std::string(backend_->Name()));
  spdlog::info("engine {} attached: name \"{}\", pid {}", id.value, engine.name, engine.pid);
  return attached;
}

absl::Status Daemon::Heartbeat(EngineId id) {
  absl::MutexLock lock(&mu_);
  auto it = engines_.find(id.value);
  if (it == engines_.end()) {
    return absl::NotFoundError(absl::StrCat("engine ", id.value, " was reclaimed"));
  }
  if (it->second.lease_ended.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat("engine ", id.value, ": the lease expired; its sessions will be freed"));
  }
  it->second.last_heartbeat = clock_->Now();
  return absl::OkStatus();
}

void Daemon::EndStream(EngineId id) {
  absl::MutexLock lock(&mu_);
  auto it = engines_.find(id.value);
  if (it == engines_.end()) return;
  it->second.context = nullptr;
  if (!it->second.lease_ended.has_value()) {
    it->second.lease_ended = clock_->Now();
    spdlog::info("engine {} (\"{}\"): Attach stream ended; {} sessions freed in {} ms", id.value,
                 it->second.name, it->second.sessions.size(),
                 absl::ToInt64Milliseconds(lease_grace_));
  }
}

void Daemon::CheckLeases() {
  struct Reclaimed {
    Engine engine;
    std::vector<std::shared_ptr<DaemonSession>> sessions;
  };
  std::vector<Reclaimed> reclaimed;
  const absl::Time now = clock_->Now();
  {
    absl::MutexLock lock(&mu_);
    for (auto it = engines_.begin(); it != engines_.end();) {
      Engine& engine = it->second;
      if (!engine.lease_ended.has_value() && now - engine.last_heartbeat > lease_timeout_) {
        engine.lease_ended = now;
        spdlog::warn("engine {} (\"{}\", pid {}): no heartbeat for {} ms (lease timeout {} ms)",
                     engine.id.value, engine.name, engine.pid,
                     absl::ToInt64Milliseconds(now - engine.last_heartbeat),
                     absl::ToInt64Milliseconds(lease_timeout_));
        if (engine.context != nullptr) engine.context->TryCancel();
      }
      if (engine.lease_ended.has_value() && now - *engine.lease_ended >= lease_grace_) {
        Reclaimed entry;
        {
          absl::MutexLock sessions_lock(&sessions_mu_);
          for (uint64_t session_id : engine.sessions) {
            auto found = sessions_.find(session_id);
            if (found == sessions_.end()) continue;
            entry.sessions.push_back(std::move(found->second));
            sessions_.erase(found);
          }
        }
        if (engine.context != nullptr) engine.context->TryCancel();
        entry.engine = std::move(engine);
        reclaimed.push_back(std::move(entry));
        engines_.erase(it++);
        continue;
      }
      ++it;
    }
  }
  for (Reclaimed& entry : reclaimed) {
    uint64_t freed = 0;
    for (auto& session : entry.sessions) {
      CaptureBeforeRelease(*session);
      freed += session->Release();
    }
    spdlog::info("engine {} (\"{}\", pid {}) reclaimed: {} sessions, {} bytes freed",
                 entry.engine.id.value, entry.engine.name, entry.engine.pid, entry.sessions.size(),
                 freed);
  }
}

void Daemon::CaptureBeforeRelease(DaemonSession& session) {
  if (prefix_cache_ == nullptr || !start_config_.prefix_capture_on_engine_death) return;
  absl::StatusOr<std::optional<PrefixCaptureResult>> captured =
      prefix_cache_->CaptureCommitted(session);
  if (!captured.ok()) {
    spdlog::info("session {}: committed state not kept in the prefix cache: {}",
                 session.id().value, captured.status().ToString());
  } else if (captured->has_value()) {
    spdlog::info("session {}: {} committed tokens kept as prefix entry {}", session.id().value,
                 (*captured)->boundary_tokens, (*captured)->entry.value);
  }
}

absl::Status Daemon::CheckEngine(const pb::EngineRef& ref) const {
  auto it = engines_.find(ref.engine_id());
  if (it == engines_.end()) {
    return absl::NotFoundError(absl::StrCat("engine ", ref.engine_id(), " is not attached"));
  }
  if (!TokensEqual(ref.engine_token(), it->second.token)) {
    return absl::PermissionDeniedError(
        absl::StrCat("wrong engine token for engine ", ref.engine_id()));
  }
  if (it->second.lease_ended.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat("engine ", ref.engine_id(), ": its lease has ended"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> Daemon::RegisterPlan(const pb::ModelPlan& proto) {
  ASSIGN_OR_RETURN(ModelPlan plan, ModelPlanFromProto(proto));
  RETURN_IF_ERROR(ValidateModelPlan(plan));
  ASSIGN_OR_RETURN(PlanFingerprint fingerprint, FingerprintModelPlan(plan, format_defaults_));
  std::string key = FingerprintToBytes(fingerprint);
  absl::MutexLock lock(&mu_);
  if (!plans_.contains(key)) {
    if (plans_.size() >= kMaxPlans) {
      return absl::ResourceExhaustedError(absl::StrCat("the daemon already holds ", plans_.size(),
                                                       " model plans (limit ", kMaxPlans, ")"));
    }
    spdlog::info("model plan \"{}\" registered: {} layers, {} MTP blocks, fingerprint {}",
                 plan.name, plan.layers.size(), plan.mtp_blocks.size(),
                 FingerprintHex(fingerprint));
    plans_.emplace(key, std::make_shared<const ModelPlan>(std::move(plan)));
  }
  return key;
}

absl::Status Daemon::CreateSession(const pb::CreateSessionRequest& request,
                                   pb::CreateSessionResponse* response) {
  ASSIGN_OR_RETURN(PlanFingerprint fingerprint, FingerprintFromBytes(request.plan_fingerprint()));
  DaemonSession::Params params;
  {
    absl::MutexLock lock(&mu_);
    if (draining_) return absl::UnavailableError("the daemon is draining; no new sessions");
    RETURN_IF_ERROR(CheckEngine(request.engine()));
    auto plan = plans_.find(FingerprintToBytes(fingerprint));
    if (plan == plans_.end()) {
      return absl::NotFoundError(
          absl::StrCat("model plan ", FingerprintHex(fingerprint), " is not registered"));
    }
    params.model = plan->second;
  }
  params.id = SessionId{next_session_id_.fetch_add(1)};
  params.owner = EngineId{request.engine().engine_id()};
  ASSIGN_OR_RETURN(params.token, RandomToken());
  params.defaults = format_defaults_;
  params.request.layer_lo = request.layer_lo();
  if (request.has_layer_hi()) params.request.layer_hi = request.layer_hi();
  params.request.tp_ranks = request.tp_ranks() == 0 ? 1 : request.tp_ranks();
  params.request.capacity = request.capacity();
  params.request.spec_snapshot = request.spec_snapshot();
  const SessionId id = params.id;
  const std::string token = params.token;
  ASSIGN_OR_RETURN(std::shared_ptr<DaemonSession> session,
                   DaemonSession::Create(std::move(params), backend_.get()));
  {
    absl::MutexLock lock(&mu_);
    // The engine may have lost its lease (or the daemon started draining) while the arena was
    // allocated: the session never becomes visible then.
    absl::Status still = draining_ ? absl::UnavailableError("the daemon is draining")
                                   : CheckEngine(request.engine());
    if (!still.ok()) {
      session->Release();
      return still;
    }
    engines_[request.engine().engine_id()].sessions.insert(id.value);
    absl::MutexLock sessions_lock(&sessions_mu_);
    sessions_[id.value] = session;
  }
  response->mutable_session()->set_session_id(id.value);
  response->mutable_session()->set_session_token(token);
  RETURN_IF_ERROR(session->GetState(response->mutable_state(), response->mutable_layout()));
  spdlog::info("session {} created for engine {}: capacity {} tokens, {} bytes", id.value,
               request.engine().engine_id(), request.capacity(), session->arena_bytes());
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<DaemonSession>> Daemon::FindSession(const pb::SessionRef& ref) {
  std::shared_ptr<DaemonSession> session;
  {
    absl::MutexLock lock(&sessions_mu_);
    auto it = sessions_.find(ref.session_id());
    if (it == sessions_.end()) {
      return absl::NotFoundError(absl::StrCat("session ", ref.session_id(), " does not exist"));
    }
    session = it->second;
  }
  if (!session->TokenMatches(ref.session_token())) {
    return absl::PermissionDeniedError(
        absl::StrCat("wrong session token for session ", ref.session_id()));
  }
  return session;
}

absl::StatusOr<uint64_t> Daemon::ReleaseSession(const pb::SessionRef& ref) {
  ASSIGN_OR_RETURN(std::shared_ptr<DaemonSession> session, FindSession(ref));
  {
    absl::MutexLock lock(&mu_);
    auto engine = engines_.find(session->owner().value);
    if (engine != engines_.end()) engine->second.sessions.erase(ref.session_id());
    absl::MutexLock sessions_lock(&sessions_mu_);
    if (sessions_.erase(ref.session_id()) == 0) {
      return absl::NotFoundError(absl::StrCat("session ", ref.session_id(), " does not exist"));
    }
  }
  const uint64_t freed = session->Release();
  spdlog::info("session {} released: {} bytes freed", ref.session_id(), freed);
  return freed;
}

void Daemon::RunStepEntry(const pb::StepEntry& entry, pb::StepResult* result) {
  absl::StatusOr<std::shared_ptr<DaemonSession>> found = FindSession(entry.session());
  if (!found.ok()) return SetResultStatus(found.status(), result);
  DaemonSession& session = **found;
  absl::Status status;
  switch (entry.op_case()) {
    case pb::StepEntry::kBegin:
      status = session.Begin(result->mutable_begin());
      break;
    case pb::StepEntry::kPrepare:
      status = session.PrepareAppend(entry.prepare().generation(), entry.prepare().rows(),
                                     result->mutable_prepare());
      break;
    case pb::StepEntry::kPublish:
      status = session.PublishAppend(entry.publish().generation(), result->mutable_publish());
      break;
    case pb::StepEntry::kCommit:
      status = session.Commit(
          entry.commit().generation(), entry.commit().accepted_rows(), result->mutable_commit(),
          absl::MakeConstSpan(entry.commit().token_ids().data(),
                              static_cast<size_t>(entry.commit().token_ids().size())));
      break;
    case pb::StepEntry::kAbort:
      status = session.Abort(entry.abort().generation(), result->mutable_abort());
      break;
    case pb::StepEntry::OP_NOT_SET:
      status = absl::InvalidArgumentError(absl::StrCat(
          "Step entry for session ", entry.session().session_id(), " names no operation"));
      break;
  }
  if (!status.ok()) {
    result->clear_payload();
    SetResultStatus(status, result);
  }
}

pb::GetStatusResponse Daemon::GetStatus() {
  pb::GetStatusResponse out;
  out.set_backend(std::string(backend_->Name()));
  const DeviceInfo info = backend_->Info();
  out.set_device_name(info.name);
  out.set_device_uuid(info.uuid);
  out.set_device_total_bytes(info.total_bytes);
  out.set_device_free_bytes(info.free_bytes);
  out.set_allocated_bytes(backend_->AllocatedBytes());
  out.set_arena_count(backend_->ArenaCount());
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  out.set_plans(plans_.size());
  out.set_draining(draining_);
  out.set_engines(engines_.size());
  absl::MutexLock sessions_lock(&sessions_mu_);
  out.set_sessions(sessions_.size());
  for (const auto& [id, engine] : engines_) {
    pb::EngineStatus* status = out.add_engine_status();
    status->set_engine_id(id);
    status->set_engine_name(engine.name);
    status->set_pid(engine.pid);
    status->set_lease_live(!engine.lease_ended.has_value() &&
                           now - engine.last_heartbeat <= lease_timeout_);
    status->set_sessions(engine.sessions.size());
    uint64_t bytes = 0;
    for (uint64_t session_id : engine.sessions) {
      auto it = sessions_.find(session_id);
      if (it != sessions_.end()) bytes += it->second->arena_bytes();
    }
    status->set_allocated_bytes(bytes);
  }
  return out;
}

}  // namespace memra
