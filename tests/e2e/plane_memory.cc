#include "tests/e2e/plane_memory.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace memra::testing {
namespace {

// OK when [offset, offset + bytes) lies inside `plane`.
absl::Status CheckRange(const char* op, const PlaneView& plane, uint64_t offset, uint64_t bytes) {
  if (offset > plane.bytes || bytes > plane.bytes - offset) {
    return absl::OutOfRangeError(absl::StrCat(op, " of ", bytes, " bytes at offset ", offset,
                                              " runs past the plane's ", plane.bytes, " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status PlaneMemory::Write(const PlaneView& plane, uint64_t offset,
                                absl::Span<const uint8_t> data) {
  RETURN_IF_ERROR(CheckRange("plane write", plane, offset, data.size()));
  return DoWrite(plane.data + offset, data);
}

absl::Status PlaneMemory::Read(const PlaneView& plane, uint64_t offset, absl::Span<uint8_t> out) {
  RETURN_IF_ERROR(CheckRange("plane read", plane, offset, out.size()));
  return DoRead(plane.data + offset, out);
}

absl::Status PlaneMemory::Move(const PlaneView& plane, uint64_t to, uint64_t from,
                               uint64_t bytes) {
  RETURN_IF_ERROR(CheckRange("plane move source", plane, from, bytes));
  RETURN_IF_ERROR(CheckRange("plane move target", plane, to, bytes));
  return DoMove(plane.data + to, plane.data + from, bytes);
}

absl::Status PlaneMemory::Fill(const PlaneView& plane, uint64_t offset, uint8_t value,
                               uint64_t bytes) {
  RETURN_IF_ERROR(CheckRange("plane fill", plane, offset, bytes));
  return DoFill(plane.data + offset, value, bytes);
}

absl::Status HostPlaneMemory::DoWrite(uint8_t* to, absl::Span<const uint8_t> data) {
  std::memcpy(to, data.data(), data.size());
  return absl::OkStatus();
}

absl::Status HostPlaneMemory::DoRead(const uint8_t* from, absl::Span<uint8_t> out) {
  std::memcpy(out.data(), from, out.size());
  return absl::OkStatus();
}

absl::Status HostPlaneMemory::DoMove(uint8_t* to, const uint8_t* from, uint64_t bytes) {
  std::memmove(to, from, bytes);
  return absl::OkStatus();
}

absl::Status HostPlaneMemory::DoFill(uint8_t* at, uint8_t value, uint64_t bytes) {
  std::memset(at, value, bytes);
  return absl::OkStatus();
}

}  // namespace memra::testing
