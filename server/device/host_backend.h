#ifndef MEMRA_SERVER_HOST_BACKEND_H_
#define MEMRA_SERVER_HOST_BACKEND_H_

// The embedded default backend: arenas in host memory. Exported arenas are sealed memfds with no
// name in any file system: the export handle is a random token an engine trades, over the handoff
// socket and only for its own session, for a descriptor of the memfd (server/edge/arena_handoff.h).
// Private arenas are anonymous memory. Every test runs on it.

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/device/arena_table.h"
#include "server/device/backend.h"
#include "server/device/checked_arena_backend.h"

namespace memra {

struct HostBackendOptions {
  // Required. Reported capacity, and the bound on the sum of live arena sizes
  // (RESOURCE_EXHAUSTED past it).
  uint64_t total_bytes = 0;
  // The memfds' name (memfd_create): what /proc/<pid>/maps and /proc/<pid>/fd show, for
  // operators; no file system path. [A-Za-z0-9._-], 1..200 chars.
  std::string name_prefix = "memra-kv";
  // Tests only: replaces getrandom(2) as the source of the export handles (32 hex chars).
  std::function<absl::StatusOr<std::string>()> handle_for_testing;
};

// Thread-safe (see DeviceBackend). Data operations run outside the arena-table lock on a
// reference to the arena's mapping. The destructor frees every remaining arena. FreeArena punches
// an exported arena's pages out of its memfd: an engine that still maps it keeps valid memory
// that reads zeros (no SIGBUS; what it touches again is charged to the engine, not the daemon),
// so no engine holds daemon memory past the admission budget, and no page is ever given to
// anything else. A crashed daemon frees nothing: the fd store keeps its arenas whole.
class HostBackend final : public CheckedArenaBackend {
 public:
  // INVALID_ARGUMENT for bad options.
  static absl::StatusOr<std::unique_ptr<HostBackend>> Create(HostBackendOptions options);

  std::string_view Name() const override { return "host"; }
  DeviceInfo Info() override;
  uint64_t AllocationGranularity() const override { return page_size_; }
  absl::Status Synchronize() override { return absl::OkStatus(); }
  absl::Status WaitForEngineEvent(absl::string_view ipc_event_handle) override;
  absl::StatusOr<ArenaId> AdoptArenaFd(int fd, uint64_t bytes,
                                       std::string export_handle) override;
  absl::StatusOr<MappedEngineBuffers> MapEngineBuffers(
      absl::Span<const EngineBufferFd> buffers) override;

 private:
  HostBackend(HostBackendOptions options, uint64_t page_size);

  absl::StatusOr<std::shared_ptr<ArenaRecord>> Allocate(uint64_t bytes,
                                                        ArenaVisibility visibility) override;
  absl::Status Fill(uint8_t* at, uint8_t value, uint64_t bytes) override;
  absl::Status Move(uint8_t* to, const uint8_t* from, uint64_t bytes) override;
  absl::Status Upload(absl::string_view op, uint8_t* to, absl::Span<const uint8_t> data) override;
  absl::Status Download(absl::string_view op, const uint8_t* from,
                        absl::Span<uint8_t> out) override;
  absl::Status StoreI32s(uint8_t* base, absl::Span<const I32Write> writes) override;
  absl::StatusOr<uint64_t> CopyHashed(uint8_t* dst, const uint8_t* src,
                                      absl::Span<const CopyRange> ranges) override;

  absl::StatusOr<std::string> NewExportHandle() const;
  absl::StatusOr<std::shared_ptr<ArenaRecord>> CreateSharedArena(uint64_t bytes) const;

  // Constant after construction.
  const HostBackendOptions options_;
  const uint64_t page_size_;
};

}  // namespace memra

#endif  // MEMRA_SERVER_HOST_BACKEND_H_
