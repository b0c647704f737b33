#include "server/cuda_backend.h"

#include <cstring>
#include <limits>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "server/cuda_errors.h"

namespace memra {
namespace {

// nvidia-smi's form: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx.
std::string FormatUuid(const cudaUUID_t& uuid) {
  const auto* b = reinterpret_cast<const unsigned char*>(uuid.bytes);
  return absl::StrFormat("GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
                         b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11],
                         b[12], b[13], b[14], b[15]);
}

bool Overlaps(uint64_t a, uint64_t b, uint64_t bytes) {
  return a < b ? b - a < bytes : a - b < bytes;
}

}  // namespace

// One cudaMalloc allocation; cudaFree on destruction. `ipc_handle` is set for exported arenas.
class CudaBackend::Arena {
 public:
  Arena(int device, uint8_t* data, uint64_t bytes) : device_(device), data_(data), bytes_(bytes) {}
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  ~Arena() {
    // cudaFree synchronizes the device; a failure here leaves nothing to recover.
    cudaSetDevice(device_);
    cudaFree(data_);
  }

  uint64_t bytes() const { return bytes_; }
  uint8_t* data() const { return data_; }

  std::optional<cudaIpcMemHandle_t> ipc_handle;  // set once, before the arena is shared

 private:
  const int device_;
  uint8_t* const data_;
  const uint64_t bytes_;
};

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(CudaBackendOptions options) {
  int count = 0;
  if (const cudaError_t err = cudaGetDeviceCount(&count); err != cudaSuccess) {
    return absl::FailedPreconditionError(
        absl::StrCat("no usable CUDA device: ", cudaGetErrorString(err), " (error ",
                     static_cast<int>(err), ")"));
  }
  if (count == 0) {
    return absl::FailedPreconditionError("no usable CUDA device: the runtime found 0 devices");
  }
  if (options.device < 0 || options.device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA device ", options.device, " out of range: ", count, " devices"));
  }
  if (const cudaError_t err = cudaSetDevice(options.device); err != cudaSuccess) {
    return CudaError(absl::StrCat("cudaSetDevice ", options.device), err);
  }
  cudaDeviceProp prop;
  if (const cudaError_t err = cudaGetDeviceProperties(&prop, options.device); err != cudaSuccess) {
    return CudaError(absl::StrCat("cudaGetDeviceProperties ", options.device), err);
  }
  cudaStream_t stream;
  if (const cudaError_t err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
      err != cudaSuccess) {
    return CudaError(absl::StrCat("cudaStreamCreate on device ", options.device), err);
  }
  return std::unique_ptr<CudaBackend>(
      new CudaBackend(options.device, stream, prop.name, FormatUuid(prop.uuid)));
}

CudaBackend::CudaBackend(int device, cudaStream_t stream, std::string name, std::string uuid)
    : device_(device),
      stream_(stream),
      name_(std::move(name)),
      uuid_(std::move(uuid)),
      arenas_("cuda", std::numeric_limits<uint64_t>::max()) {}

CudaBackend::~CudaBackend() {
  // Every call synchronizes before returning, so the stream is idle; arenas_ (destroyed after
  // this body) frees the remaining allocations.
  cudaSetDevice(device_);
  cudaStreamDestroy(stream_);
}

absl::Status CudaBackend::SelectDevice() const {
  if (const cudaError_t err = cudaSetDevice(device_); err != cudaSuccess) {
    return CudaError(absl::StrCat("cudaSetDevice ", device_), err);
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::Finish(absl::string_view op, cudaError_t enqueued) const {
  if (enqueued != cudaSuccess) return CudaError(absl::StrCat(op, " on device ", device_), enqueued);
  if (const cudaError_t err = cudaStreamSynchronize(stream_); err != cudaSuccess) {
    return CudaError(absl::StrCat(op, ": cudaStreamSynchronize on device ", device_), err);
  }
  return absl::OkStatus();
}

DeviceInfo CudaBackend::Info() {
  DeviceInfo info{.name = name_, .uuid = uuid_, .total_bytes = 0, .free_bytes = 0};
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  if (SelectDevice().ok() && cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
    info.total_bytes = total_bytes;
    info.free_bytes = free_bytes;
  }
  return info;
}

absl::StatusOr<std::shared_ptr<CudaBackend::Arena>> CudaBackend::Allocate(
    uint64_t bytes, ArenaVisibility visibility) {
  RETURN_IF_ERROR(SelectDevice());
  void* data = nullptr;
  if (const cudaError_t err = cudaMalloc(&data, bytes); err != cudaSuccess) {
    return CudaError(absl::StrCat("cudaMalloc ", bytes, " bytes on device ", device_), err);
  }
  auto arena = std::make_shared<Arena>(device_, static_cast<uint8_t*>(data), bytes);
  RETURN_IF_ERROR(Finish("zero-filling a new arena", cudaMemsetAsync(data, 0, bytes, stream_)));
  if (visibility == ArenaVisibility::kExported) {
    cudaIpcMemHandle_t handle;
    if (const cudaError_t err = cudaIpcGetMemHandle(&handle, data); err != cudaSuccess) {
      return CudaError(absl::StrCat("cudaIpcGetMemHandle for ", bytes, " bytes"), err);
    }
    arena->ipc_handle = handle;
  }
  return arena;
}

absl::StatusOr<ArenaId> CudaBackend::CreateArena(uint64_t bytes, ArenaVisibility visibility) {
  ASSIGN_OR_RETURN(const uint64_t rounded, RoundedArenaBytes(bytes));
  return arenas_.Create(rounded, [&](uint64_t size) { return Allocate(size, visibility); });
}

absl::StatusOr<ArenaExport> CudaBackend::Export(ArenaId id) {
  ASSIGN_OR_RETURN(std::shared_ptr<Arena> arena, arenas_.Find("Export", id));
  if (!arena->ipc_handle.has_value()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cuda Export: arena ", id.value, " is private (daemon-only) and is never exported"));
  }
  return ArenaExport{.backend = "cuda",
                     .handle = std::string(reinterpret_cast<const char*>(&*arena->ipc_handle),
                                           sizeof(cudaIpcMemHandle_t)),
                     .bytes = arena->bytes()};
}

absl::Status CudaBackend::FreeArena(ArenaId id) { return arenas_.Remove(id).status(); }

absl::Status CudaBackend::Memset(ArenaId id, uint64_t offset, uint8_t value, uint64_t bytes) {
  ASSIGN_OR_RETURN(std::shared_ptr<Arena> arena, arenas_.FindRange("Memset", id, offset, bytes));
  RETURN_IF_ERROR(SelectDevice());
  return Finish("Memset", cudaMemsetAsync(arena->data() + offset, value, bytes, stream_));
}

absl::Status CudaBackend::Copy(ArenaId dst_id, uint64_t dst_offset, ArenaId src_id,
                               uint64_t src_offset, uint64_t bytes) {
  ASSIGN_OR_RETURN(std::shared_ptr<Arena> dst,
                   arenas_.FindRange("Copy destination", dst_id, dst_offset, bytes));
  ASSIGN_OR_RETURN(std::shared_ptr<Arena> src,
                   arenas_.FindRange("Copy source", src_id, src_offset, bytes));
  RETURN_IF_ERROR(SelectDevice());
  uint8_t* const to = dst->data() + dst_offset;
  const uint8_t* const from = src->data() + src_offset;
  if (dst_id != src_id || !Overlaps(dst_offset, src_offset, bytes)) {
    return Finish("Copy", cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToDevice, stream_));
  }
  // cudaMemcpy leaves overlapping ranges undefined: stage through stream-ordered scratch.
  void* scratch = nullptr;
  if (const cudaError_t err = cudaMallocAsync(&scratch, bytes, stream_); err != cudaSuccess) {
    return CudaError(absl::StrCat("Copy: cudaMallocAsync ", bytes, " bytes of scratch"), err);
  }
  cudaError_t err = cudaMemcpyAsync(scratch, from, bytes, cudaMemcpyDeviceToDevice, stream_);
  if (err == cudaSuccess) {
    err = cudaMemcpyAsync(to, scratch, bytes, cudaMemcpyDeviceToDevice, stream_);
  }
  const cudaError_t freed = cudaFreeAsync(scratch, stream_);
  return Finish("Copy (overlapping, staged)", err != cudaSuccess ? err : freed);
}

absl::Status CudaBackend::WriteI32(ArenaId id, uint64_t offset, int32_t value) {
  return CopyIn("WriteI32", id, offset,
                absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(&value), sizeof(value)));
}

absl::StatusOr<int32_t> CudaBackend::ReadI32(ArenaId id, uint64_t offset) {
  int32_t value;
  RETURN_IF_ERROR(CopyOut("ReadI32", id, offset,
                          absl::MakeSpan(reinterpret_cast<uint8_t*>(&value), sizeof(value))));
  return value;
}

absl::Status CudaBackend::Write(ArenaId id, uint64_t offset, absl::Span<const uint8_t> data) {
  return CopyIn("Write", id, offset, data);
}

absl::Status CudaBackend::Read(ArenaId id, uint64_t offset, absl::Span<uint8_t> out) {
  return CopyOut("Read", id, offset, out);
}

absl::Status CudaBackend::Synchronize() {
  RETURN_IF_ERROR(SelectDevice());
  return Finish("Synchronize", cudaSuccess);
}

absl::Status CudaBackend::CopyIn(absl::string_view op, ArenaId id, uint64_t offset,
                                 absl::Span<const uint8_t> data) {
  ASSIGN_OR_RETURN(std::shared_ptr<Arena> arena, arenas_.FindRange(op, id, offset, data.size()));
  if (data.empty()) return absl::OkStatus();
  RETURN_IF_ERROR(SelectDevice());
  return Finish(op, cudaMemcpyAsync(arena->data() + offset, data.data(), data.size(),
                                    cudaMemcpyHostToDevice, stream_));
}

absl::Status CudaBackend::CopyOut(absl::string_view op, ArenaId id, uint64_t offset,
                                  absl::Span<uint8_t> out) {
  ASSIGN_OR_RETURN(std::shared_ptr<Arena> arena, arenas_.FindRange(op, id, offset, out.size()));
  if (out.empty()) return absl::OkStatus();
  RETURN_IF_ERROR(SelectDevice());
  return Finish(op, cudaMemcpyAsync(out.data(), arena->data() + offset, out.size(),
                                    cudaMemcpyDeviceToHost, stream_));
}

}  // namespace memra
