// memra-kvd's services over a real Unix socket: an in-process Daemon (host backend behind a
// fault-injecting wrapper, FakeClock for leases) and the real client library. Every RPC, every
// refusal with its code, and "a refused call changes nothing" checked by reading state back.

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "core/status_macros.h"
#include "client/client.h"
#include "client/internal.h"
#include "common/codec.h"
#include "common/grpc_status.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "spdlog/sinks/ringbuffer_sink.h"
#include "spdlog/spdlog.h"
#include "common/codec.h"
#include "common/grpc_status.h"
#include "tests/service/health.grpc.pb.h"
#include "tests/service/test_daemon.h"
#include "tests/service/test_plans.h"
#include "tests/seeded_random.h"
#include "tests/status_matchers.h"

namespace memra::testing {
namespace {

using ::memra::testing::IsOkAndHolds;

namespace pb = ::memra::kv::v1;
using ::testing::_;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::SizeIs;

constexpr uint64_t kCapacity = 256;

SessionOptions WithLayerLo(SessionOptions options, uint32_t layer_lo) {
  options.layer_lo = layer_lo;
  return options;
}

int32_t ReadMirror(const Session& session, uint32_t layer, PlaneKind kind) {
  absl::StatusOr<uint8_t*> at = session.PlanePointer(layer, kind);
  EXPECT_THAT(at, IsOk());
  int32_t value = -1;
  if (at.ok()) std::memcpy(&value, *at, sizeof(value));
  return value;
}

SessionSnapshot StateOf(Session& session) {
  absl::StatusOr<SessionSnapshot> state = session.State();
  EXPECT_THAT(state, IsOk());
  return state.ok() ? *state : SessionSnapshot();
}

// The whole state as text, for "changed nothing" comparisons.
std::string Snapshot(Session& session) {
  const SessionSnapshot state = StateOf(session);
  std::string text = absl::StrCat(state.layout_version, " ", state.capacity, " ",
                                  state.committed_len, " ", state.staged_len, " ", state.position,
                                  " ", state.active_generation, " ", state.next_generation, " ",
                                  state.tainted, state.spec_snapshot_valid, state.grow_pending);
  for (const LayerSnapshot& layer : state.layers) {
    absl::StrAppend(&text, " [", layer.layer, " ", layer.length, " ", layer.ring_base, " ",
                    layer.ring, " ", layer.index_pools_ready, "]");
  }
  return text;
}

// Begin, append `rows`, publish, commit `accepted`; returns the committed length.
uint64_t AppendAndCommit(Session& session, uint64_t rows, uint64_t accepted) {
  absl::StatusOr<Transaction> tx = session.Begin();
  EXPECT_THAT(tx, IsOk());
  EXPECT_THAT(session.PrepareAppend(tx->generation, rows), IsOk());
  EXPECT_THAT(session.PublishAppend(tx->generation), IsOk());
  absl::StatusOr<uint64_t> committed = session.Commit(tx->generation, accepted);
  EXPECT_THAT(committed, IsOk());
  return committed.ok() ? *committed : 0;
}

// A Step as the wire carries it (bad-input requests the client would not build).
absl::Status RawStep(KvClient& client, const pb::StepRequest& request, pb::StepResponse* response) {
  return FromGrpcStatus(ClientInternals::Cache(client).Step(
      ClientInternals::NewContext(client).get(), request, response));
}

pb::SessionRef WithToken(const Session& session, std::string token) {
  pb::SessionRef ref = ClientInternals::Ref(session);
  ref.set_session_token(std::move(token));
  return ref;
}

class ServiceTest : public DaemonTest {
 protected:
  // `count` sessions of kCapacity on the fixture's engine (fewer, and a failure, on error).
  std::vector<std::unique_ptr<Session>> NewSessions(int count) {
    std::vector<std::unique_ptr<Session>> sessions;
    for (int i = 0; i < count; ++i) {
      std::unique_ptr<Session> session = NewSession(*client_, kCapacity);
      if (session == nullptr) break;
      sessions.push_back(std::move(session));
    }
    return sessions;
  }
};

// Without an arena pool: a release frees its arena.
class UnpooledServiceTest : public DaemonTest {
 protected:
  void ConfigureDaemon(DaemonConfig& config) override {
    config.sessions.arena_pool_engine_bytes = 0;
  }
};

std::set<std::string> DevShmEntries() {
  std::set<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    names.insert(entry.path().filename().string());
  }
  return names;
}

// ---- Attach, plans ----

TEST_F(ServiceTest, AttachAnnouncesEngineLeaseAndBackend) {
  EXPECT_GT(client_->engine_id(), 0u);
  EXPECT_EQ(client_->lease_timeout(), absl::Milliseconds(kLeaseTimeoutMs));
  EXPECT_TRUE(client_->lease_alive());
  absl::StatusOr<pb::GetStatusResponse> status = ClientInternals::GetStatus(*client_);
  ASSERT_THAT(status, IsOk());
  EXPECT_EQ(status->backend(), "host");
  EXPECT_EQ(status->engines(), 1u);
  EXPECT_EQ(status->plans(), 1u);
  EXPECT_THAT(status->engine_status(), SizeIs(0));  // engines see the totals only
  std::unique_ptr<KvClient> operator_client = NewOperator();
  ASSERT_NE(operator_client, nullptr);
  status = ClientInternals::GetStatus(*operator_client);
  ASSERT_THAT(status, IsOk());
  ASSERT_THAT(status->engine_status(), SizeIs(1));
  EXPECT_EQ(status->engine_status(0).engine_name(), "engine-a");
  EXPECT_TRUE(status->engine_status(0).lease_live());
  EXPECT_THAT(client_->Attach("again"), StatusIs(absl::StatusCode::kFailedPrecondition,
                                                 HasSubstr("already attached as engine 1")));
  absl::StatusOr<std::unique_ptr<KvClient>> unattached = KvClient::Connect(daemon_->socket_path());
  ASSERT_THAT(unattached, IsOk());
  EXPECT_THAT((*unattached)->CreateSession(plan_, Options(kCapacity)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("before Attach")));
}

TEST_F(ServiceTest, AttachNeedsAValidSingleUseHandoffTicket) {
  // The attached engine's identity is the kernel's word for its handoff connection.
  std::unique_ptr<KvClient> operator_client = NewOperator();
  ASSERT_NE(operator_client, nullptr);
  absl::StatusOr<pb::GetStatusResponse> status = ClientInternals::GetStatus(*operator_client);
  ASSERT_THAT(status, IsOk());
  ASSERT_THAT(status->engine_status(), SizeIs(1));
  EXPECT_EQ(status->engine_status(0).pid(), getpid());
  EXPECT_EQ(status->engine_status(0).uid(), getuid());
  EXPECT_EQ(status->engine_status(0).gid(), getgid());

  auto attach = [&](const std::string& ticket) {
    grpc::ClientContext context;
    auto stream = ClientInternals::Cache(*client_).Attach(&context);
    pb::AttachRequest hello;
    hello.mutable_hello()->set_engine_name("ticketless");
    hello.mutable_hello()->set_handoff_ticket(ticket);
    pb::AttachResponse response;
    if (stream->Write(hello) && stream->Read(&response)) {
      context.TryCancel();
      (void)stream->Finish();
      return absl::OkStatus();
    }
    return FromGrpcStatus(stream->Finish());
  };
  EXPECT_THAT(attach(""), StatusIs(absl::StatusCode::kPermissionDenied,
                                   HasSubstrs("no handoff ticket", daemon_->handoff_socket_path())));
  EXPECT_THAT(attach("forged"), StatusIs(absl::StatusCode::kPermissionDenied,
                                         HasSubstr("ticket is 32 bytes, got 6")));
  std::unique_ptr<HandoffChannel> handoff = NewHandoff();
  ASSERT_NE(handoff, nullptr);
  ASSERT_THAT(attach(handoff->ticket()), IsOk());
  EXPECT_THAT(attach(handoff->ticket()),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("was already used")));
}

TEST_F(ServiceTest, ArenaDescriptorsGoOnlyToTheOwningEngine) {
  const std::set<std::string> shm_before = DevShmEntries();
  std::unique_ptr<Session> mine = NewSession(*client_, kCapacity);
  ASSERT_NE(mine, nullptr);
  const SessionArena& arena = mine->layout().arenas[0];
  // Nothing of the session is reachable by name.
  EXPECT_EQ(DevShmEntries(), shm_before);
  const std::string token = ClientInternals::Ref(*mine).session_token();

  absl::StatusOr<ArenaFd> own = ClientInternals::FetchArenaFd(*client_, mine->id(), token,
                                                              arena.handle);
  ASSERT_THAT(own, IsOk());
  EXPECT_EQ(own->bytes, arena.bytes);
  struct stat st;
  ASSERT_EQ(fstat(own->fd.get(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), arena.bytes);

  // Another engine is refused even with the session's token (a leaked capability).
  std::unique_ptr<KvClient> other = NewClient("engine-b");
  ASSERT_NE(other, nullptr);
  EXPECT_THAT(ClientInternals::FetchArenaFd(*other, mine->id(), token, arena.handle),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstrs("session 1 belongs to engine 1",
                                  "this handoff connection is engine 2's")));
  EXPECT_THAT(ClientInternals::FetchArenaFd(*other, mine->id(), "guess", arena.handle),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("wrong session token for session 1")));
  EXPECT_THAT(ClientInternals::FetchArenaFd(*client_, mine->id(), token, "0123"),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstrs("session 1 has no arena with handle \"0123\"")));
  EXPECT_THAT(ClientInternals::FetchArenaFd(*client_, 99, token, arena.handle),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("session 99")));
  // Refusals leave the connection serving.
  EXPECT_THAT(ClientInternals::FetchArenaFd(*client_, mine->id(), token, arena.handle), IsOk());
  // The session maps once: opening more planes fetches nothing more.
  EXPECT_EQ(client_->mapper().OpenCount(), 1u);
  EXPECT_EQ(daemon_->handoff().arenas_handed(), 3u);  // the session's mapping + two here
}

TEST_F(ServiceTest, AttachMustOpenWithHello) {
  grpc::ClientContext context;
  auto stream = ClientInternals::Cache(*client_).Attach(&context);
  pb::AttachRequest heartbeat;
  heartbeat.mutable_heartbeat()->set_sequence(1);
  ASSERT_TRUE(stream->Write(heartbeat));
  stream->WritesDone();
  pb::AttachResponse response;
  EXPECT_FALSE(stream->Read(&response));
  EXPECT_THAT(FromGrpcStatus(stream->Finish()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("hello")));
  EXPECT_EQ(daemon_->GetStatus().engines(), 1u);
}

TEST_F(ServiceTest, RegisterPlanIsIdempotentAndRefusesBadPlans) {
  EXPECT_THAT(client_->RegisterPlan(HybridTestPlan()), IsOk());
  EXPECT_EQ(*client_->RegisterPlan(HybridTestPlan()), plan_);

  ModelPlan zero_window = HybridTestPlan();
  zero_window.layers[kSlidingLayer].window = 0;
  EXPECT_THAT(client_->RegisterPlan(zero_window),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("layer 1 (sliding_kv): window must be positive")));

  pb::RegisterPlanRequest unspecified;
  *unspecified.mutable_engine() = *ClientInternals::Engine(*client_);
  *unspecified.mutable_plan() = ModelPlanToProto(HybridTestPlan());
  unspecified.mutable_plan()->mutable_layers(0)->set_kind(pb::STATE_KIND_UNSPECIFIED);
  pb::RegisterPlanResponse response;
  EXPECT_THAT(FromGrpcStatus(ClientInternals::Cache(*client_).RegisterPlan(
                  ClientInternals::NewContext(*client_).get(), unspecified, &response)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("plan.layers[0].kind")));
  EXPECT_EQ(daemon_->GetStatus().plans(), 1u);
}

// ---- Sessions ----

TEST_F(ServiceTest, CreateSessionReturnsEveryPlaneMapped) {
  std::unique_ptr<Session> session = NewSession(*client_, kCapacity);
  ASSERT_NE(session, nullptr);
  const SessionLayout& layout = session->layout();
  EXPECT_EQ(layout.version, 1u);
  EXPECT_EQ(layout.capacity, kCapacity);
  ASSERT_THAT(layout.arenas, SizeIs(1));
  EXPECT_EQ(layout.arenas[0].backend, "host");
  EXPECT_EQ(layout.arenas[0].bytes, host_->AllocatedBytes());
  ASSERT_THAT(layout.layers, SizeIs(4));
  for (const SessionLayer& layer : layout.layers) {
    for (const SessionPlane& plane : layer.planes) {
      EXPECT_EQ(plane.offset % 256, 0u);
      EXPECT_LE(plane.offset + plane.bytes, layout.arenas[0].bytes);
      EXPECT_THAT(session->Plane(layer.layer, plane.kind), IsOk());
    }
  }
  EXPECT_THAT(session->Plane(kFlatLayer, PlaneKind::kKeys)->rows, kCapacity);
  // docs/rules.md#swa-ring: a capacity not above window + 4,639 rows clamps the ring to the
  // capacity; the layout still says `ring`, and physical_rows == capacity says it saves nothing.
  const SessionLayer& sliding = layout.layers[kSlidingLayer];
  EXPECT_EQ(sliding.layer, kSlidingLayer);
  EXPECT_TRUE(sliding.ring);
  EXPECT_EQ(sliding.physical_rows, kCapacity);
  EXPECT_THAT(session->Plane(kSlidingLayer, PlaneKind::kBaseMirror), IsOk());
  EXPECT_THAT(session->Plane(kRecurrentLayer, PlaneKind::kKeys),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("layer 2 has no keys plane")));
  const SessionSnapshot state = StateOf(*session);
  EXPECT_EQ(state.committed_len, 0u);
  EXPECT_EQ(state.next_generation, 1u);
  EXPECT_FALSE(state.tainted);
  EXPECT_EQ(daemon_->GetStatus().sessions(), 1u);
  EXPECT_EQ(daemon_->GetStatus().engine_status(0).allocated_bytes(), layout.arenas[0].bytes);
}

TEST_F(ServiceTest, CreateSessionRefusalsAllocateNothing) {
  auto create = [&](const pb::CreateSessionRequest& request) {
    pb::CreateSessionResponse response;
    return FromGrpcStatus(ClientInternals::Cache(*client_).CreateSession(
        ClientInternals::NewContext(*client_).get(), request, &response));
  };
  pb::CreateSessionRequest good;
  good.mutable_engine()->set_engine_id(client_->engine_id());
  // The engine token is the client's secret; a bad one must be refused like a stranger's.
  good.set_plan_fingerprint(FingerprintToBytes(plan_));
  good.set_capacity(kCapacity);

  pb::CreateSessionRequest request = good;
  request.mutable_engine()->set_engine_token("0123456789abcdef");
  EXPECT_THAT(create(request),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("wrong engine token")));
  request.mutable_engine()->set_engine_id(999);
  EXPECT_THAT(create(request), StatusIs(absl::StatusCode::kNotFound, HasSubstr("engine 999")));

  EXPECT_THAT(client_->CreateSession(PlanFingerprint{}, Options(kCapacity)),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("not registered")));
  request = good;
  request.set_plan_fingerprint("short");
  EXPECT_THAT(create(request), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("5 bytes")));
  EXPECT_THAT(client_->CreateSession(plan_, Options(0)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("capacity 0 tokens: a session needs at least 1")));
  EXPECT_THAT(
      client_->CreateSession(plan_, Options(uint64_t{1} << 40)),
      StatusIs(
          absl::StatusCode::kInvalidArgument,
          HasSubstr("capacity 1099511627776 tokens exceeds i32 device mirrors (max 2147483647)")));
  EXPECT_THAT(client_->CreateSession(plan_, WithLayerLo(Options(kCapacity), 7)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("layer range [7, 4) is out of bounds for a plan of 4 layers")));
  // Past the 64 MiB budget: admission refuses before anything is allocated.
  EXPECT_THAT(client_->CreateSession(plan_, Options(1u << 30)),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("needs 163209306112 bytes, 67108864 free (0 evictable) of "
                                 "67108864 budget; eviction cannot make room")));

  EXPECT_EQ(host_->ArenaCount(), 0u);
  EXPECT_EQ(daemon_->GetStatus().sessions(), 0u);
}

TEST_F(ServiceTest, EveryCallNeedsTheSessionToken) {
  std::unique_ptr<Session> session = NewSession(*client_, kCapacity);
  ASSERT_NE(session, nullptr);
  AppendAndCommit(*session, 5, 5);
  const std::string before = Snapshot(*session);

  pb::RewindRequest rewind;
  *rewind.mutable_session() = WithToken(*session, "not-the-token");
  rewind.set_target(0);
  pb::SessionStateResponse state;
  EXPECT_THAT(FromGrpcStatus(ClientInternals::Cache(*client_).Rewind(
                  ClientInternals::NewContext(*client_).get(), rewind, &state)),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("wrong session token")));
  pb::SessionRequest release;
  *release.mutable_session() = WithToken(*session, "");
  pb::ReleaseSessionResponse released;
  EXPECT_THAT(FromGrpcStatus(ClientInternals::Cache(*client_).ReleaseSession(
                  ClientInternals::NewContext(*client_).get(), release, &released)),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("wrong session token for session 1")));
  pb::StepRequest step;
  pb::StepEntry* entry = step.add_entries();
  *entry->mutable_session() = WithToken(*session, "x");
  entry->mutable_begin();
  pb::StepResponse results;
  ASSERT_THAT(RawStep(*client_, step, &results), IsOk());
  EXPECT_EQ(results.results(0).code(), static_cast<int>(absl::StatusCode::kPermissionDenied));

  *rewind.mutable_session() = ClientInternals::Ref(*session);
  rewind.mutable_session()->set_session_id(session->id() + 1000);
  EXPECT_THAT(FromGrpcStatus(ClientInternals::Cache(*client_).Rewind(
                  ClientInternals::NewContext(*client_).get(), rewind, &state)),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("does not exist")));

  EXPECT_EQ(Snapshot(*session), before);
}

TEST_F(ServiceTest, OneEngineCannotTouchAnothersSession) {
  std::unique_ptr<KvClient> other = NewClient("engine-b");
  ASSERT_NE(other, nullptr);
  std::unique_ptr<Session> mine = NewSession(*client_, kCapacity);
  ASSERT_NE(mine, nullptr);
  // Engine B knows the id but not the token.
  pb::SessionRequest request;
  request.mutable_session()->set_session_id(mine->id());
  pb::BeginResponse begun;
  EXPECT_THAT(FromGrpcStatus(ClientInternals::Cache(*other).Begin(
                  ClientInternals::NewContext(*other).get(), request, &begun)),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("wrong session token for session 1")));
  EXPECT_EQ(StateOf(*mine).next_generation, 1u);
}

// ---- Transactions ----

TEST_F(ServiceTest, PartialCommitSetsLengthsAndMirrors) {
  std::unique_ptr<Session> session = NewSession(*client_, kCapacity);
  ASSERT_NE(session, nullptr);
  absl::StatusOr<Transaction> tx = session->Begin();
  ASSERT_THAT(tx, IsOk());
  EXPECT_EQ(tx->generation, 1u);
  EXPECT_EQ(tx->base_len, 0u);
  absl::StatusOr<PreparedAppend> append = session->PrepareAppend(tx->generation, 8);
  ASSERT_THAT(append, IsOk());
  EXPECT_EQ(append->target, 8u);
  ASSERT_THAT(append->layers, SizeIs(2));  // the two K/V layers
  EXPECT_EQ(append->layers[0].layer, kFlatLayer);
  EXPECT_EQ(append->layers[0].write_row, 0u);
  // Nothing is published before PublishAppend.
  EXPECT_EQ(ReadMirror(*session, kFlatLayer, PlaneKind::kLenMirror), 0);
  EXPECT_THAT(session->PublishAppend(tx->generation), IsOkAndHolds(8u));
  EXPECT_EQ(ReadMirror(*session, kFlatLayer, PlaneKind::kLenMirror), 8);
  EXPECT_EQ(ReadMirror(*session, kLatentLayer, PlaneKind::kLenMirror), 8);
  SessionSnapshot staged = StateOf(*session);
  EXPECT_EQ(staged.staged_len, 8u);
  EXPECT_EQ(staged.committed_len, 0u);
  EXPECT_EQ(staged.active_generation, 1u);

  EXPECT_THAT(session->Commit(tx->generation, 5), IsOkAndHolds(5u));
  SessionSnapshot committed = StateOf(*session);
  EXPECT_EQ(committed.committed_len, 5u);
  EXPECT_EQ(committed.staged_len, 5u);
  EXPECT_EQ(committed.active_generation, 0u);
  for (uint32_t layer : {kFlatLayer, kSlidingLayer, kLatentLayer}) {
    EXPECT_EQ(ReadMirror(*session, layer, PlaneKind::kLenMirror), 5) << "layer " << layer;
  }
  for (const LayerSnapshot& layer : committed.layers) EXPECT_EQ(layer.length, 5);

  absl::StatusOr<Transaction> next = session->Begin();
  ASSERT_THAT(next, IsOk());
  EXPECT_EQ(next->generation, 2u);
  EXPECT_EQ(next->base_len, 5u);
  ASSERT_THAT(session->PrepareAppend(next->generation, 3), IsOk());
  ASSERT_THAT(session->PublishAppend(next->generation), IsOk());
  EXPECT_THAT(session->Abort(next->generation), IsOkAndHolds(5u));
  EXPECT_EQ(ReadMirror(*session, kFlatLayer, PlaneKind::kLenMirror), 5);
}

TEST_F(ServiceTest, TransactionRefusalsChangeNothing) {
  std::unique_ptr<Session> session = NewSession(*client_, kCapacity);
  ASSERT_NE(session, nullptr);
  AppendAndCommit(*session, 4, 4);
  absl::StatusOr<Transaction> tx = session->Begin();
  ASSERT_THAT(tx, IsOk());
  const std::string before = Snapshot(*session);

  EXPECT_THAT(session->Begin(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("KV transaction generation 2 is already active at base 4")));
  EXPECT_THAT(session->PrepareAppend(tx->generation + 1, 1),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("stale KV transaction generation 3 (active: 2)")));
  EXPECT_THAT(session->PrepareAppend(tx->generation, kCapacity),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("KV append exceeds capacity: 260 > 256")));
  EXPECT_THAT(session->PrepareAppend(tx->generation, ~uint64_t{0}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("KV staged length overflows: 4 + 18446744073709551615")));
  EXPECT_THAT(
      session->PublishAppend(tx->generation),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               HasSubstr("no prepared append for transaction generation 2")));  // nothing prepared
  EXPECT_THAT(session->Commit(tx->generation + 7, 0),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("stale KV transaction generation 9 (active: 2)")));
  EXPECT_THAT(session->Abort(0),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("stale KV transaction generation 0 (active: 2)")));
  EXPECT_EQ(Snapshot(*session), before);

  ASSERT_THAT(session->PrepareAppend(tx->generation, 2), IsOk());
  ASSERT_THAT(session->PublishAppend(tx->generation), IsOk());
  const std::string published = Snapshot(*session);
  EXPECT_THAT(session->Commit(tx->generation, 3),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("KV commit accepts 3 rows from a 2-row transaction")));
  EXPECT_EQ(Snapshot(*session), published);
  EXPECT_EQ(ReadMirror(*session, kFlatLayer, PlaneKind::kLenMirror), 6);
}

TEST_F(ServiceTest, StepRunsManySessionsWithIndependentResults) {
  std::vector<std::unique_ptr<Session>> sessions = NewSessions(4);
  ASSERT_THAT(sessions, SizeIs(4));
  StepBatch batch;
  for (const auto& session : sessions) batch.Begin(*session);
  absl::StatusOr<std::vector<StepOutcome>> begun = client_->Step(batch);
  ASSERT_THAT(begun, IsOk());
  ASSERT_THAT(*begun, SizeIs(4));
  for (const StepOutcome& outcome : *begun) {
    ASSERT_THAT(outcome.status, IsOk());
    EXPECT_EQ(outcome.begun.generation, 1u);
  }

  batch.Clear();
  for (size_t i = 0; i < sessions.size(); ++i) batch.Prepare(*sessions[i], 1, i + 1);
  batch.Prepare(*sessions[0], 99, 1);  // stale generation: refused alone
  absl::StatusOr<std::vector<StepOutcome>> prepared = client_->Step(batch);
  ASSERT_THAT(prepared, IsOk());
  ASSERT_THAT(*prepared, SizeIs(5));
  for (size_t i = 0; i < sessions.size(); ++i) {
    ASSERT_THAT((*prepared)[i].status, IsOk());
    EXPECT_EQ((*prepared)[i].prepared->target, i + 1);
  }
  EXPECT_THAT((*prepared)[4].status,
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("stale KV transaction generation 99 (active: 1)")));
  EXPECT_FALSE((*prepared)[4].prepared.has_value());

  batch.Clear();
  for (const auto& session : sessions) batch.Publish(*session, 1);
  ASSERT_THAT(client_->Step(batch), IsOk());
  batch.Clear();
  for (size_t i = 0; i < sessions.size(); ++i) batch.Commit(*sessions[i], 1, i);
  absl::StatusOr<std::vector<StepOutcome>> committed = client_->Step(batch);
  ASSERT_THAT(committed, IsOk());
  for (size_t i = 0; i < sessions.size(); ++i) {
    ASSERT_THAT((*committed)[i].status, IsOk());
    EXPECT_EQ((*committed)[i].committed_len, i);
    EXPECT_EQ(StateOf(*sessions[i]).committed_len, i);
  }

  pb::StepRequest empty_op;
  *empty_op.add_entries()->mutable_session() = ClientInternals::Ref(*sessions[0]);
  pb::StepResponse response;
  ASSERT_THAT(RawStep(*client_, empty_op, &response), IsOk());
  EXPECT_EQ(response.results(0).code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(response.results(0).message(), HasSubstr("names no operation"));
}

// Commit's token ids travel in both the unary call and a Step entry: a count that is neither 0
// nor accepted_rows is refused with both numbers, and a full set commits.
// A Step carrying a wait event is authenticated before anything waits on that event (as the
// ordered unary calls are): a forged session, or no entry at all, is refused first. (On the host
// backend any event is then refused: its arenas are ordered by the RPC order alone.)
TEST_F(ServiceTest, StepWithAWaitEventAuthenticatesBeforeWaiting) {
  std::vector<std::unique_ptr<Session>> sessions = NewSessions(1);
  ASSERT_THAT(sessions, SizeIs(1));
  pb::StepResponse response;
  pb::StepRequest forged;
  forged.mutable_ordering()->set_wait_event(std::string(64, 'e'));
  pb::StepEntry& entry = *forged.add_entries();
  *entry.mutable_session() = WithToken(*sessions[0], "forged");
  entry.mutable_begin();
  EXPECT_THAT(RawStep(*client_, forged, &response),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("wrong session token")));
  pb::StepRequest empty;
  empty.mutable_ordering()->set_wait_event(std::string(64, 'e'));
  EXPECT_THAT(RawStep(*client_, empty, &response),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Step with a wait event carries no entries")));
  pb::StepRequest owned = forged;
  *owned.mutable_entries(0)->mutable_session() = ClientInternals::Ref(*sessions[0]);
  EXPECT_THAT(RawStep(*client_, owned, &response),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("a 64-byte interprocess event handle was sent")));
}

TEST_F(ServiceTest, CommitCarriesTokenIdsInTheUnaryCallAndInAStep) {
  std::unique_ptr<Session> session = NewSession(*client_, kCapacity);
  ASSERT_NE(session, nullptr);
  const std::vector<int32_t> tokens = {11, 12, 13};
  absl::StatusOr<Transaction> tx = session->Begin();
  ASSERT_THAT(tx, IsOk());
  ASSERT_THAT(session->PrepareAppend(tx->generation, 3), IsOk());
  ASSERT_THAT(session->PublishAppend(tx->generation), IsOk());
  EXPECT_THAT(session->Commit(tx->generation, 3, absl::MakeConstSpan(tokens).first(2)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("commit carries 2 token ids for 3 accepted rows")));
  StepBatch batch;
  batch.Commit(*session, tx->generation, 2, tokens);
  absl::StatusOr<std::vector<StepOutcome>> refused = client_->Step(batch);
  ASSERT_THAT(refused, IsOk());
  EXPECT_THAT((*refused)[0].status,
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("commit carries 3 token ids for 2 accepted rows")));
  batch.Clear();
  batch.Commit(*session, tx->generation, 3, tokens);
  absl::StatusOr<std::vector<StepOutcome>> committed = client_->Step(batch);
  ASSERT_THAT(committed, IsOk());
  ASSERT_THAT((*committed)[0].status, IsOk());
  EXPECT_EQ((*committed)[0].committed_len, 3u);
}

// ---- Advance: one Step entry per session per step ----

// The mirrors of every layer that has one, for "the device sees the same lengths" comparisons.
std::vector<int32_t> Mirrors(const Session& session) {
  std::vector<int32_t> values;
  for (uint32_t layer : {kFlatLayer, kSlidingLayer, kLatentLayer}) {
    values.push_back(ReadMirror(session, layer, PlaneKind::kLenMirror));
  }
  values.push_back(ReadMirror(session, kSlidingLayer, PlaneKind::kBaseMirror));
  return values;
}

// The one entry of a one-entry Step.
StepOutcome StepOne(KvClient& client, StepBatch& batch) {
  absl::StatusOr<std::vector<StepOutcome>> outcomes = client.Step(batch);
  EXPECT_THAT(outcomes, IsOk());
  batch.Clear();
  if (outcomes.ok() && outcomes->size() == 1) return std::move((*outcomes)[0]);
  StepOutcome missing;
  missing.status = absl::InternalError("no outcome");
  return missing;
}

TEST_F(ServiceTest, AdvanceRunsADecodeLoopInOneEntryPerSessionPerStep) {
  std::vector<std::unique_ptr<Session>> sessions = NewSessions(3);
  ASSERT_THAT(sessions, SizeIs(3));
  StepBatch batch;
  std::vector<StepOutcome> outcomes;
  for (const auto& session : sessions) batch.Advance(*session, 0, 0, 4);
  ASSERT_THAT(client_->Step(batch, outcomes), IsOk());
  for (const StepOutcome& outcome : outcomes) {
    ASSERT_THAT(outcome.status, IsOk());
    EXPECT_EQ(outcome.begun.generation, 1u);
    EXPECT_EQ(outcome.begun.base_len, 0u);
    ASSERT_TRUE(outcome.prepared.has_value());
    EXPECT_EQ(outcome.prepared->target, 4u);
    EXPECT_THAT(outcome.prepared->layers, SizeIs(2));
    EXPECT_FALSE(outcome.published);
  }
  uint64_t expected = 0;
  for (int step = 1; step <= 20; ++step) {
    const uint64_t accepted = step % 4 == 0 ? 1 : 4;  // spec-decode-like partial accepts
    std::vector<int32_t> tokens(accepted, step);
    batch.Clear();
    for (size_t i = 0; i < sessions.size(); ++i) {
      batch.Advance(*sessions[i], outcomes[i].begun.generation, accepted, step == 20 ? 0 : 4,
                    tokens);
    }
    ASSERT_THAT(client_->Step(batch, outcomes), IsOk());
    expected += accepted;
    for (size_t i = 0; i < sessions.size(); ++i) {
      ASSERT_THAT(outcomes[i].status, IsOk()) << "step " << step;
      EXPECT_TRUE(outcomes[i].published);
      EXPECT_EQ(outcomes[i].committed_len, expected);
      EXPECT_EQ(outcomes[i].prepared.has_value(), step != 20);
      if (step != 20) {
        EXPECT_EQ(outcomes[i].begun.base_len, expected);
      }
      EXPECT_EQ(Mirrors(*sessions[i]), (std::vector<int32_t>{
                                           static_cast<int32_t>(expected),
                                           static_cast<int32_t>(expected),
                                           static_cast<int32_t>(expected), 0}));
    }
  }
  for (const auto& session : sessions) {
    const SessionSnapshot state = StateOf(*session);
    EXPECT_EQ(state.committed_len, expected);
    EXPECT_EQ(state.active_generation, 0u) << "the last Advance began no transaction";
  }
  // The session API: one call, one entry.
  absl::StatusOr<StepOutcome> single = sessions[0]->Advance(0, 0, 2);
  ASSERT_THAT(single, IsOk());
  absl::StatusOr<StepOutcome> finished =
      sessions[0]->Advance(single->begun.generation, 2, 0, std::vector<int32_t>{7, 8});
  ASSERT_THAT(finished, IsOk());
  EXPECT_EQ(finished->committed_len, expected + 2);
}

TEST_F(ServiceTest, AdvanceRefusalsChangeNothing) {
  std::unique_ptr<Session> session = NewSession(*client_, kCapacity);
  ASSERT_NE(session, nullptr);
  AppendAndCommit(*session, 4, 4);
  absl::StatusOr<StepOutcome> opened = session->Advance(0, 0, 3);
  ASSERT_THAT(opened, IsOk());
  const uint64_t generation = opened->begun.generation;
  const std::string before = Snapshot(*session);
  const std::vector<int32_t> mirrors = Mirrors(*session);
  const std::vector<int32_t> tokens = {1, 2, 3};

  EXPECT_THAT(session->Advance(0, 0, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("neither a transaction to finish (generation 0) nor rows")));
  EXPECT_THAT(session->Advance(0, 0, 1, tokens),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("advance carries 3 token ids but finishes no transaction")));
  EXPECT_THAT(session->Advance(0, 0, 1),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("generation 2 is already active at base 4")));
  EXPECT_THAT(session->Advance(generation + 1, 3, 1),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("stale KV transaction generation 3 (active: 2)")));
  // After the publish part: the same token-id refusal as Commit's, and the publish undone.
  EXPECT_THAT(session->Advance(generation, 3, 1, absl::MakeConstSpan(tokens).first(2)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("commit carries 2 token ids for 3 accepted rows")));
  EXPECT_THAT(session->Advance(generation, 4, 1),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("KV commit accepts 4 rows from a 3-row transaction")));
  // The commit would be accepted alone; the next prepare is refused, so nothing is applied.
  EXPECT_THAT(session->Advance(generation, 3, kCapacity),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("KV append exceeds capacity: 263 > 256")));
  EXPECT_EQ(Snapshot(*session), before);
  EXPECT_EQ(Mirrors(*session), mirrors);

  // Another engine's Advance naming the session without its token.
  std::unique_ptr<KvClient> other = NewClient("engine-b");
  ASSERT_NE(other, nullptr);
  pb::StepRequest request;
  pb::StepEntry* entry = request.add_entries();
  *entry->mutable_session() = WithToken(*session, "not the token");
  entry->mutable_advance()->set_generation(generation);
  entry->mutable_advance()->set_accepted_rows(3);
  pb::StepResponse response;
  ASSERT_THAT(RawStep(*other, request, &response), IsOk());
  EXPECT_EQ(response.results(0).code(), static_cast<int>(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(response.results(0).message(), HasSubstr("wrong session token"));
  EXPECT_FALSE(response.results(0).has_advance());
  EXPECT_EQ(Snapshot(*session), before);

  EXPECT_THAT(session->Advance(generation, 3, 0, tokens), IsOk());
  EXPECT_EQ(StateOf(*session).committed_len, 7u);
}

// One scripted random workload, through Advance entries on one session and through the separate
// entries (sent one at a time, stopping at the first refusal, as an engine would) on another:
// every outcome, state and mirror agrees; a refused Advance changed nothing, and the separate
// side's accepted parts applied to it afterwards reach the separate side's state.
TEST_F(ServiceTest, AdvanceIsEquivalentToTheSeparateEntriesOnARandomWorkload) {
  std::unique_ptr<Session> advanced = NewSession(*client_, kCapacity);
  std::unique_ptr<Session> separate = NewSession(*client_, kCapacity);
  ASSERT_NE(advanced, nullptr);
  ASSERT_NE(separate, nullptr);
  // Refusal messages name the session: compare them as if they named the same one.
  auto same_session = [&](const absl::Status& status) {
    return absl::Status(status.code(),
                        absl::StrReplaceAll(status.message(),
                                            {{absl::StrCat("session ", separate->id()),
                                              absl::StrCat("session ", advanced->id())}}));
  };
  SeededRandom random(20261201);
  StepBatch batch;
  uint64_t open_generation = 0;
  bool unpublished = false;
  uint64_t staged_rows = 0;  // rows the open transaction prepared
  size_t refusals = 0;
  for (int step = 0; step < 150; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    if (random.Below(20) == 0) {  // the engine rewinds outside the step
      const uint64_t target = random.Below(StateOf(*advanced).staged_len + 1);
      absl::Status a = advanced->Rewind(target).status();
      EXPECT_EQ(same_session(separate->Rewind(target).status()), a);
      if (a.ok()) open_generation = 0;
    }
    const uint64_t which = random.Below(10);
    const uint64_t generation = which < 8 ? open_generation : random.Below(open_generation + 2);
    const uint64_t accepted = random.Below(staged_rows + 2);
    const uint64_t next_rows = random.Below(6) == 0 ? 0 : 1 + random.Below(12);
    std::vector<int32_t> tokens;
    if (random.Below(3) != 0) tokens.assign(random.Below(4) == 0 ? accepted + 1 : accepted, step);
    const bool publish_first = generation != 0 && generation == open_generation && unpublished;

    const std::string before = Snapshot(*advanced);
    batch.Advance(*advanced, generation, accepted, next_rows, tokens);
    const StepOutcome got = StepOne(*client_, batch);

    // The separate entries, one Step each, until the first refusal.
    StepOutcome want;
    bool published = false, committed = false, begun = false;
    auto run_separately = [&]() -> absl::Status {
      if (generation == 0 && (next_rows == 0 || !tokens.empty())) {
        // Refusals of Advance's own request, with no separate form: the same one expected.
        batch.Advance(*separate, 0, accepted, next_rows, tokens);
        return StepOne(*client_, batch).status;
      }
      if (generation != 0) {
        if (publish_first) {
          batch.Publish(*separate, generation);
          RETURN_IF_ERROR(StepOne(*client_, batch).status);
          published = true;
        }
        batch.Commit(*separate, generation, accepted, tokens);
        StepOutcome outcome = StepOne(*client_, batch);
        RETURN_IF_ERROR(outcome.status);
        committed = true;
        want.committed_len = outcome.committed_len;
      } else {
        want.committed_len = StateOf(*separate).committed_len;
      }
      if (next_rows != 0) {
        batch.Begin(*separate);
        StepOutcome outcome = StepOne(*client_, batch);
        RETURN_IF_ERROR(outcome.status);
        begun = true;
        want.begun = outcome.begun;
        batch.Prepare(*separate, outcome.begun.generation, next_rows);
        outcome = StepOne(*client_, batch);
        RETURN_IF_ERROR(outcome.status);
        want.prepared = std::move(outcome.prepared);
      }
      return absl::OkStatus();
    };
    want.status = same_session(run_separately());
    ASSERT_EQ(got.status, want.status);
    if (got.status.ok()) {
      EXPECT_EQ(got.published, published);
      EXPECT_EQ(got.committed_len, want.committed_len);
      EXPECT_EQ(got.prepared.has_value(), want.prepared.has_value());
      if (got.prepared.has_value()) {
        EXPECT_EQ(got.begun.generation, want.begun.generation);
        EXPECT_EQ(got.begun.base_len, want.begun.base_len);
        EXPECT_EQ(got.prepared->target, want.prepared->target);
        EXPECT_EQ(got.prepared->layers, want.prepared->layers);
      }
      open_generation = got.prepared.has_value() ? got.begun.generation : 0;
      unpublished = got.prepared.has_value();
      staged_rows = next_rows;
    } else {
      ++refusals;
      ASSERT_EQ(Snapshot(*advanced), before) << "a refused Advance changed the session";
      if (published) {
        ASSERT_THAT(advanced->PublishAppend(generation), IsOk());
        unpublished = false;
      }
      if (committed) {
        ASSERT_THAT(advanced->Commit(generation, accepted, tokens), IsOk());
        open_generation = 0;
      }
      if (begun) {
        ASSERT_THAT(advanced->Begin(), IsOk());
        open_generation = want.begun.generation;
        unpublished = false;
        staged_rows = 0;
      }
    }
    ASSERT_EQ(Snapshot(*advanced), Snapshot(*separate));
    ASSERT_EQ(Mirrors(*advanced), Mirrors(*separate));
  }
  EXPECT_GT(refusals, 10u);
  EXPECT_GT(StateOf(*advanced).committed_len, 100u) << "the workload should make progress";
}

// ---- The arena pool ----

// The engine's own status line (KvAdmin, operators' view).
pb::EngineStatus EngineStatusOf(Daemon& daemon, uint64_t engine_id) {
  const pb::GetStatusResponse status = daemon.GetStatus();
  for (const pb::EngineStatus& engine : status.engine_status()) {
    if (engine.engine_id() == engine_id) return engine;
  }
  return pb::EngineStatus();
}

size_t MappedCount(KvClient& client) {
  return dynamic_cast<CachingArenaMapper&>(client.mapper()).MappedCount();
}

// A steady request stream (create, decode, release, repeat) makes one arena and one mapping:
// every later session gets the pooled arena back, under the same handle, reset as new.
TEST_F(ServiceTest, ASteadyRequestStreamReusesOnePooledArenaAndMapsNothingNew) {
  const size_t opens = client_->mapper().OpenCount();
  std::string handle;
  for (int request = 0; request < 12; ++request) {
    SCOPED_TRACE(::testing::Message() << "request " << request);
    std::unique_ptr<Session> session = NewSession(*client_, kCapacity);
    ASSERT_NE(session, nullptr);
    if (request == 0) handle = session->layout().arenas[0].handle;
    EXPECT_EQ(session->layout().arenas[0].handle, handle);
    // Reset as a new session needs it: lengths, mirrors and recurrent state at zero.
    const SessionSnapshot fresh = StateOf(*session);
    EXPECT_EQ(fresh.committed_len, 0u);
    EXPECT_EQ(fresh.active_generation, 0u);
    EXPECT_EQ(fresh.next_generation, 1u);
    EXPECT_EQ(Mirrors(*session), (std::vector<int32_t>{0, 0, 0, 0}));
    absl::StatusOr<PlaneView> conv = session->Plane(kRecurrentLayer, PlaneKind::kConvState);
    ASSERT_THAT(conv, IsOk());
    EXPECT_EQ(std::count(conv->data, conv->data + conv->bytes, 0), conv->bytes)
        << "the previous request's recurrent state leaked into this one";
    // The request's own work, leaving recurrent state behind.
    std::memset(conv->data, 0x5a, conv->bytes);
    AppendAndCommit(*session, 5 + request, 5);
    ASSERT_THAT(session->Release(), IsOk());
  }
  EXPECT_EQ(client_->mapper().OpenCount(), opens + 1) << "one mapping for the whole stream";
  EXPECT_EQ(MappedCount(*client_), 1u) << "the pooled arena stays mapped, nothing else";
  const pb::EngineStatus engine = EngineStatusOf(*daemon_, client_->engine_id());
  EXPECT_EQ(engine.new_arenas(), 1u);
  EXPECT_EQ(engine.pool_hits(), 11u);
  EXPECT_EQ(engine.pooled_bytes(), host_->AllocatedBytes());
  EXPECT_EQ(host_->ArenaCount(), 1u);
  EXPECT_EQ(daemon_->GetStatus().admission().evictable_bytes(), host_->AllocatedBytes());
}

TEST_F(ServiceTest, APooledArenaNeverReachesAnotherEngine) {
  std::unique_ptr<Session> mine = NewSession(*client_, kCapacity);
  ASSERT_NE(mine, nullptr);
  const std::string handle = mine->layout().arenas[0].handle;
  ASSERT_THAT(mine->Release(), IsOk());
  std::unique_ptr<KvClient> other = NewClient("engine-b");
  ASSERT_NE(other, nullptr);
  absl::StatusOr<std::unique_ptr<Session>> theirs =
      other->CreateSession(plan_, Options(kCapacity));
  ASSERT_THAT(theirs, IsOk());
  EXPECT_NE((*theirs)->layout().arenas[0].handle, handle);
  EXPECT_EQ(EngineStatusOf(*daemon_, other->engine_id()).new_arenas(), 1u);
  EXPECT_EQ(EngineStatusOf(*daemon_, other->engine_id()).pool_hits(), 0u);
  EXPECT_EQ(EngineStatusOf(*daemon_, client_->engine_id()).pooled_bytes(),
            mine->layout().arenas[0].bytes);
  // Another size is another class: engine A gets a new arena for it and keeps the pooled one.
  std::unique_ptr<Session> larger = NewSession(*client_, 2 * kCapacity);
  ASSERT_NE(larger, nullptr);
  EXPECT_NE(larger->layout().arenas[0].handle, handle);
  EXPECT_EQ(EngineStatusOf(*daemon_, client_->engine_id()).new_arenas(), 2u);
}

// Pooled bytes are evictable: another engine's admission frees them rather than being refused,
// and the owner's client is told to drop the mapping.
TEST_F(ServiceTest, AdmissionEvictsPooledArenasBeforeRefusing) {
  std::vector<std::unique_ptr<Session>> sessions;
  absl::StatusOr<std::unique_ptr<Session>> next;
  while ((next = client_->CreateSession(plan_, Options(kCapacity))).ok()) {
    sessions.push_back(*std::move(next));
  }
  ASSERT_THAT(next.status(), StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("needs")));
  ASSERT_GE(sessions.size(), 2u);
  for (auto& session : sessions) ASSERT_THAT(session->Release(), IsOk());
  const size_t pooled = sessions.size();
  EXPECT_EQ(MappedCount(*client_), pooled);
  std::unique_ptr<KvClient> other = NewClient("engine-b");
  ASSERT_NE(other, nullptr);
  absl::StatusOr<std::unique_ptr<Session>> theirs =
      other->CreateSession(plan_, Options(kCapacity));
  ASSERT_THAT(theirs, IsOk()) << "pooled arenas were not evicted for room";
  EXPECT_LT(EngineStatusOf(*daemon_, client_->engine_id()).pooled_bytes(),
            pooled * sessions[0]->layout().arenas[0].bytes);
  // Engine A's next call hears of the freed arena and unmaps it; its session reuses one of the
  // arenas still pooled.
  const uint64_t created = EngineStatusOf(*daemon_, client_->engine_id()).new_arenas();
  std::unique_ptr<Session> reused = NewSession(*client_, kCapacity);
  ASSERT_NE(reused, nullptr);
  EXPECT_EQ(MappedCount(*client_), pooled - 1) << "the evicted arena's mapping was dropped";
  EXPECT_EQ(EngineStatusOf(*daemon_, client_->engine_id()).new_arenas(), created);
}

TEST_F(ServiceTest, AnEnginesPoolIsFreedWhenItsLeaseEndsBeforeItsGracePasses) {
  std::unique_ptr<KvClient> engine = NewClient("engine-b");
  ASSERT_NE(engine, nullptr);
  const uint64_t id = engine->engine_id();
  absl::StatusOr<std::unique_ptr<Session>> pooled =
      engine->CreateSession(plan_, Options(kCapacity));
  ASSERT_THAT(pooled, IsOk());
  absl::StatusOr<std::unique_ptr<Session>> live = engine->CreateSession(plan_, Options(kCapacity));
  ASSERT_THAT(live, IsOk());
  ASSERT_THAT((*pooled)->Release(), IsOk());
  EXPECT_EQ(host_->ArenaCount(), 2u);
  engine->Detach();  // the lease ends; its live session stays until the grace passes
  for (int i = 0; i < 500 && EngineStatusOf(*daemon_, id).lease_live(); ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  daemon_->CheckLeases();
  EXPECT_EQ(host_->ArenaCount(), 1u) << "the pooled arena went, the session's stays";
  EXPECT_EQ(EngineStatusOf(*daemon_, id).pooled_bytes(), 0u);
  EXPECT_EQ(EngineStatusOf(*daemon_, id).sessions(), 1u);
}

TEST_F(ServiceTest, AnEnginesPoolIsFreedWhenItsLeaseEndsAndAtReclaim) {
  std::unique_ptr<KvClient> engine = NewClient("engine-b");
  ASSERT_NE(engine, nullptr);
  absl::StatusOr<std::unique_ptr<Session>> session =
      engine->CreateSession(plan_, Options(kCapacity));
  ASSERT_THAT(session, IsOk());
  ASSERT_THAT((*session)->Release(), IsOk());
  EXPECT_EQ(host_->ArenaCount(), 1u);
  KillEngine(*engine);
  EXPECT_EQ(host_->ArenaCount(), 0u);
  EXPECT_EQ(daemon_->GetStatus().admission().allocated_bytes(), 0u);
  EXPECT_EQ(daemon_->GetStatus().admission().evictable_bytes(), 0u);
}

// ---- Sessions named by their dense slot ----

TEST_F(ServiceTest, StepBySlotRunsTheOwnersSessionsAndRefusesEveryoneElse) {
  std::unique_ptr<Session> first = NewSession(*client_, kCapacity);
  std::unique_ptr<Session> second = NewSession(*client_, kCapacity);
  ASSERT_NE(first, nullptr);
  ASSERT_NE(second, nullptr);
  EXPECT_NE(first->slot(), second->slot());
  StepBatch batch(StepAddressing::kSlot);
  batch.Advance(*first, 0, 0, 3);
  batch.Advance(*second, 0, 0, 5);
  absl::StatusOr<std::vector<StepOutcome>> opened = client_->Step(batch);
  ASSERT_THAT(opened, IsOk());
  ASSERT_THAT((*opened)[0].status, IsOk());
  ASSERT_THAT((*opened)[1].status, IsOk());
  EXPECT_EQ((*opened)[1].prepared->target, 5u);
  batch.Clear();
  batch.Advance(*first, (*opened)[0].begun.generation, 3, 0);
  ASSERT_THAT(client_->Step(batch), IsOk());
  EXPECT_EQ(StateOf(*first).committed_len, 3u);
  const std::string first_before = Snapshot(*first);
  const std::string second_before = Snapshot(*second);

  // Another engine naming engine A's slots, with its own (valid) credentials: refused.
  std::unique_ptr<KvClient> other = NewClient("engine-b");
  ASSERT_NE(other, nullptr);
  StepBatch foreign(StepAddressing::kSlot);
  foreign.Advance(*second, (*opened)[1].begun.generation, 5, 0);
  foreign.Begin(*first);
  absl::StatusOr<std::vector<StepOutcome>> refused = other->Step(foreign);
  ASSERT_THAT(refused, IsOk());
  for (const StepOutcome& outcome : *refused) {
    EXPECT_THAT(outcome.status,
                StatusIs(absl::StatusCode::kNotFound,
                         HasSubstr(absl::StrCat("holds no session of engine ",
                                                other->engine_id()))));
  }
  EXPECT_THAT((*refused)[0].status, StatusIs(absl::StatusCode::kNotFound,
                                             HasSubstr(absl::StrCat("slot ", second->slot()))));
  EXPECT_EQ(Snapshot(*first), first_before);
  EXPECT_EQ(Snapshot(*second), second_before);

  // A slot entry in a Step without (or with wrong) engine credentials is refused alone; an
  // entry naming its session by token in the same Step still runs.
  pb::StepRequest request;
  pb::StepEntry* by_slot = request.add_entries();
  by_slot->set_slot(second->slot());
  by_slot->mutable_begin();
  pb::StepEntry* by_token = request.add_entries();
  *by_token->mutable_session() = ClientInternals::Ref(*first);
  by_token->mutable_begin();
  pb::StepEntry* empty_slot = request.add_entries();
  empty_slot->set_slot(1000);
  empty_slot->mutable_begin();
  request.mutable_engine()->set_engine_id(client_->engine_id());
  request.mutable_engine()->set_engine_token("not the token");
  pb::StepResponse response;
  ASSERT_THAT(RawStep(*client_, request, &response), IsOk());
  EXPECT_EQ(response.results(0).code(), static_cast<int>(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(response.results(0).message(), HasSubstr("wrong engine token"));
  EXPECT_EQ(response.results(1).code(), 0);
  EXPECT_EQ(response.results(2).code(), static_cast<int>(absl::StatusCode::kPermissionDenied));
  EXPECT_EQ(Snapshot(*second), second_before);
  // With the engine's credentials, an empty slot is NOT_FOUND.
  request.mutable_entries()->DeleteSubrange(0, 2);
  ASSERT_THAT(ClientInternals::Engine(*client_), IsOk());
  *request.mutable_engine() = *ClientInternals::Engine(*client_);
  response.Clear();
  ASSERT_THAT(RawStep(*client_, request, &response), IsOk());
  EXPECT_EQ(response.results(0).code(), static_cast<int>(absl::StatusCode::kNotFound));
  EXPECT_THAT(response.results(0).message(), HasSubstr("slot 1000 holds no session"));

  // A released session's slot goes to the next session created.
  const uint32_t freed = second->slot();
  ASSERT_THAT(second->Release(), IsOk());
  std::unique_ptr<Session> third = NewSession(*client_, kCapacity);
  ASSERT_NE(third, nullptr);
  EXPECT_EQ(third->slot(), freed);
}

// A decode loop's reuse: one batch and one outcomes vector across steps. Slots whose operation
// changes lose the previous step's payload, a refused entry carries no stale one, and a reply
// that outgrows the batch's reused arena block is parsed correctly after the block grows.
TEST_F(ServiceTest, StepReusesTheBatchAndTheOutcomesAcrossSteps) {
  std::vector<std::unique_ptr<Session>> sessions = NewSessions(3);
  ASSERT_THAT(sessions, SizeIs(3));
  StepBatch batch;
  std::vector<StepOutcome> outcomes;
  for (uint64_t step = 0; step < 3; ++step) {
    const uint64_t generation = step + 1;
    batch.Clear();
    for (const auto& session : sessions) {
      batch.Begin(*session);
      batch.Prepare(*session, generation, 2);
    }
    ASSERT_THAT(client_->Step(batch, outcomes), IsOk());
    ASSERT_THAT(outcomes, SizeIs(6));
    for (size_t i = 0; i < sessions.size(); ++i) {
      ASSERT_THAT(outcomes[2 * i].status, IsOk());
      EXPECT_EQ(outcomes[2 * i].begun.generation, generation);
      EXPECT_FALSE(outcomes[2 * i].prepared.has_value());
      ASSERT_THAT(outcomes[2 * i + 1].status, IsOk());
      ASSERT_TRUE(outcomes[2 * i + 1].prepared.has_value());
      EXPECT_EQ(outcomes[2 * i + 1].prepared->target, step + 2);
      // The plan's two K/V layers, in layer order (the wire groups equal plans).
      ASSERT_THAT(outcomes[2 * i + 1].prepared->layers, SizeIs(2));
      EXPECT_EQ(outcomes[2 * i + 1].prepared->layers[0].layer, kFlatLayer);
      EXPECT_EQ(outcomes[2 * i + 1].prepared->layers[1].layer, kSlidingLayer);
    }
    // The same slots now carry Publish and Commit (and one refusal): no Prepare payload is left.
    batch.Clear();
    for (const auto& session : sessions) {
      batch.Publish(*session, generation);
      batch.Commit(*session, generation, 1);
    }
    batch.Abort(*sessions[0], 999);
    ASSERT_THAT(client_->Step(batch, outcomes), IsOk());
    ASSERT_THAT(outcomes, SizeIs(7));
    for (size_t i = 0; i < sessions.size(); ++i) {
      ASSERT_THAT(outcomes[2 * i].status, IsOk());
      EXPECT_EQ(outcomes[2 * i].staged_len, step + 2);
      EXPECT_FALSE(outcomes[2 * i + 1].prepared.has_value());
      EXPECT_EQ(outcomes[2 * i + 1].committed_len, step + 1);
    }
    EXPECT_THAT(outcomes[6].status, StatusIs(absl::StatusCode::kFailedPrecondition,
                                             HasSubstr("generation 999")));
    EXPECT_FALSE(outcomes[6].prepared.has_value());
    EXPECT_EQ(outcomes[6].committed_len, 0u);
  }
  // A much bigger reply than any before (the arena block grows), then a small one again.
  batch.Clear();
  for (int repeat = 0; repeat < 200; ++repeat) batch.Begin(*sessions[1]);
  ASSERT_THAT(client_->Step(batch, outcomes), IsOk());
  ASSERT_THAT(outcomes, SizeIs(200));
  EXPECT_THAT(outcomes[0].status, IsOk());
  EXPECT_THAT(outcomes[199].status, StatusIs(absl::StatusCode::kFailedPrecondition,
                                             HasSubstr("transaction")));
  batch.Clear();
  batch.Abort(*sessions[1], 4);
  ASSERT_THAT(client_->Step(batch, outcomes), IsOk());
  ASSERT_THAT(outcomes, SizeIs(1));
  ASSERT_THAT(outcomes[0].status, IsOk());
  EXPECT_EQ(outcomes[0].committed_len, 3u);
}

// Not a benchmark and no timing assertion: prints what one Step entry costs end to end (RPC,
// lookup, core rules, mirror writes) so a regression to milliseconds is visible in the log.
TEST_F(ServiceTest, StepCostPerSessionIsPrinted) {
  constexpr int kSessions = 128;
  constexpr int kRounds = 20;
  std::vector<std::unique_ptr<Session>> sessions;
  for (int i = 0; i < kSessions; ++i) {
    sessions.push_back(NewSession(*client_, kCapacity, /*spec_snapshot=*/false));
    ASSERT_NE(sessions.back(), nullptr);
  }
  StepBatch batch;
  const absl::Time start = absl::Now();
  for (int round = 0; round < kRounds; ++round) {
    const uint64_t generation = round + 1;
    for (int phase = 0; phase < 4; ++phase) {
      batch.Clear();
      for (const auto& session : sessions) {
        switch (phase) {
          case 0:
            batch.Begin(*session);
            break;
          case 1:
            batch.Prepare(*session, generation, 1);
            break;
          case 2:
            batch.Publish(*session, generation);
            break;
          case 3:
            batch.Commit(*session, generation, 1);
            break;
        }
      }
      absl::StatusOr<std::vector<StepOutcome>> outcomes = client_->Step(batch);
      ASSERT_THAT(outcomes, IsOk());
      for (const StepOutcome& outcome : *outcomes) ASSERT_THAT(outcome.status, IsOk());
    }
  }
  const absl::Duration per_entry = (absl::Now() - start) / (kSessions * kRounds * 4);
  std::printf("Step: %s per session entry (%d sessions x %d rounds x 4 calls)\n",
              absl::FormatDuration(per_entry).c_str(), kSessions, kRounds);
  EXPECT_EQ(StateOf(*sessions[0]).committed_len, static_cast<uint64_t>(kRounds));
}

// Many engines, each driving its own sessions from its own thread while sessions come and go
// and leases are checked: per-session locking keeps every session's count exact.
TEST_F(ServiceTest, ConcurrentEnginesKeepEverySessionExact) {
  constexpr int kEngines = 4;
  constexpr int kSessionsPerEngine = 4;
  constexpr int kRounds = 25;
  std::vector<std::unique_ptr<KvClient>> engines;
  for (int e = 0; e < kEngines; ++e) {
    engines.push_back(NewClient(absl::StrCat("engine-", e)));
    ASSERT_NE(engines.back(), nullptr);
  }
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int e = 0; e < kEngines; ++e) {
    threads.emplace_back([&, e] {
      std::vector<std::unique_ptr<Session>> sessions;
      for (int i = 0; i < kSessionsPerEngine; ++i) {
        absl::StatusOr<std::unique_ptr<Session>> session =
            engines[e]->CreateSession(plan_, Options(kCapacity, false));
        if (!session.ok()) return failures.fetch_add(1), void();
        sessions.push_back(*std::move(session));
      }
      for (int round = 0; round < kRounds; ++round) {
        StepBatch batch;
        for (const auto& session : sessions) batch.Begin(*session);
        absl::StatusOr<std::vector<StepOutcome>> begun = engines[e]->Step(batch);
        batch.Clear();
        for (const auto& session : sessions) batch.Prepare(*session, round + 1, 2);
        for (const auto& session : sessions) batch.Publish(*session, round + 1);
        for (const auto& session : sessions) batch.Commit(*session, round + 1, 1);
        absl::StatusOr<std::vector<StepOutcome>> rest = engines[e]->Step(batch);
        if (!begun.ok() || !rest.ok()) return failures.fetch_add(1), void();
        for (const StepOutcome& outcome : *begun) failures += !outcome.status.ok();
        for (const StepOutcome& outcome : *rest) failures += !outcome.status.ok();
        // A short-lived session beside the busy ones: creation and release race the steps.
        absl::StatusOr<std::unique_ptr<Session>> extra =
            engines[e]->CreateSession(plan_, Options(kCapacity, false));
        if (!extra.ok() || !(*extra)->Release().ok()) failures.fetch_add(1);
      }
      for (const auto& session : sessions) {
        absl::StatusOr<SessionSnapshot> state = session->State();
        if (!state.ok() || state->committed_len != static_cast<uint64_t>(kRounds)) {
          failures.fetch_add(1);
        }
      }
    });
  }
  threads.emplace_back([&] {
    for (int i = 0; i < 50; ++i) {
      daemon_->CheckLeases();
      (void)daemon_->GetStatus();
      absl::SleepFor(absl::Milliseconds(1));
    }
  });
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
  // Each thread's sessions were released when its Session objects went away.
  EXPECT_EQ(daemon_->GetStatus().sessions(), 0u);
  // Their arenas wait in their engines' pools (freed at reclaim), and nothing else is left.
  uint64_t pooled = 0;
  const pb::GetStatusResponse status = daemon_->GetStatus();
  for (const pb::EngineStatus& engine : status.engine_status()) pooled += engine.pooled_bytes();
  EXPECT_EQ(host_->AllocatedBytes(), pooled);
}

// ---- Rewind, spec decode ----

TEST_F(ServiceTest, RewindMovesLengthsAndMirrorsBackOnly) {
  std::unique_ptr<Session> session = NewSession(*client_, kCapacity);
  ASSERT_NE(session, nullptr);
  AppendAndCommit(*session, 20, 20);
  EXPECT_THAT(session->CanRewind(12), IsOkAndHolds(true));
  EXPECT_THAT(session->CanRewind(kCapacity + 1), IsOkAndHolds(false));
  absl::StatusOr<SessionSnapshot> rewound = session->Rewind(12);
  ASSERT_THAT(rewound, IsOk());
  EXPECT_EQ(rewound->committed_len, 12u);
  EXPECT_EQ(ReadMirror(*session, kFlatLayer, PlaneKind::kLenMirror), 12);
  EXPECT_EQ(ReadMirror(*session, kLatentLayer, PlaneKind::kLenMirror), 12);

  // Forward past the staged length is hydration, never an engine rewind.
  const std::string before = Snapshot(*session);
  EXPECT_THAT(session->Rewind(13),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("KV rewind target 13 is past the staged length 12 (only hydration "
                                 "may set unwritten rows)")));
  EXPECT_THAT(session->Rewind(kCapacity + 5),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("KV rewind target 261 is past the staged length 12 (only "
                                 "hydration may set unwritten rows)")));
  EXPECT_EQ(Snapshot(*session), before);
}

TEST_F(ServiceTest, HydratePublishesWrittenRowsIntoAFreshSessionOnly) {
  std::unique_ptr<Session> session = NewSession(*client_, kCapacity);
  ASSERT_NE(session, nullptr);
  const std::string fresh = Snapshot(*session);
  EXPECT_THAT(session->Hydrate(kCapacity + 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exceeds capacity 256")));
  EXPECT_THAT(session->Hydrate(10, {1, 0}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("must start at absolute row zero, got 1")));
  EXPECT_THAT(session->Hydrate(10, {0}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("names 1 resident starts for 2 layers")));
  EXPECT_EQ(Snapshot(*session), fresh);

  absl::StatusOr<SessionSnapshot> hydrated = session->Hydrate(100);
  ASSERT_THAT(hydrated, IsOk());
  EXPECT_EQ(hydrated->committed_len, 100u);
  EXPECT_EQ(ReadMirror(*session, kFlatLayer, PlaneKind::kLenMirror), 100);
  EXPECT_EQ(ReadMirror(*session, kLatentLayer, PlaneKind::kLenMirror), 100);
  // The sliding layer keeps its aligned live window: (100 - 31) rounded down to 32 rows.
  EXPECT_EQ(ReadMirror(*session, kSlidingLayer, PlaneKind::kBaseMirror), 64);

  const std::string after = Snapshot(*session);
  EXPECT_THAT(session->Hydrate(50),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("must be fresh")));
  EXPECT_EQ(Snapshot(*session), after);
  AppendAndCommit(*session, 4, 4);
  EXPECT_EQ(ReadMirror(*session, kFlatLayer, PlaneKind::kLenMirror), 104);
}

TEST_F(ServiceTest, SpecRollbackRestoresRecurrentStateAndLengths) {
  std::unique_ptr<Session> session = NewSession(*client_, kCapacity);
  ASSERT_NE(session, nullptr);
  AppendAndCommit(*session, 10, 10);
  absl::StatusOr<PlaneView> conv = session->Plane(kRecurrentLayer, PlaneKind::kConvState);
  absl::StatusOr<PlaneView> ssm = session->Plane(kRecurrentLayer, PlaneKind::kSsmState);
  ASSERT_THAT(conv, IsOk());
  ASSERT_THAT(ssm, IsOk());
  std::memset(conv->data, 0x11, conv->bytes);
  std::memset(ssm->data, 0x22, ssm->bytes);
  absl::StatusOr<SessionSnapshot> snap = session->SpecSnapshot();
  ASSERT_THAT(snap, IsOk());
  EXPECT_TRUE(snap->spec_snapshot_valid);

  // A speculative round overwrites the state and stages 4 draft rows.
  std::memset(conv->data, 0x77, conv->bytes);
  std::memset(ssm->data, 0x88, ssm->bytes);
  AppendAndCommit(*session, 4, 4);
  absl::StatusOr<SessionSnapshot> rolled = session->SpecRollback(1);
  ASSERT_THAT(rolled, IsOk());
  EXPECT_EQ(rolled->committed_len, 11u);
  EXPECT_EQ(ReadMirror(*session, kFlatLayer, PlaneKind::kLenMirror), 11);
  EXPECT_EQ(ReadMirror(*session, kLatentLayer, PlaneKind::kLenMirror), 11);
  EXPECT_THAT(std::vector<uint8_t>(conv->data, conv->data + conv->bytes), ::testing::Each(0x11));
  EXPECT_THAT(std::vector<uint8_t>(ssm->data, ssm->data + ssm->bytes), ::testing::Each(0x22));
}

TEST_F(ServiceTest, SpecCallsRefusedWithoutBuffers) {
  std::unique_ptr<Session> session = NewSession(*client_, kCapacity, /*spec_snapshot=*/false);
  ASSERT_NE(session, nullptr);
  AppendAndCommit(*session, 3, 3);
  const std::string before = Snapshot(*session);
  EXPECT_THAT(session->SpecSnapshot(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("spec snapshot: the session was created without spec snapshot "
                                 "buffers (1 recurrent layers need them)")));
  EXPECT_THAT(session->SpecRollback(0),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("spec rollback: no spec snapshot was taken")));
  EXPECT_EQ(Snapshot(*session), before);
}

// ---- Grow ----

TEST_F(ServiceTest, GrowCopiesRowsAndAcknowledgeFreesTheOldArena) {
  std::unique_ptr<Session> session = NewSession(*client_, kCapacity);
  ASSERT_NE(session, nullptr);
  absl::StatusOr<PlaneView> keys = session->Plane(kFlatLayer, PlaneKind::kKeys);
  ASSERT_THAT(keys, IsOk());
  for (uint64_t row = 0; row < 30; ++row) {
    std::memset(keys->data + row * keys->row_bytes, static_cast<int>(row + 1), keys->row_bytes);
  }
  AppendAndCommit(*session, 30, 30);
  const uint64_t old_bytes = host_->AllocatedBytes();

  pb::GrowRequest grow;
  *grow.mutable_session() = ClientInternals::Ref(*session);
  grow.set_target_capacity(2 * kCapacity);
  pb::GrowResponse grown;
  ASSERT_THAT(FromGrpcStatus(ClientInternals::Cache(*client_).Grow(
                  ClientInternals::NewContext(*client_).get(), grow, &grown)),
              IsOk());
  EXPECT_EQ(grown.layout().layout_version(), 2u);
  EXPECT_EQ(grown.state().committed_len(), 30u);
  EXPECT_TRUE(grown.state().grow_pending());
  EXPECT_EQ(host_->ArenaCount(), 2u);  // the old arena lives until acknowledged

  // A second grow and a reset wait for the acknowledgement; a wrong version is refused.
  EXPECT_THAT(FromGrpcStatus(ClientInternals::Cache(*client_).Grow(
                  ClientInternals::NewContext(*client_).get(), grow, &grown)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not acknowledged")));
  EXPECT_THAT(session->Reset(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("session 1: grow to layout version 2 is not acknowledged yet; "
                                 "acknowledge it before Reset")));
  pb::AcknowledgeGrowRequest ack;
  *ack.mutable_session() = ClientInternals::Ref(*session);
  ack.set_layout_version(1);
  pb::SessionStateResponse acked;
  EXPECT_THAT(FromGrpcStatus(ClientInternals::Cache(*client_).AcknowledgeGrow(
                  ClientInternals::NewContext(*client_).get(), ack, &acked)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("version 2")));
  ack.set_layout_version(2);
  ASSERT_THAT(FromGrpcStatus(ClientInternals::Cache(*client_).AcknowledgeGrow(
                  ClientInternals::NewContext(*client_).get(), ack, &acked)),
              IsOk());
  EXPECT_FALSE(acked.state().grow_pending());
  EXPECT_EQ(host_->ArenaCount(), 1u);
  EXPECT_NE(host_->AllocatedBytes(), old_bytes);
  EXPECT_THAT(FromGrpcStatus(ClientInternals::Cache(*client_).AcknowledgeGrow(
                  ClientInternals::NewContext(*client_).get(), ack, &acked)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no grow")));
}

TEST_F(ServiceTest, ClientGrowRemapsAndKeepsCommittedBytes) {
  std::unique_ptr<Session> session = NewSession(*client_, kCapacity);
  ASSERT_NE(session, nullptr);
  absl::StatusOr<PlaneView> keys = session->Plane(kFlatLayer, PlaneKind::kKeys);
  ASSERT_THAT(keys, IsOk());
  for (uint64_t row = 0; row < 17; ++row) {
    std::memset(keys->data + row * keys->row_bytes, static_cast<int>(row + 1), keys->row_bytes);
  }
  AppendAndCommit(*session, 17, 17);
  EXPECT_THAT(
      session->Grow(kCapacity),
      StatusIs(
          absl::StatusCode::kInvalidArgument,
          HasSubstr("session 1: grow target capacity 256 is not above the current capacity 256")));
  absl::StatusOr<SessionSnapshot> grown = session->Grow(3 * kCapacity);
  ASSERT_THAT(grown, IsOk());
  EXPECT_EQ(grown->capacity, 3 * kCapacity);
  EXPECT_EQ(grown->layout_version, 2u);
  absl::StatusOr<PlaneView> moved = session->Plane(kFlatLayer, PlaneKind::kKeys);
  ASSERT_THAT(moved, IsOk());
  EXPECT_EQ(moved->rows, 3 * kCapacity);
  for (uint64_t row = 0; row < 17; ++row) {
    EXPECT_EQ(moved->data[row * moved->row_bytes], static_cast<uint8_t>(row + 1)) << row;
  }
  EXPECT_EQ(ReadMirror(*session, kFlatLayer, PlaneKind::kLenMirror), 17);
  EXPECT_EQ(host_->ArenaCount(), 1u);
  // A chunk longer than the indexer's 16-row tail ring starts at a pool boundary (docs/rules.md,
  // "Indexer residency": from inside a pool it would lap the tail an abort needs).
  absl::StatusOr<Transaction> chunk = session->Begin();
  ASSERT_THAT(chunk, IsOk());
  EXPECT_THAT(session->PrepareAppend(chunk->generation, 300),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("preparing 300 rows at row 17 would overwrite indexer rows "
                                  "[16, 17)",
                                  "leaves room for 15 rows")));
  EXPECT_THAT(session->Abort(chunk->generation).status(), IsOk());
  AppendAndCommit(*session, 3, 3);
  AppendAndCommit(*session, 300, 300);  // past the old capacity
}

// ---- Taint, reset, release ----

TEST_F(ServiceTest, TaintedSessionRefusesWorkUntilReleased) {
  std::unique_ptr<Session> session = NewSession(*client_, kCapacity);
  ASSERT_NE(session, nullptr);
  AppendAndCommit(*session, 2, 2);
  absl::StatusOr<SessionSnapshot> tainted = session->Taint("kernel fault in test");
  ASSERT_THAT(tainted, IsOk());
  EXPECT_TRUE(tainted->tainted);
  const std::string before = Snapshot(*session);
  EXPECT_THAT(session->Begin(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                         HasSubstr("begin transaction: session was tainted by a "
                                                   "failed operation and cannot be reused")));
  EXPECT_THAT(
      session->Reset(),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               HasSubstr("reset: session was tainted by a failed operation and cannot be reused")));
  EXPECT_THAT(
      session->SpecSnapshot(),
      StatusIs(
          absl::StatusCode::kFailedPrecondition,
          HasSubstr(
              "spec snapshot: session was tainted by a failed operation and cannot be reused")));
  EXPECT_THAT(
      session->Grow(2 * kCapacity),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               HasSubstr("grow: session was tainted by a failed operation and cannot be reused")));
  EXPECT_EQ(Snapshot(*session), before);
  EXPECT_EQ(host_->ArenaCount(), 1u);
  EXPECT_THAT(session->Release(), IsOk());
}

// On the host backend an engine event is refused before anything changes.
TEST_F(ServiceTest, HostBackendRefusesEngineEventsAndChangesNothing) {
  std::unique_ptr<Session> session = NewSession(*client_, kCapacity);
  ASSERT_NE(session, nullptr);
  absl::StatusOr<Transaction> txn = session->Begin();
  ASSERT_THAT(txn, IsOk());
  ASSERT_THAT(session->PrepareAppend(txn->generation, 3), IsOk());
  ASSERT_THAT(session->PublishAppend(txn->generation), IsOk());
  session->SetWaitEvent(std::string(64, '\x02'));
  EXPECT_THAT(session->Commit(txn->generation, 3),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("64-byte interprocess event handle")));
  StepBatch batch;
  batch.Commit(*session, txn->generation, 3);
  batch.SetWaitEvent(std::string(64, '\x02'));
  EXPECT_THAT(client_->Step(batch).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("RPC order")));
  session->SetWaitEvent("");
  EXPECT_THAT(session->Commit(txn->generation, 3), IsOkAndHolds(3u));
}

TEST_F(ServiceTest, ResetReusesTheMappedArena) {
  std::unique_ptr<Session> session = NewSession(*client_, kCapacity);
  ASSERT_NE(session, nullptr);
  const size_t opens = client_->mapper().OpenCount();
  const std::string handle = session->layout().arenas[0].handle;
  AppendAndCommit(*session, 9, 9);
  absl::StatusOr<SessionSnapshot> reset = session->Reset();
  ASSERT_THAT(reset, IsOk());
  EXPECT_EQ(reset->committed_len, 0u);
  EXPECT_EQ(ReadMirror(*session, kFlatLayer, PlaneKind::kLenMirror), 0);
  AppendAndCommit(*session, 3, 3);
  EXPECT_EQ(client_->mapper().OpenCount(), opens);
  EXPECT_EQ(session->layout().arenas[0].handle, handle);
}

TEST_F(UnpooledServiceTest, ReleaseFreesTheArenaAndForgetsTheSession) {
  std::unique_ptr<Session> session = NewSession(*client_, kCapacity);
  ASSERT_NE(session, nullptr);
  const uint64_t bytes = host_->AllocatedBytes();
  const pb::SessionRef ref = ClientInternals::Ref(*session);
  EXPECT_THAT(session->Release(), IsOkAndHolds(bytes));
  EXPECT_EQ(host_->ArenaCount(), 0u);
  pb::GetStatusResponse status = daemon_->GetStatus();
  EXPECT_EQ(status.sessions(), 0u);
  EXPECT_EQ(status.allocated_bytes(), 0u);
  pb::SessionRequest again;
  *again.mutable_session() = ref;
  pb::ReleaseSessionResponse response;
  EXPECT_THAT(FromGrpcStatus(ClientInternals::Cache(*client_).ReleaseSession(
                  ClientInternals::NewContext(*client_).get(), again, &response)),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("session 1 does not exist")));
}


// ---- Leases and drain ----

TEST_F(ServiceTest, SilentEngineIsReclaimedAfterTimeoutAndGrace) {
  // A hand-driven lease: no keeper thread racing the fake clock.
  absl::StatusOr<std::unique_ptr<KvClient>> raw = KvClient::Connect(daemon_->socket_path());
  ASSERT_THAT(raw, IsOk());
  std::unique_ptr<HandoffChannel> handoff = NewHandoff();
  ASSERT_NE(handoff, nullptr);
  grpc::ClientContext context;
  auto stream = ClientInternals::Cache(**raw).Attach(&context);
  pb::AttachRequest hello;
  hello.mutable_hello()->set_engine_name("silent");
  hello.mutable_hello()->set_handoff_ticket(handoff->ticket());
  ASSERT_TRUE(stream->Write(hello));
  pb::AttachResponse attached;
  ASSERT_TRUE(stream->Read(&attached));
  pb::CreateSessionRequest create;
  *create.mutable_engine() = attached.attached().engine();
  create.set_plan_fingerprint(FingerprintToBytes(plan_));
  create.set_capacity(kCapacity);
  pb::CreateSessionResponse created;
  ASSERT_THAT(FromGrpcStatus(ClientInternals::Cache(**raw).CreateSession(
                  ClientInternals::NewContext(**raw).get(), create, &created)),
              IsOk());
  ASSERT_EQ(host_->ArenaCount(), 1u);

  // engine-a's keeper heartbeats on real time, so its lease lapses here too; it holds nothing.
  clock_.Advance(absl::Milliseconds(kLeaseTimeoutMs + 1));
  daemon_->CheckLeases();
  EXPECT_EQ(host_->ArenaCount(), 1u);  // expired, but within the grace period
  clock_.Advance(absl::Milliseconds(kLeaseGraceMs));
  daemon_->CheckLeases();
  EXPECT_EQ(host_->ArenaCount(), 0u);
  pb::AttachResponse ignored;
  EXPECT_FALSE(stream->Read(&ignored));  // the daemon cancelled the silent stream
  EXPECT_THAT(FromGrpcStatus(stream->Finish()),
              StatusIs(absl::StatusCode::kCancelled, HasSubstr("Cancelled on the server side")));
  // The session is gone for its old token holder too.
  pb::SessionRequest begin;
  *begin.mutable_session() = created.session();
  pb::BeginResponse begun;
  EXPECT_THAT(FromGrpcStatus(ClientInternals::Cache(**raw).Begin(
                  ClientInternals::NewContext(**raw).get(), begin, &begun)),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("session 1 does not exist")));
}

TEST_F(ServiceTest, ClosedStreamFreesSessionsAfterGrace) {
  std::unique_ptr<KvClient> engine_b = NewClient("engine-b");
  ASSERT_NE(engine_b, nullptr);
  std::unique_ptr<Session> session = NewSession(*engine_b, kCapacity);
  ASSERT_NE(session, nullptr);
  const uint64_t engine_b_id = engine_b->engine_id();
  engine_b->Detach();  // the stream ends as if the process died
  // The daemon notices the end of the stream on its own thread; the grace counts from there.
  auto lease_ended = [&] {
    const pb::GetStatusResponse status = daemon_->GetStatus();
    for (const pb::EngineStatus& engine : status.engine_status()) {
      if (engine.engine_id() == engine_b_id) return !engine.lease_live();
    }
    return false;
  };
  for (absl::Time deadline = absl::Now() + absl::Seconds(30);
       !lease_ended() && absl::Now() < deadline;) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_TRUE(lease_ended());
  daemon_->CheckLeases();
  EXPECT_EQ(host_->ArenaCount(), 1u);
  clock_.Advance(absl::Milliseconds(kLeaseGraceMs));
  daemon_->CheckLeases();
  EXPECT_EQ(host_->ArenaCount(), 0u);
  EXPECT_EQ(daemon_->GetStatus().engines(), 1u);  // engine-a only
  EXPECT_THAT(session->Begin(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("session 1 does not exist")));
}

// Lease reclaim releases each session of the engine once and says so once (it once released
// them twice and logged "reclaimed" twice).
TEST_F(ServiceTest, ReclaimReleasesEachSessionOnceAndLogsItOnce) {
  // A copy of the default logger that also keeps its lines (swapping loggers is thread-safe; the
  // daemon's threads may be logging; `previous` stays alive for any still using it).
  auto log = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(1024);
  log->set_pattern("%v");
  const std::shared_ptr<spdlog::logger> previous = spdlog::default_logger();
  auto capturing = previous->clone("reclaim-test");
  capturing->sinks().push_back(log);
  spdlog::set_default_logger(capturing);
  std::unique_ptr<KvClient> engine_b = NewClient("engine-b");
  ASSERT_NE(engine_b, nullptr);
  std::unique_ptr<Session> first = NewSession(*engine_b, kCapacity);
  std::unique_ptr<Session> second = NewSession(*engine_b, kCapacity);
  ASSERT_NE(second, nullptr);
  const uint64_t engine_b_id = engine_b->engine_id();
  uint64_t engine_b_bytes = 0;
  const pb::GetStatusResponse before = daemon_->GetStatus();
  for (const pb::EngineStatus& engine : before.engine_status()) {
    if (engine.engine_id() == engine_b_id) engine_b_bytes = engine.allocated_bytes();
  }
  ASSERT_GT(engine_b_bytes, 0u);
  const uint64_t frees_before = faults_->CallCount(BackendOp::kFreeArena);
  engine_b->Detach();
  auto engine_b_present = [&] {
    const pb::GetStatusResponse status = daemon_->GetStatus();
    for (const pb::EngineStatus& engine : status.engine_status()) {
      if (engine.engine_id() == engine_b_id) return true;
    }
    return false;
  };
  // Past the grace of a stream that ended (or a lease that lapsed: the fake clock) meanwhile.
  for (absl::Time deadline = absl::Now() + absl::Seconds(30);
       engine_b_present() && absl::Now() < deadline;) {
    clock_.Advance(absl::Milliseconds(kLeaseGraceMs));
    daemon_->CheckLeases();
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_FALSE(engine_b_present());
  spdlog::set_default_logger(previous);
  int reclaimed_lines = 0;
  for (const std::string& line : log->last_formatted()) {
    if (line.find(absl::StrCat("engine ", engine_b_id, " (")) != std::string::npos &&
        line.find("reclaimed:") != std::string::npos) {
      ++reclaimed_lines;
      EXPECT_THAT(line, HasSubstr(absl::StrCat("reclaimed: 2 sessions, ", engine_b_bytes,
                                               " bytes freed, 0 reserved bytes returned")));
    }
  }
  EXPECT_EQ(reclaimed_lines, 1);
  EXPECT_EQ(faults_->CallCount(BackendOp::kFreeArena) - frees_before, 2u);
  EXPECT_EQ(daemon_->GetStatus().sessions(), 0u);
}

TEST_F(ServiceTest, DrainRefusesNewEnginesAndSessions) {
  std::unique_ptr<Session> live = NewSession(*client_, kCapacity);
  ASSERT_NE(live, nullptr);
  EXPECT_EQ(daemon_->Drain(absl::ZeroDuration()), 1u);
  EXPECT_THAT(client_->CreateSession(plan_, Options(kCapacity)),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("draining")));
  absl::StatusOr<std::unique_ptr<KvClient>> late = KvClient::Connect(daemon_->socket_path());
  ASSERT_THAT(late, IsOk());
  EXPECT_THAT((*late)->Attach("late"),
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstr("the daemon is draining; attach to another")));
  AppendAndCommit(*live, 2, 2);  // live sessions keep working while draining
  EXPECT_TRUE(daemon_->GetStatus().draining());
}

TEST_F(ServiceTest, HealthServiceTurnsNotServingOnDrain) {
  auto channel = grpc::CreateChannel(absl::StrCat("unix:", daemon_->socket_path()),
                                     grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  auto check = [&] {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::health::v1::HealthCheckResponse response;
    EXPECT_THAT(
        FromGrpcStatus(health->Check(&context, grpc::health::v1::HealthCheckRequest(), &response)),
        IsOk());
    return response.status();
  };
  EXPECT_EQ(check(), grpc::health::v1::HealthCheckResponse::SERVING);
  daemon_->Drain(absl::ZeroDuration());
  EXPECT_EQ(check(), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
}

// ---- Backend failures ----

TEST_F(ServiceTest, FailedMirrorWriteTaintsInsteadOfHalfApplying) {
  std::unique_ptr<Session> session = NewSession(*client_, kCapacity);
  ASSERT_NE(session, nullptr);
  absl::StatusOr<Transaction> tx = session->Begin();
  ASSERT_THAT(tx, IsOk());
  ASSERT_THAT(session->PrepareAppend(tx->generation, 4), IsOk());
  ASSERT_THAT(faults_->FailNthCall(BackendOp::kWriteI32s, 1, absl::InternalError("injected")),
              IsOk());
  EXPECT_THAT(session->PublishAppend(tx->generation),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("injected")));
  EXPECT_TRUE(StateOf(*session).tainted);
  EXPECT_THAT(session->Begin(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                         HasSubstr("begin transaction: session was tainted by a "
                                                   "failed operation and cannot be reused")));
}

TEST_F(ServiceTest, FailedExportLeaksNothing) {
  ASSERT_THAT(faults_->FailNthCall(BackendOp::kExport, 1, absl::InternalError("injected")), IsOk());
  EXPECT_THAT(client_->CreateSession(plan_, Options(kCapacity)),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("injected")));
  EXPECT_EQ(host_->ArenaCount(), 0u);
  EXPECT_EQ(daemon_->GetStatus().sessions(), 0u);
}

TEST_F(ServiceTest, FailedGrowCopyLeavesTheSessionAsItWas) {
  std::unique_ptr<Session> session = NewSession(*client_, kCapacity);
  ASSERT_NE(session, nullptr);
  AppendAndCommit(*session, 12, 12);
  const std::string before = Snapshot(*session);
  ASSERT_THAT(faults_->FailNthCall(BackendOp::kCopy, 1, absl::InternalError("injected")), IsOk());
  EXPECT_THAT(session->Grow(2 * kCapacity),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("injected")));
  EXPECT_EQ(Snapshot(*session), before);
  EXPECT_EQ(host_->ArenaCount(), 1u);
  AppendAndCommit(*session, 1, 1);
}

// ---- Bad input: every RPC, out-of-range / missing / overflowing / wrong-state arguments ----

class BadInputTest : public DaemonTest {
 protected:
  using Call = std::function<grpc::Status(pb::KvCache::Stub&, grpc::ClientContext*)>;
  struct Case {
    std::string name;
    absl::StatusCode code;
    std::string message;  // a substring the refusal must carry, with its numbers
    Call call;
  };

  void SetUp() override {
    DaemonTest::SetUp();
    idle_ = NewSession(*client_, kCapacity);
    open_ = NewSession(*client_, kCapacity);
    ASSERT_NE(idle_, nullptr);
    ASSERT_NE(open_, nullptr);
    AppendAndCommit(*idle_, 10, 10);
    AppendAndCommit(*open_, 10, 10);
    absl::StatusOr<Transaction> tx = open_->Begin();
    ASSERT_THAT(tx, IsOk());
    open_generation_ = tx->generation;
  }

  void TearDown() override {
    idle_.reset();  // sessions go before the client they call through
    open_.reset();
    DaemonTest::TearDown();
  }

  // Everything a refusal must leave alone: both sessions' states and the backend's accounting.
  std::string World() {
    return absl::StrCat(Snapshot(*idle_), "|", Snapshot(*open_), "|", host_->ArenaCount(), "|",
                        host_->AllocatedBytes(), "|", daemon_->GetStatus().sessions(), "|",
                        daemon_->GetStatus().plans());
  }

  void Expect(const std::vector<Case>& cases) {
    for (const Case& c : cases) {
      const std::string before = World();
      std::unique_ptr<grpc::ClientContext> context = ClientInternals::NewContext(*client_);
      EXPECT_THAT(FromGrpcStatus(c.call(ClientInternals::Cache(*client_), context.get())),
                  StatusIs(c.code, HasSubstr(c.message)))
          << c.name;
      EXPECT_EQ(World(), before) << c.name << " changed something";
    }
  }

  template <typename Request>
  static Request On(const Session& session) {
    Request request;
    *request.mutable_session() = ClientInternals::Ref(session);
    return request;
  }

  std::unique_ptr<Session> idle_;
  std::unique_ptr<Session> open_;  // a transaction is active, nothing prepared
  uint64_t open_generation_ = 0;
};

constexpr uint64_t kMax = ~uint64_t{0};

TEST_F(BadInputTest, SessionCallsRefuseAndChangeNothing) {
  using S = pb::KvCache::Stub;
  using C = grpc::ClientContext;
  pb::SessionStateResponse state;
  pb::BeginResponse begun;
  pb::PrepareAppendResponse prepared;
  pb::PublishAppendResponse published;
  pb::CommitResponse committed;
  pb::AbortResponse aborted;
  pb::GrowResponse grown;
  pb::CanRewindResponse can;
  const Session& idle = *idle_;
  const Session& open = *open_;
  const uint64_t g = open_generation_;

  auto rewind = [&](const Session& s, uint64_t target) {
    auto r = On<pb::RewindRequest>(s);
    r.set_target(target);
    return r;
  };
  auto prepare = [&](const Session& s, uint64_t generation, uint64_t rows) {
    auto r = On<pb::PrepareAppendRequest>(s);
    r.set_generation(generation);
    r.set_rows(rows);
    return r;
  };
  auto generation = [&](const Session& s, uint64_t value) {
    auto r = On<pb::GenerationRequest>(s);
    r.set_generation(value);
    return r;
  };
  auto commit = [&](const Session& s, uint64_t value, uint64_t accepted) {
    auto r = On<pb::CommitRequest>(s);
    r.set_generation(value);
    r.set_accepted_rows(accepted);
    return r;
  };
  auto grow = [&](const Session& s, uint64_t capacity) {
    auto r = On<pb::GrowRequest>(s);
    r.set_target_capacity(capacity);
    return r;
  };
  auto rollback = [&](const Session& s, uint64_t accept) {
    auto r = On<pb::SpecRollbackRequest>(s);
    r.set_accept_len(accept);
    return r;
  };
  pb::SessionRequest missing;  // no session at all
  pb::SessionRequest no_token;
  no_token.mutable_session()->set_session_id(idle.id());
  pb::AcknowledgeGrowRequest ack = On<pb::AcknowledgeGrowRequest>(idle);
  ack.set_layout_version(2);
  pb::TaintRequest taint;
  *taint.mutable_session() = no_token.session();
  pb::GetSessionStateRequest unknown;
  unknown.mutable_session()->set_session_id(kMax);

  Expect({
      {"Begin, missing session", absl::StatusCode::kNotFound, "session 0 does not exist",
       [&](S& s, C* c) { return s.Begin(c, missing, &begun); }},
      {"Begin, no token", absl::StatusCode::kPermissionDenied, "wrong session token for session 1",
       [&](S& s, C* c) { return s.Begin(c, no_token, &begun); }},
      {"Begin, transaction already active", absl::StatusCode::kFailedPrecondition,
       "KV transaction generation 2 is already active at base 10",
       [&](S& s, C* c) { return s.Begin(c, On<pb::SessionRequest>(open), &begun); }},
      {"PrepareAppend, no transaction", absl::StatusCode::kFailedPrecondition,
       "stale KV transaction generation 1 (active: none)",
       [&](S& s, C* c) { return s.PrepareAppend(c, prepare(idle, 1, 1), &prepared); }},
      {"PrepareAppend, stale generation", absl::StatusCode::kFailedPrecondition,
       "stale KV transaction generation 1 (active: 2)",
       [&](S& s, C* c) { return s.PrepareAppend(c, prepare(open, g - 1, 1), &prepared); }},
      {"PrepareAppend, generation overflow", absl::StatusCode::kFailedPrecondition,
       "stale KV transaction generation 18446744073709551615 (active: 2)",
       [&](S& s, C* c) { return s.PrepareAppend(c, prepare(open, kMax, 1), &prepared); }},
      {"PrepareAppend, past capacity", absl::StatusCode::kInvalidArgument,
       "KV append exceeds capacity: 257 > 256",
       [&](S& s, C* c) { return s.PrepareAppend(c, prepare(open, g, kCapacity - 9), &prepared); }},
      {"PrepareAppend, rows overflow", absl::StatusCode::kInvalidArgument,
       "KV staged length overflows: 10 + 18446744073709551615",
       [&](S& s, C* c) { return s.PrepareAppend(c, prepare(open, g, kMax), &prepared); }},
      {"PublishAppend, nothing prepared", absl::StatusCode::kFailedPrecondition,
       "no prepared append for transaction generation 2",
       [&](S& s, C* c) { return s.PublishAppend(c, generation(open, g), &published); }},
      {"PublishAppend, no transaction", absl::StatusCode::kFailedPrecondition,
       "stale KV transaction generation 18446744073709551615 (active: none)",
       [&](S& s, C* c) { return s.PublishAppend(c, generation(idle, kMax), &published); }},
      {"Commit, no transaction", absl::StatusCode::kFailedPrecondition,
       "stale KV transaction generation 0 (active: none)",
       [&](S& s, C* c) { return s.Commit(c, commit(idle, 0, 0), &committed); }},
      {"Commit, more rows than staged", absl::StatusCode::kInvalidArgument,
       "KV commit accepts 1 rows from a 0-row transaction",
       [&](S& s, C* c) { return s.Commit(c, commit(open, g, 1), &committed); }},
      {"Commit, rows overflow", absl::StatusCode::kInvalidArgument,
       "KV commit accepts 18446744073709551615 rows from a 0-row transaction",
       [&](S& s, C* c) { return s.Commit(c, commit(open, g, kMax), &committed); }},
      {"Abort, stale generation", absl::StatusCode::kFailedPrecondition,
       "stale KV transaction generation 3 (active: 2)",
       [&](S& s, C* c) { return s.Abort(c, generation(open, g + 1), &aborted); }},
      {"Rewind, past staged", absl::StatusCode::kInvalidArgument,
       "KV rewind target 11 is past the staged length 10 (only hydration may set unwritten rows)",
       [&](S& s, C* c) { return s.Rewind(c, rewind(idle, 11), &state); }},
      {"Rewind, overflow", absl::StatusCode::kInvalidArgument,
       "KV rewind target 18446744073709551615 is past the staged length 10 (only hydration may set "
       "unwritten rows)",
       [&](S& s, C* c) { return s.Rewind(c, rewind(idle, kMax), &state); }},
      {"CanRewind, no token", absl::StatusCode::kPermissionDenied,
       "wrong session token for session 1",
       [&](S& s, C* c) {
         pb::RewindRequest r;
         *r.mutable_session() = no_token.session();
         return s.CanRewind(c, r, &can);
       }},
      {"SpecSnapshot, during a transaction", absl::StatusCode::kFailedPrecondition,
       "spec snapshot requires no active transaction (generation 2 is active at base 10)",
       [&](S& s, C* c) { return s.SpecSnapshot(c, On<pb::SessionRequest>(open), &state); }},
      {"SpecRollback, no snapshot", absl::StatusCode::kFailedPrecondition,
       "spec rollback: no spec snapshot was taken",
       [&](S& s, C* c) { return s.SpecRollback(c, rollback(idle, 0), &state); }},
      {"SpecRollback, overflow", absl::StatusCode::kFailedPrecondition,
       "spec rollback: no spec snapshot was taken",
       [&](S& s, C* c) { return s.SpecRollback(c, rollback(idle, kMax), &state); }},
      {"Grow, not larger", absl::StatusCode::kInvalidArgument,
       "session 1: grow target capacity 256 is not above the current capacity 256",
       [&](S& s, C* c) { return s.Grow(c, grow(idle, kCapacity), &grown); }},
      {"Grow, zero", absl::StatusCode::kInvalidArgument,
       "session 1: grow target capacity 0 is not above the current capacity 256",
       [&](S& s, C* c) { return s.Grow(c, grow(idle, 0), &grown); }},
      {"Grow, past the i32 mirrors", absl::StatusCode::kInvalidArgument,
       "capacity 1099511627776 tokens exceeds i32 device mirrors (max 2147483647)",
       [&](S& s, C* c) { return s.Grow(c, grow(idle, uint64_t{1} << 40), &grown); }},
      {"Grow, overflow", absl::StatusCode::kInvalidArgument,
       "capacity 18446744073709551615 tokens exceeds i32 device mirrors (max 2147483647)",
       [&](S& s, C* c) { return s.Grow(c, grow(idle, kMax), &grown); }},
      {"Grow, during a transaction", absl::StatusCode::kFailedPrecondition,
       "KV grow refuses active transaction generation 2 at base 10",
       [&](S& s, C* c) { return s.Grow(c, grow(open, 2 * kCapacity), &grown); }},
      {"AcknowledgeGrow, no grow", absl::StatusCode::kFailedPrecondition,
       "session 1: no grow awaits acknowledgement (layout version 1)",
       [&](S& s, C* c) { return s.AcknowledgeGrow(c, ack, &state); }},
      {"Taint, no token", absl::StatusCode::kPermissionDenied, "wrong session token for session 1",
       [&](S& s, C* c) { return s.Taint(c, taint, &state); }},
      {"GetSessionState, unknown id", absl::StatusCode::kNotFound,
       "session 18446744073709551615 does not exist",
       [&](S& s, C* c) { return s.GetSessionState(c, unknown, &state); }},
      {"ResetSession, missing session", absl::StatusCode::kNotFound, "session 0 does not exist",
       [&](S& s, C* c) { return s.ResetSession(c, missing, &state); }},
  });
}

TEST_F(BadInputTest, CreateRegisterAndStepRefuseAndChangeNothing) {
  using S = pb::KvCache::Stub;
  using C = grpc::ClientContext;
  // The engine token stays inside KvClient, so raw requests carry none: each case below is
  // refused before, or because of, the missing token.
  pb::CreateSessionRequest good;
  good.mutable_engine()->set_engine_id(client_->engine_id());
  good.set_plan_fingerprint(FingerprintToBytes(plan_));
  good.set_capacity(kCapacity);
  auto with = [&](auto edit) {
    pb::CreateSessionRequest request = good;
    edit(request);
    return request;
  };
  pb::CreateSessionResponse created;
  pb::RegisterPlanResponse registered;
  pb::StepResponse stepped;
  pb::RegisterPlanRequest empty_plan;
  *empty_plan.mutable_engine() = *ClientInternals::Engine(*client_);
  pb::RegisterPlanRequest bad_format = empty_plan;
  *bad_format.mutable_plan() = ModelPlanToProto(HybridTestPlan());
  bad_format.mutable_plan()->mutable_layers(0)->mutable_formats()->set_k(
      static_cast<pb::KFormat>(17));
  pb::StepRequest too_many;
  for (int i = 0; i < 65537; ++i)
    *too_many.add_entries()->mutable_session() = ClientInternals::Ref(*idle_);

  Expect({
      {"CreateSession, no engine token", absl::StatusCode::kPermissionDenied,
       "wrong engine token for engine 1",
       [&](S& s, C* c) { return s.CreateSession(c, good, &created); }},
      {"CreateSession, missing engine", absl::StatusCode::kNotFound, "engine 0 is not attached",
       [&](S& s, C* c) {
         return s.CreateSession(c, with([](auto& r) { r.clear_engine(); }), &created);
       }},
      {"CreateSession, missing fingerprint", absl::StatusCode::kInvalidArgument,
       "plan fingerprint is 0 bytes; expected 32",
       [&](S& s, C* c) {
         return s.CreateSession(c, with([](auto& r) { r.clear_plan_fingerprint(); }), &created);
       }},
      {"RegisterPlan, empty plan", absl::StatusCode::kInvalidArgument, "model plan has no layers",
       [&](S& s, C* c) { return s.RegisterPlan(c, empty_plan, &registered); }},
      {"RegisterPlan, unknown K format", absl::StatusCode::kInvalidArgument,
       "plan.layers[0].formats.k is 17: unspecified or unknown (accepted 1 to 7)",
       [&](S& s, C* c) { return s.RegisterPlan(c, bad_format, &registered); }},
      {"Step, too many entries", absl::StatusCode::kInvalidArgument,
       "Step carries 65537 entries; the limit is 65536",
       [&](S& s, C* c) { return s.Step(c, too_many, &stepped); }},
  });
  // Through the client (which holds the engine token): out-of-range session shapes.
  for (auto [name, message, options] :
       std::vector<std::tuple<std::string, std::string, SessionOptions>>{
           {"capacity 0", "capacity 0 tokens: a session needs at least 1", Options(0)},
           {"capacity past i32",
            "capacity 2147483648 tokens exceeds i32 device mirrors (max 2147483647)",
            Options(uint64_t{1} << 31)},
           {"capacity overflow",
            "capacity 18446744073709551615 tokens exceeds i32 device mirrors (max 2147483647)",
            Options(kMax)},
           {"layer_lo past the plan", "layer range [9, 4) is out of bounds for a plan of 4 layers",
            WithLayerLo(Options(kCapacity), 9)},
       }) {
    const std::string before = World();
    EXPECT_THAT(client_->CreateSession(plan_, options),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(message)))
        << name;
    EXPECT_EQ(World(), before) << name;
  }
  SessionOptions hi_below_lo = Options(kCapacity);
  hi_below_lo.layer_lo = 3;
  hi_below_lo.layer_hi = 1;
  SessionOptions tp = Options(kCapacity);
  tp.tp_ranks = 3;  // 64 K elements are not divisible by 3
  for (const auto& [options, message] : std::vector<std::pair<SessionOptions, std::string>>{
           {hi_below_lo, "layer range [3, 1) is out of bounds for a plan of 4 layers"},
           {tp, "layer 0: TP KV dimensions k=64 v=64 are not divisible by TP=3"},
       }) {
    const std::string before = World();
    EXPECT_THAT(client_->CreateSession(plan_, options),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(message)));
    EXPECT_EQ(World(), before);
  }
}

}  // namespace
}  // namespace memra::testing
