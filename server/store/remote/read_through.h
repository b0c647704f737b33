#ifndef MEMRA_SERVER_STORE_REMOTE_READ_THROUGH_H_
#define MEMRA_SERVER_STORE_REMOTE_READ_THROUGH_H_

// Read-through (docs/remote-tier.md): fetching what a restore pulls from the remote tier and
// verifying it before any byte reaches the store. The store decides what to pull (how far the
// cluster reaches, what its index lacks) and adopts what comes back; this piece fetches the
// values a window at a time, checks each against what the store expects of it
// (VerifyRemoteValue: header, shape, checksums) and hands the verified ones, in order, to the
// store, which copies each into its own storage before the next window is fetched (what is in
// flight stays bounded).
//
// A value that is absent (evicted or expired since the probe), corrupt (DATA_LOSS: counted and
// deleted from the cluster) or of another shape (counted) ends the pull before it, as does a
// failed fetch or the deadline: the store then keeps the values before it, or none.
//
// Thread-safety: a function; the tier is thread-safe.

#include <cstddef>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/store/remote/remote_tier.h"

namespace memra {

// Values fetched per round trip (each copied into the store and dropped before the next).
inline constexpr size_t kReadThroughWindowValues = 8;

struct ReadThroughResult {
  size_t adopted = 0;              // the leading keys whose values the store took
  RemoteTier::PullCounts counts;   // pieces and bytes adopted, corrupt and mismatched values
  absl::Status adopt_failure;      // the store's refusal that ended the pull (OK: none)
};

// Fetches `keys` in order within `timeout`: key i's value must be what `expected(i)` describes;
// `adopt(i, value)` stores it (a failure ends the pull and is returned in adopt_failure).
ReadThroughResult ReadThrough(
    RemoteTier& tier, const std::vector<std::string>& keys,
    absl::FunctionRef<RemoteValueHeader(size_t)> expected, absl::Duration timeout,
    absl::FunctionRef<absl::Status(size_t, VerifiedRemoteValue&)> adopt);

}  // namespace memra

#endif  // MEMRA_SERVER_STORE_REMOTE_READ_THROUGH_H_
