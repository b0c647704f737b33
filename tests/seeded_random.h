#ifndef MEMRA_TESTS_SEEDED_RANDOM_H_
#define MEMRA_TESTS_SEEDED_RANDOM_H_

// Deterministic xorshift64 for property tests: the same seed replays the same sequence on
// every machine, so a failing sequence can be reproduced from the test log.

#include <cstdint>

namespace memra::testing {

class SeededRandom {
 public:
  // REQUIRES: seed != 0 (xorshift's one fixed point).
  explicit SeededRandom(uint64_t seed) : state_(seed) {}

  // Uniform-enough value in [0, bound); 0 when bound is 0.
  uint64_t Below(uint64_t bound) {
    state_ ^= state_ << 13;
    state_ ^= state_ >> 7;
    state_ ^= state_ << 17;
    return bound == 0 ? 0 : state_ % bound;
  }

 private:
  uint64_t state_;
};

}  // namespace memra::testing

#endif  // MEMRA_TESTS_SEEDED_RANDOM_H_
