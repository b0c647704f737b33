#ifndef MEMRA_CORE_SHA256_H_
#define MEMRA_CORE_SHA256_H_

// SHA-256 (FIPS 180-4), for model-plan fingerprints and prefix keys: a wrong match there serves
// another model's KV, so the hash must be collision-resistant, not merely fast. Pure C++ so that
// core/ needs no crypto library.
//
// Thread-safety: a Sha256 is a value; use one per thread.

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace memra {

using Sha256Digest = std::array<uint8_t, 32>;

class Sha256 {
 public:
  Sha256();

  // Appends bytes to the message. REQUIRES: Finish() not yet called.
  void Update(std::string_view bytes);
  // Pads, processes the final block(s) and returns the digest; the hasher is spent afterwards.
  Sha256Digest Finish();

 private:
  void ProcessBlock(const uint8_t* block);

  std::array<uint32_t, 8> state_;
  std::array<uint8_t, 64> buffer_{};
  uint64_t buffered_ = 0;       // bytes in buffer_, < 64
  uint64_t message_bytes_ = 0;  // total bytes hashed (the length field is in bits, mod 2^64)
};

Sha256Digest Sha256Of(std::string_view bytes);
// Lowercase hex, 64 characters.
std::string Sha256Hex(const Sha256Digest& digest);

}  // namespace memra

#endif  // MEMRA_CORE_SHA256_H_
