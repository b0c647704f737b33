#include "server/edge/arena_handoff.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/errors.h"
#include "core/status_macros.h"
#include "server/base/secret_token.h"
#include "server/base/unix_socket.h"
#include "spdlog/spdlog.h"

namespace memra {
namespace {

constexpr size_t kReadChunkBytes = 4096;
// Bytes read from one connection per round: the rest waits in the kernel for the next round, so
// one busy engine cannot keep the thread from the others.
constexpr size_t kMaxReadPerRound = 16 * 1024;
constexpr int kMaxPollMs = 1000;
// How long the listener rests after accept ran out of descriptors.
constexpr int kAcceptBackoffMs = 100;
constexpr size_t kTicketWordBytes = 8;
// The secret's offset in a ticket: after the instance and the connection number.
constexpr size_t kTicketSecretAt = 2 * kTicketWordBytes;
static_assert(handoff::kTicketBytes > kTicketSecretAt);

// A ticket: u64 instance | u64 connection | the connection's secret (handoff_wire.h).
std::string TicketFor(uint64_t instance, uint64_t connection, absl::string_view secret) {
  std::string ticket;
  for (uint64_t word : {instance, connection}) {
    for (size_t i = 0; i < kTicketWordBytes; ++i) {
      ticket.push_back(static_cast<char>((word >> (8 * i)) & 0xff));
    }
  }
  ticket.append(secret.data(), secret.size());
  return ticket;
}

// The little-endian u64 at `at` of a ticket. REQUIRES: at + 8 <= ticket.size().
uint64_t TicketWord(absl::string_view ticket, size_t at) {
  uint64_t word = 0;
  for (size_t i = kTicketWordBytes; i-- > 0;) {
    word = (word << 8) | static_cast<uint8_t>(ticket[at + i]);
  }
  return word;
}

int64_t Milliseconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(d).count();
}

}  // namespace

ArenaHandoff::ArenaHandoff(Options options, ArenaLookup lookup, BufferIntake intake,
                           StepChannelOpener open_step_channel)
    : options_(std::move(options)),
      lookup_(std::move(lookup)),
      intake_(std::move(intake)),
      open_step_channel_(std::move(open_step_channel)) {}

ArenaHandoff::~ArenaHandoff() { Stop(); }

absl::Status ArenaHandoff::Start() {
  {
    absl::MutexLock lock(&mu_);
    if (started_) return absl::FailedPreconditionError("the handoff socket was already started");
  }
  ASSIGN_OR_RETURN(ScopedFd listener, ListenOnUnixSocket(options_.path, options_.group,
                                                         options_.mode, "handoff socket"));
  ScopedFd wake(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (wake.get() < 0) {
    const int err = errno;
    unlink(options_.path.c_str());
    return PosixError("eventfd for the handoff socket", err);
  }
  listener_ = std::move(listener);
  wake_ = std::move(wake);
  {
    absl::MutexLock lock(&mu_);
    started_ = true;
  }
  thread_ = std::thread([this] { Serve(); });
  return absl::OkStatus();
}

void ArenaHandoff::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (!started_ || stopping_) return;
    stopping_ = true;
  }
  Wake();
  if (thread_.joinable()) thread_.join();
  absl::MutexLock lock(&mu_);
  connections_.clear();  // closes every descriptor
  listener_ = ScopedFd();
  unlink(options_.path.c_str());
}

void ArenaHandoff::Wake() {
  const uint64_t one = 1;
  if (wake_.get() >= 0) (void)!write(wake_.get(), &one, sizeof(one));
}

absl::StatusOr<HandoffClaim> ArenaHandoff::ClaimTicket(absl::string_view ticket) {
  if (ticket.empty()) {
    return absl::PermissionDeniedError(absl::StrCat(
        "Attach carries no handoff ticket: connect to the handoff socket ", options_.path,
        " first and attach with the ticket it answers (docs/handoff.md)"));
  }
  if (ticket.size() != handoff::kTicketBytes) {
    return absl::PermissionDeniedError(absl::StrCat("an attach ticket is ",
                                                    handoff::kTicketBytes, " bytes, got ",
                                                    ticket.size()));
  }
  // Another daemon's ticket first: connection numbers start at 1 in every daemon, so only the
  // instance tells a ticket of the daemon that died from one of this daemon. The engine did
  // nothing wrong (its re-attach straddled a restart): it retries with a fresh ticket.
  if (const uint64_t instance = TicketWord(ticket, 0); instance != options_.instance) {
    return absl::UnavailableError(absl::StrCat(
        "the attach ticket was issued by memra-kvd instance (epoch) ", instance,
        "; this daemon is instance ", options_.instance,
        " (the daemon restarted since): connect to the handoff socket again for a fresh ticket"));
  }
  const uint64_t id = TicketWord(ticket, kTicketWordBytes);
  absl::MutexLock lock(&mu_);
  auto it = connections_.find(id);
  if (it == connections_.end() || it->second.closing) {
    return absl::PermissionDeniedError(
        absl::StrCat("the attach ticket names handoff connection ", id,
                     ", which is not open (a ticket is valid while its connection is)"));
  }
  Connection& connection = it->second;
  if (!TokensEqual(ticket.substr(kTicketSecretAt), connection.secret)) {
    return absl::PermissionDeniedError(
        absl::StrCat("the attach ticket for handoff connection ", id, " does not match"));
  }
  if (connection.claimed) {
    return absl::PermissionDeniedError(
        absl::StrCat("the ticket of handoff connection ", id, " was already used (engine ",
                     connection.engine_id, "); a ticket attaches one engine"));
  }
  connection.claimed = true;
  return HandoffClaim{.connection = id, .peer = connection.peer};
}

void ArenaHandoff::BindEngine(uint64_t connection, uint64_t engine_id) {
  bool superseded = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = connections_.find(connection);
    if (it == connections_.end()) return;
    it->second.engine_id = engine_id;
    // One connection per engine: a re-attach's connection supersedes the earlier one, so an
    // engine cannot collect slots and an old process stops receiving descriptors.
    for (auto& [id, other] : connections_) {
      if (id != connection && other.engine_id == engine_id) {
        other.closing = true;
        superseded = true;
      }
    }
  }
  if (superseded) Wake();
}

void ArenaHandoff::ForgetEngine(uint64_t engine_id) {
  bool found = false;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, connection] : connections_) {
      if (connection.engine_id == engine_id) {
        connection.closing = true;
        found = true;
      }
    }
  }
  if (found) Wake();
}

size_t ArenaHandoff::connection_count() const {
  absl::MutexLock lock(&mu_);
  return connections_.size();
}

bool ArenaHandoff::ServesEngine(uint64_t connection, uint64_t engine_id) const {
  absl::MutexLock lock(&mu_);
  auto it = connections_.find(connection);
  return it != connections_.end() && !it->second.closing && it->second.engine_id == engine_id;
}

void ArenaHandoff::Close(uint64_t id) { connections_.erase(id); }

void ArenaHandoff::Serve() {
  std::vector<pollfd> polled;
  std::vector<uint64_t> polled_ids;
  std::vector<PendingRequest> pending;
  std::vector<uint64_t> to_close;
  while (true) {
    polled.clear();
    polled_ids.clear();
    int timeout_ms = kMaxPollMs;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      const SteadyTime now = std::chrono::steady_clock::now();
      to_close.clear();
      for (auto& [id, connection] : connections_) {
        // The deadlines: a stalled request, an unclaimed ticket. Past one, the connection gets
        // its refusal and is closed.
        std::chrono::steady_clock::duration left = std::chrono::milliseconds(kMaxPollMs);
        auto enforce = [&](SteadyTime since, absl::Duration limit, absl::string_view what) {
          const SteadyTime deadline = since + absl::ToChronoMilliseconds(limit);
          if (now >= deadline && !connection.closing) {
            (void)handoff::SendFrame(
                connection.socket.get(),
                handoff::EncodeRefusal(absl::DeadlineExceededError(
                    absl::StrCat(what, " within ", absl::ToInt64Milliseconds(limit),
                                 " ms; closing the connection"))));
            connection.closing = true;
          }
          left = std::min(left, deadline - now);
        };
        if (!connection.input.empty()) {
          enforce(connection.input_since, options_.request_deadline,
                  "handoff request not complete");
        }
        // Until an engine is bound, not merely until the ticket is claimed: an Attach refused
        // after its claim (scope, limits, draining) must not hold a slot for ever.
        if (connection.engine_id == 0) {
          enforce(connection.accepted, options_.claim_deadline,
                  "no engine attached with this connection's ticket");
        }
        if (connection.closing) {
          to_close.push_back(id);
          continue;
        }
        timeout_ms = std::clamp<int>(static_cast<int>(Milliseconds(left)) + 1, 1, timeout_ms);
        polled.push_back({.fd = connection.socket.get(), .events = POLLIN, .revents = 0});
        polled_ids.push_back(id);
      }
      for (uint64_t id : to_close) Close(id);
    }
    // Out of descriptors, the listener stays readable: it is left out of the poll for
    // kAcceptBackoff instead of spinning on accept's EMFILE.
    const bool backing_off = std::chrono::steady_clock::now() < accept_resumes_;
    if (backing_off) timeout_ms = std::min<int>(timeout_ms, kAcceptBackoffMs);
    polled.push_back({.fd = backing_off ? -1 : listener_.get(), .events = POLLIN, .revents = 0});
    polled.push_back({.fd = wake_.get(), .events = POLLIN, .revents = 0});
    const int ready = poll(polled.data(), polled.size(), timeout_ms);
    if (ready < 0) {
      if (errno != EINTR) spdlog::error("handoff socket: poll: {}", strerror(errno));
      continue;
    }
    if (polled[polled.size() - 1].revents != 0) {
      uint64_t count;
      (void)!read(wake_.get(), &count, sizeof(count));
    }
    if (polled[polled.size() - 2].revents != 0) AcceptAll();
    pending.clear();
    to_close.clear();
    {
      absl::MutexLock lock(&mu_);
      for (size_t i = 0; i < polled_ids.size(); ++i) {
        if (polled[i].revents == 0) continue;
        auto it = connections_.find(polled_ids[i]);
        if (it == connections_.end()) continue;
        // Forgotten since the poll began: closed without reading what it sent.
        if (it->second.closing || !ReadFrom(it->first, it->second, pending)) {
          to_close.push_back(it->first);
        }
      }
    }
    // Answered with no lock held: the lookup takes the session registry's locks. The
    // descriptors stay open meanwhile (only this thread closes them).
    for (PendingRequest& request : pending) {
      if (!Answer(request)) to_close.push_back(request.connection);
    }
    if (!to_close.empty()) {
      absl::MutexLock lock(&mu_);
      for (uint64_t id : to_close) Close(id);
    }
  }
}

void ArenaHandoff::AcceptAll() {
  // At most kAcceptsPerRound a round: a client connecting as fast as it can (each one refused)
  // must not keep this thread from serving the connections already open. The listener stays
  // readable, so the next poll round takes the rest.
  for (int accepted = 0; accepted < kAcceptsPerRound; ++accepted) {
    ScopedFd socket(accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (socket.get() < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        spdlog::warn("handoff socket: accept: {}; next accept in {} ms", strerror(errno),
                     kAcceptBackoffMs);
        accept_resumes_ =
            std::chrono::steady_clock::now() + std::chrono::milliseconds(kAcceptBackoffMs);
      } else if (errno != EAGAIN && errno != EWOULDBLOCK) {
        spdlog::warn("handoff socket: accept: {}", strerror(errno));
      }
      return;
    }
    ucred credentials{};
    socklen_t length = sizeof(credentials);
    if (getsockopt(socket.get(), SOL_SOCKET, SO_PEERCRED, &credentials, &length) != 0) {
      spdlog::warn("handoff socket: SO_PEERCRED: {}", strerror(errno));
      continue;
    }
    absl::MutexLock lock(&mu_);
    // The limit first: a refused connection costs no random token.
    if (connections_.size() >= options_.max_connections) {
      (void)handoff::SendFrame(
          socket.get(), handoff::EncodeRefusal(absl::ResourceExhaustedError(absl::StrCat(
                            "the handoff socket serves ", connections_.size(),
                            " connections and the limit is ", options_.max_connections,
                            " (", options_.max_connections_source, ")"))));
      continue;
    }
    const size_t unbound = static_cast<size_t>(
        std::count_if(connections_.begin(), connections_.end(), [&](const auto& entry) {
          return entry.second.engine_id == 0 && entry.second.peer.uid == credentials.uid;
        }));
    if (unbound >= options_.max_unbound_per_uid) {
      (void)handoff::SendFrame(
          socket.get(), handoff::EncodeRefusal(absl::ResourceExhaustedError(absl::StrCat(
                            "uid ", credentials.uid, " holds ", unbound,
                            " handoff connections with no engine attached; the limit is ",
                            options_.max_unbound_per_uid, " (attach with the tickets first)"))));
      continue;
    }
    absl::StatusOr<std::string> secret = RandomSecretToken();
    if (!secret.ok()) {
      (void)handoff::SendFrame(socket.get(), handoff::EncodeRefusal(secret.status()));
      continue;
    }
    const uint64_t id = next_connection_++;
    if (!handoff::SendFrame(socket.get(), handoff::EncodeTicket(TicketFor(options_.instance, id, *secret))).ok()) {
      continue;
    }
    Connection& connection = connections_[id];
    connection.socket = std::move(socket);
    connection.peer = PeerCredentials{credentials.uid, credentials.gid, credentials.pid};
    connection.secret = *std::move(secret);
    connection.accepted = std::chrono::steady_clock::now();
  }
}

bool ArenaHandoff::ReadFrom(uint64_t id, Connection& connection,
                            std::vector<PendingRequest>& pending) {
  char chunk[kReadChunkBytes];
  for (size_t total = 0; total < kMaxReadPerRound;) {
    std::vector<ScopedFd> received;
    absl::StatusOr<size_t> got =
        handoff::ReceiveBytes(connection.socket.get(), absl::MakeSpan(chunk), &received);
    if (!got.ok()) return errno == EAGAIN || errno == EWOULDBLOCK;
    if (*got == 0) return false;  // the engine closed its side
    // A descriptor arrives with the bytes of the frame it was sent with, so offers take them in
    // order; past the bound (offers never sent) they are closed.
    for (ScopedFd& fd : received) {
      if (connection.descriptors.size() < kMaxPendingDescriptors) {
        connection.descriptors.push_back(std::move(fd));
      }
    }
    const ssize_t n = static_cast<ssize_t>(*got);
    total += static_cast<size_t>(n);
    bool deadline_restarts = connection.input.empty();
    connection.input.append(chunk, static_cast<size_t>(n));
    while (true) {
      absl::StatusOr<std::optional<handoff::Frame>> frame = handoff::TakeFrame(connection.input);
      const auto engine_kind = [](handoff::Kind kind) {
        return kind == handoff::Kind::kArenaRequest ||
               kind == handoff::Kind::kStepChannelRequest || kind == handoff::Kind::kBufferOffer;
      };
      if (!frame.ok() || (frame->has_value() && !engine_kind((*frame)->kind))) {
        // Unparseable, or a kind only the daemon sends: refused, then closed.
        absl::Status refusal =
            frame.ok() ? absl::InvalidArgumentError(absl::StrCat(
                             "handoff: an engine sends only arena requests (kind 2), step "
                             "channel requests (kind 5) and buffer offers (kind 16), got kind ",
                             static_cast<int>((*frame)->kind)))
                       : frame.status();
        pending.push_back({.connection = id,
                           .socket = connection.socket.get(),
                           .engine_id = connection.engine_id,
                           .request = std::move(refusal)});
        connection.input.clear();
        return true;  // the refusal is sent before the close (Serve)
      }
      if (!frame->has_value()) break;
      deadline_restarts = true;  // whatever is left is the start of the next request
      PendingRequest request{.connection = id,
                             .socket = connection.socket.get(),
                             .engine_id = connection.engine_id,
                             .request = absl::UnknownError("not decoded")};
      switch ((*frame)->kind) {
        case handoff::Kind::kArenaRequest: {
          absl::StatusOr<handoff::ArenaRequest> arena =
              handoff::DecodeArenaRequest((*frame)->body);
          if (arena.ok()) {
            request.request = *std::move(arena);
          } else {
            request.request = arena.status();
          }
          break;
        }
        case handoff::Kind::kStepChannelRequest: {
          absl::StatusOr<handoff::StepChannelRequest> channel =
              handoff::DecodeStepChannelRequest((*frame)->body);
          if (channel.ok()) {
            request.request = *channel;
          } else {
            request.request = channel.status();
          }
          break;
        }
        default: {  // kBufferOffer (engine_kind)
          absl::StatusOr<uint64_t> bytes = handoff::DecodeBufferOffer((*frame)->body);
          if (!bytes.ok()) {
            request.request = bytes.status();
            break;
          }
          PendingRequest::BufferOffer offer{.bytes = *bytes, .fd = ScopedFd()};
          if (!connection.descriptors.empty()) {
            offer.fd = std::move(connection.descriptors.front());
            connection.descriptors.pop_front();
          }
          request.request = std::move(offer);
          break;
        }
      }
      pending.push_back(std::move(request));
      if (!pending.back().request.ok()) {
        connection.input.clear();
        return true;
      }
    }
    if (deadline_restarts && !connection.input.empty()) {
      connection.input_since = std::chrono::steady_clock::now();
    }
  }
  return true;
}

bool ArenaHandoff::Answer(PendingRequest& pending) {
  if (!pending.request.ok()) {
    (void)handoff::SendFrame(pending.socket, handoff::EncodeRefusal(pending.request.status()));
    return false;
  }
  if (pending.engine_id == 0) {
    return handoff::SendFrame(pending.socket,
                              handoff::EncodeRefusal(absl::FailedPreconditionError(
                                  "this handoff connection has no engine yet: Attach with its "
                                  "ticket first")))
        .ok();
  }
  if (std::holds_alternative<PendingRequest::BufferOffer>(*pending.request)) {
    return AnswerOffer(pending);
  }
  if (absl::Status admitted = AdmitDescriptorAnswer(pending); !admitted.ok()) {
    return handoff::SendFrame(pending.socket, handoff::EncodeRefusal(admitted)).ok();
  }
  if (std::holds_alternative<handoff::StepChannelRequest>(*pending.request)) {
    return AnswerStepChannel(pending.socket, pending.engine_id);
  }
  absl::StatusOr<ArenaFd> arena =
      lookup_(pending.engine_id, std::get<handoff::ArenaRequest>(*pending.request));
  if (!arena.ok()) {
    return handoff::SendFrame(pending.socket, handoff::EncodeRefusal(arena.status())).ok();
  }
  arenas_handed_.fetch_add(1, std::memory_order_relaxed);
  return handoff::SendFrame(pending.socket, handoff::EncodeArena(arena->bytes), {arena->fd.get()})
      .ok();
}

absl::Status ArenaHandoff::AdmitDescriptorAnswer(const PendingRequest& pending) {
  int unsent = 1;  // SIOCOUTQ unknown: count as unread
  if (ioctl(pending.socket, SIOCOUTQ, &unsent) != 0) unsent = 1;
  absl::MutexLock lock(&mu_);
  auto it = connections_.find(pending.connection);
  if (it == connections_.end()) return absl::NotFoundError("the handoff connection was closed");
  size_t& unread = it->second.unread_descriptor_answers;
  if (unsent == 0) unread = 0;  // the engine read everything sent so far
  if (unread >= kMaxUnreadDescriptorAnswers) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "engine ", pending.engine_id, " has not read ", unread,
        " answers carrying descriptors on this handoff connection and the limit is ",
        kMaxUnreadDescriptorAnswers, " (kMaxUnreadDescriptorAnswers): read them first"));
  }
  ++unread;
  return absl::OkStatus();
}

bool ArenaHandoff::AnswerStepChannel(int socket, uint64_t engine_id) {
  absl::StatusOr<handoff::StepChannelFds> channel =
      open_step_channel_ == nullptr
          ? absl::FailedPreconditionError(
                "this daemon offers no step channel (step_channel = false): use Step over gRPC")
          : open_step_channel_(engine_id);
  if (!channel.ok()) {
    return handoff::SendFrame(socket, handoff::EncodeRefusal(channel.status())).ok();
  }
  return handoff::SendFrame(socket, handoff::EncodeStepChannel(channel->region.bytes),
                            {channel->region.fd.get(), channel->wake.get()})
      .ok();
}

bool ArenaHandoff::AnswerOffer(PendingRequest& pending) {
  PendingRequest::BufferOffer& offer = std::get<PendingRequest::BufferOffer>(*pending.request);
  absl::StatusOr<uint64_t> id = absl::InternalError("unanswered");
  if (offer.fd.get() < 0) {
    id = absl::InvalidArgumentError(absl::StrCat(
        "a buffer offer of ", offer.bytes,
        " bytes came without a descriptor (send exactly one with it, SCM_RIGHTS)"));
  } else if (intake_ == nullptr) {
    id = absl::FailedPreconditionError(
        "this daemon has no block store (prefix_cache_budget_bytes is 0): buffer offers are "
        "refused");
  } else {
    id = intake_(pending.engine_id, pending.connection, offer.bytes, std::move(offer.fd));
  }
  if (!id.ok()) return handoff::SendFrame(pending.socket, handoff::EncodeRefusal(id.status())).ok();
  return handoff::SendFrame(pending.socket, handoff::EncodeBufferId(*id)).ok();
}

}  // namespace memra
