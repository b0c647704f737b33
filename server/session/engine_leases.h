#ifndef MEMRA_SERVER_ENGINE_LEASES_H_
#define MEMRA_SERVER_ENGINE_LEASES_H_

// The engines attached to the daemon, their leases and their admission reservations.
//
// Leases: an engine's lease ends when its Attach stream ends or when no heartbeat arrives for
// `timeout` (the stream is then cancelled). `grace` after that, CollectReclaimable() forgets the
// engine and returns it once, with its reservations returned to the budget; the caller releases
// its sessions (server/session/session_registry.h). Lease decisions use the injected Clock.
//
// Draining: while draining, new engines, reservations and sessions are refused (UNAVAILABLE).
//
// Thread-safety: thread-safe. `mu_` is a leaf lock: nothing outside this class is called while it
// is held except the DeviceBudget (itself a leaf) and the stream cancellers. SessionRegistry
// takes its own lock before this one (AdmitSession is called under it), never after.

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/admission.h"
#include "server/base/clock.h"
#include "server/base/ids.h"
#include "server/device/device_budget.h"
#include "server/session/state_journal.h"
#include "common/daemon_restart.h"
#include "server/base/peer_credentials.h"

namespace memra {

// The lease settings (DaemonConfig lease_timeout_ms, lease_grace_ms, reservation_ttl_ms,
// max_attached_engines).
struct LeaseSettings {
  absl::Duration timeout;
  absl::Duration grace;
  absl::Duration reservation_ttl;
  // Engines known at once: attached, or in the grace after their lease ended (they still hold
  // sessions). Each live one holds an Attach stream and a server thread.
  size_t max_engines = SIZE_MAX;
};

// What an engine proves it is with: the id and token Attach handed it.
struct EngineCredentials {
  EngineId id;
  absl::string_view token;
};

// Who an engine is: the name it gave, the peer credentials its handoff ticket proved
// (server/edge/arena_handoff.h) and its prefix-cache scope (server/session/cache_scopes.h), fixed
// at Attach.
struct EngineIdentity {
  std::string name;
  PeerCredentials peer;
  std::string cache_scope;
};

// What Attach hands an engine.
struct EngineLease {
  EngineId id;
  std::string token;  // 16 random bytes
  absl::Duration timeout;
  absl::Duration grace;
  uint64_t stream = 0;  // which Attach stream holds the lease (EndStream names it)
  std::string cache_scope;  // the engine's prefix-cache scope (EngineIdentity's)
};

struct EngineReservation {
  ReservationId id;
  absl::Duration ttl;
};

// An engine as KvAdmin reports it.
struct EngineView {
  EngineId id;
  std::string name;
  PeerCredentials peer;
  std::string cache_scope;
  bool lease_live = false;
  // Re-adopted after a restart, no Attach stream yet (the lease runs from the restart).
  bool awaiting_reattach = false;
  absl::Duration heartbeat_age;  // since the last heartbeat, or since the lease ended
};

// An engine CollectReclaimable() forgot.
struct ReclaimedEngine {
  EngineId id;
  std::string name;
  PeerCredentials peer;
};

class EngineLeases {
 public:
  // REQUIRES: `clock` and `budget` (and `journal` when set) outlive this. `journal`: where
  // engines are recorded for a restart (server/session/state_journal.h); null: nowhere.
  EngineLeases(Clock* clock, DeviceBudget* budget, LeaseSettings settings,
               StateJournal* journal = nullptr);

  void ApplySettings(LeaseSettings settings) ABSL_LOCKS_EXCLUDED(mu_);
  LeaseSettings settings() const ABSL_LOCKS_EXCLUDED(mu_);

  // Attach: registers the engine (name truncated to 256 bytes); RESOURCE_EXHAUSTED naming the
  // count and the limit when max_engines are known. `cancel_stream` ends its Attach
  // stream: called at most once, when the lease times out or the daemon shuts down, never after
  // EndStream.
  absl::StatusOr<EngineLease> Attach(EngineIdentity identity,
                                     std::function<void()> cancel_stream) ABSL_LOCKS_EXCLUDED(mu_);
  // Re-attach (proto Hello.resume): the engine's lease is live again on a new stream, with the
  // same id and token. NOT_FOUND for an engine this daemon reclaimed (or never knew), or the
  // restart error (common/daemon_restart.h) when a restarted daemon did not re-adopt it;
  // PERMISSION_DENIED for a wrong token or when `peer` (the re-attach's handoff connection) is
  // another uid than the engine's; FAILED_PRECONDITION while another stream holds the lease or
  // when `cache_scope` is neither empty nor the engine's; UNAVAILABLE while draining. The
  // engine's pid becomes `peer`'s.
  absl::StatusOr<EngineLease> Resume(const EngineCredentials& engine, const PeerCredentials& peer,
                                     absl::string_view cache_scope,
                                     std::function<void()> cancel_stream)
      ABSL_LOCKS_EXCLUDED(mu_);
  // NOT_FOUND once reclaimed, FAILED_PRECONDITION once the lease ended.
  absl::Status Heartbeat(EngineId engine) ABSL_LOCKS_EXCLUDED(mu_);
  // Attach stream `stream` (EngineLease::stream; 0: whichever holds it) ended: the lease ends
  // now (if it had not). A stream the engine already replaced by re-attaching ends nothing.
  void EndStream(EngineId engine, uint64_t stream = 0) ABSL_LOCKS_EXCLUDED(mu_);

  // ---- Restart survival (server/restart/restart_state.h) ----
  // An engine the previous daemon journaled: known again with its id and token and a lease that
  // runs from now without a stream, so it must re-attach (Resume) within the lease timeout or is
  // reclaimed like a silent engine. Ids issued later are above it.
  void Readopt(EngineId id, std::string token, EngineIdentity identity) ABSL_LOCKS_EXCLUDED(mu_);
  // Ids issued from now on are >= `next` (the previous daemon's high-water mark).
  void RaiseNextEngineId(uint64_t next) ABSL_LOCKS_EXCLUDED(mu_);
  // This daemon restarted from `restart.previous_epoch`; engines in `not_readopted` (id ->
  // why) get the restart error instead of NOT_FOUND.
  void SetRestart(DaemonRestart restart, absl::flat_hash_map<uint64_t, std::string> not_readopted)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The restart this daemon re-adopted the previous daemon's state from; nullopt when it kept
  // nothing of an earlier daemon.
  std::optional<DaemonRestart> restart() const ABSL_LOCKS_EXCLUDED(mu_);

  // OK when the credentials name an attached engine whose lease is live: NOT_FOUND unknown
  // engine, PERMISSION_DENIED wrong token, FAILED_PRECONDITION lease ended.
  absl::Status Check(const EngineCredentials& engine) const ABSL_LOCKS_EXCLUDED(mu_);
  // Check() for a binding that already proved the engine's identity (its step channel, handed
  // to it alone): the same refusals but the token's.
  absl::Status CheckBound(EngineId engine) const ABSL_LOCKS_EXCLUDED(mu_);
  // Check(), then the engine's prefix-cache scope.
  absl::StatusOr<std::string> CacheScope(const EngineCredentials& engine) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Check(), and UNAVAILABLE with `draining_message` while draining (one decision, one lock).
  absl::Status Admit(const EngineCredentials& engine, absl::string_view draining_message) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // Admission reservations of `bytes` for the engine, lapsing after the reservation ttl.
  absl::StatusOr<EngineReservation> Reserve(const EngineCredentials& engine, uint64_t bytes)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The bytes the cancelled reservation held.
  absl::StatusOr<uint64_t> CancelReservation(const EngineCredentials& engine,
                                             ReservationId reservation) ABSL_LOCKS_EXCLUDED(mu_);
  // Drops reservations whose ttl has passed, logging each once.
  void ExpireReservations() ABSL_LOCKS_EXCLUDED(mu_);

  // ---- Group ranks (docs/groups.md): the engine's Check() first, then the budget's ----
  // Holds `bytes` for one rank of a group until `deadline` from now unless confirmed;
  // UNAVAILABLE while draining.
  absl::StatusOr<ReservationId> ReserveGroupRank(const EngineCredentials& engine, uint64_t bytes,
                                                 GroupRankKey group, absl::Duration deadline)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<HeldReservation> ConfirmGroupRank(const EngineCredentials& engine,
                                                   uint64_t group_id) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<HeldReservation> GroupRank(const EngineCredentials& engine,
                                            uint64_t group_id) const ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<uint64_t> ReleaseGroupRank(const EngineCredentials& engine, uint64_t group_id)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Every engine's group rank reservations, by id.
  std::vector<HeldReservation> GroupRanks() const ABSL_LOCKS_EXCLUDED(mu_);
  // Now, on the clock deadlines are kept by.
  absl::Time Now() const { return clock_->Now(); }

  // At clock->Now(): ends the leases of silent engines (cancelling their streams) and forgets
  // every engine whose grace has passed, returning each exactly once.
  std::vector<ReclaimedEngine> CollectReclaimable() ABSL_LOCKS_EXCLUDED(mu_);
  // A reclaimed engine's reservations go back to the budget; the bytes they held. Only after
  // its sessions are released: the budget's per-owner release would take their charges too.
  uint64_t ReturnReservations(EngineId engine);

  // Refuse (true) or accept again (false) new engines, reservations and sessions.
  void SetDraining(bool draining) ABSL_LOCKS_EXCLUDED(mu_);
  bool draining() const ABSL_LOCKS_EXCLUDED(mu_);

  // Shutdown: cancels every open Attach stream, then (ForgetAll) forgets every engine.
  void CancelStreams() ABSL_LOCKS_EXCLUDED(mu_);
  void ForgetAll() ABSL_LOCKS_EXCLUDED(mu_);

  std::vector<EngineView> Engines() const ABSL_LOCKS_EXCLUDED(mu_);
  size_t size() const ABSL_LOCKS_EXCLUDED(mu_);

  // Events since start (metrics).
  uint64_t lease_expiries() const { return lease_expiries_.load(std::memory_order_relaxed); }
  uint64_t engines_reclaimed() const {
    return engines_reclaimed_.load(std::memory_order_relaxed);
  }
  uint64_t reservations_expired() const {
    return reservations_expired_.load(std::memory_order_relaxed);
  }

 private:
  struct Engine {
    EngineId id;
    EngineIdentity identity;
    std::string token;
    absl::Time last_heartbeat;
    std::optional<absl::Time> lease_ended;  // stream ended or heartbeats stopped
    std::function<void()> cancel_stream;    // until called or its Attach call ends
    uint64_t stream = 0;                    // the Attach stream holding the lease (0: none)
  };

  // Records the engine for a restart (its id, token and identity).
  void JournalEngineLocked(const Engine& engine) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `token` null: the caller's binding proved the engine (CheckBound).
  absl::Status CheckLocked(EngineId engine, const absl::string_view* token) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckLocked(const EngineCredentials& engine) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // NOT_FOUND for an engine this daemon does not know, or the restart error for one the
  // previous daemon had and this one did not re-adopt.
  absl::Status UnknownEngineLocked(EngineId engine, absl::string_view what) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Clock* const clock_;
  DeviceBudget* const budget_;
  StateJournal* const journal_;

  std::atomic<uint64_t> lease_expiries_{0};
  std::atomic<uint64_t> engines_reclaimed_{0};
  std::atomic<uint64_t> reservations_expired_{0};

  mutable absl::Mutex mu_;
  LeaseSettings settings_ ABSL_GUARDED_BY(mu_);
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_engine_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_stream_ ABSL_GUARDED_BY(mu_) = 1;
  std::optional<DaemonRestart> restart_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, std::string> not_readopted_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, Engine> engines_ ABSL_GUARDED_BY(mu_);
};

}  // namespace memra

#endif  // MEMRA_SERVER_ENGINE_LEASES_H_
