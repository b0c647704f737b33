#include "server/metrics/rpc_metrics.h"

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "server/metrics/metrics.h"
#include "tests/status_matchers.h"

namespace memra::metrics {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::IsOkAndHolds;
using ::memra::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kHealthCheck[] = "/grpc.health.v1.Health/Check";
constexpr char kReflectionService[] = "grpc.reflection.v1alpha.ServerReflection";
constexpr char kReflectionInfo[] = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo";

// Serialized messages, written out so the test needs no generated code:
// HealthCheckRequest{service = <name>} and ServerReflectionRequest{list_services = ""}.
std::string HealthCheckRequest(const std::string& service) {
  return std::string("\x0a", 1) + static_cast<char>(service.size()) + service;
}
const std::string kListServicesRequest("\x3a\x00", 2);
// HealthCheckResponse{status = SERVING}.
const std::string kServingResponse("\x08\x01", 2);

grpc::ByteBuffer ToByteBuffer(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

std::string FromByteBuffer(const grpc::ByteBuffer& buffer) {
  grpc::Slice slice;
  if (!buffer.DumpToSingleSlice(&slice).ok()) return "<unreadable>";
  return std::string(reinterpret_cast<const char*>(slice.begin()), slice.size());
}

void SetDeadline(grpc::ClientContext& context) {
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
}

class RpcMetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::vector<std::string>> reflection_methods =
        ProtoServiceMethods(kReflectionService);
    ASSERT_THAT(reflection_methods, IsOk());
    std::vector<std::string> served(kHealthServiceMethods.begin(), kHealthServiceMethods.end());
    served.insert(served.end(), reflection_methods->begin(), reflection_methods->end());
    absl::StatusOr<std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>>
        interceptors = MakeRpcMetricsInterceptors(&registry_, served);
    ASSERT_THAT(interceptors, IsOk());
    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    grpc::ServerBuilder builder;
    builder.experimental().SetInterceptorCreators(*std::move(interceptors));
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = std::make_unique<grpc::GenericStub>(server_->InProcessChannel(grpc::ChannelArguments()));
  }

  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown();
  }

  // A unary call through the generic stub; `response` gets the serialized reply.
  grpc::Status CallUnary(const std::string& method, const std::string& request,
                         std::string* response = nullptr) {
    grpc::ClientContext context;
    SetDeadline(context);
    const grpc::ByteBuffer request_buffer = ToByteBuffer(request);
    grpc::ByteBuffer response_buffer;
    grpc::Status status;
    absl::Notification done;
    stub_->UnaryCall(&context, method, grpc::StubOptions(), &request_buffer, &response_buffer,
                     [&](grpc::Status result) {
                       status = std::move(result);
                       done.Notify();
                     });
    done.WaitForNotification();
    if (response != nullptr) *response = FromByteBuffer(response_buffer);
    return status;
  }

  // Waits (at most 30 s, a guard against hanging) until the exposition contains `line`:
  // the server records a cancelled call after the client has already moved on.
  bool RenderEventuallyContains(const std::string& line) {
    const absl::Time give_up = absl::Now() + absl::Seconds(30);
    while (registry_.Render().find(line) == std::string::npos) {
      if (absl::Now() > give_up) return false;
      absl::SleepFor(absl::Milliseconds(5));
    }
    return true;
  }

  // Declared first: the server's interceptors record into it until the server is gone.
  Registry registry_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::GenericStub> stub_;
};

// A reflection stream (bidi, like Attach) driven step by step on its own completion queue.
class ReflectionStream {
 public:
  explicit ReflectionStream(grpc::GenericStub& stub) {
    SetDeadline(context_);
    stream_ = stub.PrepareCall(&context_, kReflectionInfo, &cq_);
  }
  ~ReflectionStream() {
    cq_.Shutdown();
    void* tag;
    bool ok;
    while (cq_.Next(&tag, &ok)) {
    }
  }

  bool Start() {
    stream_->StartCall(this);
    return Await();
  }
  // One ListServices request and its response.
  bool ListServices(std::string* response) {
    stream_->Write(ToByteBuffer(kListServicesRequest), this);
    if (!Await()) return false;
    grpc::ByteBuffer buffer;
    stream_->Read(&buffer, this);
    if (!Await()) return false;
    *response = FromByteBuffer(buffer);
    return true;
  }
  // Half-closes and waits for the status.
  grpc::Status CloseAndFinish() {
    stream_->WritesDone(this);
    if (!Await()) return grpc::Status(grpc::StatusCode::INTERNAL, "WritesDone failed");
    return Finish();
  }
  grpc::Status CancelAndFinish() {
    context_.TryCancel();
    return Finish();
  }

 private:
  grpc::Status Finish() {
    grpc::Status status;
    stream_->Finish(&status, this);
    void* tag = nullptr;
    bool ok = false;
    if (!cq_.Next(&tag, &ok)) return grpc::Status(grpc::StatusCode::INTERNAL, "queue shut down");
    return status;
  }
  // One operation at a time, each tagged `this`.
  bool Await() {
    void* tag = nullptr;
    bool ok = false;
    return cq_.Next(&tag, &ok) && tag == this && ok;
  }

  grpc::CompletionQueue cq_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> stream_;
};

TEST_F(RpcMetricsTest, CountsUnaryCallsByMethodAndCode) {
  std::string response;
  ASSERT_TRUE(CallUnary(kHealthCheck, HealthCheckRequest(""), &response).ok());
  EXPECT_EQ(response, kServingResponse);
  ASSERT_TRUE(CallUnary(kHealthCheck, HealthCheckRequest("")).ok());
  const grpc::Status not_found = CallUnary(kHealthCheck, HealthCheckRequest("memra.nope.v1.Nope"));
  EXPECT_EQ(not_found.error_code(), grpc::StatusCode::NOT_FOUND) << not_found.error_message();

  const std::string exposition = registry_.Render();
  EXPECT_THAT(exposition, HasSubstr("# TYPE memra_rpc_requests_total counter\n"
                                    "memra_rpc_requests_total{method=\"/grpc.health.v1.Health/"
                                    "Check\",code=\"NOT_FOUND\"} 1\n"
                                    "memra_rpc_requests_total{method=\"/grpc.health.v1.Health/"
                                    "Check\",code=\"OK\"} 2\n"
                                    "# HELP memra_rpc_duration_seconds"));
  EXPECT_THAT(exposition, HasSubstr("# TYPE memra_rpc_duration_seconds histogram\n"
                                    "memra_rpc_duration_seconds_bucket{method=\"/grpc.health.v1."
                                    "Health/Check\",le=\"1e-05\"} "));
  EXPECT_THAT(exposition, HasSubstr("memra_rpc_duration_seconds_bucket{method=\"/grpc.health.v1."
                                    "Health/Check\",le=\"+Inf\"} 3\n"));
  EXPECT_THAT(exposition, HasSubstr("memra_rpc_duration_seconds_count{method=\"/grpc.health.v1."
                                    "Health/Check\"} 3\n"));
}

TEST_F(RpcMetricsTest, UnknownMethodsShareOneLabel) {
  const grpc::Status missing = CallUnary("/memra.kv.v1.Nope/Missing", "");
  EXPECT_EQ(missing.error_code(), grpc::StatusCode::UNIMPLEMENTED) << missing.error_message();
  const grpc::Status other = CallUnary("/made.up.Service/Anything", "");
  EXPECT_EQ(other.error_code(), grpc::StatusCode::UNIMPLEMENTED) << other.error_message();
  // A served service, but not one of its methods.
  const grpc::Status bogus = CallUnary("/grpc.health.v1.Health/Bogus", "");
  EXPECT_EQ(bogus.error_code(), grpc::StatusCode::UNIMPLEMENTED) << bogus.error_message();

  const std::string exposition = registry_.Render();
  EXPECT_THAT(exposition,
              HasSubstr("memra_rpc_requests_total{method=\"unknown\",code=\"UNIMPLEMENTED\"} 3\n"));
  EXPECT_THAT(exposition, Not(HasSubstr("Missing")));
  EXPECT_THAT(exposition, Not(HasSubstr("made.up")));
  EXPECT_THAT(exposition, Not(HasSubstr("Bogus")));
}

TEST_F(RpcMetricsTest, CountsAStreamOnceWhenItFinishes) {
  ReflectionStream stream(*stub_);
  ASSERT_TRUE(stream.Start());
  for (int message = 0; message < 3; ++message) {
    std::string response;
    ASSERT_TRUE(stream.ListServices(&response));
    EXPECT_THAT(response, HasSubstr("grpc.health.v1.Health"));
    // Still open: nothing counted yet.
    EXPECT_THAT(registry_.Render(), Not(HasSubstr("ServerReflectionInfo")));
  }
  const grpc::Status status = stream.CloseAndFinish();
  EXPECT_TRUE(status.ok()) << status.error_message();

  const std::string exposition = registry_.Render();
  EXPECT_THAT(exposition, HasSubstr("memra_rpc_requests_total{method=\"" +
                                    std::string(kReflectionInfo) + "\",code=\"OK\"} 1\n"));
  EXPECT_THAT(exposition, HasSubstr("memra_rpc_duration_seconds_count{method=\"" +
                                    std::string(kReflectionInfo) + "\"} 1\n"));
}

TEST_F(RpcMetricsTest, CountsACancelledStreamOnceAsCancelled) {
  {
    ReflectionStream stream(*stub_);
    ASSERT_TRUE(stream.Start());
    std::string response;
    ASSERT_TRUE(stream.ListServices(&response));
    // The reflection handler returns OK when its stream breaks; the client sees CANCELLED.
    EXPECT_EQ(stream.CancelAndFinish().error_code(), grpc::StatusCode::CANCELLED);
  }
  EXPECT_TRUE(RenderEventuallyContains("memra_rpc_requests_total{method=\"" +
                                       std::string(kReflectionInfo) + "\",code=\"CANCELLED\"} 1\n"))
      << registry_.Render();
  server_->Shutdown();
  server_.reset();
  // Still once after the server has torn every call down.
  const std::string exposition = registry_.Render();
  EXPECT_THAT(exposition, HasSubstr("memra_rpc_duration_seconds_count{method=\"" +
                                    std::string(kReflectionInfo) + "\"} 1\n"));
  EXPECT_THAT(exposition, Not(HasSubstr("code=\"OK\"")));
}

TEST(RpcMetricsRegistrationTest, ProtoServiceMethodsListsFullNames) {
  EXPECT_THAT(ProtoServiceMethods(kReflectionService),
              IsOkAndHolds(ElementsAre(std::string(kReflectionInfo))));
  EXPECT_THAT(ProtoServiceMethods("memra.kv.v1.Nope"),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstrs("\"memra.kv.v1.Nope\"", "not in this binary")));
}

TEST(RpcMetricsRegistrationTest, RefusesMalformedMethodNamesBeforeRegistering) {
  Registry registry;
  for (const std::string bad : {"", "Step", "memra.kv.v1.KvCache/Step", "/memra.kv.v1.KvCache/",
                                "//Step", "/a/b/c"}) {
    EXPECT_THAT(MakeRpcMetricsInterceptors(&registry, {std::string(kHealthCheck), bad}),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstrs("served method \"" + bad + "\"", "/package.Service/Method")));
  }
  EXPECT_EQ(registry.Render(), "");
}

TEST(RpcMetricsRegistrationTest, RefusesToRegisterTwice) {
  Registry registry;
  ASSERT_THAT(MakeRpcMetricsInterceptors(&registry, {}), IsOk());
  EXPECT_THAT(MakeRpcMetricsInterceptors(&registry, {}),
              StatusIs(absl::StatusCode::kAlreadyExists,
                       HasSubstr("\"memra_rpc_requests_total\" is already registered")));
}

TEST(RpcMetricsRegistrationTest, DurationBucketsSpan10MicrosecondsTo10Seconds) {
  const std::vector<double>& bounds = RpcDurationBucketBounds();
  ASSERT_EQ(bounds.size(), 19u);
  EXPECT_EQ(bounds.front(), 0.00001);
  EXPECT_EQ(bounds.back(), 10);
  for (size_t i = 1; i < bounds.size(); ++i) {
    EXPECT_GT(bounds[i], bounds[i - 1]);
    EXPECT_LE(bounds[i] / bounds[i - 1], 2.5 + 1e-9) << i;
  }
}

}  // namespace
}  // namespace memra::metrics
