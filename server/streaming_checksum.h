#ifndef MEMRA_SERVER_STREAMING_CHECKSUM_H_
#define MEMRA_SERVER_STREAMING_CHECKSUM_H_

// xxHash3-64 (seed 0) over input fed in pieces: the digest equals XXH3_64bits of the pieces
// concatenated, so a backend can hash bytes in whatever slices it copies them.

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"

struct XXH3_state_s;  // xxhash.h's XXH3_state_t

namespace memra {

// Not thread-safe; one per computation.
class StreamingChecksum {
 public:
  // RESOURCE_EXHAUSTED when the hash state cannot be allocated.
  static absl::StatusOr<StreamingChecksum> Create();

  void Update(const uint8_t* data, uint64_t bytes);
  uint64_t Digest() const;

 private:
  struct FreeState {
    void operator()(XXH3_state_s* state) const;
  };
  explicit StreamingChecksum(std::unique_ptr<XXH3_state_s, FreeState> state)
      : state_(std::move(state)) {}

  std::unique_ptr<XXH3_state_s, FreeState> state_;
};

}  // namespace memra

#endif  // MEMRA_SERVER_STREAMING_CHECKSUM_H_
