#include "server/store/remote/redis_cluster.h"

#include <signal.h>

#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/testing/test_redis_cluster.h"
#include "tests/status_matchers.h"

namespace memra {
namespace {

using ::memra::testing::HasSubstrs;
using ::memra::testing::IsOk;
using ::memra::testing::IsOkAndHolds;
using ::memra::testing::LocalRedisCluster;
using ::memra::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::Optional;

// ExistsEach's answer where every key was answered (a test failure otherwise).
std::vector<bool> AllAnswered(const RedisExistsResult& result) {
  EXPECT_EQ(result.unanswered, 0u) << result.first_failure;
  std::vector<bool> exists;
  for (const std::optional<bool>& answer : result.exists) exists.push_back(answer.value_or(false));
  return exists;
}

// Writes keys "<prefix>0".."<prefix><count - 1>" with value_of(i); the keys (a test failure
// for a write that fails).
std::vector<std::string> WriteKeys(RedisClusterClient& client, absl::string_view prefix,
                                   int count, const std::function<std::string(int)>& value_of) {
  std::vector<std::string> keys;
  for (int i = 0; i < count; ++i) {
    keys.push_back(absl::StrCat(prefix, i));
    EXPECT_THAT(client.Set(keys.back(), value_of(i)), IsOk()) << keys.back();
  }
  return keys;
}

std::string RandomBytes(size_t size, uint32_t seed) {
  std::mt19937 random(seed);
  std::string bytes(size, '\0');
  for (char& c : bytes) c = static_cast<char>(random() % 4 == 0 ? 0 : random());
  return bytes;
}

// ---- No server needed ----

TEST(RedisKeySlotTest, KnownSlotsAndHashTags) {
  EXPECT_EQ(RedisKeySlot("123456789"), 0x31C3 % kRedisClusterSlots);  // the CRC16 check value
  EXPECT_EQ(RedisKeySlot("foo"), 12182);
  EXPECT_EQ(RedisKeySlot("{user1000}.following"), RedisKeySlot("user1000"));
  EXPECT_EQ(RedisKeySlot("{user1000}.followers"), RedisKeySlot("{user1000}.following"));
  EXPECT_EQ(RedisKeySlot("foo{}{bar}"), RedisKeySlot("foo{}{bar}"));  // empty tag: whole key
  EXPECT_NE(RedisKeySlot("foo{}{bar}"), RedisKeySlot("bar"));
  EXPECT_EQ(RedisKeySlot("foo{{bar}}zap"), RedisKeySlot("{bar"));
}

TEST(ParseRedisNodeListTest, ParsesHostsPortsAndV6) {
  absl::StatusOr<std::vector<RedisNodeAddress>> nodes =
      ParseRedisNodeList(" 10.0.0.1:7000 , redis-b:7001,[::1]:7002");
  ASSERT_THAT(nodes, IsOk());
  ASSERT_EQ(nodes->size(), 3u);
  EXPECT_EQ((*nodes)[0], (RedisNodeAddress{"10.0.0.1", 7000}));
  EXPECT_EQ((*nodes)[1], (RedisNodeAddress{"redis-b", 7001}));
  EXPECT_EQ((*nodes)[2], (RedisNodeAddress{"::1", 7002}));
  EXPECT_EQ((*nodes)[2].ToString(), "[::1]:7002");
}

TEST(ParseRedisNodeListTest, RefusesBadEntries) {
  EXPECT_THAT(ParseRedisNodeList(""),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("entry '' is empty")));
  EXPECT_THAT(ParseRedisNodeList("a:1,,b:2"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("is empty")));
  EXPECT_THAT(ParseRedisNodeList("redis-a"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'redis-a' has no port")));
  EXPECT_THAT(ParseRedisNodeList("a:0"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("'a:0'", "1..65535")));
  EXPECT_THAT(ParseRedisNodeList("a:65536"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("'a:65536'", "1..65535")));
  EXPECT_THAT(ParseRedisNodeList(":7000"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("has no host")));
  EXPECT_THAT(ParseRedisNodeList("[::1]7000"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("has no ]:port")));
}

TEST(RedisClusterCreateTest, RefusesTls) {
  RedisClusterOptions options;
  options.seed_nodes = {{"127.0.0.1", 7000}};
  options.tls = true;
  EXPECT_THAT(RedisClusterClient::Create(options),
              StatusIs(absl::StatusCode::kUnimplemented,
                       HasSubstrs("TLS", "hiredis 0.14", "hiredis_ssl", "hiredis 1.0")));
}

TEST(RedisClusterCreateTest, RefusesOptionsThatCannotWork) {
  RedisClusterOptions options;
  EXPECT_THAT(RedisClusterClient::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no seed nodes")));
  options.seed_nodes = {{"127.0.0.1", 7000}};
  options.command_timeout = absl::ZeroDuration();
  EXPECT_THAT(RedisClusterClient::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("timeouts must be positive", "command 0")));
  options.command_timeout = absl::Milliseconds(100);
  options.max_redirects = -1;
  EXPECT_THAT(RedisClusterClient::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_redirects -1")));
  options.max_redirects = 5;
  options.user = "tier";
  EXPECT_THAT(RedisClusterClient::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("user 'tier' given without a password file")));
  options.password_file = "/nonexistent/redis.pass";
  EXPECT_THAT(RedisClusterClient::Create(options),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstrs("/nonexistent/redis.pass", "No such file")));
  const std::string empty_file = absl::StrCat(getenv("TEST_TMPDIR"), "/empty.pass");
  std::ofstream(empty_file) << "\n";
  options.password_file = empty_file;
  EXPECT_THAT(RedisClusterClient::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs(empty_file, "holds 0 bytes")));
}

TEST(RedisClusterCreateTest, RefusesANodeBackOffThatCannotWork) {
  RedisClusterOptions options;
  options.seed_nodes = {{"127.0.0.1", 7000}};
  options.node_retry_initial = absl::ZeroDuration();
  EXPECT_THAT(RedisClusterClient::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstrs("node back-off 0 to 2s", "must be positive and not shrink")));
  options.node_retry_initial = absl::Seconds(3);
  EXPECT_THAT(RedisClusterClient::Create(options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstrs("node back-off 3s to 2s")));
}

TEST(RedisClusterCreateTest, NobodyListeningIsUnavailable) {
  const int port = testing::BindLoopbackPort(0);  // bound and closed: nothing listens there
  ASSERT_GT(port, 0);
  RedisClusterOptions options;
  options.seed_nodes = {{"127.0.0.1", port}};
  const absl::Time start = absl::Now();
  EXPECT_THAT(RedisClusterClient::Create(options),
              StatusIs(absl::StatusCode::kUnavailable,
                       HasSubstrs(absl::StrCat("node 127.0.0.1:", port), "Connection refused")));
  EXPECT_LT(absl::Now() - start, options.connect_timeout + absl::Seconds(1));
}

// ---- A real cluster, shared by the tests that leave it healthy ----

class RedisClusterTest : public testing::WithRedisCluster<> {
 protected:
  RedisClusterOptions Options() const {
    RedisClusterOptions options;
    options.seed_nodes = *ParseRedisNodeList(cluster_->NodeList());
    options.password_file = cluster_->WritePasswordFile("default.pass", testing::kRedisPassword);
    return options;
  }

  std::unique_ptr<RedisClusterClient> Connect() {
    absl::StatusOr<std::unique_ptr<RedisClusterClient>> client =
        RedisClusterClient::Create(Options());
    EXPECT_THAT(client, IsOk());
    return client.ok() ? std::move(*client) : nullptr;
  }

  // Keys of the slot on `port`, from the node itself.
  std::vector<std::string> KeysInSlot(int port, uint16_t slot) {
    absl::StatusOr<std::string> keys =
        cluster_->Command(port, {"CLUSTER", "GETKEYSINSLOT", absl::StrCat(slot), "1000"});
    EXPECT_THAT(keys, IsOk());
    return keys.ok() ? absl::StrSplit(*keys, '\n', absl::SkipEmpty())
                     : std::vector<std::string>{};
  }

  int OtherMaster(int port) {
    absl::StatusOr<std::vector<int>> masters = cluster_->MasterPorts();
    EXPECT_THAT(masters, IsOk());
    for (const int master : *masters) {
      if (master != port) return master;
    }
    return 0;
  }
};


TEST_F(RedisClusterTest, SlotsAgreeWithTheServer) {
  for (const std::string& key : std::vector<std::string>{"foo", "{tag}a", "a{tag}", "{}x",
                                                       std::string("\0\xff{z}", 5),
                                                       RandomBytes(300, 1)}) {
    EXPECT_THAT(cluster_->Command(cluster_->ports()[0], {"CLUSTER", "KEYSLOT", key}),
                IsOkAndHolds(absl::StrCat(RedisKeySlot(key))))
        << absl::CHexEscape(key);
  }
}

TEST_F(RedisClusterTest, KeysSpreadOverAllMastersAndExistAcrossSlots) {
  std::unique_ptr<RedisClusterClient> client = Connect();
  ASSERT_NE(client, nullptr);
  absl::StatusOr<std::vector<int>> masters = cluster_->MasterPorts();
  ASSERT_THAT(masters, IsOk());
  ASSERT_EQ(masters->size(), 3u);
  constexpr int kKeys = 300;
  std::vector<std::string> keys;
  for (int i = 0; i < kKeys; ++i) {
    keys.push_back(absl::StrCat("spread:", i));
    ASSERT_THAT(client->Set(keys.back(), absl::StrCat("value ", i)), IsOk());
    // The client's map sends each key where the cluster says its slot lives.
    const std::optional<RedisNodeAddress> node = client->NodeForSlot(RedisKeySlot(keys.back()));
    ASSERT_TRUE(node.has_value());
    EXPECT_EQ(node->port, cluster_->OwnerOf(RedisKeySlot(keys.back()))) << keys.back();
  }
  int total = 0;
  for (const int master : *masters) {
    int on_master = 0;
    for (const std::string& key : keys) {
      absl::StatusOr<std::string> exists = cluster_->Command(master, {"EXISTS", key});
      if (exists.ok() && *exists == "1") ++on_master;
    }
    EXPECT_GT(on_master, kKeys / 6) << "master " << master;
    total += on_master;
  }
  EXPECT_EQ(total, kKeys);

  std::vector<std::string> probe = {keys[0], "spread:absent:1", keys[150], "spread:absent:2",
                                    keys[299]};
  EXPECT_EQ(AllAnswered(client->ExistsEach(probe)),
            (std::vector<bool>{true, false, true, false, true}));
  EXPECT_EQ(AllAnswered(client->ExistsEach({})), std::vector<bool>{});
  EXPECT_THAT(client->Get(keys[7]), IsOkAndHolds(Optional(std::string("value 7"))));
  EXPECT_THAT(client->Del(keys[7]), IsOkAndHolds(true));
  EXPECT_THAT(client->Del(keys[7]), IsOkAndHolds(false));
  EXPECT_THAT(client->Get(keys[7]), IsOkAndHolds(std::nullopt));
  EXPECT_EQ(client->Stats().moved_redirects, 0u);
  EXPECT_EQ(client->Stats().ask_redirects, 0u);
}

TEST_F(RedisClusterTest, BinaryValuesRoundTripAndExpire) {
  std::unique_ptr<RedisClusterClient> client = Connect();
  ASSERT_NE(client, nullptr);
  const std::vector<size_t> sizes = {0, 1, 4096, 1 << 20, 3 << 20};
  for (size_t i = 0; i < sizes.size(); ++i) {
    const std::string key = absl::StrCat("binary:", i, std::string("\0\n\xff", 3));
    const std::string value = RandomBytes(sizes[i], static_cast<uint32_t>(i + 10));
    ASSERT_THAT(client->Set(key, value), IsOk());
    absl::StatusOr<std::optional<std::string>> read = client->Get(key);
    ASSERT_THAT(read, IsOk());
    ASSERT_TRUE(read->has_value());
    EXPECT_EQ(read->value().size(), sizes[i]);
    EXPECT_TRUE(read->value() == value) << "value " << i << " differs";
  }
  ASSERT_THAT(client->Set("binary:expiring", "x", absl::Microseconds(200500)), IsOk());
  absl::StatusOr<std::string> ttl =
      cluster_->Command(cluster_->OwnerOf(RedisKeySlot("binary:expiring")),
                        {"PTTL", "binary:expiring"});
  ASSERT_THAT(ttl, IsOk());
  int ttl_ms = 0;
  ASSERT_TRUE(absl::SimpleAtoi(*ttl, &ttl_ms)) << *ttl;
  EXPECT_GT(ttl_ms, 0);
  EXPECT_LE(ttl_ms, 201);  // 200.5 ms rounds up to 201
  EXPECT_TRUE(testing::PollUntil([&] {
    absl::StatusOr<std::optional<std::string>> read = client->Get("binary:expiring");
    return read.ok() && !read->has_value();
  }));
}

TEST_F(RedisClusterTest, FollowsMovedAfterASlotIsResharded) {
  std::unique_ptr<RedisClusterClient> client = Connect();
  ASSERT_NE(client, nullptr);
  const std::string key = "{moved}key";
  const uint16_t slot = RedisKeySlot(key);
  ASSERT_THAT(client->Set(key, "before the move"), IsOk());
  const int from = cluster_->OwnerOf(slot);
  const int to = OtherMaster(from);
  ASSERT_NE(to, 0);
  ASSERT_THAT(cluster_->MigrateSlot(slot, from, to, KeysInSlot(from, slot), /*finish=*/true),
              IsOk());
  ASSERT_EQ(client->NodeForSlot(slot)->port, from);  // the client has not heard yet

  EXPECT_THAT(client->Get(key), IsOkAndHolds(Optional(std::string("before the move"))));
  EXPECT_EQ(client->Stats().moved_redirects, 1u);
  EXPECT_EQ(client->NodeForSlot(slot)->port, to);
  ASSERT_THAT(client->Set(key, "after the move"), IsOk());
  EXPECT_EQ(client->Stats().moved_redirects, 1u);  // the map was right this time
  EXPECT_THAT(cluster_->Command(to, {"GET", key}), IsOkAndHolds("after the move"));
}

TEST_F(RedisClusterTest, FollowsAskWhileASlotMigrates) {
  std::unique_ptr<RedisClusterClient> client = Connect();
  ASSERT_NE(client, nullptr);
  const std::string moved_key = "{asking}moved";
  const std::string staying_key = "{asking}staying";
  const uint16_t slot = RedisKeySlot(moved_key);
  ASSERT_THAT(client->Set(moved_key, "moved early"), IsOk());
  ASSERT_THAT(client->Set(staying_key, "still home"), IsOk());
  const int from = cluster_->OwnerOf(slot);
  const int to = OtherMaster(from);
  ASSERT_NE(to, 0);
  ASSERT_THAT(cluster_->MigrateSlot(slot, from, to, {moved_key}, /*finish=*/false), IsOk());

  EXPECT_THAT(client->Get(moved_key), IsOkAndHolds(Optional(std::string("moved early"))));
  EXPECT_EQ(client->Stats().ask_redirects, 1u);
  EXPECT_THAT(client->Get(staying_key), IsOkAndHolds(Optional(std::string("still home"))));
  EXPECT_EQ(client->Stats().ask_redirects, 1u);
  // A new key of a migrating slot is created on the importing node.
  ASSERT_THAT(client->Set("{asking}new", "born during the move"), IsOk());
  EXPECT_EQ(client->Stats().ask_redirects, 2u);
  EXPECT_EQ(AllAnswered(client->ExistsEach({moved_key, staying_key, "{asking}new", "{asking}absent"})),
            (std::vector<bool>{true, true, true, false}));
  EXPECT_EQ(client->NodeForSlot(slot)->port, from);  // ASK does not change the map
  EXPECT_EQ(client->Stats().moved_redirects, 0u);

  ASSERT_THAT(cluster_->MigrateSlot(slot, from, to, KeysInSlot(from, slot), /*finish=*/true),
              IsOk());
  EXPECT_THAT(client->Get(staying_key), IsOkAndHolds(Optional(std::string("still home"))));
  EXPECT_EQ(client->NodeForSlot(slot)->port, to);
}

TEST_F(RedisClusterTest, ThreadsShareOneConnectionPerNode) {
  std::unique_ptr<RedisClusterClient> client = Connect();
  ASSERT_NE(client, nullptr);
  constexpr int kThreads = 4;
  constexpr int kKeysPerThread = 100;
  std::vector<std::thread> threads;
  std::vector<int> wrong(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kKeysPerThread; ++i) {
        const std::string key = absl::StrCat("threads:", t, ":", i);
        const std::string value = RandomBytes(100 + i, t * 1000 + i);
        if (!client->Set(key, value).ok()) ++wrong[t];
        absl::StatusOr<std::optional<std::string>> read = client->Get(key);
        if (!read.ok() || *read != value) ++wrong[t];
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(wrong, std::vector<int>(kThreads, 0));
  // One connection per node, however many threads: at most every node, never per thread.
  EXPECT_LE(client->Stats().connects, static_cast<uint64_t>(LocalRedisCluster::kNodes));
  EXPECT_EQ(client->Stats().connection_failures, 0u);
}

TEST_F(RedisClusterTest, AclUserAuthenticates) {
  RedisClusterOptions options = Options();
  options.user = testing::kRedisAclUser;
  options.password_file = cluster_->WritePasswordFile("tier.pass", testing::kRedisAclPassword);
  absl::StatusOr<std::unique_ptr<RedisClusterClient>> client =
      RedisClusterClient::Create(options);
  ASSERT_THAT(client, IsOk());
  ASSERT_THAT((*client)->Set("acl:key", "by tier"), IsOk());
  EXPECT_THAT((*client)->Get("acl:key"), IsOkAndHolds(Optional(std::string("by tier"))));
}

TEST_F(RedisClusterTest, WrongOrMissingPasswordIsRefusedClearly) {
  RedisClusterOptions options = Options();
  options.password_file = cluster_->WritePasswordFile("wrong.pass", "not-the-password");
  EXPECT_THAT(RedisClusterClient::Create(options),
              StatusIs(absl::StatusCode::kUnauthenticated,
                       AllOf(HasSubstrs("refused the requirepass password", "wrong.pass",
                                        "WRONGPASS", "node 127.0.0.1:"),
                             Not(HasSubstr("not-the-password")))));
  options.user = testing::kRedisAclUser;
  EXPECT_THAT(RedisClusterClient::Create(options),
              StatusIs(absl::StatusCode::kUnauthenticated,
                       AllOf(HasSubstrs("user 'tier'", "WRONGPASS"),
                             Not(HasSubstr("not-the-password")))));
  options.user.clear();
  options.password_file.clear();
  EXPECT_THAT(RedisClusterClient::Create(options),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstrs("CLUSTER SLOTS", "NOAUTH")));
}

// ---- A cluster of its own: this test kills one of its masters ----

TEST(RedisClusterFailoverTest, DeadMasterFailsFastThenItsReplicaServes) {
  if (!testing::RedisInstalled()) {
    GTEST_SKIP() << testing::RedisMissingMessage();
  }
  LocalRedisCluster cluster;
  ASSERT_TRUE(cluster.Start());
  RedisClusterOptions options;
  options.seed_nodes = *ParseRedisNodeList(cluster.NodeList());
  options.password_file = cluster.WritePasswordFile("default.pass", testing::kRedisPassword);
  options.connect_timeout = absl::Milliseconds(200);
  options.command_timeout = absl::Milliseconds(300);
  absl::StatusOr<std::unique_ptr<RedisClusterClient>> created =
      RedisClusterClient::Create(options);
  ASSERT_THAT(created, IsOk());
  RedisClusterClient& client = **created;

  constexpr int kKeys = 60;
  const std::vector<std::string> keys =
      WriteKeys(client, "failover:", kKeys, [](int i) { return RandomBytes(1000 + i, i); });
  const uint16_t victim_slot = RedisKeySlot(keys[0]);
  const int victim = cluster.OwnerOf(victim_slot);
  // Every write has reached the victim's replica before the victim dies.
  ASSERT_THAT(cluster.Command(victim, {"WAIT", "1", "5000"}), IsOkAndHolds("1"));
  std::string survivor_key;
  for (const std::string& key : keys) {
    if (cluster.OwnerOf(RedisKeySlot(key)) != victim) survivor_key = key;
  }
  ASSERT_FALSE(survivor_key.empty());

  // A stalled master: the call ends at the command timeout.
  cluster.Signal(victim, SIGSTOP);
  absl::Time start = absl::Now();
  EXPECT_THAT(client.Get(keys[0]),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       HasSubstrs(absl::StrCat("node 127.0.0.1:", victim),
                                  absl::StrCat("slot ", victim_slot), "timed out after 300 ms")));
  EXPECT_LT(absl::Now() - start, options.command_timeout + absl::Milliseconds(500));
  EXPECT_THAT(client.Get(survivor_key), IsOk());

  // A dead master: calls fail fast while the cluster fails over; the other masters serve.
  cluster.Signal(victim, SIGKILL);
  start = absl::Now();
  const absl::Status dead = client.Get(keys[0]).status();
  EXPECT_TRUE(dead.code() == absl::StatusCode::kUnavailable ||
              dead.code() == absl::StatusCode::kDeadlineExceeded)
      << dead;
  EXPECT_LT(absl::Now() - start,
            options.connect_timeout + 2 * options.command_timeout + absl::Milliseconds(500));
  EXPECT_THAT(client.Get(survivor_key), IsOk());

  // The replica is promoted; the client finds it and reads the same bytes.
  absl::StatusOr<std::optional<std::string>> read;
  EXPECT_TRUE(testing::PollUntil([&] {
    read = client.Get(keys[0]);
    return read.ok();
  })) << read.status();
  ASSERT_THAT(read, IsOk());
  EXPECT_THAT(*read, Optional(RandomBytes(1000, 0)));
  ASSERT_TRUE(client.NodeForSlot(victim_slot).has_value());
  EXPECT_NE(client.NodeForSlot(victim_slot)->port, victim);
  // The promotion reaches every node's view by gossip, not at once.
  EXPECT_TRUE(testing::PollUntil(
      [&] { return cluster.OwnerOf(victim_slot) == client.NodeForSlot(victim_slot)->port; }));
  for (int i = 0; i < kKeys; ++i) {
    EXPECT_THAT(client.Get(keys[i]), IsOkAndHolds(Optional(RandomBytes(1000 + i, i)))) << i;
  }
  EXPECT_GT(client.Stats().connection_failures, 0u);
  EXPECT_GT(client.Stats().slot_map_refreshes, 1u);
}

// A master dead with its replica (no failover can happen): the first call for its slots fails
// for real and starts the node's back-off; calls during it are refused without I/O (marked
// IsRedisNodeDownRefusal), EXISTS over many keys answers every other node's keys, and the
// other masters serve. After the back-off one call tries the node again.
TEST(RedisClusterFailoverTest, ADeadNodeWithoutReplicaIsRefusedAtOnceWhileTheOthersServe) {
  if (!testing::RedisInstalled()) {
    GTEST_SKIP() << testing::RedisMissingMessage();
  }
  LocalRedisCluster cluster;
  ASSERT_TRUE(cluster.Start());
  RedisClusterOptions options;
  // Masters only as seeds: a refresh then never dials the replica killed below, so the
  // connection-failure count below is the victim's alone.
  absl::StatusOr<std::vector<int>> masters = cluster.MasterPorts();
  ASSERT_THAT(masters, IsOk());
  for (const int port : *masters) options.seed_nodes.push_back({"127.0.0.1", port});
  options.password_file = cluster.WritePasswordFile("default.pass", testing::kRedisPassword);
  // Long enough that the checks below all run inside the first back-off, even under TSan.
  options.node_retry_initial = absl::Seconds(2);
  options.node_retry_max = absl::Seconds(2);
  absl::StatusOr<std::unique_ptr<RedisClusterClient>> created =
      RedisClusterClient::Create(options);
  ASSERT_THAT(created, IsOk());
  RedisClusterClient& client = **created;

  const std::vector<std::string> keys =
      WriteKeys(client, "isolated:", 60, [](int i) { return absl::StrCat(i); });
  const uint16_t victim_slot = RedisKeySlot(keys[0]);
  const int victim = cluster.OwnerOf(victim_slot);
  const int replica = cluster.ReplicaOf(victim);
  ASSERT_GT(victim, 0);
  ASSERT_GT(replica, 0);
  std::vector<bool> on_victim;
  size_t victim_keys = 0;
  std::string survivor_key;
  for (const std::string& key : keys) {
    on_victim.push_back(cluster.OwnerOf(RedisKeySlot(key)) == victim);
    victim_keys += on_victim.back();
    if (!on_victim.back()) survivor_key = key;
  }
  ASSERT_FALSE(survivor_key.empty());
  cluster.Signal(replica, SIGKILL);
  cluster.Signal(victim, SIGKILL);

  // The first call finds the node dead (its connection closed, the reconnect refused).
  const absl::Status first = client.Get(keys[0]).status();
  EXPECT_THAT(first, StatusIs(absl::StatusCode::kUnavailable,
                              HasSubstr(absl::StrCat("node 127.0.0.1:", victim))));
  EXPECT_FALSE(IsRedisNodeDownRefusal(first));
  const RedisClusterStats after_first = client.Stats();

  // During the back-off: refused without I/O, naming the node, the slot and why.
  const absl::Status refused = client.Get(keys[0]).status();
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kUnavailable,
                                HasSubstrs(absl::StrCat("node 127.0.0.1:", victim),
                                           absl::StrCat("slot ", victim_slot),
                                           "not tried for another", "Connection refused")));
  EXPECT_TRUE(IsRedisNodeDownRefusal(refused));
  const RedisExistsResult exists = client.ExistsEach(keys);
  ASSERT_EQ(exists.exists.size(), keys.size());
  EXPECT_EQ(exists.unanswered, victim_keys);
  EXPECT_TRUE(IsRedisNodeDownRefusal(exists.first_failure)) << exists.first_failure;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (on_victim[i]) {
      EXPECT_EQ(exists.exists[i], std::nullopt) << keys[i];
    } else {
      EXPECT_EQ(exists.exists[i], std::optional<bool>(true)) << keys[i];
    }
  }
  EXPECT_THAT(client.Get(survivor_key), IsOk());
  RedisClusterStats stats = client.Stats();
  EXPECT_EQ(stats.connection_failures, after_first.connection_failures);  // no I/O to it
  EXPECT_GE(stats.node_down_refusals, 2u);

  // After the back-off the node is tried once more (and found dead again: a real failure).
  absl::SleepFor(options.node_retry_max + absl::Milliseconds(100));
  const absl::Status retried = client.Get(keys[0]).status();
  EXPECT_THAT(retried, StatusIs(absl::StatusCode::kUnavailable,
                                HasSubstr(absl::StrCat("node 127.0.0.1:", victim))));
  EXPECT_FALSE(IsRedisNodeDownRefusal(retried));
  EXPECT_GT(client.Stats().connection_failures, stats.connection_failures);
}

}  // namespace
}  // namespace memra
