// The daemon's limits (docs/security-model.md#limits), each configured small and driven past
// through the real client over the real socket: the plan layer cap on every path a plan
// arrives on, the reply-size bound it implies, sessions per engine, an engine's share of the
// budget, engines attached and arenas held. Every refusal names its count and its limit.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/internal.h"
#include "common/codec.h"
#include "common/grpc_status.h"
#include "core/admission.h"
#include "core/test_model_plans.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/memra/kv/v1/admin.grpc.pb.h"
#include "proto/memra/kv/v1/cache.grpc.pb.h"
#include "tests/service/test_daemon.h"
#include "tests/status_matchers.h"

namespace memra::testing {
namespace {

namespace pb = ::memra::kv::v1;

using ::memra::test_plans::DenseModel;
using ::memra::test_plans::KvLayer;
using ::memra::test_plans::LatentLayer;
using ::memra::test_plans::RecurrentLayer;
using ::memra::test_plans::SharedLayer;
using ::memra::test_plans::SlidingLayer;

constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
constexpr auto kExhausted = absl::StatusCode::kResourceExhausted;
// gRPC's default receive limit, which KvClient keeps.
constexpr size_t kClientReceiveLimit = size_t{4} << 20;

// ---- The plan layer cap ----

class PlanLayerCapTest : public DaemonTest {
 protected:
  static constexpr uint32_t kCap = 40;
  void ConfigureDaemon(DaemonConfig& config) override { config.sessions.max_plan_layers = kCap; }
};

TEST_F(PlanLayerCapTest, RegisterPlanRefusesPlansOverTheCapNamingBothNumbers) {
  EXPECT_THAT(client_->RegisterPlan(DenseModel(kCap, 64, 2)).status(), IsOk());
  EXPECT_THAT(client_->RegisterPlan(DenseModel(kCap + 1, 64, 2)).status(),
              StatusIs(kInvalid, HasSubstrs("model plan has 41 layers", "at most 40",
                                            "max_plan_layers")));
  ModelPlan with_mtp = DenseModel(kCap, 64, 2);  // MTP blocks count too
  with_mtp.mtp_blocks.push_back(KvLayer(kCap, 64, 2));
  EXPECT_THAT(client_->RegisterPlan(with_mtp).status(),
              StatusIs(kInvalid, HasSubstrs("41 layers", "at most 40")));
}

// A 100k-layer plan, refused before it is decoded or validated: the call answers at once.
TEST_F(PlanLayerCapTest, AHugePlanIsRefusedBeforeAnyWork) {
  ModelPlan huge;
  huge.layers.push_back(KvLayer(0, 64, 2));
  for (uint32_t i = 1; i < 100'000; ++i) huge.layers.push_back(SharedLayer(i, 0));
  EXPECT_THAT(client_->RegisterPlan(huge).status(),
              StatusIs(kInvalid, HasSubstrs("100000 layers", "at most 40")));
}

TEST_F(PlanLayerCapTest, InlinePlansOfEveryQueryAreCapped) {
  pb::ModelSelector over;
  *over.mutable_plan() = ModelPlanToProto(DenseModel(kCap + 1, 64, 2));
  const auto refused = StatusIs(kInvalid, HasSubstrs("41 layers", "at most 40"));

  pb::CostRequest cost;
  *cost.mutable_model() = over;
  cost.mutable_shape()->set_capacity(128);
  pb::CostResponse cost_reply;
  EXPECT_THAT(Admin(&pb::KvAdmin::Stub::GetCost, cost, &cost_reply), refused);

  pb::FitRequest fit;
  *fit.mutable_model() = over;
  fit.mutable_shape()->set_capacity(128);
  pb::FitResponse fit_reply;
  EXPECT_THAT(Admin(&pb::KvAdmin::Stub::GetFit, fit, &fit_reply), refused);

  pb::MaxContextRequest max_context;
  *max_context.mutable_model() = over;
  pb::MaxContextResponse max_context_reply;
  EXPECT_THAT(Admin(&pb::KvAdmin::Stub::GetMaxContext, max_context, &max_context_reply), refused);

  // At the cap the same queries answer.
  *cost.mutable_model()->mutable_plan() = ModelPlanToProto(DenseModel(kCap, 64, 2));
  EXPECT_THAT(Admin(&pb::KvAdmin::Stub::GetCost, cost, &cost_reply), IsOk());
}

TEST_F(PlanLayerCapTest, ImportedConfigsAreCapped) {
  const std::string config = R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 8,
    "hidden_size": 4096, "head_dim": 128})";
  pb::ImportModelRequest import;
  import.set_hf_config_json(config);
  import.set_register_(true);
  pb::ImportModelResponse imported;
  // The registering import is an operator's call (the admin socket); the converting one is an
  // engine's. Both are capped.
  EXPECT_THAT(Operator(&pb::KvAdmin::Stub::ImportModel, import, &imported),
              StatusIs(kInvalid, HasSubstrs("48 layers", "at most 40")));
  import.set_register_(false);
  EXPECT_THAT(Admin(&pb::KvAdmin::Stub::ImportModel, import, &imported),
              StatusIs(kInvalid, HasSubstrs("48 layers", "at most 40")));
  pb::CostRequest cost;
  cost.mutable_model()->set_hf_config_json(config);
  cost.mutable_shape()->set_capacity(128);
  pb::CostResponse cost_reply;
  EXPECT_THAT(Admin(&pb::KvAdmin::Stub::GetCost, cost, &cost_reply),
              StatusIs(kInvalid, HasSubstrs("48 layers", "at most 40")));
}

// ---- Plans per engine ----

class PlansPerEngineTest : public DaemonTest {
 protected:
  static constexpr uint64_t kPlansPerEngine = 3;  // the fixture's own plan is one of them
  void ConfigureDaemon(DaemonConfig& config) override {
    config.sessions.max_engine_plans = kPlansPerEngine;
  }
};

TEST_F(PlansPerEngineTest, AnEngineRegistersAtMostItsQuotaAndOnlyWhenAttached) {
  ASSERT_THAT(client_->RegisterPlan(DenseModel(2, 64, 1)).status(), IsOk());
  ASSERT_THAT(client_->RegisterPlan(DenseModel(2, 64, 2)).status(), IsOk());
  EXPECT_THAT(client_->RegisterPlan(DenseModel(2, 64, 1)).status(), IsOk()) << "idempotent";
  EXPECT_THAT(client_->RegisterPlan(DenseModel(2, 64, 3)).status(),
              StatusIs(kExhausted,
                       HasSubstrs(absl::StrCat("engine ", client_->engine_id(),
                                               " has registered 3 model plans"),
                                  "limit is 3 per engine", "max_engine_plans")));
  std::unique_ptr<KvClient> other = NewClient("engine-b");
  ASSERT_NE(other, nullptr);
  EXPECT_THAT(other->RegisterPlan(DenseModel(2, 64, 3)).status(), IsOk());

  // Without an attached engine there is no registering at all.
  absl::StatusOr<std::unique_ptr<KvClient>> unattached =
      KvClient::Connect(daemon_->socket_path());
  ASSERT_THAT(unattached.status(), IsOk());
  EXPECT_THAT((*unattached)->RegisterPlan(DenseModel(2, 64, 4)).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstrs("before Attach")));
  pb::RegisterPlanRequest raw;
  *raw.mutable_plan() = ModelPlanToProto(DenseModel(2, 64, 4));
  pb::RegisterPlanResponse registered;
  EXPECT_THAT(FromGrpcStatus(ClientInternals::Cache(**unattached)
                                 .RegisterPlan(ClientInternals::NewContext(**unattached).get(),
                                               raw, &registered)),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs("engine 0 is not attached")));
  EXPECT_EQ(daemon_->GetStatus().plans(), 4u);
}

// ---- The reply-size bound: at the largest cap accepted, the widest layers' CreateSession and
// GetSessionState replies stay under the client's receive limit, so no session can be created
// and charged and then fail to reach its engine. ----

class ReplySizeBoundTest : public DaemonTest {
 protected:
  void ConfigureDaemon(DaemonConfig& config) override {
    config.sessions.max_plan_layers = kMaxPlanLayersAccepted;
  }

  // One kind of layer, repeated to the cap.
  static ModelPlan WidestPlan(LayerPlan (*layer)(uint32_t)) {
    ModelPlan plan;
    plan.swa_ring = true;
    plan.index_ring_rows = 16;
    for (uint32_t i = 0; i < kMaxPlanLayersAccepted; ++i) plan.layers.push_back(layer(i));
    return plan;
  }
};

TEST_F(ReplySizeBoundTest, EveryLayerKindAtTheLargestCapFitsTheClientsReceiveLimit) {
  const std::vector<std::pair<std::string, LayerPlan (*)(uint32_t)>> kinds = {
      {"kv", [](uint32_t i) { return KvLayer(i, 32, 1); }},
      {"sliding_kv", [](uint32_t i) { return SlidingLayer(i, 32, 1, 32); }},
      {"recurrent", [](uint32_t i) { return RecurrentLayer(i, 4, 4, 8); }},
      {"latent+indexer", [](uint32_t i) { return LatentLayer(i, 8, 8, 4); }},
  };
  for (const auto& [name, layer] : kinds) {
    SCOPED_TRACE(name);
    absl::StatusOr<PlanFingerprint> plan = client_->RegisterPlan(WidestPlan(layer));
    ASSERT_THAT(plan.status(), IsOk());
    // Through the client (its 4 MiB limit): the session reaches the engine.
    absl::StatusOr<std::unique_ptr<Session>> session =
        client_->CreateSession(*plan, Options(8, /*spec_snapshot=*/false));
    ASSERT_THAT(session.status(), IsOk());
    pb::GetSessionStateRequest state_request;
    *state_request.mutable_session() = ClientInternals::Ref(**session);
    state_request.set_include_layout(true);
    pb::SessionStateResponse state;
    ASSERT_THAT(FromGrpcStatus(ClientInternals::Cache(*client_).GetSessionState(
                    ClientInternals::NewContext(*client_).get(), state_request, &state)),
                IsOk());
    // Under the limit with room for a device-sized arena's longer offsets (a few bytes more
    // per plane).
    EXPECT_LT(state.ByteSizeLong(), kClientReceiveLimit * 3 / 4);
    // The margin, for whoever raises kMaxPlanLayersAccepted.
    RecordProperty(name + "_reply_bytes", static_cast<int>(state.ByteSizeLong()));
    ASSERT_THAT((*session)->Release(), IsOk());
  }
}

// ---- Per-engine limits and the daemon's totals ----

class EngineLimitsTest : public DaemonTest {
 protected:
  static constexpr uint64_t kSessionsPerEngine = 3;
  static constexpr uint32_t kSharePercent = 50;
  static constexpr uint64_t kEngines = 3;
  static constexpr uint64_t kArenas = 5;
  void ConfigureDaemon(DaemonConfig& config) override {
    config.sessions.max_engine_sessions = kSessionsPerEngine;
    config.admission.max_engine_budget_share = kSharePercent;
    config.leases.max_engines = kEngines;
    config.admission.max_arenas = kArenas;
    // The daemon-wide limit is tested here, not the share.
    config.admission.max_engine_arenas = kArenas;
  }
};

TEST_F(EngineLimitsTest, SessionsPerEngineAreCappedAndOtherEnginesKeepTheirs) {
  std::vector<std::unique_ptr<Session>> held;
  for (uint64_t i = 0; i < kSessionsPerEngine; ++i) held.push_back(NewSession(*client_, 64));
  EXPECT_THAT(client_->CreateSession(plan_, Options(64)).status(),
              StatusIs(kExhausted,
                       HasSubstrs(absl::StrCat("engine ", client_->engine_id(), " holds 3 sessions"),
                                  "limit is 3 per engine", "max_engine_sessions")));
  std::unique_ptr<KvClient> other = NewClient("engine-b");
  ASSERT_NE(other, nullptr);
  EXPECT_NE(NewSession(*other, 64), nullptr);
  ASSERT_THAT(held.back()->Release(), IsOk());
  held.pop_back();
  EXPECT_NE(NewSession(*client_, 64), nullptr) << "a released session makes room again";
}

TEST_F(EngineLimitsTest, OneEngineHoldsAtMostItsShareOfTheBudget) {
  const uint64_t cap = kBudgetBytes * kSharePercent / 100;
  // The largest capacity whose session fits the share: reserve it, then nothing more fits.
  SessionShape shape;
  shape.spec_snapshot = true;
  absl::StatusOr<uint64_t> capacity = MaxContextThatFits(
      HybridTestPlan(), FormatDefaults{}, shape, cap,
      ArenaRounding{kPlaneAlignment, daemon_->backend().AllocationGranularity()});
  ASSERT_THAT(capacity.status(), IsOk());
  ASSERT_GT(*capacity, 64u);
  absl::StatusOr<SessionReservation> big =
      client_->Reserve(plan_, Options(*capacity));
  ASSERT_THAT(big.status(), IsOk());
  EXPECT_LE(big->bytes, cap);
  EXPECT_THAT(client_->Reserve(plan_, Options(64)).status(),
              StatusIs(kExhausted, HasSubstrs("reservation of", "refused",
                                              absl::StrCat("holds ", big->bytes, " bytes"),
                                              absl::StrCat("at most ", cap),
                                              "50% of the 67108864 byte budget",
                                              "max_engine_budget_share")));
  EXPECT_THAT(client_->CreateSession(plan_, Options(64)).status(),
              StatusIs(kExhausted, HasSubstrs("allocation of", "max_engine_budget_share")));
  // The budget is not full: another engine is admitted.
  std::unique_ptr<KvClient> other = NewClient("engine-b");
  ASSERT_NE(other, nullptr);
  EXPECT_NE(NewSession(*other, 64), nullptr);
  ASSERT_THAT(client_->CancelReservation(big->id).status(), IsOk());
  EXPECT_NE(NewSession(*client_, 64), nullptr);
}

TEST_F(EngineLimitsTest, AttachedEnginesAreCappedUntilOneIsReclaimed) {
  std::unique_ptr<KvClient> second = NewClient("engine-b");
  std::unique_ptr<KvClient> third = NewClient("engine-c");
  ASSERT_NE(third, nullptr);
  absl::StatusOr<std::unique_ptr<KvClient>> fourth = KvClient::Connect(daemon_->socket_path());
  ASSERT_THAT(fourth.status(), IsOk());
  // Every attached engine holds a handoff connection: the fourth is refused there.
  EXPECT_THAT((*fourth)->Attach("engine-d"),
              StatusIs(kExhausted, HasSubstrs("handoff socket serves 3 connections",
                                              "limit is 3", "max_attached_engines")));
  // An engine whose stream ended is still known through its grace (it holds sessions), with
  // its connection: a hand-built Attach with a ticket from a free slot is refused by the lease
  // table.
  std::unique_ptr<HandoffChannel> freed_slot;
  second->Detach();
  for (int i = 0; i < 500 && freed_slot == nullptr; ++i) {  // the daemon sees the close
    absl::StatusOr<std::unique_ptr<HandoffChannel>> channel =
        HandoffChannel::Connect(daemon_->handoff_socket_path(), absl::Seconds(5));
    if (channel.ok()) freed_slot = *std::move(channel);
    if (!channel.ok()) absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_NE(freed_slot, nullptr);
  grpc::ClientContext context;
  auto stream = ClientInternals::Cache(**fourth).Attach(&context);
  pb::AttachRequest hello;
  hello.mutable_hello()->set_engine_name("engine-d");
  hello.mutable_hello()->set_handoff_ticket(freed_slot->ticket());
  pb::AttachResponse refused;
  ASSERT_TRUE(stream->Write(hello));
  EXPECT_FALSE(stream->Read(&refused));
  EXPECT_THAT(FromGrpcStatus(stream->Finish()),
              StatusIs(kExhausted, HasSubstrs("engine \"engine-d\" refused",
                                              "3 engines are attached", "limit is 3",
                                              "max_attached_engines")));
  freed_slot.reset();
  KillEngine(*third);
  absl::Status attached_fourth = (*fourth)->Attach("engine-d");
  for (int i = 0; i < 500 && !attached_fourth.ok(); ++i) {  // until the daemon saw the closes
    absl::SleepFor(absl::Milliseconds(10));
    attached_fourth = (*fourth)->Attach("engine-d");
  }
  EXPECT_THAT(attached_fourth, IsOk());
}

TEST_F(EngineLimitsTest, ArenasAreCountedInAdmissionAndFitSaysSo) {
  std::unique_ptr<KvClient> other = NewClient("engine-b");
  ASSERT_NE(other, nullptr);
  std::vector<std::unique_ptr<Session>> held;
  for (int i = 0; i < 3; ++i) held.push_back(NewSession(*client_, 64));
  held.push_back(NewSession(*other, 64));
  absl::StatusOr<SessionReservation> reserved = other->Reserve(plan_, Options(64));
  ASSERT_THAT(reserved.status(), IsOk());  // a reservation is an arena to come: 5 of 5

  pb::FitRequest fit;
  fit.mutable_model()->set_plan_fingerprint(FingerprintToBytes(plan_));
  fit.mutable_shape()->set_capacity(64);
  pb::FitResponse fit_reply;
  ASSERT_THAT(Admin(&pb::KvAdmin::Stub::GetFit, fit, &fit_reply), IsOk());
  EXPECT_EQ(fit_reply.sessions_now(), 0u) << "the bytes are free but no arena is";
  EXPECT_EQ(fit_reply.sessions_when_empty(), kArenas);
  EXPECT_GT(fit_reply.free_bytes(), kBudgetBytes / 2);
  pb::MaxContextRequest max_context;
  max_context.mutable_model()->set_plan_fingerprint(FingerprintToBytes(plan_));
  pb::MaxContextResponse max_context_reply;
  ASSERT_THAT(Admin(&pb::KvAdmin::Stub::GetMaxContext, max_context, &max_context_reply), IsOk());
  EXPECT_EQ(max_context_reply.max_context_now(), 0u);
  EXPECT_GT(max_context_reply.max_context_when_empty(), 0u);

  EXPECT_THAT(other->CreateSession(plan_, Options(64)).status(),
              StatusIs(kExhausted, HasSubstrs("allocation refused", "holds 5 arenas",
                                              "limit is 5", "max_arenas")));
  EXPECT_THAT(other->Reserve(plan_, Options(64)).status(),
              StatusIs(kExhausted, HasSubstrs("reservation refused", "limit is 5")));
  // The reservation becomes its arena: creating from it needs no new one.
  SessionOptions from_reservation = Options(64);
  from_reservation.reservation_id = reserved->id;
  EXPECT_THAT(other->CreateSession(plan_, from_reservation).status(), IsOk());
  ASSERT_THAT(held.front()->Release(), IsOk());
  EXPECT_NE(NewSession(*other, 64), nullptr);
}

// ---- Lease streams cost no thread each ----

// 64 engines hold their Attach streams open: the daemon (in this process) serves them without
// a thread each. (With a synchronous handler per stream this process grew by 64+ threads.)
TEST_F(DaemonTest, IdleLeaseStreamsDoNotHoldAThreadEach) {
  constexpr int kStreams = 64;
  const size_t before = ProcessThreads();
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::ClientReaderWriter<pb::AttachRequest, pb::AttachResponse>>>
      streams;
  std::vector<std::unique_ptr<HandoffChannel>> handoffs;  // one ticket each
  for (int i = 0; i < kStreams; ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    streams.push_back(ClientInternals::Cache(*client_).Attach(contexts.back().get()));
    handoffs.push_back(NewHandoff());
    ASSERT_NE(handoffs.back(), nullptr);
    pb::AttachRequest hello;
    hello.mutable_hello()->set_engine_name(absl::StrCat("idle-", i));
    hello.mutable_hello()->set_handoff_ticket(handoffs.back()->ticket());
    pb::AttachResponse attached;
    ASSERT_TRUE(streams.back()->Write(hello) && streams.back()->Read(&attached));
    ASSERT_TRUE(attached.has_attached()) << i;
  }
  EXPECT_EQ(daemon_->GetStatus().engines(), uint64_t{kStreams} + 1);
  const size_t during = ProcessThreads();
  EXPECT_LT(during, before + kStreams / 4) << before << " threads before, " << during << " with "
                                           << kStreams << " lease streams open";
  for (size_t i = 0; i < streams.size(); ++i) {
    contexts[i]->TryCancel();
    (void)streams[i]->Finish();
  }
}

}  // namespace
}  // namespace memra::testing
