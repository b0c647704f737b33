#include "server/store/remote/read_through.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "spdlog/spdlog.h"

namespace memra {

ReadThroughResult ReadThrough(
    RemoteTier& tier, const std::vector<std::string>& keys,
    absl::FunctionRef<RemoteValueHeader(size_t)> expected, absl::Duration timeout,
    absl::FunctionRef<absl::Status(size_t, VerifiedRemoteValue&)> adopt) {
  ReadThroughResult result;
  const absl::Time deadline = absl::Now() + timeout;
  bool ended = false;  // a piece was missing or refused: the pull ends before it
  for (size_t start = 0; start < keys.size() && !ended; start += kReadThroughWindowValues) {
    const size_t end = std::min(keys.size(), start + kReadThroughWindowValues);
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) break;
    absl::StatusOr<std::vector<std::optional<std::string>>> values =
        tier.GetEach(std::vector<std::string>(keys.begin() + start, keys.begin() + end), left);
    if (!values.ok()) {
      spdlog::debug("prefix remote tier: a pull's fetch failed: {}", values.status().ToString());
      break;
    }
    for (size_t i = start; i < end && !ended; ++i) {
      std::optional<std::string>& fetched = (*values)[i - start];
      if (!fetched.has_value()) {  // evicted or expired since EXISTS
        ended = true;
        break;
      }
      absl::StatusOr<VerifiedRemoteValue> value =
          VerifyRemoteValue(keys[i], *fetched, expected(i));
      if (!value.ok()) {
        if (absl::IsDataLoss(value.status())) {
          ++result.counts.corrupt;
          tier.Discard(keys[i]);
          spdlog::error("prefix remote tier: {}; deleted, the restore goes on without it",
                        value.status().ToString());
        } else {
          ++result.counts.shape_mismatches;
          spdlog::warn("prefix remote tier: {}", value.status().ToString());
        }
        ended = true;
        break;
      }
      const size_t payload_bytes = value->payload.size();
      if (absl::Status adopted = adopt(i, *value); !adopted.ok()) {
        result.adopt_failure = std::move(adopted);
        return result;
      }
      ++result.adopted;
      ++result.counts.pieces;
      result.counts.bytes += payload_bytes;
      fetched.reset();
    }
  }
  return result;
}

}  // namespace memra
