#include "server/restart/restart_journal.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;

// The journal a restarted daemon would receive: the same memfd, opened again by descriptor.
std::unique_ptr<RestartJournal> Reopen(const RestartJournal& journal) {
  absl::StatusOr<std::unique_ptr<RestartJournal>> reopened =
      RestartJournal::Open(ScopedFd(fcntl(journal.fd(), F_DUPFD_CLOEXEC, 0)));
  EXPECT_THAT(reopened, IsOk());
  return reopened.ok() ? *std::move(reopened) : nullptr;
}

TEST(RestartJournal, RecordsSurviveAReopenAndTheNewestWins) {
  absl::StatusOr<std::unique_ptr<RestartJournal>> journal = RestartJournal::Create(8, 77, 3);
  ASSERT_THAT(journal, IsOk());
  ASSERT_THAT((*journal)->Write(2, "first"), IsOk());
  ASSERT_THAT((*journal)->Write(2, "second"), IsOk());
  ASSERT_THAT((*journal)->Write(2, "third"), IsOk());
  ASSERT_THAT((*journal)->Write(5, "other"), IsOk());
  (*journal)->RaiseNextSessionId(40);
  (*journal)->RaiseNextSessionId(12);  // never lowers
  (*journal)->RaiseNextEngineId(9);
  std::unique_ptr<RestartJournal> reopened = Reopen(**journal);
  ASSERT_NE(reopened, nullptr);
  EXPECT_EQ(reopened->slots(), 8u);
  EXPECT_EQ(reopened->epoch(), 77u);
  EXPECT_EQ(reopened->generation(), 3u);
  EXPECT_EQ(reopened->next_session_id(), 40u);
  EXPECT_EQ(reopened->next_engine_id(), 9u);
  EXPECT_EQ(reopened->Read(2).payload, "third");
  EXPECT_EQ(reopened->Read(5).payload, "other");
  EXPECT_FALSE(reopened->Read(0).payload.has_value());
  EXPECT_FALSE(reopened->Read(2).torn);
}

// The limit on session slots starts at the journal's own size, is raised (never lowered) to
// carry a previous daemon's, and survives a reopen; a journal whose header predates the field
// (zero there) reads its size.
TEST(RestartJournal, TheSessionSlotLimitIsCarriedAcrossRestarts) {
  absl::StatusOr<std::unique_ptr<RestartJournal>> journal = RestartJournal::Create(8, 77, 3);
  ASSERT_THAT(journal, IsOk());
  EXPECT_EQ((*journal)->session_slot_limit(), 8u);
  (*journal)->RaiseSessionSlotLimit(1001);
  (*journal)->RaiseSessionSlotLimit(20);  // never lowers
  std::unique_ptr<RestartJournal> reopened = Reopen(**journal);
  ASSERT_NE(reopened, nullptr);
  EXPECT_EQ(reopened->session_slot_limit(), 1001u);
  // Never past what any journal could hold, whatever the header says.
  reopened->RaiseSessionSlotLimit(uint64_t{1} << 40);
  EXPECT_EQ(reopened->session_slot_limit(), RestartJournal::kMaxSlots);
  // The field is the header's u64 at offset 56 (after magic, format + slot bytes, slots,
  // epoch, generation and the two id marks): zero it as an older journal has it.
  const uint64_t zero = 0;
  ASSERT_EQ(pwrite((*journal)->fd(), &zero, sizeof(zero), 7 * sizeof(uint64_t)),
            static_cast<ssize_t>(sizeof(zero)));
  EXPECT_EQ(Reopen(**journal)->session_slot_limit(), 8u);
}

TEST(RestartJournal, ATornWriteLeavesThePreviousRecord) {
  absl::StatusOr<std::unique_ptr<RestartJournal>> journal = RestartJournal::Create(4, 1, 1);
  ASSERT_THAT(journal, IsOk());
  ASSERT_THAT((*journal)->Write(1, "committed 10 rows"), IsOk());
  ASSERT_THAT((*journal)->Write(1, "committed 20 rows"), IsOk());
  // The daemon dies halfway through the next write: the half it was writing (the older one,
  // holding "committed 10 rows") gets part of the new payload and no matching checksum.
  const off_t older_half = RestartJournal::kHeaderBytes + 1 * RestartJournal::kSlotBytes +
                           RestartJournal::kHalfHeaderBytes;
  ASSERT_EQ(pwrite((*journal)->fd(), "COMMITTED 30", 12, older_half), 12);
  std::unique_ptr<RestartJournal> reopened = Reopen(**journal);
  ASSERT_NE(reopened, nullptr);
  const RestartJournal::SlotContent content = reopened->Read(1);
  EXPECT_TRUE(content.torn);
  EXPECT_FALSE(content.newest_damaged) << "the older header still says it is the older half";
  EXPECT_EQ(content.payload, "committed 20 rows");
}

// Issue 26: a damaged newest record (its write had finished: its header claims the newer
// sequence) leaves only an older record, which may be older than what the engine was told. The
// reader says so, so the daemon refuses the session rather than roll it back silently.
TEST(RestartJournal, ADamagedNewestRecordIsToldFromATornWrite) {
  absl::StatusOr<std::unique_ptr<RestartJournal>> journal = RestartJournal::Create(4, 1, 1);
  ASSERT_THAT(journal, IsOk());
  ASSERT_THAT((*journal)->Write(1, "committed 10 rows"), IsOk());  // half 0, sequence 1
  ASSERT_THAT((*journal)->Write(1, "committed 30 rows"), IsOk());  // half 1, sequence 2
  const off_t newest_payload = RestartJournal::kHeaderBytes + 1 * RestartJournal::kSlotBytes +
                               RestartJournal::kHalfBytes + RestartJournal::kHalfHeaderBytes;
  ASSERT_EQ(pwrite((*journal)->fd(), "X", 1, newest_payload), 1);
  std::unique_ptr<RestartJournal> reopened = Reopen(**journal);
  ASSERT_NE(reopened, nullptr);
  const RestartJournal::SlotContent content = reopened->Read(1);
  EXPECT_TRUE(content.torn);
  EXPECT_TRUE(content.newest_damaged);
  EXPECT_EQ(content.payload, "committed 10 rows");
  // Both halves damaged: nothing to read, and the reader says the newest is damaged.
  const off_t older_payload = newest_payload - static_cast<off_t>(RestartJournal::kHalfBytes);
  ASSERT_EQ(pwrite((*journal)->fd(), "X", 1, older_payload), 1);
  const RestartJournal::SlotContent gone = Reopen(**journal)->Read(1);
  EXPECT_TRUE(gone.newest_damaged);
  EXPECT_FALSE(gone.payload.has_value());
}

// Issue 26: truncating the journal under the daemon (root can, through the fd store) used to
// kill it with SIGBUS at its next write. Its size is sealed: truncation and growth fail.
TEST(RestartJournal, ItsSizeIsSealedSoTruncationCannotFaultItsReaders) {
  absl::StatusOr<std::unique_ptr<RestartJournal>> journal = RestartJournal::Create(4, 1, 1);
  ASSERT_THAT(journal, IsOk());
  const int seals = fcntl((*journal)->fd(), F_GET_SEALS);
  EXPECT_EQ(seals & (F_SEAL_SHRINK | F_SEAL_GROW), F_SEAL_SHRINK | F_SEAL_GROW);
  struct stat before {};
  ASSERT_EQ(fstat((*journal)->fd(), &before), 0);
  EXPECT_EQ(ftruncate((*journal)->fd(), 0), -1);
  EXPECT_EQ(errno, EPERM);
  EXPECT_EQ(ftruncate((*journal)->fd(), before.st_size + 4096), -1);
  EXPECT_EQ(errno, EPERM);
  ASSERT_THAT((*journal)->Write(3, "still writable"), IsOk());
  EXPECT_EQ(Reopen(**journal)->Read(3).payload, "still writable");

  // A kept journal that is not sealed (an older build's) is sealed when it allows it ...
  struct stat info {};
  ASSERT_EQ(fstat((*journal)->fd(), &info), 0);
  std::string bytes(static_cast<size_t>(info.st_size), '\0');
  ASSERT_EQ(pread((*journal)->fd(), bytes.data(), bytes.size(), 0), info.st_size);
  const int sealable = memfd_create("unsealed", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(sealable, 0);
  ASSERT_EQ(write(sealable, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  absl::StatusOr<std::unique_ptr<RestartJournal>> opened =
      RestartJournal::Open(ScopedFd(fcntl(sealable, F_DUPFD_CLOEXEC, 0)));
  ASSERT_THAT(opened, IsOk());
  EXPECT_EQ(ftruncate(sealable, 0), -1);
  EXPECT_EQ((*opened)->Read(3).payload, "still writable");
  close(sealable);
  // ... and refused when it cannot be sealed (mapping it could fault).
  const int unsealable = memfd_create("unsealable", MFD_CLOEXEC);
  ASSERT_GE(unsealable, 0);
  ASSERT_EQ(write(unsealable, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  EXPECT_THAT(RestartJournal::Open(ScopedFd(unsealable)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("seals are 0x1", "F_SEAL_SHRINK | F_SEAL_GROW (0x6)",
                                  "SIGBUS")));
}

TEST(RestartJournal, AClearedSlotReadsEmptyEvenIfTheClearIsTheOnlyWholeHalf) {
  absl::StatusOr<std::unique_ptr<RestartJournal>> journal = RestartJournal::Create(2, 1, 1);
  ASSERT_THAT(journal, IsOk());
  ASSERT_THAT((*journal)->Write(0, "session 4"), IsOk());
  ASSERT_THAT((*journal)->Clear(0), IsOk());
  EXPECT_FALSE((*journal)->Read(0).payload.has_value());
  ASSERT_THAT((*journal)->Write(0, "session 9"), IsOk());
  EXPECT_EQ((*journal)->Read(0).payload, "session 9");
}

TEST(RestartJournal, Refusals) {
  EXPECT_THAT(RestartJournal::Create(0, 1, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("0 slots requested")));
  absl::StatusOr<std::unique_ptr<RestartJournal>> journal = RestartJournal::Create(2, 1, 1);
  ASSERT_THAT(journal, IsOk());
  EXPECT_THAT((*journal)->Write(2, "x"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("slot 2 of 2")));
  EXPECT_THAT((*journal)->Write(0, std::string(RestartJournal::kMaxPayloadBytes + 1, 'x')),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("record of 1001 bytes; a slot holds 1000")));
  // Something else in the fd store is not taken for a journal.
  const int other = memfd_create("not-a-journal", MFD_CLOEXEC);
  ASSERT_GE(other, 0);
  ASSERT_EQ(ftruncate(other, 8192), 0);
  EXPECT_THAT(RestartJournal::Open(ScopedFd(other)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("has magic 0")));
  const int tiny = memfd_create("tiny", MFD_CLOEXEC);
  ASSERT_GE(tiny, 0);
  EXPECT_THAT(RestartJournal::Open(ScopedFd(tiny)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("is 0 bytes")));
  // A journal whose size disagrees with its slot count (a copy grown by one byte).
  const int grown = fcntl((*journal)->fd(), F_DUPFD_CLOEXEC, 0);
  ASSERT_GE(grown, 0);
  struct stat info {};
  ASSERT_EQ(fstat(grown, &info), 0);
  const int copy = memfd_create("grown", MFD_CLOEXEC);
  ASSERT_GE(copy, 0);
  std::string bytes(static_cast<size_t>(info.st_size) + 1, '\0');
  ASSERT_EQ(pread(grown, bytes.data(), static_cast<size_t>(info.st_size), 0), info.st_size);
  ASSERT_EQ(write(copy, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  close(grown);
  EXPECT_THAT(RestartJournal::Open(ScopedFd(copy)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs(absl::StrCat("kept restart journal of ", bytes.size(),
                                               " bytes claims 2 slots"))));
}

}  // namespace
}  // namespace memra
