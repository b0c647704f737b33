// End to end, the prefix cache across engine processes: the real memra-kvd binary (host
// backend) and separate prefix_engine processes. For each model kind (flat K/V, recurrent
// hybrid, SWA ring after a wrap, latent with indexer tail and pool keys) engine A commits
// tokens, writes known bytes into every plane and captures; engine B, another process, looks
// the tokens up, restores into its own fresh session and checks every restored byte. Then engine
// death: an engine that committed with token ids (and holds an open transaction with staged
// rows) is SIGKILLed; after its lease is reclaimed a new process restores its conversation.

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/internal.h"
#include "client/prefix_client.h"
#include "common/grpc_status.h"
#include "core/test_model_plans.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/memra/kv/v1/prefix.grpc.pb.h"
#include "tests/daemon_process.h"
#include "tests/e2e/operator_view.h"
#include "tests/status_matchers.h"
#include "tests/subprocess.h"

namespace memra::testing {
namespace {

namespace pb = ::memra::kv::v1;

class PrefixE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(daemon_.Start({"--budget_bytes=512MiB", "--prefix_cache_budget_bytes=128MiB",
                               "--prefix_block_tokens=16", "--lease_timeout_ms=2000",
                               "--lease_grace_ms=100"}));
    // The operator's view (ListPrefixes): the admin socket.
    absl::StatusOr<std::unique_ptr<KvClient>> checker = KvClient::Connect(daemon_.admin_socket());
    ASSERT_THAT(checker, IsOk());
    checker_ = *std::move(checker);
  }

  void TearDown() override {
    checker_.reset();
    if (daemon_.Signal(SIGTERM)) {
      EXPECT_EQ(daemon_.WaitExit(), 0);
    }
  }

  pid_t Engine(const std::string& mode, const std::string& plan, uint64_t tokens,
               const std::string& out) {
    return Spawn({Runfile("tests/e2e/prefix_engine"), "--socket=" + socket_, "--mode=" + mode,
                  "--plan=" + plan, absl::StrCat("--tokens=", tokens), "--out=" + out});
  }

  // The operator view (memra-kvctl prefixes): a raw call.
  pb::ListPrefixesResponse List() { return ListPrefixes(*checker_); }

  DaemonProcess daemon_{"pfx"};  // stopped, its directory removed, after TearDown
  const std::string& dir_ = daemon_.dir();
  const std::string& socket_ = daemon_.socket();
  std::unique_ptr<KvClient> checker_;
};

TEST_F(PrefixE2eTest, AnotherProcessRestoresExactlyTheCapturedBytesForEveryModelKind) {
  struct Kind {
    std::string plan;
    uint64_t tokens;
  };
  // swa: 4800 rows wrap the 64 + 4096 + 512 + 31 = 4703-row ring before the capture.
  const std::vector<Kind> kinds = {{"flat", 96}, {"hybrid", 64}, {"swa", 4800}, {"latent", 80}};
  uint64_t entries = 0;
  for (const Kind& kind : kinds) {
    SCOPED_TRACE(kind.plan);
    const std::string captured = absl::StrCat(dir_, "/", kind.plan, ".captured");
    EXPECT_EQ(WaitExit(Engine("capture", kind.plan, kind.tokens, captured)), 0);
    ASSERT_TRUE(Exists(captured));
    ++entries;
    const std::string restored = absl::StrCat(dir_, "/", kind.plan, ".restored");
    EXPECT_EQ(WaitExit(Engine("restore", kind.plan, kind.tokens, restored)), 0);
    ASSERT_TRUE(Exists(restored));
  }
  const pb::ListPrefixesResponse listed = List();
  EXPECT_EQ(static_cast<uint64_t>(listed.entries_size()), entries);
  EXPECT_EQ(listed.stats().restores(), entries);
  EXPECT_EQ(listed.stats().tokens_restored(), 96u + 64u + 4800u + 80u);
  EXPECT_EQ(listed.stats().lookup_hits(), entries);
  EXPECT_EQ(listed.stats().dropped_entries(), 0u);
  // Every entry of every model kind lives in one 128 MiB slab (the default, capped at the
  // 128 MiB budget): no arena per stored block.
  EXPECT_EQ(listed.stats().slabs(), 1u);
  EXPECT_EQ(listed.stats().slab_bytes(), uint64_t{128} << 20);
  EXPECT_EQ(listed.stats().slab_bytes(), listed.stats().stored_bytes() +
                                             listed.stats().slab_free_bytes() +
                                             listed.stats().slab_empty_bytes());
}

TEST_F(PrefixE2eTest, AKilledEnginesCommittedConversationRestoresInANewProcess) {
  const std::string ready = dir_ + "/hold.ready";
  const pid_t holder = Engine("hold", "flat", 64, ready);
  ASSERT_TRUE(PollUntil([&] { return Exists(ready); }, holder)) << "the holder never got ready";
  EXPECT_EQ(List().entries_size(), 0);  // nothing captured while it lives
  ASSERT_EQ(kill(holder, SIGKILL), 0);
  EXPECT_EQ(WaitExit(holder), 128 + SIGKILL);
  // The lease ends with the stream; after the grace the daemon keeps the committed 64 tokens.
  ASSERT_TRUE(PollUntil([&] { return List().entries_size() == 1; }, daemon_.pid()));
  const pb::ListPrefixesResponse listed = List();
  EXPECT_EQ(listed.entries(0).boundary_tokens(), 64u);  // never the 16 staged rows
  EXPECT_EQ(listed.stats().death_captures(), 1u);
  const std::string restored = dir_ + "/death.restored";
  EXPECT_EQ(WaitExit(Engine("restore", "flat", 64, restored)), 0);
  EXPECT_TRUE(Exists(restored));
}

// The host backend has no device queue: a Capture or Restore carrying an engine event is refused
// like every session call (INVALID_ARGUMENT, the handle's size in the message) after the session
// is authenticated and before anything is copied; without the event the same calls succeed.
TEST_F(PrefixE2eTest, HostBackendRefusesEngineEventsOnCaptureAndRestore) {
  absl::StatusOr<std::unique_ptr<KvClient>> client = KvClient::Connect(socket_);
  ASSERT_THAT(client, IsOk());
  ASSERT_THAT((*client)->Attach("event-sender"), IsOk());
  absl::StatusOr<PlanFingerprint> plan = (*client)->RegisterPlan(test_plans::DenseModel(2, 32, 1));
  ASSERT_THAT(plan, IsOk());
  SessionOptions options;
  options.capacity = 256;
  absl::StatusOr<std::unique_ptr<Session>> source = (*client)->CreateSession(*plan, options);
  absl::StatusOr<std::unique_ptr<Session>> fresh = (*client)->CreateSession(*plan, options);
  ASSERT_THAT(source, IsOk());
  ASSERT_THAT(fresh, IsOk());
  constexpr uint64_t kTokens = 32;
  std::vector<int32_t> tokens;
  for (uint64_t i = 0; i < kTokens; ++i) tokens.push_back(static_cast<int32_t>(i + 100));
  absl::StatusOr<Transaction> tx = (*source)->Begin();
  ASSERT_THAT(tx, IsOk());
  ASSERT_THAT((*source)->PrepareAppend(tx->generation, kTokens), IsOk());
  ASSERT_THAT((*source)->PublishAppend(tx->generation), IsOk());
  ASSERT_THAT((*source)->Commit(tx->generation, kTokens, tokens), IsOk());

  const std::string event(64, '\x03');
  (*source)->SetWaitEvent(event);
  EXPECT_THAT(
      (*client)->prefixes().Capture(**source, tokens, kTokens),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstrs("host backend: a 64-byte interprocess event handle", "RPC order")));
  EXPECT_EQ(List().entries_size(), 0);
  // Authenticated before any wait: a wrong token is PERMISSION_DENIED, event or not (a request
  // client.h never builds: the raw call).
  pb::CapturePrefixRequest stranger;
  *stranger.mutable_session() = ClientInternals::Ref(**source);
  stranger.mutable_session()->set_session_token(std::string(16, 'x'));
  stranger.mutable_token_ids()->Add(tokens.begin(), tokens.end());
  stranger.set_boundary_tokens(kTokens);
  stranger.mutable_ordering()->set_wait_event(event);
  pb::CapturePrefixResponse response;
  EXPECT_THAT(FromGrpcStatus(ClientInternals::Prefix(**client).Capture(
                  ClientInternals::NewContext(**client).get(), stranger, &response)),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       ::testing::HasSubstr(
                           absl::StrCat("wrong session token for session ", (*source)->id()))));
  (*source)->SetWaitEvent("");
  absl::StatusOr<PrefixCaptured> captured =
      (*client)->prefixes().Capture(**source, tokens, kTokens);
  ASSERT_THAT(captured, IsOk());
  EXPECT_EQ(List().entries_size(), 1);
  EXPECT_EQ(captured->shape_fingerprint, *plan) << "all layers, unsharded: the plan's own";
  // A router subscribing from the start hears the store: both 16-token blocks.
  std::unique_ptr<PrefixEventStream> events = (*client)->prefixes().SubscribeEvents();
  absl::StatusOr<std::optional<PrefixCacheEvent>> stored = events->Next();
  ASSERT_THAT(stored, IsOk());
  ASSERT_TRUE(stored->has_value());
  EXPECT_FALSE((*stored)->gap);
  EXPECT_EQ((*stored)->kind, PrefixEventKind::kStored);
  EXPECT_EQ((*stored)->sequence, 1u);
  EXPECT_EQ((*stored)->shape_fingerprint, *plan);
  EXPECT_EQ((*stored)->block_keys.size(), kTokens / 16);
  events->Cancel();
  absl::StatusOr<std::optional<PrefixCacheEvent>> after_cancel = events->Next();
  ASSERT_THAT(after_cancel, IsOk());
  EXPECT_FALSE(after_cancel->has_value()) << "cancelling ends the stream";

  (*fresh)->SetWaitEvent(event);
  EXPECT_THAT(
      (*client)->prefixes().Restore(**fresh, tokens, captured->entry_id),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstrs("host backend: a 64-byte interprocess event handle", "RPC order")));
  absl::StatusOr<SessionSnapshot> untouched = (*fresh)->State();
  ASSERT_THAT(untouched, IsOk());
  EXPECT_EQ(untouched->committed_len, 0u);
  EXPECT_EQ(List().stats().restores(), 0u);
  (*fresh)->SetWaitEvent("");
  absl::StatusOr<PrefixRestored> restored =
      (*client)->prefixes().Restore(**fresh, tokens, captured->entry_id);
  ASSERT_THAT(restored, IsOk());
  EXPECT_EQ(restored->restored_tokens, kTokens);
  EXPECT_EQ(List().stats().restores(), 1u);
}

}  // namespace
}  // namespace memra::testing
