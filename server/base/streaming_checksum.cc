#include "server/base/streaming_checksum.h"

#include <xxhash.h>

// Debian's libxxhash also exports XXH3 dispatched at run time to the CPU's widest vectors
// (AVX2 / AVX-512): the same digests at about twice the SSE2 baseline's rate, and hashing is
// what bounds a verified prefix restore (bench/README.md section 3).
#if defined(__x86_64__)
#define XXH_DISPATCH_DISABLE_REPLACE
#include <xxh_x86dispatch.h>
#endif

#include <algorithm>
#include <utility>

namespace memra {

void StreamingChecksum::FreeState::operator()(XXH3_state_s* state) const {
  XXH3_freeState(state);
}

absl::StatusOr<StreamingChecksum> StreamingChecksum::Create() {
  std::unique_ptr<XXH3_state_s, FreeState> state(XXH3_createState());
  if (state == nullptr || XXH3_64bits_reset(state.get()) != XXH_OK) {
    return absl::ResourceExhaustedError("cannot allocate an xxHash3 state");
  }
  return StreamingChecksum(std::move(state));
}

void StreamingChecksum::Update(const uint8_t* data, uint64_t bytes) {
#if defined(__x86_64__)
  XXH3_64bits_update_dispatch(state_.get(), data, bytes);
#else
  XXH3_64bits_update(state_.get(), data, bytes);
#endif
}

uint64_t StreamingChecksum::Digest() const { return XXH3_64bits_digest(state_.get()); }

std::vector<uint64_t> SliceChecksums(absl::Span<const uint8_t> bytes, uint64_t slice_bytes) {
  std::vector<uint64_t> slices;
  for (uint64_t at = 0; at < bytes.size() || slices.empty(); at += slice_bytes) {
    const uint64_t size = std::min<uint64_t>(slice_bytes, bytes.size() - at);
#if defined(__x86_64__)
    slices.push_back(XXH3_64bits_dispatch(bytes.data() + at, size));
#else
    slices.push_back(XXH3_64bits(bytes.data() + at, size));
#endif
  }
  return slices;
}

uint64_t PieceChecksum(const std::vector<uint64_t>& slices) {
  if (slices.size() == 1) return slices[0];
  std::vector<uint8_t> bytes(slices.size() * 8);
  for (size_t i = 0; i < slices.size(); ++i) {
    for (int b = 0; b < 8; ++b) bytes[i * 8 + b] = static_cast<uint8_t>(slices[i] >> (8 * b));
  }
  return XXH3_64bits(bytes.data(), bytes.size());
}

}  // namespace memra
