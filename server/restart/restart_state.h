#ifndef MEMRA_SERVER_RESTART_STATE_H_
#define MEMRA_SERVER_RESTART_STATE_H_

// KV that survives a daemon restart (docs/failure-model.md#the-daemon-dies). While it runs under a
// service manager (systemd, or memra-kv-supervise where there is none), memra-kvd keeps in the
// manager's file-descriptor store (sd_notify "FDSTORE=1"):
//   arena-<generation>-<id>   every session arena's memory (a duplicate of its descriptor)
//   plan-<hex fingerprint>    each model plan some session uses (a memfd holding the plan proto)
//   journal-<generation>      the restart journal (server/restart/restart_journal.h): one slot
//                             per engine (id, token, name, pid) and per session (owner, token,
//                             plan, shape, arena, committed state), written in place on every
//                             change
// and removes each with "FDSTOREREMOVE=1" when it is freed. The manager hands all of them to the
// next daemon ($LISTEN_FDS / $LISTEN_FDNAMES); ReadPreviousDaemon reads them and the daemon
// re-adopts (server/daemon.h): arenas mapped again, sessions rebuilt at their committed length,
// engines known again by id and token so they re-attach and carry on. Nothing is on disk.
// Prefix-cache entries (private anonymous memory) and reservations are not kept.
//
// <generation> grows by one per daemon start, so names never collide across restarts; a restart
// that finds two journals (it died between storing its own and removing the old one) takes the
// newest generation.
//
// Thread-safety: thread-safe. `mu_` guards the slot and name tables and is a leaf (the sender is
// called under it, nothing else). Journal writes for one session run outside it, serialised by
// the session's own mutex (server/session/state_journal.h).

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/mapped_region.h"
#include "core/model_plan.h"
#include "server/device/backend.h"
#include "server/restart/restart_journal.h"
#include "server/restart/restart_journal.pb.h"
#include "server/base/sd_notify.h"
#include "server/session/state_journal.h"

namespace memra {

// Sends one notification with descriptors attached (SdNotifyWithFds by default).
using FdStoreSender =
    std::function<absl::Status(std::string_view state, const std::vector<int>& fds)>;

// What the previous daemon left in the fd store, read but not yet applied.
struct PreviousDaemon {
  uint64_t epoch = 0;
  uint64_t generation = 0;
  uint64_t next_engine_id = 1;
  uint64_t next_session_id = 1;
  std::string journal_name;
  // The journal's session_slot_limit(): above every session slot it records
  // (SessionRegistry::Readopt refuses a slot past it as corrupt).
  uint64_t session_slot_limit = 0;
  std::vector<memra::kvd::journal::EngineRecord> engines;
  std::vector<memra::kvd::journal::SessionRecord> sessions;
  // Sessions an earlier restart did not re-adopt (their engines still get the restart error).
  std::vector<memra::kvd::journal::LostSessionRecord> lost_sessions;
  // fd name -> the plan it holds (a plan that does not parse or validate is in `problems`).
  absl::flat_hash_map<std::string, ModelPlan> plans;
  absl::flat_hash_map<std::string, ScopedFd> arenas;  // fd name -> descriptor
  // Every other passed name (older journals, unknown names): removed from the store.
  std::vector<std::string> leftovers;
  size_t torn_records = 0;  // slots with a torn half (a write in flight, or damage)
  // Slots whose every copy is damaged or does not parse: what they held cannot be named.
  size_t unreadable_records = 0;
  std::vector<std::string> problems;  // what could not be read, for the log
};

// Reads `passed` (TakeListenFds). nullopt when it holds no journal that opens (a first start, a
// restart without a service manager, a journal of another format): every passed descriptor is
// then a leftover, closed here and removed from the service manager's store (FDSTOREREMOVE),
// or the arena memory the store keeps would stay pinned there for good. Takes ownership of
// every descriptor.
std::optional<PreviousDaemon> ReadPreviousDaemon(std::vector<ListenedFd> passed);

class RestartState final : public StateJournal {
 public:
  // A journal of `slots` slots (engines + sessions), stamped with this daemon's `epoch` and
  // `generation`. `backend` duplicates arena descriptors. REQUIRES: `backend` outlives this.
  static absl::StatusOr<std::unique_ptr<RestartState>> Create(uint64_t slots, uint64_t epoch,
                                                              uint64_t generation,
                                                              DeviceBackend* backend,
                                                              FdStoreSender send = nullptr);

  // ---- StateJournal ----
  void EngineAttached(uint64_t id, absl::string_view token, absl::string_view name,
                      const PeerCredentials& peer, absl::string_view cache_scope) override
      ABSL_LOCKS_EXCLUDED(mu_);
  void EngineForgotten(uint64_t id) override ABSL_LOCKS_EXCLUDED(mu_);
  void ArenaCreated(ArenaId arena) override ABSL_LOCKS_EXCLUDED(mu_);
  void ArenaFreed(ArenaId arena) override ABSL_LOCKS_EXCLUDED(mu_);
  void SessionChanged(const JournaledSession& session) override ABSL_LOCKS_EXCLUDED(mu_);
  void SessionReleased(uint64_t id) override ABSL_LOCKS_EXCLUDED(mu_);

  // ---- Re-adoption (the daemon, before it serves) ----
  // Journals a session that was not re-adopted (at this restart or an earlier one), so the next
  // daemon answers its engine with the restart error too; dropped when its engine is forgotten.
  void SessionLost(const memra::kvd::journal::LostSessionRecord& lost) ABSL_LOCKS_EXCLUDED(mu_);
  // A re-adopted arena keeps the name its descriptor is stored under.
  void NameAdoptedArena(ArenaId arena, std::string fd_name) ABSL_LOCKS_EXCLUDED(mu_);
  // A re-adopted plan keeps the name its memfd is stored under.
  void NameAdoptedPlan(std::string fingerprint, std::string fd_name) ABSL_LOCKS_EXCLUDED(mu_);
  // Re-adopted sessions keep their slots: this journal's limit on session slots takes the
  // previous journal's (RestartJournal::session_slot_limit), so the next restart accepts them.
  void CarrySessionSlotLimit(uint64_t limit) { journal_->RaiseSessionSlotLimit(limit); }
  uint64_t session_slot_limit() const { return journal_->session_slot_limit(); }
  // Stores this daemon's journal ("journal-<generation>"): from now on a restart finds it.
  absl::Status Publish() ABSL_LOCKS_EXCLUDED(mu_);
  // Removes `fd_name` from the store (the previous daemon's leftovers).
  void Forget(const std::string& fd_name) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes the stored plans no journaled session uses.
  void ForgetUnusedPlans() ABSL_LOCKS_EXCLUDED(mu_);

  // Sends the service manager a notification that asks nothing, to learn whether it still
  // answers (the daemon's lease thread, every second). The first that fails (memra-kv-supervise
  // was killed: its socket refuses) turns restart survival off for good, logged once: the store
  // went with the service manager, and a new one would not hold this daemon's arenas.
  void ProbeStore() ABSL_LOCKS_EXCLUDED(mu_);
  // Why the service manager's store was lost (ProbeStore); nullopt while it answers.
  std::optional<std::string> store_lost() const ABSL_LOCKS_EXCLUDED(mu_);

  uint64_t generation() const { return journal_->generation(); }
  // Failures to keep something (a full journal, a refused store): each is logged; a session
  // whose arena could not be kept is journaled as not recoverable.
  uint64_t failures() const ABSL_LOCKS_EXCLUDED(mu_);
  // Descriptors this daemon has in the store now (arenas, plans, the journal once published).
  size_t stored_fds() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  RestartState(std::unique_ptr<RestartJournal> journal, DeviceBackend* backend,
               FdStoreSender send);

  // A free slot for `key` (engines and sessions share the slots); nullopt when full.
  std::optional<uint64_t> TakeSlotLocked(uint64_t key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FreeSlotLocked(uint64_t key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status StoreLocked(const std::string& name, int fd) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RemoveLocked(const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Keeps `session`'s plan as a memfd in the store the first time a session uses it.
  void RefPlanLocked(const JournaledSession& session) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UnrefPlanLocked(const std::string& fingerprint) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailLocked(std::string what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::unique_ptr<RestartJournal> journal_;
  DeviceBackend* const backend_;
  const FdStoreSender send_;

  mutable absl::Mutex mu_;
  // Slot keys: engine id << 1 | 0, session id << 1 | 1.
  absl::flat_hash_map<uint64_t, uint64_t> slots_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> free_slots_ ABSL_GUARDED_BY(mu_);
  uint64_t next_unused_slot_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<uint64_t, std::string> arena_names_ ABSL_GUARDED_BY(mu_);
  struct StoredPlan {
    std::string fd_name;
    uint64_t sessions = 0;
  };
  absl::flat_hash_map<std::string, StoredPlan> plans_ ABSL_GUARDED_BY(mu_);  // by fingerprint
  absl::flat_hash_map<uint64_t, std::string> session_plans_ ABSL_GUARDED_BY(mu_);  // id -> fp
  // Engine id -> the lost sessions journaled for it (SessionLost), freed with the engine.
  absl::flat_hash_map<uint64_t, std::vector<uint64_t>> lost_by_owner_ ABSL_GUARDED_BY(mu_);
  bool published_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<std::string> store_lost_ ABSL_GUARDED_BY(mu_);
  uint64_t failures_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace memra

#endif  // MEMRA_SERVER_RESTART_STATE_H_
