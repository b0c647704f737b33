#include "client/group.h"

#include <algorithm>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/internal.h"
#include "common/codec.h"
#include "common/grpc_status.h"
#include "core/status_macros.h"

namespace memra {
namespace {

namespace pb = ::memra::kv::v1;

// A fresh non-zero group id: two admissions of one engine never share one (ALREADY_EXISTS).
uint64_t NewGroupId() {
  static thread_local std::mt19937_64 random{std::random_device{}()};
  uint64_t id = 0;
  while (id == 0) id = random();
  return id;
}

// `status`'s code and payloads (an AdmissionRefusal stays readable) with `message`.
absl::Status Reworded(const absl::Status& status, absl::string_view message) {
  absl::Status reworded(status.code(), message);
  status.ForEachPayload([&](absl::string_view type_url, const absl::Cord& payload) {
    reworded.SetPayload(type_url, payload);
  });
  return reworded;
}

absl::Status Prefixed(absl::string_view prefix, const absl::Status& status) {
  return Reworded(status, absl::StrCat(prefix, status.message()));
}

std::string RankList(const std::vector<uint32_t>& ranks) {
  return ranks.empty() ? "none" : absl::StrJoin(ranks, ", ");
}

std::vector<uint32_t> RanksBelow(uint32_t k) {
  std::vector<uint32_t> ranks(k);
  for (uint32_t r = 0; r < k; ++r) ranks[r] = r;
  return ranks;
}

pb::GroupRankRequest GroupRankRequestOf(uint64_t group_id, const pb::EngineRef& engine) {
  pb::GroupRankRequest request;
  *request.mutable_engine() = engine;
  request.set_group_id(group_id);
  return request;
}

}  // namespace

// ---- GroupClient ----------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<GroupClient>> GroupClient::Connect(const GroupFile& file,
                                                                  GroupClientOptions options) {
  if (file.ranks.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("group ", file.name, " has no ranks"));
  }
  std::vector<std::unique_ptr<KvClient>> clients;
  for (const GroupRankEndpoint& endpoint : file.ranks) {
    const std::string where =
        absl::StrCat("group ", file.name, " rank ", endpoint.rank, "/", file.ranks.size(), " (",
                     endpoint.socket, "): ");
    absl::StatusOr<std::unique_ptr<KvClient>> client =
        KvClient::Connect(endpoint.socket, options.client);
    if (!client.ok()) return Prefixed(where, client.status());
    if (absl::Status attached =
            (*client)->Attach(absl::StrCat(options.engine_name, " rank ", endpoint.rank));
        !attached.ok()) {
      return Prefixed(where, attached);
    }
    clients.push_back(*std::move(client));
  }
  return std::unique_ptr<GroupClient>(
      new GroupClient(file, std::move(options), std::move(clients)));
}

absl::Status GroupClient::RankError(uint64_t group_id, uint32_t r,
                                    const absl::Status& status) const {
  return Prefixed(absl::StrCat("group 0x", absl::Hex(group_id), " rank ", r, "/", ranks(), " (",
                               file_.ranks[r].socket, "): "),
                  status);
}

SessionOptions GroupClient::RankOptions(const GroupPlan& plan, uint32_t r, uint64_t capacity,
                                        bool spec_snapshot) const {
  const SessionShape shape = WithRequest(plan.layout.ranks[r], capacity, spec_snapshot);
  SessionOptions options;
  options.capacity = shape.capacity;
  options.layer_lo = shape.layer_lo;
  options.layer_hi = shape.layer_hi;
  options.tp_ranks = shape.tp_ranks;
  options.spec_snapshot = shape.spec_snapshot;
  return options;
}

absl::StatusOr<GroupPlan> GroupClient::RegisterPlan(const ModelPlan& plan) {
  GroupPlan registered;
  ASSIGN_OR_RETURN(registered.layout, PlanGroupLayout(plan, file_.shape));
  if (registered.layout.ranks.size() != clients_.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "group ", file_.name, ": the layout has ", registered.layout.ranks.size(),
        " ranks, the group file ", clients_.size()));
  }
  for (uint32_t r = 0; r < ranks(); ++r) {
    absl::StatusOr<PlanFingerprint> fingerprint = clients_[r]->RegisterPlan(plan);
    if (!fingerprint.ok()) return RankError(0, r, fingerprint.status());
    registered.fingerprint = *fingerprint;  // one plan: the same fingerprint on every rank
  }
  return registered;
}

absl::StatusOr<std::vector<uint64_t>> GroupClient::Price(const GroupPlan& plan, uint64_t capacity,
                                                         bool spec_snapshot) {
  std::vector<uint64_t> bytes(ranks());
  for (uint32_t r = 0; r < ranks(); ++r) {
    const SessionOptions options = RankOptions(plan, r, capacity, spec_snapshot);
    pb::CostRequest request;
    request.mutable_model()->set_plan_fingerprint(FingerprintToBytes(plan.fingerprint));
    pb::SessionShape* shape = request.mutable_shape();
    shape->set_capacity(options.capacity);
    shape->set_layer_lo(options.layer_lo);
    if (options.layer_hi.has_value()) shape->set_layer_hi(*options.layer_hi);
    shape->set_tp_ranks(options.tp_ranks);
    shape->set_spec_snapshot(options.spec_snapshot);
    pb::CostResponse response;
    absl::Status priced = FromGrpcStatus(ClientInternals::Admin(*clients_[r])
                                             .GetCost(ClientInternals::NewContext(*clients_[r]).get(),
                                                      request, &response));
    if (!priced.ok()) return RankError(0, r, priced);
    bytes[r] = response.arena_bytes();
  }
  return bytes;
}

absl::StatusOr<GroupAdmission> GroupClient::Reserve(const GroupPlan& plan, uint64_t capacity,
                                                    bool spec_snapshot) {
  ASSIGN_OR_RETURN(std::vector<uint64_t> prices, Price(plan, capacity, spec_snapshot));
  GroupAdmission admission;
  admission.group_id = NewGroupId();
  admission.capacity = capacity;
  admission.spec_snapshot = spec_snapshot;
  for (uint32_t r = 0; r < ranks(); ++r) {
    KvClient& client = *clients_[r];
    absl::Status reserved = [&]() -> absl::Status {
      ASSIGN_OR_RETURN(pb::EngineRef engine, ClientInternals::Engine(client));
      const SessionOptions options = RankOptions(plan, r, capacity, spec_snapshot);
      pb::ReserveGroupRankRequest request;
      *request.mutable_engine() = engine;
      request.mutable_group()->set_group_id(admission.group_id);
      request.mutable_group()->set_rank(r);
      request.mutable_group()->set_ranks(ranks());
      request.set_plan_fingerprint(FingerprintToBytes(plan.fingerprint));
      request.set_capacity(options.capacity);
      request.set_layer_lo(options.layer_lo);
      if (options.layer_hi.has_value()) request.set_layer_hi(*options.layer_hi);
      request.set_tp_ranks(options.tp_ranks);
      request.set_spec_snapshot(options.spec_snapshot);
      request.set_deadline_ms(
          static_cast<uint64_t>(absl::ToInt64Milliseconds(options_.admission_deadline)));
      request.set_expected_bytes(prices[r]);
      pb::GroupRankState state;
      RETURN_IF_ERROR(FromGrpcStatus(ClientInternals::Group(client).ReserveGroupRank(
          ClientInternals::NewContext(client).get(), request, &state)));
      admission.reservation_ids.push_back(state.reservation_id());
      admission.bytes.push_back(state.bytes());
      return absl::OkStatus();
    }();
    if (!reserved.ok()) {
      // One answer: nothing held anywhere (a release that fails leaves a PENDING reservation
      // its daemon frees at the deadline).
      (void)Release(admission);
      return RankError(admission.group_id, r, reserved);
    }
  }
  return admission;
}

absl::Status GroupClient::Confirm(GroupAdmission& admission) {
  if (admission.reservation_ids.size() != ranks()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group 0x", absl::Hex(admission.group_id), " holds ", admission.reservation_ids.size(),
        " of ", ranks(), " ranks' reservations: reserve on every rank first"));
  }
  for (uint32_t r = 0; r < ranks(); ++r) {
    KvClient& client = *clients_[r];
    absl::Status confirmed = [&]() -> absl::Status {
      ASSIGN_OR_RETURN(pb::EngineRef engine, ClientInternals::Engine(client));
      pb::GroupRankState state;
      return FromGrpcStatus(ClientInternals::Group(client).ConfirmGroupRank(
          ClientInternals::NewContext(client).get(),
          GroupRankRequestOf(admission.group_id, engine), &state));
    }();
    if (!confirmed.ok()) {
      (void)Release(admission);
      return RankError(admission.group_id, r, confirmed);
    }
  }
  admission.confirmed = true;
  return absl::OkStatus();
}

absl::StatusOr<GroupAdmission> GroupClient::Admit(const GroupPlan& plan, uint64_t capacity,
                                                  bool spec_snapshot) {
  ASSIGN_OR_RETURN(GroupAdmission admission, Reserve(plan, capacity, spec_snapshot));
  RETURN_IF_ERROR(Confirm(admission));
  return admission;
}

absl::StatusOr<uint64_t> GroupClient::Release(const GroupAdmission& admission) {
  uint64_t freed = 0;
  absl::Status first;
  for (uint32_t r = 0; r < admission.reservation_ids.size() && r < ranks(); ++r) {
    KvClient& client = *clients_[r];
    absl::Status released = [&]() -> absl::Status {
      ASSIGN_OR_RETURN(pb::EngineRef engine, ClientInternals::Engine(client));
      pb::ReleaseGroupRankResponse response;
      RETURN_IF_ERROR(FromGrpcStatus(ClientInternals::Group(client).ReleaseGroupRank(
          ClientInternals::NewContext(client).get(),
          GroupRankRequestOf(admission.group_id, engine), &response)));
      freed += response.freed_bytes();
      return absl::OkStatus();
    }();
    // NOT_FOUND: nothing held there (used, freed at the deadline, lost in a restart).
    if (!released.ok() && !absl::IsNotFound(released) && first.ok()) {
      first = RankError(admission.group_id, r, released);
    }
  }
  if (!first.ok()) return first;
  return freed;
}

absl::StatusOr<std::unique_ptr<GroupSession>> GroupClient::CreateSession(
    const GroupPlan& plan, GroupAdmission admission) {
  if (!admission.confirmed || admission.reservation_ids.size() != ranks()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group 0x", absl::Hex(admission.group_id),
        " is not confirmed on every rank: Admit (or Reserve + Confirm) first"));
  }
  std::vector<std::unique_ptr<Session>> sessions;
  for (uint32_t r = 0; r < ranks(); ++r) {
    SessionOptions options = RankOptions(plan, r, admission.capacity, admission.spec_snapshot);
    options.reservation_id = admission.reservation_ids[r];
    absl::StatusOr<std::unique_ptr<Session>> session =
        clients_[r]->CreateSession(plan.fingerprint, options);
    if (!session.ok()) {
      for (std::unique_ptr<Session>& created : sessions) (void)created->Release();
      (void)Release(admission);  // the ranks not reached still hold theirs
      return RankError(admission.group_id, r, session.status());
    }
    sessions.push_back(*std::move(session));
  }
  return std::unique_ptr<GroupSession>(
      new GroupSession(this, admission.group_id, std::move(sessions)));
}

absl::StatusOr<std::unique_ptr<GroupSession>> GroupClient::CreateSession(const GroupPlan& plan,
                                                                         uint64_t capacity,
                                                                         bool spec_snapshot) {
  ASSIGN_OR_RETURN(GroupAdmission admission, Admit(plan, capacity, spec_snapshot));
  return CreateSession(plan, std::move(admission));
}

absl::Status GroupClient::CapturePrefix(GroupSession& session, absl::Span<const int32_t> token_ids,
                                        uint64_t boundary_tokens) {
  for (uint32_t r = 0; r < session.ranks(); ++r) {
    absl::StatusOr<PrefixCaptured> captured =
        clients_[r]->prefixes().Capture(session.rank(r), token_ids, boundary_tokens);
    if (!captured.ok()) return RankError(session.group_id(), r, captured.status());
  }
  return absl::OkStatus();
}

absl::StatusOr<GroupPrefixMatch> GroupClient::LookupPrefix(const GroupPlan& plan,
                                                           uint64_t capacity,
                                                           absl::Span<const int32_t> token_ids) {
  // Each rank answers its longest boundary; ask again below the shortest until every rank
  // answers the same one. Each round lowers the bound, so it ends (a miss at 0).
  absl::Span<const int32_t> asked = token_ids;
  while (true) {
    GroupPrefixMatch match;
    uint64_t shortest = asked.size();
    bool agree = true;
    for (uint32_t r = 0; r < ranks(); ++r) {
      absl::StatusOr<PrefixMatch> found =
          clients_[r]->prefixes().Lookup(plan.fingerprint, RankOptions(plan, r, capacity, false), asked);
      if (!found.ok()) return RankError(0, r, found.status());
      if (r > 0 && found->matched_tokens != match.matched_tokens) agree = false;
      match.matched_tokens = found->matched_tokens;
      shortest = std::min<uint64_t>(shortest, found->matched_tokens);
      match.entry_ids.push_back(found->entry_id);
    }
    if (shortest == 0) return GroupPrefixMatch{};
    if (agree) return match;
    asked = asked.subspan(0, shortest);
  }
}

absl::StatusOr<uint64_t> GroupClient::RestorePrefix(const GroupPlan& plan, GroupSession& session,
                                                    absl::Span<const int32_t> token_ids) {
  ASSIGN_OR_RETURN(const uint64_t capacity, [&]() -> absl::StatusOr<uint64_t> {
    ASSIGN_OR_RETURN(SessionSnapshot state, session.rank(0).State());
    return state.capacity;
  }());
  ASSIGN_OR_RETURN(GroupPrefixMatch match, LookupPrefix(plan, capacity, token_ids));
  if (match.matched_tokens == 0) {
    return absl::NotFoundError(absl::StrCat("group 0x", absl::Hex(session.group_id()),
                                            ": no prefix of the ", token_ids.size(),
                                            " tokens is held by all ", ranks(), " ranks"));
  }
  const absl::Span<const int32_t> prefix = token_ids.subspan(0, match.matched_tokens);
  for (uint32_t r = 0; r < session.ranks(); ++r) {
    absl::StatusOr<PrefixRestored> restored =
        clients_[r]->prefixes().Restore(session.rank(r), prefix, match.entry_ids[r]);
    if (!restored.ok()) {
      // On none: the ranks restored so far are made fresh again.
      std::vector<uint32_t> moved;
      for (uint32_t done = 0; done < r; ++done) {
        if (!session.rank(done).Reset().ok()) moved.push_back(done);
      }
      return session.Refused(r, restored.status(), std::move(moved));
    }
  }
  return match.matched_tokens;
}

// ---- GroupSession ---------------------------------------------------------------------------

GroupSession::~GroupSession() { (void)Release(); }

absl::Status GroupSession::Refused(uint32_t r, const absl::Status& status,
                                   std::vector<uint32_t> moved) {
  moved_ = std::move(moved);
  return client_->RankError(
      group_id_, r,
      Reworded(status, absl::StrCat(status.message(), " [ranks left moved: ", RankList(moved_),
                                    "]")));
}

absl::StatusOr<GroupTransaction> GroupSession::Begin() {
  moved_.clear();
  GroupTransaction transaction;
  for (uint32_t r = 0; r < ranks(); ++r) {
    absl::StatusOr<Transaction> begun = sessions_[r]->Begin();
    if (!begun.ok()) {
      std::vector<uint32_t> moved;
      for (uint32_t done = 0; done < r; ++done) {
        if (!sessions_[done]->Abort(transaction.generations[done]).ok()) moved.push_back(done);
      }
      return Refused(r, begun.status(), std::move(moved));
    }
    transaction.generations.push_back(begun->generation);
    transaction.base_len = begun->base_len;
  }
  return transaction;
}

std::vector<uint32_t> GroupSession::AbortEveryRank(const GroupTransaction& transaction,
                                                   uint32_t refused) {
  std::vector<uint32_t> moved;
  for (uint32_t r = 0; r < ranks(); ++r) {
    // Ranks from `refused` on never got this call: an abort refused there moved nothing.
    if (!sessions_[r]->Abort(transaction.generations[r]).ok() && r < refused) moved.push_back(r);
  }
  return moved;
}

absl::Status GroupSession::PrepareAppend(const GroupTransaction& transaction, uint64_t rows) {
  moved_.clear();
  for (uint32_t r = 0; r < ranks(); ++r) {
    absl::StatusOr<PreparedAppend> prepared =
        sessions_[r]->PrepareAppend(transaction.generations[r], rows);
    if (!prepared.ok()) return Refused(r, prepared.status(), AbortEveryRank(transaction, r));
  }
  return absl::OkStatus();
}

absl::Status GroupSession::PublishAppend(const GroupTransaction& transaction) {
  moved_.clear();
  for (uint32_t r = 0; r < ranks(); ++r) {
    absl::StatusOr<uint64_t> published = sessions_[r]->PublishAppend(transaction.generations[r]);
    if (!published.ok()) return Refused(r, published.status(), AbortEveryRank(transaction, r));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> GroupSession::Commit(const GroupTransaction& transaction,
                                              uint64_t accepted_rows,
                                              absl::Span<const int32_t> token_ids) {
  moved_.clear();
  uint64_t committed = 0;
  for (uint32_t r = 0; r < ranks(); ++r) {
    absl::StatusOr<uint64_t> done =
        sessions_[r]->Commit(transaction.generations[r], accepted_rows, token_ids);
    if (!done.ok()) {
      if (r == 0) return Refused(r, done.status(), {});  // nothing moved; still open
      std::vector<uint32_t> moved;
      for (uint32_t later = r; later < ranks(); ++later) {
        (void)sessions_[later]->Abort(transaction.generations[later]);
      }
      for (uint32_t earlier = 0; earlier < r; ++earlier) {
        absl::StatusOr<bool> can = sessions_[earlier]->CanRewind(transaction.base_len);
        if (!can.ok() || !*can || !sessions_[earlier]->Rewind(transaction.base_len).ok()) {
          moved.push_back(earlier);
        }
      }
      return Refused(r, done.status(), std::move(moved));
    }
    committed = *done;
  }
  return committed;
}

absl::StatusOr<uint64_t> GroupSession::Abort(const GroupTransaction& transaction) {
  moved_.clear();
  uint64_t committed = 0;
  for (uint32_t r = 0; r < ranks(); ++r) {
    absl::StatusOr<uint64_t> aborted = sessions_[r]->Abort(transaction.generations[r]);
    if (!aborted.ok()) return Refused(r, aborted.status(), RanksBelow(r));
    committed = *aborted;
  }
  return committed;
}

absl::StatusOr<uint64_t> GroupSession::Rewind(uint64_t target) {
  moved_.clear();
  for (uint32_t r = 0; r < ranks(); ++r) {
    absl::StatusOr<bool> can = sessions_[r]->CanRewind(target);
    if (!can.ok()) return Refused(r, can.status(), {});
    if (!*can) {
      return Refused(r,
                     absl::FailedPreconditionError(absl::StrCat(
                         "cannot rewind to ", target, " rows (CanRewind: a recurrent or lapped "
                                                      "layer); no rank was rewound")),
                     {});
    }
  }
  uint64_t committed = 0;
  for (uint32_t r = 0; r < ranks(); ++r) {
    absl::StatusOr<SessionSnapshot> rewound = sessions_[r]->Rewind(target);
    if (!rewound.ok()) return Refused(r, rewound.status(), RanksBelow(r));
    committed = rewound->committed_len;
  }
  return committed;
}

absl::Status GroupSession::SpecSnapshot() {
  moved_.clear();
  for (uint32_t r = 0; r < ranks(); ++r) {
    absl::StatusOr<SessionSnapshot> snapshot = sessions_[r]->SpecSnapshot();
    if (!snapshot.ok()) return Refused(r, snapshot.status(), RanksBelow(r));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> GroupSession::SpecRollback(uint64_t accept_len) {
  moved_.clear();
  uint64_t position = 0;
  for (uint32_t r = 0; r < ranks(); ++r) {
    absl::StatusOr<SessionSnapshot> rolled = sessions_[r]->SpecRollback(accept_len);
    if (!rolled.ok()) return Refused(r, rolled.status(), RanksBelow(r));
    position = rolled->position;
  }
  return position;
}

absl::StatusOr<std::vector<SessionSnapshot>> GroupSession::State() {
  std::vector<SessionSnapshot> states;
  for (uint32_t r = 0; r < ranks(); ++r) {
    absl::StatusOr<SessionSnapshot> state = sessions_[r]->State();
    if (!state.ok()) return client_->RankError(group_id_, r, state.status());
    states.push_back(*std::move(state));
  }
  return states;
}

absl::StatusOr<uint64_t> GroupSession::Release() {
  uint64_t freed = 0;
  absl::Status first;
  for (uint32_t r = 0; r < sessions_.size(); ++r) {
    if (sessions_[r] == nullptr) continue;
    absl::StatusOr<uint64_t> released = sessions_[r]->Release();
    if (released.ok()) {
      freed += *released;
    } else if (first.ok()) {
      first = client_->RankError(group_id_, r, released.status());
    }
    sessions_[r].reset();
  }
  if (!first.ok()) return first;
  return freed;
}

}  // namespace memra
