#include "server/base/secret_token.h"

#include <sys/random.h>

#include <cerrno>

#include "common/errors.h"

namespace memra {

absl::StatusOr<std::string> RandomSecretToken() {
  std::string token(kSecretTokenBytes, '\0');
  size_t filled = 0;
  while (filled < token.size()) {
    ssize_t got = getrandom(token.data() + filled, token.size() - filled, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      return PosixError("getrandom", errno);
    }
    filled += static_cast<size_t>(got);
  }
  return token;
}

bool TokensEqual(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= a[i] ^ b[i];
  return diff == 0;
}

}  // namespace memra
