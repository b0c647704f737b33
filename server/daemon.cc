#include "server/daemon.h"

#include <grp.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
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
#include "server/model_import.h"
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

// The admission budget the configuration and the device allow, and how it was derived.
// Host: budget_bytes, capped at the capacity the backend was created with (it cannot grow).
// CUDA: cuda_memory_fraction of the device's TOTAL memory minus cuda_reserve_bytes.
std::pair<uint64_t, std::string> BudgetFor(const DaemonConfig& config, DeviceBackend& backend) {
  const DeviceInfo info = backend.Info();
  if (config.backend == Backend::kCuda) {
    return {UsableCudaBudget(info.total_bytes, config.cuda_memory_fraction,
                             config.cuda_reserve_bytes),
            absl::StrCat("cuda: ", config.cuda_memory_fraction, " x ", info.total_bytes,
                         " total - ", config.cuda_reserve_bytes, " reserve")};
  }
  const uint64_t bytes = std::min(UsableHostBudget(config.budget_bytes), info.total_bytes);
  if (bytes < config.budget_bytes) {
    return {bytes, absl::StrCat("host: budget_bytes ", config.budget_bytes,
                                " capped at the backend's start-up capacity ", info.total_bytes)};
  }
  return {bytes, absl::StrCat("host: budget_bytes ", bytes)};
}

absl::StatusOr<uint64_t> RandomEpoch() {
  uint64_t epoch = 0;
  while (epoch == 0) {
    if (getrandom(&epoch, sizeof(epoch), 0) != sizeof(epoch)) {
      if (errno == EINTR) continue;
      return PosixError("getrandom", errno);
    }
  }
  return epoch;
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

  grpc::Status Reserve(grpc::ServerContext*, const pb::ReserveRequest* request,
                       pb::ReserveResponse* response) override {
    absl::StatusOr<pb::ReserveResponse> reserved = daemon_->Reserve(*request);
    if (reserved.ok()) *response = *std::move(reserved);
    return Reply("Reserve", reserved.status());
  }

  grpc::Status CancelReservation(grpc::ServerContext*, const pb::CancelReservationRequest* request,
                                 pb::CancelReservationResponse* response) override {
    absl::StatusOr<uint64_t> freed = daemon_->CancelReservation(*request);
    if (freed.ok()) response->set_freed_bytes(*freed);
    return Reply("CancelReservation", freed.status());
  }

  grpc::Status CreateSession(grpc::ServerContext*, const pb::CreateSessionRequest* request,
                             pb::CreateSessionResponse* response) override {
    return Reply("CreateSession", daemon_->CreateSession(*request, response));
  }

  grpc::Status ReleaseSession(grpc::ServerContext*, const pb::SessionRequest* request,
                              pb::ReleaseSessionResponse* response) override {
    // Authenticated first: nobody makes the daemon wait on an event for a session not theirs.
    if (absl::StatusOr<std::shared_ptr<DaemonSession>> session =
            daemon_->FindSession(request->session());
        !session.ok()) {
      return Reply("ReleaseSession", session.status());
    }
    if (absl::Status waited = WaitForEngine(request->ordering()); !waited.ok()) {
      return Reply("ReleaseSession", waited);
    }
    absl::StatusOr<uint64_t> freed = daemon_->ReleaseSession(request->session());
    if (freed.ok()) response->set_freed_bytes(*freed);
    return Reply("ReleaseSession", freed.status());
  }

  grpc::Status ResetSession(grpc::ServerContext*, const pb::SessionRequest* request,
                            pb::SessionStateResponse* response) override {
    return OnSession("ResetSession", request->session(), request->ordering(), response,
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
    return RunOne("Begin", entry, request->ordering(),
                  [&](pb::StepResult& r) { *response = r.begin(); });
  }

  grpc::Status PrepareAppend(grpc::ServerContext*, const pb::PrepareAppendRequest* request,
                             pb::PrepareAppendResponse* response) override {
    pb::StepEntry entry;
    *entry.mutable_session() = request->session();
    entry.mutable_prepare()->set_generation(request->generation());
    entry.mutable_prepare()->set_rows(request->rows());
    return RunOne("PrepareAppend", entry, pb::DeviceOrdering::default_instance(),
                  [&](pb::StepResult& r) { response->Swap(r.mutable_prepare()); });
  }

  grpc::Status PublishAppend(grpc::ServerContext*, const pb::GenerationRequest* request,
                             pb::PublishAppendResponse* response) override {
    pb::StepEntry entry;
    *entry.mutable_session() = request->session();
    entry.mutable_publish()->set_generation(request->generation());
    return RunOne("PublishAppend", entry, request->ordering(),
                  [&](pb::StepResult& r) { *response = r.publish(); });
  }

  grpc::Status Commit(grpc::ServerContext*, const pb::CommitRequest* request,
                      pb::CommitResponse* response) override {
    pb::StepEntry entry;
    *entry.mutable_session() = request->session();
    entry.mutable_commit()->set_generation(request->generation());
    entry.mutable_commit()->set_accepted_rows(request->accepted_rows());
    *entry.mutable_commit()->mutable_token_ids() = request->token_ids();
    return RunOne("Commit", entry, request->ordering(),
                  [&](pb::StepResult& r) { *response = r.commit(); });
  }

  grpc::Status Abort(grpc::ServerContext*, const pb::GenerationRequest* request,
                     pb::AbortResponse* response) override {
    pb::StepEntry entry;
    *entry.mutable_session() = request->session();
    entry.mutable_abort()->set_generation(request->generation());
    return RunOne("Abort", entry, request->ordering(),
                  [&](pb::StepResult& r) { *response = r.abort(); });
  }

  grpc::Status Step(grpc::ServerContext*, const pb::StepRequest* request,
                    pb::StepResponse* response) override {
    if (request->entries_size() > kMaxStepEntries) {
      return Reply("Step", absl::InvalidArgumentError(
                               absl::StrCat("Step carries ", request->entries_size(),
                                            " entries; the limit is ", kMaxStepEntries)));
    }
    if (absl::Status waited = WaitForEngine(request->ordering()); !waited.ok()) {
      return Reply("Step", waited);
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
    return OnSession("Rewind", request->session(), request->ordering(), response,
                     [&](DaemonSession& session) { return session.Rewind(request->target()); });
  }

  grpc::Status Hydrate(grpc::ServerContext*, const pb::HydrateRequest* request,
                       pb::SessionStateResponse* response) override {
    return OnSession("Hydrate", request->session(), request->ordering(), response,
                     [&](DaemonSession& session) {
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
    return OnSession("SpecSnapshot", request->session(), request->ordering(), response,
                     [](DaemonSession& session) { return session.SpecSnapshot(); });
  }

  grpc::Status SpecRollback(grpc::ServerContext*, const pb::SpecRollbackRequest* request,
                            pb::SessionStateResponse* response) override {
    return OnSession("SpecRollback", request->session(), request->ordering(), response,
                     [&](DaemonSession& session) {
      return session.SpecRollback(request->accept_len());
    });
  }

  grpc::Status Grow(grpc::ServerContext*, const pb::GrowRequest* request,
                    pb::GrowResponse* response) override {
    absl::StatusOr<std::shared_ptr<DaemonSession>> session =
        daemon_->FindSession(request->session());
    if (!session.ok()) return Reply("Grow", session.status());
    if (absl::Status waited = WaitForEngine(request->ordering()); !waited.ok()) {
      return Reply("Grow", waited);
    }
    return Reply("Grow", (*session)->Grow(request->target_capacity(), response));
  }

  grpc::Status AcknowledgeGrow(grpc::ServerContext*, const pb::AcknowledgeGrowRequest* request,
                               pb::SessionStateResponse* response) override {
    return OnSession("AcknowledgeGrow", request->session(),
                     pb::DeviceOrdering::default_instance(), response, [&](DaemonSession& session) {
      return session.AcknowledgeGrow(request->layout_version());
    });
  }

  grpc::Status Taint(grpc::ServerContext*, const pb::TaintRequest* request,
                     pb::SessionStateResponse* response) override {
    return OnSession("Taint", request->session(), pb::DeviceOrdering::default_instance(),
                     response,
                     [&](DaemonSession& session) { return session.Taint(request->reason()); });
  }

 private:
  // Runs `op` on the session and answers with its state afterwards.
  template <typename Op>
  grpc::Status OnSession(absl::string_view rpc, const pb::SessionRef& ref,
                         const pb::DeviceOrdering& ordering, pb::SessionStateResponse* response,
                         Op op) {
    absl::StatusOr<std::shared_ptr<DaemonSession>> session = daemon_->FindSession(ref);
    if (!session.ok()) return Reply(rpc, session.status());
    if (absl::Status waited = WaitForEngine(ordering); !waited.ok()) return Reply(rpc, waited);
    absl::Status status = op(**session);
    if (status.ok()) status = (*session)->GetState(response->mutable_state(), nullptr);
    return Reply(rpc, status);
  }

  // The single-session transaction RPCs run exactly what a one-entry Step runs.
  template <typename Take>
  grpc::Status RunOne(absl::string_view rpc, const pb::StepEntry& entry,
                      const pb::DeviceOrdering& ordering, Take take) {
    // Authenticated first: nobody makes the daemon wait on an event for a session not theirs.
    if (absl::StatusOr<std::shared_ptr<DaemonSession>> session =
            daemon_->FindSession(entry.session());
        !session.ok()) {
      return Reply(rpc, session.status());
    }
    if (absl::Status waited = WaitForEngine(ordering); !waited.ok()) return Reply(rpc, waited);
    pb::StepResult result;
    daemon_->RunStepEntry(entry, &result);
    const absl::Status status(static_cast<absl::StatusCode>(result.code()), result.message());
    if (status.ok()) take(result);
    return Reply(rpc, status);
  }

  // The engine's work on the memory this call touches is complete (DeviceOrdering).
  absl::Status WaitForEngine(const pb::DeviceOrdering& ordering) {
    return daemon_->backend().WaitForEngineEvent(ordering.wait_event());
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

  grpc::Status ListSessions(grpc::ServerContext*, const pb::ListSessionsRequest* request,
                            pb::ListSessionsResponse* response) override {
    return Reply("ListSessions", daemon_->ListSessions(*request, response));
  }

  grpc::Status ListEngines(grpc::ServerContext*, const pb::ListEnginesRequest*,
                           pb::ListEnginesResponse* response) override {
    pb::GetStatusResponse status = daemon_->GetStatus();
    response->mutable_engines()->Swap(status.mutable_engine_status());
    return grpc::Status::OK;
  }

  grpc::Status GetCost(grpc::ServerContext*, const pb::CostRequest* request,
                       pb::CostResponse* response) override {
    return Reply("GetCost", daemon_->GetCost(*request, response));
  }

  grpc::Status GetFit(grpc::ServerContext*, const pb::FitRequest* request,
                      pb::FitResponse* response) override {
    return Reply("GetFit", daemon_->GetFit(*request, response));
  }

  grpc::Status GetMaxContext(grpc::ServerContext*, const pb::MaxContextRequest* request,
                             pb::MaxContextResponse* response) override {
    return Reply("GetMaxContext", daemon_->GetMaxContext(*request, response));
  }

  grpc::Status ImportModel(grpc::ServerContext*, const pb::ImportModelRequest* request,
                           pb::ImportModelResponse* response) override {
    return Reply("ImportModel", daemon_->ImportModel(*request, response));
  }

  grpc::Status Drain(grpc::ServerContext*, const pb::DrainRequest*,
                     pb::DrainResponse* response) override {
    response->set_sessions_open(daemon_->SetDraining(true));
    return grpc::Status::OK;
  }

  grpc::Status Undrain(grpc::ServerContext*, const pb::UndrainRequest*,
                       pb::UndrainResponse*) override {
    daemon_->SetDraining(false);
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
  ASSIGN_OR_RETURN(uint64_t epoch, RandomEpoch());
  auto [budget_bytes, rule] = BudgetFor(config, *backend);
  spdlog::info("admission budget {} bytes ({})", budget_bytes, rule);
  return std::unique_ptr<Daemon>(new Daemon(std::move(config), std::move(backend), clock,
                                            std::make_unique<DeviceBudget>(budget_bytes, rule),
                                            epoch));
}

Daemon::Daemon(DaemonConfig config, std::unique_ptr<DeviceBackend> backend, Clock* clock,
               std::unique_ptr<DeviceBudget> budget, uint64_t epoch)
    : backend_(std::move(backend)),
      clock_(clock),
      socket_path_(config.SocketPath()),
      start_config_(std::move(config)),
      format_defaults_(),
      cache_service_(std::make_unique<CacheService>(this)),
      admin_service_(std::make_unique<AdminService>(this)),
      budget_(std::move(budget)),
      epoch_(epoch),
      started_(clock->Now()) {
  absl::MutexLock lock(&mu_);
  lease_timeout_ = absl::Milliseconds(start_config_.lease_timeout_ms);
  lease_grace_ = absl::Milliseconds(start_config_.lease_grace_ms);
  if (start_config_.prefix_cache_budget_bytes > 0) {
    PrefixCacheOptions options;
    options.budget_bytes = start_config_.prefix_cache_budget_bytes;
    options.block_tokens = start_config_.prefix_block_tokens;
    options.verify_checksums = start_config_.prefix_verify_checksums;
    options.copy_threads = static_cast<uint32_t>(start_config_.prefix_copy_threads);
    // The daemon's random epoch: a router tells a restarted daemon from a reconnect (0 means
    // "any epoch" to a subscriber, so it is never used).
    options.epoch = epoch_ == 0 ? 1 : epoch_;
    // Storage is charged to the one admission budget; admissions evict LRU entries for room.
    absl::StatusOr<std::unique_ptr<PrefixCache>> cache =
        PrefixCache::Create(options, backend_.get(), budget_.get());
    if (cache.ok()) {
      prefix_cache_ = *std::move(cache);
      prefix_cache_->InstallEvictor(*budget_);
    } else {  // ValidateConfig accepted it, so this is our bug; serve without the cache
      spdlog::error("prefix cache disabled: {}", cache.status().ToString());
    }
  }
  prefix_service_ = std::make_unique<PrefixService>(
      prefix_cache_.get(), backend_.get(),
      [this](const pb::SessionRef& ref) { return FindSession(ref); });
  reservation_ttl_ = absl::Milliseconds(start_config_.reservation_ttl_ms);
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
  ASSIGN_OR_RETURN(auto interceptors, RegisterMetrics());
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
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
  StartMetricsHttp();
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

size_t Daemon::SetDraining(bool draining) {
  {
    absl::MutexLock lock(&mu_);
    if (draining_ != draining) {
      spdlog::info(draining ? "draining: new engines and sessions are refused"
                            : "undrained: new engines and sessions are accepted again");
    }
    draining_ = draining;
    if (server_ != nullptr) server_->GetHealthCheckService()->SetServingStatus(!draining);
  }
  absl::MutexLock lock(&sessions_mu_);
  return sessions_.size();
}

size_t Daemon::Drain(absl::Duration grace) {
  SetDraining(true);
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
  std::unique_ptr<metrics::MetricsHttpServer> metrics_http;
  {
    absl::MutexLock lock(&mu_);
    draining_ = true;
    metrics_http = std::move(metrics_http_);
    for (auto& [id, engine] : engines_) {
      if (engine.context != nullptr) engine.context->TryCancel();
    }
    server = std::move(server_);
  }
  metrics_http.reset();  // joins its threads: no scrape reads the daemon after this
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
  {
    absl::MutexLock lock(&mu_);
    lease_timeout_ = absl::Milliseconds(config.lease_timeout_ms);
    lease_grace_ = absl::Milliseconds(config.lease_grace_ms);
    reservation_ttl_ = absl::Milliseconds(config.reservation_ttl_ms);
  }
  auto [budget_bytes, rule] = BudgetFor(config, *backend_);
  const BudgetChange change = budget_->SetBudget(budget_bytes, rule);
  if (change.old_budget != change.new_budget) {
    spdlog::info("admission budget {} -> {} bytes ({}); {} bytes in use", change.old_budget,
                 change.new_budget, rule, change.used_bytes);
  }
  if (change.over_budget_bytes > 0) {
    spdlog::warn("admission: {} bytes in use exceed the new budget by {}; nothing is admitted "
                 "until releases bring usage under it",
                 change.used_bytes, change.over_budget_bytes);
  }
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
        lease_expiries_.fetch_add(1, std::memory_order_relaxed);
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
    for (auto& session : entry.sessions) freed += session->Release();
    engines_reclaimed_.fetch_add(1, std::memory_order_relaxed);
    // Its sessions' charges went with their arenas; what is left is reservations.
    const uint64_t reserved = budget_->ReleaseOwner(entry.engine.id.value);
    spdlog::info(
        "engine {} (\"{}\", pid {}) reclaimed: {} sessions, {} bytes freed, {} reserved bytes "
        "returned",
        entry.engine.id.value, entry.engine.name, entry.engine.pid, entry.sessions.size(), freed,
        reserved);
  }
  ExpireReservations();
}

void Daemon::ExpireReservations() {
  for (const ExpiredReservation& expired : budget_->Expire(clock_->Now())) {
    reservations_expired_.fetch_add(1, std::memory_order_relaxed);
    spdlog::info("reservation {} of engine {} expired unused: {} bytes returned",
                 expired.id.value, expired.reservation.owner, expired.reservation.bytes);
  }
}

ArenaRounding Daemon::rounding() const {
  return ArenaRounding{kPlaneAlignment, backend_->AllocationGranularity()};
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
  return RegisterValidPlan(std::move(plan));
}

absl::StatusOr<std::string> Daemon::RegisterValidPlan(ModelPlan plan) {
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

absl::StatusOr<std::shared_ptr<const ModelPlan>> Daemon::FindPlan(
    const std::string& fingerprint) const {
  ASSIGN_OR_RETURN(PlanFingerprint parsed, FingerprintFromBytes(fingerprint));
  absl::MutexLock lock(&mu_);
  auto plan = plans_.find(fingerprint);
  if (plan == plans_.end()) {
    return absl::NotFoundError(
        absl::StrCat("model plan ", FingerprintHex(parsed), " is not registered"));
  }
  return plan->second;
}

absl::StatusOr<pb::ReserveResponse> Daemon::Reserve(const pb::ReserveRequest& request) {
  absl::Duration ttl;
  {
    absl::MutexLock lock(&mu_);
    if (draining_) return absl::UnavailableError("the daemon is draining; no new reservations");
    RETURN_IF_ERROR(CheckEngine(request.engine()));
    ttl = reservation_ttl_;
  }
  ASSIGN_OR_RETURN(std::shared_ptr<const ModelPlan> plan, FindPlan(request.plan_fingerprint()));
  ASSIGN_OR_RETURN(uint64_t bytes, SessionArenaBytes(*plan, format_defaults_,
                                                     SessionShapeFromProto(request), rounding()));
  ASSIGN_OR_RETURN(ReservationId id,
                   budget_->Reserve(request.engine().engine_id(), bytes, clock_->Now(), ttl));
  spdlog::info("reservation {} for engine {}: {} bytes (capacity {} tokens) for {} ms", id.value,
               request.engine().engine_id(), bytes, request.capacity(),
               absl::ToInt64Milliseconds(ttl));
  pb::ReserveResponse response;
  response.set_reservation_id(id.value);
  response.set_bytes(bytes);
  response.set_ttl_ms(absl::ToInt64Milliseconds(ttl));
  return response;
}

absl::StatusOr<uint64_t> Daemon::CancelReservation(const pb::CancelReservationRequest& request) {
  {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckEngine(request.engine()));
  }
  return budget_->Cancel(ReservationId{request.reservation_id()}, request.engine().engine_id());
}

absl::Status Daemon::CreateSession(const pb::CreateSessionRequest& request,
                                   pb::CreateSessionResponse* response) {
  RETURN_IF_ERROR(FingerprintFromBytes(request.plan_fingerprint()).status());
  DaemonSession::Params params;
  {
    absl::MutexLock lock(&mu_);
    if (draining_) return absl::UnavailableError("the daemon is draining; no new sessions");
    RETURN_IF_ERROR(CheckEngine(request.engine()));
  }
  ASSIGN_OR_RETURN(params.model, FindPlan(request.plan_fingerprint()));
  params.id = SessionId{next_session_id_.fetch_add(1)};
  params.owner = EngineId{request.engine().engine_id()};
  ASSIGN_OR_RETURN(params.token, RandomToken());
  params.defaults = format_defaults_;
  params.fingerprint = request.plan_fingerprint();
  params.request = SessionShapeFromProto(request);
  const SessionId id = params.id;
  const std::string token = params.token;
  std::optional<ReservationId> reservation;
  if (request.reservation_id() != 0) reservation = ReservationId{request.reservation_id()};
  ASSIGN_OR_RETURN(std::shared_ptr<DaemonSession> session,
                   DaemonSession::Create(std::move(params), backend_.get(), budget_.get(),
                                         reservation));
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
  spdlog::info("session {} created for engine {}: capacity {} tokens, {} bytes{}", id.value,
               request.engine().engine_id(), request.capacity(), session->arena_bytes(),
               reservation.has_value() ? absl::StrCat(" (reservation ", reservation->value, ")")
                                       : std::string());
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
  out.set_epoch(epoch_);
  out.set_uptime_ms(absl::ToInt64Milliseconds(now - started_));
  const AdmissionLedger ledger = budget_->Snapshot();
  pb::AdmissionStatus* admission = out.mutable_admission();
  admission->set_budget_bytes(ledger.budget());
  admission->set_reserved_bytes(ledger.reserved());
  admission->set_allocated_bytes(ledger.allocated());
  admission->set_free_bytes(ledger.free());
  admission->set_evictable_bytes(ledger.evictable());
  admission->set_reservations(ledger.reservation_count());
  admission->set_over_budget_bytes(ledger.used() > ledger.budget()
                                       ? ledger.used() - ledger.budget()
                                       : 0);
  admission->set_budget_rule(budget_->rule());
  admission->set_granularity_bytes(backend_->AllocationGranularity());
  absl::flat_hash_map<uint64_t, std::pair<uint64_t, uint64_t>> reserved_by_engine;
  for (const auto& [id, reservation] : ledger.reservations()) {
    auto& [count, bytes] = reserved_by_engine[reservation.owner];
    ++count;
    bytes += reservation.bytes;
  }
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
    status->set_last_heartbeat_age_ms(absl::ToInt64Milliseconds(
        now - (engine.lease_ended.has_value() ? *engine.lease_ended : engine.last_heartbeat)));
    if (auto reserved = reserved_by_engine.find(id); reserved != reserved_by_engine.end()) {
      status->set_reservations(reserved->second.first);
      status->set_reserved_bytes(reserved->second.second);
    }
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

// ---- KvAdmin ----

absl::Status Daemon::ListSessions(const pb::ListSessionsRequest& request,
                                  pb::ListSessionsResponse* response) {
  std::vector<std::shared_ptr<DaemonSession>> sessions;
  {
    absl::MutexLock lock(&sessions_mu_);
    for (const auto& [id, session] : sessions_) {
      if (request.engine_id() == 0 || session->owner().value == request.engine_id()) {
        sessions.push_back(session);
      }
    }
  }
  std::sort(sessions.begin(), sessions.end(),
            [](const auto& a, const auto& b) { return a->id().value < b->id().value; });
  for (const std::shared_ptr<DaemonSession>& session : sessions) {
    pb::SessionState state;
    // A session released meanwhile is simply not listed.
    if (!session->GetState(&state, nullptr).ok()) continue;
    pb::SessionSummary* summary = response->add_sessions();
    const DaemonSession::Params& params = session->params();
    summary->set_session_id(params.id.value);
    summary->set_engine_id(params.owner.value);
    summary->set_model_name(params.model->name);
    summary->set_plan_fingerprint(params.fingerprint);
    summary->set_capacity(state.capacity());
    summary->set_logical_len(state.committed_len());
    summary->set_arena_bytes(session->arena_bytes());
    summary->set_layout_version(state.layout_version());
    summary->set_in_transaction(state.active_generation() != 0);
    summary->set_tainted(state.tainted());
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const ModelPlan>> Daemon::ResolveModel(
    const pb::ModelSelector& selector) const {
  switch (selector.model_case()) {
    case pb::ModelSelector::kPlanFingerprint:
      return FindPlan(selector.plan_fingerprint());
    case pb::ModelSelector::kPlan: {
      ASSIGN_OR_RETURN(ModelPlan plan, ModelPlanFromProto(selector.plan()));
      RETURN_IF_ERROR(ValidateModelPlan(plan));
      return std::make_shared<const ModelPlan>(std::move(plan));
    }
    case pb::ModelSelector::kHfConfigJson: {
      ASSIGN_OR_RETURN(ModelPlan plan,
                       ImportHuggingFaceConfig(selector.hf_config_json(), ImportOptions{}));
      return std::make_shared<const ModelPlan>(std::move(plan));
    }
    case pb::ModelSelector::MODEL_NOT_SET:
      break;
  }
  return absl::InvalidArgumentError(
      "no model: give a plan_fingerprint, an inline plan or a Hugging Face config.json");
}

absl::Status Daemon::GetCost(const pb::CostRequest& request, pb::CostResponse* response) {
  ASSIGN_OR_RETURN(std::shared_ptr<const ModelPlan> plan, ResolveModel(request.model()));
  const SessionShape shape = SessionShapeFromProto(request.shape());
  ASSIGN_OR_RETURN(CostReport cost, SessionCost(*plan, format_defaults_, shape, rounding()));
  ASSIGN_OR_RETURN(PlanFingerprint fingerprint, FingerprintModelPlan(*plan, format_defaults_));
  ASSIGN_OR_RETURN(SessionPlan planes, PlanSession(*plan, format_defaults_, shape));
  response->set_model_name(plan->name);
  response->set_plan_fingerprint(FingerprintToBytes(fingerprint));
  response->set_capacity(cost.capacity);
  pb::CostBreakdown* breakdown = response->mutable_breakdown();
  breakdown->set_bytes_per_token(cost.breakdown.bytes_per_token);
  breakdown->set_kv_bytes_per_token(cost.breakdown.kv_bytes_per_token);
  breakdown->set_ring_bytes_per_token(cost.breakdown.ring_bytes_per_token);
  breakdown->set_latent_bytes_per_token(cost.breakdown.latent_bytes_per_token);
  breakdown->set_ring_row_cap(cost.breakdown.ring_row_cap);
  breakdown->set_fixed_bytes(cost.breakdown.fixed_bytes);
  breakdown->set_total_plane_bytes(cost.breakdown.total_bytes);
  response->set_arena_bytes(cost.arena_bytes);
  response->set_granularity_bytes(backend_->AllocationGranularity());
  response->set_layers(static_cast<uint32_t>(planes.layers.size()));
  return absl::OkStatus();
}

absl::Status Daemon::GetFit(const pb::FitRequest& request, pb::FitResponse* response) {
  ASSIGN_OR_RETURN(std::shared_ptr<const ModelPlan> plan, ResolveModel(request.model()));
  const SessionShape shape = SessionShapeFromProto(request.shape());
  ASSIGN_OR_RETURN(uint64_t session_bytes,
                   SessionArenaBytes(*plan, format_defaults_, shape, rounding()));
  const AdmissionLedger ledger = budget_->Snapshot();
  ASSIGN_OR_RETURN(SessionFit fit, FitSessions(ledger, session_bytes));
  ASSIGN_OR_RETURN(TokenFit tokens_now, TotalTokensThatFit(*plan, format_defaults_, shape,
                                                           ledger.free(), rounding()));
  ASSIGN_OR_RETURN(TokenFit tokens_empty, TotalTokensThatFit(*plan, format_defaults_, shape,
                                                             ledger.budget(), rounding()));
  response->set_session_bytes(session_bytes);
  response->set_sessions_now(fit.now);
  response->set_sessions_after_eviction(fit.after_eviction);
  response->set_sessions_when_empty(fit.when_empty);
  response->set_total_tokens_now(tokens_now.total_tokens);
  response->set_total_tokens_when_empty(tokens_empty.total_tokens);
  response->set_free_bytes(ledger.free());
  response->set_evictable_bytes(ledger.evictable());
  response->set_budget_bytes(ledger.budget());
  return absl::OkStatus();
}

absl::Status Daemon::GetMaxContext(const pb::MaxContextRequest& request,
                                   pb::MaxContextResponse* response) {
  ASSIGN_OR_RETURN(std::shared_ptr<const ModelPlan> plan, ResolveModel(request.model()));
  SessionShape shape = SessionShapeFromProto(request.shape());
  const AdmissionLedger ledger = budget_->Snapshot();
  const uint64_t after_eviction =
      ledger.free() + std::min(ledger.evictable(), UINT64_MAX - ledger.free());
  auto max_context = [&](uint64_t bytes) {
    return MaxContextThatFits(*plan, format_defaults_, shape, bytes, rounding());
  };
  ASSIGN_OR_RETURN(uint64_t now, max_context(ledger.free()));
  ASSIGN_OR_RETURN(uint64_t evicted, max_context(after_eviction));
  ASSIGN_OR_RETURN(uint64_t empty, max_context(ledger.budget()));
  response->set_max_context_now(now);
  response->set_max_context_after_eviction(evicted);
  response->set_max_context_when_empty(empty);
  if (now > 0) {
    shape.capacity = now;
    ASSIGN_OR_RETURN(uint64_t bytes, SessionArenaBytes(*plan, format_defaults_, shape, rounding()));
    response->set_session_bytes_now(bytes);
  }
  response->set_free_bytes(ledger.free());
  response->set_evictable_bytes(ledger.evictable());
  response->set_budget_bytes(ledger.budget());
  return absl::OkStatus();
}

absl::Status Daemon::ImportModel(const pb::ImportModelRequest& request,
                                 pb::ImportModelResponse* response) {
  ImportOptions options;
  options.name = request.name();
  options.swa_ring = request.swa_ring();
  if (request.has_index_ring_rows()) options.index_ring_rows = request.index_ring_rows();
  if (request.index_pool() != 0) options.index_pool = request.index_pool();
  ASSIGN_OR_RETURN(ModelPlan plan, ImportHuggingFaceConfig(request.hf_config_json(), options));
  ASSIGN_OR_RETURN(std::string architecture, HuggingFaceArchitecture(request.hf_config_json()));
  response->set_architecture(architecture);
  ASSIGN_OR_RETURN(PlanFingerprint fingerprint, FingerprintModelPlan(plan, format_defaults_));
  *response->mutable_plan() = ModelPlanToProto(plan);
  response->set_plan_fingerprint(FingerprintToBytes(fingerprint));
  if (request.register_()) {
    ASSIGN_OR_RETURN(std::string registered, RegisterValidPlan(std::move(plan)));
    response->set_registered(registered == response->plan_fingerprint());
  }
  return absl::OkStatus();
}

}  // namespace memra
