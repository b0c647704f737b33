// End to end, the prefix cache's remote tier: a real 3-master / 3-replica Redis Cluster on
// loopback ports (server/testing/test_redis_cluster.h) shared by TWO real memra-kvd daemons (two
// "machines", host backend), and separate prefix_engine processes. A prefix captured through
// daemon A is written behind to the cluster and restored bit-exactly through daemon B (its
// lookup says REMOTE; the restore pulls the pieces into B's device tier, verified); a corrupted
// value is refused (DATA_LOSS, deleted) and never restored; a master killed mid-test fails over
// while both daemons keep serving (misses, never wrong bytes); a cluster that is down when a
// daemon starts is reported (GetStatus, the log) and the daemon serves without it, then joins it
// once it is up. Every wait is bounded (kPatience).

#include <signal.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/client.h"
#include "client/internal.h"
#include "common/grpc_status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/memra/kv/v1/admin.pb.h"
#include "proto/memra/kv/v1/prefix.grpc.pb.h"
#include "server/testing/test_redis_cluster.h"
#include "tests/daemon_process.h"
#include "tests/e2e/operator_view.h"
#include "tests/e2e/facts.h"
#include "tests/status_matchers.h"
#include "tests/subprocess.h"

namespace memra::testing {
namespace {

namespace pb = ::memra::kv::v1;

constexpr int kRemoteMedium = 3;  // StorageMedium::kRemote
constexpr int kDeviceMedium = 0;

struct Kind {
  std::string plan;
  uint64_t tokens;
};
// Position-addressed (flat) and boundary-state plans (recurrent, latent indexer).
const std::vector<Kind> kKinds = {{"flat", 96}, {"hybrid", 64}, {"latent", 80}};

// One daemon ("machine") on the shared cluster, and an operator client of it.
class Machine {
 public:
  Machine(const std::string& tag, const LocalRedisCluster& cluster,
          const std::vector<std::string>& extra = {})
      : daemon_(tag) {
    std::vector<std::string> flags = {
        "--budget_bytes=512MiB", "--prefix_cache_budget_bytes=64MiB",
        "--prefix_slab_bytes=1MiB", "--prefix_block_tokens=16",
        "--prefix_remote_redis_nodes=" + cluster.NodeList(),
        "--prefix_remote_redis_password_file=" +
            cluster.WritePasswordFile("daemon.pass", kRedisPassword),
        "--prefix_remote_redis_timeout_ms=300", "--prefix_remote_redis_connect_timeout_ms=200",
        "--prefix_remote_lookup_timeout_ms=1000"};  // loaded CI machines: no spurious misses
    flags.insert(flags.end(), extra.begin(), extra.end());
    started_ = daemon_.Start(flags);
    if (!started_) return;
    absl::StatusOr<std::unique_ptr<KvClient>> client = KvClient::Connect(daemon_.admin_socket());
    EXPECT_THAT(client, IsOk());
    if (client.ok()) client_ = *std::move(client);
  }
  ~Machine() {
    client_.reset();
    if (daemon_.Signal(SIGTERM)) {
      EXPECT_EQ(daemon_.WaitExit(), 0);
    }
  }

  bool started() const { return started_ && client_ != nullptr; }

  // Runs a prefix_engine against this daemon; its exit status and facts.
  int Engine(const std::string& mode, const std::string& plan, uint64_t tokens,
             std::map<std::string, std::string>* facts = nullptr) {
    const std::string out = daemon_.Path(absl::StrCat(plan, ".", mode, ".", ++runs_));
    const int code = WaitExit(Spawn({Runfile("tests/e2e/prefix_engine"),
                                     "--socket=" + daemon_.socket(), "--mode=" + mode,
                                     "--plan=" + plan, absl::StrCat("--tokens=", tokens),
                                     "--out=" + out}));
    if (facts != nullptr) *facts = ReadFacts(out);
    return code;
  }

  pb::ListPrefixesResponse List() { return ListPrefixes(*client_); }
  pb::PrefixRemoteStats Remote() { return List().stats().remote(); }

  pb::RemoteTierState TierState() {
    absl::StatusOr<pb::GetStatusResponse> status = ClientInternals::GetStatus(*client_);
    EXPECT_THAT(status, IsOk());
    return status.ok() ? status->prefix_remote_tier() : pb::REMOTE_TIER_NONE;
  }

  // Until the writer has nothing queued or in flight.
  bool Drained() {
    return PollUntil([&] { return Remote().queued_writes() == 0; }, daemon_.pid());
  }

  DaemonProcess& daemon() { return daemon_; }

 private:
  DaemonProcess daemon_;
  bool started_ = false;
  std::unique_ptr<KvClient> client_;
  int runs_ = 0;
};

uint64_t FactNumber(const std::map<std::string, std::string>& facts, const std::string& key) {
  uint64_t value = 0;
  auto it = facts.find(key);
  EXPECT_TRUE(it != facts.end() && absl::SimpleAtoi(it->second, &value)) << "no fact " << key;
  return value;
}

class PrefixRemoteE2eTest : public WithRedisCluster<> {
 protected:
  void SetUp() override {
    WithRedisCluster::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    ASSERT_TRUE(cluster_->WaitHealthy());
    // Each test starts from an empty cluster (the daemons share one cache scope: the test's uid).
    absl::StatusOr<std::vector<int>> masters = cluster_->MasterPorts();
    ASSERT_THAT(masters, IsOk());
    for (const int master : *masters) {
      ASSERT_THAT(cluster_->Command(master, {"FLUSHALL"}), IsOk());
    }
  }

  // Every key the masters hold.
  static std::vector<std::pair<int, std::string>> RemoteKeys() {
    std::vector<std::pair<int, std::string>> keys;
    absl::StatusOr<std::vector<int>> masters = cluster_->MasterPorts();
    EXPECT_THAT(masters, IsOk());
    if (!masters.ok()) return keys;
    for (const int master : *masters) {
      absl::StatusOr<std::string> listed = cluster_->Command(master, {"KEYS", "memra-kv/*"});
      EXPECT_THAT(listed, IsOk());
      if (!listed.ok()) continue;
      for (absl::string_view key : absl::StrSplit(*listed, '\n', absl::SkipEmpty())) {
        keys.emplace_back(master, std::string(key));
      }
    }
    return keys;
  }
};

TEST_F(PrefixRemoteE2eTest, CapturedOnOneDaemonRestoresBitExactlyOnAnother) {
  Machine a("remote-a", *cluster_);
  Machine b("remote-b", *cluster_);
  ASSERT_TRUE(a.started() && b.started());
  EXPECT_EQ(a.TierState(), pb::REMOTE_TIER_UP);
  EXPECT_EQ(b.TierState(), pb::REMOTE_TIER_UP);
  for (const Kind& kind : kKinds) {
    ASSERT_EQ(a.Engine("capture", kind.plan, kind.tokens), 0) << kind.plan;
  }
  ASSERT_TRUE(a.Drained());
  const pb::PrefixRemoteStats written = a.Remote();
  // flat: 6 blocks; hybrid: 4 blocks + boundary state; latent: 5 blocks + boundary state.
  EXPECT_EQ(written.writes(), 17u);
  EXPECT_EQ(written.dropped_writes(), 0u);
  std::vector<std::pair<int, std::string>> keys = RemoteKeys();
  EXPECT_EQ(keys.size(), 17u);
  std::map<int, int> per_master;
  for (const auto& [master, key] : keys) ++per_master[master];
  EXPECT_EQ(per_master.size(), 3u) << "keys spread over every master";

  // B never saw these prefixes: its lookup reaches into the remote tier, the restore pulls,
  // verifies and restores every byte (the engine checks them all).
  for (const Kind& kind : kKinds) {
    std::map<std::string, std::string> facts;
    ASSERT_EQ(b.Engine("restore", kind.plan, kind.tokens, &facts), 0) << kind.plan;
    EXPECT_EQ(FactNumber(facts, "lookup_medium"), kRemoteMedium) << kind.plan;
    EXPECT_EQ(FactNumber(facts, "restored"), kind.tokens) << kind.plan;
  }
  pb::ListPrefixesResponse listed = b.List();
  EXPECT_EQ(listed.entries_size(), 3);
  for (const pb::PrefixEntry& entry : listed.entries()) {
    EXPECT_EQ(entry.medium(), pb::PREFIX_MEDIUM_DEVICE);  // promoted: B's own now
  }
  EXPECT_EQ(listed.stats().restores(), 3u);
  EXPECT_EQ(listed.stats().captures(), 0u);
  EXPECT_GE(listed.stats().last_sequence(), 3u);  // a STORED event per pulled entry
  const pb::PrefixRemoteStats pulled = listed.stats().remote();
  EXPECT_EQ(pulled.hits(), 3u);
  EXPECT_EQ(pulled.pulled_pieces(), 17u);
  EXPECT_EQ(pulled.corrupt(), 0u);
  EXPECT_EQ(pulled.shape_mismatches(), 0u);
  ASSERT_EQ(listed.stats().tiers_size(), 2);
  EXPECT_EQ(listed.stats().tiers(1).medium(), pb::PREFIX_MEDIUM_REMOTE);
  EXPECT_EQ(listed.stats().tiers(1).promotions(), 17u);

  // A second restore on B is local.
  std::map<std::string, std::string> facts;
  ASSERT_EQ(b.Engine("restore", "flat", 96, &facts), 0);
  EXPECT_EQ(FactNumber(facts, "lookup_medium"), kDeviceMedium);
  EXPECT_EQ(b.Remote().hits(), 3u);
}

TEST_F(PrefixRemoteE2eTest, ACorruptedRemoteValueIsRefusedAndNeverRestored) {
  Machine a("remote-a", *cluster_);
  Machine b("remote-b", *cluster_);
  ASSERT_TRUE(a.started() && b.started());
  ASSERT_EQ(a.Engine("capture", "flat", 96), 0);
  ASSERT_TRUE(a.Drained());
  std::vector<std::pair<int, std::string>> keys = RemoteKeys();
  ASSERT_EQ(keys.size(), 6u);
  // One block's payload gets one flipped byte, written back on its master.
  const auto& [master, key] = keys[0];
  absl::StatusOr<std::string> value = cluster_->Command(master, {"GET", key});
  ASSERT_THAT(value, IsOk());
  ASSERT_GT(value->size(), 72u + 100u);  // past the 72-byte header: a payload byte
  (*value)[72 + 100] ^= 0x5a;
  ASSERT_THAT(cluster_->Command(master, {"SET", key, *value}), IsOk());

  // The restore stops before the corrupt block: fewer tokens, every one of them right.
  std::map<std::string, std::string> facts;
  ASSERT_EQ(b.Engine("restore_any", "flat", 96, &facts), 0);
  EXPECT_EQ(FactNumber(facts, "lookup_medium"), kRemoteMedium);
  const uint64_t restored = FactNumber(facts, "restored");
  EXPECT_LT(restored, 96u);
  EXPECT_EQ(restored % 16, 0u);
  const pb::PrefixRemoteStats stats = b.Remote();
  EXPECT_EQ(stats.corrupt(), 1u);
  EXPECT_EQ(stats.pulled_pieces(), restored / 16);
  // The corrupt value is deleted (behind the writer queue).
  EXPECT_TRUE(PollUntil([&, &master = master, &key = key] {
    absl::StatusOr<std::string> exists = cluster_->Command(master, {"EXISTS", key});
    return exists.ok() && *exists == "0";
  }));
  // B keeps serving; A restores its own entry locally, untouched.
  ASSERT_EQ(a.Engine("restore", "flat", 96, &facts), 0);
  EXPECT_EQ(FactNumber(facts, "lookup_medium"), kDeviceMedium);
}

TEST_F(PrefixRemoteE2eTest, AKilledMasterFailsOverWhileBothDaemonsKeepServing) {
  Machine a("remote-a", *cluster_);
  Machine b("remote-b", *cluster_);
  ASSERT_TRUE(a.started() && b.started());
  ASSERT_EQ(a.Engine("capture", "flat", 96), 0);
  ASSERT_EQ(a.Engine("capture", "hybrid", 64), 0);
  ASSERT_TRUE(a.Drained());
  ASSERT_EQ(RemoteKeys().size(), 11u);
  absl::StatusOr<std::vector<int>> masters = cluster_->MasterPorts();
  ASSERT_THAT(masters, IsOk());
  // Let the replicas catch up before their master dies (replication is asynchronous).
  for (const int master : *masters) {
    ASSERT_THAT(cluster_->Command(master, {"WAIT", "1", "5000"}), IsOkAndHolds("1"));
  }
  cluster_->Signal(masters->front(), SIGKILL);

  // While the replica takes over: both daemons answer every call, a restore through B is a
  // miss or a partial of right bytes (the engine checks them), a capture on A is never blocked.
  std::map<std::string, std::string> facts;
  EXPECT_EQ(b.Engine("restore_any", "flat", 96, &facts), 0);
  const uint64_t during = FactNumber(facts, "restored");
  EXPECT_EQ(during % 16, 0u);
  EXPECT_EQ(a.Engine("capture", "latent", 80), 0);
  EXPECT_EQ(a.Engine("restore", "latent", 80), 0);  // A's own, local
  EXPECT_EQ(b.Engine("capture", "hybrid", 32), 0);  // B's own, local
  EXPECT_EQ(b.Engine("restore", "hybrid", 32), 0);

  // Failed over: the cluster is whole again, the daemons' breakers close, and B restores what A
  // captured before the kill, bit-exactly, from the promoted replica (the first calls after the
  // failover may still miss: a client learns the new map from the failure that shows it stale).
  ASSERT_TRUE(cluster_->WaitHealthy());
  ASSERT_TRUE(PollUntil([&] { return b.TierState() == pb::REMOTE_TIER_UP; }));
  ASSERT_TRUE(PollUntil([&] { return a.TierState() == pb::REMOTE_TIER_UP; }));
  auto restored_through_b = [&](const std::string& plan, uint64_t tokens) -> uint64_t {
    std::map<std::string, std::string> restored_facts;
    EXPECT_EQ(b.Engine("restore_any", plan, tokens, &restored_facts), 0)
        << plan << ": a failed call or a wrong byte";
    uint64_t restored = 0;
    return absl::SimpleAtoi(restored_facts["restored"], &restored) ? restored : 0;
  };
  const uint64_t hits_before = b.Remote().hits();
  ASSERT_TRUE(PollUntil([&] { return restored_through_b("hybrid", 64) == 64; }));
  ASSERT_TRUE(PollUntil([&] { return restored_through_b("flat", 96) == 96; }));
  EXPECT_GE(b.Remote().hits(), hits_before + 1);
  EXPECT_EQ(b.Remote().corrupt(), 0u);
  EXPECT_EQ(b.List().stats().dropped_entries(), 0u);
}

// No cluster answers when the daemon starts: reported (GetStatus DOWN, the log), the daemon
// serves from its local tiers, and joins the cluster once it is up (the breaker's probe).
TEST(PrefixRemoteStartTest, AClusterDownAtStartIsReportedAndJoinedLater) {
  if (!RedisInstalled()) GTEST_SKIP() << RedisMissingMessage();
  LocalRedisCluster later;
  ASSERT_TRUE(later.Prepare());  // ports chosen, nothing listening yet
  std::unique_ptr<Machine> machine = std::make_unique<Machine>("remote-down", later);
  ASSERT_TRUE(machine->started());
  EXPECT_EQ(machine->TierState(), pb::REMOTE_TIER_DOWN);
  pb::PrefixRemoteStats stats = machine->Remote();
  EXPECT_FALSE(stats.up());
  EXPECT_GE(stats.breaker_opens(), 1u);
  // Serving without it: capture and restore locally; the remote write is dropped and counted.
  ASSERT_EQ(machine->Engine("capture", "flat", 96), 0);
  std::map<std::string, std::string> facts;
  ASSERT_EQ(machine->Engine("restore", "flat", 96, &facts), 0);
  EXPECT_EQ(FactNumber(facts, "lookup_medium"), kDeviceMedium);
  stats = machine->Remote();
  EXPECT_GE(stats.dropped_writes(), 1u);
  EXPECT_EQ(stats.writes(), 0u);

  ASSERT_TRUE(later.Start());
  ASSERT_TRUE(PollUntil([&] { return machine->TierState() == pb::REMOTE_TIER_UP; }));
  // The first probe may answer while `redis-cli --cluster create` is still assigning slots
  // (writes to an unowned slot fail and are lost, by design); a later capture's pieces land.
  uint64_t blocks = 0;
  ASSERT_TRUE(PollUntil([&] {
    const uint64_t before = machine->Remote().writes();
    if (machine->Engine("capture", "latent", 16 * ++blocks) != 0) return false;
    return machine->Drained() && machine->Remote().writes() == before + 2;  // block + boundary
  }));
  machine.reset();
}

}  // namespace
}  // namespace memra::testing
