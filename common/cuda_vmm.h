#ifndef MEMRA_COMMON_CUDA_VMM_H_
#define MEMRA_COMMON_CUDA_VMM_H_

// CUDA VMM allocations shared as POSIX file descriptors (the cuda backend's `cuda_export = "vmm"`
// mode, docs/architecture.md): cuMemCreate with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
// exported with cuMemExportToShareableHandle and imported with cuMemImportFromShareableHandle,
// each side mapping it with cuMemAddressReserve + cuMemMap + cuMemSetAccess. Unlike legacy IPC
// memory, an allocation lives while any process (or kept descriptor) holds it, so the daemon's
// arenas survive its restart (the fd store keeps the descriptors) and are handed to engines over
// the same side channel as host memfds. The daemon (server/device/cuda_backend.h) and the engine
// library (client/cuda_mapper.h) both use this. Built only where the toolkit is (HAS_CUDA).
// The driver API is reached through the runtime (cudaGetDriverEntryPointByVersion), never
// linked: a binary built with the toolkit still starts on a machine without the driver.

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace memra {

// How a VMM arena's export handle starts (then 32 random hex characters); an IPC handle never
// does, so the engine's mapper tells the two modes apart by it.
inline constexpr absl::string_view kVmmHandlePrefix = "vmm-";

// The allocation granularity cuMemGetAllocationGranularity recommends for `device` (a CUDA
// ordinal): every VMM arena's size is a multiple of it.
absl::StatusOr<uint64_t> VmmGranularity(int device);

// The bytes of the allocation that starts at `device_pointer` on `device`
// (cuMemGetAddressRange): what a CUDA IPC handle opened there exports, so the block store checks
// an engine's buffers against it. INVALID_ARGUMENT when the pointer is not an allocation's start.
absl::StatusOr<uint64_t> DeviceAllocationBytes(int device, const void* device_pointer);

// One VMM allocation mapped read-write on its device in this process. Move-only; unmaps, frees
// the address range and releases the handle on destruction (the memory itself goes when the
// last holder anywhere releases it).
class VmmMapping {
 public:
  // A new allocation of `bytes` (a multiple of VmmGranularity(device)) on `device`, exportable
  // as a POSIX file descriptor. Not zero-filled.
  static absl::StatusOr<VmmMapping> Create(int device, uint64_t bytes);
  // Maps the allocation `fd` shares (another process's export, or a kept descriptor). Does not
  // take `fd`. INVALID_ARGUMENT for a `bytes` that is not a multiple of the granularity.
  static absl::StatusOr<VmmMapping> Import(int device, int fd, uint64_t bytes);

  VmmMapping(VmmMapping&& other) noexcept;
  VmmMapping& operator=(VmmMapping&&) = delete;
  VmmMapping(const VmmMapping&) = delete;
  ~VmmMapping();

  // A new descriptor sharing the allocation, owned by the caller.
  absl::StatusOr<int> ExportFd() const;
  void* data() const { return reinterpret_cast<void*>(address_); }
  uint64_t bytes() const { return bytes_; }

 private:
  VmmMapping(int device, uint64_t handle, uint64_t address, uint64_t bytes)
      : device_(device), handle_(handle), address_(address), bytes_(bytes) {}
  // Maps `handle` (owned from here on) as `bytes` on `device`: the mapping, or the error after
  // releasing everything.
  static absl::StatusOr<VmmMapping> Map(int device, uint64_t handle, uint64_t bytes);

  int device_;
  uint64_t handle_;   // CUmemGenericAllocationHandle; 0 after a move
  uint64_t address_;  // CUdeviceptr of the reserved and mapped range
  uint64_t bytes_;
};

}  // namespace memra

#endif  // MEMRA_COMMON_CUDA_VMM_H_
