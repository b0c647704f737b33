#ifndef MEMRA_CLIENT_MAPPER_H_
#define MEMRA_CLIENT_MAPPER_H_

// The engine side of the device seam: turns an arena export (backend name, opaque handle, bytes)
// from the daemon into a pointer the engine's kernels use. Opening a handle is expensive (a CUDA
// IPC open costs ~1 ms; a host arena's descriptor is a round trip over the handoff socket), so
// every mapper opens each handle once and caches the mapping.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
#include "common/mapped_region.h"

namespace memra {

// Where a host arena's descriptor comes from when its handle is not mapped yet: the daemon's
// handoff socket (KvClient asks it with the session's id and token). Called at most once per
// Map, only on a cache miss, with the mapper's lock held.
using ArenaFdSource = absl::FunctionRef<absl::StatusOr<ArenaFd>()>;

// Thread-safe: any method from any thread. A pointer returned by Map() stays valid until Unmap()
// of its handle or the mapper's destruction.
class ArenaMapper {
 public:
  virtual ~ArenaMapper() = default;

  // The arena's base address. A handle already mapped returns the cached address without
  // re-opening (and without calling `fetch_fd`). INVALID_ARGUMENT for another backend's export
  // or a malformed handle; FAILED_PRECONDITION when `bytes` disagrees with the arena (or with an
  // earlier Map of it); `fetch_fd`'s refusal as it is (e.g. NOT_FOUND when the arena no longer
  // exists, PERMISSION_DENIED when it is not this engine's).
  virtual absl::StatusOr<void*> Map(std::string_view backend, std::string_view handle,
                                    uint64_t bytes, ArenaFdSource fetch_fd) = 0;
  // Map() for backends whose handles alone open the arena (cuda IPC handles): a host or CUDA
  // VMM arena's first Map through it is FAILED_PRECONDITION.
  absl::StatusOr<void*> Map(std::string_view backend, std::string_view handle, uint64_t bytes);
  // NOT_FOUND when the handle is not mapped.
  virtual absl::Status Unmap(std::string_view handle) = 0;
  // Real opens so far (cache hits excluded).
  virtual size_t OpenCount() const = 0;
};

// The handle cache every mapper shares; a backend's mapper supplies Open().
//
// Invariants: (1) at most one live mapping per handle; (2) an entry's `bytes` is the size it was
// opened with; (3) opens_ counts successful Open() calls.
class CachingArenaMapper : public ArenaMapper {
 public:
  using ArenaMapper::Map;
  absl::StatusOr<void*> Map(std::string_view backend, std::string_view handle, uint64_t bytes,
                            ArenaFdSource fetch_fd) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Unmap(std::string_view handle) override ABSL_LOCKS_EXCLUDED(mu_);
  size_t OpenCount() const override ABSL_LOCKS_EXCLUDED(mu_);
  size_t MappedCount() const ABSL_LOCKS_EXCLUDED(mu_);

  // One open handle; closes it on destruction.
  class Mapping {
   public:
    virtual ~Mapping() = default;
    virtual void* data() const = 0;
  };

 protected:
  // `backend` is the ArenaExport::backend this mapper accepts.
  explicit CachingArenaMapper(std::string backend) : backend_(std::move(backend)) {}

  // Opens `handle` (validated by the implementation) as exactly `bytes` bytes, with the
  // descriptor `fetch_fd` gives when the backend needs one. Called with the cache lock held, so
  // a handle is never opened twice concurrently; must not call back into this mapper.
  virtual absl::StatusOr<std::unique_ptr<Mapping>> Open(absl::string_view handle, uint64_t bytes,
                                                        ArenaFdSource fetch_fd) = 0;

 private:
  struct Entry {
    std::unique_ptr<Mapping> mapping;
    uint64_t bytes;
  };

  const std::string backend_;  // constant after construction

  mutable absl::Mutex mu_;
  // Destroying the map closes every handle still open: nothing leaks past the mapper.
  absl::flat_hash_map<std::string, Entry> mapped_ ABSL_GUARDED_BY(mu_);
  size_t opens_ ABSL_GUARDED_BY(mu_) = 0;
};

// Maps the host backend's exports: the handle (opaque, 1..256 bytes) is traded for the arena's
// memfd through `fetch_fd`, which is mmap'd MAP_SHARED and closed (the mapping keeps the memory).
class HostArenaMapper final : public CachingArenaMapper {
 public:
  HostArenaMapper() : CachingArenaMapper("host") {}

 private:
  absl::StatusOr<std::unique_ptr<Mapping>> Open(absl::string_view handle, uint64_t bytes,
                                                ArenaFdSource fetch_fd) override;
};

}  // namespace memra

#endif  // MEMRA_CLIENT_MAPPER_H_
