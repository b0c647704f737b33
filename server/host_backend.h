#ifndef MEMRA_SERVER_HOST_BACKEND_H_
#define MEMRA_SERVER_HOST_BACKEND_H_

// The embedded default backend: arenas in host memory. Exported arenas are POSIX shared-memory
// objects engines map by name; private arenas are anonymous memory. Every test runs on it.

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "server/arena_table.h"
#include "server/backend.h"
#include "server/checked_arena_backend.h"

namespace memra {

struct HostBackendOptions {
  // Required. Reported capacity, and the bound on the sum of live arena sizes
  // (RESOURCE_EXHAUSTED past it).
  uint64_t total_bytes = 0;
  // Permission bits of every shm object (set with fchmod, so the umask does not apply).
  // Must include owner read/write and no bits for others: /dev/shm is world-listable, so the
  // name alone protects nothing.
  mode_t mode = 0600;
  // When set, shm objects are given to this group (engines of another user in it map them);
  // pair it with a mode such as 0660.
  std::optional<gid_t> group;
  // Objects are named "/<name_prefix>-<32 lowercase hex chars>". [A-Za-z0-9._-], 1..200 chars.
  std::string name_prefix = "memra-kv";
  // Tests only: replaces getrandom(2) as the source of the 32-hex-char name suffix.
  std::function<absl::StatusOr<std::string>()> name_suffix_for_testing;
};

// Thread-safe (see DeviceBackend). Data operations run outside the arena-table lock on a
// reference to the arena's mapping. The destructor frees every remaining arena: no shm object
// outlives the backend. (A crashed daemon leaves "/dev/shm/<prefix>-*" behind; removing those
// at start-up is the daemon's job, not this class's.)
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

  absl::StatusOr<std::string> NewObjectName() const;
  absl::StatusOr<std::shared_ptr<ArenaRecord>> CreateSharedArena(uint64_t bytes) const;

  // Constant after construction.
  const HostBackendOptions options_;
  const uint64_t page_size_;
};

}  // namespace memra

#endif  // MEMRA_SERVER_HOST_BACKEND_H_
