#include "tests/hostile_engines.h"

#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/internal.h"
#include "common/errors.h"
#include "common/grpc_status.h"
#include "common/handoff_wire.h"
#include "core/status_macros.h"
#include "proto/memra/kv/v1/admin.grpc.pb.h"
#include "server/edge/model_config_bounds.h"

namespace memra::testing {

namespace pb = ::memra::kv::v1;

absl::Status SendUnreadArenaRequests(KvClient& client, const Session& session, int count) {
  handoff::ArenaRequest request;
  request.session_id = session.id();
  request.session_token = ClientInternals::Ref(session).session_token();
  request.handle = session.layout().arenas.at(0).handle;
  ASSIGN_OR_RETURN(std::string frame, handoff::EncodeArenaRequest(request));
  const int socket = ClientInternals::HandoffSocket(client);
  if (socket < 0) return absl::FailedPreconditionError("the engine has no handoff connection");
  for (int i = 0; i < count; ++i) RETURN_IF_ERROR(handoff::SendFrame(socket, frame));
  return absl::OkStatus();
}

std::string OversizeModelConfig() { return std::string(kMaxModelConfigBytes + 1, '['); }

std::string OverdeepModelConfig() { return std::string(100'000, '['); }

absl::Status GetCostOf(KvClient& client, const std::string& config) {
  pb::CostRequest request;
  request.mutable_model()->set_hf_config_json(config);
  request.mutable_shape()->set_capacity(128);
  pb::CostResponse response;
  return FromGrpcStatus(ClientInternals::Admin(client).GetCost(
      ClientInternals::NewContext(client).get(), request, &response));
}

absl::Status ImportModelOf(KvClient& client, const std::string& config) {
  pb::ImportModelRequest request;
  request.set_hf_config_json(config);
  pb::ImportModelResponse response;
  return FromGrpcStatus(ClientInternals::Admin(client).ImportModel(
      ClientInternals::NewContext(client).get(), request, &response));
}

char TryConnection(const char* path, int* fd) {
  *fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (*fd < 0) return 'E';
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::strncpy(address.sun_path, path, sizeof(address.sun_path) - 1);
  if (connect(*fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) return 'E';
  static constexpr char kPreface[] =
      "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";  // + SETTINGS, empty
  // MSG_NOSIGNAL: a connection the daemon already closed at the door is EPIPE, not SIGPIPE.
  if (send(*fd, kPreface, sizeof(kPreface) - 1, MSG_NOSIGNAL) !=
      static_cast<ssize_t>(sizeof(kPreface) - 1)) {
    return 'C';  // closed before the preface went out
  }
  char reply[64];
  const ssize_t got = read(*fd, reply, sizeof(reply));
  return got > 0 ? 'S' : got == 0 || errno == ECONNRESET ? 'C' : 'E';
}

std::unique_ptr<EventStream> SubscribeEvents(KvClient& client, absl::Duration deadline) {
  auto stream = std::make_unique<EventStream>();
  pb::SubscribePrefixEventsRequest request;
  if (absl::StatusOr<pb::EngineRef> engine = ClientInternals::Engine(client); engine.ok()) {
    *request.mutable_engine() = *engine;
  }
  stream->context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  stream->reader = ClientInternals::Prefix(client).SubscribeEvents(&stream->context, request);
  stream->reader->WaitForInitialMetadata();
  return stream;
}

absl::Status EndOf(EventStream& stream) {
  pb::PrefixEvent event;
  while (stream.reader->Read(&event)) {
  }
  return FromGrpcStatus(stream.reader->Finish());
}

absl::StatusOr<KeptArena> KeptArena::Keep(KvClient& client, const Session& session,
                                          uint8_t fill) {
  const SessionArena& arena = session.layout().arenas.at(0);
  ASSIGN_OR_RETURN(ArenaFd fetched,
                   ClientInternals::FetchArenaFd(client, session.id(),
                                                 ClientInternals::Ref(session).session_token(),
                                                 arena.handle));
  void* mapped = mmap(nullptr, fetched.bytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                      fetched.fd.get(), 0);
  if (mapped == MAP_FAILED) {
    return PosixError(absl::StrCat("mapping a kept arena of ", fetched.bytes, " bytes"), errno);
  }
  std::memset(mapped, fill, fetched.bytes);
  return KeptArena(std::move(fetched.fd), static_cast<uint8_t*>(mapped), fetched.bytes);
}

KeptArena::KeptArena(KeptArena&& other) noexcept
    : fd_(std::move(other.fd_)),
      data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)) {}

KeptArena& KeptArena::operator=(KeptArena&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) munmap(data_, bytes_);
    fd_ = std::move(other.fd_);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

KeptArena::~KeptArena() {
  if (data_ != nullptr) munmap(data_, bytes_);
}

absl::StatusOr<uint64_t> KeptArena::AllocatedBytes() const {
  struct stat info {};
  if (fstat(fd_.get(), &info) != 0) return PosixError("fstat of a kept arena", errno);
  return static_cast<uint64_t>(info.st_blocks) * 512;
}

}  // namespace memra::testing
