#include "tools/kvctl_connection.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "common/errors.h"
#include "core/status_macros.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"

namespace memra::kvctl {

namespace pb = ::memra::kv::v1;

std::string UnreachableHint(const std::string& socket_path, absl::StatusCode code) {
  if (code == absl::StatusCode::kPermissionDenied) {
    return "the admin socket is for operators (mode 0600: root; the daemon's admin_socket_group "
           "and admin_socket_mode widen it): run memra-kvctl with sudo";
  }
  int gpu = -1;
  absl::string_view rest = socket_path;
  std::string unit = "memra-kvd@<gpu>";
  if (absl::ConsumePrefix(&rest, "/run/memra-kv/gpu") &&
      (absl::ConsumeSuffix(&rest, ".admin.sock") || absl::ConsumeSuffix(&rest, ".sock")) &&
      absl::SimpleAtoi(rest, &gpu) && gpu >= 0) {
    unit = absl::StrCat("memra-kvd@", gpu);
  }
  return absl::StrCat("is the daemon running? systemctl status ", unit);
}

namespace {

// A plain connect(2): a missing socket, a permission problem or a stale socket file (no
// listener) is named at once, where gRPC would retry quietly until the deadline.
absl::Status ProbeSocket(const std::string& path) {
  sockaddr_un address{};
  if (path.size() >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("socket path is ", path.size(),
                                                   " bytes; Unix sockets allow ",
                                                   sizeof(address.sun_path) - 1));
  }
  address.sun_family = AF_UNIX;
  path.copy(address.sun_path, path.size());
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return PosixError("socket(AF_UNIX)", errno);
  const int result = connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address));
  const int connect_errno = errno;
  close(fd);
  if (result != 0) return PosixError(absl::StrCat("connect ", path), connect_errno);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Connection> Connect(const Invocation& invocation) {
  Connection connection;
  connection.deadline =
      std::chrono::system_clock::now() + absl::ToChronoMilliseconds(invocation.timeout);
  RETURN_IF_ERROR(ProbeSocket(invocation.socket_path));
  std::shared_ptr<grpc::Channel> channel = grpc::CreateChannel(
      absl::StrCat("unix:", invocation.socket_path), grpc::InsecureChannelCredentials());
  if (!channel->WaitForConnected(connection.deadline)) {
    return absl::DeadlineExceededError(
        absl::StrCat("no gRPC connection within ", absl::FormatDuration(invocation.timeout)));
  }
  connection.stub = pb::KvAdmin::NewStub(channel);
  connection.prefix_stub = pb::KvPrefixCache::NewStub(channel);
  connection.group_stub = pb::KvGroup::NewStub(channel);
  return connection;
}

}  // namespace memra::kvctl
