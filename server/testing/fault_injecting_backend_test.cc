#include "server/testing/fault_injecting_backend.h"

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/device/host_backend.h"
#include "server/testing/test_host_backend.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;
using ::testing::Each;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

class FaultInjectingBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    host_ = testing::NewTestHostBackend(testing::TestHostBackendOptions());
    ASSERT_NE(host_, nullptr);
    faulty_ = std::make_unique<FaultInjectingBackend>(host_.get());
  }

  ArenaId MustCreate() {
    absl::StatusOr<ArenaId> arena = faulty_->CreateArena(1, ArenaVisibility::kExported);
    EXPECT_THAT(arena, IsOk());
    return arena.value_or(ArenaId{});
  }

  std::unique_ptr<HostBackend> host_;
  std::unique_ptr<FaultInjectingBackend> faulty_;
};

TEST_F(FaultInjectingBackendTest, ForwardsEverythingWhenUnarmed) {
  EXPECT_EQ(faulty_->Name(), "host");
  EXPECT_EQ(faulty_->AllocationGranularity(), host_->AllocationGranularity());
  const ArenaId arena = MustCreate();
  EXPECT_EQ(faulty_->ArenaCount(), 1u);
  EXPECT_EQ(faulty_->AllocatedBytes(), host_->AllocatedBytes());
  EXPECT_EQ(faulty_->Info().free_bytes, host_->Info().free_bytes);
  ASSERT_THAT(faulty_->WriteI32(arena, 0, 77), IsOk());
  absl::StatusOr<int32_t> value = host_->ReadI32(arena, 0);
  ASSERT_THAT(value, IsOk());
  EXPECT_EQ(*value, 77);
  absl::StatusOr<ArenaExport> exported = faulty_->Export(arena);
  ASSERT_THAT(exported, IsOk());
  EXPECT_EQ(exported->backend, "host");
  // Errors of the wrapped backend come through unchanged.
  EXPECT_THAT(faulty_->ReadI32(arena, exported->bytes),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ReadI32")));
  ASSERT_THAT(faulty_->FreeArena(arena), IsOk());
  EXPECT_EQ(faulty_->CallCount(BackendOp::kWriteI32), 1u);
  EXPECT_EQ(faulty_->CallCount(BackendOp::kReadI32), 1u);
  EXPECT_EQ(faulty_->InjectedFailures(), 0u);
}

TEST_F(FaultInjectingBackendTest, FailsOnlyTheNthCallAndLeavesTheTargetUntouched) {
  const ArenaId arena = MustCreate();
  ASSERT_THAT(faulty_->FailNthCall(BackendOp::kWrite, 3, absl::DataLossError("injected")), IsOk());
  const std::vector<uint8_t> bytes = {1, 2, 3, 4};
  EXPECT_THAT(faulty_->Write(arena, 0, bytes), IsOk());
  EXPECT_THAT(faulty_->Write(arena, 4, bytes), IsOk());
  EXPECT_THAT(faulty_->Write(arena, 8, bytes),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("injected")));
  std::vector<uint8_t> third(4);
  ASSERT_THAT(host_->Read(arena, 8, absl::MakeSpan(third)), IsOk());
  EXPECT_THAT(third, Each(0));  // the failed call never reached the host backend
  EXPECT_THAT(faulty_->Write(arena, 8, bytes), IsOk());  // one-shot
  EXPECT_EQ(faulty_->CallCount(BackendOp::kWrite), 4u);
  EXPECT_EQ(faulty_->InjectedFailures(), 1u);
}

TEST_F(FaultInjectingBackendTest, FailedCreateAllocatesNothing) {
  ASSERT_THAT(faulty_->FailNthCall(BackendOp::kCreateArena, 1,
                                   absl::ResourceExhaustedError("injected out of memory")),
              IsOk());
  EXPECT_THAT(faulty_->CreateArena(1, ArenaVisibility::kPrivate),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("injected out of memory")));
  EXPECT_EQ(host_->ArenaCount(), 0u);
  EXPECT_EQ(host_->AllocatedBytes(), 0u);
}

TEST_F(FaultInjectingBackendTest, ArmsArePerOpAndCanBeReplacedOrDisarmed) {
  const ArenaId arena = MustCreate();
  ASSERT_THAT(faulty_->FailNthCall(BackendOp::kMemset, 1, absl::InternalError("first")), IsOk());
  ASSERT_THAT(faulty_->FailNthCall(BackendOp::kMemset, 2, absl::InternalError("second")), IsOk());
  ASSERT_THAT(faulty_->FailNthCall(BackendOp::kCopy, 1, absl::InternalError("copy")), IsOk());
  EXPECT_THAT(faulty_->Memset(arena, 0, 1, 1), IsOk());  // the replaced arm counts from 2
  EXPECT_THAT(faulty_->Memset(arena, 0, 1, 1),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("second")));
  faulty_->Disarm(BackendOp::kCopy);
  EXPECT_THAT(faulty_->Copy(arena, 0, arena, 1, 1), IsOk());
  EXPECT_EQ(faulty_->InjectedFailures(), 1u);
}

TEST_F(FaultInjectingBackendTest, AHeldOpWaitsUntilUnheldAndOthersGoOn) {
  const ArenaId arena = MustCreate();
  faulty_->Hold(BackendOp::kMemset);
  std::atomic<bool> done{false};
  std::thread held([&] {
    EXPECT_THAT(faulty_->Memset(arena, 0, 7, 1), IsOk());
    done = true;
  });
  while (faulty_->HeldCalls(BackendOp::kMemset) == 0) std::this_thread::yield();
  EXPECT_THAT(faulty_->Copy(arena, 0, arena, 1, 1), IsOk());  // another op is not held
  EXPECT_FALSE(done.load());
  EXPECT_EQ(faulty_->HeldCalls(BackendOp::kMemset), 1u);
  faulty_->Unhold(BackendOp::kMemset);
  held.join();
  EXPECT_TRUE(done.load());
  EXPECT_EQ(faulty_->HeldCalls(BackendOp::kMemset), 0u);
  EXPECT_EQ(faulty_->CallCount(BackendOp::kMemset), 1u);
}

TEST_F(FaultInjectingBackendTest, BadArmingIsRefused) {
  EXPECT_THAT(
      faulty_->FailNthCall(BackendOp::kRead, 0, absl::InternalError("x")),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("FailNthCall(Read", "n = 0")));
  EXPECT_THAT(faulty_->FailNthCall(BackendOp::kRead, 1, absl::OkStatus()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("an error", "OK")));
}

TEST_F(FaultInjectingBackendTest, EveryFallibleOpCanBeFailed) {
  const ArenaId arena = MustCreate();
  uint8_t byte = 0;
  const std::vector<std::pair<BackendOp, std::function<absl::Status()>>> calls = {
      {BackendOp::kCreateArena,
       [&] { return faulty_->CreateArena(1, ArenaVisibility::kPrivate).status(); }},
      {BackendOp::kExport, [&] { return faulty_->Export(arena).status(); }},
      {BackendOp::kFreeArena, [&] { return faulty_->FreeArena(arena); }},
      {BackendOp::kMemset, [&] { return faulty_->Memset(arena, 0, 1, 1); }},
      {BackendOp::kCopy, [&] { return faulty_->Copy(arena, 0, arena, 1, 1); }},
      {BackendOp::kWriteI32, [&] { return faulty_->WriteI32(arena, 0, 1); }},
      {BackendOp::kWriteI32s,
       [&] {
         const I32Write write{.offset = 0, .value = 1};
         return faulty_->WriteI32s(arena, {&write, 1});
       }},
      {BackendOp::kReadI32, [&] { return faulty_->ReadI32(arena, 0).status(); }},
      {BackendOp::kWrite,
       [&] {
         return faulty_->Write(arena, 0, {&byte, 1});
       }},
      {BackendOp::kRead,
       [&] {
         return faulty_->Read(arena, 0, {&byte, 1});
       }},
      {BackendOp::kCopyRangesChecksummed,
       [&] {
         const CopyRange range{.dst_offset = 0, .src_offset = 0, .bytes = 1};
         return faulty_->CopyRangesChecksummed(arena, ArenaId{arena.value + 1}, {&range, 1})
             .status();
       }},
      {BackendOp::kSynchronize, [&] { return faulty_->Synchronize(); }},
      {BackendOp::kWaitForEngineEvent, [&] { return faulty_->WaitForEngineEvent(""); }},
  };
  ASSERT_EQ(calls.size(), kBackendOpCount);
  for (const auto& [op, call] : calls) {
    const std::string name(BackendOpName(op));
    const uint64_t calls_before = faulty_->CallCount(op);
    ASSERT_THAT(faulty_->FailNthCall(op, 1, absl::UnavailableError(name)), IsOk());
    EXPECT_THAT(call(), StatusIs(absl::StatusCode::kUnavailable, name)) << name;
    EXPECT_EQ(faulty_->CallCount(op), calls_before + 1) << name;
  }
  // Nothing reached the host backend: the arena is still there, still zero.
  EXPECT_EQ(host_->ArenaCount(), 1u);
  absl::StatusOr<int32_t> value = host_->ReadI32(arena, 0);
  ASSERT_THAT(value, IsOk());
  EXPECT_EQ(*value, 0);
}

TEST_F(FaultInjectingBackendTest, ExactlyOneOfManyConcurrentCallsFails) {
  const ArenaId arena = MustCreate();
  constexpr int kThreads = 4;
  constexpr int kCallsEach = 100;
  ASSERT_THAT(faulty_->FailNthCall(BackendOp::kMemset, 250, absl::AbortedError("injected")),
              IsOk());
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kCallsEach; ++i) {
        if (!faulty_->Memset(arena, 0, 1, 8).ok()) failures.fetch_add(1);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 1);
  EXPECT_EQ(faulty_->CallCount(BackendOp::kMemset), uint64_t{kThreads * kCallsEach});
  EXPECT_EQ(faulty_->InjectedFailures(), 1u);
}

}  // namespace
}  // namespace memra
