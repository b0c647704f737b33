#ifndef MEMRA_SERVER_STREAMING_CHECKSUM_H_
#define MEMRA_SERVER_STREAMING_CHECKSUM_H_

// xxHash3-64 (seed 0) over input fed in pieces: the digest equals XXH3_64bits of the pieces
// concatenated, so a backend can hash bytes in whatever slices it copies them.

#include <cstdint>
#include <memory>

#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

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

// A stored piece's checksums as the prefix cache seals it: one xxHash3-64 per `slice_bytes` slice
// (one slice for an empty piece), and the piece's checksum from them: the one slice's own, else
// the xxHash3-64 of the slice checksums as little-endian u64s. Shared by the local tiers and the
// remote tier's values, so a value sealed by one daemon verifies on another.
std::vector<uint64_t> SliceChecksums(absl::Span<const uint8_t> bytes, uint64_t slice_bytes);
uint64_t PieceChecksum(const std::vector<uint64_t>& slices);

}  // namespace memra

#endif  // MEMRA_SERVER_STREAMING_CHECKSUM_H_
