#include "common/daemon_restart.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace memra {
namespace {

std::string Encode(const DaemonRestart& restart) {
  std::string bytes(16, '\0');
  for (int b = 0; b < 8; ++b) {
    bytes[b] = static_cast<char>(restart.previous_epoch >> (8 * b));
    bytes[8 + b] = static_cast<char>(restart.epoch >> (8 * b));
  }
  return bytes;
}

}  // namespace

absl::Status DaemonRestartedError(const DaemonRestart& restart, absl::string_view what) {
  absl::Status status = absl::FailedPreconditionError(absl::StrCat(
      "memra-kvd restarted (epoch ", restart.previous_epoch, " -> ", restart.epoch, "); ", what));
  AttachDaemonRestart(status, restart);
  return status;
}

void AttachDaemonRestart(absl::Status& status, const DaemonRestart& restart) {
  status.SetPayload(kDaemonRestartTypeUrl, absl::Cord(Encode(restart)));
}

std::optional<DaemonRestart> GetDaemonRestart(const absl::Status& status) {
  if (status.code() != absl::StatusCode::kFailedPrecondition) return std::nullopt;
  auto payload = status.GetPayload(kDaemonRestartTypeUrl);
  if (!payload.has_value() || payload->size() != 16) return std::nullopt;
  const std::string bytes(*payload);
  DaemonRestart restart;
  for (int b = 0; b < 8; ++b) {
    restart.previous_epoch |= uint64_t{static_cast<uint8_t>(bytes[b])} << (8 * b);
    restart.epoch |= uint64_t{static_cast<uint8_t>(bytes[8 + b])} << (8 * b);
  }
  return restart;
}

}  // namespace memra
