#include "common/step_channel.h"

#include <sys/mman.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra::step_channel {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;

TEST(StepChannelLayoutTest, PartsArePageAlignedAndDoNotOverlap) {
  const Layout layout = LayoutFor(kSlots);
  EXPECT_EQ(layout.submissions_offset, kHeaderBytes);
  EXPECT_EQ(layout.completions_offset, kHeaderBytes + kSlots * sizeof(SubmissionRecord));
  EXPECT_EQ(layout.submission_side_offset,
            layout.completions_offset + kSlots * sizeof(CompletionRecord));
  EXPECT_EQ(layout.completion_side_offset,
            layout.submission_side_offset + uint64_t{kSlots} * kSubmissionSideBytes);
  EXPECT_EQ(layout.region_bytes,
            layout.completion_side_offset + uint64_t{kSlots} * kCompletionSideBytes);
  EXPECT_EQ(layout.region_bytes, 4804608u);  // docs/step-channel.md's table
  for (uint64_t offset : {layout.submissions_offset, layout.completions_offset,
                          layout.submission_side_offset, layout.completion_side_offset,
                          layout.region_bytes}) {
    EXPECT_EQ(offset % 4096, 0u) << offset;
  }
  // The ring slot count is a power of two: a free-running u32 counter wraps onto the same index.
  EXPECT_EQ(kSlots & (kSlots - 1), 0u);
  EXPECT_EQ((uint32_t{0} - 1) % kSlots, kSlots - 1);
}

TEST(StepChannelLayoutTest, AnInitializedHeaderPassesTheEnginesCheck) {
  const Layout layout = LayoutFor(kSlots);
  std::vector<uint8_t> region(layout.region_bytes, 0xee);
  InitializeHeader(region.data());
  const auto& header = *reinterpret_cast<const StepChannelHeader*>(region.data());
  EXPECT_THAT(CheckHeader(header, layout.region_bytes), IsOk());
  EXPECT_EQ(header.sq_tail.load(), 0u);
  EXPECT_EQ(header.cq_tail.load(), 0u);
  EXPECT_EQ(header.closed.load(), 0u);
  EXPECT_THAT(CheckHeader(header, layout.region_bytes - 1),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("region of 4804607 bytes", "needs 4804608")));
}

TEST(StepChannelLayoutTest, EveryConstantFieldIsCheckedWithBothValues) {
  const Layout layout = LayoutFor(kSlots);
  std::vector<uint8_t> region(layout.region_bytes, 0);
  InitializeHeader(region.data());
  auto& header = *reinterpret_cast<StepChannelHeader*>(region.data());
  // A version-1 daemon's region, met by this (version 2) library.
  header.version = kPreviousVersion;
  EXPECT_THAT(CheckHeader(header, layout.region_bytes),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("version is 1", "speaks 2")));
  header.version = kVersion;
  header.magic = 0;
  EXPECT_THAT(CheckHeader(header, layout.region_bytes),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("magic is 0")));
  header.magic = kMagic;
  header.completion_side_offset += 4096;
  EXPECT_THAT(CheckHeader(header, layout.region_bytes),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("completion_side_offset is 614400", "speaks 610304")));
}

TEST(StepChannelFutexTest, AWaitEndsAtItsTimeoutOrAtAWake) {
  // A shared mapping, as the channel's region is.
  void* memory = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(memory, MAP_FAILED);
  auto* word = new (memory) std::atomic<uint32_t>(0);
  absl::Time start = absl::Now();
  FutexWait(*word, 0, absl::Milliseconds(20));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(15));
  // A word that already differs returns at once.
  start = absl::Now();
  FutexWait(*word, 1, absl::Seconds(10));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // A waiter is woken by a store and FutexWakeAll, long before its timeout.
  std::atomic<bool> woke{false};
  std::thread waiter([&] {
    while (word->load() == 0) FutexWait(*word, 0, absl::Seconds(30));
    woke = true;
  });
  absl::SleepFor(absl::Milliseconds(20));
  start = absl::Now();
  word->store(1);
  FutexWakeAll(*word);
  waiter.join();
  EXPECT_TRUE(woke);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  munmap(memory, 4096);
}

// A prepared plan's layers go through the completion side span as LayerAppendRecords: every
// kind of core LayerAppend comes back equal, with its flags and numbers where the layout says.
TEST(StepChannelLayoutTest, LayerAppendRecordsCarryEveryKindOfLayerAppend) {
  const std::vector<LayerAppend> layers = {
      LayerAppend{.layer = 0, .write_row = 17, .ring_append = std::nullopt},
      LayerAppend{.layer = 3, .write_row = 9, .ring_append = RingAppend::Contiguous(9)},
      LayerAppend{.layer = 7,
                  .write_row = 2,
                  .ring_append = RingAppend::Rebase(4096, 511, 8192, 2)},
  };
  const LayerAppendRecord rebase = ToRecord(layers[2]);
  EXPECT_EQ(rebase.layer, 7u);
  EXPECT_EQ(rebase.flags, kLayerRing | kLayerRebase);
  EXPECT_EQ(rebase.write_row, 2u);
  EXPECT_EQ(rebase.src_row, 4096u);
  EXPECT_EQ(rebase.keep_rows, 511u);
  EXPECT_EQ(rebase.new_base, 8192u);
  EXPECT_EQ(ToRecord(layers[0]).flags, 0u);
  EXPECT_EQ(ToRecord(layers[1]).flags, kLayerRing);
  for (const LayerAppend& layer : layers) {
    LayerAppendRecord record = ToRecord(layer);
    uint8_t bytes[sizeof(LayerAppendRecord)];
    std::memcpy(bytes, &record, sizeof(record));  // as the side span carries it
    std::memcpy(&record, bytes, sizeof(record));
    EXPECT_EQ(FromRecord(record), layer) << "layer " << layer.layer;
  }
}

}  // namespace
}  // namespace memra::step_channel
