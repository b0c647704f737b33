#include "common/grpc_status.h"

#include <optional>

#include "common/daemon_restart.h"
#include "core/admission.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::StatusIs;

TEST(GrpcStatusTest, CodeAndMessageRoundTrip) {
  const absl::Status status = absl::FailedPreconditionError("session 3: stale generation 7");
  const grpc::Status wire = ToGrpcStatus(status);
  EXPECT_EQ(wire.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(wire.error_details().empty());
  EXPECT_EQ(FromGrpcStatus(wire), status);
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
}

// The refusal's numbers cross the wire as structured fields, not just text.
TEST(GrpcStatusTest, AdmissionRefusalNumbersRoundTrip) {
  AdmissionLedger ledger(1000);
  ASSERT_TRUE(ledger.Allocate(1, 700).ok());
  ledger.SetEvictable(200);
  const absl::Status refused = ledger.Allocate(2, 450).status();
  const grpc::Status wire = ToGrpcStatus(refused);
  EXPECT_EQ(wire.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_FALSE(wire.error_details().empty());
  const absl::Status back = FromGrpcStatus(wire);
  EXPECT_THAT(back, StatusIs(absl::StatusCode::kResourceExhausted,
                             HasSubstrs("needs 450 bytes", "300 free", "(200 evictable)")));
  std::optional<AdmissionRefusal> refusal = GetAdmissionRefusal(back);
  ASSERT_TRUE(refusal.has_value());
  EXPECT_EQ(*refusal, (AdmissionRefusal{.needed = 450,
                                        .free = 300,
                                        .evictable = 200,
                                        .budget = 1000,
                                        .bytes_to_evict = 150}));
}

// The restart error's two epochs cross the wire, so the client tells it from any other refusal.
TEST(GrpcStatusTest, DaemonRestartEpochsRoundTrip) {
  const absl::Status restarted = DaemonRestartedError(
      DaemonRestart{.previous_epoch = 41, .epoch = 42}, "session 3 was not re-adopted: no arena");
  EXPECT_EQ(restarted.code(), absl::StatusCode::kFailedPrecondition);
  const absl::Status back = FromGrpcStatus(ToGrpcStatus(restarted));
  EXPECT_THAT(back, StatusIs(absl::StatusCode::kFailedPrecondition,
                             HasSubstrs("memra-kvd restarted (epoch 41 -> 42); session 3")));
  EXPECT_EQ(GetDaemonRestart(back), (DaemonRestart{.previous_epoch = 41, .epoch = 42}));
  EXPECT_FALSE(GetAdmissionRefusal(back).has_value());
  EXPECT_FALSE(GetDaemonRestart(absl::FailedPreconditionError("stale generation")).has_value());
  EXPECT_FALSE(GetDaemonRestart(absl::NotFoundError("session 3 does not exist")).has_value());
}

TEST(GrpcStatusTest, ForeignDetailsAreIgnored) {
  const grpc::Status wire(grpc::StatusCode::RESOURCE_EXHAUSTED, "no room", "\xff\xff not a proto");
  const absl::Status back = FromGrpcStatus(wire);
  EXPECT_THAT(back, StatusIs(absl::StatusCode::kResourceExhausted, HasSubstrs("no room")));
  EXPECT_FALSE(GetAdmissionRefusal(back).has_value());
}

}  // namespace
}  // namespace memra
