#include "server/session/session_prefix.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/model_plan.h"
#include "core/test_model_plans.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/device/device_budget.h"
#include "server/session/daemon_session.h"
#include "server/store/prefix_cache.h"
#include "server/testing/test_host_backend.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;
namespace tp = ::memra::test_plans;

constexpr uint32_t kBlock = 16;
constexpr char kScope[] = "uid:1000";

std::vector<int32_t> Tokens(uint64_t n) {
  std::vector<int32_t> tokens;
  for (uint64_t i = 0; i < n; ++i) tokens.push_back(static_cast<int32_t>(i * 3 + 1000));
  return tokens;
}

ModelPlan FlatPlan() { return tp::DenseModel(2, 32, 1); }

// The session side over a real store and real sessions on the host backend. Content is not
// checked here (server/store/prefix_cache_test.cc checks every byte a restore moves): these
// tests are about what the session side decides.
class SessionPrefixTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = testing::NewTestHostBackend(testing::TestHostBackendOptions(uint64_t{64} << 20));
    ASSERT_NE(backend_, nullptr);
    PrefixCacheOptions options;
    options.budget_bytes = uint64_t{8} << 20;
    options.slab_bytes = uint64_t{1} << 20;
    options.block_tokens = kBlock;
    options.copy_threads = 1;
    absl::StatusOr<std::unique_ptr<PrefixCache>> cache =
        PrefixCache::Create(options, backend_.get(), /*budget=*/nullptr);
    ASSERT_THAT(cache.status(), IsOk());
    cache_ = *std::move(cache);
  }

  std::unique_ptr<DaemonSession> NewSession(uint64_t capacity) {
    DaemonSession::Params params;
    params.id = SessionId{next_id_++};
    params.owner = EngineId{1};
    params.cache_scope = kScope;
    params.token = "0123456789abcdef";
    params.model = std::make_shared<const ModelPlan>(FlatPlan());
    params.shape.capacity = capacity;
    absl::StatusOr<std::unique_ptr<DaemonSession>> session =
        DaemonSession::Create(std::move(params), backend_.get(), &session_budget_);
    EXPECT_THAT(session.status(), IsOk());
    return session.ok() ? *std::move(session) : nullptr;
  }

  // One transaction of `rows` rows, committed with `token_ids` (none: ids unknown).
  void CommitRows(DaemonSession& session, uint64_t rows, absl::Span<const int32_t> token_ids) {
    absl::StatusOr<TransactionId> begin = session.Begin();
    ASSERT_THAT(begin, IsOk());
    ASSERT_THAT(session.PrepareAppend(begin->generation, rows), IsOk());
    ASSERT_THAT(session.PublishAppend(begin->generation), IsOk());
    ASSERT_THAT(session.Commit(begin->generation, rows, token_ids), IsOk());
  }

  PlanFingerprint Shape() { return FingerprintModelPlan(FlatPlan(), FormatDefaults()).value(); }

  std::unique_ptr<HostBackend> backend_;
  DeviceBudget session_budget_{uint64_t{1} << 30, "sessions"};
  std::unique_ptr<PrefixCache> cache_;
  uint64_t next_id_ = 1;
};

// A capture is keyed by the ids the session committed: a request naming other ids (or more of
// them) is refused and stores nothing, and the honest capture afterwards is a new entry.
TEST_F(SessionPrefixTest, CaptureStoresOnlyUnderTheCommittedTokenIds) {
  const std::vector<int32_t> committed = Tokens(64);
  std::vector<int32_t> other = committed;
  other[40] = -7;  // another prompt sharing the first 40 ids
  auto session = NewSession(128);
  CommitRows(*session, 64, committed);
  const uint64_t id = session->id().value;
  EXPECT_THAT(CaptureSessionPrefix(*cache_, *session, other, 64).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("token id at position 40 is -7 in the request",
                                  absl::StrCat("session ", id, " committed ", committed[40]))));
  EXPECT_THAT(CaptureSessionPrefix(*cache_, *session, Tokens(80), 64).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("the request gives 80 token ids",
                                  absl::StrCat("session ", id, " committed 64"))));
  EXPECT_EQ(cache_->Stats().entries, 0u);
  EXPECT_EQ(cache_->Lookup(kScope, Shape(), other).outcome, LookupOutcome::kMiss);

  absl::StatusOr<PrefixCaptureResult> honest =
      CaptureSessionPrefix(*cache_, *session, committed, 64);
  ASSERT_THAT(honest.status(), IsOk());
  EXPECT_FALSE(honest->already_present);
  EXPECT_EQ(cache_->Lookup(kScope, Shape(), committed).matched_tokens, 64u);
  EXPECT_EQ(cache_->Lookup(kScope, Shape(), other).matched_tokens, 32u);  // the shared block

  // Committed without token ids: the session's ids are unknown, nothing can be captured (and
  // an engine's death keeps nothing of it).
  auto unknown = NewSession(128);
  CommitRows(*unknown, 32, {});
  EXPECT_THAT(CaptureSessionPrefix(*cache_, *unknown, Tokens(32), 32).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs(absl::StrCat("session ", unknown->id().value,
                                               "'s committed token ids are unknown (32 rows"),
                                  "commit with token ids to capture")));
  absl::StatusOr<std::optional<PrefixCaptureResult>> on_death =
      CaptureCommittedPrefix(*cache_, *unknown);
  ASSERT_THAT(on_death.status(), IsOk());
  EXPECT_FALSE(on_death->has_value());
  EXPECT_EQ(cache_->Stats().entries, 1u);
  EXPECT_EQ(cache_->Stats().death_captures, 0u);
  EXPECT_THAT(cache_->CheckInvariants(), IsOk());
}

// A restore replaces the session's state under its mutex: not while a grow awaits its
// acknowledgement (the engine may still read the old arena). The refusal changes nothing; once
// acknowledged the same restore goes, and the session's committed ids are the restored ones.
TEST_F(SessionPrefixTest, ARestoreWaitsForAnAcknowledgedGrow) {
  const std::vector<int32_t> tokens = Tokens(32);
  auto source = NewSession(64);
  CommitRows(*source, 32, tokens);
  absl::StatusOr<PrefixCaptureResult> captured =
      CaptureSessionPrefix(*cache_, *source, tokens, 32);
  ASSERT_THAT(captured.status(), IsOk());

  auto dest = NewSession(16);
  absl::StatusOr<SessionReport> grown = dest->Grow(64);
  ASSERT_THAT(grown.status(), IsOk());
  ASSERT_TRUE(grown->state.grow_pending);
  const uint64_t version = grown->state.layout_version;
  EXPECT_THAT(RestoreSessionPrefix(*cache_, *dest, captured->entry, tokens).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs(absl::StrCat("session ", dest->id().value,
                                               ": grow to layout version ", version,
                                               " is not acknowledged yet"),
                                  "acknowledge it before a restore")));
  absl::StatusOr<SessionReport> refused = dest->GetState();
  ASSERT_THAT(refused.status(), IsOk());
  EXPECT_EQ(refused->state.committed_len, 0u);
  EXPECT_EQ(cache_->Stats().restores, 0u);

  ASSERT_THAT(dest->AcknowledgeGrow(version), IsOk());
  absl::StatusOr<PrefixRestoreResult> restored =
      RestoreSessionPrefix(*cache_, *dest, captured->entry, tokens);
  ASSERT_THAT(restored.status(), IsOk());
  EXPECT_EQ(restored->entry.value, captured->entry.value);
  EXPECT_EQ(restored->restored_tokens, 32u);
  EXPECT_EQ(cache_->Stats().restores, 1u);
  // The restored rows carry their ids: the destination captures them as the same entry.
  absl::StatusOr<PrefixCaptureResult> again = CaptureSessionPrefix(*cache_, *dest, tokens, 32);
  ASSERT_THAT(again.status(), IsOk());
  EXPECT_TRUE(again->already_present);
  EXPECT_EQ(again->entry.value, captured->entry.value);
}

// A released session is gone for the prefix cache too: NOT_FOUND naming it, nothing stored.
TEST_F(SessionPrefixTest, AReleasedSessionIsNotFound) {
  const std::vector<int32_t> tokens = Tokens(32);
  auto session = NewSession(64);
  CommitRows(*session, 32, tokens);
  session->Release();
  const std::string released = absl::StrCat("session ", session->id().value, " was released");
  EXPECT_THAT(CaptureSessionPrefix(*cache_, *session, tokens, 32).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs(released)));
  EXPECT_THAT(CaptureCommittedPrefix(*cache_, *session).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs(released)));
  EXPECT_THAT(RestoreSessionPrefix(*cache_, *session, std::nullopt, tokens).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs(released)));
  EXPECT_EQ(cache_->Stats().entries, 0u);
}

}  // namespace
}  // namespace memra
