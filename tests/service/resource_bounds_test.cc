// What one client can make the daemon hold (docs/security-model.md#resources, issue 31): each
// resource driven past its bound by one client, which gets a clean refusal naming its numbers,
// while a second engine in the same test keeps being served.

#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/internal.h"
#include "common/grpc_status.h"
#include "common/handoff_wire.h"
#include "server/testing/fault_injecting_backend.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/byte_buffer.h"
#include "gtest/gtest.h"
#include "proto/memra/kv/v1/admin.grpc.pb.h"
#include "proto/memra/kv/v1/prefix.grpc.pb.h"
#include "server/edge/model_config_bounds.h"
#include "tests/daemon_process.h"
#include "tests/hostile_engines.h"
#include "tests/service/test_daemon.h"
#include "tests/status_matchers.h"

namespace memra::testing {
namespace {

namespace pb = ::memra::kv::v1;

constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
constexpr auto kExhausted = absl::StatusCode::kResourceExhausted;

grpc::ClientContext* WithDeadline(grpc::ClientContext* context) {
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  return context;
}

constexpr char kLlamaConfig[] = R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
    "hidden_size": 512, "head_dim": 64})";

// ---- 2. Client-supplied config.json: size, depth, parses at once ----

using ModelConfigBoundsTest = DaemonTest;

// Today's 4 MB of "[" took seconds and hundreds of MiB: an over-size or over-deep config is
// refused before it is parsed, on every call that takes one, and another engine's queries and
// an unattached client's are served meanwhile and afterwards (parse slots are not leaked).
TEST_F(ModelConfigBoundsTest, OversizeAndOverdeepConfigsAreRefusedBeforeParsing) {
  std::unique_ptr<KvClient> honest = NewClient("honest");
  ASSERT_NE(honest, nullptr);
  absl::StatusOr<std::unique_ptr<KvClient>> unattached = KvClient::Connect(daemon_->socket_path());
  ASSERT_THAT(unattached.status(), IsOk());

  const std::string oversize = OversizeModelConfig();
  const std::string overdeep = OverdeepModelConfig();  // 100 KB: under the size bound
  const auto too_big = StatusIs(kExhausted, HasSubstrs("config.json is 1048577 bytes",
                                                       "limit is 1048576", "kMaxModelConfigBytes"));
  const auto too_deep = StatusIs(kInvalid, HasSubstrs("config.json nests 33 deep at byte 32",
                                                      "limit is 32", "kMaxModelConfigDepth"));
  for (KvClient* hostile : {client_.get(), unattached->get()}) {
    EXPECT_THAT(GetCostOf(*hostile, oversize), too_big);
    EXPECT_THAT(GetCostOf(*hostile, overdeep), too_deep);
    EXPECT_THAT(ImportModelOf(*hostile, oversize), too_big);
    EXPECT_THAT(ImportModelOf(*hostile, overdeep), too_deep);
    pb::MaxContextRequest max_context;
    max_context.mutable_model()->set_hf_config_json(overdeep);
    pb::MaxContextResponse max_context_reply;
    EXPECT_THAT(FromGrpcStatus(ClientInternals::Admin(*hostile).GetMaxContext(
                    ClientInternals::NewContext(*hostile).get(), max_context, &max_context_reply)),
                too_deep);
    pb::FitRequest fit;
    fit.mutable_model()->set_hf_config_json(oversize);
    fit.mutable_shape()->set_capacity(128);
    pb::FitResponse fitted;
    EXPECT_THAT(FromGrpcStatus(ClientInternals::Admin(*hostile).GetFit(
                    ClientInternals::NewContext(*hostile).get(), fit, &fitted)),
                too_big);
  }
  // More calls than there are parse slots, one after another: each slot came back.
  for (size_t i = 0; i < kMaxConcurrentModelConfigParses + 2; ++i) {
    EXPECT_THAT(GetCostOf(*honest, kLlamaConfig), IsOk()) << i;
    EXPECT_THAT(ImportModelOf(**unattached, kLlamaConfig), IsOk()) << i;
  }
  EXPECT_THAT(honest->CreateSession(plan_, Options(64)).status(), IsOk());
}

// ---- 5. Long streams: a thread each, so capped per engine and per socket, and ended with the
// lease that opened them; server reflection only on the admin socket. ----

class LongStreamsTest : public DaemonTest {
 protected:
  static constexpr uint64_t kPerEngine = 4;
  static constexpr uint64_t kPerSocket = 6;
  void ConfigureDaemon(DaemonConfig& config) override {
    config.prefix.budget_bytes = uint64_t{8} << 20;
    config.sockets.max_engine_event_streams = kPerEngine;
    config.sockets.max_event_streams = kPerSocket;
  }

  static void Cancel(std::vector<std::unique_ptr<EventStream>>& streams) {
    for (auto& stream : streams) {
      stream->context.TryCancel();
      (void)stream->reader->Finish();
    }
  }
};

// 300 subscriptions from one engine held 300 daemon threads: now it holds its 4, the 296 others
// are refused at once, and another engine subscribes and works.
TEST_F(LongStreamsTest, OneEngineHoldsAtMostItsShareOfEventStreams) {
  std::unique_ptr<KvClient> honest = NewClient("honest");
  ASSERT_NE(honest, nullptr);
  const size_t before = ProcessThreads();
  std::vector<std::unique_ptr<EventStream>> open;
  for (uint64_t i = 0; i < kPerEngine; ++i) open.push_back(SubscribeEvents(*client_));
  const std::string refusal =
      absl::StrCat("SubscribeEvents streams of engine ", client_->engine_id(),
                   ": 4 are open and the limit is 4 per engine (max_engine_event_streams)");
  for (int i = 0; i < 296; ++i) {
    std::unique_ptr<EventStream> refused = SubscribeEvents(*client_);
    ASSERT_THAT(EndOf(*refused), StatusIs(kExhausted, HasSubstrs(refusal))) << i;
  }
  std::unique_ptr<EventStream> honest_stream = SubscribeEvents(*honest);
  const size_t during = ProcessThreads();
  EXPECT_LT(during, before + kPerEngine + 16)
      << before << " threads before, " << during << " with 300 subscriptions asked for";
  EXPECT_THAT(honest->CreateSession(plan_, Options(64)).status(), IsOk());
  // The per-socket cap: 5 are open, one more fits, then every engine is refused.
  std::unique_ptr<EventStream> sixth = SubscribeEvents(*honest);
  EXPECT_THAT(EndOf(*SubscribeEvents(*honest)),
              StatusIs(kExhausted, HasSubstrs("SubscribeEvents streams: 6 are running",
                                              "limit is 6 (max_event_streams, per socket)")));
  // Streams that end give their place back.
  Cancel(open);
  open.clear();
  std::unique_ptr<EventStream> again = SubscribeEvents(*client_);
  honest_stream->context.TryCancel();
  sixth->context.TryCancel();
  again->context.TryCancel();
  for (EventStream* stream : {honest_stream.get(), sixth.get(), again.get()}) {
    EXPECT_THAT(EndOf(*stream), StatusIs(absl::StatusCode::kCancelled, ::testing::_));
  }
}

// Event streams were checked only when opened: they outlived the lease. Now they end with it
// (the engine detached, in its grace: its lease has ended), and the honest engine's stays open.
TEST_F(LongStreamsTest, EventStreamsEndWithTheLeaseThatOpenedThem) {
  std::unique_ptr<KvClient> honest = NewClient("honest");
  ASSERT_NE(honest, nullptr);
  std::unique_ptr<EventStream> hostile_stream = SubscribeEvents(*client_);
  std::unique_ptr<EventStream> honest_stream = SubscribeEvents(*honest);
  const uint64_t hostile_id = client_->engine_id();
  client_->Detach();
  EXPECT_THAT(EndOf(*hostile_stream),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs(absl::StrCat("engine ", hostile_id, ": its lease has ended"))));
  EXPECT_THAT(honest->CreateSession(plan_, Options(64)).status(), IsOk());
  // The honest stream was still open: it ends by its own cancel, not the daemon's word.
  honest_stream->context.TryCancel();
  EXPECT_THAT(EndOf(*honest_stream), StatusIs(absl::StatusCode::kCancelled, ::testing::_));
}

constexpr char kReflectionInfo[] =
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo";

// One ServerReflectionInfo call (a list_services request, then half-close) on `socket_path`.
absl::Status ReflectOnce(const std::string& socket_path) {
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateChannel(absl::StrCat("unix:", socket_path), grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue queue;
  grpc::ClientContext context;
  // ServerReflectionRequest{list_services = ""}: field 7, length 0.
  const std::string list_services("\x3a\x00", 2);
  grpc::Slice slice(list_services);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  grpc::Status status;
  std::unique_ptr<grpc::GenericClientAsyncResponseReader> call =
      stub.PrepareUnaryCall(WithDeadline(&context), kReflectionInfo, request, &queue);
  call->StartCall();
  call->Finish(&response, &status, &queue);
  void* tag = nullptr;
  bool ok = false;
  queue.Next(&tag, &ok);
  queue.Shutdown();
  while (queue.Next(&tag, &ok)) {
  }
  return FromGrpcStatus(status);
}

// 300 reflection streams from an unattached client held 300 threads: the engine socket no
// longer serves reflection (the admin socket does, for operators' tools).
TEST_F(LongStreamsTest, ReflectionIsServedOnTheAdminSocketOnly) {
  const size_t before = ProcessThreads();
  for (int i = 0; i < 300; ++i) {
    ASSERT_THAT(ReflectOnce(daemon_->socket_path()),
                StatusIs(absl::StatusCode::kUnimplemented, ::testing::_))
        << i;
  }
  EXPECT_LT(ProcessThreads(), before + 16);
  EXPECT_THAT(ReflectOnce(daemon_->admin_socket_path()), IsOk());
  EXPECT_THAT(client_->CreateSession(plan_, Options(64)).status(), IsOk());
}

// ---- 3. gRPC connections: per socket, per uid, and idle ones closed ----

class ConnectionLimitsTest : public DaemonTest {
 protected:
  static constexpr uid_t kNobody = 65534;
  static constexpr uint64_t kPerUid = 4;
  static constexpr uint64_t kPerSocket = 6;
  void ConfigureDaemon(DaemonConfig& config) override {
    config.sockets.socket_mode = 0666;  // the other uid connects too
    ASSERT_EQ(chmod(dir_.c_str(), 0711), 0);
    config.connections.max_connections = kPerSocket;
    config.connections.max_connections_per_uid = kPerUid;
    config.sockets.connection_idle_timeout_ms = 1000;
  }

  // Waits (on the daemon's count) until the engine socket holds `open` connections; the count
  // it saw last.
  size_t AwaitConnections(size_t open) {
    size_t now = 0;
    for (int i = 0; i < 3000; ++i) {
      now = daemon_->engine_socket_connections().connections;
      if (now == open) break;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return now;
  }
};

// 1,100 idle connections filled a daemon's descriptors. Now another uid gets its 4, its 5th is
// closed at the door; the socket's 6 are a cap for everyone; idle connections are closed by the
// daemon; the attached engines keep being served throughout.
TEST_F(ConnectionLimitsTest, ConnectionsAreCappedPerUidAndPerSocketAndIdleOnesClosed) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root (a child connects as uid 65534)";
  std::unique_ptr<KvClient> honest = NewClient("honest");
  ASSERT_NE(honest, nullptr);
  // client_'s and honest's (gRPC may share one connection between channels of one process).
  const size_t engines = daemon_->engine_socket_connections().connections;
  ASSERT_GE(engines, 1u);
  ASSERT_LE(engines, 2u);
  int results[2];
  int hold[2];
  ASSERT_EQ(pipe2(results, O_CLOEXEC), 0);
  ASSERT_EQ(pipe2(hold, O_CLOEXEC), 0);
  const std::string path = daemon_->socket_path();
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(results[0]);
    close(hold[1]);
    if (setgroups(0, nullptr) != 0 || setgid(kNobody) != 0 || setuid(kNobody) != 0) {
      (void)!write(results[1], "X", 1);
      _exit(1);
    }
    for (uint64_t i = 0; i < kPerUid + 1; ++i) {
      int fd;
      const char outcome = TryConnection(path.c_str(), &fd);
      (void)!write(results[1], &outcome, 1);
    }
    char done;
    (void)!read(hold[0], &done, 1);  // holds its connections until the test is done
    _exit(0);
  }
  close(results[1]);
  close(hold[0]);
  std::string outcomes(kPerUid + 1, '?');
  size_t got = 0;
  while (got < outcomes.size()) {
    const ssize_t n = read(results[0], outcomes.data() + got, outcomes.size() - got);
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  close(results[0]);
  if (outcomes[0] == 'X') {
    close(hold[1]);
    waitpid(child, nullptr, 0);
    GTEST_SKIP() << "could not setuid to 65534 here";
  }
  EXPECT_EQ(outcomes, "SSSSC") << "uid 65534's 4 connections served, its 5th closed at the door";
  EXPECT_EQ(AwaitConnections(engines + kPerUid), engines + kPerUid);
  EXPECT_EQ(daemon_->engine_socket_connections().refused, 1u);
  // Root's connections fill the socket's 6; then a connection of any uid is closed too.
  std::vector<int> fill;
  for (size_t open = engines + kPerUid; open < kPerSocket; ++open) {
    fill.push_back(-1);
    EXPECT_EQ(TryConnection(path.c_str(), &fill.back()), 'S');
  }
  int extra;
  EXPECT_EQ(TryConnection(path.c_str(), &extra), 'C');
  close(extra);
  EXPECT_EQ(daemon_->engine_socket_connections().refused, 2u);
  // The attached engines are served meanwhile.
  EXPECT_THAT(honest->CreateSession(plan_, Options(64)).status(), IsOk());
  EXPECT_THAT(client_->CreateSession(plan_, Options(64)).status(), IsOk());
  // uid 65534's connections make no call: the daemon closes them after the idle timeout, and
  // the door opens again. The engines' (each with its Attach stream) stay.
  EXPECT_EQ(AwaitConnections(engines), engines);
  for (int fd : fill) close(fd);
  int again;
  EXPECT_EQ(TryConnection(path.c_str(), &again), 'S');
  close(again);
  close(hold[1]);
  int status = 0;
  EXPECT_EQ(waitpid(child, &status, 0), child);
  EXPECT_THAT(honest->CreateSession(plan_, Options(64)).status(), IsOk());
}

// ---- 4. The descriptor budget: limits derived from the daemon's own RLIMIT_NOFILE ----

class DescriptorBudgetTest : public DaemonTest {
 protected:
  static constexpr rlim_t kOpenFiles = 512;  // (512 - 128) / 2 = 192 arenas
  void ConfigureDaemon(DaemonConfig& config) override {
    // One engine floods to the daemon-wide limit here; the per-engine share is tested below.
    config.admission.max_engine_arenas = kOpenFiles;
    open_files_.Lower(kOpenFiles);
  }
  void TearDown() override {
    DaemonTest::TearDown();
    open_files_.Restore();
  }
  LoweredOpenFileLimit open_files_;
};

// With 2,048 descriptors an engine's ~2,000 sessions ended in INTERNAL EMFILE for every engine.
// Now the daemon derives max_arenas from its RLIMIT_NOFILE: the flood ends in the arena limit's
// clean refusal, and the other engine's session keeps working and it is refused the same way,
// then served once an arena is free.
TEST_F(DescriptorBudgetTest, ArenasAreBoundedByTheDescriptorsTheDaemonHas) {
  std::unique_ptr<KvClient> honest = NewClient("honest");
  ASSERT_NE(honest, nullptr);
  std::unique_ptr<Session> kept = NewSession(*honest, 64, /*spec_snapshot=*/false);
  ASSERT_NE(kept, nullptr);
  std::vector<std::unique_ptr<Session>> flood;
  absl::Status refused;
  for (int i = 0; i < 400 && refused.ok(); ++i) {
    absl::StatusOr<std::unique_ptr<Session>> session =
        client_->CreateSession(plan_, Options(64, /*spec_snapshot=*/false));
    if (session.ok()) {
      flood.push_back(*std::move(session));
    } else {
      refused = session.status();
    }
  }
  EXPECT_THAT(refused, StatusIs(kExhausted, HasSubstrs("holds 192 arenas", "limit is 192",
                                                       "max_arenas", "RLIMIT_NOFILE")));
  EXPECT_EQ(flood.size(), 191u);
  EXPECT_THAT(kept->State().status(), IsOk());
  EXPECT_THAT(honest->CreateSession(plan_, Options(64, false)).status(),
              StatusIs(kExhausted, HasSubstrs("limit is 192")));
  ASSERT_THAT(flood.back()->Release().status(), IsOk());
  flood.pop_back();
  EXPECT_THAT(honest->CreateSession(plan_, Options(64, false)).status(), IsOk());
}

// The handoff socket took max_attached_engines (256) connections whatever the daemon's
// descriptors, each able to hold 37 of them open or in flight. Now its limit is derived from
// RLIMIT_NOFILE: (512 - 128) = 384 in flight at 32 a connection is 12 (the open share, 72 at 5 a
// connection, allows 14). The 13th engine's connection is refused with the numbers; the engines
// attached are served, and a new one attaches once one leaves.
TEST_F(DescriptorBudgetTest, HandoffConnectionsAreBoundedByTheDescriptorsTheDaemonHas) {
  constexpr size_t kConnections = 12;
  std::vector<std::unique_ptr<KvClient>> hostile;
  absl::Status refused;
  for (int i = 0; i < 20 && refused.ok(); ++i) {
    absl::StatusOr<std::unique_ptr<KvClient>> engine = KvClient::Connect(daemon_->socket_path());
    ASSERT_THAT(engine.status(), IsOk());
    refused = (*engine)->Attach(absl::StrCat("hostile-", i));
    if (refused.ok()) hostile.push_back(*std::move(engine));
  }
  EXPECT_THAT(refused, StatusIs(kExhausted,
                                HasSubstrs("the handoff socket serves 12 connections",
                                           "the limit is 12", "RLIMIT_NOFILE 512",
                                           "384 in flight, 32 per connection")));
  EXPECT_EQ(hostile.size() + 1, kConnections);
  // The attached engine is served: a new session and its arena's descriptor.
  std::unique_ptr<Session> mine = NewSession(*client_, 64, /*spec_snapshot=*/false);
  ASSERT_NE(mine, nullptr);
  EXPECT_THAT(ClientInternals::FetchArenaFd(*client_, mine->id(),
                                            ClientInternals::Ref(*mine).session_token(),
                                            mine->layout().arenas[0].handle)
                  .status(),
              IsOk());
  // One hostile engine leaves; once the daemon has closed its connection a new engine attaches.
  hostile.pop_back();
  for (int i = 0; i < 2000 && daemon_->handoff().connection_count() >= kConnections; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_LT(daemon_->handoff().connection_count(), kConnections);
  std::unique_ptr<KvClient> honest = NewClient("honest");
  ASSERT_NE(honest, nullptr);
  EXPECT_NE(NewSession(*honest, 64, /*spec_snapshot=*/false), nullptr);
}

// A step channel held an eventfd with no daemon-wide count: engines that let their handoff
// connections go kept their channels. Now (512 - 128) / 32 = 12 channels are open at most: the
// next engine is refused its channel with the numbers and steps over gRPC, while an engine with
// a channel keeps stepping over it.
TEST_F(DescriptorBudgetTest, StepChannelsAreBoundedByTheDescriptorsTheDaemonHas) {
  constexpr size_t kChannels = 12;
  constexpr size_t kConnections = 12;
  ASSERT_THAT(client_->step_channel_status(), IsOk());
  std::unique_ptr<KvClient> honest = NewClient("honest");
  ASSERT_NE(honest, nullptr);
  ASSERT_THAT(honest->step_channel_status(), IsOk());
  std::vector<std::unique_ptr<KvClient>> hostile;
  absl::Status refused;
  while (refused.ok() && hostile.size() < 2 * kChannels) {
    // Each hostile engine keeps its lease and its channel and lets its handoff connection go,
    // so the connections' own limit does not stop it first.
    for (int i = 0; i < 2000 && daemon_->handoff().connection_count() >= kConnections; ++i) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    std::unique_ptr<KvClient> engine = NewClient(absl::StrCat("hostile-", hostile.size()));
    ASSERT_NE(engine, nullptr);
    refused = engine->step_channel_status();
    if (refused.ok()) shutdown(ClientInternals::HandoffSocket(*engine), SHUT_RDWR);
    hostile.push_back(std::move(engine));
  }
  EXPECT_THAT(refused, StatusIs(kExhausted, HasSubstrs("the daemon serves 12 step channels",
                                                       "the limit is 12", "RLIMIT_NOFILE 512",
                                                       "an eventfd each", "step over gRPC")));
  EXPECT_EQ(hostile.size(), kChannels - 2 + 1);
  EXPECT_EQ(daemon_->step_channel_stats().open, kChannels);
  // The refused engine steps over gRPC; the honest one over its channel.
  auto step = [&](KvClient& engine) -> absl::Status {
    absl::StatusOr<std::unique_ptr<Session>> session =
        engine.CreateSession(plan_, Options(64, /*spec_snapshot=*/false));
    if (!session.ok()) return session.status();
    StepBatch batch(StepAddressing::kSlot);
    batch.Advance(**session, 0, 0, 1);
    std::vector<StepOutcome> outcomes;
    if (absl::Status stepped = engine.Step(batch, outcomes); !stepped.ok()) return stepped;
    return outcomes.at(0).status;
  };
  const uint64_t records = daemon_->step_channel_stats().records;
  EXPECT_THAT(step(*hostile.back()), IsOk());
  EXPECT_EQ(daemon_->step_channel_stats().records, records);
  EXPECT_THAT(step(*honest), IsOk());
  EXPECT_EQ(daemon_->step_channel_stats().records, records + 1);
}

// ---- 7. A daemon-wide cap split fairly: one engine's share of max_arenas ----

// One engine could hold every arena under max_arenas, and every other engine's CreateSession was
// refused. Now an engine holds at most max_engine_arenas (by default half of max_arenas),
// reservations included: past it the refusal names the engine, its count and the limit, and a
// second engine keeps creating sessions in the half left.
class EngineArenaShareTest : public DaemonTest {
 protected:
  static constexpr uint64_t kArenas = 8;  // max_engine_arenas 0: half, 4 per engine
  void ConfigureDaemon(DaemonConfig& config) override { config.admission.max_arenas = kArenas; }
};

TEST_F(EngineArenaShareTest, OneEngineHoldsAtMostItsShareOfTheArenas) {
  std::unique_ptr<KvClient> honest = NewClient("honest");
  ASSERT_NE(honest, nullptr);
  std::vector<std::unique_ptr<Session>> flood;
  for (int i = 0; i < 3; ++i) flood.push_back(NewSession(*client_, 64, /*spec_snapshot=*/false));
  absl::StatusOr<SessionReservation> reserved = client_->Reserve(plan_, Options(64, false));
  ASSERT_THAT(reserved.status(), IsOk());  // a reservation is an arena to come: 4 of 4
  const std::string engine = absl::StrCat("engine ", client_->engine_id(), " holds 4 arenas");
  EXPECT_THAT(client_->CreateSession(plan_, Options(64, false)).status(),
              StatusIs(kExhausted, HasSubstrs("allocation refused", engine,
                                              "limit is 4 per engine", "max_engine_arenas",
                                              "8 max_arenas")));
  EXPECT_THAT(client_->Reserve(plan_, Options(64, false)).status(),
              StatusIs(kExhausted, HasSubstrs("reservation refused", engine, "limit is 4")));
  // The second engine is served in the half left, up to its own share.
  std::vector<std::unique_ptr<Session>> served;
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<std::unique_ptr<Session>> session =
        honest->CreateSession(plan_, Options(64, false));
    ASSERT_THAT(session.status(), IsOk()) << "honest session " << i;
    served.push_back(*std::move(session));
  }
  ASSERT_THAT(flood.back()->Release().status(), IsOk());
  flood.pop_back();
  EXPECT_THAT(client_->CreateSession(plan_, Options(64, false)).status(), IsOk())
      << "a released arena makes room again";
}

// An engine's pooled (released, kept for reuse) arenas count toward its share, and it was
// refused a reservation at its share although every arena it held was its own idle pool. Now a
// refusal for its share frees its own pooled arenas first and admits it; the other engine is
// refused at its own share only, and served up to it.
TEST_F(EngineArenaShareTest, AnEnginesOwnPooledArenasGoFirstAtItsShare) {
  std::unique_ptr<KvClient> honest = NewClient("honest");
  ASSERT_NE(honest, nullptr);
  for (int i = 0; i < 4; ++i) {
    std::unique_ptr<Session> session = NewSession(*client_, 64, /*spec_snapshot=*/false);
    ASSERT_NE(session, nullptr);
    ASSERT_THAT(session->Release().status(), IsOk());
  }
  // Engine a's four pooled arenas still hold its share and half of max_arenas: the other
  // engine has its own four, and no more.
  std::vector<std::unique_ptr<Session>> served;
  for (int i = 0; i < 4; ++i) {
    served.push_back(NewSession(*honest, 64, /*spec_snapshot=*/false));
    ASSERT_NE(served.back(), nullptr) << "honest session " << i;
  }
  EXPECT_THAT(honest->CreateSession(plan_, Options(64, false)).status(),
              StatusIs(kExhausted, HasSubstrs(absl::StrCat("engine ", honest->engine_id(),
                                                           " holds 4 arenas"),
                                              "limit is 4 per engine")));
  // Engine a, at its share with nothing but its idle pool: a reservation and a session of
  // another size are admitted, its pool freed for them.
  absl::StatusOr<SessionReservation> reserved = client_->Reserve(plan_, Options(128, false));
  EXPECT_THAT(reserved.status(), IsOk());
  EXPECT_THAT(client_->CreateSession(plan_, Options(256, false)).status(), IsOk());
  for (const std::unique_ptr<Session>& session : served) {
    EXPECT_THAT(session->State().status(), IsOk());
  }
}

// ---- 8. Host memory an engine keeps mapped after release ----

// A live engine that kept each released arena mapped (and its descriptor) and created the next
// held 447 MiB of the daemon's pages against a 64 MiB budget in 10 rounds while the ledger
// showed 0. Now a freed arena's pages are punched out: the real memra-kvd, with no arena pool
// (every release frees) and a 16 MiB budget, hands this process (the hostile engine) arenas
// worth three budgets, and the descriptors it kept hold none of them; its stale mappings read
// zeros; another engine is served between the rounds and after them.
TEST(KeptMappingsTest, ArenasAnEngineKeepsMappedAfterReleaseHoldNoneOfTheDaemonsMemory) {
  constexpr uint64_t kBudget = uint64_t{16} << 20;
  DaemonProcess daemon("kept");
  ASSERT_TRUE(daemon.Start({absl::StrCat("--budget_bytes=", kBudget),
                            "--arena_pool_engine_bytes=0"}));
  auto attach = [&](const std::string& name) -> std::unique_ptr<KvClient> {
    absl::StatusOr<std::unique_ptr<KvClient>> client = KvClient::Connect(daemon.socket());
    EXPECT_THAT(client.status(), IsOk());
    if (!client.ok() || !(*client)->Attach(name).ok()) return nullptr;
    return *std::move(client);
  };
  std::unique_ptr<KvClient> hostile = attach("hostile");
  std::unique_ptr<KvClient> honest = attach("honest");
  ASSERT_NE(hostile, nullptr);
  ASSERT_NE(honest, nullptr);
  absl::StatusOr<PlanFingerprint> plan = hostile->RegisterPlan(HybridTestPlan());
  ASSERT_THAT(plan.status(), IsOk());
  ASSERT_THAT(honest->RegisterPlan(HybridTestPlan()).status(), IsOk());
  absl::StatusOr<std::unique_ptr<Session>> served = honest->CreateSession(*plan, Options(64));
  ASSERT_THAT(served.status(), IsOk());

  std::vector<KeptArena> kept;
  uint64_t handed_out = 0;
  while (handed_out <= 3 * kBudget) {
    ASSERT_LT(kept.size(), 64u) << "arenas too small for the budget";
    absl::StatusOr<std::unique_ptr<Session>> session =
        hostile->CreateSession(*plan, Options(16384, /*spec_snapshot=*/false));
    ASSERT_THAT(session.status(), IsOk()) << "round " << kept.size();
    absl::StatusOr<KeptArena> arena = KeptArena::Keep(*hostile, **session, 0xa5);
    ASSERT_THAT(arena.status(), IsOk());
    handed_out += arena->bytes();
    ASSERT_THAT((*session)->Release().status(), IsOk());
    kept.push_back(*std::move(arena));
    absl::StatusOr<std::unique_ptr<Session>> between =
        honest->CreateSession(*plan, Options(64, /*spec_snapshot=*/false));
    ASSERT_THAT(between.status(), IsOk()) << "round " << kept.size();
    ASSERT_THAT((*between)->Release().status(), IsOk());
  }
  uint64_t held = 0;
  for (const KeptArena& arena : kept) {
    absl::StatusOr<uint64_t> allocated = arena.AllocatedBytes();
    ASSERT_THAT(allocated.status(), IsOk());
    held += *allocated;
  }
  EXPECT_EQ(held, 0u) << kept.size() << " released arenas (" << handed_out
                      << " bytes) kept by the engine still hold " << held
                      << " bytes of the daemon's memory; the budget is " << kBudget;
  for (const KeptArena& arena : kept) {
    EXPECT_EQ(arena.data()[0], 0);
    EXPECT_EQ(arena.data()[arena.bytes() - 1], 0);
  }
  EXPECT_THAT((*served)->State().status(), IsOk());
  EXPECT_THAT(honest->CreateSession(*plan, Options(64)).status(), IsOk());
}

// ---- 1. Descriptors in flight, 6. the handoff thread and session locks ----

using HandoffBoundsTest = DaemonTest;

// An engine that asked for its arena ~280 times and read nothing exhausted the daemon's uid's
// in-flight descriptors, and every engine's next SCM_RIGHTS send failed. Now a connection gets
// 16 unread answers with descriptors, then refusals without; another engine is served.
TEST_F(HandoffBoundsTest, UnreadDescriptorAnswersAreBoundedPerConnection) {
  std::unique_ptr<KvClient> honest = NewClient("honest");
  ASSERT_NE(honest, nullptr);
  std::unique_ptr<Session> mine = NewSession(*client_, 64, /*spec_snapshot=*/false);
  ASSERT_NE(mine, nullptr);
  constexpr int kRequests = 40;
  ASSERT_THAT(SendUnreadArenaRequests(*client_, *mine, kRequests), IsOk());
  const int socket = ClientInternals::HandoffSocket(*client_);
  // The honest engine's sessions (their arenas come over its own handoff connection) are served.
  std::unique_ptr<Session> theirs = NewSession(*honest, 64, /*spec_snapshot=*/false);
  ASSERT_NE(theirs, nullptr);
  EXPECT_THAT(ClientInternals::FetchArenaFd(*honest, theirs->id(),
                                            ClientInternals::Ref(*theirs).session_token(),
                                            theirs->layout().arenas[0].handle)
                  .status(),
              IsOk());
  // Now the hostile engine reads: 16 arenas, then the refusals.
  std::string input;
  int arenas = 0;
  std::vector<absl::Status> refusals;
  while (arenas + static_cast<int>(refusals.size()) < kRequests) {
    absl::StatusOr<std::optional<handoff::Frame>> taken = handoff::TakeFrame(input);
    ASSERT_THAT(taken.status(), IsOk());
    if (taken->has_value()) {
      if ((*taken)->kind == handoff::Kind::kArena) {
        ++arenas;
      } else {
        ASSERT_EQ((*taken)->kind, handoff::Kind::kRefusal);
        refusals.push_back(handoff::DecodeRefusal((*taken)->body));
      }
      continue;
    }
    pollfd readable{.fd = socket, .events = POLLIN, .revents = 0};
    ASSERT_EQ(poll(&readable, 1, -1), 1);
    char chunk[4096];
    std::vector<ScopedFd> received;  // closed at once
    absl::StatusOr<size_t> got =
        handoff::ReceiveBytes(socket, absl::MakeSpan(chunk), &received);
    if (!got.ok() && (errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    ASSERT_THAT(got.status(), IsOk());
    ASSERT_GT(*got, 0u);
    input.append(chunk, *got);
  }
  EXPECT_EQ(arenas, 16);
  ASSERT_EQ(refusals.size(), 24u);
  EXPECT_THAT(refusals[0],
              StatusIs(kExhausted, HasSubstrs(absl::StrCat("engine ", client_->engine_id(),
                                                           " has not read 16 answers"),
                                              "limit is 16", "kMaxUnreadDescriptorAnswers")));
  // Read now: the connection is served again.
  EXPECT_THAT(ClientInternals::FetchArenaFd(*client_, mine->id(),
                                            ClientInternals::Ref(*mine).session_token(),
                                            mine->layout().arenas[0].handle)
                  .status(),
              IsOk());
}

// The handoff thread waited on a session's lock while that session grew (seconds for a large
// arena), and every Attach's ticket waited with it. Now a Grow held inside the session's lock
// (its new arena's creation held by the test) stalls neither that session's own descriptor nor
// a new engine's Attach.
TEST_F(HandoffBoundsTest, AGrowHoldingItsSessionDoesNotStallTheHandoffThread) {
  std::unique_ptr<Session> growing = NewSession(*client_, 64, /*spec_snapshot=*/false);
  ASSERT_NE(growing, nullptr);
  const std::string token = ClientInternals::Ref(*growing).session_token();
  const std::string handle = growing->layout().arenas[0].handle;
  faults_->Hold(BackendOp::kCreateArena);
  absl::StatusOr<SessionSnapshot> grown = absl::UnknownError("not run");
  std::thread grow([&] { grown = growing->Grow(256); });
  while (faults_->HeldCalls(BackendOp::kCreateArena) == 0) absl::SleepFor(absl::Milliseconds(1));
  // The Grow holds the session's lock now.
  EXPECT_THAT(ClientInternals::FetchArenaFd(*client_, growing->id(), token, handle).status(),
              IsOk());
  std::unique_ptr<KvClient> honest = NewClient("honest");
  EXPECT_NE(honest, nullptr);
  faults_->Unhold(BackendOp::kCreateArena);
  grow.join();
  EXPECT_THAT(grown.status(), IsOk());
}

// ---- 9. The daemon's time: each engine's share ----

// No client's call rate or CPU was bounded: an engine calling from many threads took as much of
// the daemon as it asked for. Now the time the daemon spends in an engine's operations is
// charged to it (max_engine_cpu_percent of one core, 2 s of it banked): past its share the
// engine's calls, gRPC and step channel alike, are refused with the numbers until it has earned
// time back, and another engine is served meanwhile. The daemon's clock is the test's: a
// CreateSession held in the backend while the clock moves 450 ms is 450 ms of the daemon's time,
// no sleeping.
class EngineTimeShareTest : public DaemonTest {
 protected:
  void ConfigureDaemon(DaemonConfig& config) override { config.admission.max_engine_cpu_percent = 10; }

  // Moves the daemon's clock by `by` (at most the lease grace), then waits until every engine
  // has heartbeated since, so that the next move cannot expire a lease.
  void AdvanceKeepingLeases(absl::Duration by) {
    clock_.Advance(by);
    for (int i = 0; i < 500; ++i) {
      bool fresh = true;
      const pb::GetStatusResponse status = daemon_->GetStatus();
      for (const pb::EngineStatus& engine : status.engine_status()) {
        fresh = fresh && engine.last_heartbeat_age_ms() == 0;
      }
      if (fresh) return;
      absl::SleepFor(absl::Milliseconds(10));
    }
    ADD_FAILURE() << "the engines did not heartbeat after the clock moved";
  }
};

TEST_F(EngineTimeShareTest, AnEngineBeyondItsShareOfTheDaemonsTimeIsRefusedUntilItEarnsItBack) {
  std::unique_ptr<KvClient> honest = NewClient("honest");
  ASSERT_NE(honest, nullptr);
  std::unique_ptr<Session> theirs = NewSession(*honest, 64, /*spec_snapshot=*/false);
  ASSERT_NE(theirs, nullptr);
  std::unique_ptr<Session> open = NewSession(*client_, 64, /*spec_snapshot=*/false);
  ASSERT_NE(open, nullptr);
  absl::StatusOr<Transaction> begun = open->Begin();
  ASSERT_THAT(begun.status(), IsOk());
  // Engine a's CreateSession, its arena's creation held while the clock moves.
  faults_->Hold(BackendOp::kCreateArena);
  absl::StatusOr<std::unique_ptr<Session>> created = absl::UnknownError("not run");
  std::thread create([&] { created = client_->CreateSession(plan_, Options(64, false)); });
  while (faults_->HeldCalls(BackendOp::kCreateArena) == 0) absl::SleepFor(absl::Milliseconds(1));
  clock_.Advance(absl::Milliseconds(450));
  faults_->Unhold(BackendOp::kCreateArena);
  create.join();
  ASSERT_THAT(created.status(), IsOk());
  Session& mine = **created;

  // 200 ms banked (2 s at 10%) less 450 ms: 250 ms of debt, 2.5 s of the clock to earn back.
  const auto numbers = HasSubstrs(
      absl::StrCat("engine ", client_->engine_id(), " has used its share of the daemon's time"),
      "250 ms more than it has earned", "10% of one core", "max_engine_cpu_percent",
      "200 ms banked", "served again in 2500 ms");
  EXPECT_THAT(client_->CreateSession(plan_, Options(64, false)).status(),
              StatusIs(kExhausted, numbers));
  EXPECT_THAT(mine.State().status(), StatusIs(kExhausted, numbers));
  StepBatch batch(StepAddressing::kSlot);
  batch.Advance(mine, 0, 0, 1);
  std::vector<StepOutcome> outcomes;
  ASSERT_THAT(client_->Step(batch, outcomes), IsOk());
  EXPECT_THAT(outcomes.at(0).status, StatusIs(kExhausted, numbers));
  // It can still end what it started.
  EXPECT_THAT(open->Abort(begun->generation).status(), IsOk());
  // The other engine is served meanwhile, over gRPC and over its step channel.
  EXPECT_THAT(theirs->State().status(), IsOk());
  StepBatch honest_batch(StepAddressing::kSlot);
  honest_batch.Advance(*theirs, 0, 0, 1);
  ASSERT_THAT(honest->Step(honest_batch, outcomes), IsOk());
  EXPECT_THAT(outcomes.at(0).status, IsOk());
  EXPECT_THAT(honest->CreateSession(plan_, Options(64, false)).status(), IsOk());

  // Earned back on the daemon's clock: served again.
  for (int i = 0; i < 5; ++i) AdvanceKeepingLeases(absl::Milliseconds(500));
  EXPECT_THAT(mine.State().status(), IsOk());
  EXPECT_THAT(client_->CreateSession(plan_, Options(64, false)).status(), IsOk());
}

}  // namespace
}  // namespace memra::testing
