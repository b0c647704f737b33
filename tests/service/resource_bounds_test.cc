// What one client can make the daemon hold (docs/security-model.md#resources, issue 31): each
// resource driven past its bound by one client, which gets a clean refusal naming its numbers,
// while a second engine in the same test keeps being served.

#include <cstdint>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/internal.h"
#include "common/grpc_status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/memra/kv/v1/admin.grpc.pb.h"
#include "server/model_config_bounds.h"
#include "tests/service/test_daemon.h"
#include "tests/status_matchers.h"

namespace memra::testing {
namespace {

namespace pb = ::memra::kv::v1;

constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
constexpr auto kExhausted = absl::StatusCode::kResourceExhausted;

constexpr char kLlamaConfig[] = R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
    "hidden_size": 512, "head_dim": 64})";

// ---- 2. Client-supplied config.json: size, depth, parses at once ----

class ModelConfigBoundsTest : public DaemonTest {
 protected:
  absl::Status Cost(KvClient& client, const std::string& config) {
    pb::CostRequest request;
    request.mutable_model()->set_hf_config_json(config);
    request.mutable_shape()->set_capacity(128);
    pb::CostResponse response;
    return FromGrpcStatus(ClientInternals::Admin(client).GetCost(
        ClientInternals::NewContext(client).get(), request, &response));
  }
  absl::Status Import(KvClient& client, const std::string& config) {
    pb::ImportModelRequest request;
    request.set_hf_config_json(config);
    pb::ImportModelResponse response;
    return FromGrpcStatus(ClientInternals::Admin(client).ImportModel(
        ClientInternals::NewContext(client).get(), request, &response));
  }
};

// Today's 4 MB of "[" took seconds and hundreds of MiB: an over-size or over-deep config is
// refused before it is parsed, on every call that takes one, and another engine's queries and
// an unattached client's are served meanwhile and afterwards (parse slots are not leaked).
TEST_F(ModelConfigBoundsTest, OversizeAndOverdeepConfigsAreRefusedBeforeParsing) {
  std::unique_ptr<KvClient> honest = NewClient("honest");
  ASSERT_NE(honest, nullptr);
  absl::StatusOr<std::unique_ptr<KvClient>> unattached = KvClient::Connect(daemon_->socket_path());
  ASSERT_THAT(unattached.status(), IsOk());

  const std::string oversize(kMaxModelConfigBytes + 1, '[');
  const std::string overdeep(100'000, '[');  // 100 KB: under the size bound
  const auto too_big = StatusIs(kExhausted, HasSubstrs("config.json is 1048577 bytes",
                                                       "limit is 1048576", "kMaxModelConfigBytes"));
  const auto too_deep = StatusIs(kInvalid, HasSubstrs("config.json nests 33 deep at byte 32",
                                                      "limit is 32", "kMaxModelConfigDepth"));
  for (KvClient* hostile : {client_.get(), unattached->get()}) {
    EXPECT_THAT(Cost(*hostile, oversize), too_big);
    EXPECT_THAT(Cost(*hostile, overdeep), too_deep);
    EXPECT_THAT(Import(*hostile, oversize), too_big);
    EXPECT_THAT(Import(*hostile, overdeep), too_deep);
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
    EXPECT_THAT(Cost(*honest, kLlamaConfig), IsOk()) << i;
    EXPECT_THAT(Import(**unattached, kLlamaConfig), IsOk()) << i;
  }
  EXPECT_THAT(honest->CreateSession(plan_, Options(64)).status(), IsOk());
}

}  // namespace
}  // namespace memra::testing
