#include "client/handoff_channel.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/status_macros.h"

namespace memra {

absl::StatusOr<std::unique_ptr<HandoffChannel>> HandoffChannel::Connect(const std::string& path,
                                                                         absl::Duration deadline) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (path.size() >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("handoff socket path ", path, " is ",
                                                   path.size(), " bytes; the limit is ",
                                                   sizeof(address.sun_path) - 1));
  }
  std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
  ScopedFd socket(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (socket.get() < 0) {
    return absl::UnavailableError(absl::StrCat("handoff socket: socket(): ", strerror(errno)));
  }
  if (connect(socket.get(), reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    return absl::UnavailableError(absl::StrCat("memra-kvd's handoff socket ", path,
                                               " does not answer: ", strerror(errno)));
  }
  std::unique_ptr<HandoffChannel> channel(new HandoffChannel(std::move(socket), path, deadline));
  absl::MutexLock lock(&channel->mu_);
  std::vector<ScopedFd> unexpected;
  ASSIGN_OR_RETURN(handoff::Frame frame, channel->ReadFrame(&unexpected));
  if (frame.kind == handoff::Kind::kRefusal) return handoff::DecodeRefusal(frame.body);
  if (frame.kind != handoff::Kind::kTicket) {
    return absl::InternalError(absl::StrCat("handoff socket ", path,
                                            ": the first frame is of kind ",
                                            static_cast<int>(frame.kind), ", not a ticket"));
  }
  ASSIGN_OR_RETURN(channel->ticket_, handoff::DecodeTicket(frame.body));
  return channel;
}

absl::StatusOr<handoff::Frame> HandoffChannel::Exchange(absl::string_view frame,
                                                       handoff::Kind expected,
                                                       std::vector<ScopedFd>* received,
                                                       absl::Span<const int> pass_fds) {
  if (absl::Status sent = handoff::SendFrame(socket_.get(), frame, pass_fds); !sent.ok()) {
    return absl::UnavailableError(absl::StrCat("handoff socket ", path_,
                                               ": the daemon closed the connection (",
                                               sent.message(), ")"));
  }
  ASSIGN_OR_RETURN(handoff::Frame answer, ReadFrame(received));
  if (answer.kind == handoff::Kind::kRefusal) return handoff::DecodeRefusal(answer.body);
  if (answer.kind != expected) {
    return absl::InternalError(absl::StrCat("handoff socket ", path_, ": an answer of kind ",
                                            static_cast<int>(answer.kind), ", expected ",
                                            static_cast<int>(expected)));
  }
  return answer;
}

absl::StatusOr<ArenaFd> HandoffChannel::FetchArena(const handoff::ArenaRequest& request) {
  ASSIGN_OR_RETURN(std::string frame, handoff::EncodeArenaRequest(request));
  absl::MutexLock lock(&mu_);
  std::vector<ScopedFd> fds;
  ASSIGN_OR_RETURN(handoff::Frame answer, Exchange(frame, handoff::Kind::kArena, &fds));
  ASSIGN_OR_RETURN(const uint64_t bytes, handoff::DecodeArena(answer.body));
  if (fds.size() != 1) {
    return absl::DataLossError(absl::StrCat("handoff socket ", path_, ": the arena answer for \"",
                                            request.handle, "\" came with ", fds.size(),
                                            " descriptors, not 1"));
  }
  return ArenaFd{.fd = std::move(fds[0]), .bytes = bytes};
}

absl::StatusOr<handoff::StepChannelFds> HandoffChannel::OpenStepChannel() {
  absl::MutexLock lock(&mu_);
  std::vector<ScopedFd> fds;
  ASSIGN_OR_RETURN(
      handoff::Frame answer,
      Exchange(handoff::EncodeStepChannelRequest(), handoff::Kind::kStepChannel, &fds));
  ASSIGN_OR_RETURN(const uint64_t bytes, handoff::DecodeStepChannel(answer.body));
  if (fds.size() != 2) {
    return absl::DataLossError(absl::StrCat("handoff socket ", path_,
                                            ": the step channel answer came with ", fds.size(),
                                            " descriptors, not 2"));
  }
  return handoff::StepChannelFds{.region = ArenaFd{.fd = std::move(fds[0]), .bytes = bytes},
                        .wake = std::move(fds[1])};
}

absl::StatusOr<uint64_t> HandoffChannel::OfferBuffer(int fd, uint64_t bytes) {
  ASSIGN_OR_RETURN(std::string frame, handoff::EncodeBufferOffer(bytes));
  absl::MutexLock lock(&mu_);
  std::vector<ScopedFd> unexpected;  // the daemon sends no descriptor with this answer: closed
  // fd -1 sends the offer without a descriptor (the daemon refuses it; tests).
  const absl::Span<const int> pass_fds =
      fd >= 0 ? absl::Span<const int>(&fd, 1) : absl::Span<const int>();
  ASSIGN_OR_RETURN(handoff::Frame answer,
                   Exchange(frame, handoff::Kind::kBufferId, &unexpected, pass_fds));
  return handoff::DecodeBufferId(answer.body);
}

absl::StatusOr<handoff::Frame> HandoffChannel::ReadFrame(std::vector<ScopedFd>* received) {
  const absl::Time give_up = absl::Now() + deadline_;
  while (true) {
    ASSIGN_OR_RETURN(std::optional<handoff::Frame> frame, handoff::TakeFrame(input_));
    if (frame.has_value()) return *std::move(frame);
    const int64_t wait_ms = absl::ToInt64Milliseconds(give_up - absl::Now());
    pollfd polled{.fd = socket_.get(), .events = POLLIN, .revents = 0};
    const int ready = wait_ms > 0 ? poll(&polled, 1, static_cast<int>(wait_ms)) : 0;
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) {
      return absl::UnavailableError(absl::StrCat("handoff socket ", path_, ": no answer within ",
                                                 absl::FormatDuration(deadline_)));
    }
    char data[handoff::kLengthBytes + handoff::kMaxFrameBytes];
    absl::StatusOr<size_t> got = handoff::ReceiveBytes(socket_.get(), data, received);
    if (!got.ok() || *got == 0) {  // a reset is a close with our request unread
      return absl::UnavailableError(absl::StrCat(
          "handoff socket ", path_, ": the daemon closed the connection",
          got.ok() ? std::string() : absl::StrCat(" (", got.status().message(), ")")));
    }
    input_.append(data, *got);
  }
}

}  // namespace memra
