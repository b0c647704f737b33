#ifndef MEMRA_SERVER_CHECKED_ARENA_BACKEND_H_
#define MEMRA_SERVER_CHECKED_ARENA_BACKEND_H_

// The half of a DeviceBackend that is the same on every device: arena lookup, overflow-checked
// bounds, export refusal for private arenas and accounting. A concrete backend supplies
// allocation and six primitives that only ever see ranges already checked, so invariant (2) of
// DeviceBackend holds for every backend by construction.

#include <cstdint>
#include <memory>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "server/device/arena_table.h"
#include "server/device/backend.h"

namespace memra {

// Thread-safe as DeviceBackend requires, provided the primitives are.
class CheckedArenaBackend : public DeviceBackend {
 public:
  absl::StatusOr<ArenaId> CreateArena(uint64_t bytes, ArenaVisibility visibility) final;
  absl::StatusOr<ArenaExport> Export(ArenaId arena) final;
  absl::StatusOr<int> DuplicateArenaFd(ArenaId arena) final;
  absl::Status FreeArena(ArenaId arena) final;

  absl::Status Memset(ArenaId arena, uint64_t offset, uint8_t value, uint64_t bytes) final;
  absl::Status Copy(ArenaId dst, uint64_t dst_offset, ArenaId src, uint64_t src_offset,
                    uint64_t bytes) final;
  absl::Status WriteI32(ArenaId arena, uint64_t offset, int32_t value) final;
  absl::Status WriteI32s(ArenaId arena, absl::Span<const I32Write> writes) final;
  absl::StatusOr<int32_t> ReadI32(ArenaId arena, uint64_t offset) final;
  absl::Status Write(ArenaId arena, uint64_t offset, absl::Span<const uint8_t> data) final;
  absl::Status Read(ArenaId arena, uint64_t offset, absl::Span<uint8_t> out) final;
  absl::StatusOr<uint64_t> CopyRangesChecksummed(ArenaId dst, ArenaId src,
                                                 absl::Span<const CopyRange> ranges) final;

  uint64_t AllocatedBytes() const final { return arenas_.live_bytes(); }
  size_t ArenaCount() const final { return arenas_.size(); }

 protected:
  // `backend` is Name(), for messages; `capacity` bounds the sum of arena sizes. Records free
  // their own memory, so remaining arenas are released after the subclass is gone: a record's
  // destructor must not depend on the backend object.
  CheckedArenaBackend(std::string backend, uint64_t capacity)
      : arenas_(std::move(backend), capacity) {}

  // Files `record` (of exactly `bytes`, exported) as a new arena against the capacity: a
  // subclass's AdoptArenaFd maps the descriptor in `adopt` and this does the bookkeeping.
  absl::StatusOr<ArenaId> FileAdopted(
      uint64_t bytes, absl::FunctionRef<absl::StatusOr<std::shared_ptr<ArenaRecord>>(uint64_t)>
                          adopt);

  // Files `record`, memory an engine owns (MapEngineBuffers), without a charge.
  ArenaId FileEngineMemory(std::shared_ptr<ArenaRecord> record) {
    return arenas_.FileUncharged(std::move(record));
  }
  // A zero-filled arena of exactly `bytes` (already rounded); export_handle() set iff exported.
  virtual absl::StatusOr<std::shared_ptr<ArenaRecord>> Allocate(uint64_t bytes,
                                                                ArenaVisibility visibility) = 0;

  // The primitives: every pointer range [at, at + bytes) lies inside one live arena.
  virtual absl::Status Fill(uint8_t* at, uint8_t value, uint64_t bytes) = 0;
  // `to` and `from` may overlap (only within one arena): memmove semantics.
  virtual absl::Status Move(uint8_t* to, const uint8_t* from, uint64_t bytes) = 0;
  // `op` names the public call in errors.
  virtual absl::Status Upload(absl::string_view op, uint8_t* to,
                              absl::Span<const uint8_t> data) = 0;
  virtual absl::Status Download(absl::string_view op, const uint8_t* from,
                                absl::Span<uint8_t> out) = 0;
  // Each write's offset is relative to `base`, the start of one arena.
  virtual absl::Status StoreI32s(uint8_t* base, absl::Span<const I32Write> writes) = 0;
  // Copies each range from `src` + src_offset to `dst` + dst_offset (distinct arenas) and
  // returns the xxHash3-64 (seed 0) of the source bytes in range order.
  virtual absl::StatusOr<uint64_t> CopyHashed(uint8_t* dst, const uint8_t* src,
                                              absl::Span<const CopyRange> ranges) = 0;

 private:
  absl::Status WriteBytes(absl::string_view op, ArenaId id, uint64_t offset,
                          absl::Span<const uint8_t> data);
  absl::Status ReadBytes(absl::string_view op, ArenaId id, uint64_t offset,
                         absl::Span<uint8_t> out);

  ArenaTable arenas_;  // thread-safe itself
};

}  // namespace memra

#endif  // MEMRA_SERVER_CHECKED_ARENA_BACKEND_H_
