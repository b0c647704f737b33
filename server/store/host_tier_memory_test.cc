#include "server/store/host_tier_memory.h"

#include <cstdint>
#include <algorithm>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/store/slab_allocator.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;

TEST(HostTierMemoryTest, SlabsAreZeroedWritableAndBoundsChecked) {
  HostTierMemory memory(NewPlainHostMemory());
  EXPECT_EQ(memory.provider_name(), "host");
  absl::StatusOr<uint64_t> rounded = memory.RoundedSlabBytes(5000);
  ASSERT_THAT(rounded.status(), IsOk());
  EXPECT_EQ(*rounded % 4096, 0u);
  EXPECT_GE(*rounded, 5000u);
  absl::StatusOr<ArenaId> slab = memory.CreateSlab(*rounded);
  ASSERT_THAT(slab.status(), IsOk());
  EXPECT_EQ(memory.allocated_bytes(), *rounded);
  absl::StatusOr<absl::Span<uint8_t>> bytes = memory.Bytes(*slab, 100, 200);
  ASSERT_THAT(bytes.status(), IsOk());
  for (uint8_t byte : *bytes) ASSERT_EQ(byte, 0);
  (*bytes)[7] = 0x42;
  EXPECT_EQ((*memory.Bytes(*slab, 107, 1))[0], 0x42);
  EXPECT_THAT(memory.Bytes(*slab, *rounded - 10, 11).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs(absl::StrCat("[", *rounded - 10, ", ", *rounded + 1, ")"),
                                  absl::StrCat(*rounded, " bytes"))));
  EXPECT_THAT(memory.Bytes(*slab, UINT64_MAX, 2).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("overflow")));
  EXPECT_THAT(memory.Bytes(ArenaId{99}, 0, 1).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs("no slab 99")));
  EXPECT_THAT(memory.CreateSlab(*rounded + 1).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("not rounded")));
  EXPECT_THAT(memory.RoundedSlabBytes(0).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("0 bytes")));
  ASSERT_THAT(memory.FreeSlab(*slab), IsOk());
  EXPECT_EQ(memory.allocated_bytes(), 0u);
  EXPECT_THAT(memory.FreeSlab(*slab),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs("no slab")));
}

// A SlabAllocator carves spans out of host-tier slabs as it does out of backend arenas.
TEST(HostTierMemoryTest, ASlabAllocatorSubAllocatesIt) {
  HostTierMemory memory(NewPlainHostMemory());
  SlabAllocatorOptions options;
  options.slab_bytes = 64 << 10;
  absl::StatusOr<std::unique_ptr<SlabAllocator>> slabs =
      SlabAllocator::Create(options, &memory, nullptr);
  ASSERT_THAT(slabs.status(), IsOk());
  std::vector<SlabSpan> spans;
  for (int i = 0; i < 100; ++i) {
    absl::StatusOr<SlabSpan> span = (*slabs)->Allocate(1000);
    ASSERT_THAT(span.status(), IsOk());
    ASSERT_THAT((*slabs)->Release(span->slab), IsOk());
    absl::StatusOr<absl::Span<uint8_t>> bytes = memory.Bytes(span->slab, span->offset, 1000);
    ASSERT_THAT(bytes.status(), IsOk());
    std::fill(bytes->begin(), bytes->end(), static_cast<uint8_t>(i));
    spans.push_back(*span);
  }
  EXPECT_EQ((*slabs)->Stats().slabs, 2u);  // 100 spans of 1024 bytes in 64 KiB slabs
  EXPECT_EQ(memory.allocated_bytes(), uint64_t{128} << 10);
  for (size_t i = 0; i < spans.size(); ++i) {
    absl::StatusOr<absl::Span<uint8_t>> bytes = memory.Bytes(spans[i].slab, spans[i].offset, 1000);
    ASSERT_THAT(bytes.status(), IsOk());
    for (uint8_t byte : *bytes) ASSERT_EQ(byte, static_cast<uint8_t>(i));
  }
  for (const SlabSpan& span : spans) ASSERT_THAT((*slabs)->Free(span), IsOk());
  EXPECT_THAT((*slabs)->CheckInvariants(), IsOk());
  slabs->reset();
  EXPECT_EQ(memory.allocated_bytes(), 0u);
}

}  // namespace
}  // namespace memra
