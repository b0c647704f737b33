#include "server/device/host_backend.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "common/mapped_region.h"
#include "server/testing/test_host_backend.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::IsOkAndHolds;
using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::NewTestHostBackend;
using ::memra::testing::StatusIs;
using ::memra::testing::TestHostBackendOptions;
using ::testing::Each;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::MatchesRegex;

// tests/status_matchers.h has no value matcher yet; this is the one this file needs.
constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();

std::set<std::string> DevShmEntries() {
  std::set<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    names.insert(entry.path().filename().string());
  }
  return names;
}

size_t OpenDescriptors() {
  size_t count = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    ++count;
  }
  return count;
}

std::vector<uint8_t> ReadAll(DeviceBackend& backend, ArenaId arena, uint64_t offset,
                             uint64_t bytes) {
  std::vector<uint8_t> out(bytes);
  EXPECT_THAT(backend.Read(arena, offset, absl::MakeSpan(out)), IsOk());
  return out;
}

class HostBackendTest : public ::testing::Test {
 protected:
  void SetUp() override { backend_ = MakeBackend(DefaultOptions()); }

  static HostBackendOptions DefaultOptions() { return TestHostBackendOptions(64 * kMiB); }
  static std::unique_ptr<HostBackend> MakeBackend(HostBackendOptions options) {
    return NewTestHostBackend(std::move(options));
  }

  ArenaId MustCreate(uint64_t bytes, ArenaVisibility visibility = ArenaVisibility::kExported) {
    absl::StatusOr<ArenaId> arena = backend_->CreateArena(bytes, visibility);
    EXPECT_THAT(arena, IsOk());
    return arena.value_or(ArenaId{});
  }

  std::string MustExport(ArenaId arena) {
    absl::StatusOr<ArenaExport> exported = backend_->Export(arena);
    EXPECT_THAT(exported, IsOk());
    return exported.ok() ? exported->handle : "";
  }

  uint64_t page() const { return backend_->AllocationGranularity(); }

  std::unique_ptr<HostBackend> backend_;
};

TEST_F(HostBackendTest, ArenasAreZeroFilledAndRoundedToPages) {
  ASSERT_EQ(page() & (page() - 1), 0u);
  EXPECT_THAT(backend_->RoundedArenaBytes(1), IsOkAndHolds(page()));
  EXPECT_THAT(backend_->RoundedArenaBytes(page() + 1), IsOkAndHolds(2 * page()));

  const ArenaId exported = MustCreate(page() + 1);
  const ArenaId priv = MustCreate(3, ArenaVisibility::kPrivate);
  EXPECT_NE(exported, priv);
  EXPECT_THAT(ReadAll(*backend_, exported, 0, 2 * page()), Each(0));
  EXPECT_THAT(ReadAll(*backend_, priv, 0, page()), Each(0));
  EXPECT_EQ(backend_->AllocatedBytes(), 3 * page());
  EXPECT_EQ(backend_->ArenaCount(), 2u);

  absl::StatusOr<ArenaExport> info = backend_->Export(exported);
  ASSERT_THAT(info, IsOk());
  EXPECT_EQ(info->backend, "host");
  EXPECT_EQ(info->bytes, 2 * page());
}

TEST_F(HostBackendTest, ZeroAndOverflowingSizesAreRefused) {
  EXPECT_THAT(backend_->CreateArena(0, ArenaVisibility::kExported),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("arena of 0 bytes")));
  EXPECT_THAT(backend_->CreateArena(kMax - 1, ArenaVisibility::kPrivate),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs(absl::StrCat(kMax - 1), "overflows when rounded up to",
                                  absl::StrCat(page()))));
  EXPECT_EQ(backend_->ArenaCount(), 0u);
}

TEST_F(HostBackendTest, CapacityIsEnforcedWithNumbersAndChangesNothing) {
  HostBackendOptions options = DefaultOptions();
  options.total_bytes = 16 * page();
  backend_ = MakeBackend(options);
  const ArenaId arena = MustCreate(10 * page());
  EXPECT_THAT(backend_->CreateArena(8 * page(), ArenaVisibility::kExported),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstrs(absl::StrCat("arena of ", 8 * page(), " bytes does not fit"),
                                  absl::StrCat(10 * page(), " of ", 16 * page(), " bytes in use"),
                                  absl::StrCat(6 * page(), " free"))));
  EXPECT_EQ(backend_->AllocatedBytes(), 10 * page());
  EXPECT_EQ(backend_->ArenaCount(), 1u);
  EXPECT_EQ(backend_->Info().free_bytes, 6 * page());
  // Exactly the remainder fits.
  EXPECT_THAT(backend_->CreateArena(6 * page(), ArenaVisibility::kPrivate), IsOk());
  EXPECT_THAT(backend_->FreeArena(arena), IsOk());
}

TEST_F(HostBackendTest, ExportHandlesAre128RandomBitsAndNameNothingInDevShm) {
  const std::set<std::string> before = DevShmEntries();
  const ArenaId arena = MustCreate(1);
  const std::string a = MustExport(arena);
  const std::string b = MustExport(MustCreate(1));
  EXPECT_THAT(a, MatchesRegex("[0-9a-f]{32}"));
  EXPECT_THAT(b, MatchesRegex("[0-9a-f]{32}"));
  EXPECT_NE(a, b);
  EXPECT_EQ(MustExport(arena), a);  // stable for the arena's life
  // Nothing of the arenas has a name in /dev/shm (or anywhere): only descriptors reach them.
  EXPECT_EQ(DevShmEntries(), before);
}

TEST_F(HostBackendTest, ArenaDescriptorIsSealedAtItsSize) {
  const ArenaId arena = MustCreate(page());
  absl::StatusOr<int> fd = backend_->DuplicateArenaFd(arena);
  ASSERT_THAT(fd, IsOk());
  ScopedFd owned(*fd);
  EXPECT_EQ(fcntl(owned.get(), F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
  struct stat st;
  ASSERT_EQ(fstat(owned.get(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), page());
  EXPECT_EQ(fcntl(owned.get(), F_GET_SEALS), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  // An engine holding the descriptor cannot shrink it under the daemon (SIGBUS on its next
  // touch), grow it, or lift the seals.
  EXPECT_EQ(ftruncate(owned.get(), 0), -1);
  EXPECT_EQ(errno, EPERM);
  EXPECT_EQ(ftruncate(owned.get(), static_cast<off_t>(2 * page())), -1);
  EXPECT_EQ(errno, EPERM);
  EXPECT_EQ(fcntl(owned.get(), F_ADD_SEALS, F_SEAL_WRITE), -1);
  EXPECT_EQ(errno, EPERM);
  EXPECT_THAT(backend_->WriteI32(arena, page() - 4, 9), IsOk());
}

TEST_F(HostBackendTest, BadOptionsAreRefused) {
  HostBackendOptions options = DefaultOptions();
  options.total_bytes = 0;
  EXPECT_THAT(HostBackend::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("total_bytes", "got 0")));
  options = DefaultOptions();
  options.name_prefix = "../etc";
  EXPECT_THAT(HostBackend::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("name_prefix", "../etc")));
  options.name_prefix = "";
  EXPECT_THAT(HostBackend::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("name_prefix")));
}

TEST_F(HostBackendTest, AnotherMappingOfTheDescriptorSeesTheSameBytes) {
  const ArenaId arena = MustCreate(page());
  const std::vector<uint8_t> message = {1, 2, 3, 4, 5};
  ASSERT_THAT(backend_->Write(arena, 100, message), IsOk());

  absl::StatusOr<int> fd = backend_->DuplicateArenaFd(arena);
  ASSERT_THAT(fd, IsOk());
  void* mapped = mmap(nullptr, page(), PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0);
  close(*fd);
  ASSERT_NE(mapped, MAP_FAILED);
  auto* bytes = static_cast<uint8_t*>(mapped);
  EXPECT_EQ(std::vector<uint8_t>(bytes + 100, bytes + 105), message);
  bytes[200] = 42;  // an engine's kernel writing
  EXPECT_THAT(backend_->ReadI32(arena, 200), IsOkAndHolds(42));
  munmap(mapped, page());
  ASSERT_THAT(backend_->FreeArena(arena), IsOk());
}

// Issue 31 item 8: an engine that kept its mapping and descriptor of a released arena kept the
// daemon's pages alive outside the budget. Freed, the arena's pages are punched out: the stale
// mapping stays valid memory that reads zeros, the memfd keeps its size and holds no blocks,
// and only what the engine touches again is allocated (its own memory). Private arenas and
// arenas not freed are untouched.
TEST_F(HostBackendTest, AFreedArenaTakesItsPagesFromEveryMappingThatOutlivesIt) {
  const uint64_t bytes = 8 * page();
  const ArenaId arena = MustCreate(bytes);
  const ArenaId kept = MustCreate(bytes);
  const ArenaId private_arena = backend_->CreateArena(bytes, ArenaVisibility::kPrivate).value();
  std::vector<uint8_t> pattern(bytes, 0x5a);
  for (ArenaId id : {arena, kept, private_arena}) {
    ASSERT_THAT(backend_->Write(id, 0, pattern), IsOk());
  }

  absl::StatusOr<int> fd = backend_->DuplicateArenaFd(arena);
  ASSERT_THAT(fd, IsOk());
  ScopedFd engine_fd(*fd);
  void* mapped = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, engine_fd.get(), 0);
  ASSERT_NE(mapped, MAP_FAILED);
  auto* view = static_cast<uint8_t*>(mapped);
  struct stat before {};
  ASSERT_EQ(fstat(engine_fd.get(), &before), 0);
  EXPECT_GE(static_cast<uint64_t>(before.st_blocks) * 512, bytes);

  ASSERT_THAT(backend_->FreeArena(arena), IsOk());
  struct stat after {};
  ASSERT_EQ(fstat(engine_fd.get(), &after), 0);
  EXPECT_EQ(after.st_blocks, 0) << "the engine's descriptor still holds the daemon's pages";
  EXPECT_EQ(static_cast<uint64_t>(after.st_size), bytes);
  // Touching it again faults fresh pages in (the engine's own): zeros, and writable.
  EXPECT_EQ(std::count(view, view + bytes, 0), static_cast<std::ptrdiff_t>(bytes));
  view[3 * page()] = 7;
  EXPECT_EQ(view[3 * page()], 7);
  munmap(mapped, bytes);

  // The arenas not freed keep every byte.
  std::vector<uint8_t> read(bytes);
  for (ArenaId id : {kept, private_arena}) {
    ASSERT_THAT(backend_->Read(id, 0, absl::MakeSpan(read)), IsOk());
    EXPECT_EQ(read, pattern) << id;
    ASSERT_THAT(backend_->FreeArena(id), IsOk());
  }
}

TEST_F(HostBackendTest, HandlesComeFromTheConfiguredSource) {
  std::vector<std::string> handles = {"second", "first"};
  HostBackendOptions options = DefaultOptions();
  options.handle_for_testing = [&handles]() -> absl::StatusOr<std::string> {
    std::string next = handles.back();
    handles.pop_back();
    return next;
  };
  backend_ = MakeBackend(options);
  EXPECT_EQ(MustExport(MustCreate(1)), "first");
  EXPECT_EQ(MustExport(MustCreate(1)), "second");
  // A failing source fails the creation and leaks nothing.
  options.handle_for_testing = []() -> absl::StatusOr<std::string> {
    return absl::InternalError("no randomness");
  };
  backend_ = MakeBackend(options);
  EXPECT_THAT(backend_->CreateArena(1, ArenaVisibility::kExported),
              StatusIs(absl::StatusCode::kInternal, "no randomness"));
  EXPECT_EQ(backend_->AllocatedBytes(), 0u);
  EXPECT_EQ(backend_->ArenaCount(), 0u);
}

TEST_F(HostBackendTest, FreeForgetsTheArena) {
  const ArenaId arena = MustCreate(1);
  ASSERT_THAT(backend_->FreeArena(arena), IsOk());
  const std::string no_arena = absl::StrCat("no arena ", arena.value);
  EXPECT_THAT(backend_->FreeArena(arena),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs("FreeArena", no_arena)));
  EXPECT_THAT(backend_->Export(arena),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs("Export", no_arena)));
  EXPECT_THAT(backend_->DuplicateArenaFd(arena),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs("DuplicateArenaFd", no_arena)));
  EXPECT_THAT(backend_->WriteI32(arena, 0, 1),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs("WriteI32", no_arena)));
  // Ids are not reused: a new arena never answers to the stale id.
  EXPECT_NE(MustCreate(1), arena);
}

TEST_F(HostBackendTest, DestructorFreesEveryArenaAndDescriptor) {
  const size_t open_before = OpenDescriptors();
  for (int i = 0; i < 3; ++i) MustExport(MustCreate(page()));
  MustCreate(page(), ArenaVisibility::kPrivate);
  EXPECT_EQ(OpenDescriptors(), open_before + 3);  // one memfd per exported arena
  backend_.reset();
  EXPECT_EQ(OpenDescriptors(), open_before);
}

TEST_F(HostBackendTest, AccountingReturnsToZero) {
  std::vector<ArenaId> arenas;
  for (uint64_t pages : {1, 3, 2, 5}) {
    arenas.push_back(MustCreate(pages * page() - 7, pages % 2 == 0 ? ArenaVisibility::kPrivate
                                                                   : ArenaVisibility::kExported));
  }
  EXPECT_EQ(backend_->AllocatedBytes(), 11 * page());
  EXPECT_EQ(backend_->ArenaCount(), 4u);
  EXPECT_EQ(backend_->Info().free_bytes, 64 * kMiB - 11 * page());
  for (ArenaId arena : {arenas[2], arenas[0], arenas[3], arenas[1]}) {
    ASSERT_THAT(backend_->FreeArena(arena), IsOk());
  }
  EXPECT_EQ(backend_->AllocatedBytes(), 0u);
  EXPECT_EQ(backend_->ArenaCount(), 0u);
  const DeviceInfo info = backend_->Info();
  EXPECT_EQ(info.total_bytes, 64 * kMiB);
  EXPECT_EQ(info.free_bytes, 64 * kMiB);
}

TEST_F(HostBackendTest, PrivateArenasAreNeverExported) {
  const ArenaId arena = MustCreate(page(), ArenaVisibility::kPrivate);
  EXPECT_THAT(backend_->Export(arena),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs(absl::StrCat("arena ", arena.value), "private")));
  EXPECT_THAT(backend_->DuplicateArenaFd(arena),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs(absl::StrCat("arena ", arena.value), "private")));
  // Still fully usable by the daemon.
  EXPECT_THAT(backend_->WriteI32(arena, 8, -5), IsOk());
  EXPECT_THAT(backend_->ReadI32(arena, 8), IsOkAndHolds(-5));
}

TEST_F(HostBackendTest, MemsetWriteReadAndI32) {
  const ArenaId arena = MustCreate(page());
  ASSERT_THAT(backend_->Memset(arena, 10, 0xAB, 4), IsOk());
  EXPECT_THAT(ReadAll(*backend_, arena, 9, 6), ElementsAre(0, 0xAB, 0xAB, 0xAB, 0xAB, 0));
  // Unaligned i32 mirrors are legal (memcpy, no alignment assumption).
  ASSERT_THAT(backend_->WriteI32(arena, 33, -123456), IsOk());
  EXPECT_THAT(backend_->ReadI32(arena, 33), IsOkAndHolds(-123456));
  // The last four bytes of the arena are in range.
  ASSERT_THAT(backend_->WriteI32(arena, page() - 4, 7), IsOk());
  EXPECT_THAT(backend_->ReadI32(arena, page() - 4), IsOkAndHolds(7));
  // Zero-length operations at the very end are in range and do nothing.
  EXPECT_THAT(backend_->Memset(arena, page(), 1, 0), IsOk());
  EXPECT_THAT(backend_->Write(arena, page(), {}), IsOk());
}

TEST_F(HostBackendTest, WriteI32sStoresEveryValueInOrder) {
  const ArenaId arena = MustCreate(page());
  // The later store to offset 8 wins; offset 13 is unaligned.
  const std::vector<I32Write> writes = {{0, 1}, {8, -2}, {13, 300000}, {8, 4}, {page() - 4, 5}};
  ASSERT_THAT(backend_->WriteI32s(arena, writes), IsOk());
  EXPECT_THAT(backend_->ReadI32(arena, 0), IsOkAndHolds(1));
  EXPECT_THAT(backend_->ReadI32(arena, 8), IsOkAndHolds(4));
  EXPECT_THAT(backend_->ReadI32(arena, 13), IsOkAndHolds(300000));
  EXPECT_THAT(backend_->ReadI32(arena, page() - 4), IsOkAndHolds(5));
  EXPECT_THAT(backend_->WriteI32s(arena, {}), IsOk());
}

TEST_F(HostBackendTest, OneOutOfRangeWriteI32sStoresNothing) {
  const ArenaId arena = MustCreate(page());
  const std::vector<I32Write> writes = {{0, 7}, {page() - 3, 9}};
  EXPECT_THAT(backend_->WriteI32s(arena, writes),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("WriteI32s", absl::StrCat("offset ", page() - 3, " + 4"),
                                  absl::StrCat("arena ", arena.value, " of ", page(), " bytes"))));
  EXPECT_THAT(backend_->ReadI32(arena, 0), IsOkAndHolds(0));  // the valid first store did not run
  EXPECT_THAT(backend_->WriteI32s(ArenaId{arena.value + 100}, writes),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstrs("WriteI32s", absl::StrCat(arena.value + 100))));
}

TEST_F(HostBackendTest, CopyRangesChecksummedCopiesAndHashesTheSourceInRangeOrder) {
  const ArenaId src = MustCreate(4 * page(), ArenaVisibility::kPrivate);
  const ArenaId dst = MustCreate(4 * page());
  std::vector<uint8_t> bytes(3 * page());
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 31 + 7);
  ASSERT_THAT(backend_->Write(src, 0, bytes), IsOk());
  // Two ranges, gathered out of order and larger than one 64 KiB hashing slice in total; the
  // hash is of the source bytes in range order.
  const uint64_t a = 2 * page(), b = page() + 5;
  const std::vector<CopyRange> ranges = {{.dst_offset = 0, .src_offset = page(), .bytes = a},
                                         {.dst_offset = a, .src_offset = 3, .bytes = b}};
  std::vector<uint8_t> expected(bytes.begin() + page(), bytes.begin() + page() + a);
  expected.insert(expected.end(), bytes.begin() + 3, bytes.begin() + 3 + b);
  EXPECT_THAT(backend_->CopyRangesChecksummed(dst, src, ranges),
              IsOkAndHolds(XXH3_64bits(expected.data(), expected.size())));
  EXPECT_EQ(ReadAll(*backend_, dst, 0, a + b), expected);
  EXPECT_THAT(backend_->CopyRangesChecksummed(dst, src, {}), IsOkAndHolds(XXH3_64bits(nullptr, 0)));
}

TEST_F(HostBackendTest, CopyRangesChecksummedRefusalsCopyNothing) {
  const ArenaId src = MustCreate(page(), ArenaVisibility::kPrivate);
  const ArenaId dst = MustCreate(page());
  ASSERT_THAT(backend_->Memset(src, 0, 0x5A, page()), IsOk());
  const std::vector<CopyRange> ranges = {{.dst_offset = 0, .src_offset = 0, .bytes = 8},
                                         {.dst_offset = 8, .src_offset = page() - 4, .bytes = 8}};
  EXPECT_THAT(backend_->CopyRangesChecksummed(dst, src, ranges),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("CopyRangesChecksummed source",
                                  absl::StrCat("offset ", page() - 4, " + 8"))));
  EXPECT_THAT(ReadAll(*backend_, dst, 0, 16), Each(0));  // the valid first range did not run
  const std::vector<CopyRange> past_destination = {
      {.dst_offset = 0, .src_offset = 0, .bytes = 8},
      {.dst_offset = page() - 2, .src_offset = 8, .bytes = 8}};
  EXPECT_THAT(backend_->CopyRangesChecksummed(dst, src, past_destination),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("CopyRangesChecksummed destination",
                                  absl::StrCat("offset ", page() - 2, " + 8"),
                                  absl::StrCat("arena ", dst.value, " of ", page(), " bytes"))));
  EXPECT_THAT(ReadAll(*backend_, dst, 0, 16), Each(0));
  EXPECT_THAT(backend_->CopyRangesChecksummed(ArenaId{dst.value + 100}, src, ranges),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstrs("CopyRangesChecksummed destination",
                                  absl::StrCat(dst.value + 100))));
  EXPECT_THAT(backend_->CopyRangesChecksummed(src, src, ranges),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("source and destination are both arena",
                                  absl::StrCat(src.value))));
  EXPECT_THAT(backend_->CopyRangesChecksummed(dst, ArenaId{src.value + 100}, ranges),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstrs("CopyRangesChecksummed source", absl::StrCat(src.value + 100))));
}

TEST_F(HostBackendTest, CopyBetweenArenasWithOffsetsOnBothSides) {
  const ArenaId src = MustCreate(page());
  const ArenaId dst = MustCreate(2 * page(), ArenaVisibility::kPrivate);
  ASSERT_THAT(backend_->Write(src, 50, std::vector<uint8_t>{9, 8, 7, 6}), IsOk());
  ASSERT_THAT(backend_->Copy(dst, page() + 3, src, 51, 3), IsOk());
  EXPECT_THAT(ReadAll(*backend_, dst, page() + 2, 5), ElementsAre(0, 8, 7, 6, 0));
}

TEST_F(HostBackendTest, OverlappingCopyWithinOneArenaIsAMemmove) {
  const ArenaId arena = MustCreate(page());
  std::vector<uint8_t> pattern(16);
  for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<uint8_t>(i + 1);
  ASSERT_THAT(backend_->Write(arena, 0, pattern), IsOk());
  // Forward (dst after src) and backward overlaps.
  ASSERT_THAT(backend_->Copy(arena, 4, arena, 0, 10), IsOk());
  EXPECT_THAT(ReadAll(*backend_, arena, 0, 16),
              ElementsAre(1, 2, 3, 4, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 15, 16));
  ASSERT_THAT(backend_->Copy(arena, 0, arena, 4, 10), IsOk());
  EXPECT_THAT(ReadAll(*backend_, arena, 0, 16),
              ElementsAre(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 7, 8, 9, 10, 15, 16));
}

TEST_F(HostBackendTest, OutOfRangeCallsNameTheNumbersAndChangeNothing) {
  const ArenaId arena = MustCreate(page());
  const ArenaId other = MustCreate(page(), ArenaVisibility::kPrivate);
  ASSERT_THAT(backend_->Memset(arena, 0, 0x11, page()), IsOk());
  const std::string size = absl::StrCat("arena ", arena.value, " of ", page(), " bytes");
  const uint64_t near_end = page() - 100;

  EXPECT_THAT(backend_->Memset(arena, near_end, 0, 200),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("Memset", absl::StrCat("offset ", near_end, " + 200 bytes"),
                                  absl::StrCat(near_end + 200), size)));
  EXPECT_THAT(
      backend_->Copy(arena, near_end, other, 0, 101),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstrs("Copy destination", absl::StrCat("offset ", near_end), "101", size)));
  EXPECT_THAT(backend_->Copy(other, 0, arena, page(), 1),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("Copy source", absl::StrCat("offset ", page(), " + 1"), size)));
  EXPECT_THAT(backend_->WriteI32(arena, page() - 3, 1),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("WriteI32", absl::StrCat("offset ", page() - 3, " + 4"), size)));
  EXPECT_THAT(backend_->ReadI32(arena, page()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("ReadI32", size)));
  std::vector<uint8_t> buffer(2);
  EXPECT_THAT(backend_->Write(arena, page() - 1, buffer),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("Write", size)));
  EXPECT_THAT(backend_->Read(arena, page() - 1, absl::MakeSpan(buffer)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("Read", size)));

  // Offsets that wrap uint64 are overflows, not small numbers.
  EXPECT_THAT(backend_->Memset(arena, kMax - 1, 0, 4),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("Memset", absl::StrCat("offset ", kMax - 1, " + 4 bytes"),
                                  "overflows", size)));
  EXPECT_THAT(backend_->Copy(other, 8, arena, 0, kMax),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("Copy destination", absl::StrCat(kMax), "overflows")));
  EXPECT_THAT(backend_->Copy(other, 0, arena, kMax, 1),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("Copy source", absl::StrCat("offset ", kMax, " + 1"), "overflows",
                                  size)));
  EXPECT_THAT(backend_->WriteI32(arena, kMax - 2, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("WriteI32", "overflows")));

  EXPECT_THAT(ReadAll(*backend_, arena, 0, page()), Each(0x11));
  EXPECT_THAT(ReadAll(*backend_, other, 0, page()), Each(0));
}

TEST_F(HostBackendTest, ConcurrentCreateUseFreeIsConsistent) {
  constexpr int kThreads = 4;
  constexpr int kRounds = 50;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([this, t] {
      for (int round = 0; round < kRounds; ++round) {
        absl::StatusOr<ArenaId> arena = backend_->CreateArena(
            page(), round % 2 ? ArenaVisibility::kPrivate : ArenaVisibility::kExported);
        ASSERT_THAT(arena, IsOk());
        ASSERT_THAT(backend_->WriteI32(*arena, 0, t * 1000 + round), IsOk());
        ASSERT_THAT(backend_->Copy(*arena, 4, *arena, 0, 4), IsOk());
        ASSERT_THAT(backend_->ReadI32(*arena, 4), IsOkAndHolds(t * 1000 + round));
        ASSERT_THAT(backend_->FreeArena(*arena), IsOk());
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(backend_->AllocatedBytes(), 0u);
  EXPECT_EQ(backend_->ArenaCount(), 0u);
}

// The contract: a data call racing FreeArena of the same arena is the caller's bug, but it must
// stay memory-safe: it either finishes on the still-mapped arena or reports NOT_FOUND.
TEST_F(HostBackendTest, DataCallsRacingFreeStayMemorySafe) {
  for (int round = 0; round < 20; ++round) {
    const ArenaId arena = MustCreate(16 * page());
    std::atomic<bool> freed{false};
    std::thread user([&] {
      std::vector<uint8_t> buffer(16 * page());
      while (!freed.load()) {
        const absl::Status status = backend_->Read(arena, 0, absl::MakeSpan(buffer));
        ASSERT_TRUE(status.ok() || absl::IsNotFound(status)) << status;
        if (!status.ok()) return;
      }
    });
    ASSERT_THAT(backend_->FreeArena(arena), IsOk());
    freed.store(true);
    user.join();
  }
  EXPECT_EQ(backend_->ArenaCount(), 0u);
}

// The host backend has no device queue: ordering is the RPC order, and an interprocess event
// sent to it is a client mistake worth a clear refusal, not a silent no-op.
TEST_F(HostBackendTest, EngineEventsAreRefusedNoEventIsFine) {
  EXPECT_THAT(backend_->WaitForEngineEvent(""), IsOk());
  EXPECT_THAT(backend_->WaitForEngineEvent(std::string(64, '\x01')),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("64-byte interprocess event handle", "RPC order")));
}

}  // namespace
}  // namespace memra

namespace memra {
namespace {

// Restart survival: the descriptor a daemon kept maps the same memory in the next daemon.
TEST_F(HostBackendTest, AKeptDescriptorIsAdoptedWithItsBytesAndHandle) {
  const ArenaId arena = MustCreate(2 * page());
  const std::string handle = MustExport(arena);
  const std::vector<uint8_t> bytes = {1, 2, 3, 4, 5};
  ASSERT_THAT(backend_->Write(arena, page() + 7, bytes), IsOk());
  absl::StatusOr<int> kept = backend_->DuplicateArenaFd(arena);
  ASSERT_THAT(kept, IsOk());
  // The previous daemon dies: a crash frees nothing (FreeArena would punch the pages out), and
  // its backend's records go with the process; the kept fd holds the memory.
  std::exchange(backend_, MakeBackend(DefaultOptions())).reset();
  std::unique_ptr<HostBackend> next = MakeBackend(DefaultOptions());
  absl::StatusOr<ArenaId> adopted = next->AdoptArenaFd(*kept, 2 * page(), handle);
  ASSERT_THAT(adopted, IsOk());
  EXPECT_EQ(ReadAll(*next, *adopted, page() + 7, 5), bytes);
  absl::StatusOr<ArenaExport> exported = next->Export(*adopted);
  ASSERT_THAT(exported, IsOk());
  EXPECT_EQ(exported->handle, handle);
  EXPECT_EQ(exported->bytes, 2 * page());
  EXPECT_EQ(next->ArenaCount(), 1u);
  EXPECT_EQ(next->AllocatedBytes(), 2 * page());
  ASSERT_THAT(next->FreeArena(*adopted), IsOk());
  EXPECT_EQ(next->AllocatedBytes(), 0u);
}

TEST_F(HostBackendTest, AdoptionRefusalsCloseTheDescriptorAndFileNothing) {
  const ArenaId arena = MustCreate(page());
  const std::string handle = MustExport(arena);
  auto kept = [&] { return backend_->DuplicateArenaFd(arena).value_or(-1); };
  std::unique_ptr<HostBackend> next = MakeBackend(DefaultOptions());
  EXPECT_THAT(next->AdoptArenaFd(kept(), page(), ""),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("needs its handle")));
  EXPECT_THAT(next->AdoptArenaFd(kept(), 2 * page(), handle),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs(absl::StrCat("holds ", page(), " bytes but the arena was ",
                                               2 * page()))));
  EXPECT_THAT(next->AdoptArenaFd(kept(), page() - 1, handle),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs(absl::StrCat(page() - 1, " bytes is not a multiple of the "
                                               "allocation granularity ", page()))));
  EXPECT_THAT(next->AdoptArenaFd(-1, page(), handle),
              StatusIs(absl::StatusCode::kInternal,
                       HasSubstrs("fstat of a kept host arena", "errno 9")));
  EXPECT_EQ(next->ArenaCount(), 0u);
  // Private arenas are never handed out, so never kept.
  const ArenaId private_arena = MustCreate(page(), ArenaVisibility::kPrivate);
  EXPECT_THAT(backend_->DuplicateArenaFd(private_arena),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstrs("is private")));
  EXPECT_THAT(backend_->DuplicateArenaFd(ArenaId{999}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstrs("999")));
}

}  // namespace
}  // namespace memra

namespace memra {
namespace {

TEST_F(HostBackendTest, EngineBuffersMapIntoOneUnchargedArenaOverTheEnginesMemory) {
  const uint64_t page_bytes = page();
  ScopedFd first(memfd_create("engine-pool-a", MFD_CLOEXEC));
  ScopedFd second(memfd_create("engine-pool-b", MFD_CLOEXEC));
  ASSERT_GE(first.get(), 0);
  ASSERT_GE(second.get(), 0);
  ASSERT_EQ(ftruncate(first.get(), static_cast<off_t>(page_bytes)), 0);
  ASSERT_EQ(ftruncate(second.get(), static_cast<off_t>(3 * page_bytes)), 0);
  ASSERT_EQ(pwrite(second.get(), "pool", 4, static_cast<off_t>(page_bytes + 10)), 4);
  const uint64_t allocated_before = backend_->AllocatedBytes();
  const size_t arenas_before = backend_->ArenaCount();
  const std::vector<EngineBufferFd> buffers = {
      {.fd = first.get(), .offset = 0, .bytes = 100},
      // A view that starts inside a page: its base keeps the lead.
      {.fd = second.get(), .offset = page_bytes + 10, .bytes = page_bytes}};
  absl::StatusOr<MappedEngineBuffers> mapped = backend_->MapEngineBuffers(buffers);
  ASSERT_THAT(mapped, IsOk());
  ASSERT_EQ(mapped->base.size(), 2u);
  EXPECT_EQ(mapped->base[0], 0u);
  EXPECT_EQ(mapped->base[1], page_bytes + 10);
  EXPECT_EQ(backend_->AllocatedBytes(), allocated_before);
  EXPECT_EQ(backend_->ArenaCount(), arenas_before);
  std::vector<uint8_t> read(4);
  ASSERT_THAT(backend_->Read(mapped->arena, mapped->base[1], absl::MakeSpan(read)), IsOk());
  EXPECT_EQ(std::string(read.begin(), read.end()), "pool");
  const std::vector<uint8_t> written = {'d', 'a', 'e', 'm'};
  ASSERT_THAT(backend_->Write(mapped->arena, mapped->base[0] + 5, written), IsOk());
  char seen[4] = {};
  ASSERT_EQ(pread(first.get(), seen, 4, 5), 4);
  EXPECT_EQ(std::string(seen, 4), "daem");
  EXPECT_THAT(backend_->Export(mapped->arena),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstrs("private")));
  ASSERT_THAT(backend_->FreeArena(mapped->arena), IsOk());
  EXPECT_EQ(backend_->ArenaCount(), arenas_before);
  EXPECT_THAT(backend_->MapEngineBuffers({}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("no buffers")));
}

}  // namespace
}  // namespace memra
