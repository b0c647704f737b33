#ifndef MEMRA_SERVER_BACKEND_H_
#define MEMRA_SERVER_BACKEND_H_

// The device seam: every byte of cache memory the daemon owns is reached through a DeviceBackend
// (the role LevelDB's Env plays for files). It generalises the reference's `KvDev` (7 ops;
// docs/rules.md#the-reference): memory comes in arenas (one allocation each, exportable to engine
// processes), and a plane is a caller-chosen (arena, offset, bytes) sub-range of one
// (docs/architecture.md#memory).

#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace memra {

// Names one arena of one backend. Ids are never reused by a backend, so a stale id is NOT_FOUND,
// never someone else's memory. 0 is never issued.
struct ArenaId {
  uint64_t value = 0;

  friend bool operator==(ArenaId a, ArenaId b) { return a.value == b.value; }
  friend bool operator!=(ArenaId a, ArenaId b) { return a.value != b.value; }
  template <typename H>
  friend H AbslHashValue(H h, ArenaId id) {
    return H::combine(std::move(h), id.value);
  }
  friend std::ostream& operator<<(std::ostream& os, ArenaId id) {
    return os << "arena " << id.value;
  }
};

enum class ArenaVisibility {
  kExported,  // engines map it (session planes)
  kPrivate,   // daemon-only, never exported (prefix-cache storage)
};

// What an engine needs to map an exported arena. `handle` is opaque to everything but the
// matching client mapper: on the host backend a random arena handle (32 lowercase hex chars, no
// name anywhere in the file system) the engine trades for the arena's memfd over the handoff
// socket (server/edge/arena_handoff.h); on the cuda backend the 64 raw bytes of cudaIpcMemHandle_t.
// A handle stays the same for the arena's whole life (client mapping caches are keyed by it).
struct ArenaExport {
  std::string backend;
  std::string handle;
  uint64_t bytes = 0;
};

// One range of DeviceBackend::CopyRangesChecksummed.
struct CopyRange {
  uint64_t dst_offset = 0;
  uint64_t src_offset = 0;
  uint64_t bytes = 0;
};

// One 4-byte mirror store of DeviceBackend::WriteI32s.
struct I32Write {
  uint64_t offset = 0;
  int32_t value = 0;
};

// One buffer of an engine's own pool that the daemon maps (DeviceBackend::MapEngineBuffers):
// `bytes` from `offset` of the file behind `fd` (the caller keeps `fd`).
struct EngineBufferFd {
  int fd = -1;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};
// One buffer of an engine's pool on the cuda backend (DeviceBackend::MapEngineIpcBuffers):
// `bytes` from `offset_in_allocation` of the allocation whose cudaIpcMemHandle_t is `ipc_handle`
// (kCudaIpcHandleBytes raw bytes).
struct EngineBufferIpc {
  std::string ipc_handle;
  uint64_t offset_in_allocation = 0;
  uint64_t bytes = 0;
};
inline constexpr size_t kCudaIpcHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t), ...EventHandle_t
struct MappedEngineBuffers {
  ArenaId arena;
  std::vector<uint64_t> base;  // where each buffer starts in the arena
};

struct DeviceInfo {
  std::string name;
  std::string uuid;  // may be empty
  uint64_t total_bytes = 0;
  uint64_t free_bytes = 0;
};

// Thread-safety: every method may be called concurrently from any thread. Operations on one
// arena are not ordered against each other by the backend; callers order their own plane work.
// A data operation racing FreeArena on the same arena is the caller's bug but stays memory-safe.
//
// Invariants every implementation keeps:
//  (1) An arena's size is RoundedArenaBytes(requested): a multiple of AllocationGranularity().
//      Bounds are checked against that size and Export() reports it.
//  (2) Every offset/size is checked with overflow-checked arithmetic before any memory is
//      touched; a refused call (non-OK status) changes nothing.
//  (3) AllocatedBytes() is the sum of the sizes of live arenas and ArenaCount() their number;
//      both return to zero once every arena is freed.
//  (4) Data operations have completed (are visible to a mapping in another process) when they
//      return OK; Synchronize() additionally waits for anything the backend ran asynchronously.
class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;

  // "host" or "cuda": the `backend` an ArenaExport carries and a client mapper expects.
  virtual std::string_view Name() const = 0;
  virtual DeviceInfo Info() = 0;

  // Arena sizes are rounded up to a multiple of this (a nonzero power of two).
  virtual uint64_t AllocationGranularity() const = 0;
  // The bytes CreateArena(bytes, ...) takes, so admission charges exactly that.
  // INVALID_ARGUMENT for 0 bytes or when rounding overflows.
  absl::StatusOr<uint64_t> RoundedArenaBytes(uint64_t bytes) const;

  // A zero-filled arena. RESOURCE_EXHAUSTED when the device has no room.
  virtual absl::StatusOr<ArenaId> CreateArena(uint64_t bytes, ArenaVisibility visibility) = 0;
  // FAILED_PRECONDITION for a private arena.
  virtual absl::StatusOr<ArenaExport> Export(ArenaId arena) = 0;
  // A new descriptor (O_CLOEXEC) of an exported arena's memory, which the caller owns: the host
  // backend's sealed memfd, handed to the owning engine over the handoff socket (and kept across
  // a daemon restart). FAILED_PRECONDITION for a private arena or a backend whose exports are
  // not file descriptors (cuda IPC handles); NOT_FOUND for an unknown arena.
  virtual absl::StatusOr<int> DuplicateArenaFd(ArenaId arena) = 0;
  // Restart survival (server/restart/restart_state.h): files an exported arena of exactly `bytes`
  // whose memory a previous daemon created and kept as `fd` (the fd store), mapping it again. Takes
  // ownership of `fd` (closed on failure too). `export_handle` is what Export() reports, so engines
  // that mapped it before the restart keep the same handle. The arena counts against the capacity
  // like a created one. FAILED_PRECONDITION on a backend whose arenas are not file descriptors;
  // INVALID_ARGUMENT when `bytes` is not RoundedArenaBytes(bytes) or the fd is smaller than
  // `bytes`.
  virtual absl::StatusOr<ArenaId> AdoptArenaFd(int fd, uint64_t bytes,
                                               std::string export_handle);
  // The block store (server/store/block_store.h): maps an engine's own pool memory, the descriptors
  // it offered (checked regular files sealed against shrinking, each at least offset + bytes
  // long), into ONE arena the daemon copies to and from with the ordinary data operations,
  // buffer i at `base[i]`. The arena is the engine's memory: not charged against the capacity,
  // not in AllocatedBytes() or ArenaCount(), never exported; FreeArena unmaps it (the engine's
  // memory stays). INVALID_ARGUMENT for no buffers or a range that overflows;
  // FAILED_PRECONDITION on a backend whose engine memory is not file descriptors (cuda: the
  // pool's CUDA IPC handles: MapEngineIpcBuffers).
  virtual absl::StatusOr<MappedEngineBuffers> MapEngineBuffers(
      absl::Span<const EngineBufferFd> buffers);
  // The same for a cuda engine's pool: opens each distinct IPC handle once (closed when the
  // arena is freed) and checks every buffer lies inside its allocation. The arena's offsets are
  // device address differences; only the buffers' ranges are reachable (a range outside them, or
  // across two, is INVALID_ARGUMENT). INVALID_ARGUMENT for CheckEngineIpcBuffers' refusals or a
  // buffer past its allocation; FAILED_PRECONDITION on a backend without CUDA IPC (host).
  virtual absl::StatusOr<MappedEngineBuffers> MapEngineIpcBuffers(
      absl::Span<const EngineBufferIpc> buffers);
  // After a block store transfer: an interprocess event (cudaIpcEventHandle_t, 64 bytes) the
  // engine waits on before touching the blocks (TransferBlocksResponse.completion_event). Empty
  // where the copies are done when the call returns with nothing for an engine to wait on (host).
  virtual absl::StatusOr<std::string> RecordCompletionEvent();
  // Exported arenas stop being mappable by new clients. What an engine still maps is no longer
  // the daemon's memory: host: the memfd's pages are punched out, so an engine's stale mapping
  // stays valid memory (no SIGBUS) that reads zeros, and any page it touches again is its own
  // (its memory cgroup); cuda: docs/security-model.md#resources says what the driver keeps.
  // Pooled arenas (server/session/arena_pool.h) are not freed, so they keep their bytes.
  virtual absl::Status FreeArena(ArenaId arena) = 0;

  virtual absl::Status Memset(ArenaId arena, uint64_t offset, uint8_t value, uint64_t bytes) = 0;
  // memmove semantics: overlapping ranges of one arena are copied correctly.
  virtual absl::Status Copy(ArenaId dst, uint64_t dst_offset, ArenaId src, uint64_t src_offset,
                            uint64_t bytes) = 0;
  virtual absl::Status WriteI32(ArenaId arena, uint64_t offset, int32_t value) = 0;
  // Every store of `writes`, in order, with the arena looked up once (a session's length mirrors
  // after an operation: one call instead of one per layer). Every offset is checked before the
  // first store, so a refused call stores nothing.
  virtual absl::Status WriteI32s(ArenaId arena, absl::Span<const I32Write> writes) = 0;
  virtual absl::StatusOr<int32_t> ReadI32(ArenaId arena, uint64_t offset) = 0;
  virtual absl::Status Write(ArenaId arena, uint64_t offset, absl::Span<const uint8_t> data) = 0;
  virtual absl::Status Read(ArenaId arena, uint64_t offset, absl::Span<uint8_t> out) = 0;
  // Copies every range from `src` to `dst` (two different arenas) and returns the xxHash3-64
  // (seed 0) of the source bytes in range order: the prefix cache seals what it stores and
  // verifies what it restores in the same pass as the copy, so each byte is read from memory
  // once (a separate checksum pass cost as much as the copy). Every range is checked first; a
  // refused call copies nothing. INVALID_ARGUMENT when `dst` == `src`.
  virtual absl::StatusOr<uint64_t> CopyRangesChecksummed(ArenaId dst, ArenaId src,
                                                         absl::Span<const CopyRange> ranges) = 0;
  virtual absl::Status Synchronize() = 0;

  // Cross-process ordering (docs/architecture.md#calls): blocks the calling thread until the
  // engine's interprocess event `ipc_event_handle` (a cudaIpcEventHandle_t, 64 bytes) has
  // completed, so the daemon's next device work on a session cannot race the engine's kernels on
  // it. Empty: nothing to wait for (OK). The host backend has no device queue (ordering is the
  // RPC order) and refuses a non-empty handle with INVALID_ARGUMENT; cuda: INVALID_ARGUMENT for a
  // handle of the wrong size, the CUDA error when it cannot be opened or waited on.
  virtual absl::Status WaitForEngineEvent(absl::string_view ipc_event_handle) = 0;

  virtual uint64_t AllocatedBytes() const = 0;
  virtual size_t ArenaCount() const = 0;
};

// OK when [offset, offset + bytes) lies inside an arena of `arena_bytes`; otherwise
// INVALID_ARGUMENT naming `op`, the arena and the numbers. Overflow-checked.
absl::Status CheckArenaRange(absl::string_view op, ArenaId arena, uint64_t arena_bytes,
                             uint64_t offset, uint64_t bytes);

// The checks of MapEngineIpcBuffers that need no device: 1 .. 1,024 buffers, each handle
// kCudaIpcHandleBytes, bytes > 0, offset_in_allocation + bytes not overflowing. INVALID_ARGUMENT
// naming the buffer and the numbers.
absl::Status CheckEngineIpcBuffers(absl::Span<const EngineBufferIpc> buffers);
// OK when buffer `index` ([offset_in_allocation, + bytes)) lies inside its allocation of
// `allocation_bytes` (what the driver reports for the opened handle); INVALID_ARGUMENT otherwise.
absl::Status CheckEngineIpcBufferInAllocation(size_t index, const EngineBufferIpc& buffer,
                                              uint64_t allocation_bytes);

}  // namespace memra

#endif  // MEMRA_SERVER_BACKEND_H_
