#ifndef MEMRA_SERVER_ARENA_HANDOFF_H_
#define MEMRA_SERVER_ARENA_HANDOFF_H_

// The handoff socket (handoff_socket_path; docs/handoff.md): the side channel that carries what
// gRPC cannot, file descriptors. An engine connects before Attach; the daemon reads the peer's
// credentials (SO_PEERCRED: uid, gid, pid) and answers a ticket valid while that connection
// stays open. Attach carries the ticket (ClaimTicket: single use), which binds those peer
// credentials, and this connection, to the engine's lease (BindEngine). Over the connection the
// engine then trades {session id, session token, arena handle} for a descriptor of the arena's
// memfd (SCM_RIGHTS), and may ask for its step channel (docs/step-channel.md: a region and an
// eventfd, from `StepChannelOpener`); the daemon's `ArenaLookup` hands an arena only for a
// session of the engine the connection is bound to, after checking the session token. Every
// other request is a refusal record on the channel, and the connection stays open.
//
// Buffer offers (the block store, docs/block-store.md): an engine bound to a connection sends
// a descriptor of its own KV pool's memory with a kBufferOffer frame; `BufferIntake` checks and
// files it and the engine gets the buffer id (or the refusal). Descriptors that come with any
// frame wait (in arrival order, at most four; more are closed) for the offers that take them, the
// oldest first; an offer with none waiting is refused.
//
// One thread serves every connection (poll over non-blocking sockets): at most
// `max_connections` at once (a connection past it gets a RESOURCE_EXHAUSTED refusal and is
// closed), frames of at most handoff::kMaxFrameBytes, a request not complete within
// `request_deadline` closes its connection, and so does a ticket not claimed within
// `claim_deadline` (a client cannot hold a slot without attaching) and a reply the peer does not
// read (the socket buffer full). So no client can stall another.
//
// Thread-safety: thread-safe. `mu_` is a leaf lock; `ArenaLookup` runs on the serving thread
// with no lock of this class held. Only the serving thread closes connection descriptors.

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/handoff_wire.h"
#include "common/mapped_region.h"
#include "server/base/peer_credentials.h"

namespace memra {

// What a claimed ticket proves.
struct HandoffClaim {
  uint64_t connection = 0;
  PeerCredentials peer;
};

class ArenaHandoff {
 public:
  // Finds the arena `request` names for engine `engine_id`, or the refusal (any status; it goes
  // to the engine as a refusal record).
  using ArenaLookup = std::function<absl::StatusOr<ArenaFd>(
      uint64_t engine_id, const handoff::ArenaRequest& request)>;
  // Opens engine `engine_id`'s step channel (server/edge/step_channel.h), or the refusal. Null: the
  // daemon offers none (step_channel = false), and a request is FAILED_PRECONDITION.
  using StepChannelOpener =
      std::function<absl::StatusOr<handoff::StepChannelFds>(uint64_t engine_id)>;

  // Checks and files the descriptor engine `engine_id` offered over `connection`; returns the
  // buffer id or the refusal (it goes to the engine as a refusal record).
  using BufferIntake = std::function<absl::StatusOr<uint64_t>(
      uint64_t engine_id, uint64_t connection, uint64_t bytes, ScopedFd fd)>;

  // Connections accepted per poll round at most (the rest wait for the next round): a client
  // connecting as fast as it can cannot keep the serving thread from open connections.
  static constexpr int kAcceptsPerRound = 32;
  // Answers with descriptors one connection may leave unread (a step channel answer, two
  // descriptors, counts once).
  static constexpr size_t kMaxUnreadDescriptorAnswers = 16;
  // Descriptors a connection may have sent ahead of the offers that take them.
  static constexpr size_t kMaxPendingDescriptors = 4;
  // What one connection can make the daemon hold at most: open, its socket and its pending
  // descriptors; in flight, its unread answers' descriptors (two at most each), which count
  // against the daemon's uid in a separate pool as large as its RLIMIT_NOFILE. The daemon
  // derives max_connections from its RLIMIT_NOFILE with these.
  static constexpr size_t kOpenDescriptorsPerConnection = 1 + kMaxPendingDescriptors;
  static constexpr size_t kInFlightDescriptorsPerConnection = 2 * kMaxUnreadDescriptorAnswers;

  struct Options {
    std::string path;
    // chown/chmod of the socket file (the engine socket's socket_group / socket_mode).
    std::string group;
    uint32_t mode = 0660;
    // max_attached_engines, capped by the daemon's RLIMIT_NOFILE (kOpenDescriptorsPerConnection,
    // kInFlightDescriptorsPerConnection); `max_connections_source` says so in the refusal.
    size_t max_connections = 256;
    std::string max_connections_source = "max_attached_engines";
    // Connections of one uid with no engine bound yet: one user cannot fill the socket with
    // connections that never attach (room for a few engines starting at once).
    size_t max_unbound_per_uid = 8;
    absl::Duration request_deadline = absl::Seconds(2);
    absl::Duration claim_deadline = absl::Seconds(60);
    // This daemon instance (its epoch), carried in every ticket: a ticket another instance
    // issued (a re-attach that straddled a restart) is refused UNAVAILABLE, never confused
    // with one of this daemon's connections of the same number.
    uint64_t instance = 1;
  };

  // `intake` may be null: offers are then refused (FAILED_PRECONDITION: no block store).
  // `open_step_channel` may be null: step channel requests are then refused.
  ArenaHandoff(Options options, ArenaLookup lookup, BufferIntake intake = nullptr,
               StepChannelOpener open_step_channel = nullptr);
  ~ArenaHandoff();  // Stop()
  ArenaHandoff(const ArenaHandoff&) = delete;
  ArenaHandoff& operator=(const ArenaHandoff&) = delete;

  // Binds the socket (a stale file is removed, a live one refused: server/base/unix_socket.h),
  // applies the group and mode and starts the serving thread. FAILED_PRECONDITION when started
  // twice.
  absl::Status Start() ABSL_LOCKS_EXCLUDED(mu_);
  // Stops the thread, closes every connection and removes the socket file. Idempotent.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

  // Attach: the peer behind `ticket`, which is used up. UNAVAILABLE (both instances named) for a
  // ticket another daemon instance issued: the engine retries with a fresh ticket.
  // PERMISSION_DENIED (saying why, with the numbers) for an empty ticket, one of the wrong size,
  // of no open connection, used already, or whose secret is wrong.
  absl::StatusOr<HandoffClaim> ClaimTicket(absl::string_view ticket) ABSL_LOCKS_EXCLUDED(mu_);
  // The connection now serves engine `engine_id` (a no-op when it closed meanwhile); any other
  // connection bound to that engine (before a re-attach) is closed.
  void BindEngine(uint64_t connection, uint64_t engine_id) ABSL_LOCKS_EXCLUDED(mu_);
  // The engine was reclaimed: its connection is closed.
  void ForgetEngine(uint64_t engine_id) ABSL_LOCKS_EXCLUDED(mu_);

  const std::string& path() const { return options_.path; }
  // Whether an engine may ask for a step channel (Attached.step_channel).
  bool offers_step_channel() const { return open_step_channel_ != nullptr; }
  size_t connection_count() const ABSL_LOCKS_EXCLUDED(mu_);
  // Whether `connection` is open and serves engine `engine_id` (a buffer offer's id is valid
  // only while its connection is).
  bool ServesEngine(uint64_t connection, uint64_t engine_id) const ABSL_LOCKS_EXCLUDED(mu_);
  // Arena requests granted since start, counted as their descriptor is sent (metrics, tests).
  uint64_t arenas_handed() const { return arenas_handed_.load(std::memory_order_relaxed); }

 private:
  using SteadyTime = std::chrono::steady_clock::time_point;

  struct Connection {
    ScopedFd socket;
    PeerCredentials peer;
    std::string secret;  // the ticket's random part
    bool claimed = false;
    uint64_t engine_id = 0;  // 0 until BindEngine
    std::string input;       // bytes of frames not yet complete
    SteadyTime accepted;
    SteadyTime input_since;  // when `input` became non-empty
    bool closing = false;    // ForgetEngine asked; the serving thread closes it
    // Descriptors received and not yet taken by a buffer offer, in arrival order (bounded).
    std::deque<ScopedFd> descriptors;
    // Answers carrying descriptors sent since the engine was last seen to have read everything
    // (SIOCOUTQ 0): at least as many as it has not read (AdmitDescriptorAnswer).
    size_t unread_descriptor_answers = 0;
  };
  // A complete request taken off a connection, answered outside the lock.
  struct PendingRequest {
    uint64_t connection = 0;
    int socket = -1;  // stays open: only the serving thread closes
    uint64_t engine_id = 0;
    // A buffer offer's bytes and its descriptor (-1: none was waiting).
    struct BufferOffer {
      uint64_t bytes = 0;
      ScopedFd fd;
    };
    absl::StatusOr<std::variant<handoff::ArenaRequest, handoff::StepChannelRequest, BufferOffer>>
        request;
  };

  void Serve() ABSL_LOCKS_EXCLUDED(mu_);
  // Accepts what the listener holds, at most kAcceptsPerRound connections per poll round.
  void AcceptAll() ABSL_LOCKS_EXCLUDED(mu_);
  // Reads what `connection` sent; complete requests go to `pending`. False: close it.
  bool ReadFrom(uint64_t id, Connection& connection, std::vector<PendingRequest>& pending)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The answer to one request; false when it could not be sent (close the connection).
  bool Answer(PendingRequest& pending);
  // The answer to a step channel request of a connection bound to `engine_id`.
  bool AnswerStepChannel(int socket, uint64_t engine_id);
  // The answer to a buffer offer of a connection bound to an engine.
  bool AnswerOffer(PendingRequest& pending);
  void Wake();
  void Close(uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Before an answer that carries descriptors: OK, or RESOURCE_EXHAUSTED when the engine left
  // kMaxUnreadDescriptorAnswers of them unread. Descriptors queued in a socket count against
  // the daemon's uid (Linux's in-flight limit follows its RLIMIT_NOFILE): without this bound
  // one engine that never read made every later SCM_RIGHTS send fail for every engine.
  absl::Status AdmitDescriptorAnswer(const PendingRequest& pending) ABSL_LOCKS_EXCLUDED(mu_);

  const Options options_;
  const ArenaLookup lookup_;
  const BufferIntake intake_;
  const StepChannelOpener open_step_channel_;
  std::atomic<uint64_t> arenas_handed_{0};

  ScopedFd listener_;  // set by Start(), closed by Stop()
  ScopedFd wake_;      // eventfd: ForgetEngine and Stop interrupt poll()
  std::thread thread_;
  // Only the serving thread: no accept before this (accept ran out of descriptors).
  SteadyTime accept_resumes_{};

  mutable absl::Mutex mu_;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_connection_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<uint64_t, Connection> connections_ ABSL_GUARDED_BY(mu_);
};

}  // namespace memra

#endif  // MEMRA_SERVER_ARENA_HANDOFF_H_
