#include "common/handoff_wire.h"

#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace memra::handoff {
namespace {

void PutU16(std::string& out, uint16_t v) {
  for (int i = 0; i < 2; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint64_t GetLittleEndian(absl::string_view bytes) {
  uint64_t v = 0;
  for (size_t i = bytes.size(); i-- > 0;) v = (v << 8) | static_cast<uint8_t>(bytes[i]);
  return v;
}

// A whole frame: the length prefix, version, kind and body.
std::string MakeFrame(Kind kind, absl::string_view body) {
  std::string frame;
  frame.reserve(kLengthBytes + 2 + body.size());
  PutU32(frame, static_cast<uint32_t>(2 + body.size()));
  frame.push_back(static_cast<char>(kVersion));
  frame.push_back(static_cast<char>(kind));
  frame.append(body.data(), body.size());
  return frame;
}

// Reads a body field by field; every read checks the bytes left.
class BodyReader {
 public:
  BodyReader(absl::string_view what, absl::string_view body) : what_(what), rest_(body) {}

  absl::StatusOr<uint64_t> Integer(absl::string_view field, size_t bytes) {
    if (rest_.size() < bytes) return Short(field, bytes);
    const uint64_t v = GetLittleEndian(rest_.substr(0, bytes));
    rest_.remove_prefix(bytes);
    return v;
  }
  absl::StatusOr<std::string> Bytes(absl::string_view field, size_t bytes) {
    if (rest_.size() < bytes) return Short(field, bytes);
    std::string v(rest_.substr(0, bytes));
    rest_.remove_prefix(bytes);
    return v;
  }
  absl::Status End() const {
    if (rest_.empty()) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("handoff ", what_, ": ", rest_.size(), " bytes left after the last field"));
  }

 private:
  absl::Status Short(absl::string_view field, size_t bytes) const {
    return absl::InvalidArgumentError(absl::StrCat("handoff ", what_, ": ", field, " needs ",
                                                   bytes, " bytes, ", rest_.size(), " are left"));
  }

  const absl::string_view what_;
  absl::string_view rest_;
};

}  // namespace

std::string EncodeTicket(absl::string_view ticket) { return MakeFrame(Kind::kTicket, ticket); }

absl::StatusOr<std::string> EncodeArenaRequest(const ArenaRequest& request) {
  if (request.session_token.size() > kMaxTokenBytes) {
    return absl::InvalidArgumentError(absl::StrCat("handoff arena request: a session token of ",
                                                   request.session_token.size(),
                                                   " bytes; at most ", kMaxTokenBytes));
  }
  if (request.handle.empty() || request.handle.size() > kMaxHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("handoff arena request: an arena handle of ",
                                                   request.handle.size(), " bytes; 1 to ",
                                                   kMaxHandleBytes));
  }
  std::string body;
  PutU64(body, request.session_id);
  body.push_back(static_cast<char>(request.session_token.size()));
  body += request.session_token;
  PutU16(body, static_cast<uint16_t>(request.handle.size()));
  body += request.handle;
  return MakeFrame(Kind::kArenaRequest, body);
}

std::string EncodeArena(uint64_t bytes) {
  std::string body;
  PutU64(body, bytes);
  return MakeFrame(Kind::kArena, body);
}

absl::StatusOr<std::string> EncodeBufferOffer(uint64_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("handoff buffer offer of 0 bytes");
  std::string body;
  PutU64(body, bytes);
  return MakeFrame(Kind::kBufferOffer, body);
}

std::string EncodeBufferId(uint64_t buffer_id) {
  std::string body;
  PutU64(body, buffer_id);
  return MakeFrame(Kind::kBufferId, body);
}

bool KnownKind(uint8_t kind) {
  return (kind >= static_cast<uint8_t>(Kind::kTicket) &&
          kind <= static_cast<uint8_t>(Kind::kStepChannel)) ||
         kind == static_cast<uint8_t>(Kind::kBufferOffer) ||
         kind == static_cast<uint8_t>(Kind::kBufferId);
}

std::string EncodeStepChannelRequest() { return MakeFrame(Kind::kStepChannelRequest, ""); }

std::string EncodeStepChannel(uint64_t region_bytes) {
  std::string body;
  PutU64(body, region_bytes);
  return MakeFrame(Kind::kStepChannel, body);
}

std::string EncodeRefusal(const absl::Status& refusal) {
  absl::string_view message = refusal.message();
  if (message.size() > kMaxMessageBytes) message = message.substr(0, kMaxMessageBytes);
  std::string body;
  PutU32(body, static_cast<uint32_t>(refusal.code()));
  PutU16(body, static_cast<uint16_t>(message.size()));
  body.append(message.data(), message.size());
  return MakeFrame(Kind::kRefusal, body);
}

absl::StatusOr<std::optional<Frame>> TakeFrame(std::string& buffer) {
  if (buffer.size() < kLengthBytes) return std::nullopt;
  const uint64_t length = GetLittleEndian(absl::string_view(buffer).substr(0, kLengthBytes));
  if (length < 2 || length > kMaxFrameBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "handoff frame of ", length, " bytes; a frame holds 2 to ", kMaxFrameBytes));
  }
  if (buffer.size() < kLengthBytes + length) return std::nullopt;
  const uint8_t version = static_cast<uint8_t>(buffer[kLengthBytes]);
  const uint8_t kind = static_cast<uint8_t>(buffer[kLengthBytes + 1]);
  if (version != kVersion) {
    return absl::InvalidArgumentError(absl::StrCat("handoff frame of protocol version ", version,
                                                   "; this side speaks version ", kVersion));
  }
  if (!KnownKind(kind)) {
    return absl::InvalidArgumentError(
        absl::StrCat("handoff frame of unknown kind ", kind, " (kinds are 1 to 6, 16 and 17)"));
  }
  Frame frame{.kind = static_cast<Kind>(kind),
              .body = buffer.substr(kLengthBytes + 2, length - 2)};
  buffer.erase(0, kLengthBytes + length);
  return frame;
}

absl::StatusOr<std::string> DecodeTicket(absl::string_view body) {
  if (body.size() != kTicketBytes) {
    return absl::InvalidArgumentError(absl::StrCat("handoff ticket of ", body.size(),
                                                   " bytes; a ticket is ", kTicketBytes));
  }
  return std::string(body);
}

absl::StatusOr<ArenaRequest> DecodeArenaRequest(absl::string_view body) {
  BodyReader reader("arena request", body);
  ArenaRequest request;
  ASSIGN_OR_RETURN(request.session_id, reader.Integer("session_id", 8));
  ASSIGN_OR_RETURN(const uint64_t token_len, reader.Integer("token_len", 1));
  if (token_len > kMaxTokenBytes) {
    return absl::InvalidArgumentError(absl::StrCat("handoff arena request: a session token of ",
                                                   token_len, " bytes; at most ",
                                                   kMaxTokenBytes));
  }
  ASSIGN_OR_RETURN(request.session_token, reader.Bytes("token", token_len));
  ASSIGN_OR_RETURN(const uint64_t handle_len, reader.Integer("handle_len", 2));
  if (handle_len == 0 || handle_len > kMaxHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("handoff arena request: an arena handle of ",
                                                   handle_len, " bytes; 1 to ",
                                                   kMaxHandleBytes));
  }
  ASSIGN_OR_RETURN(request.handle, reader.Bytes("handle", handle_len));
  RETURN_IF_ERROR(reader.End());
  return request;
}

absl::StatusOr<uint64_t> DecodeArena(absl::string_view body) {
  BodyReader reader("arena", body);
  ASSIGN_OR_RETURN(const uint64_t bytes, reader.Integer("bytes", 8));
  RETURN_IF_ERROR(reader.End());
  return bytes;
}

absl::StatusOr<uint64_t> DecodeBufferOffer(absl::string_view body) {
  BodyReader reader("buffer offer", body);
  ASSIGN_OR_RETURN(const uint64_t bytes, reader.Integer("bytes", 8));
  RETURN_IF_ERROR(reader.End());
  if (bytes == 0) return absl::InvalidArgumentError("handoff buffer offer of 0 bytes");
  return bytes;
}

absl::StatusOr<uint64_t> DecodeBufferId(absl::string_view body) {
  BodyReader reader("buffer id", body);
  ASSIGN_OR_RETURN(const uint64_t id, reader.Integer("buffer_id", 8));
  RETURN_IF_ERROR(reader.End());
  return id;
}

absl::StatusOr<StepChannelRequest> DecodeStepChannelRequest(absl::string_view body) {
  RETURN_IF_ERROR(BodyReader("step channel request", body).End());
  return StepChannelRequest{};
}

absl::StatusOr<uint64_t> DecodeStepChannel(absl::string_view body) {
  BodyReader reader("step channel", body);
  ASSIGN_OR_RETURN(const uint64_t bytes, reader.Integer("region_bytes", 8));
  RETURN_IF_ERROR(reader.End());
  return bytes;
}

absl::Status DecodeRefusal(absl::string_view body) {
  BodyReader reader("refusal", body);
  ASSIGN_OR_RETURN(const uint64_t code, reader.Integer("code", 4));
  ASSIGN_OR_RETURN(const uint64_t length, reader.Integer("message_len", 2));
  ASSIGN_OR_RETURN(std::string message, reader.Bytes("message", length));
  RETURN_IF_ERROR(reader.End());
  const bool known =
      code >= 1 && code <= static_cast<uint64_t>(absl::StatusCode::kUnauthenticated);
  return absl::Status(known ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kUnknown,
                      message);
}

absl::Status SendFrame(int socket, absl::string_view frame, absl::Span<const int> pass_fds) {
  if (pass_fds.size() > kMaxDescriptors) {
    return absl::InvalidArgumentError(absl::StrCat("handoff socket: a frame carries at most ",
                                                   kMaxDescriptors, " descriptors, not ",
                                                   pass_fds.size()));
  }
  iovec io{.iov_base = const_cast<char*>(frame.data()), .iov_len = frame.size()};
  msghdr message{};
  message.msg_iov = &io;
  message.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxDescriptors)] = {};
  if (!pass_fds.empty()) {
    message.msg_control = control;
    message.msg_controllen = CMSG_SPACE(sizeof(int) * pass_fds.size());
    cmsghdr* header = CMSG_FIRSTHDR(&message);
    header->cmsg_level = SOL_SOCKET;
    header->cmsg_type = SCM_RIGHTS;
    header->cmsg_len = CMSG_LEN(sizeof(int) * pass_fds.size());
    std::memcpy(CMSG_DATA(header), pass_fds.data(), sizeof(int) * pass_fds.size());
  }
  ssize_t sent;
  do {
    sent = sendmsg(socket, &message, MSG_NOSIGNAL);
  } while (sent < 0 && errno == EINTR);
  if (sent < 0) {
    return absl::UnavailableError(
        absl::StrCat("handoff socket: sending a ", frame.size(), "-byte frame: ", strerror(errno)));
  }
  if (static_cast<size_t>(sent) != frame.size()) {
    return absl::UnavailableError(absl::StrCat("handoff socket: only ", sent, " of a ",
                                               frame.size(), "-byte frame went out"));
  }
  return absl::OkStatus();
}

absl::StatusOr<size_t> ReceiveBytes(int socket, absl::Span<char> buffer,
                                    std::vector<ScopedFd>* received) {
  iovec io{.iov_base = buffer.data(), .iov_len = buffer.size()};
  // Room for more than a frame carries, so a sender's extras are received (and closed), not cut
  // (MSG_CTRUNC would leak nothing, but would hide that they were sent).
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * (kMaxDescriptors + 2))];
  msghdr message{};
  message.msg_iov = &io;
  message.msg_iovlen = 1;
  message.msg_control = control;
  message.msg_controllen = sizeof(control);
  ssize_t got;
  do {
    got = recvmsg(socket, &message, MSG_CMSG_CLOEXEC);
  } while (got < 0 && errno == EINTR);
  if (got < 0) {
    const int err = errno;
    absl::Status failed =
        absl::UnavailableError(absl::StrCat("handoff socket: recvmsg: ", strerror(err)));
    errno = err;  // a non-blocking reader tells EAGAIN from a failure by it
    return failed;
  }
  for (cmsghdr* header = CMSG_FIRSTHDR(&message); header != nullptr;
       header = CMSG_NXTHDR(&message, header)) {
    if (header->cmsg_level != SOL_SOCKET || header->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (header->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(header) + i * sizeof(int), sizeof(int));
      if (received->size() < kMaxDescriptors) {
        received->emplace_back(fd);
      } else {
        ScopedFd extra(fd);  // more than a frame carries: closed
      }
    }
  }
  return static_cast<size_t>(got);
}

}  // namespace memra::handoff
