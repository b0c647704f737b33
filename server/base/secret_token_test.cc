#include "server/base/secret_token.h"

#include <string>

#include "absl/container/flat_hash_set.h"
#include "gtest/gtest.h"

namespace memra {
namespace {

TEST(SecretTokenTest, TokensAreSixteenRandomBytesAndDistinct) {
  absl::flat_hash_set<std::string> seen;
  for (int i = 0; i < 1000; ++i) {
    absl::StatusOr<std::string> token = RandomSecretToken();
    ASSERT_TRUE(token.ok()) << token.status();
    EXPECT_EQ(token->size(), kSecretTokenBytes);
    EXPECT_TRUE(seen.insert(*token).second) << "token repeated after " << i;
  }
}

TEST(SecretTokenTest, TokensEqualComparesEveryByteAndTheLength) {
  const std::string token("0123456789abcdef");
  EXPECT_TRUE(TokensEqual(token, token));
  std::string last_differs = token;
  last_differs.back() = 'g';
  EXPECT_FALSE(TokensEqual(token, last_differs));
  std::string first_differs = token;
  first_differs.front() = 'x';
  EXPECT_FALSE(TokensEqual(token, first_differs));
  EXPECT_FALSE(TokensEqual(token, token.substr(0, 15)));
  EXPECT_FALSE(TokensEqual(token, ""));
  EXPECT_TRUE(TokensEqual("", ""));
}

}  // namespace
}  // namespace memra
