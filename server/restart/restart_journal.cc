#include "server/restart/restart_journal.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/errors.h"
#include "core/status_macros.h"

namespace memra {
namespace {

constexpr uint64_t kMagic = 0x4a564b41524d454dULL;  // "MEMRAKVJ" little-endian
constexpr uint32_t kFormat = 1;
// The seals that fix a journal's size, so its mapping can never fault.
constexpr int kSizeSeals = F_SEAL_SHRINK | F_SEAL_GROW;

// One half of a slot. `checksum` covers sequence, length and the payload bytes.
struct HalfHeader {
  uint64_t sequence;
  uint64_t checksum;
  uint32_t length;
  uint32_t padding;
};
static_assert(sizeof(HalfHeader) <= RestartJournal::kHalfHeaderBytes);

// xxHash3-64 of the payload seeded with the sequence and length, so each of the three is covered.
uint64_t Checksum(uint64_t sequence, uint32_t length, const uint8_t* payload) {
  return XXH3_64bits_withSeed(payload, length, sequence * 0x9E3779B97F4A7C15ULL ^ length);
}

// A half's record when it is whole; nullopt when never written or torn (`torn` set then;
// `sequence` is then what its header claims, which a whole header still tells).
struct HalfRead {
  uint64_t sequence = 0;
  bool valid = false;
  bool torn = false;
};

HalfRead ReadHalf(const uint8_t* at) {
  HalfHeader header;
  std::memcpy(&header, at, sizeof(header));
  if (header.sequence == 0) return {};  // never written (the file reads as zero)
  if (header.length > RestartJournal::kMaxPayloadBytes ||
      Checksum(header.sequence, header.length, at + RestartJournal::kHalfHeaderBytes) !=
          header.checksum) {
    return HalfRead{.sequence = header.sequence, .valid = false, .torn = true};
  }
  return HalfRead{.sequence = header.sequence, .valid = true, .torn = false};
}

}  // namespace

struct RestartJournal::Header {
  uint64_t magic;
  uint32_t format;
  uint32_t slot_bytes;
  uint64_t slots;
  std::atomic<uint64_t> epoch;
  std::atomic<uint64_t> generation;
  std::atomic<uint64_t> next_engine_id;
  std::atomic<uint64_t> next_session_id;
  // Added within format 1 (the header's spare bytes read as zero in older journals: 0 means
  // `slots`). See session_slot_limit().
  std::atomic<uint64_t> session_slot_limit;
};

absl::StatusOr<std::unique_ptr<RestartJournal>> RestartJournal::Create(uint64_t slots,
                                                                       uint64_t epoch,
                                                                       uint64_t generation) {
  if (slots == 0 || slots > kMaxSlots) {
    return absl::InvalidArgumentError(
        absl::StrCat("restart journal: ", slots, " slots requested; 1..", kMaxSlots, " allowed"));
  }
  const int raw = memfd_create("memra-kv-journal", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (raw < 0) return PosixError("memfd_create for the restart journal", errno);
  ScopedFd fd(raw);
  const uint64_t bytes = kHeaderBytes + slots * kSlotBytes;
  if (ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) {
    return PosixError(absl::StrCat("ftruncate the restart journal to ", bytes, " bytes"), errno);
  }
  // Its size is fixed from here: a truncation (anyone holding the descriptor, the fd store's
  // owner included) would make a write or a read of the mapping fault (SIGBUS) instead of fail.
  if (fcntl(fd.get(), F_ADD_SEALS, kSizeSeals) != 0) {
    return PosixError("sealing the restart journal's size (F_SEAL_SHRINK | F_SEAL_GROW)", errno);
  }
  ASSIGN_OR_RETURN(MappedRegion region,
                   MappedRegion::MapShared(fd.get(), bytes, "the restart journal"));
  static_assert(sizeof(Header) <= kHeaderBytes);
  std::unique_ptr<RestartJournal> journal(
      new RestartJournal(std::move(fd), std::move(region), slots));
  Header* header = journal->header();
  header->magic = kMagic;
  header->format = kFormat;
  header->slot_bytes = kSlotBytes;
  header->slots = slots;
  header->epoch.store(epoch);
  header->generation.store(generation);
  header->next_engine_id.store(1);
  header->next_session_id.store(1);
  header->session_slot_limit.store(slots);
  return journal;
}

absl::StatusOr<std::unique_ptr<RestartJournal>> RestartJournal::Open(ScopedFd fd) {
  // Seal first (a journal of this build is sealed already; one that allows sealing gets the
  // seals now), then read the size the seals fix.
  (void)fcntl(fd.get(), F_ADD_SEALS, kSizeSeals);
  const int seals = fcntl(fd.get(), F_GET_SEALS);
  struct stat info {};
  if (fstat(fd.get(), &info) != 0) return PosixError("fstat of a kept restart journal", errno);
  const uint64_t size = static_cast<uint64_t>(info.st_size);
  if (info.st_size < static_cast<off_t>(kHeaderBytes)) {
    return absl::InvalidArgumentError(absl::StrCat("kept restart journal is ", info.st_size,
                                                   " bytes, less than its ", kHeaderBytes,
                                                   "-byte header"));
  }
  Header copy;
  if (pread(fd.get(), &copy, sizeof(copy), 0) != static_cast<ssize_t>(sizeof(copy))) {
    return PosixError("reading a kept restart journal's header", errno);
  }
  if (copy.magic != kMagic || copy.format != kFormat || copy.slot_bytes != kSlotBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kept restart journal has magic ", copy.magic, ", format ", copy.format, ", slot bytes ",
        copy.slot_bytes, "; this memra-kvd reads format ", kFormat, " with ", kSlotBytes,
        "-byte slots"));
  }
  if (copy.slots == 0 || copy.slots > kMaxSlots ||
      size != kHeaderBytes + copy.slots * kSlotBytes) {
    return absl::InvalidArgumentError(absl::StrCat("kept restart journal of ", size,
                                                   " bytes claims ", copy.slots, " slots"));
  }
  if (seals < 0 || (seals & kSizeSeals) != kSizeSeals) {
    return absl::FailedPreconditionError(absl::StrCat(
        "kept restart journal's seals are 0x", absl::Hex(seals < 0 ? 0 : seals),
        " and cannot be made to include F_SEAL_SHRINK | F_SEAL_GROW (0x", absl::Hex(kSizeSeals),
        "): a truncation could fault (SIGBUS) its reader, so it is not mapped"));
  }
  ASSIGN_OR_RETURN(MappedRegion region,
                   MappedRegion::MapShared(fd.get(), size, "a kept restart journal"));
  return std::unique_ptr<RestartJournal>(
      new RestartJournal(std::move(fd), std::move(region), copy.slots));
}

RestartJournal::Header* RestartJournal::header() const {
  return reinterpret_cast<Header*>(region_.data());
}

uint8_t* RestartJournal::half(uint64_t slot, int which) const {
  return region_.data() + kHeaderBytes + slot * kSlotBytes + which * kHalfBytes;
}

uint64_t RestartJournal::epoch() const { return header()->epoch.load(); }
uint64_t RestartJournal::generation() const { return header()->generation.load(); }
uint64_t RestartJournal::next_engine_id() const { return header()->next_engine_id.load(); }
uint64_t RestartJournal::next_session_id() const { return header()->next_session_id.load(); }

namespace {
void Raise(std::atomic<uint64_t>& mark, uint64_t next) {
  uint64_t now = mark.load();
  while (now < next && !mark.compare_exchange_weak(now, next)) {
  }
}
}  // namespace

void RestartJournal::RaiseNextEngineId(uint64_t next) { Raise(header()->next_engine_id, next); }
void RestartJournal::RaiseNextSessionId(uint64_t next) { Raise(header()->next_session_id, next); }

uint64_t RestartJournal::session_slot_limit() const {
  // Clamped: a header word is no license to grow a slot table past what any journal holds.
  return std::min(std::max(header()->session_slot_limit.load(), slots_), kMaxSlots);
}
void RestartJournal::RaiseSessionSlotLimit(uint64_t limit) {
  Raise(header()->session_slot_limit, limit);
}

absl::Status RestartJournal::Write(uint64_t slot, absl::string_view payload) {
  if (slot >= slots_) {
    return absl::InvalidArgumentError(
        absl::StrCat("restart journal slot ", slot, " of ", slots_));
  }
  if (payload.size() > kMaxPayloadBytes) {
    return absl::InvalidArgumentError(absl::StrCat("restart journal record of ", payload.size(),
                                                   " bytes; a slot holds ", kMaxPayloadBytes));
  }
  // Only this process writes a journal it created (a restarted daemon makes a new one), so both
  // halves are whole here and their sequences say which is older: no checksum to verify.
  HalfHeader first;
  HalfHeader second;
  std::memcpy(&first, half(slot, 0), sizeof(first));
  std::memcpy(&second, half(slot, 1), sizeof(second));
  const uint64_t newest = std::max(first.sequence, second.sequence);
  const int target = first.sequence > second.sequence ? 1 : 0;
  uint8_t* at = half(slot, target);
  HalfHeader header{.sequence = newest + 1,
                    .checksum = 0,
                    .length = static_cast<uint32_t>(payload.size()),
                    .padding = 0};
  std::memcpy(at + kHalfHeaderBytes, payload.data(), payload.size());
  header.checksum = Checksum(header.sequence, header.length, at + kHalfHeaderBytes);
  std::memcpy(at, &header, sizeof(header));
  return absl::OkStatus();
}

RestartJournal::SlotContent RestartJournal::Read(uint64_t slot) const {
  SlotContent content;
  if (slot >= slots_) return content;
  const HalfRead halves[2] = {ReadHalf(half(slot, 0)), ReadHalf(half(slot, 1))};
  content.torn = halves[0].torn || halves[1].torn;
  int newest = -1;
  for (int which = 0; which < 2; ++which) {
    if (halves[which].valid &&
        (newest < 0 || halves[which].sequence > halves[newest].sequence)) {
      newest = which;
    }
  }
  // A write lays the payload down before the header, so a write the daemon died in leaves the
  // older header (a lower sequence) over a torn payload. A torn half claiming a higher sequence
  // than the whole one finished its write and was damaged since, or its header write was torn:
  // either way the whole half may be older than what the engine was told.
  for (int which = 0; which < 2; ++which) {
    if (halves[which].torn &&
        (newest < 0 || halves[which].sequence > halves[newest].sequence)) {
      content.newest_damaged = true;
    }
  }
  if (newest < 0) return content;
  HalfHeader header;
  std::memcpy(&header, half(slot, newest), sizeof(header));
  if (header.length == 0) return content;
  content.payload.emplace(reinterpret_cast<const char*>(half(slot, newest) + kHalfHeaderBytes),
                          header.length);
  return content;
}

}  // namespace memra
