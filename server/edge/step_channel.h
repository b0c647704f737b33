#ifndef MEMRA_SERVER_STEP_CHANNEL_H_
#define MEMRA_SERVER_STEP_CHANNEL_H_

// The daemon's end of the engines' step channels (docs/step-channel.md; the layout is
// common/step_channel.h): per attached engine at most one shared-memory region, created here (a
// sealed memfd, handed over the handoff socket to that engine alone), whose submission ring
// carries slot-addressed session operations as fixed-size records and whose completion ring
// carries their results. A record is copied out of shared memory once, into a local struct,
// before anything reads it; it is decoded straight into its SessionOp
// (server/session/session_ops.h) and run by the one dispatcher the Step RPC also ends in
// (SessionRegistry), whose result is written straight into the completion record: no protobuf
// on the way. Rules, codes and messages are the Step RPC's (tests/e2e/step_channel_e2e_test.cc
// proves the outcomes identical). gRPC stays the control plane and the fallback.
//
// A round of one channel resolves all its records' slots under one acquisition of the
// registry's lock (SessionRegistry::FindSlots), then runs each record under its own session's
// lock: records of different sessions cannot share a session lock, and one session's records
// are run one by one, in order, each with its journal record before the next (what an engine
// is told happened is what a restart restores). A record parks the round (below) when its
// session is busy.
//
// Threads: ONE serving thread for every channel. It serves each open channel a round of at most
// `max_records_per_round` records (so one engine cannot starve the others), spins for
// `spin` after the last round that found work, then sleeps in epoll_wait on the channels'
// eventfds (the engines write them when they publish records while daemon_sleeping is set): no
// busy core when idle. It never waits for a session: a record whose session a long operation
// (Grow, a prefix copy) holds stays in the ring, its channel's round ends there, and the thread
// tries it again every millisecond while it serves the other engines.
//
// Bad input: the daemon keeps its own ring counters (sq_head, cq_tail) and never reads them
// back; it reads the engine's (sq_tail, cq_head) once per round. A counter claiming more records
// than the ring holds closes the channel (CloseReason::kCorrupt) for that engine only; a corrupt
// record (operation, reserved bytes, side span outside the record's own) gets an
// INVALID_ARGUMENT completion naming the numbers and changes nothing.
//
// Thread-safety: thread-safe. `mu_` guards the channel table; the serving thread takes it only
// to pick up changes (a generation counter says when), never while serving records.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
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
#include "common/step_channel.h"
#include "server/session/daemon_session.h"
#include "server/session/engine_leases.h"
#include "server/session/session_ops.h"
#include "server/session/session_registry.h"

namespace memra {

// Figures for metrics and tests.
struct StepChannelStats {
  size_t open = 0;             // channels served now
  uint64_t records = 0;        // records served since start
  uint64_t corrupt_closed = 0;  // channels closed for an absurd counter
  uint64_t sleeps = 0;         // times the serving thread slept (went idle)
};

class StepChannels {
 public:
  struct Options {
    uint32_t max_records_per_round = 64;
    // How long the serving thread keeps polling after its last work before it sleeps.
    absl::Duration spin = absl::Microseconds(50);
    // Channels open at once, daemon-wide (each holds an eventfd; the daemon derives it from its
    // RLIMIT_NOFILE); `max_channels_source` says so in the refusal.
    size_t max_channels = SIZE_MAX;
    std::string max_channels_source = "the daemon's limit";
  };

  // REQUIRES: `sessions` and `leases` outlive this.
  StepChannels(SessionRegistry* sessions, const EngineLeases* leases, Options options);
  ~StepChannels();  // Stop()
  StepChannels(const StepChannels&) = delete;
  StepChannels& operator=(const StepChannels&) = delete;

  // Starts the serving thread. FAILED_PRECONDITION when started twice.
  absl::Status Start() ABSL_LOCKS_EXCLUDED(mu_);
  // Stops the thread; every channel is closed (CloseReason::kShutdown). Idempotent.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

  // Engine `engine`'s channel: a new region and eventfd (duplicates for the engine; this keeps
  // its own). An earlier channel of the engine is closed (kReplaced): one per engine at a time.
  // At most kMaxOpensPerEngine (4) per engine lease: then FAILED_PRECONDITION naming the engine
  // and the count (each region is 4.8 MB of shared memory the engine may keep mapped, so
  // unbounded replacements would let one engine pin unbounded memory). At most
  // Options::max_channels open daemon-wide: then RESOURCE_EXHAUSTED with both numbers.
  // The engine's refusal (EngineLeases::CheckBound) when it is not attached with a live lease;
  // UNAVAILABLE before Start or after Stop.
  absl::StatusOr<handoff::StepChannelFds> Open(EngineId engine) ABSL_LOCKS_EXCLUDED(mu_);
  // The engine was reclaimed: its channel is closed (kEngineReclaimed). The engine's mapping
  // stays valid memory; the daemon reads it no more.
  void Close(EngineId engine) ABSL_LOCKS_EXCLUDED(mu_);

  StepChannelStats stats() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Channel;

  void Serve() ABSL_LOCKS_EXCLUDED(mu_);
  // One round of `channel`: true when it served a record. A record whose session a long
  // operation holds ends the round unconsumed and parks the channel (Channel::parked).
  bool ServeRound(Channel& channel);
  // Whether a round of `channel` would find work: records submitted and room for their
  // completions (an engine that frees room while records wait rings the doorbell).
  static bool Servable(const Channel& channel);
  // The outcome of the record copied into `record` (ring index `index`; `session` the one its
  // slot names, null when none of the engine's), into `completion`; false (nothing run) when
  // its session is busy in a long operation. `round_admitted`: the round admitted the engine
  // and charges its time (the record is not admitted or charged on its own).
  bool RunRecord(Channel& channel, const step_channel::SubmissionRecord& record,
                 DaemonSession* session, uint32_t index, const absl::Status& engine_check,
                 bool round_admitted, step_channel::CompletionRecord& completion);
  // The record's session operation (its token ids copied into the channel's buffer, which the
  // operation's span points into until the next record), or the INVALID_ARGUMENT naming what
  // is wrong with it: another version, operation, reserved bytes, side span.
  static absl::StatusOr<SessionOp> DecodeRecord(Channel& channel,
                                                const step_channel::SubmissionRecord& record,
                                                uint32_t index);
  // An applied operation's result into `completion` (and a plan into its side span).
  static void WriteResult(Channel& channel, uint32_t cq_index, const SessionResult& result,
                          step_channel::CompletionRecord& completion);
  // Closes `channel` for `reason` (and wakes its engine). Serving thread or under mu_.
  static void MarkClosed(Channel& channel, step_channel::CloseReason reason);
  // FAILED_PRECONDITION when `engine` opened the most channels a lease may; RESOURCE_EXHAUSTED
  // when it has none open and max_channels are.
  absl::Status CheckMayOpenLocked(EngineId engine) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Wake();
  // Logs a refusal of `channel`'s record at info, at most kRefusalsLoggedPerSecond a second
  // (the rest counted and logged as a count). Serving thread only.
  static void LogRefusal(Channel& channel, absl::string_view message);

  struct RefusalLog {
    absl::Time window_start = absl::InfinitePast();
    uint32_t logged = 0;       // in this window
    uint64_t suppressed = 0;   // in this window, not logged
  };

  SessionRegistry* const sessions_;
  const EngineLeases* const leases_;
  const Options options_;

  ScopedFd epoll_;  // the channels' eventfds and wake_
  ScopedFd wake_;   // eventfd: Open, Close and Stop interrupt the serving thread's sleep
  std::thread thread_;
  std::atomic<uint64_t> records_{0};
  std::atomic<uint64_t> corrupt_closed_{0};
  std::atomic<uint64_t> sleeps_{0};

  mutable absl::Mutex mu_;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Engine id -> its open channel.
  absl::flat_hash_map<uint64_t, std::shared_ptr<Channel>> channels_ ABSL_GUARDED_BY(mu_);
  // Engine id -> channels it opened, until Close (its reclaim).
  absl::flat_hash_map<uint64_t, uint32_t> opens_ ABSL_GUARDED_BY(mu_);
  // Bumped on every change of channels_: the serving thread re-reads the table when it moved.
  std::atomic<uint64_t> generation_{0};
};

}  // namespace memra

#endif  // MEMRA_SERVER_STEP_CHANNEL_H_
