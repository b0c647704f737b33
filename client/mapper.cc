#include "client/mapper.h"

#include <sys/stat.h>

#include <cerrno>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "common/errors.h"
#include "common/mapped_region.h"

namespace memra {
namespace {

constexpr size_t kMaxHostHandleBytes = 256;  // common/handoff_wire.h kMaxHandleBytes

absl::string_view AsAbsl(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// Handles may be binary (CUDA IPC); messages show them escaped.
std::string Printable(absl::string_view handle) { return absl::CHexEscape(handle); }

class ShmMapping final : public CachingArenaMapper::Mapping {
 public:
  explicit ShmMapping(MappedRegion region) : region_(std::move(region)) {}
  void* data() const override { return region_.data(); }

 private:
  MappedRegion region_;
};

}  // namespace

absl::StatusOr<void*> ArenaMapper::Map(std::string_view backend, std::string_view handle,
                                       uint64_t bytes) {
  return Map(backend, handle, bytes, []() -> absl::StatusOr<ArenaFd> {
    return absl::FailedPreconditionError(
        "a host arena (or a CUDA VMM one) is mapped from the descriptor the daemon hands its "
        "owning engine over the handoff socket: map it through a KvClient session (or pass a "
        "descriptor source)");
  });
}

absl::StatusOr<void*> CachingArenaMapper::Map(std::string_view backend_name,
                                              std::string_view handle_name, uint64_t bytes,
                                              ArenaFdSource fetch_fd) {
  const absl::string_view backend = AsAbsl(backend_name);
  const absl::string_view handle = AsAbsl(handle_name);
  if (backend != backend_) {
    return absl::InvalidArgumentError(absl::StrCat("the ", backend_, " mapper cannot map a \"",
                                                   Printable(backend), "\" arena export"));
  }
  if (bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Map ", Printable(handle), ": an arena of 0 bytes"));
  }
  absl::MutexLock lock(&mu_);
  if (auto it = mapped_.find(handle); it != mapped_.end()) {
    if (it->second.bytes != bytes) {
      return absl::FailedPreconditionError(absl::StrCat("Map ", Printable(handle),
                                                        ": already mapped with ", it->second.bytes,
                                                        " bytes, asked for ", bytes));
    }
    return it->second.mapping->data();
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Mapping> mapping, Open(handle, bytes, fetch_fd));
  ++opens_;
  void* data = mapping->data();
  mapped_.emplace(std::string(handle), Entry{.mapping = std::move(mapping), .bytes = bytes});
  return data;
}

absl::Status CachingArenaMapper::Unmap(std::string_view handle_name) {
  const absl::string_view handle = AsAbsl(handle_name);
  absl::MutexLock lock(&mu_);
  auto it = mapped_.find(handle);
  if (it == mapped_.end()) {
    return absl::NotFoundError(absl::StrCat("Unmap ", Printable(handle), ": not mapped"));
  }
  mapped_.erase(it);
  return absl::OkStatus();
}

size_t CachingArenaMapper::OpenCount() const {
  absl::MutexLock lock(&mu_);
  return opens_;
}

size_t CachingArenaMapper::MappedCount() const {
  absl::MutexLock lock(&mu_);
  return mapped_.size();
}

absl::StatusOr<std::unique_ptr<CachingArenaMapper::Mapping>> HostArenaMapper::Open(
    absl::string_view handle, uint64_t bytes, ArenaFdSource fetch_fd) {
  if (handle.empty() || handle.size() > kMaxHostHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("\"", Printable(handle),
                                                   "\" is not a host arena handle (1 to ",
                                                   kMaxHostHandleBytes, " bytes)"));
  }
  ASSIGN_OR_RETURN(ArenaFd arena, fetch_fd());
  const std::string what = absl::StrCat("host arena ", Printable(handle));
  struct stat st;
  if (fstat(arena.fd.get(), &st) != 0) return PosixError(absl::StrCat("fstat ", what), errno);
  // Mapping past the memory's end would turn the engine's first touch there into SIGBUS.
  if (static_cast<uint64_t>(st.st_size) != bytes || arena.bytes != bytes) {
    return absl::FailedPreconditionError(
        absl::StrCat("Map ", what, ": the descriptor holds ", st.st_size, " bytes (the daemon said ",
                     arena.bytes, "), asked for ", bytes));
  }
  ASSIGN_OR_RETURN(MappedRegion region, MappedRegion::MapShared(arena.fd.get(), bytes, what));
  return std::make_unique<ShmMapping>(std::move(region));
}

}  // namespace memra
