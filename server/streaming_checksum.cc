#include "server/streaming_checksum.h"

#include <xxhash.h>

// Debian's libxxhash also exports XXH3 dispatched at run time to the CPU's widest vectors
// (AVX2 / AVX-512): the same digests at about twice the SSE2 baseline's rate, and hashing is
// what bounds a verified prefix restore (bench/README.md section 3).
#if defined(__x86_64__)
#define XXH_DISPATCH_DISABLE_REPLACE
#include <xxh_x86dispatch.h>
#endif

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

}  // namespace memra
