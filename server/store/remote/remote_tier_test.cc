#include "server/store/remote/remote_tier.h"

#include <signal.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <xxhash.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/base/streaming_checksum.h"
#include "server/testing/test_redis_cluster.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::IsOkAndHolds;
using ::memra::testing::LocalRedisCluster;
using ::memra::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::Optional;

BlockKey KeyOf(uint8_t seed) {
  BlockKey key{};
  for (size_t i = 0; i < key.size(); ++i) key[i] = static_cast<uint8_t>(seed + i);
  return key;
}

std::string Payload(size_t size, uint8_t seed) {
  std::string bytes(size, '\0');
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<char>(seed + i * 7);
  return bytes;
}

// A block value as a capture seals it: `slice_bytes` slices, the piece checksum from them.
RemoteValueHeader HeaderFor(const std::string& payload, uint32_t slice_bytes) {
  RemoteValueHeader header;
  header.kind = RemoteValueKind::kBlock;
  header.payload_bytes = payload.size();
  header.shape_prefix = 0x1122334455667788;
  header.block_tokens = 16;
  header.slice_bytes = slice_bytes;
  header.boundary_tokens = 0;
  header.checksum = PieceChecksum(SliceChecksums(
      absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(payload.data()), payload.size()),
      slice_bytes));
  header.layout_digest = 0xabcdef;
  return header;
}

std::string ValueOf(absl::string_view key, const std::string& payload,
                    const RemoteValueHeader& header) {
  std::string value = NewRemoteValue(key, header);
  value.replace(kRemoteHeaderBytes, payload.size(), payload);
  return value;
}

// A value source that counts its reads and its destruction (shared with the test), and reads
// as `read_status` says; `on_destroy` runs in its destructor (on the thread that drops it).
struct SourceLog {
  std::atomic<int> reads{0};
  std::atomic<int> destroyed{0};
  std::atomic<bool> read_off_writer{false};  // read on the thread that queued it
};

class LoggedSource : public RemoteValueSource {
 public:
  LoggedSource(std::string value, std::shared_ptr<SourceLog> log,
               absl::Status read_status = absl::OkStatus(), std::function<void()> on_destroy = {})
      : value_(std::move(value)),
        log_(std::move(log)),
        read_status_(std::move(read_status)),
        on_destroy_(std::move(on_destroy)),
        queued_on_(std::this_thread::get_id()) {}
  ~LoggedSource() override {
    if (on_destroy_) on_destroy_();
    log_->destroyed.fetch_add(1);
  }
  uint64_t bytes() const override { return value_.size(); }
  absl::Status Read(absl::Span<char> value) override {
    log_->reads.fetch_add(1);
    if (std::this_thread::get_id() == queued_on_) log_->read_off_writer = true;
    if (!read_status_.ok()) return read_status_;
    std::memcpy(value.data(), value_.data(), value_.size());
    return absl::OkStatus();
  }

 private:
  const std::string value_;
  const std::shared_ptr<SourceLog> log_;
  const absl::Status read_status_;
  const std::function<void()> on_destroy_;
  const std::thread::id queued_on_;
};

// ---- Keys and values: no server needed ----

TEST(RemoteKeysTest, ScopeIsHashedAndKindsDiffer) {
  const std::string block = RemoteBlockKey("uid:1000", KeyOf(1));
  const std::string boundary = RemoteBoundaryKey("uid:1000", KeyOf(1));
  EXPECT_TRUE(absl::StartsWith(block, "memra-kv/v2/")) << block;
  EXPECT_FALSE(absl::StrContains(block, "uid:1000")) << block;  // a hex digest, not the name
  EXPECT_EQ(block.size(), std::string("memra-kv/v2/").size() + 64 + 3 + 64);
  EXPECT_TRUE(absl::StrContains(block, "/b/0102030405")) << block;
  EXPECT_TRUE(absl::StrContains(boundary, "/s/0102030405")) << boundary;
  EXPECT_EQ(block.substr(0, 76), boundary.substr(0, 76));  // one scope prefix for ACLs
  EXPECT_NE(RemoteBlockKey("uid:1001", KeyOf(1)).substr(0, 76), block.substr(0, 76));
}

TEST(RemoteValueTest, RoundTripsOneAndSeveralSlices) {
  for (const uint32_t slice_bytes : {1u << 20, 1000u}) {
    const std::string payload = Payload(4096, 3);
    const RemoteValueHeader header = HeaderFor(payload, slice_bytes);
    const std::string value = ValueOf("k", payload, header);
    ASSERT_EQ(value.size(), kRemoteHeaderBytes + payload.size());
    absl::StatusOr<VerifiedRemoteValue> verified = VerifyRemoteValue("k", value, header);
    ASSERT_THAT(verified, IsOk());
    EXPECT_EQ(verified->payload, payload);
    EXPECT_EQ(verified->slice_bytes, slice_bytes);
    EXPECT_EQ(verified->slice_checksums.size(), slice_bytes == 1000u ? 5u : 1u);
    EXPECT_EQ(verified->checksum, header.checksum);
  }
}

TEST(RemoteValueTest, CorruptBytesAreDataLoss) {
  const std::string payload = Payload(4096, 5);
  const RemoteValueHeader header = HeaderFor(payload, 1024);
  const std::string value = ValueOf("key", payload, header);

  EXPECT_THAT(VerifyRemoteValue("key", value.substr(0, 40), header),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstrs("key", "holds 40 bytes", "72")));
  std::string bad_header = value;
  bad_header[20] ^= 1;  // the shape prefix, under the header checksum
  EXPECT_THAT(VerifyRemoteValue("key", bad_header, header),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstrs("key", "header xxHash3")));
  std::string bad_payload = value;
  bad_payload[kRemoteHeaderBytes + 3000] ^= 0x40;
  EXPECT_THAT(VerifyRemoteValue("key", bad_payload, header),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstrs("key", "4096 payload bytes", "sealed as", "never served")));
  EXPECT_THAT(VerifyRemoteValue("key", value.substr(0, value.size() - 1), header),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstrs("key", "4096 payload bytes", "holds 4095")));
  RemoteValueHeader zero_slices = header;
  zero_slices.slice_bytes = 0;
  EXPECT_THAT(VerifyRemoteValue("key", ValueOf("key", payload, zero_slices), header),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstrs("key", "slice size 0")));
}

// A format-1 value (64-byte header sealed over [0, 56), no key digest: what the previous build
// wrote) is another build's value, a miss left in place, never DATA_LOSS (which deletes it).
TEST(RemoteValueTest, AFormat1ValueIsAnotherBuildsNotCorrupt) {
  const std::string payload = Payload(2048, 6);
  const RemoteValueHeader header = HeaderFor(payload, 1 << 20);
  const std::string key = RemoteBlockKey("scope", KeyOf(1));
  const std::string v2 = ValueOf(key, payload, header);
  std::string v1 = v2.substr(0, 56);
  v1[4] = 1;
  const uint64_t sum = XXH3_64bits(v1.data(), 56);
  for (int i = 0; i < 8; ++i) v1.push_back(static_cast<char>((sum >> (8 * i)) & 0xff));
  v1 += payload;
  EXPECT_THAT(VerifyRemoteValue(key, v1, header),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs(key, "format version 1", "expects 2")));
  // Too short even for magic and version: corrupt.
  EXPECT_THAT(VerifyRemoteValue(key, v2.substr(0, 5), header),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstrs("holds 5 bytes", "72")));
}

// A whole, valid value copied to another key of the same shape: every field and both checksums
// hold, only the key digest tells it is another prefix's bytes.
TEST(RemoteValueTest, AValueUnderAnotherKeyIsDataLossNamingBothDigests) {
  const std::string payload = Payload(2048, 6);
  const RemoteValueHeader header = HeaderFor(payload, 1 << 20);
  const std::string written_as = RemoteBlockKey("scope", KeyOf(1));
  const std::string read_as = RemoteBlockKey("scope", KeyOf(2));
  const std::string value = ValueOf(written_as, payload, header);
  ASSERT_THAT(VerifyRemoteValue(written_as, value, header), IsOk());
  EXPECT_THAT(VerifyRemoteValue(read_as, value, header),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstrs(read_as, "written under another key",
                                  absl::StrFormat("%016x", RemoteKeyDigest(written_as)),
                                  absl::StrFormat("%016x", RemoteKeyDigest(read_as)),
                                  "never served")));
}

TEST(RemoteValueTest, AnotherShapeIsAMismatchNamingBothNumbers) {
  const std::string payload = Payload(512, 9);
  const RemoteValueHeader header = HeaderFor(payload, 1 << 20);
  const std::string value = ValueOf("key-s", payload, header);
  struct Case {
    void (*change)(RemoteValueHeader&);
    std::vector<std::string> words;
  };
  const Case cases[] = {
      {[](RemoteValueHeader& h) { h.kind = RemoteValueKind::kBoundary; }, {"kind 1", "expects 2"}},
      {[](RemoteValueHeader& h) { h.payload_bytes = 1024; }, {"payload bytes 512", "expects 1024"}},
      {[](RemoteValueHeader& h) { h.shape_prefix = 7; }, {"shape key prefix", "expects 7"}},
      {[](RemoteValueHeader& h) { h.block_tokens = 32; }, {"block_tokens 16", "expects 32"}},
      {[](RemoteValueHeader& h) { h.boundary_tokens = 64; }, {"boundary tokens 0", "expects 64"}},
      {[](RemoteValueHeader& h) { h.layout_digest = 1; }, {"layout digest 11259375", "expects 1"}},
  };
  for (const Case& c : cases) {
    RemoteValueHeader expected = header;
    c.change(expected);
    std::vector<std::string> words = c.words;
    words.push_back("shape mismatch");
    words.push_back("key-s");
    absl::Status status = VerifyRemoteValue("key-s", value, expected).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
    for (const std::string& word : words) {
      EXPECT_TRUE(absl::StrContains(status.message(), word)) << status << " lacks " << word;
    }
  }
  // A valid header of format 3 (its checksum re-sealed).
  std::string resealed = NewRemoteValue("key-v", header);
  resealed.replace(kRemoteHeaderBytes, payload.size(), payload);
  resealed[4] = 3;
  const uint64_t sum = XXH3_64bits(resealed.data(), 64);
  for (int i = 0; i < 8; ++i) resealed[64 + i] = static_cast<char>((sum >> (8 * i)) & 0xff);
  EXPECT_THAT(VerifyRemoteValue("key-v", resealed, header),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("format version 3", "expects 2")));
}

TEST(RemoteTierOptionsTest, RefusesOptionsThatCannotWork) {
  RemoteTierOptions options;
  options.cluster.seed_nodes = {{"127.0.0.1", 1}};
  options.queue_bytes = 0;
  EXPECT_THAT(RemoteTier::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("queue_bytes (0)")));
  options.queue_bytes = 1 << 20;
  options.queue_entries = 0;
  EXPECT_THAT(RemoteTier::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("queue_entries (0)")));
  options.queue_entries = 16;
  options.reader_queue = 0;
  EXPECT_THAT(RemoteTier::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("reader_queue (0)")));
  options.reader_queue = 16;
  options.reader_threads = 0;
  EXPECT_THAT(RemoteTier::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("reader_threads (0)")));
  options.reader_threads = 65;
  EXPECT_THAT(RemoteTier::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("reader_threads (65)")));
  options.reader_threads = 2;
  options.breaker_max = absl::Milliseconds(10);
  EXPECT_THAT(RemoteTier::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("back-off 1s to 10ms")));
  options.breaker_max = absl::Seconds(30);
  options.cluster.tls = true;
  EXPECT_THAT(RemoteTier::Create(options),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstrs("hiredis 0.14")));
}

// Nothing listens on the seed: the tier starts down, refuses reads at once, drops writes.
TEST(RemoteTierDownTest, AClusterDownAtStartIsNotAnErrorAndCostsNothingPerCall) {
  RemoteTierOptions options;
  const int port = testing::BindLoopbackPort(0);  // free now, and nothing binds it
  ASSERT_GT(port, 0);
  options.cluster.seed_nodes = {{"127.0.0.1", port}};
  absl::StatusOr<std::unique_ptr<RemoteTier>> tier = RemoteTier::Create(options);
  ASSERT_THAT(tier, IsOk());
  EXPECT_FALSE((*tier)->Up());
  const absl::Time start = absl::Now();
  EXPECT_THAT((*tier)->ExistsEach({"a", "b"}, absl::Seconds(5)),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstrs("down")));
  EXPECT_THAT((*tier)->GetEach({"a"}, absl::Seconds(5)),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstrs("down")));
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(100));
  EXPECT_FALSE((*tier)->AdmitWrite(100));
  EXPECT_FALSE((*tier)->Enqueue("k", "v"));
  // A refused source is never read and is destroyed (its hold released) before Enqueue returns.
  auto log = std::make_shared<SourceLog>();
  EXPECT_FALSE((*tier)->Enqueue("k", std::make_unique<LoggedSource>("v", log)));
  EXPECT_EQ(log->reads.load(), 0);
  EXPECT_EQ(log->destroyed.load(), 1);
  const RemoteTierStats stats = (*tier)->Stats();
  EXPECT_FALSE(stats.up);
  EXPECT_EQ(stats.read_refusals, 2u);
  EXPECT_EQ(stats.dropped_writes, 3u);
  EXPECT_EQ(stats.breaker_opens, 1u);
}

// ---- Against a real 3-master / 3-replica cluster ----

class RemoteTierTest : public testing::WithRedisCluster<> {
 protected:
  void SetUp() override {
    WithRedisCluster::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    ASSERT_TRUE(cluster_->WaitHealthy());
  }

  RemoteTierOptions Options(absl::Duration command_timeout = absl::Milliseconds(300)) const {
    RemoteTierOptions options;
    options.cluster.seed_nodes = *ParseRedisNodeList(cluster_->NodeList());
    options.cluster.password_file =
        cluster_->WritePasswordFile("default.pass", testing::kRedisPassword);
    options.cluster.command_timeout = command_timeout;
    options.breaker_initial = absl::Milliseconds(200);
    options.breaker_max = absl::Milliseconds(800);
    return options;
  }

  // Stops (SIGSTOP) the master owning `key`'s slot; returns its port (0: none owns it).
  int StopOwnerOf(const std::string& key) {
    const int owner = cluster_->OwnerOf(RedisKeySlot(key));
    if (owner > 0) cluster_->Signal(owner, SIGSTOP);
    return owner;
  }

  std::unique_ptr<RemoteTier> Make(const RemoteTierOptions& options) {
    absl::StatusOr<std::unique_ptr<RemoteTier>> tier = RemoteTier::Create(options);
    EXPECT_THAT(tier, IsOk());
    return tier.ok() ? *std::move(tier) : nullptr;
  }
};

TEST_F(RemoteTierTest, WritesBehindInOrderAndReadsBackAcrossSlots) {
  std::unique_ptr<RemoteTier> tier = Make(Options());
  ASSERT_NE(tier, nullptr);
  EXPECT_TRUE(tier->Up());
  std::vector<std::string> keys;
  for (uint8_t i = 0; i < 12; ++i) {
    keys.push_back(RemoteBlockKey("scope-w", KeyOf(i)));
    ASSERT_TRUE(tier->AdmitWrite(1000));
    ASSERT_TRUE(tier->Enqueue(keys.back(), Payload(1000 + i, i)));
  }
  ASSERT_TRUE(tier->Flush(absl::Seconds(10)));
  std::vector<std::string> asked = keys;
  asked.push_back(RemoteBlockKey("scope-w", KeyOf(200)));  // never written
  absl::StatusOr<std::vector<bool>> exists = tier->ExistsEach(asked, absl::Seconds(2));
  ASSERT_THAT(exists, IsOk());
  EXPECT_EQ(std::count(exists->begin(), exists->end(), true), 12);
  EXPECT_FALSE(exists->back());
  absl::StatusOr<std::vector<std::optional<std::string>>> values =
      tier->GetEach(asked, absl::Seconds(2));
  ASSERT_THAT(values, IsOk());
  for (uint8_t i = 0; i < 12; ++i) {
    EXPECT_THAT((*values)[i], Optional(Payload(1000 + i, i))) << int{i};
  }
  EXPECT_EQ((*values)[12], std::nullopt);
  // A discarded (corrupt) value is deleted behind the writes.
  tier->Discard(keys[0]);
  ASSERT_TRUE(tier->Flush(absl::Seconds(10)));
  EXPECT_THAT(tier->ExistsEach({keys[0], keys[1]}, absl::Seconds(2)),
              testing::IsOkAndHolds(ElementsAre(false, true)));
  const RemoteTierStats stats = tier->Stats();
  EXPECT_EQ(stats.writes, 12u);
  EXPECT_GT(stats.written_bytes, 12000u);
  EXPECT_EQ(stats.dropped_writes, 0u);
  EXPECT_EQ(stats.queued_bytes, 0u);
  EXPECT_GE(stats.reads, 1u + 13u + 1u);
  EXPECT_GE(stats.cluster.connects, 3u);  // every master was written to
}

// Queued sources are read once, on the writer thread, and destroyed (the caller's hold
// released) before their SET is sent; a source whose read fails is a write error and nothing is
// written under its key.
TEST_F(RemoteTierTest, SourcesAreReadOnTheWriterAndReleasedBeforeTheirSet) {
  std::unique_ptr<RemoteTier> tier = Make(Options());
  ASSERT_NE(tier, nullptr);
  RedisClusterOptions observer_options = Options().cluster;
  absl::StatusOr<std::unique_ptr<RedisClusterClient>> observer =
      RedisClusterClient::Create(observer_options);
  ASSERT_THAT(observer, IsOk());
  auto log = std::make_shared<SourceLog>();
  std::atomic<int> present_at_release{0};
  std::vector<std::string> keys;
  for (uint8_t i = 0; i < 6; ++i) {
    keys.push_back(RemoteBlockKey("scope-src", KeyOf(i)));
    const std::string key = keys.back();
    auto on_destroy = [&present_at_release, &observer, key] {
      absl::StatusOr<std::optional<std::string>> value = (*observer)->Get(key);
      if (!value.ok() || value->has_value()) present_at_release.fetch_add(1);
    };
    ASSERT_TRUE(tier->Enqueue(
        key, std::make_unique<LoggedSource>(Payload(3000 + i, i), log, absl::OkStatus(),
                                            on_destroy)));
  }
  const std::string failing = RemoteBlockKey("scope-src", KeyOf(99));
  ASSERT_TRUE(tier->Enqueue(
      failing, std::make_unique<LoggedSource>(
                   Payload(100, 1), log, absl::DataLossError("the piece could not be read"))));
  ASSERT_TRUE(tier->Flush(absl::Seconds(10)));
  EXPECT_EQ(log->reads.load(), 7);
  EXPECT_EQ(log->destroyed.load(), 7);
  EXPECT_FALSE(log->read_off_writer.load());
  EXPECT_EQ(present_at_release.load(), 0);  // every key written after its source went
  absl::StatusOr<std::vector<std::optional<std::string>>> values =
      tier->GetEach(keys, absl::Seconds(2));
  ASSERT_THAT(values, IsOk());
  for (uint8_t i = 0; i < 6; ++i) EXPECT_THAT((*values)[i], Optional(Payload(3000 + i, i)));
  EXPECT_THAT(tier->ExistsEach({failing}, absl::Seconds(2)),
              testing::IsOkAndHolds(ElementsAre(false)));
  const RemoteTierStats stats = tier->Stats();
  EXPECT_EQ(stats.writes, 6u);
  EXPECT_EQ(stats.write_errors, 1u);
  EXPECT_EQ(stats.queued_bytes, 0u);
  EXPECT_EQ(stats.queued_writes, 0u);
}

TEST_F(RemoteTierTest, AFullQueueDropsTheWriteAndCountsIt) {
  RemoteTierOptions options = Options();
  options.queue_bytes = 4096;
  options.queue_entries = 1000;
  std::unique_ptr<RemoteTier> tier = Make(options);
  ASSERT_NE(tier, nullptr);
  // Admission is all or nothing for a capture's pieces: more than the queue holds is refused.
  EXPECT_FALSE(tier->AdmitWrite(4097));
  EXPECT_TRUE(tier->AdmitWrite(4096));
  EXPECT_EQ(tier->Stats().dropped_writes, 1u);
  // Enqueue never waits: whatever does not fit now is dropped (400 enqueues take far less than
  // the 200 round trips the queued ones would).
  uint64_t queued = 0;
  uint64_t dropped = 0;
  for (int i = 0; i < 400; ++i) {
    (tier->Enqueue(absl::StrCat("memra-kv/test/full/", i), Payload(2000, 1)) ? queued : dropped)++;
  }
  EXPECT_GT(dropped, 0u);
  EXPECT_GE(queued, 2u);
  ASSERT_TRUE(tier->Flush(absl::Seconds(10)));
  const RemoteTierStats stats = tier->Stats();
  EXPECT_EQ(stats.dropped_writes, 1u + dropped);
  EXPECT_EQ(stats.writes, queued);
}

// A stopped master: reads past the caller's deadline answer DEADLINE_EXCEEDED at the deadline
// (not the client's timeout); three failures open the breaker (reads refused at once, writes
// dropped); once the master answers again the writer's probe closes it.
TEST_F(RemoteTierTest, AStalledMasterCostsOneDeadlineThenTheBreakerRefusesUntilItAnswers) {
  std::unique_ptr<RemoteTier> tier = Make(Options());
  ASSERT_NE(tier, nullptr);
  const std::string key = RemoteBlockKey("scope-stall", KeyOf(7));
  const int owner = StopOwnerOf(key);
  ASSERT_GT(owner, 0);
  for (int i = 0; i < RemoteTier::kBreakerFailures; ++i) {
    const absl::Time start = absl::Now();
    EXPECT_THAT(tier->ExistsEach({key}, absl::Milliseconds(20)),
                StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstrs("20ms")));
    EXPECT_LT(absl::Now() - start, absl::Milliseconds(250));
  }
  // The abandoned calls fail at the client's 300 ms timeout and open the breaker.
  ASSERT_TRUE(testing::PollUntil([&] { return !tier->Up(); }));
  const absl::Time start = absl::Now();
  EXPECT_THAT(tier->ExistsEach({key}, absl::Seconds(1)),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstrs("circuit breaker open")));
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(50));
  EXPECT_FALSE(tier->Enqueue(key, "v"));
  RemoteTierStats stats = tier->Stats();
  EXPECT_EQ(stats.read_timeouts, 3u);
  EXPECT_GE(stats.read_refusals, 1u);
  EXPECT_GE(stats.breaker_opens, 1u);
  cluster_->Signal(owner, SIGCONT);
  ASSERT_TRUE(testing::PollUntil([&] { return tier->Up(); }));
  // Answered once the client's back-off for that node has passed (at most node_retry_max).
  EXPECT_TRUE(testing::PollUntil([&] { return tier->ExistsEach({key}, absl::Seconds(2)).ok(); }));
  stats = tier->Stats();
  EXPECT_GE(stats.probes, 1u);
}

// One reader stuck on a stopped master and one call waiting for it: a further read is refused
// at once, naming the queue, rather than waiting its deadline too.
TEST_F(RemoteTierTest, AFullReaderQueueRefusesAReadAtOnce) {
  RemoteTierOptions options = Options(/*command_timeout=*/absl::Seconds(2));
  options.reader_threads = 1;
  options.reader_queue = 1;
  std::unique_ptr<RemoteTier> tier = Make(options);
  ASSERT_NE(tier, nullptr);
  const std::string key = RemoteBlockKey("scope-queue", KeyOf(3));
  const int owner = StopOwnerOf(key);
  ASSERT_GT(owner, 0);
  // The first call holds the one reader; the second waits in the queue past its deadline.
  const absl::Status first = tier->ExistsEach({key}, absl::Milliseconds(30)).status();
  const absl::Status second = tier->ExistsEach({key}, absl::Milliseconds(30)).status();
  const absl::Time start = absl::Now();
  const absl::Status third = tier->GetEach({key}, absl::Seconds(1)).status();
  const absl::Duration took = absl::Now() - start;
  cluster_->Signal(owner, SIGCONT);
  EXPECT_THAT(first, StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstrs("30ms")));
  EXPECT_THAT(second, StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstrs("30ms")));
  EXPECT_THAT(third, StatusIs(absl::StatusCode::kUnavailable,
                              HasSubstrs("1 read calls already wait for a reader")));
  EXPECT_LT(took, absl::Milliseconds(50));
  const RemoteTierStats stats = tier->Stats();
  EXPECT_EQ(stats.read_refusals, 1u);
  EXPECT_EQ(stats.read_timeouts, 2u);
}

// Shutdown's flush: what the cluster takes within the bound is written, the rest dropped and
// counted, never waited for.
TEST_F(RemoteTierTest, FlushOrDropWritesWhatItCanAndCountsTheRestAsDropped) {
  std::unique_ptr<RemoteTier> tier = Make(Options(/*command_timeout=*/absl::Seconds(2)));
  ASSERT_NE(tier, nullptr);
  for (uint8_t i = 0; i < 4; ++i) {
    ASSERT_TRUE(tier->Enqueue(RemoteBlockKey("scope-drain", KeyOf(i)), Payload(100, i)));
  }
  EXPECT_EQ(tier->FlushOrDrop(absl::Seconds(10)), 0u);
  EXPECT_EQ(tier->Stats().writes, 4u);

  const std::string stalled_key = RemoteBlockKey("scope-drain", KeyOf(9));
  const int owner = StopOwnerOf(stalled_key);
  ASSERT_GT(owner, 0);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(tier->Enqueue(stalled_key, Payload(100, i)));
  // The first write is in flight to the stopped master; the two behind it are dropped.
  ASSERT_TRUE(testing::PollUntil([&] { return tier->Stats().queued_writes == 3 &&
                                              tier->Stats().queued_bytes == 200; }));
  const absl::Time start = absl::Now();
  const uint64_t dropped = tier->FlushOrDrop(absl::Milliseconds(200));
  const absl::Duration took = absl::Now() - start;
  cluster_->Signal(owner, SIGCONT);
  EXPECT_EQ(dropped, 2u);
  EXPECT_GE(took, absl::Milliseconds(200));
  EXPECT_LT(took, absl::Seconds(1));
  const RemoteTierStats stats = tier->Stats();
  EXPECT_EQ(stats.dropped_writes, 2u);
  EXPECT_EQ(stats.queued_bytes, 0u);
}

// A master that stops answering opens the breaker through its callers' deadlines alone, though
// the writer keeps writing to the healthy masters and the client's own timeout has not passed:
// lookups stop paying their deadline after kBreakerFailures of them.
TEST_F(RemoteTierTest, CallerDeadlinesOpenTheBreakerWhileWritesToHealthyMastersSucceed) {
  // The client's own failure comes too late to matter.
  std::unique_ptr<RemoteTier> tier = Make(Options(/*command_timeout=*/absl::Seconds(3)));
  ASSERT_NE(tier, nullptr);
  const std::string stalled_key = RemoteBlockKey("scope-deadline", KeyOf(7));
  const int stalled_owner = cluster_->OwnerOf(RedisKeySlot(stalled_key));
  std::string healthy_key;
  for (uint8_t i = 8; healthy_key.empty() && i < 200; ++i) {
    const std::string key = RemoteBlockKey("scope-deadline", KeyOf(i));
    if (cluster_->OwnerOf(RedisKeySlot(key)) != stalled_owner) healthy_key = key;
  }
  ASSERT_FALSE(healthy_key.empty());
  const int owner = StopOwnerOf(stalled_key);
  ASSERT_GT(owner, 0);
  bool up_after_deadlines = true;
  uint64_t writes = 0;
  for (int i = 0; i < RemoteTier::kBreakerFailures; ++i) {
    // A successful write between the failed reads resets nothing on the read path.
    EXPECT_TRUE(tier->Enqueue(healthy_key, Payload(100, i)));
    EXPECT_TRUE(tier->Flush(absl::Seconds(2)));
    writes = tier->Stats().writes;
    EXPECT_THAT(tier->ExistsEach({stalled_key}, absl::Milliseconds(30)),
                StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstrs("30ms")));
  }
  up_after_deadlines = tier->Up();
  const absl::Time start = absl::Now();
  const absl::Status refused = tier->ExistsEach({stalled_key}, absl::Seconds(1)).status();
  const absl::Duration took = absl::Now() - start;
  cluster_->Signal(owner, SIGCONT);
  EXPECT_EQ(writes, static_cast<uint64_t>(RemoteTier::kBreakerFailures));
  EXPECT_FALSE(up_after_deadlines);
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kUnavailable, HasSubstrs("circuit breaker")));
  EXPECT_LT(took, absl::Milliseconds(50));
  const RemoteTierStats stats = tier->Stats();
  EXPECT_EQ(stats.read_timeouts, static_cast<uint64_t>(RemoteTier::kBreakerFailures));
  EXPECT_EQ(stats.breaker_opens, 1u);
  ASSERT_TRUE(testing::PollUntil([&] { return tier->Up(); }));
}

// Options for a tier on its own cluster (`seeds`: the client's seed nodes), with a short
// breaker back-off.
RemoteTierOptions OwnClusterOptions(const LocalRedisCluster& cluster,
                                    std::vector<RedisNodeAddress> seeds) {
  RemoteTierOptions options;
  options.cluster.seed_nodes = std::move(seeds);
  options.cluster.password_file =
      cluster.WritePasswordFile("default.pass", testing::kRedisPassword);
  options.breaker_initial = absl::Milliseconds(200);
  options.breaker_max = absl::Milliseconds(800);
  return options;
}

// `count` keys of `scope` written through `tier` and flushed; the keys.
std::vector<std::string> WriteAndFlush(RemoteTier& tier, const std::string& scope, uint8_t count) {
  std::vector<std::string> keys;
  for (uint8_t i = 0; i < count; ++i) {
    keys.push_back(RemoteBlockKey(scope, KeyOf(i)));
    EXPECT_TRUE(tier.Enqueue(keys.back(), Payload(100, i)));
  }
  EXPECT_TRUE(tier.Flush(absl::Seconds(10)));
  return keys;
}

// A master dead with its replica (no failover can come): the tier stays up. Lookups answer the
// other masters' keys and read the dead one's as misses; writes to its slots fail and are
// counted without opening the breaker; writes to the others land. One dead node costs its own
// slots, never the whole tier.
TEST(RemoteTierPartialTest, ADeadMasterWithoutReplicaCostsOnlyItsOwnSlots) {
  if (!testing::RedisInstalled()) GTEST_SKIP() << testing::RedisMissingMessage();
  LocalRedisCluster cluster;
  ASSERT_TRUE(cluster.Start());
  absl::StatusOr<std::unique_ptr<RemoteTier>> created =
      RemoteTier::Create(OwnClusterOptions(cluster, *ParseRedisNodeList(cluster.NodeList())));
  ASSERT_THAT(created, IsOk());
  RemoteTier& tier = **created;

  constexpr uint8_t kKeys = 24;
  const std::vector<std::string> keys = WriteAndFlush(tier, "scope-partial", kKeys);
  ASSERT_EQ(tier.Stats().writes, kKeys);
  const int victim = cluster.OwnerOf(RedisKeySlot(keys[0]));
  const int replica = cluster.ReplicaOf(victim);
  ASSERT_GT(victim, 0);
  ASSERT_GT(replica, 0);
  std::vector<bool> expected;  // what a lookup can say: present unless on the dead master
  std::string healthy_key;
  for (const std::string& key : keys) {
    expected.push_back(cluster.OwnerOf(RedisKeySlot(key)) != victim);
    if (expected.back()) healthy_key = key;
  }
  ASSERT_FALSE(healthy_key.empty());
  cluster.Signal(replica, SIGKILL);
  cluster.Signal(victim, SIGKILL);

  // Many lookups and writes, each touching the dead master: the breaker never opens.
  for (int round = 0; round < 4 * RemoteTier::kBreakerFailures; ++round) {
    EXPECT_THAT(tier.ExistsEach(keys, absl::Seconds(2)), IsOkAndHolds(expected)) << round;
    EXPECT_TRUE(tier.Enqueue(keys[0], Payload(100, 0)));
    EXPECT_TRUE(tier.Enqueue(healthy_key, Payload(100, 1)));
    ASSERT_TRUE(tier.Flush(absl::Seconds(5)));
    EXPECT_TRUE(tier.Up()) << round;
  }
  const RemoteTierStats stats = tier.Stats();
  EXPECT_EQ(stats.breaker_opens, 0u);
  EXPECT_EQ(stats.writes, kKeys + 4u * RemoteTier::kBreakerFailures);
  EXPECT_EQ(stats.write_errors, 4u * RemoteTier::kBreakerFailures);
  EXPECT_EQ(stats.partial_lookups, 4u * RemoteTier::kBreakerFailures);  // each one partly answered
  EXPECT_EQ(stats.read_errors, 0u);
  EXPECT_GE(stats.cluster.node_down_refusals, 1u);
  EXPECT_EQ(stats.read_refusals, 0u);
}

// Every node dies after the tier is up, and the client knows only the masters (the refresh
// has no node left to ask but ones it just put in back-off): the breaker still opens, from
// the failures the calls' own refreshes meet, rather than reading every call as a refusal of
// one node in back-off.
TEST(RemoteTierPartialTest, AClusterThatDiesWholeOpensTheBreaker) {
  if (!testing::RedisInstalled()) GTEST_SKIP() << testing::RedisMissingMessage();
  LocalRedisCluster cluster;
  ASSERT_TRUE(cluster.Start());
  absl::StatusOr<std::vector<int>> masters = cluster.MasterPorts();
  ASSERT_THAT(masters, IsOk());
  std::vector<RedisNodeAddress> seeds;
  for (const int port : *masters) seeds.push_back({"127.0.0.1", port});
  absl::StatusOr<std::unique_ptr<RemoteTier>> created =
      RemoteTier::Create(OwnClusterOptions(cluster, std::move(seeds)));
  ASSERT_THAT(created, IsOk());
  RemoteTier& tier = **created;
  const std::vector<std::string> keys = WriteAndFlush(tier, "scope-dead", 24);
  for (const int port : cluster.ports()) cluster.Signal(port, SIGKILL);
  int rounds = 0;
  EXPECT_TRUE(testing::PollUntil([&] {
    ++rounds;
    (void)tier.ExistsEach(keys, absl::Milliseconds(20));
    (void)tier.Enqueue(keys[rounds % keys.size()], Payload(100, 0));
    return !tier.Up();
  })) << "the breaker never opened in " << rounds << " rounds with every node dead";
  const RemoteTierStats stats = tier.Stats();
  EXPECT_GE(stats.breaker_opens, 1u);
  EXPECT_THAT(tier.ExistsEach(keys, absl::Seconds(1)),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstrs("circuit breaker open")));
}

}  // namespace
}  // namespace memra
