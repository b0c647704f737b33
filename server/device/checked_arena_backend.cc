#include "server/device/checked_arena_backend.h"

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "spdlog/spdlog.h"

namespace memra {

absl::StatusOr<ArenaId> CheckedArenaBackend::CreateArena(uint64_t bytes,
                                                         ArenaVisibility visibility) {
  ASSIGN_OR_RETURN(const uint64_t rounded, RoundedArenaBytes(bytes));
  return arenas_.Create(rounded, [&](uint64_t size) { return Allocate(size, visibility); });
}

absl::StatusOr<ArenaId> CheckedArenaBackend::FileAdopted(
    uint64_t bytes,
    absl::FunctionRef<absl::StatusOr<std::shared_ptr<ArenaRecord>>(uint64_t)> adopt) {
  ASSIGN_OR_RETURN(const uint64_t rounded, RoundedArenaBytes(bytes));
  if (rounded != bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        std::string(Name()), " AdoptArenaFd: ", bytes, " bytes is not a multiple of the allocation granularity ",
        AllocationGranularity(), " (a kept arena always is)"));
  }
  return arenas_.Create(bytes, adopt);
}

absl::StatusOr<ArenaExport> CheckedArenaBackend::Export(ArenaId id) {
  ASSIGN_OR_RETURN(std::shared_ptr<ArenaRecord> arena, arenas_.Find("Export", id));
  const std::string backend(Name());
  if (!arena->exported()) {
    return absl::FailedPreconditionError(absl::StrCat(
        backend, " Export: arena ", id.value, " is private (daemon-only) and is never exported"));
  }
  return ArenaExport{.backend = backend, .handle = arena->export_handle(), .bytes = arena->bytes()};
}

absl::StatusOr<int> CheckedArenaBackend::DuplicateArenaFd(ArenaId id) {
  ASSIGN_OR_RETURN(std::shared_ptr<ArenaRecord> arena, arenas_.Find("DuplicateArenaFd", id));
  if (!arena->exported()) {
    return absl::FailedPreconditionError(
        absl::StrCat(std::string(Name()), " DuplicateArenaFd: arena ", id.value,
                     " is private (daemon-only) and is never handed out"));
  }
  return arena->DuplicateFd();
}

absl::Status CheckedArenaBackend::FreeArena(ArenaId id) {
  ASSIGN_OR_RETURN(std::shared_ptr<ArenaRecord> arena, arenas_.Remove(id));
  if (absl::Status retired = arena->Retire(); !retired.ok()) {
    // Freed all the same (a refusal would leave a forgotten arena charged for good); its memory
    // then lives on while an engine maps it, as before item 8 of issue 31, and the log says so.
    spdlog::error("{} FreeArena: arena {} ({} bytes) is freed but its memory was not released "
                  "from engines' mappings: {}",
                  std::string(Name()), id.value, arena->bytes(), retired.ToString());
  }
  return absl::OkStatus();
}

absl::Status CheckedArenaBackend::Memset(ArenaId id, uint64_t offset, uint8_t value,
                                         uint64_t bytes) {
  ASSIGN_OR_RETURN(std::shared_ptr<ArenaRecord> arena,
                   arenas_.FindRange("Memset", id, offset, bytes));
  return Fill(arena->data() + offset, value, bytes);
}

absl::Status CheckedArenaBackend::Copy(ArenaId dst_id, uint64_t dst_offset, ArenaId src_id,
                                       uint64_t src_offset, uint64_t bytes) {
  ASSIGN_OR_RETURN(std::shared_ptr<ArenaRecord> dst,
                   arenas_.FindRange("Copy destination", dst_id, dst_offset, bytes));
  ASSIGN_OR_RETURN(std::shared_ptr<ArenaRecord> src,
                   arenas_.FindRange("Copy source", src_id, src_offset, bytes));
  return Move(dst->data() + dst_offset, src->data() + src_offset, bytes);
}

absl::Status CheckedArenaBackend::WriteI32(ArenaId id, uint64_t offset, int32_t value) {
  return WriteBytes("WriteI32", id, offset,
                    absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(&value), sizeof(value)));
}

absl::Status CheckedArenaBackend::WriteI32s(ArenaId id, absl::Span<const I32Write> writes) {
  ASSIGN_OR_RETURN(std::shared_ptr<ArenaRecord> arena, arenas_.Find("WriteI32s", id));
  for (const I32Write& write : writes) {
    RETURN_IF_ERROR(
        arena->CheckRange("WriteI32s", id, write.offset, sizeof(write.value)));
  }
  if (writes.empty()) return absl::OkStatus();
  return StoreI32s(arena->data(), writes);
}

absl::StatusOr<int32_t> CheckedArenaBackend::ReadI32(ArenaId id, uint64_t offset) {
  int32_t value;
  RETURN_IF_ERROR(ReadBytes("ReadI32", id, offset,
                            absl::MakeSpan(reinterpret_cast<uint8_t*>(&value), sizeof(value))));
  return value;
}

absl::Status CheckedArenaBackend::Write(ArenaId id, uint64_t offset,
                                        absl::Span<const uint8_t> data) {
  return WriteBytes("Write", id, offset, data);
}

absl::Status CheckedArenaBackend::Read(ArenaId id, uint64_t offset, absl::Span<uint8_t> out) {
  return ReadBytes("Read", id, offset, out);
}

absl::StatusOr<uint64_t> CheckedArenaBackend::CopyRangesChecksummed(
    ArenaId dst_id, ArenaId src_id, absl::Span<const CopyRange> ranges) {
  if (dst_id == src_id) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CopyRangesChecksummed: source and destination are both arena ", src_id.value));
  }
  ASSIGN_OR_RETURN(std::shared_ptr<ArenaRecord> dst,
                   arenas_.Find("CopyRangesChecksummed destination", dst_id));
  ASSIGN_OR_RETURN(std::shared_ptr<ArenaRecord> src,
                   arenas_.Find("CopyRangesChecksummed source", src_id));
  for (const CopyRange& range : ranges) {
    RETURN_IF_ERROR(dst->CheckRange("CopyRangesChecksummed destination", dst_id,
                                    range.dst_offset, range.bytes));
    RETURN_IF_ERROR(
        src->CheckRange("CopyRangesChecksummed source", src_id, range.src_offset, range.bytes));
  }
  return CopyHashed(dst->data(), src->data(), ranges);
}

absl::Status CheckedArenaBackend::WriteBytes(absl::string_view op, ArenaId id, uint64_t offset,
                                             absl::Span<const uint8_t> data) {
  ASSIGN_OR_RETURN(std::shared_ptr<ArenaRecord> arena,
                   arenas_.FindRange(op, id, offset, data.size()));
  if (data.empty()) return absl::OkStatus();
  return Upload(op, arena->data() + offset, data);
}

absl::Status CheckedArenaBackend::ReadBytes(absl::string_view op, ArenaId id, uint64_t offset,
                                            absl::Span<uint8_t> out) {
  ASSIGN_OR_RETURN(std::shared_ptr<ArenaRecord> arena,
                   arenas_.FindRange(op, id, offset, out.size()));
  if (out.empty()) return absl::OkStatus();
  return Download(op, arena->data() + offset, out);
}

}  // namespace memra
