#ifndef MEMRA_SERVER_SESSION_SESSION_OPS_H_
#define MEMRA_SERVER_SESSION_SESSION_OPS_H_

// What a session operation is, and what it returns: plain C++ types, no protobuf. DaemonSession
// (server/session/daemon_session.h) has the rules; SessionRegistry::Apply is the one dispatcher;
// only the doors (server/edge: the gRPC services and the step channel) translate between these
// and their wire (protobuf, or the step channel's fixed records).
//
// Results reuse core's types where core has one (a Begin's TransactionId, a PrepareAppend's
// AppendPlan, an Advance's AdvanceResult); the rest are the small structs below. Every result
// is a value: nothing points into a session after the operation returned.

#include <cstdint>
#include <optional>
#include <variant>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/session.h"
#include "core/sizing.h"
#include "core/transaction.h"
#include "server/device/backend.h"

namespace memra {

// ---- Operations (each names its result below) ----

struct BeginOp {};  // -> TransactionId
struct PrepareAppendOp {  // -> AppendPlan
  uint64_t generation = 0;
  uint64_t rows = 0;
};
struct PublishAppendOp {  // -> PublishedAppend
  uint64_t generation = 0;
};
struct CommitOp {  // -> CommittedLength
  uint64_t generation = 0;
  uint64_t accepted_rows = 0;
  absl::Span<const int32_t> token_ids;  // none, or exactly accepted_rows
};
struct AbortOp {  // -> CommittedLength
  uint64_t generation = 0;
};
// One decode step: PublishAppend (when pending) + Commit, then Begin + PrepareAppend, all or
// nothing (SessionState::Advance). -> SessionAdvanced
struct AdvanceOp {
  AdvanceRequest request;
  absl::Span<const int32_t> token_ids;  // as CommitOp's
};
struct ResetOp {};  // -> std::monostate (as the rest without a result of their own)
struct RewindOp {
  uint64_t target = 0;
};
struct CanRewindOp {  // -> RewindPossible
  uint64_t target = 0;
};
struct HydrateOp {
  uint64_t logical_len = 0;
  absl::Span<const uint64_t> resident_starts;
};
struct SpecSnapshotOp {};
struct SpecRollbackOp {
  uint64_t accept_len = 0;
};
struct GrowOp {  // -> SessionReport, with the new layout
  uint64_t target_capacity = 0;
};
struct AcknowledgeGrowOp {
  uint64_t layout_version = 0;
};
struct TaintOp {
  absl::string_view reason;
};
// The session's state now, and its layout when `with_layout`. -> SessionReport
struct GetStateOp {
  bool with_layout = false;
};
using SessionOp =
    std::variant<BeginOp, PrepareAppendOp, PublishAppendOp, CommitOp, AbortOp, AdvanceOp, ResetOp,
                 RewindOp, CanRewindOp, HydrateOp, SpecSnapshotOp, SpecRollbackOp, GrowOp,
                 AcknowledgeGrowOp, TaintOp, GetStateOp>;

// ---- Results ----

struct PublishedAppend {
  uint64_t staged_len = 0;
};
struct CommittedLength {
  uint64_t committed_len = 0;
};
struct SessionAdvanced {
  uint64_t committed_len = 0;  // after the step (also when it finished no transaction)
  AdvanceResult step;          // core's: published, the next transaction and its plan
};
struct RewindPossible {
  bool possible = false;
};

// One layer's mirrored state (what the daemon keeps in its length / base mirrors, and a latent
// layer's indexer residency).
struct LayerStatus {
  uint32_t layer = 0;
  int64_t length = 0;  // the length mirror's value, in rows
  bool ring = false;
  uint64_t ring_base = 0;  // ring layers: the base mirror's value
  uint64_t index_pools_ready = 0;
  uint64_t index_resident_from = 0;
};
// A session's state. `layers`: each layer with a mirror or latent state once, in the order its
// first mirror (then its latent state) appears in SessionState::Mirrors() / latent().
struct SessionStatus {
  uint64_t layout_version = 0;
  uint64_t capacity = 0;
  uint64_t committed_len = 0;
  uint64_t staged_len = 0;
  uint64_t position = 0;
  uint64_t active_generation = 0;  // 0: none
  uint64_t next_generation = 0;
  bool tainted = false;
  bool spec_snapshot_valid = false;
  bool grow_pending = false;
  std::vector<LayerStatus> layers;
};
// Where a session's planes lie: one exported arena, core's plan of its planes and each plane's
// byte offset in the arena (offsets[i] is plan.planes[i]'s).
struct PlacedLayout {
  uint64_t layout_version = 0;
  uint64_t capacity = 0;
  ArenaExport arena;
  SessionPlan plan;
  std::vector<uint64_t> offsets;
};
struct SessionReport {
  SessionStatus state;
  std::optional<PlacedLayout> layout;  // GetStateOp with_layout; Grow (the new layout)
};

using SessionResult = std::variant<std::monostate, TransactionId, AppendPlan, PublishedAppend,
                                   CommittedLength, SessionAdvanced, RewindPossible,
                                   SessionReport>;

}  // namespace memra

#endif  // MEMRA_SERVER_SESSION_SESSION_OPS_H_
