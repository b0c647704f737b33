// PrefixClient, the prefix-cache view of a KvClient (client/prefix_client.h): it rides the
// client's one connection and lease (a view taken before Attach serves after it, copies are the
// same view, no second engine), and once its KvClient is gone every call is refused, naming the
// call, and sends nothing. The cache's own rules are prefix_e2e_test's and operator_socket_test's.

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "client/client.h"
#include "client/prefix_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/store/prefix_cache.h"
#include "tests/service/test_daemon.h"
#include "tests/status_matchers.h"

namespace memra::testing {
namespace {

using ::testing::HasSubstr;

constexpr uint32_t kBlockTokens = 4;
constexpr uint64_t kCapacity = 64;

class PrefixClientTest : public DaemonTest {
 protected:
  void ConfigureDaemon(DaemonConfig& config) override {
    config.prefix_cache_budget_bytes = uint64_t{8} << 20;
    config.prefix_block_tokens = kBlockTokens;
  }

  // The prefix cache's arenas are freed before the fixture counts what is left.
  void TearDown() override {
    EvictAllPrefixEntries();
    DaemonTest::TearDown();
  }

  // The refusal of a view's call after its KvClient was destroyed.
  static auto Gone(const std::string& call) {
    return StatusIs(absl::StatusCode::kFailedPrecondition,
                    HasSubstrs(call, "after its KvClient was destroyed",
                               "a view is valid while its KvClient lives"));
  }
};

TEST_F(PrefixClientTest, AViewTakenBeforeAttachServesThroughTheLeaseAttachOpens) {
  const std::vector<int32_t> ids = {1, 2, 3, 4, 5, 6, 7, 8};
  absl::StatusOr<std::unique_ptr<KvClient>> late = KvClient::Connect(daemon_->socket_path());
  ASSERT_THAT(late.status(), IsOk());
  const PrefixClient prefixes = (*late)->prefixes();
  EXPECT_THAT(prefixes.Lookup(plan_, Options(kCapacity, false), ids),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("LookupPrefix before Attach: sessions need a lease")));

  const size_t engines_before = EngineCount();
  ASSERT_THAT((*late)->Attach("engine-late"), IsOk());
  std::unique_ptr<Session> source = CommittedSession(**late, kCapacity, ids);
  ASSERT_NE(source, nullptr);
  absl::StatusOr<PrefixCaptured> captured = prefixes.Capture(*source, ids, ids.size());
  ASSERT_THAT(captured.status(), IsOk());
  EXPECT_EQ(captured->boundary_tokens, ids.size());
  EXPECT_FALSE(captured->already_present);

  // A copy, and a fresh view, are the same connection: they find and restore that entry.
  const PrefixClient copy = prefixes;
  absl::StatusOr<PrefixMatch> match = copy.Lookup(plan_, Options(kCapacity, false), ids);
  ASSERT_THAT(match.status(), IsOk());
  EXPECT_EQ(match->outcome, LookupOutcome::kHit);
  EXPECT_EQ(match->entry_id, captured->entry_id);
  EXPECT_EQ(match->matched_tokens, ids.size());
  std::unique_ptr<Session> fresh = NewSession(**late, kCapacity, /*spec_snapshot=*/false);
  ASSERT_NE(fresh, nullptr);
  absl::StatusOr<PrefixRestored> restored =
      (*late)->prefixes().Restore(*fresh, ids, captured->entry_id);
  ASSERT_THAT(restored.status(), IsOk());
  EXPECT_EQ(restored->restored_tokens, ids.size());
  EXPECT_EQ(restored->state.committed_len, ids.size());

  // The events stream of the view is this engine's scope's, over the same connection.
  std::unique_ptr<PrefixEventStream> events = copy.SubscribeEvents();
  absl::StatusOr<std::optional<PrefixCacheEvent>> heard = events->Next();
  ASSERT_THAT(heard.status(), IsOk());
  ASSERT_TRUE(heard->has_value());
  EXPECT_EQ((*heard)->kind, PrefixEventKind::kStored);
  EXPECT_EQ((*heard)->cache_scope, (*late)->cache_scope());
  events->Cancel();
  EXPECT_THAT(events->Next(), IsOkAndHolds(std::nullopt));

  // One engine more for the client and all its views: none attached on its own.
  EXPECT_EQ(EngineCount(), engines_before + 1);
}

TEST_F(PrefixClientTest, EveryCallOfAViewWhoseKvClientIsGoneIsRefusedAndSendsNothing) {
  const std::vector<int32_t> ids = {11, 12, 13, 14};
  std::unique_ptr<Session> source = CommittedSession(*client_, kCapacity, ids);
  ASSERT_NE(source, nullptr);
  std::unique_ptr<Session> fresh = NewSession(*client_, kCapacity, /*spec_snapshot=*/false);
  ASSERT_NE(fresh, nullptr);
  std::unique_ptr<KvClient> other = NewClient("engine-gone");
  ASSERT_NE(other, nullptr);
  const PrefixClient orphan = other->prefixes();
  other.reset();

  // The sessions are another (live) client's: only the view's own KvClient is gone.
  EXPECT_THAT(orphan.Capture(*source, ids, ids.size()), Gone("PrefixClient::Capture"));
  EXPECT_THAT(orphan.Lookup(plan_, Options(kCapacity, false), ids), Gone("PrefixClient::Lookup"));
  EXPECT_THAT(orphan.Restore(*fresh, ids), Gone("PrefixClient::Restore"));
  EXPECT_EQ(daemon_->prefix_cache()->Stats().entries, 0u);
  absl::StatusOr<SessionSnapshot> untouched = fresh->State();
  ASSERT_THAT(untouched.status(), IsOk());
  EXPECT_EQ(untouched->committed_len, 0u);

  // A subscription says so at its first Next(), then ends.
  std::unique_ptr<PrefixEventStream> events = orphan.SubscribeEvents();
  EXPECT_THAT(events->Next(), Gone("PrefixClient::SubscribeEvents"));
  EXPECT_THAT(events->Next(), IsOkAndHolds(std::nullopt));
  events->Cancel();

  // The live client's own view is unaffected.
  EXPECT_THAT(client_->prefixes().Capture(*source, ids, ids.size()).status(), IsOk());
  EXPECT_EQ(daemon_->prefix_cache()->Stats().entries, 1u);
}

}  // namespace
}  // namespace memra::testing
