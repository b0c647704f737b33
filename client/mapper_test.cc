#include "client/mapper.h"

#include <atomic>
#include <cstring>
#include <fstream>
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
using ::testing::HasSubstr;

// Mappings of the test backend's memfds in this process, per /proc/self/maps (the backend's
// own and the mapper's).
int MappingsOfTestArenas() {
  std::ifstream maps("/proc/self/maps");
  const std::string memfd = absl::StrCat("/memfd:", testing::UniqueShmPrefix());
  int count = 0;
  for (std::string line; std::getline(maps, line);) {
    if (line.find(memfd) != std::string::npos) ++count;
  }
  return count;
}

class HostArenaMapperTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = testing::NewTestHostBackend(testing::TestHostBackendOptions());
    ASSERT_NE(backend_, nullptr);
    page_ = backend_->AllocationGranularity();
    absl::StatusOr<ArenaId> arena = backend_->CreateArena(page_, ArenaVisibility::kExported);
    ASSERT_THAT(arena, IsOk());
    arena_ = *arena;
    absl::StatusOr<ArenaExport> exported = backend_->Export(arena_);
    ASSERT_THAT(exported, IsOk());
    export_ = *exported;
  }

  // What the daemon's handoff socket answers for the test arena: its memfd (counted).
  absl::StatusOr<ArenaFd> Fetch() {
    ++fetches_;
    absl::StatusOr<int> fd = backend_->DuplicateArenaFd(arena_);
    if (!fd.ok()) return fd.status();
    return ArenaFd{.fd = ScopedFd(*fd), .bytes = export_.bytes};
  }
  absl::StatusOr<void*> MapTestArena(uint64_t bytes) {
    return mapper_.Map("host", export_.handle, bytes, [this] { return Fetch(); });
  }

  std::unique_ptr<HostBackend> backend_;
  uint64_t page_ = 0;
  ArenaId arena_;
  ArenaExport export_;
  HostArenaMapper mapper_;
  std::atomic<int> fetches_{0};
};

TEST_F(HostArenaMapperTest, MappingSharesBytesWithTheDaemon) {
  ASSERT_THAT(backend_->WriteI32(arena_, 16, 0x01020304), IsOk());
  absl::StatusOr<void*> mapped = MapTestArena(export_.bytes);
  ASSERT_THAT(mapped, IsOk());
  auto* bytes = static_cast<uint8_t*>(*mapped);
  int32_t seen;
  std::memcpy(&seen, bytes + 16, sizeof(seen));
  EXPECT_EQ(seen, 0x01020304);
  bytes[100] = 0x5A;  // the engine's kernel writes; the daemon reads it back
  std::vector<uint8_t> out(1);
  ASSERT_THAT(backend_->Read(arena_, 100, absl::MakeSpan(out)), IsOk());
  EXPECT_EQ(out[0], 0x5A);
}

TEST_F(HostArenaMapperTest, EachHandleIsFetchedAndOpenedOnce) {
  absl::StatusOr<void*> first = MapTestArena(export_.bytes);
  ASSERT_THAT(first, IsOk());
  // Once the daemon freed the arena a fetch would fail: the cache must answer.
  ASSERT_THAT(backend_->FreeArena(arena_), IsOk());
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<void*> again = MapTestArena(export_.bytes);
    ASSERT_THAT(again, IsOk());
    EXPECT_EQ(*again, *first);
  }
  EXPECT_EQ(fetches_.load(), 1);
  EXPECT_EQ(mapper_.OpenCount(), 1u);
  EXPECT_EQ(mapper_.MappedCount(), 1u);
}

TEST_F(HostArenaMapperTest, ConcurrentMapsOfOneHandleOpenItOnce) {
  constexpr int kThreads = 4;
  std::vector<void*> seen(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      absl::StatusOr<void*> mapped = MapTestArena(export_.bytes);
      seen[t] = mapped.value_or(nullptr);
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_NE(seen[0], nullptr);
  EXPECT_THAT(seen, ::testing::Each(seen[0]));
  EXPECT_EQ(mapper_.OpenCount(), 1u);
  EXPECT_EQ(fetches_.load(), 1);
}

TEST_F(HostArenaMapperTest, SizeDisagreementsAreRefusedWithTheNumbers) {
  // First open: the descriptor's real size is checked (mapping past its end would SIGBUS).
  EXPECT_THAT(MapTestArena(2 * page_),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs(export_.handle, absl::StrCat("holds ", page_, " bytes"),
                                  absl::StrCat("asked for ", 2 * page_))));
  EXPECT_EQ(mapper_.OpenCount(), 0u);
  // Cached: the size it was opened with is checked.
  ASSERT_THAT(MapTestArena(page_), IsOk());
  EXPECT_THAT(MapTestArena(page_ / 2),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs(export_.handle, absl::StrCat("already mapped with ", page_),
                                  absl::StrCat("asked for ", page_ / 2))));
  EXPECT_EQ(mapper_.OpenCount(), 1u);
}

TEST_F(HostArenaMapperTest, ForeignOrMalformedHandlesAreInvalid) {
  auto fetch = [this] { return Fetch(); };
  EXPECT_THAT(mapper_.Map("cuda", export_.handle, export_.bytes, fetch),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("host mapper", "\"cuda\"")));
  EXPECT_THAT(mapper_.Map("host", export_.handle, 0, fetch),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("0 bytes")));
  for (const std::string& handle : std::vector<std::string>{"", std::string(257, 'h')}) {
    EXPECT_THAT(mapper_.Map("host", handle, page_, fetch),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstrs("not a host arena handle", "1 to 256 bytes")))
        << handle;
  }
  EXPECT_EQ(mapper_.OpenCount(), 0u);
  EXPECT_EQ(fetches_.load(), 0);
}

TEST_F(HostArenaMapperTest, RefusedFetchesPassThroughAndCacheNothing) {
  EXPECT_THAT(mapper_.Map("host", export_.handle, page_,
                          []() -> absl::StatusOr<ArenaFd> {
                            return absl::PermissionDeniedError(
                                "session 3 belongs to engine 1; this handoff connection is "
                                "engine 2's");
                          }),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstrs("engine 1", "engine 2")));
  // Without a descriptor source a host arena cannot be mapped at all.
  EXPECT_THAT(mapper_.Map("host", export_.handle, page_),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("handoff socket")));
  EXPECT_EQ(mapper_.MappedCount(), 0u);
  ASSERT_THAT(backend_->FreeArena(arena_), IsOk());
  EXPECT_THAT(MapTestArena(page_),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("DuplicateArenaFd")));
  EXPECT_THAT(mapper_.Unmap(export_.handle),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs(export_.handle, "not mapped")));
  EXPECT_EQ(mapper_.OpenCount(), 0u);
}

TEST_F(HostArenaMapperTest, UnmapReleasesAndAFreshMapFetchesAgain) {
  ASSERT_EQ(MappingsOfTestArenas(), 1);  // the backend's
  ASSERT_THAT(MapTestArena(export_.bytes), IsOk());
  EXPECT_EQ(MappingsOfTestArenas(), 2);
  ASSERT_THAT(mapper_.Unmap(export_.handle), IsOk());
  EXPECT_EQ(mapper_.MappedCount(), 0u);
  EXPECT_EQ(MappingsOfTestArenas(), 1);
  ASSERT_THAT(MapTestArena(export_.bytes), IsOk());
  EXPECT_EQ(fetches_.load(), 2);
  EXPECT_EQ(mapper_.OpenCount(), 2u);
}

TEST_F(HostArenaMapperTest, DestructorUnmapsEverything) {
  auto mapper = std::make_unique<HostArenaMapper>();
  ASSERT_THAT(mapper->Map("host", export_.handle, export_.bytes, [this] { return Fetch(); }),
              IsOk());
  ASSERT_THAT(backend_->FreeArena(arena_), IsOk());
  EXPECT_EQ(MappingsOfTestArenas(), 1);  // only the mapper's mapping is left
  mapper.reset();
  EXPECT_EQ(MappingsOfTestArenas(), 0);
}

}  // namespace
}  // namespace memra
