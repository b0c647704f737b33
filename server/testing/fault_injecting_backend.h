#ifndef MEMRA_SERVER_FAULT_INJECTING_BACKEND_H_
#define MEMRA_SERVER_FAULT_INJECTING_BACKEND_H_

// A DeviceBackend wrapper that fails chosen calls, so failure paths ("a refused or failed device
// operation changes nothing") are testable on any backend (LevelDB's fault-injection Env).

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/device/backend.h"

namespace memra {

// The fallible DeviceBackend operations, one per virtual method.
enum class BackendOp {
  kCreateArena,
  kExport,
  kFreeArena,
  kMemset,
  kCopy,
  kWriteI32,
  kWriteI32s,
  kReadI32,
  kWrite,
  kRead,
  kCopyRangesChecksummed,
  kSynchronize,
  kWaitForEngineEvent,
};
inline constexpr size_t kBackendOpCount = static_cast<size_t>(BackendOp::kWaitForEngineEvent) + 1;

std::string_view BackendOpName(BackendOp op);

// Thread-safe: arming, counting and forwarding may happen from any thread. Forwards every call to
// the wrapped backend except an armed failure, which returns its status without reaching the
// wrapped backend (so the wrapped backend is provably unchanged by it).
class FaultInjectingBackend final : public DeviceBackend {
 public:
  // REQUIRES: `target` outlives this wrapper.
  explicit FaultInjectingBackend(DeviceBackend* target) : target_(target) {}

  // Arms `op`: its `n`th call from now (1 = the next) fails with `status`, once. Replaces any
  // earlier arming of `op`. INVALID_ARGUMENT when n == 0 or `status` is OK.
  absl::Status FailNthCall(BackendOp op, uint64_t n, absl::Status status) ABSL_LOCKS_EXCLUDED(mu_);
  void Disarm(BackendOp op) ABSL_LOCKS_EXCLUDED(mu_);
  // Holds `op`: its calls from now wait (before reaching the wrapped backend) until
  // Unhold(op), so a test can keep a long operation in progress. HeldCalls: calls waiting now.
  void Hold(BackendOp op) ABSL_LOCKS_EXCLUDED(mu_);
  void Unhold(BackendOp op) ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t HeldCalls(BackendOp op) const ABSL_LOCKS_EXCLUDED(mu_);
  // Calls of `op` seen so far, injected failures included.
  uint64_t CallCount(BackendOp op) const ABSL_LOCKS_EXCLUDED(mu_);
  // Failures injected so far, over all ops.
  uint64_t InjectedFailures() const ABSL_LOCKS_EXCLUDED(mu_);

  std::string_view Name() const override { return target_->Name(); }
  DeviceInfo Info() override { return target_->Info(); }
  uint64_t AllocationGranularity() const override { return target_->AllocationGranularity(); }

  absl::StatusOr<ArenaId> CreateArena(uint64_t bytes, ArenaVisibility visibility) override;
  absl::StatusOr<ArenaExport> Export(ArenaId arena) override;
  // Forwarded without an injection point: it reads no device memory.
  absl::StatusOr<int> DuplicateArenaFd(ArenaId arena) override {
    return target_->DuplicateArenaFd(arena);
  }
  absl::StatusOr<ArenaId> AdoptArenaFd(int fd, uint64_t bytes,
                                       std::string export_handle) override {
    return target_->AdoptArenaFd(fd, bytes, std::move(export_handle));
  }
  absl::StatusOr<MappedEngineBuffers> MapEngineBuffers(
      absl::Span<const EngineBufferFd> buffers) override {
    return target_->MapEngineBuffers(buffers);
  }
  absl::StatusOr<MappedEngineBuffers> MapEngineIpcBuffers(
      absl::Span<const EngineBufferIpc> buffers) override {
    return target_->MapEngineIpcBuffers(buffers);
  }
  absl::StatusOr<std::string> RecordCompletionEvent() override {
    return target_->RecordCompletionEvent();
  }
  absl::Status FreeArena(ArenaId arena) override;

  absl::Status Memset(ArenaId arena, uint64_t offset, uint8_t value, uint64_t bytes) override;
  absl::Status Copy(ArenaId dst, uint64_t dst_offset, ArenaId src, uint64_t src_offset,
                    uint64_t bytes) override;
  absl::Status WriteI32(ArenaId arena, uint64_t offset, int32_t value) override;
  absl::Status WriteI32s(ArenaId arena, absl::Span<const I32Write> writes) override;
  absl::StatusOr<int32_t> ReadI32(ArenaId arena, uint64_t offset) override;
  absl::Status Write(ArenaId arena, uint64_t offset, absl::Span<const uint8_t> data) override;
  absl::Status Read(ArenaId arena, uint64_t offset, absl::Span<uint8_t> out) override;
  absl::StatusOr<uint64_t> CopyRangesChecksummed(ArenaId dst, ArenaId src,
                                                 absl::Span<const CopyRange> ranges) override;
  absl::Status Synchronize() override;
  absl::Status WaitForEngineEvent(absl::string_view ipc_event_handle) override;

  uint64_t AllocatedBytes() const override { return target_->AllocatedBytes(); }
  size_t ArenaCount() const override { return target_->ArenaCount(); }

 private:
  struct Arm {
    uint64_t calls_left;  // >= 1; the call that brings it to 0 fails
    absl::Status status;
  };

  // Counts a call of `op`; returns the injected failure when this is the armed call.
  absl::Status Enter(BackendOp op) ABSL_LOCKS_EXCLUDED(mu_);

  DeviceBackend* const target_;  // constant after construction

  mutable absl::Mutex mu_;
  std::array<uint64_t, kBackendOpCount> calls_ ABSL_GUARDED_BY(mu_) = {};
  std::array<std::optional<Arm>, kBackendOpCount> arms_ ABSL_GUARDED_BY(mu_);
  uint64_t injected_ ABSL_GUARDED_BY(mu_) = 0;
  std::array<bool, kBackendOpCount> held_ ABSL_GUARDED_BY(mu_) = {};
  std::array<uint64_t, kBackendOpCount> waiting_ ABSL_GUARDED_BY(mu_) = {};
};

}  // namespace memra

#endif  // MEMRA_SERVER_FAULT_INJECTING_BACKEND_H_
