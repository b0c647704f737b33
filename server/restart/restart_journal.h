#ifndef MEMRA_SERVER_RESTART_JOURNAL_H_
#define MEMRA_SERVER_RESTART_JOURNAL_H_

// The restart journal's storage: a memfd of fixed-size record slots, mapped and written in place,
// that memra-kvd keeps in the service manager's file-descriptor store so the next daemon finds
// it (server/restart/restart_state.h decides what goes in; nothing of it is on disk).
//
// Layout: a 4 KiB header (magic, format, slot count, the writing daemon's epoch, a generation
// that grows by one per daemon start, id high-water marks), then `slots` slots of kSlotBytes.
// A slot is two halves; a write goes to the half not holding the newest valid record, as
// {sequence, length, checksum, payload}, so a write torn by the daemon's death leaves the
// previous record readable: the checksum (xxHash3-64 over sequence, length and payload) tells a
// torn half from a whole one. A cleared slot holds a newest record of length 0.
//
// Thread-safety: writes to different slots may run concurrently; the caller serialises writes
// to one slot (a session's records are written under the session's mutex). Header setters are
// atomic stores.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/mapped_region.h"

namespace memra {

class RestartJournal {
 public:
  static constexpr uint64_t kSlotBytes = 2048;
  static constexpr uint64_t kHalfBytes = kSlotBytes / 2;
  static constexpr uint64_t kHalfHeaderBytes = 24;  // sequence, checksum, length + padding
  static constexpr uint64_t kMaxPayloadBytes = kHalfBytes - kHalfHeaderBytes;
  static constexpr uint64_t kHeaderBytes = 4096;
  static constexpr uint64_t kMaxSlots = uint64_t{1} << 24;

  // A new journal of `slots` slots (1..kMaxSlots) in a new memfd, stamped with `epoch` and
  // `generation`, its size sealed. The file is sparse: pages exist only for slots written.
  static absl::StatusOr<std::unique_ptr<RestartJournal>> Create(uint64_t slots, uint64_t epoch,
                                                                uint64_t generation);
  // Maps a journal a previous daemon kept (takes `fd`). INVALID_ARGUMENT naming what is wrong
  // for a file that is not a journal of this format (bad magic, format, or a size that does not
  // match its slot count); FAILED_PRECONDITION for one whose size is not sealed
  // (F_SEAL_SHRINK | F_SEAL_GROW, added here when the file still allows it). A journal this
  // class creates is sealed so: truncating it fails (EPERM) instead of faulting its readers.
  static absl::StatusOr<std::unique_ptr<RestartJournal>> Open(ScopedFd fd);

  int fd() const { return fd_.get(); }
  uint64_t slots() const { return slots_; }
  uint64_t epoch() const;
  uint64_t generation() const;
  // High-water marks of issued ids (the next daemon issues above them: no id names two things).
  uint64_t next_engine_id() const;
  uint64_t next_session_id() const;
  void RaiseNextEngineId(uint64_t next);
  void RaiseNextSessionId(uint64_t next);
  // Above every session slot (SessionRegistry's dense slot numbers) any session this journal
  // records can hold: at least slots() (a daemon holds fewer sessions than its journal has
  // records), raised to the previous daemon's limit by a daemon that re-adopts its sessions
  // (they keep their slots, whatever this daemon's own size); at most kMaxSlots. A record past
  // it is corrupt.
  uint64_t session_slot_limit() const;
  void RaiseSessionSlotLimit(uint64_t limit);

  // Writes `payload` into `slot`. INVALID_ARGUMENT for a slot out of range or a payload over
  // kMaxPayloadBytes. REQUIRES: this journal was created by this process (a restarted daemon
  // reads the previous journal and writes its own), so no half is torn.
  absl::Status Write(uint64_t slot, absl::string_view payload);
  // Makes `slot` read as empty.
  absl::Status Clear(uint64_t slot) { return Write(slot, ""); }

  struct SlotContent {
    std::optional<std::string> payload;  // nullopt: empty (never written, or cleared)
    bool torn = false;  // a half failed its checksum (a write the daemon died in)
    // A torn half claims a newer record than `payload` (or there is no whole half): the
    // newest record was damaged, and `payload` (if any) may be older than what the daemon
    // acknowledged. A write the daemon died in is not this (it leaves the older header).
    bool newest_damaged = false;
  };
  SlotContent Read(uint64_t slot) const;

 private:
  RestartJournal(ScopedFd fd, MappedRegion region, uint64_t slots)
      : fd_(std::move(fd)), region_(std::move(region)), slots_(slots) {}

  struct Header;
  Header* header() const;
  uint8_t* half(uint64_t slot, int which) const;

  const ScopedFd fd_;
  const MappedRegion region_;
  const uint64_t slots_;
};

}  // namespace memra

#endif  // MEMRA_SERVER_RESTART_JOURNAL_H_
