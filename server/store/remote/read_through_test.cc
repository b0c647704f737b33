#include "server/store/remote/read_through.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/base/streaming_checksum.h"
#include "server/testing/test_redis_cluster.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::StatusIs;

BlockKey KeyOf(uint8_t seed) {
  BlockKey key{};
  for (size_t i = 0; i < key.size(); ++i) key[i] = static_cast<uint8_t>(seed + 3 * i);
  return key;
}

std::string Payload(size_t size, uint8_t seed) {
  std::string bytes(size, '\0');
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<char>(seed + i * 11);
  return bytes;
}

// What the store expects of every block value here (the checksum is the value's own).
RemoteValueHeader Expected(size_t payload_bytes) {
  RemoteValueHeader header;
  header.kind = RemoteValueKind::kBlock;
  header.payload_bytes = payload_bytes;
  header.shape_prefix = 0x0102030405060708;
  header.block_tokens = 16;
  header.boundary_tokens = 0;
  header.layout_digest = 0x5eed;
  return header;
}

// A block value as a capture seals it, under `key`.
std::string ValueOf(const std::string& key, const std::string& payload,
                    RemoteValueHeader header) {
  header.slice_bytes = 1000;
  header.checksum = PieceChecksum(SliceChecksums(
      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(payload.data()), payload.size()),
      header.slice_bytes));
  std::string value = NewRemoteValue(key, header);
  value.replace(kRemoteHeaderBytes, payload.size(), payload);
  return value;
}

constexpr size_t kPayload = 3000;

class ReadThroughTest : public testing::WithRedisCluster<> {
 protected:
  void SetUp() override {
    WithRedisCluster::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    ASSERT_TRUE(cluster_->WaitHealthy());
    RemoteTierOptions options;
    options.cluster.seed_nodes = *ParseRedisNodeList(cluster_->NodeList());
    options.cluster.password_file =
        cluster_->WritePasswordFile("default.pass", testing::kRedisPassword);
    absl::StatusOr<std::unique_ptr<RemoteTier>> tier = RemoteTier::Create(options);
    ASSERT_THAT(tier.status(), IsOk());
    tier_ = *std::move(tier);
  }

  // Writes `count` good block values under scope `scope`; returns their keys in order.
  std::vector<std::string> Write(const std::string& scope, int count) {
    std::vector<std::string> keys;
    for (int i = 0; i < count; ++i) {
      keys.push_back(RemoteBlockKey(scope, KeyOf(static_cast<uint8_t>(i))));
      const std::string value =
          ValueOf(keys.back(), Payload(kPayload, static_cast<uint8_t>(i)), Expected(kPayload));
      EXPECT_TRUE(tier_->AdmitWrite(value.size()));
      EXPECT_TRUE(tier_->Enqueue(keys.back(), value));
    }
    EXPECT_TRUE(tier_->Flush(absl::Seconds(10)));
    return keys;
  }

  // Replaces the value under `key` (written through the tier's queue).
  void Overwrite(const std::string& key, const std::string& value) {
    ASSERT_TRUE(tier_->Enqueue(key, value));
    ASSERT_TRUE(tier_->Flush(absl::Seconds(10)));
  }

  // Pulls `keys`, keeping each adopted payload (in `adopted`).
  ReadThroughResult Pull(const std::vector<std::string>& keys, std::vector<std::string>& adopted,
                         std::optional<size_t> refuse_at = std::nullopt) {
    return ReadThrough(
        *tier_, keys, [](size_t) { return Expected(kPayload); }, absl::Seconds(5),
        [&](size_t i, VerifiedRemoteValue& value) -> absl::Status {
          if (refuse_at == i) return absl::ResourceExhaustedError("no room for 3000 bytes");
          adopted.emplace_back(value.payload);
          return absl::OkStatus();
        });
  }

  std::unique_ptr<RemoteTier> tier_;
};

TEST_F(ReadThroughTest, VerifiedValuesAreAdoptedInOrderAcrossWindows) {
  const int count = static_cast<int>(kReadThroughWindowValues) + 3;  // two round trips
  const std::vector<std::string> keys = Write("scope-rt-all", count);
  std::vector<std::string> adopted;
  const ReadThroughResult result = Pull(keys, adopted);
  EXPECT_THAT(result.adopt_failure, IsOk());
  EXPECT_EQ(result.adopted, static_cast<size_t>(count));
  ASSERT_EQ(adopted.size(), static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) {
    EXPECT_EQ(adopted[i], Payload(kPayload, static_cast<uint8_t>(i))) << i;
  }
  EXPECT_EQ(result.counts.pieces, static_cast<uint64_t>(count));
  EXPECT_EQ(result.counts.bytes, count * kPayload);
  EXPECT_EQ(result.counts.corrupt, 0u);
  EXPECT_EQ(result.counts.shape_mismatches, 0u);
}

TEST_F(ReadThroughTest, AnAbsentValueEndsThePullBeforeIt) {
  std::vector<std::string> keys = Write("scope-rt-gap", 3);
  keys.insert(keys.begin() + 2, RemoteBlockKey("scope-rt-gap", KeyOf(99)));  // never written
  std::vector<std::string> adopted;
  const ReadThroughResult result = Pull(keys, adopted);
  EXPECT_EQ(result.adopted, 2u);
  EXPECT_EQ(adopted.size(), 2u);
  EXPECT_EQ(result.counts.pieces, 2u);
}

TEST_F(ReadThroughTest, ACorruptValueIsCountedDeletedAndEndsThePull) {
  std::vector<std::string> keys = Write("scope-rt-bad", 4);
  // Value 1's payload flipped after sealing: its checksum no longer matches.
  std::string bad = ValueOf(keys[1], Payload(kPayload, 1), Expected(kPayload));
  bad[kRemoteHeaderBytes + 17] ^= 0x40;
  Overwrite(keys[1], bad);
  std::vector<std::string> adopted;
  const ReadThroughResult result = Pull(keys, adopted);
  EXPECT_EQ(result.adopted, 1u);
  EXPECT_EQ(result.counts.corrupt, 1u);
  EXPECT_EQ(result.counts.shape_mismatches, 0u);
  ASSERT_TRUE(tier_->Flush(absl::Seconds(10)));  // the delete is queued behind the writes
  EXPECT_THAT(tier_->ExistsEach({keys[0], keys[1], keys[2]}, absl::Seconds(2)),
              testing::IsOkAndHolds(::testing::ElementsAre(true, false, true)));
}

TEST_F(ReadThroughTest, AValueOfAnotherShapeIsAMismatchAndStays) {
  std::vector<std::string> keys = Write("scope-rt-shape", 3);
  RemoteValueHeader other = Expected(kPayload);
  other.shape_prefix ^= 1;
  Overwrite(keys[0], ValueOf(keys[0], Payload(kPayload, 0), other));
  std::vector<std::string> adopted;
  const ReadThroughResult result = Pull(keys, adopted);
  EXPECT_EQ(result.adopted, 0u);
  EXPECT_EQ(result.counts.shape_mismatches, 1u);
  EXPECT_EQ(result.counts.corrupt, 0u);
  EXPECT_THAT(tier_->ExistsEach({keys[0]}, absl::Seconds(2)),
              testing::IsOkAndHolds(::testing::ElementsAre(true)));
}

TEST_F(ReadThroughTest, TheStoresRefusalEndsThePullAndIsReturned) {
  const std::vector<std::string> keys = Write("scope-rt-full", 5);
  std::vector<std::string> adopted;
  const ReadThroughResult result = Pull(keys, adopted, /*refuse_at=*/3);
  EXPECT_THAT(result.adopt_failure,
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstrs("3000 bytes")));
  EXPECT_EQ(result.adopted, 3u);
  EXPECT_EQ(result.counts.pieces, 3u);
  EXPECT_EQ(result.counts.bytes, 3 * kPayload);
}

}  // namespace
}  // namespace memra
