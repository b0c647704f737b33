// Admission through the daemon: exact costs charged at CreateSession and Grow, reservations,
// refusals with their numbers on the wire, and the KvAdmin queries. An in-process daemon over
// the host backend on a real Unix socket, with real clients (tests/service/test_daemon.h).

#include "core/admission.h"

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/client.h"
#include "client/internal.h"
#include "common/codec.h"
#include "common/grpc_status.h"
#include "core/formats.h"
#include "core/test_model_plans.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/memra/kv/v1/admin.grpc.pb.h"
#include "tests/http_get.h"
#include "tests/seeded_random.h"
#include "tests/service/test_daemon.h"
#include "tests/status_matchers.h"

namespace memra::testing {
namespace {

namespace pb = ::memra::kv::v1;

using ::memra::test_plans::DeepSeekV3Style;
using ::memra::test_plans::DenseModel;
using ::memra::test_plans::GemmaStyle;
using ::memra::test_plans::GlmStyleWithIndexer;
using ::memra::test_plans::Llama3_8B;
using ::memra::test_plans::Qwen3NextStyle;
using ::testing::HasSubstr;
using ::testing::Not;

class AdmissionTest : public DaemonTest {
 protected:
  // Every session here gets a fresh arena, so each admission is measured against what the
  // backend allocates for it (reusing pooled arenas is tested in service_test).
  void ConfigureDaemon(DaemonConfig& config) override {
    config.sessions.arena_pool_engine_bytes = 0;
  }

  ArenaRounding Rounding() const {
    return ArenaRounding{kPlaneAlignment, daemon_->backend().AllocationGranularity()};
  }

  // The exact bytes a session of the fixture's plan takes, from the pure core function.
  uint64_t CostOf(const ModelPlan& plan, uint64_t capacity, bool spec_snapshot = true) {
    SessionShape request;
    request.capacity = capacity;
    request.spec_snapshot = spec_snapshot;
    absl::StatusOr<uint64_t> bytes =
        SessionArenaBytes(plan, FormatDefaults{}, request, Rounding());
    EXPECT_TRUE(bytes.ok()) << bytes.status();
    return bytes.value_or(0);
  }

  pb::AdmissionStatus Admission() { return daemon_->GetStatus().admission(); }

  pb::ModelSelector Registered() const {
    pb::ModelSelector selector;
    selector.set_plan_fingerprint(FingerprintToBytes(plan_));
    return selector;
  }
};

// The law: for random model plans and capacities, what the cost query says, what Reserve holds,
// what the ledger charges and what the backend allocates are the same number. There is no
// second formula.
TEST_F(AdmissionTest, AdmittedCostEqualsBytesAllocatedForRandomPlans) {
  SeededRandom random(0x5eed'ad31);
  std::vector<ModelPlan> plans = {HybridTestPlan(), Llama3_8B(), GemmaStyle(true),
                                  GemmaStyle(false), DeepSeekV3Style(), GlmStyleWithIndexer(),
                                  Qwen3NextStyle()};
  for (int i = 0; i < 6; ++i) {
    plans.push_back(DenseModel(1 + static_cast<uint32_t>(random.Below(8)),
                               64 * (1 + static_cast<uint32_t>(random.Below(2))),
                               1 + static_cast<uint32_t>(random.Below(8))));
  }
  for (const ModelPlan& plan : plans) {
    absl::StatusOr<PlanFingerprint> fingerprint = client_->RegisterPlan(plan);
    ASSERT_TRUE(fingerprint.ok()) << fingerprint.status();
    for (int round = 0; round < 3; ++round) {
      const uint64_t capacity = 1 + random.Below(96);
      const bool spec = random.Below(2) == 1;
      SCOPED_TRACE(absl::StrCat(plan.name, " capacity ", capacity, " spec ", spec));
      const uint64_t expected = CostOf(plan, capacity, spec);
      if (expected > kBudgetBytes) {
        // Too large for the budget: refused with the same exact number.
        EXPECT_THAT(client_->Reserve(*fingerprint, Options(capacity, spec)).status(),
                    StatusIs(absl::StatusCode::kResourceExhausted,
                             HasSubstrs(absl::StrCat("needs ", expected, " bytes"))));
        continue;
      }

      pb::CostRequest cost_request;
      cost_request.mutable_model()->set_plan_fingerprint(FingerprintToBytes(*fingerprint));
      cost_request.mutable_shape()->set_capacity(capacity);
      cost_request.mutable_shape()->set_spec_snapshot(spec);
      pb::CostResponse cost;
      ASSERT_THAT(Admin(&pb::KvAdmin::Stub::GetCost, cost_request, &cost), IsOk());
      EXPECT_EQ(cost.arena_bytes(), expected);

      const uint64_t backend_before = host_->AllocatedBytes();
      const uint64_t ledger_before = Admission().allocated_bytes();
      SessionOptions options = Options(capacity, spec);
      absl::StatusOr<SessionReservation> reservation = client_->Reserve(*fingerprint, options);
      ASSERT_TRUE(reservation.ok()) << reservation.status();
      EXPECT_EQ(reservation->bytes, expected);
      EXPECT_EQ(Admission().reserved_bytes(), expected);
      options.reservation_id = reservation->id;
      absl::StatusOr<std::unique_ptr<Session>> session =
          client_->CreateSession(*fingerprint, options);
      ASSERT_TRUE(session.ok()) << session.status();
      EXPECT_EQ(host_->AllocatedBytes() - backend_before, expected);
      EXPECT_EQ(Admission().allocated_bytes() - ledger_before, expected);
      EXPECT_EQ(Admission().reserved_bytes(), 0u);
      ASSERT_TRUE((*session)->Release().ok());
      EXPECT_EQ(Admission().allocated_bytes(), ledger_before);
    }
  }
}

// A refusal says needed, free, evictable and budget in the text AND in structured fields that
// survive the wire, and it allocates nothing.
TEST_F(AdmissionTest, RefusalCarriesItsNumbersOnTheWire) {
  const uint64_t capacity = 4096;
  const uint64_t cost = CostOf(HybridTestPlan(), capacity);
  std::vector<std::unique_ptr<Session>> sessions;
  while (Admission().free_bytes() >= cost) {
    sessions.push_back(NewSession(*client_, capacity));
    ASSERT_NE(sessions.back(), nullptr);
  }
  const pb::AdmissionStatus before = Admission();
  const uint64_t arenas_before = host_->ArenaCount();
  absl::StatusOr<std::unique_ptr<Session>> refused =
      client_->CreateSession(plan_, Options(capacity));
  EXPECT_THAT(refused.status(),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstrs(absl::StrCat("needs ", cost, " bytes"),
                                  absl::StrCat(before.free_bytes(), " free"), "(0 evictable)",
                                  absl::StrCat(kBudgetBytes, " budget"),
                                  "eviction cannot make room")));
  std::optional<AdmissionRefusal> refusal = GetAdmissionRefusal(refused.status());
  ASSERT_TRUE(refusal.has_value());
  EXPECT_EQ(*refusal, (AdmissionRefusal{.needed = cost,
                                        .free = before.free_bytes(),
                                        .evictable = 0,
                                        .budget = kBudgetBytes,
                                        .bytes_to_evict = 0}));
  EXPECT_EQ(host_->ArenaCount(), arenas_before);
  EXPECT_EQ(Admission().allocated_bytes(), before.allocated_bytes());

  // Reserve is refused the same way.
  absl::StatusOr<SessionReservation> reserve = client_->Reserve(plan_, Options(capacity));
  EXPECT_THAT(reserve.status(), StatusIs(absl::StatusCode::kResourceExhausted,
                                         HasSubstrs(absl::StrCat("needs ", cost, " bytes"))));
  EXPECT_TRUE(GetAdmissionRefusal(reserve.status()).has_value());
}

// An admitted reservation can always be created, whatever other engines do meanwhile.
TEST_F(AdmissionTest, ReservationIsNeverRefusedForRoom) {
  const uint64_t capacity = 4096;
  absl::StatusOr<SessionReservation> reservation = client_->Reserve(plan_, Options(capacity));
  ASSERT_TRUE(reservation.ok()) << reservation.status();
  std::unique_ptr<KvClient> other = NewClient("engine-b");
  ASSERT_NE(other, nullptr);
  std::vector<std::unique_ptr<Session>> filler;
  while (true) {
    absl::StatusOr<std::unique_ptr<Session>> session =
        other->CreateSession(plan_, Options(capacity));
    if (!session.ok()) {
      EXPECT_THAT(session.status(), StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("needs")));
      break;
    }
    filler.push_back(*std::move(session));
  }
  EXPECT_LT(Admission().free_bytes(), reservation->bytes);
  SessionOptions options = Options(capacity);
  options.reservation_id = reservation->id;
  absl::StatusOr<std::unique_ptr<Session>> session = client_->CreateSession(plan_, options);
  ASSERT_TRUE(session.ok()) << session.status();
  // Used: the same id again is NOT_FOUND.
  absl::StatusOr<std::unique_ptr<Session>> again = client_->CreateSession(plan_, options);
  EXPECT_THAT(again.status(),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstrs(absl::StrCat("reservation ", reservation->id),
                                  "not held by engine")));
}

TEST_F(AdmissionTest, ReservationRefusalsLeaveItLive) {
  absl::StatusOr<SessionReservation> reservation = client_->Reserve(plan_, Options(64));
  ASSERT_TRUE(reservation.ok()) << reservation.status();
  // Another shape: refused with both byte counts, the reservation stays.
  SessionOptions other_shape = Options(128);
  other_shape.reservation_id = reservation->id;
  EXPECT_THAT(client_->CreateSession(plan_, other_shape).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs(absl::StrCat("holds ", reservation->bytes, " bytes"),
                                  absl::StrCat("needs ", CostOf(HybridTestPlan(), 128)))));
  // Another engine cannot use or cancel it.
  std::unique_ptr<KvClient> other = NewClient("engine-b");
  ASSERT_NE(other, nullptr);
  SessionOptions same_shape = Options(64);
  same_shape.reservation_id = reservation->id;
  EXPECT_THAT(other->CreateSession(plan_, same_shape).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("not held by engine")));
  EXPECT_THAT(other->CancelReservation(reservation->id).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("not held by engine")));
  EXPECT_EQ(Admission().reserved_bytes(), reservation->bytes);
  absl::StatusOr<uint64_t> freed = client_->CancelReservation(reservation->id);
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, reservation->bytes);
  EXPECT_EQ(Admission().reserved_bytes(), 0u);
}

TEST_F(AdmissionTest, UnusedReservationExpiresAfterItsTtl) {
  // A ttl shorter than the lease timeout: the engine stays alive, only the reservation lapses.
  DaemonConfig config;
  config.sockets.socket_path = dir_ + "/kvd.sock";
  config.admission.budget_bytes = kBudgetBytes;
  config.leases.timeout = absl::Milliseconds(kLeaseTimeoutMs);
  config.leases.grace = absl::Milliseconds(kLeaseGraceMs);
  config.leases.reservation_ttl = absl::Milliseconds(400);
  daemon_->ApplyReload(config);
  absl::StatusOr<SessionReservation> reservation = client_->Reserve(plan_, Options(64));
  ASSERT_TRUE(reservation.ok()) << reservation.status();
  EXPECT_EQ(reservation->ttl, absl::Milliseconds(400));
  clock_.Advance(reservation->ttl - absl::Milliseconds(1));
  daemon_->CheckLeases();
  EXPECT_EQ(Admission().reservations(), 1u);
  clock_.Advance(absl::Milliseconds(1));
  daemon_->CheckLeases();
  EXPECT_EQ(Admission().reservations(), 0u);
  EXPECT_EQ(Admission().reserved_bytes(), 0u);
  SessionOptions options = Options(64);
  options.reservation_id = reservation->id;
  EXPECT_THAT(client_->CreateSession(plan_, options).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("expired")));
}

TEST_F(AdmissionTest, EngineDeathReturnsItsSessionsAndReservations) {
  std::unique_ptr<KvClient> doomed = NewClient("engine-b");
  ASSERT_NE(doomed, nullptr);
  ASSERT_TRUE(doomed->Reserve(plan_, Options(64)).ok());
  absl::StatusOr<std::unique_ptr<Session>> session = doomed->CreateSession(plan_, Options(256));
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_GT(Admission().reserved_bytes(), 0u);
  EXPECT_GT(Admission().allocated_bytes(), 0u);
  KillEngine(*doomed);
  EXPECT_EQ(daemon_->GetStatus().engines(), 1u);
  EXPECT_EQ(Admission().reserved_bytes(), 0u);
  EXPECT_EQ(Admission().allocated_bytes(), 0u);
  EXPECT_EQ(host_->AllocatedBytes(), 0u);
}

// Grow charges the new arena in full while the old one waits for the acknowledgement.
TEST_F(AdmissionTest, GrowChargesBothArenasUntilAcknowledged) {
  std::unique_ptr<Session> session = NewSession(*client_, 64);
  ASSERT_NE(session, nullptr);
  const uint64_t small = CostOf(HybridTestPlan(), 64);
  const uint64_t large = CostOf(HybridTestPlan(), 512);
  pb::GrowRequest request;
  *request.mutable_session() = ClientInternals::Ref(*session);
  request.set_target_capacity(512);
  pb::GrowResponse grown;
  ASSERT_THAT(FromGrpcStatus(ClientInternals::Cache(*client_).Grow(
                  ClientInternals::NewContext(*client_).get(), request, &grown)),
              IsOk());
  EXPECT_EQ(Admission().allocated_bytes(), small + large);
  EXPECT_EQ(host_->AllocatedBytes(), small + large);
  pb::AcknowledgeGrowRequest ack;
  *ack.mutable_session() = ClientInternals::Ref(*session);
  ack.set_layout_version(grown.layout().layout_version());
  pb::SessionStateResponse state;
  ASSERT_THAT(FromGrpcStatus(ClientInternals::Cache(*client_).AcknowledgeGrow(
                  ClientInternals::NewContext(*client_).get(), ack, &state)),
              IsOk());
  EXPECT_EQ(Admission().allocated_bytes(), large);
  EXPECT_EQ(host_->AllocatedBytes(), large);
}

TEST_F(AdmissionTest, GrowBeyondTheBudgetIsRefusedWithTheNewArenasBytes) {
  std::unique_ptr<Session> session = NewSession(*client_, 64);
  ASSERT_NE(session, nullptr);
  const pb::AdmissionStatus before = Admission();
  const uint64_t capacity = 1 << 20;
  const uint64_t needed = CostOf(HybridTestPlan(), capacity);
  ASSERT_GT(needed, before.free_bytes());
  absl::StatusOr<SessionSnapshot> grown = session->Grow(capacity);
  EXPECT_THAT(grown.status(),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstrs(absl::StrCat("needs ", needed, " bytes"),
                                  absl::StrCat(before.free_bytes(), " free"))));
  EXPECT_EQ(Admission().allocated_bytes(), before.allocated_bytes());
  EXPECT_EQ(host_->ArenaCount(), 1u);
}

// Any sequence of reserve / create / grow / acknowledge / release / cancel / engine death /
// expiry keeps reserved + allocated within the budget, the ledger equal to the backend, and
// every admitted reservation creatable.
TEST_F(AdmissionTest, PropertyRandomOperationsStayWithinTheBudget) {
  SeededRandom random(0xad'0155);
  struct Engine {
    std::unique_ptr<KvClient> client;
    std::vector<std::unique_ptr<Session>> sessions;
    std::vector<SessionReservation> reservations;
  };
  std::vector<Engine> engines(3);
  for (size_t i = 0; i < engines.size(); ++i) {
    engines[i].client = NewClient(absl::StrCat("prop-", i));
    ASSERT_NE(engines[i].client, nullptr);
  }
  const uint64_t capacities[] = {64, 512, 4096, 16384};
  for (int step = 0; step < 160; ++step) {
    Engine& engine = engines[random.Below(engines.size())];
    const uint64_t capacity = capacities[random.Below(4)];
    SCOPED_TRACE(absl::StrCat("step ", step));
    switch (random.Below(8)) {
      case 0: {
        absl::StatusOr<SessionReservation> reservation = engine.client->Reserve(plan_, Options(capacity));
        if (reservation.ok()) {
          engine.reservations.push_back(*reservation);
        } else {
          EXPECT_THAT(reservation.status(), StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("needs")));
        }
        break;
      }
      case 1: {
        if (engine.reservations.empty()) break;
        const SessionReservation reservation = engine.reservations.back();
        engine.reservations.pop_back();
        // Find the shape that was reserved: the cost identifies it.
        for (uint64_t c : capacities) {
          if (CostOf(HybridTestPlan(), c) != reservation.bytes) continue;
          SessionOptions options = Options(c);
          options.reservation_id = reservation.id;
          absl::StatusOr<std::unique_ptr<Session>> session =
              engine.client->CreateSession(plan_, options);
          ASSERT_TRUE(session.ok()) << "an admitted reservation must be creatable: "
                                    << session.status();
          engine.sessions.push_back(*std::move(session));
          break;
        }
        break;
      }
      case 2:
      case 3: {
        absl::StatusOr<std::unique_ptr<Session>> session =
            engine.client->CreateSession(plan_, Options(capacity));
        if (session.ok()) {
          engine.sessions.push_back(*std::move(session));
        } else {
          EXPECT_THAT(session.status(), StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("needs")));
        }
        break;
      }
      case 4: {
        if (engine.sessions.empty()) break;
        Session& session = *engine.sessions[random.Below(engine.sessions.size())];
        absl::StatusOr<SessionSnapshot> state = session.State();
        ASSERT_TRUE(state.ok()) << state.status();
        absl::StatusOr<SessionSnapshot> grown = session.Grow(state->capacity * 2);
        if (!grown.ok()) {
          EXPECT_THAT(grown.status(), StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("needs")));
        }
        break;
      }
      case 5: {
        if (engine.sessions.empty()) break;
        const size_t victim = random.Below(engine.sessions.size());
        ASSERT_TRUE(engine.sessions[victim]->Release().ok());
        engine.sessions.erase(engine.sessions.begin() + victim);
        break;
      }
      case 6: {
        if (engine.reservations.empty()) break;
        ASSERT_TRUE(engine.client->CancelReservation(engine.reservations.back().id).ok());
        engine.reservations.pop_back();
        break;
      }
      case 7: {
        // Engine death: everything it held returns; a new engine takes its place.
        engine.sessions.clear();
        engine.reservations.clear();
        KillEngine(*engine.client);
        engine.client = NewClient(absl::StrCat("prop-respawn-", step));
        ASSERT_NE(engine.client, nullptr);
        break;
      }
    }
    const pb::AdmissionStatus admission = Admission();
    ASSERT_LE(admission.reserved_bytes() + admission.allocated_bytes(), admission.budget_bytes());
    ASSERT_EQ(admission.allocated_bytes(), host_->AllocatedBytes());
  }
}

// ---- KvAdmin queries ----

TEST_F(AdmissionTest, CostOfAnImportedConfigMatchesTheCoreFunction) {
  const std::string config = R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "hidden_size": 4096, "head_dim": 128})";
  pb::CostRequest request;
  request.mutable_model()->set_hf_config_json(config);
  request.mutable_shape()->set_capacity(8192);
  pb::CostResponse cost;
  ASSERT_THAT(Admin(&pb::KvAdmin::Stub::GetCost, request, &cost), IsOk());
  // The same geometry as core's Llama-3-8B test plan (32 layers, 8 KV heads of 128): the
  // breakdown is core's CostOfSession for it, number for number.
  SessionShape shape;
  shape.capacity = 8192;
  absl::StatusOr<CostBreakdown> pure = CostOfSession(Llama3_8B(), FormatDefaults{}, shape);
  ASSERT_TRUE(pure.ok()) << pure.status();
  EXPECT_EQ(cost.breakdown().kv_bytes_per_token(), pure->kv_bytes_per_token);
  EXPECT_EQ(cost.breakdown().bytes_per_token(), pure->bytes_per_token);
  EXPECT_EQ(cost.breakdown().fixed_bytes(), pure->fixed_bytes);
  EXPECT_EQ(cost.breakdown().total_plane_bytes(), pure->total_bytes);
  EXPECT_GT(pure->kv_bytes_per_token, 0u);
  EXPECT_EQ(cost.layers(), 32u);
  EXPECT_EQ(cost.arena_bytes(), CostOf(Llama3_8B(), 8192, /*spec_snapshot=*/false));
  EXPECT_GE(cost.arena_bytes(), cost.breakdown().total_plane_bytes());
  EXPECT_EQ(cost.arena_bytes() % cost.granularity_bytes(), 0u);
}

TEST_F(AdmissionTest, FitCountsSessionsThatReallyFit) {
  const uint64_t capacity = 2048;
  pb::FitRequest request;
  *request.mutable_model() = Registered();
  request.mutable_shape()->set_capacity(capacity);
  request.mutable_shape()->set_spec_snapshot(true);
  pb::FitResponse fit;
  ASSERT_THAT(Admin(&pb::KvAdmin::Stub::GetFit, request, &fit), IsOk());
  EXPECT_EQ(fit.session_bytes(), CostOf(HybridTestPlan(), capacity));
  EXPECT_EQ(fit.sessions_now(), kBudgetBytes / fit.session_bytes());
  EXPECT_EQ(fit.sessions_when_empty(), fit.sessions_now());
  EXPECT_GE(fit.total_tokens_now(), fit.sessions_now() * capacity);
  std::vector<std::unique_ptr<Session>> sessions;
  for (uint64_t i = 0; i < fit.sessions_now(); ++i) {
    sessions.push_back(NewSession(*client_, capacity));
    ASSERT_NE(sessions.back(), nullptr) << "session " << i << " of " << fit.sessions_now();
  }
  EXPECT_THAT(client_->CreateSession(plan_, Options(capacity)).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("needs")));
  pb::FitResponse full;
  ASSERT_THAT(Admin(&pb::KvAdmin::Stub::GetFit, request, &full), IsOk());
  EXPECT_EQ(full.sessions_now(), 0u);
  EXPECT_EQ(full.sessions_when_empty(), fit.sessions_when_empty());
  EXPECT_EQ(full.free_bytes(), Admission().free_bytes());
}

TEST_F(AdmissionTest, MaxContextIsTheLargestSessionThatCanBeCreated) {
  std::unique_ptr<Session> held = NewSession(*client_, 4096);
  ASSERT_NE(held, nullptr);
  pb::MaxContextRequest request;
  *request.mutable_model() = Registered();
  request.mutable_shape()->set_spec_snapshot(true);
  pb::MaxContextResponse answer;
  ASSERT_THAT(Admin(&pb::KvAdmin::Stub::GetMaxContext, request, &answer), IsOk());
  ASSERT_GT(answer.max_context_now(), 0u);
  EXPECT_GT(answer.max_context_when_empty(), answer.max_context_now());
  EXPECT_EQ(answer.session_bytes_now(), CostOf(HybridTestPlan(), answer.max_context_now()));
  EXPECT_LE(answer.session_bytes_now(), answer.free_bytes());
  // One more token does not fit (or it would have been the answer)...
  EXPECT_THAT(client_->CreateSession(plan_, Options(answer.max_context_now() + 1)).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("needs")));
  // ... and the answer does.
  absl::StatusOr<std::unique_ptr<Session>> largest =
      client_->CreateSession(plan_, Options(answer.max_context_now()));
  EXPECT_TRUE(largest.ok()) << largest.status();
}

TEST_F(AdmissionTest, QueriesRefuseWhatTheyCannotPrice) {
  pb::CostRequest request;
  pb::CostResponse cost;
  request.mutable_shape()->set_capacity(64);
  EXPECT_THAT(Admin(&pb::KvAdmin::Stub::GetCost, request, &cost),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no model")));
  request.mutable_model()->set_plan_fingerprint(std::string(32, '\x07'));
  EXPECT_THAT(Admin(&pb::KvAdmin::Stub::GetCost, request, &cost),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs("0707", "not registered")));
  request.mutable_model()->set_hf_config_json(R"({"architectures": ["GPT2LMHeadModel"]})");
  EXPECT_THAT(Admin(&pb::KvAdmin::Stub::GetCost, request, &cost),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("GPT2LMHeadModel", "architectures[0]")));
  *request.mutable_model() = Registered();
  request.mutable_shape()->set_capacity(0);
  EXPECT_THAT(Admin(&pb::KvAdmin::Stub::GetCost, request, &cost),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("capacity")));
}

TEST_F(AdmissionTest, ImportModelRegistersAPlanEnginesCanUse) {
  pb::ImportModelRequest request;
  request.set_hf_config_json(R"({
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
    "hidden_size": 512})");
  request.set_name("tiny-qwen");
  request.set_register_(true);
  pb::ImportModelResponse imported;
  // Registering is an operator's call: the admin socket.
  ASSERT_THAT(Operator(&pb::KvAdmin::Stub::ImportModel, request, &imported), IsOk());
  EXPECT_EQ(imported.architecture(), "Qwen2ForCausalLM");
  EXPECT_TRUE(imported.registered());
  EXPECT_EQ(imported.plan().name(), "tiny-qwen");
  EXPECT_EQ(imported.plan().layers_size(), 4);
  absl::StatusOr<PlanFingerprint> fingerprint = FingerprintFromBytes(imported.plan_fingerprint());
  ASSERT_TRUE(fingerprint.ok());
  absl::StatusOr<std::unique_ptr<Session>> session =
      client_->CreateSession(*fingerprint, Options(128, false));
  EXPECT_TRUE(session.ok()) << session.status();

  request.set_hf_config_json(R"({"architectures": ["LlamaForCausalLM"]})");
  EXPECT_THAT(Operator(&pb::KvAdmin::Stub::ImportModel, request, &imported),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_hidden_layers")));
}

TEST_F(AdmissionTest, ListingsShowEnginesSessionsAndReservations) {
  std::unique_ptr<Session> session = NewSession(*client_, 256);
  ASSERT_NE(session, nullptr);
  absl::StatusOr<SessionReservation> reservation = client_->Reserve(plan_, Options(64));
  ASSERT_TRUE(reservation.ok());
  pb::ListSessionsResponse sessions;
  ASSERT_THAT(Operator(&pb::KvAdmin::Stub::ListSessions, pb::ListSessionsRequest(), &sessions),
              IsOk());
  ASSERT_EQ(sessions.sessions_size(), 1);
  const pb::SessionSummary summary = sessions.sessions(0);
  EXPECT_EQ(summary.session_id(), session->id());
  EXPECT_EQ(summary.engine_id(), client_->engine_id());
  EXPECT_EQ(summary.model_name(), HybridTestPlan().name);
  EXPECT_EQ(summary.plan_fingerprint(), FingerprintToBytes(plan_));
  EXPECT_EQ(summary.capacity(), 256u);
  EXPECT_EQ(summary.arena_bytes(), CostOf(HybridTestPlan(), 256));
  pb::ListSessionsRequest other_engine;
  other_engine.set_engine_id(client_->engine_id() + 100);
  ASSERT_THAT(Operator(&pb::KvAdmin::Stub::ListSessions, other_engine, &sessions), IsOk());
  EXPECT_EQ(sessions.sessions_size(), 0);

  pb::ListEnginesResponse engines;
  ASSERT_THAT(Operator(&pb::KvAdmin::Stub::ListEngines, pb::ListEnginesRequest(), &engines),
              IsOk());
  ASSERT_EQ(engines.engines_size(), 1);
  EXPECT_EQ(engines.engines(0).sessions(), 1u);
  EXPECT_EQ(engines.engines(0).reservations(), 1u);
  EXPECT_EQ(engines.engines(0).reserved_bytes(), reservation->bytes);
  EXPECT_EQ(engines.engines(0).allocated_bytes(), summary.arena_bytes());
  EXPECT_TRUE(engines.engines(0).lease_live());
}

TEST_F(AdmissionTest, DrainAndUndrainThroughTheAdminService) {
  std::unique_ptr<Session> session = NewSession(*client_, 64);
  ASSERT_NE(session, nullptr);
  pb::DrainResponse drained;
  ASSERT_THAT(Operator(&pb::KvAdmin::Stub::Drain, pb::DrainRequest(), &drained), IsOk());
  EXPECT_EQ(drained.sessions_open(), 1u);
  EXPECT_TRUE(daemon_->GetStatus().draining());
  EXPECT_THAT(client_->CreateSession(plan_, Options(64)).status(),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("draining")));
  EXPECT_THAT(client_->Reserve(plan_, Options(64)).status(),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("draining")));
  // Existing sessions keep working.
  EXPECT_TRUE(session->Begin().ok());
  pb::UndrainResponse undrained;
  ASSERT_THAT(Operator(&pb::KvAdmin::Stub::Undrain, pb::UndrainRequest(), &undrained), IsOk());
  EXPECT_FALSE(daemon_->GetStatus().draining());
  EXPECT_TRUE(client_->CreateSession(plan_, Options(64)).ok());
}

// SIGHUP shrinking the budget below usage admits nothing until releases make room.
TEST_F(AdmissionTest, ReloadedBudgetShrinkBelowUsageBlocksAdmissionUntilReleases) {
  std::unique_ptr<Session> session = NewSession(*client_, 4096);
  ASSERT_NE(session, nullptr);
  const uint64_t used = Admission().allocated_bytes();
  DaemonConfig smaller;
  smaller.sockets.socket_path = dir_ + "/kvd.sock";
  smaller.admission.budget_bytes = used / 2;
  daemon_->ApplyReload(smaller);
  EXPECT_EQ(Admission().budget_bytes(), used / 2);
  EXPECT_EQ(Admission().over_budget_bytes(), used - used / 2);
  EXPECT_EQ(Admission().free_bytes(), 0u);
  EXPECT_THAT(client_->CreateSession(plan_, Options(64)).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("0 free")));
  ASSERT_TRUE(session->Release().ok());
  EXPECT_TRUE(client_->CreateSession(plan_, Options(64)).ok());
  // Growing past the host backend's start-up capacity is capped there.
  DaemonConfig larger = smaller;
  larger.admission.budget_bytes = kBudgetBytes * 4;
  daemon_->ApplyReload(larger);
  EXPECT_EQ(Admission().budget_bytes(), kBudgetBytes);
  EXPECT_THAT(Admission().budget_rule(), HasSubstr("capped"));
}

}  // namespace
}  // namespace memra::testing

namespace memra::testing {
namespace {

// The Prometheus endpoint shows the ledger, the sessions and every call, read at scrape time.
TEST_F(AdmissionTest, MetricsShowTheLedgerSessionsAndCalls) {
  const int port = daemon_->metrics_port();
  ASSERT_GT(port, 0);
  std::unique_ptr<Session> session = NewSession(*client_, 256);
  ASSERT_NE(session, nullptr);
  EXPECT_THAT(client_->CreateSession(plan_, Options(1u << 30)).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("needs")));
  const std::string scrape = HttpGet(port, "/metrics");
  EXPECT_THAT(scrape, HasSubstr("HTTP/1.1 200"));
  EXPECT_THAT(scrape, HasSubstr("text/plain; version=0.0.4"));
  const pb::AdmissionStatus admission = Admission();
  EXPECT_THAT(scrape, HasSubstr(absl::StrCat("\nmemra_budget_bytes ", kBudgetBytes, "\n")));
  EXPECT_THAT(scrape,
              HasSubstr(absl::StrCat("\nmemra_allocated_bytes ", admission.allocated_bytes(), "\n")));
  EXPECT_THAT(scrape, HasSubstr("\nmemra_sessions 1\n"));
  EXPECT_THAT(scrape, HasSubstr("\nmemra_engines 1\n"));
  EXPECT_THAT(scrape, HasSubstr("\nmemra_admission_refusals 1\n"));
  const std::string engine = absl::StrCat("{engine=\"", client_->engine_id(), "\"}");
  EXPECT_THAT(scrape, HasSubstr(absl::StrCat("\nmemra_session_arenas_created", engine, " 1\n")));
  EXPECT_THAT(scrape, HasSubstr(absl::StrCat("\nmemra_arena_pool_hits", engine, " 0\n")));
  EXPECT_THAT(scrape, HasSubstr("memra_rpc_requests_total{method=\"/memra.kv.v1.KvCache/"
                                "CreateSession\",code=\"OK\"} 1\n"));
  EXPECT_THAT(scrape, HasSubstr("memra_rpc_requests_total{method=\"/memra.kv.v1.KvCache/"
                                "CreateSession\",code=\"RESOURCE_EXHAUSTED\"} 1\n"));
  EXPECT_THAT(scrape, HasSubstr("memra_rpc_duration_seconds_count{method=\"/memra.kv.v1.KvCache/"
                                "CreateSession\"} 2\n"));
  EXPECT_THAT(HttpGet(port, "/nothing"), HasSubstr("HTTP/1.1 404"));
}

// Metric names, types and help texts are an interface (dashboards, alerts, README.md
// "Metrics"): every family the daemon registers, wherever its part registers it, is exactly the
// one in tests/service/metric_families.txt (sorted by name; families render in registration
// order, which is not part of the interface). Regenerate only for a deliberate change.
TEST_F(AdmissionTest, EveryMetricFamilyKeepsItsNameTypeAndHelp) {
  const int port = daemon_->metrics_port();
  ASSERT_GT(port, 0);
  std::map<std::string, std::string> families;  // name -> its HELP and TYPE lines
  for (absl::string_view line : absl::StrSplit(HttpGet(port, "/metrics"), '\n')) {
    if (!absl::StartsWith(line, "# HELP ") && !absl::StartsWith(line, "# TYPE ")) continue;
    const std::vector<absl::string_view> words = absl::StrSplit(line, absl::MaxSplits(' ', 3));
    ASSERT_GE(words.size(), 3u) << line;
    absl::StrAppend(&families[std::string(words[2])], line, "\n");
  }
  std::string scraped;
  for (const auto& [name, lines] : families) scraped += lines;
  const char* srcdir = std::getenv("TEST_SRCDIR");
  ASSERT_NE(srcdir, nullptr);
  std::ifstream file(absl::StrCat(srcdir, "/memra_kv/tests/service/metric_families.txt"));
  ASSERT_TRUE(file.good());
  const std::string expected((std::istreambuf_iterator<char>(file)),
                             std::istreambuf_iterator<char>());
  EXPECT_EQ(scraped, expected);
}

// rpc_metrics off (the default): the daemon's own metrics are served, but calls are neither
// counted nor timed (no interceptor runs).
TEST(AdmissionMetricsTest, RpcMetricsOffServesNoCallSeries) {
  const std::string dir = MakeSocketDir();
  constexpr uint64_t kBudget = uint64_t{16} << 20;
  DaemonConfig config;
  config.sockets.socket_path = dir + "/kvd.sock";
  config.admission.budget_bytes = kBudget;
  config.metrics.metrics_address = "127.0.0.1:0";
  ASSERT_FALSE(config.metrics.rpc_metrics);
  FakeClock clock;
  absl::StatusOr<std::unique_ptr<Daemon>> daemon =
      Daemon::Create(config, NewTestHostBackend(TestHostBackendOptions(kBudget)), &clock);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  ASSERT_TRUE((*daemon)->Start().ok());
  absl::StatusOr<std::unique_ptr<KvClient>> client = KvClient::Connect(config.sockets.socket_path);
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE(ClientInternals::GetStatus(**client).ok());
  const std::string scrape = HttpGet((*daemon)->metrics_port(), "/metrics");
  EXPECT_THAT(scrape, HasSubstr(absl::StrCat("\nmemra_budget_bytes ", kBudget, "\n")));
  EXPECT_THAT(scrape, Not(HasSubstr("memra_rpc_")));
  client->reset();
  (*daemon)->Shutdown();
  daemon->reset();
  rmdir(dir.c_str());
}

}  // namespace
}  // namespace memra::testing
