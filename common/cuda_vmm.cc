#include "common/cuda_vmm.h"

#include <cuda.h>
#include <unistd.h>

#include <cstdint>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace memra {
namespace {

// A driver API error as a status naming the call and the numbers.
absl::Status CuError(absl::string_view context, CUresult result) {
  const char* name = nullptr;
  const char* text = nullptr;
  cuGetErrorName(result, &name);
  cuGetErrorString(result, &text);
  const std::string message =
      absl::StrCat(context, ": ", name != nullptr ? name : "CUDA_ERROR", " (",
                   static_cast<int>(result), "): ", text != nullptr ? text : "unknown");
  switch (result) {
    case CUDA_ERROR_OUT_OF_MEMORY:
      return absl::ResourceExhaustedError(message);
    case CUDA_ERROR_INVALID_VALUE:
      return absl::InvalidArgumentError(message);
    case CUDA_ERROR_NOT_SUPPORTED:
    case CUDA_ERROR_NO_DEVICE:
    case CUDA_ERROR_NOT_INITIALIZED:
      return absl::FailedPreconditionError(message);
    default:
      return absl::InternalError(message);
  }
}

CUmemAllocationProp AllocationProperties(int device) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

// The driver needs a current context: the device's primary one (what the runtime uses).
absl::Status UsePrimaryContext(int device) {
  if (CUresult r = cuInit(0); r != CUDA_SUCCESS) return CuError("cuInit", r);
  CUdevice handle;
  if (CUresult r = cuDeviceGet(&handle, device); r != CUDA_SUCCESS) {
    return CuError(absl::StrCat("cuDeviceGet ", device), r);
  }
  CUcontext context;
  if (CUresult r = cuDevicePrimaryCtxRetain(&context, handle); r != CUDA_SUCCESS) {
    return CuError(absl::StrCat("cuDevicePrimaryCtxRetain ", device), r);
  }
  if (CUresult r = cuCtxSetCurrent(context); r != CUDA_SUCCESS) {
    return CuError(absl::StrCat("cuCtxSetCurrent ", device), r);
  }
  // The retain is balanced by the runtime's own use of the primary context for the process's
  // life; releasing it here could destroy a context the runtime still uses.
  return absl::OkStatus();
}

absl::Status CheckMultiple(int device, uint64_t bytes) {
  absl::StatusOr<uint64_t> granularity = VmmGranularity(device);
  if (!granularity.ok()) return granularity.status();
  if (bytes == 0 || bytes % *granularity != 0) {
    return absl::InvalidArgumentError(absl::StrCat("a VMM arena of ", bytes,
                                                   " bytes is not a positive multiple of the ",
                                                   *granularity, "-byte granularity of device ",
                                                   device));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<uint64_t> VmmGranularity(int device) {
  if (absl::Status status = UsePrimaryContext(device); !status.ok()) return status;
  const CUmemAllocationProp prop = AllocationProperties(device);
  size_t granularity = 0;
  if (CUresult r = cuMemGetAllocationGranularity(&granularity, &prop,
                                                 CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
      r != CUDA_SUCCESS) {
    return CuError(absl::StrCat("cuMemGetAllocationGranularity on device ", device), r);
  }
  return static_cast<uint64_t>(granularity);
}

absl::StatusOr<VmmMapping> VmmMapping::Map(int device, uint64_t handle, uint64_t bytes) {
  auto release = [&] { cuMemRelease(static_cast<CUmemGenericAllocationHandle>(handle)); };
  absl::StatusOr<uint64_t> granularity = VmmGranularity(device);
  if (!granularity.ok()) {
    release();
    return granularity.status();
  }
  CUdeviceptr address = 0;
  if (CUresult r = cuMemAddressReserve(&address, bytes, *granularity, 0, 0); r != CUDA_SUCCESS) {
    release();
    return CuError(absl::StrCat("cuMemAddressReserve ", bytes, " bytes"), r);
  }
  if (CUresult r = cuMemMap(address, bytes, 0, static_cast<CUmemGenericAllocationHandle>(handle),
                            0);
      r != CUDA_SUCCESS) {
    cuMemAddressFree(address, bytes);
    release();
    return CuError(absl::StrCat("cuMemMap ", bytes, " bytes"), r);
  }
  CUmemAccessDesc access = {};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (CUresult r = cuMemSetAccess(address, bytes, &access, 1); r != CUDA_SUCCESS) {
    cuMemUnmap(address, bytes);
    cuMemAddressFree(address, bytes);
    release();
    return CuError(absl::StrCat("cuMemSetAccess ", bytes, " bytes on device ", device), r);
  }
  return VmmMapping(device, handle, static_cast<uint64_t>(address), bytes);
}

absl::StatusOr<VmmMapping> VmmMapping::Create(int device, uint64_t bytes) {
  if (absl::Status status = CheckMultiple(device, bytes); !status.ok()) return status;
  const CUmemAllocationProp prop = AllocationProperties(device);
  CUmemGenericAllocationHandle handle = 0;
  if (CUresult r = cuMemCreate(&handle, bytes, &prop, 0); r != CUDA_SUCCESS) {
    return CuError(absl::StrCat("cuMemCreate ", bytes, " bytes on device ", device), r);
  }
  return Map(device, static_cast<uint64_t>(handle), bytes);
}

absl::StatusOr<VmmMapping> VmmMapping::Import(int device, int fd, uint64_t bytes) {
  if (absl::Status status = CheckMultiple(device, bytes); !status.ok()) return status;
  CUmemGenericAllocationHandle handle = 0;
  if (CUresult r = cuMemImportFromShareableHandle(
          &handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
      r != CUDA_SUCCESS) {
    return CuError(absl::StrCat("cuMemImportFromShareableHandle (fd ", fd, ")"), r);
  }
  return Map(device, static_cast<uint64_t>(handle), bytes);
}

VmmMapping::VmmMapping(VmmMapping&& other) noexcept
    : device_(other.device_),
      handle_(std::exchange(other.handle_, 0)),
      address_(std::exchange(other.address_, 0)),
      bytes_(std::exchange(other.bytes_, 0)) {}

VmmMapping::~VmmMapping() {
  if (handle_ == 0) return;
  // Failures leave nothing to recover; the memory goes with its last holder.
  (void)UsePrimaryContext(device_);
  cuMemUnmap(static_cast<CUdeviceptr>(address_), bytes_);
  cuMemAddressFree(static_cast<CUdeviceptr>(address_), bytes_);
  cuMemRelease(static_cast<CUmemGenericAllocationHandle>(handle_));
}

absl::StatusOr<int> VmmMapping::ExportFd() const {
  int fd = -1;
  if (CUresult r = cuMemExportToShareableHandle(
          &fd, static_cast<CUmemGenericAllocationHandle>(handle_),
          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
      r != CUDA_SUCCESS) {
    return CuError(absl::StrCat("cuMemExportToShareableHandle of ", bytes_, " bytes"), r);
  }
  return fd;
}

}  // namespace memra
