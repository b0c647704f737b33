#include "common/cuda_vmm.h"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <cstdint>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace memra {
namespace {

// The driver entry points this file uses, resolved once through the runtime (which loads
// libcuda itself): linking libcuda would stop every binary built with the toolkit from starting
// where no driver is installed.
struct DriverApi {
  decltype(&cuGetErrorName) GetErrorName = nullptr;
  decltype(&cuGetErrorString) GetErrorString = nullptr;
  decltype(&cuInit) Init = nullptr;
  decltype(&cuDeviceGet) DeviceGet = nullptr;
  decltype(&cuDevicePrimaryCtxRetain) DevicePrimaryCtxRetain = nullptr;
  decltype(&cuCtxSetCurrent) CtxSetCurrent = nullptr;
  decltype(&cuMemGetAllocationGranularity) MemGetAllocationGranularity = nullptr;
  decltype(&cuMemCreate) MemCreate = nullptr;
  decltype(&cuMemAddressReserve) MemAddressReserve = nullptr;
  decltype(&cuMemMap) MemMap = nullptr;
  decltype(&cuMemSetAccess) MemSetAccess = nullptr;
  decltype(&cuMemUnmap) MemUnmap = nullptr;
  decltype(&cuMemAddressFree) MemAddressFree = nullptr;
  decltype(&cuMemRelease) MemRelease = nullptr;
  decltype(&cuMemExportToShareableHandle) MemExportToShareableHandle = nullptr;
  decltype(&cuMemImportFromShareableHandle) MemImportFromShareableHandle = nullptr;
  decltype(&cuMemGetAddressRange) MemGetAddressRange = nullptr;
  absl::Status loaded;
};

// The ABI version the entry points are asked for: VMM with POSIX descriptors as of CUDA 12.0.
constexpr unsigned int kDriverAbiVersion = 12000;

template <typename Function>
absl::Status Resolve(const char* symbol, Function& function) {
  void* address = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t err = cudaGetDriverEntryPointByVersion(symbol, &address, kDriverAbiVersion,
                                                           cudaEnableDefault, &found);
  if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || address == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "CUDA driver entry point ", symbol, " (ABI ", kDriverAbiVersion, ") unavailable: ",
        cudaGetErrorString(err), ", query result ", static_cast<int>(found)));
  }
  function = reinterpret_cast<Function>(address);
  return absl::OkStatus();
}

const DriverApi& Driver() {
  static const DriverApi* const api = [] {
    auto* loaded = new DriverApi;
    absl::Status status;
    for (absl::Status resolved :
         {Resolve("cuGetErrorName", loaded->GetErrorName),
          Resolve("cuGetErrorString", loaded->GetErrorString), Resolve("cuInit", loaded->Init),
          Resolve("cuDeviceGet", loaded->DeviceGet),
          Resolve("cuDevicePrimaryCtxRetain", loaded->DevicePrimaryCtxRetain),
          Resolve("cuCtxSetCurrent", loaded->CtxSetCurrent),
          Resolve("cuMemGetAllocationGranularity", loaded->MemGetAllocationGranularity),
          Resolve("cuMemCreate", loaded->MemCreate),
          Resolve("cuMemAddressReserve", loaded->MemAddressReserve),
          Resolve("cuMemMap", loaded->MemMap), Resolve("cuMemSetAccess", loaded->MemSetAccess),
          Resolve("cuMemUnmap", loaded->MemUnmap),
          Resolve("cuMemAddressFree", loaded->MemAddressFree),
          Resolve("cuMemRelease", loaded->MemRelease),
          Resolve("cuMemExportToShareableHandle", loaded->MemExportToShareableHandle),
          Resolve("cuMemImportFromShareableHandle", loaded->MemImportFromShareableHandle),
          Resolve("cuMemGetAddressRange", loaded->MemGetAddressRange)}) {
      if (status.ok()) status = resolved;
    }
    loaded->loaded = status;
    return loaded;
  }();
  return *api;
}

// A driver API error as a status naming the call and the numbers.
absl::Status CuError(absl::string_view context, CUresult result) {
  const char* name = nullptr;
  const char* text = nullptr;
  Driver().GetErrorName(result, &name);
  Driver().GetErrorString(result, &text);
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
  if (!Driver().loaded.ok()) return Driver().loaded;
  if (CUresult r = Driver().Init(0); r != CUDA_SUCCESS) return CuError("cuInit", r);
  CUdevice handle;
  if (CUresult r = Driver().DeviceGet(&handle, device); r != CUDA_SUCCESS) {
    return CuError(absl::StrCat("cuDeviceGet ", device), r);
  }
  CUcontext context;
  if (CUresult r = Driver().DevicePrimaryCtxRetain(&context, handle); r != CUDA_SUCCESS) {
    return CuError(absl::StrCat("cuDevicePrimaryCtxRetain ", device), r);
  }
  if (CUresult r = Driver().CtxSetCurrent(context); r != CUDA_SUCCESS) {
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
  if (CUresult r = Driver().MemGetAllocationGranularity(&granularity, &prop,
                                                 CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
      r != CUDA_SUCCESS) {
    return CuError(absl::StrCat("cuMemGetAllocationGranularity on device ", device), r);
  }
  return static_cast<uint64_t>(granularity);
}

absl::StatusOr<uint64_t> DeviceAllocationBytes(int device, const void* device_pointer) {
  if (absl::Status status = UsePrimaryContext(device); !status.ok()) return status;
  const auto address = reinterpret_cast<CUdeviceptr>(device_pointer);
  CUdeviceptr base = 0;
  size_t bytes = 0;
  if (CUresult r = Driver().MemGetAddressRange(&base, &bytes, address); r != CUDA_SUCCESS) {
    return CuError(absl::StrCat("cuMemGetAddressRange of device address ", address), r);
  }
  if (base != address) {
    return absl::InvalidArgumentError(absl::StrCat("device address ", address,
                                                   " is inside the allocation at ", base,
                                                   ", not its start"));
  }
  return static_cast<uint64_t>(bytes);
}

absl::StatusOr<VmmMapping> VmmMapping::Map(int device, uint64_t handle, uint64_t bytes) {
  auto release = [&] { Driver().MemRelease(static_cast<CUmemGenericAllocationHandle>(handle)); };
  absl::StatusOr<uint64_t> granularity = VmmGranularity(device);
  if (!granularity.ok()) {
    release();
    return granularity.status();
  }
  CUdeviceptr address = 0;
  if (CUresult r = Driver().MemAddressReserve(&address, bytes, *granularity, 0, 0); r != CUDA_SUCCESS) {
    release();
    return CuError(absl::StrCat("cuMemAddressReserve ", bytes, " bytes"), r);
  }
  if (CUresult r = Driver().MemMap(address, bytes, 0, static_cast<CUmemGenericAllocationHandle>(handle),
                            0);
      r != CUDA_SUCCESS) {
    Driver().MemAddressFree(address, bytes);
    release();
    return CuError(absl::StrCat("cuMemMap ", bytes, " bytes"), r);
  }
  CUmemAccessDesc access = {};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (CUresult r = Driver().MemSetAccess(address, bytes, &access, 1); r != CUDA_SUCCESS) {
    Driver().MemUnmap(address, bytes);
    Driver().MemAddressFree(address, bytes);
    release();
    return CuError(absl::StrCat("cuMemSetAccess ", bytes, " bytes on device ", device), r);
  }
  return VmmMapping(device, handle, static_cast<uint64_t>(address), bytes);
}

absl::StatusOr<VmmMapping> VmmMapping::Create(int device, uint64_t bytes) {
  if (absl::Status status = CheckMultiple(device, bytes); !status.ok()) return status;
  const CUmemAllocationProp prop = AllocationProperties(device);
  CUmemGenericAllocationHandle handle = 0;
  if (CUresult r = Driver().MemCreate(&handle, bytes, &prop, 0); r != CUDA_SUCCESS) {
    return CuError(absl::StrCat("cuMemCreate ", bytes, " bytes on device ", device), r);
  }
  return Map(device, static_cast<uint64_t>(handle), bytes);
}

absl::StatusOr<VmmMapping> VmmMapping::Import(int device, int fd, uint64_t bytes) {
  if (absl::Status status = CheckMultiple(device, bytes); !status.ok()) return status;
  CUmemGenericAllocationHandle handle = 0;
  if (CUresult r = Driver().MemImportFromShareableHandle(
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
  Driver().MemUnmap(static_cast<CUdeviceptr>(address_), bytes_);
  Driver().MemAddressFree(static_cast<CUdeviceptr>(address_), bytes_);
  Driver().MemRelease(static_cast<CUmemGenericAllocationHandle>(handle_));
}

absl::StatusOr<int> VmmMapping::ExportFd() const {
  int fd = -1;
  if (CUresult r = Driver().MemExportToShareableHandle(
          &fd, static_cast<CUmemGenericAllocationHandle>(handle_),
          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
      r != CUDA_SUCCESS) {
    return CuError(absl::StrCat("cuMemExportToShareableHandle of ", bytes_, " bytes"), r);
  }
  return fd;
}

}  // namespace memra
