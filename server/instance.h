#ifndef MEMRA_SERVER_INSTANCE_H_
#define MEMRA_SERVER_INSTANCE_H_

// One memra-kvd instance per socket: an exclusive lock beside the socket, the shared-memory name
// prefix that belongs to that socket, and removal of the objects a crashed predecessor left in
// /dev/shm (a crash skips the destructors that unlink them; nothing else ever would).

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/config.h"

namespace memra {

// "memra-kv-gpu<device>-<8 hex of the socket path>": instances on one device with different
// sockets (tests, a second daemon) never share a prefix, so cleaning one never touches another.
std::string ShmPrefix(const DaemonConfig& config);

// flock(LOCK_EX) on "<socket path>.lock", held until destruction. Move-only.
class InstanceLock {
 public:
  // FAILED_PRECONDITION when another live process holds it.
  static absl::StatusOr<InstanceLock> Acquire(const std::string& socket_path);
  InstanceLock(InstanceLock&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  InstanceLock& operator=(InstanceLock&&) = delete;
  ~InstanceLock();

 private:
  explicit InstanceLock(int fd) : fd_(fd) {}
  int fd_;
};

// Unlinks every "<shm_dir>/<prefix>-<32 lowercase hex>" (the host backend's names) and returns
// how many. REQUIRES: the caller holds the InstanceLock of the socket `prefix` belongs to and has
// created no arena yet, so every match is a dead predecessor's.
absl::StatusOr<size_t> RemoveStaleShmObjects(absl::string_view prefix,
                                             const std::string& shm_dir = "/dev/shm");

}  // namespace memra

#endif  // MEMRA_SERVER_INSTANCE_H_
