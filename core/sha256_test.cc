#include "core/sha256.h"

#include <string>

#include "gtest/gtest.h"

namespace memra {
namespace {

// FIPS 180-4 / NIST CSRC example vectors.
TEST(Sha256Test, EmptyMessage) {
  EXPECT_EQ(Sha256Hex(Sha256Of("")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
}

TEST(Sha256Test, Abc) {
  EXPECT_EQ(Sha256Hex(Sha256Of("abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(Sha256Test, FourHundredFortyEightBitMessageNeedsTwoPaddingBlocks) {
  EXPECT_EQ(Sha256Hex(Sha256Of("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
}

TEST(Sha256Test, OneMillionA) {
  EXPECT_EQ(Sha256Hex(Sha256Of(std::string(1000000, 'a'))),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256Test, IncrementalUpdatesAtEveryBoundaryMatchOneShot) {
  std::string message;
  for (int i = 0; i < 300; ++i) message.push_back(static_cast<char>(i * 7 + 3));
  const Sha256Digest whole = Sha256Of(message);
  for (size_t split = 0; split <= message.size(); ++split) {
    Sha256 hasher;
    hasher.Update(std::string_view(message).substr(0, split));
    hasher.Update(std::string_view(message).substr(split));
    EXPECT_EQ(hasher.Finish(), whole) << "split at " << split;
  }
  // Byte-at-a-time crosses every block edge and every padding case on the way; empty updates
  // (a default string_view has no data) change nothing.
  Sha256 bytewise;
  bytewise.Update(std::string_view());
  for (char c : message) bytewise.Update(std::string_view(&c, 1));
  EXPECT_EQ(bytewise.Finish(), whole);
}

TEST(Sha256Test, LengthsAroundThePaddingEdge) {
  // 55 bytes pad within one block, 56..63 need a second: each length hashes distinctly and
  // deterministically (values from Python's hashlib).
  EXPECT_EQ(Sha256Hex(Sha256Of(std::string(55, 'a'))),
            "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318");
  EXPECT_EQ(Sha256Hex(Sha256Of(std::string(56, 'a'))),
            "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a");
  EXPECT_EQ(Sha256Hex(Sha256Of(std::string(64, 'a'))),
            "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb");
}

}  // namespace
}  // namespace memra
