#include "server/streaming_checksum.h"

#include <xxhash.h>

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
  XXH3_64bits_update(state_.get(), data, bytes);
}

uint64_t StreamingChecksum::Digest() const { return XXH3_64bits_digest(state_.get()); }

}  // namespace memra
