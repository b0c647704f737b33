#include "server/device/cuda_backend.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/cuda_vmm.h"
#include "common/errors.h"
#include "common/mapped_region.h"
#include "server/base/secret_token.h"
#include "core/status_macros.h"
#include "common/cuda_errors.h"
#include "server/base/streaming_checksum.h"
#include "common/cuda_memmove.h"

namespace memra {
namespace {

// nvidia-smi's form: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx.
std::string FormatUuid(const cudaUUID_t& uuid) {
  const auto* b = reinterpret_cast<const unsigned char*>(uuid.bytes);
  return absl::StrFormat("GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
                         b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11],
                         b[12], b[13], b[14], b[15]);
}

// Frees a cudaMalloc allocation on its device.
struct DeviceFree {
  int device;
  void operator()(void* data) const {
    // cudaFree synchronizes the device; a failure here leaves nothing to recover.
    cudaSetDevice(device);
    cudaFree(data);
  }
};
using DeviceAllocation = std::unique_ptr<void, DeviceFree>;

// One cudaMalloc allocation, freed with the record (independently of the backend object).
class CudaArena final : public ArenaRecord {
 public:
  CudaArena(DeviceAllocation allocation, uint64_t bytes, std::string ipc_handle)
      : ArenaRecord(static_cast<uint8_t*>(allocation.get()), bytes, std::move(ipc_handle)),
        allocation_(std::move(allocation)) {}

 private:
  DeviceAllocation allocation_;
};

// One VMM allocation (cuda_export = "vmm") and the descriptor that shares it: the daemon's own
// mapping goes with the record; the memory goes when every holder (engines' imports, the fd
// store's copy) has released it.
class VmmArena final : public ArenaRecord {
 public:
  VmmArena(VmmMapping mapping, ScopedFd fd, std::string handle)
      : ArenaRecord(static_cast<uint8_t*>(mapping.data()), mapping.bytes(), std::move(handle)),
        mapping_(std::move(mapping)),
        fd_(std::move(fd)) {}

  absl::StatusOr<int> DuplicateFd() const override {
    const int copy = fcntl(fd_.get(), F_DUPFD_CLOEXEC, 0);
    if (copy < 0) return PosixError("fcntl(F_DUPFD_CLOEXEC) of a VMM arena", errno);
    return copy;
  }

 private:
  VmmMapping mapping_;
  ScopedFd fd_;
};

// An engine's pool (MapEngineIpcBuffers): the allocations its IPC handles opened, closed with
// the record (on their device; independently of the backend object).
class IpcEngineArena final : public SegmentedArenaRecord {
 public:
  IpcEngineArena(int device, std::vector<void*> opened, uint8_t* data, uint64_t bytes,
                 std::vector<Segment> segments)
      : SegmentedArenaRecord(data, bytes, std::move(segments)),
        device_(device),
        opened_(std::move(opened)) {}
  ~IpcEngineArena() override { CloseIpcMappings(device_, opened_); }

  static void CloseIpcMappings(int device, const std::vector<void*>& opened) {
    // Every call synchronized its copies, so nothing in flight uses them.
    cudaSetDevice(device);
    for (void* pointer : opened) cudaIpcCloseMemHandle(pointer);
  }

 private:
  const int device_;
  const std::vector<void*> opened_;
};

// kVmmHandlePrefix + 32 random hex characters: names a VMM arena to its engine (nothing else can open it
// from the name: the memory comes only as a descriptor over the side channel).
absl::StatusOr<std::string> NewVmmHandle() {
  ASSIGN_OR_RETURN(const std::string random, RandomSecretToken());
  return absl::StrCat(kVmmHandlePrefix, absl::BytesToHexString(random));
}

}  // namespace

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
  if (options.vmm_exports) {
    ASSIGN_OR_RETURN(const uint64_t granularity, VmmGranularity(options.device));
    if (granularity == 0 || kGranularity % granularity != 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cuda_export = \"vmm\": device ", options.device, "'s VMM granularity ", granularity,
          " bytes does not divide the backend's ", kGranularity, "-byte arena granularity"));
    }
  }
  cudaStream_t stream;
  if (const cudaError_t err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
      err != cudaSuccess) {
    return CudaError(absl::StrCat("cudaStreamCreate on device ", options.device), err);
  }
  cudaEvent_t completion = nullptr;
  if (const cudaError_t err = cudaEventCreateWithFlags(
          &completion, cudaEventInterprocess | cudaEventDisableTiming);
      err != cudaSuccess) {
    cudaStreamDestroy(stream);
    return CudaError(absl::StrCat("creating the completion event on device ", options.device),
                     err);
  }
  cudaIpcEventHandle_t completion_handle;
  if (const cudaError_t err = cudaIpcGetEventHandle(&completion_handle, completion);
      err != cudaSuccess) {
    cudaEventDestroy(completion);
    cudaStreamDestroy(stream);
    return CudaError("cudaIpcGetEventHandle of the completion event", err);
  }
  return std::unique_ptr<CudaBackend>(new CudaBackend(
      options, stream, completion,
      std::string(reinterpret_cast<const char*>(&completion_handle), sizeof(completion_handle)),
      prop.name, FormatUuid(prop.uuid)));
}

CudaBackend::CudaBackend(const CudaBackendOptions& options, cudaStream_t stream,
                         cudaEvent_t completion, std::string completion_handle,
                         std::string name, std::string uuid)
    : CheckedArenaBackend("cuda", std::numeric_limits<uint64_t>::max()),  // the device decides
      device_(options.device),
      vmm_exports_(options.vmm_exports),
      batch_mirror_writes_(options.batch_mirror_writes),
      stream_(stream),
      completion_event_(completion),
      completion_handle_(std::move(completion_handle)),
      name_(std::move(name)),
      uuid_(std::move(uuid)) {}

CudaBackend::~CudaBackend() {
  {
    absl::MutexLock lock(&events_mu_);
    open_events_.clear();
  }
  // Every call synchronizes before returning, so the stream is idle.
  cudaSetDevice(device_);
  cudaEventDestroy(completion_event_);
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

absl::StatusOr<std::shared_ptr<ArenaRecord>> CudaBackend::Allocate(uint64_t bytes,
                                                                   ArenaVisibility visibility) {
  RETURN_IF_ERROR(SelectDevice());
  if (vmm_exports_ && visibility == ArenaVisibility::kExported) {
    ASSIGN_OR_RETURN(VmmMapping mapping, VmmMapping::Create(device_, bytes));
    RETURN_IF_ERROR(
        Finish("zero-filling a new VMM arena", cudaMemsetAsync(mapping.data(), 0, bytes, stream_)));
    ASSIGN_OR_RETURN(const int fd, mapping.ExportFd());
    ScopedFd owned(fd);
    ASSIGN_OR_RETURN(std::string handle, NewVmmHandle());
    return std::make_shared<VmmArena>(std::move(mapping), std::move(owned), std::move(handle));
  }
  void* data = nullptr;
  if (const cudaError_t err = cudaMalloc(&data, bytes); err != cudaSuccess) {
    return CudaError(absl::StrCat("cudaMalloc ", bytes, " bytes on device ", device_), err);
  }
  DeviceAllocation allocation(data, DeviceFree{device_});
  RETURN_IF_ERROR(Finish("zero-filling a new arena", cudaMemsetAsync(data, 0, bytes, stream_)));
  std::string ipc_handle;
  if (visibility == ArenaVisibility::kExported) {
    cudaIpcMemHandle_t handle;
    if (const cudaError_t err = cudaIpcGetMemHandle(&handle, data); err != cudaSuccess) {
      return CudaError(absl::StrCat("cudaIpcGetMemHandle for ", bytes, " bytes"), err);
    }
    ipc_handle.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
  }
  return std::make_shared<CudaArena>(std::move(allocation), bytes, std::move(ipc_handle));
}

absl::StatusOr<ArenaId> CudaBackend::AdoptArenaFd(int raw_fd, uint64_t bytes,
                                                  std::string export_handle) {
  ScopedFd fd(raw_fd);
  if (!vmm_exports_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cuda AdoptArenaFd: a ", bytes, "-byte arena cannot be adopted with cuda_export = "
        "\"ipc\" (IPC memory dies with its exporter); use \"vmm\""));
  }
  if (export_handle.empty()) {
    return absl::InvalidArgumentError("cuda AdoptArenaFd: an exported arena needs its handle");
  }
  RETURN_IF_ERROR(SelectDevice());
  return FileAdopted(bytes, [&](uint64_t size) -> absl::StatusOr<std::shared_ptr<ArenaRecord>> {
    ASSIGN_OR_RETURN(VmmMapping mapping, VmmMapping::Import(device_, fd.get(), size));
    return std::make_shared<VmmArena>(std::move(mapping), std::move(fd), std::move(export_handle));
  });
}

absl::StatusOr<MappedEngineBuffers> CudaBackend::MapEngineIpcBuffers(
    absl::Span<const EngineBufferIpc> buffers) {
  RETURN_IF_ERROR(CheckEngineIpcBuffers(buffers));
  RETURN_IF_ERROR(SelectDevice());
  // Each distinct handle opened once: cudaIpcOpenMemHandle refuses a second open of one handle
  // in a process, and two tensors of one allocation are two buffers of one handle.
  struct Opened {
    uint8_t* data = nullptr;
    uint64_t bytes = 0;
  };
  absl::flat_hash_map<std::string, Opened> by_handle;
  std::vector<void*> opened;
  auto close_opened = [&] { IpcEngineArena::CloseIpcMappings(device_, opened); };
  std::vector<uint8_t*> starts;  // buffer i's device address
  for (size_t i = 0; i < buffers.size(); ++i) {
    const EngineBufferIpc& buffer = buffers[i];
    auto it = by_handle.find(buffer.ipc_handle);
    if (it == by_handle.end()) {
      cudaIpcMemHandle_t handle;
      std::memcpy(&handle, buffer.ipc_handle.data(), sizeof(handle));
      void* pointer = nullptr;
      if (const cudaError_t err =
              cudaIpcOpenMemHandle(&pointer, handle, cudaIpcMemLazyEnablePeerAccess);
          err != cudaSuccess) {
        close_opened();
        return CudaError(absl::StrCat("cudaIpcOpenMemHandle of buffer ", i,
                                      "'s handle (an allocation of another process on device ",
                                      device_, "?)"),
                         err);
      }
      opened.push_back(pointer);
      absl::StatusOr<uint64_t> bytes = DeviceAllocationBytes(device_, pointer);
      if (!bytes.ok()) {
        close_opened();
        return bytes.status();
      }
      it = by_handle.emplace(buffer.ipc_handle, Opened{static_cast<uint8_t*>(pointer), *bytes})
               .first;
    }
    if (absl::Status inside = CheckEngineIpcBufferInAllocation(i, buffer, it->second.bytes);
        !inside.ok()) {
      close_opened();
      return inside;
    }
    starts.push_back(it->second.data + buffer.offset_in_allocation);
  }
  // The arena spans the opened allocations; offsets are address differences from the lowest.
  uint8_t* low = nullptr;
  uint8_t* high = nullptr;
  for (const auto& [handle, region] : by_handle) {
    if (low == nullptr || region.data < low) low = region.data;
    if (high == nullptr || region.data + region.bytes > high) high = region.data + region.bytes;
  }
  MappedEngineBuffers mapped;
  std::vector<SegmentedArenaRecord::Segment> segments;
  for (size_t i = 0; i < buffers.size(); ++i) {
    const uint64_t base = static_cast<uint64_t>(starts[i] - low);
    mapped.base.push_back(base);
    segments.push_back({.offset = base, .bytes = buffers[i].bytes});
  }
  mapped.arena = FileEngineMemory(std::make_shared<IpcEngineArena>(
      device_, std::move(opened), low, static_cast<uint64_t>(high - low), std::move(segments)));
  return mapped;
}

absl::StatusOr<std::string> CudaBackend::RecordCompletionEvent() {
  RETURN_IF_ERROR(SelectDevice());
  RETURN_IF_ERROR(Finish("recording the completion event",
                         cudaEventRecord(completion_event_, stream_)));
  return completion_handle_;
}

absl::Status CudaBackend::Synchronize() {
  RETURN_IF_ERROR(SelectDevice());
  return Finish("Synchronize", cudaSuccess);
}

absl::Status CudaBackend::Fill(uint8_t* at, uint8_t value, uint64_t bytes) {
  RETURN_IF_ERROR(SelectDevice());
  return Finish("Memset", cudaMemsetAsync(at, value, bytes, stream_));
}

absl::Status CudaBackend::Move(uint8_t* to, const uint8_t* from, uint64_t bytes) {
  RETURN_IF_ERROR(SelectDevice());
  return Finish("Copy", MemmoveDeviceAsync(to, from, bytes, stream_));
}

absl::Status CudaBackend::Upload(absl::string_view op, uint8_t* to,
                                 absl::Span<const uint8_t> data) {
  RETURN_IF_ERROR(SelectDevice());
  return Finish(op, cudaMemcpyAsync(to, data.data(), data.size(), cudaMemcpyHostToDevice, stream_));
}

absl::Status CudaBackend::Download(absl::string_view op, const uint8_t* from,
                                   absl::Span<uint8_t> out) {
  RETURN_IF_ERROR(SelectDevice());
  return Finish(op, cudaMemcpyAsync(out.data(), from, out.size(), cudaMemcpyDeviceToHost, stream_));
}

namespace {

// Whether no two stores of `writes` target the same offset: copies within one batch run in no
// particular order, so only then may they go as one batch (WriteI32s promises "in order").
bool DistinctOffsets(absl::Span<const I32Write> writes) {
  std::vector<uint64_t> offsets;
  offsets.reserve(writes.size());
  for (const I32Write& write : writes) offsets.push_back(write.offset);
  std::sort(offsets.begin(), offsets.end());
  return std::adjacent_find(offsets.begin(), offsets.end()) == offsets.end();
}

}  // namespace

cudaError_t CudaBackend::EnqueueI32sOneByOne(uint8_t* base, absl::Span<const I32Write> writes,
                                             uint64_t* failed_offset) const {
  // Pageable sources: each enqueue has copied its 4 bytes out before returning.
  for (const I32Write& write : writes) {
    const cudaError_t err = cudaMemcpyAsync(base + write.offset, &write.value, sizeof(write.value),
                                            cudaMemcpyHostToDevice, stream_);
    if (err != cudaSuccess) {
      *failed_offset = write.offset;
      return err;
    }
  }
  return cudaSuccess;
}

cudaError_t CudaBackend::EnqueueI32sBatched(uint8_t* base,
                                            absl::Span<const I32Write> writes) const {
#if CUDART_VERSION >= 12080
  // One submission for a session's changed mirrors (a decode step changes one length mirror per
  // layer: 32 copies for Llama-3-8B). The values are read during the call (the sources are the
  // caller's `writes`, which the stream sync after this outlives anyway).
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes(writes.size(), sizeof(int32_t));
  dsts.reserve(writes.size());
  srcs.reserve(writes.size());
  for (const I32Write& write : writes) {
    dsts.push_back(base + write.offset);
    srcs.push_back(&write.value);
  }
  cudaMemcpyAttributes attributes = {};
  attributes.srcAccessOrder = cudaMemcpySrcAccessOrderDuringApiCall;
  attributes.srcLocHint.type = cudaMemLocationTypeHost;
  attributes.dstLocHint.type = cudaMemLocationTypeDevice;
  attributes.dstLocHint.id = device_;
  size_t first_copy = 0;  // the one attribute set applies from copy 0 on
#if CUDART_VERSION >= 13000
  return cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), writes.size(), &attributes,
                              &first_copy, 1, stream_);
#else
  size_t failed = 0;
  return cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), writes.size(), &attributes,
                              &first_copy, 1, &failed, stream_);
#endif
#else
  (void)base;
  (void)writes;
  return cudaErrorNotSupported;  // not reached: StoreI32s batches only from CUDA 12.8 on
#endif
}

absl::Status CudaBackend::StoreI32s(uint8_t* base, absl::Span<const I32Write> writes) {
  RETURN_IF_ERROR(SelectDevice());
  constexpr bool kBatchApi = CUDART_VERSION >= 12080;
  if (kBatchApi && batch_mirror_writes_ && writes.size() > 1 && DistinctOffsets(writes)) {
    const cudaError_t err = EnqueueI32sBatched(base, writes);
    if (err != cudaSuccess) {
      return CudaError(absl::StrCat("WriteI32s: a batch of ", writes.size(),
                                    " mirror stores on device ", device_),
                       err);
    }
    return Finish("WriteI32s", cudaSuccess);
  }
  uint64_t failed_offset = 0;
  if (const cudaError_t err = EnqueueI32sOneByOne(base, writes, &failed_offset);
      err != cudaSuccess) {
    return CudaError(absl::StrCat("WriteI32s at offset ", failed_offset, " on device ", device_),
                     err);
  }
  // One stream sync covers every store.
  return Finish("WriteI32s", cudaSuccess);
}

absl::StatusOr<uint64_t> CudaBackend::CopyHashed(uint8_t* dst, const uint8_t* src,
                                                  absl::Span<const CopyRange> ranges) {
  RETURN_IF_ERROR(SelectDevice());
  for (const CopyRange& range : ranges) {
    const cudaError_t err = cudaMemcpyAsync(dst + range.dst_offset, src + range.src_offset,
                                            range.bytes, cudaMemcpyDeviceToDevice, stream_);
    if (err != cudaSuccess) {
      return CudaError(absl::StrCat("CopyRangesChecksummed: copy of ", range.bytes,
                                    " bytes on device ", device_),
                       err);
    }
  }
  // The hash runs on the host: the source streams through a bounded host buffer while the
  // device copies run. XXH3's streaming digest equals the one-shot one.
  constexpr uint64_t kChunkBytes = 8ull << 20;
  uint64_t largest = 0;
  for (const CopyRange& range : ranges) largest = std::max(largest, range.bytes);
  std::vector<uint8_t> chunk(std::min(largest, kChunkBytes));
  ASSIGN_OR_RETURN(StreamingChecksum checksum, StreamingChecksum::Create());
  for (const CopyRange& range : ranges) {
    for (uint64_t done = 0; done < range.bytes;) {
      const uint64_t n = std::min(range.bytes - done, kChunkBytes);
      if (const cudaError_t err = cudaMemcpy(chunk.data(), src + range.src_offset + done, n,
                                             cudaMemcpyDeviceToHost);
          err != cudaSuccess) {
        return CudaError(absl::StrCat("CopyRangesChecksummed: reading ", n, " bytes to hash"),
                         err);
      }
      checksum.Update(chunk.data(), n);
      done += n;
    }
  }
  RETURN_IF_ERROR(Finish("CopyRangesChecksummed", cudaSuccess));
  return checksum.Digest();
}

absl::Status CudaBackend::WaitForEngineEvent(absl::string_view ipc_event_handle) {
  if (ipc_event_handle.empty()) return absl::OkStatus();
  if (ipc_event_handle.size() != sizeof(cudaIpcEventHandle_t)) {
    return absl::InvalidArgumentError(
        absl::StrCat("an interprocess event handle is ", sizeof(cudaIpcEventHandle_t),
                     " bytes (cudaIpcEventHandle_t); got ", ipc_event_handle.size()));
  }
  RETURN_IF_ERROR(SelectDevice());
  std::shared_ptr<CUevent_st> event;
  {
    absl::MutexLock lock(&events_mu_);
    const std::string key(ipc_event_handle);
    auto it = open_events_.find(key);
    if (it == open_events_.end()) {
      if (open_events_.size() >= kMaxOpenEvents) open_events_.clear();
      cudaIpcEventHandle_t handle;
      std::memcpy(&handle, ipc_event_handle.data(), sizeof(handle));
      cudaEvent_t opened = nullptr;
      if (const cudaError_t err = cudaIpcOpenEventHandle(&opened, handle); err != cudaSuccess) {
        return CudaError("cudaIpcOpenEventHandle of the engine's event (was it created with "
                         "cudaEventInterprocess | cudaEventDisableTiming?)",
                         err);
      }
      const int device = device_;
      std::shared_ptr<CUevent_st> owned(opened, [device](cudaEvent_t e) {
        cudaSetDevice(device);
        cudaEventDestroy(e);
      });
      it = open_events_.emplace(key, std::move(owned)).first;
    }
    event = it->second;
  }
  if (const cudaError_t err = cudaEventSynchronize(event.get()); err != cudaSuccess) {
    return CudaError("waiting for the engine's interprocess event", err);
  }
  return absl::OkStatus();
}

}  // namespace memra
