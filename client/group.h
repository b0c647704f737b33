#ifndef MEMRA_CLIENT_GROUP_H_
#define MEMRA_CLIENT_GROUP_H_

// The group client: one engine spanning GPUs (TP x PP ranks, one memra-kvd per GPU) as one
// client over N KvClients (docs/groups.md). It registers the plan on every rank, plans each
// rank's shard (core/group_layout.h), and gives one answer for the group:
//
//   admission   Reserve on every rank with one group id and a deadline (proto group.proto),
//               then Confirm on every rank, or Release on every rank that reserved: one yes or
//               no, never a partial reservation after the deadline (the daemons free PENDING
//               ones themselves).
//   sessions    one session per rank from the confirmed reservations (same capacity, each
//               rank's shard); operations apply to every rank in rank order (the guarantees
//               per operation: GroupSession below, docs/groups.md#group-sessions).
//   prefixes    captured on every rank at one boundary; a group hit is a boundary every rank
//               holds; restored on every rank or on none.
//
// Every refusal keeps the refusing rank's status code and details (an AdmissionRefusal stays
// readable with GetAdmissionRefusal) and prefixes its message with the group id, the rank and
// the rank's socket: "group 0x5eed rank 2/4 (/run/memra-kv/gpu2.sock): ...".
//
// Thread-safety: a GroupClient and its GroupSessions are used by one thread at a time (they
// hold per-group state the calls update); the KvClients underneath are thread-safe.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/client.h"
#include "client/group_file.h"
#include "client/prefix_client.h"
#include "core/group_layout.h"
#include "core/model_plan.h"

namespace memra {

struct GroupClientOptions {
  // Each rank's KvClient (deadline, mapper, scope...).
  ClientOptions client;
  // Each rank attaches as "<engine_name> rank <r>".
  std::string engine_name = "memra-group";
  // How long the ranks hold a PENDING group reservation before their daemons free it
  // (proto ReserveGroupRankRequest.deadline_ms): longer than the slowest rank's reserve, so
  // Confirm arrives before it. 1 ms .. 10 min.
  absl::Duration admission_deadline = absl::Seconds(10);
};

// A plan registered on every rank, with its TP x PP layout.
struct GroupPlan {
  PlanFingerprint fingerprint{};  // the same on every rank (one plan)
  GroupLayout layout;
};

// One group admission: every rank's reservation under one group id.
struct GroupAdmission {
  uint64_t group_id = 0;
  uint64_t capacity = 0;
  bool spec_snapshot = false;
  std::vector<uint64_t> reservation_ids;  // by rank
  std::vector<uint64_t> bytes;            // by rank: that rank's exact shard cost
  bool confirmed = false;
};

// A transaction open on every rank (each rank's own generation).
struct GroupTransaction {
  std::vector<uint64_t> generations;  // by rank
  uint64_t base_len = 0;              // rows committed when it began (every rank's)
};

struct GroupPrefixMatch {
  uint64_t matched_tokens = 0;      // the boundary every rank holds; 0: a miss
  std::vector<uint64_t> entry_ids;  // by rank (empty on a miss)
};

class GroupClient;

// One session per rank. Every operation runs on the ranks in rank order and has one answer.
// What a refusal at rank k leaves (docs/groups.md#group-sessions):
//   Begin                 ranks < k aborted again: as it was.
//   PrepareAppend,
//   PublishAppend         the transaction is aborted on every rank: the group is at the
//                         committed state it had before Begin.
//   Commit                k = 0: nothing moved (the transaction stays open). k > 0: ranks >= k
//                         abort, ranks < k are rewound to the base: as before Begin; when a rank
//                         cannot rewind (a recurrent or lapped layer) it stays moved.
//   Abort, Rewind,
//   SpecSnapshot,
//   SpecRollback          ranks < k moved (Rewind first asks CanRewind of every rank, so a
//                         target some rank cannot reach moves nothing).
// moved_ranks() names the ranks the last refused operation left moved (empty: every rank is in
// the same state); the refusal's message names them too.
//
// REQUIRES: the GroupClient that created it outlives it.
class GroupSession {
 public:
  ~GroupSession();  // Release(), best effort
  GroupSession(const GroupSession&) = delete;
  GroupSession& operator=(const GroupSession&) = delete;

  uint64_t group_id() const { return group_id_; }
  uint32_t ranks() const { return static_cast<uint32_t>(sessions_.size()); }
  // REQUIRES: r < ranks().
  Session& rank(uint32_t r) { return *sessions_[r]; }
  const std::vector<uint32_t>& moved_ranks() const { return moved_; }

  absl::StatusOr<GroupTransaction> Begin();
  absl::Status PrepareAppend(const GroupTransaction& transaction, uint64_t rows);
  absl::Status PublishAppend(const GroupTransaction& transaction);
  // The committed length (every rank's).
  absl::StatusOr<uint64_t> Commit(const GroupTransaction& transaction, uint64_t accepted_rows,
                                  absl::Span<const int32_t> token_ids = {});
  absl::StatusOr<uint64_t> Abort(const GroupTransaction& transaction);
  absl::StatusOr<uint64_t> Rewind(uint64_t target);
  absl::Status SpecSnapshot();
  absl::StatusOr<uint64_t> SpecRollback(uint64_t accept_len);
  // Every rank's state, by rank.
  absl::StatusOr<std::vector<SessionSnapshot>> State();
  // Releases every rank's session (each is tried); the bytes freed on all ranks. The first
  // refusal, naming its rank, when one refused.
  absl::StatusOr<uint64_t> Release();

 private:
  friend class GroupClient;
  GroupSession(GroupClient* client, uint64_t group_id,
               std::vector<std::unique_ptr<Session>> sessions)
      : client_(client), group_id_(group_id), sessions_(std::move(sessions)) {}
  // Rank r's refusal as the group reports it, with the ranks left moved.
  absl::Status Refused(uint32_t r, const absl::Status& status, std::vector<uint32_t> moved);
  // Aborts `transaction` on every rank after rank `refused` refused a call of it; the ranks
  // before `refused` whose abort failed (left moved).
  std::vector<uint32_t> AbortEveryRank(const GroupTransaction& transaction, uint32_t refused);

  GroupClient* const client_;
  const uint64_t group_id_;
  std::vector<std::unique_ptr<Session>> sessions_;
  std::vector<uint32_t> moved_;
};

class GroupClient {
 public:
  // Connects to and attaches on every rank's daemon of `file` (rank order). The first rank that
  // cannot be reached or attached is the refusal, naming it; nothing stays attached then.
  static absl::StatusOr<std::unique_ptr<GroupClient>> Connect(const GroupFile& file,
                                                              GroupClientOptions options = {});

  uint32_t ranks() const { return static_cast<uint32_t>(clients_.size()); }
  // REQUIRES: r < ranks().
  KvClient& rank(uint32_t r) { return *clients_[r]; }
  const GroupFile& file() const { return file_; }

  // Plans the layout (PlanGroupLayout; INVALID_ARGUMENT as it refuses) and registers the plan
  // on every rank.
  absl::StatusOr<GroupPlan> RegisterPlan(const ModelPlan& plan);
  // Every rank's exact shard cost for `capacity` as its daemon prices it (KvAdmin.GetCost).
  absl::StatusOr<std::vector<uint64_t>> Price(const GroupPlan& plan, uint64_t capacity,
                                              bool spec_snapshot = false);

  // ---- Admission (the two phases, and both at once) ----
  // Prices, then reserves every rank's shard under a fresh group id (PENDING until the
  // deadline). A refusal releases the ranks that reserved and names the rank that refused.
  absl::StatusOr<GroupAdmission> Reserve(const GroupPlan& plan, uint64_t capacity,
                                         bool spec_snapshot = false);
  // Confirms every rank; a refusal (a deadline passed, a daemon restarted) releases every rank.
  absl::Status Confirm(GroupAdmission& admission);
  // Reserve + Confirm: the group's one yes or no.
  absl::StatusOr<GroupAdmission> Admit(const GroupPlan& plan, uint64_t capacity,
                                       bool spec_snapshot = false);
  // Releases every rank's reservation that is still held (NOT_FOUND ranks hold nothing and are
  // not refusals); the bytes freed.
  absl::StatusOr<uint64_t> Release(const GroupAdmission& admission);

  // ---- Sessions ----
  // One session per rank from a confirmed admission (consumed). A rank's refusal releases the
  // sessions created and the reservations left: nothing stays held.
  absl::StatusOr<std::unique_ptr<GroupSession>> CreateSession(const GroupPlan& plan,
                                                              GroupAdmission admission);
  // Admit + CreateSession.
  absl::StatusOr<std::unique_ptr<GroupSession>> CreateSession(const GroupPlan& plan,
                                                              uint64_t capacity,
                                                              bool spec_snapshot = false);

  // ---- Prefixes ----
  // Captures every rank's shard at `boundary_tokens`. A rank's refusal names it; ranks before
  // it hold their shard, which no group lookup finds without the others (LRU evicts it).
  absl::Status CapturePrefix(GroupSession& session, absl::Span<const int32_t> token_ids,
                             uint64_t boundary_tokens);
  // The longest boundary every rank holds for `token_ids` (each rank's own shard shape).
  absl::StatusOr<GroupPrefixMatch> LookupPrefix(const GroupPlan& plan, uint64_t capacity,
                                                absl::Span<const int32_t> token_ids);
  // Restores the longest group hit into the FRESH `session` on every rank, or on none: a rank's
  // refusal resets the ranks already restored (fresh again). The restored length; NOT_FOUND on
  // a group miss.
  absl::StatusOr<uint64_t> RestorePrefix(const GroupPlan& plan, GroupSession& session,
                                         absl::Span<const int32_t> token_ids);

  // "group 0x.. rank r/N (<socket>): <status's message>", the code and details kept.
  absl::Status RankError(uint64_t group_id, uint32_t r, const absl::Status& status) const;

 private:
  GroupClient(GroupFile file, GroupClientOptions options,
              std::vector<std::unique_ptr<KvClient>> clients)
      : file_(std::move(file)), options_(std::move(options)), clients_(std::move(clients)) {}
  // Rank r's session options for `capacity` (its shard).
  SessionOptions RankOptions(const GroupPlan& plan, uint32_t r, uint64_t capacity,
                             bool spec_snapshot) const;

  const GroupFile file_;
  const GroupClientOptions options_;
  std::vector<std::unique_ptr<KvClient>> clients_;
};

}  // namespace memra

#endif  // MEMRA_CLIENT_GROUP_H_
