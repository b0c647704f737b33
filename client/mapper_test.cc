#include "client/mapper.h"

#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/host_backend.h"
#include "server/test_host_backend.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;
using ::testing::HasSubstr;

// Whether this process has `handle` (an shm name) mapped, per /proc/self/maps.
bool MappedHere(const std::string& handle) {
  std::ifstream maps("/proc/self/maps");
  const std::string path = absl::StrCat("/dev/shm", handle);
  for (std::string line; std::getline(maps, line);) {
    if (line.find(path) != std::string::npos) return true;
  }
  return false;
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

  std::unique_ptr<HostBackend> backend_;
  uint64_t page_ = 0;
  ArenaId arena_;
  ArenaExport export_;
  HostArenaMapper mapper_;
};

TEST_F(HostArenaMapperTest, MappingSharesBytesWithTheDaemon) {
  ASSERT_THAT(backend_->WriteI32(arena_, 16, 0x01020304), IsOk());
  absl::StatusOr<void*> mapped = mapper_.Map(export_.backend, export_.handle, export_.bytes);
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

TEST_F(HostArenaMapperTest, EachHandleIsOpenedOnce) {
  absl::StatusOr<void*> first = mapper_.Map("host", export_.handle, export_.bytes);
  ASSERT_THAT(first, IsOk());
  // Once the daemon unlinks the name a re-open would fail: the cache must answer.
  ASSERT_THAT(backend_->FreeArena(arena_), IsOk());
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<void*> again = mapper_.Map("host", export_.handle, export_.bytes);
    ASSERT_THAT(again, IsOk());
    EXPECT_EQ(*again, *first);
  }
  EXPECT_EQ(mapper_.OpenCount(), 1u);
  EXPECT_EQ(mapper_.MappedCount(), 1u);
}

TEST_F(HostArenaMapperTest, ConcurrentMapsOfOneHandleOpenItOnce) {
  constexpr int kThreads = 4;
  std::vector<void*> seen(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      absl::StatusOr<void*> mapped = mapper_.Map("host", export_.handle, export_.bytes);
      seen[t] = mapped.value_or(nullptr);
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_NE(seen[0], nullptr);
  EXPECT_THAT(seen, ::testing::Each(seen[0]));
  EXPECT_EQ(mapper_.OpenCount(), 1u);
}

TEST_F(HostArenaMapperTest, SizeDisagreementsAreRefusedWithTheNumbers) {
  // First open: the object's real size is checked (mapping past its end would SIGBUS).
  EXPECT_THAT(mapper_.Map("host", export_.handle, 2 * page_),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs(export_.handle, absl::StrCat("holds ", page_, " bytes"),
                                  absl::StrCat("asked for ", 2 * page_))));
  EXPECT_EQ(mapper_.OpenCount(), 0u);
  // Cached: the size it was opened with is checked.
  ASSERT_THAT(mapper_.Map("host", export_.handle, page_), IsOk());
  EXPECT_THAT(mapper_.Map("host", export_.handle, page_ / 2),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs(export_.handle, absl::StrCat("already mapped with ", page_),
                                  absl::StrCat("asked for ", page_ / 2))));
  EXPECT_EQ(mapper_.OpenCount(), 1u);
}

TEST_F(HostArenaMapperTest, ForeignOrMalformedHandlesAreInvalid) {
  EXPECT_THAT(mapper_.Map("cuda", export_.handle, export_.bytes),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("host mapper", "\"cuda\"")));
  EXPECT_THAT(mapper_.Map("host", export_.handle, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("0 bytes")));
  for (const std::string& handle :
       std::vector<std::string>{"", "/", "no-slash", "/a/b", std::string("/a\0b", 4)}) {
    EXPECT_THAT(mapper_.Map("host", handle, page_),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a host arena handle")))
        << handle;
  }
  EXPECT_EQ(mapper_.OpenCount(), 0u);
}

TEST_F(HostArenaMapperTest, UnknownHandlesAreNotFound) {
  const std::string gone = absl::StrCat("/", testing::UniqueShmPrefix(), "-gone");
  EXPECT_THAT(mapper_.Map("host", gone, page_),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs("shm_open", gone)));
  EXPECT_THAT(mapper_.Unmap(export_.handle),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs(export_.handle, "not mapped")));
}

TEST_F(HostArenaMapperTest, UnmapReleasesAndAFreshMapReopens) {
  ASSERT_THAT(mapper_.Map("host", export_.handle, export_.bytes), IsOk());
  EXPECT_TRUE(MappedHere(export_.handle));
  ASSERT_THAT(mapper_.Unmap(export_.handle), IsOk());
  EXPECT_EQ(mapper_.MappedCount(), 0u);
  // The backend's own mapping remains; only the mapper's is gone.
  ASSERT_THAT(backend_->FreeArena(arena_), IsOk());
  EXPECT_FALSE(MappedHere(export_.handle));
  EXPECT_THAT(mapper_.Map("host", export_.handle, export_.bytes),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr(export_.handle)));
  EXPECT_EQ(mapper_.OpenCount(), 1u);
}

TEST_F(HostArenaMapperTest, DestructorUnmapsEverything) {
  auto mapper = std::make_unique<HostArenaMapper>();
  ASSERT_THAT(mapper->Map("host", export_.handle, export_.bytes), IsOk());
  ASSERT_THAT(backend_->FreeArena(arena_), IsOk());
  EXPECT_TRUE(MappedHere(export_.handle));  // only the mapper's mapping is left
  mapper.reset();
  EXPECT_FALSE(MappedHere(export_.handle));
}

}  // namespace
}  // namespace memra
