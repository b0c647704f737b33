// End to end, the block store across engine processes: the real memra-kvd binary (host
// backend) and separate block_store_engine processes, each with its own memfd pool. Engine A
// stores blocks from its pool; engine B, another process in the same cache scope, finds them and
// loads them into other blocks of ITS pool, byte for byte; an engine of another scope finds
// nothing. The operator's listing shows the blocks as engine A's pool entries.

#include <unistd.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/internal.h"
#include "common/grpc_status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/memra/kv/v1/prefix.grpc.pb.h"
#include "tests/daemon_process.h"
#include "tests/e2e/operator_view.h"
#include "tests/e2e/facts.h"
#include "tests/status_matchers.h"
#include "tests/subprocess.h"

namespace memra::testing {
namespace {

namespace pb = ::memra::kv::v1;

class BlockStoreE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(daemon_.Start({"--budget_bytes=256MiB", "--prefix_cache_budget_bytes=64MiB",
                               absl::StrCat("--cache_scope_allow=other:", getuid()),
                               "--lease_timeout_ms=2000", "--lease_grace_ms=100"}));
    absl::StatusOr<std::unique_ptr<KvClient>> checker = KvClient::Connect(daemon_.admin_socket());
    ASSERT_THAT(checker, IsOk());
    checker_ = *std::move(checker);
  }

  void TearDown() override {
    checker_.reset();
    if (daemon_.Signal(SIGTERM)) {
      EXPECT_EQ(daemon_.WaitExit(), 0);
    }
  }

  int Engine(const std::string& mode, const std::string& out, std::vector<std::string> extra) {
    std::vector<std::string> args = {Runfile("tests/e2e/block_store_engine"),
                                     "--socket=" + daemon_.socket(), "--mode=" + mode,
                                     "--out=" + out};
    args.insert(args.end(), extra.begin(), extra.end());
    return WaitExit(Spawn(args));
  }

  pb::ListPrefixesResponse List() { return ListPrefixes(*checker_); }

  DaemonProcess daemon_{"blk"};
  std::unique_ptr<KvClient> checker_;
};

TEST_F(BlockStoreE2eTest, AnotherProcessLoadsTheStoredBlocksIntoItsOwnPoolByteForByte) {
  const std::string& dir = daemon_.dir();
  ASSERT_EQ(Engine("store", dir + "/a.facts", {"--blocks=5", "--seed=3"}), 0);
  const std::map<std::string, std::string> stored = ReadFacts(dir + "/a.facts");
  ASSERT_TRUE(stored.contains("engine_id"));
  EXPECT_NE(stored.at("copied_bytes"), "0");
  // B asks for six blocks: five are stored, and they load into its pool intact.
  EXPECT_EQ(Engine("load", dir + "/b.facts", {"--blocks=6", "--seed=3", "--expect_matched=5"}),
            0);
  EXPECT_EQ(ReadFacts(dir + "/b.facts").at("matched"), "5");
  // Another scope sees none of them.
  EXPECT_EQ(Engine("load", dir + "/c.facts",
                   {"--blocks=5", "--scope=other", "--expect_matched=0"}),
            0);
  const pb::ListPrefixesResponse listed = List();
  ASSERT_EQ(listed.entries_size(), 5);
  for (const pb::PrefixEntry& entry : listed.entries()) {
    EXPECT_TRUE(entry.from_engine_pool());
    EXPECT_EQ(absl::StrCat(entry.engine_id()), stored.at("engine_id"));
    EXPECT_EQ(entry.boundary_tokens(), 16u);
  }
  EXPECT_EQ(listed.stats().restores(), 5u);
}

}  // namespace
}  // namespace memra::testing
