#include "server/store/slice_copier.h"

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/base/streaming_checksum.h"
#include "server/testing/test_host_backend.h"
#include "tests/seeded_random.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;

constexpr uint64_t kSlice = 4096;
constexpr uint64_t kArenaBytes = uint64_t{1} << 20;

class SliceCopierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = testing::NewTestHostBackend(testing::TestHostBackendOptions(uint64_t{16} << 20));
    ASSERT_NE(backend_, nullptr);
    absl::StatusOr<ArenaId> session = backend_->CreateArena(kArenaBytes, ArenaVisibility::kPrivate);
    absl::StatusOr<ArenaId> storage = backend_->CreateArena(kArenaBytes, ArenaVisibility::kPrivate);
    ASSERT_THAT(session.status(), IsOk());
    ASSERT_THAT(storage.status(), IsOk());
    session_ = *session;
    storage_ = *storage;
    testing::SeededRandom random(0x51ce);
    std::vector<uint8_t> bytes(kArenaBytes);
    for (uint8_t& byte : bytes) byte = static_cast<uint8_t>(random.Below(256));
    ASSERT_THAT(backend_->Write(session_, 0, bytes), IsOk());
  }

  // Piece p: two ranges of the session arena (`first` + `second` bytes, a gap between them),
  // stored back to back in `storage_` at `stored_at`.
  static PieceCopy Piece(uint64_t session_at, uint64_t first, uint64_t second, uint64_t stored_at,
                         CopyDirection direction) {
    const bool to_storage = direction == CopyDirection::kToStorage;
    PieceCopy piece;
    const uint64_t gap = 512;
    const uint64_t sources[2] = {session_at, session_at + first + gap};
    const uint64_t sizes[2] = {first, second};
    uint64_t at = 0;
    for (int r = 0; r < 2; ++r) {
      piece.ranges.push_back(to_storage ? CopyRange{.dst_offset = at,
                                                    .src_offset = sources[r],
                                                    .bytes = sizes[r]}
                                        : CopyRange{.dst_offset = sources[r],
                                                    .src_offset = at,
                                                    .bytes = sizes[r]});
      at += sizes[r];
    }
    piece.bytes = at;
    piece.span = SlabSpan{.slab = ArenaId{}, .offset = stored_at, .bytes = at};
    return piece;
  }

  // Three pieces: 3 slices (the last partial), exactly 1 slice, 2 slices.
  std::vector<PieceCopy> Pieces(CopyDirection direction) const {
    std::vector<PieceCopy> pieces = {
        Piece(0, 5000, 5000, 0, direction),
        Piece(20000, 1000, kSlice - 1000, 16384, direction),
        Piece(40000, kSlice, kSlice, 24576, direction),
    };
    for (PieceCopy& piece : pieces) piece.span.slab = storage_;
    return pieces;
  }

  std::vector<uint8_t> Read(ArenaId arena, uint64_t offset, uint64_t bytes) {
    std::vector<uint8_t> out(bytes);
    EXPECT_THAT(backend_->Read(arena, offset, absl::MakeSpan(out)), IsOk());
    return out;
  }

  // Seals Pieces() into storage_; returns the restore side with the sealed checksums.
  std::vector<PieceCopy> Sealed(const SliceCopier& copier) {
    absl::StatusOr<std::vector<std::vector<uint64_t>>> sealed = copier.Copy(
        CopyDirection::kToStorage, session_, Pieces(CopyDirection::kToStorage), true, EntryId{});
    EXPECT_THAT(sealed.status(), IsOk());
    std::vector<PieceCopy> restore = Pieces(CopyDirection::kFromStorage);
    for (size_t p = 0; sealed.ok() && p < restore.size(); ++p) {
      restore[p].checksum = PieceChecksum((*sealed)[p]);
      if ((*sealed)[p].size() > 1) restore[p].slice_checksums = (*sealed)[p];
    }
    return restore;
  }

  std::unique_ptr<HostBackend> backend_;
  ArenaId session_;
  ArenaId storage_;
};

SliceCopierOptions Serial() {
  return {.copy_threads = 1, .parallel_copy_bytes = 1, .slice_bytes = kSlice};
}
SliceCopierOptions Parallel() {
  return {.copy_threads = 4, .parallel_copy_bytes = 1, .slice_bytes = kSlice};
}

TEST(SliceCountTest, CountsWholeAndPartialSlicesAndOneForEmpty) {
  EXPECT_EQ(SliceCount(0, kSlice), 1u);
  EXPECT_EQ(SliceCount(1, kSlice), 1u);
  EXPECT_EQ(SliceCount(kSlice, kSlice), 1u);
  EXPECT_EQ(SliceCount(kSlice + 1, kSlice), 2u);
  EXPECT_EQ(SliceCount(3 * kSlice, kSlice), 3u);
}

TEST_F(SliceCopierTest, SealsEachSliceOfTheStoredBytesSeriallyAndInParallelAlike) {
  for (const SliceCopierOptions& options : {Serial(), Parallel()}) {
    SliceCopier copier(backend_.get(), options);
    const std::vector<PieceCopy> pieces = Pieces(CopyDirection::kToStorage);
    absl::StatusOr<std::vector<std::vector<uint64_t>>> sealed =
        copier.Copy(CopyDirection::kToStorage, session_, pieces, true, EntryId{});
    ASSERT_THAT(sealed.status(), IsOk());
    ASSERT_EQ(sealed->size(), 3u);
    for (size_t p = 0; p < pieces.size(); ++p) {
      const std::vector<uint8_t> stored = Read(storage_, pieces[p].span.offset, pieces[p].bytes);
      // The stored bytes are the ranges' bytes back to back.
      std::vector<uint8_t> expected;
      for (const CopyRange& range : pieces[p].ranges) {
        const std::vector<uint8_t> part = Read(session_, range.src_offset, range.bytes);
        expected.insert(expected.end(), part.begin(), part.end());
      }
      EXPECT_EQ(stored, expected) << "piece " << p;
      EXPECT_EQ((*sealed)[p], SliceChecksums(stored, kSlice)) << "piece " << p;
    }
    EXPECT_EQ((*sealed)[0].size(), 3u);
    EXPECT_EQ((*sealed)[1].size(), 1u);
    EXPECT_EQ((*sealed)[2].size(), 2u);
  }
}

TEST_F(SliceCopierTest, RestoreVerifiesAndPutsEveryRangeBack) {
  SliceCopier copier(backend_.get(), Parallel());
  const std::vector<PieceCopy> restore = Sealed(copier);
  const std::vector<uint8_t> before = Read(session_, 0, kArenaBytes);
  ASSERT_THAT(backend_->Memset(session_, 0, 0, kArenaBytes), IsOk());
  absl::StatusOr<std::vector<std::vector<uint64_t>>> verified =
      copier.Copy(CopyDirection::kFromStorage, session_, restore, true, EntryId{7});
  ASSERT_THAT(verified.status(), IsOk());
  const std::vector<uint8_t> after = Read(session_, 0, kArenaBytes);
  for (const PieceCopy& piece : restore) {
    for (const CopyRange& range : piece.ranges) {
      for (uint64_t i = 0; i < range.bytes; ++i) {
        ASSERT_EQ(after[range.dst_offset + i], before[range.dst_offset + i])
            << "byte " << range.dst_offset + i;
      }
    }
  }
  // The gaps between ranges are not written.
  EXPECT_EQ(after[5000 + 1], 0);
}

TEST_F(SliceCopierTest, UncheckedCopyMovesTheBytesAndReturnsZeros) {
  SliceCopier copier(backend_.get(), Serial());
  const std::vector<PieceCopy> restore = Sealed(copier);
  ASSERT_THAT(backend_->Memset(session_, 0, 0, kArenaBytes), IsOk());
  // A corrupt stored byte is not looked for without checksums.
  ASSERT_THAT(backend_->Memset(storage_, 10, 0xee, 1), IsOk());
  absl::StatusOr<std::vector<std::vector<uint64_t>>> copied =
      copier.Copy(CopyDirection::kFromStorage, session_, restore, false, EntryId{7});
  ASSERT_THAT(copied.status(), IsOk());
  EXPECT_EQ((*copied)[0], std::vector<uint64_t>(3, 0));
  EXPECT_EQ(Read(session_, 10, 1)[0], 0xee);
}

TEST_F(SliceCopierTest, CorruptSliceIsDataLossNamingEntryPieceSlabOffsetAndSlice) {
  for (const SliceCopierOptions& options : {Serial(), Parallel()}) {
    SliceCopier copier(backend_.get(), options);
    const std::vector<PieceCopy> restore = Sealed(copier);
    // Piece 2's second slice (stored at 24576 + 4096).
    const std::vector<uint8_t> old = Read(storage_, 24576 + kSlice + 3, 1);
    ASSERT_THAT(backend_->Memset(storage_, 24576 + kSlice + 3, old[0] ^ 0xff, 1), IsOk());
    EXPECT_THAT(copier.Copy(CopyDirection::kFromStorage, session_, restore, true, EntryId{7})
                    .status(),
                StatusIs(absl::StatusCode::kDataLoss,
                         HasSubstrs("prefix entry 7", "stored piece 2 (slab ", "offset 24576",
                                    "slice 1 of 2 (4096 bytes)", "never served")));
  }
}

TEST_F(SliceCopierTest, OnePieceSliceComparesWithThePieceChecksumAndNamesItsOwnEntry) {
  SliceCopier copier(backend_.get(), Serial());
  std::vector<PieceCopy> restore = Sealed(copier);
  restore[1].checksum ^= 1;
  restore[1].entry = EntryId{42};
  EXPECT_THAT(
      copier.Copy(CopyDirection::kFromStorage, session_, restore, true, EntryId{7}).status(),
      StatusIs(absl::StatusCode::kDataLoss,
               HasSubstrs("prefix entry 42", "stored piece 1", "slice 0 of 1 (4096 bytes)")));
}

TEST_F(SliceCopierTest, SliceChecksumCountThatDoesNotFitTheSizeIsRefusedBeforeAnyCopy) {
  SliceCopier copier(backend_.get(), Serial());
  std::vector<PieceCopy> restore = Sealed(copier);
  restore[0].slice_checksums.pop_back();
  ASSERT_THAT(backend_->Memset(session_, 0, 0x5a, kArenaBytes), IsOk());
  EXPECT_THAT(
      copier.Copy(CopyDirection::kFromStorage, session_, restore, true, EntryId{7}).status(),
      StatusIs(absl::StatusCode::kDataLoss,
               HasSubstrs("prefix entry 7", "stored piece 0 of 10000 bytes carries 2 slice",
                          "4096-byte slices make 3")));
  EXPECT_EQ(Read(session_, 0, 1)[0], 0x5a);  // nothing copied
}

TEST_F(SliceCopierTest, PieceFailuresKeepTheOtherPiecesCopying) {
  SliceCopier copier(backend_.get(), Parallel());
  std::vector<PieceCopy> restore = Sealed(copier);
  const std::vector<uint8_t> before = Read(session_, 0, kArenaBytes);
  ASSERT_THAT(backend_->Memset(session_, 0, 0, kArenaBytes), IsOk());
  restore[0].slice_checksums[1] ^= 1;
  restore[0].entry = EntryId{3};
  std::vector<absl::Status> failures;
  absl::StatusOr<std::vector<std::vector<uint64_t>>> copied = copier.Copy(
      CopyDirection::kFromStorage, session_, restore, true, EntryId{}, &failures);
  ASSERT_THAT(copied.status(), IsOk());
  ASSERT_EQ(failures.size(), 3u);
  EXPECT_THAT(failures[0], StatusIs(absl::StatusCode::kDataLoss,
                                    HasSubstrs("prefix entry 3", "stored piece 0", "slice 1 of 3")));
  EXPECT_THAT(failures[1], IsOk());
  EXPECT_THAT(failures[2], IsOk());
  // Piece 2 arrived whole.
  for (const CopyRange& range : restore[2].ranges) {
    EXPECT_EQ(Read(session_, range.dst_offset, range.bytes),
              std::vector<uint8_t>(before.begin() + range.dst_offset,
                                   before.begin() + range.dst_offset + range.bytes));
  }
}

TEST_F(SliceCopierTest, ADeviceFailureIsReturnedAsIs) {
  SliceCopier copier(backend_.get(), Serial());
  std::vector<PieceCopy> restore = Sealed(copier);
  restore[1].span.slab = ArenaId{999999};  // no such arena
  EXPECT_THAT(
      copier.Copy(CopyDirection::kFromStorage, session_, restore, true, EntryId{7}).status(),
      StatusIs(absl::StatusCode::kNotFound, HasSubstrs("999999")));
}

}  // namespace
}  // namespace memra
