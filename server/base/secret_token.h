#ifndef MEMRA_SERVER_SECRET_TOKEN_H_
#define MEMRA_SERVER_SECRET_TOKEN_H_

// The secrets the daemon hands out (engine and session tokens): 16 random bytes from the
// kernel, compared in time independent of where two tokens differ.

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace memra {

inline constexpr size_t kSecretTokenBytes = 16;

// kSecretTokenBytes from getrandom(2); an error only when the kernel refuses.
absl::StatusOr<std::string> RandomSecretToken();

// Compares secrets in time independent of where they differ.
bool TokensEqual(absl::string_view a, absl::string_view b);

}  // namespace memra

#endif  // MEMRA_SERVER_SECRET_TOKEN_H_
