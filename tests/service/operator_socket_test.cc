// The two sockets of one daemon (server/edge/served_socket.h): the engine socket refuses every call
// that affects or reveals other engines, naming the admin socket, and still answers the
// read-only queries; the admin socket serves those calls. And a prefix capture is keyed by the
// token ids the session committed, not by the request's.

#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/internal.h"
#include "client/prefix_client.h"
#include "common/codec.h"
#include "common/grpc_status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/service/test_daemon.h"
#include "tests/service/test_plans.h"
#include "tests/status_matchers.h"

namespace memra::testing {
namespace {

namespace pb = ::memra::kv::v1;
using ::testing::_;
using ::testing::HasSubstr;
using ::testing::SizeIs;

constexpr uint32_t kBlockTokens = 4;
constexpr uint64_t kCapacity = 64;

const char kTinyQwen[] = R"({
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
    "hidden_size": 512})";

class OperatorSocketTest : public DaemonTest {
 protected:
  void ConfigureDaemon(DaemonConfig& config) override {
    config.prefix_cache_budget_bytes = uint64_t{8} << 20;
    config.prefix_block_tokens = kBlockTokens;
    config.cache_scope_allow = absl::StrCat("shared:", getuid());
  }

  // The prefix cache's arenas are freed before the fixture counts what is left.
  void TearDown() override {
    EvictAllPrefixEntries();
    DaemonTest::TearDown();
  }

  // A KvAdmin / KvPrefixCache call through `client`'s channel.
  template <typename Stub, typename Request, typename Response>
  absl::Status Call(KvClient& client,
                    grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&, Response*),
                    const Request& request, Response* response) {
    Stub* stub;
    if constexpr (std::is_same_v<Stub, pb::KvPrefixCache::Stub>) {
      stub = &ClientInternals::Prefix(client);
    } else {
      stub = &ClientInternals::Admin(client);
    }
    return FromGrpcStatus((stub->*method)(ClientInternals::NewContext(client).get(), request,
                                          response));
  }

  // Commits `tokens` (one row each) to a fresh session of the test plan.
  std::unique_ptr<Session> Committed(const std::vector<int32_t>& tokens) {
    return Committed(*client_, tokens);
  }
  std::unique_ptr<Session> Committed(KvClient& client, const std::vector<int32_t>& tokens) {
    return CommittedSession(client, kCapacity, tokens);
  }

  // A refusal of the engine socket: PERMISSION_DENIED naming the call and the admin socket.
  auto RefusedNaming(const std::string& rpc) {
    return StatusIs(absl::StatusCode::kPermissionDenied,
                    HasSubstrs(rpc, "served only on the admin socket",
                               daemon_->admin_socket_path()));
  }
};

TEST_F(OperatorSocketTest, AdminSocketIsBesideTheEngineSocketWithMode0600) {
  EXPECT_EQ(daemon_->admin_socket_path(), dir_ + "/kvd.admin.sock");
  struct stat admin {};
  ASSERT_EQ(stat(daemon_->admin_socket_path().c_str(), &admin), 0);
  EXPECT_TRUE(S_ISSOCK(admin.st_mode));
  EXPECT_EQ(admin.st_mode & 0777, 0600u);
}

TEST_F(OperatorSocketTest, EngineSocketRefusesEveryOperatorCallAndChangesNothing) {
  std::unique_ptr<Session> session = Committed({1, 2, 3, 4});
  ASSERT_NE(session, nullptr);
  ASSERT_THAT(client_->prefixes().Capture(*session, std::vector<int32_t>{1, 2, 3, 4}, 4).status(),
              IsOk());
  KvClient& engine = *client_;

  pb::DrainResponse drained;
  EXPECT_THAT(Call(engine, &pb::KvAdmin::Stub::Drain, pb::DrainRequest(), &drained),
              RefusedNaming("KvAdmin.Drain"));
  EXPECT_FALSE(daemon_->GetStatus().draining());
  pb::UndrainResponse undrained;
  EXPECT_THAT(Call(engine, &pb::KvAdmin::Stub::Undrain, pb::UndrainRequest(), &undrained),
              RefusedNaming("KvAdmin.Undrain"));
  pb::ListSessionsResponse sessions;
  EXPECT_THAT(Call(engine, &pb::KvAdmin::Stub::ListSessions, pb::ListSessionsRequest(), &sessions),
              RefusedNaming("KvAdmin.ListSessions"));
  EXPECT_THAT(sessions.sessions(), SizeIs(0));
  pb::ListEnginesResponse engines;
  EXPECT_THAT(Call(engine, &pb::KvAdmin::Stub::ListEngines, pb::ListEnginesRequest(), &engines),
              RefusedNaming("KvAdmin.ListEngines"));
  EXPECT_THAT(engines.engines(), SizeIs(0));
  pb::ImportModelRequest import;
  import.set_hf_config_json(kTinyQwen);
  import.set_register_(true);
  pb::ImportModelResponse imported;
  EXPECT_THAT(Call(engine, &pb::KvAdmin::Stub::ImportModel, import, &imported),
              RefusedNaming("KvAdmin.ImportModel with register = true"));
  EXPECT_EQ(daemon_->GetStatus().plans(), 1u);  // the fixture's plan only

  pb::ListPrefixesResponse listed;
  EXPECT_THAT(Call(engine, &pb::KvPrefixCache::Stub::ListPrefixes, pb::ListPrefixesRequest(),
                   &listed),
              RefusedNaming("KvPrefixCache.ListPrefixes"));
  EXPECT_THAT(listed.entries(), SizeIs(0));
  pb::InspectPrefixRequest inspect;
  inspect.set_entry_id(1);
  pb::PrefixEntry entry;
  EXPECT_THAT(Call(engine, &pb::KvPrefixCache::Stub::InspectPrefix, inspect, &entry),
              RefusedNaming("KvPrefixCache.InspectPrefix"));
  pb::EvictPrefixRequest evict;
  evict.set_entry_id(1);
  pb::EvictPrefixResponse evicted;
  EXPECT_THAT(Call(engine, &pb::KvPrefixCache::Stub::EvictPrefix, evict, &evicted),
              RefusedNaming("KvPrefixCache.EvictPrefix"));
  EXPECT_EQ(daemon_->prefix_cache()->Stats().entries, 1u);
}

TEST_F(OperatorSocketTest, AdminSocketServesTheOperatorCalls) {
  std::unique_ptr<Session> session = Committed({1, 2, 3, 4});
  ASSERT_NE(session, nullptr);
  absl::StatusOr<PrefixCaptured> captured =
      client_->prefixes().Capture(*session, std::vector<int32_t>{1, 2, 3, 4}, 4);
  ASSERT_THAT(captured.status(), IsOk());
  std::unique_ptr<KvClient> operator_client = NewOperator();
  ASSERT_NE(operator_client, nullptr);
  KvClient& admin = *operator_client;

  pb::ListSessionsResponse sessions;
  ASSERT_THAT(Call(admin, &pb::KvAdmin::Stub::ListSessions, pb::ListSessionsRequest(), &sessions),
              IsOk());
  ASSERT_THAT(sessions.sessions(), SizeIs(1));
  EXPECT_EQ(sessions.sessions(0).engine_id(), client_->engine_id());
  pb::ListEnginesResponse engines;
  ASSERT_THAT(Call(admin, &pb::KvAdmin::Stub::ListEngines, pb::ListEnginesRequest(), &engines),
              IsOk());
  ASSERT_THAT(engines.engines(), SizeIs(1));
  EXPECT_EQ(engines.engines(0).engine_name(), "engine-a");

  pb::DrainResponse drained;
  ASSERT_THAT(Call(admin, &pb::KvAdmin::Stub::Drain, pb::DrainRequest(), &drained), IsOk());
  EXPECT_EQ(drained.sessions_open(), 1u);
  EXPECT_TRUE(daemon_->GetStatus().draining());
  pb::UndrainResponse undrained;
  ASSERT_THAT(Call(admin, &pb::KvAdmin::Stub::Undrain, pb::UndrainRequest(), &undrained), IsOk());
  EXPECT_FALSE(daemon_->GetStatus().draining());

  pb::ImportModelRequest import;
  import.set_hf_config_json(kTinyQwen);
  import.set_register_(true);
  pb::ImportModelResponse imported;
  ASSERT_THAT(Call(admin, &pb::KvAdmin::Stub::ImportModel, import, &imported), IsOk());
  EXPECT_TRUE(imported.registered());
  EXPECT_EQ(daemon_->GetStatus().plans(), 2u);

  pb::ListPrefixesResponse listed;
  ASSERT_THAT(Call(admin, &pb::KvPrefixCache::Stub::ListPrefixes, pb::ListPrefixesRequest(),
                   &listed),
              IsOk());
  ASSERT_THAT(listed.entries(), SizeIs(1));
  pb::InspectPrefixRequest inspect;
  inspect.set_entry_id(captured->entry_id);
  pb::PrefixEntry entry;
  ASSERT_THAT(Call(admin, &pb::KvPrefixCache::Stub::InspectPrefix, inspect, &entry), IsOk());
  EXPECT_EQ(entry.boundary_tokens(), 4u);
  pb::EvictPrefixRequest evict;
  evict.set_entry_id(captured->entry_id);
  pb::EvictPrefixResponse evicted;
  ASSERT_THAT(Call(admin, &pb::KvPrefixCache::Stub::EvictPrefix, evict, &evicted), IsOk());
  EXPECT_GT(evicted.freed_bytes(), 0u);
  EXPECT_EQ(daemon_->prefix_cache()->Stats().entries, 0u);

  // Engines' calls are not served there: an operator cannot attach through it.
  EXPECT_THAT(admin.Attach("operator"), StatusIs(absl::StatusCode::kUnimplemented, _));
}

TEST_F(OperatorSocketTest, EngineSocketAnswersReadOnlyQueriesWithoutOtherEngines) {
  std::unique_ptr<KvClient> other = NewClient("engine-b");
  ASSERT_NE(other, nullptr);
  KvClient& engine = *client_;
  pb::CostRequest cost_request;
  cost_request.mutable_model()->set_plan_fingerprint(FingerprintToBytes(plan_));
  cost_request.mutable_shape()->set_capacity(kCapacity);
  pb::CostResponse cost;
  EXPECT_THAT(Call(engine, &pb::KvAdmin::Stub::GetCost, cost_request, &cost), IsOk());
  EXPECT_GT(cost.arena_bytes(), 0u);
  pb::FitRequest fit_request;
  *fit_request.mutable_model() = cost_request.model();
  *fit_request.mutable_shape() = cost_request.shape();
  pb::FitResponse fit;
  EXPECT_THAT(Call(engine, &pb::KvAdmin::Stub::GetFit, fit_request, &fit), IsOk());
  EXPECT_GT(fit.sessions_now(), 0u);
  pb::MaxContextRequest max_request;
  *max_request.mutable_model() = cost_request.model();
  pb::MaxContextResponse max_context;
  EXPECT_THAT(Call(engine, &pb::KvAdmin::Stub::GetMaxContext, max_request, &max_context), IsOk());
  EXPECT_GT(max_context.max_context_now(), 0u);
  pb::ImportModelRequest import;  // a conversion, registering nothing
  import.set_hf_config_json(kTinyQwen);
  pb::ImportModelResponse imported;
  EXPECT_THAT(Call(engine, &pb::KvAdmin::Stub::ImportModel, import, &imported), IsOk());
  EXPECT_FALSE(imported.registered());

  // The totals, not who the other engines are.
  absl::StatusOr<pb::GetStatusResponse> status = ClientInternals::GetStatus(engine);
  ASSERT_THAT(status.status(), IsOk());
  EXPECT_EQ(status->engines(), 2u);
  EXPECT_THAT(status->engine_status(), SizeIs(0));
  std::unique_ptr<KvClient> operator_client = NewOperator();
  ASSERT_NE(operator_client, nullptr);
  status = ClientInternals::GetStatus(*operator_client);
  ASSERT_THAT(status.status(), IsOk());
  EXPECT_THAT(status->engine_status(), SizeIs(2));
}

// An engine that committed tokens A cannot store its rows under tokens B: refused, nothing
// stored, and the honest capture of B afterwards is a new entry.
TEST_F(OperatorSocketTest, CaptureIsKeyedByTheCommittedTokenIds) {
  const std::vector<int32_t> honest_ids = {11, 12, 13, 14, 15, 16, 17, 18};
  const std::vector<int32_t> forged_ids = {11, 12, 13, 14, 15, 99, 17, 18};
  std::unique_ptr<Session> forger = Committed(honest_ids);
  ASSERT_NE(forger, nullptr);
  EXPECT_THAT(client_->prefixes().Capture(*forger, forged_ids, 8).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("token id at position 5 is 99 in the request",
                                  absl::StrCat("session ", forger->id(), " committed 16"))));
  EXPECT_EQ(daemon_->prefix_cache()->Stats().entries, 0u);
  SessionOptions shape = Options(kCapacity, false);
  absl::StatusOr<PrefixMatch> match = client_->prefixes().Lookup(plan_, shape, forged_ids);
  ASSERT_THAT(match.status(), IsOk());
  EXPECT_EQ(match->matched_tokens, 0u);

  std::unique_ptr<Session> honest = Committed(forged_ids);
  ASSERT_NE(honest, nullptr);
  absl::StatusOr<PrefixCaptured> captured = client_->prefixes().Capture(*honest, forged_ids, 8);
  ASSERT_THAT(captured.status(), IsOk());
  EXPECT_FALSE(captured->already_present);
  EXPECT_EQ(daemon_->prefix_cache()->Stats().entries, 1u);

  // A session committed without token ids cannot be captured at all.
  std::unique_ptr<Session> unknown = NewSession(*client_, kCapacity, /*spec_snapshot=*/false);
  ASSERT_NE(unknown, nullptr);
  absl::StatusOr<Transaction> transaction = unknown->Begin();
  ASSERT_THAT(transaction.status(), IsOk());
  ASSERT_THAT(unknown->PrepareAppend(transaction->generation, 8).status(), IsOk());
  ASSERT_THAT(unknown->PublishAppend(transaction->generation).status(), IsOk());
  ASSERT_THAT(unknown->Commit(transaction->generation, 8).status(), IsOk());
  EXPECT_THAT(client_->prefixes().Capture(*unknown, honest_ids, 8).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("commit with token ids to capture")));
  EXPECT_EQ(daemon_->prefix_cache()->Stats().entries, 1u);
}

// Entries live in the capturing engine's cache scope: an engine of another scope finds, restores
// and hears nothing of them; an engine reads only its own scope; operators see every scope.
TEST_F(OperatorSocketTest, PrefixEntriesStayInTheirCacheScope) {
  const std::vector<int32_t> ids = {21, 22, 23, 24, 25, 26, 27, 28};
  const std::string own_scope = absl::StrCat("uid:", getuid());
  EXPECT_EQ(client_->cache_scope(), own_scope);
  std::unique_ptr<Session> mine = Committed(ids);
  ASSERT_NE(mine, nullptr);
  absl::StatusOr<PrefixCaptured> captured = client_->prefixes().Capture(*mine, ids, 8);
  ASSERT_THAT(captured.status(), IsOk());

  ClientOptions options;
  options.cache_scope = "team";
  absl::StatusOr<std::unique_ptr<KvClient>> refused =
      KvClient::Connect(daemon_->socket_path(), options);
  ASSERT_THAT(refused.status(), IsOk());
  EXPECT_THAT((*refused)->Attach("team-engine"),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstrs("cache scope \"team\" is not allowed to uid",
                                  "no cache_scope_allow rule", own_scope)));
  options.cache_scope = "shared";
  absl::StatusOr<std::unique_ptr<KvClient>> shared =
      KvClient::Connect(daemon_->socket_path(), options);
  ASSERT_THAT(shared.status(), IsOk());
  ASSERT_THAT((*shared)->Attach("shared-engine"), IsOk());
  EXPECT_EQ((*shared)->cache_scope(), "shared");

  // The other scope finds and restores nothing, by match or by entry id.
  const SessionOptions shape = Options(kCapacity, false);
  absl::StatusOr<PrefixMatch> match = (*shared)->prefixes().Lookup(plan_, shape, ids);
  ASSERT_THAT(match.status(), IsOk());
  EXPECT_EQ(match->matched_tokens, 0u);
  std::unique_ptr<Session> fresh = NewSession(**shared, kCapacity, /*spec_snapshot=*/false);
  ASSERT_NE(fresh, nullptr);
  EXPECT_THAT((*shared)->prefixes().Restore(*fresh, ids, captured->entry_id).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("is not in cache scope shared")));
  EXPECT_THAT((*shared)->prefixes().Restore(*fresh, ids).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no stored prefix matches")));

  // Its own capture of the same prompt is its own entry; its subscription hears only that.
  std::unique_ptr<Session> theirs = Committed(**shared, ids);
  ASSERT_NE(theirs, nullptr);
  absl::StatusOr<PrefixCaptured> their_capture = (*shared)->prefixes().Capture(*theirs, ids, 8);
  ASSERT_THAT(their_capture.status(), IsOk());
  EXPECT_FALSE(their_capture->already_present);
  std::unique_ptr<PrefixEventStream> events = (*shared)->prefixes().SubscribeEvents();
  absl::StatusOr<std::optional<PrefixCacheEvent>> heard = events->Next();
  ASSERT_THAT(heard.status(), IsOk());
  ASSERT_TRUE(heard->has_value());
  EXPECT_EQ((*heard)->sequence, 2u);  // sequence 1 was the other scope's capture
  EXPECT_EQ((*heard)->cache_scope, "shared");
  events->Cancel();

  // An engine reads only its own scope, whatever it asks for.
  pb::LookupPrefixRequest lookup;
  ASSERT_THAT(ClientInternals::Engine(*client_).status(), IsOk());
  *lookup.mutable_engine() = *ClientInternals::Engine(*client_);
  lookup.mutable_shape()->set_plan_fingerprint(FingerprintToBytes(plan_));
  lookup.mutable_token_ids()->Add(ids.begin(), ids.end());
  lookup.set_cache_scope("shared");
  pb::LookupPrefixResponse found;
  EXPECT_THAT(Call(*client_, &pb::KvPrefixCache::Stub::Lookup, lookup, &found),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstrs("reads only its own cache scope", own_scope, "\"shared\"")));
  lookup.clear_engine();
  lookup.clear_cache_scope();
  EXPECT_THAT(Call(*client_, &pb::KvPrefixCache::Stub::Lookup, lookup, &found),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("engine 0")));

  // Operators see both scopes and look into any one they name.
  std::unique_ptr<KvClient> admin = NewOperator();
  ASSERT_NE(admin, nullptr);
  pb::ListPrefixesResponse listed;
  ASSERT_THAT(Call(*admin, &pb::KvPrefixCache::Stub::ListPrefixes, pb::ListPrefixesRequest(),
                   &listed),
              IsOk());
  std::vector<std::string> scopes;
  for (const pb::PrefixEntry& entry : listed.entries()) scopes.push_back(entry.cache_scope());
  EXPECT_THAT(scopes, ::testing::UnorderedElementsAre(own_scope, "shared"));
  EXPECT_THAT(Call(*admin, &pb::KvPrefixCache::Stub::Lookup, lookup, &found),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("names the cache scope")));
  lookup.set_cache_scope("shared");
  ASSERT_THAT(Call(*admin, &pb::KvPrefixCache::Stub::Lookup, lookup, &found), IsOk());
  EXPECT_EQ(found.entry_id(), their_capture->entry_id);
  EXPECT_EQ(found.matched_tokens(), 8u);
}

}  // namespace
}  // namespace memra::testing
