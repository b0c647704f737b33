#include "server/testing/fault_injecting_backend.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace memra {

std::string_view BackendOpName(BackendOp op) {
  switch (op) {
    case BackendOp::kCreateArena:
      return "CreateArena";
    case BackendOp::kExport:
      return "Export";
    case BackendOp::kFreeArena:
      return "FreeArena";
    case BackendOp::kMemset:
      return "Memset";
    case BackendOp::kCopy:
      return "Copy";
    case BackendOp::kWriteI32:
      return "WriteI32";
    case BackendOp::kWriteI32s:
      return "WriteI32s";
    case BackendOp::kReadI32:
      return "ReadI32";
    case BackendOp::kWrite:
      return "Write";
    case BackendOp::kRead:
      return "Read";
    case BackendOp::kCopyRangesChecksummed:
      return "CopyRangesChecksummed";
    case BackendOp::kSynchronize:
      return "Synchronize";
    case BackendOp::kWaitForEngineEvent:
      return "WaitForEngineEvent";
  }
  return "unknown";
}

absl::Status FaultInjectingBackend::FailNthCall(BackendOp op, uint64_t n, absl::Status status) {
  if (n == 0 || status.ok()) {
    const std::string_view name = BackendOpName(op);
    return absl::InvalidArgumentError(
        absl::StrCat("FailNthCall(", absl::string_view(name.data(), name.size()), ", n = ", n,
                     "): n must be >= 1 and the status an error, got ", status.ToString()));
  }
  absl::MutexLock lock(&mu_);
  arms_[static_cast<size_t>(op)] = Arm{.calls_left = n, .status = std::move(status)};
  return absl::OkStatus();
}

void FaultInjectingBackend::Disarm(BackendOp op) {
  absl::MutexLock lock(&mu_);
  arms_[static_cast<size_t>(op)].reset();
}

void FaultInjectingBackend::Hold(BackendOp op) {
  absl::MutexLock lock(&mu_);
  held_[static_cast<size_t>(op)] = true;
}

void FaultInjectingBackend::Unhold(BackendOp op) {
  absl::MutexLock lock(&mu_);
  held_[static_cast<size_t>(op)] = false;
}

uint64_t FaultInjectingBackend::HeldCalls(BackendOp op) const {
  absl::MutexLock lock(&mu_);
  return waiting_[static_cast<size_t>(op)];
}

uint64_t FaultInjectingBackend::CallCount(BackendOp op) const {
  absl::MutexLock lock(&mu_);
  return calls_[static_cast<size_t>(op)];
}

uint64_t FaultInjectingBackend::InjectedFailures() const {
  absl::MutexLock lock(&mu_);
  return injected_;
}

absl::Status FaultInjectingBackend::Enter(BackendOp op) {
  absl::MutexLock lock(&mu_);
  const size_t index = static_cast<size_t>(op);
  ++calls_[index];
  if (held_[index]) {
    ++waiting_[index];
    mu_.Await(absl::Condition(
        +[](bool* held) { return !*held; }, &held_[index]));
    --waiting_[index];
  }
  std::optional<Arm>& arm = arms_[index];
  if (!arm.has_value() || --arm->calls_left > 0) return absl::OkStatus();
  absl::Status status = std::move(arm->status);
  arm.reset();
  ++injected_;
  return status;
}

absl::StatusOr<ArenaId> FaultInjectingBackend::CreateArena(uint64_t bytes,
                                                           ArenaVisibility visibility) {
  RETURN_IF_ERROR(Enter(BackendOp::kCreateArena));
  return target_->CreateArena(bytes, visibility);
}

absl::StatusOr<ArenaExport> FaultInjectingBackend::Export(ArenaId arena) {
  RETURN_IF_ERROR(Enter(BackendOp::kExport));
  return target_->Export(arena);
}

absl::Status FaultInjectingBackend::FreeArena(ArenaId arena) {
  RETURN_IF_ERROR(Enter(BackendOp::kFreeArena));
  return target_->FreeArena(arena);
}

absl::Status FaultInjectingBackend::Memset(ArenaId arena, uint64_t offset, uint8_t value,
                                           uint64_t bytes) {
  RETURN_IF_ERROR(Enter(BackendOp::kMemset));
  return target_->Memset(arena, offset, value, bytes);
}

absl::Status FaultInjectingBackend::Copy(ArenaId dst, uint64_t dst_offset, ArenaId src,
                                         uint64_t src_offset, uint64_t bytes) {
  RETURN_IF_ERROR(Enter(BackendOp::kCopy));
  return target_->Copy(dst, dst_offset, src, src_offset, bytes);
}

absl::Status FaultInjectingBackend::WriteI32(ArenaId arena, uint64_t offset, int32_t value) {
  RETURN_IF_ERROR(Enter(BackendOp::kWriteI32));
  return target_->WriteI32(arena, offset, value);
}

absl::Status FaultInjectingBackend::WriteI32s(ArenaId arena, absl::Span<const I32Write> writes) {
  RETURN_IF_ERROR(Enter(BackendOp::kWriteI32s));
  return target_->WriteI32s(arena, writes);
}

absl::StatusOr<int32_t> FaultInjectingBackend::ReadI32(ArenaId arena, uint64_t offset) {
  RETURN_IF_ERROR(Enter(BackendOp::kReadI32));
  return target_->ReadI32(arena, offset);
}

absl::Status FaultInjectingBackend::Write(ArenaId arena, uint64_t offset,
                                          absl::Span<const uint8_t> data) {
  RETURN_IF_ERROR(Enter(BackendOp::kWrite));
  return target_->Write(arena, offset, data);
}

absl::Status FaultInjectingBackend::Read(ArenaId arena, uint64_t offset, absl::Span<uint8_t> out) {
  RETURN_IF_ERROR(Enter(BackendOp::kRead));
  return target_->Read(arena, offset, out);
}

absl::StatusOr<uint64_t> FaultInjectingBackend::CopyRangesChecksummed(
    ArenaId dst, ArenaId src, absl::Span<const CopyRange> ranges) {
  RETURN_IF_ERROR(Enter(BackendOp::kCopyRangesChecksummed));
  return target_->CopyRangesChecksummed(dst, src, ranges);
}

absl::Status FaultInjectingBackend::WaitForEngineEvent(absl::string_view ipc_event_handle) {
  RETURN_IF_ERROR(Enter(BackendOp::kWaitForEngineEvent));
  return target_->WaitForEngineEvent(ipc_event_handle);
}

absl::Status FaultInjectingBackend::Synchronize() {
  RETURN_IF_ERROR(Enter(BackendOp::kSynchronize));
  return target_->Synchronize();
}

}  // namespace memra
