#ifndef MEMRA_SERVER_STATE_JOURNAL_H_
#define MEMRA_SERVER_STATE_JOURNAL_H_

// What the daemon's parts report so that its state can survive a restart: engines attaching and
// going, arenas created and freed, sessions' committed state. server/restart/restart_state.h
// implements it (the fd store and the journal); without a service manager nothing is reported (a
// null StateJournal*), so the parts cost nothing then.
//
// Ordering the implementation relies on (so a crash at any point leaves something consistent):
// an arena is reported created before any session record names it and freed after the session's
// record stopped naming it (SessionReleased, or a newer record naming the new arena after a grow).

#include <cstdint>
#include <memory>
#include <string>

#include "absl/strings/string_view.h"
#include "core/model_plan.h"
#include "core/session.h"
#include "core/sizing.h"
#include "server/device/backend.h"
#include "server/base/peer_credentials.h"

namespace memra {

// Whether KV survives this daemon's crash, and why not (KvAdmin.GetStatus, metrics).
struct RestartSurvival {
  enum class State {
    kOn,    // a service manager keeps the journal and the arenas
    kOff,   // never on: no service manager, keep_kv_across_restarts = false, no journal
    kLost,  // was on; the service manager stopped answering (what it kept went with it)
  };
  State state = State::kOff;
  std::string detail;
};

// One session's record: who owns it, its plan and shape, where its memory is, its committed state.
struct JournaledSession {
  uint64_t id = 0;
  uint64_t owner = 0;
  uint32_t slot = 0;  // the registry's dense slot
  absl::string_view token;
  absl::string_view fingerprint;  // the plan's fingerprint bytes
  std::shared_ptr<const ModelPlan> model;
  SessionShape shape;  // capacity: the current layout's
  uint64_t layout_version = 0;
  ArenaId arena;
  absl::string_view arena_handle;
  uint64_t arena_bytes = 0;
  CommittedRecord committed;
  // Non-empty when the state cannot come back at its committed length (the reason).
  std::string not_recoverable;
};

// Thread-safety: implementations are thread-safe. SessionChanged calls for one session are
// serialised by the caller (it holds the session's mutex), and the last one wins.
class StateJournal {
 public:
  virtual ~StateJournal() = default;

  // An engine attached or re-attached (`peer`: its handoff connection's credentials).
  virtual void EngineAttached(uint64_t id, absl::string_view token, absl::string_view name,
                              const PeerCredentials& peer, absl::string_view cache_scope) = 0;
  virtual void EngineForgotten(uint64_t id) = 0;
  virtual void ArenaCreated(ArenaId arena) = 0;
  virtual void ArenaFreed(ArenaId arena) = 0;
  virtual void SessionChanged(const JournaledSession& session) = 0;
  virtual void SessionReleased(uint64_t id) = 0;
};

}  // namespace memra

#endif  // MEMRA_SERVER_STATE_JOURNAL_H_
